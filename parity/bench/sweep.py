"""Plan a sweep, run it in worker subprocesses, and turn what comes back into rows.

A worker loads both frameworks when a case has implementations of both, so that one
case's torch and JAX implementations are timed round-robin in one process and their
samples pair up (see `worker`). Isolation: by default each case runs in a worker of its
own, so the peak-memory probe, the XLA and inductor compile caches and the allocator
state of one case never leak into another, while the implementations and passes of
that case share one start-up (importing torch, jax and flax costs 3-5 s per process
here). Workers run one at a time, never in parallel: they would compete for the cores.

The quick preset uses one worker for the whole run instead: it has no torch.compile
(whose caches would carry over), JAX's compile cache is keyed by shape so cases cannot
hit each other's entries, and the memory probe resets the RSS high-water mark per item.

If a worker dies (killed for memory, a segfault) or an item exceeds its time limit, the
item it was on becomes an `error` row and a fresh worker takes the rest. On Ctrl-C the
worker is ended, its files removed, and the items not yet run are reported as such.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import psutil

from mha_spec import PASSES, allocator
from parity.bench import verdict as verdicts
from parity.bench.measure import apply_peak
from parity.bench.measure import interference as measure_interference
from parity.bench.measure import interference_notes
from parity.bench.records import Key, empty_row, merge_rows
from parity.bench.spec import (
    FLOPS_FORMULA, MEASURED, NO_PARAM_GRADS, NOISY_IQR, BenchCase, Preset, Timing, estimate_bytes, framework_device,
    pass_flops, why_not_in_bench,
)
from parity.bench.worker import TAG
from parity.devices import DevicePlan, resolve_device
from parity.env import PACKAGES, environment
from parity.impls import Implementation

MEM_HEADROOM = 0.8  # skip an item whose estimate exceeds this fraction of available memory
INTERRUPTED = "not measured: interrupted (Ctrl-C)"
# Thread settings every worker gets (the environment block records them). torch's OpenMP
# threads otherwise spin-wait after each parallel region; next to another busy process a
# spinning thread holds a core the other needs, and a call can take 50x longer (measured,
# docs/benchmark.md). Both frameworks get the same CPU count (`measure.pin_threads`).
# A value set in the environment of mha-bench wins (to measure the alternative).
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def thread_env() -> dict:
    """The thread settings the workers get: THREAD_ENV unless the environment sets them, and the
    other spin-wait knobs where the environment sets them (recorded with the run)."""
    env = {k: os.environ.get(k, v) for k, v in THREAD_ENV.items()}
    return env | {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME") if k in os.environ}


def worker_settings() -> dict:
    """Every setting a worker gets through its environment and the run records (`thread_settings.env`):
    the thread settings and glibc's allocator thresholds pinned (`mha_spec.allocator.worker_env`:
    XLA:CPU's per-call temporaries otherwise cost what the process allocated before)."""
    return thread_env() | allocator.worker_env()


def device_plan(requested: str) -> DevicePlan:
    """The run's device plan (`parity.devices`; auto: gpu, then tpu, then cpu), read from device
    nodes only, so the parent process imports no framework. The workers receive this plan as is
    and check that their framework can run on it (an absent backend makes skip rows)."""
    return resolve_device(requested, probe=False)


@dataclass(frozen=True)
class RunConfig:
    preset: Preset
    plan: DevicePlan = field(default_factory=lambda: DevicePlan("cpu", "cpu", "cpu", "cpu"))
    impls: tuple[Implementation, ...] = ()
    cases: tuple[BenchCase, ...] = ()
    user_impls: tuple[str, ...] = ()  # module:attribute specs the workers load (--impl)
    passes: tuple[str, ...] = PASSES
    threads: int | None = None
    precision: str = "highest"  # highest | default
    seed: int = 0
    isolation: str = "case"  # case | run
    item_timeout_s: float = 900.0
    interleave: bool = True  # time the implementations of a (case, pass) round-robin
    timing: Timing = field(default_factory=Timing)
    available_bytes: int | None = None
    verdict: tuple[str, str] | None = None  # the pair every verdict compares (--verdict); None: `verdict.choose_pair`
    processes: int = 2  # independent worker processes per group of items (--processes)
    baseline: str | None = None  # the implementation key ratios are taken against (--baseline); None: BASELINE_ORDER

    @property
    def device(self) -> str:
        """The device kind that runs: cpu | gpu | tpu."""
        return self.plan.name

    def __post_init__(self):
        if self.precision not in ("highest", "default"):
            raise ValueError(f"precision must be 'highest' or 'default', got {self.precision!r}")
        if self.isolation not in ("case", "run"):
            raise ValueError(f"isolation must be 'case' or 'run', got {self.isolation!r}")
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or self.processes < 1:
            raise ValueError(f"processes must be a positive int, got {self.processes!r}")


@dataclass(frozen=True)
class Item:
    id: int
    impl: Implementation
    case: BenchCase
    pass_: str
    skip: str | None = None

    def to_json(self) -> dict:
        """What a worker is sent for this item: its implementation's `Key` and its `Case`, as their JSON,
        which the worker turns back into objects once (`worker.main`)."""
        return {"id": self.id, "impl": Key.of(self.impl).to_json(), "case": self.case.to_json(), "pass": self.pass_}



def plan(cfg: RunConfig) -> list[Item]:
    """Every (case, implementation, pass), with a skip reason for what must not run."""
    avail = cfg.available_bytes if cfg.available_bytes is not None else psutil.virtual_memory().available
    items = []
    for case in cfg.cases:
        for impl in cfg.impls:
            for pass_ in cfg.passes:
                skip = cfg.plan.skip_reason or why_not_in_bench(impl, case)
                if skip:
                    pass  # the device is absent, or the implementation declares it does not run this case
                elif case.dtype == "float16" and framework_device(impl.framework, cfg.plan) == "cpu":
                    skip = "float16 not benchmarked on CPU (no native half-precision matmul; emulated)"
                else:
                    need = estimate_bytes(impl, case, pass_)
                    if need > MEM_HEADROOM * avail:
                        skip = (
                            f"estimated memory {need / 2**30:.1f} GiB > {MEM_HEADROOM:.0%} of available "
                            f"{avail / 2**30:.1f} GiB ({'materialises B·N·T·S scores' if impl.materializes_scores else 'activations'})"
                        )
                items.append(Item(len(items), impl, case, pass_, skip))
    return items


def _groups(items: list[Item], isolation: str) -> list[list[Item]]:
    """The items each worker runs: one case (both frameworks) per worker, or all in one."""
    groups: dict = {}
    for it in items:
        if not it.skip:
            groups.setdefault(it.case if isolation == "case" else None, []).append(it)
    return list(groups.values())


# ---------------------------------------------------------------- workers

Spawn = Callable[[dict, dict], subprocess.Popen]


def _spawn(spec: dict, env: dict) -> subprocess.Popen:
    """A worker, its spec on stdin (no file to leave behind)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity.bench.worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
    except BrokenPipeError:  # it died at start-up: its exit code and stderr say why
        pass
    except BaseException:  # Ctrl-C before anyone reads it: no worker may outlive this
        proc.kill()
        proc.wait()
        raise
    return proc


def _worker_env(cfg: RunConfig, scratch: str) -> dict:
    env = dict(os.environ)
    env.update(worker_settings())
    # A fresh inductor cache per worker: torch.compile times are cold compiles, not disk-cache hits.
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=scratch)
    # Allocate GPU memory on demand so that JAX's peak is the program's, not a 75% preallocation.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _pump(stream, q: queue.Queue, tag: str) -> None:
    try:
        for line in stream:
            q.put((tag, line))
    except (OSError, ValueError):  # the stream was closed under it: the worker was ended (Ctrl-C)
        pass
    q.put((tag, None))


@dataclass
class Collected:
    rows: dict = field(default_factory=dict)  # item id -> its row from each worker process, in process order
    peaks: list = field(default_factory=list)  # every matmul-peak measurement of the run
    envs: dict = field(default_factory=dict)  # framework -> env report
    probes: list = field(default_factory=list)  # per worker group: {"process", "items", "probes", "threads"}
    interrupted: bool = False  # Ctrl-C: the rows of the items not run say so

    def add(self, item_id: int, row: dict) -> None:
        self.rows.setdefault(item_id, []).append(row)

    def done(self, item_id: int, process: int) -> bool:
        """Whether the item has its row from worker process `process` (0-based)."""
        return len(self.rows.get(item_id, ())) > process


@dataclass
class WorkerEnd:
    """How one worker's stream ended: its exit code, the item it was on, and why it may have died."""

    rc: int
    current: int | None  # the item id it had started and not finished
    timed_out: bool
    stderr_tail: list


def _end(proc) -> None:
    """End a worker that is still running (it ignores SIGINT): SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _consume(proc, cfg: RunConfig, by_id: dict, out: Collected, on_event, process: int = 0) -> WorkerEnd:
    """Read a worker's tagged lines into `out` until it exits; kill it when an item overruns.
    Whatever interrupts the reading (Ctrl-C) ends the worker before it propagates."""
    try:
        return _read(proc, cfg, by_id, out, on_event, process)
    finally:
        _end(proc)
        for stream in (proc.stdout, proc.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass


def _read(proc, cfg: RunConfig, by_id: dict, out: Collected, on_event, process: int) -> WorkerEnd:
    q: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_pump, args=(stream, q, tag), daemon=True)
               for stream, tag in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for t in threads:
        t.start()
    stderr_tail: list[str] = []
    current, started_at, open_streams, timed_out = None, time.monotonic(), 2, False
    while open_streams:
        try:
            tag, line = q.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() - started_at > cfg.item_timeout_s:
                timed_out = True
                proc.kill()
            continue
        if line is None:
            open_streams -= 1
        elif tag == "err":
            stderr_tail = (stderr_tail + [line.rstrip()])[-20:]
        elif line.startswith(TAG):
            kind, _, payload = line[len(TAG):].partition("\t")
            data = json.loads(payload)
            if kind == "ENV":
                out.envs.setdefault(data["framework"], data)
            elif kind == "PEAK":
                out.peaks.append(data)
            elif kind == "START":
                current, started_at = data, time.monotonic()
                on_event("start", by_id[data])
            elif kind == "ROW":
                out.add(data.pop("id"), data)
                current = None
                on_event("row", data)
            elif kind == "PROBES":
                out.probes.append({**data, "process": process})
    rc = proc.wait()
    for t in threads:
        t.join(timeout=5.0)
    return WorkerEnd(rc, current, timed_out, stderr_tail)


def _death_message(end: WorkerEnd, cfg: RunConfig) -> str:
    if end.timed_out:
        why = f"timed out: no result within {cfg.item_timeout_s:.0f} s, worker killed"
    elif end.rc < 0:
        why = f"worker killed by signal {-end.rc}" + (" (SIGKILL: likely out of memory)" if end.rc == -9 else "")
    else:
        why = f"worker exited with code {end.rc}"
    tail = " | ".join(end.stderr_tail[-3:])
    return (f"{why}; stderr: {tail}" if tail else why)[:800]


def spawn_group(
    cfg: RunConfig, items: list[Item], peaks: list[dict], out: Collected,
    on_event: Callable[[str, object], None], scratch: str, spawn: Spawn = _spawn, process: int = 0,
) -> None:
    """Run items in workers until each has its row from worker process `process`; a dead or stuck
    worker costs one item."""
    pending = [it for it in items if not out.done(it.id, process)]
    by_id = {it.id: it for it in items}
    while pending:
        spec = {
            "device": cfg.plan.to_dict(), "threads": cfg.threads,
            "precision": cfg.precision, "seed": cfg.seed, "timing": asdict(cfg.timing),
            "peaks": peaks, "items": [it.to_json() for it in pending], "interleave": cfg.interleave,
            "user_impls": list(cfg.user_impls), "verdict": list(cfg.verdict) if cfg.verdict else None,
            # The best rates so far: the worker re-measures its peak when a row beats them.
            "known_peaks": [rec for rec in out.peaks if rec.get("gflops")],
        }
        end = _consume(spawn(spec, _worker_env(cfg, scratch)), cfg, by_id, out, on_event, process)
        pending = [it for it in pending if not out.done(it.id, process)]
        if not pending:
            break
        victims = [by_id[end.current]] if end.current is not None else pending  # died outside an item: all fail
        for it in victims:
            out.add(it.id, empty_row(it.impl, it.case, it.pass_, device=framework_device(it.impl.framework, cfg.plan),
                                     status="error", message=_death_message(end, cfg)))
            on_event("row", out.rows[it.id][-1])
        pending = [it for it in pending if not out.done(it.id, process)]


def execute(cfg: RunConfig, items: list[Item], on_event=lambda kind, data: None, spawn: Spawn = _spawn) -> Collected:
    """Every item's row (skips included). Ctrl-C ends the running worker and removes the scratch
    directory; the items without a row get one that says they were not run (`interrupted`)."""
    out = Collected()
    for it in items:
        if it.skip:
            out.add(it.id, empty_row(it.impl, it.case, it.pass_, device=framework_device(it.impl.framework, cfg.plan),
                                     status="skip", message=it.skip))
            on_event("row", out.rows[it.id][0])
    try:
        with tempfile.TemporaryDirectory(prefix="mha-bench-") as scratch:
            # Process after process: the second worker of a case starts after the first has run every
            # group, so the two see different moments of the machine (what the interval must cover).
            for process in range(cfg.processes):
                for group in _groups(items, cfg.isolation):
                    # Every worker re-measures the peak for its dtypes: the run's peak is the best of
                    # them all, so a burst of load during one measurement cannot lower the bar.
                    dtypes = sorted({it.case.dtype for it in group})
                    peaks = [{"dtype": d, "sizes": list(cfg.preset.peak_sizes)} for d in dtypes]
                    spawn_group(cfg, group, peaks, out, on_event, scratch, spawn, process)
    except KeyboardInterrupt:
        out.interrupted = True
        for it in items:
            if it.id not in out.rows:
                out.add(it.id, empty_row(it.impl, it.case, it.pass_, device=framework_device(it.impl.framework, cfg.plan),
                                         status="skip", message=INTERRUPTED))
    return out


# ---------------------------------------------------------------- post-processing


def finish(items: list[Item], out: Collected, baseline: str | None = None) -> list[dict]:
    """Rows in plan order (merged over the worker processes) with GFLOP/s, peak fraction and the
    ratio to the baseline (`baseline_of`). A merged row keeps its `samples` (processes -> rounds ->
    seconds) for the verdicts; the reports write only the `records.Row` fields."""
    rows = []
    for it in items:
        row = merge_rows(out.rows[it.id])
        rows.append(apply_peak(row, pass_flops(it.case, it.pass_), device_peak(out.peaks, it.case.dtype)))
    _ratios(items, rows, baseline)
    return rows


def group_interference(out: Collected, ids: set, cores: int | None) -> list[str]:
    """What the interference probes of the worker processes that ran these items saw, by process."""
    texts = []
    for rec in out.probes:
        if ids & set(rec["items"]):
            texts += [f"worker process {rec['process'] + 1}: {t}"
                      for t in measure_interference(rec["probes"], cores, rec.get("threads") or 1)]
    return list(dict.fromkeys(texts))


def run_notes(out: Collected, cores: int | None) -> list[str]:
    """What the worker processes' probes saw that is reported without vetoing (`measure.interference_notes`)."""
    texts = [f"worker process {rec['process'] + 1}: {t}" for rec in out.probes
             for t in interference_notes(rec["probes"], cores, rec.get("threads") or 1)]
    return list(dict.fromkeys(texts))


def finish_verdicts(cfg: RunConfig, items: list[Item], rows: list[dict], out: Collected, interference=(),
                    cores: int | None = None) -> list[dict]:
    """One verdict per (case, pass) that timed two implementations, from the samples of every worker
    process (`verdict.compute`); conclusive only where both rows are measured and neither the run
    (`interference`, the parent's checks) nor the rounds of its workers saw interference."""
    groups: dict = {}
    for it, row in zip(items, rows):
        groups.setdefault((it.case.label, it.pass_), []).append((it, row))
    vs = []
    for (label, pass_), members in groups.items():
        timed = {it.id: (it, row) for it, row in members if row.get("samples") and row.get("median_s")}
        usable = timed if cfg.verdict else {i: m for i, m in timed.items() if m[1]["status"] in MEASURED}
        if not cfg.verdict:  # a row doing less backward work is not ranked against one doing more
            same = verdicts.same_work({i: row.get("param_grads") for i, (_, row) in usable.items()})
            usable = {i: m for i, m in usable.items() if i in same}
        keys = {i: str(Key.of(it.impl)) for i, (it, _) in usable.items()}
        pair = verdicts.choose_pair(keys, {i: it.impl.framework for i, (it, _) in usable.items()},
                                    {i: row["median_s"] for i, (_, row) in usable.items()}, cfg.verdict)
        if pair is None:
            continue
        (a, ra), (b, rb) = ((keys[s], usable[s][1]["samples"]) for s in pair)
        n = min(len(ra), len(rb))
        v = verdicts.compute(label, pass_, a, ra[:n], b, rb[:n], paired=cfg.interleave)
        texts = [*interference, *group_interference(out, {it.id for it, _ in members}, cores)]
        vs.append(verdicts.finalize(v, {str(Key.of(it.impl)): row for it, row in members}, texts))
    return vs


def device_peak(peaks: list, dtype: str) -> float | None:
    """The device's peak for a dtype: the best matmul rate any worker of either framework reached.

    One peak per device and dtype, not per framework: a framework with a slower
    matmul must not get a lower bar, and every peak_fraction reads on one scale.
    """
    rates = [rec["gflops"] for rec in peaks if rec["dtype"] == dtype and rec.get("gflops")]
    return max(rates) if rates else None


# The default baseline of the ratio column, the first of these measured in the (case, pass); else
# the first measured row in plan order.
BASELINE_ORDER = ("ours-torch:eager:fused", "ours-jax:jit:fused", "ours-torch:eager:weights", "ours-jax:jit:weights")


def baseline_of(keys_measured: list[str], baseline: str | None = None) -> str | None:
    """The implementation key a (case, pass)'s ratios are taken against: `baseline` (--baseline) if
    measured there, else the first of BASELINE_ORDER measured, else the first measured."""
    for key in (baseline, *BASELINE_ORDER):
        if key in keys_measured:
            return key
    return keys_measured[0] if keys_measured else None


def _ratios(items, rows, baseline: str | None = None) -> None:
    """ratio = median / the baseline's median in the same (case, pass) (`baseline_of`), named in
    the row's `baseline`; a baseline is a measured row (ok or noisy: an error row's time is not trusted).

    Rows flagged `error` after timing keep a ratio too (shown marked), against the baseline. A fwd+bwd row
    that does other backward work than the baseline (`param_grads` differs) has no ratio: its message
    says why (`spec.NO_PARAM_GRADS`)."""
    groups: dict = {}
    for it, row in zip(items, rows):
        groups.setdefault((it.case, it.pass_), []).append(row)
        if row.get("param_grads") is False and row["status"] != "skip":
            row["message"] = "; ".join(m for m in (row.get("message"), NO_PARAM_GRADS) if m)
    for members in groups.values():
        measured = {str(Key.of_row(r)): r.get("param_grads") for r in members if r["status"] in MEASURED and r.get("median_s")}
        same = verdicts.same_work(measured)  # by default, a row doing the most backward work
        key = baseline_of([k for k in measured if k in same or k == baseline], baseline)
        if key is None:
            continue
        base_row = next(r for r in members if str(Key.of_row(r)) == key)
        for row in members:
            if row.get("param_grads") != base_row.get("param_grads"):
                continue
            if row["status"] in ("ok", "noisy", "error") and row.get("median_s"):
                row["ratio"], row["baseline"] = row["median_s"] / base_row["median_s"], key


def bench_environment(cfg: RunConfig, out: Collected) -> dict:
    """The shared environment block (parity.env) plus what this benchmark run measured and chose."""
    base = environment()
    return {
        "python": base["python"],
        "versions": {p: base[p] for p in PACKAGES},
        "platform": base["platform"],
        "cpu_model": base["cpu_model"],
        "cpu_count": base["cpu_count"],
        "memory_total_bytes": psutil.virtual_memory().total,
        "device": cfg.device,
        "device_absent": cfg.plan.skip_reason or None,
        "device_plan": cfg.plan.to_dict(),
        "device_names": {fw: {k: v for k, v in e.items() if k.endswith("_device")} for fw, e in out.envs.items()},
        "threads_requested": cfg.threads,
        "threads": {fw: len(e.get("cpus", [])) for fw, e in out.envs.items()},
        "thread_settings": {
            "env": worker_settings(), "affinity_cpus": {fw: e.get("cpus") for fw, e in out.envs.items()},
            "torch_threads": out.envs.get("torch", {}).get("torch_threads"),
            "xla_threads": "the process's CPU affinity (XLA sizes its pools from it)",
        },
        "precision": cfg.precision,
        "precision_settings": {
            fw: {k: v for k, v in e.items() if "precision" in k} for fw, e in out.envs.items()
        },
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "inductor_env": {k: v for k, v in os.environ.items() if k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE"))},
        "inductor_config": out.envs.get("torch", {}).get("torch_inductor"),
        "inductor_cache": "fresh per worker (cold compiles)",
        "isolation": cfg.isolation,
        "interleaved": cfg.interleave,
        "paired": cfg.interleave,
        "processes": cfg.processes,
        "verdict_rule": {"ci_level": verdicts.CI_LEVEL, "ci_target": verdicts.CI_TARGET, "min_rounds": verdicts.MIN_ROUNDS,
                         "min_processes": verdicts.MIN_PROCESSES, "noisy_iqr": NOISY_IQR,
                         "statistic": "median of paired log(time ratio); hierarchical percentile bootstrap over "
                         "worker processes, rounds and pairs"},
        "preset": cfg.preset.name,
        "timing": asdict(cfg.timing),
        "peaks": [
            {"dtype": dt, "gflops": device_peak(out.peaks, dt)} for dt in sorted({p["dtype"] for p in out.peaks})
        ],
        "peak_measurements": out.peaks,
        "flops_formula": FLOPS_FORMULA,
        "unavailable": {fw: e.get("unavailable") for fw, e in out.envs.items() if e.get("unavailable")},
    }
