"""mha_jax.MultiHeadLatentAttention (DeepSeek's multi-head latent attention) in float64: against transformers'
DeepseekV3Attention, its latent cache (prefill + steps == one causal forward, naive == absorbed, left padding),
and mha_torch.MultiHeadLatentAttention on the same weights.

Tiny pairwise-distinct sizes (E=12, N=3, Q=7, C=6, Dn=4, Dr=2, Dv=5; B=3, T=5) so a swapped axis fails; every
weight redrawn (the RMSNorm weights away from 1, the biases away from torch's init). Dr=2 is one rotated pair, which
"half" and "interleaved" pair alike and YaRN (original 16, factor 4) leaves unscaled: two of the transformers cases
rotate Dr=16 features, so the convention and the YaRN ramp show. Every module call is jitted (`_jit`): eager JAX
compiles each primitive per shape (measured 1.4 s per new shape of this layer, a whole jitted call 0.2 s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from mha_jax import LatentCache, MultiHeadLatentAttention
from mha_spec import RopeScaling

B, T, E, N = 3, 5, 12, 3
Q, C, Dn, Dr, Dv = 7, 6, 4, 2, 5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale_all_dim": 1.0}
HF_NAMES = {"q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_a_norm",
            "o_proj": "out_proj"}
# (q_lora_rank, rope_interleave, yarn, attention_bias, Dr): every pair of values of two of the first four
# factors appears in some row (5 rows instead of 16).
HF_CASES = [(None, False, False, False, Dr), (None, True, True, True, 16), (Q, False, True, True, 16),
            (Q, True, False, True, Dr), (Q, True, True, False, Dr)]


@functools.partial(nnx.jit, static_argnames=("need_weights", "is_causal", "absorb", "return_intermediates"))
def _jit(m, x, mask=None, positions=None, cache=None, key_value=None, key_positions=None, *, need_weights=True,
         is_causal=False, absorb=False, return_intermediates=False):
    """m(x, ...) as one compiled program per layer, shapes and flags."""
    return m(x, mask, need_weights, positions=positions, cache=cache, key_value=key_value, key_positions=key_positions,
             is_causal=is_causal, absorb=absorb, return_intermediates=return_intermediates)


def _hf_layer(q_lora, interleave: bool, yarn: bool, bias: bool, rope_dim: int = Dr):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {**YARN, "rope_theta": 10000.0}
    cfg = DeepseekV3Config(hidden_size=E, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=q_lora,
                           kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=rope_dim, v_head_dim=Dv,
                           rope_interleave=interleave, attention_bias=bias, rope_parameters=rope,
                           max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(7)
    layer = DeepseekV3Attention(cfg, layer_idx=0).double().eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
            elif name.endswith(".bias"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
    return cfg, layer


def _canonical(layer) -> dict[str, np.ndarray]:
    """HF's state dict under the canonical names (mha_spec.MLA_KEYS)."""
    sd = {}
    for name, p in layer.state_dict().items():
        module, param = name.rsplit(".", 1)
        sd[f"{HF_NAMES.get(module, module)}.{param}"] = p.detach().numpy().copy()
    return sd


def _jax_mla(sd, **kw) -> MultiHeadLatentAttention:
    """Our module holding the canonical weights sd: every parameter of the module is one of sd's entries."""
    rope_dim = sd["kv_a_proj.weight"].shape[0] - C  # its rows are C + Dr
    m = MultiHeadLatentAttention(E, N, kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=rope_dim, v_head_dim=Dv,
                                 q_lora_rank=Q if "q_a_proj.weight" in sd else None, bias="out_proj.bias" in sd,
                                 param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
    shapes = m.config.weight_shapes()
    assert sorted(sd) == sorted(shapes), (sorted(sd), sorted(shapes))
    assert len(jax.tree.leaves(nnx.state(m, nnx.Param))) == len(shapes)
    for key, value in sd.items():
        assert value.shape == shapes[key], key
        module, param = key.rsplit(".", 1)
        layer = getattr(m, module)
        if module.endswith("norm"):
            layer.weight[...] = jnp.asarray(value)
        elif param == "weight":
            layer.kernel[...] = jnp.asarray(value.T)  # torch (out, in) -> nnx.Linear's (in, out)
        else:
            layer.bias[...] = jnp.asarray(value)
    return m


def _scaling(yarn: bool):
    return RopeScaling.from_mapping("yarn", {k: v for k, v in YARN.items() if k != "rope_type"}) if yarn else None


@pytest.fixture(scope="module")
def x64():
    return np.random.default_rng(5).standard_normal((B, T, E))


@pytest.mark.parametrize("q_lora,interleave,yarn,bias,rope_dim", HF_CASES)
def test_forward_matches_transformers(q_lora, interleave, yarn, bias, rope_dim, x64):
    cfg, layer = _hf_layer(q_lora, interleave, yarn, bias, rope_dim)
    pos = np.arange(T) + 3  # past 0, so a position offset shows
    xt = torch.from_numpy(x64)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(xt, torch.from_numpy(pos)[None].expand(B, T))
    additive = torch.full((T, T), -torch.inf, dtype=torch.float64).triu(1)[None, None]  # (1, 1, T, T), causal
    with torch.no_grad():
        want, want_w = layer(xt, position_embeddings=(cos, sin), attention_mask=additive)
    m = _jax_mla(_canonical(layer), rope="interleaved" if interleave else "half", rope_scaling=_scaling(yarn))
    assert m.config.softmax_scale == pytest.approx(layer.scaling, rel=1e-15)
    got, got_w = _jit(m, x64, positions=pos, is_causal=True)
    # HF's cos/sin are float32 (cast to float64) and its eager softmax float32: measured max |diff| over the five
    # cases 1.2e-7 on the outputs (|out| <= 1.5), 7.0e-8 on the weights. The other convention (Dr=16) or the
    # scaling flipped (yarn <-> none) measured >= 8e-2 on both.
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ the latent cache

STARTS = np.array([0, 2, 1], np.int32)  # left padding per row
L, CAP, PREFILL = 6, 7, 4


@pytest.fixture(scope="module")
def cached_layer():
    _, layer = _hf_layer(Q, True, True, True)
    return _jax_mla(_canonical(layer), rope_scaling=_scaling(True), masked_rows="zero")


def _decode(m, x, absorb: bool):
    """Prefill PREFILL tokens, then one step per token: (outputs (B, L, E), last step's weights
    (B, N, 1, CAP), the final cache)."""
    cache = m.init_cache(B, CAP, starts=STARTS)
    out, _, cache = _jit(m, x[:, :PREFILL], cache=cache, absorb=absorb)
    outs = [out]
    for t in range(PREFILL, L):
        out, w, cache = _jit(m, x[:, t:t + 1], cache=cache, absorb=absorb)
        outs.append(out)
    return np.concatenate([np.asarray(o) for o in outs], axis=1), np.asarray(w), cache


def test_cache_decode_matches_forward_naive_and_absorbed(cached_layer):
    m = cached_layer
    x = np.random.default_rng(9).standard_normal((B, L, E))
    # One forward over the padded rows: token t of row b keeps starts[b] <= s <= t, at position t - starts[b].
    s = np.arange(L)
    keep = (s[None, None, :] >= STARTS[:, None, None]) & (s[None, None, :] <= s[None, :, None])  # (B, L, L)
    pos = s[None, :] - STARTS[:, None]  # (B, L)
    want, want_w = _jit(m, x, keep, positions=pos)
    naive, naive_w, naive_cache = _decode(m, x, absorb=False)
    absorbed, absorbed_w, absorbed_cache = _decode(m, x, absorb=True)
    valid = s[None, :] >= STARTS[:, None]  # (B, L): the padded tokens' rows keep no key
    np.testing.assert_allclose(naive[valid], np.asarray(want)[valid], rtol=0, atol=1e-12)
    np.testing.assert_allclose(absorbed[valid], naive[valid], rtol=0, atol=1e-12)
    # The last step's weights over the CAP slots: slot s holds token s; slot L (unwritten) gets none.
    np.testing.assert_allclose(naive_w[:, :, 0, :L], np.asarray(want_w)[:, :, L - 1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(absorbed_w, naive_w, rtol=0, atol=1e-12)
    assert not naive_w[:, :, :, L:].any()
    # The cache holds the same latents either way, and C + Dr numbers per token.
    for name in ("c", "k_pe", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(absorbed_cache, name)), np.asarray(getattr(naive_cache, name)))
    assert naive_cache.width == naive_cache.c.shape[2] + naive_cache.k_pe.shape[2] == m.config.cache_width == C + Dr
    np.testing.assert_array_equal(np.asarray(naive_cache.lengths), [L] * B)
    # Left padding: row 1 decoded after 2 padding slots is row 1's tokens alone, causal from position 0.
    alone, _ = _jit(m, x[1:2, 2:], is_causal=True)
    np.testing.assert_allclose(naive[1, 2:], np.asarray(alone)[0], rtol=0, atol=1e-12)


def test_absorbed_forward_and_stages(cached_layer):
    m = cached_layer
    x = np.random.default_rng(3).standard_normal((B, T, E))
    out, w, st = _jit(m, x, is_causal=True, return_intermediates=True)
    out_a, w_a, st_a = _jit(m, x, is_causal=True, return_intermediates=True, absorb=True)
    np.testing.assert_allclose(np.asarray(out_a), np.asarray(out), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(st_a.scores), np.asarray(st.scores), rtol=0, atol=1e-12)
    assert st.q.shape == (B, N, T, Dn + Dr) and st.k.shape == (B, N, T, Dn + Dr) and st.v.shape == (B, N, T, Dv)
    assert st.q_rot.shape == (B, N, T, Dr) and st.k_rot.shape == (B, 1, T, Dr) and st.latent.shape == (B, T, C)
    # The scores are the stages' own logits: cat(q_nope, q_rot) · cat(k_nope, k_rot) · scale, -inf above the diagonal.
    q = np.concatenate([np.asarray(st.q)[..., :Dn], np.asarray(st.q_rot)], axis=-1)
    k = np.concatenate([np.asarray(st.k)[..., :Dn], np.repeat(np.asarray(st.k_rot), N, axis=1)], axis=-1)
    logits = np.einsum("bntd,bnsd->bnts", q, k) * m.config.softmax_scale
    causal = np.tril(np.ones((T, T), bool))
    np.testing.assert_allclose(np.asarray(st.scores)[..., causal], logits[..., causal], rtol=0, atol=1e-12)
    assert np.isneginf(np.asarray(st.scores)[..., ~causal]).all()


def test_bfloat16_cache_naive_and_absorbed(cached_layer):
    """A bfloat16 layer decodes both ways (XLA's CPU dot refused one of the absorbed contractions for 16-bit
    inputs) with scores in float32, near the float64 layer whose weights it rounds."""
    x = np.random.default_rng(2).standard_normal((B, T, E))
    want, _ = _jit(cached_layer, x, is_causal=True)
    m = nnx.clone(cached_layer)
    nnx.update(m, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(m)))
    for absorb in (False, True):
        got, _, cache = _jit(m, jnp.asarray(x, jnp.bfloat16), cache=m.init_cache(B, CAP), absorb=absorb)
        assert got.dtype == cache.c.dtype == jnp.bfloat16
        # Measured max |diff| 3.8e-3 (naive), 4.4e-3 (absorbed) at |out| <= 1.3: bfloat16 rounds weights and inputs
        # at 2^-9 relative; float32 scores and softmax keep it there.
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), rtol=0, atol=2e-2)


def test_cache_refusals(cached_layer):
    m = cached_layer
    x = np.zeros((B, 2, E))
    cache = m.init_cache(B, 3)
    with pytest.raises(ValueError, match="cache's keep-mask"):
        m(x, np.ones((2, 2), bool), cache=cache)
    with pytest.raises(ValueError, match="4 new tokens"):
        m(np.zeros((B, 4, E)), cache=cache)
    _, _, full = _jit(m, x, cache=cache)
    with pytest.raises(ValueError, match=r"rows \[0, 1, 2\].*no room for 2"):
        m(x, cache=full)
    with pytest.raises(TypeError, match="float32"):
        m(x.astype(np.float32))
    with pytest.raises(ValueError, match="must lie in"):
        LatentCache(cache.c, cache.k_pe, cache.starts, jnp.asarray([0, 4, 0], jnp.int32))


# ------------------------------------------------------------------------------------------ against mha_torch


def test_matches_mha_torch():
    from mha_torch import MultiHeadLatentAttention as TorchMLA

    sd = _canonical(_hf_layer(None, False, False, True)[1])
    kw = dict(kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv, rope="half", bias=True,
              masked_rows="uniform")
    ours = _jax_mla(sd, **{k: v for k, v in kw.items() if k in ("rope", "masked_rows")})
    theirs = TorchMLA(E, N, dtype=torch.float64, **kw)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, T, E))
    keep = rng.random((B, T, T)) > 0.4
    keep[2, 1] = False  # a row that keeps no key: "uniform" gives it the mean of v
    pos = np.array([[4, 1, 0, 7, 2], [0, 1, 2, 3, 4], [9, 8, 7, 6, 5]])
    got = _jit(ours, x, keep, positions=pos, return_intermediates=True)
    with torch.no_grad():
        want = theirs(torch.from_numpy(x), torch.from_numpy(keep), positions=torch.from_numpy(pos),
                      return_intermediates=True)
    np.testing.assert_allclose(np.asarray(got[0]), want[0].numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(got[1]), want[1].numpy(), rtol=0, atol=1e-12)
    for name in ("q", "k", "v", "q_rot", "k_rot", "latent", "scores", "context"):
        np.testing.assert_allclose(np.asarray(getattr(got[2], name)), getattr(want[2], name).numpy(), rtol=0,
                                   atol=1e-12, err_msg=name)


def test_matches_mha_torch_cross_and_cache():
    from mha_torch import MultiHeadLatentAttention as TorchMLA

    sd = _canonical(_hf_layer(Q, True, True, False)[1])
    ours = _jax_mla(sd, rope_scaling=_scaling(True))
    theirs = TorchMLA(E, N, kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv, q_lora_rank=Q,
                      rope_scaling=_scaling(True), dtype=torch.float64)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    rng = np.random.default_rng(8)
    x, kv = rng.standard_normal((B, T, E)), rng.standard_normal((B, CAP, E))
    kpos = np.arange(CAP) + 2
    t = {"x": torch.from_numpy(x), "kv": torch.from_numpy(kv), "kpos": torch.from_numpy(kpos)}
    # Cross-attention (S = CAP != T) on the fused path: no weights either side.
    got, got_w = _jit(ours, x, key_value=kv, key_positions=kpos, need_weights=False, absorb=True)
    with torch.no_grad():
        want, want_w = theirs(t["x"], None, False, key_value=t["kv"], key_positions=t["kpos"], absorb=True)
    assert got_w is None and want_w is None
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=1e-12)
    # A prefill into left-padded caches, absorbed: outputs, weights and the caches written.
    ours_cache = ours.init_cache(B, CAP, starts=STARTS)
    theirs_cache = theirs.init_cache(B, CAP, starts=torch.from_numpy(STARTS.astype(np.int64)))
    got, got_w, got_cache = _jit(ours, x, cache=ours_cache, absorb=True)
    with torch.no_grad():
        want, want_w, want_cache = theirs(t["x"], cache=theirs_cache, absorb=True)
    valid = np.arange(T)[None, :] >= STARTS[:, None]  # (B, T): the padding tokens' rows keep no key ("nan")
    np.testing.assert_allclose(np.asarray(got)[valid], want.numpy()[valid], rtol=0, atol=1e-12)
    assert np.isnan(np.asarray(got)[~valid]).all() and np.isnan(want.numpy()[~valid]).all()
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), rtol=0, atol=1e-12)
    for name in ("c", "k_pe", "lengths"):
        np.testing.assert_allclose(np.asarray(getattr(got_cache, name)), getattr(want_cache, name).numpy(), rtol=0,
                                   atol=1e-12, err_msg=name)
