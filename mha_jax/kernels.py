"""Which kernel the JAX fused path (need_weights=False) runs, and with which chunk sizes.

Kernels (the names the benchmark records):

  einsum     `attention_core` without returning the weights: materialises (B, N, T, S)
  chunked    `chunked_attention`: online softmax, flash backward, O(T + S) memory
  dpa-xla    `jax.nn.dot_product_attention(implementation="xla")`: materialises
  dpa-cudnn  `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN flash attention

The choice is a pure function of (platform, device kind, dtype, sizes, mask) so a
benchmark can record which kernel ran (`fused_choice`). Among the kernels that are
allowed for the dtype and fit the memory guard, it takes the one that was fastest in
the nearest measured problem of this device kind (`TABLE`, written by
scripts/measure_blocks.py; nearest in log B·N, log T, log S). Rules that come before
the table, each for a reason that no timing can overrule:

- float64 never runs dpa-* (their softmax is float32: 4e-8 off the float64 oracle);
- float16 never runs dpa-xla (it takes no precision argument, and under a pinned
  "highest" XLA:CPU rejects its float16 backward dots, 'F16_F16_F32');
- a materialising kernel runs only while B·N·T·S <= the caller's memory guard
  (`mha_jax.attention.MATERIALIZE_LIMIT`);
- on a CUDA GPU, float16/bfloat16 with a head dim that is a multiple of 8 and <= 128
  (and even T and S when there is a mask: cuDNN's masked backward needs them) runs
  dpa-cudnn. This branch has not run on a GPU in this project yet (no GPU was lent);
  only its decision logic is tested, with fake device kinds.

A device kind with no table (any GPU or TPU so far) takes "einsum" below the guard and
"chunked" with DEFAULT_BLOCKS above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

KERNELS = ("einsum", "chunked", "dpa-xla", "dpa-cudnn")
DEFAULT_BLOCKS = (512, 1024)


@dataclass(frozen=True)
class Measured:
    """One measured problem (S = T): its fastest kernel (fwd and fwd+bwd together) and the chunked kernel's fastest blocks."""

    BN: int  # batch x heads
    T: int
    S: int
    fastest: str
    blocks: tuple[int, int] | None  # (q_chunk, k_chunk)


@dataclass(frozen=True)
class Choice:
    kernel: str
    q_chunk: int | None = None
    k_chunk: int | None = None
    why: str = ""


# scripts/measure_blocks.py on the project's 2-core AMD EPYC VM (float32, H=64, precision
# "highest"), four runs while other jobs shared the cores (load average 2-11), combined with
# `--combine` (geometric mean over runs and over the fwd and fwd+bwd passes of each candidate's
# time / the fastest's); every time is in docs/results/flash-blocks-cpu.run{1,2,3,4}.json, the
# ratios in docs/results/flash-blocks-cpu.md, the method in docs/drafts/flash.md. The comment
# after each row gives scores (1.00 = fastest in every run and pass that measured it).
TABLE: dict[str, tuple[Measured, ...]] = {
    "cpu": (
        Measured(BN=32, T=256, S=256, fastest="chunked", blocks=(256, 256)),  # 1.07; einsum 1.29, dpa-xla 1.34
        Measured(BN=32, T=512, S=512, fastest="chunked", blocks=(256, 256)),  # 1.00; 128x256 1.05, einsum 1.59
        Measured(BN=32, T=1024, S=1024, fastest="chunked", blocks=(128, 256)),  # 1.17; 256x256 1.27, einsum 2.42
        Measured(BN=32, T=2048, S=2048, fastest="chunked", blocks=(256, 256)),  # 1.03; 256x512 1.13, 512x1024 1.31, 256x2048 1.63
        Measured(BN=8, T=8192, S=8192, fastest="chunked", blocks=(512, 512)),  # 1.00; 256x512 1.19, 512x1024 1.29
    ),
}


def device_kind(device=None) -> str:
    """The device kind the table is keyed by ("cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite", ...)."""
    return (device or jax.devices()[0]).device_kind


def _distance(row: Measured, BN: int, T: int, S: int) -> float:
    return abs(math.log(BN / row.BN)) + abs(math.log(T / row.T)) + abs(math.log(S / row.S))


def _cudnn_allowed(platform: str, dtype, T: int, S: int, H: int, has_mask: bool) -> bool:
    if platform not in ("gpu", "cuda") or jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
        return False
    if H % 8 or H > 128:  # cuDNN flash attention's head-dim limit (256 from Hopper on; 128 is safe)
        return False
    return not has_mask or (T % 2 == 0 and S % 2 == 0)


def choose(*, platform: str, kind: str, dtype, B: int, N: int, T: int, S: int, H: int, has_mask: bool, materialize_limit: int) -> Choice:
    """The kernel and chunk sizes for one fused call; pure (no device is queried)."""
    dtype = jnp.dtype(dtype)
    if B == 0 or T == 0:
        return Choice("chunked", *DEFAULT_BLOCKS, why="B = 0 or T = 0: the chunked kernel returns the empty context")
    if _cudnn_allowed(platform, dtype, T, S, H, has_mask):
        return Choice("dpa-cudnn", why="CUDA GPU, 16-bit, head dim and mask within cuDNN's limits")
    fits = B * N * T * S <= materialize_limit
    allowed = {"chunked"}
    if fits:
        allowed.add("einsum")
        if dtype in (jnp.float32, jnp.bfloat16):
            allowed.add("dpa-xla")
    rows = sorted(TABLE.get(kind, ()), key=lambda r: _distance(r, B * N, T, S))
    with_blocks = [r for r in rows if r.blocks is not None]
    blocks = with_blocks[0].blocks if with_blocks else DEFAULT_BLOCKS
    if not rows:
        kernel = "einsum" if fits else "chunked"
        return Choice(kernel, *(blocks if kernel == "chunked" else (None, None)), why=f"no measured table for device kind {kind!r}")
    kernel = rows[0].fastest if rows[0].fastest in allowed else ("einsum" if fits else "chunked")
    why = f"nearest measured: B·N={rows[0].BN} T={rows[0].T} S={rows[0].S} ({rows[0].fastest} fastest)"
    if kernel != rows[0].fastest:
        why += f"; {rows[0].fastest} not allowed for {dtype.name} at B·N·T·S={B * N * T * S}"
    return Choice(kernel, *(blocks if kernel == "chunked" else (None, None)), why=why)


def fused_choice(B: int, N: int, T: int, S: int, H: int, dtype, *, has_mask: bool, device=None) -> Choice:
    """What `fused_attention_core` runs for these sizes on `device` (default: JAX's first device)."""
    from mha_jax import attention  # late: attention imports this module

    device = device or jax.devices()[0]
    return choose(platform=device.platform, kind=device_kind(device), dtype=dtype, B=B, N=N, T=T, S=S, H=H,
                  has_mask=has_mask, materialize_limit=attention.MATERIALIZE_LIMIT)
