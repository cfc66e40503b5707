"""Outputs: the rich table, JSON, Markdown, the plot, and `compare`."""

from __future__ import annotations

import json
import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parity.atomic import atomic_path, write_atomic
from parity.bench.spec import ROW_FIELDS

SCHEMA = "mha-bench/1"
MATCH_KEY = ("impl", "mode", "pass", "batch", "seq_q", "seq_k", "embed", "heads", "dtype", "need_weights")


def _variant(row) -> str:
    return f"{row['impl']} {row['mode']} {'weights' if row['need_weights'] else 'fused'}"


def _case(row) -> str:
    return f"B={row['batch']} T={row['seq_q']} S={row['seq_k']} E={row['embed']} N={row['heads']} {row['dtype']}"


def _fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _fmt(x, spec="{:.3g}") -> str:
    return "-" if x is None else spec.format(x)


def _mem(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


COLUMNS = ("case", "pass", "implementation", "median", "IQR", "ratio", "GFLOP/s", "peak", "compile", "recompile", "mem", "status")


def _cells(row) -> list[str]:
    status = row["status"]
    if status != "ok":
        note = f"{status}: {row.get('message') or ''}"
    else:
        note = "ok" + (f" ({row['warning']})" if row.get("warning") else "")
    return [
        _case(row), row["pass"], _variant(row), _fmt_s(row["median_s"]), _fmt_s(row["iqr_s"]),
        _fmt(row["ratio"], "{:.2f}×"), _fmt(row["gflops"], "{:.1f}"), _fmt(row["peak_fraction"], "{:.0%}"),
        _fmt_s(row["compile_s"]), _fmt_s(row["recompile_s"]), _mem(row["peak_mem_bytes"]), note,
    ]


def print_table(rows, console: Console | None = None) -> None:
    """One table per case (ratio = median / fastest implementation of that case and pass)."""
    console = console or Console()
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(_case(row), []).append(row)
    for case, members in by_case.items():
        table = Table(title=f"{case}  (ratio = median / fastest of the same pass)", title_justify="left")
        for col in COLUMNS[1:]:
            table.add_column(col, overflow="fold", no_wrap=col not in ("status", "implementation"))
        for row in members:
            table.add_row(*(escape(c) for c in _cells(row)[1:]))
        console.print(table)


def to_json(rows, env: dict) -> dict:
    return {"schema": SCHEMA, "environment": env, "rows": [{k: r.get(k) for k in ROW_FIELDS} for r in rows]}


def write_json(path: str, rows, env: dict) -> None:
    write_atomic(path, (json.dumps(to_json(rows, env), indent=1, allow_nan=False) + "\n").encode())


def markdown(rows, env: dict) -> str:
    peaks = ", ".join(f"{p['dtype']} {p['gflops']:.0f} GFLOP/s" for p in env.get("peaks", []) if p.get("gflops"))
    lines = [
        "# mha-bench results",
        "",
        f"- device: {env.get('device')} — {env.get('cpu_model')}; threads: {env.get('threads')}; "
        f"precision: {env.get('precision')}; preset: {env.get('preset')}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in env.get('versions', {}).items())}; python {env.get('python')}",
        f"- measured matmul peak (best square matmul of either framework, any worker): {peaks or 'n/a'}",
        f"- load average at the end: {env.get('loadavg_end')} (other processes on the machine make timings noisy)",
        f"- FLOPs: {env.get('flops_formula')}; ratio = median / fastest of the same case and pass",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(row)) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, rows, env: dict) -> None:
    write_atomic(path, markdown(rows, env).encode())


def write_plot(path: str, rows) -> None:
    """Time and GFLOP/s against sequence length, log-log, one column per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in ok)] or ["fwd"]
    fig, axes = plt.subplots(2, len(passes), figsize=(6.5 * len(passes), 8), squeeze=False)
    colors = plt.get_cmap("tab20").colors  # > 10 series: tab10 would repeat colours
    for col, pass_ in enumerate(passes):
        series: dict = {}
        for r in ok:
            if r["pass"] == pass_:
                label = f"{_variant(r)} {r['dtype']} B={r['batch']} E={r['embed']}"
                series.setdefault(label, []).append((r["seq_q"], r["median_s"], r["gflops"]))
        for n, (label, pts) in enumerate(sorted(series.items())):
            pts.sort()
            xs = [p[0] for p in pts]
            style = "-o" if "ours" in label else "--s"  # ours solid, peers dashed
            kw = {"label": label, "markersize": 4, "color": colors[n % len(colors)]}
            axes[0][col].plot(xs, [p[1] for p in pts], style, **kw)
            axes[1][col].plot(xs, [p[2] for p in pts], style, **kw)
        for ax, ylabel in ((axes[0][col], "median time (s)"), (axes[1][col], "GFLOP/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length (T = S)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_title(f"{pass_}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.tight_layout(rect=(0, 0.04 + 0.018 * math.ceil(len(labels) / 2), 1, 1))
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- compare


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"{path} is not an mha-bench JSON file (no 'rows')")
    return data


def compare(base: dict, new: dict, threshold: float = 0.10) -> list[dict]:
    """Matching rows of two runs; `regression` when new's median is > (1 + threshold) × base's,
    or when a row that was ok in base is no longer ok."""
    def key(r):
        return tuple(r.get(k) for k in MATCH_KEY)

    base_rows = {key(r): r for r in base["rows"]}
    out = []
    for r in new["rows"]:
        b = base_rows.get(key(r))
        if b is None or b["status"] != "ok":
            continue
        entry = {"key": dict(zip(MATCH_KEY, key(r))), "base_s": b["median_s"], "new_s": r.get("median_s")}
        if r["status"] != "ok":
            entry.update(change=None, regression=True, note=f"now {r['status']}: {r.get('message')}")
        else:
            change = r["median_s"] / b["median_s"] - 1
            entry.update(change=change, regression=change > threshold, note="")
        out.append(entry)
    return out


def print_compare(results, threshold: float, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"mha-bench compare (regression: > {threshold:.0%} slower, or no longer ok)")
    for col in ("case", "pass", "implementation", "base", "new", "change", "verdict"):
        table.add_column(col)
    for e in results:
        k = e["key"]
        verdict = "[red]REGRESSION[/red]" if e["regression"] else "ok"
        table.add_row(
            _case(k), k["pass"], _variant(k), _fmt_s(e["base_s"]), _fmt_s(e["new_s"]),
            _fmt(e["change"], "{:+.1%}"), verdict + (f" {e['note']}" if e["note"] else ""),
        )
    console.print(table)
