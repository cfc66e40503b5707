"""parity.convert: bit-exact round trips, explicit layouts, ecosystem peers, safetensors files."""

from __future__ import annotations

import pickle
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import linen, nnx

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, build, cast_sd, np_dtype, run
from parity import convert, reference
from parity.tolerances import compare, tolerance_for

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["torch_mha", "flax_nnx"])
def test_ecosystem_round_trips_are_bit_identical(dtype, fmt, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    to, frm = getattr(convert, f"to_{fmt}"), getattr(convert, f"from_{fmt}")
    assert_bit_identical(frm(to(sd, S.N)), sd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flax_linen_round_trip_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_flax_linen(convert.to_flax_linen(sd, S.N)), sd)


def test_flax_layout_table(sd64):
    """Head n owns features n*H .. n*H+H-1 of the classic layout; flax's kernel axes are (E, N, H) and (N, H, E)."""
    H = S.E // S.N
    p = convert.to_flax_linen(sd64, S.N)["params"]
    n, h, e = 2, 1, 5
    assert p["query"]["kernel"][e, n, h] == sd64["q_proj.weight"][n * H + h, e]
    assert p["value"]["bias"][n, h] == sd64["v_proj.bias"][n * H + h]
    assert p["out"]["kernel"][n, h, e] == sd64["out_proj.weight"][e, n * H + h]


def test_torch_mha_packing(sd64):
    m = convert.to_torch_mha(sd64, S.N)
    E = S.E
    np.testing.assert_array_equal(m.in_proj_weight.detach().numpy()[E : 2 * E], sd64["k_proj.weight"])
    np.testing.assert_array_equal(m.in_proj_bias.detach().numpy()[2 * E :], sd64["v_proj.bias"])


# ------------------------------------------------------------- peers fed converted weights


def _ours(sd, policy, q, k, v, keep, framework="torch"):
    out, w = run(framework, build(framework, sd, S.N, masked_rows=policy), q, k, v, keep)
    return out, w


@pytest.mark.parametrize("need_weights", [True, False])
def test_torch_mha_peer(need_weights, sd64, rng):
    """torch.nn.MultiheadAttention masks where True: pass ~keep, per batch*head for a 3-D mask.

    With need_weights=True a fully masked row is NaN (our "nan"); with need_weights=False it
    takes SDPA's fast path and gives a zero context (our "zero").
    """
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    peer = convert.to_torch_mha(sd64, S.N)
    attn_mask = torch.from_numpy(~np.repeat(keep, S.N, axis=0))  # (B*N, T, S), True = masked
    with torch.no_grad():
        out, w = peer(*(torch.from_numpy(x) for x in (q, k, v)), attn_mask=attn_mask, need_weights=need_weights, average_attn_weights=False)
    policy = "nan" if need_weights else "zero"
    ours_out, ours_w = _ours(sd64, policy, q, k, v, keep)
    tol = tolerance_for("float64").forward
    c = compare(out.numpy(), ours_out, tol)
    assert c.passed, c
    if need_weights:
        c = compare(w.numpy(), ours_w, tol)
        assert c.passed, c


def test_sdpa_peer_is_the_zero_policy(sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    H = S.E // S.N

    def proj(x, p):
        y = x @ sd64[f"{p}.weight"].T + sd64[f"{p}.bias"]
        return torch.from_numpy(y.reshape(*y.shape[:2], S.N, H).transpose(0, 2, 1, 3))

    ctx = F.scaled_dot_product_attention(proj(q, "q_proj"), proj(k, "k_proj"), proj(v, "v_proj"), attn_mask=torch.from_numpy(keep[:, None]))
    ctx = ctx.numpy().transpose(0, 2, 1, 3).reshape(S.B, S.T, S.E)
    out = ctx @ sd64["out_proj.weight"].T + sd64["out_proj.bias"]
    c = compare(out, _ours(sd64, "zero", q, k, v, keep)[0], tolerance_for("float64").forward)
    assert c.passed, c


@pytest.mark.parametrize("peer_kind", ["linen", "nnx"])
def test_flax_peers_are_the_uniform_policy(peer_kind, sd64, rng):
    """flax masks where False (same polarity as ours) and gives fully masked rows uniform weights.

    flax computes its softmax in float32 even for float64 inputs, so it is compared in
    float32 with the float32 tolerance (its float64 deviation is the harness's to report).
    """
    sd = cast_sd(sd64, np.float32)
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    if peer_kind == "linen":
        variables = convert.to_flax_linen(sd, S.N)
        out = linen.MultiHeadDotProductAttention(num_heads=S.N).apply(variables, q, k, v, mask=keep[:, None])
    else:
        out = convert.to_flax_nnx(sd, S.N)(q, k, v, mask=jnp.asarray(keep[:, None]))
    ours = _ours(sd, "uniform", q, k, v, keep, framework="jax")[0]
    c = compare(np.asarray(out), ours, tolerance_for("float32").forward)
    assert c.passed, c
    exact = reference.forward(sd64, q, k, v, keep, num_heads=S.N, masked_rows="uniform")
    assert compare(np.asarray(out), exact.output, tolerance_for("float32").forward).passed


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


def test_flax_linen_bad_tree(sd64):
    variables = convert.to_flax_linen(sd64, S.N)
    with pytest.raises(ValueError, match=r"missing keys \['params'\]"):
        convert.from_flax_linen(variables["params"])
    del variables["params"]["out"]["bias"]
    with pytest.raises(ValueError, match=r"\['out'\]: missing keys \['bias'\]"):
        convert.from_flax_linen(variables)


def test_flax_linen_malformed_trees_are_clear_errors(sd64):
    """Not AttributeError: a non-mapping level or a non-array leaf is a TypeError naming where."""
    good = convert.to_flax_linen(sd64, S.N)["params"]
    with pytest.raises(TypeError, match=r"flax.linen params must be a mapping, got int"):
        convert.from_flax_linen({"params": 5})
    with pytest.raises(TypeError, match=r"\['key'\] must be a mapping, got list"):
        convert.from_flax_linen({"params": dict(good, key=[1, 2])})
    with pytest.raises(TypeError, match=r"\['out'\]\['kernel'\] must be an array, got str"):
        convert.from_flax_linen({"params": dict(good, out={"kernel": "w", "bias": good["out"]["bias"]})})


def test_torch_to_jax_of_a_torch_mha_points_to_from_torch_mha():
    with pytest.raises(TypeError, match=r"got MultiheadAttention; for torch.nn.MultiheadAttention use sd = convert.from_torch_mha\(m\)"):
        convert.torch_to_jax(torch.nn.MultiheadAttention(12, 3, batch_first=True))
    with pytest.raises(TypeError, match=r"convert.from_flax_nnx\(m\)"):
        convert.jax_to_torch(nnx.MultiHeadAttention(3, 12, rngs=nnx.Rngs(0), decode=False))


def test_from_torch_mha_accepts_batch_first_false(sd64, rng):
    """The weights do not depend on batch_first: the same sd gives the same attention, sequence-first."""
    seq_first = convert.to_torch_mha(sd64, S.N, batch_first=False)
    assert seq_first.batch_first is False
    assert_bit_identical(convert.from_torch_mha(seq_first), sd64)
    q, k, v = make_inputs(rng)
    with torch.no_grad():
        out, _ = seq_first(*(torch.from_numpy(x.transpose(1, 0, 2)) for x in (q, k, v)))
    ours = _ours(sd64, "nan", q, k, v, None)[0]
    c = compare(out.numpy().transpose(1, 0, 2), ours, tolerance_for("float64").forward)
    assert c.passed, c


def test_torch_mha_unsupported_configs_are_named():
    with pytest.raises(ValueError, match="packed in_proj_weight"):
        convert.from_torch_mha(torch.nn.MultiheadAttention(12, 3, batch_first=True, kdim=8, vdim=8))
    with pytest.raises(ValueError, match="GQA|grouped"):
        convert.from_flax_nnx(nnx.MultiHeadAttention(4, 12, num_kv_heads=2, rngs=nnx.Rngs(0), decode=False))


# ------------------------------------------------------------- files


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


def test_jax_dot_product_attention_peer_is_the_uniform_policy(sd64, rng):
    """jax.nn.dot_product_attention (True = attend, layout BTNH) on our projections, float32."""
    import jax

    sd = cast_sd(sd64, np.float32)
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    H = S.E // S.N

    def proj(x, p):
        return (x @ sd[f"{p}.weight"].T + sd[f"{p}.bias"]).reshape(x.shape[0], x.shape[1], S.N, H)

    ctx = jax.nn.dot_product_attention(proj(q, "q_proj"), proj(k, "k_proj"), proj(v, "v_proj"), mask=keep[:, None])
    out = np.asarray(ctx).reshape(S.B, S.T, S.E) @ sd["out_proj.weight"].T + sd["out_proj.bias"]
    c = compare(out, _ours(sd, "uniform", q, k, v, keep, framework="jax")[0], tolerance_for("float32").forward)
    assert c.passed, c
