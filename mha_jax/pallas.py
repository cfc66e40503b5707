"""Our fused path's wrappers of the Pallas flash kernels that ship with jax.

  gpu_flash  `jax.experimental.pallas.ops.gpu.attention.mha` (Triton): layout (B, T, N, H)
  tpu_flash  `jax.experimental.pallas.ops.tpu.flash_attention.flash_attention` (Mosaic):
             layout (B, N, T, H)

Both take and return our layout: q (B, T, N, H), k and v (B, S, K, H) with K dividing N; query
head h = j·G + g reads key/value head j (G = N // K). Neither kernel takes grouped heads, so the
kernel runs once per g on the K query heads j·G + g, against the same K and V: K and V are never
repeated (their gradients are, one per g, before autodiff sums them). Not a `jax.vmap` over g:
a vmapped grid gets one axis more than the TPU kernel's dimension semantics name (TPU
interpret mode rejects it) and than Triton's three grid axes. The mask is what the
kernels express, named by the caller: is_causal (s <= t: the top-left triangle) and segment ids
(B, T) for the queries with, on the TPU, separate ones (B, S) for the keys; anything else is a
ValueError naming `mha_jax.kernels.pallas_refusal`'s reason. Fully masked rows (only a query
segment id that no key has makes one: causal rows keep key 0, shared ids keep the query itself)
follow `masked_rows` as every other fused kernel does, applied to the kernel's output from the
segment ids alone.

Neither kernel takes a precision: they are traced (forward and backward) under
`jax.default_matmul_precision` of the call's precision, so their dots follow it. With
interpret=True (default: on a CPU) they run in Pallas interpret mode, the GPU kernel through
its own `interpret=` and the TPU kernel under `pltpu.force_tpu_interpret_mode`; that is the
only way they have run here (no GPU or TPU).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import kernels
from mha_jax.chunked import fill_masked_rows, mean_over_keys
from mha_spec import MASKED_ROWS_POLICIES


def _check(kernel: str, q, k, v, is_causal: bool, segment_ids, key_segment_ids, masked_rows: str, precision) -> str:
    """The call's mask kind; ValueError/TypeError naming the shapes or the kernel's refusal."""
    if masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
    if q.ndim != 4 or k.ndim != 4 or tuple(k.shape) != tuple(v.shape) or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} (B, T, N, H), k {tuple(k.shape)} and v {tuple(v.shape)} (B, S, K, H) "
                         f"do not fit together (K must divide N)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, _, H = q.shape
    S = k.shape[1]
    for name, ids, L in (("segment_ids", segment_ids, T), ("key_segment_ids", key_segment_ids, S)):
        if ids is None:
            continue
        if np.dtype(ids.dtype).kind not in "iu":
            raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")
        if tuple(ids.shape) != (B, L):
            raise ValueError(f"{name} must have shape ({B}, {L}) for q {tuple(q.shape)} and k {tuple(k.shape)}, "
                             f"got {tuple(ids.shape)}")
    if segment_ids is None and key_segment_ids is not None:
        raise ValueError("key_segment_ids without segment_ids: pass the queries' segment ids too")
    if segment_ids is not None and key_segment_ids is None and T != S:
        raise ValueError(f"segment_ids with T={T} != S={S}: pass key_segment_ids (B, S) too")
    if segment_ids is None:
        kind = kernels.MASK_CAUSAL if is_causal else kernels.MASK_NONE
    elif key_segment_ids is None:
        kind = kernels.MASK_CAUSAL_SEGMENTS if is_causal else kernels.MASK_SEGMENTS
    else:
        kind = kernels.MASK_CAUSAL_KEY_SEGMENTS if is_causal else kernels.MASK_KEY_SEGMENTS
    refusal = kernels.pallas_refusal(kernel, dtype=q.dtype, T=T, S=S, H=H, mask_kind=kind, precision=precision)
    if refusal is not None:
        raise ValueError(f"{kernel} cannot run q {tuple(q.shape)}, k {tuple(k.shape)}: {refusal}")
    return kind


def _int32_ids(q_ids, k_ids):
    """Segment ids as int32 with the same equalities: cast where they fit, else ranks (B, T + S)."""
    if np.dtype(q_ids.dtype).itemsize < 4 or jnp.dtype(q_ids.dtype) == jnp.int32:
        q32 = q_ids.astype(jnp.int32)
        return q32, (None if k_ids is None else k_ids.astype(jnp.int32))
    both = q_ids if k_ids is None else jnp.concatenate([q_ids, k_ids.astype(q_ids.dtype)], axis=1)  # (B, T [+ S])
    ranks = jax.vmap(lambda row: jnp.searchsorted(jnp.sort(row), row))(both).astype(jnp.int32)  # equal ids, equal ranks
    T = q_ids.shape[1]
    return ranks[:, :T], (None if k_ids is None else ranks[:, T:])


def rows_attending(q_ids, k_ids, is_causal: bool):
    """bool (B, T): query t of row b keeps some key, for segment ids q_ids (B, T) and k_ids (B, S)
    (and, is_causal, s <= t): sorts the keys' ids, so O((T + S) log S), no (T, S) mask."""
    S = k_ids.shape[1]
    order = jnp.argsort(k_ids, axis=1, stable=True)  # (B, S): among equal ids, the first key first
    sorted_ids = jnp.take_along_axis(k_ids, order, axis=1)
    at = jax.vmap(lambda row, ids: jnp.searchsorted(row, ids, side="left"))(sorted_ids, q_ids)  # (B, T)
    at_c = jnp.minimum(at, S - 1)
    keeps = (at < S) & (jnp.take_along_axis(sorted_ids, at_c, axis=1) == q_ids)
    if is_causal:
        first = jnp.take_along_axis(order, at_c, axis=1)  # (B, T): the first key with the query's id
        keeps = keeps & (first <= jnp.arange(q_ids.shape[1])[None, :])
    return keeps


def _under(contexts, fn):
    """fn with its forward and its backward both traced under the contexts (context managers
    made fresh by `contexts()`): a custom_vjp kernel's backward is traced when the gradient is
    taken, after the forward's `with` has closed."""
    if contexts is None:
        return fn

    @jax.custom_vjp
    def call(*args):
        with contexts():
            return fn(*args)

    def fwd(*args):
        with contexts():
            out, vjp = jax.vjp(fn, *args)
        return out, vjp

    def bwd(vjp, g):
        with contexts():
            return vjp(g)

    call.defvjp(fwd, bwd)
    return call


def _contexts(precision, tpu_interpret: bool = False, without_x64: bool = False):
    # Both kernels' causal index arithmetic mixes int32 program ids with Python ints, which x64
    # makes int64 (a TypeError in lax.div / lax.select): they are traced with x64 off. Their
    # inputs are 32-bit or 16-bit floats and int32 segment ids, so x64 changes nothing else.
    name = kernels.precision_name(precision)
    without_x64 = without_x64 and jax.config.jax_enable_x64
    if name is None and not tpu_interpret and not without_x64:
        return None

    @contextlib.contextmanager
    def entered():
        with contextlib.ExitStack() as stack:
            if name is not None:
                stack.enter_context(jax.default_matmul_precision(name))
            if without_x64:
                stack.enter_context(jax.enable_x64(False))
            if tpu_interpret:
                from jax.experimental.pallas import tpu as pltpu

                stack.enter_context(pltpu.force_tpu_interpret_mode())
            yield

    return entered


def _finish(context, v, q_ids, k_ids, is_causal: bool, masked_rows: str, G: int):
    """The masked-row policy on context (B, T, N, H): only separate key segment ids can leave a
    query row with no key."""
    if k_ids is None:
        return context
    row_any = rows_attending(q_ids, k_ids, is_causal)[:, :, None, None]  # (B, T, 1, 1)
    mean_v = mean_over_keys(v)  # (B, 1, K, H)
    if G > 1:
        mean_v = jnp.repeat(mean_v, G, axis=2)  # (B, 1, N, H): query head h reads key/value head h // G
    return fill_masked_rows(context, row_any, masked_rows, mean_v)


def _default_interpret(interpret):
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def gpu_flash(q, k, v, *, is_causal: bool = False, segment_ids=None, masked_rows: str = "nan", precision=None,
              interpret: bool | None = None):
    """softmax(Q Kᵀ / √H) V by pallas-gpu-flash: q (B, T, N, H), k and v (B, S, K, H) -> (B, T, N, H).

    T = S; is_causal keeps s <= t; segment_ids (B, T) are the queries' and the keys' ids. No mask
    it expresses leaves a row empty, so masked_rows is checked and has nothing to fill.
    """
    _check(kernels.PALLAS_GPU, q, k, v, is_causal, segment_ids, None, masked_rows, precision)
    from jax.experimental.pallas.ops.gpu import attention as gpu

    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    fwd_block, bwd_block = kernels.gpu_blocks(T)
    blocks = gpu.BlockSizes(block_q=fwd_block, block_k=fwd_block, block_q_dkv=bwd_block, block_kv_dkv=bwd_block,
                            block_q_dq=bwd_block, block_kv_dq=bwd_block)
    ids = None if segment_ids is None else _int32_ids(segment_ids, None)[0]
    interpret = _default_interpret(interpret)

    def run(q, k, v, ids):
        def one_group(qg):  # (B, T, K, H): the query heads j·G + g for one g
            return gpu.mha(qg, k, v, ids, sm_scale=1.0 / math.sqrt(H), causal=is_causal, block_sizes=blocks,
                           interpret=interpret)

        if G == 1:
            return one_group(q)
        q5 = q.reshape(B, T, K, G, H)
        return jnp.stack([one_group(q5[:, :, :, g]) for g in range(G)], axis=3).reshape(B, T, N, H)

    return _under(_contexts(precision, without_x64=True), run)(q, k, v, ids)


def tpu_flash(q, k, v, *, is_causal: bool = False, segment_ids=None, key_segment_ids=None, masked_rows: str = "nan",
              precision=None, interpret: bool | None = None):
    """softmax(Q Kᵀ / √H) V by pallas-tpu-flash: q (B, T, N, H), k and v (B, S, K, H) -> (B, T, N, H).

    T and S multiples of `kernels.TPU_BLOCK`; is_causal keeps s <= t (top-left); segment_ids
    (B, T) with key_segment_ids (B, S) (default: the same, when T = S) keep equal ids. A query
    whose id no key has gets `masked_rows`' value (mean V of its own key/value head, 0 or NaN).
    """
    _check(kernels.PALLAS_TPU, q, k, v, is_causal, segment_ids, key_segment_ids, masked_rows, precision)
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    blocks = tpu.BlockSizes(block_q=kernels.TPU_BLOCK, block_k_major=kernels.TPU_BLOCK, block_k=kernels.TPU_BLOCK,
                            block_b=1, block_q_major_dkv=kernels.TPU_BLOCK, block_k_major_dkv=kernels.TPU_BLOCK,
                            block_k_dkv=kernels.TPU_BLOCK, block_q_dkv=kernels.TPU_BLOCK,
                            block_k_major_dq=kernels.TPU_BLOCK, block_k_dq=kernels.TPU_BLOCK,
                            block_q_dq=kernels.TPU_BLOCK)
    q_ids = k_ids = None
    if segment_ids is not None:
        q_ids, k_ids = _int32_ids(segment_ids, key_segment_ids)
    interpret = _default_interpret(interpret)

    def run(q, k, v, q_ids, k_ids):
        seg = None if q_ids is None else tpu.SegmentIds(q_ids, q_ids if k_ids is None else k_ids)
        kh, vh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))  # (B, K, S, H)

        def one_group(qg):  # (B, K, T, H): the query heads j·G + g for one g
            return tpu.flash_attention(qg, kh, vh, segment_ids=seg, causal=is_causal, sm_scale=1.0 / math.sqrt(H),
                                       block_sizes=blocks)

        qh = jnp.transpose(q.reshape(B, T, K, G, H), (0, 3, 2, 1, 4))  # (B, G, K, T, H)
        out = jnp.stack([one_group(qh[:, g]) for g in range(G)], axis=3)  # (B, K, T, G, H)
        return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(B, T, N, H)

    context = _under(_contexts(precision, tpu_interpret=interpret, without_x64=True), run)(q, k, v, q_ids, k_ids)
    return _finish(context, v, q_ids, k_ids, is_causal, masked_rows, G)


def flash(kernel: str, q, k, v, *, is_causal: bool = False, segment_ids=None, key_segment_ids=None,
          masked_rows: str = "nan", precision=None, interpret: bool | None = None):
    """`gpu_flash` or `tpu_flash` by the kernel's name (kernels.PALLAS_GPU, kernels.PALLAS_TPU)."""
    if kernel == kernels.PALLAS_GPU:
        if key_segment_ids is not None:
            raise ValueError(f"{kernel} takes one set of segment ids for queries and keys, not key_segment_ids")
        return gpu_flash(q, k, v, is_causal=is_causal, segment_ids=segment_ids, masked_rows=masked_rows,
                         precision=precision, interpret=interpret)
    if kernel == kernels.PALLAS_TPU:
        return tpu_flash(q, k, v, is_causal=is_causal, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                         masked_rows=masked_rows, precision=precision, interpret=interpret)
    raise ValueError(f"kernel {kernel!r} is not one of {kernels.PALLAS_KERNELS}")
