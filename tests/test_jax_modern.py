"""mha_jax.MultiHeadAttention's layers after Llama (head_dim, QK-norm, scale, softcap, sinks) against the
float64 oracle: eager (weights), fused (the table's kernel, and the chunked kernel forced to 2 x 3 blocks),
gradients of every weight, the KV cache, the kernel choice and the converters.

Tiny sizes, H = 8 != E/N = 4, one key/value head, RoPE at positions past 0, a row that keeps no key,
every weight redrawn (no norm weight at its resting value, no zero sink).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mha_jax import KVCache, MultiHeadAttention, chunked_attention, fused_attention_core, kernels
from mha_jax.attention import attention_core
from parity import convert, reference

B, T, S, E, N, K, H = 3, 5, 7, 12, 3, 1, 8
ATOL = 1e-10
CASES = {
    "scale": (dict(scale=0.2), False),
    "softcap": (dict(softcap=1.5), False),
    "sinks": ({}, True),
    "qk-norm-head+offset": (dict(qk_norm="head", qk_norm_offset=1.0, qk_norm_eps=1e-3), False),
    "all-flat": (dict(qk_norm="flat", softcap=1.3, scale=0.3), True),
}


def _drawn(rng, qk_norm=None, sinks=False):
    sd = {"q_proj.weight": (N * H, E), "k_proj.weight": (K * H, E), "v_proj.weight": (K * H, E),
          "out_proj.weight": (E, N * H), "q_proj.bias": (N * H,), "k_proj.bias": (K * H,), "v_proj.bias": (K * H,),
          "out_proj.bias": (E,)}
    sd = {name: rng.uniform(-0.5, 0.5, shape) for name, shape in sd.items()}
    if qk_norm:
        flat = qk_norm == "flat"
        sd["q_norm.weight"] = rng.uniform(0.5, 1.5, N * H if flat else H)
        sd["k_norm.weight"] = rng.uniform(0.5, 1.5, K * H if flat else H)
    if sinks:
        sd["sinks"] = rng.standard_normal(N)
    return sd


def _problem(rng):
    q, k, v = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E)), rng.standard_normal((B, S, E))
    keep = rng.random((B, T, S)) > 0.3
    keep[..., 0] = True
    keep[1, 2] = False  # a row that keeps no key
    return q, k, v, keep


POS = dict(positions=np.arange(T) + 3, key_positions=np.arange(S) + 1)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_oracle(case, rng, forced_kernel):
    kw, sinks = CASES[case]
    sd = _drawn(rng, kw.get("qk_norm"), sinks)
    q, k, v, keep = _problem(rng)
    layer = dict(num_kv_heads=K, masked_rows="zero", rope="half", **kw)
    want = reference.forward(sd, q, k, v, keep, num_heads=N, **layer, **POS)
    m = convert.to_jax(sd, N, **layer)
    args = [jnp.asarray(x) for x in (q, k, v, keep)]
    pos = {n: jnp.asarray(p) for n, p in POS.items()}
    out, w, st = m(*args, return_intermediates=True, **pos)
    np.testing.assert_allclose(np.asarray(out), want.output, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(w), want.weights, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(st.scores), want.scores, rtol=0, atol=ATOL)  # capped, -inf where masked
    if sinks:  # the row that keeps no key gives everything to its sink, whatever masked_rows says
        assert not np.asarray(w)[1, :, 2].any()
    for name in ("q_norm", "k_norm"):
        if hasattr(st, name) and getattr(want, name) is not None:
            np.testing.assert_allclose(np.asarray(getattr(st, name)), getattr(want, name), rtol=0, atol=ATOL)
    fused, _ = m(*args, need_weights=False, **pos)
    np.testing.assert_allclose(np.asarray(fused), want.output, rtol=0, atol=ATOL)
    forced_kernel(kernels.CHUNKED)  # several blocks on both axes
    chunked, _ = m(*args, need_weights=False, **pos)
    np.testing.assert_allclose(np.asarray(chunked), want.output, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kernel", [kernels.EINSUM, kernels.CHUNKED])
def test_gradients_match_oracle(kernel, rng, forced_kernel):
    """Every weight's gradient (norm weights and sinks too) and the inputs', on the weights path and the
    forced fused kernel (the chunked kernel's own backward: softcap's 1 - tanh², the sinks' -p_sink·D)."""
    kw = dict(qk_norm="flat", softcap=1.3, scale=0.3, qk_norm_offset=1.0)
    sd = _drawn(rng, "flat", sinks=True)
    q, k, v, keep = _problem(rng)
    g = rng.standard_normal((B, T, E))
    want = reference.backward(sd, q, k, v, keep, g, num_heads=N, num_kv_heads=K, masked_rows="zero", **kw)
    graph, state = nnx.split(convert.to_jax(sd, N, num_kv_heads=K, masked_rows="zero", **kw))
    forced_kernel(kernel)

    def loss(state, q, k, v):
        return (nnx.merge(graph, state)(q, k, v, jnp.asarray(keep), need_weights=kernel == kernels.EINSUM)[0] * g).sum()

    # one program under jit (op by op, the suite compiled each primitive apart: ~10 s cold)
    d_state, *d_in = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(state, *(jnp.asarray(x) for x in (q, k, v)))
    got = convert.from_jax(nnx.merge(graph, d_state))
    assert set(got) == set(sd)
    for name in sd:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=ATOL, err_msg=name)
    for name, d in zip(("query", "key", "value"), d_in):
        np.testing.assert_allclose(np.asarray(d), want[name], rtol=0, atol=ATOL, err_msg=name)


def test_chunked_kernel_with_a_causal_band_and_head_steps(rng):
    """The band (no keep-mask), one head block a step, softcap and sinks: the chunked kernel against the
    materialised core, forward and gradients (sinks included)."""
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 4, 8))) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    sinks = jnp.asarray(rng.standard_normal(4))
    causal = jnp.tril(jnp.ones((6, 6), bool))
    kw = dict(scale=0.4, softcap=2.0)

    def band(q, k, v, sinks):
        return chunked_attention(q, k, v, is_causal=True, q_chunk=4, k_chunk=3, head_chunk=1, sinks=sinks, **kw)

    def dense(q, k, v, sinks):
        return attention_core(q, k, v, causal, sinks=sinks, **kw)[0]

    np.testing.assert_allclose(band(q, k, v, sinks), dense(q, k, v, sinks), rtol=0, atol=ATOL)
    grads = [jax.jit(jax.grad(lambda *a, f=f: (f(*a) ** 2).sum(), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
             for f in (band, dense)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("need_weights", [True, False])
def test_decode_matches_oracle(need_weights, rng):
    """A prefill of 3 tokens then one at a time, left-padded rows: the cache holds the normalised, rotated
    keys; the padding columns keep no key (sinks: zeros)."""
    kw = dict(qk_norm="head", qk_norm_offset=1.0, softcap=1.1, scale=0.25)
    sd = _drawn(rng, "head", sinks=True)
    L, starts = 6, np.array([0, 2, 1])
    x = rng.standard_normal((B, L, E))
    want = reference.decode(sd, x, starts=starts, prefill=3, num_heads=N, num_kv_heads=K, rope="interleaved",
                            masked_rows="nan", **kw)
    m = convert.to_jax(sd, N, num_kv_heads=K, rope="interleaved", masked_rows="nan", **kw)
    cache, outs, at = m.init_cache(B, L, starts=jnp.asarray(starts)), [], 0
    # under jit, as a decoding loop runs it: one program for the prompt, one for the steps
    step = nnx.jit(lambda m, xs, cache: m(xs, xs, xs, need_weights=need_weights, cache=cache))
    for n in (3, 1, 1, 1):
        xs = jnp.asarray(x[:, at:at + n])
        out, w, cache = step(m, xs, cache)
        if need_weights:
            np.testing.assert_allclose(np.asarray(w), want.weights[len(outs)], rtol=0, atol=ATOL)
        outs.append(np.asarray(out))
        at += n
    assert isinstance(cache, KVCache)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want.output, rtol=0, atol=ATOL)


class FakeDevice:
    def __init__(self, platform):
        self.platform, self.device_kind = platform, platform


def test_kernel_choice_keeps_to_the_kernels_that_take_the_mods():
    def choose(platform, dtype, mods, rows=()):
        src = (kernels.Source("test rows", rows, "test"),) if rows else ()
        return kernels.choose(platform=platform, sources=src, dtype=dtype, B=2, N=8, T=1024, S=1024, H=128,
                              has_mask=False, materialize_limit=2**40, score_mods=mods)

    assert choose("tpu", jnp.bfloat16, ()).kernel == kernels.PALLAS_TPU
    c = choose("tpu", jnp.bfloat16, ("scale",))
    assert c.kernel == kernels.CHUNKED and "cannot compute scale" in c.why
    assert choose("cuda", jnp.bfloat16, ("scale",)).kernel == kernels.DPA_CUDNN
    assert choose("cuda", jnp.bfloat16, ("softcap",)).kernel == kernels.CHUNKED
    xla = (kernels.Measured(BN=16, T=1024, S=1024, fastest=kernels.DPA_XLA, blocks=(256, 256)),)
    assert choose("cpu", jnp.float32, ("scale",), xla).kernel == kernels.DPA_XLA
    c = choose("cpu", jnp.float32, ("sinks",), xla)
    assert c.kernel == kernels.EINSUM and "with sinks" in c.why
    assert kernels.untaken_score_mods(kernels.DPA_XLA, ("scale", "softcap", "sinks")) == ("softcap", "sinks")
    with pytest.raises(ValueError, match="'cap'"):
        kernels.untaken_score_mods(kernels.EINSUM, ("cap",))


def test_a_kernel_forced_past_the_rule_is_refused(rng, forced_kernel):
    q = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32)
    forced_kernel(kernels.DPA_XLA)
    np.testing.assert_allclose(fused_attention_core(q, q, q, scale=0.5), attention_core(q, q, q, scale=0.5)[0],
                               rtol=0, atol=1e-6)  # dot_product_attention takes the scale
    with pytest.raises(ValueError, match="dpa-xla was chosen .* cannot take softcap, sinks"):
        fused_attention_core(q, q, q, softcap=2.0, sinks=jnp.zeros(2))


def test_parameters_construction_and_bad_input():
    m = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm="head", qk_norm_offset=1.0, sinks=True,
                           rngs=nnx.Rngs(0))
    assert m.q_proj.kernel.shape == (E, N * H) and m.k_proj.kernel.shape == (E, K * H) and m.out_proj.kernel.shape == (N * H, E)
    assert m.q_norm.weight.shape == (H,) and not np.asarray(m.q_norm.weight[...]).any()  # offset + w = 1
    assert m.sinks.shape == (N,) and not np.asarray(m.sinks[...]).any()
    flat = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm="flat", rngs=nnx.Rngs(0))
    assert flat.q_norm.weight.shape == (N * H,) and flat.k_norm.weight.shape == (K * H,)
    np.testing.assert_array_equal(flat.k_norm.weight[...], np.ones(K * H))
    classic = MultiHeadAttention(E, N, rngs=nnx.Rngs(0))
    assert classic.q_norm is None and classic.sinks is None
    assert set(convert.from_jax(classic)) == set(classic.config.weight_shapes())
    for bad, error, field in ((dict(qk_norm="rms"), ValueError, "qk_norm"), (dict(softcap=-1.0), ValueError, "softcap"),
                              (dict(sinks=1), TypeError, "sinks"), (dict(scale="0.1"), TypeError, "scale"),
                              (dict(qk_norm_eps=1e-5), ValueError, "qk_norm_eps")):
        with pytest.raises(error, match=field):
            MultiHeadAttention(E, N, rngs=nnx.Rngs(0), **bad)
    sd = _drawn(np.random.default_rng(0), "head", sinks=True)
    with pytest.raises(ValueError, match="sinks=False contradicts"):
        convert.to_jax(sd, N, num_kv_heads=K, qk_norm="head", sinks=False)


def test_sharded_routes_refuse_what_they_do_not_compute():
    from mha_jax import parallel

    m = MultiHeadAttention(E, N, num_kv_heads=K, qk_norm="flat", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sharded_attention does not compute qk-norm-flat"):
        parallel.params_of(m)
    with pytest.raises(ValueError, match="shard_heads .* does not compute qk-norm-flat"):
        parallel.shard_heads(m, parallel.make_mesh(1))


def test_score_mods_of_a_call_and_of_a_layer():
    assert kernels.score_mods_of() == ()
    assert kernels.score_mods_of(scale=0.1, sinks=jnp.zeros(3)) == ("scale", "sinks")
    cfg = MultiHeadAttention(E, N, softcap=2.0, rngs=nnx.Rngs(0)).config
    assert kernels.score_mods_of(scale=cfg.scale, softcap=cfg.softcap, sinks=cfg.sinks) == ("softcap",)
