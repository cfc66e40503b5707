"""Outputs: the console table and verdicts, JSON, Markdown, the plot, and `compare`.

The console table fits 100 columns; the Markdown has every column and every message.
Rows flagged `error` after they were timed (a rate above the measured peak, an output that
differs from the others') keep their numbers: the Markdown marks them "(error)", the console
shows them in red and the plot draws them with a red cross, so a reader sees what was
rejected instead of a hole.
"""

from __future__ import annotations

import collections
import json
import math
import textwrap
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mha_spec import PASSES
from mha_spec.files import JSONFileError, atomic_path, parse_json, write_atomic
from parity.bench import verdict as verdicts
from parity.bench.records import KEY_FIELDS, Key, Row, Verdict, finite, match_key, named, short
from parity.bench.spec import MEASURED, NO_PARAM_GRADS, NOISY_IQR, case_label, modern_label, variant_fields

# /2: the `noisy` status and `verdicts`. The variant fields (kv_heads, rope, bias) were added
# without a new schema: a row without them is the classic layer, which is what it measured.
# /3: rows gain mask, rounds, processes, process_medians_s and baseline (the ratio's); verdicts
# gain rounds, processes, interference and reason, and their ci is null where there is no interval.
# /4: rows gain mask_path, grad_rel_diff and param_grads; verdicts gain note. The fields of the layers after
# Llama (head_dim, qk_norm, qk_norm_eps, qk_norm_offset, scale, softcap, sinks) were added as the variant
# fields were, without a new schema: a row without them is the classic layer, which is what it measured. So were
# rope_dim and rope_scaling (partial rotary, scaled RoPE): a row without them rotated whole heads, unscaled.
SCHEMA = "mha-bench/4"
READABLE_SCHEMAS = ("mha-bench/1", "mha-bench/2", "mha-bench/3", SCHEMA)
CONSOLE_WIDTH = 100


def _variant(row) -> str:
    return f"{row['impl']} {row['mode']} {'weights' if row['need_weights'] else 'fused'}"


_case = case_label  # the case as rows and verdicts name it (`BenchCase.label`)


def _fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _fmt(x, spec="{:.3g}") -> str:
    return "-" if x is None else spec.format(x)


def _mem(x) -> str:
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


COLUMNS = ("case", "pass", "implementation", "median", "IQR", "ratio to baseline", "GFLOP/s", "peak", "compile", "recompile",
           "mem", "out diff", "grad diff", "param grads", "status", "kernel", "mask path")


def _note(row) -> str:
    message = row.get("message") or ""
    return message if message.startswith(row["status"] + ":") else row["status"] + (f": {message}" if message else "")


def _cells(row) -> list[str]:
    """The Markdown cells of a row: every column, the status with its message."""
    mark = " (error)" if row["status"] == "error" else ""  # a number that was measured but not trusted

    def marked(x, spec):
        return "-" if x is None else spec.format(x) + mark

    # What ran (`parity.kernel_ran`): the SDPA backend, the JAX kernel and its blocks; "-" in a file without it.
    return [
        _case(row), row["pass"], _variant(row), _fmt_s(row["median_s"]), _fmt_s(row["iqr_s"]),
        marked(row["ratio"], "{:.2f}×"), marked(row["gflops"], "{:.1f}"), marked(row["peak_fraction"], "{:.0%}"),
        _fmt_s(row["compile_s"]), _fmt_s(row["recompile_s"]), _mem(row["peak_mem_bytes"]),
        _fmt(row.get("out_max_diff"), "{:.2g}"), _fmt(row.get("grad_rel_diff"), "{:.2g}"),
        {True: "yes", False: "no"}.get(row.get("param_grads"), "-"), _note(row), row.get("kernel") or "-",
        row.get("mask_path") or "-",
    ]


CONSOLE_COLUMNS = ("pass", "implementation", "median", "IQR", "ratio", "GFLOP/s", "peak", "compile", "status")
_STATUS_STYLE = {"error": "red", "noisy": "yellow", "skip": "dim"}


def _console_cells(row) -> list[str]:
    iqr = None if not row.get("median_s") or row.get("iqr_s") is None else row["iqr_s"] / row["median_s"]
    return [
        row["pass"], _variant(row), _fmt_s(row["median_s"]), _fmt(iqr, "{:.0%}"), _fmt(row["ratio"], "{:.2f}×"),
        _fmt(row["gflops"], "{:.1f}"), _fmt(row["peak_fraction"], "{:.0%}"), _fmt_s(row["compile_s"]), row["status"],
    ]


def print_table(rows, console: Console | None = None) -> None:
    """One table per case, at most CONSOLE_WIDTH columns wide; then the messages of the rows
    that are not ok (errors one by one, skips counted by reason). The Markdown has the rest."""
    console = console or Console()
    width = min(console.width, CONSOLE_WIDTH)
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(_case(row), []).append(row)
    for case, members in by_case.items():
        bases = ", ".join(dict.fromkeys(r["baseline"] for r in members if r.get("baseline"))) or "-"
        table = Table(title=f"{case}  (IQR / median; ratio to {bases})", title_justify="left",
                      box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
        for col in CONSOLE_COLUMNS:
            table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=30 if col == "implementation" else None,
                             justify="left" if col in ("pass", "implementation", "status") else "right")
        for row in sorted(members, key=lambda r: r["pass"] != "fwd"):  # stable: plan order within a pass
            table.add_row(*(Text(c) for c in _console_cells(row)), style=_STATUS_STYLE.get(row["status"]))
        console.print(table, width=width)
    for row in rows:
        if row["status"] == "error" and row.get("message"):
            console.print(f"error: {Key.of_row(row)} {row['pass']} {_case(row)}: {row['message']}",
                          markup=False, style=_STATUS_STYLE["error"], width=width)
        elif row.get("param_grads") is False and row["status"] in MEASURED:
            console.print(f"note: {Key.of_row(row)} {row['pass']} {_case(row)}: {NO_PARAM_GRADS}", markup=False,
                          width=width)
    skips = collections.Counter(row.get("message") or "" for row in rows if row["status"] == "skip")
    for message, n in skips.items():
        console.print(f"skip: {n} row(s): {message}", markup=False, style="dim", width=width)


def verdict_lines(vs, rows) -> list[str]:
    """One sentence per verdict (`verdict.sentence`), with why an inconclusive one is."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((_case(r), r["pass"]), {})[str(Key.of_row(r))] = r
    return [f"{v['pass']} {v['case']}: " + verdicts.sentence(v, by_case.get((v["case"], v["pass"]), {})) for v in vs]


def print_verdicts(vs, rows, console: Console | None = None) -> None:
    console = console or Console()
    for v, line in zip(vs, verdict_lines(vs, rows)):
        console.print("verdict " + line, markup=False, style="bold" if v["conclusive"] else None,
                      width=min(console.width, CONSOLE_WIDTH))


def to_json(rows, env: dict, verdicts_=()) -> dict:
    return {"schema": SCHEMA, "environment": env, "rows": [Row.of(r).to_json() for r in rows],
            "verdicts": [Verdict.of(v).to_json() for v in verdicts_]}


def write_json(path: str, rows, env: dict, verdicts_=()) -> None:
    write_atomic(path, (json.dumps(to_json(rows, env, verdicts_), indent=1, allow_nan=False) + "\n").encode())


def markdown(rows, env: dict, verdicts_=()) -> str:
    peaks = ", ".join(f"{p['dtype']} {p['gflops']:.0f} GFLOP/s" for p in env.get("peaks", []) if p.get("gflops"))
    bases = sorted({f"{r['pass']} {_case(r)}: {r['baseline']}" for r in rows if r.get("baseline")})
    lines = [
        "# mha-bench results",
        "",
        *(["## Verdicts", "", *(f"- {line}" for line in verdict_lines(verdicts_, rows)), ""] if verdicts_ else []),
        "## Run",
        "",
        f"- device: {env.get('device')} — {env.get('cpu_model')}; threads: {env.get('threads')}; "
        f"precision: {env.get('precision')}; preset: {env.get('preset')}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in env.get('versions', {}).items())}; python {env.get('python')}",
        f"- measured matmul peak (best square matmul of either framework, any worker): {peaks or 'n/a'}; "
        f"{sum('remeasured_for' in p for p in env.get('peak_measurements', []))} re-measured because a row beat it",
        f"- load average at the start: {env.get('loadavg_start')}, at the end: {env.get('loadavg_end')} "
        f"on {env.get('cpu_count')} cores; cores other processes used on average over the run: {env.get('others_cpu')}",
        f"- FLOPs: {env.get('flops_formula')}; ratio to baseline = median / the baseline's median in the same case "
        "and pass; numbers marked (error) were measured but rejected (see the status column)",
        f"- baselines: {'; '.join(bases) or 'none'}",
        f"- threads: {env.get('thread_settings') or env.get('threads')}",
        f"- noisy: IQR/median above {NOISY_IQR:.0%} (shown, no veto); verdicts: {verdicts.CI_LEVEL:.0%} hierarchical "
        "percentile-bootstrap interval (worker processes, rounds, pairs) of the median paired log ratio, conclusive when "
        f"it excludes 1, with at least {verdicts.MIN_PROCESSES} worker processes and {verdicts.MIN_ROUNDS} rounds, both "
        "rows measured and no interference",
        *(f"- **{w}**" for w in env.get("interference") or ()),
        *(f"- {w}" for w in env.get("interference_notes") or ()),
        "",
        "## Rows",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(row)) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, rows, env: dict, verdicts_=()) -> None:
    write_atomic(path, markdown(rows, env, verdicts_).encode())


# ---------------------------------------------------------------- plot

# Colour = implementation and mode, linestyle = weights or fused, marker = dtype; a second,
# third ... shape (B, E, N) of the same variant gets hollow markers and a thicker line.
# Together these make every series' look unique (tests/test_bench.py checks it).
_LINESTYLES = {True: "-", False: "--"}  # need_weights: with weights solid, fused dashed
_MARKERS = {"float32": "o", "bfloat16": "s", "float16": "^"}


def _series_key(row) -> tuple:
    return (row["impl"], row["mode"], row["need_weights"], row["dtype"], row["batch"], row["embed"], row["heads"],
            *variant_fields(row))


def series_styles(rows) -> dict[tuple, dict]:
    """{series key: matplotlib keyword arguments}, for every series with a median in `rows`."""
    keys = sorted({_series_key(r) for r in rows if r.get("median_s")}, key=str)
    variants = list(dict.fromkeys((k[0], k[1]) for k in keys))  # (impl, mode), first-seen order
    # None (a classic layer's rope, scale, ...) sorts before any value: None and a value do not compare.
    shapes = sorted({k[4:] for k in keys}, key=lambda shape: tuple((x is not None, x) for x in shape))
    palette = _palette(len(variants))
    styles = {}
    for k in keys:
        nth_shape = shapes.index(k[4:])
        styles[k] = {
            "color": palette[variants.index((k[0], k[1]))], "linestyle": _LINESTYLES[k[2]],
            "marker": _MARKERS.get(k[3], "D"), "fillstyle": "full" if nth_shape == 0 else "none",
            "linewidth": 1.5 + nth_shape,
        }
    return styles


def _palette(n: int) -> list:
    import matplotlib

    colors = list(matplotlib.colormaps["tab10"].colors)
    if n > len(colors):  # more variants than tab10 has colours: spread a continuous map instead
        cmap = matplotlib.colormaps["turbo"]
        colors = [cmap(i / max(n - 1, 1)) for i in range(n)]
    return colors[:n]


# ---------------------------------------------------------------- the cross-framework table (`mha-bench table`)


def _cell(r: dict | None, what: str) -> str:
    """One number of a row as the table prints it; '' where the row lacks it, its status where it was not timed."""
    if r is None:
        return ""
    if r["status"] not in MEASURED:
        return r["status"] if what == "ms" else ""
    value = {"ms": r.get("median_s"), "tflops": r.get("gflops"), "peak": r.get("peak_fraction")}[what]
    if value is None:
        return ""
    return {"ms": f"{1e3 * value:.3g}", "tflops": f"{value / 1e3:.3g}", "peak": f"{100 * value:.0f} %"}[what]


def _mib(r: dict | None) -> str:
    return "–" if r is None or r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"


TABLE_COLUMNS = ("shape", "implementation", "fwd ms", "fwd TFLOP/s", "fwd % peak", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                 "fwd+bwd % peak", "peak MiB fwd / fwd+bwd", "compile s fwd / fwd+bwd", "kernel")


def cross_table(rows, env: dict) -> str:
    """One run's rows as one Markdown table: a row per (shape, implementation), the shapes in the run's order, each
    pass's median time, TFLOP/s and fraction of the run's measured matmul peak, the peak memory and compile time
    of both passes and the kernel that ran; the FLOP formula and the machine in its header."""
    peaks = ", ".join(f"{p['dtype']} {p['gflops']:.0f} GFLOP/s" for p in env.get("peaks", []) if p.get("gflops"))
    threads = env.get("threads")
    threads = ", ".join(f"{k} {v}" for k, v in threads.items()) if isinstance(threads, dict) else threads
    lines = [f"# mha-bench table: {env.get('device')} — {env.get('cpu_model')}, threads: {threads}, "
             f"precision {env.get('precision')}", "",
             f"FLOPs: {env.get('flops_formula')}. TFLOP/s = FLOPs / median time; % peak = of the run's measured "
             f"matmul peak ({peaks or 'n/a'}). A pass that was not timed shows its status (skip, error).", "",
             "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    by = collections.defaultdict(dict)  # (shape, key) -> pass -> row
    for r in rows:
        by[(_case(r), str(Key.of_row(r)))][r["pass"]] = r
    shown = None
    for (shape, key), passes in by.items():
        f, b = passes.get("fwd"), passes.get("fwd+bwd")
        kernel = next((x.get("kernel") for x in (f, b) if x is not None and x.get("kernel")), "")
        comp = " / ".join("–" if x is None or x.get("compile_s") is None else f"{x['compile_s']:.2g}" for x in (f, b))
        cells = [shape if shape != shown else "", key, _cell(f, "ms"), _cell(f, "tflops"), _cell(f, "peak"),
                 _cell(b, "ms"), _cell(b, "tflops"), _cell(b, "peak"), f"{_mib(f)} / {_mib(b)}", comp, kernel or ""]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        shown = shape
    return "\n".join(lines) + "\n"


# The layer fields a plot title names, with their short names; a field the rows differ in lists its values.
_TITLE_FIELDS = (("embed", "E"), ("heads", "N"), ("kv_heads", "K"), ("rope", "RoPE"), ("bias", "bias"),
                 ("mask", "mask"), ("batch", "B"), ("seq_q", "T"), ("seq_k", "S"), ("dtype", "dtype"))


def layer_title(rows) -> str:
    """The whole layer the rows time: E, N, K, RoPE, bias, mask, B, T, S and the dtype (several values
    where the rows differ), e.g. 'E=512 N=8 K=2 RoPE=half bias=none mask=causal B=1 T=1024 S=1024 float32'."""
    def value(r, name):
        kv_heads, rope, bias, mask = variant_fields(r)[:4]
        return {"kv_heads": kv_heads, "rope": rope or "none", "bias": bias, "mask": mask}.get(name, r.get(name))

    parts = []
    for name, short in _TITLE_FIELDS:
        vals = sorted({value(r, name) for r in rows}, key=lambda x: (isinstance(x, str), x))
        text = ",".join(map(str, vals)) or "?"
        parts.append(text if name == "dtype" else f"{short}={text}")
    # The layers after Llama: what differs from the classic layer, as the case label says it (`modern_label`).
    modern = {modern_label(r).strip() for r in rows}
    if modern - {""}:
        parts.insert(5, " | ".join(sorted(m or "classic" for m in modern)))
    return " ".join(parts)


TITLE_SIZE = 9  # the plot title's font size (points)
PASS_WIDTH_IN = 6.5  # the figure's width per pass (inches)


def title_chars(width_in: float, fontsize: float = TITLE_SIZE) -> int:
    """Characters a title line may hold in a figure `width_in` wide: DejaVu Sans averages about 0.6 of the font
    size per character on this text (measured: the widest title line of tests/test_bench_table.py fits)."""
    return int(width_in * 72 / (0.6 * fontsize))


def verdictshort(v: dict, width: int = 140) -> str:
    """A verdict in a plot's words: pass, case, who is faster by how much, the interval, conclusive or why not;
    wrapped at `width` characters, between words (a long reason is shortened at a word: the report has it whole)."""
    ci = v.get("ci")
    span = f"{verdicts.CI_LEVEL:.0%} CI {ci[0]:.3g}-{ci[1]:.3g}" if ci and math.isfinite(ci[1]) else "no interval"
    reason = textwrap.shorten(v.get("reason") or "see the report", 90, placeholder=" ...")
    state = "conclusive" if v["conclusive"] else f"inconclusive ({reason})"
    text = f"{v['pass']} {v['case']}: {v['faster']} {v['ratio']:.3g}x faster than {v['slower']}, {span}, {state}"
    if v.get("note"):
        text += f"; {v['note']}"
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def plot_title(rows, env: dict | None, verdicts_=(), width: int = 140) -> str:
    """The layer, the machine and the run's settings; then each verdict; every line wrapped at `width`
    characters between words (`title_chars` of the figure's width)."""
    env = env or {}
    device = env.get("device") or ", ".join(sorted({str(r.get("device")) for r in rows}))
    model = env.get("cpu_model") if device == "cpu" else None
    bits = [f"device {device}" + (f" ({model})" if model else ""), f"preset {env.get('preset', '?')}",
            f"precision {env.get('precision', '?')}"]
    lines = [f"mha-bench: {layer_title(rows)}" if rows else "mha-bench", ", ".join(bits)]
    lines = [textwrap.fill(t, width, break_long_words=False, break_on_hyphens=False) for t in lines]
    return "\n".join([*lines, *(verdictshort(v, width) for v in verdicts_)])


def write_plot(path: str, rows, env: dict | None = None, verdicts_=()) -> None:
    """`plot_figure` saved as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = plot_figure(rows, env, verdicts_)
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


def plot_figure(rows, env: dict | None = None, verdicts_=()):
    """Time and GFLOP/s, one column per pass, with the spread (IQR) as error bars on the times; the title
    (`plot_title`) wrapped to the figure's width, so every verdict is shown whole.

    Several sequence lengths: lines against the length, log-log. One length: a bar per
    implementation (points stacked in one column would hide each other). Rows flagged
    `error` that still have a time are drawn as red crosses (lines) or red-hatched bars.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["status"] in ("ok", "noisy", "error") and r.get("median_s")]
    passes = [p for p in PASSES if any(r["pass"] == p for r in timed)] or ["fwd"]
    styles = series_styles(timed)
    bars = len({r["seq_q"] for r in timed}) == 1
    title = plot_title(rows, env, verdicts_, title_chars(PASS_WIDTH_IN * len(passes)))
    lines = title.count("\n") + 1
    # the plots keep their 8.5 inches; the title's lines get their own room above them
    fig, axes = plt.subplots(2, len(passes), figsize=(PASS_WIDTH_IN * len(passes), 8.5 + 0.17 * lines), squeeze=False)
    for col, pass_ in enumerate(passes):
        members = [r for r in timed if r["pass"] == pass_]
        if bars:
            _plot_bars(axes[0][col], axes[1][col], members, styles)
        else:
            for key, style in styles.items():
                series = sorted((r for r in members if _series_key(r) == key), key=lambda r: r["seq_q"])
                if series:
                    _plot_series(axes[0][col], axes[1][col], series, style)
        for ax, label in ((axes[0][col], "median time (s), error bars: IQR"), (axes[1][col], "GFLOP/s")):
            if bars:
                ax.set_xlabel(label)
            else:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("sequence length (T = S)" if all(r["seq_q"] == r["seq_k"] for r in members)
                              else "query length T (S: see the title)")
                ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
        shared = ""
        if bars and members:
            r0 = members[0]
            shared = f", T={r0['seq_q']} S={r0['seq_k']}" + "".join(
                f" {short}={r0[k]}" for k, short in (("batch", "B"), ("embed", "E"), ("heads", "N"))
                if len({r[k] for r in members}) == 1)
        axes[0][col].set_title(f"{pass_}{shared}")
        _plot_peaks(axes[1][col], members, vertical=bars)
    handles, labels = _legend_entries(axes[0])
    if handles and not bars:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    top = 1 - (0.17 * lines + 0.1) / fig.get_figheight()  # the title's lines (the layer, the run, each verdict)
    fig.tight_layout(rect=(0, 0 if bars else 0.04 + 0.018 * math.ceil(len(labels) / 2), 1, top))
    # The title after the layout: tight_layout would reserve a suptitle's height again below `top`, and
    # with a verdict per case that squeezed the plots into the bottom third of the figure.
    fig.suptitle(title, fontsize=TITLE_SIZE, y=1 - 0.05 / fig.get_figheight(), va="top")
    return fig


def _legend_entries(top_axes) -> tuple[list, list[str]]:
    """(handles, labels) of every series, each label once (a series may appear in one pass only);
    the error crosses of every series as one neutral entry, listed last."""
    import matplotlib.lines

    legend: dict = {}
    for ax in top_axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    if _ERROR_LABEL in legend:
        del legend[_ERROR_LABEL]
        legend[_ERROR_LABEL] = matplotlib.lines.Line2D([], [], linestyle="none", color="grey", **_ERROR_MARKER)
    return list(legend.values()), list(legend)


_ERROR_LABEL = "error row (measured, not trusted)"
_ERROR_MARKER = {"marker": "X", "markersize": 9, "markeredgecolor": "red", "markeredgewidth": 1.5}


def _iqr_bars(members) -> list[float]:
    """Half the IQR of each row (the error bar either side of the median)."""
    return [(r.get("iqr_s") or 0.0) / 2 for r in members]


def _series_label(r) -> str:
    label = f"{_variant(r)} {r['dtype']} B={r['batch']} E={r['embed']} N={r['heads']}"
    kv_heads, rope, bias, mask = variant_fields(r)[:4]
    return label + (f" K={kv_heads}" if kv_heads != r["heads"] else "") + (f" rope={rope}" if rope else "") + (
        f" bias={bias}" if bias != "all" else "") + modern_label(r) + (f" mask={mask}" if mask != "none" else "")


def _plot_series(ax_time, ax_rate, members, style) -> None:
    """One series on both axes: a line through its measured points, red crosses on its error points."""
    label = _series_label(members[0])
    ok = [r for r in members if r["status"] in MEASURED]
    bad = [r for r in members if r["status"] == "error"]
    if ok:
        ax_time.errorbar([r["seq_q"] for r in ok], [r["median_s"] for r in ok], yerr=_iqr_bars(ok), label=label,
                         markersize=4, capsize=2, **style)
    rated = [r for r in ok if r.get("gflops")]
    if rated:
        ax_rate.plot([r["seq_q"] for r in rated], [r["gflops"] for r in rated], label=label, markersize=4, **style)
    for ax, field_ in ((ax_time, "median_s"), (ax_rate, "gflops")):
        errs = [(r["seq_q"], r[field_]) for r in bad if r.get(field_)]
        if errs:
            ax.plot(*zip(*errs), linestyle="none", color=style["color"], label=_ERROR_LABEL, **_ERROR_MARKER)


def _plot_peaks(ax_rate, members, vertical: bool) -> None:
    """The measured matmul peak of each dtype among `members` as a dotted line on the GFLOP/s axes, named at
    its end: how far each row is from what the machine's own matmul reached in the same run (the highest, where
    a row's peak was measured again: the roof)."""
    peaks = {}
    for r in members:
        if r.get("peak_gflops"):
            peaks[r["dtype"]] = max(peaks.get(r["dtype"], 0.0), r["peak_gflops"])
    for dtype, peak in sorted(peaks.items()):
        line = ax_rate.axvline if vertical else ax_rate.axhline
        line(peak, linestyle=":", color="black", linewidth=1)
        text = f"{dtype} matmul peak {peak:.0f}"
        if vertical:
            ax_rate.text(peak, 1.0, text, transform=ax_rate.get_xaxis_transform(), ha="right", va="bottom", fontsize=7)
        else:
            ax_rate.text(1.0, peak, text, transform=ax_rate.get_yaxis_transform(), ha="right", va="bottom", fontsize=7)


def _plot_bars(ax_time, ax_rate, members, styles) -> None:
    """One horizontal bar per row (one sequence length): median with its IQR, and GFLOP/s.
    Labels name the implementation, and the dtype and shape only where the rows differ in them."""
    members = sorted(members, key=lambda r: str(_series_key(r)))
    varying = [k for k in ("dtype", "batch", "embed", "heads") if len({r[k] for r in members}) > 1]
    short = {"dtype": "", "batch": "B=", "embed": "E=", "heads": "N="}
    labels = [" ".join([_variant(r), *(f"{short[k]}{r[k]}" for k in varying)])
              + ("" if r["status"] == "ok" else f" ({r['status']})") for r in members]
    y = list(range(len(members)))
    colors = [styles[_series_key(r)]["color"] for r in members]
    hatch = ["xx" if r["status"] == "error" else ("//" if r["status"] == "noisy" else "") for r in members]
    edge = ["red" if r["status"] == "error" else "black" for r in members]
    for ax, values, err in ((ax_time, [r["median_s"] for r in members], _iqr_bars(members)),
                            (ax_rate, [r.get("gflops") or 0.0 for r in members], None)):
        drawn = ax.barh(y, values, xerr=err, color=colors, edgecolor=edge, capsize=3)
        for patch, h in zip(drawn, hatch):
            patch.set_hatch(h)
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()


# ---------------------------------------------------------------- reading saved runs


class BenchFileError(ValueError):
    """A file that is not a valid mha-bench JSON of this schema; the message is one line."""


def load(path: str) -> dict:
    """Read and validate an mha-bench JSON file; BenchFileError says what is wrong."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise BenchFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if not text.strip():
        raise BenchFileError(f"{path}: empty file, not an mha-bench JSON")
    try:
        data = parse_json(text, path)
    except JSONFileError as e:
        raise BenchFileError(str(e)) from None
    validate(data, path)
    return data


def validate(data, path: str = "input") -> None:
    """Check everything `compare`, `report` and the writers read from a loaded run: after it, none
    of them can raise on `data`. BenchFileError, one line naming the file (and row or verdict)."""
    if not isinstance(data, dict):
        raise BenchFileError(f"{path}: not an mha-bench JSON (top level is a {type(data).__name__}, not an object)")
    schema = data.get("schema")
    if schema is None:
        hint = " (it looks like an mha-parity report)" if {"summary", "rows"} <= set(data) else ""
        raise BenchFileError(f"{path}: not an mha-bench JSON: no 'schema' field{hint}")
    if schema not in READABLE_SCHEMAS:
        raise BenchFileError(f"{path}: schema {str(schema)[:80]!r} is not supported (this mha-bench reads "
                             f"{' and '.join(map(repr, READABLE_SCHEMAS))})")
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise BenchFileError(f"{path}: 'rows' must be a list, got {type(rows).__name__}")
    if not rows:
        raise BenchFileError(f"{path}: 'rows' is empty")
    problem = _environment_problem(data.get("environment", {}))
    if problem:
        raise BenchFileError(f"{path}: 'environment': {problem}")
    seen: dict = {}
    for i, row in enumerate(rows):
        problem = Row.problem(row)
        if problem:
            raise BenchFileError(f"{path}: row {i}{named(row)}: {problem}")
        first = seen.setdefault(match_key(row), i)
        if first != i:
            raise BenchFileError(f"{path}: row {i} repeats row {first} (same case, pass and implementation)")
    vs = data.get("verdicts", [])
    if not isinstance(vs, list):
        raise BenchFileError(f"{path}: 'verdicts' must be a list, got {type(vs).__name__}")
    for i, v in enumerate(vs):
        problem = Verdict.problem(v)
        if problem:
            raise BenchFileError(f"{path}: verdict {i}: {problem}")


def _environment_problem(env) -> str | None:
    """The environment fields the Markdown iterates or formats as numbers (the rest it only prints)."""
    if not isinstance(env, dict):
        return f"must be an object, got {type(env).__name__}"
    if not isinstance(env.get("versions", {}), dict):
        return f"versions must be an object, got {short(env['versions'])}"
    for name in ("peaks", "peak_measurements"):
        items = env.get(name, [])
        if not (isinstance(items, list) and all(isinstance(p, dict) for p in items)):
            return f"{name} must be a list of objects, got {short(items)}"
    for p in env.get("peaks", []):
        if p.get("gflops") is not None and not (finite(p["gflops"]) and p["gflops"] >= 0):
            return f"a peak's gflops = {short(p['gflops'])} is not a finite non-negative number"
        if p.get("gflops") and not isinstance(p.get("dtype"), str):
            return f"a peak's dtype = {short(p.get('dtype'))} is not a string"
    for name in ("interference", "interference_notes"):
        texts = env.get(name)
        if texts is not None and not (isinstance(texts, list) and all(isinstance(w, str) for w in texts)):
            return f"{name} must be null or a list of strings, got {short(texts)}"
    return None


# ---------------------------------------------------------------- compare


@dataclass
class Comparison:
    entries: list[dict] = field(default_factory=list)  # one per key present in both files
    only_base: list[dict] = field(default_factory=list)  # keys of rows present in BASE only
    only_new: list[dict] = field(default_factory=list)

    @property
    def compared(self) -> int:
        """Entries that carry a verdict on speed (ok in base; ok or no longer ok in new)."""
        return sum(e["verdict"] not in ("not compared",) for e in self.entries)

    @property
    def regressions(self) -> int:
        return sum(e["regression"] for e in self.entries)

    def count(self, verdict: str) -> int:
        return sum(e["verdict"] == verdict for e in self.entries)


def verdict(base_s: float, base_iqr: float, new_s: float, new_iqr: float, threshold: float) -> str:
    """The rule: a slow-down is a REGRESSION only when it is both larger than `threshold` of the
    base median and larger than the runs' noise, the mean of their IQRs ((iqr_base + iqr_new) / 2).
    Larger than the threshold but inside the noise: "noisy" (not counted). Speed-ups alike: "faster"."""
    diff, noise = new_s - base_s, (base_iqr + new_iqr) / 2
    if diff > threshold * base_s:
        return "REGRESSION" if diff > noise else "noisy"
    if -diff > threshold * base_s and -diff > noise:
        return "faster"
    return "ok"


def noisy(row) -> bool:
    """A measured row too noisy to decide anything with, by the run's own rule (spec.NOISY_IQR):
    status `noisy`, or an IQR/median above it in a file written before that status existed."""
    return row["status"] == "noisy" or row["iqr_s"] / row["median_s"] > NOISY_IQR


def compare(base: dict, new: dict, threshold: float = 0.10) -> Comparison:
    """Match the rows of two validated runs by case, pass and implementation (see `verdict`).

    A row measured in base and failed or skipped in new is a regression ("no longer ok"); a
    row not measured in base has no speed to compare against ("not compared"). A row noisy in
    either run (`noisy`, the run's own rule) decides nothing: "noisy", never a regression."""
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
    base_rows = {match_key(r): r for r in base["rows"]}
    new_rows = {match_key(r): r for r in new["rows"]}
    out = Comparison(
        only_base=[dict(zip(KEY_FIELDS, k)) for k in base_rows if k not in new_rows],
        only_new=[dict(zip(KEY_FIELDS, k)) for k in new_rows if k not in base_rows],
    )
    for k, r in new_rows.items():
        b = base_rows.get(k)
        if b is None:
            continue
        entry = {"key": dict(zip(KEY_FIELDS, k)), "base_s": b.get("median_s"), "new_s": r.get("median_s"),
                 "change": None, "noise": None, "regression": False, "note": ""}
        if b["status"] not in MEASURED:
            entry.update(verdict="not compared", note=f"base {b['status']}")
        elif r["status"] not in MEASURED:
            entry.update(verdict="no longer ok", regression=True, note=f"now {r['status']}: {r.get('message')}")
        else:
            why = [f"{name} {x['iqr_s'] / x['median_s']:.1%}" for name, x in (("base", b), ("new", r)) if noisy(x)]
            v = "noisy" if why else verdict(b["median_s"], b["iqr_s"], r["median_s"], r["iqr_s"], threshold)
            if None not in (b.get("mask_path"), r.get("mask_path")) and b["mask_path"] != r["mask_path"]:
                why.append(f"the mask reached the kernel as {b['mask_path']} in base, {r['mask_path']} in new")
            entry.update(change=r["median_s"] / b["median_s"] - 1, note="; ".join(why),
                         noise=(b["iqr_s"] + r["iqr_s"]) / 2 / b["median_s"], verdict=v, regression=v == "REGRESSION")
        out.entries.append(entry)
    return out


_VERDICT_STYLE = {"REGRESSION": "red", "no longer ok": "red", "noisy": "yellow", "faster": "green"}


def print_compare(result: Comparison, threshold: float, console: Console | None = None) -> None:
    """One table per case, at most CONSOLE_WIDTH columns; the notes too long for a cell below it."""
    console = console or Console()
    width = min(console.width, CONSOLE_WIDTH)
    console.print(f"mha-bench compare: REGRESSION = more than {threshold:.0%} slower and beyond the mean IQR of the "
                  f"two runs, or no longer ok; noisy = IQR/median above {NOISY_IQR:.0%} in either run, or a change "
                  "inside the noise", markup=False, width=width)
    by_case: dict = {}
    for e in result.entries:
        by_case.setdefault(_case(e["key"]), []).append(e)
    for case, entries in by_case.items():
        table = Table(title=case, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      padding=(0, 1), collapse_padding=True)
        for col in ("pass", "implementation", "base", "new", "change", "noise", "verdict"):
            table.add_column(col, no_wrap=True, overflow="ellipsis", max_width=30 if col == "implementation" else None,
                             justify="right" if col in ("base", "new", "change", "noise") else "left")
        notes = []
        for e in entries:
            k, v = e["key"], e["verdict"]
            short = v == "noisy" and e["note"]  # the IQR/median of the noisy run(s)
            cell = v + (f": {e['note']}" if short else "")
            if e["note"] and not short:
                notes.append(f"{k['pass']} {_variant(k)}: {v}: {e['note']}")
            table.add_row(k["pass"], _variant(k), _fmt_s(e["base_s"]), _fmt_s(e["new_s"]),
                          _fmt(e["change"], "{:+.1%}"), _fmt(e["noise"], "±{:.1%}"), Text(cell, style=_VERDICT_STYLE.get(v)))
        console.print(table, width=width)
        for note in notes:
            console.print("  " + note, markup=False, width=width)
    for name, keys in (("BASE", result.only_base), ("NEW", result.only_new)):
        if keys:
            console.print(f"{len(keys)} row(s) only in {name}:", markup=False)
            for k in keys:
                console.print(f"  {_case(k)}  {k['pass']}  {_variant(k)}", markup=False)


def environment_differences(base: dict, new: dict) -> list[str]:
    """The settings that make two runs' times incomparable, where they differ."""
    eb, en = base.get("environment") or {}, new.get("environment") or {}
    return [f"{k}: {eb.get(k)!r} vs {en.get(k)!r}" for k in ("device", "cpu_model", "precision", "threads")
            if eb.get(k) != en.get(k)]
