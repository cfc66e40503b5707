"""Measure the JAX fused-attention kernels and chunk sizes on this machine; write the table.

    .venv/bin/python scripts/measure_blocks.py                      # default sizes, ~5 min on 2 cores
    .venv/bin/python scripts/measure_blocks.py --sizes 4x8x2048x64 --blocks 512x1024,256x2048

For every size (B x N x T x H, S = T) it compiles each candidate, then times them
round-robin (the direction reversed each round, so a load drift hits all alike) and
keeps the min and the median of the repeats; only ratios within one size of one run
mean anything on a shared machine. Candidates: our einsum core without weights
("einsum", materialises (B, N, T, S)), `jax.nn.dot_product_attention`'s XLA path
("dpa-xla", materialises too) and the chunked kernel ("chunked") at each block size;
materialising candidates are skipped above mha_jax.kernels.MATERIALIZE_LIMIT scores.
Passes: "fwd" (the context) and "fwdbwd" (gradient of its sum w.r.t. q, k, v).

It writes JSON (--json, default docs/results/flash-blocks-<device>.json) with every
time, the load average at start and end and the device kind, and prints the rows in
the form of `mha_jax.kernels.TABLE` for pasting there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention_core, chunked_attention
from mha_jax.attention import MATERIALIZE_LIMIT
from mha_jax.kernels import device_kind

DEFAULT_SIZES = "4x8x256x64,4x8x512x64,4x8x1024x64,4x8x2048x64,1x8x8192x64"
DEFAULT_BLOCKS = "256x512,512x512,256x1024,512x1024,1024x1024,256x2048,512x2048,2048x512"


def _candidates(B, N, T, H, blocks):
    """{name: f(q, k, v) -> context (B, T, N, H)}."""
    out = {}
    if B * N * T * T <= MATERIALIZE_LIMIT:
        out["einsum"] = lambda q, k, v: attention_core(q, k, v)[0]
        out["dpa-xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(H), implementation="xla")
    for cq, ck in dict.fromkeys((min(cq, T), min(ck, T)) for cq, ck in blocks):  # a block > T is the whole axis
        out[f"chunked:{cq}x{ck}"] = lambda q, k, v, cq=cq, ck=ck: chunked_attention(q, k, v, q_chunk=cq, k_chunk=ck)
    return out


def _program(f, pass_):
    if pass_ == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def measure_size(B, N, T, H, blocks, passes, reps, dtype, budget_s):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(3))
    rows = []
    for pass_ in passes:
        compiled, first = {}, []
        for name, f in _candidates(B, N, T, H, blocks).items():
            compiled[name] = _program(f, pass_).lower(q, k, v).compile()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](q, k, v))  # warm-up
            first.append(time.perf_counter() - t0)
        # Small problems get more repeats (up to ~budget_s per candidate, at most 50).
        reps_here = max(reps, min(50, int(budget_s / max(min(first), 1e-4))))
        times = {name: [] for name in compiled}
        order = list(compiled)
        for r in range(reps_here):
            for name in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[name](q, k, v))
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            rows.append(dict(B=B, N=N, T=T, S=T, H=H, pass_=pass_, candidate=name, min_s=min(ts), median_s=float(np.median(ts)), reps=len(ts)))
            print(f"B={B} N={N} T={T} H={H} {pass_:7s} {name:18s} min {1e3 * min(ts):9.1f} ms  median {1e3 * np.median(ts):9.1f} ms", flush=True)
    return rows


def summarise(runs):
    """Per (B, N, T, S): the fastest kernel and the chunked kernel's fastest blocks.

    runs: a list of runs (each a list of rows). Absolute times from different runs on a shared
    machine are not comparable, so a candidate's score is the geometric mean of its time / the
    fastest candidate's time over every (run, pass) that measured it: forward and forward+backward
    count alike (the fused path serves inference and training). Where two or more runs measured a
    size, a candidate seen in only one of them is left out.
    """
    out = []
    sizes = sorted({(r["B"], r["N"], r["T"], r["S"]) for run in runs for r in run})
    for key in sizes:
        ratios, seen = {}, {}
        for n, run in enumerate(runs):
            for pass_ in ("fwd", "fwdbwd"):
                pick = [r for r in run if (r["B"], r["N"], r["T"], r["S"]) == key and r["pass_"] == pass_]
                for r in pick:
                    ratios.setdefault(r["candidate"], []).append(r["min_s"] / min(x["min_s"] for x in pick))
                    seen.setdefault(r["candidate"], set()).add(n)
        need = 2 if max(len(v) for v in seen.values()) >= 2 else 1
        score = {c: math.exp(np.mean(np.log(v))) for c, v in ratios.items() if len(seen[c]) >= need}
        fastest = min(score, key=score.get)
        chunked = [c for c in score if c.startswith("chunked:")]
        blocks = min(chunked, key=score.get).split(":")[1] if chunked else None
        out.append(dict(BN=key[0] * key[1], T=key[2], S=key[3], fastest=fastest.split(":")[0], blocks=blocks,
                        scores={c: round(v, 3) for c, v in sorted(score.items(), key=lambda kv: kv[1])}))
    return out


def print_table(table):
    print("rows for mha_jax.kernels.TABLE:")
    for t in table:
        blocks = "None" if t["blocks"] is None else "(" + t["blocks"].replace("x", ", ") + ")"
        print(f"    Measured(BN={t['BN']}, T={t['T']}, S={t['S']}, fastest={t['fastest']!r}, blocks={blocks}),  # {t['scores']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated BxNxTxH (S = T)")
    p.add_argument("--blocks", default=DEFAULT_BLOCKS, help="comma-separated q_chunk x k_chunk")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--reps", type=int, default=3, help="repeats at least (more for small sizes, see --budget)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds per candidate that set the repeats of small sizes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    p.add_argument("--combine", nargs="+", metavar="RUN.json", help="only summarise earlier runs together (no timing)")
    args = p.parse_args(argv)
    if args.combine:
        runs = []
        for path in args.combine:
            with open(path) as f:
                runs.append(json.load(f)["rows"])
        print_table(summarise(runs))
        return
    if args.reps < 1:
        p.error("--reps must be >= 1")
    jax.config.update("jax_default_matmul_precision", "highest")  # as mha-bench pins it
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks.split(",")]
    kind = device_kind()
    load_start = os.getloadavg()
    print(f"device kind {kind!r}, load average {load_start}, {os.cpu_count()} cores", flush=True)
    rows = []
    for B, N, T, H in sizes:
        rows += measure_size(B, N, T, H, blocks, args.passes.split(","), args.reps, jnp.dtype(args.dtype), args.budget)
    table = summarise([rows])
    report = dict(device_kind=kind, machine=platform.processor() or platform.machine(), cores=os.cpu_count(),
                  load_average_start=load_start, load_average_end=os.getloadavg(), dtype=args.dtype,
                  jax=jax.__version__, precision="highest", rows=rows, table=table)
    path = args.json or f"docs/results/flash-blocks-{kind.replace(' ', '_')}.json"
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}; load average at end {report['load_average_end']}")
    print_table(table)


if __name__ == "__main__":
    main()
