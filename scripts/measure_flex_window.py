"""torch on CPU with a sliding window: SDPA with the dense keep-mask against FlexAttention's
block-sparse mask, B=1 T=S=8192 N=8 H=64 float32, forward + backward, medians of a few runs.

Beyond mha-bench: FlexAttention is no implementation of mha-bench (`mha-bench --help` lists them),
and this times the attention kernels alone, without the layer's projections.

    .venv/bin/python scripts/measure_flex_window.py [T] [W]

Prints one line per kernel; a kernel that cannot run here prints why. Run on a quiet machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 3) -> float:
    fn()  # warm-up (and compile)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    W = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    B, N, H = 1, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, T, H, generator=g, requires_grad=True) for _ in range(3))
    i = torch.arange(T)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)  # (T, S): the last W keys

    def run(attn):
        def step():
            q.grad = k.grad = v.grad = None
            attn().sum().backward()
        return step

    dense = timed(run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)))
    causal = timed(run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    print(f"torch {torch.__version__} T={T} W={W}: sdpa dense window mask {dense:.2f} s, sdpa is_causal {causal:.2f} s")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def window(b, h, qi, ki):
            return (ki <= qi) & (ki > qi - W)

        block = create_block_mask(window, B=None, H=None, Q_LEN=T, KV_LEN=T, device="cpu")
        flex = torch.compile(flex_attention)
        t = timed(run(lambda: flex(q, k, v, block_mask=block)))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        err = (flex(q, k, v, block_mask=block) - ref).abs().max().item()
        print(f"flex_attention (torch.compile, block mask) {t:.2f} s, {dense / t:.2f}x the dense sdpa; max |diff| {err:.1e}")
    except Exception as e:  # what FlexAttention does on this CPU is the measurement
        print(f"flex_attention: cannot run here: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
