"""Weight files of grouped / RoPE / bias-free layers: save, load, and what the metadata must say."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from helpers import run
from mha_spec import AttentionConfig
from parity import convert

B, T, S, N, K, H = 3, 5, 7, 6, 2, 4
E = N * H


def _sd(rng, kv_heads=K, qkv_bias=True, out_bias=True, dtype=np.float64):
    shapes = AttentionConfig(E, N, num_kv_heads=kv_heads, qkv_bias=qkv_bias, out_bias=out_bias).weight_shapes()
    return {name: (rng.standard_normal(shape) / 4).astype(dtype) for name, shape in shapes.items()}


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


LAYERS = {  # every feature, each in at least one layer, with a non-default rope_theta and policy
    "grouped-rope-half-no-qkv-bias": dict(num_kv_heads=K, rope="half", rope_theta=500.0, qkv_bias=False),
    "multi-query-interleaved-no-out-bias": dict(num_kv_heads=1, rope="interleaved", out_bias=False),
    "grouped-no-biases-bfloat16": dict(num_kv_heads=3, qkv_bias=False, out_bias=False),
}


@pytest.mark.parametrize("name", LAYERS)
def test_every_variant_round_trips_through_a_file(name, tmp_path, rng):
    """Module -> file -> Checkpoint: the same weights bit for bit, the same layer, the same output."""
    kwargs = LAYERS[name]
    dtype = torch.bfloat16 if "bfloat16" in name else torch.float64
    m = convert.to_torch(_sd(rng, kwargs.get("num_kv_heads"), kwargs.get("qkv_bias", True), kwargs.get("out_bias", True)),
                         N, **{k: v for k, v in kwargs.items() if k not in ("qkv_bias", "out_bias")},
                         masked_rows="uniform")
    m = m.to(dtype)
    path = tmp_path / "layer.safetensors"
    convert.save(m, path)
    ckpt = convert.load(path)
    assert ckpt.config == AttentionConfig(E, N, masked_rows="uniform", **kwargs)
    assert_bit_identical(ckpt.state_dict, convert.from_torch(m))
    assert ckpt.state_dict["q_proj.weight"].dtype == (np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else np.float64)
    again = ckpt.to_torch()
    assert again.config == m.config
    x = [rng.standard_normal((B, L, E)).astype(ckpt.state_dict["q_proj.weight"].dtype) for L in (T, S, S)]
    np.testing.assert_array_equal(run("torch", again, *x)[0], run("torch", m, *x)[0])
    if name != next(iter(LAYERS)):
        return
    in_jax = ckpt.to_jax()  # one layer is enough to show the JAX side reads and writes the same file
    assert in_jax.config == m.config
    convert.save(in_jax, path)
    from_jax = convert.load(path)
    assert from_jax.config == ckpt.config
    assert_bit_identical(from_jax.state_dict, ckpt.state_dict)


def test_a_bare_state_dict_is_saved_with_its_layer_keywords(tmp_path, rng):
    sd = _sd(rng, qkv_bias=False)
    path = tmp_path / "sd.safetensors"
    convert.save(sd, path, num_heads=N, num_kv_heads=K, rope="interleaved", rope_theta=123.5, masked_rows="zero")
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.num_kv_heads, ckpt.rope, ckpt.rope_theta, ckpt.masked_rows) == (N, K, "interleaved", 123.5, "zero")
    assert_bit_identical(ckpt.state_dict, sd)
    # The k/v rows say K*H = 8: without num_kv_heads they do not fit N=6 heads of H=4.
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 24\), expected \(24, 24\)"):
        convert.save(sd, path, num_heads=N, masked_rows="zero")
    module = convert.to_torch(sd, N, num_kv_heads=K, rope="half", rope_theta=500.0)
    with pytest.raises(ValueError, match="rope_theta=10000.0 contradicts the module's rope_theta=500.0"):
        convert.save(module, path, rope_theta=10000.0)
    with pytest.raises(ValueError, match="num_kv_heads=3 contradicts the module's num_kv_heads=2"):
        convert.save(module, path, num_kv_heads=3)


def _write(path, sd, **changes):
    metadata = {"format": "mha-parity", "format_version": "2", "embed_dim": str(E), "num_heads": str(N),
                "num_kv_heads": str(K), "rope": "half", "rope_theta": "500.0", "masked_rows": "nan"}
    metadata.update(changes)
    save_file(sd, str(path), metadata={k: v for k, v in metadata.items() if v is not None})


def test_a_version_1_file_is_the_classic_layer(tmp_path, rng):
    """Files written before the layer had more than heads and a policy load as the classic layer."""
    sd = _sd(rng, kv_heads=None)
    path = tmp_path / "v1.safetensors"
    classic = dict(format_version="1", num_kv_heads=None, rope=None, rope_theta=None)
    _write(path, sd, **classic)
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.masked_rows, ckpt.num_kv_heads, ckpt.rope, ckpt.rope_theta) == (N, "nan", None, None, 10000.0)
    assert_bit_identical(ckpt.state_dict, sd)
    assert ckpt.config == AttentionConfig(E, N) and ckpt.to_torch().config == AttentionConfig(E, N)
    _write(path, sd, **dict(classic, rope="half"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: metadata fields ['rope'] are not part of format_version '1'")):
        convert.load(path)
    _write(path, {k: v for k, v in sd.items() if k != "out_proj.bias"}, **classic)
    with pytest.raises(ValueError, match=re.escape(f"{path}: state dict: missing keys ['out_proj.bias']")):
        convert.load(path)


@pytest.mark.parametrize("changes, message", [
    ({"num_kv_heads": None}, "metadata lacks 'num_kv_heads'"),
    ({"rope_theta": None}, "metadata lacks 'rope_theta'"),
    ({"num_kv_heads": "two"}, "metadata field 'num_kv_heads' = 'two' is not a positive integer"),
    ({"num_kv_heads": "4"}, "metadata field 'num_kv_heads' = 4 does not divide num_heads 6"),
    ({"num_kv_heads": "3"}, r"k_proj.weight has shape \(8, 24\), expected \(12, 24\)"),
    ({"rope": "neox"}, r"metadata field 'rope' = 'neox' is not one of \('none', 'half', 'interleaved'\)"),
    ({"rope_theta": "inf"}, "metadata field 'rope_theta' = 'inf' is not a finite number > 1"),
    ({"rope_theta": "ten"}, "metadata field 'rope_theta' = 'ten' is not a finite number > 1"),
    ({"rope_theta": "0.5"}, "metadata field 'rope_theta' = '0.5' is not a finite number > 1"),
])
def test_bad_variant_metadata_names_file_and_field(changes, message, tmp_path, rng):
    path = tmp_path / "bad.safetensors"
    _write(path, _sd(rng), **changes)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        convert.load(path)


def test_a_partial_bias_set_in_a_file_is_named(tmp_path, rng):
    sd = _sd(rng)
    del sd["v_proj.bias"]
    path = tmp_path / "partial.safetensors"
    _write(path, sd)
    with pytest.raises(ValueError, match=re.escape(f"{path}: state dict: missing keys ['v_proj.bias']") + ".*partial set"):
        convert.load(path)
