"""The partial and scaled RoPE cases (`mha-parity --cases rope`, also in `modern`): they reach the scaled
frequencies, our modules pass them, and a port with one of the slips these layers invite is red at q_rot.

The ports are our torch module built with one field wrong (`dataclasses.replace` of the case's layer, as
tests/test_modern_cases.py does): the scaling ignored (a port written for Llama 3.0 running Llama 3.1), the
whole head rotated (GPT-NeoX's rotary_pct dropped), LongRoPE held to its short factors (the switch never
taken). The decode case's prompt rotates with LongRoPE's short factors and its later steps with the long
ones, so a single forward is not its truth: the decode check judges our decoders against the per-call one.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from mha_spec import DTYPE_NAMES, ROPE_SCALINGS, RopeScaling
from parity import convert
from parity.cli_args import parse_layer
from parity.harness import draw_inputs, run
from parity.harness.decode import schedule
from parity.harness.matrix import CASE_SETS, ROPE_SHAPES, modern_matrix, rope_matrix
from parity.impls import Implementation
from parity.impls.registry import layer_kwargs

CASES = rope_matrix()
FORWARD = tuple(c for c in CASES if not c.decode)
DECODE = next(c for c in CASES if c.decode)


def _port(name: str, **wrong):
    """Our torch module on the case's layer with `wrong` layer keywords (a function of the case's own)."""

    def factory(sd, num_heads, *, dtype, device, masked_rows, problem):
        from torch.func import functional_call

        layer = layer_kwargs(sd, num_heads, problem)
        layer.update({k: f(problem.config) for k, f in wrong.items()})
        m = convert.to_torch(sd, num_heads, masked_rows=masked_rows, **layer).to(device)

        def fn(p, query, key, value, mask, **positions):
            return functional_call(m, p, (query, key, value, mask), {"need_weights": True, **positions})

        def intermediates(p, query, key, value, mask, **positions):
            kw = {"need_weights": True, "return_intermediates": True, **positions}
            return functional_call(m, p, (query, key, value, mask), kw)[2]

        fn.intermediates = intermediates
        return fn

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=("grouped", "rope-half", "rope-interleaved", "no-qkv-bias", "no-out-bias", "head-dim",
                                    "sinks", "rope-partial", "rope-scaled"), uses_params=True)


def _short_only(config):
    s = config.rope_scaling
    return dataclasses.replace(s, long_factor=s.short_factor)


SLIPS = {  # port -> (its implementation, the case it is red on)
    "scaling-ignored": (_port("scaling-ignored", rope_scaling=lambda c: None), "scaled-llama3"),
    "whole-head-rotated": (_port("whole-head-rotated", rope_dim=lambda c: None), "partial-neox"),
    "longrope-short-only": (_port("longrope-short-only", rope_scaling=_short_only), "longrope-phi3"),
}


def test_the_cases_reach_the_scaled_frequencies_in_every_dtype():
    assert {c.name for c in CASES} <= {c.name for c in modern_matrix()} and CASE_SETS["rope"] is rope_matrix
    assert {c.shape.rope_scaling.kind for c in CASES if c.shape.rope_scaling} == set(ROPE_SCALINGS)
    assert {d for c in CASES for d in c.dtypes} == set(DTYPE_NAMES)
    assert any("rope-partial" in c.config.features and "head-dim" in c.config.features for c in CASES)  # Phi-3
    for c in FORWARD:
        x, s = draw_inputs(c, 0), c.shape.rope_scaling
        orig = getattr(s, "original_max_position_embeddings", None)
        if orig is not None:  # every position past the original context
            assert min(x.positions.min(), x.key_positions.min()) + 1 > orig, c.name
        assert len({r.tobytes() for r in x.positions}) == c.shape.B, c.name  # rows still differ
    phi3 = next(c for c in FORWARD if c.shape.name == "longrope-phi3").config
    assert phi3.rope_frequencies(long=True) != phi3.rope_frequencies(long=False)


def test_the_decode_prompt_rotates_short_and_its_later_steps_long():
    s, sch = DECODE.shape, schedule(DECODE.shape)
    assert s.rope_scaling.switches and "rope-partial" in DECODE.config.features
    pos = np.arange(sch.tokens)[None, :] - sch.starts[:, None]  # (B, T): the decode check's positions
    long = [s.rope_scaling.uses_long(int(pos[:, lo:hi].max())) for _, lo, hi in sch.calls()]
    assert long[0] is False and long[-1] is True  # the prompt below the switch, the last step past it


@pytest.fixture(scope="module")
def report():
    """Every forward case in float32 (no XLA compile: torch only), ours and the slips; the decode case decoded."""
    impls = ("torch", "torch-fused", *(impl for impl, _ in SLIPS.values()))
    rows = run(cases=FORWARD, checks=("forward",), dtypes=("float32",), impls=impls, device="cpu").rows
    rows += run(cases=(DECODE,), checks=("decode",), dtypes=("float32",), impls=("torch",), device="cpu").rows
    return rows


def test_our_torch_module_passes_every_case_and_the_decode(report):
    for impl in ("torch", "torch-fused"):
        for c in (*FORWARD, DECODE):
            rows = [r for r in report if r.impl == impl and r.case == c.name and r.status != "skip"]
            if c is DECODE and impl == "torch-fused":
                continue
            assert rows and all(r.status == "pass" for r in rows), (impl, c.name, [r for r in rows if r.status != "pass"])
    decode = [r for r in report if r.case == DECODE.name and r.check == "decode" and r.impl == "torch"]
    assert {r.quantity for r in decode} >= {"prefill", "step 1", "step 2", "step 3", "cache"}


@pytest.mark.parametrize("slip", SLIPS)
def test_a_slip_is_red_at_q_rot_on_its_case(report, slip):
    impl, shape = SLIPS[slip]
    rows = [r for r in report if r.impl == impl.name and r.case.startswith(f"{shape}/") and r.reference == "oracle"
            and r.quantity == "output"]
    assert rows and all(r.status == "fail" and r.stage == "q_rot" for r in rows), rows
    assert all(r.margin > 3 for r in rows), [r.margin for r in rows]


def test_layer_flag_round_trips_rope_dim_and_rope_scaling():
    yarn = "yarn:factor=32.0,original_max_position_embeddings=4096,beta_fast=32.0,truncate=false"
    c = parse_layer(f"E=16,N=2,rope=half,theta=500,rope_dim=4,rope_scaling={yarn},bias=none")
    assert (c.rope_dim, c.rope_scaling, c.qkv_bias) == (4, RopeScaling.parse(yarn), False)
    assert str(c.rope_scaling) == yarn  # the spelling reads back to itself
    phi3 = ROPE_SHAPES["longrope-phi3"]
    text = f"E=12,N=3,H=8,rope=half,theta=2500,bias=none,rope_dim=6,rope_scaling={phi3.rope_scaling}"
    assert parse_layer(text) == phi3.config


@pytest.mark.parametrize("text, words", [
    ("E=16,N=2,rope_dim=4", "rope=None"),  # ignored without RoPE
    ("E=16,N=2,rope_scaling=linear:factor=2", "rope=None"),
    ("E=16,N=2,rope=half,rope_dim=3", "rope_dim must be an even int"),
    ("E=16,N=2,rope=half,rope_scaling=linear:factor=2,beta_fast=4", "does not read beta_fast"),
    ("E=16,N=2,rope=half,rope_scaling=dynamic:factor=2", "not supported"),
    ("E=16,N=2,rope=half,rope_scaling=llama3:factor=8", "needs low_freq_factor"),
    ("E=16,N=2,rope=half,rope_scaling=linear:factor=2,factr=3", "unknown keys"),
    ("E=16,N=2,rope=half,rope_dim=2,rope_dim=4", "each once"),
])
def test_layer_flag_refuses_what_the_layer_would_ignore(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse_layer(text)
