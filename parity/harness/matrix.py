"""The case matrix and the seeded inputs every implementation is fed.

A case is a shape, a mask kind and a masked-row policy; dtypes are a separate
axis of the run. Inputs are drawn once per case, in float64, from a NumPy
generator seeded by (seed, case name), so filtering cases never changes another
case's numbers; each dtype then rounds the same draw.

Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, check_config
from parity.convert import CANONICAL_KEYS

DTYPES = ("float64", "float32", "bfloat16", "float16")
MASK_KINDS = ("none", "padding", "causal", "random")
CHECKS = ("forward", "gradient", "training", "peers")


def numpy_dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {DTYPES}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    S: int
    E: int
    N: int
    cross: bool  # False: key = value = query (self-attention), needs T == S

    def __post_init__(self):
        check_config(self.E, self.N, "nan")
        if not self.cross and self.T != self.S:
            raise ValueError(f"shape {self.name}: self-attention needs T == S, got T={self.T}, S={self.S}")

    @property
    def H(self) -> int:
        return self.E // self.N


@dataclass(frozen=True)
class Case:
    shape: Shape
    mask: str = "none"
    masked_rows: str = "nan"
    train: bool = False  # the training check is slow, so only some cases run it
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask {self.mask!r} is not one of {MASK_KINDS}")
        if self.masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"masked_rows {self.masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
        if not self.name:
            object.__setattr__(self, "name", f"{self.shape.name}/{self.mask}/{self.masked_rows}")


# Shapes: self and cross, B=1 and B>1, N=1 and several heads, an odd head dim,
# T != S both ways (T > S makes causal masks fully mask the first rows), one large.
SHAPES = {
    s.name: s
    for s in (
        Shape("self", B=3, T=5, S=5, E=12, N=3, cross=False),
        Shape("b1-h1", B=1, T=6, S=6, E=8, N=1, cross=False),
        Shape("cross", B=3, T=5, S=7, E=12, N=3, cross=True),
        Shape("odd-h", B=2, T=4, S=6, E=15, N=3, cross=True),
        Shape("t>s", B=2, T=7, S=3, E=16, N=4, cross=True),
        Shape("large", B=2, T=16, S=16, E=512, N=256, cross=False),
    )
}


def default_matrix() -> tuple[Case, ...]:
    """Every mask under every policy on the base shape; the other shapes more sparsely.

    The full product (6 shapes x 10 mask/policy pairs x 4 dtypes) would not fit the
    60-second budget; each axis value still appears, and each policy meets fully
    masked rows from every mask kind that can make them.
    """
    base = SHAPES["self"]
    cases = [Case(base, "none")]
    cases += [Case(base, m, p, train=(m, p) == ("padding", "zero")) for m in MASK_KINDS[1:] for p in MASKED_ROWS_POLICIES]
    cases += [
        Case(SHAPES["b1-h1"], "none"),
        Case(SHAPES["b1-h1"], "causal", "nan"),
        Case(SHAPES["cross"], "none"),
        Case(SHAPES["cross"], "random", "uniform", train=True),
        Case(SHAPES["odd-h"], "padding", "zero"),
        Case(SHAPES["odd-h"], "random", "nan"),
        Case(SHAPES["t>s"], "causal", "uniform"),
        Case(SHAPES["t>s"], "random", "zero"),
        Case(SHAPES["large"], "random", "uniform"),
    ]
    return tuple(cases)


def quick_matrix() -> tuple[Case, ...]:
    """A few seconds: one self-attention case and one cross case with fully masked rows."""
    return (Case(SHAPES["self"], "none", train=True), Case(SHAPES["cross"], "random", "uniform"))


@dataclass(frozen=True)
class Inputs:
    """One case's draw, in float64; `in_dtype` rounds it for a run in a given dtype."""

    query: np.ndarray  # (B, T, E)
    key: np.ndarray  # (B, S, E)
    value: np.ndarray  # (B, S, E)
    keep: np.ndarray | None  # bool (B, 1, T, S), True = attend
    state_dict: dict  # canonical names, torch layout
    cotangent: np.ndarray  # (B, T, E), for the gradient check
    target: np.ndarray  # (B, T, E), for the training check

    def in_dtype(self, dtype: np.dtype) -> Inputs:
        def r(x):
            return np.asarray(x, dtype=dtype)

        return Inputs(
            r(self.query), r(self.key), r(self.value), self.keep,
            {k: r(v) for k, v in self.state_dict.items()}, r(self.cotangent), r(self.target),
        )


def _keep_mask(kind: str, shape: Shape, rng: np.random.Generator) -> np.ndarray | None:
    B, T, S = shape.B, shape.T, shape.S
    if kind == "none":
        return None
    if kind == "padding":
        lengths = rng.integers(1, S + 1, size=B)
        lengths[-1] = 0  # one sequence with no keys at all: its rows are fully masked
        keep = np.arange(S)[None, None, :] < lengths[:, None, None]  # (B, 1, S)
        keep = np.broadcast_to(keep, (B, T, S))
    elif kind == "causal":
        # Bottom-right aligned (query t is key t + S - T); with T > S the first rows see nothing.
        keep = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
        keep = np.broadcast_to(keep, (B, T, S))
    else:
        keep = rng.random((B, T, S)) < 0.7
        keep[-1, 0, :] = False  # at least one fully masked row
        keep[0, -1, :] = True  # and at least one full row
    # One layout for every kind (B, 1, T, S), so jitted functions are reused across masks.
    return np.ascontiguousarray(keep[:, None, :, :])


def _case_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def draw_inputs(case: Case, seed: int) -> Inputs:
    """The case's inputs, a pure function of (seed, case.name)."""
    s = case.shape
    rng = _case_rng(seed, case.name)
    query = rng.standard_normal((s.B, s.T, s.E))
    if s.cross:
        key, value = rng.standard_normal((s.B, s.S, s.E)), rng.standard_normal((s.B, s.S, s.E))
    else:
        key, value = query.copy(), query.copy()
    bound = 1.0 / np.sqrt(s.E)  # torch.nn.Linear's default init range
    sd = {}
    for name in CANONICAL_KEYS:
        shape = (s.E, s.E) if name.endswith("weight") else (s.E,)
        sd[name] = rng.uniform(-bound, bound, shape)
    keep = _keep_mask(case.mask, s, rng)
    # Scaled so gradient magnitudes stay O(1) whatever B and T are.
    cotangent = rng.standard_normal((s.B, s.T, s.E)) / np.sqrt(s.B * s.T)
    target = rng.standard_normal((s.B, s.T, s.E))
    return Inputs(query, key, value, keep, sd, cotangent, target)
