"""torch.nn.MultiheadAttention as a peer: its weight converters, its factories, its declarations.

    from_torch_mha / to_torch_mha   packed in_proj_weight [q; k; v] (3E, E), in_proj_bias (3E,) <-> canonical
    torch-mha                       need_weights=True, average_attn_weights=False: its weights too
    torch-mha-fused                 need_weights=False (the SDPA fast path), benchmark only

Its bool attn_mask is True = masked out and is ADDED to the scores as -inf, so a fully
masked row is NaN (the "nan" policy) and its NaN reaches the query and key gradients
("flow"); the fast path gives 0 there. torch is imported on first use.
Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from parity.canonical import (
    check_shape,
    check_state_dict,
    numpy_dtype_of_torch,
    numpy_to_tensor,
    refuse_dtype_change,
    tensor_to_numpy,
    torch_dtype_of,
)
from parity.implementation import Implementation
from parity.peers.common import FRAMEWORK_PEER_CASES, classic_only


# What no other file of parity/ uses (tests/test_house.py): torch's module itself.
OWNS = ("torch.nn.MultiheadAttention",)

# ---------------------------------------------------------------- converters


def is_torch_mha(obj) -> bool:
    """Whether obj is a torch.nn.MultiheadAttention (False without importing torch when torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.MultiheadAttention)


def from_torch_mha(m) -> dict[str, np.ndarray]:
    """torch.nn.MultiheadAttention (packed in_proj_weight, bias) -> canonical.

    batch_first does not change the weights, so either value is accepted.
    """
    import torch

    if not isinstance(m, torch.nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
    if not m._qkv_same_embed_dim or m.in_proj_weight is None:
        raise ValueError("torch.nn.MultiheadAttention must use a packed in_proj_weight (kdim == vdim == embed_dim)")
    if m.in_proj_bias is None or m.out_proj.bias is None:
        raise ValueError("torch.nn.MultiheadAttention must have bias=True")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn have no counterpart in the classic module")
    E = m.embed_dim
    w_in, b_in = tensor_to_numpy(m.in_proj_weight), tensor_to_numpy(m.in_proj_bias)
    check_shape(w_in, (3 * E, E), "in_proj_weight")
    check_shape(b_in, (3 * E,), "in_proj_bias")
    sd = {}
    for i, p in enumerate(("q_proj", "k_proj", "v_proj")):  # in_proj rows are [q; k; v]
        sd[f"{p}.weight"] = w_in[i * E : (i + 1) * E].copy()
        sd[f"{p}.bias"] = b_in[i * E : (i + 1) * E].copy()
    sd["out_proj.weight"] = tensor_to_numpy(m.out_proj.weight)
    sd["out_proj.bias"] = tensor_to_numpy(m.out_proj.bias)
    check_state_dict(sd)
    return sd


def to_torch_mha(sd, num_heads: int, **module_kwargs):
    """Canonical state dict -> torch.nn.MultiheadAttention (batch_first=True unless asked) in the weights' dtype."""
    import torch

    classic_only(sd, "torch.nn.MultiheadAttention")
    E, dtype = check_state_dict(sd)
    refuse_dtype_change(module_kwargs, "dtype", dtype, numpy_dtype_of_torch)
    module_kwargs.setdefault("batch_first", True)  # our layout is [B, L, E]; the weights do not depend on it
    m = torch.nn.MultiheadAttention(E, num_heads, dtype=torch_dtype_of(dtype), **module_kwargs)
    device = m.in_proj_weight.device
    state = {
        "in_proj_weight": np.concatenate([sd[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")], axis=0),
        "in_proj_bias": np.concatenate([sd[f"{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")], axis=0),
        "out_proj.weight": sd["out_proj.weight"],
        "out_proj.bias": sd["out_proj.bias"],
    }
    m.load_state_dict({k: numpy_to_tensor(v, device) for k, v in state.items()}, strict=True)
    return m


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def _torch_mha(sd, num_heads, *, dtype, device, need_weights):
    import torch
    from torch.func import functional_call

    m = to_torch_mha(sd, num_heads).to(device).eval()

    def fn(params, query, key, value, drop):
        B, T, S, N = query.shape[0], query.shape[1], key.shape[1], num_heads
        # Packed in_proj = [q; k; v] rows; its bool mask is True = masked out, 3-D as (B*N, T, S).
        packed = {
            "in_proj_weight": torch.cat([params[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]),
            "in_proj_bias": torch.cat([params[f"{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")]),
            "out_proj.weight": params["out_proj.weight"], "out_proj.bias": params["out_proj.bias"],
        }
        attn_mask = None if drop is None else drop.expand(B, N, T, S).reshape(B * N, T, S)
        kw = {"attn_mask": attn_mask, "need_weights": need_weights, "average_attn_weights": False}
        return functional_call(m, packed, (query, key, value), kw)

    return fn


torch_mha_weights = functools.partial(_torch_mha, need_weights=True)
torch_mha_fused = functools.partial(_torch_mha, need_weights=False)


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    Implementation("torch-mha", "torch", f"{__name__}:torch_mha_weights", returns_weights=True, masked_rows="nan",
                   mask="drop", role="peer", runs_on=FRAMEWORK_PEER_CASES, masked_row_grads="flow",
                   doc="torch.nn.MultiheadAttention(batch_first=True), average_attn_weights=False; "
                   "bool attn_mask True = masked out (added as -inf); softmax of all -inf gives NaN rows, "
                   "and their NaN reaches the query and key gradients"),
    Implementation("torch-mha-fused", "torch", f"{__name__}:torch_mha_fused", masked_rows="zero", mask="drop", role="peer",
                   family="torch-mha", harness=False, doc="torch.nn.MultiheadAttention, need_weights=False (SDPA fast path)"),
)
