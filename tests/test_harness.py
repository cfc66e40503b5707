"""The parity harness tested on itself: planted bugs turn it red and name the stage,
same seed gives the same report, reports are written whole, absent devices skip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.harness import Case, Shape, draw_inputs, run
from parity.harness.matrix import SHAPES
from tests import planted

SMALL = Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True)
MASKED = Case(SMALL, "random", "uniform")  # has a fully masked row


def _run(**kw):
    kw.setdefault("cases", [MASKED])
    kw.setdefault("dtypes", ("float32",))
    kw.setdefault("checks", ("forward",))
    kw.setdefault("device", "cpu")
    return run(**kw)


def _bad(report, impl_prefix):
    return [r for r in report.rows if r.status == "fail" and r.impl.startswith(impl_prefix) and r.reference == "oracle"]


def test_clean_run_passes():
    report = _run(checks=("forward", "gradient"), dtypes=("float64", "bfloat16"))
    assert report.ok, [r for r in report.rows if r.status != "pass"]
    assert {r.impl for r in report.rows} >= {"torch", "torch-fused", "jax", "jax-jit", "jax-fused"}


@pytest.mark.parametrize(
    "bug, stages",
    [
        (planted.transposed_q_weight("jax"), {"q"}),
        (planted.wrong_scale("torch"), {"scores"}),
        (planted.flipped_mask("jax"), {"scores", "weights"}),
        (planted.wrong_scale("torch-fused"), {"context"}),  # the fused path has no scores to look at
    ],
)
def test_planted_bug_turns_red_and_names_stage(bug, stages):
    report = _run(impls=("torch", "jax-jit", bug))
    assert not report.ok
    bad = _bad(report, bug.name)
    assert bad, "the planted bug was not caught"
    assert {r.stage for r in bad} <= stages and {r.stage for r in bad}, {r.stage for r in bad}
    clean = [r for r in report.rows if r.impl in ("torch", "jax-jit")]
    assert clean and all(r.status == "pass" for r in clean), "a clean implementation was blamed"


def test_planted_bug_in_gradients_is_caught():
    bug = planted.wrong_scale("torch")
    report = _run(checks=("gradient",), impls=("torch", bug))
    assert {r.stage for r in _bad(report, bug.name)} == {"scores"}


def test_same_seed_same_report_and_inputs(tmp_path):
    a = draw_inputs(MASKED, 7)
    b = draw_inputs(MASKED, 7)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("query", "key", "value", "keep", "cotangent"))
    assert not np.array_equal(a.query, draw_inputs(MASKED, 8).query)
    r1 = _run(seed=7, dtypes=("float32", "bfloat16"), checks=("forward", "gradient"), json_path=tmp_path / "a.json")
    r2 = _run(seed=7, dtypes=("float32", "bfloat16"), checks=("forward", "gradient"), json_path=tmp_path / "b.json")
    assert json.loads((tmp_path / "a.json").read_text())["rows"] == json.loads((tmp_path / "b.json").read_text())["rows"]
    assert r1.rows == r2.rows


def test_reports_written_with_environment(tmp_path):
    report = _run(json_path=tmp_path / "r.json", markdown_path=tmp_path / "r.md")
    data = json.loads((tmp_path / "r.json").read_text())
    env = data["environment"]
    for field in ("python", "jax", "jaxlib", "flax", "optax", "torch", "numpy", "seed", "jax_enable_x64",
                  "jax_default_matmul_precision", "torch_float32_matmul_precision", "device"):
        assert field in env
    assert env["jax_default_matmul_precision"] == "highest"
    row = data["rows"][0]
    for field in ("case", "check", "impl", "reference", "dtype", "device", "max_abs_err", "max_rel_err", "atol", "rtol", "status", "stage", "message"):
        assert field in row
    assert data["summary"]["total"] == len(report.rows)
    md = (tmp_path / "r.md").read_text()
    assert "## Environment" in md and "| case |" in md
    assert not list(tmp_path.glob("*.tmp")), "temp files left behind"


def test_an_error_becomes_a_row_and_the_rest_runs(monkeypatch):
    from parity.impls.torch_impls import TorchRunner

    def boom(self, *a, **k):
        raise MemoryError("planted OOM")

    monkeypatch.setattr(TorchRunner, "forward", boom)
    report = _run()
    errors = [r for r in report.rows if r.status == "error"]
    assert errors and all("planted OOM" in r.message for r in errors)
    assert any(r.status == "pass" and r.impl.startswith("jax") for r in report.rows)


def test_interrupt_writes_what_finished(monkeypatch, tmp_path):
    from parity.harness import runner

    calls = []
    real = runner._run_unit

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "_run_unit", interrupt_second)
    report = _run(dtypes=("float32", "float64"), json_path=tmp_path / "r.json")
    assert report.interrupted and not report.ok
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["interrupted"] and data["rows"]
    assert {r["dtype"] for r in data["rows"]} == {"float32"}


def test_absent_device_skips_cleanly():
    import jax

    try:
        jax.devices("tpu")
        pytest.skip("a TPU is present")
    except RuntimeError:
        pass
    report = _run(device="tpu")
    assert report.rows and all(r.status == "skip" for r in report.rows)
    assert "not present" in report.rows[0].message
    assert not report.ok and report.checked_nothing  # a run that checked nothing is not a pass


def test_every_row_spells_its_device_one_way():
    """torch's device prints "cpu" and JAX's "cpu:0": a report names both the same, as the skip and
    coverage rows do."""
    import jax
    import torch

    from parity.devices import device_label

    assert device_label(torch.device("cpu")) == device_label(jax.devices("cpu")[0]) == device_label("cpu") == "cpu:0"
    assert device_label("cuda:1") == device_label("gpu:1") == "gpu:1"
    with pytest.raises(ValueError, match="none of"):
        device_label("mps")
    with pytest.raises(TypeError, match="torch.device"):
        device_label(0)
    report = _run(checks=("forward", "gradient"), impls=("torch", "jax-jit"))
    assert {r.device for r in report.rows} == {"cpu:0"}, {r.device for r in report.rows}


def test_training_and_peers_pass():
    report = run(cases=[Case(SHAPES["self"], "random", "zero", train=True, peers=True)], dtypes=("float64",),
                 checks=("training", "peers"), device="cpu")
    assert report.ok, [r for r in report.rows if r.status != "pass"]
    checks = {r.check for r in report.rows}
    assert checks == {"training", "peers"}
    peers = {r.impl for r in report.rows if r.check == "peers"}
    assert peers >= {"torch-mha", "torch-sdpa-core", "flax-linen-mha", "flax-nnx-mha", "jax-dpa-core"}
    losses = [r for r in report.rows if r.quantity == "loss"]
    assert len(losses) == 3  # adam, adamw, sgd


def test_cli_quick_json(tmp_path, capsys):
    from parity.cli import main

    code = main(["--cases", "cross", "--dtypes", "float32", "--checks", "forward", "--device", "cpu", "--quick",
                 "--no-progress", "--json", str(tmp_path / "q.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pass" in out and (tmp_path / "q.json").exists()
    with pytest.raises(SystemExit):
        main(["--dtypes", "float8"])


@settings(max_examples=8, deadline=None)
@given(
    B=st.integers(1, 3), T=st.integers(1, 6), S=st.integers(1, 6), N=st.integers(1, 4), H=st.integers(1, 4),
    kv=st.integers(1, 4), rope=st.sampled_from([None, "half", "interleaved"]),
    biases=st.sampled_from([(True, True), (False, True), (True, False), (False, False)]),
    mask=st.sampled_from(["none", "padding", "causal", "random"]), policy=st.sampled_from(["nan", "zero", "uniform"]),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_and_mask_passes(B, T, S, N, H, kv, rope, biases, mask, policy, seed):
    """Any sizes, mask and policy, and any layer: K = gcd(N, kv) key/value heads, RoPE where H is even, any biases."""
    import math

    layer = dict(num_kv_heads=math.gcd(N, kv), rope=rope if H % 2 == 0 else None, qkv_bias=biases[0],
                 out_bias=biases[1])
    case = Case(Shape("p", B=B, T=T, S=S, E=N * H, N=N, cross=True, **layer), mask, policy)
    report = run(cases=[case], dtypes=("float64",), checks=("forward",), impls=("torch", "jax-jit"), device="cpu", seed=seed)
    assert report.ok, [r for r in report.rows if r.status != "pass"]
