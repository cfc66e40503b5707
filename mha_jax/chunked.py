"""Blocked attention with an online softmax and a flash backward: O(T + S) memory.

jax.nn.dot_product_attention's XLA path builds the whole (B, N, T, S) score
tensor (on CPU, and on GPU outside cuDNN). This kernel never holds more than
(B, N, q_chunk, k_chunk) scores.

Forward: an outer `lax.map` over query blocks, an inner `lax.scan` over key
blocks carrying the running max, sum and context (flash-attention's recurrence);
it keeps the output O and the per-row log-sum-exp L (O(T) residuals, no scores;
keeping a one-block problem's probabilities instead was measured slower: B=1 N=8
T=S=512 fwd+bwd in one 512x512 block, 2-core Xeon, 20 ms against 11 ms recomputed).
Backward (`jax.custom_vjp`): an outer `lax.scan` over key blocks, an inner one
over query blocks; each block's probabilities are recomputed once,
P = exp(s - L), and dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - D) with
D = rowsum(dO ∘ O), dQ += dS K, dK += dSᵀ Q, each block held as Pᵀ, dSᵀ (key rows,
query columns) so that no score-sized operand is transposed (`_backward`).

Block skipping: the keep-mask is summarised once per call (per head step, below) into a kind per
(query block, key block): EMPTY (nothing kept for any batch element or head),
FULL (everything kept) or PARTIAL. Forward and backward branch on it
(`lax.switch`): an EMPTY block runs no matmul at all (for a causal mask, the
blocks above the diagonal), a FULL block skips the mask select. One consequence:
a NaN in V at a key that a whole block of queries cannot see does not reach those
queries, where the materialised path's 0 × NaN spreads it to every row. (A NaN key's
0 × NaN in the query gradient is written back outside the kernel, as is the materialised
path's zero gradient of a row that keeps no key: `_query_gradient_as_materialised`.)
A causal triangle or window given as structure (`diagonal_band`, no keep-mask) is summarised
while tracing instead: the kinds and the rows that keep nothing are NumPy constants, each block's
mask comes from iotas, and both loops visit only the non-empty blocks, so no (T, S) array exists.
`block_census(keep, B, N, T, S, q_chunk, k_chunk)` counts the blocks of each kind from that same
summary (a causal sliding window of w keys at T = S leaves about 2·w/T of the blocks non-empty
with w-sized blocks; D packed causal documents about 1/(2·D)).
No exp2: XLA lowers it to exp(x · ln 2), one multiply more than exp. The row sums
stay a reduction: taking them from the P·V matmul (V with a column of ones) was
measured slower (forward 1.03x at B=1 N=8 T=S=2048 H=64, blocks 512x512).

Which rows attend to nothing comes from the keep-mask, never from the numbers,
so a NaN input gives a NaN output (as on the materialised path) instead of being
taken for a fully masked row. The masked-row policy is applied outside the
custom VJP, so JAX differentiates it as on the materialised path (the NaN of
"nan" and the mean of V of "uniform"/"nan" reach V's gradient there).

A custom VJP has no forward-mode rule: jax.jvp and jax.jacfwd of this kernel raise
JAX's TypeError ("can't apply forward-mode autodiff (jvp) to a custom_vjp
function"); jax.linearize returns, and its linear map raises the same error when
applied. Forward-over-reverse works (jax.hessian = jacfwd(jacrev)): the backward
is plain JAX. Use the materialised `attention_core` for pure forward mode.

Head steps (`head_chunk`): the kernel may run a piece of its B·K head blocks at a time, one piece
after another (`head_steps`), so that a taller block's scores stay in cache between the passes
over them; 2-core Xeon, B=4 N=8 T=S=4096 fwd+bwd: 3.79 s with all 32 at 512x512, 2.30 s one at a
time at 2048x1024. The table (`mha_jax.kernels`) says how many per processor and size.

Internal layout BNTH (heads next to batch, so every block matmul is a plain
batched matmul); the public layout is BTNH. Legend in `mha_spec`. With K key/value
heads the kernel runs on K heads and G·T query rows (G = N/K: a group's query heads
stacked along the query axis), so K and V are never repeated per query head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

import numpy as np

from mha_spec import Structure, mask_shape_4d


def accumulation_dtype(dtype):
    """float32 for 16-bit inputs, the input dtype otherwise (float32 or float64)."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def fold_scale(q, scale: float | None = None):
    """(q, scale left for the scores): the softmax scale (None: 1/√H) folded into q where that is
    as accurate (one rounding in the same dtype either way).

    Scaling q is a pass over (B, T, N, H) instead of (B, N, T, S), and it spares XLA a
    broadcast of the scale to the score shape (measured at B=4, T=S=2048, H=64: the
    gradient program's temporary memory drops from 2080 to 1568 MiB). For 16-bit q the
    scale would round q a second time, so it is applied to the float32 scores instead.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if accumulation_dtype(q.dtype) == q.dtype:
        return q * jnp.asarray(scale, q.dtype), 1.0
    return q, scale


def fill_masked_rows(x, row_any, masked_rows: str, uniform_value):
    """Overwrite the rows of x whose query may attend to nothing (row_any False).

    uniform_value is what such a row holds under "uniform" (1/S for weights, mean V for a
    context). Under "nan" the fill is uniform_value times a factor that is NaN on exactly
    those rows, so on the fused path the gradient meets NaN where the materialised path's
    NaN weights meet V (the same (batch, head) slices of V), and nowhere else. Under "zero"
    it is 0 * uniform_value: 0, but NaN where mean V is NaN (or infinite), as the
    materialised path's zero weights times a NaN in V are.
    """
    if masked_rows == "zero":
        fill = jnp.asarray(uniform_value, x.dtype) * jnp.zeros((), x.dtype)
    elif masked_rows == "nan":
        fill = jnp.asarray(uniform_value, x.dtype) * jnp.where(row_any, 1.0, jnp.nan).astype(x.dtype)
    else:
        fill = jnp.asarray(uniform_value, x.dtype)
    return jnp.where(row_any, x, fill)


def keep_4d(keep, B: int, N: int, T: int, S: int):
    """A core's keep-mask of any shape the modules take -> (B|1, N|1, T|1, S|1); None stays None.

    [T, S] -> [1, 1, T, S], [B, T, S] -> [B, 1, T, S] (`mha_spec.mask_shape_4d`: a batch
    axis, never read as heads by broadcasting), 4-D as is; anything else is a ValueError
    naming the shapes. Every kernel then sees the same four axes.
    """
    if keep is None:
        return None
    keep = jnp.asarray(keep)
    return keep.reshape(mask_shape_4d(keep.shape, B, N, T, S))


def mean_over_keys(v):
    """mean(V) over the keys, (B, S, K, H) -> (B, 1, K, H) in the accumulation dtype.

    Summed as V·(1/S), as the weights path's uniform row computes it: a plain sum of finite
    values near the dtype's largest could overflow to inf before the division.
    """
    return (v.astype(accumulation_dtype(v.dtype)) * (1.0 / v.shape[1])).sum(axis=1, keepdims=True)


EMPTY, FULL, PARTIAL = 0, 1, 2  # block kinds: keep-mask all False, all True, mixed


def diagonal_band(structure: Structure) -> tuple[int | None, int | None] | None:
    """A `mha_spec.Structure` without segment ids as the band the kernel skips blocks by: `Structure.band`,
    (lo, hi) such that query t keeps key s exactly when lo <= s - t <= hi, or None when nothing is asked.
    Segment ids are a ValueError: the kernel takes them as a keep-mask (`structured_keep`)."""
    if structure.segment_ids is not None:
        raise ValueError("the chunked kernel takes segment ids as a keep-mask (structured_keep), not as structure")
    return structure.band()


def _structure(T: int, S: int, structure, is_causal, window, alignment) -> Structure:
    """The band's keywords, or a `mha_spec.Structure` given in their place, as one Structure for (T, S)."""
    if structure is None:
        return Structure.of(T, S, is_causal=is_causal, window=window, alignment=alignment)
    if not isinstance(structure, Structure):
        raise TypeError(f"structure must be a mha_spec.Structure, got {type(structure).__name__}")
    if is_causal is not False or window is not None or alignment != "top-left":
        raise ValueError("pass structure= or is_causal/window/alignment, not both")
    if (structure.T, structure.S) != (T, S):
        raise ValueError(f"a structure for T={structure.T}, S={structure.S} given with T={T}, S={S}")
    return structure


def band_keep(T: int, S: int, band):
    """bool (1, 1, T, S) of a band (lo, hi) (`diagonal_band`), built from iotas."""
    lo, hi = band
    d = jnp.arange(S)[None, :] - jnp.arange(T)[:, None]  # (T, S): s - t
    keep = jnp.ones((T, S), bool)
    keep = keep if lo is None else keep & (d >= lo)
    return (keep if hi is None else keep & (d <= hi))[None, None]


@dataclass(frozen=True)
class _Band:
    """A mask given by its structure instead of as data: row r of the kernel's query axis (query
    heads' rows stacked per key/value head, padded) is query t = r mod T; rows r >= R are padding
    and keep nothing; row t keeps the keys s < S with lo <= s - t <= hi (None: unbounded)."""

    R: int
    T: int
    lo: int | None
    hi: int | None


@dataclass(frozen=True)
class _Plan:
    """Static facts of one call (hashable: it is a nondiff argument of the custom VJP)."""

    S: int  # true key length; keys at S.. are padding
    cq: int  # query block
    ck: int  # key block
    scale: float  # left for the scores (1.0 when folded into q)
    precision: object
    band: _Band | None = None  # the mask, when it is a band (then no keep-mask is passed)
    softcap: float | None = None  # the scaled scores become softcap·tanh(s / softcap) before the mask


def _band_keys(band: _Band, S: int, Rp: int):
    """NumPy (first, last) kept key of each of Rp kernel rows; first > last on a row that keeps
    nothing. Static: computed while tracing, so a band costs no pass over a mask at run time."""
    r = np.arange(Rp)
    t = r % band.T
    first = np.zeros(Rp, np.int64) if band.lo is None else np.maximum(0, t + band.lo)
    last = np.full(Rp, S - 1, np.int64) if band.hi is None else np.minimum(S - 1, t + band.hi)
    return first, np.where(r < band.R, last, -1)


def _band_attends(band: _Band, S: int, Rp: int):
    """Bool (1, 1, Rp, 1): the rows that keep at least one key under the band."""
    first, last = _band_keys(band, S, Rp)
    return jnp.asarray(first <= last)[None, None, :, None]


def _band_kinds(plan: _Plan, nq: int, nk: int):
    """NumPy (nq, nk) block kinds of plan.band from each row's interval of kept keys: exactly the
    kinds of the same mask given densely."""
    first, last = (x[:, None] for x in _band_keys(plan.band, plan.S, nq * plan.cq))  # (Rp, 1)
    starts = np.arange(nk)[None, :] * plan.ck  # (1, nk)
    ends = starts + plan.ck - 1
    any_ = (np.maximum(first, starts) <= np.minimum(last, ends)).reshape(nq, plan.cq, nk).any(axis=1)
    all_ = ((first <= starts) & (last >= ends)).reshape(nq, plan.cq, nk).all(axis=1)
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY))


def _band_visits(plan: _Plan, nq: int, nk: int):
    """The blocks a band's loops visit, known while tracing, or None (no band: every block):
    (kinds (nq + 1, nk + 1) int32 with an EMPTY row and column for the padding index,
    key blocks per query block (nq, L) and query blocks per key block (nk, M), each list the
    non-EMPTY blocks padded with the EMPTY index nk or nq). The loops then run max-non-empty
    steps instead of nk or nq, so a window's cost follows its blocks, not T/c of them."""
    if plan.band is None:
        return None
    kinds = _band_kinds(plan, nq, nk)

    def lists(rows, pad):
        picked = [np.flatnonzero(r != EMPTY) for r in rows]
        width = max(1, max(len(p) for p in picked))
        return jnp.asarray(np.stack([np.pad(p, (0, width - len(p)), constant_values=pad) for p in picked]), jnp.int32)

    return jnp.asarray(np.pad(kinds, ((0, 1), (0, 1))), jnp.int32), lists(kinds, nk), lists(kinds.T, nq)


def _row_attends(plan: _Plan, keep, Rp: int):
    """Bool (B|1, N|1, Rp|1, 1): the kernel rows that keep at least one key, from the mask alone."""
    if plan.band is not None:
        return _band_attends(plan.band, plan.S, Rp)
    return jnp.ones((1, 1, 1, 1), bool) if keep is None else keep.any(axis=-1, keepdims=True)


def _block_kinds(plan: _Plan, keep, nq: int, nk: int):
    """(nq|1, nk) int32 block kinds from the padded keep-mask (or the band), computed once per call;
    None when every block is FULL (no mask and no key padding): then no block needs a select or a branch."""
    if plan.band is not None:
        return jnp.asarray(_band_kinds(plan, nq, nk), jnp.int32)
    if keep is None:
        if plan.S % plan.ck == 0:
            return None
        return jnp.asarray([[FULL] * (nk - 1) + [PARTIAL]], jnp.int32)  # only the padded tail block
    kb, kn, kt, _ = keep.shape
    rows = 1 if kt == 1 else nq
    blocks = keep.reshape(kb, kn, rows, kt // rows, nk, plan.ck)
    any_, all_ = blocks.any(axis=(0, 1, 3, 5)), blocks.all(axis=(0, 1, 3, 5))  # one batched matmul serves every (B, N)
    return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int32)


def _by_kind(kinds, i, j, step, carry):
    """step(masked: bool)(carry), chosen by the kind of block (i, j); an EMPTY block leaves the carry
    (its matmuls are skipped). Without kinds every block is FULL."""
    if kinds is None:
        return step(False)(carry)
    kind = kinds[0 if kinds.shape[0] == 1 else i, j]
    return lax.switch(kind, [lambda c: step(None)(c), step(False), step(True)], carry)


def _block_mask(plan: _Plan, keep_i, i, j):
    """Bool (B|1, N|1, cq|1, ck) for query block i and key block j: the keep-mask's slice, the band
    from iotas, or the key-padding mask."""
    if plan.band is not None:
        band = plan.band
        r = i * plan.cq + jnp.arange(plan.cq)[:, None]  # (cq, 1) kernel rows
        s = j * plan.ck + jnp.arange(plan.ck)[None, :]  # (1, ck) keys
        d = s - r % band.T
        mask = (r < band.R) & (s < plan.S)
        mask = mask if band.lo is None else mask & (d >= band.lo)
        mask = mask if band.hi is None else mask & (d <= band.hi)
        return mask[None, None]
    if keep_i is not None:
        return lax.dynamic_slice_in_dim(keep_i, j * plan.ck, plan.ck, axis=3)
    return (j * plan.ck + jnp.arange(plan.ck) < plan.S)[None, None, None, :]


def _block_scores(plan: _Plan, a, b, mask):
    """Scaled (and soft-capped) scores of one block, -inf where masked, in the accumulation dtype:
    a (B, N, X, H) against b (B, N, Y, H) gives (B, N, X, Y), queries against keys (B, N, cq, ck) or
    keys against queries (B, N, ck, cq) with the mask in the same orientation."""
    acc = accumulation_dtype(a.dtype)
    s = jnp.einsum("BNXH,BNYH->BNXY", a, b, preferred_element_type=acc, precision=plan.precision)
    if plan.scale != 1.0:
        s = s * plan.scale
    if plan.softcap is not None:  # elementwise, before the mask: the capped logits are what is masked
        s = plan.softcap * jnp.tanh(s / plan.softcap)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _rows(x, i, c):
    """Query block i of an array whose axis 2 is T (or 1, when it broadcasts)."""
    return x if x is None or x.shape[2] == 1 else lax.dynamic_slice_in_dim(x, i * c, c, axis=2)


def _columns(x, i, c):
    """Query block i of a (B, N, 1, Tp) row vector."""
    return lax.dynamic_slice_in_dim(x, i * c, c, axis=3)


def _forward(plan: _Plan, q, k, v, keep, sinks=None):
    """(O, L): O (B, N, Tp, H) in the accumulation dtype, 0 on rows with no kept key;
    L (B, N, Tp, 1) the log-sum-exp of each row's scores, 0 on rows with no kept key.
    sinks (1, N, Tp, 1) in the accumulation dtype, or None: each row's sink logit starts the
    running max and adds its exp to the denominator, once per row; L then includes it."""
    B, N, Tp, H = q.shape
    acc = accumulation_dtype(q.dtype)
    nq, nk = Tp // plan.cq, k.shape[2] // plan.ck
    row_any = _row_attends(plan, keep, Tp)
    visits = _band_visits(plan, nq, nk)
    kinds = _block_kinds(plan, keep, nq, nk) if visits is None else visits[0]

    def q_block(i):
        qi, keep_i = _rows(q, i, plan.cq), _rows(keep, i, plan.cq)  # (B, N, cq, H)

        def k_step(carry, j):
            def step(masked):
                def run(carry):
                    o, m, l = carry  # (B, N, cq, H), (B, N, cq, 1), (B, N, cq, 1)
                    if masked is None:  # EMPTY: nothing to add
                        return carry, None
                    kj = lax.dynamic_slice_in_dim(k, j * plan.ck, plan.ck, axis=2)  # (B, N, ck, H)
                    vj = lax.dynamic_slice_in_dim(v, j * plan.ck, plan.ck, axis=2)
                    s = _block_scores(plan, qi, kj, _block_mask(plan, keep_i, i, j) if masked else None)  # (B, N, cq, ck)
                    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))  # NaN stays NaN
                    # A row that has seen only masked keys keeps max -inf; use 0 so exp() gives 0, not NaN.
                    safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    p = jnp.exp(s - safe)
                    alpha = jnp.exp(m - safe)
                    pv = jnp.einsum("BNTS,BNSH->BNTH", p.astype(v.dtype), vj, preferred_element_type=acc, precision=plan.precision)
                    return (alpha * o + pv, m_new, alpha * l + p.sum(axis=-1, keepdims=True)), None
                return run

            return _by_kind(kinds, i, j, step, carry)

        if sinks is None:
            m0, l0 = jnp.full((B, N, plan.cq, 1), -jnp.inf, acc), jnp.zeros((B, N, plan.cq, 1), acc)
        else:  # the sink as a column already seen: max = sink, sum = exp(sink - sink)
            m0 = jnp.broadcast_to(_rows(sinks, i, plan.cq), (B, N, plan.cq, 1))
            l0 = jnp.ones((B, N, plan.cq, 1), acc)
        init = (jnp.zeros((B, N, plan.cq, H), acc), m0, l0)
        (o, m, l), _ = lax.scan(k_step, init, jnp.arange(nk) if visits is None else visits[1][i])
        attends = _rows(row_any, i, plan.cq)  # from the mask, not from l: NaN must stay NaN
        if sinks is not None:  # a row that keeps no key gives everything to its sink: O = 0, L = sink
            return jnp.where(attends, o / l, 0.0), m + jnp.log(l)
        l = jnp.where(attends, l, 1.0)
        o = jnp.where(attends, o / l, 0.0)
        lse = jnp.where(attends, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l), 0.0)
        return o, lse

    o, lse = lax.map(q_block, jnp.arange(nq))  # (nq, B, N, cq, H), (nq, B, N, cq, 1)
    return _unblock(o), _unblock(lse)


def _unblock(x):
    """(n, B, N, c, X) blocks -> (B, N, n*c, X)."""
    n, B, N, c, X = x.shape
    return jnp.moveaxis(x, 0, 2).reshape(B, N, n * c, X)


def _score_gradient(plan: _Plan, p_t, s_t, dp_t, d_i):
    """dSᵀ of one block (B, N, ck, cq), with respect to q·k, from Pᵀ, the scores Sᵀ (scaled, capped, -inf where
    masked), dPᵀ and D: P ∘ (dP - D), through the soft-cap (times 1 - (capped / cap)²) and the scale."""
    ds_t = p_t * (dp_t - d_i)
    if plan.softcap is not None:  # masked: -inf², clamped to 1, gives 0 (p is 0 there too)
        ds_t = ds_t * (1.0 - jnp.minimum(jnp.square(s_t / plan.softcap), 1.0))
    return ds_t * plan.scale if plan.scale != 1.0 else ds_t


def _sink_gradient(sinks, lse, D):
    """The sinks' gradient (1, N, Tp, 1), summed over the batch: -p_sink · rowsum(dP ∘ P) = -p_sink · D with
    p_sink = exp(sink - L), from the row statistics alone (no pass over the blocks); None without sinks."""
    if sinks is None:
        return None
    return -(jnp.exp(sinks - lse) * jnp.swapaxes(D, 2, 3)).sum(axis=0, keepdims=True).astype(sinks.dtype)


def _backward(plan: _Plan, res, d_o):
    """dQ, dK, dV and the sinks' gradient (`_sink_gradient`) from the saved (q, k, v, keep, sinks, O, L) and
    dO (B, N, Tp, H).

    Each block holds Pᵀ, dSᵀ (B, N, ck, cq): every score-sized operand is then contracted on an
    axis XLA:CPU takes as laid out, where (cq, ck) blocks had two of them copied transposed
    (B=1 N=8 H=64, 512x512 blocks, 2-core Xeon: 8.6 ms a block, 5.9 ms as Pᵀ)."""
    q, k, v, keep, sinks, o, lse = res
    acc = accumulation_dtype(q.dtype)
    nq, nk = q.shape[2] // plan.cq, k.shape[2] // plan.ck
    visits = _band_visits(plan, nq, nk)
    kinds = _block_kinds(plan, keep, nq, nk) if visits is None else visits[0]
    d_o = d_o.astype(acc)
    D = jnp.swapaxes(jnp.sum(d_o * o, axis=-1, keepdims=True), 2, 3)  # (B, N, 1, Tp)
    lse_t = jnp.swapaxes(lse, 2, 3)  # (B, N, 1, Tp)
    dot = partial(jnp.einsum, preferred_element_type=acc, precision=plan.precision)

    def k_block(dq, j):
        kj = lax.dynamic_slice_in_dim(k, j * plan.ck, plan.ck, axis=2)  # (B, N, ck, H)
        vj = lax.dynamic_slice_in_dim(v, j * plan.ck, plan.ck, axis=2)

        def q_step(carry, i):
            def step(masked):
                def run(carry):
                    dk, dv = carry  # (B, N, ck, H) each
                    if masked is None:  # EMPTY: no gradient flows through this block
                        return carry, jnp.zeros((q.shape[0], q.shape[1], plan.cq, q.shape[3]), acc)
                    qi, d_oi = _rows(q, i, plan.cq), _rows(d_o, i, plan.cq)  # (B, N, cq, H)
                    # The probabilities, recomputed once per block; 0 where masked.
                    mask = jnp.swapaxes(_block_mask(plan, _rows(keep, i, plan.cq), i, j), 2, 3) if masked else None
                    s_t = _block_scores(plan, kj, qi, mask)  # (B, N, ck, cq)
                    p_t = jnp.exp(s_t - _columns(lse_t, i, plan.cq))
                    dv = dv + dot("BNST,BNTH->BNSH", p_t.astype(v.dtype).astype(acc), d_oi)
                    dp_t = dot("BNSH,BNTH->BNST", vj.astype(acc), d_oi)
                    ds_t = _score_gradient(plan, p_t, s_t, dp_t, _columns(D, i, plan.cq))
                    dk = dk + dot("BNST,BNTH->BNSH", ds_t, qi.astype(acc))
                    dq_t = dot("BNSH,BNST->BNHT", kj.astype(acc), ds_t)  # (B, N, H, cq): transposes K, not dSᵀ
                    return (dk, dv), jnp.swapaxes(dq_t, 2, 3)
                return run

            return _by_kind(kinds, i, j, step, carry)

        zeros = jnp.zeros(kj.shape, acc)
        if visits is None:
            (dk, dv), dq_blocks = lax.scan(q_step, (zeros, zeros), jnp.arange(nq))  # (nq, B, N, cq, H)
            return dq + _unblock(dq_blocks), (dk, dv)
        rows = visits[2][j]  # (M,): the query blocks this key block reaches, then the EMPTY index nq
        (dk, dv), dq_blocks = lax.scan(q_step, (zeros, zeros), rows)  # (M, B, N, cq, H)
        return dq.at[rows].add(dq_blocks), (dk, dv)  # dq by blocks, with a discarded block nq

    B, N, Rp, H = q.shape
    if visits is None:
        dq, (dk, dv) = lax.scan(k_block, jnp.zeros(q.shape, acc), jnp.arange(nk))  # dk, dv: (nk, B, N, ck, H)
    else:
        dq, (dk, dv) = lax.scan(k_block, jnp.zeros((nq + 1, B, N, plan.cq, H), acc), jnp.arange(nk))
        dq = _unblock(dq[:nq])  # (B, N, Rp, H)
    return (dq.astype(q.dtype), _unblock(dk).astype(k.dtype), _unblock(dv).astype(v.dtype), None,
            _sink_gradient(sinks, lse, D))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, k, v, keep, sinks):
    return _forward(plan, q, k, v, keep, sinks)[0]


def _flash_fwd(plan: _Plan, q, k, v, keep, sinks):
    o, lse = _forward(plan, q, k, v, keep, sinks)
    return o, (q, k, v, keep, sinks, o, lse)


_flash.defvjp(_flash_fwd, _backward)


def _pad_keep(keep, S: int, Tp: int, Sp: int):
    """bool (B|1, N|1, T|1, S|1) -> (B|1, N|1, Tp|1, Sp); padding is never kept."""
    kb, kn, kt, _ = keep.shape
    keep = jnp.broadcast_to(keep, (kb, kn, kt, S))
    return jnp.pad(keep, ((0, 0), (0, 0), (0, Tp - kt if kt > 1 else 0), (0, Sp - S)))


def _stack_group_rows(keep, K: int, G: int, T: int):
    """The keep-mask (B|1, N|1, T|1, S|1) for queries stacked as (B, K, G·T): row g·T + t of
    key/value head j is query head j·G + g at position t.

    A mask that varies neither over heads nor rows stays as it is; one that varies over rows
    only is repeated G times, one over heads only T times (bool copies, never of K or V).
    """
    kb, kn, kt, ks = keep.shape
    if G == 1 or (kn == 1 and kt == 1):
        return keep
    grouped = keep.reshape(kb, K, G, kt, ks) if kn != 1 else keep[:, :, None]  # (B|1, K|1, G|1, T|1, S|1)
    grouped = jnp.broadcast_to(grouped, (kb, grouped.shape[1], G, T, ks))
    return grouped.reshape(kb, grouped.shape[1], G * T, ks)


def chunked_attention(q, k, v, keep=None, *, masked_rows="nan", q_chunk=512, k_chunk=1024, precision=None,
                      is_causal: bool = False, window=None, alignment: str = "top-left", head_chunk=None,
                      structure: Structure | None = None, scale: float | None = None, softcap: float | None = None,
                      sinks=None):
    """softmax(Q Kᵀ / √H) V without materialising (B, N, T, S), forward or backward.

    scale replaces 1/√H; softcap (a positive float) caps the scaled scores to softcap·tanh(s / softcap)
    on each block before the mask; sinks (N,) (any float dtype, differentiable) adds each query head's
    sink logit to every row's softmax denominator (its column dropped): a row that keeps no key is
    then 0, whatever masked_rows says.

    q (B, T, N, H), k and v (B, S, K, H) with K dividing N: query head h reads key/value
    head h // (N/K). The G = N/K query heads of one key/value head run as one query axis of
    G·T rows against that head's keys, so K, V and their gradients stay at K heads (and a
    keep-mask that varies over query rows but not heads is repeated G times, as bools).
    keep: bool keep-mask [T, S], [B, T, S] (a batch axis) or (B|1, N|1, T|1, S|1), or None.
    is_causal, window and alignment are the modules' structured keywords, or structure a
    `mha_spec.Structure` in their place (without segment ids: those go in keep), ANDed with keep
    (`diagonal_band`); without keep the kernel never builds a (T, S) mask: each block's mask comes
    from iotas, and the block kinds and empty rows from the band while tracing, so a window's cost
    follows the blocks it touches. head_chunk: how many of the kernel's B·K head blocks (batch
    elements x key/value heads) run a step, one step after another (None: all at once;
    `head_steps` says which piece runs): the same arithmetic per block, in another order, except
    that a step skips the blocks its own batch elements and heads leave empty (so a NaN in V
    behind such a block reaches fewer rows, as with block skipping itself).
    Returns the context (B, T, N, H) in q's dtype. Accumulates in float32 for 16-bit inputs,
    float64 for float64. T = 0 or B = 0 gives an empty context; S = 0 is a ValueError (no
    key to attend to).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    sinks = _check_call(q, k, v, q_chunk, k_chunk, head_chunk, sinks)
    keep = keep_4d(keep, B, N, T, S)  # (B|1, N|1, T|1, S|1)
    band = diagonal_band(_structure(T, S, structure, is_causal, window, alignment))
    if band is not None and keep is not None:
        keep, band = keep & band_keep(T, S, band), None  # (B|1, N|1, T, S)
    if B == 0 or T == 0:
        return jnp.zeros((B, T, N, H), q.dtype)
    masked = keep is not None or band is not None
    if masked:
        row_any = (keep.any(axis=-1, keepdims=True) if keep is not None  # (B|1, N|1, T|1, 1): from the mask alone
                   else _band_attends(_Band(T, T, *band), S, T))
        q = _query_gradient_as_materialised(q, k, row_any)
    ctx = _chunked(q, k, v, keep, sinks, q_chunk=q_chunk, k_chunk=k_chunk, precision=precision, band=band,
                   head_chunk=head_chunk, scale=None if scale is None else float(scale),
                   softcap=None if softcap is None else float(softcap))  # (B, N, T, H)
    if masked and sinks is None:  # with sinks a row that keeps no key is 0 (the sink takes it)
        G = N // K
        mean_v = mean_over_keys(v)[:, 0]  # (B, K, H)
        mean_v = (jnp.repeat(mean_v, G, axis=1) if G > 1 else mean_v)[:, :, None, :]  # (B, N, 1, H)
        ctx = fill_masked_rows(ctx, row_any, masked_rows, mean_v)
    return jnp.transpose(ctx, (0, 2, 1, 3)).astype(q.dtype)  # (B, T, N, H)


def _check_call(q, k, v, q_chunk, k_chunk, head_chunk, sinks):
    """`chunked_attention`'s shapes, blocks and head chunk checked before anything is traced (ValueError
    naming them); the sinks (N,) as a jax array, or None."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if S == 0:
        raise ValueError(f"chunked_attention needs at least one key: got key shape {k.shape} (S=0)")
    if K == 0 or N % K or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"key/value heads must divide the query heads and key and value must have one shape: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (B, L, heads, H)")
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"q_chunk and k_chunk must be positive, got {q_chunk} and {k_chunk}")
    head_steps(B, K, head_chunk)
    sinks = None if sinks is None else jnp.asarray(sinks)
    if sinks is not None and tuple(sinks.shape) != (N,):
        raise ValueError(f"sinks must have shape (N,) = ({N},), one per query head of q {tuple(q.shape)}, "
                         f"got {tuple(sinks.shape)}")
    return sinks


@jax.custom_vjp
def _nan_gradient_where(x, flags):
    """x unchanged; in the backward, NaN replaces x's gradient wherever `flags` (broadcast) is True."""
    return x


def _nan_gradient_where_fwd(x, flags):
    return x, flags


def _nan_gradient_where_bwd(flags, g):
    return jnp.where(flags, jnp.asarray(jnp.nan, g.dtype), g), None


_nan_gradient_where.defvjp(_nan_gradient_where_fwd, _nan_gradient_where_bwd)


def _query_gradient_as_materialised(q, k, row_any):
    """q (B, T, N, H), unchanged, with the gradient NaN and zeros of the materialised path;
    row_any (B|1, N|1, T|1, 1): the rows that keep a key.

    There q's gradient is dS·K over every key, masked ones included (dS is 0 there, and 0 x NaN
    is NaN): a NaN in a key makes it NaN at that feature on every row of the query heads reading
    it, where this kernel skips the blocks with nothing kept. A row that keeps no key is a
    constant there (the policy's fill), so its query gets no gradient, where this kernel's
    backward would compute dO·Vᵀ for it, NaN with a NaN in V.
    """
    G = q.shape[2] // k.shape[2]
    k_nan = jnp.isnan(k).any(axis=1)  # (B, K, H)
    k_nan = (jnp.repeat(k_nan, G, axis=1) if G > 1 else k_nan)[:, None]  # (B, 1, N, H)
    attends = jnp.transpose(row_any, (0, 2, 1, 3))  # (B|1, T|1, N|1, 1)
    q = _nan_gradient_where(q, k_nan)  # first: the NaN reaches the rows that keep no key too
    return jnp.where(attends, q, lax.stop_gradient(q))


def _blocking(R: int, S: int, q_chunk: int, k_chunk: int) -> tuple[int, int, int, int]:
    """(cq, ck, Rp, Sp): the blocks, each clamped to its axis, and the axes padded to whole blocks."""
    cq, ck = min(q_chunk, R), min(k_chunk, S)
    return cq, ck, -(-R // cq) * cq, -(-S // ck) * ck


def _kernel_keep(keep, K: int, G: int, T: int, S: int, Rp: int, Sp: int):
    """The keep-mask as the kernel's blocks see it: query heads' rows stacked per key/value head, padded."""
    return None if keep is None else _pad_keep(_stack_group_rows(keep, K, G, T), S, Rp, Sp)


def block_census(keep, B: int, N: int, T: int, S: int, q_chunk: int = 512, k_chunk: int = 1024, *,
                 kv_heads: int | None = None, is_causal: bool = False, window=None,
                 alignment: str = "top-left", head_chunk: int | None = None,
                 structure: Structure | None = None) -> dict[str, int]:
    """How many (query block, key block) pairs `chunked_attention` finds EMPTY, FULL and PARTIAL for
    this keep-mask and these blocks: {"empty": .., "full": .., "partial": ..}, summing to the blocks of
    the (padded) grid times the head steps (`head_steps`; one without head_chunk).

    The count is the kernel's own decision: the same preparation of the mask (grouped rows stacked
    when kv_heads < N, padding to whole blocks, blocks clamped to the axes, one piece of head blocks
    a step) and the same summary, `_block_kinds`, that forward and backward branch on. A block is
    EMPTY only when nothing is kept for any batch element or head of its step (one batched matmul
    serves them all; a mask that differs between batch elements leaves more blocks EMPTY when each
    step holds fewer of them): an EMPTY block runs no
    matmul, in the forward and in the backward; every other block runs its Q·Kᵀ and P·V (in the
    backward the recomputed Q·Kᵀ and four more), PARTIAL with the mask select. keep, is_causal,
    window, alignment and structure: as `chunked_attention` takes them (a band alone is summarised from its
    structure, as the kernel does).
    """
    for name, val in (("B", B), ("N", N), ("T", T), ("S", S), ("q_chunk", q_chunk), ("k_chunk", k_chunk)):
        if isinstance(val, bool) or not isinstance(val, int) or val < (0 if name in ("B", "T") else 1):
            raise ValueError(f"block_census: {name} must be a {'non-negative' if name in ('B', 'T') else 'positive'} "
                             f"int, got {val!r}")
    K = N if kv_heads is None else kv_heads
    if isinstance(K, bool) or not isinstance(K, int) or K < 1 or N % K:
        raise ValueError(f"block_census: kv_heads must divide N={N}, got {kv_heads!r}")
    bc, kc = head_steps(B, K, head_chunk)  # checks head_chunk
    keep = keep_4d(keep, B, N, T, S)  # (B|1, N|1, T|1, S|1)
    band = diagonal_band(_structure(T, S, structure, is_causal, window, alignment))
    if band is not None and keep is not None:
        keep, band = keep.astype(bool) & band_keep(T, S, band), None
    if B == 0 or T == 0:  # the kernel returns the empty context without a block
        return {"empty": 0, "full": 0, "partial": 0}
    G = N // K
    cq, ck, Rp, Sp = _blocking(G * T, S, q_chunk, k_chunk)
    keep_p = _kernel_keep(None if keep is None else keep.astype(bool), K, G, T, S, Rp, Sp)
    plan = _Plan(S=S, cq=cq, ck=ck, scale=1.0, precision=None,
                 band=None if band is None else _Band(G * T, T, *band))
    nq, nk = Rp // cq, Sp // ck
    counts = dict.fromkeys(("empty", "full", "partial"), 0)
    for b in range(0, B, bc):
        for h in range(0, K, kc):
            piece = keep_p if keep_p is None else keep_p[b:b + bc] if keep_p.shape[0] != 1 else keep_p
            piece = piece if piece is None or piece.shape[1] == 1 else piece[:, h:h + kc]
            kinds = _block_kinds(plan, piece, nq, nk)  # (nq|1, nk), or None: every block FULL
            kinds = jnp.full((nq, nk), FULL) if kinds is None else jnp.broadcast_to(kinds, (nq, nk))
            for name, kind in (("empty", EMPTY), ("full", FULL), ("partial", PARTIAL)):
                counts[name] += int((kinds == kind).sum())
    return counts


def head_steps(B: int, K: int, head_chunk: int | None) -> tuple[int, int]:
    """(batch elements, key/value heads) of one step when the kernel runs head_chunk of its B·K head
    blocks at a time (None: all): the largest such piece of at most head_chunk head blocks that is
    a whole number of heads of one batch element (a divisor of K) or whole batch elements (K times
    a divisor of B), so every step is a plain slice and no mask is broadcast. ValueError unless
    head_chunk is None or a positive integer."""
    if head_chunk is not None and (type(head_chunk) is not int or head_chunk < 1):
        raise ValueError(f"head_chunk must be a positive integer or None, got {head_chunk!r}")
    if head_chunk is None or head_chunk >= B * K:
        return B, K
    if head_chunk < K:
        return 1, max(d for d in range(1, head_chunk + 1) if K % d == 0)
    return max(d for d in range(1, head_chunk // K + 1) if B % d == 0), K


def _by_head_steps(plan: _Plan, steps: tuple[int, int], q, k, v, keep, sinks=None):
    """_flash over pieces of (bc, kc) = steps head blocks at a time, one after another: q (B, K, Rp, H),
    k and v (B, K, Sp, H), keep (B|1, K|1, Rp|1, Sp) or None, sinks (1, K, Rp, 1) or None; the context
    (B, K, Rp, H).

    Why: a block's scores are (B, K, cq, ck) at once; at B·K = 32, 256x512 that is 16 MiB, which
    leaves the caches between the passes over it (QKᵀ, max, exp, P·V). Fewer head blocks a step
    keep a taller block in cache. Pieces run in the order of (B, K) as laid out, so splitting and
    joining them are reshapes, not copies."""
    B, K = q.shape[:2]
    bc, kc = steps
    if (bc, kc) == (B, K):
        return _flash(plan, q, k, v, keep, sinks)
    nb, nh = B // bc, K // kc

    def pieces(x):  # (B, K, L, H) -> (nb·nh, bc, kc, L, H)
        return x.reshape(nb * nh, bc, kc, *x.shape[2:])

    def step(i_qkv):
        i, qi, ki, vi = i_qkv
        keep_i = keep
        if keep is not None and keep.shape[0] != 1:
            keep_i = lax.dynamic_slice_in_dim(keep_i, (i // nh) * bc, bc, axis=0)
        if keep is not None and keep.shape[1] != 1:
            keep_i = lax.dynamic_slice_in_dim(keep_i, (i % nh) * kc, kc, axis=1)
        sinks_i = None if sinks is None else lax.dynamic_slice_in_dim(sinks, (i % nh) * kc, kc, axis=1)
        return _flash(plan, qi, ki, vi, keep_i, sinks_i)

    out = lax.map(step, (jnp.arange(nb * nh), pieces(q), pieces(k), pieces(v)))  # (nb·nh, bc, kc, Rp, H)
    return out.reshape(B, K, *out.shape[3:])


# Compiled once per shapes and blocks: run eagerly, the kernel's loops would otherwise be
# traced and compiled again on every call (measured 0.46 s a call at B=3 T=5 S=7 N=6).
@partial(jax.jit, static_argnames=("q_chunk", "k_chunk", "precision", "band", "head_chunk", "scale", "softcap"))
def _chunked(q, k, v, keep, sinks=None, *, q_chunk, k_chunk, precision, band=None, head_chunk=None, scale=None,
             softcap=None):
    """The context (B, N, T, H) in the accumulation dtype, 0 on rows that keep no key; band: a
    `diagonal_band` (lo, hi) when the mask is one (keep is None then); scale, softcap and sinks (N,) as
    `chunked_attention` takes them."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    q, scale = fold_scale(q, scale)
    R = G * T  # query rows per key/value head
    cq, ck, Rp, Sp = _blocking(R, S, q_chunk, k_chunk)

    def padded(x, L, Lp):  # (B, n, L, H) -> (B, n, Lp, H), zero padded
        return jnp.pad(x, ((0, 0), (0, 0), (0, Lp - L), (0, 0)))

    q_rows = jnp.transpose(q.reshape(B, T, K, G, H), (0, 2, 3, 1, 4)).reshape(B, K, R, H)  # row g·T + t
    if keep is not None:
        # A mask known at compile time (a constant under jit) would have every reduction over it
        # constant-folded by XLA's evaluator: measured 8-27 s per reduction for a 2048 x 2048
        # causal mask. The barrier makes them run as compiled code instead.
        keep = lax.optimization_barrier(jnp.asarray(keep))
    keep_p = _kernel_keep(keep, K, G, T, S, Rp, Sp)
    plan = _Plan(S=S, cq=cq, ck=ck, scale=scale, precision=precision,
                 band=None if band is None else _Band(R, T, *band), softcap=softcap)
    k_heads, v_heads = (padded(jnp.transpose(x, (0, 2, 1, 3)), S, Sp) for x in (k, v))  # (B, K, Sp, H)
    steps = head_steps(B, K, head_chunk)
    sink_rows = None if sinks is None else _sink_rows(sinks, K, G, T, Rp, accumulation_dtype(q.dtype))
    ctx = _by_head_steps(plan, steps, padded(q_rows, R, Rp), k_heads, v_heads, keep_p, sink_rows)[:, :, :R]  # (B, K, G·T, H)
    return ctx.reshape(B, N, T, H)  # head j·G + g: the rows g·T .. g·T + T - 1 of key/value head j


def _sink_rows(sinks, K: int, G: int, T: int, Rp: int, acc):
    """sinks (N,) -> (1, K, Rp, 1) in acc: kernel row g·T + t of key/value head j holds query head
    j·G + g's sink; padding rows hold 0 (they keep no key and are sliced off)."""
    rows = jnp.repeat(sinks.astype(acc).reshape(K, G), T, axis=1)  # (K, G·T)
    return jnp.pad(rows, ((0, 0), (0, Rp - G * T)))[None, :, :, None]
