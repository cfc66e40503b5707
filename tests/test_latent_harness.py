"""DeepSeek V2/V3 multi-head latent attention in the harness: the hf-deepseek layouts (parity.latent) held to
transformers' own modules and config classes, the latent harness's rows (parity.harness.latent), `mha-parity
--checkpoint` of tiny save_pretrained DeepSeek models and `--cases latent`, the planted bugs red at their stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mha_spec import LatentAttentionConfig, RopeScaling
from parity import reference_mla
from parity.cli import main
from parity.examples.mla_torch import BUGS, planted
from parity.harness.latent import LatentCase, draw, draw_weights, hf_peer, latent_cases, run_latent, torch_impl
from parity.latent import from_hf_deepseek, read_deepseek_config, to_hf_deepseek
from parity.peers.hf_deepseek import hf_layer

PREFIX = "model.layers.0.self_attn."
# Pairwise distinct: E, N, C, Dn, Dr, Dv, Q
E, N, C, Dn, Dr, Dv, Q = 12, 3, 6, 10, 8, 5, 7
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(version="v3", **kw):
    import transformers

    Config = transformers.DeepseekV3Config if version == "v3" else transformers.DeepseekV2Config
    base = dict(vocab_size=32, hidden_size=E, intermediate_size=20, moe_intermediate_size=6, num_hidden_layers=1,
                first_k_dense_replace=1, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=Q, kv_lora_rank=C,
                qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv, max_position_embeddings=64,
                rope_parameters=dict(YARN), attention_bias=True, n_routed_experts=4, num_experts_per_tok=2)
    return Config(**{**base, **kw})


def _save(path, version="v3", **kw):
    """A tiny DeepSeek causal LM (dense MLP: first_k_dense_replace), its attention's norms and biases redrawn away
    from their init (ones, ~0) so a dropped term cannot hide, saved with save_pretrained."""
    import transformers

    cfg = _config(version, **kw)
    Model = transformers.DeepseekV3ForCausalLM if version == "v3" else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(0)
    m = Model(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "self_attn" in n and (n.endswith("layernorm.weight") or n.endswith("bias")):
                p.uniform_(0.5, 1.5)
    m.save_pretrained(path)
    return path


def _cli(*args, tmp_path) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    code = main([*args, "--no-progress", "--json", str(out)])
    return code, (json.loads(out.read_text()) if out.exists() else {})


# ---------------------------------------------------------------- layouts and config.json


@pytest.mark.parametrize("version, q_lora, bias", [("v3", Q, True), ("v3", None, False), ("v2", None, True)])
def test_hf_deepseek_names_are_transformers_state_dict_both_ways(version, q_lora, bias):
    cfg = LatentAttentionConfig(E, N, C, Dn, Dr, Dv, q_lora_rank=q_lora, bias=bias)
    hf = hf_layer(cfg, version)[0]
    sd = draw_weights(np.random.default_rng(0), cfg)
    named = to_hf_deepseek(sd, PREFIX)
    assert {k.removeprefix(PREFIX) for k in named} == set(hf.state_dict())  # transformers' names, all of them
    hf.load_state_dict({k.removeprefix(PREFIX): torch.tensor(v) for k, v in named.items()}, strict=True)
    others = {"model.layers.0.mlp.gate_proj.weight": np.ones((2, 2)), "model.layers.1.self_attn.o_proj.weight": np.ones(1)}
    back = from_hf_deepseek({**named, **others}, PREFIX, config=cfg)  # outside the prefix: ignored
    assert sorted(back) == sorted(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)


def test_from_hf_deepseek_refuses_by_name():
    cfg = LatentAttentionConfig(E, N, C, Dn, Dr, Dv, q_lora_rank=Q)
    named = to_hf_deepseek(draw_weights(np.random.default_rng(0), cfg), PREFIX)
    with pytest.raises(ValueError, match="rotary_emb.inv_freq"):
        from_hf_deepseek({**named, PREFIX + "rotary_emb.inv_freq": np.ones(4)}, PREFIX)
    rows = N * (Dn + Dv)
    with pytest.raises(ValueError, match=rf"kv_b_proj.weight has shape \({rows}, 5\), expected \({rows}, 6\)"):
        from_hf_deepseek({**named, PREFIX + "kv_b_proj.weight": np.ones((rows, 5))}, PREFIX, config=cfg)
    with pytest.raises(ValueError, match="q_proj.weight"):  # config.json says no q_lora: q_proj missing
        from_hf_deepseek(named, PREFIX, config=LatentAttentionConfig(E, N, C, Dn, Dr, Dv))


def test_read_deepseek_config_is_what_transformers_builds():
    # rms_norm_eps is the decoder layer's: transformers' attention norms keep 1e-6 (their default eps)
    v3 = _config(rms_norm_eps=1e-5, rope_interleave=False)
    cfg = read_deepseek_config(v3.to_dict())
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as m3
    attn = m3.DeepseekV3Attention(v3, 0)
    assert cfg.norm_eps == attn.kv_a_layernorm.variance_epsilon == attn.q_a_layernorm.variance_epsilon == 1e-6
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-15)  # mscale_all_dim read
    assert (cfg.embed_dim, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim, cfg.q_lora_rank, cfg.bias) == (E, N, C, Dn, Dr, Dv, Q, True)
    assert cfg.rope == "half" and cfg.rope_scaling == RopeScaling.from_mapping(
        "yarn", {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")})
    assert cfg.weight_shapes() == {k: tuple(v.shape) for k, v in _canonical(attn.state_dict()).items()}
    v2 = read_deepseek_config(_config("v2", q_lora_rank=None, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 500.0}).to_dict())
    assert (v2.rope, v2.q_lora_rank, v2.rope_scaling, v2.rope_theta) == ("interleaved", None, None, 500.0)


def _canonical(state):
    return from_hf_deepseek({k: v.numpy() for k, v in state.items()})


@pytest.mark.parametrize("change, named", [
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"head_dim": 5}, "head_dim"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"model_type": "llama"}, "model_type"),
    ({"auto_map": {"AutoModel": "x.Y"}}, "auto_map"),
])
def test_read_deepseek_config_refuses_what_changes_attention_by_name(change, named):
    cfg = {**_config().to_dict(), **change}
    with pytest.raises(ValueError, match=named):
        read_deepseek_config(cfg)


def test_v2_has_no_half_rope():
    with pytest.raises(ValueError, match="rope_interleave"):
        read_deepseek_config({**_config("v2").to_dict(), "rope_interleave": False})


# ---------------------------------------------------------------- the oracle's yardstick


def test_oracle_in_a_dtype_rounds_its_stages_and_float64_is_unchanged():
    case = latent_cases()[0]
    i = draw(case, 0)
    kw = case.oracle_keywords()
    plain = reference_mla.forward(i.sd, i.x, None, is_causal=True, **kw)
    same = reference_mla.forward(i.sd, i.x, None, is_causal=True, dtype=np.float64, **kw)
    f32 = reference_mla.forward(i.sd, i.x, None, is_causal=True, dtype=np.float32, **kw)
    assert np.array_equal(plain.output, same.output)
    err = np.abs(f32.output - plain.output).max() / np.abs(plain.output).max()
    assert 1e-9 < err < 1e-5  # float32's rounding, not another computation
    assert np.array_equal(f32.c, f32.c.astype(np.float32).astype(np.float64))  # each stage stored in float32


# ---------------------------------------------------------------- the harness's rows and the planted bugs


@pytest.mark.parametrize("bug, check, quantity, stage", [
    ("rope-key-half", "forward", "output", "k_rot"),
    ("rope-key-per-head", "forward", "output", "k_rot"),
    ("no-mscale", "forward", "output", "scores"),
    ("cache-raw-latent", "decode", "decode naive", "prefill"),
    ("absorb-heads", "decode", "decode absorbed", "prefill"),
])
def test_planted_bugs_are_red_at_their_stage(bug, check, quantity, stage):
    case = next(c for c in latent_cases() if c.config.rope_scaling is not None)  # YaRN with mscale; Dn >= Dr
    ok, bad = torch_impl("right", _right()), torch_impl("planted", planted(bug))
    report = run_latent(cases=[case], impls=[ok, bad], dtypes=["float32"], checks=["forward", "decode"])
    assert all(r.status == "pass" for r in report.rows if r.impl == "right")
    failing = [r for r in report.rows if r.impl == "planted" and r.status == "fail"]
    row = next(r for r in failing if r.check == check and r.quantity == quantity and r.reference == "oracle")
    assert row.stage == stage and row.margin > 10
    if bug == "absorb-heads":  # the naive decode and the forward are right; absorbed != naive
        assert {(r.check, r.quantity, r.reference) for r in failing} == {
            ("decode", "decode absorbed", "oracle"), ("decode", "decode absorbed", "planted naive decode")}
    if bug == "cache-raw-latent":  # the forward is right; the decode is not the layer's own forward
        assert not any(r.check == "forward" for r in failing)
        assert any(r.reference == "planted causal forward" for r in failing)


def _right():
    from parity.harness.latent import ours_torch_module

    return ours_torch_module


def test_rows_are_judged_by_the_tables_with_every_gradient():
    case = LatentCase("t/bias/padding", LatentAttentionConfig(E, N, C, Dn, Dr, Dv, q_lora_rank=Q, bias=True), 3, 4,
                      mask="padding")
    report = run_latent(cases=[case], impls=[torch_impl("torch", _right()), hf_peer("v3")],
                        dtypes=["float64", "bfloat16"], checks=["forward", "gradient", "peers"])
    judged = [r for r in report.rows if r.status != "skip"]
    assert report.ok and all(r.reference == "oracle" and r.margin is not None for r in judged)
    skipped = [(r.impl, r.dtype, r.message) for r in report.rows if r.status == "skip"]  # said, not left out
    assert skipped == [("hf-deepseek-v3", "bfloat16", "hf-deepseek-v3 runs float64, float32")]
    grads = {r.quantity for r in report.rows if r.check == "gradient" and r.dtype == "bfloat16"}
    assert grads == {"d_inputs", *(f"d_{k}" for k in case.config.weight_shapes())}
    peers = [r for r in judged if r.impl == "hf-deepseek-v3"]
    assert peers and {r.dtype for r in peers} == {"float64"} and all(r.check == "peers" for r in peers)
    assert all("float32's bound" in r.message for r in peers if r.quantity == "output")


# ---------------------------------------------------------------- mha-parity


def test_checkpoint_v3_passes_with_the_hf_peer(tmp_path):
    directory = _save(tmp_path / "v3")
    code, report = _cli("--checkpoint", str(directory), "--prefix", PREFIX, tmp_path=tmp_path)
    rows = report["rows"]
    assert code == 0 and rows and all(r["status"] == "pass" for r in rows)
    assert {r["impl"] for r in rows} == {"torch", "torch-fused", "jax-jit", "hf-deepseek-v3"}
    assert {r["check"] for r in rows} == {"forward", "gradient", "decode", "peers"}
    assert {r["dtype"] for r in rows} == {"float64", "float32"}
    assert any(r["quantity"] == "d_q_a_norm.weight" for r in rows)  # the redrawn norm's gradient, checked
    assert report["environment"]["checkpoint_layout"] == "hf-deepseek-v3"


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_checkpoint_without_q_lora_and_v2(version, tmp_path):
    directory = _save(tmp_path / version, version, q_lora_rank=None, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 10000.0})
    code, report = _cli("--checkpoint", str(directory), "--prefix", PREFIX, "--impls", "torch", "--shape", "2,2,4",
                        tmp_path=tmp_path)
    assert code == 0 and all(r["status"] == "pass" for r in report["rows"])
    assert any(r["impl"] == f"hf-deepseek-{version}" for r in report["rows"])
    assert any(r["quantity"] == "d_q_proj.weight" for r in report["rows"])
    assert report["environment"]["checkpoint_decode_prompt"] == 2  # --shape 2,2,4: the 2 newest of 4 decoded


def test_checkpoint_refuses_a_tensor_under_the_prefix_it_does_not_read(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    directory = _save(tmp_path / "v3")
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, PREFIX + "k_norm.weight": np.ones(3, np.float32)}, directory / "model.safetensors")
    assert main(["--checkpoint", str(directory), "--prefix", PREFIX, "--no-progress"]) == 2
    assert "k_norm.weight" in capsys.readouterr().err


def test_cases_latent_alone_and_merged(tmp_path):
    code, report = _cli("--cases", "latent", "--dtypes", "float32", "--impls", "torch", "--checks", "forward",
                        tmp_path=tmp_path)
    assert code == 0 and {r["case"] for r in report["rows"]} == {c.name for c in latent_cases()}
    code, report = _cli("--cases", "latent,self/none/nan", "--dtypes", "float32", "--impls", "torch", "--checks",
                        "forward", tmp_path=tmp_path)
    cases = {r["case"] for r in report["rows"]}
    assert code == 0 and "self/none/nan" in cases and {c.name for c in latent_cases()} <= cases


def test_a_user_latent_layer_through_impl_is_red_at_its_stage(tmp_path, capsys):
    code, report = _cli("--cases", "latent", "--dtypes", "float32", "--impls", "torch", "--checks", "forward",
                        "--impl", "parity.examples.mla_torch:no_mscale", tmp_path=tmp_path)
    failing = {(r["case"], r["impl"], r["stage"]) for r in report["rows"] if r["status"] != "pass"}
    scaled = {c.name for c in latent_cases() if c.config.rope_scaling is not None}
    assert code == 1 and failing == {(name, "no_mscale", "scores") for name in scaled}
    out = " ".join(capsys.readouterr().out.split())
    assert "no_mscale: FAILS forward on 1 of 7 cases (first diverging stage: scores)" in out, out[-600:]
    assert main(["--cases", "latent", "--impl", "json:no_such_layer", "--no-progress"]) == 2
    assert "no_such_layer" in capsys.readouterr().err


def test_a_user_layer_under_transformers_names_gets_them_and_gives_canonical_gradients(tmp_path):
    """`hf_named.names = "hf-deepseek-v3"`: its module holds q_a_layernorm, kv_a_proj_with_mqa, o_proj...; green on
    forward, gradients and decode. The same module declared with canonical names cannot load the state dict."""
    from parity.examples.mla_torch import hf_named

    code, report = _cli("--cases", "latent", "--dtypes", "float64", "--impls", "torch", "--checks",
                        "forward,gradient,decode", "--impl", "parity.examples.mla_torch:hf_named", tmp_path=tmp_path)
    mine = [r for r in report["rows"] if r["impl"] == "hf_named"]
    assert code == 0 and mine and all(r["status"] in ("pass", "skip") for r in mine)
    assert {r["check"] for r in mine if r["status"] == "pass"} == {"forward", "gradient", "decode"}
    assert "d_kv_a_proj.weight" in {r["quantity"] for r in mine}  # its gradients read back under canonical names
    wrong = run_latent(cases=latent_cases()[:1], dtypes=("float64",), checks=("forward",),
                       impls=[torch_impl("canonical-declared", hf_named)])
    assert {r.status for r in wrong.rows if r.impl == "canonical-declared"} == {"error"}


def test_checkpoint_cases_start_a_scaled_rope_past_its_original_context_and_decode_the_t_newest():
    from parity.harness.latent import checkpoint_cases

    cfg = read_deepseek_config(_config().to_dict())
    causal, padded = checkpoint_cases(cfg, 2, 3, 7)
    assert (causal.T, causal.prefill, padded.T) == (7, 4, 7)  # T < S: S - T prompt tokens, then T steps
    assert draw(causal, 0).positions.min() == YARN["original_max_position_embeddings"] == causal.positions_from
    plain = read_deepseek_config(_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to_dict())
    assert checkpoint_cases(plain, 2, 5, 5)[0].positions_from is None
    with pytest.raises(ValueError, match="T <= S"):
        checkpoint_cases(cfg, 2, 6, 5)


def test_left_padding_leaves_rows_to_the_policy():
    case = next(c for c in latent_cases() if c.mask == "left-padding")
    i = draw(case, 0)
    keep = i.keep & np.tril(np.ones((case.T, case.T), bool))
    assert not keep.any(axis=-1).all()  # some query keeps no key: masked_rows decides it
    out = reference_mla.forward(i.sd, i.x, i.keep, is_causal=True, positions=i.positions, **case.oracle_keywords())
    assert np.isfinite(out.output).all()  # "zero"/"uniform", not NaN


def test_deepseek_checkpoint_usage_errors(tmp_path, capsys):
    directory = _save(tmp_path / "v3")
    for args, named in ((["--layout", "hf-deepseek-v2"], "hf-deepseek-v3"), (["--checks", "leak"], "leak"),
                        (["--dtypes", "float16"], "float16"), (["--prefix", "model.layers.5.self_attn."], "layer 5")):
        assert main(["--checkpoint", str(directory), "--prefix", PREFIX, *args, "--no-progress"]) == 2, args
        assert named in capsys.readouterr().err, args
