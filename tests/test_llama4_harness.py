"""Llama 4 judged like the rest: config.json read per layer, `--checkpoint` of a chunked RoPE layer and of a
NoPE temperature layer, the chunk case kind, the hf-llama4 peers, and a port's slips named at their stage.

The checkpoint is a tiny save_pretrained Llama4ForCausalLM (E=16, N=4, K=2, head_dim 6, two layers:
no_rope_layers [1, 0], attention_chunk_size 3, use_qk_norm, the temperature with floor_scale 2, llama3 RoPE
with original_max_position_embeddings 8), every attention tensor redrawn. The layer read is the saved
model's own: the oracle on it equals the model's Llama4TextAttention (its chunked mask from transformers'
create_chunked_causal_mask, its temperature at the cache slots it counts) at float32's forward bar, and the
same weights read as a plain Llama layer are far outside it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity import layouts, reference
from parity.cli import main
from parity.harness import checkpoint
from parity.harness.runner import run
from parity.tolerances import compare, tolerance_for

E, N, K, H = 16, 4, 2, 6
C, FLOOR = 3, 2
P0, P1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."  # 0: RoPE, chunked, L2; 1: NoPE, temperature
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
BAR = tolerance_for("float32").forward


def _text_config(**changes):
    import transformers

    kw = dict(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, num_hidden_layers=2,
              intermediate_size=8, intermediate_size_mlp=8, vocab_size=32, num_local_experts=1,
              attention_chunk_size=C, use_qk_norm=True, rms_norm_eps=1e-5, no_rope_layers=[1, 0],
              attn_temperature_tuning=True, floor_scale=FLOOR, attn_scale=0.1, rope_parameters=LLAMA3)
    kw.update(changes)
    return transformers.Llama4TextConfig(**kw)


def _save(path, **changes):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(_text_config(**changes))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every attention tensor redrawn
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.copy_((torch.rand(p.shape, generator=g) - 0.5) * 1.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("llama4"))


# --- config.json -------------------------------------------------------------------------------------------

def test_config_json_gives_each_layer_its_own_attention():
    cfg = _text_config()
    d = cfg.to_dict()
    rope = layouts.attention_config(d, "c", layer=0, ignore_chunk=True)
    assert (rope.rope, rope.qk_norm, rope.qk_norm_eps, rope.head_size, rope.kv_heads) == \
        ("interleaved", "l2", cfg.rms_norm_eps, cfg.head_dim, cfg.num_key_value_heads)
    assert rope.rope_theta == LLAMA3["rope_theta"] and rope.rope_scaling.kind == "llama3"
    assert rope.rope_scaling.original_max_position_embeddings == LLAMA3["original_max_position_embeddings"]
    assert not rope.attn_temperature_tuning and (rope.qkv_bias, rope.out_bias) == (False, False)
    nope = layouts.attention_config(d, "c", layer=1)
    assert (nope.rope, nope.qk_norm, nope.attn_temperature_tuning) == (None, None, True)
    assert (nope.floor_scale, nope.attn_scale) == (cfg.floor_scale, cfg.attn_scale)
    assert [layouts.layer_chunk(d, "c", L) for L in (0, 1)] == [C, None]
    # the multimodal config reads its text_config alike; attention_bias reaches all four projections
    assert layouts.attention_config({"model_type": "llama4", "text_config": d}, "c", layer=1) == nope
    assert layouts.layer_chunk({"model_type": "llama4", "text_config": d}, "c", 0) == C
    biased = layouts.attention_config(_text_config(attention_bias=True).to_dict(), "c", layer=1)
    assert (biased.qkv_bias, biased.out_bias) == (True, True)
    # without no_rope_layers: Llama4TextConfig's rule, every 4th layer NoPE, the RoPE layers chunked
    d4 = {**_text_config(num_hidden_layers=4, no_rope_layers=None).to_dict(), "no_rope_layers": None,
          "layer_types": None}
    assert [layouts.attention_config(d4, "c", layer=L, ignore_chunk=True).rope for L in range(4)] == \
        ["interleaved"] * 3 + [None]
    assert [layouts.layer_chunk(d4, "c", L) for L in range(4)] == [C, C, C, None]
    no_norm = layouts.attention_config({**d, "use_qk_norm": False}, "c", layer=0, ignore_chunk=True)
    assert no_norm.qk_norm is None


@pytest.mark.parametrize("change, layer, error, said", [
    ({}, 0, NotImplementedError, "chunked_attention"),  # read_hf_config does not apply a chunk
    ({}, None, NotImplementedError, "differs between layers"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, 0, NotImplementedError, "sliding_attention"),
    ({"attention_chunk_size": 0}, 0, ValueError, "attention_chunk_size"),
    ({"use_qk_norm": "yes"}, 0, ValueError, "use_qk_norm"),
    ({"floor_scale": 0}, 1, ValueError, "floor_scale"),
    ({"no_rope_layers": [1, 2]}, 1, ValueError, "no_rope_layers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}, 0,
     NotImplementedError, "partial_rotary_factor"),
    ({"attn_logit_softcapping": 30.0}, 1, NotImplementedError, "attn_logit_softcapping"),
])
def test_what_llama4_s_config_says_otherwise_is_refused_by_name(change, layer, error, said):
    d = {**_text_config().to_dict(), **change}
    with pytest.raises(error, match=said):
        layouts.layer_chunk(d, "c", layer)
        layouts.attention_config(d, "c", layer=layer, ignore_chunk=said != "chunked_attention")


def test_other_models_are_still_refused_for_chunks_and_qk_norm_flags():
    with pytest.raises(ValueError, match=r"attention_chunk_size=4.*use_qk_norm=True"):
        layouts.hf_model({"model_type": "not-llama4", "attention_chunk_size": 4, "use_qk_norm": True}, "c")


# --- the checkpoint -----------------------------------------------------------------------------------------

def _hf_attention(directory, layer: int, x, positions, padding):
    """The saved model's Llama4TextAttention of `layer` on x (float64, eager), with the mask its model builds
    (the chunked layer's create_chunked_causal_mask, the full layer's create_causal_mask, over the 2D padding)
    and, for the temperature, a cache that says it has seen positions[0, 0] tokens."""
    import torch
    import transformers
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask

    model = transformers.Llama4ForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")
    att, config = model.model.layers[layer].self_attn, model.config

    class Seen:  # what the module asks of its cache: the tokens seen (its temperature's offset), keys untouched
        def get_seq_length(self, layer_idx=0):
            return int(positions[0, 0])

        def update(self, k, v, layer_idx, *args, **kwargs):
            return k, v

    xt, ids = torch.from_numpy(x), torch.from_numpy(positions)
    make = create_chunked_causal_mask if config.layer_types[layer] == "chunked_attention" else create_causal_mask
    mask = make(config=config, inputs_embeds=xt, attention_mask=torch.from_numpy(padding.astype(np.int64)),
                past_key_values=None, position_ids=ids)
    with torch.no_grad():
        return att(xt, position_embeddings=model.model.rotary_emb(xt, ids), attention_mask=mask,
                   past_key_values=Seen())[0].numpy()


@pytest.mark.parametrize("layer, prefix", [(0, P0), (1, P1)])
def test_the_layer_read_computes_what_the_saved_model_does(layer, prefix, saved):
    read = checkpoint.load_layer(saved, "hf-llama", prefix)
    assert read.chunk == (C if layer == 0 else None)
    case = checkpoint.cases(read.config, 2, 5, 5, chunk=read.chunk)[0]
    assert case.mask == ("chunk" if layer == 0 else "causal")
    x = case.draw_inputs(0, read.state_dict)
    if layer == 1:  # the cache slots, alike in every row, across floor((p + 1) / 2)'s steps
        assert (x.positions == x.positions[:1]).all() and np.ptp(np.floor((x.positions + 1) / FLOOR)) >= 2
    else:  # a llama3 RoPE: the positions past its original context
        assert x.positions.min() >= LLAMA3["original_max_position_embeddings"]
    padding = np.ones((case.shape.B, case.shape.S), bool)
    theirs = _hf_attention(saved, layer, x.query, x.positions, padding)
    c = read.config
    kw = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta,
              rope_scaling=c.rope_scaling, qk_norm=c.qk_norm, qk_norm_eps=c.qk_norm_eps,
              attn_temperature_tuning=c.attn_temperature_tuning, floor_scale=c.floor_scale, attn_scale=c.attn_scale)
    ours = reference.forward(x.state_dict, x.query, x.key, x.value, x.keep, **kw, **x.structure_kw, **x.position_kw)
    assert compare(theirs, ours.output, BAR).passed
    # the same weights read as a plain Llama layer (rotate-half, no chunk, no norm, no temperature) are not it
    plain = reference.forward(x.state_dict, x.query, x.key, x.value, None, num_heads=N, num_kv_heads=K, rope="half",
                              rope_theta=c.rope_theta, is_causal=True, positions=x.positions, key_positions=x.positions)
    assert not compare(theirs, plain.output, BAR).passed


def _rows(path):
    return json.loads(path.read_text())["rows"]


@pytest.mark.parametrize("prefix", [P0, P1])
def test_mha_parity_judges_both_layers_green(prefix, saved, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(saved), "--prefix", prefix, "--no-progress", "--impls", "torch", "--dtypes",
                 "float32", "--json", str(out)]) == 0
    rows = _rows(out)
    ran = {(r["check"], r["impl"]) for r in rows if r["status"] == "pass"}
    assert all(r["status"] in ("pass", "skip") for r in rows)
    assert {("forward", "torch"), ("gradient", "torch")} <= ran
    if prefix == P0:  # the chunk binds at S = 5: chunked cases, the leak check across the chunk, the chunked decode
        assert {r["case"] for r in rows} >= {"checkpoint/chunk/nan", "checkpoint/chunk+padding/uniform"}
        assert {("leak", "torch"), ("peers", "hf-llama4"), ("decode", "torch")} <= ran
        decoded = {r["case"] for r in rows if r["check"] == "decode" and r["impl"] == "torch"}
        assert decoded == {"checkpoint/chunk/nan"}
        skipped = [r for r in rows if r["check"] == "decode" and r["impl"] == "hf-llama4-decode"]
        assert skipped and all(r["status"] == "skip" and "given no chunk" in r["message"] for r in skipped)
        assert "attention_chunk_size=3" in capsys.readouterr().out
    else:
        assert {("decode", "torch"), ("peers", "hf-llama4-nope")} <= ran


def test_a_chunk_longer_than_the_tokens_gives_the_causal_cases_and_decodes(tmp_path_factory, tmp_path):
    """attention_chunk_size 16 >= S = 5: the chunk keeps every causal key, so the RoPE layer gets the causal
    cases and the decode check, ours and transformers' Llama4TextAttention with a DynamicCache (hf-llama4-decode)."""
    directory = _save(tmp_path_factory.mktemp("llama4-c16"), attention_chunk_size=16)
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(directory), "--prefix", P0, "--no-progress", "--impls", "torch", "--checks",
                 "decode", "--dtypes", "float32", "--json", str(out)]) == 0
    rows = _rows(out)
    assert {r["case"] for r in rows} == {"checkpoint/causal/nan"}
    ran = [r for r in rows if r["status"] != "skip"]
    assert all(r["status"] == "pass" for r in ran) and {r["impl"] for r in ran} >= {"torch", "hf-llama4-decode"}
    assert {r["quantity"] for r in ran if r["impl"] == "hf-llama4-decode"} >= {"prefill", "step 1", "step 2"}


def test_its_weight_file_beside_config_json_is_read_the_same(saved, capsys):
    """A single file takes its layer's RoPE (interleaved pairs), norm and chunk from the config.json beside it."""
    assert main(["--checkpoint", str(saved / "model.safetensors"), "--prefix", P0, "--heads", str(N), "--rope-theta",
                 "500", "--no-progress", "--impls", "torch", "--checks", "forward", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "rope=interleaved" in out and "qk_norm=l2" in out and "chunk=3" in out
    nope = ["--checkpoint", str(saved / "model.safetensors"), "--prefix", P1, "--heads", str(N), "--no-progress",
            "--impls", "torch", "--checks", "forward", "--dtypes", "float32"]
    assert main(nope) == 0 and "rope=None" in capsys.readouterr().out  # a NoPE layer takes no --rope-theta
    assert main([*nope, "--rope-theta", "500"]) == 2 and "NoPE layer" in capsys.readouterr().err


# --- the case kind, the peers, the slips --------------------------------------------------------------------

def test_the_chunked_case_binds_and_a_structured_implementation_without_chunk_skips():
    from parity.harness.matrix import LLAMA4_CHUNK, draw_inputs, modern_matrix
    from parity.impls import Implementation

    case = next(c for c in modern_matrix() if c.mask == "chunk")
    assert case.name == "chunked-llama4/chunk/nan" and case.structured and case.train and case.peers
    x = draw_inputs(case, 0)
    causal = np.tril(np.ones((case.shape.T, case.shape.S), bool))
    assert LLAMA4_CHUNK < case.shape.T and (x.keep[:, 0] != causal).any()  # the chunk takes keys the causal mask keeps
    from types import SimpleNamespace

    from parity.harness.leak import perturbed_tokens

    pq, pk, where = perturbed_tokens(SimpleNamespace(case=case, x=x))  # the leak check perturbs the first chunk
    assert pq[:, :LLAMA4_CHUNK].all() and not pq[:, LLAMA4_CHUNK:].any() and (pk == pq).all() and "chunk" in where
    report = run(cases="modern", case_filter=(case.name,), dtypes=("float32",), checks=("forward", "leak"),
                 impls=("torch",), device="cpu")  # ours across the chunk, bit for bit (gradients: test_modern_cases)
    assert {(r.check, r.status) for r in report.rows if r.impl == "torch"} == {("forward", "pass"), ("leak", "pass")}
    old = Implementation("old-structured", "torch", "m:f", structured=True)
    assert "takes_chunk" in old.unsupported("float32", cross=False, mask="chunk")
    assert old.unsupported("float32", cross=False, mask="window") is None
    assert Implementation("dense", "torch", "m:f").unsupported("float32", cross=False, mask="chunk") is None
    with pytest.raises(ValueError, match="structured=True"):
        Implementation("bad", "torch", "m:f", takes_chunk=True)


def test_the_chunked_case_decodes_across_a_chunk_and_a_chunk_slip_in_the_cache_is_red(monkeypatch):
    """chunked-llama4 decodes (a prompt of 4, steps at positions crossing a chunk boundary in every row): ours green,
    the protocol decoders (given no chunk) skip saying so; the torch caches' chunk keep-mask counted one position
    late is red at the scores from the prompt on, in torch and torch-static and where jax's prompt is continued by
    torch, while jax-jit (and torch's prompt continued by jax, whose write is not the mask) stays green."""
    import torch

    import mha_torch.kv_cache as kv
    from parity.harness import decode
    from parity.harness.matrix import Case, LLAMA4_CHUNK, LLAMA4_SHAPES, modern_matrix

    case = next(c for c in modern_matrix() if c.mask == "chunk")
    assert case.decode and case.chunk == LLAMA4_CHUNK
    sch = decode.schedule(case.shape)
    pos = reference.decode_positions(sch.starts, sch.tokens)  # (B, T)
    first_step = pos[:, sch.prompt - 1:]  # the prompt's last token and the steps, per row
    crosses = (first_step[:, 1:] // LLAMA4_CHUNK != first_step[:, :-1] // LLAMA4_CHUNK).any(axis=1)
    assert crosses.all() and len(set(sch.starts.tolist())) == case.shape.B  # every row, each padded apart
    with pytest.raises(ValueError, match="a decode case"):
        Case(LLAMA4_SHAPES["chunked-llama4"], "chunk", "nan", chunk=3, padded=True, decode=True)

    green = run(cases=[case], checks=("decode",), dtypes=("float32",), impls=("torch", "torch-static"), device="cpu")
    ours = [r for r in green.rows if r.impl in ("torch", "torch-static")]
    assert len(ours) == 10 and all(r.status == "pass" for r in ours)
    hf = [r for r in green.rows if r.impl == "hf-llama4-decode"]
    assert hf and all(r.status == "skip" and decode.CHUNK_DECODER_SKIP in r.message for r in hf)

    keep_mask = kv.KVCache.keep_mask

    def late(self, T, chunk=None):  # the chunks counted one position late (from starts[b] + 1)
        if chunk is None:
            return keep_mask(self, T)
        s, last = torch.arange(self.capacity), self.slots(T)[:, None, :, None]
        start = self.starts[:, None, None, None] + 1
        return keep_mask(self, T) & (torch.div(s - start, chunk, rounding_mode="floor")
                                     == torch.div(last - start, chunk, rounding_mode="floor"))

    monkeypatch.setattr(kv.KVCache, "keep_mask", late)
    report = run(cases=[case], checks=("decode",), dtypes=("float32",), impls=("torch", "torch-static", "jax-jit"),
                 device="cpu")
    calls = ("prefill", "step 1", "step 2", "step 3")
    for impl, red in (("torch", calls), ("torch-static", calls), ("jax->torch", calls[1:]), ("jax-jit", ()),
                      ("torch->jax", ())):
        rows = {r.quantity: r for r in report.rows if r.impl == impl and r.quantity in calls}
        assert set(rows) == set(calls[1:] if "->" in impl else calls), impl  # a continuation has the steps only
        assert {q for q, r in rows.items() if r.status != "pass"} == set(red), impl
        assert all(rows[q].status == "fail" and rows[q].stage == "scores" for q in red), impl


def test_a_chunked_checkpoint_layer_gets_its_decode_case_and_the_decode_check(saved):
    """T == S: checkpoint/chunk/nan decodes (not its padded twin); T < S: checkpoint-decode/chunk/nan over the S
    tokens; a sliding window still has none; the default checks of a binding chunk hold leak and decode."""
    read = checkpoint.load_layer(saved, "hf-llama", P0)
    same = {c.name: c for c in checkpoint.cases(read.config, 2, 5, 5, decode=True, chunk=read.chunk)}
    assert [n for n, c in same.items() if c.decode] == ["checkpoint/chunk/nan"]
    assert same["checkpoint/chunk/nan"].chunk == C
    fewer = {c.name: c for c in checkpoint.cases(read.config, 2, 3, 5, decode=True, chunk=read.chunk)}
    own = fewer["checkpoint-decode/chunk/nan"]
    assert own.decode and own.chunk == C and (own.shape.T, own.shape.S, own.shape.cross) == (5, 5, False)
    assert not any(c.decode for n, c in fewer.items() if n != own.name)
    assert not any(c.decode for c in checkpoint.cases(read.config, 2, 3, 5, decode=True, chunk=read.chunk,
                                                      redraw=("q_proj.weight",)) if c.name.startswith("checkpoint-r"))
    assert not any(c.decode for c in checkpoint.cases(read.config, 2, 5, 5, decode=True, sliding_window=3))
    assert {"leak", "decode"} <= set(checkpoint.CHUNK_CHECKS)


def test_the_peer_builds_transformers_chunked_mask_and_refuses_what_it_cannot_be_given():
    """hf-llama4 on the chunked case's draw equals the oracle; told another chunk, it does not (its mask is
    transformers' own, from the chunk it is given); the NoPE peer refuses positions that differ between rows."""
    import dataclasses

    import torch

    from parity.harness.matrix import draw_inputs, modern_matrix
    from parity.impls.registry import builtin

    case = next(c for c in modern_matrix() if c.mask == "chunk")
    x = draw_inputs(case, 0)
    fn = builtin("hf-llama4").make({k: v.astype(np.float32) for k, v in x.state_dict.items()}, case.shape.N,
                                   "uniform", torch.device("cpu"), case.problem)
    q = torch.from_numpy(x.query.astype(np.float32))
    pos = {k: torch.from_numpy(v) for k, v in x.position_kw.items()}
    want = reference.forward(x.state_dict, x.query, x.key, x.value, None, num_heads=case.shape.N,
                             num_kv_heads=case.shape.K, rope="interleaved", rope_theta=case.shape.rope_theta,
                             qk_norm="l2", qk_norm_eps=case.shape.qk_norm_eps, **x.structure_kw, **x.position_kw)
    for chunk, same in ((case.chunk, True), (case.chunk + 1, False)):
        got = fn(q, q, q, None, **pos, **{**x.structure_kw, "chunk": chunk}).numpy()
        assert compare(got, want.output, BAR).passed == same, chunk
    nope = next(c for c in modern_matrix() if c.shape.name == "nope-llama4")
    xn = draw_inputs(nope, 0)
    fn = builtin("hf-llama4-nope").make({k: v.astype(np.float32) for k, v in xn.state_dict.items()}, nope.shape.N,
                                        "uniform", torch.device("cpu"), dataclasses.replace(nope.problem))
    qn = torch.from_numpy(xn.query.astype(np.float32))
    with pytest.raises(ValueError, match="cache slots"):
        fn(qn, qn, qn, None, positions=torch.from_numpy(xn.positions))


# (slip, the stage it is named at) on the RoPE cases l2-llama4 and chunked-llama4; "norm-before-rope" computes
# the same function (RoPE keeps each head's sum of squares) and passes.
SLIPS = {"chunk-off-by-one": "scores", "temperature-on-rope-layers": "scores", "norm-over-projection": "q_rot"}


def test_the_port_is_green_and_each_slip_red_at_its_stage():
    from parity.examples import llama4_torch

    impls = (llama4_torch.port, *llama4_torch.PLANTED.values())
    report = run(cases="modern", case_filter=("*llama4/*",), dtypes=("float64", "float32"), checks=("forward",),
                 impls=impls, device="cpu")
    rows = [r for r in report.rows if r.reference == "oracle" and r.quantity == "output" and r.status != "skip"]
    by = {}
    for r in rows:
        by.setdefault(r.impl.removeprefix("llama4-torch-"), {})[(r.case.split("/")[0], r.dtype)] = r
    assert len(by["port"]) == 6 and all(r.status == "pass" for r in by["port"].values())
    assert all(r.status == "pass" for r in by["norm-before-rope"].values())
    for slip, stage in SLIPS.items():
        red = {k: r for k, r in by[slip].items() if r.status != "pass"}
        cases = {"chunked-llama4"} if slip == "chunk-off-by-one" else {"chunked-llama4", "l2-llama4"}
        assert {k[0] for k in red} == cases, (slip, sorted(red))
        for r in red.values():  # measured: margins 9.6e3 (float32) .. 9.5e10 (float64)
            assert r.status == "fail" and r.stage == stage and r.margin > 1e3, (slip, r)
        assert all(r.status == "pass" for k, r in by[slip].items() if k not in red)  # the NoPE case: no norm
