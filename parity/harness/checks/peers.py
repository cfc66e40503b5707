"""The peers check: the ecosystem's attention layers (parity.peers) against the oracle and our module of
their framework; the gradients of those that declare variants or give their own (`fn.vjp`)."""

from __future__ import annotations

from parity import reference
from parity.harness.checks.check import Check
from parity.harness.checks.common import GRAD_GROUPS, grad_group
from parity.harness.judge import judge, judge_grads, status
from parity.harness.report import Row, error_row
from parity.impls import Implementation, builtin, mask_for
from parity.peers.common import MissingPackage
from parity.tolerances import TOLERANCES, errors


def check_peers(unit, peers) -> list[Row]:
    rows = []
    for peer in peers:
        if peer.decode:  # a decoder: the decode check runs it
            continue
        why = unit.why_not_here(peer)
        if why:
            rows.append(unit.row("peers", peer, "oracle", "skip", message=why))
            continue
        policy = peer.policy(unit.case.masked_rows)
        effective = unit.judged(peer)
        table = TOLERANCES[effective]
        tol, k = table.forward, table.three_way_k
        exact, low = unit.oracle.forward(policy, effective)
        note = f"masked_rows={policy}: {peer.doc}"
        if effective != unit.dtype:
            note += f"; judged at the {effective} tolerance (the precision it computes in)"
        ours_impl = builtin(unit.runner(peer).ours)
        try:
            out, w = unit.forward(peer, policy)
            ours = unit.runner(peer).forward(unit.built(ours_impl, policy), *unit.inputs())
        except MissingPackage as e:
            rows.append(unit.row("peers", peer, "oracle", "skip", message=f"{peer.name} not run: {e}"))
            continue
        except Exception as e:
            rows.append(error_row(unit, "peers", peer, "oracle", e))
            continue
        for q, a, mine in (("output", out, ours[0]), ("weights", w, ours[1])):
            if a is None:
                continue
            yard = None if low is None else getattr(low, q)
            c = judge(a, getattr(exact, q), tol, k, yard)
            rows.append(unit.row("peers", peer, "oracle", status(c), q, c, message=note))
            yard_err = None if low is None else errors(yard, getattr(exact, q))[0]
            c = judge(a, mine, tol, k, yard_err=yard_err)
            rows.append(unit.row("peers", peer, f"{ours_impl.framework}[{policy}]", status(c), q, c, message=note))
        vjp = getattr(unit.built(peer, policy).fn, "vjp", None)
        # Autodiff of the parameters is checked for the peers that declare variants; the classic
        # framework peers stay forward-only (each gradient is one more XLA compile in the default run).
        if vjp is not None or (peer.uses_params and peer.variants):
            try:
                if vjp is not None:
                    rows += _peer_grad_rows(unit, peer, policy, vjp, TOLERANCES[effective], note)
                else:
                    rows += _peer_autodiff_rows(unit, peer, policy, TOLERANCES[effective], note)
            except Exception as e:
                rows.append(error_row(unit, "peers", peer, "oracle", e))
    return rows


def _peer_autodiff_rows(unit, peer: Implementation, policy: str, table, note: str) -> list[Row]:
    """A peer that computes with the canonical parameters (uses_params): its framework's autodiff gradients
    w.r.t. query, key, value and every parameter, against the oracle's under the masked-row gradient it declares."""
    at = unit.judged(peer)
    expected, yard = unit.oracle.gradients(policy, peer.masked_row_grads, at)
    _, _, got = unit.runner(peer).vjp(unit.built(peer, policy), *unit.inputs(), unit.x.cotangent)
    missing = sorted(n for n in expected if got.get(n) is None)
    if missing:
        raise ValueError(f"{peer.name} gave no gradient for {', '.join(missing)}")
    floors = unit.oracle.floors(policy, peer.masked_row_grads, expected, at)
    note = f"{note}; masked_row_grads={peer.masked_row_grads}"
    rows = []
    for group in GRAD_GROUPS:
        c, worst = judge_grads(got, expected, table.gradient, grad_group(group, expected), table.three_way_k, yard, floors)
        rows.append(unit.row("peers", peer, "oracle", status(c), group, c, message=f"{worst}; {note}"))
    return rows


def _peer_grad_rows(unit, peer: Implementation, policy: str, vjp, table, note: str) -> list[Row]:
    """A self-attention peer's own gradients (fn.vjp: w.r.t. its one input and its weights) against the
    oracle's, under the masked-row gradient it declares. Its input is the query, key and value at once,
    so its input gradient is judged against the sum of the oracle's three."""
    at = unit.judged(peer)
    expected, yard = unit.oracle.gradients(policy, peer.masked_row_grads, at)
    x = unit.x
    structure = unit.structure(peer)
    keep, kw = (x.keep, {}) if structure is None else (structure[1], structure[0])
    got = vjp(x.query, mask_for(peer, keep, unit.case.shape.N, x.query.dtype), x.cotangent,
              **(x.position_kw if peer.takes_problem else {}), **kw)
    expected = dict(expected, input=sum(reference.as_float64(expected[n]) for n in ("query", "key", "value")))
    if yard is not None:  # the sum's error is at most the sum of the three errors
        yard = dict(yard, input=sum(yard[n] for n in ("query", "key", "value")))
    floors = unit.oracle.floors(policy, peer.masked_row_grads, expected, at)
    note = f"{note}; masked_row_grads={peer.masked_row_grads}"
    rows = []
    for quantity, names in (("d_input", ("input",)), ("d_params", grad_group("d_params", expected))):
        c, worst = judge_grads(got, expected, table.gradient, names, table.three_way_k, yard, floors)
        rows.append(unit.row("peers", peer, "oracle", status(c), quantity, c, message=f"{worst}; {note}"))
    return rows


CHECK = Check("peers", lambda unit, impls, peers: check_peers(unit, peers), flag="peers")

__all__ = ["check_peers", "CHECK"]
