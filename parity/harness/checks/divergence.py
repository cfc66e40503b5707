"""The divergence search: the first stage of a failing call (`reference.STAGES` order) that leaves the oracle,
where the implementation exposes its intermediates (`fn.intermediates`)."""

from __future__ import annotations

import numpy as np

from parity import reference
from parity.harness.judge import judge
from parity.impls import Implementation


def _stage_views(got: dict, exact, low, keep, shape4):
    """(got, expected, yardstick) per stage the implementation reports, as it reports it.

    Scores are compared where the case keeps a key on a row that attends to something:
    what an implementation puts at masked places (-inf, finfo.min, the raw score) is its own.
    """
    views = {}
    if "scores" in got:
        valid = np.ones(shape4, bool) if keep is None else np.broadcast_to(keep, shape4)
        valid = valid & valid.any(axis=-1, keepdims=True)

        def only_valid(s):
            s = reference.as_float64(s)
            return np.where(valid, s, 0.0) if np.shape(s) == shape4 else s

        views["scores"] = (only_valid(got["scores"]), only_valid(exact.scores), None if low is None else only_valid(low.scores))
    for stage in reference.STAGES:
        if stage in got and stage not in views and getattr(exact, stage) is not None:
            views[stage] = (got[stage], getattr(exact, stage), None if low is None else getattr(low, stage))
    return views


def divergence(unit, impl: Implementation, policy: str) -> dict:
    """{"stage": first stage (reference.STAGES order) off the oracle} or {"message": why none is named}."""
    try:
        got = unit.runner(impl).intermediates(unit.built(impl, policy), *unit.inputs())
    except Exception as e:  # the search is a diagnosis; its failure must not hide the row
        return {"message": f"divergence search failed: {type(e).__name__}: {e}"[:300]}
    if got is None:
        return {"message": f"{impl.name} exposes no intermediates (fn.intermediates), so no stage is named"}
    exact, low = unit.oracle.forward(policy, unit.judged(impl))
    s = unit.case.shape
    views = _stage_views(got, exact, low, unit.x.keep, (s.B, s.N, s.T, s.S))
    for stage in reference.STAGES:
        if stage not in views:
            continue
        actual, expected, yard = views[stage]
        if np.shape(actual) != np.shape(expected):
            return {"stage": stage, "message": f"{stage} has shape {np.shape(actual)}, the oracle's is {np.shape(expected)}"}
        table = unit.table(impl)
        if not judge(actual, expected, table.forward, table.three_way_k, yard).passed:
            return {"stage": stage}
    return {"stage": "output"}


__all__ = ["divergence"]
