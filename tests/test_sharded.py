"""Sharded attention (tp, sp, dp) in both frameworks, across simulated devices and real processes.

Three process groups start together once per module (they share the two cores): JAX with 4
simulated devices in one process, torch as 4 gloo processes, and JAX as 2 processes joined by
jax.distributed. Each runs a batch of jobs and planted bugs and returns report rows; the tests
below read them. The layers: parity.harness.sharded.PROBLEMS (the classic layer, B=4 T=16 S=12
E=24 N=8; a grouped-query layer with RoPE and no biases, B=4 T=20 S=12 E=96 N=16 K=8).

What each job list covers, and why no more: sharding bugs live in the split (tp: heads and a
per-head mask; sp: query/key blocks, their mask columns and positions; dp: batch rows), the
reduction (tp's all-reduce and its bias) and the ring (block order, the whole row's emptiness,
mean V over every block). So every sharding meets no mask and a mask it cuts; the masked-row
policies run where a fill needs the whole sequence (sp); float32 runs once per sharding; the
one-device paths' own mask and policy semantics are tested elsewhere (tests/test_modules.py,
tests/test_edges.py).
"""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest
import torch

from mha_spec import SHARDINGS
from parity.harness.sharded import PLANTS, SHARDED_MASK_KINDS, Job
from parity.harness.sharded.cases import unsplittable
from parity.harness.sharded.launch import finish, run_sharded, start

CLASSIC_F64 = {
    "tp": (("none", "nan"), ("random", "uniform"), ("random-heads", "zero")),
    "sp": (("none", "nan"), ("random", "nan"), ("random", "zero"), ("random", "uniform")),
    "dp": (("none", "nan"), ("random", "zero")),
}
GROUPED_F64 = {"tp": (("random-heads", "zero"),), "sp": (("random", "uniform"),), "dp": (("random", "nan"),)}
F32 = (("random", "uniform"),)  # classic, every sharding
GSPMD = (("classic", ("random", "nan")), ("grouped-rope", ("random", "uniform")))
# Each plant's own sharding and one it must leave green, on jobs whose layer the plant can break.
PLANT_JOBS = {
    "bias_per_shard": ("classic", ("random", "uniform"), {"tp": "tp", "other": "sp"}),
    "bias_grad_div": ("classic", ("random", "uniform"), {"tp": "tp", "other": "sp"}),
    "ring_mask_offset": ("classic", ("random", "uniform"), {"sp": "sp", "other": "tp"}),
    "ring_local_positions": ("grouped-rope", ("random", "uniform"), {"sp": "sp", "other": "tp"}),
}
OTHER = {plant: layouts["other"] for plant, (_, _, layouts) in PLANT_JOBS.items()}
TWO_PROCESS_JOBS = (("sp", "grouped-rope", "random", "uniform", "float64"), ("tp", "classic", "random-heads", "zero", "float32"))


def _jobs(fw, layer, dtype, per_layout, devices=4):
    return [Job(fw, layout, devices, mask, policy, dtype, layer=layer) for layout, mps in per_layout.items() for mask, policy in mps]


def _main_runs(fw):
    main = _jobs(fw, "classic", "float64", CLASSIC_F64) + _jobs(fw, "grouped-rope", "float64", GROUPED_F64)
    main += _jobs(fw, "classic", "float32", {layout: F32 for layout in SHARDINGS})
    if fw == "jax":  # the unchanged module with head-sharded parameters, GSPMD under jit
        main += [Job(fw, "tp-gspmd", 4, mask, policy, "float64", layer=layer) for layer, (mask, policy) in GSPMD]
    runs = [{"jobs": main}]
    for plant, (layer, (mask, policy), layouts) in PLANT_JOBS.items():
        per_layout = {layouts[PLANTS[plant]]: ((mask, policy),), layouts["other"]: ((mask, policy),)}
        if plant == "ring_local_positions":  # the grouped layer's tp job of the main run (a mask per head)
            per_layout["tp"] = GROUPED_F64["tp"]
        runs.append({"plant": plant, "jobs": _jobs(fw, layer, "float64", per_layout)})
    return runs


def _two_process_jobs(fw):
    return [Job(fw, layout, 2, mask, policy, dtype, layer=layer) for layout, layer, mask, policy, dtype in TWO_PROCESS_JOBS]


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
def test_four_devices_every_sharding_and_layer_passes(groups, fw):
    rows = groups((fw, 4))[0]
    assert not _bad(rows), "\n".join(_bad(rows))
    seen = {(r.impl, r.dtype, r.case, r.reference, r.quantity) for r in rows if r.device.startswith("4x")}
    expected = [(layer, dtype, layout, mp) for layer, dtype, table in (("classic", "float64", CLASSIC_F64), ("grouped-rope", "float64", GROUPED_F64),
                                                                      ("classic", "float32", {layout: F32 for layout in SHARDINGS}))
                for layout, mps in table.items() for mp in mps]
    for layer, dtype, layout, (mask, policy) in expected:
        for ref in ("oracle", "one-device"):
            for q in ("output", "d_inputs", "d_params"):
                assert (f"{fw}-{layout}", dtype, f"{layer}/{mask}/{policy}", ref, q) in seen
    # every policy meets fully masked rows on the ring, every mask kind runs on some sharding
    assert {c.split("/", 2)[2] for (i, _, c, _, _) in seen if i == f"{fw}-sp" and "/none/" not in c} == {"nan", "zero", "uniform"}
    assert {c.split("/")[1] for (_, _, c, _, _) in seen} == set(SHARDED_MASK_KINDS)
    if fw == "jax":
        assert {(d, c) for (i, d, c, _, _) in seen if i == "jax-tp-gspmd"} == {("float64", "classic/random/nan"),
                                                                                 ("float64", "grouped-rope/random/uniform")}


def test_two_real_jax_processes_pass(groups):
    """jax.distributed over 2 processes (gloo collectives): the ring and the head split across processes."""
    rows = groups(("jax", 2))[0]
    assert not _bad(rows), "\n".join(_bad(rows))
    assert {(r.impl, r.case, r.dtype) for r in rows} == {(f"jax-{layout}", f"{layer}/{mask}/{policy}", dtype)
                                                          for layout, layer, mask, policy, dtype in TWO_PROCESS_JOBS}
    assert all("2 processes" in r.device for r in rows), {r.device for r in rows}
    assert len(rows) == len(TWO_PROCESS_JOBS) * 6  # (3 quantities x 2 references) per job


EXPECTED_FAILS = {
    "bias_per_shard": {("oracle", "output"), ("one-device", "output"), ("oracle", "d_params"), ("one-device", "d_params")},
    "bias_grad_div": {("oracle", "d_params"), ("one-device", "d_params")},
    "ring_mask_offset": {(ref, q) for ref in ("oracle", "one-device") for q in ("output", "d_inputs", "d_params")},
    "ring_local_positions": {(ref, q) for ref in ("oracle", "one-device") for q in ("output", "d_inputs", "d_params")},
}


@pytest.mark.parametrize("fw", ["jax", "torch"])
@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bug_turns_its_sharding_red(groups, fw, plant):
    runs = groups((fw, 4))
    rows = runs[1 + list(PLANTS).index(plant)]
    layout = PLANTS[plant]
    red = {(r.reference, r.quantity) for r in rows if r.status == "fail"}
    assert red == EXPECTED_FAILS[plant], red
    assert {r.impl for r in rows if r.status == "fail"} == {f"{fw}-{layout}"}
    assert all(r.stage.startswith(f"{layout}:") and r.message.startswith(f"{layout} over 4 devices") for r in rows if r.status == "fail")
    if plant == "bias_grad_div":
        assert all("out_proj.bias" in r.message for r in rows if r.status == "fail")
    other = [r for r in rows if r.impl == f"{fw}-{OTHER[plant]}"]
    assert other and not _bad(other)


# ---------------------------------------------------------------- in this process


def test_jax_bad_configurations_are_clear_errors():
    from mha_jax import parallel

    rng = np.random.default_rng(0)
    sd = {p: {"kernel": rng.standard_normal((12, 12)), "bias": rng.standard_normal(12)} for p in parallel.PROJECTIONS}
    x = rng.standard_normal((2, 6, 12))
    mesh = parallel.make_mesh(1, "x")
    with pytest.raises(ValueError, match=r"mesh has no axis 'tp'; its axes are \('x',\)"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="tp", num_heads=3, axis="tp")
    with pytest.raises(ValueError, match="sharding 'pp' is not one of"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="pp", num_heads=3)
    with pytest.warns(DeprecationWarning, match="spelled sharding="), pytest.raises(ValueError, match="sharding 'pp'"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, layout="pp", num_heads=3)  # the old keyword still reaches the check
    with pytest.raises(TypeError, match="needs sharding="):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, num_heads=3)
    with pytest.raises(ValueError, match=r"sharding 'tp': num_heads N=3 is not divisible by the 2 shards"):
        parallel.check_sharding("tp", 2, B=2, T=6, S=6, N=3)
    with pytest.raises(ValueError, match=r"sharding 'tp': num_kv_heads K=2 is not divisible by the 4 shards"):
        parallel.check_sharding("tp", 4, B=2, T=6, S=6, N=8, K=2)
    with pytest.raises(ValueError, match=r"sharding 'sp': key length S=7 is not divisible by the 2 shards"):
        parallel.check_sharding("sp", 2, B=2, T=6, S=7, N=3)
    with pytest.raises(ValueError, match=r"sharding 'dp': batch B=3 is not divisible by the 2 shards"):
        parallel.check_sharding("dp", 2, B=3, T=6, S=6, N=3)
    with pytest.raises(TypeError, match="query, key and value dtypes differ"):
        parallel.sharded_attention(sd, x, x.astype(np.float32), x, mesh=mesh, sharding="dp", num_heads=3)
    with pytest.raises(ValueError, match="a mesh of 3 devices needs 3"):
        parallel.make_mesh(3, devices=jax.devices()[:1])
    # k/v kernels of the wrong width for num_kv_heads; a partial set of q/k/v biases; positions without RoPE
    with pytest.raises(ValueError, match=r"params\['k_proj'\]\['kernel'\] has shape \(12, 12\), expected \(12, 4\) .*K=1"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="dp", num_heads=3, num_kv_heads=1)
    no_k_bias = {**sd, "k_proj": {"kernel": sd["k_proj"]["kernel"]}}
    with pytest.raises(ValueError, match="q/k/v biases come all three or none"):
        parallel.sharded_attention(no_k_bias, x, x, x, mesh=mesh, sharding="dp", num_heads=3)
    with pytest.raises(ValueError, match="positions/key_positions are given but rope=None"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="sp", num_heads=3, positions=np.arange(6))
    with pytest.raises(ValueError, match=r"positions must have shape \(6,\) or \(2, 6\), got \(5,\)"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="sp", num_heads=3, rope="half", positions=np.arange(5))
    with pytest.raises(TypeError, match="key_positions must be a jax or numpy array of integers"):
        parallel.sharded_attention(sd, x, x, x, mesh=mesh, sharding="sp", num_heads=3, rope="half", key_positions=np.ones(6))


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
    with pytest.raises(ValueError, match=r"sharding 'tp': num_heads N=3 is not divisible by the 2 ranks"):
        parallel._check_divisible("tp", 2, **{"num_heads N": 3})


def test_torch_plan_is_colwise_qkv_rowwise_out():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import mha_torch

    plan = mha_torch.tensor_parallel_plan()
    assert set(plan) == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert all(isinstance(plan[p], ColwiseParallel) for p in ("q_proj", "k_proj", "v_proj"))
    assert isinstance(plan["out_proj"], RowwiseParallel)


def test_unsplittable_sizes_give_skip_rows_without_launching():
    rows = run_sharded(devices=3, shardings=("tp", "dp"), frameworks=("jax", "torch"), dtypes=("float64",))
    assert rows and all(r.status == "skip" for r in rows)
    assert {r.message for r in rows} == {"N=8 not divisible by 3 devices", "N=16, K=8 not divisible by 3 devices",
                                         "B=4 not divisible by 3 devices"}
    # the key/value heads alone: N=16 splits over 16 devices, K=8 does not
    assert unsplittable(Job("torch", "tp", 16, "none", "nan", "float64", layer="grouped-rope")) == "K=8 not divisible by 16 devices"
    assert unsplittable(Job("jax", "tp-gspmd", 16, "none", "nan", "float64", layer="grouped-rope")) == "K=8 not divisible by 16 devices"
    with pytest.raises(ValueError, match="unknown sharding"):
        run_sharded(devices=2, shardings=("pp",))
    with pytest.raises(ValueError, match="unknown layer"):
        run_sharded(devices=2, layers=("llama",))


# ---------------------------------------------------------------- the ring's masked-row fill near the dtype's max

# V of float32 values near the largest finite one (3.4e38): their mean is finite, their plain sum is not.
_BIG_V = np.array([[3.0e38, 2.0e38], [3.0e38, -1.0e38], [3.0e38, 2.0e38], [-1.0e38, 2.0e38]], np.float32)  # (S=4, H=2)
_MEAN_V = _BIG_V.astype(np.float64).mean(axis=0)  # [2.0e38, 1.25e38]


def _big_v_keep(T: int, S: int) -> np.ndarray:
    """Row 0 keeps no key (the policy fills it with mean V); row t > 0 keeps only key t - 1 (a
    single finite V row: nothing else on the ring sums two large values)."""
    keep = np.zeros((T, S), bool)
    for t in range(1, T):
        keep[t, t - 1] = True
    return keep


def test_torch_ring_fills_a_masked_row_with_a_finite_mean_of_large_values():
    """uniform: the fully masked row is mean(V) of the key/value head its query heads read (a sum of
    V·(1/S): the plain sum of 3e38 + 3e38 overflows float32)."""
    import torch.distributed as dist

    from mha_torch import parallel

    T, S, H = 3, 4, 2
    q = torch.zeros(1, 2, T, H)  # N=2 query heads reading K=1 key/value head
    k = torch.zeros(1, 1, S, H)
    v = torch.from_numpy(_BIG_V).reshape(1, 1, S, H)
    keep = torch.from_numpy(_big_v_keep(T, S)).reshape(1, 1, T, S)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = parallel.ring_attention(q, k, v, keep, masked_rows="uniform", S_total=S)  # (1, N, T, H)
    finally:
        dist.destroy_process_group()
    assert torch.isfinite(ctx).all(), ctx
    np.testing.assert_allclose(ctx[0, :, 0].numpy(), np.stack([_MEAN_V, _MEAN_V]), rtol=1e-6)
    np.testing.assert_array_equal(ctx[0, 0, 1:].numpy(), _BIG_V[: T - 1])  # row t: V of key t - 1


def test_jax_ring_fills_a_masked_row_with_a_finite_mean_of_large_values():
    from mha_jax import parallel

    T, S, H, E = 3, 4, 2, 4
    eye = np.eye(E, dtype=np.float32)
    params = {"q_proj": {"kernel": np.zeros((E, E), np.float32)}, "k_proj": {"kernel": np.zeros((E, H), np.float32)},
              "v_proj": {"kernel": eye[:, :H].copy()}, "out_proj": {"kernel": eye}}  # v = value[..., :H], out = context
    value = np.zeros((1, S, E), np.float32)
    value[0, :, :H] = _BIG_V
    x = np.zeros((1, T, E), np.float32)
    mesh = parallel.make_mesh(1)
    out = jax.jit(lambda v: parallel.sharded_attention(params, x, x[:, :1].repeat(S, 1), v, _big_v_keep(T, S), mesh=mesh,
                                                       sharding="sp", num_heads=2, num_kv_heads=1, masked_rows="uniform"))(value)
    out = np.asarray(out)  # (1, T, E): both query heads' contexts side by side
    assert np.isfinite(out).all(), out
    np.testing.assert_allclose(out[0, 0], np.concatenate([_MEAN_V, _MEAN_V]), rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1:, :H], _BIG_V[: T - 1])
