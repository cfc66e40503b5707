"""The oracle: the classic multi-head attention in NumPy, independent of both frameworks.

`forward` in float64 is the reference every implementation is judged against.
`forward(..., dtype=low)` runs the *same maths in a low dtype*: the inputs and
weights are rounded to that dtype, each stage is computed exactly (float64)
and its result rounded to the dtype the modules store it in (scores and
softmax in float32 for 16-bit dtypes, as the modules do). Its error against
float64 is the yardstick of the three-way judge for 16-bit dtypes.
`backward` is a hand-derived float64 vector-Jacobian product.

Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mha_spec import check_config, check_qkv_shapes, mask_shape_4d

STAGES = ("q", "k", "v", "scores", "weights", "context", "output")
"""Intermediates in the order the data flows; the harness names the first that diverges."""


@dataclass(frozen=True)
class Intermediates:
    q: np.ndarray  # (B, N, T, H)
    k: np.ndarray  # (B, N, S, H)
    v: np.ndarray  # (B, N, S, H)
    scores: np.ndarray  # (B, N, T, S), scaled, -inf where masked
    weights: np.ndarray  # (B, N, T, S), after the masked-row policy
    context: np.ndarray  # (B, T, E), heads concatenated
    output: np.ndarray  # (B, T, E)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values to dtype and back: 'stored in dtype', computed in float64."""
    return np.asarray(x, dtype=dtype).astype(np.float64)


def _accumulation_dtype(dtype) -> np.dtype:
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def keep_mask(mask, B: int, N: int, T: int, S: int):
    """Keep-mask (0 = masked) of any numeric dtype -> bool (B|1, N|1, T|1, S|1), or None."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    return (mask != 0).reshape(mask_shape_4d(mask.shape, B, N, T, S))


def _linear(x, sd, name, dtype):
    return _round(x @ _round(sd[f"{name}.weight"], dtype).T + _round(sd[f"{name}.bias"], dtype), dtype)


def forward(sd, query, key, value, mask=None, *, num_heads: int, masked_rows: str = "nan", dtype=np.float64) -> Intermediates:
    """The classic module's maths, stage by stage; returns every intermediate as float64 arrays."""
    E = sd["q_proj.weight"].shape[0]
    H = check_config(E, num_heads, masked_rows)
    B, T, S = check_qkv_shapes(np.shape(query), np.shape(key), np.shape(value), E)
    N = num_heads
    acc = _accumulation_dtype(dtype)
    xq, xk, xv = (_round(np.asarray(x, np.float64), dtype) for x in (query, key, value))

    def heads(x):  # (B, L, E) -> (B, N, L, H)
        return x.reshape(x.shape[0], x.shape[1], N, H).transpose(0, 2, 1, 3)

    q = heads(_linear(xq, sd, "q_proj", dtype))
    k = heads(_linear(xk, sd, "k_proj", dtype))
    v = heads(_linear(xv, sd, "v_proj", dtype))
    scores = _round(np.einsum("BNTH,BNSH->BNTS", q, k) / np.sqrt(H), acc)
    keep = keep_mask(mask, B, N, T, S)
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
        row_any = keep.any(axis=-1, keepdims=True)
        safe = np.where(row_any, scores, 0.0)
    else:
        row_any, safe = np.ones((1, 1, 1, 1), bool), scores
    with np.errstate(invalid="ignore"):
        shifted = np.exp(safe - safe.max(axis=-1, keepdims=True))
        weights = shifted / shifted.sum(axis=-1, keepdims=True)
    fill = {"nan": np.nan, "zero": 0.0, "uniform": 1.0 / S}[masked_rows]
    weights = _round(_round(np.where(row_any, weights, fill), acc), dtype)
    context = _round(np.einsum("BNTS,BNSH->BNTH", weights, v), dtype)
    context = context.transpose(0, 2, 1, 3).reshape(B, T, E)
    output = _linear(context, sd, "out_proj", dtype)
    return Intermediates(q, k, v, scores, weights, context, output)


def backward(sd, query, key, value, mask, cotangent, *, num_heads: int, masked_rows: str = "nan", dtype=np.float64) -> dict[str, np.ndarray]:
    """Gradients of sum(output * cotangent) w.r.t. query, key, value and every weight.

    Keys: "query", "key", "value" and the canonical state-dict names. A fully masked
    row's weights are a constant of the policy, so no gradient flows through its
    scores; under "nan" its NaN reaches V's gradients, as in the modules.
    With a low `dtype` it is the same maths with each stored result rounded as the
    modules store it (activations and gradients in the dtype, the softmax backward in
    float32 as its forward): the yardstick of the three-way judge for gradients.
    """
    acc = _accumulation_dtype(dtype)

    def r(x, dt=dtype):
        return _round(x, dt)

    f = forward(sd, query, key, value, mask, num_heads=num_heads, masked_rows=masked_rows, dtype=dtype)
    W = {k: r(as_float64(v)) for k, v in sd.items()}
    xq, xk, xv = (r(as_float64(x)) for x in (query, key, value))
    g = r(as_float64(cotangent))  # (B, T, E)
    B, T, E = g.shape
    N = num_heads
    H = E // N
    S = xk.shape[1]

    grads = {
        "out_proj.weight": r(np.einsum("BTF,BTE->FE", g, f.context)),
        "out_proj.bias": r(g.sum(axis=(0, 1))),
    }
    d_context = r(g @ W["out_proj.weight"]).reshape(B, T, N, H).transpose(0, 2, 1, 3)  # (B, N, T, H)
    d_weights = r(np.einsum("BNTH,BNSH->BNTS", d_context, f.v))
    d_v = r(np.einsum("BNTS,BNTH->BNSH", f.weights, d_context))
    keep = keep_mask(mask, B, N, T, S)
    row_any = np.ones((1, 1, 1, 1), bool) if keep is None else keep.any(axis=-1, keepdims=True)
    p = np.where(row_any, f.weights, 0.0)  # the softmax's own output; constant rows carry no gradient
    d_scores = r(p * (d_weights - (d_weights * p).sum(axis=-1, keepdims=True)), acc)
    d_scores = r(np.where(row_any, d_scores, 0.0) / np.sqrt(H), acc)
    d_q = r(np.einsum("BNTS,BNSH->BNTH", d_scores, f.k))
    d_k = r(np.einsum("BNTS,BNTH->BNSH", d_scores, f.q))

    for name, d_heads, x, grad_key in (("q_proj", d_q, xq, "query"), ("k_proj", d_k, xk, "key"), ("v_proj", d_v, xv, "value")):
        d_proj = d_heads.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], E)  # (B, L, E)
        grads[f"{name}.weight"] = r(np.einsum("BLF,BLE->FE", d_proj, x))
        grads[f"{name}.bias"] = r(d_proj.sum(axis=(0, 1)))
        grads[grad_key] = r(d_proj @ W[f"{name}.weight"])
    return grads


def as_float64(x) -> np.ndarray:
    """Any float array (bfloat16 included) as float64, for comparisons."""
    x = np.asarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)
