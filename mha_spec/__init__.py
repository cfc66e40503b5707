"""Framework-free specification shared by `mha_torch` and `mha_jax`.

Pure Python on shape tuples: it imports neither torch nor jax, so both
modules can validate inputs the same way without breaking the wall between
frameworks. Everything here runs at trace time on static shapes, so it adds
no data-dependent branching under `jax.jit` or `torch.compile`.

Shape-letter legend, used verbatim in comments and einsum strings across the
project:

    B  batch           T  query length     S  key/value length
    N  number of heads H  head dim          E  embed dim (= N * H)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MASKED_ROWS_POLICIES = ("nan", "zero", "uniform")
"""What a query row that may attend to no key returns.

nan      NaN weights and output on that row (the classic module: softmax of all -inf)
zero     weights 0, so the context is 0 and the output is out_proj's bias (torch SDPA)
uniform  weights 1/S, so the context is the mean of V (flax, jax.nn.dot_product_attention)
"""


def check_config(embed_dim: int, num_heads: int, masked_rows: str) -> int:
    """Validate the constructor arguments; return head_dim."""
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
        if val <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}"
        )
    if masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(
            f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}"
        )
    return embed_dim // num_heads


def check_qkv_shapes(q_shape, k_shape, v_shape, embed_dim: int) -> tuple[int, int, int]:
    """Validate query [B, T, E], key [B, S, E], value [B, S, E]; return (B, T, S)."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        if len(shape) != 3:
            raise ValueError(
                f"{name} must have rank 3 [batch, length, embed_dim], got shape {shape}"
            )
        if shape[-1] != embed_dim:
            raise ValueError(
                f"{name} last dim must be embed_dim={embed_dim}, got shape {shape}"
            )
    if k_shape[1] == 0:
        # T=0 or B=0 is an empty result; S=0 would make every query attend to nothing.
        raise ValueError(
            f"key/value length S=0: a query must have at least one key to attend to; "
            f"got key {k_shape} and value {v_shape}"
        )
    if k_shape[1] != v_shape[1]:
        raise ValueError(
            f"key and value must have the same length, got key {k_shape} and value {v_shape}"
        )
    if not (q_shape[0] == k_shape[0] == v_shape[0]):
        raise ValueError(
            f"batch sizes differ: query {q_shape}, key {k_shape}, value {v_shape}"
        )
    return q_shape[0], q_shape[1], k_shape[1]


def check_mask_values(mask_shape, has_nan: bool, has_negative: bool) -> None:
    """Reject a float keep-mask whose values betray a mistake (each module computes the flags).

    Called only where the values are concrete (torch eager, NumPy or concrete jax arrays);
    under jit/compile tracing nothing is checked.
    """
    if has_nan:
        raise ValueError(
            f"float mask of shape {tuple(mask_shape)} contains NaN; a keep-mask must say "
            f"keep (nonzero) or mask (0) for every entry"
        )
    if has_negative:
        raise ValueError(
            f"float mask of shape {tuple(mask_shape)} has negative values: it looks like an "
            f"additive mask (0 = attend, -inf = masked); this module takes a keep-mask "
            f"(0 = masked): pass (mask == 0)"
        )


def mask_shape_4d(mask_shape, batch: int, heads: int, q_len: int, k_len: int) -> tuple[int, int, int, int]:
    """The 4-D shape a keep-mask is viewed as, before broadcasting to [B, N, T, S].

    [T, S] -> [1, 1, T, S];  [B, T, S] -> [B, 1, T, S] (a head axis is inserted,
    the classic docstring's intent; the classic code broadcasts it wrongly);
    [B|1, N|1, T|1, S|1] as is. Anything else is a ValueError naming the shapes.
    """
    mask_shape = tuple(mask_shape)
    target = (batch, heads, q_len, k_len)
    if len(mask_shape) == 2:
        shape4 = (1, 1) + mask_shape
    elif len(mask_shape) == 3:
        shape4 = (mask_shape[0], 1) + mask_shape[1:]
    elif len(mask_shape) == 4:
        shape4 = mask_shape
    else:
        raise ValueError(
            f"mask must have rank 2 [T, S], 3 [B, T, S] or 4 [B, N, T, S], got shape "
            f"{mask_shape}; attention is [B, N, T, S] = {target}"
        )
    if any(m not in (1, t) for m, t in zip(shape4, target)):
        raise ValueError(
            f"mask of shape {mask_shape} (read as {shape4}) does not broadcast to "
            f"[B, N, T, S] = {target}"
        )
    return shape4


STAGE_NAMES = ("q", "k", "v", "scores", "weights", "context", "output")


@dataclass(frozen=True)
class Stages:
    """A module's intermediates, in the float64 oracle's layouts (`parity.reference.forward`).

    q (B, N, T, H); k, v (B, N, S, H); scores (B, N, T, S), scaled, -inf where masked, in
    float32 for 16-bit inputs; weights (B, N, T, S) after the masked-row policy; context
    (B, T, E), heads concatenated, before out_proj; output (B, T, E). The fused paths never
    build scores or weights: those are None there. Arrays of the module's framework.
    """

    q: Any
    k: Any
    v: Any
    scores: Any
    weights: Any
    context: Any
    output: Any
