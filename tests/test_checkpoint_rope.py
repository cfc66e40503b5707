"""config.json's RoPE and per-layer attention, and the fused families, read from tiny save_pretrained checkpoints.

Llama 3.1's llama3 scaling, Phi-3's LongRoPE with partial RoPE (original context 8, so positions past it take
the long factors) and a Phi-3 with head_dim 8 != E/N, GPT-NeoX with rotary_pct 0.25 and biases, Falcon's new
decoder architecture (K=2 of N=6) and multi_query, Qwen2 with a sliding window on its layers from
max_window_layers on, GPT-OSS with its default YaRN. Each is read field by field into what its config says;
its RoPE frequencies and cos/sin factor are transformers' own rotary embedding's; the oracle on the layer read
equals the saved model's attention module (float64, every attention tensor redrawn); the CLI judges one.
What the tool does not model (dynamic NTK, ALiBi, a key rope_parameters' kind does not read) is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_spec import RopeScaling
from parity import layouts
from parity.cli import main
from parity.harness import checkpoint

LLAMA_P = "model.layers.0.self_attn."
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
LONG = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0], "partial_rotary_factor": 0.5}
SMALL = dict(vocab_size=16, intermediate_size=8, num_hidden_layers=1)
# name -> (config class, model class, config keywords, prefix, the AttentionConfig fields the config gives)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                    rope_parameters=LLAMA3), LLAMA_P,
               dict(embed_dim=12, num_heads=3, kv_heads=1, head_size=4, rope_theta=500000.0, rope_dim=None,
                    rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=16), qkv_bias=False, out_bias=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=32,
                  original_max_position_embeddings=8, rope_parameters=LONG, pad_token_id=0), LLAMA_P,
             # factor: max_position_embeddings / original_max_position_embeddings = 32 / 8 (transformers' rule)
             dict(embed_dim=24, num_heads=3, kv_heads=1, head_size=8, rope_theta=10000.0, rope_dim=4,
                  rope_scaling=RopeScaling("longrope", factor=4.0, original_max_position_embeddings=8,
                                           short_factor=(1.0, 1.5), long_factor=(2.0, 3.0)),
                  qkv_bias=False, out_bias=False)),
    "phi3-head-dim": ("Phi3Config", "Phi3ForCausalLM",
                      dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=1, head_dim=8, pad_token_id=0,
                           rope_parameters={"rope_type": "default", "rope_theta": 2500.0, "partial_rotary_factor": 0.5}),
                      LLAMA_P, dict(embed_dim=12, num_heads=3, kv_heads=1, head_size=8, rope_theta=2500.0, rope_dim=4,
                                    rope_scaling=None)),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(hidden_size=24, num_attention_heads=3, rotary_pct=0.25,
                                                         rotary_emb_base=300.0),
             "gpt_neox.layers.0.attention.",
             dict(embed_dim=24, num_heads=3, kv_heads=3, head_size=8, rope_theta=300.0, rope_dim=2, rope_scaling=None,
                  qkv_bias=True, out_bias=True)),
    "falcon-new": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=24, num_attention_heads=6, num_kv_heads=2,
                                                             new_decoder_architecture=True, bias=True),
                   "transformer.h.0.self_attention.",
                   dict(embed_dim=24, num_heads=6, kv_heads=2, head_size=4, rope_dim=None, rope_scaling=None,
                        qkv_bias=True, out_bias=True)),
    "falcon-mq": ("FalconConfig", "FalconForCausalLM", dict(hidden_size=12, num_attention_heads=3, multi_query=True),
                  "transformer.h.0.self_attention.",
                  dict(embed_dim=12, num_heads=3, kv_heads=1, head_size=4, qkv_bias=False, out_bias=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=12, num_attention_heads=3, num_key_value_heads=1, use_sliding_window=True,
                   sliding_window=3, max_window_layers=1, num_hidden_layers=2), "model.layers.1.self_attn.",
              dict(embed_dim=12, num_heads=3, kv_heads=1, qkv_bias=True, out_bias=False, rope_scaling=None)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",  # GptOssConfig's default rope_parameters: YaRN
                dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                     num_experts_per_tok=1, num_hidden_layers=2), "model.layers.1.self_attn.",
                dict(embed_dim=12, num_heads=4, kv_heads=2, head_size=8, rope_theta=150000.0, sinks=True,
                     rope_scaling=RopeScaling("yarn", factor=32.0, original_max_position_embeddings=4096,
                                              beta_fast=32.0, beta_slow=1.0, truncate=False))),
}


def _save(name, path):
    import torch
    import transformers

    cls_name, model_name, kwargs, _, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cls_name)(**{**SMALL, **kwargs}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every attention tensor redrawn (biases and sinks start at zero)
        for key, p in model.named_parameters():
            if any(s in key for s in ("self_attn", "attention.", "self_attention")):
                p.copy_((torch.rand(p.shape, generator=g) - 0.5) * 1.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {name: _save(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


def _layer(saved, name):
    return checkpoint.load_layer(saved[name], layouts.HF_MODELS[_model_type(saved[name])].layout, FAMILIES[name][3])


def _model_type(path):
    return layouts.read_config_json(path)[0]["model_type"]


@pytest.mark.parametrize("name", FAMILIES)
def test_config_json_gives_the_layer_field_by_field(name, saved):
    c = _layer(saved, name).config
    for field, value in FAMILIES[name][4].items():
        assert getattr(c, field) == value, field
    assert c.rope == "half"


def _hf(directory):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")


def _parts(model, name):
    """(attention module of the layer read, the model's rotary embedding)."""
    if name == "neox":
        return model.gpt_neox.layers[0].attention, model.gpt_neox.rotary_emb
    if name.startswith("falcon"):
        return model.transformer.h[0].self_attention, model.transformer.rotary_emb
    layer = int(FAMILIES[name][3].split(".")[2])
    return model.model.layers[layer].self_attn, model.model.rotary_emb


@pytest.mark.parametrize("name", FAMILIES)
def test_the_rope_read_is_transformers_rotary_embedding(name, saved):
    """inv_freq (float32 in transformers: its rounding, ~6e-8 relative, bounds the gap) and the cos/sin factor."""
    c = _layer(saved, name).config
    _, rotary = _parts(_hf(saved[name]), name)
    theirs = rotary.inv_freq.double().numpy()
    assert theirs.shape == (c.rotary_dim // 2,)
    np.testing.assert_allclose(np.array(c.rope_frequencies()), theirs, rtol=2e-7, atol=0)
    assert c.rope_scale == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_oracle_on_the_layer_read_is_the_saved_model_s_attention(name, saved):
    """The weights split and the config read compute what the model's own module computes, positions 0..4 and
    7..11: past Phi-3's original 8, so its long factors; then layer 1 of Qwen2 in its window of 3 keys."""
    import torch

    from parity import reference
    from parity.peers import hf

    layer = _layer(saved, name)
    c, T = layer.config, 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, T, c.embed_dim))
    positions = np.arange(T)[None] + np.array([[0], [7]])
    keep = np.tril(np.ones((T, T), bool))[None].repeat(2, 0)
    if layer.sliding_window is not None and layer.sliding_window < T:
        keep &= ~np.tril(np.ones((T, T), bool), -layer.sliding_window)[None]
    att, rotary = _parts(_hf(saved[name]), name)
    xt = torch.from_numpy(x)
    cos, sin = rotary(xt, torch.from_numpy(positions))
    mask = torch.from_numpy(hf.additive_mask(keep, np.float64))
    with torch.no_grad():
        args = (xt, None, mask) if name.startswith("falcon") else (xt,)
        kw = {} if name.startswith("falcon") else {"attention_mask": mask}
        expected = att(*args, position_embeddings=(cos.double(), sin.double()), **kw)[0].numpy()
    got = reference.forward(layer.state_dict, x, x, x, keep, positions=positions, key_positions=positions,
                            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta,
                            rope_dim=c.rope_dim, rope_scaling=c.rope_scaling).output
    # transformers' cos/sin are float32 even for a float64 model: measured 2.3e-7 at most on outputs up to ~4
    # (Llama 3.1's), so the bar is 1e-5 of the largest output; a RoPE read otherwise is off by 1e-2 and more
    assert np.max(np.abs(got - expected)) <= 1e-5 * np.max(np.abs(expected)), name


def test_qwen2_s_layers_slide_from_max_window_layers_on(saved):
    cfg, where = layouts.read_config_json(saved["qwen2"])
    assert [checkpoint.sliding_window(cfg, where, layer) for layer in (0, 1)] == [None, 3]
    assert checkpoint.load_layer(saved["qwen2"], prefix="model.layers.0.self_attn.").sliding_window is None
    with pytest.raises(NotImplementedError, match=r"layer_types\[1\] = 'sliding_attention'"):
        layouts.read_hf_config(saved["qwen2"], layer=1)
    off = {**cfg, "use_sliding_window": False}  # Qwen2Config: no window at all then, whatever layer_types says
    assert checkpoint.sliding_window(off, where, 1) is None and layouts.read_hf_config(off, layer=1).rope == "half"


BASE = dict(model_type="llama", hidden_size=12, num_attention_heads=3, max_position_embeddings=64)


@pytest.mark.parametrize("change, error, said", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), NotImplementedError, "'dynamic' is not supported"),
    (dict(rope_scaling={"type": "proportional", "factor": 2.0}), NotImplementedError, "proportional"),
    (dict(rope_parameters={"rope_type": "default", "factor": 2.0}), ValueError, r"set \['factor'\] with rope_type 'default'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}), ValueError, "mrope_section"),
    (dict(rope_parameters={"rope_type": "linear", "type": "yarn", "factor": 2.0}), ValueError, "say one"),
    (dict(model_type="falcon", alibi=True), NotImplementedError, "alibi = True: ALiBi"),
    (dict(model_type="falcon", multi_query=False, num_kv_heads=1), ValueError, "Falcon's classic attention"),
])
def test_what_is_not_modelled_is_refused_by_name(change, error, said):
    with pytest.raises(error, match=said):
        layouts.read_hf_config({**BASE, **change})


def test_legacy_spellings_read_as_transformers_reads_them():
    linear = layouts.read_hf_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 50.0})
    assert (linear.rope_scaling, linear.rope_theta) == (RopeScaling("linear", factor=2.0), 50.0)
    neox = layouts.read_hf_config({**BASE, "model_type": "gpt_neox", "hidden_size": 24})  # rotary_pct's default
    assert (neox.rope_dim, neox.qkv_bias, neox.out_bias) == (2, True, True)
    su = layouts.read_hf_config({**BASE, "model_type": "phi3", "original_max_position_embeddings": 16,
                                 "rope_scaling": {"type": "su", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}})
    assert su.rope_scaling == RopeScaling("longrope", factor=4.0, original_max_position_embeddings=16,
                                          short_factor=(1.0, 1.0), long_factor=(2.0, 2.0))


@pytest.mark.parametrize("name, layout", [("phi3", "hf-phi3"), ("neox", "hf-gpt-neox")])
def test_mha_parity_judges_a_fused_checkpoint(name, layout, saved, capsys):
    """Without --layout: config.json's model_type gives it."""
    assert main(["--checkpoint", str(saved[name]), "--prefix", FAMILIES[name][3], "--no-progress",
                 "--impls", "torch", "--checks", "forward", "--dtypes", "float32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"(layout {layout}," in out and "rope_dim=" in out and " pass" in out and " 0 fail" in out


def test_checkpoint_cases_start_past_the_original_context(saved):
    """A scaled RoPE's cases run at positions past original_max_position_embeddings (the scaling shows there)."""
    from parity.harness.matrix import draw_inputs

    for name in ("llama3", "phi3", "gpt_oss"):
        config = _layer(saved, name).config
        original = config.rope_scaling.original_max_position_embeddings
        for case in checkpoint.cases(config, 2, 5, 5):
            x = draw_inputs(case, 0)
            assert x.positions.min() >= original and x.key_positions.min() >= original, (name, case.name)
    neox = checkpoint.cases(_layer(saved, "neox").config, 2, 5, 5)
    assert all(case.positions_from is None for case in neox)  # unscaled: positions as the matrix draws them


@pytest.mark.parametrize("name, bug, stage", [("llama3", "llama3_every_frequency", "q_rot"),
                                              ("phi3", "longrope_wrong_length", "q_rot"),
                                              ("neox", "neox_split_qkv", "q")])
def test_a_port_s_rope_slip_is_red_on_the_checkpoint(name, bug, stage, saved, capsys):
    """The checkpoint's cases reach what each slip gets wrong: the port with it is red, named at its stage."""
    code = main(["--checkpoint", str(saved[name]), "--prefix", FAMILIES[name][3], "--no-progress", "--checks",
                 "forward", "--dtypes", "float32", "--impls", "torch", "--impl", f"parity.examples.rope_torch:{bug}"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1 and f"rope-torch-{bug.replace('_', '-')}" in out and f"(first diverging stage: {stage})" in out, out[-1500:]


def test_a_deepseek_config_is_refused_naming_latent_attention():
    """read_hf_config (the Llama-style reader) refuses a DeepSeek config by what it is; parity.latent reads it."""
    for model_type in ("deepseek_v2", "deepseek_v3"):
        with pytest.raises(ValueError, match="multi-head latent attention"):
            layouts.read_hf_config({"model_type": model_type, "hidden_size": 12, "num_attention_heads": 3,
                                    "kv_lora_rank": 6, "q_lora_rank": 7})
