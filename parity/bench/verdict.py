"""Which implementation is faster, by how much, and how sure: the verdict of one (case, pass).

Framework-free (NumPy and `scipy.stats`), so it runs in the worker, which stops sampling
once the interval is narrow enough (`settled`), and in the parent, which decides whether
a verdict is conclusive once it knows every row's final status (`finalize`).

The interval. Interleaved timing gives one sample per implementation per round, so two
implementations' samples come in pairs that shared a moment of the machine's load. The
ratio of implementation B to A is estimated as exp(median over rounds of log(tB / tA)):
a burst of load that slows both calls of a round cancels in the log-ratio. Its 95 %
interval is the percentile bootstrap (`scipy.stats.bootstrap`) of that median over the
rounds. Timed one after another (`--sequential`) the samples are not paired: the
statistic is then log(median tB / median tA), resampled from the two samples apart.

The rules:
  - a verdict is conclusive only if its whole interval lies on one side of 1, it rests on
    at least MIN_PAIRS repeats, and both rows are `ok` (never `noisy`, never `error`);
  - sampling stops early once the interval's half-width is at most CI_TARGET of the ratio.
"""

from __future__ import annotations

import math

import numpy as np

CI_LEVEL = 0.95
CI_TARGET = 0.05  # stop sampling once (hi - lo) / 2 <= CI_TARGET * ratio
MIN_PAIRS = 8  # fewer repeats than this never give a conclusive verdict
N_RESAMPLES = 2000
SEED = 0  # the bootstrap's resampling is seeded: the same samples give the same interval
VERDICT_FIELDS = ("case", "pass", "faster", "slower", "ratio", "ci", "conclusive", "repeats")


def log_ratio_interval(times_a, times_b, paired: bool = True) -> tuple[float, float, float]:
    """(estimate, lo, hi) of log(time of B / time of A); lo = -inf, hi = inf below 2 samples."""
    a, b = np.asarray(times_a, np.float64), np.asarray(times_b, np.float64)
    if a.size == 0 or b.size == 0 or np.any(a <= 0) or np.any(b <= 0):
        raise ValueError(f"need positive times for both implementations, got {a.size} and {b.size} samples")
    # scipy.stats is imported here, not with the module: it takes ~1 s, and every mha-bench process
    # (parent, workers) imports this module while only those that compare two implementations need it.
    from scipy import stats

    if paired:
        if a.size != b.size:
            raise ValueError(f"paired samples must be as many: {a.size} vs {b.size}")
        d = np.log(b) - np.log(a)
        est = float(np.median(d))
        if d.size < 2:
            return est, -math.inf, math.inf
        if np.ptp(d) == 0:
            return est, est, est  # every round gave the same ratio: nothing to resample
        res = stats.bootstrap((d,), np.median, confidence_level=CI_LEVEL, method="percentile",
                              n_resamples=N_RESAMPLES, rng=np.random.default_rng(SEED))
    else:
        est = float(np.log(np.median(b)) - np.log(np.median(a)))
        if min(a.size, b.size) < 2:
            return est, -math.inf, math.inf
        if np.ptp(a) == 0 and np.ptp(b) == 0:
            return est, est, est

        def stat(x, y, axis=-1):
            return np.log(np.median(y, axis=axis)) - np.log(np.median(x, axis=axis))

        res = stats.bootstrap((a, b), stat, confidence_level=CI_LEVEL, method="percentile", paired=False,
                              n_resamples=N_RESAMPLES, rng=np.random.default_rng(SEED))
    ci = res.confidence_interval
    return est, float(ci.low), float(ci.high)


def compute(case: str, pass_: str, key_a: str, times_a, key_b: str, times_b, paired: bool = True) -> dict:
    """The verdict between two implementations' samples, oriented so that ratio = slower / faster >= 1.

    `conclusive` here says only what the samples say (the interval excludes 1, enough repeats);
    `finalize` also requires both rows to be ok."""
    est, lo, hi = log_ratio_interval(times_a, times_b, paired)
    if est >= 0:  # B is slower
        faster, slower, ratio, ci = key_a, key_b, math.exp(est), [math.exp(lo), math.exp(hi)]
    else:
        faster, slower, ratio, ci = key_b, key_a, math.exp(-est), [math.exp(-hi), math.exp(-lo)]
    repeats = min(len(times_a), len(times_b))
    return {"case": case, "pass": pass_, "faster": faster, "slower": slower, "ratio": ratio, "ci": ci,
            "conclusive": excludes_one(ci) and repeats >= MIN_PAIRS, "repeats": repeats}


def excludes_one(ci) -> bool:
    lo, hi = ci
    return lo > 1.0 or hi < 1.0


def settled(verdict: dict, target: float = CI_TARGET) -> bool:
    """The interval is narrow enough: half-width <= target of the ratio."""
    lo, hi = verdict["ci"]
    return math.isfinite(hi) and (hi - lo) / 2 <= target * verdict["ratio"]


def finalize(verdict: dict, rows_by_key: dict) -> dict:
    """Conclusive only if the samples say so and both rows are ok (a noisy or error row never is)."""
    statuses = [(rows_by_key.get(verdict[k]) or {}).get("status") for k in ("faster", "slower")]
    out = dict(verdict)
    out["conclusive"] = bool(verdict["conclusive"] and statuses == ["ok", "ok"])
    return out


def why_inconclusive(verdict: dict, rows_by_key: dict) -> str | None:
    """Why a verdict is not conclusive, in words (None if it is): the first reason that applies."""
    if verdict["conclusive"]:
        return None
    for k in ("faster", "slower"):
        status = (rows_by_key.get(verdict[k]) or {}).get("status")
        if status != "ok":
            return f"{verdict[k]} is {status or 'missing'}"
    if verdict["repeats"] < MIN_PAIRS:
        return f"too few repeats ({verdict['repeats']} < {MIN_PAIRS})"
    if not excludes_one(verdict["ci"]):
        return "the interval contains 1 (no measurable difference at this noise)"
    return "not conclusive"


def sentence(verdict: dict, rows_by_key: dict | None = None) -> str:
    """One line: 'A is 1.34x faster than B (95% CI 1.28-1.40, 40 repeats)' or 'inconclusive: ...'."""
    lo, hi = verdict["ci"]
    ci = f"{CI_LEVEL:.0%} CI {lo:.3g}-{hi:.3g}" if math.isfinite(hi) else "no interval"
    body = f"{verdict['faster']} is {verdict['ratio']:.3g}x faster than {verdict['slower']} ({ci}, {verdict['repeats']} repeats)"
    if verdict["conclusive"]:
        return body
    why = why_inconclusive(verdict, rows_by_key or {})
    return f"inconclusive ({why}): {body}"
