"""The leak check: on a structured mask case, nothing reaches the tokens the mask keeps it from.

On each case whose mask is structured (`matrix.STRUCTURED_MASKS`: packed documents, a sliding
window, Llama 4's chunks), each of our implementations and the user's runs the case's inputs twice, as
drawn and with one part perturbed, with the same program and the same cotangent:

    packed   a row's first document (self-attention: its tokens; cross-attention: its keys and values), in
             the row where that leaves the most of the row's queries unaffected
    window   the first two tokens of every row (cross-attention: the first two keys and values)
    chunk    the first chunk of every row: its first C tokens (cross-attention: keys and values 0..C-1), the
             chunks counted from key 0 as the mask counts them; every query of a later chunk is unaffected

By the case's dense keep-mask, a query is *affected* when it is perturbed itself or keeps a
perturbed key; a fully masked query under masked_rows="uniform" is the mean of every value, so it
keeps every key here. Every other query's output row must be bit for bit what it was; so must the
input gradients that only unaffected queries reach -- the query gradient at an unaffected query,
the key and value gradients at a key that is not perturbed and that only unaffected queries keep.
A tolerance would hide a small leak (a masked key at weight 1e-9, a window one token too wide);
exact equality cannot (a masked weight is exactly 0, and 0 times a finite value adds nothing).
Rows: check "leak", reference "unperturbed", quantity "output" and "d_inputs". Their bound is 0, so
their margin (`leak_margin`) is the largest change in units of eps·max|value|: 0 when bit for bit,
at least 1 on any change.
"""

from __future__ import annotations

import numpy as np

from parity import reference
from parity.dtypes import eps
from parity.harness.report import Row, error_row

CHECK = "leak"
REFERENCE = "unperturbed"
EAGER_JAX_SKIP = "our eager JAX is jax-jit's program op by op: jax-jit's leak rows check it"


def perturbed_tokens(unit) -> tuple[np.ndarray, np.ndarray, str]:
    """(query tokens (B, T) bool, key/value tokens (B, S) bool, in words) the check perturbs. packed: the
    first document of the row where perturbing it leaves the most queries of that row unaffected (the
    first such row); window: the first two tokens of every row; chunk: the first chunk's C tokens of every
    row."""
    s, st = unit.case.shape, unit.x.structure_kw
    pq, pk = np.zeros((s.B, s.T), bool), np.zeros((s.B, s.S), bool)
    what = "keys" if s.cross else "tokens"
    if unit.case.mask == "packed":
        seg = st.get("key_segment_ids", st["segment_ids"]) if s.cross else st["segment_ids"]

        def left_alone(b):
            p = np.zeros_like(pk if s.cross else pq)
            p[b] = seg[b] == seg[b, 0]
            uq, _ = unaffected(unit.x.keep, p if not s.cross else pq, p, "uniform")
            return int(uq[b].sum())

        b = max(range(s.B), key=lambda r: (left_alone(r), -r))
        (pk if s.cross else pq)[b] = seg[b] == seg[b, 0]
        where = f"document {seg[b, 0]} of row {b} ({what} {_span(np.flatnonzero(seg[b] == seg[b, 0]))})"
    elif unit.case.mask == "chunk":
        C = st["chunk"]
        (pk if s.cross else pq)[:, :C] = True
        where = f"the first chunk ({what} 0-{min(C, s.S if s.cross else s.T) - 1}) of every row"
    else:
        (pk if s.cross else pq)[:, :2] = True
        where = f"the first two {what} of every row"
    if not s.cross:
        pk = pq.copy()
    return pq, pk, where


def _span(idx) -> str:
    return f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else f"{idx[0]}"


def unaffected(keep: np.ndarray, pq: np.ndarray, pk: np.ndarray, policy: str) -> tuple[np.ndarray, np.ndarray]:
    """(queries (B, T), keys (B, S)) that must not change: queries neither perturbed nor keeping a perturbed
    key; keys not perturbed and kept by unaffected queries only. keep: bool (B, 1, T, S); policy: the
    masked-row policy the implementation runs with ("uniform": a fully masked row reads every key)."""
    k = keep[:, 0]  # (B, T, S)
    if policy == "uniform":
        k = k | ~k.any(axis=-1, keepdims=True)
    affected = pq | (k & pk[:, None, :]).any(axis=-1)  # (B, T)
    read_by_affected = (k & affected[:, :, None]).any(axis=1)  # (B, S)
    return ~affected, ~pk & ~read_by_affected


def _perturb(x, where, rng):
    out = reference.as_float64(x).copy()
    out[where] += rng.standard_normal(out[where].shape)
    return out.astype(x.dtype)


def _compare(base, other, rows_ok) -> tuple[int, int, float, tuple | None, float]:
    """(values compared, values that differ, max |difference| among finite ones, first differing (b, t),
    the largest finite |value| on either side)."""
    a, b = reference.as_float64(base)[rows_ok], reference.as_float64(other)[rows_ok]
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    worst = float(diff[np.isfinite(diff)].max()) if np.isfinite(diff).any() and not same.all() else 0.0
    first = None
    if not same.all():
        bt = np.argwhere(rows_ok)[np.flatnonzero(~same.reshape(len(a), -1).all(axis=-1))[0]]
        first = tuple(int(i) for i in bt)
    both = np.concatenate([a.ravel(), b.ravel()])
    finite = np.abs(both[np.isfinite(both)])
    return int(a.size), int((~same).sum()), worst, first, float(finite.max()) if finite.size else 0.0


def leak_margin(changed: int, worst: float, scale: float, dtype: str) -> float:
    """A leak row's margin. Its bound is 0 (bit for bit), so error ÷ bound says nothing: the margin is the
    largest change in units of the dtype's resolution at the largest value compared, eps·max|value| -- how
    far above rounding the leak is -- and at least 1 when anything changed (a change of any size fails);
    0 when nothing did."""
    if not changed:
        return 0.0
    unit = eps(dtype) * scale
    return max(1.0, worst / unit) if unit > 0 else 1.0  # unit 0: every value compared is 0 or changed to NaN/inf


def _skip(unit, impl) -> str | None:
    why = unit.why_not_here(impl)
    if why:
        return why
    if impl.decode:
        return f"{impl.name} is a decoder (decode=True): the decode check judges it"
    if unit.runner(impl).replays_jit(impl):
        return EAGER_JAX_SKIP
    return None


def check_leak(unit, impls) -> list[Row]:
    """The leak rows of one structured unit (see the module docstring); [] on a dense case."""
    if not unit.case.structured:
        return []
    impls = [i for i in impls if i.role in ("ours", "user")]
    rows = [unit.row(CHECK, i, REFERENCE, "skip", message=why) for i in impls if (why := _skip(unit, i))]
    run = [i for i in impls if not _skip(unit, i)]
    if not run:
        return rows
    x = unit.x
    pq, pk, where = perturbed_tokens(unit)
    rng = np.random.default_rng(0)
    q2 = _perturb(x.query, pq, rng)
    k2, v2 = (q2.copy(), q2.copy()) if not unit.case.shape.cross else (_perturb(x.key, pk, rng), _perturb(x.value, pk, rng))
    inputs = [(x.query, x.key, x.value), (q2, k2, v2)]
    for runner in unit.runners.values():  # each runner's implementations run together (one program for JAX's jit ones)
        group = [i for i in run if unit.runner(i) is runner]
        if not group:
            continue
        try:
            builts = [unit.built(i, i.policy(unit.case.masked_rows)) for i in group]
            results = runner.vjp_each(builts, inputs, x.keep, x.cotangent)
        except Exception:  # noqa: BLE001 - each implementation alone then reports its own error
            results = []
            for i in group:
                try:
                    b = unit.built(i, i.policy(unit.case.masked_rows))
                    results.append(runner.vjp_each([b], inputs, x.keep, x.cotangent)[0])
                except Exception as e:
                    results.append(e)
        for impl, result in zip(group, results):
            if isinstance(result, Exception):
                rows.append(error_row(unit, CHECK, impl, REFERENCE, result))
                continue
            uq, uk = unaffected(x.keep, pq, pk, impl.policy(unit.case.masked_rows))
            rows += _rows(unit, impl, result, uq, uk, where)
    return rows


def _rows(unit, impl, result, uq, uk, where) -> list[Row]:
    (out, _, grads), (out2, _, grads2) = result
    rows = []
    n, bad, worst, first, scale = _compare(out, out2, uq)
    rows.append(_row(unit, impl, "output", n, bad, worst, first, scale, where,
                     f"the output rows of the {int(uq.sum())} queries that keep no perturbed token"))
    masks = {"query": uq & uk if impl.inputs == "self" else uq, "key": uk, "value": uk}
    total = [0, 0, 0.0, None, 0.0]
    named = []
    for name, ok in masks.items():
        g, g2 = (grads or {}).get(name), (grads2 or {}).get(name)
        if g is None or g2 is None or not ok.any():
            continue
        n, bad, worst, first, scale = _compare(g, g2, ok)
        named.append(name)
        total[0] += n
        total[1] += bad
        total[2] = max(total[2], worst)
        total[4] = max(total[4], scale)
        if bad and total[3] is None:
            total[3] = (name, *first)
    if named:
        rows.append(_row(unit, impl, "d_inputs", *total, where,
                         f"the {'/'.join(named)} gradients at the tokens only unaffected queries reach"))
    return rows


def _row(unit, impl, quantity, n, bad, worst, first, scale, where, what) -> Row:
    if n == 0:
        return unit.row(CHECK, impl, REFERENCE, "skip", quantity, message=f"{where} perturbed: nothing is left unaffected")
    if not bad:
        return unit.row(CHECK, impl, REFERENCE, "pass", quantity, max_abs_err=0.0, atol=0.0, rtol=0.0, margin=0.0,
                        message=f"{where} perturbed; {what}: {n} values bit for bit unchanged")
    at = f"(batch, token) {first}" if len(first) == 2 else f"{first[0]} at (batch, token) {tuple(first[1:])}"
    m = leak_margin(bad, worst, scale, unit.dtype)
    return unit.row(CHECK, impl, REFERENCE, "fail", quantity, max_abs_err=worst, atol=0.0, rtol=0.0, margin=m,
                    message=f"{where} perturbed; {what}: {bad} of {n} values changed (by up to {worst:.3g}, "
                            f"{m:.2g} x eps·max|value| (margin); first {at}): the perturbed tokens reach what the mask "
                            "keeps them from")


__all__ = ["check_leak", "perturbed_tokens", "unaffected", "CHECK", "REFERENCE"]
