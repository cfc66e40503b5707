"""Outputs: the rich table, JSON, Markdown, the plot, and `compare`.

Rows flagged `error` after they were timed (a rate above the measured peak, an output that
differs from the others') keep their numbers: the tables show them with an "(error)" mark and
the plot draws them with a red cross, so a reader sees what was rejected instead of a hole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parity.atomic import atomic_path, write_atomic
from parity.bench.spec import ROW_FIELDS, STATUSES

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
    mark = " (error)" if status == "error" else ""  # a number that was measured but not trusted

    def marked(x, spec):
        return "-" if x is None else spec.format(x) + mark

    # Our JAX fused path chooses its kernel per problem: say which one ran.
    chosen = f" [{row['kernel']}]" if row.get("kernel") and row["impl"] == "ours-jax" and not row["need_weights"] else ""
    return [
        _case(row), row["pass"], _variant(row) + chosen, _fmt_s(row["median_s"]), _fmt_s(row["iqr_s"]),
        marked(row["ratio"], "{:.2f}×"), marked(row["gflops"], "{:.1f}"), marked(row["peak_fraction"], "{:.0%}"),
        _fmt_s(row["compile_s"]), _fmt_s(row["recompile_s"]), _mem(row["peak_mem_bytes"]), note,
    ]


def print_table(rows, console: Console | None = None) -> None:
    """One table per case (ratio = median / fastest implementation of that case and pass)."""
    console = console or Console()
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(_case(row), []).append(row)
    for case, members in by_case.items():
        table = Table(title=f"{case}  (ratio = median / fastest ok row of the same pass)", title_justify="left")
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
        f"- measured matmul peak (best square matmul of either framework, any worker): {peaks or 'n/a'}; "
        f"{sum('remeasured_for' in p for p in env.get('peak_measurements', []))} re-measured because a row beat it",
        f"- load average at the start: {env.get('loadavg_start')}, at the end: {env.get('loadavg_end')} "
        f"on {env.get('cpu_count')} cores (other processes on the machine make timings noisy)",
        f"- FLOPs: {env.get('flops_formula')}; ratio = median / fastest ok row of the same case and pass; "
        "numbers marked (error) were measured but rejected (see the status column)",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(row)) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, rows, env: dict) -> None:
    write_atomic(path, markdown(rows, env).encode())


# ---------------------------------------------------------------- plot

# Colour = implementation and mode, linestyle = weights or fused, marker = dtype; a second,
# third ... shape (B, E, N) of the same variant gets hollow markers and a thicker line.
# Together these make every series' look unique (tests/test_bench.py checks it).
_LINESTYLES = {True: "-", False: "--"}  # need_weights: with weights solid, fused dashed
_MARKERS = {"float32": "o", "bfloat16": "s", "float16": "^"}


def _series_key(row) -> tuple:
    return (row["impl"], row["mode"], row["need_weights"], row["dtype"], row["batch"], row["embed"], row["heads"])


def series_styles(rows) -> dict[tuple, dict]:
    """{series key: matplotlib keyword arguments}, for every series with a median in `rows`."""
    keys = sorted({_series_key(r) for r in rows if r.get("median_s")}, key=str)
    variants = list(dict.fromkeys((k[0], k[1]) for k in keys))  # (impl, mode), first-seen order
    shapes = sorted({k[4:] for k in keys})
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


def plot_title(rows, env: dict | None) -> str:
    env = env or {}
    device = env.get("device") or ", ".join(sorted({str(r.get("device")) for r in rows}))
    model = env.get("cpu_model") if device == "cpu" else None
    bits = [f"device {device}" + (f" ({model})" if model else ""), f"preset {env.get('preset', '?')}",
            f"precision {env.get('precision', '?')}"]
    return "mha-bench: " + ", ".join(bits)


def write_plot(path: str, rows, env: dict | None = None) -> None:
    """Time and GFLOP/s against sequence length, log-log, one column per pass.

    Rows flagged `error` that still have a time are drawn as red crosses, off the lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.lines
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["status"] in ("ok", "error") and r.get("median_s")]
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in timed)] or ["fwd"]
    styles = series_styles(timed)
    fig, axes = plt.subplots(2, len(passes), figsize=(6.5 * len(passes), 8.5), squeeze=False)
    for col, pass_ in enumerate(passes):
        for key, style in styles.items():
            members = sorted((r for r in timed if r["pass"] == pass_ and _series_key(r) == key), key=lambda r: r["seq_q"])
            if members:
                _plot_series(axes[0][col], axes[1][col], members, style)
        for ax, ylabel in ((axes[0][col], "median time (s)"), (axes[1][col], "GFLOP/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length (T = S)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_title(f"{pass_}")
    fig.suptitle(plot_title(rows, env), fontsize=10)
    legend: dict = {}  # label -> handle, once each: a series may appear in one pass only
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    if _ERROR_LABEL in legend:  # one neutral entry for the crosses of every series, listed last
        del legend[_ERROR_LABEL]
        legend[_ERROR_LABEL] = matplotlib.lines.Line2D([], [], linestyle="none", color="grey", **_ERROR_MARKER)
    handles, labels = list(legend.values()), list(legend)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7)
    fig.tight_layout(rect=(0, 0.04 + 0.018 * math.ceil(len(labels) / 2), 1, 0.97))
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


_ERROR_LABEL = "error row (measured, not trusted)"
_ERROR_MARKER = {"marker": "X", "markersize": 9, "markeredgecolor": "red", "markeredgewidth": 1.5}


def _plot_series(ax_time, ax_rate, members, style) -> None:
    """One series on both axes: a line through its ok points, red crosses on its error points."""
    r0 = members[0]
    label = f"{_variant(r0)} {r0['dtype']} B={r0['batch']} E={r0['embed']} N={r0['heads']}"
    ok = [r for r in members if r["status"] == "ok"]
    bad = [r for r in members if r["status"] == "error"]
    for ax, field_ in ((ax_time, "median_s"), (ax_rate, "gflops")):
        pts = [(r["seq_q"], r[field_]) for r in ok if r.get(field_)]
        if pts:
            ax.plot(*zip(*pts), label=label, markersize=4, **style)
        errs = [(r["seq_q"], r[field_]) for r in bad if r.get(field_)]
        if errs:
            ax.plot(*zip(*errs), linestyle="none", color=style["color"], label=_ERROR_LABEL, **_ERROR_MARKER)


# ---------------------------------------------------------------- reading saved runs


class BenchFileError(ValueError):
    """A file that is not a valid mha-bench JSON of this schema; the message is one line."""


_INT_FIELDS = ("batch", "seq_q", "seq_k", "embed", "heads")
_STR_FIELDS = ("impl", "mode", "pass", "dtype")


def load(path: str) -> dict:
    """Read and validate an mha-bench JSON file; BenchFileError says what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BenchFileError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise BenchFileError(f"{path}: empty file, not an mha-bench JSON")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    validate(data, path)
    return data


def validate(data, path: str = "input") -> None:
    if not isinstance(data, dict):
        raise BenchFileError(f"{path}: not an mha-bench JSON (top level is a {type(data).__name__}, not an object)")
    schema = data.get("schema")
    if schema is None:
        hint = " (it looks like an mha-parity report)" if {"summary", "rows"} <= set(data) else ""
        raise BenchFileError(f"{path}: not an mha-bench JSON: no 'schema' field{hint}")
    if schema != SCHEMA:
        raise BenchFileError(f"{path}: schema {schema!r} is not supported (this mha-bench reads {SCHEMA!r})")
    rows = data.get("rows")
    if not isinstance(rows, list):
        raise BenchFileError(f"{path}: 'rows' must be a list, got {type(rows).__name__}")
    if not rows:
        raise BenchFileError(f"{path}: 'rows' is empty")
    if not isinstance(data.get("environment", {}), dict):
        raise BenchFileError(f"{path}: 'environment' must be an object")
    seen: dict = {}
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            raise BenchFileError(f"{path}: row {i}: {problem}")
        first = seen.setdefault(_key(row), i)
        if first != i:
            raise BenchFileError(f"{path}: row {i} repeats row {first} (same case, pass and implementation)")


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _row_problem(row) -> str | None:
    if not isinstance(row, dict):
        return f"not an object ({type(row).__name__})"
    missing = [k for k in (*MATCH_KEY, "status", "median_s", "iqr_s") if k not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    if row["status"] not in STATUSES:
        return f"status {row['status']!r} is not one of {STATUSES}"
    bad = [k for k in _STR_FIELDS if not isinstance(row[k], str)]
    bad += [k for k in _INT_FIELDS if not (isinstance(row[k], int) and not isinstance(row[k], bool) and row[k] > 0)]
    bad += [] if isinstance(row["need_weights"], bool) else ["need_weights"]
    if bad:
        return f"bad value(s) for {', '.join(f'{k}={row[k]!r}' for k in bad)}"
    for name, lowest in (("median_s", "positive"), ("iqr_s", "non-negative")):
        x = row[name]
        if x is None and (row["status"] != "ok"):
            continue
        if not (_is_num(x) and math.isfinite(x) and (x > 0 if lowest == "positive" else x >= 0)):
            return f"{name} = {x!r} is not a finite {lowest} number ({row['status']} row)"
    return None


def _key(row) -> tuple:
    return tuple(row.get(k) for k in MATCH_KEY)


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


def compare(base: dict, new: dict, threshold: float = 0.10) -> Comparison:
    """Match the rows of two validated runs by case, pass and implementation (see `verdict`).

    A row ok in base and not ok in new is a regression ("no longer ok"); a row not ok in
    base has no speed to compare against ("not compared")."""
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive finite number, got {threshold!r}")
    base_rows = {_key(r): r for r in base["rows"]}
    new_rows = {_key(r): r for r in new["rows"]}
    out = Comparison(
        only_base=[dict(zip(MATCH_KEY, k)) for k in base_rows if k not in new_rows],
        only_new=[dict(zip(MATCH_KEY, k)) for k in new_rows if k not in base_rows],
    )
    for k, r in new_rows.items():
        b = base_rows.get(k)
        if b is None:
            continue
        entry = {"key": dict(zip(MATCH_KEY, k)), "base_s": b.get("median_s"), "new_s": r.get("median_s"),
                 "change": None, "noise": None, "regression": False, "note": ""}
        if b["status"] != "ok":
            entry.update(verdict="not compared", note=f"base {b['status']}")
        elif r["status"] != "ok":
            entry.update(verdict="no longer ok", regression=True, note=f"now {r['status']}: {r.get('message')}")
        else:
            v = verdict(b["median_s"], b["iqr_s"], r["median_s"], r["iqr_s"], threshold)
            entry.update(change=r["median_s"] / b["median_s"] - 1,
                         noise=(b["iqr_s"] + r["iqr_s"]) / 2 / b["median_s"], verdict=v, regression=v == "REGRESSION")
        out.entries.append(entry)
    return out


_VERDICT_STYLE = {"REGRESSION": "red", "no longer ok": "red", "noisy": "yellow", "faster": "green"}


def print_compare(result: Comparison, threshold: float, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"mha-bench compare (REGRESSION: > {threshold:.0%} slower and beyond the mean IQR of the "
                  "two runs, or no longer ok)")
    for col in ("case", "pass", "implementation", "base", "new", "change", "noise", "verdict"):
        table.add_column(col)
    for e in result.entries:
        k, v = e["key"], e["verdict"]
        style = _VERDICT_STYLE.get(v)
        table.add_row(
            escape(_case(k)), k["pass"], escape(_variant(k)), _fmt_s(e["base_s"]), _fmt_s(e["new_s"]),
            _fmt(e["change"], "{:+.1%}"), _fmt(e["noise"], "±{:.1%}"),
            (f"[{style}]{v}[/{style}]" if style else v) + (f" {escape(e['note'])}" if e["note"] else ""),
        )
    console.print(table)
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
