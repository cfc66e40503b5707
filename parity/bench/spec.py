"""What the benchmark runs: cases, implementations, presets, the FLOP formula.

Framework-free (NumPy only), so the parent process can plan a sweep, estimate
memory and count FLOPs without paying for a torch or jax import.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from parity import draw
from parity.dtypes import numpy_dtype
from parity.impls import BUILTIN, Implementation

FRAMEWORKS = ("torch", "jax")
PASSES = ("fwd", "fwd+bwd")
DTYPES = {name: numpy_dtype(name) for name in ("float32", "bfloat16", "float16")}  # what the benchmark times

# One result row, in this order in the JSON and the Markdown.
ROW_FIELDS = (
    "impl", "framework", "mode", "pass", "batch", "seq_q", "seq_k", "embed", "heads", "dtype",
    "need_weights", "kernel", "device", "compile_s", "recompile_s", "median_s", "iqr_s", "min_s", "repeats",
    "ratio", "gflops", "peak_gflops", "peak_fraction", "peak_mem_bytes", "mem_source", "out_max_diff",
    "status", "message",
)
# ok: measured and trusted; noisy: measured, but its spread is above NOISY_IQR (never ok, never
# in a conclusive verdict); error: failed, or measured and rejected; skip: not run, with the reason.
STATUSES = ("ok", "noisy", "error", "skip")
MEASURED = ("ok", "noisy")
NOISY_IQR = 0.10  # a row whose IQR / median exceeds this is `noisy`, here and in `compare`


def framework_device(framework: str, device: str) -> str:
    """What each framework runs on: torch uses cuda for gpu and stays on cpu with a TPU."""
    if framework == "torch":
        return "cuda" if device == "gpu" else "cpu"
    return device


def row_key(row: dict) -> str:
    """A row's implementation key, family:mode:weights|fused (what `Implementation.bench_key` gives)."""
    return f"{row['impl']}:{row['mode']}:{'weights' if row['need_weights'] else 'fused'}"


@dataclass(frozen=True)
class BenchCase:
    """One problem size; every implementation gets the same weights and inputs for it."""

    batch: int
    seq_q: int
    seq_k: int
    embed: int
    heads: int
    dtype: str

    def __post_init__(self):
        for name in ("batch", "seq_q", "seq_k", "embed", "heads"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"Case.{name} must be a positive int, got {val!r}")
        if self.embed % self.heads:
            raise ValueError(f"embed={self.embed} is not divisible by heads={self.heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(DTYPES)}")

    @property
    def label(self) -> str:
        return f"B={self.batch} T={self.seq_q} S={self.seq_k} E={self.embed} N={self.heads} {self.dtype}"

    def fields(self) -> dict:
        return {
            "batch": self.batch, "seq_q": self.seq_q, "seq_k": self.seq_k,
            "embed": self.embed, "heads": self.heads, "dtype": self.dtype,
        }

    def shrunk(self) -> BenchCase:
        """The shape-change case used to measure recompilation: both lengths halved."""
        return replace(self, seq_q=max(1, self.seq_q // 2), seq_k=max(1, self.seq_k // 2))


# The implementations come from the one registry (parity.impls), which the harness uses too;
# a row's `impl` column is the registry entry's family, its key family:mode:weights|fused.
IMPLS = tuple(i for i in BUILTIN if i.bench)


def select_impls(spec: str | None, impls=IMPLS) -> tuple[Implementation, ...]:
    """Filter by comma-separated patterns `name[:mode[:weights|fused]]`; '*' matches anything."""
    if not spec:
        return tuple(impls)
    chosen = []
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        parts = pattern.split(":")
        if len(parts) > 3:
            raise ValueError(f"impl pattern {pattern!r} has more than name:mode:weights|fused")
        matched = [
            im for im in impls
            if all(p in ("*", "") or p == have for p, have in zip(parts, im.bench_key.split(":")))
        ]
        if not matched:
            known = ", ".join(im.bench_key for im in impls)
            raise ValueError(f"impl pattern {pattern!r} matches nothing; known: {known}")
        chosen.extend(im for im in matched if im not in chosen)
    return tuple(im for im in impls if im in chosen)  # keep the canonical order


# ---------------------------------------------------------------- FLOPs


def forward_flops(batch: int, seq_q: int, seq_k: int, embed: int) -> int:
    """The one analytic count used for both frameworks (multiply-add = 2 FLOPs).

    Projections: q and out over seq_q rows, k and v over seq_k rows, each E×E:
    2·B·E²·(2·Nq + 2·Nk). Attention: Q·Kᵀ and P·V, each 2·B·Nq·Nk·E summed over
    heads: 4·B·Nq·Nk·E. Softmax, bias and scaling are not counted (lower order).
    """
    return 2 * batch * embed * embed * (2 * seq_q + 2 * seq_k) + 4 * batch * seq_q * seq_k * embed


def pass_flops(case: BenchCase, pass_: str) -> int:
    """fwd: the forward count; fwd+bwd: 3× (backward = 2× forward: input and weight grads)."""
    if pass_ not in PASSES:
        raise ValueError(f"pass {pass_!r} is not one of {PASSES}")
    f = forward_flops(case.batch, case.seq_q, case.seq_k, case.embed)
    return f if pass_ == "fwd" else 3 * f


# ---------------------------------------------------------------- memory estimate


def estimate_bytes(impl: Implementation, case: BenchCase, pass_: str) -> int:
    """A deliberately generous upper estimate of an item's peak memory, to skip what cannot fit.

    Activations: inputs, projections, context and output, ~8 arrays of (B, L, E).
    A materialising implementation also holds ~3 float32 (B, N, T, S) arrays in the
    forward (scores, softmax, weights) and ~6 with the backward (saved + gradients).
    """
    item = DTYPES[case.dtype].itemsize
    acts = 8 * case.batch * (case.seq_q + case.seq_k) * case.embed * max(item, 4)
    weights = 4 * (case.embed * case.embed + case.embed) * 4 * 3  # params, grads, optimiser-free slack
    scores = 0
    if impl.materializes_scores:
        per = case.batch * case.heads * case.seq_q * case.seq_k * 4
        scores = per * (3 if pass_ == "fwd" else 6)
    mult = 1 if pass_ == "fwd" else 3
    return acts * mult + weights + scores


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class Timing:
    """How one (case, pass) is timed (see `measure.time_group`).

    Repeats are rounds: each implementation of the case is timed once per round. After
    min_repeats rounds, sampling stops as soon as the verdict's interval is narrow enough
    (`verdict.settled`) or the timed calls have spent budget_s per implementation; never
    more than max_repeats rounds.
    """

    warmup: int = 1  # steady-state calls run and discarded after compilation
    min_repeats: int = 8
    max_repeats: int = 200
    budget_s: float = 1.0  # seconds of timed calls per implementation (the group gets n × this)

    def __post_init__(self):
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise ValueError(f"bad timing: {self}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s}")


@dataclass(frozen=True)
class Preset:
    name: str
    batch: tuple[int, ...]
    seqs: tuple[int, ...]
    embed: tuple[int, ...]
    heads: tuple[int, ...]
    dtypes: tuple[str, ...]
    passes: tuple[str, ...] = PASSES
    impls: str | None = None  # select_impls pattern; None = all
    timing: Timing = field(default_factory=Timing)
    peak_sizes: tuple[int, ...] = (1024, 2048)  # square matmuls for the measured peak
    isolation: str = "case"  # one worker per case, or one for the whole run (see sweep)
    doc: str = ""

    def cases(self) -> list[BenchCase]:
        return [
            BenchCase(b, s, s, e, h, d)
            for d, b, e, h, s in itertools.product(self.dtypes, self.batch, self.embed, self.heads, self.seqs)
        ]


# The matmul peak: the fastest call over several repeats and sizes, so that on a noisy
# machine the peak is an honest upper bound for the medians measured against it.
PEAK_TIMING = Timing(warmup=2, min_repeats=5, max_repeats=30, budget_s=0.75)

# torch.compile is left out of `quick`: its first compile in a process costs ~20 s on
# 2 cores (inductor start-up), a third of the quick budget on its own.
_NO_COMPILE = ",".join(
    im.bench_key for im in IMPLS if im.mode != "compile"
)

PRESETS = {
    "quick": Preset(
        "quick", batch=(2,), seqs=(128, 512), embed=(256,), heads=(4,), dtypes=("float32",),
        impls=_NO_COMPILE, timing=Timing(warmup=1, min_repeats=8, max_repeats=200, budget_s=0.5),
        peak_sizes=(1024, 2048), isolation="run",
        doc="smoke run, about a minute on a 2-core CPU; no torch.compile; one worker for the run",
    ),
    "default": Preset(
        "default", batch=(4,), seqs=(256, 1024, 2048), embed=(512,), heads=(8,),
        dtypes=("float32", "bfloat16"), timing=Timing(warmup=2, min_repeats=8, max_repeats=400, budget_s=1.5),
        peak_sizes=(1024, 2048, 3072), doc="every implementation, float32 and bfloat16",
    ),
    "long": Preset(
        "long", batch=(1,), seqs=(1024, 2048, 4096, 8192, 16384, 32768), embed=(512,), heads=(8,),
        dtypes=("float32",), timing=Timing(warmup=1, min_repeats=3, max_repeats=50, budget_s=4.0),
        peak_sizes=(1024, 2048), doc="sequence sweep to 32768; materialising paths skipped where they cannot fit",
    ),
}


# ---------------------------------------------------------------- weights and inputs


def canonical_weights(embed: int, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """One canonical state dict (parity.convert layout) shared by every implementation.

    torch.nn.Linear's default init, U(-1/√E, 1/√E), drawn in float32 and rounded once
    to the case dtype, so every framework starts from the very same bits.
    """
    sd = draw.state_dict(np.random.default_rng(seed), embed)
    return {k: v.astype(np.float32).astype(DTYPES[dtype]) for k, v in sd.items()}


def make_inputs(case: BenchCase, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query (B, T, E), key and value (B, S, E), standard normal, in the case dtype."""
    rng = np.random.default_rng(seed + 1)
    dt = DTYPES[case.dtype]
    q = rng.standard_normal((case.batch, case.seq_q, case.embed), np.float32).astype(dt)  # (B, T, E)
    k = rng.standard_normal((case.batch, case.seq_k, case.embed), np.float32).astype(dt)  # (B, S, E)
    v = rng.standard_normal((case.batch, case.seq_k, case.embed), np.float32).astype(dt)  # (B, S, E)
    return q, k, v


def empty_row(impl: Implementation, case: BenchCase, pass_: str, **kw) -> dict:
    """A row with every field present (None where not measured)."""
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        impl=impl.family or impl.name, framework=impl.framework, mode=impl.mode, need_weights=impl.returns_weights,
        **case.fields(),
    )
    row["pass"] = pass_
    row.update(kw)
    return row
