"""mha_torch's partial and scaled RoPE (rope_dim, rope_scaling; `mha_spec.rope`): held to a NumPy rotation written
here from mha_spec's frequencies (float64, every kind, both conventions, every path), to LongRoPE's per-call
long/short rule (over queries and keys, over the whole batch; a decode step crossing the switch), and to
transformers' own rotary embedding and apply_rotary_pos_emb (float32, its cos/sin are float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mha_spec import AttentionConfig, RopeScaling
from mha_torch import MultiHeadAttention, parallel
from mha_torch.attention import positions_4d, rope_max_position, rotate

B, T, S, E, N, K, H, R = 3, 5, 7, 12, 3, 1, 8, 4  # R = rope_dim < H
ORIG = 16  # original_max_position_embeddings
RTOL = 1e-12
SCALINGS = {
    None: None,
    "linear": RopeScaling("linear", factor=2.5),
    # theta 10000, R = 4: wavelengths 2π (between orig/high and orig/low: interpolated) and 200π (> orig/low: divided)
    "llama3": RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=ORIG),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=ORIG, beta_fast=8.0, beta_slow=0.5),
    "longrope": RopeScaling("longrope", factor=4.0, original_max_position_embeddings=ORIG, short_factor=(1.0, 1.7),
                            long_factor=(2.5, 6.0)),
}


def _module(rope, scaling, rope_dim=R, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, rope=rope, rope_dim=rope_dim,
                              rope_scaling=SCALINGS[scaling], dtype=dtype)


def np_rotate(x, pos, inv_freq, scale, convention, rope_dim):
    """x (B, n, L, H) float64, pos (B|1, L) ints: pair (a, b) of the first rope_dim features turns by pos·inv_freq,
    cos and sin times scale; the rest pass. Pairs: (i, i + R/2) for "half", (2i, 2i + 1) for "interleaved"."""
    half = rope_dim // 2
    first = np.arange(half) if convention == "half" else np.arange(0, rope_dim, 2)
    second = first + half if convention == "half" else first + 1
    angle = np.asarray(pos, dtype=np.float64)[:, None, :, None] * np.asarray(inv_freq)  # (B|1, 1, L, R/2)
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    out = np.array(x, dtype=np.float64)
    a, b = x[..., first], x[..., second]
    out[..., first], out[..., second] = a * cos - b * sin, b * cos + a * sin
    return out


def np_context(q, k, v, scale):
    """softmax(q kᵀ · scale) v with K key/value heads serving N/K query heads each -> (B, T, N·H)."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    ctx = (w / w.sum(-1, keepdims=True)) @ v  # (B, N, T, H)
    return ctx.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)


def _inputs(seed, L1=T, L2=S, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L1, E, generator=g, dtype=dtype), torch.randn(B, L2, E, generator=g, dtype=dtype),
            torch.randn(B, L2, E, generator=g, dtype=dtype))


def _expected(m, st, pos, key_pos, long):
    """The NumPy q_rot, k_rot of the module's q, k (Stages) with mha_spec's short or long table."""
    c = m.config
    freq = c.rope_frequencies(long=long)
    return (np_rotate(st.q.detach().numpy(), pos, freq, c.rope_scale, c.rope, c.rotary_dim),
            np_rotate(st.k.detach().numpy(), key_pos, freq, c.rope_scale, c.rope, c.rotary_dim))


@pytest.mark.parametrize("need_weights", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("scaling", list(SCALINGS), ids=[str(s) for s in SCALINGS])
@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_rotation_and_attention_match_numpy_past_the_original_context(rope, scaling, need_weights):
    """Positions 40.. (past original 16, not starting at 0, per row): q_rot/k_rot are NumPy's, features R..H-1
    pass unchanged, and the context is attention over NumPy's rotated q and k (the path used them)."""
    m = _module(rope, scaling)
    rng = np.random.default_rng(1)
    pos, key_pos = rng.integers(40, 60, (B, T)), rng.integers(40, 60, (B, S))
    _, _, st = m(*_inputs(2), need_weights=need_weights, positions=torch.from_numpy(pos),
                 key_positions=torch.from_numpy(key_pos), return_intermediates=True)
    want_q, want_k = _expected(m, st, pos, key_pos, long=True)  # longrope: every position past 16 -> long
    np.testing.assert_allclose(st.q_rot.detach().numpy(), want_q, rtol=RTOL, atol=1e-15)
    np.testing.assert_allclose(st.k_rot.detach().numpy(), want_k, rtol=RTOL, atol=1e-15)
    np.testing.assert_array_equal(st.q_rot[..., R:].detach().numpy(), st.q[..., R:].detach().numpy())  # passes
    np.testing.assert_array_equal(st.k_rot[..., R:].detach().numpy(), st.k[..., R:].detach().numpy())
    assert np.abs(want_q[..., :R] - st.q[..., :R].detach().numpy()).max() > 0.1  # the first R turn visibly
    ctx = np_context(want_q, want_k, st.v.detach().numpy(), m.config.softmax_scale)
    np.testing.assert_allclose(st.context.detach().numpy(), ctx, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_whole_head_with_yarn_matches_numpy(rope):
    """rope_dim=None (R = H) with a scaling: every feature rotates, cos/sin times YaRN's factor."""
    m = _module(rope, "yarn", rope_dim=None)
    pos = np.arange(30, 30 + T)[None]
    _, _, st = m(*_inputs(3), positions=torch.from_numpy(pos[0]), return_intermediates=True)
    assert m.config.rope_scale > 1.0
    want_q, want_k = _expected(m, st, pos, np.arange(S)[None], long=False)
    np.testing.assert_allclose(st.q_rot.detach().numpy(), want_q, rtol=RTOL, atol=1e-15)
    np.testing.assert_allclose(st.k_rot.detach().numpy(), want_k, rtol=RTOL, atol=1e-15)


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_rotate_backward_is_autograd_of_the_rotation(rope):
    """The rotation's gradient is autograd's (gradcheck: finite differences), pass-through features included."""
    cfg = AttentionConfig(E, N, head_dim=H, rope=rope, rope_dim=R, rope_scaling=SCALINGS["yarn"])
    x = torch.randn(2, 3, 4, H, dtype=torch.float64, requires_grad=True)
    pos = positions_4d(torch.tensor([[3, 50, 7, 20], [0, 1, 2, 90]]), 2, 4, "positions", x.device)
    assert torch.autograd.gradcheck(lambda y: rotate(y, pos, cfg), (x,))


def _longrope_call(m, pos, key_pos):
    _, _, st = m(*_inputs(4), positions=torch.tensor(pos), key_positions=torch.tensor(key_pos),
                 return_intermediates=True)
    return st


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_longrope_switches_on_the_calls_largest_position_over_queries_and_keys(rope):
    """max position + 1 <= 16: short factors for every token; a single key at 16 (queries all below it) turns
    the whole call, queries included, to the long ones."""
    m = _module(rope, "longrope")
    short_keys = np.tile(np.arange(9, 9 + S), (B, 1))  # largest 15: length 16, not past 16
    long_keys = short_keys.copy()
    long_keys[1, 3] = 16  # one key, one row: length 17 > 16
    pos = np.tile(np.arange(T), (B, 1))
    for keys, long in ((short_keys, False), (long_keys, True)):
        st = _longrope_call(m, pos, keys)
        want_q, want_k = _expected(m, st, pos, keys, long=long)
        np.testing.assert_allclose(st.q_rot.detach().numpy(), want_q, rtol=RTOL, atol=1e-15)
        np.testing.assert_allclose(st.k_rot.detach().numpy(), want_k, rtol=RTOL, atol=1e-15)
        other_q, _ = _expected(m, st, pos, keys, long=not long)
        assert np.abs(other_q - want_q).max() > 1e-3  # the other table would be seen


def test_longrope_decode_step_crossing_the_switch():
    """Prompt of 8 tokens (slots 0..7, row 1 left-padded by 2) below original 8, then one step at slot 8: the
    cached keys keep their short rotation, the step's q and k use the long table in every row, even row 1
    whose own position (6) + 1 does not pass 8: the batch's largest does. Output = attention over both."""
    scaling = RopeScaling("longrope", factor=4.0, original_max_position_embeddings=8, short_factor=(1.0, 1.7),
                          long_factor=(2.5, 6.0))
    torch.manual_seed(5)
    m = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, rope="half", rope_dim=R, rope_scaling=scaling,
                           dtype=torch.float64)
    P, starts = 8, np.array([0, 2, 0])
    cache = m.init_cache(B, P + 2, starts=torch.from_numpy(starts))
    x, _, _ = _inputs(6, L1=P + 1, L2=P + 1)
    _, _, cache, st0 = m(x[:, :P], x[:, :P], x[:, :P], cache=cache, return_intermediates=True)
    pos0 = np.arange(P)[None] - starts[:, None]  # (B, P): slot - starts, largest 7
    _, want_k0 = _expected(m, st0, pos0, pos0, long=False)
    _, _, cache, st1 = m(x[:, P:], x[:, P:], x[:, P:], cache=cache, return_intermediates=True)
    pos1 = P - starts[:, None]  # (B, 1): 8, 6, 8
    want_q1, want_k1 = _expected(m, st1, pos1, pos1, long=True)
    np.testing.assert_allclose(st1.q_rot.detach().numpy(), want_q1, rtol=RTOL, atol=1e-15)
    np.testing.assert_allclose(st1.k_rot.detach().numpy(), want_k1, rtol=RTOL, atol=1e-15)
    np.testing.assert_allclose(cache.k[:, :, :P].detach().numpy(), want_k0, rtol=RTOL, atol=1e-15)  # kept short
    short_q1, _ = _expected(m, st1, pos1, pos1, long=False)
    assert np.abs(short_q1[1] - want_q1[1]).max() > 1e-3  # row 1 alone would have stayed short
    keys = np.concatenate([want_k0, want_k1], axis=2)  # (B, K, P + 1, H)
    values = cache.v[:, :, : P + 1].detach().numpy()
    for b in range(B):  # row b attends slots starts[b]..P
        ctx = np_context(want_q1[b:b + 1], keys[b:b + 1, :, starts[b]:], values[b:b + 1, :, starts[b]:],
                         m.config.softmax_scale)
        np.testing.assert_allclose(st1.context[b:b + 1].detach().numpy(), ctx, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------- transformers

HF_CASES = {
    "linear": {"factor": 2.5},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 8.0, "beta_slow": 0.5},
    "longrope": {"factor": 4.0, "original_max_position_embeddings": ORIG, "short_factor": [1.0, 1.7, 1.2, 1.4],
                 "long_factor": [2.5, 6.0, 3.0, 8.0]},
}


def _hf_params(kind, partial):
    """HF_CASES[kind] with LongRoPE's lists cut to the R/2 pairs of partial_rotary_factor `partial`."""
    return {k: v[: int(H * partial) // 2] if isinstance(v, list) else v for k, v in HF_CASES[kind].items()}


def _hf_rotate(kind, partial, q, position_ids):
    """transformers' rotation of q (B, N, T, H): LlamaRotaryEmbedding (float32 cos/sin), then Llama's
    apply_rotary_pos_emb (R = H) or Phi-3's (rotates the first rotary_dim = cos.shape[-1] features)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply
    R_ = int(H * partial)
    cfg = LlamaConfig(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                      max_position_embeddings=4 * ORIG, rope_parameters={"rope_type": kind, "rope_theta": 10000.0,
                                                                         "partial_rotary_factor": partial,
                                                                         **_hf_params(kind, partial)})
    cos, sin = LlamaRotaryEmbedding(cfg)(q, position_ids)  # (B, T, R) float32
    assert cos.shape[-1] == R_
    apply = llama_apply if R_ == H else phi3_apply
    return apply(q, q, cos, sin)[0]


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("kind,start", [("linear", 40), ("llama3", 40), ("yarn", 40), ("longrope", 3),
                                        ("longrope", 40)])
def test_rotated_q_matches_transformers_float32(kind, start, partial):
    """Our float32 q_rot equals transformers' for its llama3/yarn/linear/longrope (short: positions 3..7 and
    keys 0..6, long: 40..) with partial_rotary_factor 1 and 0.5. HF's angles are float32 products: at position 44
    and inv_freq 1 (llama3 keeps the fast pairs) one rounds by up to ulp(44)/2 = 1.9e-6 rad, times |q| <= 2.01
    here. Measured max |ours - HF| over these cases: 3.2e-6 (llama3, 40), 1.7e-6 (longrope, 40), 1.4e-6
    (linear), 2.4e-7 (yarn; longrope at 3): bound 5e-6."""
    R_ = int(H * partial)
    scaling = RopeScaling.from_mapping(kind, _hf_params(kind, partial))  # the keys HF's config gets
    torch.manual_seed(7)
    m = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, rope="half", rope_dim=R_, rope_scaling=scaling,
                           dtype=torch.float32)
    pos = torch.arange(start, start + T).repeat(B, 1)  # (B, T)
    q_in, k_in, v_in = _inputs(8, dtype=torch.float32)
    _, _, st = m(q_in, k_in, v_in, positions=pos, return_intermediates=True)
    # transformers' longrope takes its call length from these position ids alone: keys 0..6 keep the table
    hf_q = _hf_rotate(kind, partial, st.q.detach(), pos)
    err = (st.q_rot.detach() - hf_q).abs().max().item()
    assert err < 5e-6, err
    assert (hf_q - st.q.detach()).abs().max() > 0.1  # it rotates


# ---------------------------------------------------------------- parallel paths and errors


def test_rotate_refuses_longrope_without_the_calls_max():
    cfg = AttentionConfig(E, N, head_dim=H, rope="half", rope_dim=R, rope_scaling=SCALINGS["longrope"])
    with pytest.raises(ValueError, match="longrope.*max_position"):
        rotate(torch.zeros(1, 1, 2, H), torch.zeros(1, 1, 2, 1, dtype=torch.int64), cfg)


def test_parallel_paths_pick_longropes_table_from_the_whole_problem():
    """One rank (gloo, world size 1): tp_forward and sequence_parallel_forward equal the module's forward with
    LongRoPE whose switch comes from one key (the long table); data parallel refuses per-row positions by name."""
    import torch.distributed as dist
    m = _module("interleaved", "longrope")
    q_in, k_in, v_in = _inputs(9)
    pos, key_pos = torch.arange(T).repeat(B, 1), torch.arange(S).repeat(B, 1)
    key_pos[2, 4] = 30  # only this key passes 16
    want, _ = m(q_in, k_in, v_in, need_weights=False, positions=pos, key_positions=key_pos)
    short, _ = m(q_in, k_in, v_in, need_weights=False, positions=pos, key_positions=torch.arange(S).repeat(B, 1))
    assert (want - short).abs().max() > 1e-3  # the table matters to the output
    got_tp, _ = parallel.tp_forward(m, q_in, k_in, v_in, positions=pos, key_positions=key_pos)
    torch.testing.assert_close(got_tp, want, rtol=1e-12, atol=1e-13)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got_sp = parallel.sequence_parallel_forward(m, q_in, k_in, v_in, positions=pos, key_positions=key_pos)
        with pytest.raises(ValueError, match="longrope.*key_positions"):
            parallel.data_parallel_forward(m, q_in, k_in, v_in, key_positions=key_pos)
        got_dp = parallel.data_parallel_forward(m, q_in, k_in, v_in, positions=torch.arange(T))  # shared: runs
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got_sp, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(got_dp, m(q_in, k_in, v_in, need_weights=False)[0], rtol=1e-12, atol=1e-13)


def test_rope_max_position_is_none_unless_the_table_switches_and_minus_one_when_empty():
    p = torch.arange(6).reshape(1, 1, 6, 1)
    assert rope_max_position(AttentionConfig(E, N, rope="half", rope_scaling=SCALINGS["linear"]), p) is None
    cfg = AttentionConfig(E, N, head_dim=H, rope="half", rope_dim=R, rope_scaling=SCALINGS["longrope"])
    assert rope_max_position(cfg, p, torch.tensor([[[[9]], [[2]]]])).item() == 9
    assert rope_max_position(cfg, p[:, :, :0]).item() == -1


def test_extra_repr_names_rope_dim_and_scaling():
    text = repr(_module("half", "yarn"))
    assert f"rope_dim={R}" in text and "rope_scaling='yarn:factor=4.0," in text
    assert "rope_dim" not in repr(_module("half", None, rope_dim=None))
