"""`--checkpoint` judges only attention the tool models: every tensor under the prefix is read, or
the run refuses (exit 2, on stderr, before anything runs), naming the tensors and the features.

Tiny save_pretrained checkpoints of the families researchers port today -- Qwen3, Gemma 2,
Gemma 3, OLMo 2, GPT-OSS, Phi-3, GPT-NeoX, Phi-2, Falcon -- built with head_dim = E/N wherever the
config takes one (and Gemma's query_pre_attn_scalar = head_dim). Phi-2 (model_type 'phi': a dense
output projection, partial RoPE) and a Falcon with ALiBi are refused as a directory and as their
model.safetensors beside config.json; every family whose block holds a tensor hf-llama reads
only for a layer config.json describes (QK-norm weights, sinks) or never (fused projections, dense)
is refused as that file alone, which cannot say the norm's epsilon or offset, and a fused family's
directory read as hf-llama is refused naming its fused tensor and its own layout. The families read
(Qwen3, Gemma 2 and 3, OLMo 2, GPT-OSS) are judged in test_checkpoint_modern.py; the RoPE of GPT-OSS,
Phi-3 and GPT-NeoX, and the fused layouts, in test_checkpoint_rope.py.
A Llama directory with a config field the tool cannot honour is refused by name too.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parity import layouts
from parity.cli import main

E, N, K = 16, 4, 2
PREFIX = "model.layers.0.self_attn."
NEOX = "gpt_neox.layers.0.attention."
FALCON = "transformer.h.0.self_attention."
FAST = ["--no-progress", "--impls", "torch", "--checks", "forward", "--dtypes", "float32"]

# family -> (config class, model class, extra config keywords, prefix, what the refusal must name:
# in every refusal, in the directory's (config.json's) refusal only, and the tensors hf-llama leaves unread;
# whether its directory is refused: the families read from config.json are only refused as a file alone)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=E // N), PREFIX,
              ["QK-norm"], [], ["q_norm.weight", "k_norm.weight"], False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=E // N, query_pre_attn_scalar=E // N), PREFIX,
               [], [], [], False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=E // N, query_pre_attn_scalar=E // N), PREFIX,
               ["QK-norm"], [], ["q_norm.weight", "k_norm.weight"], False),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, PREFIX, ["QK-norm"], [], ["q_norm.weight", "k_norm.weight"], False),
    # GPT-OSS, Phi-3 and GPT-NeoX directories are read (their RoPE field by field: test_checkpoint_rope.py);
    # GPT-OSS's sinks, Phi-3's and GPT-NeoX's fused tensors are still refused in a lone file and as hf-llama.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=E // N, num_local_experts=2, num_experts_per_tok=1),
                PREFIX, [], [], ["sinks"], False),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), PREFIX,
             ["fused projections"], [], ["qkv_proj.weight"], False),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(num_key_value_heads=None), NEOX,
                 ["fused projections"], [], ["query_key_value.weight", "dense.weight"], False),
    # Phi-2 (model_type 'phi', not read): its output projection is `dense` and it rotates half of each head.
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=None), PREFIX,
            [], ["partial_rotary_factor=0.5"], ["dense.weight", "dense.bias"], True),
    # Falcon is read, ALiBi (Falcon-RW's position biases on the scores) is not: refused by name.
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_key_value_heads=None, intermediate_size=None, alibi=True),
               FALCON, [], ["alibi = True: ALiBi"], ["query_key_value.weight", "dense.weight"], True),
}
TENSORS = [f for f, spec in FAMILIES.items() if spec[6]]  # families whose block holds a tensor hf-llama does not read
REFUSED = [f for f, spec in FAMILIES.items() if spec[7]]  # families whose directory is refused
# what a directory's refusal names: the tensors left unread, unless config.json's model is read (a field refused)
UNREAD_IN_DIRECTORY = [f for f in REFUSED if f not in layouts.HF_MODELS]


def _save(cls_name, model_name, kwargs, path):
    import torch
    import transformers

    torch.manual_seed(0)
    kw = dict(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, num_hidden_layers=1, intermediate_size=8,
              vocab_size=32)
    kw.update(kwargs)
    config = getattr(transformers, cls_name)(**{k: v for k, v in kw.items() if v is not None})
    getattr(transformers, model_name)(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (its save_pretrained directory, its model.safetensors copied alone into another directory)."""
    out = {}
    for family, (cls_name, model_name, kwargs, *_) in FAMILIES.items():
        directory = _save(cls_name, model_name, kwargs, tmp_path_factory.mktemp(family))
        alone = tmp_path_factory.mktemp(f"{family}-alone") / "weights.safetensors"
        shutil.copy(directory / "model.safetensors", alone)
        out[family] = directory, alone
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500.0), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def nothing_runs(monkeypatch):
    """A refusal comes before the harness: running it fails the test."""
    def run(**kwargs):
        raise AssertionError("the harness ran")

    monkeypatch.setattr("parity.harness.runner.run", run)


def _refused(capsys, *argv) -> str:
    """Run the CLI; it must exit 2 with one message on stderr and nothing on stdout. The message, one line."""
    assert main([*argv, *FAST]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return " ".join(captured.err.split())


def _names(err, family, *, config: bool, tensors: bool):
    _, _, _, prefix, always, in_config, unread, _ = FAMILIES[family]
    # never a route that drops what was found (building the layer by hand, a single file with flags)
    assert "yourself" not in err and "--heads" not in err and "ignore_sliding_window" not in err, err
    for said in always + (in_config if config else []):
        assert said in err, (family, said, err)
    for key in unread if tensors else []:
        assert f"'{prefix}{key}'" in err, (family, key, err)


@pytest.mark.parametrize("family", REFUSED)
def test_a_directory_is_refused_naming_what_the_tool_does_not_model(family, saved, capsys, nothing_runs):
    directory, _ = saved[family]
    err = _refused(capsys, "--checkpoint", str(directory), "--prefix", FAMILIES[family][3])
    assert f"{directory / 'config.json'}" in err
    _names(err, family, config=True, tensors=family in UNREAD_IN_DIRECTORY)


@pytest.mark.parametrize("family", REFUSED)
def test_its_weight_file_beside_config_json_is_refused_the_same(family, saved, capsys, nothing_runs):
    directory, _ = saved[family]
    err = _refused(capsys, "--checkpoint", str(directory / "model.safetensors"), "--prefix", FAMILIES[family][3],
                   "--heads", str(N), "--rope-theta", "10000")
    assert f"{directory / 'config.json'}" in err
    _names(err, family, config=True, tensors=family in UNREAD_IN_DIRECTORY)


@pytest.mark.parametrize("family", TENSORS)
def test_the_weight_file_alone_is_refused_naming_the_tensors_it_would_leave_unread(family, saved, capsys, nothing_runs):
    _, alone = saved[family]
    err = _refused(capsys, "--checkpoint", str(alone), "--prefix", FAMILIES[family][3], "--heads", str(N),
                   "--rope-theta", "10000")
    _names(err, family, config=False, tensors=True)


@pytest.mark.parametrize("family", TENSORS)
def test_the_readers_refuse_the_block_too(family, saved):
    directory, alone = saved[family]
    prefix, unread = FAMILIES[family][3], FAMILIES[family][6]
    if family in UNREAD_IN_DIRECTORY:
        with pytest.raises(ValueError, match="is not one of") as info:
            layouts.read_checkpoint(directory, prefix=prefix)
        assert all(f"'{prefix}{key}'" in str(info.value) for key in unread)
    elif (own := layouts.HF_MODELS[family].layout) != "hf-llama":  # a fused family read as hf-llama
        with pytest.raises(ValueError, match=f"model_type '{family}' uses layout '{own}', not 'hf-llama'") as info:
            layouts.read_checkpoint(directory, prefix=prefix)
        assert all(f"'{prefix}{key}'" in str(info.value) for key in unread)
        assert "fused projections" in str(info.value) and own in str(info.value).split("fused projections")[1]
    elif family == "gpt_oss":  # its layer 0 slides; the rest of the layer (sinks, YaRN) is read
        with pytest.raises(NotImplementedError, match="layer_types\\[0\\] = 'sliding_attention'"):
            layouts.read_checkpoint(directory, prefix=prefix)  # read_checkpoint applies no window
        sd, config = layouts.read_checkpoint(directory, prefix=prefix, ignore_sliding_window=True)
        assert "sinks" in sd and config.sinks and config.rope_scaling.kind == "yarn"
    with pytest.raises((ValueError, KeyError)) as info:
        layouts.read_layout(alone, "hf-llama", prefix=prefix)
    assert all(f"'{prefix}{key}'" in str(info.value) for key in unread)


def test_a_lone_file_without_tensors_to_tell_says_what_it_judges(saved, capsys, monkeypatch):
    """Gemma 2's block is q/k/v/o alone: without config.json nothing says it soft-caps or windows, and the
    printed line says the layer is what the flags and the layout say."""
    class Ran(Exception):
        pass

    def run(**kwargs):
        raise Ran

    monkeypatch.setattr("parity.harness.runner.run", run)
    _, alone = saved["gemma2"]
    with pytest.raises(Ran):
        main(["--checkpoint", str(alone), "--prefix", PREFIX, "--heads", str(N), "--rope-theta", "10000", *FAST])
    out = " ".join(capsys.readouterr().out.split())
    assert "no config.json beside the file: the layer is what the flags and the layout say" in out


def test_a_tensor_of_the_block_that_is_not_attention_is_named_not_judged(tmp_path, capsys, monkeypatch):
    """BERT's residual LayerNorm sits under its attention prefix: the printed line names it, unread."""
    class Ran(Exception):
        pass

    def run(**kwargs):
        raise Ran

    monkeypatch.setattr("parity.harness.runner.run", run)
    directory = _save("BertConfig", "BertModel", dict(num_key_value_heads=None, vocab_size=11), tmp_path / "bert")
    prefix = "encoder.layer.0.attention."
    with pytest.raises(Ran):
        main(["--checkpoint", str(directory / "model.safetensors"), "--layout", "hf-bert", "--prefix", prefix,
              "--heads", str(N), *FAST])
    out = " ".join(capsys.readouterr().out.split())
    assert (f"also under the prefix, not judged: {prefix}output.LayerNorm.bias (not attention: BertSelfOutput's "
            f"LayerNorm") in out, out
    assert f"{prefix}output.LayerNorm.weight (not attention" in out


# ---------------------------------------------------------------- a Llama directory with what the tool cannot honour


def _llama_with(llama_dir, tmp_path, **changes):
    directory = tmp_path / "llama"
    shutil.copytree(llama_dir, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize("changes, said", [
    # llama3 and yarn are read (a Llama 3.1 directory field by field: test_checkpoint_rope.py); what is not:
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 64,
                       "low_freq_factor": 1.0}}, "rope_scaling 'yarn' does not read low_freq_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),  # Llama rotates the whole head
    ({"attention_bias": True}, "qkv_bias=True"),  # the weights have none
    ({"head_dim": 8}, "head_dim = 8"),
    ({"auto_map": {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}}, "auto_map="),
])
def test_a_llama_directory_with_a_field_the_tool_cannot_honour_is_refused_by_name(llama_dir, tmp_path, capsys, nothing_runs,
                                                                                  changes, said):
    directory = _llama_with(llama_dir, tmp_path, **changes)
    err = _refused(capsys, "--checkpoint", str(directory), "--prefix", PREFIX)
    assert said in err, err


def test_a_tensor_under_the_prefix_the_layout_does_not_read_is_refused(llama_dir, tmp_path, capsys, nothing_runs):
    from safetensors.numpy import load_file, save_file

    directory = _llama_with(llama_dir, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors[f"{PREFIX}lambda_q1"] = np.ones(4, np.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    for argv in (["--checkpoint", str(directory)], ["--checkpoint", str(directory / "model.safetensors"),
                                                    "--heads", str(N), "--rope-theta", "500"]):
        err = _refused(capsys, *argv, "--prefix", PREFIX)
        assert f"'{PREFIX}lambda_q1' (unknown: the tool does not know what it computes)" in err, err


@pytest.mark.parametrize("flags, said", [
    (["--heads", "8", "--rope-theta", "500"], "--heads 8 but num_attention_heads 4"),
    (["--heads", str(N), "--rope-theta", "10000"], "--rope-theta 10000.0 but rope_theta 500.0"),
])
def test_a_file_s_flags_must_agree_with_the_config_json_beside_it(llama_dir, capsys, nothing_runs, flags, said):
    err = _refused(capsys, "--checkpoint", str(llama_dir / "model.safetensors"), "--prefix", PREFIX, *flags)
    assert said in err and str(llama_dir / "config.json") in err, err


def test_a_stored_rope_buffer_is_read_and_checked(llama_dir, tmp_path):
    """Llama checkpoints written before transformers 4.31 hold rotary_emb.inv_freq: the default RoPE's
    frequencies are read and pass; llama3-scaled ones (low frequencies divided by 8) are refused."""
    from safetensors.numpy import load_file, save_file

    H = E // N
    default = (1.0 / 500.0 ** (np.arange(0, H, 2) / H)).astype(np.float32)
    for inv_freq, ok in ((default, True), (default / np.array([1.0, 8.0], np.float32), False)):
        directory = _llama_with(llama_dir, tmp_path / str(ok))
        tensors = load_file(directory / "model.safetensors")
        tensors[f"{PREFIX}rotary_emb.inv_freq"] = inv_freq
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        if ok:
            sd, _ = layouts.read_checkpoint(directory, prefix=PREFIX)
            assert sorted(sd) == ["k_proj.weight", "out_proj.weight", "q_proj.weight", "v_proj.weight"]
        else:
            with pytest.raises(ValueError, match=r"rotary_emb.inv_freq .* is not the default RoPE's"):
                layouts.read_checkpoint(directory, prefix=PREFIX)
