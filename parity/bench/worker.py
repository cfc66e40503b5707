"""The subprocess that runs one group of items of one framework.

    python -m parity.bench.worker SPEC.json

SPEC holds the framework, device, threads, precision, seed, timing, the matmul
peaks to measure and the items. Results go to stdout as tagged JSON lines, one
per event, flushed at once, so that the parent keeps every finished row even if
this process is killed (out of memory) half-way:

    @@ENV <json>    @@PEAK <json>    @@START <item id>    @@ROW <json>

A row whose rate beats the best matmul peak known so far triggers a fresh peak
measurement before the row is sent (`PeakBar`): the parent judges every row
against the best of all the run's measurements.

A failing item becomes an `error` row and the loop goes on. By default all the
implementations of one (case, pass) are timed round-robin (`measure.run_interleaved`)
so that load drift on a shared machine hits them alike.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from parity.bench.measure import pin_threads, run_bench, run_interleaved
from parity.bench.spec import IMPLS, PEAK_TIMING, BenchCase, Timing, empty_row, pass_flops
from parity.impls import load_user_impl

TAG = "@@"


def emit(kind: str, payload) -> None:
    sys.stdout.write(f"{TAG}{kind}\t{json.dumps(payload)}\n")
    sys.stdout.flush()


def error_message(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    head = lines[0] if lines else ""
    return f"{type(e).__name__}: {head}"[:500]


def run_item(mod, impl, case: BenchCase, pass_: str, device: str, seed: int, timing: Timing, clock) -> dict:
    """Build, time, probe memory and fingerprint one item; exceptions become an error row."""
    row = empty_row(impl, case, pass_, device=device)
    try:
        bench = mod.build(impl, case, pass_, device, seed)
        row["kernel"] = bench.kernel
        row.update(run_bench(bench, timing, clock))
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - any failure of one item is recorded, the sweep goes on
        row.update(status="error", message=error_message(e))
        traceback.print_exc(file=sys.stderr)
    return row


def run_group_interleaved(mod, group, device: str, seed: int, timing: Timing, clock):
    """All implementations of one (case, pass), timed round-robin (see measure.run_interleaved)."""
    rows, benches, slots = {}, [], []
    for item_id, impl, case, pass_ in group:
        rows[item_id] = empty_row(impl, case, pass_, device=device)
        try:
            benches.append(mod.build(impl, case, pass_, device, seed))
            rows[item_id]["kernel"] = benches[-1].kernel
            slots.append(item_id)
        except Exception as e:  # noqa: BLE001
            rows[item_id].update(status="error", message=error_message(e))
            traceback.print_exc(file=sys.stderr)
    results = run_interleaved(benches, timing, clock, on_prepare=lambda i: emit("START", slots[i]))
    for item_id, res in zip(slots, results):
        row = rows[item_id]
        try:
            if isinstance(res, Exception):
                raise res
            row.update(res)
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            row.update(status="error", message=error_message(e))
            traceback.print_exception(e, file=sys.stderr)
    del benches  # free this group's inputs and executables before the next
    return [(item_id, rows[item_id]) for item_id, *_ in group]


class PeakBar:
    """The best matmul rate this worker knows per dtype; re-measured when a row beats it.

    A rate above the device's peak cannot be real, but on a loaded machine the peak taken
    at start-up may have caught a burst of load while a later item ran in a quiet moment.
    So before the parent demotes such a row to `error` (measure.apply_peak, against the
    best of every measurement of the run), the worker measures the peak again right then.
    At most MAX_REMEASURES per dtype: a real bug (a missing sync) must not cost one per row.

    The re-measure adds a square matmul of the row's own FLOP count to the preset's sizes.
    Measured under load 9-10 on 2 cores: the 1024-2048 matmuls (10-90 ms a call) peaked at
    32-118 GFLOP/s because a call that long is almost always preempted, while 1-4 ms items
    ran at 125-147 between preemptions; a matmul as short as the item sees the same windows.
    """

    MAX_REMEASURES = 3

    def __init__(self, mod, framework: str, device: str, peaks: list[dict], known: list[dict], clock):
        self.mod, self.framework, self.device, self.clock = mod, framework, device, clock
        self.sizes = {p["dtype"]: p["sizes"] for p in peaks}
        self.best: dict[str, float] = {}
        for rec in known:
            self._raise_bar(rec)
        self.remeasured: dict[str, int] = {}

    def _raise_bar(self, rec: dict) -> None:
        if rec.get("gflops"):
            self.best[rec["dtype"]] = max(self.best.get(rec["dtype"], 0.0), rec["gflops"])

    def measure(self, dtype: str, reason: str | None = None, extra_size: int | None = None) -> None:
        sizes = sorted({*self.sizes[dtype], extra_size} - {None})
        try:
            rate, n = self.mod.peak_gflops(dtype, sizes, self.device, PEAK_TIMING, self.clock)
            rec = {"framework": self.framework, "dtype": dtype, "gflops": rate, "size": n}
        except Exception as e:  # noqa: BLE001
            rec = {"framework": self.framework, "dtype": dtype, "gflops": None, "error": error_message(e)}
        if reason:
            rec["remeasured_for"] = reason
        emit("PEAK", rec)
        self._raise_bar(rec)

    def vet(self, rows: list[tuple[int, dict]]) -> None:
        """Re-measure once per dtype if any of these rows' rates is above the bar."""
        worst: dict[str, tuple[float, int, int]] = {}
        for item_id, row in rows:
            if row.get("status") != "ok" or not row.get("median_s"):
                continue
            case = BenchCase(**{k: row[k] for k in ("batch", "seq_q", "seq_k", "embed", "heads", "dtype")})
            flops = pass_flops(case, row["pass"])
            rate = flops / row["median_s"] / 1e9
            bar = self.best.get(case.dtype)
            if bar is not None and rate > bar and rate > worst.get(case.dtype, (0.0,))[0]:
                worst[case.dtype] = (rate, item_id, flops)
        for dtype, (rate, item_id, flops) in worst.items():
            if dtype in self.sizes and self.remeasured.get(dtype, 0) < self.MAX_REMEASURES:
                self.remeasured[dtype] = self.remeasured.get(dtype, 0) + 1
                self.measure(dtype, reason=f"item {item_id}: {rate:.1f} GFLOP/s > {self.best[dtype]:.1f}",
                             extra_size=matched_size(flops))


def matched_size(flops: int) -> int:
    """The square matmul size (a multiple of 64, at least 64) that does about `flops`: 2·n³ ≈ flops."""
    return max(64, round((flops / 2) ** (1 / 3) / 64) * 64)


def run_items(mod, spec: dict, items, timing: Timing, clock):
    """Yield the rows of each timing group: one item at a time, or one (case, pass) round-robin."""
    device, seed = spec["device"], spec["seed"]
    if not spec.get("interleave", True):
        for item_id, impl, case, pass_ in items:
            emit("START", item_id)
            mod.reset_compiled()
            yield [(item_id, run_item(mod, impl, case, pass_, device, seed, timing, clock))]
        return
    groups: dict = {}
    for item in items:
        groups.setdefault((item[2], item[3]), []).append(item)
    for group in groups.values():
        mod.reset_compiled()
        yield run_group_interleaved(mod, group, device, seed, timing, clock)


def setup(spec: dict, cpus: list[int]):
    """Import the framework's implementation module and configure it: (module, env report)."""
    fw, device = spec["framework"], spec["device"]
    if fw == "torch":
        from parity.bench import impl_torch as mod

        env = mod.setup(device, len(cpus), spec["precision"])
    elif fw == "jax":
        from parity.bench import impl_jax as mod

        env = mod.setup(device, spec["precision"])
    else:
        raise ValueError(f"unknown framework {fw!r}")
    env["cpus"] = cpus
    env["unavailable"] = mod.check_device(device)
    return mod, env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    cpus = pin_threads(spec.get("threads"))  # before any framework sizes its thread pools
    mod, env = setup(spec, cpus)
    fw, device, reason = spec["framework"], spec["device"], env["unavailable"]
    emit("ENV", {"framework": fw, **env})
    user = [i for s in spec.get("user_impls", []) for i in load_user_impl(s)]
    impls = {im.bench_key: im for im in (*IMPLS, *user)}
    items = [(item["id"], impls[item["impl"]], BenchCase(**item["case"]), item["pass"]) for item in spec["items"]]
    if reason:
        for item_id, impl, case, pass_ in items:
            emit("START", item_id)
            emit("ROW", {"id": item_id, **empty_row(impl, case, pass_, device=device, status="skip", message=reason)})
        return 0
    clock = time.perf_counter
    bar = PeakBar(mod, fw, device, spec.get("peaks", []), spec.get("known_peaks", []), clock)
    for peak in spec.get("peaks", []):
        bar.measure(peak["dtype"])
    for rows in run_items(mod, spec, items, Timing(**spec["timing"]), clock):
        bar.vet(rows)
        for item_id, row in rows:
            emit("ROW", {"id": item_id, **row})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
