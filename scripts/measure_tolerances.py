"""Measure the errors the tolerance table in parity/tolerances.py must admit.

Beyond mha-bench, which measures speed: this measures the raw errors against the float64 oracle
across sizes and seeds, before any tolerance judges them (`mha-parity` reports them judged).

For each dtype and a few sizes and seeds: the max abs error of ours-torch and ours-jax
(weights path and fused path) against the float64 oracle, and for 16-bit dtypes the ratio
of that error to the oracle's own maths in the dtype (the three-way yardstick).

    .venv/bin/python scripts/measure_tolerances.py
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from parity import convert, reference  # noqa: E402
from parity.tolerances import errors  # noqa: E402

SIZES = [(3, 5, 7, 12, 3), (2, 33, 65, 64, 4), (1, 256, 256, 512, 8)]  # B, T, S, E, N
DTYPES = ["float64", "float32", "bfloat16", "float16"]


def main(seeds=(0, 1, 2)):
    import ml_dtypes
    import torch

    print(f"{'dtype':9} {'B,T,S,E,N':18} {'impl':12} {'max_abs_err':>12} {'yardstick':>12} {'ratio':>6}")
    for dtype in DTYPES:
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        for B, T, S, E, N in SIZES:
            worst: dict[str, tuple[float, float]] = {}
            for seed in seeds:
                rng = np.random.default_rng(seed)
                bound = 1 / np.sqrt(E)
                sd = {f"{p}.{w}": rng.uniform(-bound, bound, (E, E) if w == "weight" else (E,)).astype(dt) for p in convert.PROJECTIONS for w in ("weight", "bias")}
                xs = [rng.standard_normal((B, L, E)).astype(dt) for L in (T, S, S)]
                keep = rng.random((B, T, S)) > 0.3
                keep[..., 0] = True
                x64 = [reference.as_float64(x) for x in xs]
                exact = reference.forward({k: reference.as_float64(v) for k, v in sd.items()}, *x64, keep, num_heads=N).output
                yard = errors(reference.forward(sd, *x64, keep, num_heads=N, dtype=dt).output, exact)[0] if dt.itemsize < 4 else float("nan")
                tm, jm = convert.to_torch(sd, N), convert.to_jax(sd, N)
                for nw in (True, False):
                    with torch.no_grad():
                        out_t = convert.tensor_to_numpy(tm(*(convert.numpy_to_tensor(x) for x in xs), torch.from_numpy(keep), need_weights=nw)[0])
                    out_j = np.asarray(jm(*xs, keep, need_weights=nw)[0])
                    for impl, out in ((f"torch{'' if nw else '-fused'}", out_t), (f"jax{'' if nw else '-fused'}", out_j)):
                        err = errors(out, exact)[0]
                        prev = worst.get(impl, (0.0, 0.0))
                        worst[impl] = (max(prev[0], err), max(prev[1], err / yard if yard == yard else 0.0))
            for impl, (err, ratio) in worst.items():
                print(f"{dtype:9} {f'{B},{T},{S},{E},{N}':18} {impl:12} {err:12.3e} {'':>12} {ratio:6.2f}")


if __name__ == "__main__":
    main()
