"""mha_jax.MultiHeadAttention's partial rotary (rope_dim) and scaled RoPE (rope_scaling) against a NumPy
rotation written here from mha_spec's frequencies (float64): eager and the chunked kernel, the q_rot/k_rot
stages, the features past rope_dim passing through, LongRoPE's per-call switch (eager, under jit with
traced positions, a decode step crossing it), the sharded entry point, and the errors.

Tiny sizes: B=2, T=5, S=7, E=12, N=3 query heads over K=1 key/value head, H=10 of which R=6 rotate
(so "half" pairs i with i + 3, not i + H/2). rope_theta=10 puts llama3's three bands (kept, interpolated,
divided) and a YaRN ramp over the three pairs; positions start past original_max_position_embeddings=16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mha_jax import MultiHeadAttention, kernels
from mha_jax.parallel import make_mesh, params_of, sharded_attention
from mha_spec import RopeScaling

B, T, S, E, N, K, H, R = 2, 5, 7, 12, 3, 1, 10, 6
THETA, ORIGINAL = 10.0, 16
# float64 all through; the module's cos/sin come from XLA's cos/sin, these from NumPy's (angles up to 47 rad).
# Measured (jax 0.10.2, CPU): rotated q/k identical, outputs within 3e-16; the margin is for other cos/sin.
RTOL, ATOL = 1e-12, 1e-12
LONGROPE = RopeScaling("longrope", factor=4.0, original_max_position_embeddings=ORIGINAL,
                       short_factor=(1.0, 1.5, 2.0), long_factor=(2.0, 3.0, 5.0))
SCALINGS = {
    "none": None,
    "linear": RopeScaling("linear", factor=2.5),
    "llama3": RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0,
                          original_max_position_embeddings=ORIGINAL),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),  # cos/sin times 1.139
    "longrope": LONGROPE,  # cos/sin times sqrt(1.5)
}
# Past the original context: rows at different positions (B, T); keys (S,) spaced by 2.
POS = 40 + np.arange(T)[None, :] + 3 * np.arange(B)[:, None]
KEY_POS = 41 + 2 * np.arange(S)


def _module(scaling, rope="half", dtype=jnp.float64):
    return MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, rope=rope, rope_theta=THETA, rope_dim=R,
                              rope_scaling=scaling, param_dtype=dtype, rngs=nnx.Rngs(7))


def _np_rotate(x, pos, cfg, long: bool):
    """x (B, n, L, H) rotated pair by pair at positions (L,) | (B, L), from mha_spec's frequencies."""
    inv_freq = np.asarray(cfg.rope_frequencies(long), np.float64)  # (R/2,)
    pos = np.asarray(pos, np.float64)
    angles = (pos[:, None] if pos.ndim == 2 else pos[None, None])[..., None] * inv_freq  # (B|1, 1, L, R/2)
    cos, sin = np.cos(angles) * cfg.rope_scale, np.sin(angles) * cfg.rope_scale
    half = cfg.rotary_dim // 2
    pairs = [(i, i + half) if cfg.rope == "half" else (2 * i, 2 * i + 1) for i in range(half)]
    out = np.array(x, np.float64)
    for i, (a, b) in enumerate(pairs):
        out[..., a] = x[..., a] * cos[..., i] - x[..., b] * sin[..., i]
        out[..., b] = x[..., b] * cos[..., i] + x[..., a] * sin[..., i]
    return out  # features R..H-1 copied as they were


def _np_heads(layer, x, n):
    """The projection of x (B, L, E) split into n heads: (B, n, L, H)."""
    y = np.asarray(x) @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
    return y.reshape(y.shape[0], y.shape[1], n, H).transpose(0, 2, 1, 3)


def _np_attend(m, q, k, v):
    """Output (B, T, E) of rotated q (B, N, T, H) over k, v (B, K, S, H): no mask, softmax in float64."""
    k, v = (np.repeat(z, N // K, axis=1) for z in (k, v))  # query head h reads h // (N/K)
    s = q @ k.swapaxes(-1, -2) * H ** -0.5  # (B, N, T, S)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    ctx = (w @ v).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], N * H)  # (B, T, N·H)
    return ctx @ np.asarray(m.out_proj.kernel[...]) + np.asarray(m.out_proj.bias[...])


def _np_forward(m, xq, xkv, pos, key_pos, long: bool):
    """(output, q_rot, k_rot) of the layer without a mask, all in NumPy."""
    q = _np_rotate(_np_heads(m.q_proj, xq, N), pos, m.config, long)
    k = _np_rotate(_np_heads(m.k_proj, xkv, K), key_pos, m.config, long)
    return _np_attend(m, q, k, _np_heads(m.v_proj, xkv, K)), q, k


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(11)
    return rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))


def _check_stages(st, m, pos, key_pos, long):
    want_q = _np_rotate(np.asarray(st.q), pos, m.config, long)
    want_k = _np_rotate(np.asarray(st.k), key_pos, m.config, long)
    np.testing.assert_allclose(np.asarray(st.q_rot), want_q, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(st.k_rot), want_k, rtol=RTOL, atol=ATOL)
    # Features R..H-1 pass through bit for bit; the first R really turned.
    np.testing.assert_array_equal(np.asarray(st.q_rot)[..., R:], np.asarray(st.q)[..., R:])
    np.testing.assert_array_equal(np.asarray(st.k_rot)[..., R:], np.asarray(st.k)[..., R:])
    assert np.abs(np.asarray(st.q_rot)[..., :R] - np.asarray(st.q)[..., :R]).max() > 0.1


@pytest.mark.parametrize("convention", ["half", "interleaved"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_eager_and_chunked_match_numpy(kind, convention, inputs, forced_kernel):
    m = _module(SCALINGS[kind], convention)
    xq, xkv = (jnp.asarray(x) for x in inputs)
    pos = {"positions": jnp.asarray(POS), "key_positions": jnp.asarray(KEY_POS)}
    want, _, _ = _np_forward(m, *inputs, POS, KEY_POS, long=True)  # past 16: LongRoPE's long factors
    out, _, st = m(xq, xkv, xkv, return_intermediates=True, **pos)
    _check_stages(st, m, POS, KEY_POS, long=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)
    forced_kernel(kernels.CHUNKED)  # the chunked kernel, 2 x 3 blocks
    out, _, st = m(xq, xkv, xkv, need_weights=False, return_intermediates=True, **pos)
    _check_stages(st, m, POS, KEY_POS, long=True)
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)


def test_longrope_switches_on_the_largest_position_of_queries_and_keys(inputs):
    """Queries at 0..4 always; the keys' largest position 15 keeps the short factors (15 + 1 = 16 is not
    past 16), 16 takes the long ones for every token, the queries too. Eager (decided on the host) and
    under jit with traced positions (one program selecting between both tables)."""
    m = _module(LONGROPE)
    xq, xkv = (jnp.asarray(x) for x in inputs)
    pos = np.arange(T)
    jitted = nnx.jit(lambda m, p, kp: m(xq, xkv, xkv, positions=p, key_positions=kp, return_intermediates=True))
    for top, long in ((15, False), (16, True)):
        key_pos = np.arange(S) + top - (S - 1)  # (S,), its largest is top
        want, want_q, _ = _np_forward(m, *inputs, pos, key_pos, long)
        for call in (lambda p, kp: m(xq, xkv, xkv, positions=p, key_positions=kp, return_intermediates=True),
                     lambda p, kp: jitted(m, p, kp)):
            out, _, st = call(jnp.asarray(pos), jnp.asarray(key_pos))
            _check_stages(st, m, pos, key_pos, long)
            np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)
    # The two tables differ at these positions: the check above could not pass with the wrong one.
    assert np.abs(_np_rotate(np.asarray(st.q), pos, m.config, True)
                  - _np_rotate(np.asarray(st.q), pos, m.config, False)).max() > 0.1


def test_longrope_decode_crossing_the_switch_keeps_the_cached_keys_short(inputs):
    """A prompt at 11..15 (short), then one step under jit at 16 (long: its q and k) or 15 (short): the
    prompt's cached keys keep their short rotation either way."""
    m = _module(LONGROPE)
    xq = inputs[0]  # (B, T, E): the prompt
    x_step = np.random.default_rng(3).standard_normal((B, 1, E))
    prompt_pos = np.broadcast_to(11 + np.arange(T), (B, T))
    cache = m.init_cache(B, T + 1)
    _, _, cache, st = m(*(jnp.asarray(xq),) * 3, positions=jnp.asarray(prompt_pos), cache=cache,
                        return_intermediates=True)
    k_prompt = _np_rotate(np.asarray(st.k), prompt_pos, m.config, long=False)  # (B, K, T, H)
    np.testing.assert_allclose(np.asarray(st.k_rot), k_prompt, rtol=RTOL, atol=ATOL)
    step = nnx.jit(lambda m, x, cache, p: m(x, x, x, positions=p, cache=cache, return_intermediates=True))
    for at, long in ((16, True), (15, False)):
        p = np.full((B, 1), at)
        out, _, new, st = step(m, jnp.asarray(x_step), cache, jnp.asarray(p))
        q = _np_rotate(_np_heads(m.q_proj, x_step, N), p, m.config, long)
        k = _np_rotate(_np_heads(m.k_proj, x_step, K), p, m.config, long)
        np.testing.assert_allclose(np.asarray(st.q_rot), q, rtol=RTOL, atol=ATOL)
        cached = np.asarray(new.k).transpose(0, 2, 1, 3)  # (B, K, C, H)
        np.testing.assert_allclose(cached[:, :, :T], k_prompt, rtol=RTOL, atol=ATOL)  # still short
        np.testing.assert_allclose(cached[:, :, T:], k, rtol=RTOL, atol=ATOL)
        v = np.concatenate([_np_heads(m.v_proj, xq, K), _np_heads(m.v_proj, x_step, K)], axis=2)
        want = _np_attend(m, q, np.concatenate([k_prompt, k], axis=2), v)
        np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)


def test_traced_positions_without_x64_select_too(inputs):
    """float32, no x64, traced positions: float32 angles (up to ~60 rad here), the same switch."""
    with jax.enable_x64(False):
        m = _module(LONGROPE, "interleaved", jnp.float32)
        xq, xkv = (jnp.asarray(x, jnp.float32) for x in inputs)
        run = nnx.jit(lambda m, p, kp: m(xq, xkv, xkv, positions=p, key_positions=kp, return_intermediates=True)[2])
        for pos, key_pos, long in ((np.arange(T), np.arange(S), False), (POS, KEY_POS, True)):
            st = run(m, jnp.asarray(pos, jnp.int32), jnp.asarray(key_pos, jnp.int32))
            want = _np_rotate(np.asarray(st.q, np.float64), pos, m.config, long)
            # float32 angles: rounding up to |angle|·2⁻²⁴ = 47·6e-8 = 3e-6 rad here, times |q| <= 2.1, plus
            # float32 products: bound ~7e-6; measured max |difference| 8.5e-7 (2e-7 at the short positions).
            np.testing.assert_allclose(np.asarray(st.q_rot), want, rtol=0, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(st.q_rot)[..., R:], np.asarray(st.q)[..., R:])


def test_sharded_attention_takes_rope_dim_and_scaling():
    """The sequence-parallel entry point (one device here), under jit: LongRoPE's switch decided from the
    whole call's positions and handed to the shards; matches NumPy. sharded_attention computes E = N·H
    only, so this layer is E = 30 wide."""
    width = N * H
    m = MultiHeadAttention(width, N, num_kv_heads=K, rope="half", rope_theta=THETA, rope_dim=R, rope_scaling=LONGROPE,
                           param_dtype=jnp.float64, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(12)
    inputs = rng.standard_normal((B, T, width)), rng.standard_normal((B, S, width))
    xq, xkv = (jnp.asarray(x) for x in inputs)
    run = jax.jit(lambda p, kp: sharded_attention(params_of(m), xq, xkv, xkv, mesh=make_mesh(1), sharding="sp",
                                                  num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA,
                                                  rope_dim=R, rope_scaling=LONGROPE, positions=p, key_positions=kp))
    for pos, key_pos, long in ((np.arange(T), np.arange(S), False), (np.arange(T), KEY_POS, True)):
        want, _, _ = _np_forward(m, *inputs, pos, key_pos, long)
        np.testing.assert_allclose(np.asarray(run(jnp.asarray(pos), jnp.asarray(key_pos))), want, rtol=RTOL, atol=ATOL)


def test_bad_rope_dim_and_scaling_are_named():
    for bad, error, field in ((dict(rope=None, rope_dim=R), ValueError, "rope_dim"),
                              (dict(rope_dim=7), ValueError, "rope_dim"),
                              (dict(rope_dim=12), ValueError, "rope_dim"),
                              (dict(rope_scaling="linear:factor=2"), TypeError, "rope_scaling"),
                              (dict(rope_dim=4), ValueError, "rope_dim / 2")):  # LongRoPE's 3 factors, 2 pairs
        kw = dict(rope="half", rope_scaling=LONGROPE) | bad
        with pytest.raises(error, match=field):
            MultiHeadAttention(E, N, head_dim=H, rngs=nnx.Rngs(0), **kw)
