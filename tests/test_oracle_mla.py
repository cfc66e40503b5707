"""The MLA oracle (parity/reference_mla.py) against transformers' DeepseekV3Attention in float64, torch autograd of
that module, central differences, HF's DynamicCache (which holds DeepSeek V3's compressed latents), and itself
(decode == one causal forward; the absorbed decode == the naive one). Tiny pairwise-distinct sizes: E=12, N=3,
Q=7, C=6, Dn=4, Dr=8, Dv=5, B=3, T=5, L=7 (Dr=8, not 2: with one rotated pair "half" and "interleaved" are the
same rotation and YaRN leaves the one frequency alone, so neither could be checked; one case keeps Dr=2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from mha_spec import RopeScaling
from parity import reference_mla as mla
from mha_spec.mla import LatentAttentionConfig
from parity.reference import decode_keep, decode_positions, rope_attention_factor, rope_inv_freq, rotate

# transformers' DeepseekV3Attention holds its rotary cos/sin (float32 angles) and its RMSNorms in float32 even in a
# float64 model, so it sits ~1e-7 from the float64 oracle. Errors are max |oracle - HF| / max |HF| (`_err`);
# measured worst over the cases here: forward output 2.5e-7, weights 1.8e-7, gradients 4.1e-7, decode outputs
# 1.0e-7, latent cache c 9.0e-8, k_pe 6.3e-8. HF_TOL is 2e-6, ~5x the worst.
HF_TOL = 2e-6
# float64 against float64: decode against forward (naive and absorbed) measured 2.7e-15 absolute
SELF_TOL = 1e-12
# central differences, h=1e-6: |numeric - analytic| / max(1, |numeric|) measured worst 4.2e-9 (h=1e-5: 8.3e-8,
# the truncation h² dominating; 1e-6 balances it against rounding); a wrong term is O(1)
FD_TOL = 5e-8

E, N, Q, C, DN, DR, DV = 12, 3, 7, 6, 4, 8, 5
B, T, L, PREFILL = 3, 5, 7, 4
HF_NAME = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm",
           "out_proj": "o_proj"}
YARN = dict(factor=4.0, original_max_position_embeddings=16, mscale=1.0)
SCALINGS = {"default": None, "yarn-1.0": dict(YARN, mscale_all_dim=1.0), "yarn-0.707": dict(YARN, mscale_all_dim=0.707)}
POSITIONS = np.array([[17, 18, 19, 20, 21], [30, 31, 32, 33, 34], [3, 4, 5, 6, 7]])  # (B, T): past 16 mostly


def _layer(q_lora=Q, interleave=True, scaling="default", bias=True, dr=DR, seed=0):
    """(HF module, its rotary embedding, the oracle's keywords, the canonical state dict) of one tiny layer; every
    weight redrawn (norm weights around 1, biases nonzero) so a missing term shows."""
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if SCALINGS[scaling] is not None:
        params = {"rope_type": "yarn", "rope_theta": 10000.0, **SCALINGS[scaling]}
    config = DeepseekV3Config(hidden_size=E, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=q_lora,
                              kv_lora_rank=C, qk_nope_head_dim=DN, qk_rope_head_dim=dr, v_head_dim=DV,
                              rope_interleave=interleave, rope_parameters=params, attention_bias=bias,
                              max_position_embeddings=64, rms_norm_eps=1e-6, vocab_size=10, intermediate_size=8,
                              moe_intermediate_size=8, num_hidden_layers=1, n_routed_experts=2, n_group=1,
                              topk_group=1, num_experts_per_tok=1)
    config._attn_implementation = "eager"
    module = DeepseekV3Attention(config, layer_idx=0).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.3 * noise if "layernorm" in name else (0.3 if name.endswith("bias") else 0.5) * noise)
    hf = dict(module.named_parameters())
    sd = {}
    for key in LatentAttentionConfig(E, N, C, DN, dr, DV, q_lora, bias=bias).weight_shapes():
        mod, _, leaf = key.partition(".")
        sd[key] = hf[f"{HF_NAME.get(mod, mod)}.{leaf}"].detach().numpy().copy()
    kw = dict(num_heads=N, kv_lora_rank=C, qk_nope_head_dim=DN, qk_rope_head_dim=dr, v_head_dim=DV, q_lora_rank=q_lora,
              rope="interleaved" if interleave else "half", norm_eps=1e-6,
              rope_scaling=None if SCALINGS[scaling] is None else RopeScaling("yarn", **SCALINGS[scaling]))
    return module, DeepseekV3RotaryEmbedding(config), kw, sd


def _additive(keep):
    """bool keep (B, 1, T, S) -> HF's additive float64 mask (0 kept, finfo.min masked)."""
    return torch.as_tensor(np.where(keep, 0.0, np.finfo(np.float64).min))


def _hf(module, rotary, x, positions, keep, cache=None):
    """HF's (output, attention weights) for x (B, T, E) at positions (B, T) under keep (B, 1, T, S)."""
    xt = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    cos_sin = rotary(xt, torch.as_tensor(positions))
    out, weights = module(xt, position_embeddings=cos_sin, attention_mask=_additive(keep), past_key_values=cache)
    return out, weights


def _err(ours, ref) -> float:
    """max |ours - ref| over max |ref|: HF's float32 cos/sin err by ~1e-7 of the angle, so of the size of things."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _x(seed=1, length=T):
    return np.random.default_rng(seed).standard_normal((B, length, E))


def _causal(length=T):
    return np.broadcast_to(np.tril(np.ones((length, length), bool)), (B, 1, length, length))


CASES = [(q, i, s, b) for q in (Q, None) for i in (True, False) for s in SCALINGS for b in (True, False)]


@pytest.mark.parametrize("q_lora,interleave,scaling,bias", CASES)
def test_forward_matches_hf(q_lora, interleave, scaling, bias):
    module, rotary, kw, sd = _layer(q_lora, interleave, scaling, bias)
    x = _x()
    with torch.no_grad():
        out, weights = _hf(module, rotary, x, POSITIONS, _causal())
    f = mla.forward(sd, x, positions=POSITIONS, is_causal=True, **kw)
    assert _err(f.output, out.numpy()) < HF_TOL
    assert _err(f.weights, weights.numpy()) < HF_TOL


def test_forward_matches_hf_with_one_rotated_pair():
    """The brief's literal Dr=2 (the rotation is one pair: the conventions coincide there)."""
    module, rotary, kw, sd = _layer(Q, True, "yarn-0.707", True, dr=2)
    x = _x(2)
    with torch.no_grad():
        out, _ = _hf(module, rotary, x, POSITIONS, _causal())
    assert _err(mla.forward(sd, x, positions=POSITIONS, is_causal=True, **kw).output, out.numpy()) < HF_TOL


@pytest.mark.parametrize("q_lora,interleave,scaling,bias", [(Q, True, "yarn-0.707", True), (None, False, "default", False)])
def test_gradients_match_torch_autograd(q_lora, interleave, scaling, bias):
    module, rotary, kw, sd = _layer(q_lora, interleave, scaling, bias)
    x = _x(3)
    g = np.random.default_rng(4).standard_normal((B, T, E))
    xt = torch.tensor(x, requires_grad=True)
    out, _ = _hf(module, rotary, xt, POSITIONS, _causal())
    (out * torch.as_tensor(g)).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in module.named_parameters()}
    ours = mla.backward(sd, x, None, g, positions=POSITIONS, is_causal=True, **kw)
    assert set(ours) == set(sd) | {"x"}
    for key, grad in ours.items():
        mod, _, leaf = key.partition(".")
        ref = xt.grad.numpy() if key == "x" else hf_grads[f"{HF_NAME.get(mod, mod)}.{leaf}"]
        assert np.abs(ref).max() > 1e-3, key  # a gradient that is there
        assert _err(grad, ref) < HF_TOL, key


@pytest.mark.parametrize("q_lora,masked_rows", [(Q, "zero"), (None, "uniform")])
def test_backward_matches_central_differences(q_lora, masked_rows):
    """Directional derivatives of sum(output·g) along a random direction per tensor, under a keep-mask with a
    fully masked row (a constant of the policy: its gradient must be none)."""
    _, _, kw, sd = _layer(q_lora, False, "yarn-0.707", True)
    rng = np.random.default_rng(5)
    x, g = _x(6), rng.standard_normal((B, T, E))
    keep = rng.random((B, 1, T, T)) < 0.6
    keep[:, :, np.arange(T), np.arange(T)] = True
    keep[1, :, 2] = False  # row 2 of batch 1 keeps nothing
    grads = mla.backward(sd, x, keep, g, positions=POSITIONS, masked_rows=masked_rows, **kw)
    h = 1e-6
    for key in grads:
        d = rng.standard_normal(x.shape if key == "x" else sd[key].shape)

        def loss(sign, key=key, d=d):
            sd2 = dict(sd) if key == "x" else {**sd, key: sd[key] + sign * h * d}
            x2 = x + sign * h * d if key == "x" else x
            return (mla.forward(sd2, x2, keep, positions=POSITIONS, masked_rows=masked_rows, **kw).output * g).sum()
        numeric = (loss(1) - loss(-1)) / (2 * h)
        analytic = (grads[key] * d).sum()
        assert abs(numeric - analytic) <= FD_TOL * max(1.0, abs(numeric)), (key, numeric, analytic)


def _hf_decode(module, rotary, x, starts):
    """HF's outputs (B, L, E) of a prefill then one token per call against a DynamicCache, and the cache."""
    cache = DynamicCache(config=module.config)
    outs = []
    with torch.no_grad():
        for lo, hi in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, L)]:
            slots = np.arange(lo, hi)
            keep = (np.arange(hi)[None, None, None, :] >= starts[:, None, None, None]) & (
                np.arange(hi)[None, None, None, :] <= slots[None, None, :, None])  # (B, 1, T, hi)
            out, _ = _hf(module, rotary, torch.as_tensor(x[:, lo:hi]), slots[None, :] - starts[:, None], keep, cache)
            outs.append(out.numpy())
    return np.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("q_lora,interleave,scaling", [(Q, True, "yarn-0.707"), (None, False, "yarn-1.0")])
def test_decode_matches_hf_dynamic_cache(q_lora, interleave, scaling):
    """Left padding (starts) as HF meets it: a mask that hides the padding, positions slot - start. The padding
    columns' own queries attend nothing (NaN here, HF's finfo.min gives a uniform row): compared elsewhere."""
    module, rotary, kw, sd = _layer(q_lora, interleave, scaling, True)
    x, starts = _x(7, L), np.array([0, 2, 1])
    out, cache = _hf_decode(module, rotary, x, starts)
    d = mla.decode(sd, x, prefill=PREFILL, starts=starts, **kw)
    c_hf, pe_hf = cache.layers[0].keys.numpy(), cache.layers[0].values.numpy()  # (B, 1, L, C), (B, 1, L, Dr)
    assert c_hf.shape == (B, 1, L, C) and pe_hf.shape == (B, 1, L, DR)
    assert _err(d.c, c_hf[:, 0]) < HF_TOL
    # HF's interleaved rotation writes its result de-interleaved (the pairs' first members, then their second:
    # apply_rotary_pos_emb_interleave's cat), so its cache holds k_pe in that order; the oracle keeps the layout
    # (DeepSeek's own view_as_complex rotation). Same scores either way: q is permuted alike.
    order = np.r_[0:DR:2, 1:DR:2] if interleave else np.arange(DR)
    assert _err(d.k_pe[..., order], pe_hf[:, 0]) < HF_TOL
    real = np.arange(L)[None, :] >= starts[:, None]  # (B, L)
    assert _err(d.output[real], out[real]) < HF_TOL


@pytest.mark.parametrize("absorbed,prefill", [(False, PREFILL), (True, PREFILL), (True, 0), (False, L)])
def test_decode_equals_one_causal_forward(absorbed, prefill):
    _, _, kw, sd = _layer(Q, True, "yarn-0.707", True)
    x, starts = _x(8, L), np.array([1, 0, 3])
    d = mla.decode(sd, x, prefill=prefill, starts=starts, absorbed=absorbed, **kw)
    f = mla.forward(sd, x, decode_keep(starts, L), positions=decode_positions(starts, L), **kw)
    np.testing.assert_allclose(d.output, f.output, rtol=0, atol=SELF_TOL)  # NaN on the padding queries in both
    assert np.isnan(d.output[2, :3]).all() and not np.isnan(d.output[2, 3:]).any()
    np.testing.assert_allclose(d.c, f.c, rtol=0, atol=SELF_TOL)
    np.testing.assert_allclose(d.k_pe, f.k_pe[:, 0], rtol=0, atol=SELF_TOL)


def _output_from(f, sd, kw, q_rot=None, k=None, scale=None):
    """The output of the attention core run again on f's stages with one of them replaced (a planted slip)."""
    q_rot = f.q_rot if q_rot is None else q_rot
    k = f.k if k is None else k
    scale = mla.softmax_scale(mla.config_of_mla(sd, **{n: kw[n] for n in kw if n != "num_heads"},
                                                num_heads=N)) if scale is None else scale
    s = np.einsum("BNTD,BNSD->BNTS", q_rot, k) * scale + np.where(_causal(), 0.0, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    context = np.einsum("BNTS,BNSD->BTND", w, f.v).reshape(B, T, N * DV)
    return context @ sd["out_proj.weight"].T + sd["out_proj.bias"]


def test_planted_slips_are_far_outside_the_tolerance():
    """What an MLA port gets wrong, each > 100x HF_TOL from HF -- while the oracle is within it."""
    module, rotary, kw, sd = _layer(Q, True, "yarn-0.707", True)
    x = _x(9)
    with torch.no_grad():
        hf = _hf(module, rotary, x, POSITIONS, _causal())[0].numpy()
    f = mla.forward(sd, x, positions=POSITIONS, is_causal=True, **kw)
    assert _err(_output_from(f, sd, kw), hf) < HF_TOL  # the re-run itself is faithful
    unshared = f.k.copy()
    unshared[:, 1:, :, DN:] = 0.0  # the rope key given to the first head only, not shared by all N
    raw = (x @ sd["kv_a_proj.weight"].T + sd["kv_a_proj.bias"])[:, None, :, C:]  # (B, 1, S, Dr) before RoPE
    inv = rope_inv_freq(DR, 10000.0, kw["rope_scaling"])
    pos = POSITIONS[:, None, :, None] * inv
    factor = rope_attention_factor(kw["rope_scaling"])
    half_key = f.k.copy()
    half_key[..., DN:] = rotate(raw, factor * np.cos(pos), factor * np.sin(pos), "half")  # q stays interleaved
    slips = {"rope key not shared": _output_from(f, sd, kw, k=unshared),
             "mscale missing from the scale": _output_from(f, sd, kw, scale=(DN + DR) ** -0.5),
             "half rotation on the rope key": _output_from(f, sd, kw, k=half_key)}
    for name, out in slips.items():
        assert _err(out, hf) > 100 * HF_TOL, name


def test_config_of_mla_names_what_is_wrong():
    _, _, kw, sd = _layer(Q, True, "default", True)
    fields = {n: kw[n] for n in kw if n != "num_heads"}
    cfg = mla.config_of_mla(sd, N, **fields)
    assert (cfg.embed_dim, cfg.bias, cfg.q_lora_rank) == (E, True, Q)
    with pytest.raises(ValueError, match="missing \\['q_a_norm.weight'\\]"):
        mla.config_of_mla({k: v for k, v in sd.items() if k != "q_a_norm.weight"}, N, **fields)
    with pytest.raises(ValueError, match="unexpected \\['q_proj.weight'\\]"):
        mla.config_of_mla({**sd, "q_proj.weight": np.zeros((N * (DN + DR), E))}, N, **fields)
    with pytest.raises(ValueError, match="kv_b_proj.weight has shape \\(27, 5\\), expected \\(27, 6\\)"):
        mla.config_of_mla({**sd, "kv_b_proj.weight": np.zeros((N * (DN + DV), C - 1))}, N, **fields)
    with pytest.raises(ValueError, match="q_proj"):  # q_lora_rank=None asks for q_proj, the dict has q_a_proj
        mla.config_of_mla(sd, N, **{**fields, "q_lora_rank": None})
    with pytest.raises(ValueError, match="masked_rows"):
        mla.forward(sd, _x(), masked_rows="drop", **kw)
    with pytest.raises(ValueError, match="x must have shape"):
        mla.forward(sd, _x()[..., :-1], **kw)


@pytest.mark.parametrize("masked_rows", ["nan", "zero", "uniform"])
def test_a_row_that_keeps_nothing_follows_the_policy(masked_rows):
    """As reference.forward: NaN, zeros (the output is out_proj's bias), or 1/S over every key (the mean value)."""
    _, _, kw, sd = _layer(None, True, "default", True)
    keep = np.ones((B, 1, T, T), bool)
    keep[2, :, 1] = False  # batch 2's query 1 keeps nothing
    f = mla.forward(sd, _x(10), keep, positions=POSITIONS, masked_rows=masked_rows, **kw)
    row = f.output[2, 1]
    if masked_rows == "nan":
        assert np.isnan(row).all() and not np.isnan(np.delete(f.output[2], 1, axis=0)).any()
        return
    context = 0.0 if masked_rows == "zero" else f.v[2].mean(axis=1).reshape(N * DV)  # (N, S, Dv) -> (N·Dv,)
    np.testing.assert_allclose(row, sd["out_proj.weight"] @ np.broadcast_to(context, (N * DV,)) + sd["out_proj.bias"],
                               rtol=0, atol=SELF_TOL)
    np.testing.assert_allclose(f.weights[2, :, 1], 0.0 if masked_rows == "zero" else 1 / T, rtol=0, atol=0)


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_scale_and_frequencies_agree_with_hf_and_mha_spec(scaling):
    """The oracle's own mscale and its (reference.py's) frequencies against HF's module.scaling and rotary
    inv_freq (float32 there: 1e-7), and against LatentAttentionConfig's, written apart (float64: 1e-15)."""
    module, rotary, kw, sd = _layer(Q, True, scaling, False)
    cfg = mla.config_of_mla(sd, **kw)
    ours = mla.softmax_scale(cfg)
    assert ours == pytest.approx(module.scaling, rel=1e-15) and ours == pytest.approx(cfg.softmax_scale, rel=1e-15)
    inv = rope_inv_freq(DR, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv, rotary.inv_freq.double().numpy(), rtol=1e-7, atol=0)
    np.testing.assert_allclose(inv, cfg.rope_frequencies(), rtol=1e-15, atol=0)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(rotary.attention_scaling, rel=1e-15)
