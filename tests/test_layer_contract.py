"""A correct layer is green as it is written: one input (inputs="self"), its own parameter names
(names=), the layer it is (requires=), the precision it computes in (computes_in=); sizes from the
command line (--layer, --shape); the verdict in words."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from rich.console import Console

from mha_spec import AttentionConfig, Problem
from parity import reference
from parity.cli_args import parse_layer
from parity.harness.report import Report, Row, print_report, verdict_lines
from parity.impls import Implementation, implementation

LLAMA = ("grouped", "rope-half", "no-qkv-bias", "no-out-bias")
CONFIG = AttentionConfig(24, 4, num_kv_heads=2, qkv_bias=False, out_bias=False, rope="half", rope_theta=500.0)


def _factory(state_dict, num_heads, *, dtype, device, problem=None):
    return lambda p, x, mask, positions=None: None


class TestDeclarations:
    def test_requires_adds_its_features_and_declines_layers_without_them(self):
        impl = Implementation("mine", "torch", _factory, requires=("grouped", "no-out-bias"))
        assert set(impl.variants) == {"grouped", "no-out-bias"} and not impl.classic
        assert "requires grouped, no-out-bias: this layer lacks grouped" in impl.unsupported(
            "float32", AttentionConfig(24, 4, out_bias=False))
        assert "lacks grouped, no-out-bias" in impl.unsupported("float32", None)  # the classic layer
        assert impl.unsupported("float32", AttentionConfig(24, 4, num_kv_heads=2, out_bias=False)) is None

    def test_one_input_layers_decline_cross_attention_and_runs_on_is_one_rule(self):
        impl = Implementation("mine", "torch", _factory, inputs="self", runs_on=("self/causal/*",))
        assert "inputs='self'" in impl.unsupported("float32", cross=True, mask="causal")
        assert "runs_on" in impl.unsupported("float32", cross=False, mask="padding")
        assert impl.unsupported("float32", cross=False, mask="causal") is None

    @pytest.mark.parametrize("kw, message", [
        ({"inputs": "one"}, "inputs='one' is not one of"),
        ({"requires": ("gqa",)}, "requires must be a tuple of"),
        ({"computes_in": "float8"}, "computes_in='float8' is not one of"),
        ({"names": "hf-mistral"}, "names='hf-mistral' is not a layout"),
        ({"inputs": "self", "uses_params": False}, "needs uses_params=True"),
    ])
    def test_bad_declarations_are_value_errors_naming_the_field(self, kw, message):
        with pytest.raises(ValueError, match=message):
            Implementation("mine", "torch", _factory, **kw)

    def test_computes_in_judges_wider_dtypes_at_its_bound_only(self):
        impl = Implementation("mine", "torch", _factory, computes_in="float32")
        assert [impl.judged_at(d) for d in ("float64", "float32", "bfloat16", "float16")] == \
               ["float32", "float32", "bfloat16", "float16"]


@pytest.fixture(scope="module")
def llama_unit():
    rng = np.random.default_rng(3)
    B, T = 3, 5
    sd = {k: rng.standard_normal(s) * 0.3 for k, s in CONFIG.weight_shapes().items()}
    x = rng.standard_normal((B, T, 24))
    pos = np.stack([rng.permutation(11)[:T] for _ in range(B)]).astype(np.int64)
    keep = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, 1, T, T))
    cot = rng.standard_normal((B, T, 24))
    kw = dict(num_heads=4, num_kv_heads=2, rope="half", rope_theta=500.0, positions=pos, key_positions=pos,
              masked_rows="nan")
    exact = reference.forward(sd, x, x, x, keep, **kw)
    grads = reference.backward(sd, x, x, x, keep, cot, masked_row_grads="flow", **kw)
    return sd, x, pos, keep, cot, exact, grads


class TestAdapter:
    """The HF-style layers of parity.examples, called through the contract, against the float64 oracle."""

    @pytest.mark.parametrize("framework", ["torch", "jax"])
    def test_a_one_input_layer_with_hf_names_matches_the_oracle(self, llama_unit, framework):
        sd, x, pos, keep, cot, exact, grads = llama_unit
        if framework == "torch":
            from parity.examples.llama_torch import layer as impl
            from parity.impls.torch_impls import TorchRunner as Runner

            runner = Runner("cpu")
        else:
            import jax

            from parity.examples.llama_jax import hf_port as impl
            from parity.impls.jax_impls import JaxRunner as Runner

            runner = Runner(jax.devices("cpu")[0])
        B, T, _ = x.shape
        built = runner.build(impl, sd, 4, "nan", Problem(CONFIG, B, T, T), {"positions": pos, "key_positions": pos})
        out, w, got = runner.vjp(built, x, x, x, keep, cot)
        # float32 cos/sin and softmax in a float64 run: within float32's bound, far outside float64's
        assert 1e-12 < np.abs(out - exact.output).max() < 1e-5
        assert np.abs(w - exact.weights).max() < 1e-5
        d_x = grads["query"] + grads["key"] + grads["value"]
        assert np.abs(got["query"] - d_x).max() < 1e-4 * np.abs(d_x).max()
        # one input: x's gradient is the whole of it (torch gives None for the unused inputs, JAX zeros)
        assert all(got[n] is None or not np.any(got[n]) for n in ("key", "value"))
        for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"):  # o_proj's reaches out_proj
            assert np.abs(got[name] - grads[name]).max() < 1e-4 * np.abs(grads[name]).max(), name

    def test_names_maps_every_tensor_of_the_layout(self):
        from parity.contract import renamer

        rng = np.random.default_rng(0)
        import torch

        sd = {k: torch.tensor(rng.standard_normal(s)) for k, s in AttentionConfig(12, 3).weight_shapes().items()}
        gpt2 = renamer("hf-gpt2", "torch")(sd)
        assert sorted(gpt2) == ["c_attn.bias", "c_attn.weight", "c_proj.bias", "c_proj.weight"]
        assert torch.equal(gpt2["c_attn.weight"][:, 12:24], sd["k_proj.weight"].T)  # stored (in, out), q | k | v
        llama = renamer("hf-llama", "torch")({k: v for k, v in sd.items() if k.endswith("weight")})
        assert sorted(llama) == ["k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]
        assert llama["o_proj.weight"] is sd["out_proj.weight"]


@pytest.mark.parametrize("text, message", [
    ("E=64", "N missing"),
    ("E=64,N=4,K=3", "num_kv_heads=3 must divide num_heads=4"),
    ("E=64,N=4,rope=xpos", "rope='xpos' is not none or one of half, interleaved"),
    ("E=64,N=4,bias=q", "bias='q' is not one of all, none, qkv, out"),
    ("E=64,N=4,E=32", "each once"),
    ("E=64,N=0", "expected a positive integer"),
    ("E=64,N=4,theta=500000", "theta= is RoPE's base, but the layer has no RoPE"),
    ("E=64,N=4,rope=none,theta=500", "theta= is RoPE's base, but the layer has no RoPE"),
])
def test_the_layer_flag_names_what_is_wrong(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_layer(text)


def test_a_forgotten_rope_is_a_usage_error_on_the_command_line(capsys):
    from parity.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--no-progress", "--layer", "E=64,N=4,theta=500000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "theta=" in err and "no RoPE" in err


def test_the_layer_flag_reads_a_llama_layer():
    assert parse_layer("E=24,N=4,K=2,rope=half,theta=500,bias=none") == CONFIG
    assert parse_layer("E=12,N=3") == AttentionConfig(12, 3)


def _rows(impl, statuses):
    return [Row(case, check, impl, "oracle", dtype, "cpu", st, "output", 1e-7, 1e-7, 1e-6, 1e-5,
                stage="scores" if st == "fail" else "", message="" if st != "skip" else f"{impl} declares inputs='self'")
            for case, check, dtype, st in statuses]


class TestVerdictInWords:
    USER = Implementation("my-llama", "torch", _factory, inputs="self", computes_in="float32")

    def test_a_green_layer_is_said_green_with_what_was_checked_and_skipped(self):
        rows = _rows("my-llama", [("a/causal", "forward", "float64", "pass"), ("a/causal", "gradient", "float32", "pass"),
                                  ("b/padding", "forward", "float32", "pass"), ("cross/none", "forward", "float32", "skip")])
        (style, text), = verdict_lines(Report({}, rows, users=[self.USER]))
        assert style == "green"
        assert text.startswith("my-llama: forward and gradients match the float64 oracle within float64, float32 bounds "
                               "(float64 at the float32 bound: computes_in) on 2 cases, 1 skipped: declares inputs='self'")

    def test_a_red_layer_is_said_red_with_its_stage(self):
        rows = _rows("my-llama", [("a/causal", "forward", "float32", "fail"), ("b/padding", "forward", "float32", "pass")])
        (style, text), = verdict_lines(Report({}, rows, users=[self.USER]))
        assert style == "bold red" and text == "my-llama: FAILS forward on 1 of 2 cases (first diverging stage: scores)"

    def test_the_default_table_is_one_line_per_implementation_check_and_dtype_within_80_columns(self):
        import dataclasses

        rows = [dataclasses.replace(r, quantity=q) for impl in ("torch", "llama-jax-port-tile-bug")
                for q in ("output", "weights") for r in _rows(impl, [(f"c{i}", "forward", "float32", "pass")
                                                                     for i in range(3)])]
        console = Console(width=80, record=True, force_terminal=False)
        print_report(Report({"seed": 0}, rows), console)
        table = console.export_text().split("rows:")[0]
        lines = [line for line in table.splitlines() if "fwd" in line]
        assert len(lines) == 2 and "llama-jax-port-tile-bug" in lines[1] and "12/12" not in table and "6/6" in lines[1]
        assert max(len(line) for line in table.splitlines()) <= 80


class TestEndToEnd:
    """The HF-style layer and its JAX port through the harness: green as written, the planted bugs red."""

    def test_quick_adds_the_layers_own_case_and_both_layers_are_green_with_direct_rows(self, capsys):
        from parity.cli import main

        code = main(["--no-progress", "--quick", "--impls", "torch", "--checks", "forward,gradient",
                     "--impl", "parity.examples.llama_torch:layer", "--impl", "parity.examples.llama_jax:hf_port"])
        out = " ".join(capsys.readouterr().out.split())
        assert code == 0, out
        assert ("llama-torch-layer: forward and gradients match the float64 oracle within float32 bounds on 2 cases, "
                "1 skipped: declares inputs='self'") in out
        assert "llama-jax-hf-port: forward and gradients match" in out

    def test_computes_in_judges_float64_at_float32_and_direct_rows_compare_the_two(self):
        from parity.examples.llama_jax import hf_port, hf_port_with_rope_on_v
        from parity.examples.llama_torch import layer
        from parity.harness import run
        from parity.harness.matrix import Shape, layer_cases

        shape = Shape.of("hf", Problem(CONFIG, 2, 5, 5), cross=False)
        report = run(cases=layer_cases(shape, quick=True, dtypes=("float64", "float32")), checks=("forward", "gradient"),
                     impls=("torch", layer, hf_port, hf_port_with_rope_on_v), device="cpu")
        rows = report.rows
        good = ("llama-torch-layer", "llama-jax-hf-port")
        ok = [r for r in rows if r.impl in good and r.reference in ("oracle", "torch", *good)]
        assert ok and all(r.status == "pass" for r in ok), [r for r in ok if r.status != "pass"]
        f64 = [r for r in ok if r.dtype == "float64" and r.reference == "oracle"]
        assert f64 and all(r.atol >= 1e-6 for r in f64)  # float32's bounds: at least its floor, far above float64's
        assert all("judged at the float32 bound" in r.message for r in f64)
        direct = {(r.check, r.quantity) for r in ok if r.reference == "llama-jax-hf-port"}
        assert direct == {("forward", "output"), ("forward", "weights"), ("gradient", "d_inputs"), ("gradient", "d_params")}
        x_rows = [r for r in ok if r.check == "gradient" and r.quantity == "d_inputs" and r.reference == "oracle"]
        assert all("d_x judged against d_query + d_key + d_value" in r.message for r in x_rows)
        bug = [r for r in rows if r.impl == "llama-jax-hf-port-rope-on-v" and r.reference == "oracle" and r.check == "forward"]
        assert {r.dtype for r in bug if r.quantity == "output" and r.status == "fail" and r.stage == "context"} == \
               {"float64", "float32"}  # the stage named at float32's bound in float64 too
        assert all(r.status == "pass" for r in bug if r.quantity == "weights")  # right up to the weights

    def test_a_checkpoint_with_zero_biases_is_redrawn_so_ignoring_them_is_red(self, tmp_path, capsys):
        import torch
        import transformers

        from parity.cli import main

        torch.manual_seed(0)
        config = transformers.Qwen2Config(hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
                                          num_hidden_layers=1, intermediate_size=16, vocab_size=11, rope_theta=500.0,
                                          max_position_embeddings=64, use_sliding_window=False)
        transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
        assert main(["--no-progress", "--checkpoint", str(tmp_path), "--prefix", "model.layers.0.self_attn.",
                     "--impls", "torch", "--checks", "forward", "--dtypes", "float32", "--cases", "checkpoint-redrawn,"
                     "checkpoint/causal", "--impl", "parity.examples.llama_jax:hf_port",
                     "--impl", "parity.examples.llama_jax:hf_port_ignoring_biases"]) == 1
        out = " ".join(capsys.readouterr().out.split())
        assert "warning: q_proj.bias, k_proj.bias, v_proj.bias hold one value throughout" in out
        assert "fail checkpoint-redrawn/causal/nan forward llama-jax-hf-port-no-biases vs oracle float32 output" in out
        assert "stage=q" in out and "llama-jax-hf-port-no-biases: FAILS forward on 1 of 2 cases" in out
        assert "llama-jax-hf-port: forward matches the float64 oracle within float32 bounds on 2 cases" in out

