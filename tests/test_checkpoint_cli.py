"""`mha-parity --checkpoint`: a layer of a transformers checkpoint checked end to end.

A tiny LlamaForCausalLM written by save_pretrained: its layer passes (exit 0, the report
naming the file and prefix); the same layer fed to the jnp.tile port fails with the stage
named (exit 1); a single .safetensors file needs the heads and RoPE base (exit 2 naming the
flags); a bad path, layout, prefix or shape, or weights config.json does not describe, are
exit 2 naming them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.cli import main

PREFIX = "model.layers.1.self_attn."
# forward and peers, float32, ours torch: what a check of one layer needs, in a few seconds
FAST = ["--no-progress", "--impls", "torch", "--checks", "forward,peers", "--dtypes", "float32"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
                                      intermediate_size=16, vocab_size=11, rope_theta=500.0, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _report(path):
    with open(path) as f:
        return json.load(f)


def test_checkpoint_directory_passes_and_the_report_names_it(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(llama_dir), "--layout", "hf-llama", "--prefix", PREFIX, *FAST,
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(llama_dir) in printed and PREFIX in printed and "K=2" in printed and "rope_theta=500" in printed
    rep = _report(out)
    env = rep["environment"]
    assert env["checkpoint"] == str(llama_dir) and env["checkpoint_prefix"] == PREFIX
    assert env["checkpoint_layout"] == "hf-llama"
    rows = rep["rows"]
    assert {r["case"] for r in rows} == {"checkpoint/causal/nan", "checkpoint/padding/uniform"}
    ran = {(r["case"], r["impl"]) for r in rows if r["status"] == "pass"}
    for case in ("checkpoint/causal/nan", "checkpoint/padding/uniform"):
        for impl in ("torch", "hf-llama", "torch-sdpa-gqa"):
            assert (case, impl) in ran, (case, impl)
    # jax-dpa-gqa runs where the registry's runs_on says (padded self-attention, cross-attention):
    # on the padded case it passes, on the causal one it is a skip row that says why.
    assert ("checkpoint/padding/uniform", "jax-dpa-gqa") in ran
    causal_dpa = [r for r in rows if r["case"] == "checkpoint/causal/nan" and r["impl"] == "jax-dpa-gqa"]
    assert causal_dpa and all(r["status"] == "skip" and "runs_on" in r["message"] for r in causal_dpa)
    assert not [r for r in rows if r["status"] in ("fail", "error")]


def test_checkpoint_layer_with_a_buggy_port_fails_naming_the_stage(llama_dir, tmp_path):
    out = tmp_path / "r.json"
    code = main(["--checkpoint", str(llama_dir), "--prefix", PREFIX, "--no-progress", "--impls", "torch",
                 "--checks", "forward", "--dtypes", "float32", "--cases", "checkpoint/causal",
                 "--impl", "parity.examples.llama_jax:port", "--impl", "parity.examples.llama_jax:port_with_tile_bug",
                 "--json", str(out)])
    assert code == 1
    rows = _report(out)["rows"]
    assert all(r["status"] == "pass" for r in rows if r["impl"] == "llama-jax-port")
    bad = [r for r in rows if r["impl"] == "llama-jax-port-tile-bug" and r["reference"] == "oracle"]
    assert bad and all(r["status"] == "fail" and r["stage"] == "scores" for r in bad)


def test_single_file_needs_heads_and_rope_base(llama_dir, capsys):
    weights = str(llama_dir / "model.safetensors")
    assert main(["--checkpoint", weights, "--prefix", PREFIX, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--heads" in err and "--rope-theta" in err and weights in err
    assert main(["--checkpoint", weights, "--prefix", PREFIX, "--heads", "6", "--rope-theta", "500", *FAST,
                 "--cases", "checkpoint/causal", "--checks", "forward"]) == 0
    assert "K=2" in capsys.readouterr().out  # read off k_proj's 8 rows: 2 heads of H = 24 / 6
    assert main(["--checkpoint", weights, "--prefix", PREFIX, "--heads", "6", "--kv-heads", "3",
                 "--rope-theta", "500", "--no-progress"]) == 2
    assert "k_proj" in capsys.readouterr().err


@pytest.mark.parametrize("args, named", [
    (["--prefix", "model.layers.9.self_attn."], "model.layers.9.self_attn."),
    (["--layout", "hf-nope"], "hf-nope"),
    (["--layout", "hf-bert"], "hf-bert"),
    (["--shape", "2,6,5"], "T <= S"),
    (["--heads", "6"], "--heads"),  # a directory's config.json says it
])
def test_bad_checkpoint_arguments_are_usage_errors_naming_them(llama_dir, capsys, args, named):
    assert main(["--checkpoint", str(llama_dir), "--prefix", PREFIX, "--no-progress", *args]) == 2
    assert named in capsys.readouterr().err


def test_checkpoint_flags_need_checkpoint_and_paths_must_exist(tmp_path, capsys):
    assert main(["--prefix", PREFIX, "--no-progress"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    missing = str(tmp_path / "nowhere")
    assert main(["--checkpoint", missing, "--no-progress"]) == 2
    assert missing in capsys.readouterr().err


def test_weights_config_json_does_not_describe_are_named(llama_dir, tmp_path, capsys):
    """config.json says 2 key/value heads; a layer whose k_proj holds 3 is refused with the key named."""
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    k = tensors[f"{PREFIX}k_proj.weight"]
    tensors[f"{PREFIX}k_proj.weight"] = np.concatenate([k, k[:4]])  # 12 rows: 3 heads of 4
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert main(["--checkpoint", str(bad), "--prefix", PREFIX, "--no-progress"]) == 2
    out = capsys.readouterr().err
    assert "k_proj" in out and str(bad) in out


def _planted(llama_dir, tmp_path, value):
    """A copy of the checkpoint whose block's q_proj.weight holds one `value` (NaN or inf)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "planted"
    shutil.copytree(llama_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    w = tensors[f"{PREFIX}q_proj.weight"].copy()
    w[3, 5] = value
    tensors[f"{PREFIX}q_proj.weight"] = w
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("value, said", [(np.nan, "holds 1 NaN and 0 inf of 576 values"),
                                         (-np.inf, "holds 0 NaN and 1 inf of 576 values")])
def test_a_non_finite_weight_is_a_usage_error_naming_file_prefix_and_tensor(llama_dir, tmp_path, capsys, value, said):
    """Every output a NaN weight reaches is NaN, in the oracle too: nothing could be compared."""
    bad = _planted(llama_dir, tmp_path, value)
    single = ["--heads", "6", "--rope-theta", "500"]
    for path, flags in ((bad, []), (bad / "model.safetensors", single)):
        assert main(["--checkpoint", str(path), "--prefix", PREFIX, *FAST, "--checks", "forward", *flags]) == 2
        out = " ".join(capsys.readouterr().err.split())
        assert f"{bad / 'model.safetensors'}: tensor '{PREFIX}q_proj.weight' (prefix '{PREFIX}') {said}" in out, out


def test_fixed_weights_holding_nan_are_red_rows_not_a_silent_pass(llama_dir):
    """From Python the weights are the caller's: with one NaN in q_proj.weight the causal case's
    oracle is NaN everywhere, and so are our module and a planted layer that returns NaN whatever
    it is given. Each row compared nothing where the reference is a number: each fails, naming the tensor."""
    import torch

    from parity import layouts
    from parity.harness import checkpoint, run
    from parity.impls import implementation

    @implementation(name="all-nan", framework="torch", mode="eager", mask="keep", masked_rows="nan",
                    returns_weights=False, variants=("grouped", "rope-half", "no-qkv-bias", "no-out-bias"))
    def all_nan(state_dict, num_heads, *, dtype, device, problem):
        return lambda p, query, key, value, keep, **positions: torch.full_like(query, float("nan"))

    sd, config = layouts.read_checkpoint(llama_dir, prefix=PREFIX)
    sd["q_proj.weight"] = sd["q_proj.weight"].copy()
    sd["q_proj.weight"][3, 5] = np.nan
    causal = checkpoint.cases(config, 2, 5, 5)[:1]
    report = run(cases=causal, state_dict=sd, impls=["torch", all_nan], dtypes=("float32",), checks=("forward",),
                 device="cpu")
    outputs = [r for r in report.rows if r.quantity == "output"]
    assert {(r.impl, r.reference) for r in outputs} == {("torch", "oracle"), ("all-nan", "oracle"), ("all-nan", "torch")}
    for r in outputs:
        assert r.status == "fail" and r.max_abs_err == 0.0, r  # nothing compared: no error seen, yet red
        assert r.message.startswith("240 of 240 reference values are NaN/inf and were not compared"), r.message  # B·T·E = 2·5·24
        assert "(q_proj.weight)" in r.message
    assert not report.ok


def test_a_loop_of_symbolic_links_is_named_as_one(llama_dir, tmp_path, capsys):
    """os.path.exists is False for a link loop as for a missing file: the message says which it is."""
    import shutil

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    inner = tmp_path / "inner"  # a checkpoint directory whose weight file is a loop
    inner.mkdir()
    shutil.copy(llama_dir / "config.json", inner / "config.json")
    (inner / "model.safetensors").symlink_to(tmp_path / "a")
    looped = tmp_path / "a" / "model.safetensors"
    for path, named in ((tmp_path / "a", tmp_path / "a"), (looped, looped), (inner, inner / "model.safetensors")):
        assert main(["--checkpoint", str(path), "--prefix", PREFIX, "--no-progress"]) == 2
        out = " ".join(capsys.readouterr().err.split())
        assert f"{named}: a loop of symbolic links" in out, out
