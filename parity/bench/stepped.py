"""The timing of `mha-bench latent` and `mha-bench --decode`: worker processes, one after the other, each
timing every implementation of a pass round-robin (`measure.sample`, the interference probe at each round's
end), after holding each one's output to the float64 oracle; then rows over all processes' samples and a
verdict for every pair of a pass (`verdict.compute`, its hierarchical interval; `verdict.finalize`'s rules).

Framework-free. A run is a spec object with: passes, processes, threads, budget_s, to_json(), keys(pass_) ->
[(key, framework, form)], label(pass_); and its module, which the worker process imports (`python -m
<module> --worker`), provides `work(spec)` built on `work_passes` here.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import Callable

from parity.bench import verdict as verdicts
from parity.bench.spec import Timing

TIMING = Timing(warmup=2, min_repeats=12, max_repeats=400, budget_s=1.0, round_repeats=4)


def timing_of(budget_s: float) -> Timing:
    return TIMING if budget_s == TIMING.budget_s else Timing(**{**asdict(TIMING), "budget_s": budget_s})


def work_passes(spec, bench_of: Callable, reference_of: Callable, check: Callable) -> dict:
    """One worker process's samples: for each pass, every implementation built (`bench_of(key, framework, form,
    pass_) -> (measure.Bench, row fields)`), prepared, its output checked (`check(pass_, prepared, reference) ->
    (max |diff|, why not or None)` against `reference_of(pass_)`), then the checked ones timed round-robin.
    {"rows": [...], "probes": {pass: [...]}, "threads": n}; a row's "rounds" are its samples (seconds). A row
    that raised, or computes something else than the oracle, is an error row and is not timed (timing it would
    compare unequal work)."""
    from parity.bench import measure
    from mha_spec import allocator

    measure.pin_threads(spec.threads)
    allocator.pin_this_process()
    timing = timing_of(spec.budget_s)
    rows, probes = [], {}
    for pass_ in spec.passes:
        ref = reference_of(pass_)
        benches, row_of = {}, {}
        for key, fw, form in spec.keys(pass_):
            row = {"impl": key, "framework": fw, "form": form, "pass": pass_, "status": "ok", "message": None,
                   "compile_s": None, "out_max_diff": None, "rounds": []}
            rows.append(row)
            try:
                bench, fields = bench_of(key, fw, form, pass_)
                row.update(fields)
                prepared = measure.prepare(bench, timing, measure.time.perf_counter)
                row["compile_s"] = prepared.compile_s
                row["out_max_diff"], why = check(pass_, prepared, ref)
            except Exception as e:  # noqa: BLE001 - the row says what failed
                row["status"], row["message"] = "error", f"{type(e).__name__}: {e}"[:400]
                continue
            if why is not None:
                row["status"], row["message"] = "error", f"not the oracle's result: {why}"
                continue
            benches[len(benches)], row_of[len(row_of)] = bench, row
        rounds, errors, probes[pass_] = measure.sample(benches, timing, probe=measure.InterferenceProbe())
        for i, row in row_of.items():
            row["rounds"] = rounds[i]
            if i in errors:
                row["status"], row["message"] = "error", f"{type(errors[i]).__name__}: {errors[i]}"[:400]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"rows": rows, "probes": probes, "threads": threads}


def spawn(module: str, spec) -> dict:
    """One worker process (`python -m <module> --worker`, the spec's JSON on stdin), its JSON result."""
    proc = subprocess.run([sys.executable, "-m", module, "--worker"], input=json.dumps(spec.to_json()),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def combine(spec, results: list[dict], derive: Callable[[dict], None] = lambda row: None) -> dict:
    """The run's rows (each implementation's samples over every process, `derive(row)` adding what follows
    from its median) and verdicts (every pair of a pass), and the interference each pass saw."""
    from parity.bench import measure

    cores = os.cpu_count()
    rows = []
    for i, first in enumerate(results[0]["rows"]):
        per_proc = [r["rows"][i] for r in results]
        failed = next((r for r in per_proc if r["status"] == "error"), None)
        row = {k: v for k, v in first.items() if k != "rounds"}
        row["samples"] = [r["rounds"] for r in per_proc]  # processes -> rounds -> seconds
        row["out_max_diff"] = max((r["out_max_diff"] for r in per_proc if r["out_max_diff"] is not None), default=None)
        if failed is not None:
            row.update(status="error", message=failed["message"], samples=[])
        else:
            stats = measure.summarize([t for p in row["samples"] for rd in p for t in rd])
            row.update(median_s=stats.median_s, iqr_s=stats.iqr_s, min_s=stats.min_s, repeats=stats.repeats,
                       status="noisy" if stats.noise() else "ok", message=stats.noise())
            derive(row)
        rows.append(row)
    interference = {p: [n for r in results for n in measure.interference(r["probes"].get(p, []), cores, r["threads"])]
                    for p in spec.passes}
    found = []
    for pass_ in spec.passes:
        timed = [r for r in rows if r["pass"] == pass_ and r["samples"]]
        by_key = {r["impl"]: r for r in rows if r["pass"] == pass_}
        for a, b in itertools.combinations(timed, 2):
            v = verdicts.compute(spec.label(pass_), pass_, a["impl"], a["samples"], b["impl"], b["samples"])
            found.append(verdicts.finalize(v, by_key, interference[pass_]))
    return {"rows": rows, "verdicts": found, "interference": interference}


def run(spec, spawn_worker: Callable, derive: Callable[[dict], None] = lambda row: None) -> dict:
    """`spec.processes` workers, one after the other, combined (`combine`): the report without its schema."""
    from parity.env import cpu_model

    results = [spawn_worker(spec) for _ in range(spec.processes)]
    environment = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "threads": results[0]["threads"]}
    return {"environment": environment, "spec": spec.to_json(), **combine(spec, results, derive)}


def table(rows, columns: list[tuple[str, Callable[[dict], str]]]) -> list[str]:
    """Markdown lines of a table: a column per (heading, cell of a row)."""
    return ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows)]


def median_cell(r: dict) -> str:
    return "" if r.get("median_s") is None else f"{1e3 * r['median_s']:.3f} ms"


def iqr_cell(r: dict) -> str:
    return "" if r.get("median_s") is None else f"{100 * r['iqr_s'] / r['median_s']:.0f} %"


def verdict_lines(found, pass_: str) -> list[str]:
    return [f"- {verdicts.sentence(v)}" for v in found if v["pass"] == pass_]
