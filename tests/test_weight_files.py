"""Weight files: save/load of every layer (classic and grouped/RoPE/bias-free), their metadata, and
what both readers (convert.load, convert.read_layout) do with files that are not weight files."""

from __future__ import annotations

import pickle
import re

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from conftest import SIZES
from helpers import DTYPES, build, cast_sd, np_dtype, run
from mha_spec import AttentionConfig
from parity import convert

S = SIZES


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


# ------------------------------------------------------------- the classic layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_load_round_trip(dtype, sd64, tmp_path, rng):
    sd = cast_sd(sd64, np_dtype(dtype))
    path = tmp_path / "mha.safetensors"
    convert.save(sd, path, num_heads=S.N, masked_rows="zero")
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.masked_rows) == (S.N, "zero")
    assert_bit_identical(ckpt.state_dict, sd)
    tm, jm = ckpt.to_torch(), ckpt.to_jax()  # nothing but the file is needed
    assert (tm.num_heads, tm.masked_rows, jm.num_heads, jm.masked_rows) == (S.N, "zero", S.N, "zero")
    assert_bit_identical(convert.from_torch(tm), sd)
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left nothing behind


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_save_a_module_keeps_its_policy(framework, sd64, tmp_path):
    path = tmp_path / "m.safetensors"
    convert.save(build(framework, sd64, S.N, masked_rows="zero"), path)
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.masked_rows) == (S.N, "zero")
    assert_bit_identical(ckpt.state_dict, sd64)
    with pytest.raises(ValueError, match="masked_rows='nan' contradicts the module's masked_rows='zero'"):
        convert.save(build(framework, sd64, S.N, masked_rows="zero"), path, masked_rows="nan")


def test_save_a_bare_state_dict_needs_the_policy(sd64, tmp_path):
    """A state dict does not know its masked-row policy: no silent 'nan' default."""
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="needs num_heads= and masked_rows="):
        convert.save(sd64, path, num_heads=S.N)
    with pytest.raises(TypeError, match="needs num_heads= and masked_rows="):
        convert.save(sd64, path, masked_rows="zero")
    with pytest.raises(TypeError, match="save takes our torch or JAX module or a canonical state dict, got MultiheadAttention"):
        convert.save(torch.nn.MultiheadAttention(12, 3), path, num_heads=3, masked_rows="nan")
    assert not path.exists()


def _write_with_metadata(path, sd, **changes):
    from safetensors.numpy import save_file

    metadata = {"format": "mha-parity", "format_version": "1", "embed_dim": "12", "num_heads": "3", "masked_rows": "zero"}
    metadata.update(changes)
    save_file(sd, str(path), metadata={k: v for k, v in metadata.items() if v is not None})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format_version": "3"}, r"'format_version' = '3'; this version reads \['1', '2'\]"),
        ({"embed_dim": "16"}, r"'embed_dim' = 16 but the weights are \(12, 12\)"),
        ({"embed_dim": "twelve"}, r"'embed_dim' = 'twelve' is not a positive integer"),
        ({"num_heads": "-3"}, r"'num_heads' = '-3' is not a positive integer"),
        ({"num_heads": "5"}, r"'num_heads' = 5 does not divide embed_dim 12"),
        ({"masked_rows": "ignore"}, r"'masked_rows' = 'ignore' is not one of"),
        ({"embed_dim": None}, r"metadata lacks 'embed_dim'"),
        ({"format_version": None}, r"metadata lacks 'format_version'"),
    ],
)
def test_load_checks_every_metadata_field(changes, message, sd64, tmp_path):
    path = tmp_path / "bad.safetensors"
    _write_with_metadata(path, sd64, **changes)
    with pytest.raises(ValueError, match=f"{path.name}: (metadata field )?{message}"):
        convert.load(path)


def test_load_names_the_file_when_the_tensors_are_wrong(sd64, tmp_path):
    path = tmp_path / "short.safetensors"
    _write_with_metadata(path, {k: v for k, v in sd64.items() if k != "v_proj.bias"})
    with pytest.raises(ValueError, match=r"short.safetensors: state dict: missing keys \['v_proj.bias'\]"):
        convert.load(path)


def test_load_refuses_foreign_files_and_save_a_bad_policy(sd64, tmp_path):
    from safetensors.numpy import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file(sd64, str(foreign))
    with pytest.raises(ValueError, match="no 'mha-parity' metadata"):
        convert.load(foreign)
    with pytest.raises(ValueError, match="masked_rows='ignore'"):
        convert.save(sd64, tmp_path / "x.safetensors", num_heads=S.N, masked_rows="ignore")


# ------------------------------------------------------------- files that are not weight files: both readers


READERS = {
    "load": convert.load,
    "read_layout": lambda path: convert.read_layout(path, "hf-bert"),
}


class _Planted:
    """Unpickling this creates `marker`: proof that a reader unpickled the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _good_file(sd64, path, reader: str):
    """A file the reader accepts: ours for load, one BERT attention block for read_layout."""
    if reader == "load":
        convert.save(sd64, path, num_heads=S.N, masked_rows="zero")
    else:
        from safetensors.numpy import save_file

        save_file(convert.to_layout(sd64, "hf-bert"), str(path))
    return path


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "how, message",
    [
        ("pickle", r"is a Python pickle \(protocol 4\), not a safetensors file; .*never loaded"),
        ("torch-zip", r"is a zip archive -- PyTorch's pickle checkpoint format -- not a safetensors file; .*never loaded"),
        ("torch-legacy", r"is a Python pickle \(protocol 2\), not a safetensors file"),
    ],
    ids=["pickle", "torch-zip", "torch-legacy"],
)
def test_a_pickle_is_named_and_never_unpickled(reader, how, message, tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "weights.pt"
    payload = {"q_proj.weight": _Planted(marker)}
    if how == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=4))
    else:
        torch.save(payload, path, _use_new_zipfile_serialization=how == "torch-zip")
    with pytest.raises(ValueError, match=re.escape(str(path)) + " " + message):
        READERS[reader](path)
    assert not marker.exists()


@pytest.mark.parametrize("reader", READERS)
def test_a_truncated_file_is_named(reader, sd64, tmp_path):
    whole = _good_file(sd64, tmp_path / "whole.safetensors", reader).read_bytes()
    header_len = int.from_bytes(whole[:8], "little")
    data_len = len(whole) - 8 - header_len  # what the header describes: every byte after it
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ValueError, match=re.escape(f"{cut} is truncated: its header describes {data_len} bytes of tensor data, the file holds {data_len - 100}")):
        READERS[reader](cut)
    cut.write_bytes(whole[: 8 + header_len // 2])
    with pytest.raises(ValueError, match=re.escape(f"{cut} is truncated or not a safetensors file: its first 8 bytes announce a {header_len}-byte header")):
        READERS[reader](cut)
    cut.write_bytes(whole[:5])
    with pytest.raises(ValueError, match=re.escape(f"{cut} holds 5 bytes, too few for a safetensors file")):
        READERS[reader](cut)


@pytest.mark.parametrize("reader", READERS)
def test_a_directory_or_a_missing_file_is_named(reader, sd64, tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(f"{folder} is a directory holding no .safetensors file")):
        READERS[reader](folder)
    _good_file(sd64, folder / "model.safetensors", reader)
    with pytest.raises(IsADirectoryError, match=re.escape(f"{folder} is a directory, not a safetensors file; pass one of the files in it: ['model.safetensors']")):
        READERS[reader](folder)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'absent.safetensors'}: no such weight file")):
        READERS[reader](tmp_path / "absent.safetensors")


@pytest.mark.parametrize("reader", READERS)
def test_bytes_paths_are_paths_and_other_objects_are_type_errors(reader, sd64, tmp_path):
    path = _good_file(sd64, tmp_path / "w.safetensors", reader)
    from_bytes, from_str = READERS[reader](bytes(path)), READERS[reader](str(path))
    sd_bytes, sd_str = (x.state_dict if reader == "load" else x for x in (from_bytes, from_str))
    assert_bit_identical(sd_bytes, sd_str)
    assert_bit_identical(sd_str, sd64)
    with pytest.raises(IsADirectoryError, match=re.escape(f"{tmp_path} is a directory")):
        READERS[reader](bytes(tmp_path))
    for bad in (3, None):  # an int would otherwise open a file descriptor
        with pytest.raises(TypeError, match=f"a weight file path must be a str, bytes or os.PathLike, got {type(bad).__name__}"):
            READERS[reader](bad)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize(
    "dtype, stored, message",
    [
        (ml_dtypes.float8_e4m3fn, "F8_E4M3", r" \(float8\): float8 weights are not supported, dequantize them first; only float16, bfloat16, float32 and float64"),
        (ml_dtypes.float8_e5m2, "F8_E5M2", r" \(float8\): float8 weights are not supported"),
        (np.int64, "I64", r"; only float16, bfloat16, float32 and float64 tensors are read"),
    ],
    ids=["float8_e4m3fn", "float8_e5m2", "int64"],
)
def test_a_tensor_of_another_dtype_is_named_by_key(reader, dtype, stored, message, sd64, tmp_path):
    from safetensors.numpy import save_file

    key = "k_proj.weight" if reader == "load" else "self.key.weight"
    tensors = dict(sd64) if reader == "load" else convert.to_layout(sd64, "hf-bert")
    tensors[key] = tensors[key].astype(dtype)
    path = tmp_path / "odd.safetensors"
    if reader == "load":
        _write_with_metadata(path, tensors)
    else:
        save_file(tensors, str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor {key!r} has dtype {stored}") + message):
        READERS[reader](path)


def test_a_buffer_may_be_a_mask_a_weight_may_not(tmp_path):
    """get_buffer reads a bool or uint8 mask (GPT-2's causal mask was stored as either) in its dtype; get, the
    weights' reader, refuses it by key; get_buffer refuses what no buffer is stored as (int64)."""
    from safetensors.numpy import save_file

    from parity.weight_file import open_weight_file

    mask = np.tril(np.ones((3, 3), bool))
    path = tmp_path / "buffers.safetensors"
    save_file({"mask": mask, "mask8": mask.astype(np.uint8), "count": np.arange(3)}, str(path))
    with open_weight_file(path) as f:
        assert f.get_buffer("mask").dtype == np.bool_ and np.array_equal(f.get_buffer("mask"), mask)
        assert f.get_buffer("mask8").dtype == np.uint8 and np.array_equal(f.get_buffer("mask8"), mask)
        with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'mask' has dtype BOOL")):
            f.get("mask")
        with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'count' has dtype I64")):
            f.get_buffer("count")


def test_a_reader_that_casts_is_caught(sd64, tmp_path, monkeypatch):
    """The stored dtype is the dtype returned: a reader that hands back another one is an error, not a cast."""
    from parity import weight_file

    path = tmp_path / "bf16.safetensors"
    convert.save(cast_sd(sd64, np.dtype(ml_dtypes.bfloat16)), path, num_heads=S.N, masked_rows="zero")
    assert convert.load(path).state_dict["q_proj.bias"].dtype == np.dtype(ml_dtypes.bfloat16)
    real = weight_file._read_bf16
    monkeypatch.setattr(weight_file, "_read_bf16", lambda p, key: real(p, key).astype(np.float32))
    with pytest.raises(TypeError, match=re.escape(f"{path}: tensor 'q_proj.weight' is stored as BF16 but was read as float32")):
        convert.load(path)


# ------------------------------------------------------------- grouped / RoPE / bias-free layers


GN, GK, GH = 6, 2, 4  # a grouped layer: N query heads, K key/value heads, H head dim
GE = GN * GH


def _sd(rng, kv_heads=GK, qkv_bias=True, out_bias=True, dtype=np.float64):
    shapes = AttentionConfig(GE, GN, num_kv_heads=kv_heads, qkv_bias=qkv_bias, out_bias=out_bias).weight_shapes()
    return {name: (rng.standard_normal(shape) / 4).astype(dtype) for name, shape in shapes.items()}


LAYERS = {  # every feature, each in at least one layer, with a non-default rope_theta and policy
    "grouped-rope-half-no-qkv-bias": dict(num_kv_heads=GK, rope="half", rope_theta=500.0, qkv_bias=False),
    "multi-query-interleaved-no-out-bias": dict(num_kv_heads=1, rope="interleaved", out_bias=False),
    "grouped-no-biases-bfloat16": dict(num_kv_heads=3, qkv_bias=False, out_bias=False),
}


@pytest.mark.parametrize("name", LAYERS)
def test_every_variant_round_trips_through_a_file(name, tmp_path, rng):
    """Module -> file -> Checkpoint: the same weights bit for bit, the same layer, the same output."""
    kwargs = LAYERS[name]
    dtype = torch.bfloat16 if "bfloat16" in name else torch.float64
    m = convert.to_torch(_sd(rng, kwargs.get("num_kv_heads"), kwargs.get("qkv_bias", True), kwargs.get("out_bias", True)),
                         GN, **{k: v for k, v in kwargs.items() if k not in ("qkv_bias", "out_bias")},
                         masked_rows="uniform")
    m = m.to(dtype)
    path = tmp_path / "layer.safetensors"
    convert.save(m, path)
    ckpt = convert.load(path)
    assert ckpt.config == AttentionConfig(GE, GN, masked_rows="uniform", **kwargs)
    assert_bit_identical(ckpt.state_dict, convert.from_torch(m))
    assert ckpt.state_dict["q_proj.weight"].dtype == (np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else np.float64)
    again = ckpt.to_torch()
    assert again.config == m.config
    x = [rng.standard_normal((S.B, L, GE)).astype(ckpt.state_dict["q_proj.weight"].dtype) for L in (S.T, S.S, S.S)]
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
    convert.save(sd, path, num_heads=GN, num_kv_heads=GK, rope="interleaved", rope_theta=123.5, masked_rows="zero")
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.num_kv_heads, ckpt.rope, ckpt.rope_theta, ckpt.masked_rows) == (GN, GK, "interleaved", 123.5, "zero")
    assert_bit_identical(ckpt.state_dict, sd)
    # The k/v rows say K*H = 8: without num_kv_heads they do not fit N=6 heads of H=4.
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 24\), expected \(24, 24\)"):
        convert.save(sd, path, num_heads=GN, masked_rows="zero")
    module = convert.to_torch(sd, GN, num_kv_heads=GK, rope="half", rope_theta=500.0)
    with pytest.raises(ValueError, match="rope_theta=10000.0 contradicts the module's rope_theta=500.0"):
        convert.save(module, path, rope_theta=10000.0)
    with pytest.raises(ValueError, match="num_kv_heads=3 contradicts the module's num_kv_heads=2"):
        convert.save(module, path, num_kv_heads=3)


def _write_v2(path, sd, **changes):
    metadata = {"format": "mha-parity", "format_version": "2", "embed_dim": str(GE), "num_heads": str(GN),
                "num_kv_heads": str(GK), "rope": "half", "rope_theta": "500.0", "masked_rows": "nan"}
    metadata.update(changes)
    save_file(sd, str(path), metadata={k: v for k, v in metadata.items() if v is not None})


def test_a_version_1_file_is_the_classic_layer(tmp_path, rng):
    """Files written before the layer had more than heads and a policy load as the classic layer."""
    sd = _sd(rng, kv_heads=None)
    path = tmp_path / "v1.safetensors"
    classic = dict(format_version="1", num_kv_heads=None, rope=None, rope_theta=None)
    _write_v2(path, sd, **classic)
    ckpt = convert.load(path)
    assert (ckpt.num_heads, ckpt.masked_rows, ckpt.num_kv_heads, ckpt.rope, ckpt.rope_theta) == (GN, "nan", None, None, 10000.0)
    assert_bit_identical(ckpt.state_dict, sd)
    assert ckpt.config == AttentionConfig(GE, GN) and ckpt.to_torch().config == AttentionConfig(GE, GN)
    _write_v2(path, sd, **dict(classic, rope="half"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: metadata fields ['rope'] are not part of format_version '1'")):
        convert.load(path)
    _write_v2(path, {k: v for k, v in sd.items() if k != "out_proj.bias"}, **classic)
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
    _write_v2(path, _sd(rng), **changes)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        convert.load(path)


def test_a_partial_bias_set_in_a_file_is_named(tmp_path, rng):
    sd = _sd(rng)
    del sd["v_proj.bias"]
    path = tmp_path / "partial.safetensors"
    _write_v2(path, sd)
    with pytest.raises(ValueError, match=re.escape(f"{path}: state dict: missing keys ['v_proj.bias']") + ".*partial set"):
        convert.load(path)


@pytest.mark.parametrize("layer", [dict(rope="half", rope_dim=2), dict(rope="half", rope_scaling="linear:factor=2"),
                                   dict(scale=0.3), dict(softcap=30.0), dict(sinks=True), dict(qk_norm="head"),
                                   dict(attn_temperature_tuning=True)])
def test_save_refuses_a_layer_the_format_cannot_describe(layer, tmp_path):
    """A field the file's metadata does not carry would load as another layer: save names it and writes nothing."""
    from mha_spec import RopeScaling
    from mha_torch import MultiHeadAttention

    if "rope_scaling" in layer:
        layer = {**layer, "rope_scaling": RopeScaling.parse(layer["rope_scaling"])}
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=f"does not carry {next(k for k in layer if k != 'rope')}="):
        convert.save(MultiHeadAttention(12, 3, **layer), path)
    assert not path.exists()


def test_a_head_dim_of_its_own_round_trips(tmp_path):
    from mha_torch import MultiHeadAttention

    m = MultiHeadAttention(12, 3, head_dim=8, rope="half", num_kv_heads=1)
    convert.save(m, tmp_path / "w.safetensors")
    assert convert.load(tmp_path / "w.safetensors").config == m.config
