"""float16 values near the dtype's largest (65504) in V: a row that keeps no key reads mean(V),
whose plain float16 sum over the keys overflows; every path sums V·(1/S) in float32 instead.

Identity projections carry the inputs through unchanged, so V is 50000-60000 where attention
sees it; every path (weights, fused on each JAX kernel, both rings on one device) is judged
against the float64 oracle by the three-way rule of 16-bit dtypes, NaN placement exactly.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from conftest import SIZES
from helpers import build, cast_sd, run
from parity import convert, reference
from parity.tolerances import compare_three_way, tolerance_for

S = SIZES
F16 = np.float16
ROW = (1, 2)  # batch 1, query row 2: keeps no key


def _identity_sd() -> dict:
    return {name: (np.eye(S.E) if name.endswith("weight") else np.zeros(S.E))
            for p in ("q_proj", "k_proj", "v_proj", "out_proj") for name in (f"{p}.weight", f"{p}.bias")}


def _inputs():
    rng = np.random.default_rng(16)
    q, k = (rng.standard_normal((S.B, L, S.E)) for L in (S.T, S.S))
    v = rng.uniform(50000.0, 60000.0, (S.B, S.S, S.E))
    keep = rng.random((S.B, S.T, S.S)) > 0.4
    keep[..., 0] = True
    keep[:, :, 3] = False  # a key no row keeps
    keep[ROW] = False
    return [x.astype(F16) for x in (q, k, v)], keep


def _torch_ring(sd, policy, q, k, v, keep):
    import torch.distributed as dist

    from mha_torch import parallel

    m = build("torch", sd, S.N, masked_rows=policy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            out = parallel.sequence_parallel_forward(m, *(convert.numpy_to_tensor(x) for x in (q, k, v)), torch.from_numpy(keep))
    finally:
        dist.destroy_process_group()
    return convert.tensor_to_numpy(out)


def _jax_ring(sd, policy, q, k, v, keep):
    from mha_jax import parallel

    params = parallel.params_of(build("jax", sd, S.N, masked_rows=policy))
    mesh = parallel.make_mesh(1)
    fn = jax.jit(lambda q, k, v: parallel.sharded_attention(params, q, k, v, keep, mesh=mesh, sharding="sp", num_heads=S.N,
                                                            masked_rows=policy))
    return np.asarray(fn(q, k, v))


PATHS = ["torch-weights", "torch-fused", "jax-weights", "jax-einsum", "jax-chunked", "jax-dpa-xla", "torch-ring", "jax-ring"]


@pytest.mark.parametrize("policy", ["uniform", "nan"])
@pytest.mark.parametrize("path", PATHS)
def test_a_row_that_keeps_no_key_reads_a_finite_mean_of_huge_values(path, policy, forced_kernel):
    (q, k, v), keep = _inputs()
    with np.errstate(over="ignore"):
        assert np.isinf(v.sum(axis=1, dtype=F16)).all()  # the overflow a plain float16 sum meets
    sd = cast_sd(_identity_sd(), F16)
    if path in ("torch-ring", "jax-ring"):
        out = (_torch_ring if path == "torch-ring" else _jax_ring)(sd, policy, q, k, v, keep)
    else:
        framework, kind = path.split("-", 1)
        if kind not in ("weights", "fused"):
            forced_kernel(kind)
        out, _ = run(framework, build(framework, sd, S.N, masked_rows=policy), q, k, v, keep, need_weights=kind == "weights")
    x64 = [reference.as_float64(x) for x in (q, k, v)]
    exact = reference.forward(_identity_sd(), *x64, keep, num_heads=S.N, masked_rows=policy).output
    low = reference.forward(sd, *x64, keep, num_heads=S.N, masked_rows=policy, dtype=F16).output
    out = out.astype(np.float64)
    tol = tolerance_for("float16")
    c = compare_three_way(out, exact, low, tol.three_way_k, tol.forward.atol)  # NaN placement exactly
    assert c.passed, c
    if policy == "uniform":
        mean_v = x64[2][ROW[0]].mean(axis=0)  # identity projections: the output row is mean(V)
        np.testing.assert_allclose(exact[ROW], mean_v, rtol=1e-12)
        assert np.isfinite(out[ROW]).all() and (out[ROW] > 50000).all()
        row = compare_three_way(out[ROW], exact[ROW], low[ROW], tol.three_way_k, tol.forward.atol)
        assert row.passed, row
    else:
        assert np.isnan(out[ROW]).all()
    assert np.isfinite(np.delete(out.reshape(-1, S.E), ROW[0] * S.T + ROW[1], axis=0)).all()
