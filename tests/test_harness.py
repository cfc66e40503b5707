"""The parity harness tested on itself: planted bugs turn it red and name the stage,
same seed gives the same report, reports are written whole, absent devices skip; and on
grouped-query, multi-query, rotary and bias-free layers (TestVariants)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mha_torch.attention
from mha_spec import VARIANT_FEATURES, AttentionConfig, Problem
from parity import draw
from parity.convert import CANONICAL_KEYS
from parity.harness import Case, Shape, draw_inputs, run
from parity.harness.matrix import CASE_SETS, SHAPES, VARIANT_SHAPES, default_matrix, modern_matrix
from parity.impls import builtin, implementation
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


# ---------------------------------------------------------------- grouped-query, multi-query, rotary and bias-free layers

LLAMA = Case(VARIANT_SHAPES["llama"], "padding", "uniform")  # N=8, K=2, RoPE half, no biases; an empty key row
INTERLEAVED = Case(VARIANT_SHAPES["rope-interleaved"], "causal", "zero")  # cross, rope_theta=500, with biases
HALF = Case(VARIANT_SHAPES["rope-half"], "random", "nan")  # cross, T < S, rope_theta=1e6; a fully masked row
CLASSIC = Case(Shape("c", B=3, T=5, S=7, E=12, N=3, cross=True), "random", "nan")
ROPE = (LLAMA, INTERLEAVED, HALF)


# ---------------------------------------------------------------- a port written as a user would


def _rope(x, pos, cfg: AttentionConfig):
    """Rotary embedding from its definition: pair i turns by pos * theta ** (-2i / H)."""
    H = x.shape[-1]
    inv_freq = cfg.rope_theta ** (-torch.arange(0, H, 2, dtype=torch.float64) / H)
    angles = pos[:, None, :, None].to(torch.float64) * inv_freq  # (B, 1, L, H/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if cfg.rope == "half":
        x1, x2 = x[..., : H // 2], x[..., H // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _attention(p, query, key, value, keep, cfg: AttentionConfig, positions=None, key_positions=None, expand="repeat"):
    """(output, stages) of a grouped/rotary/bias-optional layer in plain torch, without mha_torch."""
    B, T, _ = query.shape
    S, N, K, H = key.shape[1], cfg.num_heads, cfg.kv_heads, cfg.head_size

    def heads(x, name, n, L):  # (B, L, E) -> (B, n, L, H)
        return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias")).view(B, L, n, H).transpose(1, 2)

    q, k, v = heads(query, "q_proj", N, T), heads(key, "k_proj", K, S), heads(value, "v_proj", K, S)
    stages = {"q": q, "k": k, "v": v}
    if cfg.rope is not None:
        q, k = _rope(q, positions, cfg), _rope(k, key_positions, cfg)
        stages.update(q_rot=q, k_rot=k)
    G = N // K
    if expand == "repeat":  # query head h reads key/value head h // G
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    else:  # the porting bug: query head h reads key/value head h % K
        k, v = k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(H)
    att = scores if keep is None else scores.masked_fill(~keep, float("-inf"))
    weights = F.softmax(att, dim=-1)  # a row with no key is NaN: masked_rows="nan"
    context = (weights @ v).transpose(1, 2).reshape(B, T, N * H)
    output = F.linear(context, p["out_proj.weight"], p.get("out_proj.bias"))
    stages.update(scores=scores, weights=weights, context=context, output=output)
    return output, stages


RECEIVED = []  # (problem, positions) of every call of a declared port


def _declared_port(name: str, expand: str = "repeat"):
    @implementation(name=name, framework="torch", masked_rows="nan", variants=VARIANT_FEATURES)
    def factory(state_dict, num_heads, *, dtype, device, problem):
        cfg = problem.config

        def fn(p, query, key, value, keep, **positions):
            RECEIVED.append((problem, {k: v.numpy().copy() for k, v in positions.items()}))
            return _attention(p, query, key, value, keep, cfg, expand=expand, **positions)[0]

        fn.intermediates = lambda *a, **positions: _attention(*a, cfg, expand=expand, **positions)[1]
        return fn

    return factory


@implementation(name="classic-port", framework="torch", masked_rows="nan")
def classic_port(state_dict, num_heads, *, dtype, device):
    """Written before variants existed: no declaration, no problem, no positions."""
    cfg = AttentionConfig(state_dict["q_proj.weight"].shape[1], num_heads)
    return lambda p, query, key, value, keep: _attention(p, query, key, value, keep, cfg)[0]


# ---------------------------------------------------------------- planted bugs wrapping our torch module


@contextlib.contextmanager
def _swapped_rope_convention():
    real = mha_torch.attention.rotate
    other = {"half": "interleaved", "interleaved": "half"}
    mha_torch.attention.rotate = lambda x, pos, config, max_position=None: real(
        x, pos, dataclasses.replace(config, rope=other[config.rope]), max_position)
    try:
        yield
    finally:
        mha_torch.attention.rotate = real


def _rope_swapped(fn):
    @functools.wraps(fn)
    def call(*args, **kw):
        with _swapped_rope_convention():
            return fn(*args, **kw)

    return call


def _key_positions_off_by_one(fn):
    @functools.wraps(fn)
    def call(*args, key_positions=None, **kw):
        return fn(*args, key_positions=None if key_positions is None else key_positions + 1, **kw)

    return call


TILE = _declared_port("tile-port", expand="tile")
ROPE_SWAPPED = planted.wrap_torch_variants("rope-swapped", _rope_swapped)
KEY_POS = planted.wrap_torch_variants("key-positions-plus-one", _key_positions_off_by_one)
PORT = _declared_port("llama-port")
PLANTED = {TILE.name: "scores", ROPE_SWAPPED.name: "q_rot", KEY_POS.name: "k_rot"}
"""Where each bug first shows. Tile: q, k, v and their rotations have the oracle's K key/value heads
and are right; the scores are the first stage that pairs a query head with a key/value head."""


@pytest.fixture(scope="module")
def torch_report():
    RECEIVED.clear()
    return run(cases=[*ROPE, CLASSIC], dtypes=("float64",), checks=("forward", "gradient"), device="cpu",
               impls=("torch", classic_port, PORT, TILE, ROPE_SWAPPED, KEY_POS))


def _rows(report, impl, case=None):
    return [r for r in report.rows if r.impl == impl and (case is None or r.case == case.name)]


class TestVariants:
    """The harness on grouped-query, multi-query, rotary and bias-free layers.

    Our modules pass the variant cases; a layer that declares no variants skips them with a row
    naming the feature and still passes the classic ones; a layer that declares them receives the
    `mha_spec.Problem` and the very positions the oracle rotates by; and the three classic porting
    bugs (key/value heads tiled instead of repeated, the RoPE convention swapped, key positions off
    by one) fail with the first diverging stage named."""

    def test_our_modules_pass_the_llama_case_on_both_paths(self):
        """Grouped heads, RoPE at drawn positions and no biases, with an empty key row, through the JAX
        runner (int32 positions, bias-free parameters) and the torch one; the other variant cases run
        through the torch runner in `torch_report` and all of them in `mha-parity --cases modern`."""
        impls = ("torch", "torch-fused", "jax-jit", "jax-fused")
        report = run(cases=[LLAMA], dtypes=("float64",), checks=("forward", "gradient"), impls=impls, device="cpu")
        assert report.ok, [r for r in report.rows if r.status != "pass"]
        for impl in impls:
            mine = {r.check for r in _rows(report, impl) if r.status == "pass" and r.reference == "oracle"}
            assert mine == {"forward", "gradient"}, impl

    def test_an_undeclared_layer_skips_the_variant_cases_naming_them_and_passes_the_classic_one(self, torch_report):
        on_llama = _rows(torch_report, "classic-port", LLAMA)
        assert on_llama and all(r.status == "skip" for r in on_llama)
        assert "rope-interleaved" in _rows(torch_report, "classic-port", INTERLEAVED)[0].message
        for feature in ("grouped", "rope-half", "no-qkv-bias", "no-out-bias"):
            assert feature in on_llama[0].message
        assert "declares no variants" in on_llama[0].message
        on_classic = _rows(torch_report, "classic-port", CLASSIC)
        assert {r.status for r in on_classic} == {"pass"} and {r.check for r in on_classic} == {"forward", "gradient"}

    def test_a_declared_layer_receives_the_problem_and_the_oracles_positions(self, torch_report):
        mine = _rows(torch_report, "llama-port")
        assert mine and {r.status for r in mine} == {"pass"}, [r for r in mine if r.status != "pass"]
        for case in (*ROPE, CLASSIC):
            assert {r.check for r in mine if r.case == case.name} == {"forward", "gradient"}, case.name
        for case in (*ROPE, CLASSIC):
            # The port declares masked_rows="nan": its problem carries that policy.
            expected = dataclasses.replace(case.problem, config=dataclasses.replace(case.config, masked_rows="nan"))
            calls = [pos for problem, pos in RECEIVED if problem == expected]
            assert calls, f"the port was never built with the problem of {case.name}"
            drawn = draw_inputs(case, 0)
            for got in calls:  # forward, gradient, intermediates: the oracle's positions, or none without RoPE
                assert set(got) == set(drawn.position_kw)
                for name, pos in got.items():
                    np.testing.assert_array_equal(pos, drawn.position_kw[name])
        assert {p for p, _ in RECEIVED} <= {dataclasses.replace(c.problem, config=dataclasses.replace(c.config, masked_rows="nan"))
                                            for c in (*ROPE, CLASSIC)}
        drawn = draw_inputs(LLAMA, 0)
        assert not (drawn.positions == np.arange(LLAMA.shape.T)).all(axis=-1).any()  # not the default

    @pytest.mark.parametrize("bug", sorted(PLANTED))
    def test_a_porting_bug_fails_naming_its_first_diverging_stage(self, torch_report, bug):
        cases = (LLAMA,) if bug == TILE.name else ROPE  # tiling K=N heads changes nothing
        for case in cases:
            bad = [r for r in _rows(torch_report, bug, case) if r.status == "fail" and r.reference == "oracle"]
            assert bad, f"{bug} was not caught on {case.name}"
            assert {r.check for r in bad if r.quantity == "output"} == {"forward", "gradient"}
            assert {r.stage for r in bad if r.check == "forward"} == {PLANTED[bug]}, case.name
        on_classic = _rows(torch_report, bug, CLASSIC)
        assert on_classic and {r.status for r in on_classic} == {"pass"}  # nothing to get wrong there
        assert not [r for r in torch_report.rows if r.impl in ("torch", "llama-port") and r.status != "pass"]

    def test_the_declarations_are_the_one_place_that_skips(self):
        ours, classic = builtin("torch"), classic_port
        assert ours.variants == VARIANT_FEATURES and builtin("jax-jit").variants == VARIANT_FEATURES
        assert builtin("torch-mha").variants == ()
        assert ours.unsupported("float32", LLAMA.config) is None
        assert classic.unsupported("float32", CLASSIC.config) is None
        why = classic.unsupported("float32", VARIANT_SHAPES["mqa"].config)
        assert "grouped" in why and "rope" not in why
        only_grouped = dataclasses.replace(PORT, name="only-grouped", variants=("grouped",))
        why = only_grouped.unsupported("float32", VARIANT_SHAPES["rope-interleaved"].config)
        assert "variants=grouped" in why and "rope-interleaved" in why
        with pytest.raises(ValueError, match="variants must be a tuple"):
            dataclasses.replace(PORT, variants=("gqa",))
        sd = draw.state_dict(np.random.default_rng(0), LLAMA.config)
        with pytest.raises(TypeError, match="problem="):
            PORT.make(sd, 8, "nan", "cpu")
        with pytest.raises(ValueError, match="not the problem's layer"):
            PORT.make(sd, 8, "nan", "cpu", Problem(VARIANT_SHAPES["gqa"].config, 2, 5, 7))

    def test_a_classic_layer_draws_what_it_always_drew(self):
        """The historical draw, written out: U(-1/√E, 1/√E) over the eight canonical entries in order,
        (E, E) weights and (E,) biases. Seeded case numbers depend on it."""
        config = AttentionConfig(15, 5)
        got = draw.state_dict(np.random.default_rng(3), config)
        rng, bound = np.random.default_rng(3), 1 / np.sqrt(15)
        for name in CANONICAL_KEYS:
            np.testing.assert_array_equal(got[name], rng.uniform(-bound, bound, (15, 15) if name.endswith("weight") else (15,)))
        bias_free = draw.state_dict(np.random.default_rng(3), VARIANT_SHAPES["llama"].config)
        assert set(bias_free) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}
        assert bias_free["k_proj.weight"].shape == (2 * 4, 32)

    def test_rope_cases_draw_increasing_non_default_positions(self):
        for case in (LLAMA, Case(VARIANT_SHAPES["rope-interleaved"], "none")):
            x, s = draw_inputs(case, 5), case.shape
            assert x.positions.dtype == np.int64 and x.positions.shape == (s.B, s.T) and x.key_positions.shape == (s.B, s.S)
            for pos in (x.positions, x.key_positions):
                assert (np.diff(pos, axis=-1) > 0).all() and (pos[:, 0] > 0).all()
            assert np.array_equal(x.positions, x.key_positions) == (not s.cross)
            assert x.in_dtype(np.float32).position_kw.keys() == {"positions", "key_positions"}
        assert draw_inputs(CLASSIC, 5).position_kw == {}

    def test_the_case_sets_cover_every_feature(self):
        modern, default = modern_matrix(), default_matrix()
        for feature in VARIANT_FEATURES:
            assert any(feature in c.config.features for c in modern), feature
        assert any(c.config.features for c in default)
        assert {c.name for c in default if c.config.features} <= {c.name for c in modern}
        assert any(c.train and c.config.features for c in modern) and any(c.peers and c.config.features for c in modern)
        assert set(CASE_SETS) >= {"default", "quick", "modern"}
        assert all(not c.config.features for c in default if c.shape.name in SHAPES)
        from parity.harness.runner import RunRequest, plan_run

        plan = plan_run(RunRequest(case_filter=("modern",), device="cpu"))
        assert [c.name for c in plan.cases] == [c.name for c in modern]
        plan = plan_run(RunRequest(cases="modern", case_filter=("llama",), device="cpu"))
        assert {c.shape.name for c in plan.cases} == {"llama"}
        with pytest.raises(ValueError, match="unknown case set"):
            plan_run(RunRequest(cases="nope", device="cpu"))
        from parity.cli import build_parser

        assert "modern" in " ".join(build_parser().format_help().split())

    def test_fixed_weights_replace_the_draw_and_must_be_the_cases_layer(self):
        sd = draw.state_dict(np.random.default_rng(9), LLAMA.config)
        x = draw_inputs(LLAMA, 0, {k: v.astype(np.float32) for k, v in sd.items()})
        assert all(np.array_equal(x.state_dict[k], sd[k].astype(np.float32)) for k in sd)
        assert np.array_equal(x.query, draw_inputs(LLAMA, 0).query)  # the rest of the draw is the same
        with pytest.raises(ValueError, match=r"missing \['k_proj.bias', 'q_proj.bias', 'v_proj.bias'\]"):
            draw_inputs(Case(VARIANT_SHAPES["no-out-bias"], "none"), 0, sd)
        wrong = dict(sd, **{"k_proj.weight": np.zeros((32, 32))})
        with pytest.raises(ValueError, match=r"k_proj.weight has shape \(32, 32\), expected \(8, 32\)"):
            draw_inputs(LLAMA, 0, wrong)
