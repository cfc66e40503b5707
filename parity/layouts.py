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

The canonical state dict is parity.canonical's: q_proj/k_proj/v_proj/out_proj
.weight (out, in) and .bias, as NumPy arrays. parity.convert re-exports this module's
API; this module never imports parity.convert.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from parity.canonical import check_state_dict, tensor_to_numpy
from parity.weight_file import open_weight_file


@dataclass(frozen=True)
class Stored:
    """One tensor of a layout: where it lives and what it holds.

    The canonical tensors in `parts` are concatenated along the stored tensor's last
    axis (GPT-2's c_attn holds q | k | v). `in_out` means a weight is stored (in, out),
    the transpose of nn.Linear's (out, in) -- GPT-2's Conv1D.
    """

    key: str  # relative to the prefix
    shape: tuple[str, ...]  # in units of E: "E" or "3E"
    parts: tuple[str, ...]  # canonical keys, in order along the last axis
    in_out: bool = False


@dataclass(frozen=True)
class Layout:
    name: str
    spellings: tuple[tuple[Stored, ...], ...]  # the first is the one written
    e_key: tuple[str, ...]  # per spelling: the (E,) tensor that fixes E

    def keys(self, spelling: int = 0) -> tuple[str, ...]:
        return tuple(s.key for s in self.spellings[spelling])


def _linear(key: str, proj: str) -> tuple[Stored, Stored]:
    """An nn.Linear(E, E) named `key`: weight (out, in) = canonical, bias (E,)."""
    return Stored(f"{key}.weight", ("E", "E"), (f"{proj}.weight",)), Stored(f"{key}.bias", ("E",), (f"{proj}.bias",))


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
}
LAYOUTS = tuple(LAYOUT_TABLES)


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


def _dims(shape: tuple[str, ...], E: int) -> tuple[int, ...]:
    return tuple({"E": E, "3E": 3 * E}[d] for d in shape)


def _expected(s: Stored, E: int | None) -> str:
    sym = f"({', '.join(s.shape)}{',' if len(s.shape) == 1 else ''})"
    text = sym if E is None else f"{_dims(s.shape, E)} = {sym}"
    return text + (" stored (in, out) as a Conv1D" if s.in_out else "")


def _choose_spelling(layout: Layout, keys, prefix: str, source: str) -> int:
    """The spelling all of whose keys are present; a clear KeyError when none or several are."""
    present = set(keys)
    complete = [i for i, sp in enumerate(layout.spellings) if all(prefix + s.key in present for s in sp)]
    if len(complete) == 1:
        return complete[0]
    if len(complete) > 1:
        raise ValueError(f"{source}layout {layout.name!r}: prefix {prefix!r} holds several spellings at once; pass a narrower prefix")
    # None complete: report the spelling with most keys found, naming the first missing key.
    best = max(range(len(layout.spellings)), key=lambda i: sum(prefix + s.key in present for s in layout.spellings[i]))
    missing = [s for s in layout.spellings[best] if prefix + s.key not in present]
    s = missing[0]
    others = "" if len(layout.spellings) == 1 else f" (nor the alternative spelling(s) {[sp[0].key for sp in layout.spellings if sp is not layout.spellings[best]]})"
    raise KeyError(
        f"{source}layout {layout.name!r}: missing {prefix + s.key!r}, expected shape {_expected(s, None)}; "
        f"{len(missing)} of {len(layout.spellings[best])} tensors missing under prefix {prefix!r}{others}"
    )


def _embed_dim(layout: Layout, spelling: int, get, prefix: str, source: str) -> int:
    key = prefix + layout.e_key[spelling]
    shape = tuple(get(key).shape)
    if len(shape) != 1:
        raise ValueError(f"{source}layout {layout.name!r}: {key} has shape {shape}, expected (E,)")
    return shape[0]


# ---------------------------------------------------------------- API


def _from_getter(get, keys, layout: str, prefix: str, source: str = "") -> dict[str, np.ndarray]:
    """Shared by from_layout and read_layout: `get(key)` returns one tensor, `keys` are all keys.

    `source` ("model.safetensors: ") starts every error message about the tensors.
    """
    lay = _layout(layout)
    spelling = _choose_spelling(lay, keys, prefix, source)
    cache: dict[str, np.ndarray] = {}

    def fetch(key):  # each tensor is read once (read_layout reads from disk)
        if key not in cache:
            cache[key] = _as_numpy(get(key), key)
        return cache[key]

    E = _embed_dim(lay, spelling, fetch, prefix, source)
    sd = {}
    for s in lay.spellings[spelling]:
        key = prefix + s.key
        arr = fetch(key)
        if tuple(arr.shape) != _dims(s.shape, E):
            hint = " -- a (3E, E) c_attn is nn.Linear's (out, in) orientation: transposed?" if s.in_out and len(s.parts) > 1 else ""
            raise ValueError(f"{source}layout {layout!r}: {key} has shape {tuple(arr.shape)}, expected {_expected(s, E)} (E={E}){hint}")
        for name, part in zip(s.parts, np.split(arr, len(s.parts), axis=-1)):
            sd[name] = np.ascontiguousarray(part.T if s.in_out else part).copy()
    try:
        check_state_dict(sd)  # the dtypes: one of the four, the same for every tensor
    except TypeError as e:
        raise TypeError(f"{source}layout {layout!r} under prefix {prefix!r}: {e}") from e
    return sd


def from_layout(tensors: Mapping, layout: str, *, prefix: str = "") -> dict[str, np.ndarray]:
    """One attention block of a checkpoint (a mapping of names to numpy/torch/jax arrays) -> canonical."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> array, got {type(tensors).__name__}")
    return _from_getter(tensors.__getitem__, tensors.keys(), layout, prefix)


def to_layout(sd, layout: str, *, prefix: str = "", spelling: int = 0) -> dict[str, np.ndarray]:
    """Canonical -> the layout's tensors under `prefix`, as NumPy arrays.

    spelling 0 (default) is the checkpoint-file spelling; "hf-vit" spelling 1 is the
    transformers 5.x module names ({q,k,v,o}_proj), for loading into a ViTAttention.
    """
    lay = _layout(layout)
    if spelling not in range(len(lay.spellings)):
        raise ValueError(f"layout {layout!r} has spellings {list(range(len(lay.spellings)))}, got spelling={spelling!r}")
    check_state_dict(sd)
    out = {}
    for s in lay.spellings[spelling]:
        parts = [sd[p].T if s.in_out else sd[p] for p in s.parts]
        out[prefix + s.key] = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return out


def read_layout(path, layout: str, *, prefix: str = "") -> dict[str, np.ndarray]:
    """Read one attention block from a .safetensors checkpoint: only its tensors are read (lazily).

    Every error names the file: a directory, a missing, truncated or pickle file, a tensor
    in a dtype other than float16/bfloat16/float32/float64 (float8 included), a missing key
    or a wrong shape.
    """
    with open_weight_file(path) as f:
        return _from_getter(f.get, f.keys, layout, prefix, source=f"{f.path}: ")
