"""Multi-head attention in Flax NNX, with the semantics of `mha_torch`.

Internal layout BTNH (legend in `mha_spec`); einsum strings use the legend verbatim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.chunked import accumulation_dtype, chunked_attention, fill_masked_rows, fold_scale
from mha_jax import kernels
from mha_spec import Stages, check_config, check_mask_values, check_qkv_shapes, mask_shape_4d

# Stages (framework-free, in mha_spec) as a pytree, so return_intermediates works under jit.
jax.tree_util.register_dataclass(Stages, data_fields=[f.name for f in dataclasses.fields(Stages)], meta_fields=[])


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
    if kind == "f" or mask.dtype == jnp.bfloat16:
        _check_concrete_mask_values(mask)
    mask = jnp.asarray(mask)
    keep = mask if mask.dtype == jnp.bool_ else mask != 0
    return keep.reshape(shape4)


def _check_concrete_mask_values(mask):
    """NaN or negative values in a float keep-mask are errors, where the values are known.

    Under jit (a tracer) nothing is checked: a value check there would need a host round trip
    (or checkify); the README says so.
    """
    if isinstance(mask, jax.core.Tracer):
        return
    mask = np.asarray(mask).astype(np.float32)  # bfloat16/float16 too; NaN and sign survive
    check_mask_values(mask.shape, bool(np.isnan(mask).any()), bool((mask < 0).any()))


def _check_dtype(name: str, dtype) -> None:
    """A computation or parameter dtype must be floating, and float64 needs x64 (no silent float32)."""
    if dtype is None:
        return
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dt}")
    if dt == jnp.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{name}=float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")


def _row_attends(keep):
    return keep.any(axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1)


def attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None, return_scores=False):
    """softmax(Q Kᵀ / √H) V with materialised weights.

    q (B, T, N, H), k and v (B, S, N, H), keep bool broadcastable to (B, N, T, S) or None.
    Returns context (B, T, N, H) and weights (B, N, T, S), both in q's dtype, and with
    return_scores also the scaled scores (B, N, T, S), -inf where masked.
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
    returned_scores = scores  # before the row fix below
    if keep is not None:
        row_any = _row_attends(keep)
        # A fully masked row gets all-zero scores: its softmax is finite (uniform),
        # so no NaN reaches the backward pass; the policy then sets its value.
        scores = jnp.where(row_any, scores, 0.0)
    weights = jax.nn.softmax(scores, axis=-1)
    if keep is not None:
        weights = fill_masked_rows(weights, row_any, masked_rows, 1.0 / S)
    weights = weights.astype(dtype)
    context = jnp.einsum("BNTS,BSNH->BTNH", weights, v, precision=precision, preferred_element_type=acc).astype(dtype)
    if return_scores:
        return context, weights, returned_scores
    return context, weights


def fused_attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None):
    """The same context as `attention_core`, without returning (or, when large, building) weights.

    The kernel and its chunk sizes come from `mha_jax.kernels.fused_choice` (measured per
    processor; it also says why, for a benchmark row): our einsum core,
    the chunked kernel (flash backward, O(T + S) memory) or jax.nn.dot_product_attention
    (XLA, or cuDNN on a CUDA GPU for 16-bit). Whichever runs, fully masked rows follow
    `masked_rows` and which rows those are comes from the keep-mask alone, so NaN inputs
    give NaN outputs. S = 0 is a ValueError; T = 0 gives an empty context.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    if S == 0:
        raise ValueError(f"fused_attention_core needs at least one key: got key shape {k.shape} (S=0)")
    choice = kernels.fused_choice(B, N, T, S, H, q.dtype, has_mask=keep is not None)
    if choice.kernel == "einsum":
        return attention_core(q, k, v, keep, masked_rows=masked_rows, precision=precision)[0]
    if choice.kernel == "chunked":
        return chunked_attention(q, k, v, keep, masked_rows=masked_rows, q_chunk=choice.q_chunk, k_chunk=choice.k_chunk, precision=precision)
    # jax.nn.dot_product_attention takes no precision argument (the global default applies).
    implementation = "cudnn" if choice.kernel == "dpa-cudnn" else "xla"
    context = jax.nn.dot_product_attention(q, k, v, mask=keep, scale=1.0 / math.sqrt(H), implementation=implementation)  # (B, T, N, H)
    if keep is not None:
        # jax gives fully masked rows uniform weights; apply our policy on (B, T, N, H).
        row_any = jnp.transpose(_row_attends(keep), (0, 2, 1, 3))  # (B|1, T|1, N|1, 1)
        mean_v = jnp.mean(v.astype(accumulation_dtype(v.dtype)), axis=1, keepdims=True)  # (B, 1, N, H)
        context = fill_masked_rows(context, row_any, masked_rows, mean_v)
    return context


class MultiHeadAttention(nnx.Module):
    """Classic multi-head attention in Flax NNX: separate q/k/v/out projections with bias.

    __call__(query [B, T, E], key [B, S, E], value [B, S, E], mask=None, need_weights=True)
      -> (output [B, T, E], weights [B, N, T, S] or None)
    With return_intermediates=True: (output, weights, mha_spec.Stages).

    Same semantics as `mha_torch.MultiHeadAttention`: keep-mask (0 = masked) of
    dtype bool, int or float and shape [T, S], [B, T, S] or [B|1, N|1, T, S];
    masked_rows "nan" | "zero" | "uniform". Parameters are stored in `param_dtype`,
    kernels (in, out) as in nnx.Linear. `dtype` is the computation dtype; None means the
    parameters' dtype. Inputs must have the computation dtype (a mismatch is a TypeError,
    as in torch), and outputs have it. T=0 or B=0 give empty outputs, S=0 is a ValueError.
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
        _check_dtype("dtype", dtype)
        _check_dtype("param_dtype", param_dtype)
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

    def _heads(self, layer: nnx.Linear, x, dtype):
        # The head count comes from the projected width, not num_heads: under a sharded
        # (tensor-parallel) layout a device may hold only its share of the heads.
        y = self._project(layer, x, dtype)  # (B, L, N·H)
        B, L, width = y.shape
        return y.reshape(B, L, width // self.head_dim, self.head_dim)  # (B, L, N, H)

    def _check_inputs(self, query, key, value):
        """(B, T, S, computation dtype); inputs must have that dtype: no silent cast."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
        shapes = check_qkv_shapes(query.shape, key.shape, value.shape, self.embed_dim)
        param_dtype = jnp.dtype(self.q_proj.kernel[...].dtype)
        dtype = jnp.dtype(self.dtype or param_dtype)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if jnp.dtype(x.dtype) != dtype:
                what = f"the module computes in dtype={dtype}" if self.dtype else f"the module's parameters are {dtype}"
                raise TypeError(f"{name} has dtype {x.dtype} but {what}")
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            # Without x64 jax would silently compute in float32.
            raise TypeError("float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")
        return shapes + (dtype,)

    def __call__(self, query, key, value, mask=None, need_weights: bool = True, *, return_intermediates: bool = False):
        B, T, S, dtype = self._check_inputs(query, key, value)
        keep = None if mask is None else _keep_mask(mask, B, self.num_heads, T, S)
        query, key, value = (jnp.asarray(x) for x in (query, key, value))

        q = self._heads(self.q_proj, query, dtype)  # (B, T, N, H)
        k = self._heads(self.k_proj, key, dtype)  # (B, S, N, H)
        v = self._heads(self.v_proj, value, dtype)  # (B, S, N, H)
        kw = {"masked_rows": self.masked_rows, "precision": self.precision}
        scores = weights = None
        if need_weights and return_intermediates:
            context, weights, scores = attention_core(q, k, v, keep, return_scores=True, **kw)
        elif need_weights:
            context, weights = attention_core(q, k, v, keep, **kw)
        elif T == 0:  # no queries: nothing for any fused kernel to do
            context = jnp.zeros(q.shape, dtype)
        else:
            context = fused_attention_core(q, k, v, keep, **kw)
        context = context.reshape(B, T, q.shape[2] * self.head_dim)  # (B, T, E), or this device's share
        output = self._project(self.out_proj, context, dtype)  # (B, T, E)
        if return_intermediates:
            heads_first = (jnp.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))  # (B, N, L, H), the oracle's layout
            return output, weights, Stages(*heads_first, scores, weights, context, output)
        return output, weights
