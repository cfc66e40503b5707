"""Which implementation is faster, by how much, and how sure: the verdict of one (case, pass).

Framework-free (NumPy), so it runs in the worker, which stops sampling once its own interval
is narrow enough (`settled`), and in the parent, which computes every verdict from the samples
of all the case's worker processes and decides whether it is conclusive once it knows every
row's final status and the run's interference (`finalize`).

The samples are nested: worker processes (`--processes`, started apart, each with its own
compiles, allocator and moment of the machine), rounds within a process (`round_repeats`
repeats each, probed for interference at their end), and repeats within a round. Interleaved
timing gives one call per implementation per repeat, so two implementations' calls come in
pairs that shared a moment of the machine's load. The ratio of B to A is estimated as
exp(median over all pairs of log(tB / tA)): a burst of load that slows both calls of a pair
cancels in their log-ratio.

Its 95 % interval is a hierarchical percentile bootstrap: each resample draws the processes
with replacement, then within each drawn process its rounds with replacement, then within each
drawn round its pairs with replacement, and takes the median of what was drawn. A shift of the
ratio from one process to the next, or from one round to the next, therefore widens the
interval, where resampling the pairs alone would see only the noise within a round. Timed one
after another (`--sequential`) the calls are not paired: the statistic is then
median log tB - median log tA, both resampled the same way (the processes drawn together).

The rules:
  - a verdict is conclusive only if its whole interval lies on one side of 1, it rests on at
    least MIN_PROCESSES processes and MIN_ROUNDS rounds, neither row is an `error`, both do the
    same backward work (a fwd+bwd row without parameter gradients is not ranked against one with
    them: `same_work`), and no interference was seen during the run; a `noisy` row (its own IQR
    above 10 %) does not veto a tight paired interval, it stays marked for the reader;
  - a verdict between rows whose masks reached their kernels differently (`mask_path`) says so in
    its `note` (`mask_note`), conclusive or not;
  - a worker stops sampling early once its own interval's half-width is at most CI_TARGET of
    the ratio.
"""

from __future__ import annotations

import math

import numpy as np

from parity.bench.records import VERDICT_FIELDS, VERDICT_FIELDS_2  # noqa: F401  (the JSON's, `records.Verdict`)

CI_LEVEL = 0.95
CI_TARGET = 0.05  # stop sampling once (hi - lo) / 2 <= CI_TARGET * ratio
MIN_ROUNDS = 6  # fewer rounds (over all processes) than this never give a conclusive verdict
MIN_PROCESSES = 2  # nor fewer worker processes: one process cannot show the run-to-run spread
N_RESAMPLES = 2000
SEED = 0  # the bootstrap's resampling is seeded: the same samples give the same interval


def _padded(nested) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """processes -> rounds -> samples as (X [P, R, N] NaN-padded, rounds per process [P], samples per round [P, R])."""
    P = len(nested)
    R = max(len(p) for p in nested)
    N = max((len(r) for p in nested for r in p), default=0)
    x = np.full((P, R, N), np.nan)
    rounds = np.array([len(p) for p in nested])
    counts = np.zeros((P, R), int)
    for i, proc in enumerate(nested):
        for j, rnd in enumerate(proc):
            x[i, j, :len(rnd)] = rnd
            counts[i, j] = len(rnd)
    return x, rounds, counts


def _draw(x, rounds, counts, procs, rng) -> np.ndarray:
    """The values of each resample, (n, P·R·N) with NaN where nothing was drawn: `procs` (n, P) are
    the processes drawn; then rounds within each, then samples within each round, with replacement."""
    n, P = procs.shape
    R, N = x.shape[1:]
    nr = rounds[procs]  # (n, P) rounds of each drawn process
    ri = np.floor(rng.random((n, P, R)) * nr[..., None]).astype(int)  # (n, P, R)
    ns = counts[procs[..., None], ri]  # (n, P, R) samples of each drawn round
    si = np.floor(rng.random((n, P, R, N)) * ns[..., None]).astype(int)  # (n, P, R, N)
    vals = x[procs[..., None, None], ri[..., None], si]
    keep = (np.arange(R)[None, None, :] < nr[..., None])[..., None] & (np.arange(N) < ns[..., None])
    return np.where(keep, vals, np.nan).reshape(n, -1)


def _nested_ok(nested, name: str) -> None:
    if not nested or not all(p for p in nested) or not all(len(r) for p in nested for r in p):
        raise ValueError(f"{name}: need at least one process with rounds of samples, got {nested!r}"[:300])


def hierarchical_interval(nested_a, nested_b=None, *, paired: bool = True) -> tuple[float, float | None, float | None]:
    """(estimate, lo, hi) of the median log-ratio; lo = hi = None when there is no interval (one round).

    paired: `nested_a` holds the per-pair log-ratios (processes -> rounds -> values); else the
    log-times of A and B apart, and the statistic is median log B - median log A."""
    _nested_ok(nested_a, "samples")
    if not paired:
        _nested_ok(nested_b, "samples of B")
        if len(nested_b) != len(nested_a):
            raise ValueError(f"A and B have samples from {len(nested_a)} and {len(nested_b)} processes")
    flat_a = np.concatenate([np.asarray(r, np.float64) for p in nested_a for r in p])
    flat_b = None if paired else np.concatenate([np.asarray(r, np.float64) for p in nested_b for r in p])
    est = float(np.median(flat_a)) if paired else float(np.median(flat_b) - np.median(flat_a))
    n_rounds = sum(len(p) for p in nested_a)
    if n_rounds < 2:
        return est, None, None
    if np.ptp(flat_a) == 0 and (paired or np.ptp(flat_b) == 0):
        return est, est, est  # every pair gave the same value: nothing to resample
    rng = np.random.default_rng(SEED)
    procs = rng.integers(0, len(nested_a), (N_RESAMPLES, len(nested_a)))
    stat = np.nanmedian(_draw(*_padded(nested_a), procs, rng), axis=1)
    if not paired:
        stat = np.nanmedian(_draw(*_padded(nested_b), procs, rng), axis=1) - stat
    alpha = (1 - CI_LEVEL) / 2
    lo, hi = np.quantile(stat, [alpha, 1 - alpha])
    return est, float(lo), float(hi)


def paired_log_ratios(rounds_a, rounds_b) -> list[list[list[float]]]:
    """log(tB / tA) per pair, processes -> rounds -> pairs. A process's i-th call of A and of B in
    a round are a pair; a bench that failed mid-way leaves the pairs it did complete."""
    if len(rounds_a) != len(rounds_b):
        raise ValueError(f"paired samples need the same processes: {len(rounds_a)} vs {len(rounds_b)}")
    out = []
    for pa, pb in zip(rounds_a, rounds_b):
        proc = []
        for ra, rb in zip(pa, pb):
            n = min(len(ra), len(rb))
            a, b = np.asarray(ra[:n], np.float64), np.asarray(rb[:n], np.float64)
            if np.any(a <= 0) or np.any(b <= 0):
                raise ValueError("need positive times for both implementations")
            if n:
                proc.append(list(np.log(b) - np.log(a)))
        if proc:
            out.append(proc)
    return out


def compute(case: str, pass_: str, key_a: str, rounds_a, key_b: str, rounds_b, paired: bool = True) -> dict:
    """The verdict between two implementations' samples (each processes -> rounds -> seconds), oriented
    so that ratio = slower / faster >= 1; ci is None when there is no interval (a single round).

    `conclusive` here says only what the samples say (the interval excludes 1, enough processes and
    rounds); `finalize` also requires both rows measured and no interference."""
    if paired:
        d = paired_log_ratios(rounds_a, rounds_b)
        est, lo, hi = hierarchical_interval(d, paired=True)
        procs, n_rounds, repeats = len(d), sum(len(p) for p in d), sum(len(r) for p in d for r in p)
    else:
        la = [[list(np.log(np.asarray(r, np.float64))) for r in p] for p in rounds_a]
        lb = [[list(np.log(np.asarray(r, np.float64))) for r in p] for p in rounds_b]
        est, lo, hi = hierarchical_interval(la, lb, paired=False)
        procs, n_rounds = len(la), min(sum(len(p) for p in la), sum(len(p) for p in lb))
        repeats = min(sum(len(r) for p in la for r in p), sum(len(r) for p in lb for r in p))
    if est >= 0:  # B is slower
        faster, slower, ratio = key_a, key_b, math.exp(est)
        ci = None if lo is None else [math.exp(lo), math.exp(hi)]
    else:
        faster, slower, ratio = key_b, key_a, math.exp(-est)
        ci = None if lo is None else [math.exp(-hi), math.exp(-lo)]
    v = {"case": case, "pass": pass_, "faster": faster, "slower": slower, "ratio": ratio, "ci": ci,
         "conclusive": False, "repeats": repeats, "rounds": n_rounds, "processes": procs, "interference": [],
         "reason": None}
    v["conclusive"] = sample_reason(v) is None
    return v


def excludes_one(ci) -> bool:
    if ci is None:
        return False
    lo, hi = ci
    return lo > 1.0 or hi < 1.0


def settled(verdict: dict, target: float = CI_TARGET) -> bool:
    """The interval is narrow enough: half-width <= target of the ratio."""
    ci = verdict["ci"]
    return ci is not None and math.isfinite(ci[1]) and (ci[1] - ci[0]) / 2 <= target * verdict["ratio"]


def sample_reason(verdict: dict) -> str | None:
    """Why the samples alone do not make the verdict conclusive (None: they do)."""
    procs, rounds = verdict.get("processes"), verdict.get("rounds")
    if procs is not None and procs < MIN_PROCESSES:
        return (f"one worker process ({procs} < {MIN_PROCESSES}): the run-to-run spread is not measured"
                if procs == 1 else f"too few worker processes ({procs} < {MIN_PROCESSES})")
    if rounds is not None and rounds < MIN_ROUNDS:
        return f"too few rounds ({rounds} < {MIN_ROUNDS})"
    if verdict["ci"] is None:
        return "no interval (a single round)"
    if not excludes_one(verdict["ci"]):
        return "the interval contains 1 (no measurable difference at this noise)"
    return None


def finalize(verdict: dict, rows_by_key: dict, interference=()) -> dict:
    """Conclusive only if the samples say so, neither row is an error (or missing), both do the same
    backward work, and the run saw no interference; `reason` says why not, in words, and `note` where the
    two rows' masks reached their kernels differently (`mask_note`)."""
    out = dict(verdict)
    out["interference"] = list(interference)
    out["reason"] = why_inconclusive(out, rows_by_key)
    out["conclusive"] = out["reason"] is None
    out["note"] = mask_note(out, rows_by_key)
    return out


def same_work(work: dict) -> set:
    """The slots a default verdict may pair, {slot: param_grads} (True / False on fwd+bwd, None on fwd): where
    any computes the parameters' gradients, those that do (a row that computes none does less backward work);
    else all of them."""
    if any(w is True for w in work.values()):
        return {s for s, w in work.items() if w is not False}
    return set(work)


def mask_note(verdict: dict, rows_by_key: dict) -> str | None:
    """In words, how the mask reached each row's kernel, where the two rows' `mask_path`s differ (None where
    they agree or are not known): the ratio then also measures that difference, not the kernels alone."""
    paths = {k: (rows_by_key.get(verdict[k]) or {}).get("mask_path") for k in ("faster", "slower")}
    if None in paths.values() or paths["faster"] == paths["slower"]:
        return None
    return (f"the mask reached the kernels differently: {verdict['faster']} {paths['faster']}, "
            f"{verdict['slower']} {paths['slower']}")


def why_inconclusive(verdict: dict, rows_by_key: dict) -> str | None:
    """Why a verdict is not conclusive (None if it is): the first reason that applies."""
    for k in ("faster", "slower"):
        status = (rows_by_key.get(verdict[k]) or {}).get("status")
        if status not in ("ok", "noisy"):
            return f"{verdict[k]} is {status or 'missing'}"
    grads = {k: (rows_by_key.get(verdict[k]) or {}).get("param_grads") for k in ("faster", "slower")}
    if {grads["faster"], grads["slower"]} == {True, False}:
        less = verdict["faster"] if grads["faster"] is False else verdict["slower"]
        return f"{less} computes no parameter gradients: less backward work than the other row"
    if verdict.get("interference"):
        return f"interference during the run: {verdict['interference'][0].removeprefix('interference: ')}"
    return sample_reason(verdict)


def sentence(verdict: dict, rows_by_key: dict | None = None) -> str:
    """One line: 'A is 1.34x faster than B (95% CI 1.28-1.40, 2 processes, 12 rounds, 48 repeats)' or
    'inconclusive (why): ...'."""
    ci = verdict["ci"]
    span = (f"{CI_LEVEL:.0%} CI {ci[0]:.3g}-{ci[1]:.3g}" if ci is not None and math.isfinite(ci[1])
            else "no interval")
    counts = ", ".join(f"{verdict[k]} {k}" for k in ("processes", "rounds") if verdict.get(k) is not None)
    body = (f"{verdict['faster']} is {verdict['ratio']:.3g}x faster than {verdict['slower']} "
            f"({span}, {counts + ', ' if counts else ''}{verdict['repeats']} repeats)")
    note = verdict.get("note") or mask_note(verdict, rows_by_key or {})
    if note:
        body += f"; {note}"
    if verdict["conclusive"]:
        return body
    why = verdict.get("reason") or why_inconclusive(verdict, rows_by_key or {}) or "not conclusive"
    return f"inconclusive ({why}): {body}"


def choose_pair(keys: dict, frameworks: dict, medians: dict, named=None) -> tuple | None:
    """The two slots a verdict compares: `named` (--verdict A,B) if both are here; else the fastest
    (by median) of each framework, or the two fastest when one framework is present. keys: slot ->
    implementation key; frameworks: slot -> framework; medians: slot -> median seconds (timed slots only)."""
    live = list(medians)
    if named:
        by_key = {keys[s]: s for s in live}
        return (by_key[named[0]], by_key[named[1]]) if all(k in by_key for k in named) else None
    ranked = sorted(live, key=lambda s: medians[s])
    best: dict = {}
    for s in ranked:
        best.setdefault(frameworks[s], s)
    if len(best) >= 2:
        return tuple(sorted(best.values(), key=live.index))[:2]
    return tuple(sorted(ranked[:2], key=live.index)) if len(ranked) >= 2 else None
