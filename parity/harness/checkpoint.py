"""`mha-parity --checkpoint`: the forward, gradient, peers and decode checks on a layer someone holds.

    mha-parity --checkpoint DIR_OR_FILE --layout hf-llama --prefix model.layers.3.self_attn. [--shape B,T,S]

A transformers checkpoint directory gives the weights and, from its config.json, the layer
(heads, key/value heads, rope_theta, biases: `parity.layouts.read_checkpoint`). A single
.safetensors file says none of that: it needs --heads and --rope-theta (a hf-llama
layer always rotates, rotate-half as Hugging Face does); --kv-heads is read off the
k_proj rows when not given, and checked when it is; the biases are the keys present.
A config.json beside the file (a save_pretrained directory) is read as well: the layer
the flags give must be the one it describes.
(--num-heads and --num-kv-heads are deprecated spellings of --heads and --kv-heads: they warn.)

Only a layer the tool models is checked, so that a green row is about the checkpoint's own
attention: every tensor under the prefix is read (or is a buffer checked against the layer,
or a tensor the layout names as no part of attention); one left over is refused, named with
the feature it implies (q_norm/k_norm QK-norm, sinks attention sinks, qkv_proj fused
projections, ...); so is a config.json (the directory's, or the one beside a file) of a
model whose attention the tool does not model, naming what it does (partial or scaled RoPE,
fused projections, ...: `parity.layouts.unmodelled_features`). Qwen3, Gemma 2 and 3, OLMo 2
and GPT-OSS are read (`parity.layouts.attention_config`): head_dim, QK-norm (q_norm/k_norm
weights), the query scale, soft-capping and sinks from config.json, the layer index from the
prefix (layer_types[L]: a sliding_attention layer gets its window as Mistral's below; Gemma 3's
RoPE base per layer type). Refusals are usage errors (exit 2, on stderr), raised before anything
runs.

The layer runs as a decoder's self-attention at B, T, S (default 2, 5, 5): query, key and
value are one sequence when T == S; with T < S the T queries are the newest of S tokens
(a decoder with a cache: key/value inputs drawn apart, the causal mask bottom-right
aligned; with RoPE the queries' positions are the last T of the keys'). Two cases, the
masks a decoder sees:

    checkpoint/causal/nan        causal (no row is fully masked, so the policy never shows); with
                                 T == S also the decode check's case (a prompt, then single-token
                                 steps with a KV cache: `parity.harness.decode`)
    checkpoint/padding/uniform   padded keys, one sequence all padding: its rows are fully
                                 masked, and "uniform" is what Hugging Face's finfo.min mask gives
    checkpoint-decode/causal/nan with T < S and the decode check selected: its case, causal
                                 self-attention over the S tokens

A Mistral or Mixtral directory whose config.json sets sliding_window=W attends to the last W
keys (itself included): with W < S the two cases are the window's, is_causal with window
(W - 1, 0), bottom-right aligned as the causal mask is -- checkpoint/window/nan and
checkpoint/window+padding/uniform -- and there is no decode case (a KV cache takes no window);
with W >= S the window keeps every causal key and the cases are the ones above. Mixtral's
attention is Mistral's; its mixture-of-experts MLP is not attention and is not read. Qwen2's
use_sliding_window slides layers max_window_layers and up (its layer_types): those get the window.

Llama 4 (model_type llama4_text, or llama4's text_config; `parity.layouts.attention_config`): layer L is
a RoPE layer (interleaved pairs, the L2 QK-norm) or a NoPE one (the query temperature) by no_rope_layers[L],
and chunked by layer_types[L] (`parity.layouts.layer_chunk`). A chunk C < S gives the cases
checkpoint/chunk/nan and checkpoint/chunk+padding/uniform -- bottom-right aligned as the window's, the
chunks counted from the first key as transformers counts cache positions (the RoPE positions drawn apart,
as position_ids are) -- with the leak check and the decode check (checkpoint/chunk/nan decodes when T == S,
else checkpoint-decode/chunk/nan over the S tokens: our caches' chunked keep-mask, the chunks counted from each
row's first token; the protocol decoders, given no chunk, skip it); C >= S keeps every causal key: the causal
cases. A NoPE temperature layer's query positions are cache slots alike in every row
(`temperature_positions`), which is what Llama4TextAttention counts (it reads no position_ids for it).

Phi-3 (--layout hf-phi3), GPT-NeoX (hf-gpt-neox) and Falcon (hf-falcon) fuse q, k and v in one tensor,
which their layouts split (`parity.layouts.fuse_qkv`); their RoPE, like Llama 3.1's llama3 scaling and
GPT-OSS's YaRN, is read from config.json (`parity.layouts.attention_config`: rope_dim from
partial_rotary_factor / rotary_pct, rope_scaling from rope_parameters); dynamic NTK scaling and Falcon's
ALiBi are refused by name. A single GPT-NeoX weight file needs its config.json beside it (the rotated part).

Every case draws its inputs and RoPE positions as the matrix does (seeded by the case name),
the query positions then taken from the key positions (`DecoderCase`); only the weights are
the checkpoint's. With a scaled RoPE (llama3, YaRN, LongRoPE) the forward and gradient cases'
positions start at its original_max_position_embeddings (`past_original`), past the original
context, where the scaling shows; the decode check's calls run at their cache slots (0, 1, ...),
below it for these models' contexts. The report's environment names the file, the layout
and the prefix. A bad path, layout or prefix, or a missing flag, is a `LoadError` (exit 2)
naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from mha_spec import AttentionConfig, Problem
from parity.harness.checks import CHECKS as REGISTERED
from parity.harness.checks import checkpoint_checks
from parity.harness.matrix import Case, Inputs, Shape, draw_inputs
from parity.impls.registry import LoadError

DEFAULT_SHAPE = (2, 5, 5)
# The registry's checks a --checkpoint run selects by default (`Check.on_checkpoint`): training and sharded
# check our modules on drawn layers; with a sliding window smaller than S the leak check runs and no decode case.
CHECKS = checkpoint_checks(window=False)
WINDOW_CHECKS = checkpoint_checks(window=True)
# A chunk smaller than S: the window's checks (the leak check) and the decode check (a KV cache takes a chunk).
CHUNK_CHECKS = tuple(n for n in REGISTERED if n in CHECKS or n in WINDOW_CHECKS)
DTYPES_DEFAULT = ("float64", "float32")  # --dtypes picks others (bfloat16, float16)
MASKS = (("causal", "nan"), ("padding", "uniform"))  # (mask kind, masked-row policy): see the module docstring
# With a sliding window smaller than S: (masked-row policy, padding ANDed) of the two window cases.
WINDOW_MASKS = (("nan", False), ("uniform", True))
_FILE_FLAGS = ("heads", "kv_heads", "rope_theta")
# The layouts of models with RoPE (rotate-half, as Hugging Face has it): a single file of one is read with
# --rope-theta, and a config.json beside it must be of a model that layout reads (`parity.layouts.HF_MODELS`).
_ROPE_LAYOUTS = ("hf-llama", "hf-phi3", "hf-gpt-neox", "hf-falcon")
# Layouts whose layer a weight file and the flags cannot describe: GPT-NeoX rotates a fraction of each head
# (rotary_pct, a quarter unless config.json says otherwise), so without config.json its RoPE is unknown.
_CONFIG_ONLY = {"hf-gpt-neox": "GPT-NeoX rotates part of each head (rotary_pct, 0.25 by default)"}  # the dests of the single-file flags (--heads, --kv-heads, --rope-theta)


@dataclass(frozen=True)
class CheckpointLayer:
    """One attention block read from a checkpoint: where it came from, its weights and its layer."""

    path: str
    layout: str
    prefix: str
    state_dict: dict
    config: AttentionConfig
    sliding_window: int | None = None  # config.json's sliding_window (Mistral, Mixtral): the last W keys
    # The other tensors under the prefix, each with what it is: a buffer checked against the layer, or a tensor
    # of the block that takes no part in attention (`parity.layouts.account`); none of them is judged.
    other_tensors: tuple[str, ...] = ()
    config_json: str | None = None  # the config.json read (the directory's, or the one beside a single file)
    chunk: int | None = None  # Llama 4's attention_chunk_size C on a chunked_attention layer (`layouts.layer_chunk`)

    @property
    def dtype(self) -> str:
        return str(next(iter(self.state_dict.values())).dtype)

    @property
    def layer_text(self) -> str:
        c = self.config
        text = (f"E={c.embed_dim} N={c.num_heads} K={c.kv_heads} H={c.head_size} qkv_bias={c.qkv_bias} "
                f"out_bias={c.out_bias} rope={c.rope} rope_theta={c.rope_theta:g}")
        if c.rope_dim is not None:
            text += f" rope_dim={c.rope_dim}"
        if c.rope_scaling is not None:
            text += f" rope_scaling={c.rope_scaling}"
        if c.qk_norm is not None:
            text += f" qk_norm={c.qk_norm} qk_norm_eps={c.qk_norm_eps:g} qk_norm_offset={c.qk_norm_offset:g}"
        for name in ("scale", "softcap"):
            if getattr(c, name) is not None:
                text += f" {name}={getattr(c, name):g}"
        if c.attn_temperature_tuning:
            text += f" attn_temperature_tuning=True floor_scale={c.floor_scale:g} attn_scale={c.attn_scale:g}"
        if self.chunk is not None:
            text += f" chunk={self.chunk}"
        return text + (" sinks=True" if c.sinks else "")

    @property
    def environment(self) -> dict:
        """What the report records about the layer checked."""
        env = {"checkpoint": self.path, "checkpoint_layout": self.layout, "checkpoint_prefix": self.prefix,
               "checkpoint_layer": self.layer_text, "checkpoint_dtype": self.dtype}
        if self.sliding_window is not None:
            env["checkpoint_sliding_window"] = self.sliding_window
        if self.chunk is not None:
            env["checkpoint_chunk"] = self.chunk
        if self.other_tensors:
            env["checkpoint_other_tensors"] = "; ".join(self.other_tensors)
        env["checkpoint_config"] = self.config_json or "none: the layer is what the flags and the layout say"
        return env

    def describe(self, tokens: int | None = None, constant: tuple[str, ...] = ()) -> str:
        """What is checked, before the table (the report's environment carries the same): the layer, with
        `tokens` (S) its cases' keys against the sliding window, and a warning naming the `constant` tensors,
        which blind the forward check (see `constant_tensors`)."""
        text = f"checkpoint {self.path} (layout {self.layout}, prefix {self.prefix!r}, {self.dtype}): {self.layer_text}"
        W, S = self.sliding_window, tokens
        if W is not None:
            text += (f"\nsliding_window={W}: " + (f"fewer keys than the S={S} tokens, so the cases apply the window "
                                                    f"(is_causal, window ({W - 1}, 0)); no decode case (a KV cache takes no window)"
                                                    if window_binds(W, S) else
                                                    f"at least the S={S} tokens, so the window keeps every causal key: the "
                                                    f"causal cases are the model's (--shape with S > {W} checks the window)"))
        C = self.chunk
        if C is not None:
            text += (f"\nattention_chunk_size={C}: " + (
                f"fewer keys than the S={S} tokens, so the cases apply the chunk (is_causal within chunks of {C} "
                f"tokens counted from the first key, the queries the last T of the keys) and the decode case (the "
                f"chunks counted from each row's first token)" if chunk_binds(C, S) else
                f"at least the S={S} tokens, so the chunk keeps every causal key: the causal cases are the model's "
                f"(--shape with S > {C} checks the chunk)"))
        if self.config.attn_temperature_tuning:
            text += (f"\nNoPE query temperature (floor_scale={self.config.floor_scale:g}): the cases' query positions "
                     f"are cache slots p0, p0 + 1, ... alike in every row, as Llama4TextAttention counts them "
                     f"(`temperature_positions`)")
        if self.config_json is None:
            text += ("\nno config.json beside the file: the layer is what the flags and the layout say; what a config.json "
                     "would add (soft-capping, a query scale, sliding windows, scaled RoPE) cannot be seen in a weight file")
        if self.other_tensors:
            text += f"\nalso under the prefix, not judged: {'; '.join(self.other_tensors)}"
        if constant:
            text += (f"\nwarning: {', '.join(constant)} hold one value throughout (all zero, "
                     "as freshly initialised): a port that ignores them computes the same, so the case "
                     "checkpoint-redrawn/causal/nan checks the layer with them drawn")
        return text

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class CheckpointRun:
    """A --checkpoint run: its layer, the S tokens of its cases, the layer's constant tensors (drawn in one case),
    and the `parity.harness.run` arguments (cases, fixed weights, the report's environment, checks, dtypes)."""

    layer: CheckpointLayer
    tokens: int
    constant: tuple[str, ...]
    run_kwargs: dict

    def describe(self) -> str:
        return self.layer.describe(self.tokens, self.constant)


def _fail(path, layout, prefix, e: BaseException) -> LoadError:
    said = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) adds quotes
    text = " ".join(str(said).split()) or type(e).__name__
    return LoadError(f"--checkpoint {path} --layout {layout} --prefix {prefix!r}: {type(e).__name__}: {text}")


def load_layer(path, layout: str = "hf-llama", prefix: str = "", *, num_heads: int | None = None,
               num_kv_heads: int | None = None, rope_theta: float | None = None) -> CheckpointLayer:
    """Read one attention block; any failure is a `LoadError` naming the path, layout and prefix.

    Every tensor under the prefix is accounted for, or the block is refused: one the layout does not read
    (`parity.layouts.account`), a model config.json describes with attention the tool does not model -- the
    directory's, or the one beside a single file, which the flags must then agree with."""
    from parity import layouts
    from parity.weight_file import path_problem

    if layout not in layouts.LAYOUTS:
        raise LoadError(f"--layout {layout!r} is not a known layout; known: {', '.join(layouts.LAYOUTS)}")
    if (problem := path_problem(os.fsdecode(path))) is not None:
        raise LoadError(f"--checkpoint {path}: {problem}")
    given = {"--heads": num_heads, "--kv-heads": num_kv_heads, "--rope-theta": rope_theta}  # by the flags that give them
    try:
        if os.path.isdir(path):
            extra = [flag for flag, v in given.items() if v is not None]
            if extra:
                raise LoadError(f"--checkpoint {path} is a directory: its config.json gives the layer, so "
                                f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not taken (a single .safetensors file needs them)")
            parsed = layouts.read_config_json(path)  # read once: the window, the chunk, then the layer
            window = sliding_window(*parsed, layer=layouts.layer_index(prefix))
            chunk = layouts.layer_chunk(*parsed, layouts.layer_index(prefix))
            sd, config = layouts.read_checkpoint(path, layout, prefix=prefix, ignore_sliding_window=window is not None,
                                                 config_json=parsed, ignore_chunk=chunk is not None)
            config_json = parsed[1]
            tensors = layouts.account(layouts.checkpoint_tensor_names(path), layout, prefix, _features(config))
        else:
            sd, config, window, config_json, tensors, chunk = _read_file(path, layout, prefix, num_heads, num_kv_heads,
                                                                         rope_theta)
    except LoadError:
        raise
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError) as e:
        raise _fail(path, layout, prefix, e) from e
    others = (*(f"{k} (a buffer, checked against the layer)" for k in tensors.buffers),
              *(f"{k} (not attention: {why})" for k, why in tensors.not_attention.items()))
    return CheckpointLayer(str(path), layout, prefix, sd, config, window, others, config_json, chunk)


def default_layout(path) -> str:
    """The layout of the model config.json describes (the directory's, or the one beside a single file:
    `parity.layouts.HF_MODELS`), so `--checkpoint DIR` of a Phi-3, GPT-NeoX or Falcon needs no --layout;
    "hf-llama" when there is none, or it is not one the tool reads (`load_layer` then names why)."""
    from mha_spec.files import read_json
    from parity.layouts import HF_MODELS

    path = os.fsdecode(path)
    where = os.path.join(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)), "config.json")
    try:
        cfg = read_json(where) if os.path.isfile(where) else None
    except (OSError, ValueError):
        cfg = None  # load_layer reads it again and names what is wrong with it
    model = HF_MODELS.get(cfg.get("model_type")) if isinstance(cfg, dict) else None
    return "hf-llama" if model is None else model.layout


def read_sliding_window(directory) -> int | None:
    """config.json's sliding_window W of a checkpoint directory (`sliding_window`); None when it holds no
    config.json."""
    from mha_spec.files import read_json

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        return None  # read_checkpoint names what is missing
    return sliding_window(read_json(config_path), config_path)


def sliding_window(cfg, where: str, layer: int | None = None) -> int | None:
    """A parsed config.json's sliding_window W for a model whose every layer attends to its last W keys
    (Mistral, Mixtral: `layouts.HF_MODELS` names the field "sliding_window"), or for block `layer` (L, from
    its prefix: `layouts.layer_index`) of a model whose layer_types[L] is "sliding_attention" (Qwen3, Gemma 2
    and 3, GPT-OSS: `layouts.layer_window`); None when unset or for another model (Qwen2's use_sliding_window
    is left to `read_checkpoint`, which refuses it). A W that is not a positive int is a ValueError naming it
    and `where` (the config.json's path)."""
    from parity.layouts import HF_MODELS, layer_window

    if isinstance(cfg, dict) and (W := layer_window(cfg, where, layer)) is not None:
        return W
    model = HF_MODELS.get(cfg.get("model_type")) if isinstance(cfg, dict) else None
    if model is None or model.sliding_window_field != "sliding_window" or cfg.get("sliding_window") is None:
        return None
    W = cfg["sliding_window"]
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"{where}: sliding_window = {W!r} is not a positive integer (the keys a query attends to)")
    return W


def _read_file(path, layout, prefix, num_heads, num_kv_heads, rope_theta):
    """(state dict, AttentionConfig, sliding window, the config.json read or None, its tensors under the prefix
    accounted for, Llama 4's chunk or None) of a single weight file, from the flags; a config.json beside the
    file is read too (`_beside`), and the flags must agree with it. A Llama 4 NoPE layer (the config.json
    beside says so) takes no --rope-theta."""
    from parity import layouts
    from parity.canonical import LAYER_FIELDS, ROPE_FIELDS, check_variant_state_dict

    # Hugging Face's convention for the layouts of RoPE models (`_ROPE_LAYOUTS`); the classic layouts have none
    rope = "half" if layout in _ROPE_LAYOUTS else None
    beside = _beside_json(path)  # read once: whether the layer rotates, then the layer
    nope = layout == "hf-llama" and _says_nope(beside, prefix)  # a Llama 4 NoPE layer rotates nothing
    if nope:
        rope = None
    missing = ["--heads"] if num_heads is None else []
    if rope is not None and rope_theta is None:
        missing.append("--rope-theta")
    if missing:
        raise LoadError(f"--checkpoint {path} is a single weight file, which does not say the layer's heads or RoPE: "
                        f"give {' and '.join(missing)} (or the checkpoint directory holding config.json)")
    if rope is None and rope_theta is not None:
        raise LoadError(f"--rope-theta: layout {layout!r} has no rotary embedding" if not nope else
                        f"--rope-theta: the config.json beside the file says {prefix!r} is a NoPE layer (Llama 4's "
                        f"no_rope_layers): it has no rotary embedding")
    names = layouts.checkpoint_tensor_names(path)
    described, window, where, chunk = _beside(path, layout, layouts.account(names, layout, prefix), prefix, beside)
    if described is not None and layout == "hf-llama" and described.rope != rope:
        rope = described.rope  # Llama 4: interleaved pairs on its RoPE layers, none on its NoPE layers
    if described is None and layout in _CONFIG_ONLY:
        raise LoadError(f"--checkpoint {path} is a single weight file with no config.json beside it: {_CONFIG_ONLY[layout]}, "
                        f"which only config.json says (give the checkpoint directory)")
    tensors = layouts.account(names, layout, prefix, _features(described))
    sd = layouts.read_layout(path, layout, prefix=prefix, num_heads=num_heads, rope_theta=rope_theta,
                             qk_norm=_weighted_norm(described), sinks=getattr(described, "sinks", False))
    (NH, E), kv_rows = sd["q_proj.weight"].shape, sd["k_proj.weight"].shape[0]
    if num_kv_heads is None:
        num_kv_heads = kv_rows // (NH // num_heads)  # read_layout checked: a whole number of heads dividing N
    layer = {} if described is None else {f: getattr(described, f) for f in LAYER_FIELDS}  # what the tensors cannot say
    said_rope = {} if described is None else {f: getattr(described, f) for f in ROPE_FIELDS}  # Llama 4's L2 norm needs it
    read, _ = check_variant_state_dict(sd, num_heads, num_kv_heads, **layer, **said_rope)
    # RoPE's part and scaling are config.json's (a file cannot say them): the described layer's, else none
    rope_kw = {} if described is None else {f: getattr(described, f) for f in ROPE_FIELDS[2:]}
    config = AttentionConfig(E, num_heads, num_kv_heads=num_kv_heads, head_dim=read.head_dim, qkv_bias=read.qkv_bias,
                             out_bias=read.out_bias, rope=rope, sinks=read.sinks,
                             rope_theta=10000.0 if rope_theta is None or rope is None else float(rope_theta),
                             **rope_kw, **layer)
    if described is not None:
        _agree(path, config, described)
    return sd, config, window, where, tensors, chunk


def _beside_json(path) -> tuple:
    """(parsed config.json, its path, the error reading it) of the config.json beside a weight file, read once;
    (None, None, None) when there is none. An error is kept for `_beside` to raise, after the flags' own."""
    from mha_spec.files import read_json

    where = os.path.join(os.path.dirname(os.path.abspath(os.fsdecode(path))), "config.json")
    if not os.path.isfile(where):
        return None, None, None
    try:
        return read_json(where), where, None
    except (OSError, ValueError) as e:
        return None, where, e


def _says_nope(beside: tuple, prefix: str) -> bool:
    """Whether the config.json beside a weight file (`_beside_json`) describes the prefix's block as a layer
    without RoPE (a Llama 4 NoPE layer); False when it does not or cannot say (`_beside` then names why)."""
    from parity import layouts

    cfg, where, _ = beside
    model = layouts.HF_MODELS.get(cfg.get("model_type")) if isinstance(cfg, dict) else None
    if model is None or not model.llama4:
        return False
    try:
        return layouts.attention_config(cfg, where, layer=layouts.layer_index(prefix), ignore_chunk=True).rope is None
    except (ValueError, TypeError, NotImplementedError):
        return False


def _features(config) -> tuple[str, ...]:
    """The layer features whose tensors the layout reads (`parity.layouts.account`): the config's QK-norm, sinks."""
    if config is None:
        return ()
    return (*(("qk_norm",) if _weighted_norm(config) else ()), *(("sinks",) if config.sinks else ()))


def _weighted_norm(config) -> str | None:
    """The config's QK-norm when it has weights (q_norm/k_norm: "head", "flat"); None otherwise (Llama 4's "l2"
    is weightless)."""
    norm = getattr(config, "qk_norm", None)
    return norm if norm in ("head", "flat") else None


def _beside(path, layout: str, tensors, prefix: str = "", beside: tuple | None = None):
    """(AttentionConfig, sliding window, its path, Llama 4's chunk) of the config.json in a single weight file's
    directory (a save_pretrained directory); (None, None, None, None) when there is none. For hf-llama its model must be one
    `parity.layouts.read_hf_config` reads; for every layout, what it sets that the tool does not model
    (`parity.layouts.unmodelled_features`) is refused by name: a file alone cannot say it. beside: the
    config.json as `_beside_json` read it (None: read here)."""
    from parity import layouts

    cfg, where, error = _beside_json(path) if beside is None else beside
    if where is None:
        return None, None, None, None
    if error is not None:
        raise error
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} (beside the weight file) holds a JSON {type(cfg).__name__}, not an object")
    if layout not in _ROPE_LAYOUTS:
        features = layouts.unmodelled_features(cfg)
        if features:
            raise ValueError(f"{where} (beside the weight file) describes attention the tool does not model: "
                             f"{'; '.join(features)}")
        return None, None, where, None
    model = layouts.hf_model(cfg, where, tensors)
    if model.layout != layout:
        raise ValueError(layouts.layout_mismatch(cfg, f"{where} (beside the weight file)", model, layout, tensors))
    layer = layouts.layer_index(prefix)
    window = sliding_window(cfg, where, layer)
    chunk = layouts.layer_chunk(cfg, where, layer)
    return (layouts.attention_config(cfg, where, ignore_sliding_window=window is not None, layer=layer,
                                     ignore_chunk=chunk is not None), window, where, chunk)


def _agree(path, config: AttentionConfig, described: AttentionConfig) -> None:
    """The layer the flags and the file's tensors give must be the one config.json beside the file describes."""
    fields = (("--heads", "num_attention_heads", "num_heads"),
              ("--kv-heads (or k_proj's rows)", "num_key_value_heads", "kv_heads"),
              ("--rope-theta", "rope_theta", "rope_theta"),
              ("the layout's RoPE", "the layer's RoPE", "rope"),
              ("the file's q/k/v biases", "the model's q/k/v biases", "qkv_bias"),
              ("the file's out_proj bias", "the model's out_proj bias", "out_bias"),
              ("E", "hidden_size", "embed_dim"),
              ("the file's head_dim (q_proj's rows / N)", "head_dim", "head_size"),
              ("the file's sinks", "the model's sinks", "sinks"),
              ("RoPE's rotated features (config.json's only)", "the rotated part of the head", "rotary_dim"),
              ("RoPE's scaling (config.json's only)", "the RoPE scaling", "rope_scaling"))
    differ = [f"{flag} {getattr(config, attr)!r} but {field} {getattr(described, attr)!r}"
              for flag, field, attr in fields if getattr(config, attr) != getattr(described, attr)]
    if differ:
        where = os.path.join(os.path.dirname(os.path.abspath(os.fsdecode(path))), "config.json")
        raise ValueError(f"the layer does not agree with {where}, beside the weight file: {'; '.join(differ)}")


def constant_tensors(state_dict: dict) -> tuple[str, ...]:
    """The tensors that hold one value throughout (all zero, as a freshly initialised bias is):
    a port that ignores such a tensor computes what the file computes, so the forward check
    cannot tell; a case with them redrawn can."""
    import numpy as np

    from parity.reference import as_float64

    out = []
    for name, a in state_dict.items():
        a = as_float64(a)
        if a.size and np.all(a == a.flat[0]):
            out.append(name)
    return tuple(out)


class DecoderCase(Case):
    """A checkpoint case: its T queries are the newest of its S tokens (T <= S), so with RoPE the
    queries' positions are the last T of the keys' (query t sits at key t + S - T, where the
    bottom-right causal mask puts it). A NoPE layer with Llama 4's temperature takes its query positions
    from the cache slots instead (`temperature_positions`)."""

    def draw_inputs(self, seed: int, state_dict: dict | None = None) -> Inputs:
        """The matrix's draw (`draw_inputs`), the query positions then taken from the key positions (a
        temperature layer's: `temperature_positions`)."""
        x = draw_inputs(self, seed, state_dict)
        if x.positions is None:
            return x
        s = self.shape
        if s.rope is None and s.attn_temperature_tuning:
            return dataclasses.replace(x, positions=temperature_positions(self.config, s.B, s.T, s.S))
        return dataclasses.replace(x, positions=x.key_positions[:, self.shape.S - self.shape.T:].copy())


def temperature_positions(config: AttentionConfig, B: int, T: int, S: int):
    """int64 (B, T): the query positions of a checkpoint case of a NoPE layer with Llama 4's temperature.
    Llama4TextAttention does not read position_ids for it: it counts cache slots, arange(T) plus the tokens
    the cache has seen, alike for every row. So the cases' positions are slots p0 + S - T + t, one list for
    every row -- the model's own numbers with p0 tokens seen before the S -- and p0 puts the S tokens across
    the first step of floor((p + 1) / floor_scale) (p = ceil(floor_scale) - 1) where the sequence reaches it,
    so the temperature takes two values among them (Llama 4's floor_scale 8192: p0 = 8191 - S // 2)."""
    import math

    import numpy as np

    first_step = math.ceil(config.floor_scale) - 1  # the smallest p with floor((p + 1) / floor_scale) = 1
    p0 = max(0, first_step - S // 2)
    return np.broadcast_to(p0 + np.arange(S - T, S, dtype=np.int64)[None], (B, T)).copy()


def window_binds(sliding_window: int | None, S: int) -> bool:
    """Whether a sliding window of W keys masks anything among S tokens (W < S)."""
    return sliding_window is not None and sliding_window < S


def chunk_binds(chunk: int | None, S: int) -> bool:
    """Whether Llama 4's chunks of C tokens mask anything among S tokens (C < S: a second chunk begins)."""
    return chunk is not None and chunk < S


def past_original(config: AttentionConfig) -> int | None:
    """Where a checkpoint case's positions start: a scaled RoPE's original_max_position_embeddings (every
    position past the original context, where the scaled frequencies differ from the plain ones most and
    LongRoPE takes its long factors; RoPE positions need not start at 0, so no long sequence is needed);
    None for a RoPE without one (positions as the matrix draws them)."""
    scaling = config.rope_scaling
    return None if scaling is None else scaling.original_max_position_embeddings


def cases(config: AttentionConfig, B: int, T: int, S: int, redraw: tuple = (), decode: bool = False,
          sliding_window: int | None = None, chunk: int | None = None) -> tuple[Case, ...]:
    """The checkpoint's cases at B, T, S (see the module docstring); with `redraw` (constant
    tensors), also "checkpoint-redrawn/<mask>/nan": the file's weights with those tensors drawn.
    decode: the decode check is selected (with T < S it gets a case of its own; with T == S the causal
    case is its case either way). sliding_window: config.json's W; with W < S the cases are the window's
    (window (W - 1, 0), bottom-right aligned), without a decode case. chunk: Llama 4's attention_chunk_size C;
    with C < S the cases are "checkpoint/chunk/nan" and "checkpoint/chunk+padding/uniform": bottom-right
    aligned (the T queries are the last of the S tokens) and the chunks counted from the first key, as
    transformers' chunked mask counts cache positions (the RoPE positions are drawn apart, as position_ids
    are); decode: "checkpoint/chunk/nan" decodes when T == S, else "checkpoint-decode/chunk/nan" (the S
    tokens) does -- the chunks then counted from each row's first token, as our caches' `keep_mask(T, chunk=C)`
    and transformers' create_chunked_causal_mask (past the left padding) count them."""
    if T > S:
        raise ValueError(f"--shape {B},{T},{S}: a decoder's queries are the newest of its tokens, so T <= S; got T > S")
    shape = Shape.of("checkpoint", Problem(config, B, T, S), cross=T != S)
    redrawn = Shape.of("checkpoint-redrawn", Problem(config, B, T, S), cross=T != S)
    past = {"positions_from": past_original(config)}  # the decode check's steps run at their cache slots
    if window_binds(sliding_window, S) and chunk_binds(chunk, S):
        raise ValueError(f"a sliding window ({sliding_window}) and a chunk ({chunk}) on one layer: no model has both")
    if window_binds(sliding_window, S) or chunk_binds(chunk, S):
        mask = "window" if window_binds(sliding_window, S) else "chunk"
        kind = {"window": (sliding_window - 1, 0)} if mask == "window" else {"chunk": chunk}
        window = {**kind, "alignment": "bottom-right", **past}
        # A chunk decodes (our caches take one: `KVCache.keep_mask(T, chunk=C)`); a window does not.
        decodes = decode and mask == "chunk"
        out = tuple(DecoderCase(shape, mask, policy, padded=padded, peers=True, jax_eager=False, **window,
                                decode=decodes and not padded and T == S)
                    for policy, padded in WINDOW_MASKS)
        if decodes and T < S:
            own = Shape.of("checkpoint-decode", Problem(config, B, S, S), cross=False)
            out += (DecoderCase(own, "chunk", "nan", chunk=chunk, jax_eager=False, decode=True),)
        if redraw:
            out += (DecoderCase(redrawn, mask, WINDOW_MASKS[0][0], jax_eager=False, redraw=tuple(redraw), **window),)
        return out
    out = tuple(DecoderCase(shape, mask, policy, peers=True, jax_eager=False, **past,
                            decode=mask == "causal" and T == S and S > 1) for mask, policy in MASKS)
    if decode and T < S:
        own = Shape.of("checkpoint-decode", Problem(config, B, S, S), cross=False)
        out += (DecoderCase(own, "causal", "nan", jax_eager=False, decode=True),)
    if redraw:
        out += (DecoderCase(redrawn, *MASKS[0], jax_eager=False, redraw=tuple(redraw), **past),)
    return out


def parse_shape(text: str) -> tuple[int, int, int]:
    """An argparse `type`: 'B,T,S' -> (B, T, S), positive integers."""
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,T,S (three positive integers), got {text!r}") from None
    if len(vals) != 3 or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected B,T,S (three positive integers), got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The --checkpoint flags of `mha-parity`."""
    from parity.cli_args import add_alias, positive_float, positive_int
    from parity.latent import LATENT_LAYOUTS
    from parity.layouts import LAYOUTS

    g = p.add_argument_group("a checkpoint's layer (--checkpoint)")
    g.add_argument("--checkpoint", metavar="DIR_OR_FILE", default=None,
                   help="check one attention block of a checkpoint: a transformers directory (config.json + "
                   "model.safetensors or its sharded index) or one .safetensors file; runs forward, gradient and peers "
                   "on a causal and a padded case, and decode (a prompt, then single-token steps with a KV cache) "
                   "(default dtypes float64,float32); a tensor under --prefix the layout does not read, or a model "
                   "whose attention the tool does not model, is refused by name (exit 2)")
    g.add_argument("--layout", default=None, metavar="NAME",
                   help=f"how the checkpoint names the block's tensors ({', '.join(LAYOUTS)}; DeepSeek's latent "
                   f"attention: {', '.join(LATENT_LAYOUTS)}, docs/latent.md; default: the one of config.json's model_type "
                   f"(the directory's, or the one beside a file), else hf-llama)")
    g.add_argument("--prefix", default="", metavar="PREFIX", help="the block's key prefix, e.g. model.layers.3.self_attn.")
    g.add_argument("--shape", type=parse_shape, default=None, metavar="B,T,S",
                   help=f"batch, query and key lengths of the --checkpoint or --layer cases (T <= S; T < S is "
                   f"cross-attention; default {','.join(map(str, DEFAULT_SHAPE))})")
    # --heads/--kv-heads as mha-bench spells them; --num-heads/--num-kv-heads parse the same, with a warning.
    add_alias(g, "--num-heads", g.add_argument("--heads", type=positive_int, default=None, metavar="N",
                                               help="single file: query heads"))
    add_alias(g, "--num-kv-heads", g.add_argument("--kv-heads", type=positive_int, default=None, metavar="K",
                                                  help="single file: key/value heads (default: read off k_proj's rows)"))
    g.add_argument("--rope-theta", type=positive_float, default=None, metavar="THETA",
                   help="single file, hf-llama: the rotary base (config.json's rope_theta)")


def usage_problem(args) -> str | None:
    """A flag that needs --checkpoint, or one --checkpoint cannot take (None: fine)."""
    own = ("layout", "prefix", *(() if getattr(args, "layer", None) else ("shape",)), *_FILE_FLAGS)
    if args.checkpoint is None:
        given = [f"--{a.replace('_', '-')}" for a in own
                 if getattr(args, a) not in (None, "", "hf-llama")]
        return (f"{', '.join(given)}: the flags of a checkpoint's layer; give --checkpoint too"
                + (" (or --layer, for --shape)" if "--shape" in given else "")) if given else None
    if args.quick:
        return "--quick picks the drawn matrix; --checkpoint runs the checkpoint's own cases"
    if args.devices is not None:
        return "--devices checks the sharded layouts of drawn layers; it does not take --checkpoint"
    return None


def prepare(args) -> CheckpointRun:
    """The --checkpoint run the arguments ask for: the layer read (a `LoadError` otherwise), its cases, and the
    checks/dtypes defaults (the ones given on the command line win)."""
    layer = load_layer(args.checkpoint, args.layout or default_layout(args.checkpoint), args.prefix, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, rope_theta=args.rope_theta)
    B, T, S = args.shape or DEFAULT_SHAPE
    constant = constant_tensors(layer.state_dict)
    default = (WINDOW_CHECKS if window_binds(layer.sliding_window, S) else CHUNK_CHECKS if chunk_binds(layer.chunk, S)
               else CHECKS)
    try:
        checks = args.checks if args.checks is not None else default
        chosen = cases(layer.config, B, T, S, redraw=constant, decode="decode" in checks,
                       sliding_window=layer.sliding_window, chunk=layer.chunk)
    except ValueError as e:
        raise LoadError(str(e)) from e
    environment = dict(layer.environment)
    if layer.sliding_window is not None or layer.chunk is not None:
        environment["checkpoint_tokens"] = S
    if constant:
        environment["checkpoint_constant_tensors"] = ",".join(constant)
    return CheckpointRun(layer, S, constant, {"cases": chosen, "state_dict": layer.state_dict,
                                              "environment": environment, "checks": checks,
                                              "dtypes": args.dtypes if args.dtypes is not None else DTYPES_DEFAULT})


def run_kwargs(args) -> dict:
    """`parity.harness.run` arguments for --checkpoint (`prepare(args).run_kwargs`)."""
    return prepare(args).run_kwargs


__all__ = ["CheckpointLayer", "CheckpointRun", "DecoderCase", "load_layer", "read_sliding_window", "sliding_window",
           "window_binds", "chunk_binds", "temperature_positions", "cases", "prepare", "run_kwargs",
           "add_arguments", "usage_problem", "CHECKS", "MASKS", "WINDOW_MASKS", "WINDOW_CHECKS",
           "CHUNK_CHECKS", "DEFAULT_SHAPE", "DTYPES_DEFAULT"]
