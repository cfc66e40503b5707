"""Real transformers Llama and Qwen2 attention blocks through the "hf-llama" layout and config.json.

Tiny configs (E=24, N=6 query heads, K=2 key/value heads, H=4), random weights and biases,
float64, eager attention, rope_theta 500, self-attention (T = S = 5) at non-default
positions with a causal + padding mask. HF's cos/sin come from its own rotary class.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import transformers
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

from mha_spec import AttentionConfig, RopeScaling
from parity import convert, layouts, reference
from parity.peers import hf
from parity.tolerances import compare, tolerance_for

B, T, E, N, K, H = 3, 5, 24, 6, 2, 4
THETA = 500.0
PREFIX = "model.layers.1.self_attn."

# HF's own precision on a float64 model. LlamaRotaryEmbedding computes cos/sin in float32 (then
# casts them to float64) and eager attention takes its softmax in float32 (softmax(dtype=float32),
# cast back): a float64 LlamaAttention is float32-accurate. Measured against the float64 oracle
# on these inputs (outputs up to |8|): max abs error 2.7e-7 (Llama) and 3.7e-7 (biased Llama,
# Qwen2). The bar is float32's forward entry, |error| <= 1e-6 + 1e-5 |expected|: >= 2.7x margin.
# Its eager mask adds finfo(float64).min, which is -inf once the softmax casts to float32, so
# the row that keeps no key is NaN, like our "nan" policy.
HF_PRECISION = tolerance_for("float32").forward
F64 = tolerance_for("float64").forward


def _random(module):
    """HF initialises biases to zero; random ones make a dropped or misplaced bias visible."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) - 0.5)
    return module.eval()


def _hf_config(kind: str):
    common = dict(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, num_hidden_layers=2, intermediate_size=8,
                  vocab_size=16, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                  attn_implementation="eager")
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(attention_bias=kind == "llama-bias", **common)


BLOCKS = {  # kind -> (attention class, rotary class, (qkv_bias, out_bias))
    "llama": (LlamaAttention, LlamaRotaryEmbedding, (False, False)),
    "llama-bias": (LlamaAttention, LlamaRotaryEmbedding, (True, True)),
    "qwen2": (Qwen2Attention, Qwen2RotaryEmbedding, (True, False)),
}


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(18)
    x = rng.standard_normal((B, T, E))
    positions = np.arange(T)[None] + np.array([[0], [3], [11]])  # (B, T): continuing sequences
    pad = np.ones((B, T), bool)  # HF's attention_mask, 1 = real token
    pad[1, -2:] = False  # right-padded
    pad[2, :1] = False  # left-padded: query 0 of batch 2 keeps no key
    return x, positions, pad


def _hf_block(kind, inputs):
    """(block state dict in HF names, HF's output, our keep-mask) for one real attention block."""
    attention, rotary, _ = BLOCKS[kind]
    config = _hf_config(kind)
    att = _random(attention(config, layer_idx=1).double())
    x, positions, pad = inputs
    xt = torch.from_numpy(x)
    with torch.no_grad():
        mask = create_causal_mask(config=config, inputs_embeds=xt, attention_mask=torch.from_numpy(pad.astype(np.int64)),
                                  past_key_values=None, position_ids=torch.arange(T)[None].expand(B, T))
        emb = rotary(config)(xt, torch.from_numpy(positions))
        out = att(xt, position_embeddings=emb, attention_mask=mask)[0].numpy()
    keep = np.tril(np.ones((T, T), bool))[None] & pad[:, None, :]
    np.testing.assert_array_equal(hf.additive_mask(keep, np.float64), mask.numpy())  # the same mask
    assert not keep[2, 0].any()
    return {PREFIX + k: v for k, v in att.state_dict().items()}, out, keep


def _ours(framework, m, x, keep, positions, need_weights=True):
    """Our module's output on self-attention x with query and key positions `positions`."""
    if framework == "torch":
        t, pos = torch.from_numpy(x), torch.from_numpy(positions)
        with torch.no_grad():
            return m(t, t, t, torch.from_numpy(keep), need_weights, positions=pos, key_positions=pos)[0].numpy()
    return np.asarray(m(x, x, x, keep, need_weights, positions=positions, key_positions=positions)[0])


@pytest.mark.parametrize("kind", BLOCKS)
def test_hf_block_through_the_layout_matches_ours_and_the_oracle(kind, inputs):
    tensors, hf_out, keep = _hf_block(kind, inputs)
    x, positions, _ = inputs
    sd = convert.from_layout(tensors, "hf-llama", prefix=PREFIX, num_heads=N)
    qkv_bias, out_bias = BLOCKS[kind][2]
    assert set(sd) == set(AttentionConfig(E, N, num_kv_heads=K, qkv_bias=qkv_bias, out_bias=out_bias).weight_shapes())
    layer = dict(num_kv_heads=K, rope="half", rope_theta=THETA)
    oracle = reference.forward(sd, x, x, x, keep, num_heads=N, positions=positions, key_positions=positions, **layer).output
    assert np.isnan(oracle[2, 0]).all() and not np.isnan(oracle[:, 1:]).any()  # "nan": the row that keeps no key
    # HF, float64 in name, float32 in precision (see HF_PRECISION); its NaN row is where ours is.
    c = compare(hf_out, oracle, HF_PRECISION)
    assert c.passed, c
    for framework in ("torch", "jax"):
        m = (convert.to_torch if framework == "torch" else convert.to_jax)(sd, N, masked_rows="nan", **layer)
        for need_weights in (True, False):
            out = _ours(framework, m, x, keep, positions, need_weights)
            c = compare(out, oracle, F64)
            assert c.passed, (framework, need_weights, c)
            c = compare(out, hf_out, HF_PRECISION)
            assert c.passed, (framework, need_weights, c)
    # The convention mix-up on the same weights is caught by far more than HF's precision.
    wrong = reference.forward(sd, x, x, x, keep, num_heads=N, positions=positions, key_positions=positions,
                              **dict(layer, rope="interleaved")).output
    assert np.nanmax(np.abs(wrong - hf_out)) > 1e3 * HF_PRECISION.atol


def test_meta_interleaved_weights_match_hf_rotate_half(inputs):
    """Meta's original Llama rows, run with rope="interleaved", give HF's rotate-half output."""
    tensors, hf_out, keep = _hf_block("qwen2", inputs)
    x, positions, _ = inputs
    hf_sd = convert.from_layout(tensors, "hf-llama", prefix=PREFIX)
    meta = convert.permute_rope(hf_sd, num_heads=N, num_kv_heads=K, to="interleaved")
    assert not np.array_equal(meta["q_proj.weight"], hf_sd["q_proj.weight"])
    out = _ours("torch", convert.to_torch(meta, N, num_kv_heads=K, rope="interleaved", rope_theta=THETA), x, keep,
                positions)
    c = compare(out, hf_out, HF_PRECISION)
    assert c.passed, c
    half = reference.forward(hf_sd, x, x, x, keep, num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA,
                             positions=positions, key_positions=positions).output
    c = compare(out, half, F64)
    assert c.passed, c


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny LlamaForCausalLM (2 layers) written by save_pretrained, once whole and once in shards."""
    model = _random(transformers.LlamaForCausalLM(_hf_config("llama")).double())
    whole, sharded = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="10KB")
    assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
    return model, whole, sharded


def test_a_save_pretrained_directory_gives_the_config_and_the_weights(saved_llama):
    model, whole, sharded = saved_llama
    expected = convert.from_layout(model.state_dict(), "hf-llama", prefix=PREFIX)
    assert not np.array_equal(expected["q_proj.weight"],
                              convert.from_layout(model.state_dict(), "hf-llama", prefix="model.layers.0.self_attn.")["q_proj.weight"])
    for directory in (whole, sharded):
        sd, config = layouts.read_checkpoint(directory, "hf-llama", prefix=PREFIX)
        assert config == AttentionConfig(E, N, num_kv_heads=K, qkv_bias=False, out_bias=False, rope="half", rope_theta=THETA)
        assert sorted(sd) == sorted(expected)
        for name in sd:
            assert sd[name].dtype == np.float64 and sd[name].tobytes() == expected[name].tobytes(), (directory, name)
    with pytest.raises(IsADirectoryError, match="transformers checkpoint directory .* read whole by parity.convert.read_checkpoint"):
        convert.read_layout(whole, "hf-llama", prefix=PREFIX)
    # A single file does not say the heads: the caller's config, checked against the weights.
    single = whole / "model.safetensors"
    with pytest.raises(TypeError, match="single weight file.*pass config="):
        layouts.read_checkpoint(single, prefix=PREFIX)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 24\), expected \(24, 24\)"):
        layouts.read_checkpoint(single, prefix=PREFIX, config=AttentionConfig(E, N, qkv_bias=False, out_bias=False))


def _config_json(**changes):
    cfg = {"model_type": "llama", "hidden_size": E, "num_attention_heads": N, "num_key_value_heads": K, "head_dim": H,
           "attention_bias": False, "rope_parameters": {"rope_theta": THETA, "rope_type": "default"}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("cfg, expected", [
    (_config_json(), AttentionConfig(E, N, num_kv_heads=K, qkv_bias=False, out_bias=False, rope="half", rope_theta=THETA)),
    # transformers 4.x spelling: top-level rope_theta, rope_scaling null; no num_key_value_heads = N; no head_dim
    (_config_json(rope_parameters=None, rope_theta=THETA, rope_scaling=None, num_key_value_heads=None, head_dim=None),
     AttentionConfig(E, N, qkv_bias=False, out_bias=False, rope="half", rope_theta=THETA)),
    (_config_json(model_type="qwen2", attention_bias=None),
     AttentionConfig(E, N, num_kv_heads=K, qkv_bias=True, out_bias=False, rope="half", rope_theta=THETA)),
    (_config_json(model_type="mistral", attention_bias=None, sliding_window=None, rope_parameters=None),
     AttentionConfig(E, N, num_kv_heads=K, qkv_bias=False, out_bias=False, rope="half")),
    (_config_json(attention_bias=True, num_key_value_heads=1),
     AttentionConfig(E, N, num_kv_heads=1, rope="half", rope_theta=THETA)),
    # transformers reads a set rope_scaling (4.x's type spelling) whole, instead of rope_parameters' llama3
    (_config_json(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64, "rope_theta": THETA},
                  rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": THETA}),
     AttentionConfig(E, N, num_kv_heads=K, qkv_bias=False, out_bias=False, rope="half", rope_theta=THETA,
                     rope_scaling=RopeScaling("linear", factor=2.0))),
])
def test_config_json_fields_are_read(cfg, expected):
    assert layouts.read_hf_config(cfg) == expected


@pytest.mark.parametrize("changes, error, message", [
    ({"head_dim": 8}, ValueError, r"head_dim = 8 but hidden_size / num_attention_heads = 24 / 6"),
    # llama3, linear and yarn are read (field by field: test_checkpoint_rope.py); one missing a key it needs is not
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0}}, ValueError,
     r"rope_scaling 'llama3' needs low_freq_factor, high_freq_factor"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0, "original_max_position_embeddings": 64}},
     ValueError, r"rope_scaling 'linear' does not read original_max_position_embeddings: it would be ignored"),
    ({"partial_rotary_factor": 0.5}, NotImplementedError, r"partial_rotary_factor=0.5"),
    ({"model_type": "mistral", "sliding_window": 4096}, NotImplementedError,
     r"sliding_window = 4096 turns on sliding-window attention"),
    ({"model_type": "gemma"}, ValueError, r"model_type 'gemma' is not one of \['falcon', 'gemma2', 'gemma3', 'gemma3_text', "
     r"'gpt_neox', 'gpt_oss', 'llama', 'llama4', 'llama4_text', 'mistral', 'mixtral', 'olmo2', 'phi3', 'qwen2', "
     r"'qwen3', 'qwen3_moe'\]"),
    ({"num_key_value_heads": 4}, ValueError, r"num_kv_heads=4 must divide num_heads=6"),
    ({"attention_bias": "yes"}, ValueError, r"attention_bias = 'yes' is not a bool"),
    # transformers reads a set rope_scaling instead of rope_parameters: what the tool does not model there is refused
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0, "rope_theta": THETA}}, NotImplementedError,
     r"rope_scaling 'dynamic' is not supported: dynamic NTK scaling"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0, "rope_theta": THETA}}, NotImplementedError,
     r"rope_scaling 'proportional' is not supported"),
    # the default RoPE reads no scaling key: one set would be ignored
    ({"rope_parameters": {"rope_type": "default", "factor": 2.0, "rope_theta": THETA}}, ValueError,
     r"the RoPE parameters set \['factor'\] with rope_type 'default', which reads none of them"),
    # either spelling: transformers 5 reads rope_type first, older releases read type alone
    ({"rope_parameters": {"type": "dynamic", "factor": 2.0, "rope_theta": THETA}}, NotImplementedError,
     r"rope_scaling 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "type": "dynamic", "factor": 2.0, "rope_theta": THETA}}, ValueError,
     r"rope_type = 'default' but type = 'dynamic' in the RoPE parameters: transformers 5 reads the first, 4.x the "
     r"second; say one"),
    ({"rope_scaling": {"rope_theta": THETA, "partial_rotary_factor": 0.5}}, NotImplementedError,
     r"partial_rotary_factor=0.5: .*rotates the whole head"),
    ({"rope_scaling": {"full_attention": {"rope_type": "default"}}}, NotImplementedError,
     r"rope_scaling nested per layer type"),
    # a set rope_scaling without rope_theta: transformers takes 10000, not rope_parameters' THETA
    ({"rope_scaling": {"rope_type": "default"}}, ValueError,
     rf"rope_parameters.rope_theta = {THETA}, but rope_scaling is set too and transformers reads it instead "
     r"\(rope_theta 10000.0\)"),
])
def test_config_json_refusals_are_named(changes, error, message, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config_json(**changes)))
    with pytest.raises(error, match=f"{path}: .*{message}" if error is ValueError else message):
        layouts.read_hf_config(tmp_path)
    if "sliding_window" in changes:  # ... read on request, for lengths within the window
        assert layouts.read_hf_config(path, ignore_sliding_window=True).num_kv_heads == K


def _grouped_sd(rng, qkv_bias, out_bias, dtype=np.float32):
    shapes = AttentionConfig(E, N, num_kv_heads=K, qkv_bias=qkv_bias, out_bias=out_bias).weight_shapes()
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


@pytest.mark.parametrize("qkv_bias, out_bias", [(False, False), (True, False), (True, True)])
def test_the_hf_llama_table_round_trips_each_bias_set(qkv_bias, out_bias):
    sd = _grouped_sd(np.random.default_rng(1), qkv_bias, out_bias)
    tensors = layouts.to_layout(sd, "hf-llama", prefix=PREFIX, num_heads=N)
    names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}
    assert sorted(tensors) == sorted(PREFIX + names[k.split(".")[0]] + "." + k.split(".")[1] for k in sd)
    back = convert.from_layout(tensors, "hf-llama", prefix=PREFIX, num_heads=N)
    assert sorted(back) == sorted(sd) and all(back[k].tobytes() == sd[k].tobytes() for k in sd)


def test_the_hf_llama_table_names_what_it_cannot_hold():
    sd = _grouped_sd(np.random.default_rng(2), False, True)  # out_proj's bias alone: no HF model has it
    with pytest.raises(ValueError, match=r"layout 'hf-llama': the layout holds no biases or q/k/v biases only or all "
                                         r"four biases; this state dict has out_proj bias only"):
        layouts.to_layout(sd, "hf-llama")
    tensors = layouts.to_layout(_grouped_sd(np.random.default_rng(2), True, False), "hf-llama", prefix=PREFIX)
    # k/v rows K*H = 8 are two heads of H = 4 for N = 6; for N = 4 (H = 6) they are no whole number of heads.
    with pytest.raises(ValueError, match=re.escape(f"layout 'hf-llama': {PREFIX}k_proj.weight has shape (8, 24), "
                                                   "expected (K*H, E) = (K*6, 24) with K dividing num_heads=4")):
        convert.from_layout(tensors, "hf-llama", prefix=PREFIX, num_heads=4)
    bad = dict(tensors, **{PREFIX + "v_proj.weight": tensors[PREFIX + "v_proj.weight"][:4]})
    with pytest.raises(ValueError, match=re.escape(f"layout 'hf-llama': {PREFIX}v_proj.weight has shape (4, 24), "
                                                   f"expected (8, 24) = (KH, E) (E=24, K*H=8 from {PREFIX}k_proj.weight)")):
        convert.from_layout(bad, "hf-llama", prefix=PREFIX)
    del tensors[PREFIX + "v_proj.bias"]
    with pytest.raises(ValueError, match=r"missing keys \['v_proj.bias'\].*partial set"):
        convert.from_layout(tensors, "hf-llama", prefix=PREFIX)
    head_dim_8 = dict(tensors, **{PREFIX + "q_proj.weight": np.zeros((48, E), np.float32)})  # N*H != E (Gemma-like)
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(48, 24\), expected \(24, 24\).* head_dim other than E/N"):
        convert.from_layout(head_dim_8, "hf-llama", prefix=PREFIX)
