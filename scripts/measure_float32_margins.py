"""Measure the float32 and float64 margins of our modules and of planted 1% projection errors.

Beyond mha-bench, which measures speed: this measures accuracy margins. Beyond `mha-parity`, which
reports the margins of the weights it draws: it sweeps weight scales and seeds over three real layers
and plants a 1 % error in each projection, to show the bound admits every correct layer and fails each bug.

The float32/float64 bound (parity/tolerances.py, WIDE DTYPES) is k times the error of the oracle's
own maths in float32 (float64: scaled to float64's resolution), plus a floor. This script runs the
harness (`parity.harness.run`, checks forward and gradient, float32 and float64) on three layers --
Llama (grouped K=2, rotate-half RoPE at 1e4, no biases), Qwen2 (the same at 1e6, biases on q/k/v,
none on o) and the classic layer (four biases, no RoPE), each E=64, N=4, B=2, T=S=9, causal --
with weights drawn N(0, scale²) for each scale and seed (inputs N(0, 1), as the harness draws them),
and prints, per layer, scale and dtype:

  ours   the largest margin (max error ÷ bound; <= 1 passes) over every row of our implementations
         (torch, torch-fused, jax, jax-jit, jax-fused; torch-compile and torch-compile-fused with
         --compile) and the seeds, and which implementation it was;
  bugs   for each projection, our torch module with that projection's weight 1% too large: the
         smallest over the seeds of its largest row margin (> 1: red at every seed).

    .venv/bin/python scripts/measure_float32_margins.py                 # ~3 min on 2 cores (2-core AMD EPYC)
    .venv/bin/python scripts/measure_float32_margins.py --compile       # + torch.compile
    .venv/bin/python scripts/measure_float32_margins.py --seeds 3 --scales 0.3 --layers llama
    .venv/bin/python scripts/measure_float32_margins.py --draws 0 --scales 1.0   # the plain yardstick alone
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import sys
import time

import numpy as np

from mha_spec import VARIANT_FEATURES
from parity.harness import Case, Shape, run
from parity.harness.report import margin
from parity.impls import Implementation, builtin
from parity.tolerances import TOLERANCES

LAYERS = {
    "llama": dict(num_kv_heads=2, qkv_bias=False, out_bias=False, rope="half", rope_theta=1e4),
    "qwen2": dict(num_kv_heads=2, qkv_bias=True, out_bias=False, rope="half", rope_theta=1e6),
    "classic": dict(),
    # GPT-OSS's attention shape (head_dim 64, fewer key/value heads, every bias), not in the default set
    "gpt-oss": dict(E=256, num_kv_heads=2, qkv_bias=True, out_bias=True, rope="half", rope_theta=150000.0),
}
SCALES = (0.02, 0.1, 0.3, 1.0)
OURS = ("torch", "torch-fused", "jax", "jax-jit", "jax-fused")
COMPILED = ("torch-compile", "torch-compile-fused")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
DTYPES = ("float32", "float64")


def one_percent_off(projection: str) -> Implementation:
    """Our torch module (the case's policy, every variant) with `projection`'s weight multiplied by 1.01."""
    base = builtin("torch")

    def around(fn):
        @functools.wraps(fn)
        def call(params, *args, **kw):
            name = f"{projection}.weight"
            return fn({**params, name: params[name] * 1.01}, *args, **kw)

        return call

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)
        wrapped = around(fn)
        wrapped.intermediates = around(fn.intermediates)
        return wrapped

    return Implementation(f"1%-{projection}", "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=VARIANT_FEATURES)


def case_of(layer: str) -> Case:
    kw = dict(LAYERS[layer])
    E = kw.pop("E", 64)
    shape = Shape(layer, B=2, T=9, S=9, E=E, N=4, cross=False, **kw)
    return Case(shape, "causal", "nan", jax_eager=True)  # jax eager: our eager JAX forward, checked too


def weights(case: Case, scale: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, int(scale * 1000)])
    return {n: rng.normal(0.0, scale, s) for n, s in case.shape.config.weight_shapes().items()}


def measure(layer: str, scale: float, seeds: int, ours: tuple[str, ...]) -> dict:
    """{dtype: (worst margin of ours, its implementation, {projection: least bug margin})}."""
    case = case_of(layer)
    bugs = [one_percent_off(p) for p in PROJECTIONS]
    worst = {d: (0.0, "") for d in DTYPES}
    least = {d: {p: np.inf for p in PROJECTIONS} for d in DTYPES}
    for seed in range(seeds):
        report = run(cases=[case], state_dict=weights(case, scale, seed), dtypes=DTYPES, checks=("forward", "gradient"),
                     impls=[*ours, *bugs], device="cpu", seed=seed, compile=any(i in COMPILED for i in ours))
        bug_worst = {(d, p): 0.0 for d in DTYPES for p in PROJECTIONS}
        for r in report.rows:
            m = margin(r)
            if r.status == "error":
                raise RuntimeError(f"{layer} scale {scale} seed {seed}: {r.impl} {r.check} errored: {r.message}")
            if m is None:
                continue
            if r.impl in ours and m > worst[r.dtype][0]:
                worst[r.dtype] = (m, r.impl)
            elif r.impl.startswith("1%-"):
                key = (r.dtype, r.impl.removeprefix("1%-"))
                bug_worst[key] = max(bug_worst[key], m)
        for (d, p), m in bug_worst.items():
            least[d][p] = min(least[d][p], m)
    return {d: (*worst[d], least[d]) for d in DTYPES}


def processor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} cores)" if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 (default 10)")
    p.add_argument("--scales", default=",".join(map(str, SCALES)), help="weight standard deviations")
    p.add_argument("--layers", default="llama,qwen2,classic", help=f"of {', '.join(LAYERS)}")
    p.add_argument("--compile", action="store_true", help="also torch-compile and torch-compile-fused")
    p.add_argument("--draws", type=int, default=None,
                   help="the yardstick's nudged runs in float32/float64 instead of the table's (0: the plain run only)")
    args = p.parse_args(argv)
    if args.draws is not None:  # this process only: how the margins depend on the nudged runs
        for d in DTYPES:
            TOLERANCES[d] = dataclasses.replace(TOLERANCES[d], draws=args.draws)
    layers = args.layers.split(",")
    unknown = [x for x in layers if x not in LAYERS]
    if unknown:
        p.error(f"unknown layers {unknown}; known: {list(LAYERS)}")
    scales = [float(s) for s in args.scales.split(",")]
    if args.seeds < 1 or any(not s > 0 for s in scales) or (args.draws is not None and args.draws < 0):
        p.error(f"--seeds must be >= 1, --scales > 0 and --draws >= 0; got {args.seeds}, {scales}, {args.draws}")
    ours = OURS + (COMPILED if args.compile else ())
    import torch

    from parity import compile_cache

    torch.set_num_threads(1)  # tiny matrices: on a busy 2-core machine the thread pool's overhead is most of a call
    compile_cache.enable()  # as mha-parity does: a seed's programs are the same at every scale (the weights are arguments)
    started = time.perf_counter()
    print(f"processor: {processor()}; python {sys.version.split()[0]}")
    print(f"command: python scripts/measure_float32_margins.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"seeds 0-{args.seeds - 1}; ours: {', '.join(ours)}; bugs: each projection's weight x1.01 in our torch module; "
          f"k={TOLERANCES['float32'].three_way_k:g}, yardstick runs 1+{TOLERANCES['float32'].draws}")
    print()
    print("| layer | weight std | dtype | ours: worst margin (impl) | " + " | ".join(f"1% {p}: least margin" for p in PROJECTIONS) + " |")
    print("|---|---|---|---|" + "---|" * len(PROJECTIONS))
    for layer in layers:
        for scale in scales:
            for dtype, (m, impl, bugs) in measure(layer, scale, args.seeds, ours).items():
                cells = [layer, f"{scale:g}", dtype, f"{m:.2g} ({impl})"] + [f"{bugs[q]:.3g}" for q in PROJECTIONS]
                print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
