"""The pairs rows: the user's layers of different frameworks (a torch layer and its JAX port) judged against
each other, beside each against the oracle, within the forward and the gradient checks."""

from __future__ import annotations

from parity.dtypes import coarser
from parity.harness.checks.common import GRAD_GROUPS, disagreement, fully_masked_rows, grad_group, one_input
from parity.harness.judge import judge, judge_grads, status
from parity.harness.report import Row
from parity.tolerances import TOLERANCES, errors


def pair_rows(unit, impls, check: str) -> list[Row]:
    """The rows of `check` ("forward" or "gradient") for every pair of the user's layers run by different
    runners, from what that check returned for each (`unit.results`): the same bound as implementation-vs-
    implementation rows (each may be off the oracle by it, bias floors included), at the coarser of the
    two's `computes_in`."""
    users = [i for i in impls if i.role == "user"]
    rows = []
    for n, a in enumerate(users):
        for b in users[n + 1:]:
            if unit.runner(a) is unit.runner(b):
                continue
            policy = a.policy(unit.case.masked_rows)
            if policy != b.policy(unit.case.masked_rows):
                continue  # fully masked rows differ by their declarations; each is judged against the oracle
            ra, rb = unit.results.get((check, a.name)), unit.results.get((check, b.name))
            if ra is None or rb is None:
                continue
            at = coarser(unit.judged(a), unit.judged(b))
            pair = _forward_pair if check == "forward" else _gradient_pair
            rows += pair(unit, a, b, ra, rb, policy, at)
    return rows


def _forward_pair(unit, a, b, ra: dict, rb: dict, policy: str, at: str) -> list[Row]:
    table = TOLERANCES[at]
    exact, low = unit.oracle.forward(policy, at)
    rows = []
    for q in ("output", "weights"):
        if ra.get(q) is None or rb.get(q) is None:
            continue
        yard = None if low is None else errors(getattr(low, q), getattr(exact, q))[0]
        c = judge(ra[q], rb[q], table.forward, table.three_way_k, yard_err=yard)
        rows.append(unit.row("forward", a, b.name, status(c), q, c,
                             message="" if c.passed else disagreement(c, ra[q], rb[q])))
    return rows


def _gradient_pair(unit, a, b, ra: dict, rb: dict, policy: str, at: str) -> list[Row]:
    table = TOLERANCES[at]
    if a.masked_row_grads != b.masked_row_grads and fully_masked_rows(unit):
        return []
    if "x" in ra or "x" in rb:
        ra, rb = one_input(ra), one_input(rb)
    expected, yard = unit.oracle.gradients(policy, a.masked_row_grads, at)
    floors = unit.oracle.floors(policy, a.masked_row_grads, expected, at)
    yard = one_input(yard) if "x" in ra else yard
    rows = []
    for group in GRAD_GROUPS:
        names = tuple(n for n in grad_group(group, ra) if rb.get(n) is not None and ra[n] is not None)
        if names:
            c, note = judge_grads(ra, rb, table.gradient, names, table.three_way_k, yard, floors)
            rows.append(unit.row("gradient", a, b.name, status(c), group, c, message=note))
    return rows


def check_pairs(unit, impls) -> list[Row]:
    """The pairs rows of both checks (`pair_rows`), from what they returned in this unit."""
    return pair_rows(unit, impls, "forward") + pair_rows(unit, impls, "gradient")


__all__ = ["check_pairs", "pair_rows"]
