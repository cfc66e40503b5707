"""Query/key-chunked attention with an online softmax: O(T + S) memory.

jax.nn.dot_product_attention's XLA path builds the whole (B, N, T, S) score
tensor (on CPU, and on GPU outside cuDNN). This one never holds more than
(B, N, q_chunk, k_chunk) scores: an outer `lax.map` over query chunks and an
inner `lax.scan` over key chunks carry the running max, sum and context
(flash-attention's recurrence). Both bodies are rematerialised
(`jax.checkpoint`) so the backward pass stays O(T + S) too.

Layout BTNH, legend in `mha_spec`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def accumulation_dtype(dtype):
    """float32 for 16-bit inputs, the input dtype otherwise (float32 or float64)."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def fold_scale(q):
    """(q, scale left for the scores): 1/√H folded into q where that is as accurate (one
    rounding in the same dtype either way).

    Scaling q is a pass over (B, T, N, H) instead of (B, N, T, S), and it spares XLA a
    broadcast of the scale to the score shape (measured at B=4, T=S=2048, H=64: the
    gradient program's temporary memory drops from 2080 to 1568 MiB). For 16-bit q the
    scale would round q a second time, so it is applied to the float32 scores instead.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if accumulation_dtype(q.dtype) == q.dtype:
        return q * jnp.asarray(scale, q.dtype), 1.0
    return q, scale


def fill_masked_rows(x, row_any, masked_rows: str, uniform_value):
    """Overwrite the rows of x whose query may attend to nothing (row_any False).

    uniform_value is what such a row holds under "uniform" (1/S for weights, mean V for a
    context). Under "nan" the fill is uniform_value times a factor that is NaN on exactly
    those rows, so on the fused path the gradient meets NaN where the materialised path's
    NaN weights meet V (the same (batch, head) slices of V), and nowhere else.
    """
    if masked_rows == "zero":
        fill = jnp.zeros((), x.dtype)
    elif masked_rows == "nan":
        fill = jnp.asarray(uniform_value, x.dtype) * jnp.where(row_any, 1.0, jnp.nan).astype(x.dtype)
    else:
        fill = jnp.asarray(uniform_value, x.dtype)
    return jnp.where(row_any, x, fill)


def chunked_attention(q, k, v, keep=None, *, masked_rows="nan", q_chunk=512, k_chunk=1024, precision=None):
    """softmax(Q Kᵀ / √H) V without materialising (B, N, T, S).

    q (B, T, N, H), k and v (B, S, N, H); keep: bool keep-mask broadcastable to
    (B, N, T, S), as (B|1, N|1, T|1, S|1), or None. Returns the context (B, T, N, H)
    in q's dtype. Accumulates in float32 for 16-bit inputs, float64 for float64.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    dtype = q.dtype
    acc = accumulation_dtype(dtype)
    q, scores_scale = fold_scale(q)
    cq, ck = min(q_chunk, T), min(k_chunk, S)
    nq, nk = -(-T // cq), -(-S // ck)
    Tp, Sp = nq * cq, nk * ck

    qp = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))  # (B, Tp, N, H)
    kp = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))  # (B, Sp, N, H)
    vp = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))  # (B, Sp, N, H)

    # Padded keys must never be attended to: fold them into the keep-mask.
    if keep is None and Sp != S:
        keep = jnp.ones((1, 1, 1, S), bool)
    if keep is not None:
        kb, kn, kt, _ = keep.shape
        keep = jnp.broadcast_to(keep, (kb, kn, kt, S))
        keep = jnp.pad(keep, ((0, 0), (0, 0), (0, Tp - T if kt > 1 else 0), (0, Sp - S)))

    def q_chunk_context(i):
        qi = lax.dynamic_slice_in_dim(qp, i * cq, cq, axis=1)  # (B, cq, N, H)
        keep_i = None
        if keep is not None:
            keep_i = keep if keep.shape[2] == 1 else lax.dynamic_slice_in_dim(keep, i * cq, cq, axis=2)

        @jax.checkpoint
        def k_step(carry, j):
            ctx, run_max, run_sum = carry  # (B, N, cq, H), (B, N, cq, 1), (B, N, cq, 1)
            kj = lax.dynamic_slice_in_dim(kp, j * ck, ck, axis=1)  # (B, ck, N, H)
            vj = lax.dynamic_slice_in_dim(vp, j * ck, ck, axis=1)  # (B, ck, N, H)
            s = jnp.einsum("BTNH,BSNH->BNTS", qi, kj, preferred_element_type=acc, precision=precision)
            if scores_scale != 1.0:
                s = s * scores_scale
            if keep_i is not None:
                keep_ij = lax.dynamic_slice_in_dim(keep_i, j * ck, ck, axis=3)
                s = jnp.where(keep_ij, s, -jnp.inf)  # (B, N, cq, ck)
            # The max only stabilises exp(); the result does not depend on it.
            new_max = lax.stop_gradient(jnp.maximum(run_max, s.max(axis=-1, keepdims=True)))
            # A row that has seen only masked keys keeps max -inf; use 0 so exp() gives 0, not NaN.
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            p = jnp.exp(s - safe_max)  # (B, N, cq, ck)
            rescale = jnp.exp(run_max - safe_max)
            run_sum = rescale * run_sum + p.sum(axis=-1, keepdims=True)
            pv = jnp.einsum("BNTS,BSNH->BNTH", p.astype(dtype), vj, preferred_element_type=acc, precision=precision)
            return (rescale * ctx + pv, new_max, run_sum), None

        init = (
            jnp.zeros((B, N, cq, H), acc),
            jnp.full((B, N, cq, 1), -jnp.inf, acc),
            jnp.zeros((B, N, cq, 1), acc),
        )
        (ctx, _, run_sum), _ = lax.scan(k_step, init, jnp.arange(nk))
        attended = run_sum > 0  # False exactly where the row kept no key
        return jnp.where(attended, ctx / jnp.where(attended, run_sum, 1.0), 0.0), attended

    ctx, attended = lax.map(jax.checkpoint(q_chunk_context), jnp.arange(nq))  # (nq, B, N, cq, H)
    ctx = jnp.moveaxis(ctx, 0, 2).reshape(B, N, Tp, H)[:, :, :T]  # (B, N, T, H)
    attended = jnp.moveaxis(attended, 0, 2).reshape(B, N, Tp, 1)[:, :, :T]  # (B, N, T, 1)
    mean_v = None if masked_rows == "zero" else jnp.mean(v.astype(acc), axis=1)[:, :, None, :]  # (B, N, 1, H)
    ctx = fill_masked_rows(ctx, attended, masked_rows, mean_v)
    return jnp.transpose(ctx, (0, 2, 1, 3)).astype(dtype)  # (B, T, N, H)
