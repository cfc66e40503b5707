"""The harness on the layers after Llama (`--cases modern`: Qwen3, Gemma 2/3, OLMo 2, GPT-OSS shapes):
our torch module passes against the oracle, and a port with one of the slips these layers invite is red,
named at the stage where it leaves the oracle, in float32 and in float64.

The ports are our torch module built with one field wrong (`dataclasses.replace` of the case's layer):
Gemma's norm weight read as w instead of 1 + w, the sinks dropped, the soft-cap forgotten, Gemma's
scale taken as H**-0.5, the norm's eps ignored (0). Each is what a port written from a Llama layer does.
And the norm weights and sinks frozen (a port whose optimizer never sees them): its forward is right,
its gradient rows are red (those gradients are judged, as zero where they are missing).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mha_spec import VARIANT_FEATURES
from parity import convert
from parity.harness.matrix import LLAMA4_SHAPES, MODERN_SHAPES, modern_matrix
from parity.harness.runner import run
from parity.impls import Implementation
from parity.impls.registry import layer_kwargs


def _port(name: str, drop=(), frozen=(), **wrong):
    """Our torch module on the case's layer with `wrong` fields, the tensors `drop` left out and those of
    `frozen` kept as the module's own constants (not taken from the parameters: no gradient reaches them)."""

    def factory(sd, num_heads, *, dtype, device, masked_rows, problem):
        import torch
        from torch.func import functional_call

        kept = {k: v for k, v in sd.items() if k not in drop}
        layer = {**layer_kwargs(sd, num_heads, problem), **wrong}
        m = convert.to_torch(kept, num_heads, masked_rows=masked_rows, **layer).to(device)
        params = {k for k, _ in m.named_parameters() if k not in frozen}

        def fn(p, query, key, value, mask, **positions):
            return functional_call(m, {k: v for k, v in p.items() if k in params}, (query, key, value, mask),
                                   {"need_weights": True, **positions})

        def intermediates(p, query, key, value, mask, **positions):
            kw = {"need_weights": True, "return_intermediates": True, **positions}
            return functional_call(m, {k: v for k, v in p.items() if k in params}, (query, key, value, mask), kw)[2]

        fn.intermediates = intermediates
        del torch
        return fn

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=VARIANT_FEATURES, uses_params=True)


PORTS = {  # port -> (the case it is judged on, the stage it must be named at)
    "norm-without-offset": (_port("norm-without-offset", qk_norm_offset=0.0), "gemma3", "q_norm"),
    "sinks-dropped": (_port("sinks-dropped", drop=("sinks",)), "gpt-oss", "weights"),
    "softcap-forgotten": (_port("softcap-forgotten", softcap=None), "gemma2", "scores"),
    "default-scale": (_port("default-scale", scale=None), "gemma3", "scores"),
    "norm-eps-ignored": (_port("norm-eps-ignored", qk_norm_eps=0.0), "olmo2", "q_norm"),
    # Llama 4: the L2 norm after RoPE forgotten; the NoPE layers' temperature forgotten (attn_scale 0: factor 1)
    "l2-norm-forgotten": (_port("l2-norm-forgotten", qk_norm=None, qk_norm_eps=1e-6), "l2-llama4", "q_rot"),
    "temperature-forgotten": (_port("temperature-forgotten", attn_scale=0.0), "nope-llama4", "scores"),
}


def test_every_new_feature_has_a_case_and_our_torch_module_passes_them():
    shapes = {**MODERN_SHAPES, **LLAMA4_SHAPES}
    cases = [c for c in modern_matrix() if c.shape.name in shapes or c.shape.name.startswith("decode-")]
    features = {f for c in cases for f in c.config.features}
    assert set(VARIANT_FEATURES[5:]) <= features
    report = run(cases="modern", case_filter=tuple(f"{n}*" for n in shapes), dtypes=("float64", "float32"),
                 checks=("forward", "gradient"), impls=("torch", "torch-fused"), device="cpu")
    ran = [r for r in report.rows if r.status != "skip"]
    assert ran and all(r.status == "pass" for r in ran), [r for r in ran if r.status != "pass"][:3]
    assert {r.case.split("/")[0] for r in ran} == set(shapes)


@pytest.mark.parametrize("port", PORTS)
def test_a_port_slip_is_red_at_its_stage(port):
    impl, shape, stage = PORTS[port]
    report = run(cases="modern", case_filter=(f"{shape}/*",), dtypes=("float64", "float32"), checks=("forward",),
                 impls=(impl,), device="cpu")
    rows = [r for r in report.rows if r.impl == port and r.reference == "oracle" and r.quantity == "output"]
    assert {r.dtype for r in rows} == {"float64", "float32"}
    for r in rows:
        assert r.status == "fail", (port, r)
        assert r.stage == stage, (port, r.stage, r.message)
        assert r.margin > 3, (port, r.margin)  # measured: 6.5 (eps ignored, float32), the others >= 1.5e4


def test_the_drawn_layers_hide_nothing():
    """The case's draws: norm weights away from 1 - offset, sinks not 0, the soft-cap binding."""
    from parity import reference
    from parity.harness.matrix import draw_inputs

    by_shape = {c.shape.name: c for c in modern_matrix()}
    for name in MODERN_SHAPES:
        x = draw_inputs(by_shape[name], 0)
        for key in ("q_norm.weight", "k_norm.weight"):
            if key in x.state_dict:
                w = x.state_dict[key] + by_shape[name].shape.qk_norm_offset
                assert np.abs(w - 1).max() > 0.2, (name, key)
        if "sinks" in x.state_dict:
            assert np.abs(x.state_dict["sinks"]).min() > 0.01
    gemma2 = by_shape["gemma2"]
    x = draw_inputs(gemma2, 0)
    s = dataclasses.replace(gemma2.shape)
    f = reference.forward(x.state_dict, x.query, x.key, x.value, x.keep, num_heads=s.N, num_kv_heads=s.num_kv_heads,
                          rope=s.rope, rope_theta=s.rope_theta, scale=s.scale, softcap=s.softcap, **x.position_kw)
    finite = np.abs(f.scores[np.isfinite(f.scores)])
    assert finite.max() > 0.5 * s.softcap  # tanh(s / cap) is visibly not s / cap there


@pytest.mark.parametrize("shape, frozen", [("gemma3", ("q_norm.weight", "k_norm.weight")), ("gpt-oss", ("sinks",))])
def test_frozen_norm_weights_or_sinks_are_red_in_the_gradient_check(shape, frozen):
    impl = _port(f"frozen-{shape}", frozen=frozen)
    report = run(cases="modern", case_filter=(f"{shape}/*",), dtypes=("float32",), checks=("forward", "gradient"),
                 impls=(impl,), device="cpu")
    mine = [r for r in report.rows if r.impl == impl.name and r.reference == "oracle"]
    assert all(r.status == "pass" for r in mine if r.check == "forward"), mine
    params = [r for r in mine if r.check == "gradient" and r.quantity == "d_params"]
    assert params and all(r.status == "fail" for r in params), params
    assert all(f"no gradient for {', '.join(frozen)}" in r.message for r in params), [r.message for r in params]


def test_layer_flag_takes_the_new_fields_and_refuses_what_it_would_ignore():
    import argparse

    from parity.cli_args import parse_layer

    c = parse_layer("E=12,N=3,K=1,H=8,rope=half,qk_norm=head,qk_norm_offset=1,scale=0.25,softcap=30,sinks=yes")
    assert (c.head_dim, c.qk_norm, c.qk_norm_offset, c.scale, c.softcap, c.sinks) == (8, "head", 1.0, 0.25, 30.0, True)
    assert parse_layer("E=12,N=3,qk_norm=flat,qk_norm_eps=1e-5").qk_norm_eps == 1e-5
    for bad, words in (("E=12,N=3,qk_norm_eps=1e-5", "without qk_norm"), ("E=12,N=3,sinks=maybe", "sinks='maybe'"),
                       ("E=12,N=3,qk_norm=axis", "qk_norm='axis'"), ("E=12,N=3,scale=-1", "positive"),
                       ("E=12,N=3,softcap=0", "positive")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse_layer(bad)


def test_a_soft_capped_fully_masked_row_s_gradient_flows_through_the_cap_as_gemma2s_does():
    """transformers adds its finfo.min mask after Gemma 2's cap: a fully masked row's gradient ("flow") goes
    through the cap's derivative at each key's own logit. The oracle takes it so, and hf-gemma2 agrees on a
    padded case whose rows include fully masked ones (with the derivative taken as 1 there it was red,
    margins 6.5e3 and 2.1e4)."""
    from parity.harness.matrix import Shape, layer_cases

    shape = Shape("capped", B=3, T=5, S=5, E=12, N=3, cross=False, num_kv_heads=1, head_dim=8, qkv_bias=False,
                  out_bias=False, rope="half", rope_theta=500.0, scale=0.5, softcap=0.5)
    cases = [c for c in layer_cases(shape, dtypes=("float32",)) if c.mask == "padding"]
    from parity.harness.matrix import draw_inputs

    keep = draw_inputs(cases[0], 0).keep
    assert not keep.any(axis=-1).all()  # the premise: a row keeps no key
    report = run(cases=cases, checks=("peers",), impls=("torch",), device="cpu")
    rows = [r for r in report.rows if r.impl == "hf-gemma2" and r.reference == "oracle"]
    assert {r.quantity for r in rows} >= {"output", "d_input", "d_params"}
    assert all(r.status == "pass" for r in rows), rows


def test_a_gemma3_config_with_a_soft_cap_is_refused_since_transformers_ignores_it(tmp_path):
    """transformers' Gemma3Attention stores attn_logit_softcapping and never applies it: the premise, measured
    here (its output is the same with and without), so a Gemma 3 config that sets it is refused by name."""
    import torch
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding

    from parity import layouts

    rope = {"full_attention": {"rope_type": "default", "rope_theta": 500.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
    kw = dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=1, head_dim=8, num_hidden_layers=2,
              intermediate_size=8, vocab_size=16, layer_types=["full_attention"] * 2, rope_parameters=rope,
              attn_implementation="eager")
    outs = []
    for cap in (None, 0.01):
        config = transformers.Gemma3TextConfig(**kw, attn_logit_softcapping=cap)
        torch.manual_seed(0)
        att = Gemma3Attention(config, layer_idx=1).double().eval()
        x = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        cos, sin = Gemma3RotaryEmbedding(config)(x, torch.arange(5)[None].expand(2, 5), "full_attention")
        with torch.no_grad():
            outs.append(att(x, position_embeddings=(cos.double(), sin.double()), attention_mask=None)[0])
    assert torch.equal(outs[0], outs[1])  # a cap of 0.01 would change every score if it were applied
    config.to_json_file(tmp_path / "config.json")
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        layouts.read_hf_config(tmp_path, layer=1)
