"""mha_spec.rope: the scaled RoPE frequencies and cos/sin factor, held to transformers' ROPE_INIT_FUNCTIONS
(the models' own definitions; they compute in float32, so agreement is to float32's rounding), and the
RopeScaling spelling."""

import numpy as np
import pytest

from mha_spec import AttentionConfig, RopeScaling, rope_frequencies

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

H, THETA = 16, 500.0
SHORT = (1.0, 1.1, 1.3, 2.0, 1.0, 1.0, 1.2, 1.4)
LONG = (1.5, 2.0, 3.0, 4.5, 5.0, 6.0, 7.0, 8.0)
KINDS = [
    ("linear", dict(factor=4.0)),
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=32)),
    ("yarn", dict(factor=4.0, original_max_position_embeddings=32, beta_fast=8.0, beta_slow=2.0, truncate=False,
                  mscale=1.0, mscale_all_dim=0.5)),
    ("longrope", dict(factor=4.0, original_max_position_embeddings=32, short_factor=SHORT, long_factor=LONG)),
]


def _hf(kind, params, partial, seq_len):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = LlamaConfig(hidden_size=48, num_attention_heads=3, head_dim=H, max_position_embeddings=128,
                      rope_parameters={"rope_type": kind, "rope_theta": THETA, "partial_rotary_factor": partial,
                                       **{k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}})
    freq, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
    return freq.double().numpy(), factor


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("kind,params", KINDS, ids=[f"{k}{i}" for i, (k, _) in enumerate(KINDS)])
def test_frequencies_match_transformers(kind, params, partial):
    R = int(H * partial)
    params = {k: v[: R // 2] if isinstance(v, tuple) else v for k, v in params.items()}
    scaling = RopeScaling.from_mapping(kind, params)
    for long in (False, True) if scaling.switches else (False,):
        hf_freq, hf_factor = _hf(kind, params, partial, seq_len=100 if long else None)
        ours = np.array(rope_frequencies(R, THETA, scaling, long))
        assert ours.shape == hf_freq.shape == (R // 2,)
        np.testing.assert_allclose(ours, hf_freq, rtol=4e-7, atol=0)  # float32's rounding of HF's, a few ulps
        assert scaling.scale == pytest.approx(hf_factor, rel=1e-12)
    if kind != "linear":
        base = np.array(rope_frequencies(R, THETA))
        assert not np.allclose(ours, base / params["factor"])  # not a plain linear scaling: a wrong kind shows


def test_longrope_switch_is_transformers_rule():
    s = RopeScaling.from_mapping("longrope", dict(factor=4.0, original_max_position_embeddings=32,
                                                  short_factor=SHORT, long_factor=LONG))
    assert not s.uses_long(31) and s.uses_long(32)  # length = largest position + 1 > 32


def test_parse_and_str_round_trip():
    for kind, params in KINDS:
        s = RopeScaling.from_mapping(kind, params)
        assert RopeScaling.parse(str(s)) == s


@pytest.mark.parametrize("bad,error", [
    ("dynamic:factor=2", NotImplementedError),
    ("linear:factor=2,beta_fast=3", ValueError),  # a key linear does not read
    ("llama3:factor=8", ValueError),  # missing keys
    ("wavy:factor=2", ValueError),
    ("linear:factor", ValueError),
    ("linear:factor=x", ValueError),
])
def test_bad_scalings_are_named(bad, error):
    with pytest.raises(error, match="rope_scaling|dynamic"):
        RopeScaling.parse(bad)


def test_config_fields():
    s = RopeScaling.parse("linear:factor=2")
    c = AttentionConfig(12, 3, rope="half", rope_dim=2, rope_scaling=s)
    assert c.rotary_dim == 2 and {"rope-partial", "rope-scaled"} <= c.features
    assert AttentionConfig(12, 3, rope="half", rope_dim=4).features == {"rope-half"}  # R = H is not partial
    for bad in (dict(rope_dim=2), dict(rope_scaling=s)):
        with pytest.raises(ValueError, match="rope=None"):
            AttentionConfig(12, 3, **bad)
    for R in (3, 0, 6, True):
        with pytest.raises(ValueError, match="rope_dim"):
            AttentionConfig(12, 3, rope="half", rope_dim=R)
    with pytest.raises(TypeError, match="RopeScaling"):
        AttentionConfig(12, 3, rope="half", rope_scaling="linear:factor=2")
    with pytest.raises(ValueError, match="pairs"):
        AttentionConfig(48, 3, rope="half", rope_scaling=RopeScaling.from_mapping("longrope", dict(
            factor=4.0, original_max_position_embeddings=32, short_factor=SHORT[:4], long_factor=LONG[:4])))
