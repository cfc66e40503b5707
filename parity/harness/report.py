"""Report rows, the environment block, and the JSON / Markdown / terminal renderings."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

STATUSES = ("pass", "fail", "error", "skip")


@dataclass(frozen=True)
class Row:
    """One result: one quantity of one implementation against one reference."""

    case: str
    check: str  # forward | gradient | training | peers
    impl: str
    reference: str  # "oracle" (float64 NumPy) or another implementation's name
    dtype: str
    device: str
    status: str  # pass | fail | error | skip
    quantity: str = ""  # output, weights, d_inputs, d_params, loss, params
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    atol: float | None = None
    rtol: float | None = None
    stage: str = ""  # first diverging stage, on failure
    message: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass
class Report:
    environment: dict
    rows: list = field(default_factory=list)
    interrupted: bool = False
    elapsed_s: float = 0.0

    def summary(self) -> dict:
        counts = {s: 0 for s in STATUSES}
        for r in self.rows:
            counts[r.status] += 1
        return {"total": len(self.rows), **counts, "interrupted": self.interrupted, "elapsed_s": round(self.elapsed_s, 2)}

    @property
    def ok(self) -> bool:
        """Nothing failed or errored (skips are fine) and the run was not cut short."""
        s = self.summary()
        return s["fail"] == 0 and s["error"] == 0 and not self.interrupted

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


COLUMNS = ("case", "check", "impl", "reference", "dtype", "device", "quantity", "max_abs_err", "max_rel_err", "atol", "rtol", "status", "stage", "message")


def to_markdown(report: Report) -> str:
    env, s = report.environment, report.summary()
    lines = ["# mha-parity report", "", "## Environment", ""]
    lines += [f"- **{k}**: {v}" for k, v in env.items()]
    lines += ["", "## Summary", ""]
    lines += [f"{s['total']} rows: {s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['skip']} skip"
              + (" (interrupted)" if report.interrupted else "") + f"; {s['elapsed_s']} s", ""]
    lines += ["## Rows", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report.rows:
        cells = [fmt(getattr(r, c)).replace("|", "\\|").replace("\n", " ") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- terminal

_STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta", "skip": "yellow"}


def grouped(rows) -> list[dict]:
    """Rows folded per (check, impl, reference, dtype, quantity): counts and the worst error."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r.check, r.impl, r.reference, r.dtype, r.quantity)
        g = groups.setdefault(key, {"rows": 0, "pass": 0, "fail": 0, "error": 0, "skip": 0, "worst": None})
        g["rows"] += 1
        g[r.status] += 1
        if r.max_abs_err is not None and r.atol is not None:
            # Worst = largest error relative to what the row allowed.
            ratio = r.max_abs_err / (r.atol + (r.rtol or 0.0) or 1e-300)
            if g["worst"] is None or ratio > g["worst"][0]:
                g["worst"] = (ratio, r)
    return [{"key": k, **v} for k, v in groups.items()]


def print_report(report: Report, console, all_rows: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    env = report.environment
    console.print(
        f"[bold]mha-parity[/] seed={env.get('seed')} device={env.get('device')} x64={env.get('jax_enable_x64')} "
        f"precision: jax={env.get('jax_default_matmul_precision')} torch={env.get('torch_float32_matmul_precision')}"
    )
    if all_rows:
        table = Table(title="mha-parity: every row")
        for c in COLUMNS:
            table.add_column(c, overflow="fold")
        for r in report.rows:
            cells = [escape(fmt(getattr(r, c))) for c in COLUMNS]
            cells[COLUMNS.index("status")] = f"[{_STYLE[r.status]}]{r.status}[/]"
            table.add_row(*cells)
        console.print(table)
    else:
        table = Table(title="mha-parity (worst row of each group; --all-rows for every row)")
        for c in ("check", "impl", "reference", "dtype", "quantity", "rows", "max_abs_err", "max_rel_err", "atol", "rtol", "status"):
            table.add_column(c, justify="right" if c in ("rows",) or c.startswith(("max", "atol", "rtol")) else "left")
        for g in grouped(report.rows):
            check, impl, ref, dtype, qty = g["key"]
            worst = g["worst"][1] if g["worst"] else None
            status = next((s for s in ("error", "fail", "pass", "skip") if g[s]), "skip")
            counts = f"{g['pass']}/{g['rows']}" if status in ("pass", "fail") else f"{g[status]}/{g['rows']} {status}"
            w = [fmt(getattr(worst, c)) if worst else "" for c in ("max_abs_err", "max_rel_err", "atol", "rtol")]
            table.add_row(*map(escape, (check, impl, ref, dtype, qty, counts, *w)), f"[{_STYLE[status]}]{status}[/]")
        console.print(table)
    bad = [r for r in report.rows if r.status in ("fail", "error")]
    if bad and not all_rows:
        table = Table(title="failures and errors")
        for c in ("case", "check", "impl", "reference", "dtype", "quantity", "max_abs_err", "atol", "status", "stage", "message"):
            table.add_column(c, overflow="fold")
        for r in bad[:60]:
            cells = map(escape, (r.case, r.check, r.impl, r.reference, r.dtype, r.quantity, fmt(r.max_abs_err), fmt(r.atol)))
            table.add_row(*cells, f"[{_STYLE[r.status]}]{r.status}[/]", escape(r.stage), escape(r.message))
        console.print(table)
        if len(bad) > 60:
            console.print(f"... and {len(bad) - 60} more; see the JSON/Markdown report")
    skips = sorted({r.message for r in report.rows if r.status == "skip" and r.message})
    for msg in skips:
        console.print(f"[yellow]skip:[/] {escape(msg)}")
    s = report.summary()
    style = "green" if report.ok else "bold red"
    console.print(
        f"[{style}]{s['total']} rows: {s['pass']} pass, {s['fail']} fail, {s['error']} error, {s['skip']} skip"
        f"{' (interrupted)' if report.interrupted else ''} in {s['elapsed_s']} s[/]"
    )
