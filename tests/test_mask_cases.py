"""The harness's structured mask cases (packed documents, sliding windows), their leak rows, the
peers that take those masks themselves, and `--checkpoint` on Mistral and Mixtral directories.

- The cases exist (one packed and one window case in the default matrix, every one in `--cases masks`)
  and say what they are: 2-3 documents per row in layouts that differ, RoPE positions restarting with
  each document, a window smaller than T, padding ANDed in one case.
- Ours are green on them in float64 and float32 (forward, gradient, leak), taking the structure as
  keywords; ports that take the keywords and drop one (the window, the documents) are red, and the
  one that drops the documents is red in the leak rows too.
- Peers: hf-mistral (the mask MistralModel builds), jax-dpa-masks (dot_product_attention's own
  arguments) and torch-sdpa-gqa (the dense mask) pass; what they cannot express is measured here
  (jax's top-left window, query_seq_lengths zeroing, HF's packing found from position_ids).
- `--checkpoint` on a tiny Mistral directory whose window is smaller than S is green, and red for a
  port that ignores the window; a Mixtral directory's attention is Mistral's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_spec import VARIANT_FEATURES, AttentionConfig
from parity import reference
from parity.harness import run
from parity.harness.matrix import MASK_SHAPES, Case, default_matrix, draw_inputs, mask_matrix
from parity.impls import Implementation, builtin
from parity.implementation import STRUCTURED_MASKS, RunsOn

OURS = ("torch", "torch-fused", "jax-jit", "jax-fused")
PREFIX = "model.layers.0.self_attn."


def _dropping(name: str, *dropped: str):
    """Our torch module declaring structured=True that drops structured keywords: a port that takes them
    and ignores them (its intermediates dropped alike, so the failing stage is named)."""
    base = builtin("torch")

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)

        def wrap(f):
            def call(params, q, k, v, mask, **kws):
                return f(params, q, k, v, mask, **{n: a for n, a in kws.items() if n not in dropped})

            return call

        wrapped = wrap(fn)
        wrapped.intermediates = wrap(fn.intermediates)
        return wrapped

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=VARIANT_FEATURES, structured=True)


IGNORES_WINDOW = _dropping("ignores-window", "window")
IGNORES_DOCUMENTS = _dropping("ignores-documents", "segment_ids", "key_segment_ids")


# ---------------------------------------------------------------- the cases


def test_the_default_matrix_has_one_packed_and_one_window_case_and_the_masks_set_has_them_all():
    default = [c for c in default_matrix() if c.structured]
    assert sorted(c.mask for c in default) == ["packed", "window"]
    assert all(c.mask in c.name and c.peers for c in default)
    masks = mask_matrix()
    assert {c.name for c in default} <= {c.name for c in masks}
    assert {c.mask for c in masks} == set(STRUCTURED_MASKS) and all(c.structured for c in masks)
    assert [c.name for c in masks if c.padded] == ["window-mistral/window+padding/uniform"]
    assert any(c.alignment == "bottom-right" and c.shape.T < c.shape.S for c in masks)
    for c in masks:
        if c.mask == "window":
            assert c.window[0] + 1 < c.shape.T and c.window[1] == 0  # the window is smaller than T: it masks
    from parity.harness.runner import RunRequest, plan_run

    assert [c.name for c in plan_run(RunRequest(case_filter=("masks",), device="cpu")).cases] == [
        c.name for c in masks]


def test_packed_rows_have_two_or_three_documents_in_layouts_of_their_own_and_positions_that_restart():
    case = next(c for c in default_matrix() if c.mask == "packed")
    x = draw_inputs(case, 0)
    seg = x.structure_kw["segment_ids"]
    assert x.structure_kw["is_causal"] is True and seg.shape == (case.shape.B, case.shape.T)
    documents = [len(np.unique(row)) for row in seg]
    assert set(documents) == {2, 3} and len({row.tobytes() for row in seg}) == len(seg)
    for row, pos in zip(seg, x.positions):  # each document's positions 0, 1, 2, ...
        for d in np.unique(row):
            assert pos[row == d].tolist() == list(range((row == d).sum()))
    assert np.array_equal(x.positions, x.key_positions)
    # The dense keep-mask every implementation without `structured` gets: causal within each document.
    expected = (seg[:, None, :, None] == seg[:, None, None, :]) & np.tril(np.ones((8, 8), bool))
    assert np.array_equal(x.keep, expected)


def test_the_window_case_masks_the_keys_before_its_window_and_padding_is_anded():
    plain, padded = (c for c in mask_matrix() if c.shape.name == "window-mistral")
    x, xp = draw_inputs(plain, 0), draw_inputs(padded, 0)
    assert x.structure_kw == {"is_causal": True, "window": (3, 0)} and x.padding is None
    t, s = np.arange(8)[:, None], np.arange(8)[None, :]
    assert np.array_equal(x.keep[0, 0], (s <= t) & (s >= t - 3))
    assert np.array_equal(xp.keep, reference.structured_keep(8, 8, **xp.structure_kw) & xp.padding)
    assert not xp.padding[-1].any() and (~xp.keep.any(axis=-1)).any()  # a row of padding only: fully masked rows


def test_bad_structured_cases_and_runs_on_patterns_are_named():
    shape = MASK_SHAPES["window-mistral"]
    with pytest.raises(ValueError, match="window= is given with mask 'window'"):
        Case(shape, "window")
    with pytest.raises(ValueError, match="window= is given"):
        Case(shape, "causal", window=(3, 0))
    with pytest.raises(ValueError, match="padded=True combines padding with a structured mask"):
        Case(shape, "causal", padded=True)
    with pytest.raises(ValueError, match="alignment='middle'"):
        Case(shape, "window", window=(3, 0), alignment="middle")
    with pytest.raises(ValueError, match="window left must be a non-negative int"):
        Case(shape, "window", window=(-1, 0))
    assert {r.mask for r in RunsOn.parse("self/[pw]*/float32")} == {"padding", "packed", "window"}
    with pytest.raises(ValueError, match="its mask 'pack' is not"):
        RunsOn.parse("self/pack/*")
    with pytest.raises(TypeError, match="structured must be a bool"):
        Implementation("x", "torch", lambda *a, **k: None, structured="yes")
    with pytest.raises(ValueError, match="a decoder .* takes no structured masks"):
        Implementation("x", "torch", lambda *a, **k: None, decode=True, structured=True)


def test_a_structured_implementation_gets_the_keywords_and_only_the_padding_as_its_mask():
    """What reaches fn: the case's structure as keywords (segment ids as int64 tensors) and the padding alone;
    an implementation without `structured` gets the whole mask, dense."""
    import torch

    seen = {}

    def factory(sd, num_heads, **kw):
        def fn(q, k, v, mask, **kws):
            seen["call"] = (mask, kws)
            return torch.zeros_like(q)

        return fn

    from parity.harness.checks import Unit
    from parity.impls.torch_impls import TorchRunner

    case = next(c for c in mask_matrix() if c.padded)
    x = draw_inputs(case, 0).in_dtype(np.float32)
    runners = {"torch": TorchRunner("cpu")}
    for structured in (True, False):
        impl = Implementation(f"spy-{structured}", "torch", factory, uses_params=False, variants=VARIANT_FEATURES,
                              structured=structured)
        unit = Unit(case, "float32", x, runners)
        unit.runner(impl).forward(unit.built(impl, "uniform"), *unit.inputs())
        mask, kws = seen["call"]
        if structured:
            assert {n: v for n, v in kws.items() if n in ("is_causal", "window")} == {"is_causal": True, "window": (3, 0)}
            assert np.array_equal(mask.numpy(), x.padding)
        else:
            assert set(kws) == {"positions", "key_positions"} and np.array_equal(mask.numpy(), x.keep)


# ---------------------------------------------------------------- ours green, planted ports red


@pytest.fixture(scope="module")
def mask_report():
    return run(cases="masks", checks=("forward", "gradient", "leak"), dtypes=("float64", "float32"),
               impls=(*OURS, IGNORES_WINDOW, IGNORES_DOCUMENTS), device="cpu")


def test_ours_are_green_on_every_mask_case_with_leak_rows(mask_report):
    ours = [r for r in mask_report.rows if r.impl in OURS]
    assert [r for r in ours if r.status in ("fail", "error")] == []
    for case in mask_matrix():
        for dtype in ("float64", "float32"):
            if dtype not in case.dtypes:
                continue
            for impl in OURS:
                got = {(r.check, r.quantity) for r in ours
                       if r.case == case.name and r.dtype == dtype and r.impl == impl and r.status == "pass"}
                assert {("forward", "output"), ("gradient", "d_inputs"), ("leak", "output"), ("leak", "d_inputs")} <= got, \
                    (case.name, dtype, impl)
    leak = [r for r in ours if r.check == "leak" and r.status == "pass"]
    assert all(r.max_abs_err == 0.0 and "bit for bit unchanged" in r.message for r in leak)


def test_a_port_that_ignores_the_window_is_red_at_the_weights(mask_report):
    rows = [r for r in mask_report.rows if r.impl == "ignores-window" and r.check == "forward" and r.reference == "oracle"]
    window = {r.status for r in rows if "/window" in r.case}
    assert window == {"fail"}
    assert {r.stage for r in rows if r.status == "fail"} == {"weights"}  # the scores are right where kept
    assert {r.status for r in rows if "/packed/" in r.case} == {"pass"}  # nothing to ignore there
    assert any(r.status == "fail" for r in mask_report.rows if r.impl == "ignores-window" and r.check == "leak")


def test_a_port_that_ignores_the_documents_leaks_and_the_leak_rows_say_so(mask_report):
    packed = [r for r in mask_report.rows if r.impl == "ignores-documents" and "/packed/" in r.case]
    assert {r.status for r in packed if r.check == "forward" and r.reference == "oracle"} == {"fail"}
    leak = [r for r in packed if r.check == "leak" and r.quantity == "output"]
    assert leak and {r.status for r in leak} == {"fail"}
    assert all("the perturbed tokens reach what the mask keeps them from" in r.message and r.max_abs_err > 0.01
               for r in leak)
    assert {r.status for r in mask_report.rows if r.impl == "ignores-documents" and "/window" in r.case
            and r.status != "skip"} == {"pass"}


# ---------------------------------------------------------------- peers


MASK_PEERS = ("hf-mistral", "jax-dpa-masks", "torch-sdpa-gqa", "hf-llama")  # what the tests below read


@pytest.fixture(scope="module")
def peer_report():
    """The peers check on the mask cases, for the peers these tests read alone (every other peer has
    its own test file; the Pallas peers' interpret-mode calls would cost most of this run)."""
    from parity.harness import runner as harness_runner

    select = harness_runner.select
    cases = [c for c in mask_matrix() if c.peers]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
            i for i in select(role, *a, **kw) if role != "peer" or i.name in MASK_PEERS))
        return run(cases=cases, checks=("peers",), dtypes=("float64", "float32"), device="cpu")


@pytest.mark.parametrize("peer", ["hf-mistral", "jax-dpa-masks", "torch-sdpa-gqa"])
def test_the_peers_that_take_structured_masks_pass_on_packed_and_window_cases(peer_report, peer):
    rows = [r for r in peer_report.rows if r.impl == peer]
    assert rows and [r for r in rows if r.status in ("fail", "error")] == []
    for name in ("packed-llama/packed/nan", "window-mistral/window/nan", "window-mistral/window+padding/uniform"):
        got = {r.quantity for r in rows if r.case == name and r.dtype == "float32" and r.status == "pass"}
        assert {"output"} <= got and (got & {"d_input", "d_inputs"}), (peer, name, got)


def test_hf_mistral_builds_the_mask_hf_llama_is_given_dense(peer_report):
    """The mask MistralModel builds (sliding_window, packing from position_ids, the 2D padding) is the case's:
    MistralAttention's output is hf-llama's with our dense mask, to the bit (the same eager maths)."""
    def errs(impl):
        return {(r.case, r.dtype): r.max_abs_err for r in peer_report.rows
                if r.impl == impl and r.reference == "oracle" and r.quantity == "output" and r.status == "pass"}

    mistral = errs("hf-mistral")
    assert len(mistral) >= 3 and mistral == {k: v for k, v in errs("hf-llama").items() if k in mistral}


def test_hf_mistral_skips_float64_windows_and_jax_dpa_masks_float64(peer_report):
    skip = {(r.impl, r.case, r.dtype) for r in peer_report.rows if r.status == "skip"}
    assert ("hf-mistral", "window-mistral/window+padding/uniform", "float64") in skip
    assert ("jax-dpa-masks", "window-mistral/window+padding/uniform", "float64") in skip


def test_hf_mistral_builds_the_window_from_sliding_window():
    from parity.peers.hf import mistral_sliding_window

    assert mistral_sliding_window(is_causal=True, window=(3, 0)) == 4
    assert mistral_sliding_window(is_causal=True, segment_ids=np.zeros((1, 3), np.int64)) is None
    with pytest.raises(ValueError, match="always causal"):
        mistral_sliding_window(window=(3, 0))
    with pytest.raises(ValueError, match=r"window \(W - 1, 0\); got window \(3, 1\)"):
        mistral_sliding_window(is_causal=True, window=(3, 1))


def test_jax_dot_product_attention_aligns_its_window_top_left():
    """Measured: is_causal and local_window_size keep s <= t (top-left); with T < S a decoder's chunk
    (bottom-right) is another mask, so jax-dpa-masks refuses it instead of disagreeing."""
    import jax

    rng = np.random.default_rng(0)
    T, S, H = 3, 5, 4
    q, k, v = rng.standard_normal((1, T, 1, H)), rng.standard_normal((1, S, 1, H)), rng.standard_normal((1, S, 1, H))

    def dense(keep):
        s = np.where(keep, np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bnts,bsnh->btnh", w / w.sum(-1, keepdims=True), v)

    got = np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(1, 0), implementation="xla"))
    top_left = np.abs(got - dense(reference.structured_keep(T, S, is_causal=True, window=(1, 0)))).max()
    bottom_right = np.abs(got - dense(reference.structured_keep(T, S, is_causal=True, window=(1, 0),
                                                                alignment="bottom-right"))).max()
    assert top_left < 1e-6 and bottom_right > 0.1  # measured 8.5e-08 (float32 softmax) and 2.05
    from parity.peers.jax_dpa import dpa_masks

    config = AttentionConfig(4, 1)
    from mha_spec import Problem

    fn = dpa_masks(None, 1, dtype="float64", device=None, problem=Problem(config, 1, T, S))
    params = {n: np.eye(4) if n.endswith("weight") else np.zeros(4) for n in config.weight_shapes()}
    with pytest.raises(ValueError, match="top-left"):
        fn(params, np.zeros((1, T, 4)), np.zeros((1, S, 4)), np.zeros((1, S, 4)), None, is_causal=True,
           window=(1, 0), alignment="bottom-right")


def test_query_seq_lengths_zeroes_the_padded_queries_while_empty_key_rows_are_uniform():
    """Measured: with query_seq_lengths a padded query's output is 0 ("zero"), with key_value_seq_lengths = 0
    it is the mean of V ("uniform"): two policies in one call, so jax-dpa-masks passes key lengths only."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 1, 4)) for _ in range(3))
    out = np.asarray(jax.nn.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([2, 4], jnp.int32),
                                                  key_value_seq_lengths=jnp.array([2, 0], jnp.int32)))
    assert np.all(out[0, 2:] == 0)
    np.testing.assert_allclose(out[1], np.broadcast_to(v[1].mean(axis=0), out[1].shape), atol=1e-6)


def _mistral_mask(attention_mask, position_ids, window=4):
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from parity.peers.hf import hf_mistral_config

    config = hf_mistral_config(AttentionConfig(8, 2, num_kv_heads=1, qkv_bias=False, out_bias=False, rope="half",
                                               rope_theta=1e6), window)
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    m = make(config=config, inputs_embeds=torch.zeros(1, position_ids.shape[1], 8), attention_mask=attention_mask,
             past_key_values=None, position_ids=position_ids)
    return (m == 0).numpy()[0, 0]


def test_hf_finds_documents_in_position_ids_when_no_attention_mask_is_given():
    """Measured (transformers 5.23): without an attention_mask, positions that do not step by 1 start a new
    "document" (find_packed_sequence_indices), so skipped-token positions split a sequence; generate's
    all-ones mask keeps the window. And with a mask, packing is off: a padded packed batch attends across
    documents, which hf-mistral refuses."""
    import torch

    pos = torch.tensor([[3, 4, 6, 7, 8, 10]])
    window = reference.structured_keep(6, 6, is_causal=True, window=(3, 0))[0, 0]
    assert np.array_equal(_mistral_mask(torch.ones(1, 6, dtype=torch.int64), pos), window)
    split = _mistral_mask(None, pos)
    assert not split[2, :2].any() and not split[5, :5].any()  # "documents" [3, 4], [6, 7, 8], [10]
    packed = _mistral_mask(torch.tensor([[1, 1, 1, 1, 1, 0]]), torch.tensor([[0, 1, 2, 0, 1, 2]]), window=None)
    assert packed[3, :3].all()  # the second document attends the first
    from parity.peers.hf import hf_mistral
    from mha_spec import Problem

    config = AttentionConfig(8, 2, num_kv_heads=1, qkv_bias=False, out_bias=False, rope="half", rope_theta=1e6)
    sd = {n: np.zeros(s) for n, s in config.weight_shapes().items()}
    fn = hf_mistral(sd, 2, dtype="float32", device="cpu", problem=Problem(config, 1, 6, 6))
    x = torch.zeros(1, 6, 8)
    with pytest.raises(ValueError, match="packed documents with padding cannot be expressed"):
        fn(x, x, x, torch.ones(1, 6, 6, dtype=torch.bool), positions=torch.tensor([[0, 1, 2, 0, 1, 2]]),
           key_positions=torch.tensor([[0, 1, 2, 0, 1, 2]]), is_causal=True,
           segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))


# ---------------------------------------------------------------- --checkpoint: Mistral and Mixtral


def _save(tmp_path_factory, name, window, **extra):
    import torch
    import transformers

    torch.manual_seed(0)
    kw = dict(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=16,
              vocab_size=11, rope_theta=500.0, max_position_embeddings=64, sliding_window=window)
    config, model = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                     "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[name]
    path = tmp_path_factory.mktemp(name)
    model(config(**kw, **extra)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return _save(tmp_path_factory, "mistral", 3)  # S = 5 tokens at the default shape: the window binds


def _cli(tmp_path, *args):
    from parity.cli import main

    out = tmp_path / "r.json"
    code = main([*args, "--no-progress", "--json", str(out)])
    return code, json.loads(out.read_text())


def test_checkpoint_of_a_mistral_directory_applies_its_window_and_passes(mistral_dir, tmp_path, capsys):
    code, rep = _cli(tmp_path, "--checkpoint", str(mistral_dir), "--prefix", PREFIX, "--dtypes", "float32",
                     "--impls", "torch,jax-jit")
    assert code == 0
    assert "sliding_window=3" in capsys.readouterr().out
    assert rep["environment"]["checkpoint_sliding_window"] == 3
    rows = rep["rows"]
    assert {r["case"] for r in rows} - {"*"} == {"checkpoint/window/nan", "checkpoint/window+padding/uniform"}
    passed = {(r["case"], r["impl"], r["check"]) for r in rows if r["status"] == "pass"}
    for case in ("checkpoint/window/nan", "checkpoint/window+padding/uniform"):
        for impl, check in (("torch", "forward"), ("jax-jit", "gradient"), ("torch", "leak"), ("hf-mistral", "peers"),
                            ("jax-dpa-masks", "peers")):
            assert (case, impl, check) in passed, (case, impl, check)


def test_checkpoint_with_a_port_that_ignores_the_window_is_red(mistral_dir, tmp_path):
    code, rep = _cli(tmp_path, "--checkpoint", str(mistral_dir), "--prefix", PREFIX, "--dtypes", "float32",
                     "--impls", "torch", "--checks", "forward", "--impl", "tests.test_mask_cases:IGNORES_WINDOW")
    assert code == 1
    bad = [r for r in rep["rows"] if r["impl"] == "ignores-window" and r["reference"] == "oracle"]
    assert bad and {r["status"] for r in bad} == {"fail"} and {r["stage"] for r in bad} == {"weights"}
    assert {r["status"] for r in rep["rows"] if r["impl"] == "torch"} == {"pass"}


def test_a_window_at_least_s_keeps_the_causal_cases_and_mixtral_attention_is_mistrals(tmp_path_factory, tmp_path):
    wide = _save(tmp_path_factory, "mistral", 8)  # 8 >= S = 5: the window keeps every causal key
    code, rep = _cli(tmp_path, "--checkpoint", str(wide), "--prefix", PREFIX, "--dtypes", "float32", "--impls", "torch",
                     "--checks", "forward")
    assert code == 0 and {r["case"] for r in rep["rows"]} == {"checkpoint/causal/nan", "checkpoint/padding/uniform"}
    mixtral = _save(tmp_path_factory, "mixtral", 3, num_local_experts=2, num_experts_per_tok=1)
    code, rep = _cli(tmp_path, "--checkpoint", str(mixtral), "--prefix", PREFIX, "--dtypes", "float32", "--impls",
                     "torch", "--checks", "forward,peers")
    assert code == 0 and rep["environment"]["checkpoint_sliding_window"] == 3
    assert any(r["impl"] == "hf-mistral" and r["status"] == "pass" for r in rep["rows"])
