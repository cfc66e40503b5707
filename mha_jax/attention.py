"""Multi-head attention in Flax NNX, with the semantics of `mha_torch`.

Internal layout BTNH (legend in `mha_spec`); einsum strings use the legend verbatim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.chunked import accumulation_dtype, chunked_attention, fill_masked_rows, fold_scale
from mha_spec import check_config, check_qkv_shapes, mask_shape_4d

MATERIALIZE_LIMIT = 2**24
"""Largest B·N·T·S for which the fused path lets jax.nn.dot_product_attention
build the score tensor (64 MiB in float32); above it the chunked path runs."""


def _torch_linear_init(fan_in: int):
    """U(-1/√fan_in, 1/√fan_in): torch.nn.Linear's default, for weights and biases alike."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _keep_mask(mask, B: int, N: int, T: int, S: int):
    """Any bool/int/float keep-mask (0 = masked) -> bool (B|1, N|1, T|1, S|1)."""
    if not isinstance(mask, (jax.Array, np.ndarray)):
        raise TypeError(f"mask must be a jax or numpy array, got {type(mask).__name__}")
    kind = np.dtype(mask.dtype).kind
    if kind not in "biuf" and mask.dtype != jnp.bfloat16:
        raise TypeError(f"mask must be bool, int or float, got {mask.dtype}")
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    mask = jnp.asarray(mask)
    keep = mask if mask.dtype == jnp.bool_ else mask != 0
    return keep.reshape(shape4)


def _row_attends(keep):
    return keep.any(axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1)


def attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None):
    """softmax(Q Kᵀ / √H) V with materialised weights.

    q (B, T, N, H), k and v (B, S, N, H), keep bool broadcastable to (B, N, T, S) or None.
    Returns context (B, T, N, H) and weights (B, N, T, S), both in q's dtype.
    Scores and softmax run in float32 for 16-bit inputs (float64 stays float64).
    """
    dtype = q.dtype
    S = k.shape[1]
    acc = accumulation_dtype(dtype)
    q, scores_scale = fold_scale(q)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=acc, precision=precision)
    if scores_scale != 1.0:
        scores = scores * scores_scale
    if keep is not None:
        scores = jnp.where(keep, scores, -jnp.inf)
        row_any = _row_attends(keep)
        # A fully masked row gets all-zero scores: its softmax is finite (uniform),
        # so no NaN reaches the backward pass; the policy then sets its value.
        scores = jnp.where(row_any, scores, 0.0)
    weights = jax.nn.softmax(scores, axis=-1)
    if keep is not None:
        weights = fill_masked_rows(weights, row_any, masked_rows, 1.0 / S)
    weights = weights.astype(dtype)
    context = jnp.einsum("BNTS,BSNH->BTNH", weights, v, precision=precision, preferred_element_type=acc).astype(dtype)
    return context, weights


def fused_attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None):
    """The same context as `attention_core`, without returning (or, when large, building) weights.

    jax.nn.dot_product_attention computes its softmax in float32, which keeps the
    accuracy of float32 and 16-bit inputs but not of float64; its XLA path
    materialises (B, N, T, S); and it takes no precision argument, so under a pinned
    "highest" XLA:CPU rejects its float16 backward dots ('F16_F16_F32'). So: float64,
    float16, or B·N·T·S > MATERIALIZE_LIMIT runs `chunked_attention` (precision passed
    through); float32 and bfloat16 below the limit run jax.nn.dot_product_attention.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    if q.dtype in (jnp.float64, jnp.float16) or B * N * T * S > MATERIALIZE_LIMIT:
        return chunked_attention(q, k, v, keep, masked_rows=masked_rows, precision=precision)
    context = jax.nn.dot_product_attention(q, k, v, mask=keep, scale=1.0 / math.sqrt(H))  # (B, T, N, H)
    if keep is not None:
        # jax gives fully masked rows uniform weights; apply our policy on (B, T, N, H).
        row_any = jnp.transpose(_row_attends(keep), (0, 2, 1, 3))  # (B|1, T|1, N|1, 1)
        mean_v = None if masked_rows == "zero" else jnp.mean(v.astype(accumulation_dtype(v.dtype)), axis=1, keepdims=True)  # (B, 1, N, H)
        context = fill_masked_rows(context, row_any, masked_rows, mean_v)
    return context


class MultiHeadAttention(nnx.Module):
    """Classic multi-head attention in Flax NNX: separate q/k/v/out projections with bias.

    __call__(query [B, T, E], key [B, S, E], value [B, S, E], mask=None, need_weights=True)
      -> (output [B, T, E], weights [B, N, T, S] or None)

    Same semantics as `mha_torch.MultiHeadAttention`: keep-mask (0 = masked) of
    dtype bool, int or float and shape [T, S], [B, T, S] or [B|1, N|1, T, S];
    masked_rows "nan" | "zero" | "uniform". `dtype` is the computation dtype;
    None means the inputs' dtype, so outputs keep the input dtype. Parameters are
    stored in `param_dtype`, kernels (in, out) as in nnx.Linear.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rngs: nnx.Rngs,
        masked_rows: str = "nan",
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
    ):
        self.head_dim = check_config(embed_dim, num_heads, masked_rows)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.masked_rows = masked_rows
        self.dtype = dtype
        self.precision = precision
        init = _torch_linear_init(embed_dim)

        def linear():
            return nnx.Linear(
                embed_dim, embed_dim, dtype=dtype, param_dtype=param_dtype, precision=precision,
                kernel_init=init, bias_init=init, rngs=rngs,
            )

        self.q_proj, self.k_proj, self.v_proj, self.out_proj = linear(), linear(), linear(), linear()

    def _project(self, layer: nnx.Linear, x, dtype):
        kernel = layer.kernel[...].astype(dtype)  # (E_in, E_out)
        bias = layer.bias[...].astype(dtype)
        # Accumulate in >= float32 (XLA's CPU dot would otherwise accumulate float16 in float16).
        y = jnp.einsum("BTE,EF->BTF", x, kernel, precision=self.precision, preferred_element_type=accumulation_dtype(dtype))
        return (y + bias).astype(dtype)

    def __call__(self, query, key, value, mask=None, need_weights: bool = True):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
        B, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, self.embed_dim)
        if not (query.dtype == key.dtype == value.dtype):
            raise TypeError(
                f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}"
            )
        if not jnp.issubdtype(query.dtype, jnp.floating):
            raise TypeError(f"inputs must be floating point, got {query.dtype}")
        dtype = jnp.dtype(self.dtype or query.dtype)
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            # Without x64 jax would silently compute in float32.
            raise TypeError("float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")
        N, H = self.num_heads, self.head_dim
        keep = None if mask is None else _keep_mask(mask, B, N, T, S)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))

        q = self._project(self.q_proj, query, dtype).reshape(B, T, N, H)
        k = self._project(self.k_proj, key, dtype).reshape(B, S, N, H)
        v = self._project(self.v_proj, value, dtype).reshape(B, S, N, H)
        if need_weights:
            context, weights = attention_core(q, k, v, keep, masked_rows=self.masked_rows, precision=self.precision)
        else:
            context = fused_attention_core(q, k, v, keep, masked_rows=self.masked_rows, precision=self.precision)
            weights = None
        output = self._project(self.out_proj, context.reshape(B, T, N * H), dtype)  # (B, T, E)
        return output, weights
