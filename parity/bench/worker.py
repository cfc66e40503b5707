"""The subprocess that times a group of items, torch and JAX alike, in one process.

    python -m parity.bench.worker < SPEC.json

SPEC (read from stdin, so no file is left behind) holds the device plan the parent
resolved (`parity.devices.DevicePlan.to_dict`: each framework's device is read off it), threads,
precision, seed, timing, the matmul peaks to measure and the items (`sweep.Item.to_json`: an
implementation's `records.Key`, a `records.Case` and a pass, each as its JSON). `main` turns the plan,
each key and each case back into objects once and hands those objects on. Results go to
stdout as tagged JSON lines, one per event, flushed at once, so that the parent keeps
every finished row even if this process is killed (out of memory) half-way:

    @@ENV <json>    @@PEAK <json>    @@START <item id>    @@ROW <json>    @@PROBES <json>

Both frameworks are loaded here when the items need both, so that the implementations
of one (case, pass) — torch and JAX together — are timed round-robin and every round
gives paired samples (`measure.sample`, `verdict`); each row carries its raw samples, by
round, and the interference probe's record of every round follows the group's rows: the
parent computes the verdict over all the worker processes of the case. Before timing, every implementation's
output is compared with a reference's, ours when present, else the first (`OutputCheck`): a
mismatch is an `error` row. A row whose rate beats the best matmul peak known so far triggers a fresh peak
measurement before the row is sent (`PeakBar`).

SIGINT is ignored: a Ctrl-C at the terminal reaches the whole process group, and the
parent, which owns the partial report, ends this process itself.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import time
import traceback

import numpy as np

from parity import kernel_ran
from parity.bench import verdict
from parity.bench.measure import (
    InterferenceProbe, flat, pin_threads, prepare, same_gradients, same_output, sample, summary,
)
from parity.bench.records import Case, Key, empty_row
from parity.bench.spec import IMPLS, PEAK_TIMING, BenchCase, Timing, framework_device, pass_flops
from parity.devices import DevicePlan
from parity.implementation import FRAMEWORKS
from parity.impls import load_user_impl

TAG = "@@"
# Which implementation's output the others are compared with, when present (else the first).
REFERENCE_ORDER = ("ours-torch:eager:weights", "ours-torch:eager:fused", "ours-jax:jit:weights")


def emit(kind: str, payload) -> None:
    sys.stdout.write(f"{TAG}{kind}\t{json.dumps(payload)}\n")
    sys.stdout.flush()


def error_message(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    head = lines[0] if lines else ""
    return f"{type(e).__name__}: {head}"[:500]


class OutputCheck:
    """Every implementation's output, and on fwd+bwd its gradients, against the reference's
    (`measure.same_output`, `measure.same_gradients`), compared as soon as the reference is known, so
    that at most the reference's arrays are kept: the reference is the first of REFERENCE_ORDER present,
    else the first implementation with an output."""

    def __init__(self, keys: dict[int, str], dtype: str, precision: str, bias_terms: int | None = None):
        order = list(keys)
        self.keys, self.dtype, self.precision, self.bias_terms = keys, dtype, precision, bias_terms
        self.rank = {s: (REFERENCE_ORDER.index(k) if k in REFERENCE_ORDER else len(REFERENCE_ORDER), order.index(s))
                     for s, k in keys.items()}
        self.pending = set(keys)  # slots whose output may still come
        self.held: dict[int, tuple] = {}  # slot -> (output, gradients or None)
        self.ref: int | None = None
        self.diffs: dict[int, float | None] = {}
        self.grad_diffs: dict[int, float | None] = {}
        self.mismatch: dict[int, str] = {}

    def add(self, slot: int, output, gradients: dict | None = None) -> None:
        """`slot` is prepared (output None: it has none, or it failed; gradients: fwd+bwd's, by name)."""
        self.pending.discard(slot)
        if output is not None:
            self.held[slot] = (output, gradients)
        self._compare()

    def _compare(self) -> None:
        if self.ref is None:
            best = min(self.held, key=self.rank.get, default=None)
            if best is None or any(self.rank[s] < self.rank[best] for s in self.pending):
                return  # a better-ranked reference may still come
            self.ref = best
        ref_out, ref_grads = self.held[self.ref]
        for s in [s for s in self.held if s != self.ref]:
            out, grads = self.held.pop(s)
            try:
                diff, why = same_output(out, ref_out, self.dtype, self.precision)
            except Exception as e:  # noqa: BLE001 - an output that cannot be compared is this item's failure
                diff, why = None, f"its output could not be compared: {error_message(e)}"
            self.diffs[s] = diff
            if grads is not None and ref_grads is not None:
                try:
                    self.grad_diffs[s], grad_why = same_gradients(grads, ref_grads, self.dtype, self.precision,
                                                                  self.bias_terms)
                except Exception as e:  # noqa: BLE001 - as above
                    self.grad_diffs[s], grad_why = None, f"its gradients could not be compared: {error_message(e)}"
                why = "; ".join(w for w in (why, grad_why) if w) or None
            if why:
                self.mismatch[s] = f"not the same computation as {self.keys[self.ref]}: {why}"

    def done(self) -> None:
        self.held.clear()  # the reference's array too: free before timing


def read_mask_path(bench) -> str | None:
    """The row's `mask_path` (`spec.MASK_PATHS`) from a prepared bench; None where it has no reading, or the
    reading failed (a diagnosis: its failure must not lose the measured row; the traceback goes to stderr)."""
    if bench.mask_path is None:
        return None
    try:
        return bench.mask_path()
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        return None


def prepare_group(mods: dict, group, plan: DevicePlan, seed: int, timing: Timing, clock, check: OutputCheck):
    """Build and prepare every implementation of one (case, pass) (`measure.prepare`), read what ran and how
    its mask came, and check its output and gradients (`check`). Returns (rows by item id, benches and their
    `Prepared` by item id for those that are ready to time, kernel notes "requested X, ran Y" by item id)."""
    rows, benches, prepared, notes = {}, {}, {}, {}
    for item_id, impl, case, pass_ in group:
        device = framework_device(impl.framework, plan)
        rows[item_id] = empty_row(impl, case, pass_, device=device)
        emit("START", item_id)
        try:
            bench = mods[impl.framework].build(impl, case, pass_, device, seed)
            rows[item_id]["kernel"] = kernel_ran.row_kernel(bench.kernel)[0]  # the request, should prepare fail
            prepared[item_id] = prepare(bench, timing, clock)
            benches[item_id] = bench
            # What ran, read off the compiled program or the profiled output call of `prepare`, untimed.
            rows[item_id]["kernel"], notes[item_id] = kernel_ran.row_kernel(bench.kernel)
            rows[item_id]["mask_path"] = read_mask_path(bench)
        except Exception as e:  # noqa: BLE001 - any failure of one item is recorded, the group goes on
            rows[item_id].update(status="error", message=error_message(e))
            traceback.print_exc(file=sys.stderr)
        output = gradients = None
        if item_id in prepared:
            output, gradients = prepared[item_id].output, prepared[item_id].gradients
            prepared[item_id].output = prepared[item_id].gradients = None  # the check holds what it needs
        check.add(item_id, output, gradients)
    check.done()
    for s, diff in check.diffs.items():
        rows[s]["out_max_diff"] = diff
    for s, diff in check.grad_diffs.items():
        rows[s]["grad_rel_diff"] = diff
    return rows, benches, prepared, notes


def time_group(mods: dict, group, spec: dict, timing: Timing, clock, probe=None, plan: DevicePlan | None = None):
    """All implementations of one (case, pass): build, check outputs, time, summarise.

    group: [(item id, Implementation, BenchCase, pass)]; plan: the run's device plan (`main` reads it
    once per process; None: read from spec["device"], for a caller that runs one group).
    Returns ([(item id, row)], [the interference probe's record of each round]); each timed row
    carries its raw `samples` (rounds of seconds), from which the parent computes the verdict
    over every worker process of the case."""
    precision, interleave, named = spec["precision"], spec.get("interleave", True), spec.get("verdict")
    keys = {item_id: str(Key.of(impl)) for item_id, impl, _, _ in group}
    fws = {item_id: impl.framework for item_id, impl, _, _ in group}
    case, pass_ = group[0][2], group[0][3]
    check = OutputCheck(keys, case.dtype, precision, case.bias_terms)
    plan = DevicePlan.from_dict(spec["device"]) if plan is None else plan
    rows, benches, prepared, notes = prepare_group(mods, group, plan, spec["seed"], timing, clock, check)
    mismatch = check.mismatch
    work = {s: impl.uses_params if pass_ == "fwd+bwd" else None for s, impl, _, _ in group}
    ranked = set(work) if named else verdict.same_work(work)  # `spec.NO_PARAM_GRADS`

    def settled(rounds):
        medians = {s: float(np.median(flat(r))) for s, r in rounds.items() if s not in mismatch and s in ranked and r}
        pair = verdict.choose_pair(keys, fws, medians, named)
        if pair is None:
            return False
        a, b = pair
        v = verdict.compute(case.label, pass_, keys[a], [rounds[a]], keys[b], [rounds[b]], paired=True)
        return verdict.settled(v)

    if probe is not None:
        probe.start()
    rounds, errors, probes = sample(benches, timing, clock, interleave, settled if interleave else None, probe)
    for s, bench in benches.items():
        res = errors.get(s) or summary(bench, prepared[s], flat(rounds[s]), clock)
        if isinstance(res, Exception):
            rows[s].update(status="error", message=error_message(res))
            traceback.print_exception(res, file=sys.stderr)
            continue
        res.pop("samples"), res.pop("output")
        rows[s].update(res, samples=rounds[s], rounds=len(rounds[s]), processes=1)
        if notes.get(s) and not rows[s].get("message"):
            rows[s]["message"] = notes[s]
        if s in mismatch:
            rows[s].update(status="error", message=mismatch[s])
    return [(item_id, rows[item_id]) for item_id, *_ in group], probes


class PeakBar:
    """The best matmul rate this worker knows per dtype; re-measured when a row beats it.

    A rate above the device's peak cannot be real, but on a loaded machine the peak taken
    at start-up may have caught a burst of load while a later item ran in a quiet moment.
    So before the parent demotes such a row to `error` (measure.apply_peak, against the
    best of every measurement of the run), the worker measures the peak again right then,
    with every framework it has loaded. At most MAX_REMEASURES per dtype: a real bug (a
    missing sync) must not cost one per row.

    The re-measure adds a square matmul of the row's own FLOP count to the preset's sizes.
    Measured under load 9-10 on 2 cores: the 1024-2048 matmuls (10-90 ms a call) peaked at
    32-118 GFLOP/s because a call that long is almost always preempted, while 1-4 ms items
    ran at 125-147 between preemptions; a matmul as short as the item sees the same windows.
    """

    MAX_REMEASURES = 3

    def __init__(self, mods: dict, devices: dict, peaks: list[dict], known: list[dict], clock):
        self.mods, self.devices, self.clock = mods, devices, clock
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
        for fw, mod in self.mods.items():
            try:
                rate, n = mod.peak_gflops(dtype, sizes, self.devices[fw], PEAK_TIMING, self.clock)
                rec = {"framework": fw, "dtype": dtype, "gflops": rate, "size": n}
            except Exception as e:  # noqa: BLE001
                rec = {"framework": fw, "dtype": dtype, "gflops": None, "error": error_message(e)}
            if reason:
                rec["remeasured_for"] = reason
            emit("PEAK", rec)
            self._raise_bar(rec)

    def vet(self, rows: list[tuple[int, dict]], cases: dict[int, BenchCase] | None = None) -> None:
        """Re-measure once per dtype if any of these rows' rates is above the bar. cases: item id ->
        its case, as the worker already holds it (None: each read from its row's fields)."""
        worst: dict[str, tuple[float, int, int]] = {}
        for item_id, row in rows:
            if row.get("status") not in ("ok", "noisy") or not row.get("median_s"):
                continue
            case = cases[item_id] if cases is not None else BenchCase.from_fields(row)
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


def groups(items) -> list[list]:
    """The items by (case, pass), in plan order: each group is timed together."""
    out: dict = {}
    for item in items:
        out.setdefault((item[2], item[3]), []).append(item)
    return list(out.values())


def setup(framework: str, device: str, spec: dict, cpus: list[int], compiles: bool):
    """Import one framework's implementation module and configure it for `device`: (module, env report).
    compiles: a torch.compile implementation is among the items."""
    if framework == "torch":
        from parity.bench import torch_bench as mod

        env = mod.setup(device, len(cpus), spec["precision"], compiles)
    elif framework == "jax":
        from parity.bench import jax_bench as mod

        env = mod.setup(device, spec["precision"])
    else:
        raise ValueError(f"unknown framework {framework!r}")
    env["cpus"] = cpus
    env["unavailable"] = mod.check_device(device)
    return mod, env


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends this process (module docstring)
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        with open(argv[0]) as f:
            spec = json.load(f)
    else:
        spec = json.load(sys.stdin)
    cpus = pin_threads(spec.get("threads"))  # before any framework sizes its pools
    user = [i for s in spec.get("user_impls", []) for i in load_user_impl(s)]
    known = (*IMPLS, *user)
    items = [(item["id"], Key.from_json(item["impl"]).find(known), Case.from_json(item["case"]), item["pass"])
             for item in spec["items"]]
    plan = DevicePlan.from_dict(spec["device"])
    mods, devices = {}, {}
    for fw in sorted({impl.framework for _, impl, _, _ in items}, key=FRAMEWORKS.index):
        devices[fw] = framework_device(fw, plan)
        mod, env = setup(fw, devices[fw], spec, cpus, compiles=any(impl.mode == "compile" for _, impl, _, _ in items))
        emit("ENV", {"framework": fw, **env})
        if env["unavailable"]:
            for item_id, impl, case, pass_ in items:
                if impl.framework == fw:
                    emit("START", item_id)
                    emit("ROW", {"id": item_id, **empty_row(impl, case, pass_, device=devices[fw], status="skip",
                                                            message=env["unavailable"])})
            continue
        mods[fw] = mod
    items = [it for it in items if it[1].framework in mods]
    # What the imports made lives as long as the process: out of the collector's sight, the full
    # collection before every memory probe (`measure.CpuPeakRss`) takes milliseconds, not ~0.5 s.
    gc.freeze()
    clock = time.perf_counter
    bar = PeakBar(mods, devices, spec.get("peaks", []), spec.get("known_peaks", []), clock)
    for peak in spec.get("peaks", []):
        bar.measure(peak["dtype"])
    timing = Timing(**spec["timing"])
    probe = InterferenceProbe(clock)
    for group in groups(items):
        for mod in mods.values():
            mod.reset_compiled()
        rows, probes = time_group(mods, group, spec, timing, clock, probe, plan)
        bar.vet(rows, {item_id: case for item_id, _, case, _ in group})
        for item_id, row in rows:
            emit("ROW", {"id": item_id, **row})
        emit("PROBES", {"items": [item_id for item_id, _ in rows], "probes": probes, "threads": len(cpus)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
