"""T = 0 with explicit positions in both modules, and every documented mask shape in the cores.

Sizes are pairwise distinct (B=2 differs from N=3, so a [B, T, S] mask broadcast as
[1, B, T, S] fails instead of borrowing another batch element's mask); one key/value head
(K=1) so the grouped code paths run too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from parity.tolerances import compare, tolerance_for

B, T, S, N, K, H = 2, 5, 7, 3, 1, 4
E = N * H


# ------------------------------------------------------- T = 0 with positions

# positions per batch element with key_positions, and shared ones without
POSITIONS = [((B, 0), (B, S)), ((0,), None)]


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("pos_shape, kpos_shape", POSITIONS)
def test_torch_empty_queries_with_positions(need_weights, pos_shape, kpos_shape):
    """Cross-attention with S = 7 keys and no query: empty output, weights [B, N, 0, S], zero gradients
    (no query reads the keys, values or weights)."""
    torch.manual_seed(0)
    m = mha_torch.MultiHeadAttention(E, N, num_kv_heads=K, rope="interleaved", dtype=torch.float64)
    q = torch.zeros(B, 0, E, dtype=torch.float64)
    kv = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    pos = torch.zeros(pos_shape, dtype=torch.int64)
    kpos = None if kpos_shape is None else torch.arange(S).repeat(B, 1)
    out, w = m(q, kv, kv, torch.ones(0, S, dtype=torch.bool), need_weights, positions=pos, key_positions=kpos)
    assert out.shape == (B, 0, E) and out.dtype == torch.float64
    assert (w is None) if not need_weights else w.shape == (B, N, 0, S)
    out.sum().backward()
    assert kv.grad.shape == (B, S, E) and not kv.grad.any()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


@pytest.fixture(scope="module")
def jax_module():
    """One module for the JAX tests: building one runs (and compiles) its initialisers."""
    return mha_jax.MultiHeadAttention(E, N, num_kv_heads=K, rope="half", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("pos_shape, kpos_shape", POSITIONS)
def test_jax_eager_empty_queries_with_positions(pos_shape, kpos_shape, jax_module):
    m = jax_module
    q = np.zeros((B, 0, E), np.float32)
    kv = np.random.default_rng(0).standard_normal((B, S, E)).astype(np.float32)
    pos = np.zeros(pos_shape, np.int32)
    kpos = None if kpos_shape is None else np.tile(np.arange(S, dtype=np.int32), (B, 1))
    for need_weights in (True, False):  # the weights path, and the fused one
        out, w = m(q, kv, kv, None, need_weights, positions=pos, key_positions=kpos)
        assert out.shape == (B, 0, E) and out.dtype == jnp.float32
        assert (w is None) if not need_weights else w.shape == (B, N, 0, S)


def test_jax_jit_empty_queries_with_positions_and_their_gradients(jax_module):
    """Both paths in one jitted program (one compile); gradients w.r.t. key, value and every
    parameter are zero."""
    m = jax_module
    q = jnp.zeros((B, 0, E), jnp.float32)
    kv = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, E)), jnp.float32)
    pos, kpos = jnp.zeros((B, 0), jnp.int32), jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1))
    keep = jnp.ones((B, 0, S), bool)

    def loss(k, v, m):
        weighted, w = m(q, k, v, keep, True, positions=pos, key_positions=kpos)
        fused, none = m(q, k, v, keep, False, positions=pos, key_positions=kpos)
        assert none is None
        return weighted.sum() + fused.sum(), (weighted, w, fused)

    (_, (weighted, w, fused)), (gk, gv, gm) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(kv, kv, m)
    assert weighted.shape == fused.shape == (B, 0, E) and w.shape == (B, N, 0, S)
    assert gk.shape == gv.shape == (B, S, E) and not np.asarray(gk).any() and not np.asarray(gv).any()
    params = jax.tree_util.tree_leaves(gm)
    assert len(params) == 8 and not any(np.asarray(p).any() for p in params)  # 4 kernels, 4 biases


# ------------------------------------------------------- mask shapes in the cores

MASK_SHAPES = {  # documented shape -> how it reads as (B|1, N|1, T|1, S|1), written out here
    "TS": ((T, S), lambda m: m[None, None]),
    "BTS": ((B, T, S), lambda m: m[:, None]),  # a batch axis: gets a head axis
    "T1": ((T, 1), lambda m: m[None, None]),  # key axis of 1: one flag per query row
    "BT1": ((B, T, 1), lambda m: m[:, None]),
    "11TS": ((1, 1, T, S), lambda m: m),
    "B1TS": ((B, 1, T, S), lambda m: m),
    "B1T1": ((B, 1, T, 1), lambda m: m),
    "BNTS": ((B, N, T, S), lambda m: m),
    "1N1S": ((1, N, 1, S), lambda m: m),
    "1111": ((1, 1, 1, 1), lambda m: m),
}
# The JAX kernels compile once per (B|1, N|1, T|1, S|1) shape, so they run one mask of each
# rank below 4 per reading and its 4-D twin (three compiles per kernel); [B, N, T, S] runs on
# every kernel in test_jax_attention.py, [B, 1, 1, S] and [1, 1, T, 1] on the chunked one in
# test_chunked.py.
JAX_MASK_SHAPES = ("TS", "11TS", "BTS", "B1TS", "T1")


def _masks(name):
    """(the mask in its documented shape, the same mask written out as (B, N, T, S)).

    Every row keeps key 0 except query row 1, which keeps none, wherever the shape has a T axis."""
    shape, as4 = MASK_SHAPES[name]
    m = np.random.default_rng(sum(map(ord, name))).random(shape) > 0.4
    m[..., 0] = True
    if len(shape) >= 2 and shape[-2] == T:
        m[..., 1, :] = False
    return m, np.array(np.broadcast_to(as4(m), (B, N, T, S)))  # a writable copy


def _qkv(rng, dtype):
    return [rng.standard_normal(s).astype(dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]


@pytest.mark.parametrize("kernel", ["einsum", "chunked", "dpa-xla"])
def test_jax_fused_core_takes_every_documented_mask_shape_on_every_kernel(kernel, forced_kernel):
    """Each kernel and mask shape against the materialised core on the full (B, N, T, S) mask,
    NaN (policy "nan") on the fully masked row included; float32 (dpa-xla's softmax is float32)."""
    forced_kernel(kernel)
    q, k, v = (jnp.asarray(x) for x in _qkv(np.random.default_rng(2), np.float32))
    tol = tolerance_for("float32").forward
    for name in JAX_MASK_SHAPES:
        keep, full = _masks(name)
        want = np.asarray(mha_jax.attention_core(q, k, v, jnp.asarray(full))[0])
        for core in (mha_jax.fused_attention_core, lambda *a: mha_jax.attention_core(*a)[0]):
            got = np.asarray(core(q, k, v, jnp.asarray(keep)))
            c = compare(got, want, tol)
            assert got.shape == (B, T, N, H) and c.passed, (name, c)
        assert np.isnan(want).any(), name  # row 1 keeps no key: the NaN comparison can fail


def test_torch_cores_take_every_documented_mask_shape():
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(x).transpose(1, 2) for x in _qkv(rng, np.float64))  # (B, heads, L, H)
    k_n, v_n = (x.repeat_interleave(N // K, dim=1) for x in (k, v))  # attention_core takes N heads
    tol = tolerance_for("float64").forward
    for name in MASK_SHAPES:
        keep, full = (torch.from_numpy(x) for x in _masks(name))
        want = mha_torch.attention_core(q, k_n, v_n, full)[0].numpy()
        for got in (mha_torch.attention_core(q, k_n, v_n, keep)[0], mha_torch.fused_attention_core(q, k, v, keep)):
            c = compare(got.numpy(), want, tol)
            assert tuple(got.shape) == (B, N, T, H) and c.passed, (name, c)


def test_a_mask_that_fits_no_documented_shape_is_named():
    q, k, v = (jnp.asarray(x) for x in _qkv(np.random.default_rng(4), np.float32))
    for core in (mha_jax.attention_core, mha_jax.fused_attention_core, mha_jax.chunked_attention):
        with pytest.raises(ValueError, match=r"mask of shape \(3, 5, 7\) \(read as \(3, 1, 5, 7\)\) does not broadcast"):
            core(q, k, v, jnp.ones((3, T, S), bool))


@pytest.mark.parametrize("pos_shape", [(2, 0), (0,)])
def test_the_oracle_and_the_rope_peers_take_empty_queries_with_positions(pos_shape):
    from mha_spec import AttentionConfig
    from parity import reference
    from parity.peers.sdpa import rope_cos_sin

    c = AttentionConfig(12, 3, num_kv_heads=1, rope="half")
    sd = {k: np.ones(s) for k, s in c.weight_shapes().items()}
    q, kv = np.zeros((2, 0, 12)), np.ones((2, 7, 12))
    out = reference.forward(sd, q, kv, kv, None, num_heads=3, num_kv_heads=1, rope="half",
                            positions=np.zeros(pos_shape, np.int64), key_positions=np.arange(7)).output
    assert out.shape == (2, 0, 12)
    cos, _ = rope_cos_sin(torch.zeros(pos_shape, dtype=torch.int64), 0, 4, 10000.0, torch.float32, "cpu")
    assert cos.shape[2] == 0
