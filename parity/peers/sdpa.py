"""torch's F.scaled_dot_product_attention as a peer: our projections around SDPA's core.

    torch-sdpa-core   the classic layer: N heads, bool mask True = attend
    torch-sdpa-gqa    grouped/multi-query, rotary and bias-free layers: SDPA(enable_gqa=True) on the
                      K key/value heads (query head h reads key/value head h // (N / K))

    factory(state_dict, num_heads, *, dtype, device[, problem]) -> fn
    fn(params, query, key, value, keep, *[, positions=None, key_positions=None], is_causal=False) -> output

keep: bool (B, 1, T, S), True = attend (SDPA's own polarity); a fully masked row gives 0
(the "zero" policy). is_causal=True, keep None: SDPA's own top-left causal mask, as a torch
user writes a causal layer (`takes_is_causal`). The rotary embedding is its own code, written
the way the ecosystem writes it (`x·cos + rotate_half(x)·sin` as in GPT-NeoX/Hugging Face,
`rotate_every_two` as in GPT-J), not `mha_torch.rotate`: a shared RoPE bug could not hide
behind agreement.
No converter: it computes with the canonical parameters themselves. torch is imported on
first use.
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mha_spec import LLAMA_FEATURES
from parity.implementation import Implementation
from parity.peers.common import FRAMEWORK_PEER_CASES, torch_out, torch_project

if TYPE_CHECKING:
    import torch


# What no other file of parity/ calls (tests/test_house.py): SDPA, by any spelling (F., torch.nn.functional.).
OWNS = ("scaled_dot_product_attention",)

# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def sdpa_core(sd, num_heads, *, dtype, device):
    import torch.nn.functional as F

    def fn(params, query, key, value, keep, *, is_causal=False):
        B, T, E = query.shape
        N, H = num_heads, E // num_heads
        q, k, v = (torch_project(x, params, p, N, H) for x, p in ((query, "q_proj"), (key, "k_proj"), (value, "v_proj")))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=is_causal,
                                             scale=1.0 / math.sqrt(H))  # (B, N, T, H)
        return torch_out(ctx, params)

    return fn


def _acc(dtype: torch.dtype) -> torch.dtype:
    """cos/sin and the rotation: float64 stays float64, everything else runs in float32."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_cos_sin(pos, length: int, head_dim: int, theta: float, dtype: torch.dtype, device):
    """cos, sin (B|1, 1, L, H/2) of pos · theta^(-2i/H); pos (L,) | (B, L) integers, None = arange(L)."""
    import torch

    if pos is None:
        pos = torch.arange(length, device=device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    lead = pos.shape[0] if pos.ndim == 2 else 1  # not -1: the length may be 0
    angles = pos.to(torch.float64).reshape(lead, 1, length, 1) * inv_freq
    return torch.cos(angles).to(_acc(dtype)), torch.sin(angles).to(_acc(dtype))


def _rotate_half(x):
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    import torch

    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x, cos, sin, convention: str):
    """x (B, n, L, H) rotated; cos/sin (B|1, 1, L, H/2) widened to H the convention's way."""
    import torch

    if convention == "half":
        cos, sin, turn = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), _rotate_half
    else:
        cos, sin, turn = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), _rotate_every_two
    xa = x.to(cos.dtype)
    return (xa * cos + turn(xa) * sin).to(x.dtype)


def sdpa_gqa(sd, num_heads, *, dtype, device, problem):
    import torch.nn.functional as F

    cfg = problem.config
    N, K, H, rope = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.rope
    if N != num_heads:
        raise ValueError(f"torch-sdpa-gqa: num_heads={num_heads} but the problem's config has {N}")

    def fn(params, query, key, value, keep, *, positions=None, key_positions=None, is_causal=False):
        B, T, _ = query.shape
        S = key.shape[1]
        q = torch_project(query, params, "q_proj", N, H)  # (B, N, T, H)
        k, v = torch_project(key, params, "k_proj", K, H), torch_project(value, params, "v_proj", K, H)  # (B, K, S, H)
        if rope is not None:
            q = apply_rope(q, *rope_cos_sin(positions, T, H, cfg.rope_theta, q.dtype, q.device), rope)
            k = apply_rope(k, *rope_cos_sin(key_positions, S, H, cfg.rope_theta, k.dtype, k.device), rope)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=is_causal, scale=1.0 / math.sqrt(H),
                                             enable_gqa=K != N)  # (B, N, T, H)
        return torch_out(ctx, params)

    return fn


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    Implementation("torch-sdpa-core", "torch", f"{__name__}:sdpa_core", masked_rows="zero", role="peer",
                   runs_on=FRAMEWORK_PEER_CASES, takes_is_causal=True,
                   doc="the same projections around F.scaled_dot_product_attention; bool mask True = attend; "
                   "fully masked rows give 0"),
    # float64/float32: 16-bit adds compiles and transformers calls to the default run and proves no more.
    Implementation("torch-sdpa-gqa", "torch", f"{__name__}:sdpa_gqa", masked_rows="zero", role="peer",
                   bench=True, runs_on=("*/*/float64", "*/*/float32"), variants=LLAMA_FEATURES, takes_is_causal=True,
                   doc="our projections around F.scaled_dot_product_attention(enable_gqa=True) on the K key/value "
                   "heads, RoPE by its own rotate_half/rotate_every_two; bool mask True = attend; empty rows give 0"),
)
