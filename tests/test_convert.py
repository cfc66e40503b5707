"""parity.convert's converters of our modules: bit-exact round trips, strictness, the public API. The peers'
converters (re-exported here) are tested with their modules: tests/test_peer_*.py."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import SIZES
from helpers import DTYPES, cast_sd, np_dtype
from parity import convert

S = SIZES


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_jax_torch_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    tm = convert.to_torch(sd, S.N, masked_rows="uniform")
    jm = convert.torch_to_jax(tm)
    back = convert.jax_to_torch(jm)
    assert (jm.num_heads, jm.masked_rows, back.num_heads, back.masked_rows) == (S.N, "uniform", S.N, "uniform")
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
        convert.to_torch(sd, S.N)


def test_wrong_shapes_and_types_are_errors(sd64):
    sd = dict(sd64, **{"v_proj.weight": sd64["v_proj.weight"][:, :-1]})
    with pytest.raises(ValueError, match=r"v_proj.weight has shape \(12, 11\), expected \(12, 12\)"):
        convert.to_jax(sd, S.N)
    sd = dict(sd64, **{"out_proj.bias": sd64["out_proj.bias"].astype(np.float32)})
    with pytest.raises(TypeError, match="mixes dtypes"):
        convert.to_torch(sd, S.N)
    sd = dict(sd64, **{"q_proj.bias": torch.zeros(12)})
    with pytest.raises(TypeError, match="q_proj.bias must be a numpy.ndarray"):
        convert.check_state_dict(sd)
    with pytest.raises(ValueError, match="embed_dim=12 is not divisible by num_heads=5"):
        convert.to_flax_linen(sd64, 5)


def test_no_silent_dtype_change(sd64):
    sd16 = cast_sd(sd64, np.float16)
    with pytest.raises(TypeError, match="differs from the weights' dtype float16"):
        convert.to_torch(sd16, S.N, dtype=torch.float32)
    with pytest.raises(TypeError, match="differs from the weights' dtype float16"):
        convert.to_jax(sd16, S.N, param_dtype=jnp.float32)
    import jax

    with jax.enable_x64(False):
        with pytest.raises(TypeError, match="jax_enable_x64"):
            convert.to_jax(sd64, S.N)


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
                          (layouts, ("LAYOUTS", "from_layout", "to_layout", "read_layout", "read_checkpoint", "read_hf_config"))):
        for name in names:
            assert name in convert.__all__ and getattr(convert, name) is getattr(module, name), name


def test_bfloat16_tensor_numpy_bridge_is_bit_exact(rng):
    bits = rng.integers(0, 2**16, 1000, dtype=np.uint16).view(np.int16)
    a = bits.view(ml_dtypes.bfloat16)
    t = convert.numpy_to_tensor(a)
    assert t.dtype == torch.bfloat16
    back = convert.tensor_to_numpy(t)
    assert back.dtype == ml_dtypes.bfloat16 and back.tobytes() == a.tobytes()
