"""The Pallas kernels as peers (parity.peers.pallas), run here in Pallas interpret mode on the CPU.

Each peer is called directly on a grouped layer (B=2, T=S=13: not a multiple of any kernel block, so
the padding is exercised; E=32, N=4, K=2, H=8: padded to 16 for the GPU kernels) and judged against
the float64 oracle (`parity.reference`) on the same float32-rounded weights and inputs, forward and,
where the kernel has one, its own backward; causal, packed (causal within documents) and no mask.

Bounds, from measurement (this file's inputs, float32, the three masks, both flash kernels and the
decoder): the layer output is off the oracle by at most 2.2e-6 (jax.nn.dot_product_attention with XLA on
the same projections: 2.0e-6) and the gradients by at most 2.1e-5 (XLA: 1.5e-5), so FORWARD and GRADIENT
below are ~5x the worst measured. A planted masking bug moves outputs by O(0.1) (asserted > 1e-2).

Planted bugs in the kernels' own masking, each red: the GPU kernel's `segment_mask` replaced by one that
also keeps earlier documents; a copy of the TPU kernel's single-block forward body whose causal mask
keeps one future key; the decode kernel's start_idx one slot early (a left-padding slot attended).
Each first interpret-mode call compiles (0.5-4 s); the cases share compiled kernels where they can.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mha_spec import AttentionConfig, Problem
from parity import reference
from parity.peers import pallas
from parity.peers.common import MissingPackage
from parity.tolerances import Tolerance, compare

B, T, E, N, K = 2, 13, 32, 4, 2
H = E // N
FORWARD = Tolerance(atol=1e-5, rtol=1e-5)
GRADIENT = Tolerance(atol=1e-4, rtol=1e-4)
SEGMENTS = np.array([[0] * 5 + [1] * 8, [0] * 3 + [1] * 6 + [2] * 4])  # (B, T): 2 and 3 documents


def _layer(rope=None):
    cfg = AttentionConfig(E, N, num_kv_heads=K, rope=rope, rope_theta=500.0 if rope else 10000.0)
    rng = np.random.default_rng(7)
    sd = {k: rng.uniform(-0.5, 0.5, s).astype(np.float32) for k, s in cfg.weight_shapes().items()}
    return cfg, sd


CFG, SD = _layer()
MASKS = {
    "causal": reference.structured_keep(T, T, is_causal=True),
    "packed": reference.structured_keep(T, T, is_causal=True, segment_ids=SEGMENTS),
    "none": None,
}


@pytest.fixture(scope="module")
def inputs():
    import jax

    jax.config.update("jax_enable_x64", True)  # as the harness runs: the kernels must not care
    rng = np.random.default_rng(11)
    x = rng.standard_normal((B, T, E)).astype(np.float32)
    cot = rng.standard_normal((B, T, E)).astype(np.float32)
    return x, cot


def _build(factory, b=B):
    import jax
    import jax.numpy as jnp

    fn = factory(SD, N, dtype="float32", device=jax.devices("cpu")[0], problem=Problem(CFG, b, T, T))
    return fn, {k: jnp.asarray(v) for k, v in SD.items()}


def _keep(mask, b=B):
    import jax.numpy as jnp

    return None if mask is None else jnp.asarray(np.broadcast_to(mask, (b, 1, T, T)))


def _oracle(x, mask, cot=None):
    kw = dict(num_heads=N, num_kv_heads=K)
    if cot is None:
        return reference.forward(SD, x, x, x, mask, **kw).output
    g = reference.backward(SD, x, x, x, mask, cot, **kw)
    return {"input": g["query"] + g["key"] + g["value"], **{n: g[n] for n in SD}}


def _vjp(fn, params, x, keep, cot):
    """(output, {input, every parameter}) of self-attention fn(p, x, x, x, keep) and its gradients."""
    import jax
    import jax.numpy as jnp

    out, pull = jax.vjp(lambda p, x: fn(p, x, x, x, keep), params, jnp.asarray(x))
    d_params, d_x = pull(jnp.asarray(cot))
    return np.asarray(out), {"input": np.asarray(d_x), **{n: np.asarray(g) for n, g in d_params.items()}}


def _assert_grads(got, expected):
    assert sorted(got) == sorted(expected)
    for n in expected:
        c = compare(got[n], expected[n], GRADIENT)
        assert c.passed, (n, c)


# ---------------------------------------------------------------- masks and platforms (no kernel runs)


def test_dense_masks_read_as_causal_and_segment_ids():
    causal, seg = pallas.kernel_mask(np.broadcast_to(MASKS["packed"], (B, 1, T, T)))
    assert causal and seg.dtype == np.int32
    assert np.array_equal(seg[:, :, None] == seg[:, None, :], SEGMENTS[:, :, None] == SEGMENTS[:, None, :])
    assert pallas.kernel_mask(MASKS["causal"]) == (True, None)
    assert pallas.kernel_mask(np.ones((1, 1, T, T), bool)) == (False, None)
    causal, seg = pallas.kernel_mask(reference.structured_keep(T, T, segment_ids=SEGMENTS))
    assert not causal and seg is not None
    # documents need not be contiguous: ids 0, 1, 0 keep the first and last token together
    causal, seg = pallas.kernel_mask(reference.structured_keep(3, 3, is_causal=True, segment_ids=np.array([[0, 1, 0]])))
    assert causal and seg[0, 0] == seg[0, 2] != seg[0, 1]


@pytest.mark.parametrize("what, keep", [
    ("padding", np.arange(T)[None, None, None, :] < np.array([9, T])[:, None, None, None]),
    ("window", reference.structured_keep(T, T, window=(2, 0))),
    ("random", np.random.default_rng(0).random((B, 1, T, T)) > 0.3),
    ("empty row", np.tril(np.ones((T, T), bool), -1)[None, None]),
    ("T != S", np.ones((B, 1, T, T + 3), bool)),
])
def test_other_masks_are_the_harness_skip(what, keep):
    with pytest.raises(pallas.KernelCannot):
        pallas.kernel_mask(np.broadcast_to(keep, (B, 1, *keep.shape[2:])))
    assert issubclass(pallas.KernelCannot, MissingPackage)  # what check_peers and the decode check make a skip row


def test_a_peer_refuses_an_unfit_mask_before_compiling(inputs):
    x, _ = inputs
    fn, params = _build(pallas.gpu_flash)
    with pytest.raises(pallas.KernelCannot, match="not causal, segment ids"):
        fn(params, x, x, x, _keep(np.tril(np.ones((T, T), bool), 1)))  # one key into the future: neither
    with pytest.raises(ValueError, match="not both"):
        fn(params, x, x, x, _keep(MASKS["causal"]), is_causal=True)


def test_each_kernel_runs_interpreted_on_cpu_natively_on_its_own_accelerator_and_not_elsewhere():
    for name, own in pallas.PLATFORMS.items():
        assert pallas.interpreted(name, "cpu") is True
        assert pallas.interpreted(name, own) is False
        other = "tpu" if own == "gpu" else "gpu"
        with pytest.raises(pallas.KernelCannot, match=f"does not run natively on {other}"):
            pallas.interpreted(name, other)


def test_declarations():
    by = {i.name: i for i in pallas.IMPLEMENTATIONS}
    assert sorted(by) == ["pallas-gpu-decode", "pallas-gpu-flash", "pallas-tpu-flash"]
    assert by["pallas-gpu-decode"].decode and not by["pallas-gpu-flash"].decode
    for name in ("pallas-gpu-flash", "pallas-tpu-flash"):  # packed rows: causal AND segment ids, T = S
        assert by[name].runs("self/packed/float32") and not by[name].runs("cross/packed/float32")
    for impl in by.values():
        assert "(interpret)" in impl.doc and impl.role == "peer" and not impl.bench
        assert "dtypes=float32" in impl.unsupported("float64") and impl.unsupported("float32", CFG) is None


# ---------------------------------------------------------------- the flash kernels against the oracle


@pytest.mark.parametrize("mask", ["causal", "packed"])
def test_gpu_flash_forward_and_backward(inputs, mask):
    x, cot = inputs
    fn, params = _build(pallas.gpu_flash)
    out, grads = _vjp(fn, params, x, _keep(MASKS[mask]), cot)
    assert out.dtype == np.float32
    c = compare(out, _oracle(x, MASKS[mask]), FORWARD)
    assert c.passed, c
    _assert_grads(grads, _oracle(x, MASKS[mask], cot))


def test_gpu_flash_without_a_mask_keeps_its_padding_out(inputs):
    """T=13 padded to 16: with no mask the three padded keys are kept out by a segment id of their own."""
    x, _ = inputs
    fn, params = _build(pallas.gpu_flash)
    c = compare(np.asarray(fn(params, x, x, x, None)), _oracle(x, None), FORWARD)
    assert c.passed, c


def test_gpu_flash_takes_the_masks_as_keywords_too(inputs):
    """is_causal= and segment_ids= (what a caller under jit passes): the same kernel as the dense mask's."""
    import jax.numpy as jnp

    x, _ = inputs
    fn, params = _build(pallas.gpu_flash)
    out = fn(params, x, x, x, None, is_causal=True, segment_ids=jnp.asarray(SEGMENTS, jnp.int32))
    c = compare(np.asarray(out), _oracle(x, MASKS["packed"]), FORWARD)
    assert c.passed, c


def test_tpu_flash_forward_and_backward_packed(inputs):
    x, cot = inputs
    fn, params = _build(pallas.tpu_flash)
    out, grads = _vjp(fn, params, x, _keep(MASKS["packed"]), cot)
    c = compare(out, _oracle(x, MASKS["packed"]), FORWARD)
    assert c.passed, c
    _assert_grads(grads, _oracle(x, MASKS["packed"], cot))


def test_tpu_flash_forward_causal(inputs):
    x, _ = inputs
    fn, params = _build(pallas.tpu_flash)
    c = compare(np.asarray(fn(params, x, x, x, _keep(MASKS["causal"]))), _oracle(x, MASKS["causal"]), FORWARD)
    assert c.passed, c


# ---------------------------------------------------------------- the decode kernel through the decode protocol


STARTS = np.array([0, 2, 1])  # each row's left padding, as the decode check pads its rows
DECODE_T = 7


def _decode(start_shift=0):
    """The decoder fed DECODE_T tokens one per call (RoPE half, grouped): (outputs (3, T, E), oracle, positions)."""
    import jax
    import jax.numpy as jnp

    cfg, sd = _layer(rope="half")
    b = len(STARTS)
    x = np.random.default_rng(5).standard_normal((b, DECODE_T, E)).astype(np.float32)
    pos = reference.decode_positions(STARTS, DECODE_T)  # (B, T): -1, -2 on the padding
    params = {k: jnp.asarray(v) for k, v in sd.items()}
    fn = pallas.gpu_decode(sd, N, dtype="float32", device=jax.devices("cpu")[0], problem=Problem(cfg, b, DECODE_T, DECODE_T))
    cache, outs = None, []
    for t in range(DECODE_T):
        position = jnp.asarray(np.where(pos[:, t] < 0, -1, pos[:, t]), jnp.int32)
        if start_shift:
            out, cache = pallas.decode_step(params, jnp.asarray(x[:, t:t + 1]), cache, position, config=cfg,
                                            interpret=True, start_shift=start_shift)
        else:
            out, cache = fn(params, jnp.asarray(x[:, t:t + 1]), cache, position)
        assert out.shape == (b, 1, E) and out.dtype == jnp.float32
        outs.append(np.asarray(out))
    exact = reference.forward(sd, x, x, x, reference.decode_keep(STARTS, DECODE_T), num_heads=N, num_kv_heads=K,
                              rope="half", rope_theta=500.0, positions=pos, key_positions=pos).output
    return np.concatenate(outs, axis=1), exact, pos


def test_gpu_decode_one_token_a_call_is_the_causal_forward_on_real_tokens():
    got, exact, pos = _decode()
    real = pos >= 0
    c = compare(got[real], exact[real], FORWARD)
    assert c.passed, c


def test_gpu_decode_refuses_padding_after_a_real_token():
    import jax
    import jax.numpy as jnp

    cfg, sd = _layer(rope="half")
    b = len(STARTS)  # _decode's shapes: its compiled kernel serves
    fn = pallas.gpu_decode(sd, N, dtype="float32", device=jax.devices("cpu")[0], problem=Problem(cfg, b, 2, 2))
    params = {k: jnp.asarray(v) for k, v in sd.items()}
    x = jnp.zeros((b, 1, E), jnp.float32)
    _, cache = fn(params, x, None, jnp.asarray([-1, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"rows \[2\] get a padding token after a real one"):
        fn(params, x, cache, jnp.asarray([0, 1, -1], jnp.int32))


# ---------------------------------------------------------------- planted bugs in the kernels' masking: red


@pytest.fixture
def fresh_kernels():
    """The planted tests trace the kernels anew (their own batch size, B=3) and clear the compiled ones after,
    so no later call meets a buggy kernel from the cache."""
    import jax

    yield
    jax.clear_caches()


def _segments3():
    return np.concatenate([SEGMENTS, SEGMENTS[:1]])  # (3, T)


def test_planted_document_leak_in_the_gpu_segment_mask_is_red(inputs, monkeypatch, fresh_kernels):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention

    right = attention.segment_mask

    def leaky(q_ids, kv_ids):  # also keeps the earlier documents' keys
        return right(q_ids, kv_ids) | (jnp.expand_dims(q_ids, -1) > jnp.expand_dims(kv_ids, 0))

    monkeypatch.setattr(attention, "segment_mask", leaky)
    x = np.concatenate([inputs[0], inputs[0][:1]])  # (3, T, E)
    mask = reference.structured_keep(T, T, is_causal=True, segment_ids=_segments3())
    fn, params = _build(pallas.gpu_flash, b=3)
    out, exact = np.asarray(fn(params, x, x, x, _keep(mask, 3))), _oracle(x, mask)
    assert not compare(out, exact, FORWARD).passed
    first_doc = _segments3() == 0  # (3, T): no earlier document to leak
    assert compare(out[first_doc], exact[first_doc], FORWARD).passed
    assert np.abs(out[~first_doc] - exact[~first_doc]).max() > 1e-2
    ids = _segments3()
    leaked = _oracle(x, reference.structured_keep(T, T, is_causal=True) & (ids[:, None, :, None] >= ids[:, None, None, :]))
    assert compare(out, leaked, FORWARD).passed  # exactly the planted mask


def test_planted_causal_off_by_one_in_a_copy_of_the_tpu_kernel_is_red(inputs, monkeypatch, fresh_kernels):
    """The TPU forward runs its single-block body when one key block is the whole (padded) sequence: a copy of
    that body (jax 0.10.2's `_flash_attention_kernel_single_batch_single_step`, segment ids left out, as
    the causal mask does not use them) with `col_ids <= row_ids + 1`: each query also keeps the next key."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    def single_step(batch_idx, q_tile_ref, k_tile_ref, v_tile_ref, ab_tile_ref, q_segment_ids_tile_ref,
                    kv_segment_ids_tile_ref, o_tile_ref, l_ref=None, m_ref=None, *, causal, sm_scale, block_k,
                    kv_seq_len, mask_value):
        assert ab_tile_ref is None and q_segment_ids_tile_ref is None
        block_q = q_tile_ref.shape[2]
        q, k = q_tile_ref[batch_idx], k_tile_ref[batch_idx]
        s = jax.lax.dot_general(q, k, fa.TRANS_B_DIM_NUMBERS, preferred_element_type=jnp.float32)
        if sm_scale != 1.0:
            s *= sm_scale
        mask = None
        if causal:
            row_ids = jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0) + pl.program_id(2) * block_q
            col_ids = jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            mask = col_ids <= row_ids + 1  # the planted bug: the kernel's is col_ids <= row_ids
        s = s if mask is None else s + jnp.where(mask, 0.0, mask_value)
        m = jnp.max(s, axis=1)[:, None]
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=1)[:, None]
        p /= l
        if m_ref is not None:
            m_ref[batch_idx] = lax.broadcast_in_dim(m, m_ref.shape[2:], range(2))
        if l_ref is not None:
            l_ref[batch_idx] = lax.broadcast_in_dim(l, l_ref.shape[2:], range(2))
        v = v_tile_ref[batch_idx]
        o_tile_ref[batch_idx] = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(
            o_tile_ref.dtype)

    monkeypatch.setattr(fa, "_flash_attention_kernel_single_batch_single_step", single_step)
    x = np.concatenate([inputs[0], inputs[0][:1]])  # (3, T, E)
    fn, params = _build(pallas.tpu_flash, b=3)
    out, exact = np.asarray(fn(params, x, x, x, _keep(MASKS["causal"], 3))), _oracle(x, MASKS["causal"])
    assert not compare(out, exact, FORWARD).passed
    assert np.abs(out - exact).max() > 1e-2
    # exactly the planted mask: up to the last, each query keeps one key more (the last one's next is a padding key)
    leaked = _oracle(x, reference.structured_keep(T, T, window=(None, 1)))
    assert compare(out[:, :-1], leaked[:, :-1], FORWARD).passed


def test_planted_early_start_in_the_decode_kernel_attends_the_padding_red():
    got, exact, pos = _decode(start_shift=-1)  # start_idx one slot early: the last padding slot is attended
    real = pos >= 0
    assert not compare(got[real], exact[real], FORWARD).passed
    unpadded = STARTS == 0  # row 0 has no padding slot to attend
    assert compare(got[unpadded][real[unpadded]], exact[unpadded][real[unpadded]], FORWARD).passed
    assert np.abs(got[~unpadded][real[~unpadded]] - exact[~unpadded][real[~unpadded]]).max() > 1e-2
    assert math.isfinite(float(np.abs(got[real]).max()))
