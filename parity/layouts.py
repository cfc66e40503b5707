"""State-dict layouts of real checkpoints: one attention block of a Hugging Face model.

Each layout is a total, explicit table (penzai style): every tensor the block owns,
its name relative to a prefix, its shape in units of E, which canonical tensors it
holds and how it is stored. Nothing is guessed from a suffix or an ndim; every shape
is asserted. Every key under the prefix is accounted for (`account`): the table's weights
are read; a buffer it names (Llama's rotary_emb.inv_freq, GPT-2's causal mask) is read and
checked against the layer; a tensor of the block that takes no part in attention (BERT's
output.LayerNorm) is named as such; anything else is an error naming the tensor and the
feature it implies (q_norm/k_norm QK-norm, sinks attention sinks, qkv_proj fused
projections, ...), since checking the rest would judge another attention than the
checkpoint's. Keys outside the prefix (the MLP, the rest of the model) are not looked at.
Dtypes pass through unchanged (bfloat16 included).

    layout    prefix (one block)            tensors (relative to the prefix)
    hf-bert   encoder.layer.{i}.attention.   self.{query,key,value}.{weight,bias}, output.dense.{weight,bias}
    hf-vit    encoder.layer.{i}.attention.   attention.{query,key,value}.*, output.dense.*   (file spelling)
              layers.{i}.attention.          {q,k,v,o}_proj.*                                 (transformers 5.x modules)
    hf-gpt2   h.{i}.attn.                    c_attn.weight (E, 3E) stored (in, out), columns q | k | v;
                                             c_attn.bias (3E,); c_proj.weight (E, E) (in, out); c_proj.bias (E,)
    hf-llama  model.layers.{i}.self_attn.    q_proj.weight (NH, E), k_proj/v_proj.weight (KH, E), o_proj.weight (E, NH);
              (Llama, Mistral, Qwen2,        biases: none (Llama, Mistral), q/k/v (Qwen2), all four (attention_bias);
              Qwen3, Gemma 2/3, OLMo 2,      q_norm.weight/k_norm.weight (H,) per head or (NH,)/(KH,) flat (OLMo 2),
              GPT-OSS)                       sinks (N,): read only for a layer described with QK-norm / sinks
    hf-phi3   model.layers.{i}.self_attn.    qkv_proj.weight (NH + 2KH, E) rows q | k | v; o_proj.weight (E, NH); no biases
    hf-gpt-neox gpt_neox.layers.{i}.attention. query_key_value.weight (3E, E) viewed (N, 3, H): per head q, k, v;
                                             .bias (3E,); dense.weight/bias (E, E)/(E,) (biases: both or neither)
    hf-falcon transformer.h.{i}.self_attention. query_key_value.weight (NH + 2KH, E) viewed (K, N/K + 2, H): per
                                             key/value head its query heads, its k, its v (multi_query: K = 1;
                                             classic: K = N); dense (E, E); biases both or neither; needs num_heads

KH is K*H, the key/value heads' rows, NH is N*H, the query heads' (E unless the layer
has a head_dim of its own, read off o_proj's columns): a file does not say N, so from the
tensors alone k/v rows are checked to agree and to divide NH; `num_heads=N` checks them
in units of heads (H = NH/N, K = KH/H dividing N). A grouped layer's canonical dict has k/v weights
(KH, E) and only the biases it has (parity.canonical.bias_flags); to_torch(sd, N,
num_kv_heads=K) checks it again.

The canonical state dict is parity.canonical's: q_proj/k_proj/v_proj/out_proj
.weight (out, in) and .bias, as NumPy arrays. parity.convert re-exports this module's
API; this module never imports parity.convert.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mha_spec import is_int
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
    # In units (`_UNITS`): "E", "3E", "KH" (key/value heads' rows, K*H), "NH" (query heads' rows, N*H), "N"
    # (query heads), "H|NH" / "H|KH" (a QK-norm weight: one head's H, or the whole projection's rows).
    shape: tuple[str, ...]
    parts: tuple[str, ...]  # canonical keys, in order along the last axis
    in_out: bool = False
    optional: bool = False
    # A tensor of a layer feature ("qk_norm", "sinks") the tensors alone cannot describe (a norm's epsilon and
    # offset are config.json's): read only when the caller says the layer has it; otherwise it is unread.
    feature: str | None = None
    # q, k and v fused along the ROWS (axis 0) of one (out, in) tensor, a `FUSIONS` entry: "rows" (Phi-3's
    # qkv_proj: all of q, then k, then v) or "grouped" (per key/value head: that head's N/K query heads, its k,
    # its v -- GPT-NeoX and Falcon; `fuse_qkv`). None: the parts are concatenated along the last axis as above.
    fused: str | None = None


_ALL_BIASES = ((True, True),)  # (qkv_bias, out_bias) pairs


@dataclass(frozen=True)
class Layout:
    name: str
    spellings: tuple[tuple[Stored, ...], ...]  # the first is the one written
    e_key: tuple[str, ...]  # per spelling: the tensor whose last axis is E
    bias_sets: tuple[tuple[bool, bool], ...] = _ALL_BIASES  # the (qkv_bias, out_bias) a block may have
    # Buffers a checkpoint may hold beside the weights: read and checked against the layer (`_check_buffer`),
    # never taken as weights.
    buffers: tuple[str, ...] = ()
    # (key, why): tensors the block's module holds that take no part in attention (BERT's residual LayerNorm);
    # named, never read.
    not_attention: tuple[tuple[str, str], ...] = ()

    def keys(self, spelling: int = 0) -> tuple[str, ...]:
        return tuple(s.key for s in self.spellings[spelling])

    @property
    def grouped(self) -> bool:
        """Whether k/v may have fewer rows than q (shape "KH"), or q/k/v are fused along rows (`Stored.fused`):
        then the canonical dict is checked as a layer of N*H, K*H rows with the biases it has."""
        return any("KH" in s.shape or s.fused for sp in self.spellings for s in sp)

    @property
    def fused(self) -> Stored | None:
        """The tensor holding q, k and v fused along its rows (its weight), None for a layout without one."""
        return next((s for s in self.spellings[0] if s.fused and len(s.shape) == 2), None)


def _linear(key: str, proj: str, rows: str = "E", optional_bias: bool = False, cols: str = "E") -> tuple[Stored, Stored]:
    """An nn.Linear(cols, rows) named `key`: weight (out, in) = canonical, bias (rows,)."""
    return (Stored(f"{key}.weight", (rows, cols), (f"{proj}.weight",)),
            Stored(f"{key}.bias", (rows,), (f"{proj}.bias",), optional=optional_bias))


def _unfused(q: str, k: str, v: str, o: str) -> tuple[Stored, ...]:
    return (*_linear(q, "q_proj"), *_linear(k, "k_proj"), *_linear(v, "v_proj"), *_linear(o, "out_proj"))


_QKV_W = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_QKV_B = ("q_proj.bias", "k_proj.bias", "v_proj.bias")

_BERT_NORM = ("BertSelfOutput's LayerNorm of output.dense's result plus the block's input: the residual's norm, "
              "applied after attention")

LAYOUT_TABLES: dict[str, Layout] = {
    "hf-bert": Layout(
        "hf-bert",
        (_unfused("self.query", "self.key", "self.value", "output.dense"),),
        ("output.dense.bias",),
        not_attention=tuple((f"output.LayerNorm.{p}", _BERT_NORM) for p in ("weight", "bias")),
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
        buffers=("bias", "masked_bias"),  # GPT2Attention's causal mask and its fill, persistent before transformers 4.2x
    ),
    "hf-llama": Layout(
        "hf-llama",
        (
            (
                *_linear("q_proj", "q_proj", "NH", optional_bias=True),
                *_linear("k_proj", "k_proj", "KH", optional_bias=True),
                *_linear("v_proj", "v_proj", "KH", optional_bias=True),
                *_linear("o_proj", "out_proj", optional_bias=True, cols="NH"),
                # Qwen3, Gemma 3 (per head) and OLMo 2 (over the whole projection): QK-norm; GPT-OSS: sinks.
                Stored("q_norm.weight", ("H|NH",), ("q_norm.weight",), optional=True, feature="qk_norm"),
                Stored("k_norm.weight", ("H|KH",), ("k_norm.weight",), optional=True, feature="qk_norm"),
                Stored("sinks", ("N",), ("sinks",), optional=True, feature="sinks"),
            ),
        ),
        ("q_proj.weight",),
        # Llama/Mistral: none; Qwen2: q/k/v; Llama with attention_bias=True: all four.
        bias_sets=((False, False), (True, False), (True, True)),
        buffers=("rotary_emb.inv_freq",),  # persistent in Llama checkpoints written before transformers 4.31
    ),
    # Phi-3: qkv_proj (N*H + 2*K*H, E) holds all of q's rows, then k's, then v's (Phi3Attention slices them so);
    # no biases; o_proj (E, N*H), head_dim of its own allowed.
    "hf-phi3": Layout(
        "hf-phi3",
        ((Stored("qkv_proj.weight", ("QKV", "E"), _QKV_W, fused="rows"),
          Stored("o_proj.weight", ("E", "NH"), ("out_proj.weight",))),),
        ("qkv_proj.weight",),
        bias_sets=((False, False),),
    ),
    # GPT-NeoX (Pythia): query_key_value (3E, E) viewed (N, 3, H), each head's q, k, v in turn (GPTNeoXAttention's
    # view(..., N, 3H).chunk(3)): the grouped fusion with K = N ("3E": GPT-NeoX has no grouped heads); biases on
    # both projections or neither (attention_bias). Checkpoints before transformers 4.3x keep the causal mask, its
    # fill and RoPE's inv_freq as buffers beside the weights.
    "hf-gpt-neox": Layout(
        "hf-gpt-neox",
        ((Stored("query_key_value.weight", ("3E", "E"), _QKV_W, fused="grouped"),
          Stored("query_key_value.bias", ("3E",), _QKV_B, optional=True, fused="grouped"),
          *_linear("dense", "out_proj", optional_bias=True)),),
        ("query_key_value.weight",),
        bias_sets=((False, False), (True, True)),
        buffers=("rotary_emb.inv_freq", "bias", "masked_bias"),
    ),
    # Falcon: one layout for its three fusions, because they are one formula. FalconAttention._split_heads views
    # query_key_value's rows (K, N/K + 2, H) with new_decoder_architecture (each key/value head's group of query
    # heads, then its k, then its v); multi_query's [Q (N*H) | K (H) | V (H)] is that view with K = 1, and the
    # classic per-head (N, 3, H) is it with K = N. The rows, (N + 2K) * H, and num_heads= (which the split needs
    # anyway) say K, so a layout name per variant would only be a second way to say what the shapes say -- and a
    # way to name the wrong one. dense (E, E): Falcon's head_dim is E/N. Biases on both or neither (config's bias).
    "hf-falcon": Layout(
        "hf-falcon",
        ((Stored("query_key_value.weight", ("QKV", "E"), _QKV_W, fused="grouped"),
          Stored("query_key_value.bias", ("QKV",), _QKV_B, optional=True, fused="grouped"),
          *_linear("dense", "out_proj", optional_bias=True)),),
        ("query_key_value.weight",),
        bias_sets=((False, False), (True, True)),
    ),
}
LAYOUTS = tuple(LAYOUT_TABLES)
FUSIONS = ("rows", "grouped")
"""How a layout fuses q, k and v along one tensor's rows (`Stored.fused`, `fuse_qkv`)."""

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


def _dims(shape: tuple[str, ...], units: Mapping) -> tuple[int, ...]:
    """A Stored shape in numbers; `units` maps each unit ("E", "KH", ...) the block has to its size."""
    return tuple(units[d] for d in shape)


def _expected(s: Stored, units: Mapping | None) -> str:
    shape = tuple("N*H + 2*K*H" if d == "QKV" else d for d in s.shape)
    sym = f"({', '.join(shape)}{',' if len(shape) == 1 else ''})"
    text = sym if units is None else f"{_dims(s.shape, units)} = {sym}"
    fused = {"rows": ", rows q | k | v", "grouped": ", rows per key/value head: its N/K query heads, its k, its v"}
    return text + (" stored (in, out) as a Conv1D" if s.in_out else "") + fused.get(s.fused, "")


_HEAD_UNITS = ("N", "H|NH", "H|KH")  # the units a block's sinks and QK-norm weights say (`_head_units`)


def _present(spelling: tuple[Stored, ...], present: set, prefix: str) -> list[Stored]:
    return [s for s in spelling if prefix + s.key in present]


def _layer_features(qk_norm: str | None, sinks: bool) -> tuple[str, ...]:
    """The layer features whose tensors a read takes (`Stored.feature`), from the layer's qk_norm and sinks."""
    if qk_norm not in (None, "head", "flat"):
        raise ValueError(f"qk_norm must be None, 'head' or 'flat', got {qk_norm!r}")
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks must be a bool, got {type(sinks).__name__}")
    return (*(("qk_norm",) if qk_norm else ()), *(("sinks",) if sinks else ()))


def _require_features(layout: Layout, spelling: int, keys, prefix: str, source: str, features) -> None:
    """The tensors of each feature the caller says the layer has must be there (a KeyError naming the first)."""
    present = set(keys)
    for s in layout.spellings[spelling]:
        if s.feature in features and prefix + s.key not in present:
            raise KeyError(f"{source}layout {layout.name!r}: missing {prefix + s.key!r}, expected shape "
                           f"{_expected(s, None)}: the layer is described with {s.feature} (config.json's model, or {s.feature}=)")


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


def _query_rows(layout: Layout, spelling: int, get, prefix: str, E: int, source: str) -> int:
    """N*H, the columns of the output projection (o_proj.weight, stored (E, NH)); E for a layout whose
    heads always span E. q_proj's rows are then checked against it."""
    stored = next((s for s in layout.spellings[spelling] if s.shape and s.shape[-1] == "NH" and len(s.shape) == 2), None)
    if stored is None:
        return E
    key = prefix + stored.key
    shape = tuple(get(key).shape)
    if len(shape) != 2 or not shape[1]:
        raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected {_expected(stored, None)} "
                         f"(E={E}) with N*H, the query heads' width, its columns")
    return shape[1]


def _kv_rows(layout: Layout, spelling: int, get, prefix: str, E: int, source: str, NH: int | None = None) -> int | None:
    """K*H, the rows of the first "KH" tensor (k_proj.weight); None for a layout without grouped heads.

    From the tensors alone K*H must divide N*H (K divides N; N*H = E unless the layer has a
    head_dim of its own); the others are then checked against it.
    """
    stored = next((s for s in layout.spellings[spelling] if s.shape and s.shape[0] == "KH"), None)
    if stored is None:
        return None
    NH = E if NH is None else NH
    key = prefix + stored.key
    shape = tuple(get(key).shape)
    if len(shape) != len(stored.shape) or not shape[0] or NH % shape[0]:
        if NH == E:
            raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected {_expected(stored, None)} "
                             f"(E={E}) with K*H dividing E, as it does for K key/value heads dividing N = E/H")
        raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected {_expected(stored, None)} "
                         f"(E={E}) with K*H dividing N*H={NH} (the output projection's columns), as it does for K "
                         f"key/value heads dividing N")
    return shape[0]


def fused_heads(layout: str, NH: int, KH: int, num_heads: int | None, what: str = "") -> tuple[int, int, int] | None:
    """(N, K, H) of a layout's fused q/k/v tensor (`Stored.fused`) for a layer of N*H = NH query rows and K*H = KH
    key/value rows; None for a "rows" fusion without num_heads (its split needs no heads). The "grouped" fusion
    interleaves per key/value head, so where its rows split depends on N and H, which the tensors do not say:
    it needs num_heads=N. A ValueError (starting with `what`) names what does not fit."""
    lay = _layout(layout)
    stored = lay.fused
    if stored is None:
        raise ValueError(f"layout {layout!r} fuses no q/k/v tensor")
    if num_heads is None:
        if stored.fused == "grouped":
            raise ValueError(f"{what}layout {layout!r}: {stored.key} interleaves q, k and v per key/value head "
                             f"(viewed (K, N/K + 2, H)), so splitting it needs num_heads= (config.json's "
                             f"num_attention_heads); the tensors do not say N")
        return None
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"{what}num_heads must be a positive int, got {num_heads!r}")
    if NH % num_heads:
        raise ValueError(f"{what}layout {layout!r}: num_heads={num_heads} does not divide N*H={NH}, the query rows "
                         f"of {stored.key}")
    H = NH // num_heads
    if KH % H or num_heads % (KH // H):
        raise ValueError(f"{what}layout {layout!r}: {stored.key} has K*H={KH} key/value rows, not K heads of "
                         f"H = N*H/N = {H} with K dividing num_heads={num_heads}")
    if "3E" in stored.shape and KH != NH:
        raise ValueError(f"{what}layout {layout!r} has no grouped heads: {stored.key} holds (N, 3, H), so K must be "
                         f"N={num_heads}, got K={KH // H}")
    return num_heads, KH // H, H


def fuse_qkv(parts, fused: str, heads: tuple[int, int, int] | None, concat):
    """q (N*H, ...), k, v (K*H, ...) -> the fused tensor, rows ((N + 2K)*H, ...), bit for bit (a permutation of the
    rows). `fused`: a `FUSIONS` entry; heads (N, K, H) (`fused_heads`), needed by "grouped"; concat(arrays, axis):
    the framework's concatenation (np.concatenate; torch.cat and jnp.concatenate serve the contract, so autodiff
    carries gradients back through it: its transpose is the split)."""
    q, k, v = parts
    if fused == "rows":
        return concat([q, k, v], 0)
    N, K, H = heads
    rest = tuple(q.shape[1:])
    groups = concat([q.reshape((K, N // K, H) + rest), k.reshape((K, 1, H) + rest), v.reshape((K, 1, H) + rest)], 1)
    return groups.reshape(((N + 2 * K) * H,) + rest)  # (K, N/K + 2, H, ...) -> rows


def split_qkv(arr, fused: str, NH: int, KH: int, heads: tuple[int, int, int] | None):
    """The inverse of `fuse_qkv`: the fused rows -> (q (N*H, ...), k (K*H, ...), v (K*H, ...)), views of `arr`."""
    if fused == "rows":
        return arr[:NH], arr[NH:NH + KH], arr[NH + KH:]
    N, K, H = heads
    rest = tuple(arr.shape[1:])
    groups = arr.reshape((K, N // K + 2, H) + rest)  # each key/value head's query heads, its k, its v
    return (groups[:, :-2].reshape((N * H,) + rest), groups[:, -2].reshape((K * H,) + rest),
            groups[:, -1].reshape((K * H,) + rest))


def _fused_kv_rows(lay: Layout, spelling: int, get, prefix: str, E: int, NH: int, source: str) -> int | None:
    """K*H of a layout fusing q/k/v along rows, from its weight's rows R = N*H + 2*K*H (N*H the output
    projection's columns; "3E" layouts: K*H = N*H, the rows then checked to be 3E); None for another layout."""
    stored = next((s for s in lay.spellings[spelling] if s.fused and len(s.shape) == 2), None)
    if stored is None:
        return None
    if "3E" in stored.shape:
        return NH
    key = prefix + stored.key
    shape = tuple(get(key).shape)
    rows = shape[0] if len(shape) == 2 else 0
    if rows <= NH or (rows - NH) % 2 or NH % ((rows - NH) // 2):
        raise ValueError(f"{source}layout {lay.name!r}: {key} has shape {shape}, expected (N*H + 2*K*H, E) = "
                         f"({NH} + 2*K*H, {E}): the N*H={NH} query rows (the output projection's columns), then K*H "
                         f"rows for each of k and v, K*H dividing N*H")
    return (rows - NH) // 2


def _head_units(get, keys: Mapping, NH: int, KH: int, what: str, qk_norm: str | None = None) -> dict:
    """{"N": ..., "H|NH": ..., "H|KH": ...} as a block's sinks (N,) and q_norm weight say them; `keys` maps each
    unit to the key of the tensor in it, for those the block holds. A file does not say N: sinks give it; a
    q_norm weight is one head's H (dividing N*H and K*H; k_norm's then too) or the whole projection's N*H
    (k_norm's then K*H, OLMo 2's); qk_norm, when the layer says which, decides. `what` starts every message."""
    units = {}
    if "N" in keys:
        shape = tuple(getattr(get(keys["N"]), "shape", ()))
        if len(shape) != 1 or not shape[0] or NH % shape[0] or KH % (NH // shape[0]):
            raise ValueError(f"{what}{keys['N']} has shape {shape}, expected (N,): one sink logit per query head, "
                             f"N heads of H dividing N*H={NH} and K*H={KH}")
        units["N"] = shape[0]
    if "H|NH" in keys:
        shape = tuple(getattr(get(keys["H|NH"]), "shape", ()))
        q = shape[0] if len(shape) == 1 else 0
        heads = f", H = N*H/N = {NH // units['N']} for the N={units['N']} sinks" if "N" in units else ""
        if (qk_norm == "head" and q == NH and KH != NH) or (qk_norm == "flat" and q != NH):
            want = f"(H,) for qk_norm='head' (a norm over each head, H dividing N*H={NH} and K*H={KH}{heads})" \
                if qk_norm == "head" else f"(N*H,) = ({NH},) for qk_norm='flat' (a norm over the whole q projection)"
            raise ValueError(f"{what}{keys['H|NH']} has shape {shape}, expected {want}")
        if not q or (q != NH and (NH % q or KH % q or ("N" in units and q != NH // units["N"]))):
            raise ValueError(f"{what}{keys['H|NH']} has shape {shape}, expected (H,) for a norm over each head (H "
                             f"dividing N*H={NH} and K*H={KH}{heads}) or (N*H,) = ({NH},) for one over the whole "
                             f"q projection")
        units["H|NH"], units["H|KH"] = q, KH if q == NH else q
    elif "H|KH" in keys:  # without q_norm's weight: its own length (the missing q_norm is named after)
        shape = tuple(getattr(get(keys["H|KH"]), "shape", ()))
        units["H|KH"] = shape[0] if len(shape) == 1 else 0
    return units


def _stored_key(layout: Layout, part: str) -> str:
    """The layout's name (first spelling) of the tensor holding canonical `part` alone, or of the fused tensor
    holding it among q, k and v."""
    fused = next((f"{s.key} (its {part.split('_')[0]} rows)" for s in layout.spellings[0] if s.fused and part in s.parts),
                 part)
    return next((s.key for s in layout.spellings[0] if s.parts == (part,)), fused)


def _check_heads(sd: dict, layout: Layout, num_heads: int | None, prefix: str, source: str) -> None:
    """With num_heads=N: N*H (q_proj's rows; E for a classic layer) divisible by N, k/v rows a whole number K of
    heads of H = N*H/N, K dividing N; sinks (N,); a q_norm weight one head's (H,) or the projection's (N*H,)."""
    if num_heads is None:
        return
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    NH, E = sd["q_proj.weight"].shape
    if NH % num_heads:
        said = f"E={E}" if NH == E else f"N*H={NH} (the rows of {prefix}{_stored_key(layout, 'q_proj.weight')})"
        raise ValueError(f"{source}layout {layout.name!r}: num_heads={num_heads} does not divide {said}")
    H, KH = NH // num_heads, sd["k_proj.weight"].shape[0]
    if KH % H or num_heads % (KH // H):
        key = _stored_key(layout, "k_proj.weight") if layout.grouped else "k_proj.weight"
        raise ValueError(f"{source}layout {layout.name!r}: {prefix}{key} has shape {sd['k_proj.weight'].shape}, expected "
                         f"(K*H, E) = (K*{H}, {E}) with K dividing num_heads={num_heads} (H = {'E' if NH == E else 'N*H'}/N = {H})")
    if "sinks" in sd and tuple(sd["sinks"].shape) != (num_heads,):
        raise ValueError(f"{source}layout {layout.name!r}: {prefix}{_stored_key(layout, 'sinks')} has shape "
                         f"{tuple(sd['sinks'].shape)}, expected (N,) = ({num_heads},): one logit per query head")
    if "q_norm.weight" in sd and tuple(sd["q_norm.weight"].shape) not in ((H,), (NH,)):
        raise ValueError(f"{source}layout {layout.name!r}: {prefix}{_stored_key(layout, 'q_norm.weight')} has shape "
                         f"{tuple(sd['q_norm.weight'].shape)}, expected (H,) = ({H},) per head or (N*H,) = ({NH},) "
                         f"over the whole projection, for num_heads={num_heads}")


def _check_norm_kind(sd: dict, layout: Layout, qk_norm: str | None, num_heads: int | None, prefix: str,
                     source: str) -> None:
    """The QK-norm weights read are the kind the layer says: "flat" (N*H,) / (K*H,), "head" (H,) both."""
    if qk_norm is None:
        return
    NH, q = sd["q_proj.weight"].shape[0], tuple(sd["q_norm.weight"].shape)
    H = NH // num_heads if num_heads else None
    want = (NH,) if qk_norm == "flat" else (H,) if H else tuple(sd["k_norm.weight"].shape)
    if q != want:
        size = "N*H" if qk_norm == "flat" else "H"
        raise ValueError(f"{source}layout {layout.name!r}: {prefix}{_stored_key(layout, 'q_norm.weight')} has shape "
                         f"{q}, expected ({size},) = {want} for qk_norm={qk_norm!r} (a norm over "
                         f"{'the whole projection' if qk_norm == 'flat' else 'each head'})")


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
    if q is None or q.ndim != 2 or not q.shape[0]:
        raise ValueError(f"{what}q_proj.weight has shape {getattr(q, 'shape', None)}, expected (N*H, E) "
                         f"(N*H = E unless the layer has a head_dim of its own)")
    NH, E = q.shape
    if k is None or k.ndim != 2 or not k.shape[0] or NH % k.shape[0]:
        raise ValueError(f"{what}k_proj.weight has shape {getattr(k, 'shape', None)}, expected (KH, E) with K*H dividing "
                         f"{'E' if NH == E else 'N*H'}={NH}")
    KH = k.shape[0]
    expected = {"q_proj.weight": (NH, E), "k_proj.weight": (KH, E), "v_proj.weight": (KH, E), "out_proj.weight": (E, NH),
                "q_proj.bias": (NH,), "k_proj.bias": (KH,), "v_proj.bias": (KH,), "out_proj.bias": (E,)}
    expected = {k: v for k, v in expected.items() if k.endswith(".weight") or k in sd}
    expected.update(_canonical_head_shapes(sd, NH, KH, what))
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}state dict: missing keys {missing}, unexpected keys {extra}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            said = f"E={E}, K*H={KH}" if NH == E else f"E={E}, N*H={NH}, K*H={KH}"
            raise ValueError(f"{what}{name} has shape {tuple(sd[name].shape)}, expected {shape} ({said})")
    dtypes = {name: sd[name].dtype for name in expected}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"{what}state dict mixes dtypes: {dtypes}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}unsupported dtype {q.dtype}; expected one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return E, q.dtype


def _canonical_head_shapes(sd: Mapping, NH: int, KH: int, what: str) -> dict:
    """The shapes a canonical dict's sinks and QK-norm weights must have (`_head_units`): both norm weights when
    it holds either, sinks when it holds them."""
    names = {"N": "sinks", "H|NH": "q_norm.weight", "H|KH": "k_norm.weight"}
    units = _head_units(sd.__getitem__, {u: n for u, n in names.items() if n in sd}, NH, KH, what)
    out = {"sinks": (units["N"],)} if "sinks" in sd else {}
    if "q_norm.weight" in sd or "k_norm.weight" in sd:
        out.update({"q_norm.weight": (units.get("H|NH"),), "k_norm.weight": (units.get("H|KH"),)})
    return out


# ---------------------------------------------------------------- every tensor under the prefix


# What a tensor the layout does not name implies, by its module's name (any dotted component of its key but
# the last; a one-component key by itself). "{layout}" is the layout's name. The first match wins.
_IMPLIED_FEATURES = (
    (("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm", "q_ln", "k_ln"),
     "QK-norm: q and k normalised before their dot product, which layout {layout!r} reads only for a layer "
     "described with it (config.json's model: Qwen3, Gemma 3, OLMo 2)"),
    (("sinks",), "attention sinks: a learned logit per head in the softmax's denominator, which layout {layout!r} "
                 "reads only for a layer described with it (config.json's model: GPT-OSS)"),
    (("qkv_proj", "query_key_value", "c_attn", "Wqkv", "wqkv", "qkv", "W_pack", "in_proj_weight", "in_proj_bias"),
     "fused projections: q, k and v in one tensor, which layout {layout!r} does not read (layouts hf-phi3, "
     "hf-gpt-neox and hf-falcon read Phi-3's qkv_proj, GPT-NeoX's and Falcon's query_key_value)"),
    (("dense", "c_proj", "o_proj", "out_proj", "wo", "output"),
     "an output projection under a name layout {layout!r} does not read"),
    (("q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv"),
     "a q/k/v projection under a name layout {layout!r} does not read"),
    (("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_layernorm", "kv_a_layernorm"),
     "low-rank (MLA) projections, which the tool does not model"),
    (("distance_embedding",), "relative position embeddings, which the tool does not model"),
    (("rotary_emb",), "RoPE buffers, which layout {layout!r} does not check"),
    (("bias", "masked_bias"), "a mask buffer, which layout {layout!r} does not check"),
    (("LayerNorm", "layernorm", "layer_norm", "norm", "ln"), "a norm inside the block, which the tool does not model"),
)
_UNKNOWN_TENSOR = "unknown: the tool does not know what it computes"
_SHOWN = 8  # unread tensors named in a message; the rest are counted


def implied_feature(key: str, layout: str = "hf-llama") -> str:
    """What a tensor a layout does not read implies, in words, from its module's name (`key` relative to the
    prefix): `q_norm`/`k_norm` QK-norm, `sinks` attention sinks, `qkv_proj`/`query_key_value`/`c_attn` fused
    projections, ...; anything else is unknown."""
    parts = key.split(".")
    names = parts[:-1] if len(parts) > 1 else parts
    for modules, feature in _IMPLIED_FEATURES:
        if any(n in modules for n in names):
            return feature.format(layout=layout)
    return _UNKNOWN_TENSOR


@dataclass(frozen=True)
class TensorAccount:
    """Every tensor under a prefix, by what a layout does with it."""

    read: tuple[str, ...]  # the layout's weights, read into the canonical dict
    buffers: tuple[str, ...]  # buffers read and checked against the layer (RoPE's inv_freq, GPT-2's causal mask)
    not_attention: dict  # key -> why it takes no part in attention (named, not read)
    unread: dict  # key -> the feature it implies (`implied_feature`): the reason to refuse

    def describe_unread(self) -> str:
        """The unread tensors grouped by the feature each implies (the first few named, the rest counted)."""
        by_feature: dict[str, list[str]] = {}
        for key, feature in self.unread.items():
            by_feature.setdefault(feature, []).append(key)
        shown, parts = 0, []
        for feature, keys in by_feature.items():
            names = keys[:max(_SHOWN - shown, 1)]
            shown += len(names)
            more = f" and {len(keys) - len(names)} more" if len(keys) > len(names) else ""
            parts.append(f"{', '.join(repr(k) for k in names)}{more} ({feature})")
        return "; ".join(parts)


def account(keys, layout: str, prefix: str = "", features=()) -> TensorAccount:
    """Sort every key under `prefix` (every key, for prefix "") by what `layout` does with it: read (any of its
    spellings), a buffer it checks, a tensor of the block that is not attention, or unread. `features`: the
    layer features ("qk_norm", "sinks") the caller says the layer has; a feature's tensors are read only then."""
    lay = _layout(layout)
    own = {s.key for sp in lay.spellings for s in sp if s.feature is None or s.feature in features}
    outside = dict(lay.not_attention)
    read, buffers, not_attention, unread = [], [], {}, {}
    for key in sorted(k for k in keys if isinstance(k, str) and k.startswith(prefix)):
        rel = key[len(prefix):]
        if rel in own:
            read.append(key)
        elif rel in lay.buffers:
            buffers.append(key)
        elif rel in outside:
            not_attention[key] = outside[rel]
        else:
            unread[key] = implied_feature(rel, lay.name)
    return TensorAccount(tuple(read), tuple(buffers), not_attention, unread)


def unread_error(account_: TensorAccount, layout: str, prefix: str, source: str = "") -> ValueError:
    """The refusal of a block with tensors its layout does not read: judging the tensors it does read would
    judge another attention than the checkpoint's."""
    n = len(account_.unread)
    return ValueError(f"{source}layout {layout!r} does not read {n} tensor{'s' if n != 1 else ''} under prefix "
                      f"{prefix!r}: {account_.describe_unread()}. A check of the tensors it reads would judge another "
                      f"attention than the checkpoint's, so none is read")


def _close(stored: np.ndarray, expected: np.ndarray) -> bool:
    """`stored` is `expected` (float64) rounded once to the stored dtype, give or take a few of its ulps."""
    info = ml_dtypes.finfo(stored.dtype)
    gap = np.abs(stored.astype(np.float64) - expected)
    return bool(np.all(gap <= 16 * float(info.eps) * np.abs(expected) + 2 * float(info.smallest_normal) * float(info.eps)))


def _check_buffer(rel: str, arr: np.ndarray, key: str, source: str, NH: int, num_heads: int | None,
                  rope_theta: float | None, rope_dim: int | None = None, rope_scaling=None) -> None:
    """A layout's buffer (`Layout.buffers`) must say what the layer computes, else a ValueError naming it.
    NH: the query heads' width N*H (E unless the layer has a head_dim of its own)."""
    arr = np.asarray(arr)
    if rel == "rotary_emb.inv_freq":  # RoPE's inverse frequencies: scaled RoPE would show here
        if num_heads is None or rope_theta is None:
            raise ValueError(f"{source}{key} holds RoPE's inverse frequencies: give num_heads= and rope_theta= "
                             f"(config.json's) so they are checked against the layer")
        from mha_spec import rope_frequencies

        H = NH // num_heads
        R = H if rope_dim is None else rope_dim
        tables = [np.array(rope_frequencies(R, float(rope_theta), rope_scaling, long), np.float64)
                  for long in ((False, True) if rope_scaling is not None and rope_scaling.switches else (False,))]
        if arr.dtype.kind != "f" or not any(arr.shape == t.shape and _close(arr, t) for t in tables):
            expected = tables[0]
            said = "the default RoPE's 1 / rope_theta^(2i/H)" if rope_scaling is None else f"RoPE scaled {rope_scaling}"
            sizes = f"H={H}" if R == H else f"R={R} of H={H}"
            raise ValueError(f"{source}{key} ({arr.dtype}{list(arr.shape)}) is not {said} for rope_theta="
                             f"{rope_theta:g} and {sizes} (expected {expected[:3].tolist()}..., stored "
                             f"{arr.ravel()[:3].tolist()}...): a scaled RoPE or another base, which the layer would "
                             f"not compute")
    elif rel == "bias":  # GPT-2's causal mask, (1, 1, P, P) lower-triangular ones
        P = arr.shape[-1] if arr.ndim == 4 else -1
        if arr.shape != (1, 1, P, P) or not np.array_equal(arr.astype(bool), np.tril(np.ones((P, P), bool))[None, None]) \
                or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"{source}{key} {arr.dtype}{list(arr.shape)} is not GPT-2's causal mask (1, 1, P, P) "
                             f"of lower-triangular ones")
    elif rel == "masked_bias":  # the fill of masked scores in GPT-2 before transformers 4.2x: it must zero them
        if arr.size != 1 or arr.dtype.kind != "f" or not float(arr.ravel()[0]) <= -1e4:
            raise ValueError(f"{source}{key} = {arr.ravel()[:3].tolist()} is not a masked-score fill of -1e4 or "
                             f"below (GPT-2's, whose weights it zeroes)")
    else:  # pragma: no cover - a layout naming a buffer this function does not know is a bug in the tables
        raise ValueError(f"no check for buffer {rel!r}")


# ---------------------------------------------------------------- API


def _check_finite(arr: np.ndarray, key: str, prefix: str, source: str) -> None:
    """A weight read from a file holds numbers only: a NaN or inf in it would make every output it
    reaches NaN, in the oracle as in every implementation, where nothing can be compared."""
    nan, inf = int(np.count_nonzero(np.isnan(arr))), int(np.count_nonzero(np.isinf(arr)))
    if nan or inf:
        raise ValueError(f"{source}tensor {key!r} (prefix {prefix!r}) holds {nan} NaN and {inf} inf of {arr.size} "
                         f"values: a checkpoint's weights must be finite")


def _block_units(lay: Layout, spelling: int, fetch, present: set, prefix: str, source: str,
                 qk_norm: str | None) -> dict:
    """The sizes of the block's units ("E", "3E", "KH", "NH", and those of `_HEAD_UNITS` it holds), read off
    its tensors (`_embed_dim`, `_query_rows`, `_kv_rows`, `_head_units`)."""
    E = _embed_dim(lay, spelling, fetch, prefix, source)
    NH = _query_rows(lay, spelling, fetch, prefix, E, source)
    KH = _kv_rows(lay, spelling, fetch, prefix, E, source, NH)
    if KH is None:
        KH = _fused_kv_rows(lay, spelling, fetch, prefix, E, NH, source)
    held = {s.shape[0]: prefix + s.key for s in lay.spellings[spelling]
            if s.shape and s.shape[0] in _HEAD_UNITS and prefix + s.key in present}
    return {"E": E, "3E": 3 * E, "KH": KH, "NH": NH, "QKV": None if KH is None else NH + 2 * KH,
            **_head_units(fetch, held, NH, KH, f"{source}layout {lay.name!r}: ", qk_norm)}


def _shape_error(lay: Layout, spelling: int, s: Stored, arr, units: Mapping, prefix: str, source: str) -> ValueError:
    """A tensor of the block whose shape is not the one its layout's units give: named, with where each unit
    was read from and a hint at the usual mistake."""
    E, NH, KH = units["E"], units["NH"], units["KH"]
    stored = lay.spellings[spelling]
    hint = " -- a (3E, E) c_attn is nn.Linear's (out, in) orientation: transposed?" if s.in_out and len(s.parts) > 1 else ""
    if lay.grouped and s.parts in (("q_proj.weight",), ("out_proj.weight",)):
        hint = (" -- q_proj's rows and the output projection's columns are both N*H: a head_dim other than "
                "E/N shows in both")
    kv_from = next((t.key for t in stored if t.shape and t.shape[0] in ("KH", "QKV")), None)
    kh = "" if KH is None or kv_from is None else f", K*H={KH} from {prefix}{kv_from}"
    nh_from = next((t.key for t in stored if t.shape[1:] == ("NH",)), None)
    if lay.grouped and nh_from is not None and (NH != E or s.shape[0] == "NH"):
        kh += f", N*H={NH} from {prefix}{nh_from}"
    return ValueError(f"{source}layout {lay.name!r}: {prefix + s.key} has shape {tuple(arr.shape)}, expected "
                      f"{_expected(s, units)} (E={E}{kh}){hint}")


def _from_getter(get, keys, layout: str, prefix: str, source: str = "", num_heads: int | None = None,
                 finite: bool = False, rope_theta: float | None = None, get_buffer=None,
                 qk_norm: str | None = None, sinks: bool = False, rope_dim: int | None = None,
                 rope_scaling=None) -> dict[str, np.ndarray]:
    """Shared by from_layout and read_layout: `get(key)` returns one tensor, `keys` are all keys.

    `source` ("model.safetensors: ") starts every error message about the tensors; `finite`: a
    tensor holding NaN/inf is a ValueError naming it (the file readers ask for it). Every key under
    the prefix is accounted for (`account`): one the layout does not read is an error naming it and
    the feature it implies; a buffer is read with `get_buffer` (default `get`) and checked against
    the layer (num_heads and rope_theta for RoPE's inv_freq).
    """
    lay = _layout(layout)
    keys = tuple(keys)
    features = _layer_features(qk_norm, sinks)
    tensors = account(keys, layout, prefix, features)
    try:
        spelling = _choose_spelling(lay, keys, prefix, source)
        _require_features(lay, spelling, keys, prefix, source, features)
    except KeyError as e:  # the missing key first; what stands in its place, when anything does
        if tensors.unread:
            raise KeyError(f"{e.args[0]}; what is there, unread: {tensors.describe_unread()}") from None
        raise
    if tensors.unread:
        raise unread_error(tensors, layout, prefix, source)
    cache: dict[str, np.ndarray] = {}

    def fetch(key):  # each tensor is read once (read_layout reads from disk)
        if key not in cache:
            cache[key] = _as_numpy(get(key), key)
            if finite:
                _check_finite(cache[key], key, prefix, source)
        return cache[key]

    units = _block_units(lay, spelling, fetch, set(keys), prefix, source, qk_norm)
    E, NH, KH = units["E"], units["NH"], units["KH"]
    sd = {}
    for s in _present(lay.spellings[spelling], set(keys), prefix):
        key = prefix + s.key
        arr = fetch(key)
        if tuple(arr.shape) != _dims(s.shape, units):
            raise _shape_error(lay, spelling, s, arr, units, prefix, source)
        if s.fused:  # the heads are needed (and checked) only once the fused tensor's shape is known good
            heads = fused_heads(layout, NH, KH, num_heads, source)
            parts = split_qkv(arr, s.fused, NH, KH, heads)
        else:
            parts = np.split(arr, len(s.parts), axis=-1)
        for name, part in zip(s.parts, parts):
            sd[name] = np.ascontiguousarray(part.T if s.in_out else part).copy()
    # which biases; the dtypes: one of the four, the same for every tensor
    _check_canonical(sd, lay, f"{source}layout {layout!r} under prefix {prefix!r}: ")
    _check_heads(sd, lay, num_heads, prefix, source)
    _check_norm_kind(sd, lay, qk_norm, num_heads, prefix, source)
    for key in tensors.buffers:
        _check_buffer(key[len(prefix):], _as_numpy((get_buffer or get)(key), key), key, source, NH, num_heads, rope_theta,
                      rope_dim, rope_scaling)
    return sd


def from_layout(tensors: Mapping, layout: str, *, prefix: str = "", num_heads: int | None = None,
                rope_theta: float | None = None, qk_norm: str | None = None,
                sinks: bool = False, rope_dim: int | None = None, rope_scaling=None) -> dict[str, np.ndarray]:
    """One attention block of a checkpoint (a mapping of names to numpy/torch/jax arrays) -> canonical.

    num_heads=N, when given, is checked against the shapes (in units of heads for
    "hf-llama"'s key/value rows); the canonical dict itself carries no N. Every key under
    the prefix is accounted for (`account`): a tensor the layout does not read is a
    ValueError naming it and the feature it implies (`q_norm` QK-norm, `sinks` attention
    sinks, `qkv_proj` fused projections, ...), and a buffer the layout knows is checked
    (RoPE's `rotary_emb.inv_freq` against num_heads and rope_theta, which it then needs).
    qk_norm ("head"/"flat") and sinks=True say the layer has QK-norm / sinks: "hf-llama"'s
    q_norm.weight, k_norm.weight and sinks are read (and required) only then, since their
    epsilon and offset are config.json's, not the tensors'.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, got {type(tensors).__name__}")
    return _from_getter(tensors.__getitem__, tensors.keys(), layout, prefix, num_heads=num_heads, rope_theta=rope_theta,
                        qk_norm=qk_norm, sinks=sinks, rope_dim=rope_dim, rope_scaling=rope_scaling)


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
    E, _ = _check_canonical(sd, lay, f"layout {layout!r}: ")
    _check_heads(sd, lay, num_heads, "", "")
    heads = _fused_canonical(sd, lay, E, num_heads)
    out = {}
    for s in lay.spellings[spelling]:
        if s.optional and not all(p in sd for p in s.parts):
            continue
        parts = [sd[p].T if s.in_out else sd[p] for p in s.parts]
        if s.fused:
            out[prefix + s.key] = np.ascontiguousarray(fuse_qkv(parts, s.fused, heads, np.concatenate))
        else:
            out[prefix + s.key] = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return out


def _fused_canonical(sd: Mapping, lay: Layout, E: int, num_heads: int | None) -> tuple[int, int, int] | None:
    """The heads (N, K, H) a layout fusing q/k/v needs of a canonical dict (`fused_heads`; None for another
    layout, or a "rows" fusion without num_heads), and a ValueError when the dict does not fit the layout's
    units: GPT-NeoX's and Falcon's output projection is (E, E), so N*H must be E."""
    if lay.fused is None:
        return None
    NH, KH = sd["q_proj.weight"].shape[0], sd["k_proj.weight"].shape[0]
    if "NH" not in (d for s in lay.spellings[0] for d in s.shape) and NH != E:
        raise ValueError(f"layout {lay.name!r}: q_proj.weight has {NH} rows, expected E={E}: the layout's output "
                         f"projection is (E, E), so its heads span E (head_dim = E/N)")
    if "3E" in lay.fused.shape and KH != NH:
        raise ValueError(f"layout {lay.name!r}: k_proj.weight has {KH} rows, expected E={E}: {lay.fused.key} holds "
                         f"(N, 3, H), so the layout has no grouped heads (K = N)")
    return fused_heads(lay.name, NH, KH, num_heads, f"layout {lay.name!r}: ")


def read_layout(path, layout: str, *, prefix: str = "", num_heads: int | None = None,
                rope_theta: float | None = None, qk_norm: str | None = None,
                sinks: bool = False, rope_dim: int | None = None, rope_scaling=None) -> dict[str, np.ndarray]:
    """Read one attention block from a .safetensors checkpoint: only its tensors are read (lazily).

    Every error names the file: a directory, a missing, truncated or pickle file, a tensor
    in a dtype other than float16/bfloat16/float32/float64 (float8 included), a tensor holding
    NaN or inf (named with the prefix), a missing key or a wrong shape, a tensor under the
    prefix the layout does not read (named with the feature it implies, as `from_layout`
    does), a buffer that does not fit the layer. qk_norm and sinks as for `from_layout`. For a
    transformers checkpoint directory (config.json, sharded weights) use `read_checkpoint`.
    """
    with open_weight_file(path) as f:
        return _from_getter(f.get, f.keys, layout, prefix, source=f"{f.path}: ", num_heads=num_heads, finite=True,
                            rope_theta=rope_theta, get_buffer=f.get_buffer, qk_norm=qk_norm, sinks=sinks,
                            rope_dim=rope_dim, rope_scaling=rope_scaling)


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
    head_dim: bool = False  # config.json's head_dim may differ from hidden_size / num_attention_heads
    qk_norm: str | None = None  # "head" / "flat": an RMSNorm of q and k (epsilon rms_norm_eps) before RoPE
    qk_norm_offset: float = 0.0  # the norm's weight is offset + w (Gemma's 1 + w)
    query_scalar: bool = False  # scores scaled by query_pre_attn_scalar**-0.5 (Gemma), not head_dim**-0.5
    softcap: bool = False  # attn_logit_softcapping soft-caps the scores (Gemma 2, Gemma 3)
    sinks: bool = False  # a learned sink logit per head (GPT-OSS)
    # layer_types[L] says whether layer L is full or sliding_attention (window sliding_window): a layer's
    # attention depends on L, which the prefix then has to say.
    layer_types: bool = False
    bias_default: bool = False  # a bias flag's value when config.json lacks its field (GPT-NeoX: attention_bias True)
    # Its attention rotates the first R features and passes the rest (Phi-3's and GPT-NeoX's apply_rotary_pos_emb);
    # the others rotate the whole head, so a partial_rotary_factor there is refused (their cos/sin of R features
    # would not even broadcast against q's H).
    partial_rope: bool = False
    # Llama 4's text attention (`llama4_fields`): per layer, RoPE (interleaved, as apply_rotary_emb's complex
    # pairs) with the weightless L2 QK-norm, or NoPE with the query temperature; chunked or full attention.
    llama4: bool = False


_BY_LAYER = dict(head_dim=True, qkv_bias="attention_bias", out_bias="attention_bias", layer_types=True)

# Every model_type read_hf_config understands; all use rotate-half RoPE ("half").
HF_MODELS: dict[str, HFModel] = {
    "llama": HFModel("hf-llama", qkv_bias="attention_bias", out_bias="attention_bias"),
    "mistral": HFModel("hf-llama", qkv_bias=False, out_bias=False, sliding_window_field="sliding_window"),
    "mixtral": HFModel("hf-llama", qkv_bias=False, out_bias=False, sliding_window_field="sliding_window"),
    # Qwen2: layer L slides when use_sliding_window and L >= max_window_layers (Qwen2Config's layer_types rule).
    "qwen2": HFModel("hf-llama", qkv_bias=True, out_bias=False, layer_types=True),
    "qwen3": HFModel("hf-llama", **_BY_LAYER, qk_norm="head"),
    # Qwen3-MoE's attention is Qwen3's; its sliding_window applies to every layer when use_sliding_window is set.
    "qwen3_moe": HFModel("hf-llama", head_dim=True, qkv_bias="attention_bias", out_bias="attention_bias",
                         sliding_window_field="use_sliding_window", qk_norm="head"),
    "gemma2": HFModel("hf-llama", **_BY_LAYER, query_scalar=True, softcap=True),
    # Gemma 3 has no soft-cap: transformers' Gemma3Attention stores attn_logit_softcapping but never applies it,
    # so a config that sets it is refused by name (which of the two was meant, the file cannot say).
    "gemma3": HFModel("hf-llama", **_BY_LAYER, qk_norm="head", qk_norm_offset=1.0, query_scalar=True),
    "gemma3_text": HFModel("hf-llama", **_BY_LAYER, qk_norm="head", qk_norm_offset=1.0, query_scalar=True),
    "olmo2": HFModel("hf-llama", head_dim=True, qkv_bias="attention_bias", out_bias="attention_bias", qk_norm="flat"),
    "gpt_oss": HFModel("hf-llama", **_BY_LAYER, sinks=True),
    # Phi-3: q/k/v fused (qkv_proj), no biases, LongRoPE and partial RoPE, one sliding_window for every layer.
    "phi3": HFModel("hf-phi3", qkv_bias=False, out_bias=False, head_dim=True, sliding_window_field="sliding_window",
                    partial_rope=True),
    # GPT-NeoX (Pythia): q/k/v fused per head, partial RoPE (a quarter by default), attention_bias default True.
    "gpt_neox": HFModel("hf-gpt-neox", qkv_bias="attention_bias", out_bias="attention_bias", bias_default=True,
                        partial_rope=True),
    # Falcon: q/k/v fused per key/value head (`_falcon_kv_heads` says how many), config's bias on both.
    "falcon": HFModel("hf-falcon", qkv_bias="bias", out_bias="bias"),
    # Llama 4 (Llama4TextAttention): hf-llama's tensors, attention_bias on all four, a head_dim of its own; each
    # layer's RoPE/NoPE, norm, temperature and chunk from no_rope_layers and layer_types (`llama4_fields`).
    # "llama4" is the multimodal config: its text_config's attention.
    "llama4_text": HFModel("hf-llama", qkv_bias="attention_bias", out_bias="attention_bias", head_dim=True,
                           llama4=True),
    "llama4": HFModel("hf-llama", qkv_bias="attention_bias", out_bias="attention_bias", head_dim=True, llama4=True),
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


# The RoPE keys of rope_parameters read here; every other key belongs to the scaling (`mha_spec.RopeScaling`,
# which names one it does not read) or, for the default RoPE, is refused by name.
_ROPE_OWN_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
# The base a config.json without one gets: transformers' default_theta of the model's config class.
_DEFAULT_THETAS = {"gpt_oss": 150000.0}
# rope_type spellings transformers maps to another kind for one model (Phi3Config: "su" and "yarn" are LongRoPE).
_KIND_ALIASES = {"phi3": {"su": "longrope", "yarn": "longrope"}}
_SCALED_ORIGINAL = ("llama3", "yarn", "longrope")  # the kinds transformers gives original_max_position_embeddings


def _rope_params(cfg: Mapping, source: str) -> Mapping:
    """The RoPE field transformers reads (a set rope_scaling, else rope_parameters; {} for neither); nested per
    layer type here (`_layer_rope` picked none) is refused; so is a rope_theta in rope_parameters that a set
    rope_scaling hides (transformers would not use it)."""
    fields = _rope_fields(cfg, source)
    for name, params in fields.items():
        if any(isinstance(v, Mapping) for v in params.values()):
            raise NotImplementedError(f"{source}: {name} nested per layer type ({sorted(params)}) are not supported: "
                                      f"every layer here has one RoPE")
    read = next(iter(fields.values()), {})
    hidden = fields.get("rope_parameters", {}).get("rope_theta") if "rope_scaling" in fields else None
    # The theta transformers uses then: rope_scaling's, the top level's, else the model's default (compared
    # with that default too: a hidden theta nothing else repeats is still ignored by transformers).
    used = read.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETAS.get(cfg.get("model_type"), _DEFAULT_ROPE_THETA)))
    if hidden is not None and hidden != used:
        raise _config_error(source, f"rope_parameters.rope_theta = {hidden!r}, but rope_scaling is set too and "
                                    f"transformers reads it instead (rope_theta {used!r}): say one rope_theta")
    return read


def _rope_kind(params: Mapping, model_type, source: str) -> str:
    """The RoPE kind: rope_type (transformers 5 reads it first), else type (4.x's spelling); both set and
    different is refused (readers of either release would compute different RoPEs)."""
    said = {k: params[k] for k in ("rope_type", "type") if params.get(k) is not None}
    if len(set(said.values())) > 1:
        raise _config_error(source, f"rope_type = {said['rope_type']!r} but type = {said['type']!r} in the RoPE "
                                    f"parameters: transformers 5 reads the first, 4.x the second; say one")
    kind = next(iter(said.values()), "default")
    if not isinstance(kind, str):
        raise _config_error(source, f"rope_type = {kind!r} is not a string")
    return _KIND_ALIASES.get(model_type, {}).get(kind, kind)


def _rope_number(holder: Mapping, key: str, where: str, source: str):
    value = holder[key]
    if not _number(value):
        raise _config_error(source, f"{where}{key} = {value!r} is not a number")
    return value


def _rope_base_and_fraction(cfg: Mapping, params: Mapping, model_type, source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as transformers reads them: rope_parameters first, then config.json's
    top level (4.x), GPT-NeoX's own rotary_emb_base and rotary_pct, then the model's defaults (GPT-NeoX rotates a
    quarter of each head unless told otherwise: GPTNeoXConfig's rotary_pct default 0.25)."""
    theta_keys = ("rope_theta", "rotary_emb_base") if model_type == "gpt_neox" else ("rope_theta",)
    fraction_keys = ("partial_rotary_factor", "rotary_pct") if model_type == "gpt_neox" else ("partial_rotary_factor",)
    out = []
    for keys, default in ((theta_keys, _DEFAULT_THETAS.get(model_type, _DEFAULT_ROPE_THETA)),
                          (fraction_keys, 0.25 if model_type == "gpt_neox" else 1.0)):
        value = default
        for where, holder in (("rope_parameters.", params), ("", cfg)):
            key = next((k for k in keys if holder.get(k) is not None), None)
            if key is not None:
                value = _rope_number(holder, key, where, source)
                break
        out.append(float(value))
    return out[0], out[1]


def _rope_scaling(cfg: Mapping, params: Mapping, kind: str, model_type, source: str):
    """The `mha_spec.RopeScaling` of a scaled RoPE from the keys of its rope_parameters; None for the default one,
    whose every other key is refused by name. original_max_position_embeddings as transformers'
    standardize_rope_params takes it for llama3, yarn and longrope: config.json's top level first (Phi-3 keeps it
    there; Phi3Config's default 4096), else rope_parameters', else max_position_embeddings; LongRoPE's and
    YaRN's factor, when unset, max_position_embeddings / original_max_position_embeddings."""
    from mha_spec import RopeScaling

    keys = {k: v for k, v in params.items() if k not in _ROPE_OWN_KEYS}
    if kind == "default":
        if extra := sorted(k for k, v in keys.items() if v is not None):
            raise _config_error(source, f"the RoPE parameters set {extra} with rope_type 'default', which reads none "
                                        f"of them: they would be ignored")
        return None
    if kind in _SCALED_ORIGINAL:
        top = cfg.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
        original = top if top is not None else keys.get("original_max_position_embeddings",
                                                        cfg.get("max_position_embeddings"))
        keys["original_max_position_embeddings"] = original
        if kind in ("yarn", "longrope") and keys.get("factor") is None:
            longest = cfg.get("max_position_embeddings")
            if not _number(longest) or not _number(original) or original <= 0:
                raise _config_error(source, f"rope_type {kind!r} without a factor needs max_position_embeddings / "
                                            f"original_max_position_embeddings, got {longest!r} / {original!r}")
            keys["factor"] = longest / original
    try:
        return RopeScaling.from_mapping(kind, keys)
    except NotImplementedError as e:
        raise NotImplementedError(f"{source}: {e}") from e
    except (TypeError, ValueError) as e:
        raise _config_error(source, f"the RoPE parameters {dict(params)}: {e}") from e


def _rope(cfg: Mapping, H: int, source: str, partial: bool = True) -> dict:
    """The AttentionConfig RoPE fields (rope_theta, rope_dim, rope_scaling) of a config.json (the layer's RoPE
    already picked: `_layer_rope`): the kind (`_rope_kind`), the base and the rotated fraction
    (`_rope_base_and_fraction`: rope_dim = int(H * fraction), transformers' rule), the scaling
    (`_rope_scaling`). A kind the tool does not model (dynamic, proportional, ...) is refused by name, and so is
    a partial RoPE for a model whose attention rotates the whole head (partial=False: `HFModel.partial_rope`)."""
    model_type = cfg.get("model_type")
    params = _rope_params(cfg, source)
    kind = _rope_kind(params, model_type, source)
    theta, fraction = _rope_base_and_fraction(cfg, params, model_type, source)
    if not 0 < fraction <= 1:
        raise _config_error(source, f"partial_rotary_factor = {fraction!r} is not in (0, 1]")
    if fraction != 1 and not partial:
        raise NotImplementedError(f"{source}: partial_rotary_factor={fraction!r}: {model_type!r}'s attention rotates "
                                  f"the whole head (its apply_rotary_pos_emb has no pass-through part), so RoPE on "
                                  f"part of each head is not this model's")
    R = int(H * fraction)
    if R < 2 or R % 2:
        raise _config_error(source, f"partial_rotary_factor = {fraction!r} rotates int({H} * {fraction!r}) = {R} "
                                    f"features of each head: RoPE rotates an even number >= 2")
    return dict(rope_theta=theta, rope_dim=None if R == H else R,
                rope_scaling=_rope_scaling(cfg, params, kind, model_type, source))


def _int_field(cfg: Mapping, field: str, source: str, default=None) -> int:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _config_error(source, f"{field} = {value!r} is not a positive integer")
    return value


def read_config_json(source) -> tuple[Mapping, str]:
    """(parsed config.json, where it came from) of a directory, a file path or a dict: read once, the pair
    goes to `attention_config` and `read_checkpoint(config_json=...)`."""
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


# ---------------------------------------------------------------- what a config.json sets that the tool does not model


# What the attention code of a model_type the tool does not read always does, whatever config.json says
# (read off transformers' modeling files); what config.json can switch is found by `unmodelled_features`.
_MLA = ("multi-head latent attention: low-rank q and kv projections with their RMSNorms, a rope key "
                    "shared by all heads, a value head dim of its own (mha_torch/mha_jax MultiHeadLatentAttention; "
                    "`mha-parity --checkpoint` reads it through parity.latent: docs/latent.md)",)
FAMILY_FEATURES: dict[str, tuple[str, ...]] = {
    "qwen3": ("QK-norm: an RMSNorm over each head of q and k before RoPE (q_norm, k_norm)",),
    "qwen3_moe": ("QK-norm: an RMSNorm over each head of q and k before RoPE (q_norm, k_norm)",),
    "gemma3": ("QK-norm: Gemma's RMSNorm (scale 1 + w) over each head of q and k before RoPE (q_norm, k_norm)",),
    "gemma3_text": ("QK-norm: Gemma's RMSNorm (scale 1 + w) over each head of q and k before RoPE (q_norm, k_norm)",),
    "olmo2": ("QK-norm: an RMSNorm over the whole q and k projections, all heads at once, before RoPE (q_norm, k_norm)",),
    "gpt_oss": ("attention sinks: a learned logit per head in the softmax's denominator (sinks)",),
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
}

_QK_NORM_FLAGS = ("use_qk_norm", "qk_layernorm", "qk_norm", "use_qk_layernorm")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rope_features(cfg: Mapping, H) -> list[str]:
    """Scaled, partial or per-layer-type RoPE in config.json's RoPE fields (either spelling, nested or flat)."""
    out = []
    for field in _ROPE_FIELDS:
        params = cfg.get(field)
        if not isinstance(params, Mapping) or not params:
            continue
        nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
        if nested:
            each = ", ".join(f"{k}: {v.get('rope_type', v.get('type', 'default'))} rope_theta="
                             f"{v.get('rope_theta', '?')}" for k, v in nested.items())
            out.append(f"{field} per layer type ({each}): a RoPE of its own on each kind of layer")
        for where, p in ((field, params), *((f"{field}.{k}", v) for k, v in nested.items())):
            for key in _ROPE_TYPE_KEYS:
                if p.get(key, "default") != "default":
                    out.append(f"{where}.{key}={p[key]!r}: scaled RoPE")
                    break
            factor = p.get("partial_rotary_factor")
            if factor is not None and factor != 1:
                out.append(f"{where}.partial_rotary_factor={factor!r}: RoPE on part of each head only")
    for field in ("partial_rotary_factor", "rotary_pct"):
        value = cfg.get(field)
        if value is not None and value != 1:
            out.append(f"{field}={value!r}: RoPE on part of each head only")
    if cfg.get("rotary_dim") is not None and cfg.get("rotary_dim") != H:
        out.append(f"rotary_dim={cfg['rotary_dim']!r} (head_dim {H}): RoPE on part of each head only")
    return out


def _window_features(cfg: Mapping) -> list[str]:
    out = []
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)) and any(t != "full_attention" for t in types):
        counts = {t: list(types).count(t) for t in dict.fromkeys(types)}
        out.append(f"layer_types ({', '.join(f'{n} {t}' for t, n in counts.items())}): layers that attend "
                   f"otherwise than every causal key")
    if cfg.get("use_sliding_window") is True:
        out.append(f"use_sliding_window=True (sliding_window={cfg.get('sliding_window')!r}): a sliding window")
    elif cfg.get("sliding_window") is not None and cfg.get("use_sliding_window") is not False:
        out.append(f"sliding_window={cfg['sliding_window']!r}: a sliding window")
    if cfg.get("attention_chunk_size") is not None:
        out.append(f"attention_chunk_size={cfg['attention_chunk_size']!r}: attention within chunks")
    if cfg.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention: attention to later tokens too")
    return out


def _scale_features(cfg: Mapping, E, N, H) -> list[str]:
    out = []
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (not _number(E) or not _number(N) or not N or E % N or head_dim != E // N):
        wide = f" = {N * head_dim}" if _number(N) and _number(head_dim) else ""
        out.append(f"head_dim={head_dim!r}, not hidden_size / num_attention_heads = {E} / {N}: q, k and v are "
                   f"num_attention_heads·head_dim{wide} wide, not hidden_size")
    if cfg.get("attn_logit_softcapping") is not None:
        c = cfg["attn_logit_softcapping"]
        out.append(f"attn_logit_softcapping={c!r}: the scores soft-capped to {c}·tanh(s / {c}) before the softmax")
    q = cfg.get("query_pre_attn_scalar")
    if q is not None and q != H:
        out.append(f"query_pre_attn_scalar={q!r}: the scores scaled by 1/sqrt({q}), not 1/sqrt(head_dim={H})")
    m = cfg.get("attention_multiplier")
    if m is not None and not (_number(m) and _number(H) and H and abs(m - H ** -0.5) <= 1e-12 * H ** -0.5):
        out.append(f"attention_multiplier={m!r}: the scores scaled by it, not by 1/sqrt(head_dim={H})")
    if cfg.get("scale_attn_weights") is False:
        out.append("scale_attn_weights=False: the scores not scaled by 1/sqrt(head_dim)")
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        out.append("scale_attn_by_inverse_layer_idx=True: the scores divided by the layer's index + 1 too")
    if cfg.get("clip_qkv") is not None:
        out.append(f"clip_qkv={cfg['clip_qkv']!r}: q, k and v clipped")
    return out


def unmodelled_features(cfg: Mapping) -> list[str]:
    """What a config.json sets that makes attention compute otherwise than the tool's modules, one phrase
    each naming the field: a head_dim other than E/N, attn_logit_softcapping, query_pre_attn_scalar,
    attention_multiplier, GPT-2's scale_attn_* flags, clip_qkv, scaled RoPE (rope_scaling / rope_parameters
    with a rope_type other than default, nested per layer type or not), partial RoPE (partial_rotary_factor,
    rotary_pct, rotary_dim), layer_types other than full_attention, sliding_window (unless use_sliding_window
    is False), attention_chunk_size, bidirectional attention, QK-norm flags, ALiBi, relative position
    embeddings, custom modeling code (auto_map). A multimodal config's text_config is read as well."""
    out = []
    for where, holder in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(holder, Mapping):
            continue
        E = holder.get("hidden_size", holder.get("n_embd"))
        N = holder.get("num_attention_heads", holder.get("n_head"))
        H = holder.get("head_dim")
        if H is None and _number(E) and _number(N) and N and not E % N:
            H = E // N
        found = [*_scale_features(holder, E, N, H), *_rope_features(holder, H), *_window_features(holder)]
        found += [f"{f}={holder[f]!r}: QK-norm" for f in _QK_NORM_FLAGS if holder.get(f)]
        if holder.get("alibi"):
            found.append("alibi=True: ALiBi position biases on the scores")
        kind = holder.get("position_embedding_type")
        if kind not in (None, "absolute", "rope", "rotary"):
            found.append(f"position_embedding_type={kind!r}: position terms inside the scores")
        out += [where + f for f in found]
    if cfg.get("auto_map"):
        out.append(f"auto_map={dict(cfg['auto_map']) if isinstance(cfg['auto_map'], Mapping) else cfg['auto_map']!r}: "
                   f"modeling code of its own, whose attention the tool does not read")
    return out


def _unmodelled_message(cfg: Mapping, where: str, unread: TensorAccount | None) -> str:
    """Why a config.json's model is refused: everything found that the tool does not model, never the
    model_type alone (`unmodelled_features`, `FAMILY_FEATURES`, the tensors under the prefix it does not read)."""
    model_type = cfg.get("model_type")
    features = [*FAMILY_FEATURES.get(model_type, ()), *unmodelled_features(cfg)]
    if unread is not None and unread.unread:
        features.append(f"under the prefix, tensors the layout does not read: {unread.describe_unread()}")
    head = (f"{where}: model_type {model_type!r} is not one of {sorted(HF_MODELS)}, the models whose attention this "
            f"tool reads from config.json" if model_type not in HF_MODELS else f"{where}: model_type {model_type!r}")
    if features:
        said = "; ".join(f"({i}) {f}" for i, f in enumerate(features, 1))
        return (f"{head}; its attention does what the tool does not model: {said}. Its q/k/v/o tensors checked as "
                f"a Llama layer would judge another attention than this model's, so it is refused")
    return (f"{head}; config.json sets no field the tool knows to change attention, but this model's attention is "
            f"its modeling code's, which the tool does not read, so it is refused")


def hf_model(cfg: Mapping, where: str, tensors: TensorAccount | None = None) -> HFModel:
    """The model_type's entry of HF_MODELS; a ValueError naming what the tool does not model otherwise
    (another model_type, or modeling code of its own: auto_map), with `tensors`' unread ones."""
    model_type = cfg.get("model_type")
    if model_type not in HF_MODELS or cfg.get("auto_map"):
        raise ValueError(_unmodelled_message(cfg, where, tensors))
    return HF_MODELS[model_type]


def read_hf_config(source, *, masked_rows: str = "nan", ignore_sliding_window: bool = False, layer: int | None = None,
                   ignore_chunk: bool = False):
    """A transformers config.json (a directory holding one, its path, or the parsed dict) ->
    mha_spec.AttentionConfig.

    Read: model_type (one of HF_MODELS), hidden_size, num_attention_heads,
    num_key_value_heads (absent: num_attention_heads), head_dim (absent/null or E/N for
    Llama, Mistral, Mixtral and Qwen2; anything else is a ValueError), the RoPE base (transformers
    5's rope_parameters.rope_theta or 4.x's rope_theta; absent: 10000), the biases (Llama's
    attention_bias; Qwen2's q/k/v biases; none for Mistral). RoPE is "half" (transformers'
    rotate_half). Scaled RoPE (rope_scaling / rope_parameters: linear, llama3, yarn, longrope) is read
    into `mha_spec.RopeScaling`, partial RoPE (partial_rotary_factor, GPT-NeoX's rotary_pct) into rope_dim
    for the models whose attention rotates part of the head (phi3, gpt_neox). Refused by name: dynamic
    and proportional RoPE, a RoPE key the kind does not read, partial RoPE on a model that rotates the
    whole head, RoPE nested per layer type without an entry for the layer, and sliding-window attention (Mistral's sliding_window, Qwen2's
    use_sliding_window) unless ignore_sliding_window=True -- our modules attend to every
    key, which equals a sliding window only while no query sees more keys than the window.
    Another model_type, or modeling code of its own (auto_map), is a ValueError naming what
    its attention does that the tool does not model (`unmodelled_features`, `FAMILY_FEATURES`),
    never the model_type alone. masked_rows is not in config.json: it is the caller's choice,
    passed through.

    The layers after Llama (qwen3, qwen3_moe, gemma2, gemma3, gemma3_text, olmo2, gpt_oss): head_dim
    may differ from E/N; QK-norm (rms_norm_eps; Gemma's offset 1), query_pre_attn_scalar's scale,
    attn_logit_softcapping and sinks as the model_type's attention code has them (`HF_MODELS`);
    layer (L, from the block's prefix: `layer_index`) picks layer_types[L] (a sliding_attention layer
    only with ignore_sliding_window=True) and Gemma 3's per-layer-type RoPE base.

    Llama 4 (llama4_text, and llama4's text_config; `_llama4_layer`): layer L from no_rope_layers[L] (RoPE:
    interleaved pairs, rope_parameters' RoPE with llama3 scaling, the L2 QK-norm with use_qk_norm; NoPE: the
    query temperature with attn_temperature_tuning, floor_scale, attn_scale) and layer_types[L] (a
    chunked_attention layer only with ignore_chunk=True, its chunk `layer_chunk`'s); head_dim, attention_bias.
    """
    cfg, where = read_config_json(source)
    return attention_config(cfg, where, masked_rows=masked_rows, ignore_sliding_window=ignore_sliding_window,
                            layer=layer, ignore_chunk=ignore_chunk)


def attention_config(cfg: Mapping, where: str, *, masked_rows: str = "nan", ignore_sliding_window: bool = False,
                     layer: int | None = None, ignore_chunk: bool = False):
    """`read_hf_config` of a config.json already parsed (`read_config_json`); `where` names it in errors.
    layer: the block's index L (`layer_index` of its prefix), which a model with layer_types needs.
    ignore_chunk: a Llama 4 chunked_attention layer is read, the caller applying its chunk (`layer_chunk`)."""
    from mha_spec import AttentionConfig

    model = hf_model(cfg, where)
    cfg = _language_config(cfg, where)
    E = _int_field(cfg, "hidden_size", where)
    N = _int_field(cfg, "num_attention_heads", where)
    K = _kv_heads(cfg, N, where)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and not model.head_dim and (E % N or head_dim != E // N):
        raise _config_error(where, f"head_dim = {head_dim!r} but hidden_size / num_attention_heads = {E} / {N}: our "
                                   f"modules need num_attention_heads * head_dim = hidden_size")
    H = _int_field(cfg, "head_dim", where) if head_dim is not None else None
    H = None if H is None or (not E % N and H == E // N) else H  # None: E/N, the classic path
    layer_type = _layer_type(cfg, model, where, layer, ignore_sliding_window)
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
        flags[name] = rule if isinstance(rule, bool) else cfg.get(rule, model.bias_default)
        if not isinstance(flags[name], bool):
            raise _config_error(where, f"{rule} = {flags[name]!r} is not a bool")
    if model.llama4:
        position = _llama4_layer(cfg, where, layer, H or E // N, ignore_chunk)
    else:
        position = dict(rope="half", **_rope(_layer_rope(cfg, layer_type, where), H or E // N, where, model.partial_rope))
    try:
        return AttentionConfig(E, N, num_kv_heads=K if K != N else None, head_dim=H, **position,
                               masked_rows=masked_rows, **flags, **_modern_fields(cfg, model, where, H or E // N))
    except (TypeError, ValueError) as e:
        raise _config_error(where, str(e)) from e


def _language_config(cfg: Mapping, where: str) -> Mapping:
    """A multimodal config.json's language model (gemma3's, llama4's text_config, under its text model_type);
    any other config.json as it is."""
    own = {"gemma3": "gemma3", "llama4": "llama4_text"}.get(cfg.get("model_type"))
    if own is None:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise _config_error(where, f"model_type {cfg.get('model_type')!r} without a text_config mapping: its attention "
                                   f"is unknown")
    return {**text, "model_type": own}


# Llama4TextConfig's defaults for the fields its attention reads, when config.json lacks them.
LLAMA4_DEFAULTS = dict(use_qk_norm=True, no_rope_layer_interval=4, attention_chunk_size=8192,
                       attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rms_norm_eps=1e-5)


def _llama4_field(cfg: Mapping, name: str):
    value = cfg.get(name)
    return LLAMA4_DEFAULTS[name] if value is None and name in LLAMA4_DEFAULTS else value


def llama4_rope_layers(cfg: Mapping, where: str) -> list[bool]:
    """Per layer, whether Llama 4's layer L rotates (Llama4TextAttention.use_rope = no_rope_layers[L], truthy:
    RoPE; falsy: NoPE). A missing or empty no_rope_layers is Llama4TextConfig's rule: every
    no_rope_layer_interval-th layer (L + 1 divisible by it) is NoPE, over num_hidden_layers."""
    given = cfg.get("no_rope_layers")
    if given:
        if not isinstance(given, (list, tuple)) or any(isinstance(v, float) or v not in (0, 1) for v in given):
            raise _config_error(where, f"no_rope_layers = {given!r} is not a list of 0/1 (1: the layer uses RoPE)")
        return [bool(v) for v in given]
    interval = _int_field(cfg, "no_rope_layer_interval", where, LLAMA4_DEFAULTS["no_rope_layer_interval"])
    layers = _int_field(cfg, "num_hidden_layers", where)
    return [(i + 1) % interval != 0 for i in range(layers)]


def llama4_layer_types(cfg: Mapping, where: str) -> list[str]:
    """Llama 4's layer_types ("chunked_attention" | "full_attention" per layer): config.json's, else
    Llama4TextConfig's rule (the RoPE layers chunked, the NoPE layers full: `llama4_rope_layers`)."""
    types = cfg.get("layer_types")
    if types is None:
        return ["chunked_attention" if r else "full_attention" for r in llama4_rope_layers(cfg, where)]
    if not isinstance(types, (list, tuple)) or not types:
        raise _config_error(where, f"layer_types = {types!r} is not a list of layer types")
    return list(types)


def _llama4_pick(values: list, layer: int | None, field: str, where: str):
    """values[L] of a per-layer list; with no L (the prefix names no layer) the one value every layer has."""
    if layer is None:
        if len(set(values)) == 1:
            return values[0]
        raise NotImplementedError(f"{where}: {field} differs between layers ({sorted(set(map(str, values)))}) and "
                                  f"the prefix does not say the layer's index (…layers.L.…), so which attention the "
                                  f"block has is unknown")
    if not 0 <= layer < len(values):
        raise _config_error(where, f"the prefix names layer {layer}, but {field} has {len(values)} layers")
    return values[layer]


def layer_chunk(cfg: Mapping, where: str, layer: int | None) -> int | None:
    """Llama 4's chunk C (attention_chunk_size) of block L when layer_types[L] is "chunked_attention" (a query
    attends to the causal keys of its own chunk of C positions, chunks counted from the sequence's first
    token); None for a full layer or another model. A C that is not a positive int is a ValueError naming it."""
    if not isinstance(cfg, Mapping) or not HF_MODELS.get(cfg.get("model_type"), HFModel("", False, False)).llama4:
        return None
    cfg = _language_config(cfg, where)
    types = llama4_layer_types(cfg, where)
    kind = _llama4_pick(types, layer, "layer_types", where)
    if kind != "chunked_attention":
        return None
    C = _llama4_field(cfg, "attention_chunk_size")
    if isinstance(C, bool) or not isinstance(C, int) or C < 1:
        raise _config_error(where, f"attention_chunk_size = {C!r} is not a positive integer (the chunk of layer "
                                   f"{layer}, a chunked_attention layer)")
    return C


def _llama4_bool(cfg: Mapping, name: str, where: str) -> bool:
    value = _llama4_field(cfg, name)
    if not isinstance(value, bool):
        raise _config_error(where, f"{name} = {value!r} is not a bool")
    return value


def _llama4_layer(cfg: Mapping, where: str, layer: int | None, H: int, ignore_chunk: bool) -> dict:
    """The AttentionConfig position fields of Llama 4's block L (Llama4TextAttention): a RoPE layer
    (no_rope_layers[L] truthy) rotates consecutive pairs (apply_rotary_emb's complex multiplication:
    rope="interleaved") by rope_parameters' RoPE (llama3 scaling included), then, with use_qk_norm, the
    weightless L2 norm (epsilon rms_norm_eps); a NoPE layer rotates nothing and, with attn_temperature_tuning,
    scales its queries by the temperature (floor_scale, attn_scale). layer_types[L] is "full_attention" or
    "chunked_attention" (refused unless ignore_chunk: the caller applies the chunk, `layer_chunk`); any other
    type is refused by name."""
    uses_rope = _llama4_pick(llama4_rope_layers(cfg, where), layer, "no_rope_layers", where)
    kind = _llama4_pick(llama4_layer_types(cfg, where), layer, "layer_types", where)
    if kind not in ("full_attention", "chunked_attention"):
        raise NotImplementedError(f"{where}: layer_types[{layer}] = {kind!r}: attention the tool does not model")
    if kind == "chunked_attention" and not ignore_chunk:
        raise NotImplementedError(f"{where}: layer_types[{layer}] = 'chunked_attention' (attention_chunk_size="
                                  f"{_llama4_field(cfg, 'attention_chunk_size')!r}): attention within chunks, which "
                                  f"read_hf_config does not apply (mha-parity --checkpoint does: layer_chunk)")
    qk_norm, tuning = _llama4_bool(cfg, "use_qk_norm", where), _llama4_bool(cfg, "attn_temperature_tuning", where)
    if uses_rope:
        out = dict(rope="interleaved", **_rope(cfg, H, where, partial=False))
        if qk_norm:  # Llama4TextL2Norm(rms_norm_eps), on RoPE layers only
            eps = _llama4_field(cfg, "rms_norm_eps")
            if not _number(eps) or eps <= 0:
                raise _config_error(where, f"rms_norm_eps = {eps!r} is not a positive number (the L2 QK-norm's epsilon)")
            out.update(qk_norm="l2", qk_norm_eps=float(eps))
        return out
    out = dict(rope=None)  # a NoPE layer: rope_parameters is the RoPE layers' business
    if tuning:  # on NoPE layers only
        for name in ("floor_scale", "attn_scale"):
            if not _number(_llama4_field(cfg, name)):
                raise _config_error(where, f"{name} = {_llama4_field(cfg, name)!r} is not a number (the NoPE "
                                           f"layers' query temperature)")
        if _llama4_field(cfg, "floor_scale") <= 0:
            raise _config_error(where, f"floor_scale = {_llama4_field(cfg, 'floor_scale')!r} is not positive")
        out.update(attn_temperature_tuning=True, floor_scale=float(_llama4_field(cfg, "floor_scale")),
                   attn_scale=float(_llama4_field(cfg, "attn_scale")))
    return out


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(prefix: str) -> int | None:
    """The layer index L a block's prefix names ("model.layers.L.self_attn." -> L); None when it names none."""
    found = _LAYER_INDEX.findall(prefix or "")
    return int(found[-1]) if found else None


def _layer_type(cfg: Mapping, model: HFModel, where: str, layer: int | None, ignore_window: bool) -> str | None:
    """The block's layer_types[L] for a model whose layers differ by type ("full_attention"; "sliding_attention"
    only with ignore_window, the caller applying the window: `layer_window`); None for a model without them.
    A layer type the tool does not model, no layer_types, or a prefix that does not say L is refused by name."""
    if not model.layer_types:
        return None
    types = _layer_types(cfg)
    if types is None and cfg.get("model_type") == "qwen3" and not cfg.get("use_sliding_window"):
        types = ["full_attention"]  # Qwen3Config's rule: sliding layers only with use_sliding_window
        layer = None
    if not isinstance(types, (list, tuple)) or not types:
        raise NotImplementedError(f"{where}: no layer_types: {cfg.get('model_type')!r} decides each layer's attention "
                                  f"(full or a sliding window) by a rule of its own, which the tool does not read")
    if layer is None:
        if all(t == "full_attention" for t in types):
            return "full_attention"
        raise NotImplementedError(f"{where}: layer_types mixes {sorted(set(types))} and the prefix does not say the "
                                  f"layer's index (…layers.L.…), so which attention the block has is unknown")
    if not 0 <= layer < len(types):
        raise _config_error(where, f"the prefix names layer {layer}, but layer_types has {len(types)} layers")
    kind = types[layer]
    if kind == "sliding_attention" and not ignore_window:
        raise NotImplementedError(f"{where}: layer_types[{layer}] = 'sliding_attention' (sliding_window="
                                  f"{cfg.get('sliding_window')!r}): a sliding window, which read_hf_config does not "
                                  f"apply (mha-parity --checkpoint does)")
    if kind not in ("full_attention", "sliding_attention"):
        raise NotImplementedError(f"{where}: layer_types[{layer}] = {kind!r}: attention the tool does not model")
    return kind


def _layer_types(cfg: Mapping):
    """config.json's layer_types as the model's config class makes them. Qwen2Config: without use_sliding_window
    its sliding_window is None, so no layer slides whatever layer_types says; with it, layer_types when given,
    else layer L slides when L >= max_window_layers (default 28)."""
    types = cfg.get("layer_types")
    if cfg.get("model_type") != "qwen2":
        return types
    layers = cfg.get("num_hidden_layers")
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        count = len(types) if isinstance(types, (list, tuple)) else layers if is_int(layers) and layers > 0 else 1
        return ["full_attention"] * count
    first = cfg.get("max_window_layers", 28)
    if types is None and is_int(layers) and is_int(first):
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return types


def layer_window(cfg: Mapping, where: str, layer: int | None) -> int | None:
    """The sliding window W (the last W keys) of block L of a model with layer_types whose layer L is
    "sliding_attention"; None for a full layer, another model, or a prefix that names no layer (refused by
    `attention_config` when it matters). A W that is not a positive int is a ValueError naming it."""
    model = HF_MODELS.get(cfg.get("model_type")) if isinstance(cfg, Mapping) else None
    types = _layer_types(cfg) if model is not None and model.layer_types else None
    if not isinstance(types, (list, tuple)) or layer is None or not 0 <= layer < len(types) \
            or types[layer] != "sliding_attention":
        return None
    W = cfg.get("sliding_window")
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"{where}: sliding_window = {W!r} is not a positive integer (the keys a query attends to "
                         f"on layer {layer}, a sliding_attention layer)")
    return W


def _layer_rope(cfg: Mapping, layer_type: str | None, where: str) -> Mapping:
    """config.json with the layer's own RoPE: a rope_parameters nested per layer type (Gemma 3) gives the
    block's layer type's entry; a flat one, every layer's."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, Mapping) or not any(isinstance(v, Mapping) for v in params.values()) \
            or layer_type is None:
        if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
            raise NotImplementedError(f"{where}: rope_local_base_freq = {cfg['rope_local_base_freq']!r}: the sliding "
                                      f"layers' RoPE base of a Gemma 3 config, which the tool does not read")
        return cfg
    if layer_type not in params or not isinstance(params[layer_type], Mapping):
        raise NotImplementedError(f"{where}: rope_parameters nested per layer type ({sorted(params)}) has no entry "
                                  f"for this layer's type {layer_type!r}")
    return {**cfg, "rope_parameters": params[layer_type]}


def _kv_heads(cfg: Mapping, N: int, where: str) -> int:
    """K, the key/value heads: num_key_value_heads (absent: N); Falcon's as FalconAttention takes them
    (`_falcon_kv_heads`)."""
    if cfg.get("model_type") == "falcon":
        return _falcon_kv_heads(cfg, N, where)
    K = cfg.get("num_key_value_heads")
    return N if K is None else _int_field(cfg, "num_key_value_heads", where)


def _falcon_kv_heads(cfg: Mapping, N: int, where: str) -> int:
    """Falcon's K: num_kv_heads (default N) with new_decoder_architecture, else 1 with multi_query (FalconConfig's
    default True), else N (the classic per-head fusion). ALiBi is refused by name: position biases on the scores,
    which the tool does not model (its RoPE is then off). parallel_attn only places the MLP beside attention."""
    if cfg.get("alibi"):
        raise NotImplementedError(f"{where}: alibi = {cfg['alibi']!r}: ALiBi position biases on the scores (and no "
                                  f"RoPE), which the tool does not model")
    for flag in ("new_decoder_architecture", "multi_query"):
        if not isinstance(cfg.get(flag, False), bool):
            raise _config_error(where, f"{flag} = {cfg[flag]!r} is not a bool")
    if cfg.get("new_decoder_architecture", False):
        K = cfg.get("num_kv_heads")
        return N if K is None else _int_field(cfg, "num_kv_heads", where)
    if cfg.get("multi_query", True):
        return 1
    K = cfg.get("num_kv_heads")
    if K is not None and K != N:
        raise _config_error(where, f"num_kv_heads = {K!r} with neither new_decoder_architecture nor multi_query: "
                                   f"Falcon's classic attention has one key/value head per query head ({N})")
    return N


def _modern_fields(cfg: Mapping, model: HFModel, where: str, H: int) -> dict:
    """The AttentionConfig fields a model after Llama sets from config.json (QK-norm, scale, soft-cap, sinks)."""
    out = {}
    if cfg.get("use_bidirectional_attention"):
        raise NotImplementedError(f"{where}: use_bidirectional_attention: attention to later tokens too, which the "
                                  f"tool's causal cases do not model")
    if model.qk_norm is not None:
        eps = cfg.get("rms_norm_eps")
        if not _number(eps) or eps <= 0:
            raise _config_error(where, f"rms_norm_eps = {eps!r} is not a positive number (QK-norm's epsilon)")
        out.update(qk_norm=model.qk_norm, qk_norm_eps=float(eps), qk_norm_offset=model.qk_norm_offset)
    if model.query_scalar:
        q = cfg.get("query_pre_attn_scalar")
        if not _number(q) or q <= 0:
            raise _config_error(where, f"query_pre_attn_scalar = {q!r} is not a positive number (the scores are "
                                       f"scaled by its inverse square root)")
        out["scale"] = None if q == H else float(q) ** -0.5
    if not model.softcap and cfg.get("attn_logit_softcapping") is not None:
        raise NotImplementedError(f"{where}: attn_logit_softcapping = {cfg['attn_logit_softcapping']!r}, which "
                                  f"{cfg.get('model_type')}'s attention in transformers does not apply: which was "
                                  f"meant, the file cannot say")
    if model.softcap and cfg.get("attn_logit_softcapping") is not None:
        c = cfg["attn_logit_softcapping"]
        if not _number(c) or c <= 0:
            raise _config_error(where, f"attn_logit_softcapping = {c!r} is not a positive number")
        out["softcap"] = float(c)
    if model.sinks:
        out["sinks"] = True
    return out


def read_checkpoint(path, layout: str = "hf-llama", *, prefix: str = "", config=None, masked_rows: str = "nan",
                    ignore_sliding_window: bool = False, config_json: tuple[Mapping, str] | None = None,
                    ignore_chunk: bool = False):
    """One attention block of a checkpoint -> (canonical state dict, mha_spec.AttentionConfig).

    `path` is a transformers checkpoint directory (config.json with model.safetensors, or
    with model.safetensors.index.json and its shards) or one .safetensors file. With
    config=None the layer's description comes from the directory's config.json
    (`read_hf_config`; its layout must be `layout`); a single file carries none, so it
    then needs config=. A given config is used as it is (config.json is not read) and
    checked against the weights; masked_rows, ignore_sliding_window and ignore_chunk go to
    `read_hf_config` when config.json is read; config_json, the directory's config.json as
    `read_config_json` parsed it (contents, path), is used instead of reading the file again.
    Only the block's tensors are read, and every tensor under the prefix is accounted for
    (`account`): one the layout does not read is a ValueError naming it and the feature it
    implies. A model_type outside HF_MODELS (or a config.json naming modeling code of its
    own, auto_map) is a ValueError naming what its attention does that the tool does not
    model: the fields of config.json that say so (`unmodelled_features`), what its attention
    code always does (`FAMILY_FEATURES`), and the tensors under the prefix the layout would
    leave unread.
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
            config = _directory_config(path, layout, prefix, masked_rows, ignore_sliding_window, config_json,
                                       ignore_chunk)
        single, index = _weight_files(path)
        if single is not None:
            sd = read_layout(single, layout, prefix=prefix, num_heads=config.num_heads, **_layer_read(config))
        else:
            sd = _read_sharded(path, index, layout, prefix, config.num_heads, config)
    else:
        if config is None:
            raise TypeError(f"{path} is a single weight file, which does not say the layer's heads or RoPE: pass "
                            f"config=mha_spec.AttentionConfig(...), or the checkpoint directory holding config.json")
        sd = read_layout(path, layout, prefix=prefix, num_heads=config.num_heads, **_layer_read(config))
    _check_fits(sd, config, path, prefix)
    return sd, config


def _layer_read(config) -> dict:
    """The keywords `read_layout` takes from a layer's config: the features whose tensors are read (a qk_norm
    with weights, sinks) and the RoPE a stored inv_freq is checked against (`parity.canonical.ROPE_FIELDS` but rope)."""
    rope = {"rope_theta": config.rope_theta, "rope_dim": config.rope_dim, "rope_scaling": config.rope_scaling} \
        if config.rope is not None else {}
    weighted = config.qk_norm if config.qk_norm in ("head", "flat") else None  # Llama 4's "l2" has no tensors
    return dict(rope, qk_norm=weighted, sinks=config.sinks)


def _check_fits(sd: dict, config, path: str, prefix: str) -> None:
    """The block read must be the layer `config` describes: heads, biases, head_dim, sinks, norm shapes."""
    from parity.canonical import LAYER_FIELDS, ROPE_FIELDS, check_variant_state_dict

    try:
        cfg, _ = check_variant_state_dict(sd, config.num_heads, config.num_kv_heads,
                                          **{f: getattr(config, f) for f in (*LAYER_FIELDS, *ROPE_FIELDS)})
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path} under prefix {prefix!r} does not fit {config}: {e}") from e
    if (cfg.qkv_bias, cfg.out_bias, cfg.embed_dim) != (config.qkv_bias, config.out_bias, config.embed_dim):
        raise ValueError(f"{path} under prefix {prefix!r}: the weights have embed_dim={cfg.embed_dim}, "
                         f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}; the config says embed_dim={config.embed_dim}, "
                         f"qkv_bias={config.qkv_bias}, out_bias={config.out_bias}")
    if (cfg.head_size, cfg.sinks) != (config.head_size, config.sinks):
        raise ValueError(f"{path} under prefix {prefix!r}: the weights have head_dim={cfg.head_size}, sinks={cfg.sinks}; "
                         f"the config says head_dim={config.head_size}, sinks={config.sinks}")


def _directory_config(path: str, layout: str, prefix: str, masked_rows: str, ignore_sliding_window: bool,
                      parsed: tuple[Mapping, str] | None = None, ignore_chunk: bool = False):
    """The AttentionConfig a checkpoint directory's config.json describes for `layout`; a model the tool does
    not model is refused naming what it does, and (given a prefix) the block's tensors the layout would leave
    unread. parsed: the directory's config.json already read (`read_config_json`)."""
    cfg, where = read_config_json(path) if parsed is None else parsed
    tensors = None
    known = HF_MODELS.get(cfg.get("model_type")) if not cfg.get("auto_map") else None
    if (known is None or known.layout != layout) and prefix:
        try:  # the tensors are named when they can be listed; the refusal stands either way
            tensors = account(checkpoint_tensor_names(path), layout, prefix)
        except (OSError, ValueError):
            tensors = None
    model = hf_model(cfg, where, tensors)
    if model.layout != layout:
        raise ValueError(layout_mismatch(cfg, where, model, layout, tensors))
    return attention_config(cfg, where, masked_rows=masked_rows, ignore_sliding_window=ignore_sliding_window,
                            layer=layer_index(prefix), ignore_chunk=ignore_chunk)


def layout_mismatch(cfg: Mapping, where: str, model: HFModel, layout: str, tensors: TensorAccount | None) -> str:
    """Why a config.json's model is not read with `layout`: the layout its model_type has, and what `layout`
    would leave unread under the prefix (fused projections, ...) when the tensors were listed."""
    unread = f"; under the prefix, layout {layout!r} would leave unread {tensors.describe_unread()}" \
        if tensors is not None and tensors.unread else ""
    return f"{where}: model_type {cfg.get('model_type')!r} uses layout {model.layout!r}, not {layout!r}{unread}"


def _weight_files(directory) -> tuple[str | None, str | None]:
    """(model.safetensors, None) or (None, model.safetensors.index.json) of a checkpoint directory; a
    FileNotFoundError naming what is there when it holds neither."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.lexists(single):  # lexists: a link that leads nowhere is named by the reader, not skipped
        return single, None
    if os.path.lexists(index):
        return None, index
    found = sorted(os.listdir(directory))
    raise FileNotFoundError(f"{directory}: no model.safetensors nor model.safetensors.index.json (found {found}); "
                            f"weight files are read as safetensors only")


def _weight_map(index_path) -> Mapping:
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if weight_map is None:
        raise ValueError(f"{index_path} is not a safetensors index (a JSON object with a 'weight_map')")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"{index_path}: 'weight_map' is not a mapping")
    return weight_map


def checkpoint_tensor_names(path) -> frozenset:
    """The names of every tensor of a checkpoint -- a directory (model.safetensors, or the index's weight_map)
    or one .safetensors file -- read from the headers only."""
    path = file_path(path)
    if os.path.isdir(path):
        single, index = _weight_files(path)
        if single is None:
            return frozenset(_weight_map(index))
        path = single
    with open_weight_file(path) as f:
        return f.keys


def _read_sharded(directory, index_path, layout, prefix, num_heads, config):
    """The block's tensors from the shards model.safetensors.index.json names (each shard opened once)."""
    weight_map = _weight_map(index_path)
    with ExitStack() as stack:
        opened = {}

        def shard_of(key):
            shard = weight_map[key]
            if os.path.basename(shard) != shard:
                raise ValueError(f"{index_path}: shard {shard!r} for {key!r} is not a file name in {directory}")
            if shard not in opened:
                opened[shard] = stack.enter_context(open_weight_file(os.path.join(directory, shard)))
            return opened[shard]

        return _from_getter(lambda key: shard_of(key).get(key), weight_map.keys(), layout, prefix,
                            source=f"{index_path}: ", num_heads=num_heads, finite=True,
                            get_buffer=lambda key: shard_of(key).get_buffer(key), **_layer_read(config))
