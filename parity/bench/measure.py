"""The timing methodology, framework-free so that it can be tested with fake clocks.

An implementation hands over a `Bench`: a no-argument `step` (one call of the
thing being measured, returning its outputs), a `sync` that waits for those
outputs, and optionally how it compiles. `run_bench` then

1. compiles ahead of time if it can (JAX: `.lower(...).compile()`), timed as compile_s;
2. otherwise, for compile-on-first-call (torch.compile), times the first call and
   reports compile_s = first call - steady median;
3. runs `warmup` discarded calls;
4. repeats timed calls, each ending in `sync`, until the budget is spent (at least
   min_repeats, at most max_repeats), and reports median, IQR and min;
5. measures the recompilation cost of a shape change, if the bench offers one.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity.bench.spec import Timing

Clock = Callable[[], float]


@dataclass(frozen=True)
class Stats:
    median_s: float
    iqr_s: float
    min_s: float
    repeats: int

    def warning(self, iqr_warn: float) -> str | None:
        """Noisy when the interquartile range exceeds iqr_warn of the median."""
        if self.median_s > 0 and self.iqr_s / self.median_s > iqr_warn:
            return f"noisy: IQR/median = {self.iqr_s / self.median_s:.0%} > {iqr_warn:.0%}"
        return None


def summarize(times) -> Stats:
    if len(times) == 0:
        raise ValueError("no timings to summarize")
    t = np.asarray(times, dtype=np.float64)
    q1, med, q3 = np.percentile(t, [25, 50, 75])
    return Stats(float(med), float(q3 - q1), float(t.min()), len(t))


def timed_call(step: Callable[[], Any], sync: Callable[[Any], None], clock: Clock) -> float:
    """One call, synchronised before the clock stops (async dispatch would time nothing)."""
    t0 = clock()
    out = step()
    sync(out)
    return clock() - t0


def repeat(step, sync, timing: Timing, clock: Clock) -> list[float]:
    times: list[float] = []
    start = clock()
    while len(times) < timing.max_repeats:
        times.append(timed_call(step, sync, clock))
        if len(times) >= timing.min_repeats and clock() - start >= timing.budget_s:
            break
    return times


def first_call_overhead(step, sync, clock: Clock, steady_calls: int = 3) -> float:
    """Compile-on-first-call cost: the first call minus the fastest of a few steady calls."""
    first = timed_call(step, sync, clock)
    steady = min(timed_call(step, sync, clock) for _ in range(max(1, steady_calls)))
    return max(first - steady, 0.0)


@dataclass(frozen=True)
class Bench:
    """What an implementation gives the methodology (see the module docstring)."""

    step: Callable[[], Any]
    sync: Callable[[Any], None]
    aot_compile: Callable[[], Any] | None = None  # compiles; the call is timed as compile_s
    compiles_on_first_call: bool = False  # torch.compile
    recompile: Callable[[Clock], float] | None = None  # seconds to recompile for a new shape
    fingerprint: Callable[[Any], float] | None = None  # mean |output| of a step's output: equal work
    # One untimed call under a peak-memory probe: (bytes, source, the call's output). It
    # stands in for the last warm-up call, so that slow cases pay no extra call for it.
    memory: Callable[[], tuple[int | None, str, Any]] | None = None
    kernel: str | None = None  # what actually ran (e.g. the JAX fused path's choice), for the row


def run_bench(bench: Bench, timing: Timing, clock: Clock = time.perf_counter) -> dict:
    """Time one item; returns the row fields it measured."""
    res = run_interleaved([bench], timing, clock)[0]
    if isinstance(res, Exception):
        raise res
    return res


def _prepare(bench: Bench, timing: Timing, clock: Clock) -> tuple[float | None, float | None, dict]:
    """Compile and warm up one bench: (compile_s or None, first-call time or None, extra row fields)."""
    compile_s = first = None
    if bench.aot_compile is not None:
        t0 = clock()
        bench.aot_compile()
        compile_s = clock() - t0
    warmup = timing.warmup
    if bench.compiles_on_first_call:
        first = timed_call(bench.step, bench.sync, clock)
        warmup = max(warmup - 1, 0)  # the compiling call already warmed up
    extra = {}
    if bench.memory is not None:
        warmup = max(warmup - 1, 0)  # the probed call is a warm-up call
    for _ in range(warmup):
        timed_call(bench.step, bench.sync, clock)
    out = None
    if bench.memory is not None:
        extra["peak_mem_bytes"], extra["mem_source"], out = bench.memory()
    if bench.fingerprint is not None:
        if out is None:
            out = bench.step()
        extra["out_fingerprint"] = bench.fingerprint(out)
    return compile_s, first, extra


def run_interleaved(
    benches: list[Bench], timing: Timing, clock: Clock = time.perf_counter, on_prepare=lambda i: None,
) -> list[dict | Exception]:
    """Time several benches of one case round-robin, alternating direction: A, B, C, C, B, A, A, ...

    On a shared machine the load drifts over seconds; timing implementations one
    after the other turns that drift into fake ratios between them. Interleaving
    gives every implementation the same share of each load phase, so their ratio
    holds even when the absolute times move. Reversing every other round removes
    what a fixed order leaves: a linear drift within a round, and the cost of
    always following the same neighbour (measured: a fixed A, B order showed ours-jax
    1.06x flax.nnx at T=2048; alternating, 0.99x). Each bench keeps its own budget (time
    spent in its own timed calls), min and max repeats. A bench that raises gets
    its exception in its slot and leaves the rotation; the others go on.
    """
    results: list = [None] * len(benches)
    prepared = {}
    for i, b in enumerate(benches):
        on_prepare(i)
        try:
            prepared[i] = _prepare(b, timing, clock)
        except Exception as e:  # noqa: BLE001 - recorded per bench
            results[i] = e
    times: dict[int, list[float]] = {i: [] for i in prepared}
    active = list(prepared)
    forward = True
    while active:
        for i in list(active) if forward else list(reversed(active)):
            try:
                times[i].append(timed_call(benches[i].step, benches[i].sync, clock))
            except Exception as e:  # noqa: BLE001
                results[i] = e
                active.remove(i)
                continue
            n, spent = len(times[i]), sum(times[i])
            if n >= timing.max_repeats or (n >= timing.min_repeats and spent >= timing.budget_s):
                active.remove(i)
        forward = not forward
    for i, (compile_s, first, extra) in prepared.items():
        if results[i] is not None:
            continue
        stats = summarize(times[i])
        if first is not None:
            compile_s = max(first - stats.median_s, 0.0)
        try:
            recompile_s = benches[i].recompile(clock) if benches[i].recompile is not None else None
        except Exception as e:  # noqa: BLE001
            results[i] = e
            continue
        results[i] = {
            "compile_s": compile_s, "recompile_s": recompile_s, "median_s": stats.median_s,
            "iqr_s": stats.iqr_s, "min_s": stats.min_s, "repeats": stats.repeats,
            "warning": stats.warning(timing.iqr_warn), **extra,
        }
    return results


def apply_peak(row: dict, flops: int, peak_gflops: float | None) -> dict:
    """GFLOP/s from the analytic count and the median; a rate above the measured peak is an error.

    Above-peak cannot be a record: it means the timing missed work (no sync, dead
    code eliminated) or the FLOP count is wrong, so the row is demoted to `error`.
    """
    row = dict(row)
    if row.get("status") != "ok" or not row.get("median_s"):
        return row
    gflops = flops / row["median_s"] / 1e9
    row["gflops"] = gflops
    row["peak_gflops"] = peak_gflops
    if peak_gflops:
        row["peak_fraction"] = gflops / peak_gflops
        if gflops > peak_gflops:
            row["status"] = "error"
            row["message"] = (
                f"{gflops:.1f} GFLOP/s exceeds the measured {row['dtype']} matmul peak "
                f"{peak_gflops:.1f} GFLOP/s: the timing missed work or the FLOP count is wrong"
            )
    return row


# ---------------------------------------------------------------- CPU memory

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(name: str) -> int:
    with open(_STATUS) as f:
        m = re.search(rf"^{name}:\s+(\d+) kB", f.read(), re.M)
    if m is None:
        raise OSError(f"{name} not in {_STATUS}")
    return int(m.group(1)) * 1024


class CpuPeakRss:
    """Peak RSS growth of this process over one call (Linux).

    Before the call: garbage-collect, `malloc_trim(0)` so freed heap pages go back to
    the OS, reset the high-water mark (writing 5 to /proc/self/clear_refs) and read
    VmRSS. After it: VmHWM - that VmRSS. Since the mark is reset per call, items
    sharing a worker process do not see each other's peaks.
    """

    source = "cpu: VmHWM growth over one synchronised call (clear_refs reset, malloc_trim)"

    def __init__(self):
        self.reason = None
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
            _status_kib("VmHWM")
        except OSError as e:
            self.reason = f"cannot reset the RSS high-water mark: {e}"
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    def __call__(self, step, sync) -> tuple[int | None, str, Any]:
        if self.reason:
            out = step()
            sync(out)
            return None, f"unavailable ({self.reason})", out
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        base = _status_kib("VmRSS")
        out = step()
        sync(out)
        peak = _status_kib("VmHWM")
        return max(peak - base, 0), self.source, out


def pin_threads(threads: int | None) -> list[int]:
    """Restrict this process (before any framework starts its pools) to `threads` CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads:
        if threads > len(cpus):
            raise ValueError(f"--threads {threads} but only {len(cpus)} CPUs are available")
        cpus = cpus[:threads]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
    n = str(len(cpus))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = n
    return cpus
