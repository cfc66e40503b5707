"""Causal against unmasked attention on both fused paths, round-robin in one process.

Beyond mha-bench: it pairs one implementation's causal and unmasked times in each round and
reports their ratio with its per-round range. mha-bench pairs implementations within one case;
`mha-bench --mask none,causal --impls ours-torch:eager:fused,ours-jax:jit:fused` times the two
masks as separate cases, so it gives both medians but no paired causal/unmasked ratio.

What a causal keep-mask buys: torch's fused path runs SDPA with is_causal=True when it
recognises the mask; the JAX chunked kernel skips the blocks above the diagonal (forward and
backward). Both modules share one set of weights (convert.torch_to_jax), float32, precision
highest. Each round times every (framework, mask, pass) once, in an order reversed every
round; the speed-up is the median unmasked time over the median causal time, and its range
is the lowest and highest per-round ratio (the two times of a ratio come from one round).

    .venv/bin/python scripts/measure_causal.py --batch 2 --seq 4096 --rounds 5 \
        --json docs/results/causal-speedup.json --markdown docs/results/causal-speedup.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's idle threads must not spin beside XLA's

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

import mha_torch  # noqa: E402
from mha_jax import kernels  # noqa: E402
from parity import convert  # noqa: E402
from parity.env import environment, pin_jax, pin_torch  # noqa: E402


def torch_steps(tm, x, keep):
    def fwd():
        with torch.no_grad():
            tm(x, x, x, keep, need_weights=False)[0].sum().item()

    def fwd_bwd():
        xi = x.detach().requires_grad_(True)
        tm.zero_grad(set_to_none=True)
        tm(xi, xi, xi, keep, need_weights=False)[0].sum().backward()
        xi.grad.sum().item()

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def jax_steps(jm, x, keep):
    graphdef, state = nnx.split(jm)

    def loss(state, x, keep):
        out, _ = nnx.merge(graphdef, state)(x, x, x, keep, need_weights=False)
        return out.sum()

    f = jax.jit(loss)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return {"fwd": lambda: f(state, x, keep).block_until_ready(),
            "fwd+bwd": lambda: jax.block_until_ready(g(state, x, keep))}


def build_steps(B: int, T: int, E: int, N: int) -> dict:
    """(framework, mask, pass) -> a call that runs it once, both modules on one set of weights."""
    torch.manual_seed(0)
    pin_torch(True)  # full-precision float32 matmuls in both, as mha-bench's default
    pin_jax(True)
    tm = mha_torch.MultiHeadAttention(E, N, masked_rows="zero")
    jm = convert.torch_to_jax(tm)
    x = np.random.default_rng(0).standard_normal((B, T, E), dtype=np.float32)
    tril = np.tril(np.ones((T, T), bool))
    steps = {}
    for mask, keep in (("none", None), ("causal", tril)):
        for p, fn in torch_steps(tm, torch.from_numpy(x), None if keep is None else torch.from_numpy(keep)).items():
            steps[("torch", mask, p)] = fn
        for p, fn in jax_steps(jm, jnp.asarray(x), None if keep is None else jnp.asarray(keep)).items():
            steps[("jax", mask, p)] = fn
    return steps


def time_round_robin(steps: dict, rounds: int) -> dict:
    """Seconds of each call per round, every call once a round, the order reversed every other round."""
    for fn in steps.values():  # compile and warm up
        fn()
    times = {k: [] for k in steps}
    keys = list(steps)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            t0 = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    return times


def speedups(times: dict) -> list[dict]:
    rows = []
    for fw in ("torch", "jax"):
        for p in ("fwd", "fwd+bwd"):
            full, causal = times[(fw, "none", p)], times[(fw, "causal", p)]
            per_round = [a / b for a, b in zip(full, causal)]
            rows.append({"framework": fw, "pass": p, "none_ms": 1e3 * statistics.median(full),
                         "causal_ms": 1e3 * statistics.median(causal),
                         "speedup": statistics.median(full) / statistics.median(causal),
                         "speedup_min": min(per_round), "speedup_max": max(per_round),
                         "none_s": full, "causal_s": causal})
    return rows


def markdown(head: str, rows: list[dict]) -> str:
    lines = [f"# Causal vs unmasked, {head}", "", "| framework | pass | unmasked ms | causal ms | speed-up | per-round range |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {r['pass']} | {r['none_ms']:.0f} | {r['causal_ms']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['speedup_min']:.2f}-{r['speedup_max']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    B, T, E, N = args.batch, args.seq, args.embed, args.heads

    rows = speedups(time_round_robin(build_steps(B, T, E, N), args.rounds))
    kernel = kernels.fused_choice(B, N, T, T, E // N, jnp.float32, has_mask=True)
    head = (f"B={B} T=S={T} E={E} N={N} float32, fused paths (torch: SDPA is_causal; "
            f"jax: {kernel.kernel} {kernel.q_chunk}x{kernel.k_chunk}, {kernel.why}), {args.rounds} rounds")
    text = markdown(head, rows)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": head, "rows": rows, "environment": environment()}, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
