"""`mha-parity` (also `python -m parity`): run the parity matrix, print a table, write reports.

Exit status: 0 when nothing failed or errored (skips are fine), 1 otherwise,
2 for a usage error, 130 when interrupted (the reports of what finished are
still written).
"""

from __future__ import annotations

import argparse

from parity.cli_args import comma_separated
from parity.harness.matrix import CHECKS, DTYPES
from parity.harness.runner import DEVICES


def build_parser() -> argparse.ArgumentParser:
    from parity.harness.impls import OURS

    p = argparse.ArgumentParser(
        prog="mha-parity",
        description="Check mha_torch and mha_jax against each other, a float64 NumPy oracle and the "
        "ecosystem's attention layers: forward, gradients, training and divergence.",
    )
    p.add_argument("--device", choices=DEVICES, default="auto", help="where to run (auto = best present; default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small matrix that takes a few seconds")
    p.add_argument("--cases", type=comma_separated(), default=(), metavar="A,B", help="case name prefixes or globs (e.g. 'self/*,cross')")
    p.add_argument("--dtypes", type=comma_separated(DTYPES), default=DTYPES, metavar=",".join(DTYPES))
    p.add_argument("--checks", type=comma_separated(CHECKS), default=CHECKS, metavar=",".join(CHECKS))
    p.add_argument("--impls", type=comma_separated([i.name for i in OURS]), default=None, metavar="torch,jax-jit,...",
                   help="which of our implementations to run (default: all but torch-compile)")
    p.add_argument("--compile", action="store_true", help="also run torch.compile (slow on CPU)")
    p.add_argument("--framework-defaults", action="store_true",
                   help="keep the frameworks' default matmul precision (TF32 on GPU, bf16 passes on TPU) instead of 'highest'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the JSON report here (atomically)")
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown report here (atomically)")
    p.add_argument("--all-rows", action="store_true", help="print every row, not the per-group summary")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from parity.harness.report import print_report
    from parity.harness.runner import run

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or redirected: rich's 80 columns would fold the table
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=args.no_progress,
    )
    state = {"task": None, "started": False}

    def on_start(total):
        state["task"] = progress.add_task("starting", total=total)

    def on_progress(description):
        if state["started"]:
            progress.advance(state["task"])
        state["started"] = True
        progress.update(state["task"], description=description)

    try:
        with progress:
            report = run(
                case_filter=args.cases, dtypes=args.dtypes, checks=args.checks, impls=args.impls, device=args.device,
                seed=args.seed, quick=args.quick, compile=args.compile, framework_defaults=args.framework_defaults,
                json_path=args.json, markdown_path=args.markdown, on_start=on_start, on_progress=on_progress,
            )
    except ValueError as e:
        console.print(f"[bold red]mha-parity: {e}")
        return 2
    if report.environment.get("x64_enabled_for_run"):
        console.print("float64 in the run: jax_enable_x64 was enabled for it (recorded in the report's environment)")
    print_report(report, console, all_rows=args.all_rows)
    for label, path in (("JSON", args.json), ("Markdown", args.markdown)):
        if path:
            console.print(f"{label} report: {path}")
    if report.interrupted:
        console.print("[bold red]interrupted: the reports hold what finished")
        return 130
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
