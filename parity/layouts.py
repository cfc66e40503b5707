"""State-dict layouts of real checkpoints: one attention block of a Hugging Face model.

Each layout is a total, explicit table (penzai style): every tensor the block owns,
its name relative to a prefix, its shape in units of E, which canonical tensors it
holds and how it is stored. Nothing is guessed from a suffix or an ndim; every shape
is asserted; keys under the prefix that the table does not name (LayerNorm, MLP, the
rest of the model) are ignored. Dtypes pass through unchanged (bfloat16 included).

    layout    prefix (one block)            tensors (relative to the prefix)
    hf-bert   encoder.layer.{i}.attention.   self.{query,key,value}.{weight,bias}, output.dense.{weight,bias}
    hf-vit    encoder.layer.{i}.attention.   attention.{query,key,value}.*, output.dense.*   (file spelling)
              layers.{i}.attention.          {q,k,v,o}_proj.*                                 (transformers 5.x modules)
    hf-gpt2   h.{i}.attn.                    c_attn.weight (E, 3E) stored (in, out), columns q | k | v;
                                             c_attn.bias (3E,); c_proj.weight (E, E) (in, out); c_proj.bias (E,)
    hf-llama  model.layers.{i}.self_attn.    q_proj.weight (E, E), k_proj/v_proj.weight (KH, E), o_proj.weight (E, E);
              (Llama, Mistral, Qwen2)        biases: none (Llama, Mistral), q/k/v (Qwen2), all four (attention_bias)

KH is K*H, the key/value heads' rows: a file does not say N, so from the tensors alone
k/v rows are checked to agree and to divide E; `num_heads=N` checks them in units of
heads (H = E/N, K = KH/H dividing N). A grouped layer's canonical dict has k/v weights
(KH, E) and only the biases it has (parity.canonical.bias_flags); to_torch(sd, N,
num_kv_heads=K) checks it again.

The canonical state dict is parity.canonical's: q_proj/k_proj/v_proj/out_proj
.weight (out, in) and .bias, as NumPy arrays. parity.convert re-exports this module's
API; this module never imports parity.convert.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from mha_spec.files import read_json
from parity.canonical import SUPPORTED_DTYPES, bias_flags, check_state_dict, tensor_to_numpy
from parity.weight_file import file_path, open_weight_file, path_error, path_problem


@dataclass(frozen=True)
class Stored:
    """One tensor of a layout: where it lives and what it holds.

    The canonical tensors in `parts` are concatenated along the stored tensor's last
    axis (GPT-2's c_attn holds q | k | v). `in_out` means a weight is stored (in, out),
    the transpose of nn.Linear's (out, in) -- GPT-2's Conv1D. An `optional` tensor (a
    bias a model may lack) is read when present; which biases a block has is then
    checked against the layout's `bias_sets`.
    """

    key: str  # relative to the prefix
    shape: tuple[str, ...]  # in units of E: "E", "3E", or "KH" (key/value heads' rows, K*H)
    parts: tuple[str, ...]  # canonical keys, in order along the last axis
    in_out: bool = False
    optional: bool = False


_ALL_BIASES = ((True, True),)  # (qkv_bias, out_bias) pairs


@dataclass(frozen=True)
class Layout:
    name: str
    spellings: tuple[tuple[Stored, ...], ...]  # the first is the one written
    e_key: tuple[str, ...]  # per spelling: the tensor whose last axis is E
    bias_sets: tuple[tuple[bool, bool], ...] = _ALL_BIASES  # the (qkv_bias, out_bias) a block may have

    def keys(self, spelling: int = 0) -> tuple[str, ...]:
        return tuple(s.key for s in self.spellings[spelling])

    @property
    def grouped(self) -> bool:
        """Whether k/v may have fewer rows than q (shape "KH")."""
        return any("KH" in s.shape for sp in self.spellings for s in sp)


def _linear(key: str, proj: str, rows: str = "E", optional_bias: bool = False) -> tuple[Stored, Stored]:
    """An nn.Linear(E, rows) named `key`: weight (out, in) = canonical, bias (rows,)."""
    return (Stored(f"{key}.weight", (rows, "E"), (f"{proj}.weight",)),
            Stored(f"{key}.bias", (rows,), (f"{proj}.bias",), optional=optional_bias))


def _unfused(q: str, k: str, v: str, o: str) -> tuple[Stored, ...]:
    return (*_linear(q, "q_proj"), *_linear(k, "k_proj"), *_linear(v, "v_proj"), *_linear(o, "out_proj"))


_QKV_W = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_QKV_B = ("q_proj.bias", "k_proj.bias", "v_proj.bias")

LAYOUT_TABLES: dict[str, Layout] = {
    "hf-bert": Layout(
        "hf-bert",
        (_unfused("self.query", "self.key", "self.value", "output.dense"),),
        ("output.dense.bias",),
    ),
    "hf-vit": Layout(
        "hf-vit",
        (
            _unfused("attention.query", "attention.key", "attention.value", "output.dense"),  # checkpoint files
            _unfused("q_proj", "k_proj", "v_proj", "o_proj"),  # transformers 5.x ViTAttention modules
        ),
        ("output.dense.bias", "o_proj.bias"),
    ),
    "hf-gpt2": Layout(
        "hf-gpt2",
        (
            (
                Stored("c_attn.weight", ("E", "3E"), _QKV_W, in_out=True),
                Stored("c_attn.bias", ("3E",), _QKV_B),
                Stored("c_proj.weight", ("E", "E"), ("out_proj.weight",), in_out=True),
                Stored("c_proj.bias", ("E",), ("out_proj.bias",)),
            ),
        ),
        ("c_proj.bias",),
    ),
    "hf-llama": Layout(
        "hf-llama",
        (
            (
                *_linear("q_proj", "q_proj", optional_bias=True),
                *_linear("k_proj", "k_proj", "KH", optional_bias=True),
                *_linear("v_proj", "v_proj", "KH", optional_bias=True),
                *_linear("o_proj", "out_proj", optional_bias=True),
            ),
        ),
        ("q_proj.weight",),
        # Llama/Mistral: none; Qwen2: q/k/v; Llama with attention_bias=True: all four.
        bias_sets=((False, False), (True, False), (True, True)),
    ),
}
LAYOUTS = tuple(LAYOUT_TABLES)

_BIAS_SET_NAMES = {(True, True): "all four biases", (True, False): "q/k/v biases only",
                   (False, True): "out_proj bias only", (False, False): "no biases"}


# ---------------------------------------------------------------- helpers


def _layout(name) -> Layout:
    if name not in LAYOUT_TABLES:
        raise ValueError(f"unknown layout {name!r}; expected one of {list(LAYOUTS)}")
    return LAYOUT_TABLES[name]


def _as_numpy(x, name: str) -> np.ndarray:
    """NumPy, torch or JAX array -> NumPy, bit for bit (no dtype change)."""
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return tensor_to_numpy(x)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return np.asarray(x)
    raise TypeError(f"{name} is a {type(x).__name__}; expected a numpy, torch or jax array")


def _dims(shape: tuple[str, ...], E: int, KH: int | None = None) -> tuple[int, ...]:
    return tuple({"E": E, "3E": 3 * E, "KH": KH}[d] for d in shape)


def _expected(s: Stored, E: int | None, KH: int | None = None) -> str:
    sym = f"({', '.join(s.shape)}{',' if len(s.shape) == 1 else ''})"
    text = sym if E is None else f"{_dims(s.shape, E, KH)} = {sym}"
    return text + (" stored (in, out) as a Conv1D" if s.in_out else "")


def _present(spelling: tuple[Stored, ...], present: set, prefix: str) -> list[Stored]:
    return [s for s in spelling if prefix + s.key in present]


def _choose_spelling(layout: Layout, keys, prefix: str, source: str) -> int:
    """The spelling all of whose required keys are present; a clear KeyError when none or several are."""
    present = set(keys)
    complete = [i for i, sp in enumerate(layout.spellings) if all(s.optional or prefix + s.key in present for s in sp)]
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise ValueError(f"{source}layout {layout.name!r}: prefix {prefix!r} holds several spellings at once; pass a narrower prefix")
    # None complete: report the spelling with most keys found, naming the first missing key.
    best = max(range(len(layout.spellings)), key=lambda i: sum(prefix + s.key in present for s in layout.spellings[i]))
    required = [s for s in layout.spellings[best] if not s.optional]
    missing = [s for s in required if prefix + s.key not in present]
    s = missing[0]
    others = "" if len(layout.spellings) == 1 else f" (nor the alternative spelling(s) {[sp[0].key for sp in layout.spellings if sp is not layout.spellings[best]]})"
    raise KeyError(
        f"{source}layout {layout.name!r}: missing {prefix + s.key!r}, expected shape {_expected(s, None)}; "
        f"{len(missing)} of {len(required)} tensors missing under prefix {prefix!r}{others}"
    )


def _embed_dim(layout: Layout, spelling: int, get, prefix: str, source: str) -> int:
    stored = next(s for s in layout.spellings[spelling] if s.key == layout.e_key[spelling])
    key = prefix + stored.key
    shape = tuple(get(key).shape)
    if len(shape) != len(stored.shape):
        raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected {_expected(stored, None)}")
    return shape[-1]


def _kv_rows(layout: Layout, spelling: int, get, prefix: str, E: int, source: str) -> int | None:
    """K*H, the rows of the first "KH" tensor (k_proj.weight); None for a layout without grouped heads.

    From the tensors alone K*H must divide E (K divides N, and N*H = E); the others are
    then checked against it.
    """
    stored = next((s for s in layout.spellings[spelling] if s.shape and s.shape[0] == "KH"), None)
    if stored is None:
        return None
    key = prefix + stored.key
    shape = tuple(get(key).shape)
    if len(shape) != len(stored.shape) or not shape[0] or E % shape[0]:
        raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected {_expected(stored, None)} "
                         f"(E={E}) with K*H dividing E, as it does for K key/value heads dividing N = E/H")
    return shape[0]


def _check_heads(sd: dict, layout: Layout, num_heads: int | None, prefix: str, source: str) -> None:
    """With num_heads=N: E divisible by N, and k/v rows a whole number K of heads of H = E/N, K dividing N."""
    if num_heads is None:
        return
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    E = sd["q_proj.weight"].shape[1]
    if E % num_heads:
        raise ValueError(f"{source}layout {layout.name!r}: num_heads={num_heads} does not divide E={E}")
    H, KH = E // num_heads, sd["k_proj.weight"].shape[0]
    if KH % H or num_heads % (KH // H):
        key = next(s.key for s in layout.spellings[0] if s.parts == ("k_proj.weight",)) if layout.grouped else "k_proj.weight"
        raise ValueError(f"{source}layout {layout.name!r}: {prefix}{key} has shape {sd['k_proj.weight'].shape}, expected "
                         f"(K*H, E) = (K*{H}, {E}) with K dividing num_heads={num_heads} (H = E/N = {H})")


def _check_canonical(sd, layout: Layout, what: str) -> tuple[int, np.dtype]:
    """A canonical dict the layout can hold: (E, dtype). Classic layouts take the classic dict only.

    `what` ("model.safetensors: layout 'hf-llama' under prefix '...': ") starts every message.
    """
    if not layout.grouped:
        try:
            return check_state_dict(sd)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}{e}") from e
    if not isinstance(sd, Mapping):
        raise TypeError(f"state dict must be a mapping of name -> numpy array, got {type(sd).__name__}")
    try:
        flags = bias_flags(sd.keys())
    except ValueError as e:
        raise ValueError(f"{what}{e}") from e
    if flags not in layout.bias_sets:
        raise ValueError(f"{what}the layout holds {' or '.join(_BIAS_SET_NAMES[b] for b in layout.bias_sets)}; "
                         f"this state dict has {_BIAS_SET_NAMES[flags]} ({sorted(k for k in sd if k.endswith('.bias'))})")
    for name in sd:
        if not isinstance(sd[name], np.ndarray):
            raise TypeError(f"{what}{name} must be a numpy.ndarray, got {type(sd[name]).__name__}")
    q, k = sd.get("q_proj.weight"), sd.get("k_proj.weight")
    if q is None or q.ndim != 2 or q.shape[0] != q.shape[1]:
        raise ValueError(f"{what}q_proj.weight has shape {getattr(q, 'shape', None)}, expected (E, E): "
                         f"our modules need N*H = E (a head_dim other than E/N is not supported)")
    E = q.shape[1]
    if k is None or k.ndim != 2 or not k.shape[0] or E % k.shape[0]:
        raise ValueError(f"{what}k_proj.weight has shape {getattr(k, 'shape', None)}, expected (KH, E) with K*H dividing E={E}")
    KH = k.shape[0]
    expected = {"q_proj.weight": (E, E), "k_proj.weight": (KH, E), "v_proj.weight": (KH, E), "out_proj.weight": (E, E),
                "q_proj.bias": (E,), "k_proj.bias": (KH,), "v_proj.bias": (KH,), "out_proj.bias": (E,)}
    expected = {k: v for k, v in expected.items() if k.endswith(".weight") or k in sd}
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}state dict: missing keys {missing}, unexpected keys {extra}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{what}{name} has shape {tuple(sd[name].shape)}, expected {shape} (E={E}, K*H={KH})")
    dtypes = {name: sd[name].dtype for name in expected}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"{what}state dict mixes dtypes: {dtypes}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}unsupported dtype {q.dtype}; expected one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return E, q.dtype


# ---------------------------------------------------------------- API


def _check_finite(arr: np.ndarray, key: str, prefix: str, source: str) -> None:
    """A weight read from a file holds numbers only: a NaN or inf in it would make every output it
    reaches NaN, in the oracle as in every implementation, where nothing can be compared."""
    nan, inf = int(np.count_nonzero(np.isnan(arr))), int(np.count_nonzero(np.isinf(arr)))
    if nan or inf:
        raise ValueError(f"{source}tensor {key!r} (prefix {prefix!r}) holds {nan} NaN and {inf} inf of {arr.size} "
                         f"values: a checkpoint's weights must be finite")


def _from_getter(get, keys, layout: str, prefix: str, source: str = "", num_heads: int | None = None,
                 finite: bool = False) -> dict[str, np.ndarray]:
    """Shared by from_layout and read_layout: `get(key)` returns one tensor, `keys` are all keys.

    `source` ("model.safetensors: ") starts every error message about the tensors; `finite`: a
    tensor holding NaN/inf is a ValueError naming it (the file readers ask for it).
    """
    lay = _layout(layout)
    spelling = _choose_spelling(lay, keys, prefix, source)
    cache: dict[str, np.ndarray] = {}

    def fetch(key):  # each tensor is read once (read_layout reads from disk)
        if key not in cache:
            cache[key] = _as_numpy(get(key), key)
            if finite:
                _check_finite(cache[key], key, prefix, source)
        return cache[key]

    E = _embed_dim(lay, spelling, fetch, prefix, source)
    KH = _kv_rows(lay, spelling, fetch, prefix, E, source)
    present = set(keys)
    sd = {}
    for s in _present(lay.spellings[spelling], present, prefix):
        key = prefix + s.key
        arr = fetch(key)
        if tuple(arr.shape) != _dims(s.shape, E, KH):
            hint = " -- a (3E, E) c_attn is nn.Linear's (out, in) orientation: transposed?" if s.in_out and len(s.parts) > 1 else ""
            if lay.grouped and s.parts in (("q_proj.weight",), ("out_proj.weight",)):
                hint = " -- our modules need N*H = E: a head_dim other than E/N is not supported"
            kh = "" if KH is None else f", K*H={KH} from {prefix}{next(t.key for t in lay.spellings[spelling] if t.shape and t.shape[0] == 'KH')}"
            raise ValueError(f"{source}layout {layout!r}: {key} has shape {tuple(arr.shape)}, expected {_expected(s, E, KH)} (E={E}{kh}){hint}")
        for name, part in zip(s.parts, np.split(arr, len(s.parts), axis=-1)):
            sd[name] = np.ascontiguousarray(part.T if s.in_out else part).copy()
    # which biases; the dtypes: one of the four, the same for every tensor
    _check_canonical(sd, lay, f"{source}layout {layout!r} under prefix {prefix!r}: ")
    _check_heads(sd, lay, num_heads, prefix, source)
    return sd


def from_layout(tensors: Mapping, layout: str, *, prefix: str = "", num_heads: int | None = None) -> dict[str, np.ndarray]:
    """One attention block of a checkpoint (a mapping of names to numpy/torch/jax arrays) -> canonical.

    num_heads=N, when given, is checked against the shapes (in units of heads for
    "hf-llama"'s key/value rows); the canonical dict itself carries no N.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, got {type(tensors).__name__}")
    return _from_getter(tensors.__getitem__, tensors.keys(), layout, prefix, num_heads=num_heads)


def to_layout(sd, layout: str, *, prefix: str = "", spelling: int = 0, num_heads: int | None = None) -> dict[str, np.ndarray]:
    """Canonical -> the layout's tensors under `prefix`, as NumPy arrays.

    spelling 0 (default) is the checkpoint-file spelling; "hf-vit" spelling 1 is the
    transformers 5.x module names ({q,k,v,o}_proj), for loading into a ViTAttention.
    A bias the state dict lacks is not written ("hf-llama"); a set of biases the layout
    cannot hold (out_proj's alone for "hf-llama") is a ValueError.
    """
    lay = _layout(layout)
    if spelling not in range(len(lay.spellings)):
        raise ValueError(f"layout {layout!r} has spellings {list(range(len(lay.spellings)))}, got spelling={spelling!r}")
    _check_canonical(sd, lay, f"layout {layout!r}: ")
    _check_heads(sd, lay, num_heads, "", "")
    out = {}
    for s in lay.spellings[spelling]:
        if s.optional and not all(p in sd for p in s.parts):
            continue
        parts = [sd[p].T if s.in_out else sd[p] for p in s.parts]
        out[prefix + s.key] = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return out


def read_layout(path, layout: str, *, prefix: str = "", num_heads: int | None = None) -> dict[str, np.ndarray]:
    """Read one attention block from a .safetensors checkpoint: only its tensors are read (lazily).

    Every error names the file: a directory, a missing, truncated or pickle file, a tensor
    in a dtype other than float16/bfloat16/float32/float64 (float8 included), a tensor holding
    NaN or inf (named with the prefix), a missing key or a wrong shape. For a transformers checkpoint directory (config.json, sharded
    weights) use `read_checkpoint`.
    """
    with open_weight_file(path) as f:
        return _from_getter(f.get, f.keys, layout, prefix, source=f"{f.path}: ", num_heads=num_heads, finite=True)


# ---------------------------------------------------------------- transformers checkpoint directories


@dataclass(frozen=True)
class HFModel:
    """How one transformers model_type's config.json describes its attention layer.

    A bias flag is True/False when the architecture fixes it, or the config field that
    says it (absent = False).
    """

    layout: str
    qkv_bias: bool | str
    out_bias: bool | str
    sliding_window_field: str | None = None  # a field that, when set, turns on sliding-window attention


# Every model_type read_hf_config understands; all use rotate-half RoPE ("half") and N*H = E.
HF_MODELS: dict[str, HFModel] = {
    "llama": HFModel("hf-llama", qkv_bias="attention_bias", out_bias="attention_bias"),
    "mistral": HFModel("hf-llama", qkv_bias=False, out_bias=False, sliding_window_field="sliding_window"),
    "mixtral": HFModel("hf-llama", qkv_bias=False, out_bias=False, sliding_window_field="sliding_window"),
    "qwen2": HFModel("hf-llama", qkv_bias=True, out_bias=False, sliding_window_field="use_sliding_window"),
}

_DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _config_error(source: str, message: str) -> ValueError:
    return ValueError(f"{source}: {message}")


# The config.json fields transformers reads RoPE from, in the order it prefers them: a set (non-empty)
# rope_scaling, the 4.x spelling, replaces rope_parameters whole (PreTrainedConfig.convert_rope_params_to_dict).
_ROPE_FIELDS = ("rope_scaling", "rope_parameters")
# How each names the RoPE type: transformers 5 reads rope_type first, then type; older releases
# read type alone, so a non-default value under either spelling is a scaled RoPE to some reader.
_ROPE_TYPE_KEYS = ("rope_type", "type")


def _rope_fields(cfg: Mapping, source: str) -> dict[str, Mapping]:
    """{field: its mapping} for each RoPE field config.json sets (null and {} are unset, as for transformers)."""
    fields = {}
    for name in _ROPE_FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise _config_error(source, f"{name} = {value!r} is not a mapping")
        if value:
            fields[name] = value
    return fields


def _refuse_scaling(name: str, params: Mapping, source: str) -> None:
    """Anything in one RoPE field but the default, unscaled, whole-head RoPE is refused by name."""
    if any(isinstance(v, Mapping) for v in params.values()):
        raise NotImplementedError(f"{source}: {name} nested per layer type ({sorted(params)}) are not supported: "
                                  f"every layer here has one RoPE")
    for key in _ROPE_TYPE_KEYS:
        if key in params and params[key] != "default":
            raise NotImplementedError(f"{source}: rope_type {params[key]!r} ({name}.{key}, in {name} = {dict(params)}) is "
                                      f"not supported: our modules implement the default, unscaled RoPE only")


def _rope_theta(cfg: Mapping, source: str) -> float:
    """rope_theta as transformers reads it, from rope_scaling (when set), else rope_parameters, else the
    top-level rope_theta (transformers 4.x), else 10000. A scaled, partial or per-layer RoPE in any field,
    under either type spelling, is refused by name; so is a rope_theta in rope_parameters that a set
    rope_scaling hides (transformers would not use it)."""
    fields = _rope_fields(cfg, source)
    for name, params in fields.items():
        _refuse_scaling(name, params, source)
    for where, holder in [*fields.items(), ("config.json's top level", cfg)]:
        factor = holder.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            raise NotImplementedError(f"{source}: partial_rotary_factor={factor!r} ({where}) is not supported: our "
                                      f"modules rotate the whole head")
    read = next(iter(fields.values()), {})  # the field transformers reads
    theta = read.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))
    hidden = fields.get("rope_parameters", {}).get("rope_theta") if "rope_scaling" in fields else None
    if hidden is not None and hidden != theta:
        raise _config_error(source, f"rope_parameters.rope_theta = {hidden!r}, but rope_scaling is set too and "
                                    f"transformers reads it instead (rope_theta {theta!r}): say one rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise _config_error(source, f"rope_theta = {theta!r} is not a number")
    return float(theta)


def _int_field(cfg: Mapping, field: str, source: str, default=None) -> int:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _config_error(source, f"{field} = {value!r} is not a positive integer")
    return value


def _config_json(source) -> tuple[Mapping, str]:
    """(parsed config.json, where it came from) of a directory, a file path or a dict."""
    if isinstance(source, Mapping):
        return source, "config"
    path = file_path(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if (problem := path_problem(path)) is not None:
        raise path_error(path, problem, "no such config file (a transformers checkpoint directory holds config.json)")
    cfg = read_json(path)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
    return cfg, path


def _hf_model(cfg: Mapping, where: str) -> HFModel:
    model_type = cfg.get("model_type")
    if model_type not in HF_MODELS:
        raise _config_error(where, f"model_type {model_type!r} is not one of {sorted(HF_MODELS)}; for another model "
                                   f"build the mha_spec.AttentionConfig yourself")
    return HF_MODELS[model_type]


def read_hf_config(source, *, masked_rows: str = "nan", ignore_sliding_window: bool = False):
    """A transformers config.json (a directory holding one, its path, or the parsed dict) ->
    mha_spec.AttentionConfig.

    Read: model_type (one of HF_MODELS), hidden_size, num_attention_heads,
    num_key_value_heads (absent: num_attention_heads), head_dim (absent/null or E/N;
    anything else is a ValueError: our modules need N*H = E), the RoPE base (transformers
    5's rope_parameters.rope_theta or 4.x's rope_theta; absent: 10000), the biases (Llama's
    attention_bias; Qwen2's q/k/v biases; none for Mistral). RoPE is "half" (transformers'
    rotate_half). Refused by name: scaled RoPE (rope_type other than "default":
    llama3, linear, dynamic, yarn, ...), partial_rotary_factor != 1, RoPE nested per layer
    type, and sliding-window attention (Mistral's sliding_window, Qwen2's
    use_sliding_window) unless ignore_sliding_window=True -- our modules attend to every
    key, which equals a sliding window only while no query sees more keys than the window.
    masked_rows is not in config.json: it is the caller's choice, passed through.
    """
    cfg, where = _config_json(source)
    return _attention_config(cfg, where, masked_rows, ignore_sliding_window)


def _attention_config(cfg: Mapping, where: str, masked_rows: str, ignore_sliding_window: bool):
    from mha_spec import AttentionConfig

    model = _hf_model(cfg, where)
    E = _int_field(cfg, "hidden_size", where)
    N = _int_field(cfg, "num_attention_heads", where)
    K = cfg.get("num_key_value_heads")
    K = N if K is None else _int_field(cfg, "num_key_value_heads", where)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (E % N or head_dim != E // N):
        raise _config_error(where, f"head_dim = {head_dim!r} but hidden_size / num_attention_heads = {E} / {N}: our "
                                   f"modules need num_attention_heads * head_dim = hidden_size")
    if model.sliding_window_field is not None and cfg.get(model.sliding_window_field) not in (None, False) \
            and not ignore_sliding_window:
        window = cfg.get("sliding_window")
        raise NotImplementedError(
            f"{where}: {model.sliding_window_field} = {cfg.get(model.sliding_window_field)!r} turns on sliding-window "
            f"attention (window {window!r}), which our modules do not implement; it equals full attention while no "
            f"query sees more than the window's keys: read_hf_config(..., ignore_sliding_window=True) to check it there")
    flags = {}
    for name in ("qkv_bias", "out_bias"):
        rule = getattr(model, name)
        flags[name] = rule if isinstance(rule, bool) else cfg.get(rule, False)
        if not isinstance(flags[name], bool):
            raise _config_error(where, f"{rule} = {flags[name]!r} is not a bool")
    try:
        return AttentionConfig(E, N, num_kv_heads=K if K != N else None, rope="half", rope_theta=_rope_theta(cfg, where),
                               masked_rows=masked_rows, **flags)
    except (TypeError, ValueError) as e:
        raise _config_error(where, str(e)) from e


def read_checkpoint(path, layout: str = "hf-llama", *, prefix: str = "", config=None, masked_rows: str = "nan",
                    ignore_sliding_window: bool = False):
    """One attention block of a checkpoint -> (canonical state dict, mha_spec.AttentionConfig).

    `path` is a transformers checkpoint directory (config.json with model.safetensors, or
    with model.safetensors.index.json and its shards) or one .safetensors file. With
    config=None the layer's description comes from the directory's config.json
    (`read_hf_config`; its layout must be `layout`); a single file carries none, so it
    then needs config=. A given config is used as it is (config.json is not read) and
    checked against the weights; masked_rows and ignore_sliding_window go to
    `read_hf_config` when config.json is read. Only the block's tensors are read.
    """
    from mha_spec import AttentionConfig

    path = file_path(path)
    if config is not None and not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be an mha_spec.AttentionConfig, got {type(config).__name__}")
    _layout(layout)
    if (problem := path_problem(path)) is not None:
        raise path_error(path, problem, "no such checkpoint directory or weight file")
    if os.path.isdir(path):
        if config is None:
            cfg, where = _config_json(path)
            if _hf_model(cfg, where).layout != layout:
                raise ValueError(f"{where}: model_type {cfg['model_type']!r} uses layout "
                                 f"{_hf_model(cfg, where).layout!r}, not {layout!r}")
            config = _attention_config(cfg, where, masked_rows, ignore_sliding_window)
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.lexists(single):  # lexists: a link that leads nowhere is named by the reader, not skipped
            sd = read_layout(single, layout, prefix=prefix, num_heads=config.num_heads)
        elif os.path.lexists(index):
            sd = _read_sharded(path, index, layout, prefix, config.num_heads)
        else:
            found = sorted(os.listdir(path))
            raise FileNotFoundError(f"{path}: no model.safetensors nor model.safetensors.index.json (found {found}); "
                                    f"weight files are read as safetensors only")
    else:
        if config is None:
            raise TypeError(f"{path} is a single weight file, which does not say the layer's heads or RoPE: pass "
                            f"config=mha_spec.AttentionConfig(...), or the checkpoint directory holding config.json")
        sd = read_layout(path, layout, prefix=prefix, num_heads=config.num_heads)
    from parity.canonical import check_variant_state_dict

    try:
        cfg, _ = check_variant_state_dict(sd, config.num_heads, config.num_kv_heads)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path} under prefix {prefix!r} does not fit {config}: {e}") from e
    if (cfg.qkv_bias, cfg.out_bias, cfg.embed_dim) != (config.qkv_bias, config.out_bias, config.embed_dim):
        raise ValueError(f"{path} under prefix {prefix!r}: the weights have embed_dim={cfg.embed_dim}, "
                         f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}; the config says embed_dim={config.embed_dim}, "
                         f"qkv_bias={config.qkv_bias}, out_bias={config.out_bias}")
    return sd, config


def _read_sharded(directory, index_path, layout, prefix, num_heads):
    """The block's tensors from the shards model.safetensors.index.json names (each shard opened once)."""
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if weight_map is None:
        raise ValueError(f"{index_path} is not a safetensors index (a JSON object with a 'weight_map')")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"{index_path}: 'weight_map' is not a mapping")
    with ExitStack() as stack:
        opened = {}

        def get(key):
            shard = weight_map[key]
            if os.path.basename(shard) != shard:
                raise ValueError(f"{index_path}: shard {shard!r} for {key!r} is not a file name in {directory}")
            if shard not in opened:
                opened[shard] = stack.enter_context(open_weight_file(os.path.join(directory, shard)))
            return opened[shard].get(key)

        return _from_getter(get, weight_map.keys(), layout, prefix, source=f"{index_path}: ", num_heads=num_heads,
                            finite=True)
