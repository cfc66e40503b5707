"""`--checkpoint` reads the attention of Qwen3, Gemma 2, Gemma 3, OLMo 2 and GPT-OSS and judges it.

Tiny save_pretrained checkpoints (E=16, N=4, K=2, head_dim 8 != E/N; Gemma's query_pre_attn_scalar 20
!= head_dim; Gemma 2's cap 2.0; GPT-OSS with default RoPE and biases; Gemma 3 with a RoPE base per layer
type), every attention tensor redrawn (transformers initialises norms to 1 or 0, sinks and biases to 0,
behind which a dropped term hides). Layer 1 is a full-attention layer, layer 0 a sliding one.

The layer read (weights and config.json's fields) is the family's own: the oracle on it equals the
saved model's attention module at float32's forward bar, and reading it as a Llama layer (the feature
dropped) is far outside it. The CLI then exits 0 with our modules passing; a file that disagrees with
its config.json is still refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parity import layouts
from parity.cli import main
from parity.harness import checkpoint
from parity.tolerances import tolerance_for

E, N, K, H = 16, 4, 2, 8
P1, P0 = "model.layers.1.self_attn.", "model.layers.0.self_attn."
ROPE = {"rope_type": "default", "rope_theta": 500.0}
FAST = ["--no-progress", "--impls", "torch", "--checks", "forward", "--dtypes", "float32"]
BAR = tolerance_for("float32").forward
FULL_SLIDING = ["sliding_attention", "full_attention"]

# family -> (config class, model class, config keywords, the AttentionConfig fields config.json must give)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_parameters=ROPE, rms_norm_eps=1e-5),
              dict(qk_norm="head", qk_norm_eps=1e-5, qk_norm_offset=0.0, sinks=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(rope_parameters=ROPE, query_pre_attn_scalar=20,
                                                         attn_logit_softcapping=2.0, sliding_window=3),
               dict(qk_norm=None, scale=20 ** -0.5, softcap=2.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(query_pre_attn_scalar=20, layer_types=FULL_SLIDING, sliding_window=3,
                    rope_parameters={"full_attention": ROPE, "sliding_attention": {"rope_type": "default",
                                                                                   "rope_theta": 40.0}}),
               dict(qk_norm="head", qk_norm_offset=1.0, scale=20 ** -0.5, softcap=None)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_parameters=ROPE), dict(qk_norm="flat", qk_norm_eps=1e-5)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(rope_parameters=ROPE, num_local_experts=2,
                                                          num_experts_per_tok=1, attention_bias=True, sliding_window=3),
                dict(sinks=True, qkv_bias=True, out_bias=True, qk_norm=None)),
}


def _save(family, path, **changes):
    import torch
    import transformers

    cls_name, model_name, kwargs, _ = FAMILIES[family]
    torch.manual_seed(0)
    kw = dict(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, num_hidden_layers=2,
              intermediate_size=8, vocab_size=32, **kwargs)
    kw.update(changes)
    model = getattr(transformers, model_name)(getattr(transformers, cls_name)(**kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every attention tensor redrawn, norms around their resting value
        for name, p in model.named_parameters():
            if "self_attn" in name:
                rest = 1.0 if "norm" in name and not family.startswith("gemma") else 0.0
                p.copy_(rest + (torch.rand(p.shape, generator=g) - 0.5) * (0.8 if "proj.weight" not in name else 1.2))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {family: _save(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def _hf_output(directory, layer, x, positions, keep):
    """The saved model's own attention module of `layer`, in float64, on x."""
    import torch
    import transformers

    from parity.peers import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="eager")
    att = model.model.layers[layer].self_attn
    xt, pos = torch.from_numpy(x), torch.from_numpy(positions)
    rotary = model.model.rotary_emb
    kind = getattr(att, "layer_type", None)
    cos, sin = rotary(xt, pos, kind) if "gemma3" in type(att).__module__ else rotary(xt, pos)
    mask = torch.from_numpy(hf.additive_mask(keep, np.float64))
    with torch.no_grad():
        return att(xt, position_embeddings=(cos.double(), sin.double()), attention_mask=mask)[0].numpy()


def _inputs():
    rng = np.random.default_rng(3)
    T = 5
    x = rng.standard_normal((2, T, E))
    positions = np.arange(T)[None] + np.array([[0], [7]])  # (B, T)
    keep = np.tril(np.ones((T, T), bool))[None].repeat(2, 0)  # causal
    return x, positions, keep


def _oracle(layer, x, positions, keep, **change):
    from parity import reference

    c = layer.config
    kw = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta,
              qk_norm=c.qk_norm, qk_norm_eps=c.qk_norm_eps, qk_norm_offset=c.qk_norm_offset, scale=c.scale,
              softcap=c.softcap)
    kw.update(change)
    if kw["qk_norm"] is None:  # the norm's epsilon and offset mean nothing without it
        del kw["qk_norm_eps"], kw["qk_norm_offset"]
    return reference.forward(layer.state_dict, x, x, x, keep, positions=positions, key_positions=positions, **kw).output


@pytest.mark.parametrize("family", FAMILIES)
def test_config_json_gives_the_family_s_layer(family, saved):
    layer = checkpoint.load_layer(saved[family], prefix=P1)
    c = layer.config
    assert (c.embed_dim, c.num_heads, c.kv_heads, c.head_size, c.rope_theta) == (E, N, K, H, 500.0)
    for field, value in FAMILIES[family][3].items():
        assert getattr(c, field) == pytest.approx(value) if isinstance(value, float) else getattr(c, field) == value, field
    assert layer.sliding_window is None  # layer 1 is a full-attention layer
    if c.qk_norm:
        q = layer.state_dict["q_norm.weight"]
        assert q.shape == ((N * H,) if c.qk_norm == "flat" else (H,)) and np.ptp(q) > 0  # read, redrawn
    assert ("sinks" in layer.state_dict) == c.sinks


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_read_computes_what_the_saved_model_does(family, saved):
    """The oracle on the layer read equals the model's own attention module; the layer read as Llama's
    would (the family's feature dropped) is far outside the bar."""
    layer = checkpoint.load_layer(saved[family], prefix=P1)
    x, positions, keep = _inputs()
    expected = _hf_output(saved[family], 1, x, positions, keep)
    got = _oracle(layer, x, positions, keep)
    assert np.max(np.abs(got - expected)) <= BAR.atol + BAR.rtol * np.max(np.abs(expected)), family
    c = layer.config
    if c.sinks:
        sd = {k: v for k, v in layer.state_dict.items() if k != "sinks"}
        layer = checkpoint.CheckpointLayer(layer.path, layer.layout, layer.prefix, sd, c)
        slip = _oracle(layer, x, positions, keep)
    else:  # Llama's reading: no norms, H**-0.5, no cap
        sd = {k: v for k, v in layer.state_dict.items() if "norm" not in k}
        layer = checkpoint.CheckpointLayer(layer.path, layer.layout, layer.prefix, sd, c)
        slip = _oracle(layer, x, positions, keep, softcap=None, scale=None, qk_norm=None)
    assert np.max(np.abs(slip - expected)) > 20 * (BAR.atol + BAR.rtol * np.max(np.abs(expected))), family


def test_gemma3_s_layers_take_their_own_rope_base(saved):
    """Gemma 3 nests rope_parameters per layer type: layer 1 (full) has 500, layer 0 (sliding) 40, whose
    window W=3 the cases apply; the oracle on layer 0 is the model's sliding layer."""
    full = checkpoint.load_layer(saved["gemma3"], prefix=P1)
    sliding = checkpoint.load_layer(saved["gemma3"], prefix=P0)
    assert (full.config.rope_theta, sliding.config.rope_theta) == (500.0, 40.0)
    assert sliding.sliding_window == 3
    x, positions, keep = _inputs()
    keep = keep & ~np.tril(np.ones((5, 5), bool), -3)[None]  # the last 3 keys, itself included
    expected = _hf_output(saved["gemma3"], 0, x, positions, keep)
    assert np.max(np.abs(_oracle(sliding, x, positions, keep) - expected)) <= BAR.atol + BAR.rtol * np.abs(expected).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_mha_parity_judges_the_checkpoint(family, saved, capsys):
    assert main(["--checkpoint", str(saved[family]), "--prefix", P1, *FAST]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"prefix '{P1}'" in out and "H=8" in out and " pass" in out and " fail" not in out.replace("0 fail", "")


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_a_sliding_layer_runs_with_its_window(family, saved, capsys):
    """Layer 0 is a sliding_attention layer of W=3 keys: with S=5 the cases are the window's."""
    assert main(["--checkpoint", str(saved[family]), "--prefix", P0, *FAST]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sliding_window=3: fewer keys than the S=5 tokens" in out, out


def test_its_weight_file_beside_config_json_is_read_the_same(saved, capsys):
    directory = saved["olmo2"]
    assert main(["--checkpoint", str(directory / "model.safetensors"), "--prefix", P1, "--heads", str(N),
                 "--rope-theta", "500", *FAST]) == 0
    assert "qk_norm=flat" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------- what is still refused


def _copy(saved, family, tmp_path, tensors=None, **config):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / family
    shutil.copytree(saved[family], directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(config)
    (directory / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        stored = load_file(directory / "model.safetensors")
        tensors(stored)
        save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _refused(capsys, directory, prefix=P1) -> str:
    assert main(["--checkpoint", str(directory), "--prefix", prefix, *FAST]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    return " ".join(captured.err.split())


def _drop(key):
    return lambda t: t.pop(P1 + key)


def _flat_q_norm(t):
    t[P1 + "q_norm.weight"] = np.ones(N * H, np.float32)


@pytest.mark.parametrize("family, tensors, config, said", [
    ("qwen3", _drop("k_norm.weight"), {}, f"missing '{P1}k_norm.weight'"),
    ("gpt_oss", _drop("sinks"), {}, f"missing '{P1}sinks'"),
    ("qwen3", _flat_q_norm, {}, "q_norm.weight has shape (32,), expected (H,) for qk_norm='head'"),
    ("olmo2", None, {"model_type": "qwen3"}, "q_norm.weight has shape (32,), expected (H,) for qk_norm='head'"),
    ("qwen3", None, {"model_type": "olmo2"}, "q_norm.weight has shape (8,), expected (N*H,) = (32,) for qk_norm='flat'"),
    ("gemma2", None, {"head_dim": 4}, "head_dim"),
    # YaRN is read (GPT-OSS's default, field by field: test_checkpoint_rope.py), a key it does not read is not
    ("gpt_oss", None, {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 500.0,
                                           "original_max_position_embeddings": 64, "low_freq_factor": 1.0}},
     "rope_scaling 'yarn' does not read low_freq_factor"),
    # a per-layer-type RoPE is read (Gemma 3's linear: test_gemma3_s_full_layers_read_their_own_scaling), dynamic is not
    ("gemma3", None, {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 500.0},
                                          "sliding_attention": ROPE}}, "'dynamic' is not supported"),
    ("qwen3", None, {"rope_parameters": dict(ROPE, partial_rotary_factor=0.5)}, "partial_rotary_factor=0.5"),
    ("gemma2", None, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", None, {"layer_types": ["sliding_attention", "chunked_attention"]}, "'chunked_attention'"),
])
def test_a_file_or_config_the_layer_does_not_fit_is_refused(family, tensors, config, said, saved, tmp_path, capsys):
    err = _refused(capsys, _copy(saved, family, tmp_path, tensors, **config))
    assert said in err, err


def test_gemma3_s_full_layers_read_their_own_scaling(saved, tmp_path):
    """Gemma 3 (4B and up) scales only its full-attention layers' RoPE (linear, factor 8): layer 1 reads it,
    the sliding layer 0 keeps its own unscaled base."""
    from mha_spec import RopeScaling

    directory = _copy(saved, "gemma3", tmp_path, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 40.0}})
    _, full = layouts.read_checkpoint(directory, prefix=P1)
    _, sliding = layouts.read_checkpoint(directory, prefix=P0, ignore_sliding_window=True)
    assert (full.rope_theta, full.rope_scaling) == (500.0, RopeScaling("linear", factor=8.0))
    assert (sliding.rope_theta, sliding.rope_scaling) == (40.0, None)


def test_a_prefix_without_the_layer_index_is_refused_when_layers_differ(saved, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    directory = _copy(saved, "gemma2", tmp_path)
    stored = load_file(directory / "model.safetensors")
    save_file({k.replace(P1, "attn."): v for k, v in stored.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    assert "does not say the layer's index" in _refused(capsys, directory, "attn.")


def test_the_layout_round_trips_the_tensors_of_each_feature():
    from mha_spec import AttentionConfig

    rng = np.random.default_rng(0)
    for qk_norm, sinks in (("head", False), ("flat", True), (None, True)):
        shapes = AttentionConfig(E, N, num_kv_heads=K, head_dim=H, qk_norm=qk_norm, sinks=sinks).weight_shapes()
        sd = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
        tensors = layouts.to_layout(sd, "hf-llama", prefix=P1, num_heads=N)
        assert tensors[P1 + "o_proj.weight"].shape == (E, N * H)
        back = layouts.from_layout(tensors, "hf-llama", prefix=P1, num_heads=N, qk_norm=qk_norm, sinks=sinks)
        assert sorted(back) == sorted(sd) and all(back[k].tobytes() == sd[k].tobytes() for k in sd)
        if qk_norm or sinks:  # the tensors alone do not say the norm's epsilon and offset: not read unasked
            with pytest.raises(ValueError, match="would judge another attention"):
                layouts.from_layout(tensors, "hf-llama", prefix=P1, num_heads=N)
