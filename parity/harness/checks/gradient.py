"""The gradient check: each implementation's gradients (inputs, parameters) against the oracle's under the
masked-row gradient it declares, and against our torch module's; the output of that call too."""

from __future__ import annotations

import numpy as np

from parity import reference
from parity.harness.checks.check import Check
from parity.harness.checks.common import (GRAD_GROUPS, changed_rows, fully_masked_rows, grad_group, one_input, ref_name,
                                          skip_reason, torch_reference, versus_torch)
from parity.harness.checks.divergence import divergence
from parity.harness.checks.forward import judge_forward
from parity.harness.checks.pairs import pair_rows
from parity.harness.judge import judge, judge_grads, status
from parity.harness.report import Row, error_row
from parity.impls import Implementation


def _masked_row_note(unit, got: dict, expected: dict, failing) -> str:
    """Why q/k gradients differ on fully masked rows, when that is what they do (else "")."""
    rows = fully_masked_rows(unit)
    q = got.get("query")
    if not rows or q is None or not ({"query", "key"} & set(failing)):
        return ""
    a, e = reference.as_float64(q), reference.as_float64(expected["query"])
    tensors = ", ".join(n for n in failing if n.split(".")[0] in ("query", "key", "q_proj", "k_proj"))
    where = ", ".join(f"({b}, {t})" for b, t in rows[:6]) + (" ..." if len(rows) > 6 else "")
    nan_rows = [r for r in rows if np.isnan(a[r]).any() and not np.isnan(e[r]).any()]
    if nan_rows:
        return (f"NaN in {tensors}, from the fully masked (batch, query) rows {where}, where the oracle is finite: "
                "their NaN softmax is differentiated through the scores, as with an additive mask (scores + 0/-inf); "
                "a select (where(keep, scores, -inf)) keeps that NaN in the value gradients, as the classic module does "
                "(declare masked_row_grads='flow' if the additive mask is meant)")
    bound = unit.tol.gradient.atol
    moved = [r for r in rows if np.all(e[r] == 0) and np.nanmax(np.abs(a[r])) > bound]
    if moved:
        return (f"non-zero gradients in {tensors} from the fully masked (batch, query) rows {where}, where the oracle's "
                "are 0: gradient flows through those rows' scores, as when a large finite value is added to masked scores "
                "(finfo.min, as Hugging Face does; declare masked_row_grads='flow' if that is meant): "
                "the forward is uniform, but not a constant")
    return ""


def _grad_rows(unit, impl: Implementation, ref: str, got: dict, expected: dict, yard_err, floors,
               extra=None, explain=None) -> list[Row]:
    rows = []
    tol, k = unit.table(impl).gradient, unit.table(impl).three_way_k
    for group in GRAD_GROUPS:
        names = grad_group(group, expected)
        if group == "d_params" and not impl.uses_params:
            rows.append(unit.row("gradient", impl, ref, "skip", group,
                                 message=f"{impl.name} declares uses_params=False: its parameters are its own"))
            continue
        missing = [n for n in names if got.get(n) is None]
        # A missing gradient is judged as zero: right only where the true gradient is zero.
        filled = {n: np.zeros_like(reference.as_float64(expected[n])) if got.get(n) is None else got[n] for n in names}
        c, note = judge_grads(filled, expected, tol, names, k, yard_err, floors)
        kw = dict(extra or {}) if not c.passed else {}
        message = [unit.judged_note(impl)]
        if names == ("x",):
            message.append("one input (inputs='self'): d_x judged against d_query + d_key + d_value")
        if missing:
            message.append(f"no gradient for {', '.join(missing)} (judged as zero)")
        message.append(note)
        if not c.passed:
            failing = [n for n in names if not judge(filled[n], expected[n], tol, k,
                                                     yard_err=None if yard_err is None else yard_err[n],
                                                     floor=floors.get(n, 0.0)).passed]
            message.insert(0, f"fails: {', '.join(failing)}")
            if explain is not None:
                message.append(explain(filled, failing))
            message.append(kw.get("message", ""))
        kw["message"] = "; ".join(m for m in message if m)
        rows.append(unit.row("gradient", impl, ref, status(c), group, c, **kw))
    return rows



def check_gradient(unit, impls) -> list[Row]:
    rows = []
    for impl in impls:
        why = skip_reason(unit, impl, "gradient")
        if why:
            rows.append(unit.row("gradient", impl, "oracle", "skip", message=why))
            continue
        policy = impl.policy(unit.case.masked_rows)
        at = unit.judged(impl)
        expected, yard_err = unit.oracle.gradients(policy, impl.masked_row_grads, at)
        floors = unit.oracle.floors(policy, impl.masked_row_grads, expected, at)
        try:
            out, w, got = unit.runner(impl).vjp(unit.built(impl, policy), *unit.inputs(), unit.x.cotangent)
        except Exception as e:
            rows.append(error_row(unit, "gradient", impl, "oracle", e))
            continue
        if impl.inputs == "self":
            got, expected, yard_err = one_input(got), one_input(expected), one_input(yard_err)
        unit.results[("gradient", impl.name)] = got
        rows += changed_rows(unit, impl, "gradient", policy)
        # The call autograd differentiated is judged too: its output may differ from the forward check's.
        rows += judge_forward(unit, impl, policy, out, w, check="gradient",
                               note="the output of the gradient call (autograd on)")

        def explain(filled, failing, expected=expected):
            return _masked_row_note(unit, filled, expected, failing)

        judged = _grad_rows(unit, impl, "oracle", got, expected, yard_err, floors, explain=explain)
        if any(r.status == "fail" for r in judged):
            # A wrong gradient with a right forward is the backward pass's own fault.
            extra = divergence(unit, impl, policy)
            if extra.get("stage") == "output":
                extra["stage"] = "backward"
            judged = _grad_rows(unit, impl, "oracle", got, expected, yard_err, floors, extra, explain)
        rows += judged
        if versus_torch(unit, impl):
            ref = ref_name(unit, policy)
            if impl.masked_row_grads != "stop" and fully_masked_rows(unit):
                rows.append(unit.row("gradient", impl, ref, "skip", message=(
                    f"{impl.name} declares masked_row_grads={impl.masked_row_grads} and this case has fully masked rows; "
                    "our torch module stops their gradient, so it is judged against the oracle only")))
                rows += changed_rows(unit, impl, "gradient", policy)
                continue
            try:
                base = torch_reference(unit, policy, "gradient")
            except Exception as e:
                rows.append(error_row(unit, "gradient", impl, ref, e))
                continue
            if impl.inputs == "self":
                base = one_input(base)
            rows += _grad_rows(unit, impl, ref, got, base, yard_err, floors)
        rows += changed_rows(unit, impl, "gradient", policy)
    return rows


CHECK = Check("gradient", lambda unit, impls, peers: check_gradient(unit, impls) + pair_rows(unit, impls, "gradient"),
              runs=lambda impl: not impl.decode)

__all__ = ["check_gradient", "CHECK"]
