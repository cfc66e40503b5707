"""Multi-head attention in PyTorch: the classic module, with explicit semantics.

Shapes (legend in `mha_spec`): B batch, T query length, S key length,
N heads, H head dim, E = N * H.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mha_spec import check_config, check_qkv_shapes, mask_shape_4d

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _keep_mask(mask: torch.Tensor, B: int, N: int, T: int, S: int) -> torch.Tensor:
    """Any bool/int/float keep-mask (0 = masked) -> bool [B|1, N|1, T|1, S|1]."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, int or float, got {mask.dtype}")
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.reshape(shape4)


def _apply_masked_row_policy(x, row_any, masked_rows: str, uniform_value):
    """Overwrite the rows of x whose query may attend to nothing (row_any False).

    uniform_value is what such a row holds under "uniform" (1/S for weights, mean V for a
    context). Under "nan" the fill is uniform_value times a factor that is NaN on exactly
    those rows, so on the fused path the gradient meets NaN where the materialised path's
    NaN weights meet V (the same (batch, head) slices of V), and nowhere else.
    """
    if masked_rows == "zero":
        fill = torch.zeros((), dtype=x.dtype, device=x.device)
    elif masked_rows == "nan":
        fill = uniform_value * torch.where(row_any, 1.0, float("nan")).to(x.dtype)
    else:
        fill = uniform_value
    return torch.where(row_any, x, fill)


def attention_core(q, k, v, keep, *, masked_rows: str = "nan"):
    """softmax(Q Kᵀ / √H) V with materialised weights.

    q (B, N, T, H), k and v (B, N, S, H), keep bool broadcastable to (B, N, T, S) or None.
    Returns context (B, N, T, H) in q's dtype and weights (B, N, T, S) in q's dtype.
    Scores and softmax run in float32 for 16-bit inputs (float64 stays float64).
    """
    dtype = q.dtype
    B, N, T, H = q.shape
    S = k.shape[-2]
    if dtype in _LOW_PRECISION:
        # Products of 16-bit numbers are exact in float32; rounding the scores to
        # 16 bits before the softmax would cost ~1e-2 relative error in the weights.
        q, k = q.float(), k.float()
    # baddbmm applies 1/√H in the GEMM epilogue: no extra pass over (B, N, T, S).
    scores = torch.baddbmm(
        torch.empty(B * N, T, S, dtype=q.dtype, device=q.device),
        q.reshape(B * N, T, H),
        k.reshape(B * N, S, H).transpose(1, 2),
        beta=0.0,
        alpha=1.0 / math.sqrt(H),
    ).view(B, N, T, S)
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
        row_any = keep.any(dim=-1, keepdim=True)  # (B|1, N|1, T|1, 1)
        # A fully masked row gets all-zero scores: its softmax is finite (uniform),
        # so no NaN reaches the backward pass; the policy then sets its value.
        scores.masked_fill_(~row_any, 0.0)
    weights = torch.softmax(scores, dim=-1)
    if keep is not None:
        weights = _apply_masked_row_policy(
            weights, row_any, masked_rows, torch.full((), 1.0 / S, dtype=weights.dtype, device=weights.device)
        )
    weights = weights.to(dtype)
    context = torch.matmul(weights, v)  # (B, N, T, H)
    return context, weights


def fused_attention_core(q, k, v, keep, *, masked_rows: str = "nan"):
    """The same maths through F.scaled_dot_product_attention; never returns weights.

    SDPA gives zeros on fully masked rows; the policy is applied afterwards on the
    (B, N, T, H) context, so nothing of size (B, N, T, S) is built here.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)  # (B, N, T, H)
    if keep is not None:
        row_any = keep.any(dim=-1, keepdim=True)  # (B|1, N|1, T|1, 1)
        mean_v = None  # only "nan" and "uniform" rows need it
        if masked_rows != "zero":
            acc = torch.float32 if v.dtype in _LOW_PRECISION else v.dtype
            mean_v = v.to(acc).mean(dim=-2, keepdim=True).to(v.dtype)  # (B, N, 1, H)
        context = _apply_masked_row_policy(context, row_any, masked_rows, mean_v)
    return context


class MultiHeadAttention(nn.Module):
    """Classic multi-head attention: separate q/k/v/out projections with bias.

    forward(query [B, T, E], key [B, S, E], value [B, S, E], mask=None, need_weights=True)
      -> (output [B, T, E], weights [B, N, T, S] or None)

    mask is a keep-mask (0/False = masked out) of dtype bool, int or float, of shape
    [T, S], [B, T, S], [B|1, N|1, T, S]. masked_rows picks what a query that may
    attend to nothing returns: "nan" (classic), "zero" (SDPA) or "uniform" (flax).
    need_weights=False takes the fused SDPA path and returns (output, None).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, masked_rows: str = "nan", dtype=None, device=None):
        super().__init__()
        self.head_dim = check_config(embed_dim, num_heads, masked_rows)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.masked_rows = masked_rows
        factory = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(embed_dim, embed_dim, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **factory)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, masked_rows={self.masked_rows!r}"

    def _split_heads(self, x):
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, N, L, H)

    def forward(self, query, key, value, mask=None, need_weights: bool = True):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        B, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, self.embed_dim)
        param_dtype = self.q_proj.weight.dtype
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dtype != param_dtype:
                # No silent promotion: the caller converts the module or the inputs.
                raise TypeError(
                    f"{name} has dtype {x.dtype} but the module's parameters are {param_dtype}"
                )
        keep = None if mask is None else _keep_mask(mask, B, self.num_heads, T, S)

        q = self._split_heads(self.q_proj(query))  # (B, N, T, H)
        k = self._split_heads(self.k_proj(key))  # (B, N, S, H)
        v = self._split_heads(self.v_proj(value))  # (B, N, S, H)
        if need_weights:
            context, weights = attention_core(q, k, v, keep, masked_rows=self.masked_rows)
        else:
            context, weights = fused_attention_core(q, k, v, keep, masked_rows=self.masked_rows), None
        context = context.transpose(1, 2).reshape(B, T, self.embed_dim)  # (B, T, E)
        return self.out_proj(context), weights
