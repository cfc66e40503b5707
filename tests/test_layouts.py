"""Hugging Face layouts (parity.convert.from_layout / to_layout / read_layout), proven on the real modules.

Each real model is built once per module (transformers' import and model builds are the slow part):
one layer, E=12, N=3, eval mode, dropout 0, eager attention, float64 unless the library's maths is not.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from conftest import SIZES
from helpers import DTYPES, cast_sd, np_dtype, run
from parity import convert
from parity.peers import hf
from parity.tolerances import compare, tolerance_for

S = SIZES
T = S.T  # self-attention: S = T


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def _hf_random_init(model):
    """HF initialises biases to zero; random biases make a dropped or swapped bias visible."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) - 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def bert():
    return _hf_random_init(transformers.BertModel(hf.hf_bert_config(S.E, S.N)).double())


@pytest.fixture(scope="module")
def gpt2():
    return _hf_random_init(transformers.GPT2Model(hf.hf_gpt2_config(S.E, S.N)).double())


@pytest.fixture(scope="module")
def vit():
    config = transformers.ViTConfig(
        hidden_size=S.E, num_attention_heads=S.N, num_hidden_layers=1, intermediate_size=16, image_size=8, patch_size=4,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, attn_implementation="eager",
    )
    return _hf_random_init(transformers.ViTModel(config))  # float32: its eager softmax is float32 anyway


def _padding(rng):
    """(B, T) HF attention_mask, 1 = real token: batch 1 right-padded, batch 2 left-padded."""
    pad = np.ones((S.B, T), bool)
    pad[1, -2:] = False
    pad[2, :1] = False
    return pad


def _ours_both(sd, keep, x, policy):
    for framework in ("torch", "jax"):
        m = (convert.to_torch if framework == "torch" else convert.to_jax)(sd, S.N, masked_rows=policy)
        out, _ = run(framework, m, x, x, x, keep)
        yield framework, out


# ------------------------------------------------------------- BERT


def test_bert_attention_matches_ours(bert, rng):
    """BertSelfAttention then output.dense (BertSelfOutput's dropout, LayerNorm, residual are not attention).

    The padding mask goes the library's way: a (B, S) 1/0 attention_mask through transformers'
    own create_bidirectional_mask (additive, finfo.min); ours gets keep = padding[:, None, :].
    """
    prefix = "encoder.layer.0.attention."
    sd = convert.from_layout(bert.state_dict(), "hf-bert", prefix=prefix)
    assert sd["q_proj.weight"].dtype == np.float64
    x = rng.standard_normal((S.B, T, S.E))
    pad = _padding(rng)
    xt = torch.from_numpy(x)
    att = bert.encoder.layer[0].attention
    with torch.no_grad():
        mask = create_bidirectional_mask(config=bert.config, inputs_embeds=xt, attention_mask=torch.from_numpy(pad.astype(np.int64)))
        expected = att.output.dense(att.self(xt, attention_mask=mask)[0]).numpy()
    keep = np.broadcast_to(pad[:, None, :], (S.B, T, T)).copy()
    for framework, out in _ours_both(sd, keep, x, "nan"):
        c = compare(out, expected, tolerance_for("float64").forward)
        assert c.passed, (framework, c)
    # ... and the peer adapter's mask translation is the library's own.
    np.testing.assert_array_equal(hf.additive_mask(keep, np.float64), mask.numpy())


def test_bert_round_trip_into_the_real_module_is_bit_exact(bert):
    prefix = "encoder.layer.0.attention."
    sd = convert.from_layout(bert.state_dict(), "hf-bert", prefix=prefix)
    fresh = transformers.BertModel(hf.hf_bert_config(S.E, S.N)).double()
    missing, unexpected = fresh.load_state_dict({k: torch.from_numpy(v) for k, v in convert.to_layout(sd, "hf-bert", prefix=prefix).items()}, strict=False)
    assert not unexpected and all(not k.startswith(prefix) or "LayerNorm" in k for k in missing)
    for k, v in fresh.state_dict().items():
        if k.startswith(prefix) and "LayerNorm" not in k:
            assert torch.equal(v, bert.state_dict()[k]), k


def test_bert_through_a_save_pretrained_file(bert, tmp_path, rng):
    bert.save_pretrained(tmp_path)
    prefix = "encoder.layer.0.attention."
    sd = convert.read_layout(tmp_path / "model.safetensors", "hf-bert", prefix=prefix)
    assert_bit_identical(sd, convert.from_layout(bert.state_dict(), "hf-bert", prefix=prefix))
    x = rng.standard_normal((S.B, T, S.E))
    with torch.no_grad():
        att = bert.encoder.layer[0].attention
        expected = att.output.dense(att.self(torch.from_numpy(x))[0]).numpy()
    out, _ = run("jax", convert.to_jax(sd, S.N), x, x, x)
    assert compare(out, expected, tolerance_for("float64").forward).passed


def test_bfloat16_file_and_torch_tensors_keep_their_dtype(bert, tmp_path):
    m16 = transformers.BertModel(hf.hf_bert_config(S.E, S.N))
    m16.load_state_dict(bert.state_dict())
    m16 = m16.to(torch.bfloat16)
    m16.save_pretrained(tmp_path)
    prefix = "encoder.layer.0.attention."
    from_file = convert.read_layout(tmp_path / "model.safetensors", "hf-bert", prefix=prefix)
    from_torch = convert.from_layout(m16.state_dict(), "hf-bert", prefix=prefix)
    assert from_file["q_proj.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert_bit_identical(from_file, from_torch)
    assert convert.tensor_to_numpy(m16.encoder.layer[0].attention.self.key.bias).tobytes() == from_file["k_proj.bias"].tobytes()


# ------------------------------------------------------------- ViT: two spellings


def test_vit_reads_both_spellings_and_writes_the_file_one(vit, tmp_path, rng):
    in_memory = convert.from_layout(vit.state_dict(), "hf-vit", prefix="layers.0.attention.")
    vit.save_pretrained(tmp_path)
    from_file = convert.read_layout(tmp_path / "model.safetensors", "hf-vit", prefix="encoder.layer.0.attention.")
    assert_bit_identical(in_memory, from_file)
    written = convert.to_layout(in_memory, "hf-vit", prefix="encoder.layer.0.attention.")
    assert sorted(written) == sorted(f"encoder.layer.0.attention.{n}.{w}" for n in ("attention.query", "attention.key", "attention.value", "output.dense") for w in ("weight", "bias"))
    fresh = transformers.models.vit.modeling_vit.ViTAttention(vit.config)  # back into the real module, bit for bit
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in convert.to_layout(in_memory, "hf-vit", spelling=1).items()}, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, vit.layers[0].attention.state_dict()[k]), k
    # ViT's eager attention computes its softmax in float32 whatever the input dtype: compare in float32.
    x = rng.standard_normal((S.B, T, S.E)).astype(np.float32)
    keep = np.broadcast_to(_padding(rng)[:, None, :], (S.B, T, T)).copy()
    with torch.no_grad():
        expected = vit.layers[0].attention(torch.from_numpy(x), attention_mask=torch.from_numpy(hf.additive_mask(keep, np.float32)))[0].numpy()
    for framework, out in _ours_both(in_memory, keep, x, "nan"):
        c = compare(out, expected, tolerance_for("float32").forward)
        assert c.passed, (framework, c)


# ------------------------------------------------------------- GPT-2: fused Conv1D, causal


def test_gpt2_attention_is_ours_with_a_causal_keep_mask(gpt2, rng):
    """GPT2Attention is causal only through the mask GPT2Model builds (create_causal_mask);
    our module reproduces it with keep = tril(T, T) & padding[:, None, :]. Left padding makes
    query 0 of batch 2 fully masked: GPT-2 then averages V over every key (our 'uniform')."""
    sd = convert.from_layout(gpt2.state_dict(), "hf-gpt2", prefix="h.0.attn.")
    x = rng.standard_normal((S.B, T, S.E))
    pad = _padding(rng)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        mask = create_causal_mask(config=gpt2.config, inputs_embeds=xt, attention_mask=torch.from_numpy(pad.astype(np.int64)),
                                  past_key_values=None, position_ids=torch.arange(T)[None].expand(S.B, T))
        expected = gpt2.h[0].attn(xt, attention_mask=mask)[0].numpy()
    keep = hf.gpt2_keep_mask(pad)
    assert not keep[2, 0].any()  # the fully masked row is really there
    for framework, out in _ours_both(sd, keep, x, "uniform"):
        c = compare(out, expected, tolerance_for("float64").forward)
        assert c.passed, (framework, c)
    np.testing.assert_array_equal(hf.gpt2_padding_of(keep), pad)


def test_gpt2_conv1d_columns_are_q_k_v(gpt2):
    """c_attn.weight is (in, out) = (E, 3E): columns [0, E) are q, so q_proj.weight (out, in) is its transpose."""
    sd = convert.from_layout(gpt2.state_dict(), "hf-gpt2", prefix="h.0.attn.")
    w = gpt2.state_dict()["h.0.attn.c_attn.weight"].numpy()
    E = S.E
    np.testing.assert_array_equal(sd["k_proj.weight"], w[:, E : 2 * E].T)
    np.testing.assert_array_equal(sd["out_proj.weight"], gpt2.state_dict()["h.0.attn.c_proj.weight"].numpy().T)
    fresh = transformers.GPT2Model(hf.hf_gpt2_config(S.E, S.N)).double()
    fresh.h[0].attn.load_state_dict({k: torch.from_numpy(v) for k, v in convert.to_layout(sd, "hf-gpt2").items()}, strict=True)
    for k, v in fresh.h[0].attn.state_dict().items():
        assert torch.equal(v, gpt2.h[0].attn.state_dict()[k]), k


def test_gpt2_through_a_save_pretrained_file(gpt2, tmp_path):
    gpt2.save_pretrained(tmp_path)
    sd = convert.read_layout(tmp_path / "model.safetensors", "hf-gpt2", prefix="h.0.attn.")
    assert_bit_identical(sd, convert.from_layout(gpt2.state_dict(), "hf-gpt2", prefix="h.0.attn."))


def test_read_layout_reads_only_the_block(gpt2, tmp_path, monkeypatch):
    """Lazily: of the whole checkpoint, only the four tensors of h.0.attn are read."""
    import safetensors

    gpt2.save_pretrained(tmp_path)
    read, real_open = [], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    convert.read_layout(tmp_path / "model.safetensors", "hf-gpt2", prefix="h.0.attn.")
    assert sorted(read) == [f"h.0.attn.{n}" for n in ("c_attn.bias", "c_attn.weight", "c_proj.bias", "c_proj.weight")]
    with real_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert len(list(f.keys())) > 10  # ... of a file that holds much more


def test_a_transposed_c_attn_fails_loudly_in_the_converter(gpt2):
    tensors = dict(gpt2.state_dict())
    tensors["h.0.attn.c_attn.weight"] = tensors["h.0.attn.c_attn.weight"].T  # (3E, E): nn.Linear's orientation
    with pytest.raises(ValueError, match=r"'hf-gpt2': h.0.attn.c_attn.weight has shape \(36, 12\), expected \(12, 36\) = \(E, 3E\) stored \(in, out\) as a Conv1D \(E=12\) -- .* transposed\?"):
        convert.from_layout(tensors, "hf-gpt2", prefix="h.0.attn.")


# ------------------------------------------------------------- the tables themselves


@pytest.mark.parametrize("layout", ("hf-bert", "hf-vit", "hf-gpt2", "hf-llama"))  # fused ones: test_layouts_fused
@pytest.mark.parametrize("dtype", DTYPES)
def test_to_layout_from_layout_is_bit_identical(layout, dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    tensors = convert.to_layout(sd, layout, prefix="blk.")
    assert all(isinstance(v, np.ndarray) and v.dtype == np_dtype(dtype) for v in tensors.values())
    assert_bit_identical(convert.from_layout(tensors, layout, prefix="blk."), sd)


@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_from_layout_takes_torch_and_jax_arrays(kind, sd64):
    sd = cast_sd(sd64, np.float32)
    tensors = convert.to_layout(sd, "hf-gpt2")
    wrap = (lambda a: torch.from_numpy(a)) if kind == "torch" else jnp.asarray
    assert_bit_identical(convert.from_layout({k: wrap(v) for k, v in tensors.items()}, "hf-gpt2"), sd)


def test_every_key_under_the_prefix_is_accounted_for_and_missing_ones_named(sd64):
    """BERT's residual LayerNorm sits under the attention prefix: named as no part of attention, not read.
    A key the layout does not know under the prefix is refused, named; keys outside the prefix are not looked at."""
    prefix = "bert.encoder.layer.3.attention."
    tensors = convert.to_layout(sd64, "hf-bert", prefix=prefix)
    tensors[f"{prefix}output.LayerNorm.weight"] = np.ones(12)
    tensors["bert.encoder.layer.2.attention.self.query.weight"] = np.ones((5, 5))
    assert_bit_identical(convert.from_layout(tensors, "hf-bert", prefix=prefix), sd64)
    account = convert.account(tensors, "hf-bert", prefix)
    assert account.unread == {} and account.buffers == () and len(account.read) == 8
    assert list(account.not_attention) == [f"{prefix}output.LayerNorm.weight"]
    assert "LayerNorm" in account.not_attention[f"{prefix}output.LayerNorm.weight"]
    unknown = dict(tensors, **{f"{prefix}self.distance_embedding.weight": np.ones((9, 4))})
    with pytest.raises(ValueError, match=re.escape(f"layout 'hf-bert' does not read 1 tensor under prefix {prefix!r}: "
                                                   f"'{prefix}self.distance_embedding.weight' (relative position embeddings")):
        convert.from_layout(unknown, "hf-bert", prefix=prefix)
    del tensors[f"{prefix}self.value.bias"]
    with pytest.raises(KeyError, match=r"layout 'hf-bert': missing 'bert.encoder.layer.3.attention.self.value.bias', expected shape \(E,\)"):
        convert.from_layout(tensors, "hf-bert", prefix=prefix)
    with pytest.raises(KeyError, match=r"missing 'x.attention.query.weight'.* alternative spelling"):
        convert.from_layout(tensors, "hf-vit", prefix="x.")


@pytest.mark.parametrize("key, feature", [
    ("q_norm.weight", "QK-norm"), ("k_layernorm.weight", "QK-norm"), ("sinks", "attention sinks"),
    ("qkv_proj.weight", "fused projections"), ("query_key_value.bias", "fused projections"),
    ("c_attn.weight", "fused projections"), ("dense.weight", "an output projection"),
    ("kv_a_proj_with_mqa.weight", "low-rank (MLA)"), ("lambda_q1", "unknown"),
])
def test_a_tensor_left_over_is_named_with_the_feature_it_implies(key, feature, sd64):
    tensors = dict(convert.to_layout(sd64, "hf-llama", prefix="blk."), **{f"blk.{key}": np.ones(4)})
    with pytest.raises(ValueError, match=re.escape(f"'blk.{key}' ({feature}")) as info:
        convert.from_layout(tensors, "hf-llama", prefix="blk.")
    assert "would judge another attention than the checkpoint's" in str(info.value)


def test_a_fused_block_names_its_fused_tensor_beside_the_missing_key(sd64):
    """Phi-3's block: qkv_proj in place of q/k/v_proj. The missing key, then what stands in its place."""
    tensors = convert.to_layout(sd64, "hf-llama", prefix="blk.")
    fused = {"blk.qkv_proj.weight": np.concatenate([tensors.pop(f"blk.{p}_proj.weight") for p in "qkv"]),
             "blk.o_proj.weight": tensors["blk.o_proj.weight"]}
    with pytest.raises(KeyError, match=r"missing 'blk.q_proj.weight'.*what is there, unread: 'blk.qkv_proj.weight' "
                                       r"\(fused projections"):
        convert.from_layout(fused, "hf-llama", prefix="blk.")


def test_gpt2_s_causal_mask_buffer_is_read_and_checked(sd64, tmp_path):
    """Old GPT-2 checkpoints hold attn.bias (the causal mask, bool or uint8) and attn.masked_bias (its fill):
    read and checked; a mask that is not lower-triangular is refused, naming it."""
    from safetensors.numpy import save_file

    tensors = convert.to_layout(sd64, "hf-gpt2", prefix="h.0.attn.")
    causal = np.tril(np.ones((6, 6), bool))[None, None]
    path = tmp_path / "gpt2.safetensors"
    for mask in (causal, causal.astype(np.uint8)):
        save_file(dict(tensors, **{"h.0.attn.bias": mask, "h.0.attn.masked_bias": np.array(-1e4, np.float32)}), str(path))
        assert_bit_identical(convert.read_layout(path, "hf-gpt2", prefix="h.0.attn."), sd64)
    save_file(dict(tensors, **{"h.0.attn.bias": np.ones((1, 1, 6, 6), bool)}), str(path))
    with pytest.raises(ValueError, match=r"h.0.attn.bias bool\[1, 1, 6, 6\] is not GPT-2's causal mask"):
        convert.read_layout(path, "hf-gpt2", prefix="h.0.attn.")
    with pytest.raises(ValueError, match=r"masked_bias = \[0.0\] is not a masked-score fill"):
        convert.from_layout(dict(tensors, **{"h.0.attn.masked_bias": np.array(0.0)}), "hf-gpt2", prefix="h.0.attn.")


def test_a_rope_buffer_needs_the_layer_to_be_checked_against(sd64):
    """rotary_emb.inv_freq says the RoPE: read only with num_heads and rope_theta, and checked."""
    tensors = convert.to_layout(sd64, "hf-llama", prefix="blk.")
    H = 12 // 3
    inv_freq = 1.0 / 500.0 ** (np.arange(0, H, 2) / H)
    tensors["blk.rotary_emb.inv_freq"] = inv_freq.astype(np.float16)
    with pytest.raises(ValueError, match="holds RoPE's inverse frequencies: give num_heads= and rope_theta="):
        convert.from_layout(tensors, "hf-llama", prefix="blk.")
    assert_bit_identical(convert.from_layout(tensors, "hf-llama", prefix="blk.", num_heads=3, rope_theta=500.0), sd64)
    with pytest.raises(ValueError, match=r"is not the default RoPE's 1 / rope_theta\^\(2i/H\) for rope_theta=10000 and H=4"):
        convert.from_layout(tensors, "hf-llama", prefix="blk.", num_heads=3, rope_theta=10000.0)


def test_two_vit_spellings_under_one_prefix_are_an_error(sd64):
    both = {**convert.to_layout(sd64, "hf-vit", prefix="a."), **convert.to_layout(sd64, "hf-vit", prefix="a.", spelling=1)}
    with pytest.raises(ValueError, match="holds several spellings at once"):
        convert.from_layout(both, "hf-vit", prefix="a.")
    assert_bit_identical(convert.from_layout(convert.to_layout(sd64, "hf-vit", spelling=1), "hf-vit"), sd64)


def test_wrong_shapes_and_unknown_layouts_are_named(sd64):
    tensors = convert.to_layout(sd64, "hf-bert")
    tensors["self.key.weight"] = tensors["self.key.weight"][:, :8]
    with pytest.raises(ValueError, match=r"layout 'hf-bert': self.key.weight has shape \(12, 8\), expected \(12, 12\) = \(E, E\) \(E=12\)"):
        convert.from_layout(tensors, "hf-bert")
    with pytest.raises(ValueError, match=r"unknown layout 'hf-t5'; expected one of \['hf-bert', 'hf-vit', 'hf-gpt2', 'hf-llama', 'hf-phi3', 'hf-gpt-neox', 'hf-falcon'\]"):
        convert.from_layout(tensors, "hf-t5")
    with pytest.raises(TypeError, match="self.query.weight is a list"):
        convert.from_layout(dict(convert.to_layout(sd64, "hf-bert"), **{"self.query.weight": [[0.0]]}), "hf-bert")


def test_read_layout_names_the_file_in_its_layout_errors(sd64, tmp_path):
    """A missing key, a wrong shape, mixed dtypes: the error starts with the file it is about."""
    from safetensors.numpy import save_file

    tensors = convert.to_layout(sd64, "hf-gpt2", prefix="h.0.attn.")
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "h.0.attn.c_proj.bias"}, str(path))
    with pytest.raises(KeyError, match=re.escape(f"{path}: layout 'hf-gpt2': missing 'h.0.attn.c_proj.bias'")):
        convert.read_layout(path, "hf-gpt2", prefix="h.0.attn.")
    save_file(dict(tensors, **{"h.0.attn.c_attn.weight": np.ascontiguousarray(tensors["h.0.attn.c_attn.weight"].T)}), str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}: layout 'hf-gpt2': h.0.attn.c_attn.weight has shape (36, 12), expected (12, 36)")):
        convert.read_layout(path, "hf-gpt2", prefix="h.0.attn.")
    save_file(dict(tensors, **{"h.0.attn.c_proj.bias": tensors["h.0.attn.c_proj.bias"].astype(np.float32)}), str(path))
    with pytest.raises(TypeError, match=re.escape(f"{path}: layout 'hf-gpt2' under prefix 'h.0.attn.': state dict mixes dtypes")):
        convert.read_layout(path, "hf-gpt2", prefix="h.0.attn.")
