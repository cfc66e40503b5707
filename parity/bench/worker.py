"""The subprocess that runs one group of items of one framework.

    python -m parity.bench.worker SPEC.json

SPEC holds the framework, device, threads, precision, seed, timing, the matmul
peaks to measure and the items. Results go to stdout as tagged JSON lines, one
per event, flushed at once, so that the parent keeps every finished row even if
this process is killed (out of memory) half-way:

    @@ENV <json>    @@PEAK <json>    @@START <item id>    @@ROW <json>

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
from parity.bench.spec import IMPLS, PEAK_TIMING, Case, Timing, empty_row

TAG = "@@"


def emit(kind: str, payload) -> None:
    sys.stdout.write(f"{TAG}{kind}\t{json.dumps(payload)}\n")
    sys.stdout.flush()


def error_message(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    head = lines[0] if lines else ""
    return f"{type(e).__name__}: {head}"[:500]


def run_item(mod, impl, case: Case, pass_: str, device: str, seed: int, timing: Timing, clock) -> dict:
    """Build, time, probe memory and fingerprint one item; exceptions become an error row."""
    row = empty_row(impl, case, pass_, device=device)
    try:
        bench = mod.build(impl, case, pass_, device, seed)
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    cpus = pin_threads(spec.get("threads"))  # before any framework sizes its thread pools
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
    reason = mod.check_device(device)
    env["unavailable"] = reason
    emit("ENV", {"framework": fw, **env})
    timing = Timing(**spec["timing"])
    clock = time.perf_counter
    impls = {im.key: im for im in IMPLS}
    for peak in spec.get("peaks", []):
        if reason:
            break
        try:
            rate, n = mod.peak_gflops(peak["dtype"], peak["sizes"], device, PEAK_TIMING, clock)
            emit("PEAK", {"framework": fw, "dtype": peak["dtype"], "gflops": rate, "size": n})
        except Exception as e:  # noqa: BLE001
            emit("PEAK", {"framework": fw, "dtype": peak["dtype"], "gflops": None, "error": error_message(e)})
    items = [(item["id"], impls[item["impl"]], Case(**item["case"]), item["pass"]) for item in spec["items"]]
    if reason:
        for item_id, impl, case, pass_ in items:
            emit("START", item_id)
            emit("ROW", {"id": item_id, **empty_row(impl, case, pass_, device=device, status="skip", message=reason)})
        return 0
    if not spec.get("interleave", True):
        for item_id, impl, case, pass_ in items:
            emit("START", item_id)
            mod.reset_compiled()
            row = run_item(mod, impl, case, pass_, device, spec["seed"], timing, clock)
            emit("ROW", {"id": item_id, **row})
        return 0
    groups: dict = {}
    for item in items:
        groups.setdefault((item[2], item[3]), []).append(item)
    for group in groups.values():
        mod.reset_compiled()
        for item_id, row in run_group_interleaved(mod, group, device, spec["seed"], timing, clock):
            emit("ROW", {"id": item_id, **row})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
