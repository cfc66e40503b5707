"""The timing methodology, framework-free so that it can be tested with fake clocks.

An implementation hands over a `Bench`: a no-argument `step` (one call of the
thing being measured, returning its outputs), a `sync` that waits for those
outputs, and optionally how it compiles. `time_group` then, for every
implementation of one (case, pass):

1. compiles ahead of time if it can (JAX: `.lower(...).compile()`), timed as compile_s;
2. otherwise, for compile-on-first-call (torch.compile), times the first call and
   reports compile_s = first call - steady median;
3. runs `warmup` discarded calls (the memory probe and the output check are two of them);
4. times rounds, one synchronised call of every implementation per round, reversing
   the order each round (A B C, C B A, ...), until the verdict's interval is narrow
   enough or the budget is spent (`Timing`), and reports median, IQR and min;
5. measures the recompilation cost of a shape change, if the bench offers one.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from parity.bench.spec import NOISY_IQR, Timing

Clock = Callable[[], float]


@dataclass(frozen=True)
class Stats:
    median_s: float
    iqr_s: float
    min_s: float
    repeats: int

    def noise(self, threshold: float = NOISY_IQR) -> str | None:
        """Why the row is `noisy` (its IQR above `threshold` of the median), or None."""
        if self.median_s > 0 and self.iqr_s / self.median_s > threshold:
            return f"noisy: IQR/median = {self.iqr_s / self.median_s:.1%} > {threshold:.0%}"
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
    # One untimed forward call, its output (B, T, E) as a NumPy array: every implementation
    # of a case must compute the same output (`same_output`). It stands in for a warm-up call.
    output: Callable[[], np.ndarray] | None = None
    # One untimed call under a peak-memory probe: (bytes, source, the call's output). It
    # stands in for the last warm-up call, so that slow cases pay no extra call for it.
    memory: Callable[[], tuple[int | None, str, Any]] | None = None
    kernel: str | None = None  # what actually ran (e.g. the JAX fused path's choice), for the row
    # fwd+bwd: the gradients of one step's result, named ("x" or "query", "key", "value", then the canonical
    # parameter names where it computes them) as NumPy arrays: compared with the reference's (`same_gradients`).
    # Read off the memory probe's call, which stands in for a warm-up call.
    gradients: Callable[[Any], dict[str, np.ndarray]] | None = None
    # How the case's mask reached the kernel (`spec.MASK_PATHS`), read once the bench is prepared.
    mask_path: Callable[[], str | None] | None = None


@dataclass
class Prepared:
    compile_s: float | None
    first_call_s: float | None  # torch.compile's compiling call, None otherwise
    fields: dict  # row fields measured while preparing (memory)
    output: np.ndarray | None
    gradients: dict[str, np.ndarray] | None = None  # fwd+bwd: `Bench.gradients` of one step


def prepare(bench: Bench, timing: Timing, clock: Clock) -> Prepared:
    """Compile and warm up one bench; its output and peak memory come from two of the warm-up calls."""
    compile_s = first = None
    if bench.aot_compile is not None:
        t0 = clock()
        bench.aot_compile()
        compile_s = clock() - t0
    warmup = timing.warmup
    if bench.compiles_on_first_call:
        first = timed_call(bench.step, bench.sync, clock)
        warmup -= 1  # the compiling call already warmed up
    output = None
    if bench.output is not None:
        output = bench.output()
        warmup -= 1
    if bench.memory is not None:
        warmup -= 1
    for _ in range(max(warmup, 0)):
        timed_call(bench.step, bench.sync, clock)
    fields, result = {}, None
    if bench.memory is not None:
        fields["peak_mem_bytes"], fields["mem_source"], result = bench.memory()
    gradients = None
    if bench.gradients is not None:
        if bench.memory is None:
            result = bench.step()
            bench.sync(result)
        gradients = bench.gradients(result)
    return Prepared(compile_s, first, fields, output, gradients)


def sample(
    benches: dict[int, Bench], timing: Timing, clock: Clock = time.perf_counter, interleave: bool = True,
    settled: Callable[[dict[int, list[list[float]]]], bool] | None = None, probe: Callable[[], dict] | None = None,
) -> tuple[dict[int, list[list[float]]], dict[int, Exception], list[dict]]:
    """Timed calls of prepared benches: ({slot: rounds of seconds per call}, {slot: the exception it
    raised}, [what `probe` said at the end of each round]).

    Interleaved (the default): repeats of one call each, alternating direction: A, B, C, C, B, A, A, ...
    On a shared machine the load drifts over seconds; timing implementations one after the
    other turns that drift into fake ratios between them. Round-robin gives every implementation
    the same share of each load phase, and the i-th calls of two implementations form a pair
    that saw the same moment (`verdict`). Reversing every other repeat removes what a fixed order
    leaves: a linear drift within a repeat, and the cost of always following the same neighbour
    (measured: a fixed A, B order showed ours-jax 1.06x flax.nnx at T=2048; alternating, 0.99x).
    A bench that raises leaves the rotation; the others go on.

    Every `round_repeats` repeats close a round: `probe()` (the interference probe) runs then,
    outside any timed call. At the end of a round, after min_repeats repeats, sampling stops once
    `settled(rounds)` (checked at rounds growing by a quarter, so the bootstrap costs little) or
    once the timed calls spent budget_s per bench; at max_repeats at the latest. Sequential
    (interleave=False): each bench alone, same rules.
    """
    rounds: dict[int, list[list[float]]] = {i: [] for i in benches}
    errors: dict[int, Exception] = {}
    probes: list[dict] = []

    def run_rounds(slots: list[int]) -> None:
        active, forward, repeats, next_check = list(slots), True, 0, 0
        while active:
            n = min(timing.round_repeats, timing.max_repeats - repeats)  # the last round may be short
            forward = _one_round(benches, rounds, errors, active, forward, n, clock)
            if probe is not None:
                probes.append(probe())
            repeats += n
            if repeats >= timing.max_repeats:
                break
            if repeats < timing.min_repeats:
                continue
            if sum(sum(map(sum, rounds[i])) for i in slots) >= timing.budget_s * len(slots):
                break
            n_rounds = len(rounds[slots[0]])
            if settled is not None and n_rounds >= next_check:
                next_check = max(n_rounds + 1, math.ceil(n_rounds * 1.25))
                if settled({i: rounds[i] for i in active}):
                    break

    if interleave:
        run_rounds(list(benches))
    else:
        for i in benches:
            run_rounds([i])
    return {i: [r for r in rs if r] for i, rs in rounds.items()}, errors, probes


def _one_round(benches, rounds, errors, active: list[int], forward: bool, repeats: int, clock: Clock) -> bool:
    """One round of `repeats` repeats over the active slots, alternating direction; a slot whose
    call raises leaves `active` with its exception in `errors`. Returns the next repeat's direction."""
    for i in active:
        rounds[i].append([])
    for _ in range(repeats):
        for i in list(active) if forward else list(reversed(active)):
            try:
                rounds[i][-1].append(timed_call(benches[i].step, benches[i].sync, clock))
            except Exception as e:  # noqa: BLE001 - recorded per bench
                errors[i] = e
                active.remove(i)
        forward = not forward
    return forward


def flat(rounds) -> list[float]:
    """The samples of rounds, in order."""
    return [t for r in rounds for t in r]


CALIBRATION_LOOP = 20_000  # iterations of the probe's pure-Python loop: about a millisecond
CALIBRATION_DRIFT = 0.25  # a calibration loop this much slower than the run's fastest was slowed down
OTHERS_CPU = 0.5  # other processes using this many cores on average (rounds, or the start/end window) is interference


def calibration_loop(n: int = CALIBRATION_LOOP, clock: Clock = time.perf_counter) -> float:
    """Seconds for a fixed pure-Python loop: how fast one core runs for this process right now."""
    t0 = clock()
    x = 0
    for i in range(n):
        x += i * i
    return clock() - t0


def _system_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _loadavg():
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


class InterferenceProbe:
    """What the machine did during each round, measured at its end, outside the timed calls: the
    calibration loop's time, the 1-minute load average, and the cores other processes used since
    the previous probe (the system's busy CPU time minus this process's, over the wall time).
    The readers are parameters so that tests can feed them."""

    def __init__(self, clock: Clock = time.perf_counter, busy=_system_busy_s, own=_own_cpu_s, loadavg=_loadavg,
                 calibrate=calibration_loop):
        self.clock, self.busy, self.own, self.loadavg, self.calibrate = clock, busy, own, loadavg, calibrate
        self.start()

    def start(self) -> None:
        self.last = (self.clock(), self.busy(), self.own())

    def __call__(self) -> dict:
        now = (self.clock(), self.busy(), self.own())
        wall = now[0] - self.last[0]
        others = max((now[1] - self.last[1]) - (now[2] - self.last[2]), 0.0) / wall if wall > 0 else None
        record = {"calib_s": self.calibrate(), "loadavg": self.loadavg(), "others_cpu": others}
        self.start()  # the calibration loop is this process's own work: not counted in the next round
        return record


def interference(probes: list[dict], cores: int | None, own_threads: int) -> list[str]:
    """What the probes of one worker process's rounds say disturbed them (empty: nothing): other
    processes used OTHERS_CPU cores or more on average. This is the one per-round signal that vetoes a
    verdict: it counts the CPU time others actually took, while the load average lags by minutes (a
    previous run's load lingers) and a ~1 ms loop jitters by a scheduler tick (`interference_notes`)."""
    others = [p["others_cpu"] for p in probes if p.get("others_cpu") is not None]
    if others and sum(others) / len(others) >= OTHERS_CPU:
        return [f"other processes used {sum(others) / len(others):.2f} cores on average during the rounds"]
    return []


def interference_notes(probes: list[dict], cores: int | None, own_threads: int) -> list[str]:
    """What the probes saw that is reported but does not veto (see `interference`):

    - more than a quarter of the rounds' calibration loops ran CALIBRATION_DRIFT slower than the
      fastest of them: the core may have been shared or its clock changed;
    - the 1-minute load average minus the worker's own threads reached half the cores.
    """
    out = []
    calib = [p["calib_s"] for p in probes if p.get("calib_s")]
    if calib:
        slow = sum(c > (1 + CALIBRATION_DRIFT) * min(calib) for c in calib)
        if slow * 4 > len(calib):
            out.append(f"the calibration loop ran more than {CALIBRATION_DRIFT:.0%} slower than its fastest in "
                       f"{slow} of {len(calib)} rounds")
    loads = [p["loadavg"] for p in probes if p.get("loadavg") is not None]
    if loads and cores and max(loads) - own_threads >= cores / 2:
        out.append(f"load average {max(loads):.2f} during the rounds, less the worker's {own_threads} thread(s), "
                   f"is at or above half the {cores} cores")
    return out


def _own_and_children_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OthersCpu:
    """Cores the machine's other processes used since this was made: the system's busy CPU time less
    this process's and its waited-for children's (the run's workers), over the wall time. Read it after
    the workers have been waited for, or their CPU counts as others'. None where unreadable."""

    def __init__(self, clock: Clock = time.perf_counter, busy=_system_busy_s, own=_own_and_children_cpu_s):
        self.clock, self.busy, self.own = clock, busy, own
        self.start = self._read()

    def _read(self):
        try:
            return self.clock(), self.busy(), self.own()
        except (ImportError, OSError):
            return None

    def __call__(self) -> float | None:
        now = self._read()
        if now is None or self.start is None or now[0] <= self.start[0]:
            return None
        return max((now[1] - self.start[1]) - (now[2] - self.start[2]), 0.0) / (now[0] - self.start[0])


def time_group(
    benches: list[Bench], timing: Timing, clock: Clock = time.perf_counter, on_prepare=lambda i: None,
    interleave: bool = True, settled=None,
) -> list[dict | Exception]:
    """Prepare, sample and summarise several benches of one (case, pass); per slot the row fields
    it measured (with its raw `samples` and `output`) or the exception it raised."""
    results: list = [None] * len(benches)
    prepared = {}
    for i, b in enumerate(benches):
        on_prepare(i)
        try:
            prepared[i] = prepare(b, timing, clock)
        except Exception as e:  # noqa: BLE001 - recorded per bench
            results[i] = e
    rounds, errors, _ = sample({i: benches[i] for i in prepared}, timing, clock, interleave, settled)
    for i, p in prepared.items():
        results[i] = errors.get(i) or summary(benches[i], p, flat(rounds[i]), clock)
    return results


def summary(bench: Bench, p: Prepared, times: list[float], clock: Clock) -> dict | Exception:
    """The row fields of one timed bench (recompilation measured now, after its samples)."""
    stats = summarize(times)
    compile_s = p.compile_s if p.first_call_s is None else max(p.first_call_s - stats.median_s, 0.0)
    try:
        recompile_s = bench.recompile(clock) if bench.recompile is not None else None
    except Exception as e:  # noqa: BLE001
        return e
    noise = stats.noise()
    return {
        "compile_s": compile_s, "recompile_s": recompile_s, "median_s": stats.median_s,
        "iqr_s": stats.iqr_s, "min_s": stats.min_s, "repeats": stats.repeats,
        "status": "noisy" if noise else "ok", "message": noise, **p.fields,
        "samples": list(times), "output": p.output,
    }


def run_bench(bench: Bench, timing: Timing, clock: Clock = time.perf_counter) -> dict:
    """Time one bench alone; returns the row fields it measured."""
    res = time_group([bench], timing, clock)[0]
    if isinstance(res, Exception):
        raise res
    return res


# ---------------------------------------------------------------- the same computation


def output_bound(dtype: str, precision: str = "highest") -> tuple[float, float, bool]:
    """(atol, rtol, elementwise) for |out - reference| between two implementations' outputs of one case.

    From the tolerance table (`parity.tolerances`): each implementation may be off the exact
    answer by the table's forward bound, so two of them may differ by twice it, elementwise:
    |out - ref| <= 2·atol + 2·rtol·|ref| (float32, float64: the table's atol and rtol, its bound
    where no yardstick is run, as here). 16-bit dtypes, whose table entry has no rtol (and float32
    matmuls at "default" precision, which may round their inputs to bfloat16 on an accelerator):
    the table judges those against the oracle's own maths in that dtype (three-way), which the
    benchmark does not run, so the yardstick is k units of rounding (k = the table's three_way_k)
    of the output's largest value, for each of the two: |out - ref| <= 2·atol + 2·k·eps·max|ref|.
    """
    from parity.bench.spec import DTYPES
    from parity.tolerances import tolerance_for

    judged = "bfloat16" if dtype == "float32" and precision == "default" else dtype
    tol = tolerance_for(DTYPES[judged])
    if tol.forward.rtol > 0:
        return 2 * tol.forward.atol, 2 * tol.forward.rtol, True
    return 2 * tol.forward.atol, 2 * tol.three_way_k * float(ml_dtypes.finfo(DTYPES[judged]).eps), False


def same_output(out: np.ndarray, ref: np.ndarray, dtype: str, precision: str = "highest") -> tuple[float | None, str | None]:
    """(max |out - ref|, None) if `out` computes what `ref` does (`output_bound`), else (that, why not).
    NaNs must sit at the same places. Where no difference can be taken (the shapes differ, or the
    NaNs sit elsewhere) it is None, and the reason says why: a row's out_max_diff is a finite
    number or null, never infinite (the JSON has no infinity)."""
    a, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if a.shape != r.shape:
        return None, f"output shape {a.shape} differs from the reference's {r.shape}"
    nan_a, nan_r = np.isnan(a), np.isnan(r)
    if np.any(nan_a != nan_r):
        return None, f"NaN at {int(np.count_nonzero(nan_a != nan_r))} place(s) where the reference has none, or the reverse"
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, replaced where the two are equal
        diff = np.where(nan_r | (a == r), 0.0, np.abs(a - r))  # an infinity matches only itself
    atol, rtol, elementwise = output_bound(dtype, precision)
    size = np.where(nan_r, 0.0, np.abs(r))
    bound = atol + rtol * (size if elementwise else size.max(initial=0.0))
    worst = float(diff.max(initial=0.0))
    over = diff > bound
    if not np.any(over):
        return worst, None
    shown = worst if math.isfinite(worst) else None
    at = np.unravel_index(int(np.argmax(np.where(over, diff - bound, -np.inf))), diff.shape)
    scale = "|ref|" if elementwise else "max|ref|"
    return shown, (f"max |out - reference| {worst:.3g} > {atol:.3g} + {rtol:.3g}·{scale} at index "
                   f"{tuple(int(x) for x in at)} ({int(np.count_nonzero(over))} of {diff.size} elements)")


def gradient_bound(dtype: str, precision: str = "highest", bias_terms: int | None = None) -> tuple[float, float]:
    """(atol, r) for |g - reference| between two implementations' gradients of one case, per gradient:
    |g - g_ref| <= atol + r·scale, scale = the largest |g_ref| of that gradient (of its projection's
    family for a bias: k_proj's is zero by the maths, its values only rounding of the family's terms).

    From the tolerance table's gradient entry (`parity.tolerances`), as `output_bound` reads its forward
    entry: each implementation may be off by the table's bound, so two by twice it. float32 (float64):
    r = 2·rtol (the entry's atol and rtol, its bound where no yardstick is run) at the gradient's scale
    rather than elementwise: a gradient element is a sum over B·T (or B·S) terms that may cancel to near
    0, where an elementwise bound would count the order of summation as a difference. 16-bit dtypes
    (and float32 matmuls at "default" precision), whose entry has no rtol: r = 2·k·eps, k the table's
    three_way_k, as for the output; a bias gradient (`bias_terms`: the per-token terms it sums)
    at least 2·(eps/2)·√n: an implementation that sums it in the dtype (JAX's x @ W.T + b) rounds every
    partial sum, about eps/2·√n of the scale (the table's BIAS GRADIENTS; docs/benchmark.md has the
    measurement)."""
    from parity.bench.spec import DTYPES
    from parity.tolerances import tolerance_for

    judged = "bfloat16" if dtype == "float32" and precision == "default" else dtype
    tol = tolerance_for(DTYPES[judged])
    if tol.gradient.rtol > 0:
        return 2 * tol.gradient.atol, 2 * tol.gradient.rtol
    eps = float(ml_dtypes.finfo(DTYPES[judged]).eps)
    return 2 * tol.gradient.atol, max(2 * tol.three_way_k * eps, eps * math.sqrt(bias_terms or 0))


def _gradient_scales(ref: dict) -> dict[str, float]:
    """{gradient name: its scale for `gradient_bound`}: its largest finite |value|; a bias's, the largest of its
    projection's family (`parity.tolerances.GRADIENT_FAMILIES`: its input, weight and bias)."""
    from parity.tolerances import GRADIENT_FAMILIES

    def absmax(a):
        a = np.abs(np.asarray(a, np.float64))
        a = a[np.isfinite(a)]
        return float(a.max()) if a.size else 0.0

    own = {n: absmax(a) for n, a in ref.items()}
    scales = dict(own)
    for members in GRADIENT_FAMILIES.values():
        family = max((own[n] for n in members if n in own), default=0.0)
        scales.update({n: family for n in members if n in own and n.endswith(".bias")})
    return scales


def same_gradients(grads: dict, ref: dict, dtype: str, precision: str = "highest",
                   bias_terms: int | None = None) -> tuple[float | None, str | None]:
    """(largest |g - g_ref| / scale over the gradients compared, None) if `grads` are the reference's
    (`gradient_bound`; bias_terms: the per-token terms a bias gradient sums), else (that, why not).
    Compared: the gradients both have; an input gradient the reference has and `grads` lacks is a
    difference, a parameter gradient it lacks is not (a row with uses_params=False computes none:
    `spec.NO_PARAM_GRADS`). NaNs must sit at the same places."""
    scales = _gradient_scales(ref)
    worst, bad = 0.0, []
    missing = [n for n in ref if n not in grads and "." not in n]  # inputs: x, query, key, value
    for name in (n for n in ref if n in grads):
        a, e = np.asarray(grads[name], np.float64), np.asarray(ref[name], np.float64)
        if a.shape != e.shape:
            bad.append(f"{name} has shape {a.shape}, the reference's {e.shape}")
            continue
        nan_a, nan_e = np.isnan(a), np.isnan(e)
        if np.any(nan_a != nan_e):
            bad.append(f"{name} has NaN at {int(np.count_nonzero(nan_a != nan_e))} place(s) the reference has not, "
                       "or the reverse")
            continue
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, replaced where the two are equal
            diff = float(np.where(nan_e | (a == e), 0.0, np.abs(a - e)).max(initial=0.0))
        scale = scales[name]
        atol, r = gradient_bound(dtype, precision, bias_terms if name.endswith(".bias") else None)
        if scale > 0 and math.isfinite(diff):
            worst = max(worst, diff / scale)
        if not diff <= atol + r * scale:
            bad.append(f"{name} max |g - reference| {diff:.3g} > {atol:.3g} + {r:.3g}·{scale:.3g} (its scale)")
    if missing:
        bad.insert(0, f"no gradient for {', '.join(missing)}")
    if not bad:
        return worst, None
    more = f" (and {len(bad) - 2} more)" if len(bad) > 2 else ""
    return worst, f"gradients differ: {'; '.join(bad[:2])}{more}"


def apply_peak(row: dict, flops: int, peak_gflops: float | None) -> dict:
    """GFLOP/s from the analytic count and the median; a rate above the measured peak is an error.

    Above-peak cannot be a record: it means the timing missed work (no sync, dead
    code eliminated) or the FLOP count is wrong, so the row is demoted to `error`.
    """
    row = dict(row)
    if row.get("status") not in ("ok", "noisy") or not row.get("median_s"):
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
