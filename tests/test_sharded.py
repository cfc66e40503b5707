"""Sharded attention (tp, sp, dp) in both frameworks, across simulated devices and real processes.

Four process groups start together once per module (they share the two cores): JAX with 4
simulated devices in one process, JAX as 2 processes joined by jax.distributed, torch as 4
and as 2 gloo processes. Each runs a batch of jobs and planted bugs and returns report rows;
the tests below read them. Sizes: parity.harness.sharded.SHAPE (B=4, T=16, S=12, E=24, N=8).
"""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest
import torch

from parity.harness.sharded import MASK_POLICIES, PLANTS, Job
from parity.harness.sharded.cases import HEAD_MASK
from parity.harness.sharded.launch import finish, run_sharded, start

_FULL = MASK_POLICIES  # every mask kind, every policy
_F32 = (("causal", "nan"), ("random", "zero"), ("padding", "zero"), ("random", "uniform"))
_TWO = {"float64": (("random", "uniform"),), "float32": (("causal", "nan"),)}
LAYOUTS = ("tp", "sp", "dp")
_OTHER = {"tp": "sp", "sp": "tp"}  # a layout a plant must leave green


def _jobs(fw, devices, dtype, mask_policies, layouts=LAYOUTS):
    return [Job(fw, layout, devices, mask, policy, dtype) for layout in layouts for mask, policy in mask_policies]


def _main_runs(fw):
    main = _jobs(fw, 4, "float64", _FULL) + _jobs(fw, 4, "float32", _F32)
    if fw == "jax":  # the unchanged module with head-sharded parameters, GSPMD under jit
        main += _jobs(fw, 4, "float64", (("random", "nan"),), ("tp-gspmd",)) + _jobs(fw, 4, "float32", (("causal", "nan"),), ("tp-gspmd",))
    runs = [{"jobs": main}]
    for plant, layout in PLANTS.items():
        runs.append({"plant": plant, "jobs": _jobs(fw, 4, "float64", (("random", "nan"),), (layout, _OTHER[layout]))})
    return runs


def _two_process_jobs(fw):
    return [job for dtype, mps in _TWO.items() for job in _jobs(fw, 2, dtype, mps)]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Start every group at once, collect each when a test first asks for it; afterwards no
    worker runs and no scratch directory is left."""
    scratch = tmp_path_factory.mktemp("sharded-scratch")
    saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        pending = {
            ("jax", 4): start("jax", _main_runs("jax"), devices=4),
            ("torch", 4): start("torch", _main_runs("torch"), devices=4),
            ("jax", 2): start("jax", [{"jobs": _two_process_jobs("jax")}], devices=2, processes=2),
            ("torch", 2): start("torch", [{"jobs": _two_process_jobs("torch")}], devices=2),
        }
    finally:
        tempfile.tempdir = saved
    done = {}

    def get(key):
        if key not in done:
            done[key] = finish([pending[key]], timeout_s=280)[0]
        return done[key]

    yield get
    for key, g in pending.items():
        if key not in done:  # a test that stopped early: end the group
            g.close()
    assert not list(scratch.glob("sharded-*")), list(scratch.iterdir())
    assert not [p.pid for g in pending.values() for p in g.procs if p.poll() is None]


def _bad(rows):
    return [f"{r.impl} {r.case} {r.dtype} {r.reference} {r.quantity}: {r.status} {r.max_abs_err} {r.message[:300]}" for r in rows if r.status != "pass"]


@pytest.mark.parametrize("fw", ["jax", "torch"])
def test_four_devices_every_layout_mask_policy_dtype_passes(groups, fw):
    rows = groups((fw, 4))[0]
    assert not _bad(rows), "\n".join(_bad(rows))
    seen = {(r.impl, r.dtype, r.case.split("/", 1)[1], r.reference, r.quantity) for r in rows if r.device.startswith("4x")}
    for layout in LAYOUTS:
        for mask, policy in _FULL:
            for ref in ("oracle", "one-device"):
                for q in ("output", "d_inputs", "d_params"):
                    assert (f"{fw}-{layout}", "float64", f"{mask}/{policy}", ref, q) in seen
        assert (f"{fw}-{layout}", "float64", f"{HEAD_MASK}/zero", "oracle", "d_params") in seen  # a mask per head
        assert {(m, p) for (i, d, c, _, _) in seen if i == f"{fw}-{layout}" and d == "float32" for m, p in [c.split("/")]} == set(_F32)
    if fw == "jax":
        assert {(d, c) for (i, d, c, _, _) in seen if i == "jax-tp-gspmd"} == {("float64", "random/nan"), ("float32", "causal/nan")}


@pytest.mark.parametrize("fw", ["jax", "torch"])
def test_two_real_processes_pass(groups, fw):
    rows = groups((fw, 2))[0]
    assert not _bad(rows), "\n".join(_bad(rows))
    assert {r.impl for r in rows} == {f"{fw}-{layout}" for layout in LAYOUTS}
    assert all("2 processes" in r.device for r in rows), {r.device for r in rows}
    assert len(rows) == 3 * 2 * 6  # 3 layouts x 2 jobs x (3 quantities x 2 references)


EXPECTED_FAILS = {
    "bias_per_shard": {("oracle", "output"), ("one-device", "output"), ("oracle", "d_params"), ("one-device", "d_params")},
    "bias_grad_div": {("oracle", "d_params"), ("one-device", "d_params")},
    "ring_mask_offset": {("oracle", "output"), ("one-device", "output"), ("oracle", "d_inputs"), ("one-device", "d_inputs"),
                         ("oracle", "d_params"), ("one-device", "d_params")},
}


@pytest.mark.parametrize("fw", ["jax", "torch"])
@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_turns_its_layout_red(groups, fw, plant):
    runs = groups((fw, 4))
    rows = runs[1 + list(PLANTS).index(plant)]
    layout = PLANTS[plant]
    red = {(r.reference, r.quantity) for r in rows if r.status == "fail"}
    assert red == EXPECTED_FAILS[plant], red
    assert {r.impl for r in rows if r.status == "fail"} == {f"{fw}-{layout}"}
    assert all(r.stage.startswith(f"{layout}:") and r.message.startswith(f"{layout} over 4 devices") for r in rows if r.status == "fail")
    if plant == "bias_grad_div":
        assert all("out_proj.bias" in r.message for r in rows if r.status == "fail")
    assert not _bad([r for r in rows if r.impl == f"{fw}-{_OTHER[layout]}"])


# ---------------------------------------------------------------- bad configurations (in this process)


def test_jax_bad_configurations_are_clear_errors():
    from mha_jax import parallel

    rng = np.random.default_rng(0)
    sd = {p: {"kernel": rng.standard_normal((12, 12)), "bias": rng.standard_normal(12)} for p in parallel.PROJECTIONS}
    x = rng.standard_normal((2, 6, 12))
    mesh = parallel.make_mesh(1, "x")
    with pytest.raises(ValueError, match=r"mesh has no axis 'tp'; its axes are \('x',\)"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, layout="tp", num_heads=3, axis="tp")
    with pytest.raises(ValueError, match="layout 'pp' is not one of"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, layout="pp", num_heads=3)
    with pytest.raises(ValueError, match=r"layout 'tp': num_heads N=3 is not divisible by the 2 shards"):
        parallel.check_layout("tp", 2, B=2, T=6, S=6, N=3)
    with pytest.raises(ValueError, match=r"layout 'sp': key length S=7 is not divisible by the 2 shards"):
        parallel.check_layout("sp", 2, B=2, T=6, S=7, N=3)
    with pytest.raises(ValueError, match=r"layout 'dp': batch B=3 is not divisible by the 2 shards"):
        parallel.check_layout("dp", 2, B=3, T=6, S=6, N=3)
    with pytest.raises(TypeError, match="query, key and value dtypes differ"):
        parallel.sharded_attention(sd, x, x.astype(np.float32), x, mesh=mesh, layout="dp", num_heads=3)
    with pytest.raises(ValueError, match="a mesh of 3 devices needs 3"):
        parallel.make_mesh(3, devices=jax.devices()[:1])


def test_torch_without_a_process_group_is_a_clear_error():
    import mha_torch
    from mha_torch import parallel

    assert not torch.distributed.is_initialized()
    m = mha_torch.MultiHeadAttention(12, 3, dtype=torch.float64)
    x = torch.zeros(2, 6, 12, dtype=torch.float64)
    for call in (lambda: parallel.sequence_parallel_forward(m, x, x, x), lambda: parallel.data_parallel_forward(m, x, x, x),
                 lambda: parallel.all_reduce_grads(m), lambda: parallel.parallelize_heads(m, None)):
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised: call torch.distributed.init_process_group"):
            call()
    with pytest.raises(ValueError, match=r"layout 'tp': num_heads N=3 is not divisible by the 2 ranks"):
        parallel._check_divisible("tp", 2, **{"num_heads N": 3})


def test_torch_plan_is_colwise_qkv_rowwise_out():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import mha_torch

    plan = mha_torch.tensor_parallel_plan()
    assert set(plan) == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all(isinstance(plan[p], ColwiseParallel) for p in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(plan["out_proj"], RowwiseParallel)


def test_unsplittable_sizes_give_skip_rows_without_launching():
    rows = run_sharded(devices=3, layouts=("tp", "dp"), frameworks=("jax", "torch"), dtypes=("float64",))
    assert rows and all(r.status == "skip" for r in rows)
    assert {r.message for r in rows} == {"N=8 not divisible by 3 devices", "B=4 not divisible by 3 devices"}
    with pytest.raises(ValueError, match="unknown layout"):
        run_sharded(devices=2, layouts=("pp",))
