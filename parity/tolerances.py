"""The one tolerance table, keyed by dtype, and the comparison every check uses.

Every dtype uses a three-way judge (as PyTorch's SDPA tests do for 16-bit): the candidate's
max error against the float64 oracle may be at most k times the max error of the oracle's
own maths run in that dtype (`reference.forward(..., dtype=...)`, the yardstick), plus
`atol` as a floor for the case where that yardstick error is ~0, NaNs at the same places.
So a tolerance comes from a measurement, not from taste, and it grows with the size of the
terms a layer sums. Where no yardstick is run (the training rows, the sharded check, direct
comparisons) the table's elementwise entry applies: |actual - expected| <= atol + rtol * |expected|.

WIDE DTYPES (float32, float64). A 16-bit layer accumulates in float32, so its error is the
rounding of what it stores, which the yardstick reproduces (our modules' ratio to it is
0.97-1.26). A float32 layer accumulates in float32 itself: each sum's rounding is about
eps·Σ|terms| -- large where large terms cancel to a small result (an output near 0 among
outputs up to ~10, a row of the softmax between two near-equal large scores) -- which rounding
the stored stages alone does not reproduce: our torch module's error over that yardstick had a
median of 5-11x and a maximum of 117x (a one-off run, 40 seeds of a classic layer of std-1 weights,
E=64: a heavy tail, two random errors at one sensitive place). A computed float32 product is
the exact product of terms each nudged by up to ~eps (its backward error), so the float32
yardstick is the largest error over the plain run and WIDE_DRAWS runs on inputs, weights and
cotangent each nudged by a seeded relative uniform(-eps, eps) (`yardstick_runs`, `envelope`):
in the same one-off run the ratio was <= 3.8 (torch, 40 seeds x weight std 0.02/0.3/1.0,
Llama and classic layers), and at most ~7.4 for any of our modules in
scripts/measure_float32_margins.py (10 seeds x std 0.02-1.0, Llama, Qwen2 and classic; the
jax module, Qwen2 at std 1.0), so k = WIDE_K = 16 leaves >= 2x (with the plain run alone, that
script's --draws 0, our modules reach margin 1.6 at std 1.0: red). float64's yardstick is the
same float32 one with k scaled by eps(float64)/eps(float32): float64 layers accumulate in
float64 the way float32 ones do in float32. The floors (atol) are the elementwise entries'
atol (float32: 1e-6 forward, 1e-5 gradients; float64: 1e-12); they govern only small outputs
(weights of std 0.02). Measured with that script: our modules' margins <= 0.46, a projection
1% off red by >= 21x (float32, std 1.0, k_proj) and >= 79x at std <= 0.3; the table is in
docs/harness.md.

MARGINS. Every comparison carries its margin, from the same numbers as its verdict: max error
÷ the bound (elementwise: the largest elementwise ratio), at most 1 on a pass and above 1 on
a fail (`settled_margin`: a comparison failing within its bound -- NaN placement, a bound that
is not finite -- has margin inf).

Gradients whose true value is zero. A gradient computed from others can be
exactly zero by the maths: k_proj.bias, because softmax ignores a constant added to
every score of a row, so sum_s dL/dk[s] = 0. Its yardstick (the oracle's own 16-bit
maths, which sums the rounded per-key terms in float64) is then ~0 too, and any correct
16-bit layer's rounding noise would exceed k times it. Rule (`gradient_floors`): each
gradient belongs to the projection whose output gradient it is computed from
(GRADIENT_FAMILIES: the input, the weight and the bias of q_proj, k_proj, v_proj;
out_proj's weight and bias); scale = the largest |true gradient| in that family. A
gradient whose own largest |true value| is at most eps(dtype) * scale -- zero at the
dtype's resolution -- is allowed k * eps(dtype) * scale, the rounding of the terms it
is summed from. Every other gradient keeps its three-way bound unchanged (a floor
there would loosen it: measured on the default matrix, our modules' bias gradients
sit at up to 0.7 eps * scale of their bound). The same rule holds in float32 and float64,
eps being the yardstick dtype's (float32 for both; k is scaled for float64).

BIAS GRADIENTS. A bias gradient is a sum over tokens of its projection's output
gradient: n = B*T terms for q_proj and out_proj (out_proj's terms are the cotangent), B*S
for k_proj and v_proj. Our modules accumulate it in float32, and the yardstick sums the
terms in float64 and rounds once; an implementation whose autodiff sums in the input
dtype (JAX's `x @ W.T + b` in float16: XLA reduces the cotangent in float16; the example
port's out_proj.bias error measured equal to a one-at-a-time float16 sum's in 8 of 10
case/dtype pairs, 0.78x in the others) adds a rounding per partial sum -- up to
about (n-1) * eps/2 * sum|terms| in the worst case, about sqrt(n) * eps/2 * |partial sums|
typically -- which k times the yardstick does not cover. Rule (`reduction_floors`): each
bias gradient is also allowed the three-way bound of that reduction, k * err(dtype_sum
(terms), exact) + atol, where the terms are the oracle's own in the dtype (as
reference.backward(dtype=...) stores them: `parity.harness.checks.Oracle.bias_terms`) and
dtype_sum adds them one at a time in the dtype; the larger of the two bounds applies. On a
grouped layer (G query heads per key/value head) XLA, under jit, fuses repeat_kv's transpose
(the sum over the group) into the k/v bias reduction: one float16 sum of B*G*S per-query-head
terms, each rounded, instead of B*S. The jitted HF-style port's v_proj.bias reproduced that sum
bit for bit or within an ulp on 10 of 10 seeds (causal, B=3 T=S=5 N=3 K=1, float16; 4 ulps off
the exact value at seed 0, against 1 ulp for the sum over tokens: margin 1.25 under that floor
alone, 0.33 with this one). So on grouped layers k_proj's and v_proj's floors are also computed
over the per-query-head terms (`reference.backward(per_query_head=True)`), the larger applying;
a 2% v_proj.bias error stays red there (margins 2.0-6.4). In float32 and float64 every layer
sums in its dtype, so the same floor applies there (float64's: the float32 sum's error, with
float64's scaled k). Measured for 16-bit (ten cases of the default and modern sets -- self, cross, large, gqa, mqa, both RoPE
conventions, no-qkv-bias, no-out-bias -- x seeds 0-9, each bias gradient's margin = error /
bound; 2-core AMD EPYC CPU), under the three-way bound alone -> with the floor:
    bias margins          example Llama JAX port        our torch and JAX modules
    float16               2.56 -> 0.59 out_proj.bias    <= 0.80 -> <= 0.37
                          2.15 -> 0.78 v_proj.bias
    bfloat16              3.96 -> 0.33 out_proj.bias    <= 0.59 -> <= 0.59
                          1.59 -> 0.55 v_proj.bias
The bias bounds grow 3-12x (out_proj, v_proj), 1.5-3.2x (q_proj), <= 1.9x (k_proj). A bias
gradient 1% off stays red in float16 (margin >= 1.4 over those runs; >= 2.3 for
out_proj.bias, where the bound without the floor gave >= 7.6). In bfloat16 1% is about one
ulp, inside a bfloat16 sum's rounding, and neither bound catches it reliably (margin 0.2-1.0
without the floor, 0.2-0.3 with it); a dropped bias (100% off) is red in both dtypes. The
port's largest float16 margin left, 1.27 on q_proj.bias (cross/random/uniform, one seed),
is not its reduction: it stores the scores and their gradient in float16, where the
yardstick stores them in float32.

NON-FINITE REFERENCES. A comparison counts the elements it compared (`compared`: the
reference a finite number, the candidate not NaN) of the reference's `size`. Elementwise:
where the reference is a number the candidate must be within the bound (NaN or inf there
fails); where it is NaN the candidate must be NaN; an infinite reference is matched only by
the same infinity; a bound that is not finite (an overflowed 16-bit yardstick) passes
nothing. What a reference NaN means is the caller's to say, and the harness says it per
row (`parity.harness.checks.Unit.nonfinite_verdict`):
  - the unit's inputs and weights all finite: the float64 oracle is NaN only where the
    "nan" policy makes it (fully masked rows and what they reach: under "nan", v_proj's
    and out_proj.weight's gradients are NaN everywhere), so NaN matched is right; a row
    that compared nothing (NaN everywhere in both) passes and says so;
  - an input or weight holding NaN/inf at the run dtype (fixed weights, or a weight beyond
    float16's range): a row whose reference holds any NaN/inf fails, naming the tensors --
    the values it covers were never compared. (A checkpoint file read by read_checkpoint /
    read_layout never gets this far: a NaN/inf tensor there is a ValueError.)
So a row passes only if at least one element was compared where the reference is finite,
or the reference is NaN everywhere by the policy's design (finite inputs).

How the numbers were chosen (measured with scripts/measure_tolerances.py for 16-bit and
scripts/measure_float32_margins.py for float32/float64, written in docs/harness.md's
"Tolerances" section): see the comment on each entry and WIDE DTYPES above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from parity.dtypes import eps as _eps
from parity.dtypes import numpy_dtype
from parity.reference import as_float64


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


@dataclass(frozen=True)
class DtypeTolerance:
    forward: Tolerance  # outputs and attention weights
    gradient: Tolerance  # input and parameter gradients
    # The harness's rule in every dtype (`three_way`): max error <= three_way_k * the yardstick's error + atol.
    three_way_k: float | None = None  # allowed multiple of the yardstick's error (None: elementwise atol + rtol·|e|)
    yardstick: str | None = None  # the dtype the yardstick's maths runs in, where not this one (float64: float32)
    draws: int = 0  # runs of the yardstick's maths on inputs and weights nudged by up to eps, beside the plain one


# float32 and float64 (WIDE DTYPES in the module docstring): k in units of the float32 yardstick, and its draws.
WIDE_K = 16.0
WIDE_DRAWS = 4

TOLERANCES: dict[str, DtypeTolerance] = {
    # float64 and float32: the three-way judge, as for 16-bit, on a yardstick that also nudges the terms a
    # float32 layer sums (WIDE DTYPES). float64's yardstick is float32's maths, k scaled to float64's resolution.
    # atol: the floor for a yardstick that is ~0 (as 16-bit's). atol and rtol together are the elementwise
    # bound |a - e| <= atol + rtol·|e| that `compare` applies where no yardstick is run (the training rows,
    # the sharded check, direct comparisons in the tests).
    "float64": DtypeTolerance(forward=Tolerance(1e-12, 1e-12), gradient=Tolerance(1e-12, 1e-12),
                              three_way_k=WIDE_K * _eps("float64") / _eps("float32"), yardstick="float32",
                              draws=WIDE_DRAWS),
    "float32": DtypeTolerance(forward=Tolerance(1e-6, 1e-5), gradient=Tolerance(1e-5, 1e-4), three_way_k=WIDE_K,
                              draws=WIDE_DRAWS),
    # 16-bit: three-way judge. Measured ratio of our error to the yardstick: 0.97-1.01 (bfloat16),
    # 0.97-1.26 (float16), so k=3 leaves >2x margin while a real bug (a wrong scale, a
    # dropped bias) is 10-100x the yardstick. The atol here is only a floor for a yardstick that
    # happens to be ~0; it sits well below the smallest yardstick measured
    # (6.2e-4 bfloat16, 7.8e-5 float16 at E=512).
    "bfloat16": DtypeTolerance(forward=Tolerance(5e-5, 0.0), gradient=Tolerance(5e-4, 0.0), three_way_k=3.0),
    "float16": DtypeTolerance(forward=Tolerance(5e-6, 0.0), gradient=Tolerance(5e-5, 0.0), three_way_k=3.0),
}


def yardstick_dtype(dtype: str) -> str:
    """The dtype whose maths (`reference.forward(..., dtype=...)`, `reference.backward`) is `dtype`'s yardstick:
    the dtype itself, or float32 for float64 (whose own maths is the oracle)."""
    return TOLERANCES[dtype].yardstick or dtype


def yardstick_runs(maths, sd: dict, arrays: tuple, dtype: str) -> list:
    """The runs of the yardstick of a unit judged at `dtype`: `maths(sd, arrays, np_dtype)` (the oracle's maths with
    each stage rounded to that dtype, e.g. reference.forward(..., dtype=np_dtype)) at `yardstick_dtype(dtype)`, then,
    `draws` times, on `sd` and the float `arrays` (inputs, cotangent) with every element nudged by a relative
    uniform(-eps, eps) of that dtype (a seeded draw: the same inputs give the same yardstick). WIDE DTYPES in the
    module docstring says why."""
    at = yardstick_dtype(dtype)
    np_dtype, e = numpy_dtype(at), _eps(at)
    runs = [maths(sd, arrays, np_dtype)]
    rng = np.random.default_rng(0)

    def nudge(a):
        a = as_float64(a)
        return a * (1.0 + e * rng.uniform(-1.0, 1.0, a.shape))

    for _ in range(TOLERANCES[dtype].draws):
        runs.append(maths({n: nudge(v) for n, v in sd.items()}, tuple(nudge(a) for a in arrays), np_dtype))
    return runs


def _envelope_array(exact, runs):
    exact = as_float64(exact)
    dev = np.zeros_like(exact)
    with np.errstate(invalid="ignore"):
        for run in runs:
            run = as_float64(run)
            dev = np.fmax(dev, np.where(run == exact, 0.0, np.abs(run - exact)))  # fmax: a NaN run adds nothing
        return np.where(np.isfinite(exact), exact + dev, exact)


def envelope(exact, runs):
    """One yardstick from several runs (`yardstick_runs`): per stage (fields of reference.Intermediates, or keys of
    a dict) exact + the largest |run - exact| over the runs, elementwise, so that errors(envelope, exact) is the
    largest error of any run, on every part of it. A single run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    if isinstance(exact, dict):
        return {n: _envelope_array(e, [r[n] for r in runs]) for n, e in exact.items()}
    parts = {f.name: getattr(exact, f.name) for f in dataclasses.fields(exact)}
    return dataclasses.replace(exact, **{n: None if e is None else _envelope_array(e, [getattr(r, n) for r in runs])
                                          for n, e in parts.items()})


def tolerance_for(dtype) -> DtypeTolerance:
    name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[name]


@dataclass(frozen=True)
class Comparison:
    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    nan_mismatch: int  # elements NaN in one array and not the other
    passed: bool
    values_ok: bool | None = None  # the values where both are not NaN are within the bound (None: not recorded)
    compared: int | None = None  # elements where the reference is a finite number and the candidate is not NaN
    size: int | None = None  # elements in the reference (None: counts not recorded)
    # max error ÷ the bound it was allowed, from the same numbers as `passed` (`settled_margin`): at most 1 on a
    # pass, above 1 on a fail (inf where what fails is not the size of an error: NaN placement, a bound that is
    # not finite). None: not recorded.
    margin: float | None = None

    @property
    def nothing_compared(self) -> bool:
        """No element was compared where the reference is finite, though there were elements: the
        reference is NaN/inf everywhere (and the candidate, else NaN placement differs). Whether
        that may pass is the caller's to say (see NON-FINITE REFERENCES above)."""
        return bool(self.size) and self.compared == 0

    @property
    def not_compared(self) -> int:
        """Elements of the reference that are NaN/inf, so were not compared (0 when not recorded)."""
        return 0 if self.size is None else self.size - self.compared


# The gradients computed from one projection's output gradient (see the module docstring).
GRADIENT_FAMILIES = {
    "q_proj": ("query", "q_proj.weight", "q_proj.bias"),
    "k_proj": ("key", "k_proj.weight", "k_proj.bias"),
    "v_proj": ("value", "v_proj.weight", "v_proj.bias"),
    "out_proj": ("out_proj.weight", "out_proj.bias"),
}


def _finite_absmax(x) -> float:
    a = np.abs(as_float64(x))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def gradient_floors(exact: dict, dtype: str) -> dict[str, float]:
    """{gradient name: k * eps * family scale} for the gradients whose true value is zero at the
    dtype's resolution, eps being the yardstick dtype's (float64: k is in float32 units, see WIDE DTYPES).
    See the module docstring."""
    table = TOLERANCES[dtype]
    if table.three_way_k is None:
        return {}
    eps = _eps(yardstick_dtype(dtype))
    floors = {}
    for names in GRADIENT_FAMILIES.values():
        present = [n for n in names if n in exact and exact[n] is not None]
        scale = max((_finite_absmax(exact[n]) for n in present), default=0.0)
        for n in present:  # an all-NaN gradient (the "nan" policy's v_proj) has no value to floor
            if scale > 0 and np.isfinite(as_float64(exact[n])).any() and _finite_absmax(exact[n]) <= eps * scale:
                floors[n] = table.three_way_k * eps * scale
    return floors


def _differences(a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """|a - e| elementwise (float64, no NaN in either), 0 where both hold the same infinity (as for
    NaNs at the same place), inf where only one is infinite."""
    with np.errstate(invalid="ignore"):
        return np.where(a == e, 0.0, np.abs(a - e))


def dtype_sum(terms, dtype) -> np.ndarray:
    """terms (n, F) summed over n in `dtype` as an implementation that reduces in its input dtype does:
    each term rounded to the dtype, added one at a time, each partial sum rounded (float64 result)."""
    dt = numpy_dtype(dtype)
    rounded = np.asarray(terms, np.float64).astype(dt)  # (n, F)
    total = np.zeros(rounded.shape[1:], dt)
    for term in rounded:
        total = (total + term).astype(dt)
    return as_float64(total)


def reduction_floors(terms: dict, exact: dict, dtype: str) -> dict[str, float]:
    """{bias gradient: k * err(dtype_sum(terms), exact) + atol}: the three-way bound of a bias gradient whose
    sum over tokens runs in the dtype (the yardstick's dtype: float32 for float64). `terms` maps each bias
    gradient to its per-token terms (n, F), float64. See BIAS GRADIENTS in the module docstring."""
    table = TOLERANCES[dtype]
    if table.three_way_k is None:
        return {}
    at = yardstick_dtype(dtype)
    return {n: table.three_way_k * errors(dtype_sum(t, at), exact[n])[0] + table.gradient.atol
            for n, t in terms.items() if n in exact}


def errors(actual, expected) -> tuple[float, float, int]:
    """(max abs error, max relative error, NaN-placement mismatches), NaNs at equal places ignored."""
    a, e = as_float64(actual), as_float64(expected)
    if a.shape != e.shape:
        raise ValueError(f"cannot compare shapes {a.shape} and {e.shape}")
    a_nan, e_nan = np.isnan(a), np.isnan(e)
    nan_mismatch = int(np.count_nonzero(a_nan != e_nan))
    both = ~(a_nan | e_nan)
    if not both.any():
        return 0.0, 0.0, nan_mismatch
    a, e = a[both], e[both]
    diff = _differences(a, e)
    with np.errstate(invalid="ignore"):  # inf / inf where the reference is infinite: masked below
        rel = diff / np.maximum(np.abs(e), np.finfo(np.float64).tiny)
    rel = np.where(diff == 0, 0.0, np.where(np.isinf(e), np.inf, rel))
    return float(diff.max()), float(rel.max()), nan_mismatch


def counts(actual, expected) -> tuple[int, int]:
    """(elements compared: the reference finite and the candidate not NaN, elements in the reference)."""
    a, e = as_float64(actual), as_float64(expected)
    return int(np.count_nonzero(np.isfinite(e) & ~np.isnan(a))), int(e.size)


def settled_margin(value_margin: float, passed: bool) -> float:
    """The margin a verdict is printed beside: the values' margin (max error ÷ bound), except that a failing
    comparison whose values are within their bound (it fails on NaN placement, or on a bound that is not
    finite) gets inf: a NaN where a number belongs is an unbounded error. So fail <=> margin > 1."""
    if passed:
        return float(value_margin)
    return float(value_margin) if value_margin > 1 else float("inf")


def ratio(err: float, bound: float) -> float:
    """err ÷ bound; 0 when err is 0, inf when the bound is 0 (or not finite) and err is not."""
    if err == 0:
        return 0.0
    if not (np.isfinite(bound) and bound > 0):
        return float("inf")
    return float(err / bound)


def bounded(max_abs: float, atol: float) -> bool:
    """max_abs <= atol, where a bound that is not finite (a 16-bit yardstick that overflowed to inf,
    so any error would fit under it) never passes."""
    return bool(np.isfinite(atol) and max_abs <= atol)


def compare(actual, expected, tol: Tolerance) -> Comparison:
    """Elementwise allclose against an exact reference, NaNs required at the same places."""
    max_abs, max_rel, nan_mismatch = errors(actual, expected)
    a, e = as_float64(actual), as_float64(expected)
    both = ~(np.isnan(a) | np.isnan(e))
    a, e = a[both], e[both]
    # an infinite reference allows no error: only the same infinity matches it
    diff, bound = _differences(a, e), tol.atol + tol.rtol * np.where(np.isinf(e), 0.0, np.abs(e))
    ok = bool(np.all(diff <= bound))
    # the margin of an elementwise bound is the largest elementwise ratio, so it is <= 1 exactly when ok
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(diff == 0, 0.0, np.where(bound > 0, diff / np.where(bound > 0, bound, 1.0), np.inf))
    value_margin = float(ratios.max()) if ratios.size else 0.0
    passed = ok and nan_mismatch == 0
    return Comparison(max_abs, max_rel, tol.atol, tol.rtol, nan_mismatch, passed, ok, *counts(actual, expected),
                      margin=settled_margin(value_margin, passed))


def three_way(actual, expected64, k: float, yard_err: float, atol: float, floor: float = 0.0,
              pair: bool = False) -> Comparison:
    """The three-way judge: max |actual - exact| <= max(k * yard_err + atol, floor), NaNs at the same places.

    yard_err: the yardstick, err(the oracle's own maths in the dtype, exact); atol: the table's
    floor for a yardstick that is ~0; floor: a larger least bound where one applies (a true-zero
    gradient's or a reduction's, `gradient_floors`, `reduction_floors`). pair: `actual` and
    `expected64` are two candidates, each of which may be k yardsticks off the oracle in opposite
    directions (one ulp apart is normal), so the yardstick term is doubled."""
    max_abs, max_rel, nan_mismatch = errors(actual, expected64)
    bound = max((2 if pair else 1) * k * yard_err + atol, floor)
    ok = bounded(max_abs, bound)
    passed = ok and nan_mismatch == 0
    return Comparison(max_abs, max_rel, bound, 0.0, nan_mismatch, passed, ok, *counts(actual, expected64),
                      margin=settled_margin(ratio(max_abs, bound), passed))


def compare_three_way(actual, expected64, low_dtype_oracle, k: float, atol: float) -> Comparison:
    """`three_way` with the yardstick measured here: err(low_dtype_oracle, exact)."""
    return three_way(actual, expected64, k, errors(low_dtype_oracle, expected64)[0], atol)
