"""parity.convert's converters of our modules: bit-exact round trips, strictness, the public API; then
grouped-query, RoPE and bias-free layers (TestRope: the RoPE row permutation between conventions;
TestGrouped, TestBiasFree, TestVariants). The peers' converters (re-exported here) are tested with
their modules: tests/test_peer_*.py."""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import SIZES
from helpers import DTYPES, cast_sd, np_dtype
from parity import convert, reference


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_jax_torch_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    tm = convert.to_torch(sd, SIZES.N, masked_rows="uniform")
    jm = convert.torch_to_jax(tm)
    back = convert.jax_to_torch(jm)
    assert (jm.num_heads, jm.masked_rows, back.num_heads, back.masked_rows) == (SIZES.N, "uniform", SIZES.N, "uniform")
    assert back.q_proj.weight.dtype == tm.q_proj.weight.dtype
    for name, t in tm.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    assert_bit_identical(convert.from_torch(back), sd)
    assert_bit_identical(convert.from_jax(jm), sd)
    assert jm.q_proj.kernel[...].dtype == np_dtype(dtype)


# ------------------------------------------------------------- strictness


def test_missing_and_unexpected_keys_are_named(sd64):
    sd = dict(sd64)
    del sd["k_proj.bias"]
    sd["k_proj.bais"] = sd64["k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['k_proj.bias'\], unexpected keys \['k_proj.bais'\]"):
        convert.to_torch(sd, SIZES.N)


def test_wrong_shapes_and_types_are_errors(sd64):
    sd = dict(sd64, **{"v_proj.weight": sd64["v_proj.weight"][:, :-1]})
    with pytest.raises(ValueError, match=r"v_proj.weight has shape \(12, 11\), expected \(12, 12\)"):
        convert.to_jax(sd, SIZES.N)
    sd = dict(sd64, **{"out_proj.bias": sd64["out_proj.bias"].astype(np.float32)})
    with pytest.raises(TypeError, match="mixes dtypes"):
        convert.to_torch(sd, SIZES.N)
    sd = dict(sd64, **{"q_proj.bias": torch.zeros(12)})
    with pytest.raises(TypeError, match="q_proj.bias must be a numpy.ndarray"):
        convert.check_state_dict(sd)
    with pytest.raises(ValueError, match="embed_dim=12 is not divisible by num_heads=5"):
        convert.to_flax_linen(sd64, 5)


def test_no_silent_dtype_change(sd64):
    sd16 = cast_sd(sd64, np.float16)
    with pytest.raises(TypeError, match="differs from the weights' dtype float16"):
        convert.to_torch(sd16, SIZES.N, dtype=torch.float32)
    with pytest.raises(TypeError, match="differs from the weights' dtype float16"):
        convert.to_jax(sd16, SIZES.N, param_dtype=jnp.float32)
    import jax

    with jax.enable_x64(False):
        with pytest.raises(TypeError, match="jax_enable_x64"):
            convert.to_jax(sd64, SIZES.N)


def test_torch_to_jax_of_a_torch_mha_points_to_from_torch_mha():
    with pytest.raises(TypeError, match=r"got MultiheadAttention; for torch.nn.MultiheadAttention use sd = convert.from_torch_mha\(m\)"):
        convert.torch_to_jax(torch.nn.MultiheadAttention(12, 3, batch_first=True))
    with pytest.raises(TypeError, match=r"convert.from_flax_nnx\(m\)"):
        convert.jax_to_torch(nnx.MultiHeadAttention(3, 12, rngs=nnx.Rngs(0), decode=False))


def test_the_public_api_is_one_definition_each():
    """parity.convert re-exports the canonical dict's and the layouts' API: the same objects, not copies."""
    from parity import canonical, layouts

    assert all(hasattr(convert, name) for name in convert.__all__)
    for module, names in ((canonical, ("CANONICAL_KEYS", "check_state_dict", "tensor_to_numpy", "numpy_to_tensor")),
                          (layouts, ("LAYOUTS", "from_layout", "to_layout", "read_layout", "read_checkpoint", "read_hf_config",
                                    "account", "unmodelled_features"))):
        for name in names:
            assert name in convert.__all__ and getattr(convert, name) is getattr(module, name), name


def test_bfloat16_tensor_numpy_bridge_is_bit_exact(rng):
    bits = rng.integers(0, 2**16, 1000, dtype=np.uint16).view(np.int16)
    a = bits.view(ml_dtypes.bfloat16)
    t = convert.numpy_to_tensor(a)
    assert t.dtype == torch.bfloat16
    back = convert.tensor_to_numpy(t)
    assert back.dtype == ml_dtypes.bfloat16 and back.tobytes() == a.tobytes()


# ------------------------------------------------------------- grouped-query, RoPE and bias-free layers

B, T, S, N, K, H = 3, 5, 7, 6, 2, 4
E = N * H
THETA = 500.0


def _sd(rng, qkv_bias=True):
    sd = {"q_proj.weight": rng.standard_normal((N * H, E)), "k_proj.weight": rng.standard_normal((K * H, E)),
          "v_proj.weight": rng.standard_normal((K * H, E)), "out_proj.weight": rng.standard_normal((E, N * H)),
          "out_proj.bias": rng.standard_normal(E)}
    if qkv_bias:
        sd.update({"q_proj.bias": rng.standard_normal(N * H), "k_proj.bias": rng.standard_normal(K * H),
                   "v_proj.bias": rng.standard_normal(K * H)})
    return {k: v / math.sqrt(v.shape[-1]) for k, v in sd.items()}


def _hf_permute(w, n_heads):
    """Hugging Face convert_llama_weights_to_hf.permute, written as it is there (torch)."""
    w = torch.from_numpy(w)
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).numpy()


class TestRope:
    """convert.permute_rope: Hugging Face's q/k row permutation and its inverse."""

    def test_to_half_is_hf_permutation_and_interleaved_its_inverse(self):
        sd = _sd(np.random.default_rng(0), qkv_bias=False)
        half = convert.permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")
        np.testing.assert_array_equal(half["q_proj.weight"], _hf_permute(sd["q_proj.weight"], N))
        np.testing.assert_array_equal(half["k_proj.weight"], _hf_permute(sd["k_proj.weight"], K))
        for name in ("v_proj.weight", "out_proj.weight", "out_proj.bias"):
            np.testing.assert_array_equal(half[name], sd[name])
        assert not np.array_equal(half["q_proj.weight"], sd["q_proj.weight"])
        back = convert.permute_rope(half, num_heads=N, num_kv_heads=K, to="interleaved")
        for name in sd:
            np.testing.assert_array_equal(back[name], sd[name])

    @pytest.mark.parametrize("qkv_bias", [True, False])
    def test_meta_interleaved_equals_permuted_half(self, qkv_bias):
        """Meta-style weights with rope="interleaved" = HF-permuted weights with rope="half"
        (oracle and torch module), at non-default positions, with a mask."""
        rng = np.random.default_rng(1)
        sd = _sd(rng, qkv_bias)
        q, k, v = (rng.standard_normal((B, L, E)) for L in (T, S, S))
        keep = rng.random((B, T, S)) < 0.7
        keep[:, :, 0] = True
        pos, kpos = rng.integers(0, 40, size=(B, T)), rng.integers(0, 40, size=(B, S))
        hf = convert.permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")
        kw = dict(num_heads=N, num_kv_heads=K, rope_theta=THETA, positions=pos, key_positions=kpos)
        meta_out = reference.forward(sd, q, k, v, keep, rope="interleaved", **kw).output
        hf_out = reference.forward(hf, q, k, v, keep, rope="half", **kw).output
        np.testing.assert_allclose(hf_out, meta_out, rtol=1e-12, atol=1e-12)
        wrong = reference.forward(sd, q, k, v, keep, rope="half", **kw).output  # the convention mix-up
        assert np.abs(wrong - meta_out).max() > 1e-2

        from mha_torch import MultiHeadAttention

        mod = MultiHeadAttention(E, N, num_kv_heads=K, qkv_bias=qkv_bias, rope="half", rope_theta=THETA,
                                 dtype=torch.float64)
        mod.load_state_dict({name: torch.from_numpy(a) for name, a in hf.items()}, strict=True)
        with torch.no_grad():
            for need_weights in (True, False):
                out, _ = mod(*(torch.from_numpy(x) for x in (q, k, v)), torch.from_numpy(keep), need_weights,
                             positions=torch.from_numpy(pos), key_positions=torch.from_numpy(kpos))
                np.testing.assert_allclose(out.numpy(), meta_out, rtol=1e-10, atol=1e-10)

    @pytest.mark.parametrize("kwargs, match", [
        (dict(num_heads=N, to="neox"), "to='neox'"),
        (dict(num_heads=5, num_kv_heads=K, to="half"), "q_proj.weight has 24 rows, not 5 heads"),
        (dict(num_heads=N, num_kv_heads=0, to="half"), "num_kv_heads must be a positive int"),
    ])
    def test_bad_permute_arguments_are_named(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            convert.permute_rope(_sd(np.random.default_rng(2)), **kwargs)


class TestGrouped:
    """k/v weights of K·H rows."""

    def test_kv_rows_without_num_kv_heads_are_named(self):
        with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 24\), expected \(24, 24\)"):
            convert.to_torch(_sd(np.random.default_rng(5)), N)


class TestBiasFree:
    """The keys say which biases exist: all q/k/v biases or none."""

    @pytest.mark.parametrize("drop, match", [
        (["k_proj.bias"], r"missing keys \['k_proj.bias'\].*partial set"),
        (["q_proj.bias", "k_proj.bias", "out_proj.bias"], r"missing keys \['k_proj.bias', 'q_proj.bias'\].*partial set"),
    ])
    def test_partial_bias_set_is_named(self, drop, match):
        sd = _sd(np.random.default_rng(4))
        for name in drop:
            del sd[name]
        with pytest.raises(ValueError, match=match):
            convert.to_torch(sd, N, num_kv_heads=K)


class TestVariants:
    """Every K and bias combination through to_torch/from_torch."""

    @pytest.mark.parametrize("qkv_bias, out_bias", [(True, True), (True, False), (False, True), (False, False)])
    @pytest.mark.parametrize("n_kv", [None, 2, 1])
    def test_to_torch_from_torch_round_trip(self, n_kv, qkv_bias, out_bias):
        """The keys say which biases exist; k/v weights keep their K*H rows; the module matches the oracle."""
        from mha_spec import AttentionConfig

        rng = np.random.default_rng(3)
        shapes = AttentionConfig(E, N, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias).weight_shapes()
        sd = {name: rng.standard_normal(shape) / 3 for name, shape in shapes.items()}
        m = convert.to_torch(sd, N, num_kv_heads=n_kv, rope="interleaved", rope_theta=THETA)
        assert m.config.kv_heads == (n_kv or N) and m.config.rope == "interleaved"
        assert (m.q_proj.bias is not None, m.out_proj.bias is not None) == (qkv_bias, out_bias)
        back = convert.from_torch(m)
        assert sorted(back) == sorted(sd)
        for name in sd:
            np.testing.assert_array_equal(back[name], sd[name])
        q, k, v = (rng.standard_normal((B, L, E)) for L in (T, S, S))
        with torch.no_grad():
            out, _ = m(*(torch.from_numpy(x) for x in (q, k, v)))
        want = reference.forward(sd, q, k, v, None, num_heads=N, num_kv_heads=n_kv, rope="interleaved",
                                 rope_theta=THETA).output
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-10)
