"""The chunked JAX kernel alone (mha_jax.chunked.chunked_attention, no projections) with a causal
sliding window against no mask, B=1 T=S=8192 N=8 H=64 float32, forward + backward under jit,
medians of a few runs, at several block sizes.

Beyond mha-bench: `mha-bench tune` times the kernel alone but unmasked only, and mha-bench's
`--mask window:W` times the whole layer with the kernel table's blocks; this times the kernel
alone with the window, as structure and as a dense mask, at the blocks given, and `--probe`
splits the window's time into its parts.

    .venv/bin/python scripts/measure_window_kernel.py [T] [W] [q_chunk x k_chunk ...]
    .venv/bin/python scripts/measure_window_kernel.py --probe [T] [W]   # where the window's time goes

--probe, at 512x512 blocks, times forward and fwd+bwd with no mask, an all-true dense mask, the
window, and a mask that keeps whole blocks (the window's non-empty blocks, every one FULL): the
first two differ by the dense mask's own passes, the window and its whole blocks by the partial
blocks' selects; a mask that keeps nothing runs no block, so its time is the mask's fixed cost.

Each block size times the window twice: as a dense (T, S) keep-mask and as structure
(is_causal=True, window=(W - 1, 0): no mask is built, the kernel visits only the band's blocks).

The module's figure (docs/results/bench-masks-8192.md) includes the four projections, which a
window does not shrink; this is the kernel's own speed-up. Run on a quiet machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.chunked import block_census, chunked_attention


def timed(fn, reps: int = 3) -> float:
    jax.block_until_ready(fn())  # warm-up (and compile)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def fwd_bwd(cq: int, ck: int, **structure):
    """The jitted gradients of sum(context) w.r.t. q, k and v: forward and backward in one program;
    structure: chunked_attention's is_causal / window (the mask given as a band, no keep-mask)."""
    def loss(q, k, v, keep):
        return chunked_attention(q, k, v, keep, q_chunk=cq, k_chunk=ck, **structure).sum()

    return jax.jit(lambda q, k, v, keep: jax.grad(loss, argnums=(0, 1, 2))(q, k, v, keep))


def probe(q, k, v, window, W: int, c: int = 512) -> None:
    T = q.shape[1]
    near = np.arange(T)[None, :] // c - np.arange(T)[:, None] // c  # key block - query block
    whole = jnp.asarray((near <= 0) & (near >= -W // c))  # every block the window touches, kept whole
    fwd = jax.jit(lambda q, k, v, keep: chunked_attention(q, k, v, keep, q_chunk=c, k_chunk=c))
    both = fwd_bwd(c, c)
    for name, keep in (("no mask", None), ("all-true mask", jnp.ones((T, T), bool)), ("window", window),
                       ("the window's blocks, all FULL", whole), ("nothing kept (no block runs)", jnp.zeros((T, T), bool))):
        census = "" if keep is None else f"; blocks {block_census(np.asarray(keep), 1, q.shape[2], T, T, c, c)}"
        print(f"{name}: fwd {timed(lambda: fwd(q, k, v, keep)):.2f} s, fwd+bwd {timed(lambda: both(q, k, v, keep)):.2f} s{census}", flush=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--probe"]
    T = int(args[0]) if len(args) > 0 else 8192
    W = int(args[1]) if len(args) > 1 else 1024
    blocks = [tuple(int(n) for n in b.split("x")) for b in args[2:]] or [(512, 512)]
    B, N, H = 1, 8, 64
    q, k, v = (jnp.asarray(np.random.default_rng(s).standard_normal((B, T, N, H)), jnp.float32) for s in range(3))
    i = np.arange(T)
    keep = jnp.asarray((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W))  # (T, S): the last W keys
    print(f"{jax.devices()[0].device_kind}; B={B} T=S={T} N={N} H={H} float32, window {W}")
    if "--probe" in sys.argv:
        return probe(q, k, v, keep, W)
    structure = dict(is_causal=True, window=(W - 1, 0))  # the same window as a band
    for cq, ck in blocks:
        f, g = fwd_bwd(cq, ck), fwd_bwd(cq, ck, **structure)
        dense = timed(lambda: f(q, k, v, None))
        window = timed(lambda: f(q, k, v, keep))
        band = timed(lambda: g(q, k, v, None))
        census = block_census(np.asarray(keep), B, N, T, T, cq, ck)
        print(f"blocks {cq}x{ck}: unmasked {dense:.2f} s; window as a dense mask {window:.2f} s ({dense / window:.2f}x), "
              f"as structure {band:.2f} s ({dense / band:.2f}x); blocks {census}")


if __name__ == "__main__":
    main()
