"""The harness on grouped-query, multi-query, rotary and bias-free layers.

Our modules pass the variant cases; a layer that declares no variants skips them with a row
naming the feature and still passes the classic ones; a layer that declares them receives the
`mha_spec.Problem` and the very positions the oracle rotates by; and the three classic porting
bugs (key/value heads tiled instead of repeated, the RoPE convention swapped, key positions off
by one) fail with the first diverging stage named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha_torch.attention
from mha_spec import VARIANT_FEATURES, AttentionConfig, Problem
from parity import draw
from parity.convert import CANONICAL_KEYS
from parity.harness import Case, Shape, draw_inputs, run
from parity.harness.matrix import CASE_SETS, SHAPES, VARIANT_SHAPES, default_matrix, modern_matrix
from parity.impls import builtin, implementation
from tests import planted

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
    mha_torch.attention.rotate = lambda x, pos, theta, convention: real(x, pos, theta, other[convention])
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


# ---------------------------------------------------------------- tests


def test_our_modules_pass_the_llama_case_on_both_paths():
    """Grouped heads, RoPE at drawn positions and no biases, with an empty key row, through the JAX
    runner (int32 positions, bias-free parameters) and the torch one; the other variant cases run
    through the torch runner in `torch_report` and all of them in `mha-parity --cases modern`."""
    impls = ("torch", "torch-fused", "jax-jit", "jax-fused")
    report = run(cases=[LLAMA], dtypes=("float64",), checks=("forward", "gradient"), impls=impls, device="cpu")
    assert report.ok, [r for r in report.rows if r.status != "pass"]
    for impl in impls:
        mine = {r.check for r in _rows(report, impl) if r.status == "pass" and r.reference == "oracle"}
        assert mine == {"forward", "gradient"}, impl


def test_an_undeclared_layer_skips_the_variant_cases_naming_them_and_passes_the_classic_one(torch_report):
    on_llama = _rows(torch_report, "classic-port", LLAMA)
    assert on_llama and all(r.status == "skip" for r in on_llama)
    assert "rope-interleaved" in _rows(torch_report, "classic-port", INTERLEAVED)[0].message
    for feature in ("grouped", "rope-half", "no-qkv-bias", "no-out-bias"):
        assert feature in on_llama[0].message
    assert "declares no variants" in on_llama[0].message
    on_classic = _rows(torch_report, "classic-port", CLASSIC)
    assert {r.status for r in on_classic} == {"pass"} and {r.check for r in on_classic} == {"forward", "gradient"}


def test_a_declared_layer_receives_the_problem_and_the_oracles_positions(torch_report):
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
def test_a_porting_bug_fails_naming_its_first_diverging_stage(torch_report, bug):
    cases = (LLAMA,) if bug == TILE.name else ROPE  # tiling K=N heads changes nothing
    for case in cases:
        bad = [r for r in _rows(torch_report, bug, case) if r.status == "fail" and r.reference == "oracle"]
        assert bad, f"{bug} was not caught on {case.name}"
        assert {r.check for r in bad if r.quantity == "output"} == {"forward", "gradient"}
        assert {r.stage for r in bad if r.check == "forward"} == {PLANTED[bug]}, case.name
    on_classic = _rows(torch_report, bug, CLASSIC)
    assert on_classic and {r.status for r in on_classic} == {"pass"}  # nothing to get wrong there
    assert not [r for r in torch_report.rows if r.impl in ("torch", "llama-port") and r.status != "pass"]


def test_the_declarations_are_the_one_place_that_skips():
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


def test_a_classic_layer_draws_what_it_always_drew():
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


def test_rope_cases_draw_increasing_non_default_positions():
    for case in (LLAMA, Case(VARIANT_SHAPES["rope-interleaved"], "none")):
        x, s = draw_inputs(case, 5), case.shape
        assert x.positions.dtype == np.int64 and x.positions.shape == (s.B, s.T) and x.key_positions.shape == (s.B, s.S)
        for pos in (x.positions, x.key_positions):
            assert (np.diff(pos, axis=-1) > 0).all() and (pos[:, 0] > 0).all()
        assert np.array_equal(x.positions, x.key_positions) == (not s.cross)
        assert x.in_dtype(np.float32).position_kw.keys() == {"positions", "key_positions"}
    assert draw_inputs(CLASSIC, 5).position_kw == {}


def test_the_case_sets_cover_every_feature():
    modern, default = modern_matrix(), default_matrix()
    for feature in VARIANT_FEATURES:
        assert any(feature in c.config.features for c in modern), feature
    assert any(c.config.features for c in default)
    assert {c.name for c in default if c.config.features} <= {c.name for c in modern}
    assert any(c.train and c.config.features for c in modern) and any(c.peers and c.config.features for c in modern)
    assert set(CASE_SETS) >= {"default", "quick", "modern"}
    assert all(not c.config.features for c in default if c.shape.name in SHAPES)
    from parity.harness.runner import _plan

    plan = _plan(None, ("modern",), None, None, None, "cpu", False, False, ())
    assert [c.name for c in plan.cases] == [c.name for c in modern]
    plan = _plan("modern", ("llama",), None, None, None, "cpu", False, False, ())
    assert {c.shape.name for c in plan.cases} == {"llama"}
    with pytest.raises(ValueError, match="unknown case set"):
        _plan("nope", (), None, None, None, "cpu", False, False, ())
    from parity.cli import build_parser

    assert "modern" in " ".join(build_parser().format_help().split())


def test_fixed_weights_replace_the_draw_and_must_be_the_cases_layer():
    sd = draw.state_dict(np.random.default_rng(9), LLAMA.config)
    x = draw_inputs(LLAMA, 0, {k: v.astype(np.float32) for k, v in sd.items()})
    assert all(np.array_equal(x.state_dict[k], sd[k].astype(np.float32)) for k in sd)
    assert np.array_equal(x.query, draw_inputs(LLAMA, 0).query)  # the rest of the draw is the same
    with pytest.raises(ValueError, match=r"missing \['k_proj.bias', 'q_proj.bias', 'v_proj.bias'\]"):
        draw_inputs(Case(VARIANT_SHAPES["no-out-bias"], "none"), 0, sd)
    wrong = dict(sd, **{"k_proj.weight": np.zeros((32, 32))})
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(32, 32\), expected \(8, 32\)"):
        draw_inputs(LLAMA, 0, wrong)
