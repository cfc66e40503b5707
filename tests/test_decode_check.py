"""The decode check (`mha-parity --checks decode`): a prompt and single-token steps with a KV cache,
judged against the oracle's one causal forward.

Our modules are green on the default decode case (float64, float32) and on every modern decode
layer, the prompt run in one framework and the steps in the other included; bugs planted in our
torch module's cache (the padding attended; keys rotated at the slot) are red at the stage they
break, or only where a cache is continued by the other framework; the example decoder is green and
its three planted bugs red naming the first call and, per row, the first position off; a decoder
that raises or breaks the protocol is an error row naming it; the command line exits 0 / 1 / 2;
`--checkpoint` decodes a saved Llama layer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mha_torch.kv_cache
from mha_spec import LLAMA_FEATURES, VARIANT_FEATURES
from parity.cli import main
from parity.examples import decoders
from parity.harness import run
from parity.harness.decode import schedule
from parity.harness.matrix import default_matrix, modern_matrix
from parity.impls import builtin, implementation

OURS = ("torch", "torch-fused", "jax-jit", "jax-fused")
CALLS = ("prefill", "step 1", "step 2", "step 3")
DEFAULT = next(c for c in default_matrix() if c.decode)
CLASSIC = next(c for c in default_matrix() if c.decode and not c.config.features)  # the flax decoding peer's layer
ROPE_FEATURES = {"rope-half", "rope-interleaved"}


# ---------------------------------------------------------------- decoders of the test's own


def _example_step(position_bias=0, keep_last=None, keep_first=None, fail_at=None, drop_feature=False):
    """The example decoder, changed: keep_last: its cache forgets all but the last n tokens; keep_first: a cache
    of n slots that stores nothing more once full (each call still attends the new token: the cache it was
    given and the token); fail_at: it raises at that call; drop_feature: its output loses one feature."""

    def factory(state_dict, num_heads, *, dtype, device, problem):
        inner = decoders.decoder.factory(state_dict, num_heads, dtype=dtype, device=device, problem=problem)
        calls = []

        def fn(p, x_t, cache, position):
            calls.append(1)
            if fail_at is not None and len(calls) == fail_at:
                raise RuntimeError("the cache is full")
            out, cache = inner(p, x_t, cache, position)
            if keep_last is not None and cache.k.shape[2] > keep_last:
                cache = decoders.Cache(cache.k[:, :, -keep_last:], cache.v[:, :, -keep_last:], cache.real[:, -keep_last:])
            if keep_first is not None and cache.k.shape[2] > keep_first:
                cache = decoders.Cache(cache.k[:, :, :keep_first], cache.v[:, :, :keep_first], cache.real[:, :keep_first])
            return (out[..., :-1] if drop_feature else out), cache

        return fn

    return factory


def _user(name, factory, **kw):
    return implementation(name=name, framework="torch", decode=True, variants=VARIANT_FEATURES, **kw)(factory)


# Keeps one token fewer than the prompt: every prompt token still sees its past, the first step does not.
FORGETFUL = _user("forgets-the-oldest", _example_step(keep_last=schedule(DEFAULT.shape).prompt - 1))
# A cache hard-capped at 6 slots: the 7th token still attends the 6 and itself, so only an 8th is wrong.
CAPPED = _user("capped-at-6", _example_step(keep_first=6))
RAISES = _user("raises-at-call-3", _example_step(fail_at=3))
WRONG_SHAPE = _user("drops-a-feature", _example_step(drop_feature=True))


@implementation(name="three-arguments", framework="torch", decode=True, variants=VARIANT_FEATURES)
def three_arguments(state_dict, num_heads, *, dtype, device, problem):
    return lambda p, x_t, cache: (x_t, cache)


USERS = (decoders.decoder, *decoders.planted, FORGETFUL, CAPPED, RAISES, WRONG_SHAPE, three_arguments)


@pytest.fixture(scope="module")
def default_report():
    return run(cases=[DEFAULT], checks=("decode",), dtypes=("float64", "float32"), impls=(*OURS, *USERS), device="cpu")


def _rows(report, impl, dtype=None, case=None):
    return [r for r in report.rows if r.impl == impl and r.check == "decode" and (dtype is None or r.dtype == dtype)
            and (case is None or r.case == case)]


# ---------------------------------------------------------------- ours


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("impl", OURS)
def test_our_modules_pass_every_call_of_the_default_case(default_report, impl, dtype):
    rows = _rows(default_report, impl, dtype)
    assert [r.quantity for r in rows] == [*CALLS, "cache"]
    assert all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
    assert all(r.max_abs_err is not None and r.max_abs_err <= r.atol + r.rtol for r in rows)
    assert "left padding 0,2,1" in rows[0].message  # the rows are left-padded differently


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["torch->jax", "jax->torch"])
def test_a_prompt_in_one_framework_continues_in_the_other(default_report, name, dtype):
    rows = _rows(default_report, name, dtype)
    assert [r.quantity for r in rows] == list(CALLS[1:])  # the steps; the prompt is the other framework's row
    assert all(r.status == "pass" for r in rows), rows
    first = "torch" if name.startswith("torch") else "jax-jit"
    assert f"the prompt by {first}, its cache converted" in rows[0].message


def test_decode_rows_say_which_kernel_ran(default_report):
    """Each call's kernel (torch: the profiler around that call; JAX: the trace of that call's program), as in
    forward rows; a converted prompt's rows name the kernel of the framework that ran the steps; the cache row,
    written before any attention kernel runs, names none."""
    kernels = {name: {r.kernel for r in _rows(default_report, name) if r.status != "skip" and r.quantity != "cache"}
               for name in ("torch", "torch-fused", "jax-jit", "torch->jax", "jax->torch", "pallas-gpu-decode")}
    assert all(r.kernel == "" for name in OURS for r in _rows(default_report, name) if r.quantity == "cache")
    assert kernels["torch"] == kernels["jax->torch"] == {"bmm-softmax (weights)"}
    assert kernels["jax-jit"] == kernels["torch->jax"] == {"einsum"}
    assert len(kernels["torch-fused"]) == 1 and kernels["torch-fused"].pop().startswith("sdpa:")
    assert kernels["pallas-gpu-decode"] == {"pallas (interpret)"}, kernels  # its own kernel, interpreted on a CPU


def test_each_call_names_the_kernel_it_ran(tmp_path, monkeypatch):
    """A kernel table that picks chunked for the prompt and einsum for a single-token step: the prefill row
    names chunked, the step rows einsum (B·K = 6 key/value head blocks; G·T = 8 prompt rows and 2 step rows
    per block, against C = 8 slots)."""
    from mha_jax import kernels

    monkeypatch.setenv("MHA_PARITY_CACHE_DIR", str(tmp_path))
    proc = kernels.processor()
    sch = schedule(DEFAULT.shape)
    G = DEFAULT.shape.N // DEFAULT.shape.K
    assert (DEFAULT.shape.B * DEFAULT.shape.K, G * sch.prompt, G, sch.capacity) == (6, 8, 2, 8)
    rows = [dict(BN=6, T=2, S=8, fastest="einsum", blocks=None), dict(BN=6, T=8, S=8, fastest="chunked", blocks=[4, 4])]
    (tmp_path / "kernels.json").write_text(json.dumps({"schema": kernels.TABLE_SCHEMA, "processors": {
        proc.key: {"device_kind": proc.device_kind, "model": proc.model, "isa": proc.isa, "rows": rows}}}))
    report = run(cases=[DEFAULT], checks=("decode",), dtypes=("float32",), impls=("torch", "jax-fused"), device="cpu")
    fused = {r.quantity: r.kernel for r in _rows(report, "jax-fused")}
    assert fused == {"prefill": "chunked:4x4", "step 1": "einsum", "step 2": "einsum", "step 3": "einsum", "cache": ""}
    assert all(r.status == "pass" for r in _rows(report, "jax-fused"))


def test_eager_jax_is_a_skip_row_saying_why():
    report = run(cases=[DEFAULT], checks=("decode",), dtypes=("float32",), impls=("torch", "jax"), device="cpu")
    rows = _rows(report, "jax")
    assert rows and all(r.status == "skip" and "jitted" in r.message for r in rows)


def test_one_compiled_step_serves_every_position():
    """The JAX decoder traces the prompt once and the single-token step once, whatever the position."""
    import jax

    from parity.harness.matrix import draw_inputs
    from parity.impls.jax_impls import JaxRunner

    x = draw_inputs(DEFAULT, 0).in_dtype(np.float32)
    sch = schedule(DEFAULT.shape)
    dec = JaxRunner(jax.devices("cpu")[0]).decoder(builtin("jax-jit"), x.state_dict, DEFAULT.shape.N, "nan",
                                                   DEFAULT.problem)
    cache = dec.empty(DEFAULT.shape.B, sch.capacity, sch.starts)
    for _, lo, hi in sch.calls():
        _, _, cache = dec.call(cache, x.query[:, lo:hi])
    assert dec.traces == [sch.prompt, 1] and sch.steps == 3
    assert np.asarray(cache.lengths).tolist() == [sch.tokens] * DEFAULT.shape.B


def _with_torch_cache(monkeypatch, attr, fn):
    monkeypatch.setattr(mha_torch.kv_cache.KVCache, attr, fn)
    return run(cases=[DEFAULT], checks=("decode",), dtypes=("float32",), impls=("torch", "torch-fused", "jax-jit"),
               device="cpu")


def test_the_padding_attended_by_our_torch_cache_is_red_at_the_weights(monkeypatch):
    def keep_mask(self, T):  # starts ignored: the left padding is attended
        return torch.arange(self.capacity)[None, None, None, :] <= self.slots(T)[:, None, :, None]

    report = _with_torch_cache(monkeypatch, "keep_mask", keep_mask)
    for impl, stage in (("torch", "weights"), ("torch-fused", "context"), ("jax->torch", "weights")):
        bad = [r for r in _rows(report, impl) if r.quantity in CALLS]
        assert bad and all(r.status == "fail" and r.stage == stage for r in bad), (impl, bad)
        assert all("only the left-padded rows are off" in r.message for r in bad), impl
    # the keys and values it wrote are right: JAX continues its prompt correctly
    assert all(r.status == "pass" for r in _rows(report, "torch->jax") + _rows(report, "jax-jit"))
    assert all(r.status == "pass" for r in _rows(report, "torch") if r.quantity == "cache")


def test_keys_rotated_at_the_slot_pass_alone_and_fail_where_the_other_framework_continues(monkeypatch):
    """Positions counted from the slot, not the row's first real token: RoPE scores see only position
    differences, so torch's own outputs are right, but its cache is not the documented one."""
    report = _with_torch_cache(monkeypatch, "positions", lambda self, T: self.slots(T))
    torch_rows = _rows(report, "torch")
    assert all(r.status == "pass" for r in torch_rows if r.quantity in CALLS)
    cache_row = next(r for r in torch_rows if r.quantity == "cache")
    assert cache_row.status == "fail" and cache_row.stage == "cache" and "keys" in cache_row.message
    to_jax = _rows(report, "torch->jax")
    assert to_jax and all(r.status == "fail" and r.stage == "cache" for r in to_jax)
    to_torch = _rows(report, "jax->torch")
    assert to_torch[0].status == "fail" and to_torch[0].stage == "q_rot"  # the new token rotated at its slot
    assert all(r.status == "pass" for r in _rows(report, "jax-jit"))


@pytest.fixture(scope="module")
def modern_report():
    cases = [c for c in modern_matrix() if c.decode and c is not DEFAULT]
    report = run(cases=cases, checks=("decode",), dtypes=("float32",),
                 impls=("torch", "jax-jit", decoders.decoder, decoders.decoder_position_off_by_one), device="cpu")
    return cases, report


def test_our_modules_and_the_example_pass_every_modern_decode_layer(modern_report):
    cases, report = modern_report
    features = set().union(*(c.config.features for c in cases))
    assert features >= {"grouped", "rope-half", "rope-interleaved", "no-qkv-bias", "no-out-bias"}
    assert any(not c.config.features for c in cases)  # and the classic layer
    for case in cases:
        for impl in ("torch", "jax-jit", "torch->jax", "jax->torch", "decoder-example"):
            rows = _rows(report, impl, case=case.name)
            if impl == "decoder-example" and not case.config.features <= set(LLAMA_FEATURES):
                # the example decodes the Llama-era layers it declares; a layer after Llama is a skip naming it
                assert rows and all(r.status == "skip" and "which it does not run" in r.message for r in rows)
                continue
            assert rows and all(r.status == "pass" for r in rows), (case.name, impl, rows)


def test_a_position_bug_is_red_exactly_on_the_rope_layers(modern_report):
    cases, report = modern_report
    for case in cases:
        rows = _rows(report, "decoder-position-off-by-one", case=case.name)
        red = bool(ROPE_FEATURES & case.config.features)
        want = "skip" if not case.config.features <= set(LLAMA_FEATURES) else "fail" if red else "pass"
        assert rows and all(r.status == want for r in rows), (case.name, rows)


def test_the_peer_decoders_run_where_their_declarations_allow(default_report, modern_report):
    hf = _rows(default_report, "hf-llama-decode")
    if hf and all(r.status == "skip" and "not installed" in r.message for r in hf):
        pytest.skip("transformers is not installed")
    assert [r.quantity for r in hf if r.dtype == "float32"] == list(CALLS)
    assert all(r.status == "pass" for r in hf), hf
    flax = _rows(default_report, "flax-nnx-mha-decode")
    assert flax and all(r.status == "skip" and "no variants" in r.message for r in flax)
    cases, report = modern_report
    classic = next(c for c in cases if not c.config.features)
    flax = _rows(report, "flax-nnx-mha-decode", case=classic.name)
    assert [r.quantity for r in flax] == list(CALLS) and all(r.status == "pass" for r in flax), flax


# ---------------------------------------------------------------- 16-bit


@pytest.fixture(scope="module")
def low_report():
    return run(cases=[DEFAULT], checks=("decode",), dtypes=("bfloat16", "float16"),
               impls=("torch", "jax-jit", "jax-fused", decoders.decoder, decoders.decoder_position_off_by_one), device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_default_decode_case_runs_in_16_bit_at_its_bounds(low_report, dtype):
    """16-bit is what models decode in: the default decode case runs in every dtype, judged three-way
    against the oracle's own maths in the dtype (the forward check's 16-bit bound); ours and the example
    pass, a position bug is red."""
    assert set(DEFAULT.dtypes) >= {"bfloat16", "float16"}
    for impl in ("torch", "jax-jit", "jax-fused", "torch->jax", "jax->torch"):
        rows = _rows(low_report, impl, dtype)
        assert rows and all(r.status == "pass" and r.max_abs_err is not None for r in rows), (impl, rows)
    assert [r.quantity for r in _rows(low_report, "jax-fused", dtype)] == [*CALLS, "cache"]
    assert all(r.status == "pass" for r in _rows(low_report, "decoder-example", dtype))
    bug = _rows(low_report, "decoder-position-off-by-one", dtype)
    assert bug and all(r.status == "fail" for r in bug)


# ---------------------------------------------------------------- the classic layer, longer than 16 tokens


def _flax_is_causal(state_dict, num_heads, *, dtype, device):
    from parity.peers.flax import flax_nnx_decode

    return flax_nnx_decode(state_dict, num_heads, dtype=dtype, device=device, is_causal=True)


FLAX_IS_CAUSAL = implementation(name="flax-is-causal", framework="jax", decode=True, masked_rows="uniform",
                                computes_in="float32")(_flax_is_causal)


@pytest.fixture(scope="module")
def classic_report():
    return run(cases=[CLASSIC], checks=("decode",), dtypes=("float32",), impls=("torch", "jax-jit", CAPPED, FLAX_IS_CAUSAL),
               device="cpu")


def test_the_default_matrix_decodes_a_classic_layer_longer_than_16_tokens(classic_report):
    assert CLASSIC.shape.T > 16 and CLASSIC.shape.rope is None and CLASSIC.shape.K == CLASSIC.shape.N
    assert "float32" in CLASSIC.dtypes
    for impl in ("torch", "jax-jit", "torch->jax", "jax->torch", "flax-nnx-mha-decode"):
        rows = _rows(classic_report, impl)
        assert rows and all(r.status == "pass" for r in rows), (impl, rows)
    assert [r.quantity for r in _rows(classic_report, "flax-nnx-mha-decode")] == list(CALLS)


def test_a_cache_capped_at_6_passes_7_tokens_and_fails_the_long_case(default_report, classic_report):
    assert DEFAULT.shape.T == 7 and all(r.status == "pass" for r in _rows(default_report, CAPPED.name))
    rows = _rows(classic_report, CAPPED.name)
    assert rows[0].quantity == "prefill" and rows[0].status == "fail" and rows[0].stage == "prefill"
    # row 0 (no padding) stores tokens 0-5: its 8th token (position 7) is the first whose past is lost
    assert "row 0 position 7" in rows[0].message


def test_the_flax_peer_is_judged_with_is_causal_true_as_well(classic_report):
    """flax's decoding peer with is_causal=True at every call: where the installed flax ignores it at decode
    (>= 0.12.11) the declared peer passes; before, the declared peer is a skip row naming the releases, and
    the same peer run anyway (a user's declaration) is red: row 0 attends its slot 0 alone from its second
    token (position 1), the padded row's slot 0 is padding, so it attends nothing from its first (position 0)."""
    from parity.peers.flax import CAUSAL_DECODE_FIXED, flax_version

    peer, anyway = _rows(classic_report, "flax-nnx-mha-decode-causal"), _rows(classic_report, FLAX_IS_CAUSAL.name)
    if flax_version() >= CAUSAL_DECODE_FIXED:
        assert peer and anyway and all(r.status == "pass" for r in peer + anyway)
        return
    assert len(peer) == 1 and peer[0].status == "skip" and "flax >= 0.12.11 is not installed" in peer[0].message
    assert [r.quantity for r in anyway] == list(CALLS) and all(r.status == "fail" for r in anyway)
    assert "first call off the oracle: prefill" in anyway[0].message
    assert "row 0 position 1, row 1 position 0" in anyway[0].message


# ---------------------------------------------------------------- decoders


def test_the_example_decoder_passes(default_report):
    rows = _rows(default_report, "decoder-example")
    assert [r.quantity for r in rows] == [*CALLS, *CALLS]  # float64, then float32
    assert all(r.status == "pass" for r in rows), rows


# bug -> the first position off in every row (left padding 0, 2, 1), and whether only padded rows are
POSITION_BUG = "row 0 position 1, row 1 position 1, row 2 position 1"
PADDING_BUG = "row 0 none, row 1 position 0, row 2 position 0"


@pytest.mark.parametrize("bug, where, padded_only", [
    (decoders.decoder_position_off_by_one, POSITION_BUG, False),
    (decoders.decoder_new_key_at_position_0, POSITION_BUG, False),
    (decoders.decoder_padding_attended, PADDING_BUG, True),
])
def test_each_planted_decoder_bug_is_red_naming_where(default_report, bug, where, padded_only):
    rows = _rows(default_report, bug.name)
    assert [r.quantity for r in rows] == [*CALLS, *CALLS]
    assert all(r.status == "fail" and r.stage == "prefill" for r in rows), rows
    assert all("first call off the oracle: prefill" in r.message and where in r.message for r in rows)
    assert all(("only the left-padded rows are off" in r.message) == padded_only for r in rows)


def test_a_cache_that_forgets_is_red_from_the_first_step(default_report):
    rows = _rows(default_report, FORGETFUL.name, "float32")
    assert rows[0].quantity == "prefill" and rows[0].status == "pass"  # the prompt fits in what it keeps
    assert all(r.status == "fail" and r.stage == "step output" for r in rows[1:]), rows
    assert "first call off the oracle: step 1" in rows[1].message and "row 0 position 4" in rows[1].message


@pytest.mark.parametrize("impl, words", [
    (RAISES, ("token 2 of 7", "RuntimeError: the cache is full")),
    (WRONG_SHAPE, ("output of shape (3, 1, 23), expected (3, 1, 24)",)),
    (three_arguments, ("declares decode=True", "fn(p, x_t, cache, position)")),
])
def test_a_decoder_that_raises_or_breaks_the_protocol_is_an_error_row(default_report, impl, words):
    rows = _rows(default_report, impl.name)
    assert len(rows) == 2 and all(r.status == "error" for r in rows)  # one per dtype
    for r in rows:
        assert impl.name in r.message and all(w in r.message for w in words), r.message


def test_decoders_and_the_other_layers_skip_each_others_checks():
    from parity.examples.nanogpt_torch import nanogpt  # a layer, not a decoder

    classic = next(c for c in modern_matrix() if c.decode and not c.config.features)
    report = run(cases=[classic], checks=("forward", "decode"), dtypes=("float32",),
                 impls=("torch", decoders.decoder, nanogpt), device="cpu")
    fwd = [r for r in report.rows if r.impl == "decoder-example" and r.check == "forward"]
    assert fwd and all(r.status == "skip" and "is a decoder" in r.message for r in fwd)
    skip = _rows(report, nanogpt.name)
    assert skip and all(r.status == "skip" and "not a decoder" in r.message for r in skip)
    layer = [r for r in report.rows if r.impl == nanogpt.name and r.check == "forward"]
    assert layer and all(r.status == "pass" for r in layer)
    assert report.ok
    with pytest.raises(ValueError, match="decoder-example: decode"):
        run(cases=[DEFAULT], checks=("forward",), dtypes=("float32",), impls=(decoders.decoder,), device="cpu")


# ---------------------------------------------------------------- the command line


def _cli(tmp_path, *argv):
    out = tmp_path / f"report{len(list(tmp_path.glob('report*.json')))}.json"  # one file per run
    code = main(["--no-progress", *argv, "--json", str(out)])
    return code, (json.loads(out.read_text())["rows"] if out.exists() else [])


def test_the_command_line_exit_status(tmp_path, capsys):
    fast = ("--checks", "decode", "--impls", "torch", "--dtypes", "float32")
    code, rows = _cli(tmp_path, *fast, "--impl", "parity.examples.decoders:decoder")
    assert code == 0 and any(r["impl"] == "decoder-example" and r["status"] == "pass" for r in rows)
    assert {r["case"] for r in rows if r["status"] == "pass"} == {c.name for c in default_matrix() if c.decode}
    code, rows = _cli(tmp_path, *fast, "--impl", "parity.examples.decoders:decoder_padding_attended")
    assert code == 1 and {r["stage"] for r in rows if r["status"] == "fail"} == {"prefill"}
    capsys.readouterr()
    code, rows = _cli(tmp_path, "--checks", "forward", "--impl", "parity.examples.decoders:decoder")
    assert code == 2 and not rows and "decode" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--layer", "E=12,N=3"], ["--checkpoint", "no-such-dir"]])
@pytest.mark.parametrize("shape", ["1,1,1", "2,1,1"])
def test_a_decode_of_one_token_is_a_usage_error(capsys, argv, shape):
    code = main(["--no-progress", *argv, "--shape", shape, "--checks", "decode"])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert f"--shape {shape} --checks decode: a decode needs at least 2 tokens" in err and "got 1" in err


def test_the_layer_flag_decodes_when_the_decode_check_is_named(tmp_path):
    """--layer at T = S: its causal case decodes; at T < S a causal self-attention case over the S tokens."""
    for shape, case in (("2,4,4", "layer/causal/nan"), ("2,3,4", "layer-decode/causal/nan")):
        code, rows = _cli(tmp_path, "--layer", "E=12,N=3", "--shape", shape, "--checks", "decode", "--impls", "torch",
                          "--dtypes", "float32")
        mine = [r for r in rows if r["impl"] == "torch"]
        assert code == 0 and [r["quantity"] for r in mine] == [*CALLS, "cache"]
        assert mine and all(r["status"] == "pass" and r["case"] == case for r in mine), mine


PREFIX = "model.layers.0.self_attn."


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=1,
                                      intermediate_size=16, vocab_size=11, rope_theta=500.0, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_checkpoints_layer_decodes(llama_dir, tmp_path):
    code, rows = _cli(tmp_path, "--checkpoint", str(llama_dir), "--prefix", PREFIX, "--checks", "decode",
                      "--impls", "torch,jax-jit", "--dtypes", "float32",
                      "--impl", "parity.examples.decoders:decoder_new_key_at_position_0")
    assert code == 1
    for impl in ("torch", "jax-jit", "torch->jax", "jax->torch", "hf-llama-decode"):
        mine = [r for r in rows if r["impl"] == impl]
        assert mine and all(r["status"] == "pass" and r["case"] == "checkpoint/causal/nan" for r in mine), impl
    bad = [r for r in rows if r["impl"] == "decoder-new-key-at-position-0"]
    assert bad and all(r["status"] == "fail" and r["stage"] == "prefill" for r in bad)
    # with fewer queries than keys, the decode check gets a self-attention case of its own
    code, rows = _cli(tmp_path, "--checkpoint", str(llama_dir), "--prefix", PREFIX, "--checks", "decode",
                      "--impls", "torch", "--dtypes", "float32", "--shape", "2,3,5")
    assert code == 0 and {r["case"] for r in rows if r["status"] == "pass"} == {"checkpoint-decode/causal/nan"}
