"""Report rows, the environment block, and the JSON / Markdown / terminal renderings."""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import asdict, dataclass, field

from mha_spec import DTYPE_NAMES
from parity.tolerances import ratio

STATUSES = ("pass", "fail", "error", "skip")


@dataclass(frozen=True)
class Row:
    """One result: one quantity of one implementation against one reference."""

    case: str
    check: str  # forward | gradient | leak | training | peers | decode
    impl: str
    reference: str  # "oracle" (float64 NumPy) or another implementation's name
    dtype: str
    device: str
    status: str  # pass | fail | error | skip
    quantity: str = ""  # output, weights, d_inputs, d_params, loss, params; decode: prefill, step 1, ...
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    stage: str = ""  # first diverging stage, on failure
    message: str = ""
    kernel: str = ""  # the attention kernel its forward call ran (`parity.kernel_ran`); "" where not read
    # max error ÷ the bound it was allowed, computed with the verdict (`parity.tolerances.Comparison.margin`):
    # at most 1 on a pass, above 1 on a fail; None: not judged by a bound (skip, error, a row without numbers)
    margin: float | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")
        if self.margin is not None and self.status == "fail" and not self.margin > 1:
            # it fails on something other than the size of its error (NaN placement, values that could not
            # be compared): no bound covers that
            object.__setattr__(self, "margin", math.inf)


def error_row(unit, check: str, impl, ref: str, exc: BaseException, **kw) -> Row:
    """The row of a call that raised: `unit.row` (parity.harness.checks.Unit) with status "error", the
    exception's type and message and where it was raised; kw: more of `unit.row`'s keywords."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return unit.row(check, impl, ref, "error", message=f"{type(exc).__name__}: {exc}"[:500] + where, **kw)


@dataclass
class Report:
    environment: dict
    rows: list = field(default_factory=list)
    interrupted: bool = False
    elapsed_s: float = 0.0
    write_errors: list = field(default_factory=list)  # report files that could not be written
    unchecked: list = field(default_factory=list)  # the user's implementations that no unit ran (each skipped)
    users: list = field(default_factory=list)  # the user's Implementation objects, for the verdict in words

    def summary(self) -> dict:
        counts = {s: 0 for s in STATUSES}
        for r in self.rows:
            counts[r.status] += 1
        return {"total": len(self.rows), **counts, "interrupted": self.interrupted, "elapsed_s": round(self.elapsed_s, 2),
                "unchecked": list(self.unchecked)}

    @property
    def checked_nothing(self) -> bool:
        return self.summary()["pass"] == 0

    @property
    def ok(self) -> bool:
        """Something was checked and passed, nothing failed or errored (skips are fine), not cut short,
        and every implementation of the user's was checked somewhere (a layer that skipped every unit,
        e.g. one declaring no variants on the variant cases, is not a pass)."""
        s = self.summary()
        return s["pass"] > 0 and s["fail"] == 0 and s["error"] == 0 and not self.interrupted and not self.unchecked

    def to_dict(self) -> dict:
        return {"environment": self.environment, "summary": self.summary(), "rows": [_jsonable(asdict(r)) for r in self.rows]}


def _jsonable(d: dict) -> dict:
    # JSON has no inf/nan; write them as strings rather than emit invalid JSON.
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=1) + "\n"


def fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


COLUMNS = ("case", "check", "impl", "reference", "dtype", "device", "quantity", "max_abs_err", "max_rel_err", "atol", "rtol",
           "margin", "status", "stage", "kernel", "message")


def cell(r: Row, column: str) -> str:
    """One of COLUMNS of a row, as the tables print it."""
    return fmt_margin(margin(r)) if column == "margin" else fmt(getattr(r, column))


def to_markdown(report: Report) -> str:
    env, s = report.environment, report.summary()
    lines = ["# mha-parity report", "", "## Summary", ""]
    lines += [f"{s['total']} rows: {s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['skip']} skip"
              + (" (interrupted)" if report.interrupted else "") + f"; {s['elapsed_s']} s"
              + ("; **nothing was checked**" if report.checked_nothing else "")
              + (f"; **nothing was checked for {', '.join(report.unchecked)}**" if report.unchecked else ""), ""]
    lines += ["One line per (check, implementation, reference, dtype, quantity): its worst row. "
              "margin = max error ÷ the bound it was allowed (< 1 passes).", ""]
    cols = GROUP_COLUMNS + WIDE_COLUMNS
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells, _ in group_cells(report.rows, wide=True)]
    skips = sorted({r.message for r in report.rows if r.status == "skip" and r.message})
    if skips:
        lines += ["", "Skipped, and why:", ""] + [f"- {m}" for m in skips]
    lines += ["", "## Environment", ""]
    lines += [f"- **{k}**: {v}" for k, v in env.items()]
    lines += ["", "## Rows", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report.rows:
        cells = [cell(r, c).replace("|", "\\|").replace("\n", " ") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- terminal

_STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta", "skip": "yellow"}
MAX_SKIP_LINES = 8  # more distinct skip reasons than this are counted, not printed (--details prints them)


def grouped(rows) -> list[dict]:
    """Rows folded per (check, impl, reference, dtype, quantity): counts and the worst row by margin."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r.check, r.impl, r.reference, r.dtype, r.quantity)
        g = groups.setdefault(key, {"rows": 0, "pass": 0, "fail": 0, "error": 0, "skip": 0, "worst": None})
        g["rows"] += 1
        g[r.status] += 1
        m = margin(r)
        if m is not None and (g["worst"] is None or m > g["worst"][0]):
            g["worst"] = (m, r)
    return [{"key": k, **v} for k, v in groups.items()]


def margin(r: Row) -> float | None:
    """The fraction of its bound a row used: `Row.margin`, as its judge computed it with the verdict (at most
    1 passes, above 1 fails). A row made without one (by hand, or an older report's) gets max_abs_err ÷
    (atol + rtol) -- 0 for no error, inf for an error where the bound is 0 -- and inf if it fails within it."""
    if r.margin is not None:
        return r.margin
    if r.max_abs_err is None or r.atol is None or not isinstance(r.max_abs_err, float):
        return None
    m = ratio(r.max_abs_err, (r.atol or 0.0) + (r.rtol or 0.0))
    return m if r.status != "fail" or m > 1 else math.inf


def fmt_margin(m: float | None) -> str:
    """A margin as the tables print it: two significant digits, "inf" for an unbounded one."""
    return "" if m is None else ("inf" if math.isinf(m) else f"{m:.2g}")


GROUP_COLUMNS = ("check", "impl", "vs", "dtype", "qty", "rows", "margin", "status")
WIDE_COLUMNS = ("max_abs_err", "max_rel_err", "atol", "rtol")
# Short forms so that the default table fits 80 columns; the reports keep the full names.
_SHORT = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16", "forward": "fwd",
          "gradient": "grad", "training": "train", "output": "out", "weights": "wts", "d_inputs": "d_in",
          "d_params": "d_par", "params": "par"}


def group_status(g: dict) -> str:
    return next((s for s in ("error", "fail", "pass", "skip") if g[s]), "skip")


def group_cells(rows, wide: bool = False) -> list[tuple[list[str], str]]:
    """(cells, status) per group, in GROUP_COLUMNS order (+ WIDE_COLUMNS when wide)."""
    out = []
    for g in grouped(rows):
        check, impl, ref, dtype, qty = g["key"]
        worst = g["worst"][1] if g["worst"] else None
        st = group_status(g)
        counts = f"{g['pass']}/{g['rows']}" if st in ("pass", "fail") else f"{g[st]}/{g['rows']}"
        m = fmt_margin(g["worst"][0]) if g["worst"] else ""
        cells = [_SHORT.get(check, check), impl, ref, _SHORT.get(dtype, dtype), _SHORT.get(qty, qty), counts, m, st]
        if wide:
            cells += [fmt(getattr(worst, c)) if worst else "" for c in WIDE_COLUMNS]
        out.append((cells, st))
    return out


SUMMARY_COLUMNS = ("impl", "check", "dtype", "rows", "margin", "status")


def summary_cells(rows) -> list[tuple[list[str], str]]:
    """(cells, status) per (implementation, check, dtype): the console's default table, in SUMMARY_COLUMNS order.

    rows: "passed/judged" (or the count of the group's status); margin: the worst over every
    quantity and reference of the group."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        g = groups.setdefault((r.impl, r.check, r.dtype), {"rows": 0, "pass": 0, "fail": 0, "error": 0, "skip": 0,
                                                           "worst": None})
        g["rows"] += 1
        g[r.status] += 1
        m = margin(r)
        if m is not None and (g["worst"] is None or m > g["worst"]):
            g["worst"] = m
    out = []
    for (impl, check, dtype), g in groups.items():
        st = group_status(g)
        judged = g["rows"] - g["skip"]
        counts = f"{g['pass']}/{judged}" if st in ("pass", "fail", "error") else f"{g['skip']} skip"
        m = fmt_margin(g["worst"])
        out.append(([impl, _SHORT.get(check, check), _SHORT.get(dtype, dtype), counts, m, st], st))
    return out


def _short_reason(impl: str, message: str) -> str:
    """A skip message without the implementation's name in front, cut to one short clause."""
    text = message.removeprefix(f"{impl} ").split("; ")[0]
    return text if len(text) <= 90 else text[:87] + "..."


def verdict_lines(report: Report) -> list[tuple[str, str]]:
    """(style, text) per user implementation: what was checked and how it came out, in words."""
    out = []
    for impl in report.users:
        mine = [r for r in report.rows if r.impl == impl.name]
        ran = [r for r in mine if r.status != "skip"]
        cases = sorted({r.case for r in ran})
        skipped = sorted({r.case for r in mine if r.case != "*"} - set(cases))
        reasons = sorted({_short_reason(impl.name, r.message) for r in mine if r.status == "skip" and r.case in skipped})
        tail = (f", {len(skipped)} skipped: {'; '.join(reasons[:2])}" + (" ..." if len(reasons) > 2 else "")
                if skipped else "")
        if not ran:
            out.append(("bold red", f"{impl.name}: nothing was checked{tail}"))
            continue
        bad = [r for r in ran if r.status in ("fail", "error")]
        checks = [c for c in ("forward", "gradient", "leak", "decode", "peers", "training") if any(r.check == c for r in ran)]
        dtypes = [d for d in DTYPE_NAMES if any(r.dtype == d for r in ran)]
        at = ""
        if impl.computes_in is not None and any(impl.judged_at(d) != d for d in dtypes):
            at = f" ({', '.join(d for d in dtypes if impl.judged_at(d) != d)} at the {impl.computes_in} bound: computes_in)"
        if not bad:
            judged = [c for c in checks if c != "leak"]  # the leak rows compare a run with itself, not the oracle
            what = " and ".join({"forward": "forward", "gradient": "gradients", "decode": "decode steps"}.get(c, c)
                                for c in judged)
            verb = "matches" if judged == ["forward"] else "match"
            leak = "; nothing crosses the structured masks (leak rows bit for bit)" if "leak" in checks else ""
            text = (f"{what} {verb} the float64 oracle within {', '.join(dtypes)} bounds{at} " if judged
                    else "leak rows pass ")
            out.append(("green", f"{impl.name}: {text}on {len(cases)} case{'s' if len(cases) != 1 else ''}"
                                 f"{leak if judged else ''}{tail}"))
            continue
        parts = []
        for c in checks:
            failing = [r for r in bad if r.check == c]
            if failing:
                stages = sorted({r.stage for r in failing if r.stage})
                where = f" (first diverging stage: {', '.join(stages)})" if stages else ""
                parts.append(f"{c} on {len({r.case for r in failing})} of {len({r.case for r in ran if r.check == c})} "
                             f"cases{where}")
        out.append(("bold red", f"{impl.name}: FAILS {'; '.join(parts)}{tail}"))
    return out


def _table(report: Report, all_rows: bool, all_columns: bool, details: bool):
    """The console table: the summary (default), every row (all_rows), or the per-group one (details). Every
    cell is a rich Text: names and messages are printed as written (no markup, no emoji codes)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def styled(cells, columns, st):
        cells = [Text(c) for c in cells]
        cells[columns.index("status")] = Text(st, style=_STYLE[st])
        return cells

    if not all_rows and not details and not all_columns:
        table = Table(title=Text("per implementation, check, dtype; margin = worst error ÷ bound (< 1 passes)"),
                      box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for c in SUMMARY_COLUMNS:
            table.add_column(c, justify="right" if c in ("rows", "margin") else "left", no_wrap=True)
        for cells, st in summary_cells(report.rows):
            table.add_row(*styled(cells, SUMMARY_COLUMNS, st))
    elif all_rows:
        table = Table(title=Text("mha-parity: every row"), box=box.SIMPLE_HEAD)
        for c in COLUMNS:
            table.add_column(c, overflow="fold")
        for r in report.rows:
            table.add_row(*styled([cell(r, c) for c in COLUMNS], COLUMNS, r.status))
    else:
        table = Table(title=Text("worst row of each group; margin = error ÷ bound (< 1 passes)"), box=box.SIMPLE_HEAD,
                      pad_edge=False, title_justify="left")
        for c in GROUP_COLUMNS + (WIDE_COLUMNS if all_columns else ()):
            numeric = c in ("rows", "margin") + WIDE_COLUMNS
            # Only the names may fold; numbers and short fields never do.
            table.add_column(c, justify="right" if numeric else "left", no_wrap=c not in ("impl", "vs"), overflow="fold")
        for cells, st in group_cells(report.rows, wide=all_columns):
            table.add_row(*styled(cells, GROUP_COLUMNS + (WIDE_COLUMNS if all_columns else ()), st))
    return table


def print_table(console, table) -> None:
    """`table` printed line by line without the spaces rich pads its cells with at the end of a line."""
    from rich.text import Text

    for line in console.render_lines(table, console.options, pad=False, new_lines=False):
        text = Text()
        for segment in line:
            if not segment.control:
                text.append(segment.text, segment.style)
        text.rstrip()
        console.print(text, soft_wrap=True)


def _say(console, *parts) -> None:
    """One line of text: each part a str (printed as written: no markup, no emoji codes) or (str, style)."""
    from rich.text import Text

    console.print(Text.assemble(*parts), soft_wrap=True)


def print_report(report: Report, console, all_rows: bool = False, all_columns: bool = False,
                 details: bool = False) -> None:
    """The summary table (one line per implementation, check and dtype; readable at 80 columns), failures
    with their stage, the skip reasons, the counts and one line in words per user implementation.
    details: one line per (check, implementation, reference, dtype, quantity) instead, and every skip
    reason; all_rows: every row. Everything is printed as text (rich Text): what a layer's name or message
    says is never read as markup or emoji codes; no line ends in spaces."""
    env = report.environment
    _say(console, ("mha-parity", "bold"),
         f" seed={env.get('seed')} device={env.get('device')} x64={env.get('jax_enable_x64')} "
         f"precision: jax={env.get('jax_default_matmul_precision')} torch={env.get('torch_float32_matmul_precision')}")
    print_table(console, _table(report, all_rows, all_columns, details))
    _print_failures(report, console, all_rows)
    skips = sorted({r.message for r in report.rows if r.status == "skip" and r.message})
    if details or all_rows or len(skips) <= MAX_SKIP_LINES:
        for msg in skips:
            _say(console, ("skip:", "yellow"), f" {msg}")
    else:
        _say(console, ("skip:", "yellow"), f" {len(skips)} distinct reasons (--details prints them; the reports hold them)")
    s = report.summary()
    style = "green" if report.ok else "bold red"
    _say(console, (f"{s['total']} rows: {s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['skip']} skip"
                   f"{' (interrupted)' if report.interrupted else ''} in {s['elapsed_s']} s", style))
    if report.checked_nothing:
        _say(console, ("nothing was checked: no row passed (see the skip reasons above)", "bold red"))
    elif report.unchecked:
        _say(console, (f"nothing was checked for {', '.join(report.unchecked)}: every unit skipped it "
                       "(see the skip reasons above)", "bold red"))
    for style, text in verdict_lines(report):
        _say(console, (text, style))


def failure_numbers(r: Row) -> str:
    """A failing row's numbers, as its margin says them: "margin 2.3: err 2.3e-06 > bound 1.00e-06"; an
    elementwise bound (atol + rtol·|expected|) or a row failing within its bound (NaN placement, values not
    compared: margin inf) shows its bound without a comparison sign."""
    if r.max_abs_err is None:
        return ""
    bound = f"{fmt(r.atol)}" + (f" + {fmt(r.rtol)}·|expected|" if r.rtol else "")
    over = not r.rtol and r.atol is not None and r.max_abs_err > r.atol
    return f" margin {fmt_margin(margin(r))}: err {fmt(r.max_abs_err)}" + (f" > bound {bound}" if over else f", bound {bound}")


def _print_failures(report: Report, console, all_rows: bool) -> None:
    """Each failure or error as a short block: it has room for its stage and message at 80 columns."""
    bad = [r for r in report.rows if r.status in ("fail", "error")]
    if not bad or all_rows:
        return
    _say(console, (f"{len(bad)} failure(s)/error(s):", "bold red"))
    for r in bad[:40]:
        where = f" stage={r.stage}" if r.stage else ""
        _say(console, (r.status, _STYLE[r.status]),
             f" {r.case} {r.check} {r.impl} vs {r.reference} {r.dtype} {r.quantity}{failure_numbers(r)}{where}")
        if r.message:
            _say(console, f"    {r.message}")
    if len(bad) > 40:
        _say(console, f"... and {len(bad) - 40} more; see the JSON/Markdown report")
