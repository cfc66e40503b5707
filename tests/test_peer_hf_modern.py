"""The families' own transformers attention modules as peers: hf-qwen3, hf-gemma2, hf-gemma3, hf-olmo2,
hf-gpt-oss, each run on our weights and judged by the peers check (float64 runs at float32's entry:
transformers computes cos/sin, the QK-norm and the softmax in float32).

Each declares exactly the features it runs and requires its family's own; on its family's layer it
passes forward and gradients against the oracle and our modules, and a Llama layer is a skip row.
hf-gemma2 runs fully masked rows too: their gradient flows through the cap, in transformers and the oracle.
hf-qwen3 and hf-gemma3 run each other's norm offset (the weight goes in as offset + w in the module's
spelling), so a Gemma 3 layer without a scale of its own is judged by both.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_spec import AttentionConfig, Problem
from parity import reference
from parity.harness import Case, Shape, run
from parity.harness import runner as harness_runner
from parity.impls import registry
from parity.tolerances import tolerance_for

NEW = ("hf-qwen3", "hf-gemma2", "hf-gemma3", "hf-olmo2", "hf-gpt-oss")
_COMMON = dict(B=2, T=5, S=5, E=12, N=3, cross=False, rope="half", rope_theta=500.0)
SHAPES = {
    "hf-qwen3": Shape("peer-qwen3", **_COMMON, num_kv_heads=1, head_dim=8, qkv_bias=False, out_bias=False,
                      qk_norm="head", qk_norm_eps=1e-5),
    "hf-gemma2": Shape("peer-gemma2", **_COMMON, num_kv_heads=1, head_dim=8, qkv_bias=False, out_bias=False,
                       scale=0.5, softcap=0.5),
    "hf-gemma3": Shape("peer-gemma3", **_COMMON, head_dim=6, qkv_bias=False, out_bias=False, qk_norm="head",
                       qk_norm_offset=1.0),  # no scale of its own: hf-qwen3 runs it too
    "hf-olmo2": Shape("peer-olmo2", **_COMMON, head_dim=4, qkv_bias=False, out_bias=False, qk_norm="flat",
                      qk_norm_eps=1e-5),
    "hf-gpt-oss": Shape("peer-gpt-oss", **_COMMON, num_kv_heads=1, head_dim=6, sinks=True),
}
CASES = [Case(s, mask, policy, peers=True, jax_eager=False, dtypes=dtypes) for s in SHAPES.values()
         for mask, policy, dtypes in (("causal", "nan", ("float64", "float32")), ("padding", "uniform", ("float32",)))]


@pytest.fixture(scope="module")
def report():
    with pytest.MonkeyPatch.context() as mp:
        select = harness_runner.select
        mp.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
            i for i in select(role, *a, **kw) if role != "peer" or i.name in NEW))
        return run(cases=CASES, checks=("peers",), dtypes=("float64", "float32"), device="cpu")


@pytest.mark.parametrize("name", NEW)
def test_each_peer_passes_on_its_family_s_layer(report, name):
    rows = [r for r in report.rows if r.impl == name]
    assert not [r for r in rows if r.status in ("fail", "error")], [r for r in rows if r.status in ("fail", "error")]
    passed = {(r.case, r.reference, r.dtype, r.quantity) for r in rows if r.status == "pass"}
    own = f"{SHAPES[name].name}/causal/nan"
    for dtype in ("float64", "float32"):
        assert (own, "oracle", dtype, "output") in passed, (name, dtype)
    assert any(c == own and q != "output" for c, _, _, q in passed), name  # its gradients are judged
    padded = f"{SHAPES[name].name}/padding/uniform"
    assert any(c == padded and d == "float32" for c, _, d, _ in passed), name  # fully masked rows too


def test_hf_qwen3_runs_gemma3_s_offset(report):
    passed = {r.case for r in report.rows if r.impl == "hf-qwen3" and r.status == "pass"}
    assert "peer-gemma3/causal/nan" in passed


@pytest.mark.parametrize("name", NEW)
def test_each_peer_declares_what_it_runs(name):
    impl = next(i for i in registry.select("peer") if i.name == name)
    assert impl.unsupported("float32", Problem(SHAPES[name].config, 2, 5, 5).config) is None
    llama = AttentionConfig(12, 3, num_kv_heads=1, qkv_bias=False, out_bias=False, rope="half", rope_theta=500.0)
    assert "requires" in impl.unsupported("float32", llama)
    others = [SHAPES[o].config for o in NEW if o != name]
    skipped = [c for c in others if impl.unsupported("float32", c) is not None]
    assert len(skipped) >= 3, name  # the other families' features it does not run


def _peer(name, sd, config, dtype="float32"):
    import torch

    impl = next(i for i in registry.select("peer") if i.name == name)
    return impl.make(sd, config.num_heads, "nan", torch.device("cpu"), problem=Problem(config, 2, 5, 5))


@pytest.mark.parametrize("name, slip", [
    ("hf-gemma2", dict(softcap=None)), ("hf-gemma3", dict(qk_norm_offset=0.0)), ("hf-qwen3", dict(qk_norm_eps=1e-1)),
])
def test_a_peer_computes_its_family_s_feature(name, slip):
    """The peer's output is the oracle's for its layer, and far from the layer with the feature slipped."""
    import torch

    from parity import draw

    config = SHAPES[name].config
    sd = draw.state_dict(np.random.default_rng(4), config)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 12))
    keep = np.tril(np.ones((5, 5), bool))[None].repeat(2, 0)
    pos = np.arange(5)[None].repeat(2, 0) + np.array([[0], [4]])
    fn = _peer(name, {k: v.astype(np.float32) for k, v in sd.items()}, config)
    xt, pt = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(pos)
    got = fn(xt, xt, xt, torch.from_numpy(keep), positions=pt, key_positions=pt).numpy()
    kw = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, rope="half", rope_theta=500.0,
              positions=pos, key_positions=pos, qk_norm=config.qk_norm, scale=config.scale, softcap=config.softcap)
    if config.qk_norm:
        kw.update(qk_norm_eps=config.qk_norm_eps, qk_norm_offset=config.qk_norm_offset)
    bar = tolerance_for("float32").forward
    right = reference.forward(sd, x, x, x, keep, **kw).output
    wrong = reference.forward(sd, x, x, x, keep, **dict(kw, **slip)).output
    scale = np.abs(right).max()
    assert np.abs(got - right).max() <= bar.atol + bar.rtol * scale
    assert np.abs(got - wrong).max() > 20 * (bar.atol + bar.rtol * scale)
