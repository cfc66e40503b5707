"""The forward check: each implementation's output (and weights) against the oracle, and our torch module."""

from __future__ import annotations

from parity.harness.checks.check import Check
from parity.harness.checks.common import (changed_rows, disagreement, ref_name, skip_reason, torch_reference,
                                          versus_torch)
from parity.harness.checks.divergence import divergence
from parity.harness.checks.pairs import pair_rows
from parity.harness.judge import judge, status
from parity.harness.judge import margin as judge_margin
from parity.harness.report import Row, error_row
from parity.impls import Implementation
from parity.tolerances import Comparison, errors


def judge_forward(unit, impl: Implementation, policy: str, out, w, check: str = "forward", note: str = "") -> list[Row]:
    exact, low = unit.oracle.forward(policy, unit.judged(impl))
    tol, k = unit.table(impl).forward, unit.table(impl).three_way_k
    note = "; ".join(n for n in (note, unit.judged_note(impl)) if n)
    quantities = [("output", out)] + ([] if w is None else [("weights", w)])
    cmps = [(q, a, judge(a, getattr(exact, q), tol, k, None if low is None else getattr(low, q))) for q, a in quantities]
    extra = divergence(unit, impl, policy) if any(not c.passed for *_, c in cmps) else {}
    rows = []
    for q, a, c in cmps:
        kw = dict(extra) if not c.passed else {}
        message = [note] if note else []
        if not c.passed:
            autograd = _autograd_note(unit, impl, q, c, tol, k, exact, low) if check == "gradient" else ""
            message += [disagreement(c, a, getattr(exact, q)), autograd or extra.get("message", "")]
        kw["message"] = "; ".join(m for m in message if m)
        rows.append(unit.row(check, impl, "oracle", status(c), q, c, **kw))
    return rows


def _autograd_note(unit, impl: Implementation, q: str, c: Comparison, tol, k, exact, low) -> str:
    """Why the gradient call's `q` fails where it was measured: the forward check's call of the same
    implementation on the same inputs (autograd off) passing the same bound says the difference is autograd's;
    "" when the forward check did not run this implementation or failed it too (nothing apart was measured)."""
    plain = (unit.results.get(("forward", impl.name)) or {}).get(q)
    if plain is None:
        return ""
    off = judge(plain, getattr(exact, q), tol, k, getattr(low, q))
    if not off.passed:
        return ""
    return (f"its forward call (autograd off) passes the same bound (margin {judge_margin(off):.2g}) and this call "
            f"(autograd on) does not (margin {judge_margin(c):.2g}): it computes differently with autograd on")


def _forward_vs_torch(unit, impl: Implementation, policy: str, got: dict) -> list[Row]:
    ref = ref_name(unit, policy)
    try:
        base = torch_reference(unit, policy, "forward")
    except Exception as e:
        return [error_row(unit, "forward", impl, ref, e)]
    exact, low = unit.oracle.forward(policy, unit.judged(impl))
    rows = []
    for q, a in got.items():
        if a is None or base[q] is None:
            continue
        yard_err = None if low is None else errors(getattr(low, q), getattr(exact, q))[0]
        table = unit.table(impl)
        c = judge(a, base[q], table.forward, table.three_way_k, yard_err=yard_err)
        message = [unit.judged_note(impl)] + ([] if c.passed else [disagreement(c, a, base[q])])
        rows.append(unit.row("forward", impl, ref, status(c), q, c, message="; ".join(m for m in message if m)))
    return rows


def _prefetch(unit, impls) -> None:
    """The implementations a runner computes jointly (`joins`: JAX's jit ones), forward and gradients in one
    program per runner (see JaxRunner.prefetch)."""
    if "gradient" not in unit.checks:
        return
    for runner in unit.runners.values():
        joined = [i for i in impls if unit.runner(i) is runner and runner.joins(i) and not skip_reason(unit, i, "gradient")]
        if not joined:
            continue
        try:
            builts = [unit.built(i, i.policy(unit.case.masked_rows)) for i in joined]
            runner.prefetch(builts, *unit.inputs(), unit.x.cotangent)
        except Exception:  # noqa: BLE001 - each implementation then reports its own error
            pass


def check_forward(unit, impls) -> list[Row]:
    rows = []
    _prefetch(unit, impls)
    for impl in impls:
        why = skip_reason(unit, impl, "forward")
        if why:
            rows.append(unit.row("forward", impl, "oracle", "skip", message=why))
            continue
        policy = impl.policy(unit.case.masked_rows)
        try:
            out, w = unit.forward(impl, policy)
        except Exception as e:
            rows.append(error_row(unit, "forward", impl, "oracle", e))
            continue
        rows += changed_rows(unit, impl, "forward", policy)
        unit.results[("forward", impl.name)] = {"output": out, "weights": w}
        rows += judge_forward(unit, impl, policy, out, w)
        if versus_torch(unit, impl):
            rows += _forward_vs_torch(unit, impl, policy, {"output": out, "weights": w})
        rows += changed_rows(unit, impl, "forward", policy)  # the divergence search and our torch calls
    return rows


CHECK = Check("forward", lambda unit, impls, peers: check_forward(unit, impls) + pair_rows(unit, impls, "forward"),
              runs=lambda impl: not impl.decode)

__all__ = ["check_forward", "judge_forward", "CHECK"]
