"""`mha-bench`: the command line.

    mha-bench [--preset quick|default|long] [--device cpu|gpu|tpu|auto] [--impls PATTERNS]
              [--passes fwd,fwd+bwd] [--dtypes ...] [--seq ...] [--batch ..] [--embed ..] [--heads ..]
              [--threads K] [--precision highest|default] [--json P] [--markdown P] [--plot P.png]
    mha-bench compare BASE.json NEW.json [--threshold 0.10]
    mha-bench report RUN.json [--markdown P] [--plot P.png]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity.bench import report, runner
from parity.bench.spec import DTYPES, IMPLS, PASSES, PRESETS, Case, select_impls
from parity.cli_args import comma_separated


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mha-bench",
        description="Jit benchmark of multi-head attention across torch and JAX "
        "(also: `mha-bench compare BASE.json NEW.json`).",
        epilog="implementations: " + ", ".join(im.key for im in IMPLS),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="grid and timing preset (default quick)")
    p.add_argument("--device", choices=("cpu", "gpu", "tpu", "auto"), default="cpu",
                   help="auto = best present; torch runs on cpu when the device is a TPU")
    p.add_argument("--impls", help="comma-separated name[:mode[:weights|fused]] patterns, e.g. ours-torch:eager,jax-dpa-core")
    p.add_argument("--passes", type=comma_separated(PASSES, nonempty=True), help="fwd,fwd+bwd")
    p.add_argument("--dtypes", type=comma_separated(tuple(DTYPES), nonempty=True), help="float32,bfloat16,float16")
    p.add_argument("--seq", type=_ints, help="sequence lengths (T = S), e.g. 256,1024")
    p.add_argument("--max-seq", type=int, help="drop preset lengths above this")
    p.add_argument("--batch", type=_ints)
    p.add_argument("--embed", type=_ints)
    p.add_argument("--heads", type=_ints)
    p.add_argument("--threads", type=int, help="CPU threads per worker (affinity + framework thread pools)")
    p.add_argument("--precision", choices=("highest", "default"), default="highest",
                   help="highest: pin float32 matmuls to full precision in both frameworks (default)")
    p.add_argument("--budget", type=float, help="seconds of timed repeats per item (overrides the preset)")
    p.add_argument("--min-repeats", type=int)
    p.add_argument("--peak-sizes", type=_ints, help="square matmul sizes for the measured peak (overrides the preset)")
    p.add_argument("--isolation", choices=("case", "framework"),
                   help="one worker per (framework, case) or per framework (default: the preset's)")
    p.add_argument("--sequential", action="store_true",
                   help="time implementations one after another instead of round-robin per (case, pass)")
    p.add_argument("--item-timeout", type=float, default=1800.0, help="seconds before a stuck item is killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="print the planned items and exit")
    return p


def build_config(args) -> runner.RunConfig:
    preset = PRESETS[args.preset]
    device, absent = runner.resolve_device(args.device)
    seqs = args.seq or preset.seqs
    if args.max_seq:
        seqs = tuple(s for s in seqs if s <= args.max_seq)
    dtypes = args.dtypes or preset.dtypes
    if not args.dtypes and device == "gpu" and "bfloat16" in dtypes:
        dtypes = (*dtypes, "float16")  # native half matmuls on GPUs; CPU runs skip float16
    cases = tuple(
        Case(b, s, s, e, h, d)
        for d in dtypes for b in (args.batch or preset.batch) for e in (args.embed or preset.embed)
        for h in (args.heads or preset.heads) for s in seqs
    )
    timing = preset.timing
    if args.budget is not None:
        timing = replace(timing, budget_s=args.budget)
    if args.min_repeats is not None:
        timing = replace(timing, min_repeats=args.min_repeats, max_repeats=max(timing.max_repeats, args.min_repeats))
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    impls = select_impls(args.impls) if args.impls else select_impls(preset.impls)
    if args.peak_sizes:
        preset = replace(preset, peak_sizes=args.peak_sizes)
    return runner.RunConfig(
        preset=preset, device=device, device_absent=absent, impls=impls, cases=cases,
        passes=args.passes or preset.passes, threads=args.threads, precision=args.precision, seed=args.seed,
        isolation=args.isolation or preset.isolation, interleave=not args.sequential, item_timeout_s=args.item_timeout, timing=timing,
    )


def run(argv, console: Console) -> int:
    args = run_parser().parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as e:
        console.print(f"[red]mha-bench: {e}[/red]")
        return 2
    items = runner.plan(cfg)
    if args.list:
        for it in items:
            line = f"{it.case.label}  {it.pass_:8s} {it.impl.key}" + (f"  (skip: {it.skip})" if it.skip else "")
            console.print(line, markup=False)
        return 0
    if cfg.device_absent:
        console.print(f"mha-bench: skipping: device {cfg.device} not present ({cfg.device_absent})", style="yellow", markup=False)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=args.no_progress, transient=True,
    )
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with progress:
        task = progress.add_task("mha-bench", total=len(items))

        def on_event(kind, data):
            if kind == "start":
                progress.update(task, description=f"{data.case.label} {data.pass_} {data.impl.key}")
            else:
                progress.advance(task)

        collected = runner.execute(cfg, items, on_event)
    rows = runner.finish(items, collected, cfg.precision)
    env = {"loadavg_start": load_start, **runner.environment(cfg, collected)}
    report.print_table(rows, console)
    for r in rows:
        if r["status"] == "ok" and r.get("warning"):
            console.print(f"[yellow]warning: {r['impl']} {r['mode']} {r['pass']} {r['seq_q']}: {r['warning']}[/yellow]")
    if args.json:
        report.write_json(args.json, rows, env)
    if args.markdown:
        report.write_markdown(args.markdown, rows, env)
    if args.plot:
        report.write_plot(args.plot, rows)
    n_err = sum(r["status"] == "error" for r in rows)
    if n_err:
        console.print(f"[red]{n_err} item(s) failed; see the status column[/red]")
    return 0


def compare_main(argv, console: Console) -> int:
    p = argparse.ArgumentParser(prog="mha-bench compare", description="Flag regressions between two mha-bench JSON files.")
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--threshold", type=float, default=0.10, help="relative slow-down counted as a regression")
    args = p.parse_args(argv)
    results = report.compare(report.load(args.base), report.load(args.new), args.threshold)
    report.print_compare(results, args.threshold, console)
    n = sum(e["regression"] for e in results)
    console.print(f"{len(results)} matching row(s), {n} regression(s)")
    return 1 if n else 0


def report_main(argv, console: Console) -> int:
    p = argparse.ArgumentParser(prog="mha-bench report", description="Re-render a saved mha-bench JSON.")
    p.add_argument("json")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    args = p.parse_args(argv)
    data = report.load(args.json)
    report.print_table(data["rows"], console)
    if args.markdown:
        report.write_markdown(args.markdown, data["rows"], data.get("environment", {}))
    if args.plot:
        report.write_plot(args.plot, data["rows"])
    return 0


def main(argv=None, console: Console | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)  # redirected to a file or a CI log: do not fold at 80
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:], console)
    if argv[:1] == ["report"]:
        return report_main(argv[1:], console)
    return run(argv, console)
