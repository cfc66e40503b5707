"""`--checkpoint`'s layer: config.json is opened once per load, and the layer describes itself from its fields.

A tiny MistralForCausalLM (sliding_window=3) written by save_pretrained: loading its directory, or its
model.safetensors with the config.json beside it, opens that config.json exactly once (the window and the
layer come from the one parse). `CheckpointLayer.describe` says what it holds, whatever its path spells.
"""

from __future__ import annotations

import builtins
import os

import numpy as np
import pytest

from mha_spec import AttentionConfig
from parity.harness.checkpoint import CheckpointLayer, load_layer

PREFIX = "model.layers.0.self_attn."


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
                                        num_hidden_layers=1, intermediate_size=16, vocab_size=11, rope_theta=500.0,
                                        max_position_embeddings=64, sliding_window=3)
    path = tmp_path_factory.mktemp("mistral")
    transformers.MistralForCausalLM(config).save_pretrained(path)
    return path


def _config_opens(monkeypatch) -> list:
    """The config.json paths builtins.open is asked for from now on."""
    opened, real = [], builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and os.path.basename(os.fsdecode(file)) == "config.json":
            opened.append(os.fsdecode(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    return opened


def test_a_checkpoint_directory_opens_its_config_json_once(mistral_dir, monkeypatch):
    opened = _config_opens(monkeypatch)
    layer = load_layer(mistral_dir, "hf-llama", PREFIX)
    assert len(opened) == 1, opened
    # the one read gives both the window and the layer
    assert layer.sliding_window == 3 and (layer.config.num_heads, layer.config.kv_heads) == (6, 2)
    assert layer.config_json == os.path.join(str(mistral_dir), "config.json")


def test_a_weight_file_opens_the_config_json_beside_it_once(mistral_dir, monkeypatch):
    opened = _config_opens(monkeypatch)
    layer = load_layer(mistral_dir / "model.safetensors", "hf-llama", PREFIX, num_heads=6, rope_theta=500.0)
    assert len(opened) == 1, opened
    assert layer.sliding_window == 3 and layer.config.kv_heads == 2


def _layer(config_json, sliding_window=None, other_tensors=()):
    sd = {"q_proj.weight": np.zeros((12, 12), np.float32)}
    config = AttentionConfig(12, 3, qkv_bias=False, out_bias=False, rope="half", rope_theta=500.0)
    return CheckpointLayer("ckpt", "hf-llama", "p.", sd, config, sliding_window, other_tensors, config_json)


def test_the_layer_describes_itself_from_its_fields():
    # A config.json under a directory spelt "none..." is still a config.json read: no "no config.json" line.
    read = _layer("none-dir/config.json", sliding_window=4, other_tensors=("a (x)", "b (y)"))
    text = read.describe(tokens=7, constant=("o_proj.bias", "q_proj.bias"))
    assert text.splitlines()[0] == ("checkpoint ckpt (layout hf-llama, prefix 'p.', float32): E=12 N=3 K=3 H=4 "
                                    "qkv_bias=False out_bias=False rope=half rope_theta=500")
    assert "no config.json" not in text
    assert "sliding_window=4: fewer keys than the S=7 tokens" in text and "window (3, 0)" in text
    assert "also under the prefix, not judged: a (x); b (y)" in text
    assert "warning: o_proj.bias, q_proj.bias hold one value throughout" in text
    flagged = _layer(None)
    assert "\nno config.json beside the file" in str(flagged) and "sliding_window" not in str(flagged)
    assert str(flagged) == flagged.describe()
