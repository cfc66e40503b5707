"""What the checks of a unit share: the gradient groups, why an implementation sits a check out, the rows of a
call that changed its arguments, and our torch module as the cross-framework reference."""

from __future__ import annotations

import numpy as np

from parity import reference
from parity.canonical import PARAMETER_KEYS
from parity.harness.judge import nan_note
from parity.harness.report import Row
from parity.impls import Implementation, builtin
from parity.tolerances import Comparison

GRAD_GROUPS = {
    # "x": a one-input layer's (inputs="self") gradient, judged against d_query + d_key + d_value
    "d_inputs": ("query", "key", "value", "x"),
    "d_params": PARAMETER_KEYS,  # the norm weights and the sinks too: a port that freezes them is red
}

# Our eager JAX implementation is jax-jit's program run op by op: it is checked where it is
# cheap. A user's eager JAX implementation is checked everywhere, gradients included.
EAGER_JAX_SKIP = "eager JAX compiles each op per shape (~1 s); ours runs on the base cases only, jax-jit runs the same program"
EAGER_JAX_GRAD_SKIP = "our eager JAX is jax-jit's program op by op: its gradients are checked under jit (jax-jit)"


def grad_group(group: str, expected: dict) -> tuple[str, ...]:
    """A gradient group's names in this layer (the oracle's keys: a projection without bias has none)."""
    return tuple(n for n in GRAD_GROUPS[group] if n in expected)


def skip_reason(unit, impl: Implementation, check: str) -> str | None:
    """Why `impl` does not run `check` in this unit: its own declaration, or our eager JAX's cost."""
    why = unit.why_not_here(impl)
    if why:
        return why
    if impl.decode:
        return f"{impl.name} is a decoder (decode=True): the decode check judges it, one token per call"
    if unit.runner(impl).replays_jit(impl):
        if check == "gradient":
            return EAGER_JAX_GRAD_SKIP
        if not unit.case.jax_eager:
            return EAGER_JAX_SKIP
    return None


def changed_rows(unit, impl: Implementation, check: str, policy: str) -> list[Row]:
    """A fail row when a call changed its inputs or parameters in place (the runner notes it)."""
    built = unit.built(impl, policy)
    changed, built.changed[:] = list(built.changed), []
    if not changed:
        return []
    return [unit.row(check, impl, "inputs", "fail", "inputs",
                     message=f"{'; '.join(changed)}: an attention layer must not change its arguments")]


def disagreement(c: Comparison, actual, expected) -> str:
    """What differs, the numbers first: values off the bound, then where NaNs differ."""
    parts = []
    if c.values_ok is False:
        parts.append(f"values off by up to {c.max_abs_err:.3g} where both are numbers "
                     f"(bound {c.atol:.3g}{f' + {c.rtol:.3g}·|expected|' if c.rtol else ''})")
    if c.nan_mismatch:
        parts.append("NaN placement differs: " + nan_note(actual, expected))
    return "; ".join(parts)


def ref_name(unit, policy: str) -> str:
    return "torch" if policy == unit.case.masked_rows else f"torch[{policy}]"


def versus_torch(unit, impl: Implementation) -> bool:
    """The user's implementations, and those that our torch module's runner does not run, are also judged
    against our torch module (same policy)."""
    return impl.role == "user" or unit.runner(impl) is not unit.runners["torch"]


def torch_reference(unit, policy: str, what: str) -> dict:
    """Our torch module (eager, with weights) under `policy`: its forward or its gradients."""
    b, r = unit.built(builtin("torch"), policy), unit.runners["torch"]
    if what == "forward":
        out, w = r.forward(b, *unit.inputs())
        return {"output": out, "weights": w}
    return r.grads(b, *unit.inputs(), unit.x.cotangent)


def fully_masked_rows(unit) -> list[tuple[int, int]]:
    """(batch, query) of every query row that attends to no key."""
    keep = unit.x.keep
    if keep is None:
        return []
    return [(int(b), int(t)) for b, t in zip(*np.nonzero(~keep.any(axis=-1)[:, 0]))]


def one_input(grads: dict | None) -> dict | None:
    """Gradients (or their yardstick errors) as a one-input layer has them: "x" for query, key and value
    (their sum: the errors of a sum add up at most); the parameters' as they are."""
    if grads is None:
        return None
    parts = [grads.get(n) for n in ("query", "key", "value")]
    rest = {n: g for n, g in grads.items() if n not in ("query", "key", "value")}
    if all(g is None for g in parts):
        return rest
    if isinstance(parts[0], float):
        return {**rest, "x": float(sum(g for g in parts if g is not None))}
    return {**rest, "x": sum(reference.as_float64(g) for g in parts if g is not None)}


__all__ = ["GRAD_GROUPS", "EAGER_JAX_SKIP", "EAGER_JAX_GRAD_SKIP", "grad_group", "skip_reason", "changed_rows",
           "disagreement", "ref_name", "versus_torch", "torch_reference", "fully_masked_rows", "one_input"]
