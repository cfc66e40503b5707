"""`mha-bench sharded`: per-device peak memory and forward time of the shardings.

    mha-bench sharded [--shards 1,2,4] [--shardings sp,tp] [--frameworks jax,torch]
                      [--seq 4096] [--embed 256] [--heads 4] [--batch 1] [--repeats 3]
                      [--job-timeout 900] [--json P] [--markdown P]

`--shards` lists the device counts each sharding is split over (simulated CPU devices for JAX,
gloo processes for torch; `--device` elsewhere in `mha-bench` is the device kind). The rows come
from `parity.bench.sharded.iter_bench_sharded` (each (framework, sharding, shard count) in fresh
processes; JAX's memory is its compiled program's per-device `memory_analysis()`, torch's each
rank's peak RSS growth). On simulated CPU devices every device shares the same cores: the
times are overhead measurements, and per-device memory is the headline.

Every argument is checked before anything starts (exit 2): positive sizes, E divisible by N,
T (sp) and N (tp) divisible by every device count, distinct output files. A repeated device
count, sharding or framework is measured once. Ctrl-C ends the running measurement's processes,
writes the report of what finished and exits 130. A report that cannot be written once the
table is printed (a full disk) is said in one line and the run exits 3.

`--layouts` is the deprecated spelling of `--shardings` (it warns): in `mha-parity`, `--layout`
names a checkpoint's tensors, so the word for how the work is split is "sharding" in both tools.
"""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console
from rich.table import Table

from mha_spec.files import check_writable, write_atomic
from mha_spec import SHARDINGS
from parity.cli_args import add_alias, comma_separated, positive_float, positive_int, positive_ints as _ints
from parity.bench.sharded import SHARDED_FRAMEWORKS, TIMEOUT_S

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_WRITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
BENCH_SHARDINGS = tuple(s for s in SHARDINGS if s in ("sp", "tp"))  # what the memory benchmark measures (no dp)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mha-bench sharded", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=_ints, default=(1, 2, 4), metavar="N,..",
                   help="device counts to split each sharding over (default 1,2,4)")
    add_alias(p, "--layouts", p.add_argument(
        "--shardings", type=comma_separated(BENCH_SHARDINGS, nonempty=True), default=("sp", "tp"), metavar="sp,tp",
        help="sp: the query sequence (ring attention), tp: the heads (default sp,tp)"))
    p.add_argument("--frameworks", type=comma_separated(SHARDED_FRAMEWORKS, nonempty=True), default=SHARDED_FRAMEWORKS)
    p.add_argument("--seq", type=positive_int, default=4096, help="T = S (default 4096)")
    p.add_argument("--embed", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--job-timeout", type=positive_float, default=TIMEOUT_S, metavar="SECONDS",
                   help="the longest one measurement's processes may run before they are killed (default %(default)g)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    return p


def markdown(rows, title: str, note: str) -> str:
    lines = [f"# {title}", "", f"{note}.", "",
             "| framework | layout | devices | per-device peak | ratio to 1 device | median time | memory source |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = "-" if r.get("ratio_to_1_device") is None else f"{r['ratio_to_1_device']:.3f}"
        lines.append(f"| {r['framework']} | {r['layout']} | {r['devices']} | {r['per_device_peak_bytes'] / 2**20:.1f} MiB | "
                     f"{ratio} | {r['time_s'] * 1e3:.0f} ms | {r['mem_source']} |")
    return "\n".join(lines) + "\n"


def main(argv, console: Console) -> int:
    from parity.bench.sharded import TIME_NOTE, check_sizes, iter_bench_sharded, with_ratios

    args = parser().parse_args(argv)
    sizes = {"B": args.batch, "T": args.seq, "E": args.embed, "N": args.heads, "repeats": args.repeats}
    try:
        paths = [os.path.realpath(p) for p in (args.json, args.markdown) if p]
        if len(set(paths)) < len(paths):
            raise ValueError("--json and --markdown must be different files")
        for path in paths:
            check_writable(path)
        check_sizes(devices=args.shards, layouts=args.shardings, frameworks=args.frameworks, **sizes)
    except ValueError as e:
        console.print(f"[red]mha-bench sharded: error: {e}[/red]", soft_wrap=True)
        return EXIT_USAGE
    rows, interrupted = [], False
    try:
        for row in iter_bench_sharded(devices=args.shards, layouts=args.shardings, frameworks=args.frameworks,
                                      timeout_s=args.job_timeout, **sizes):
            rows.append(row)
    except KeyboardInterrupt:  # the running measurement's processes and files are already gone
        interrupted = True
    rows = with_ratios(rows)
    title = f"Sharded attention: per-device memory, B={args.batch} T=S={args.seq} E={args.embed} N={args.heads} float32 forward"
    table = Table(title=title + (" (interrupted)" if interrupted else ""), caption=TIME_NOTE)
    for col in ("framework", "layout", "devices", "per-device peak", "÷ 1 device", "median time"):
        table.add_column(col, justify="right" if col not in ("framework", "layout") else "left")
    for r in rows:
        ratio = "-" if r.get("ratio_to_1_device") is None else f"{r['ratio_to_1_device']:.3f}"
        table.add_row(r["framework"], r["layout"], str(r["devices"]), f"{r['per_device_peak_bytes'] / 2**20:.1f} MiB",
                      ratio, f"{r['time_s'] * 1e3:.0f} ms")
    console.print(table)
    written = write_reports(args, rows, title + (" (interrupted)" if interrupted else ""), interrupted, TIME_NOTE, console)
    if interrupted:
        console.print("[bold red]interrupted: the report holds the measurements that finished", soft_wrap=True)
        return EXIT_INTERRUPTED
    if not written:
        return EXIT_WRITE
    return EXIT_OK if rows else EXIT_FAIL


def write_reports(args, rows, title: str, interrupted: bool, note: str, console: Console) -> bool:
    """Write the requested reports; True if all were. A failure is one line, and the other report is still written."""
    reports = (("--json", args.json, lambda: json.dumps({"schema": "mha-bench-sharded/1", "interrupted": interrupted,
                                                         "rows": rows}, indent=1) + "\n"),
               ("--markdown", args.markdown, lambda: markdown(rows, title, note)))
    written = True
    for flag, path, text in reports:
        if not path:
            continue
        try:
            write_atomic(path, text())
        except OSError as e:
            console.print(f"mha-bench sharded: error: could not write {flag} {path}: {e.strerror or e}",
                          style="red", markup=False, soft_wrap=True)
            written = False
    return written
