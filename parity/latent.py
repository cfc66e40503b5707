"""DeepSeek V2/V3 checkpoints of multi-head latent attention: transformers' tensor names both ways, and
config.json -> `mha_spec.LatentAttentionConfig`.

Layouts: "hf-deepseek-v3" (DeepseekV3Attention) and "hf-deepseek-v2" (DeepseekV2Attention). Both name the
same tensors (a pure rename of the canonical `mha_spec.MLA_KEYS`: q_a_layernorm -> q_a_norm, kv_a_proj_with_mqa
-> kv_a_proj, kv_a_layernorm -> kv_a_norm, o_proj -> out_proj); they differ in the RoPE convention only:
V3 reads config.json's rope_interleave (True: consecutive pairs, False: halves), V2 always rotates consecutive
pairs (its apply_rotary_emb views (x[2i], x[2i+1]) as one complex number) and has no such field.

What transformers (v5) computes and this reader follows (read off modeling_deepseek_v3.py / _v2.py):
  - the q_a and kv_a RMSNorms are built without an eps, so they use 1e-6 whatever rms_norm_eps says
    (rms_norm_eps is the decoder layer's input/post-attention norms', outside the attention);
  - the softmax scale is (Dn + Dr) ** -0.5, times mscale(factor, mscale_all_dim)² for a RoPE whose rope_type is
    not "default" and that sets mscale_all_dim (`yarn_apply_mscale`);
  - num_key_value_heads other than num_attention_heads would repeat the expanded keys again (repeat_kv on N
    heads): refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_spec import LatentAttentionConfig, RopeScaling

LATENT_LAYOUTS = ("hf-deepseek-v3", "hf-deepseek-v2")
MODEL_TYPES = {"deepseek_v3": "hf-deepseek-v3", "deepseek_v2": "hf-deepseek-v2"}
# canonical module -> transformers' module (DeepseekV3Attention / DeepseekV2Attention)
HF_DEEPSEEK_NAMES = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj",
                     "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
                     "out_proj": "o_proj"}
_CANONICAL = {hf: ours for ours, hf in HF_DEEPSEEK_NAMES.items()}
NORM_EPS = 1e-6  # DeepseekV{2,3}RMSNorm's default, the one the attention's norms get


def _as_numpy(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        import torch

        if x.dtype == torch.bfloat16:
            x = x.float()
        x = x.numpy()
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
        raise TypeError(f"{name} must hold floating point numbers, got dtype {arr.dtype}")
    return arr


def from_hf_deepseek(tensors: Mapping, prefix: str = "", *, config: LatentAttentionConfig | None = None
                     ) -> dict[str, np.ndarray]:
    """The canonical state dict of the layer whose transformers names start with `prefix` (e.g.
    "model.layers.0.self_attn."); tensors outside the prefix are ignored (the MLP/MoE, other layers). Every tensor
    under the prefix is read or refused by name (ValueError). With `config`, the keys must be exactly
    `config.weight_shapes()`' and each shape its entry (ValueError naming the tensor, its shape and the expected
    one); every tensor must be finite."""
    out, unknown = {}, []
    for key in tensors:
        if not key.startswith(prefix):
            continue
        rel = key[len(prefix):]
        module, _, leaf = rel.rpartition(".")
        if module not in _CANONICAL or leaf not in ("weight", "bias") or (leaf == "bias" and module.endswith("norm")):
            unknown.append(key)
            continue
        out[f"{_CANONICAL[module]}.{leaf}"] = (key, _as_numpy(tensors[key], key))
    if unknown:
        raise ValueError(f"under the prefix {prefix!r}, tensors the DeepSeek attention layout does not read: "
                         f"{sorted(unknown)} (it reads {sorted(f'{v}.weight' for v in HF_DEEPSEEK_NAMES.values())} "
                         f"and the projections' .bias)")
    if not out:
        raise ValueError(f"no tensor under the prefix {prefix!r} (e.g. model.layers.0.self_attn.); keys begin "
                         f"{sorted(tensors)[:4]}")
    for name, (key, arr) in out.items():
        if not np.isfinite(arr.astype(np.float64)).all():
            raise ValueError(f"{key} holds NaN/inf: a checkpoint's weights are finite numbers")
    if config is not None:
        expected = config.weight_shapes()
        missing = sorted(f"{prefix}{_hf_key(n)}" for n in set(expected) - set(out))
        extra = sorted(out[n][0] for n in set(out) - set(expected))
        if missing or extra:
            raise ValueError(f"the tensors under {prefix!r} are not config.json's layer (q_lora_rank="
                             f"{config.q_lora_rank}, attention_bias={config.bias}): missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            key, arr = out[name]
            if tuple(arr.shape) != shape:
                raise ValueError(f"{key} has shape {tuple(arr.shape)}, expected {shape} from config.json (E="
                                 f"{config.embed_dim}, N={config.num_heads}, C={config.kv_lora_rank}, Dn="
                                 f"{config.qk_nope_head_dim}, Dr={config.qk_rope_head_dim}, Dv={config.v_head_dim}, "
                                 f"Q={config.q_lora_rank})")
    return {name: arr for name, (_, arr) in sorted(out.items())}


def _hf_key(canonical: str) -> str:
    module, _, leaf = canonical.rpartition(".")
    if module not in HF_DEEPSEEK_NAMES or leaf not in ("weight", "bias"):
        raise ValueError(f"{canonical!r} is not a canonical MLA key (mha_spec.MLA_KEYS' .weight / .bias)")
    return f"{HF_DEEPSEEK_NAMES[module]}.{leaf}"


def canonical_name(name: str) -> str:
    """A transformers DeepSeek attention parameter's canonical name: "kv_a_proj_with_mqa.weight" -> "kv_a_proj.weight";
    a KeyError naming it where it is none of `HF_DEEPSEEK_NAMES`."""
    module, _, leaf = name.rpartition(".")
    if module not in _CANONICAL:
        raise KeyError(f"{name!r} is not a parameter of transformers' DeepSeek attention ({sorted(_CANONICAL)})")
    return f"{_CANONICAL[module]}.{leaf}"


def to_hf_deepseek(sd: Mapping, prefix: str = "") -> dict:
    """The canonical state dict `sd` under transformers' names (values as given), each key prefixed."""
    return {f"{prefix}{_hf_key(k)}": v for k, v in sd.items()}


# ---------------------------------------------------------------- config.json


# The fields read here (every other one goes through `parity.layouts.unmodelled_features`, or is the MLP/MoE's,
# the embeddings', the tokenizer's: none of them enters the attention).
_READ = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim", "qk_head_dim", "rope_interleave", "rope_parameters",
         "rope_scaling", "rope_theta", "partial_rotary_factor", "attention_bias", "rms_norm_eps",
         "attention_dropout", "max_position_embeddings", "original_max_position_embeddings", "num_hidden_layers")


def _int(cfg: Mapping, field: str, source: str, optional: bool = False):
    if field not in cfg:
        raise ValueError(f"{source}: config.json does not say {field} (an MLA layer's size; transformers' default "
                         f"is not assumed)")
    v = cfg[field]
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{source}: {field} = {v!r} is not a positive integer")
    return v


def _rope(cfg: Mapping, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, the scaling) as transformers 5 standardizes them: a set rope_scaling (4.x) else
    rope_parameters; rope_theta there, else at the top level, else 10000; YaRN's original_max_position_embeddings
    from the top level, else the parameters, else max_position_embeddings; its factor, when unset,
    max_position_embeddings / original."""
    fields = {f: cfg[f] for f in ("rope_scaling", "rope_parameters") if isinstance(cfg.get(f), Mapping) and cfg[f]}
    for f in ("rope_scaling", "rope_parameters"):
        if cfg.get(f) is not None and not isinstance(cfg[f], Mapping):
            raise ValueError(f"{source}: {f} = {cfg[f]!r} is not a mapping")
    params = dict(next(iter(fields.values()), {}))
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{source}: RoPE parameters nested per layer type ({sorted(params)}): DeepSeek's layers "
                         f"share one RoPE")
    kinds = {k: params.pop(k) for k in ("rope_type", "type") if params.get(k) is not None}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"{source}: rope_type and type differ ({kinds}): say one")
    kind = next(iter(kinds.values()), "default")
    theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta", 10000.0) if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{source}: rope_theta = {theta!r} is not a number")
    fraction = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if fraction not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor = {fraction!r}: DeepSeek's attention rotates all "
                         f"qk_rope_head_dim features of q_pe and k_pe (its head_dim is qk_rope_head_dim)")
    if kind == "default":
        if extra := sorted(k for k, v in params.items() if v is not None):
            raise ValueError(f"{source}: the RoPE parameters set {extra} with rope_type 'default', which reads "
                             f"none of them")
        return float(theta), None
    if kind in ("yarn", "llama3"):
        top = cfg.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (
            top if top is not None else params.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
        if kind == "yarn" and params.get("factor") is None:
            longest, original = cfg.get("max_position_embeddings"), params["original_max_position_embeddings"]
            if not isinstance(longest, int) or not isinstance(original, int) or original <= 0:
                raise ValueError(f"{source}: YaRN without a factor needs max_position_embeddings / "
                                 f"original_max_position_embeddings, got {longest!r} / {original!r}")
            params["factor"] = longest / original
    try:
        scaling = RopeScaling.from_mapping(kind, params)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(f"{source}: the RoPE parameters {dict(fields.get('rope_scaling') or fields.get('rope_parameters'))}"
                         f": {e}") from e
    return float(theta), scaling


def _refuse_unread(cfg: Mapping, where: str, N: int, Dr: int) -> None:
    """ValueError naming what a DeepSeek config.json sets that the latent attention does not model or read: grouped
    expanded heads, attention dropout, a bad rms_norm_eps, a qk_head_dim/head_dim other than transformers derives,
    and whatever `parity.layouts.unmodelled_features` finds in the fields not read here."""
    from parity.layouts import unmodelled_features

    K = cfg.get("num_key_value_heads")
    if K is not None and K != N:
        raise ValueError(f"{where}: num_key_value_heads = {K!r} != num_attention_heads = {N}: transformers' "
                         f"DeepSeek attention would repeat its N expanded key heads {N}/{K!r} times; not modelled")
    if cfg.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(f"{where}: attention_dropout = {cfg['attention_dropout']!r}: dropout on the attention "
                         f"weights in training is not modelled")
    eps = cfg.get("rms_norm_eps", NORM_EPS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{where}: rms_norm_eps = {eps!r} is not a number >= 0")
    # transformers derives these two (qk_head_dim = Dn + Dr, head_dim = Dr: the RoPE's width) and saves them
    nope = cfg.get("qk_nope_head_dim")
    for name, derived in (("qk_head_dim", nope + Dr if isinstance(nope, int) else None), ("head_dim", Dr)):
        if cfg.get(name) is not None and cfg[name] != derived:
            raise ValueError(f"{where}: {name} = {cfg[name]!r}, but transformers' DeepSeek attention uses "
                             f"{derived!r} (qk_nope_head_dim + qk_rope_head_dim, qk_rope_head_dim): the field "
                             f"would be ignored")
    rest = {k: v for k, v in cfg.items() if k not in _READ}
    if unmodelled := unmodelled_features(rest):
        raise ValueError(f"{where}: config.json sets what the latent attention does not model: "
                         + "; ".join(unmodelled))


def _flags(cfg: Mapping, model_type: str, where: str) -> tuple[bool, bool]:
    """(rope_interleave, attention_bias), each a bool; V2 always rotates consecutive pairs."""
    interleave = cfg.get("rope_interleave", True)
    if model_type == "deepseek_v2" and interleave is not True and "rope_interleave" in cfg:
        raise ValueError(f"{where}: rope_interleave = {interleave!r} on deepseek_v2, whose attention always rotates "
                         f"consecutive pairs (apply_rotary_emb) and does not read the field")
    if not isinstance(interleave, bool):
        raise ValueError(f"{where}: rope_interleave = {interleave!r} is not a bool")
    bias = cfg.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise ValueError(f"{where}: attention_bias = {bias!r} is not a bool")
    return interleave, bias


def read_deepseek_config(source, layer: int | None = None) -> LatentAttentionConfig:
    """The `LatentAttentionConfig` of a DeepSeek V2/V3 config.json (a directory, the file, or the parsed dict):
    hidden_size, num_attention_heads, q_lora_rank (null: a plain q_proj), kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, the RoPE (rope_parameters or 4.x rope_scaling, rope_theta; YaRN with mscale and
    mscale_all_dim), rope_interleave (V3; V2 always interleaved), attention_bias; the norms' eps is 1e-6 (see the
    module docstring; rms_norm_eps must be a number but is the decoder layer's). Refused by name (ValueError):
    another model_type, num_key_value_heads != num_attention_heads, attention_dropout != 0, partial RoPE, a RoPE
    kind the modules do not model, and whatever `parity.layouts.unmodelled_features` finds in the other fields
    (sliding windows, soft-capping, custom code, ...). `layer` (every DeepSeek layer has the same attention) must
    be < num_hidden_layers when given."""
    from parity.layouts import read_config_json

    cfg, where = read_config_json(source)
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)} (multi-head latent "
                         f"attention)")
    E, N = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    Dr = _int(cfg, "qk_rope_head_dim", where)
    _refuse_unread(cfg, where, N, Dr)
    interleave, bias = _flags(cfg, model_type, where)
    theta, scaling = _rope(cfg, where)
    if layer is not None:
        L = cfg.get("num_hidden_layers")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or (isinstance(L, int) and layer >= L):
            raise ValueError(f"{where}: layer {layer!r} is not one of the num_hidden_layers = {L!r} layers")
    try:
        return LatentAttentionConfig(
            E, N, _int(cfg, "kv_lora_rank", where), _int(cfg, "qk_nope_head_dim", where), Dr,
            _int(cfg, "v_head_dim", where), q_lora_rank=_int(cfg, "q_lora_rank", where, optional=True),
            rope="interleaved" if interleave else "half", rope_theta=theta, rope_scaling=scaling, norm_eps=NORM_EPS,
            bias=bias)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(f"{where}: {e}") from e


def layout_of(source) -> str | None:
    """"hf-deepseek-v3"/"hf-deepseek-v2" for a directory (or a file beside a config.json) whose model_type is
    DeepSeek's; None otherwise (no config.json, another model)."""
    import os

    from mha_spec.files import read_json

    path = os.fspath(source)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    try:  # read_json: too deep a nesting is a ValueError naming the file, not a RecursionError
        cfg = read_json(cfg_path)
    except (OSError, ValueError):
        return None  # not DeepSeek's; the Llama-style reader says what is wrong with it
    return MODEL_TYPES.get(cfg.get("model_type")) if isinstance(cfg, Mapping) else None


__all__ = ["LATENT_LAYOUTS", "HF_DEEPSEEK_NAMES", "canonical_name", "from_hf_deepseek", "to_hf_deepseek",
           "read_deepseek_config", "layout_of"]


def _tensors_under(path: str, prefix: str) -> dict[str, np.ndarray]:
    """Every tensor whose name starts with `prefix` of a checkpoint directory (model.safetensors or the shards
    model.safetensors.index.json names) or one .safetensors file, read lazily, in its stored dtype."""
    import json
    import os

    from parity.weight_file import open_weight_file

    files: dict[str, list[str]] = {}
    if os.path.isdir(path):
        single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
        if os.path.lexists(single):
            files[single] = []
        elif os.path.lexists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, Mapping):
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map')")
            for key, shard in weight_map.items():
                if key.startswith(prefix):
                    files.setdefault(os.path.join(path, shard), []).append(key)
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors nor model.safetensors.index.json")
    else:
        files[path] = []
    out = {}
    for file, keys in files.items():
        with open_weight_file(file) as f:
            for key in keys or sorted(k for k in f.keys if k.startswith(prefix)):
                out[key] = f.get(key)
    return out


def read_deepseek_checkpoint(path, prefix: str = "", layout: str | None = None
                             ) -> tuple[dict[str, np.ndarray], LatentAttentionConfig, str]:
    """(the canonical state dict (float64), the layer's config, the layout) of one DeepSeek attention block: a
    checkpoint directory's config.json and its tensors under `prefix` (a single .safetensors file needs a
    config.json beside it). `layout` (hf-deepseek-v3 | hf-deepseek-v2), when given, must be config.json's."""
    import os

    from parity.layouts import layer_index

    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config = read_deepseek_config(directory, layer=layer_index(prefix))
    from parity.layouts import read_config_json

    found = MODEL_TYPES[read_config_json(directory)[0]["model_type"]]
    if layout is not None and layout != found:
        raise ValueError(f"{directory}/config.json: model_type says layout {found!r}, not --layout {layout!r}")
    sd = from_hf_deepseek(_tensors_under(path, prefix), prefix, config=config)
    return {k: v.astype(np.float64) for k, v in sd.items()}, config, found


__all__ += ["read_deepseek_checkpoint"]
