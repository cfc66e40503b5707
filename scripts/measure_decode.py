"""One decode step (one new token against a KV cache): our JAX module under one jax.jit against our
torch module eager and under torch.compile, paired round-robin in one process.

Beyond mha-bench: mha-bench times whole-sequence passes (fwd, fwd+bwd) only; one decode step
against a prefilled KV cache, each implementation continuing its own cache, is not among them.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/measure_decode.py [--batch 1,4] [--prefill 1024]
        [--capacity 2048] [--steps 200] [--json PATH] [--markdown PATH]

The layer is a Llama-style one: E=512, N=8 query heads, K=2 key/value heads, rotate-half RoPE,
no biases, float32. Each framework prefills the same `--prefill` tokens into an empty cache of
`--capacity` slots, then decodes: every round runs one step of each implementation (the order
rotates each round), each continuing its own cache, as a decoding loop does. JAX's step donates
its cache (updated in place, as a JAX decoding loop runs it); our torch cache is immutable, so
each torch step writes a new one (a (B, K, C, H) copy per step, part of what is timed).

Before timing, the three first steps' outputs are compared (they decode the same token from
the same prefill): a step that computes something else would be timed for nothing. Speed only
means something on a quiet machine; the processor and load average go into the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import mha_torch
from mha_jax import kernels
from mha_spec import allocator
from parity import convert

E, N, K = 512, 8, 2
LAYER = dict(num_kv_heads=K, qkv_bias=False, out_bias=False, rope="half")


def steppers(batch: int, prefill: int, capacity: int, seed: int = 0):
    """{name: (state, step)}: step(state) -> (output (B, 1, E) NumPy-convertible, new state)."""
    torch.manual_seed(seed)
    tm = mha_torch.MultiHeadAttention(E, N, **LAYER).eval()
    jm = convert.torch_to_jax(tm)
    rng = np.random.default_rng(seed)
    x_pre = rng.standard_normal((batch, prefill, E)).astype(np.float32)
    x_new = rng.standard_normal((batch, 1, E)).astype(np.float32)
    graphdef, state = nnx.split(jm)

    def jax_step(state, cache, x):
        out, _, new = nnx.merge(graphdef, state)(x, x, x, cache=cache, need_weights=False)
        return out, new

    jit_step = jax.jit(jax_step, donate_argnums=1)
    jax_prefill = jax.jit(jax_step)
    _, jcache = jax_prefill(state, jm.init_cache(batch, capacity), jnp.asarray(x_pre))
    jx = jnp.asarray(x_new)

    def torch_run(module):
        def step(cache):
            with torch.inference_mode():
                out, _, new = module(tx, tx, tx, cache=cache, need_weights=False)
            return out, new
        return step

    tx = torch.from_numpy(x_new)
    with torch.inference_mode():
        _, _, tcache = tm(torch.from_numpy(x_pre), torch.from_numpy(x_pre), torch.from_numpy(x_pre),
                       cache=tm.init_cache(batch, capacity), need_weights=False)
    compiled = torch.compile(tm)
    return {
        "ours-jax jit": (jcache, lambda c: jit_step(state, c, jx)),
        "ours-torch eager": (tcache, torch_run(tm)),
        "ours-torch compile": (tcache, torch_run(compiled)),
    }


def block(out):
    return jax.block_until_ready(out) if isinstance(out, jax.Array) else out


def measure(batch: int, prefill: int, capacity: int, steps: int) -> dict:
    impls = steppers(batch, prefill, capacity)
    states = {name: s for name, (s, _) in impls.items()}
    first, compile_s = {}, {}
    for name, (_, step) in impls.items():  # compile, and the first step's output for the check
        t0 = time.perf_counter()
        out, states[name] = step(states[name])
        first[name] = np.asarray(block(out))
        compile_s[name] = time.perf_counter() - t0
    ref = first["ours-torch eager"]
    diffs = {name: float(np.max(np.abs(o - ref))) for name, o in first.items()}
    if max(diffs.values()) > 1e-4:
        raise SystemExit(f"the first decode steps disagree: {diffs}")
    for _ in range(5):  # warm: steady-state steps, discarded
        for name, (_, step) in impls.items():
            out, states[name] = step(states[name])
            block(out)
    times = {name: [] for name in impls}
    names = list(impls)
    for r in range(steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            out, states[name] = impls[name][1](states[name])
            block(out)
            times[name].append(time.perf_counter() - t0)
    base = times["ours-torch eager"]
    out = {}
    for name, ts in times.items():
        q1, med, q3 = np.percentile(ts, [25, 50, 75])
        ratios = [t / b for t, b in zip(ts, base)]  # paired by round
        out[name] = dict(median_ms=1e3 * med, iqr_over_median=(q3 - q1) / med, min_ms=1e3 * min(ts),
                         median_ratio_to_torch_eager=statistics.median(ratios), first_call_s=compile_s[name],
                         first_step_max_abs_diff=diffs[name])
    return out


def markdown(report: dict) -> str:
    lines = [f"# One decode step: {report['processor']}, {report['cores']} cores", "",
             f"E={E}, N={N}, K={K}, rope half, no bias, float32; cache of {report['capacity']} slots holding "
             f"{report['prefill']} prefilled tokens; {report['steps']} paired rounds; load average "
             f"{report['load_average_start'][0]:.2f} -> {report['load_average_end'][0]:.2f}; allocator "
             f"{report.get('allocator') or 'as the environment gives it'}.", "",
             "| B | implementation | median | IQR / median | min | paired ratio to torch eager | first call |",
             "|---|---|---|---|---|---|---|"]
    for b, rows in report["results"].items():
        for name, r in rows.items():
            lines.append(f"| {b} | {name} | {r['median_ms']:.3f} ms | {100 * r['iqr_over_median']:.0f} % | "
                         f"{r['min_ms']:.3f} ms | {r['median_ratio_to_torch_eager']:.2f}x | {r['first_call_s']:.2f} s |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,4", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    if args.prefill + args.steps + 10 > args.capacity:
        p.error(f"--capacity {args.capacity} holds fewer than prefill + steps + 10 warm-up steps")
    alloc = allocator.pin_this_process()  # as mha-bench's workers: the per-call cost without the process's history
    load_start = os.getloadavg()
    with jax.default_matmul_precision("highest"):
        results = {str(b): measure(b, args.prefill, args.capacity, args.steps) for b in args.batch}
    report = dict(processor=kernels.processor().model, cores=os.cpu_count(), torch=torch.__version__, jax=jax.__version__,
                  prefill=args.prefill, capacity=args.capacity, steps=args.steps, load_average_start=list(load_start),
                  load_average_end=list(os.getloadavg()), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                  allocator=alloc, results=results)
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
