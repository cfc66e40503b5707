"""Llama 4's attention features: chunked local attention (`chunk=`, a mask structure), the
weightless L2 QK-norm after RoPE (qk_norm="l2") and the NoPE layers' query temperature
(attn_temperature_tuning, floor_scale, attn_scale), in the spec, both modules and the oracle.

The modules are held to the oracle at 1e-12 in float64 (eager and fused paths, a KV cache for the norm, the
temperature and the chunk, the oracle's decode to its one forward); the chunked mask to its definition (transformers' chunked_overlay AND causal, evaluated
index by index); the oracle to transformers' Llama4TextAttention (float64 module; its RoPE runs in float32:
apply_rotary_emb takes xq.float(), and its temperature factor is float32: the bars and their measurements at
FORWARD_BARS), both layers of a Llama4TextConfig with attention_chunk_size, use_qk_norm and temperature tuning.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from mha_spec import AttentionConfig, Structure, VARIANT_FEATURES
from parity import reference
from parity.tolerances import Tolerance, compare, tolerance_for

B, T, S, E, N, K, H = 3, 5, 7, 12, 3, 1, 4
C = 3  # the chunk: chunks [0, 3), [3, 6), [6, 9) of the key positions
THETA = 500.0
ATOL = 1e-12


def _sd(rng) -> dict:
    """A canonical float64 state dict of E=12, N=3 heads of H=4 over K=1 key/value head, no biases (Llama 4)."""
    shapes = {"q_proj": (N * H, E), "k_proj": (K * H, E), "v_proj": (K * H, E), "out_proj": (E, N * H)}
    return {f"{name}.weight": rng.standard_normal(shape) * 0.4 for name, shape in shapes.items()}


LAYERS = {  # name -> the layer's keywords (modules and oracle alike)
    "chunk": dict(rope="interleaved", rope_theta=THETA),
    "l2": dict(rope="interleaved", rope_theta=THETA, qk_norm="l2", qk_norm_eps=1e-5),
    "temperature": dict(attn_temperature_tuning=True, floor_scale=4.0, attn_scale=0.1),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(47)
    x = rng.standard_normal((B, T, E))
    kv = rng.standard_normal((B, S, E))
    positions = np.arange(T)[None] + np.array([[0], [3], [11]])  # (B, T): up to 15, floor((p + 1) / 4) is 0..4
    return _sd(rng), x, kv, positions


def _torch(sd, layer):
    m = mha_torch.MultiHeadAttention(E, N, num_kv_heads=K, qkv_bias=False, out_bias=False, dtype=torch.float64,
                                     **layer)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    return m


def _jax(sd, layer):
    m = mha_jax.MultiHeadAttention(E, N, rngs=nnx.Rngs(0), num_kv_heads=K, qkv_bias=False, out_bias=False,
                                   param_dtype=jnp.float64, **layer)
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(m, p).kernel[...] = jnp.asarray(sd[f"{p}.weight"].T)  # (E_in, E_out)
    return m


# --- the spec ---------------------------------------------------------------------------------------------

def test_the_config_takes_the_features_and_refuses_what_would_be_ignored():
    l2 = AttentionConfig(E, N, head_dim=H, rope="interleaved", qk_norm="l2")
    assert "qk-norm-l2" in l2.features and {"qk-norm-l2", "temperature"} <= set(VARIANT_FEATURES)
    assert not any("norm" in name for name in l2.weight_shapes())  # the L2 norm has no weight
    hot = AttentionConfig(E, N, attn_temperature_tuning=True, floor_scale=4.0)
    assert "temperature" in hot.features and hot.uses_positions and not AttentionConfig(E, N).uses_positions
    with pytest.raises(ValueError, match="needs rope"):
        AttentionConfig(E, N, qk_norm="l2")
    with pytest.raises(ValueError, match="qk_norm_offset"):
        AttentionConfig(E, N, rope="half", qk_norm="l2", qk_norm_offset=1.0)
    with pytest.raises(ValueError, match="temperature on a RoPE layer"):
        AttentionConfig(E, N, rope="half", attn_temperature_tuning=True)
    with pytest.raises(ValueError, match="without attn_temperature_tuning"):
        AttentionConfig(E, N, floor_scale=4.0)
    with pytest.raises(ValueError, match="floor_scale must be > 0"):
        AttentionConfig(E, N, attn_temperature_tuning=True, floor_scale=0.0)
    with pytest.raises(TypeError, match="attn_temperature_tuning must be a bool"):
        AttentionConfig(E, N, attn_temperature_tuning=1)


def test_chunk_is_a_causal_structure_and_no_band():
    st = Structure.of(T, S, chunk=C, alignment="bottom-right")
    assert st.is_causal and st.chunk == C and st.band() is None and not st.asks_nothing and not st.plain_causal
    assert Structure.of(T, S, **st.keywords()) == st and st.keywords()["chunk"] == C
    assert st.band_only().asks_nothing and st.segments_only() is st  # the whole mask is a keep-mask
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="chunk must be a positive int"):
            Structure.of(T, S, chunk=bad)
    with pytest.raises(ValueError, match="without is_causal"):
        Structure(T, S, chunk=C)
    # A chunk is the cache's own mask too (KVCache.keep_mask(T, chunk=C)): not among what a cache refuses.
    with pytest.raises(TypeError, match="chunk"):
        Structure.refuse_with_cache(chunk=C)
    with pytest.raises(ValueError, match="window with a cache"):
        Structure.refuse_with_cache(window=(C, 0))


def _by_definition(T_, S_, chunk, offset):
    """transformers' chunked_causal_mask_function (chunked_overlay AND causal, no left padding), index by index,
    with query t at key position t + offset."""
    from transformers.masking_utils import chunked_causal_mask_function

    f = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.int64))
    zero = torch.tensor(0)
    return np.array([[bool(f(zero, zero, torch.tensor(t + offset), torch.tensor(s))) for s in range(S_)]
                     for t in range(T_)])[None, None]


@pytest.mark.parametrize("T_,S_,alignment", [(7, 7, "top-left"), (T, S, "bottom-right"), (T, S, "top-left"),
                                             (S, T, "bottom-right")])
def test_the_chunked_mask_is_transformers_chunked_causal_mask(T_, S_, alignment):
    offset = S_ - T_ if alignment == "bottom-right" else 0
    want = _by_definition(T_, S_, C, offset)
    assert want.any(axis=-1).sum() >= 1 and not want.all()
    ours = reference.structured_keep(T_, S_, chunk=C, alignment=alignment)
    np.testing.assert_array_equal(ours, want)
    np.testing.assert_array_equal(mha_torch.structured_keep(T_, S_, chunk=C, alignment=alignment).numpy(), want)
    np.testing.assert_array_equal(np.asarray(mha_jax.structured_keep(T_, S_, chunk=C, alignment=alignment)), want)
    seg = np.array([[0] * (T_ - 2) + [1] * 2])  # (1, T) with a window too: all ANDed, in all three
    kw = dict(chunk=C, window=(1, None), alignment=alignment)
    if T_ == S_:
        both = reference.structured_keep(T_, S_, segment_ids=seg, **kw)
        np.testing.assert_array_equal(both, want & (seg[:, None, :, None] == seg[:, None, None, :])
                                      & (np.arange(S_)[None, :] >= np.arange(T_)[:, None] + offset - 1))
        np.testing.assert_array_equal(mha_torch.structured_keep(T_, S_, segment_ids=torch.from_numpy(seg), **kw), both)
        np.testing.assert_array_equal(np.asarray(mha_jax.structured_keep(T_, S_, segment_ids=seg, **kw)), both)


# --- the modules against the oracle ------------------------------------------------------------------------

def _oracle(sd, x, kv, name, **kw):
    return reference.forward(sd, x, kv, kv, num_heads=N, num_kv_heads=K, **LAYERS[name], **kw)


@pytest.mark.parametrize("name", list(LAYERS))
def test_torch_is_the_oracle(name, data):
    sd, x, kv, positions = data
    m = _torch(sd, LAYERS[name])
    kw = dict(chunk=C, alignment="bottom-right") if name == "chunk" else {}
    pos = dict(positions=torch.from_numpy(positions)) if name == "temperature" else {}
    f = _oracle(sd, x, kv, name, positions=positions if pos else None, **kw)
    xt, kvt = torch.from_numpy(x), torch.from_numpy(kv)
    for need_weights in (True, False):
        out, w = m(xt, kvt, kvt, need_weights=need_weights, **kw, **pos)
        np.testing.assert_allclose(out.detach().numpy(), f.output, rtol=0, atol=ATOL)
        if need_weights:
            np.testing.assert_allclose(w.detach().numpy(), f.weights, rtol=0, atol=ATOL)
    if name == "chunk":  # bottom-right: query 1 sits at key 3, the first of chunk 1, and keeps it alone
        assert (f.weights[:, :, 1, :3] == 0).all() and np.allclose(f.weights[:, :, 1, 3], 1.0)
    if name == "l2":  # the stage after RoPE is after the norm too: unit RMS per head
        _, _, st = m(xt, kvt, kvt, return_intermediates=True)
        np.testing.assert_allclose(st.q_rot.detach().numpy(), f.q_rot, rtol=0, atol=ATOL)
        assert st.q_norm is None and np.allclose((f.q_rot ** 2).mean(-1), 1.0, atol=1e-3)


@pytest.mark.parametrize("name", list(LAYERS))
def test_jax_is_the_oracle(name, data, forced_kernel):
    from mha_jax import kernels

    sd, x, kv, positions = data
    m = _jax(sd, LAYERS[name])
    kw = dict(chunk=C, alignment="bottom-right") if name == "chunk" else {}
    pos = dict(positions=positions) if name == "temperature" else {}
    f = _oracle(sd, x, kv, name, **kw, **pos)
    out, w = m(x, kv, kv, **kw, **pos)
    np.testing.assert_allclose(np.asarray(out), f.output, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(w), f.weights, rtol=0, atol=ATOL)
    forced_kernel(kernels.CHUNKED)  # the chunked kernel: the chunk reaches it as a dense keep-mask
    out, _ = m(x, kv, kv, need_weights=False, **kw, **pos)
    np.testing.assert_allclose(np.asarray(out), f.output, rtol=0, atol=ATOL)


def test_chunk_reaches_every_jax_kernel_as_a_mask(data, forced_kernel):
    from mha_jax import kernels

    sd, x, kv, _ = data
    q = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, N, H)))
    k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((B, S, K, H))) for i in (2, 3))
    keep = reference.structured_keep(T, S, chunk=C, alignment="bottom-right")
    want = mha_jax.attention_core(q, k, v, keep)[0]
    for kernel in (kernels.EINSUM, kernels.CHUNKED):  # (dot_product_attention: the einsum's keep-mask, float32 inside)
        forced_kernel(kernel)
        got = mha_jax.fused_attention_core(q, k, v, chunk=C, alignment="bottom-right")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL, err_msg=kernel)


def _jitted_step(m, xs, cache, **chunk):
    """One call of the JAX module with a cache under nnx.jit: two programs (prefill, step), not every op compiled
    one by one (measured: 6.6 s eager, the whole test)."""
    from flax import nnx

    return nnx.jit(lambda m, xs, cache: m(xs, xs, xs, cache=cache, need_weights=False, **chunk))(m, xs, cache)


@pytest.mark.parametrize("name", ["l2", "temperature", "chunk"])
def test_a_cache_runs_the_norm_the_temperature_and_the_chunk_as_the_oracle_decodes(name, data):
    """The oracle's decode (its own cache path) equals one forward with decode_keep and decode_positions, and
    both modules' caches equal it; the chunk (C = 3 over T = 5, row 1 left-padded by 1) counts positions from
    each row's start: row 1's chunks are its slots [1, 4), [4, 7)."""
    sd, x, _, _ = data
    starts = np.array([0, 1, 0])
    chunk = dict(chunk=C) if name == "chunk" else {}
    dec = reference.decode(sd, x, starts=starts, prefill=3, num_heads=N, num_kv_heads=K, **LAYERS[name], **chunk)
    pos = reference.decode_positions(starts, T)
    one = reference.forward(sd, x, x, x, reference.decode_keep(starts, T, **chunk), num_heads=N, num_kv_heads=K,
                            positions=pos, **({"key_positions": pos} if name != "temperature" else {}), **LAYERS[name])
    np.testing.assert_allclose(dec.output, one.output, rtol=0, atol=ATOL)
    if chunk:  # the chunk binds: row 1's token at slot 4 (position 3) keeps slot 4 alone
        keep = reference.decode_keep(starts, T, chunk=C)
        assert keep[1, 0, 4].tolist() == [False, False, False, False, True] and keep[0, 0, 4, 3]
        plain = reference.decode(sd, x, starts=starts, prefill=3, num_heads=N, num_kv_heads=K, **LAYERS[name])
        assert np.abs(np.nan_to_num(plain.output - dec.output)).max() > 1e-3
    for framework in ("torch", "jax"):
        if framework == "torch":
            m, arr, to_np = _torch(sd, LAYERS[name]), torch.from_numpy, lambda a: a.detach().numpy()
            cache = m.init_cache(B, T, starts=torch.from_numpy(starts))
        else:
            m, arr, to_np = _jax(sd, LAYERS[name]), jnp.asarray, np.asarray
            cache = m.init_cache(B, T, starts=jnp.asarray(starts))
        if framework == "jax":
            call = (lambda m, xs, cache: _jitted_step(m, xs, cache, **chunk))
        else:
            call = (lambda m, xs, cache: m(xs, xs, xs, cache=cache, need_weights=False, **chunk))
        outs = []
        for lo, hi in [(0, 3)] + [(t, t + 1) for t in range(3, T)]:
            xs = arr(x[:, lo:hi])
            out, _, cache = call(m, xs, cache)
            outs.append(to_np(out))
        got = np.concatenate(outs, axis=1)
        assert np.isnan(got[1, 0]).all()  # row 1's padding slot attends nothing: NaN in both (equal_nan)
        np.testing.assert_allclose(got, dec.output, rtol=0, atol=ATOL, err_msg=framework)
    with pytest.raises(ValueError, match="with a cache"):  # the other structured masks are still refused
        _torch(sd, LAYERS["chunk"])(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x),
                                     cache=_torch(sd, LAYERS["chunk"]).init_cache(B, T), window=(2, 0))


def test_temperature_takes_positions_and_the_oracle_backward_is_torch_autograd(data):
    sd, x, kv, positions = data
    layer = LAYERS["temperature"]
    m = _torch(sd, layer)
    xt = torch.from_numpy(x).requires_grad_(True)
    kvt = torch.from_numpy(kv)
    out, _ = m(xt, kvt, kvt, positions=torch.from_numpy(positions), chunk=C, alignment="bottom-right")
    cot = np.random.default_rng(3).standard_normal(out.shape)
    (out * torch.from_numpy(cot)).sum().backward()
    g = reference.backward(sd, x, kv, kv, None, cot, num_heads=N, num_kv_heads=K, positions=positions, chunk=C,
                           alignment="bottom-right", **layer)
    np.testing.assert_allclose(xt.grad.numpy(), g["query"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(m.q_proj.weight.grad.numpy(), g["q_proj.weight"], rtol=0, atol=ATOL)
    l2 = LAYERS["l2"]  # the L2 norm's backward (after RoPE's) against autograd too
    m2, xt2 = _torch(sd, l2), torch.from_numpy(x).requires_grad_(True)
    out2, _ = m2(xt2, kvt, kvt, positions=torch.from_numpy(positions), key_positions=torch.arange(S) + 2)
    (out2 * torch.from_numpy(cot)).sum().backward()
    g2 = reference.backward(sd, x, kv, kv, None, cot, num_heads=N, num_kv_heads=K, positions=positions,
                            key_positions=np.arange(S) + 2, **l2)
    for ours, theirs in ((xt2.grad, g2["query"]), (m2.k_proj.weight.grad, g2["k_proj.weight"])):
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=ATOL)
    plain = reference.forward(sd, x, kv, kv, num_heads=N, num_kv_heads=K, chunk=C, alignment="bottom-right")
    assert np.abs(out.detach().numpy() - plain.output).max() > 1e-3  # the temperature shows
    for mod, arr in ((_torch(sd, {}), torch.from_numpy), (_jax(sd, {}), jnp.asarray)):
        with pytest.raises(ValueError, match="no attn_temperature_tuning"):
            mod(arr(x), arr(x), arr(x), positions=arr(positions))


# --- the oracle against transformers ------------------------------------------------------------------------

# transformers' float64 Llama 4 rotates q and k in float32 (apply_rotary_emb: xq.float(), float32 freqs_cis): the
# RoPE layer is held to float32's forward entry (atol 1e-6, rtol 1e-5); measured on these inputs: max error
# 7.4e-8, 0.04 of the bar. The NoPE layer has no RoPE, only the float32 temperature factor (rounded ~3e-8
# relative): measured max error 8.0e-11, held to 1e-9 (12x), which the planted slips miss by > 1e4x.
FORWARD_BARS = {0: tolerance_for("float32").forward, 1: Tolerance(atol=1e-9, rtol=0.0)}


def _llama4(layer_idx: int):
    import transformers
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    config = transformers.Llama4TextConfig(
        hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, num_hidden_layers=2,
        intermediate_size=8, intermediate_size_mlp=8, vocab_size=16, attention_chunk_size=C, use_qk_norm=True,
        rms_norm_eps=1e-5, no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attn_implementation="eager")
    assert config.layer_types == ["chunked_attention", "full_attention"]
    g = torch.Generator().manual_seed(5)
    att = Llama4TextAttention(config, layer_idx).double().eval()
    with torch.no_grad():
        for p in att.parameters():
            p.copy_((torch.rand(p.shape, generator=g, dtype=p.dtype) - 0.5) * 0.8)
    return config, att, Llama4TextRotaryEmbedding(config)


@pytest.mark.parametrize("layer_idx", [0, 1])  # 0: RoPE, chunked, L2 norm; 1: NoPE, full, temperature
def test_the_oracle_is_llama4_text_attention(layer_idx):
    config, att, rotary = _llama4(layer_idx)
    L = 7  # self-attention over 7 tokens: chunks [0, 3), [3, 6), [6]; floor((t + 1) / 4) is 0, 1
    x = np.random.default_rng(8).standard_normal((B, L, E))
    xt = torch.from_numpy(x)
    freqs = rotary(xt, torch.arange(L)[None].expand(B, L))
    keep = _by_definition(L, L, C, 0) if layer_idx == 0 else np.tril(np.ones((L, L), bool))[None, None]
    mask = torch.from_numpy(np.where(keep, 0.0, np.finfo(np.float64).min))  # eager's additive mask
    out = att(xt, position_embeddings=freqs, attention_mask=mask)[0].detach().numpy()
    sd = {{"o_proj": "out_proj"}.get(n.split(".")[0], n.split(".")[0]) + ".weight": p.detach().numpy()
          for n, p in att.named_parameters()}
    layer = (dict(rope="interleaved", rope_theta=THETA, qk_norm="l2", qk_norm_eps=1e-5, chunk=C) if layer_idx == 0
             else dict(attn_temperature_tuning=True, floor_scale=4.0, attn_scale=0.1, is_causal=True))
    f = reference.forward(sd, x, x, x, num_heads=N, num_kv_heads=K, **layer)
    c = compare(out, f.output, FORWARD_BARS[layer_idx])
    assert c.passed, c
    slip = dict(layer, qk_norm=None) if layer_idx == 0 else dict(layer, floor_scale=8192.0)  # no norm / no heat
    slipped = reference.forward(sd, x, x, x, num_heads=N, num_kv_heads=K,
                                **{k: v for k, v in slip.items() if not (k == "qk_norm_eps" and layer_idx == 0)})
    assert not compare(out, slipped.output, tolerance_for("float32").forward).passed
