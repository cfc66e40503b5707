"""mha_torch.MultiHeadLatentAttention (DeepSeek V2/V3 MLA, `mha_spec.LatentAttentionConfig`) and its LatentCache:
held to transformers' DeepseekV3Attention (forward and every gradient, float64 models; transformers' cos/sin,
RMSNorm and softmax are float32, hence the measured tolerance), eager vs fused vs absorbed to float64 rounding,
prefill + decode through the latent cache against one causal forward (left padding too), and named errors."""

from __future__ import annotations

import pytest
import torch

from mha_spec import RopeScaling
from mha_torch import LatentCache, MultiHeadLatentAttention

# Pairwise distinct sizes so a swapped axis fails: B, T, S, E, N, C, Dn, Dv, Q; Dr = 8 where the rope layout and
# YaRN's ramp matter (with Dr = 2 there is one pair: "half" and "interleaved" are the same rotation).
B, T, S, E, N, C, Dn, Dv, Q = 2, 5, 9, 12, 3, 6, 4, 10, 7
TIGHT = 1e-12
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale_all_dim": 1.0}
HF_NAMES = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b_proj",
            "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b_proj",
            "o_proj": "out_proj"}


def _layer(Dr=8, q_lora=Q, rope="interleaved", scaling=None, bias=False, masked_rows="nan", seed=0):
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(E, N, kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                                 q_lora_rank=q_lora, rope=rope, rope_scaling=scaling, bias=bias,
                                 masked_rows=masked_rows, dtype=torch.float64)
    with torch.no_grad():  # the norms start at ones (a no-op weight): draw them and the biases, so a mix-up shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return m


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- (a) transformers' DeepseekV3Attention


def _hf_layer(Dr, q_lora, interleave, yarn, bias):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = DeepseekV3Config(hidden_size=E, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=q_lora,
                           kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                           rope_interleave=interleave, attention_bias=bias, max_position_embeddings=64,
                           rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(2)
    hf = DeepseekV3Attention(cfg, layer_idx=0).to(torch.float64)
    with torch.no_grad():  # RMSNorm weights start at ones, biases near zero: redraw both
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    return hf, DeepseekV3RotaryEmbedding(cfg)


def _ours_from_hf(hf, Dr, q_lora, interleave, yarn, bias):
    scaling = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale_all_dim=1.0) if yarn else None
    ours = _layer(Dr, q_lora, "interleaved" if interleave else "half", scaling, bias)
    state = {}
    for name, p in hf.state_dict().items():
        module, _, leaf = name.partition(".")
        state[f"{HF_NAMES[module]}.{leaf}"] = p.clone()
    ours.load_state_dict(state, strict=True)  # every canonical key, nothing else
    return ours


# Measured (2-core EPYC, all 17 cases): forward max |ours - HF| 6.5e-8 over outputs up to ~2; gradients 2.5e-7 (x)
# and 6.3e-7 (weights), each relative to that gradient's max |.|: transformers' float32 cos/sin, RMSNorm and softmax.
# A planted swap of the rope layout or a dropped mscale is off by > 1e-2 (`test_the_hf_comparison_sees_...`).
HF_TOL = 5e-6
HF_CASES = [(8, q, il, yarn, bias) for q in (Q, None) for il in (True, False) for yarn in (False, True)
            for bias in (False, True)] + [(2, Q, True, True, True)]


@pytest.mark.parametrize("Dr, q_lora, interleave, yarn, bias", HF_CASES)
def test_matches_transformers_deepseek_v3_forward_and_gradients(Dr, q_lora, interleave, yarn, bias):
    hf, rotary = _hf_layer(Dr, q_lora, interleave, yarn, bias)
    ours = _ours_from_hf(hf, Dr, q_lora, interleave, yarn, bias)
    assert ours.config.softmax_scale == pytest.approx(hf.scaling, rel=1e-15)
    pos = torch.stack([torch.arange(T) + 3, torch.arange(T) + 11])  # (B, T): per-row, past YaRN's 16 for row 1
    x_hf, x_ours, g = _x(B, T, E).requires_grad_(), _x(B, T, E).requires_grad_(), _x(B, T, E, seed=3)
    cos, sin = rotary(x_hf, pos)
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out_hf, _ = hf(x_hf, (cos, sin), additive[None, None])
    out, _ = ours(x_ours, is_causal=True, positions=pos)
    assert (out - out_hf).abs().max() < HF_TOL
    (out_hf * g).sum().backward()
    (out * g).sum().backward()
    assert (x_ours.grad - x_hf.grad).abs().max() < HF_TOL * x_hf.grad.abs().max()
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        module, _, leaf = name.partition(".")
        mine = ours_params[f"{HF_NAMES[module]}.{leaf}"].grad
        assert (mine - p.grad).abs().max() < HF_TOL * p.grad.abs().max(), name


@pytest.mark.parametrize("planted", ["rope layout", "no mscale"])
def test_the_hf_comparison_sees_a_wrong_rope_layout_or_scale(planted):
    hf, rotary = _hf_layer(8, Q, True, True, False)
    ours = _ours_from_hf(hf, 8, Q, True, True, False)
    wrong = _layer(rope="half" if planted == "rope layout" else "interleaved",
                   scaling=None if planted == "no mscale" else ours.config.rope_scaling)
    wrong.load_state_dict(ours.state_dict())
    pos = torch.arange(T)[None].expand(B, T)
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out_hf, _ = hf(_x(B, T, E), rotary(_x(B, T, E), pos), additive[None, None])
    assert (ours(_x(B, T, E), is_causal=True)[0] - out_hf).abs().max() < HF_TOL
    assert (wrong(_x(B, T, E), is_causal=True)[0] - out_hf).abs().max() > 1e-2


def test_state_dict_is_the_canonical_weights():
    for q_lora in (Q, None):
        for bias in (False, True):
            m = _layer(q_lora=q_lora, bias=bias)
            assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == m.config.weight_shapes()


# ---------------------------------------------------------------- (b) eager, fused, absorbed


def _four_ways(m, x, **kw):
    """The layer's output by every path: (naive, absorbed) x (weights materialised, SDPA)."""
    return [m(x, need_weights=nw, absorb=ab, **kw)[0] for ab in (False, True) for nw in (True, False)]


@pytest.mark.parametrize("masked_rows", ["nan", "zero", "uniform"])
def test_eager_fused_and_absorbed_agree_with_a_mask_and_each_policy(masked_rows):
    m = _layer(rope="half", masked_rows=masked_rows, bias=True)
    x, kv = _x(B, T, E), _x(B, S, E, seed=4)
    keep = torch.rand(B, T, S, generator=torch.Generator().manual_seed(5)) > 0.4  # [B, T, S]
    keep[0, 2] = False  # a row that keeps no key: the policy decides it
    keep[1, 0] = False
    outs = _four_ways(m, x, mask=keep, key_value=kv, positions=torch.arange(T) + 2, key_positions=torch.arange(S))
    row = outs[0][0, 2]
    assert row.isnan().all() if masked_rows == "nan" else row.isfinite().all()
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=0, atol=TIGHT, equal_nan=True)


def test_eager_fused_and_absorbed_agree_causal_with_gradients():
    m = _layer(scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale_all_dim=1.0))
    x = _x(B, T, E)
    grads = []
    for ab in (False, True):
        for nw in (True, False):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            (m(xi, need_weights=nw, absorb=ab, is_causal=True)[0] * _x(B, T, E, seed=6)).sum().backward()
            grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
    for other in grads[1:]:
        for a, b in zip(other, grads[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=TIGHT)


def test_intermediates_are_the_documented_stages():
    m = _layer()
    x = _x(B, T, E)
    out, w, st = m(x, is_causal=True, return_intermediates=True)
    assert st.q.shape == (B, N, T, Dn + 8) and st.k.shape == (B, N, T, Dn + 8) and st.v.shape == (B, N, T, Dv)
    assert st.q_rot.shape == (B, N, T, 8) and st.k_rot.shape == (B, 1, T, 8) and st.latent.shape == (B, T, C)
    assert st.context.shape == (B, T, N * Dv) and st.output is out and st.weights is w
    # The scores, rebuilt from the stages by the docstring's formula: nope part + rotated part, times the scale.
    logits = (st.q[..., :Dn] @ st.k[..., :Dn].transpose(-1, -2) + st.q_rot @ st.k_rot.transpose(-1, -2))
    logits = (logits * m.config.softmax_scale).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(st.scores, logits, rtol=0, atol=TIGHT)
    torch.testing.assert_close(st.context, (w @ st.v).transpose(1, 2).reshape(B, T, N * Dv), rtol=0, atol=TIGHT)
    # k's rope part is k_pe before RoPE, shared by every head; q's nope part feeds the logits unrotated
    assert torch.equal(st.k[:, 0, :, Dn:], st.k[:, 2, :, Dn:])
    assert not torch.allclose(st.k[:, :1, :, Dn:], st.k_rot)  # positions 1.. turn it


def test_cross_attention_on_x_itself_is_self_attention():
    m = _layer(scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale_all_dim=1.0))
    x, pos = _x(B, T, E), torch.arange(2 * T).reshape(B, T)  # per-row positions
    self_out, _ = m(x, is_causal=True, positions=pos)
    cross_out, _ = m(x, is_causal=True, positions=pos, key_value=x.clone(), key_positions=pos)
    torch.testing.assert_close(cross_out, self_out, rtol=0, atol=TIGHT)
    shifted, _ = m(x, is_causal=True, positions=pos, key_value=x.clone())  # keys at arange(S): another result
    assert (shifted - self_out).abs().max() > 1e-3


# ---------------------------------------------------------------- (c) the latent cache


@pytest.mark.parametrize("absorb, need_weights", [(False, True), (True, True), (False, False), (True, False)])
def test_prefill_then_decode_equals_one_causal_forward(absorb, need_weights):
    m = _layer(bias=True)
    x = _x(B, T, E)
    full, _, st = m(x, is_causal=True, return_intermediates=True)
    cache = m.init_cache(B, capacity=T + 2)
    out, _, cache = m(x[:, :3], cache=cache, absorb=absorb, need_weights=need_weights)  # prefill 3 tokens
    steps = [out]
    for t in range(3, T):  # then one token at a time
        out, _, cache = m(x[:, t:t + 1], cache=cache, absorb=absorb, need_weights=need_weights)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=TIGHT)
    # what the cache holds: c after its norm and k_pe after RoPE, C + Dr numbers per token
    assert cache.width == C + 8 == m.config.cache_width < N * (Dn + 8 + Dv)
    assert cache.c.shape == (B, T + 2, C) and cache.k_pe.shape == (B, T + 2, 8) and cache.lengths.tolist() == [T, T]
    torch.testing.assert_close(cache.c[:, :T], st.latent, rtol=0, atol=TIGHT)
    torch.testing.assert_close(cache.k_pe[:, :T], st.k_rot[:, 0], rtol=0, atol=TIGHT)
    assert not cache.c[:, T:].any()  # unwritten slots stay empty


def test_naive_and_absorbed_decode_agree_step_by_step_with_weights():
    m = _layer(q_lora=None, rope="half")
    x = _x(B, T, E)
    cache = m.init_cache(B, capacity=T)
    for t in range(T):
        naive = m(x[:, t:t + 1], cache=cache, return_intermediates=True)
        absorbed = m(x[:, t:t + 1], cache=cache, absorb=True, return_intermediates=True)
        for a, b in ((naive[0], absorbed[0]), (naive[1], absorbed[1]), (naive[3].scores, absorbed[3].scores)):
            torch.testing.assert_close(b, a, rtol=0, atol=TIGHT)
        assert naive[1].shape == (B, N, 1, T) and naive[1][..., t + 1:].eq(0).all()  # the slots not yet written
        cache = naive[2]


def test_left_padded_rows_decode_as_their_own_unpadded_sequences():
    m = _layer()
    starts = torch.tensor([2, 0])  # row 0: 2 padding tokens then 3 prompt tokens; row 1: 5 prompt tokens
    P, steps = 5, 2
    x = _x(B, P + steps, E)
    cache = m.init_cache(B, capacity=P + steps + 1, starts=starts)
    out, _, cache = m(x[:, :P], cache=cache)
    outs = [out]
    for t in range(P, P + steps):
        out, _, cache = m(x[:, t:t + 1], cache=cache, absorb=True)
        outs.append(out)
    got = torch.cat(outs, dim=1)  # (B, P + steps, E)
    for b in range(B):
        alone, _ = m(x[b:b + 1, starts[b]:], is_causal=True)  # the row without its padding, positions from 0
        torch.testing.assert_close(got[b:b + 1, starts[b]:], alone, rtol=0, atol=TIGHT)


# ---------------------------------------------------------------- (d) errors


def test_errors_are_named():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MultiHeadLatentAttention(E, N, kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=3, v_head_dim=Dv)
    with pytest.raises(ValueError, match="masked_rows"):
        _layer(masked_rows="ignore")
    m = _layer()
    with pytest.raises(ValueError, match=r"x must have shape .*got \(2, 5\)"):
        m(_x(B, T))
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, 12\).*got \(2, 5, 11\)"):
        m(_x(B, T, E - 1))
    with pytest.raises(ValueError, match=r"key_value must have shape \(2, L, 12\).*got \(3, 9, 12\)"):
        m(_x(B, T, E), key_value=_x(B + 1, S, E))
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        m(_x(B, T, E).float())
    with pytest.raises(ValueError, match="mask"):
        m(_x(B, T, E), mask=torch.ones(T + 1, T, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_positions= without key_value="):
        m(_x(B, T, E), key_positions=torch.arange(T))
    with pytest.raises(ValueError, match="positions must have shape"):
        m(_x(B, T, E), positions=torch.arange(T + 1))
    cache = m.init_cache(B, capacity=T)
    with pytest.raises(ValueError, match="the cache's keep-mask"):
        m(_x(B, T, E), cache=cache, is_causal=True)
    with pytest.raises(ValueError, match="no room for 6 more tokens"):
        m(_x(B, T + 1, E), cache=cache)
    with pytest.raises(ValueError, match="T = 0 new tokens"):
        m(_x(B, 0, E), cache=cache)
    with pytest.raises(TypeError, match="the cache holds torch.float32"):
        m(_x(B, 1, E), cache=LatentCache.empty(B, T, C, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"does not fit B=2 new rows of a layer with C=6, Dr=8"):
        m(_x(B, 1, E), cache=LatentCache.empty(B, T, C, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="mha_torch.LatentCache"):
        m(_x(B, 1, E), cache=object())
    with pytest.raises(ValueError, match=r"LatentCache.starts must lie in \[0, capacity=5\]"):
        LatentCache.empty(B, T, C, 8, dtype=torch.float64, starts=torch.tensor([0, 6]))
