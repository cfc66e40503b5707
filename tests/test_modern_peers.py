"""The peers of grouped/multi-query, rotary and bias-free layers, and the Llama-style example port.

torch-sdpa-gqa, jax-dpa-gqa, keras-gqa and hf-llama pass against the float64 oracle and our modules,
forward and gradients; HF Llama's float64 precision is measured (it computes RoPE's cos/sin
and its softmax in float32, so float64 runs are judged at the float32 entry) and so is its
fully masked row (NaN in float64, uniform otherwise: why its float64 runs are limited).
parity.examples.llama_jax's port passes; its jnp.tile twin and the other classic porting
bugs fail with the first diverging stage named.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_spec import AttentionConfig, Problem
from parity import reference
from parity.examples import llama_jax
from parity.harness import Case, Shape, run
from parity.harness import runner as harness_runner
from parity.harness.matrix import VARIANT_SHAPES
from parity.tolerances import TOLERANCES
from tests import planted

NEW = ("torch-sdpa-gqa", "jax-dpa-gqa", "hf-llama")
LLAMA = Case(VARIANT_SHAPES["llama"], "causal", "nan", peers=True)  # self, N=8 K=2, RoPE half, no biases
PADDED = Case(VARIANT_SHAPES["llama"], "padding", "uniform", peers=True)  # one sequence all padding
MAIN = {"torch-sdpa-gqa": LLAMA, "hf-llama": LLAMA, "jax-dpa-gqa": PADDED}  # where each runs in both dtypes
# Cross-attention, Meta's interleaved RoPE, one sequence all padding: fully masked rows.
CROSS = Case(VARIANT_SHAPES["rope-interleaved"], "padding", "uniform", peers=True, dtypes=("float64",))
# Qwen2's bias set (q/k/v only) with interleaved weights: HF runs them through its q/k row permutation.
QWEN = Case(Shape("qwen-interleaved", B=2, T=5, S=5, E=24, N=6, cross=False, num_kv_heads=2, out_bias=False,
                  rope="interleaved", rope_theta=500.0), "padding", "uniform", peers=True, dtypes=("float32",))


def _rows(report, impl, case=None, status=None):
    return [r for r in report.rows if r.impl == impl and (case is None or r.case == case.name)
            and (status is None or r.status == status)]


@pytest.fixture(scope="module")
def peers_report():
    with pytest.MonkeyPatch.context() as mp:
        select = harness_runner.select
        mp.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
            i for i in select(role, *a, **kw) if role != "peer" or i.name in NEW))
        return run(cases=[LLAMA, PADDED, CROSS, QWEN], checks=("peers",), dtypes=("float64", "float32"), device="cpu")


@pytest.mark.parametrize("name", NEW)
def test_modern_peer_passes_forward_and_gradients(peers_report, name):
    rows = _rows(peers_report, name)
    assert not [r for r in rows if r.status in ("fail", "error")], [r for r in rows if r.status != "pass"]
    passed = {(r.case, r.reference, r.dtype, r.quantity) for r in rows if r.status == "pass"}
    grads = ("d_input", "d_params") if name == "hf-llama" else ("d_inputs", "d_params")
    case = MAIN[name].name
    for dtype in ("float64", "float32"):  # both dtypes on the Llama layer, against the oracle and our module
        assert (case, "oracle", dtype, "output") in passed, (name, dtype)
        assert any(c == case and ref != "oracle" and d == dtype for c, ref, d, _ in passed), (name, dtype)
        for g in grads:
            assert (case, "oracle", dtype, g) in passed, (name, dtype, g)


def test_cross_attention_and_qwen_bias_set(peers_report):
    for name in ("torch-sdpa-gqa", "jax-dpa-gqa"):  # cross-attention, interleaved, fully masked rows
        assert {r.quantity for r in _rows(peers_report, name, CROSS, "pass")} >= {"output", "d_inputs", "d_params"}
    # HF Llama is self-attention: a skip row naming its runs_on; on the Qwen2-style layer it runs.
    assert [r.status for r in _rows(peers_report, "hf-llama", CROSS)] == ["skip"]
    assert "self/" in _rows(peers_report, "hf-llama", CROSS)[0].message
    assert {r.quantity for r in _rows(peers_report, "hf-llama", QWEN, "pass")} == {"output", "d_input", "d_params"}


def test_float64_is_judged_at_the_precision_each_peer_computes_in(peers_report):
    by_name = {r.impl: r for r in peers_report.rows if r.impl in NEW and r.case == MAIN[r.impl].name
               and r.dtype == "float64" and r.quantity == "output" and r.reference == "oracle"}
    for name in ("jax-dpa-gqa", "hf-llama"):  # float32 softmax (and HF's float32 cos/sin)
        assert "judged at the float32 tolerance" in by_name[name].message
        assert by_name[name].atol >= TOLERANCES["float32"].forward.atol  # float32's bound: at least its floor
    assert by_name["torch-sdpa-gqa"].atol < 1e-9  # float64 throughout: float64's bound (its floor is 1e-12)
    assert "judged at" not in by_name["torch-sdpa-gqa"].message


# ---------------------------------------------------------------- Keras's GroupQueryAttention

# Grouped heads (N=8, K=2), cross-attention, every bias, one sequence all padding: fully masked rows.
KERAS_GQA = Case(VARIANT_SHAPES["gqa"], "padding", "uniform", peers=True)


@pytest.fixture(scope="module")
def keras_report():
    with pytest.MonkeyPatch.context() as mp:
        select = harness_runner.select
        mp.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
            i for i in select(role, *a, **kw) if role != "peer" or i.name == "keras-gqa"))
        classic = Case(Shape("classic", B=2, T=3, S=4, E=12, N=3, cross=True), "none", "nan", peers=True,
                       dtypes=("float32",))
        return run(cases=[KERAS_GQA, LLAMA, classic], checks=("peers",), dtypes=("float64", "float32"), device="cpu")


def test_keras_gqa_passes_forward_and_gradients_on_a_grouped_layer(keras_report):
    """Its autodiff through stateless_call reaches every canonical parameter: a kernel or bias the
    layer ignored, or a head order unlike ours, fails against the oracle."""
    rows = _rows(keras_report, "keras-gqa", KERAS_GQA)
    assert rows and all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
    for dtype in ("float64", "float32"):
        got = {(r.reference, r.quantity) for r in rows if r.dtype == dtype}
        assert got == {("oracle", "output"), ("jax[uniform]", "output"), ("oracle", "d_inputs"), ("oracle", "d_params")}
    f64 = [r for r in rows if r.dtype == "float64" and r.reference == "oracle" and r.quantity == "output"]
    assert "judged at the float32 tolerance" in f64[0].message  # jax.nn.dot_product_attention's float32 softmax


def test_keras_gqa_skips_what_it_cannot_hold_saying_why(keras_report):
    llama = _rows(keras_report, "keras-gqa", LLAMA)
    assert llama and all(r.status == "skip" and "rope-half" in r.message for r in llama)
    classic = [r for r in keras_report.rows if r.impl == "keras-gqa" and r.case.startswith("classic")]
    assert classic and all(r.status == "skip" and "has a peer of its own" in r.message for r in classic)


# ---------------------------------------------------------------- HF Llama, measured


def _hf_llama(config, B, T, dtype):
    import torch

    from parity.peers.hf import hf_llama

    rng = np.random.default_rng(7)
    sd = {k: rng.uniform(-0.3, 0.3, s) for k, s in config.weight_shapes().items()}
    fn = hf_llama({k: v.astype(dtype) for k, v in sd.items()}, config.num_heads, dtype=dtype,
                  device=torch.device("cpu"), problem=Problem(config, B, T, T))
    return sd, fn, rng


def test_hf_llama_float64_is_float32_precision():
    """Measured: 2e-8..5e-8 off the oracle (float32 cos/sin and softmax), far above float64's bound and
    below float32's. If transformers computed in float64 the lower bound fails: drop the table entry."""
    import torch

    config = AttentionConfig(24, 6, num_kv_heads=2, qkv_bias=False, out_bias=False, rope="half", rope_theta=10000.0)
    sd, fn, rng = _hf_llama(config, 2, 5, "float64")
    x = rng.standard_normal((2, 5, 24))
    pos = 40 + np.cumsum(rng.integers(1, 4, (2, 5)), axis=1)
    want = reference.forward(sd, x, x, x, None, num_heads=6, num_kv_heads=2, rope="half", positions=pos,
                             key_positions=pos).output
    t = torch.from_numpy(x)
    err = np.abs(fn(t, t, t, None, positions=torch.from_numpy(pos), key_positions=torch.from_numpy(pos)).numpy() - want).max()
    assert TOLERANCES["float64"].forward.atol < err < TOLERANCES["float32"].forward.atol, err


def test_hf_llama_fully_masked_row_is_nan_in_float64_uniform_in_float32():
    import torch

    config = AttentionConfig(12, 3, num_kv_heads=1, rope="half")
    keep = np.ones((2, 4, 4), bool)
    keep[1, 2] = False  # one query that sees no key
    for dtype, expect_nan in (("float64", True), ("float32", False)):
        _, fn, rng = _hf_llama(config, 2, 4, dtype)
        x = torch.from_numpy(rng.standard_normal((2, 4, 12)).astype(dtype))
        out = fn(x, x, x, torch.from_numpy(keep)).numpy()
        assert np.isnan(out[1, 2]).all() == expect_nan and np.isfinite(np.delete(out[1], 2, axis=0)).all(), dtype


def test_hf_llama_takes_one_position_list():
    import torch

    config = AttentionConfig(12, 3, rope="half")
    _, fn, rng = _hf_llama(config, 1, 4, "float32")
    x = torch.from_numpy(rng.standard_normal((1, 4, 12)).astype("float32"))
    with pytest.raises(ValueError, match="key_positions must equal positions"):
        fn(x, x, x, None, positions=torch.arange(4)[None], key_positions=torch.arange(1, 5)[None])


# ---------------------------------------------------------------- the Llama-style port and its bugs

PORTS = {"llama-jax-port": None, "llama-jax-port-tile-bug": "scores", "llama-rope-swapped": "q_rot",
         "llama-key-pos-off-by-one": "k_rot"}


@pytest.fixture(scope="module")
def ports_report():
    impls = [llama_jax.port, llama_jax.port_with_tile_bug, planted.llama_rope_swapped(),
             planted.llama_key_positions_off_by_one()]
    interleaved = Case(VARIANT_SHAPES["rope-interleaved"], "none", "nan", dtypes=("float32",))
    return run(cases=[Case(VARIANT_SHAPES["llama"], "causal", "nan"), interleaved], checks=("forward",),
               dtypes=("float32",), impls=impls, device="cpu")


@pytest.mark.parametrize("name, stage", PORTS.items())
def test_llama_port_passes_and_each_porting_bug_names_its_stage(ports_report, name, stage):
    rows = [r for r in ports_report.rows if r.impl == name and r.case == "llama/causal/nan"]
    assert {r.reference for r in rows} == {"oracle", "torch"}
    if stage is None:
        assert rows and all(r.status == "pass" for r in rows), rows
    else:
        assert all(r.status == "fail" for r in rows), rows
        assert {r.stage for r in rows if r.reference == "oracle"} == {stage}


def test_llama_port_declares_its_variants(ports_report):
    rows = [r for r in ports_report.rows if r.impl == "llama-jax-port" and r.case.startswith("rope-interleaved")]
    assert rows and all(r.status == "skip" and "rope-interleaved" in r.message for r in rows)
