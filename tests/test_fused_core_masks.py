"""The JAX fused core called directly with a 2-D keep-mask, on every kernel, heads not grouped
(K = N; tests/test_empty_and_mask_shapes.py runs the documented shapes with K = 1)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from conftest import SIZES
from parity.tolerances import compare, tolerance_for

S = SIZES
H = S.E // S.N
KERNELS = ["einsum", "chunked", "dpa-xla"]


def _qkv():
    rng = np.random.default_rng(12)
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((S.B, S.T, S.N, H), (S.B, S.S, S.N, H), (S.B, S.S, S.N, H))]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_2d_keep_mask_is_every_batch_element_and_head_s(kernel, forced_kernel):
    forced_kernel(kernel)
    q, k, v = _qkv()
    keep = np.random.default_rng(13).random((S.T, S.S)) > 0.4
    keep[:, 0] = True
    keep[3] = False  # query row 3 keeps no key
    full = jnp.asarray(np.broadcast_to(keep, (S.B, S.N, S.T, S.S)))
    for policy in ("uniform", "nan"):
        want = np.asarray(mha_jax.attention_core(q, k, v, full, masked_rows=policy)[0])
        got = np.asarray(mha_jax.fused_attention_core(q, k, v, jnp.asarray(keep), masked_rows=policy))
        c = compare(got, want, tolerance_for("float32").forward)
        assert got.shape == (S.B, S.T, S.N, H) and c.passed, (policy, c)
        assert np.isnan(want[:, 3]).all() == (policy == "nan")  # the policy's row is there


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_2d_keep_mask_of_another_shape_is_a_value_error_naming_it(kernel, forced_kernel):
    forced_kernel(kernel)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask of shape \(7, 5\) \(read as \(1, 1, 7, 5\)\) does not broadcast to "
                                         r"\[B, N, T, S\] = \(3, 3, 5, 7\)"):
        mha_jax.fused_attention_core(q, k, v, jnp.ones((S.S, S.T), bool))
