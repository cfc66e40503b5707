"""mha-bench on self-attention: a T == S case is one input x for query, key and value (fwd+bwd takes
its gradient once), so inputs="self" layers are timed there; a T != S case stays cross-attention,
where they are skip rows. End to end through the CLI with a real worker, and the builds in process."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.bench import cli
from parity.bench.spec import IMPLS, MEASURED, BenchCase, make_inputs, why_not_in_bench
from parity.impls import load_user_impl
from test_bench_cli import _console

# RoPE needs an even head size: E=24, N=4 (H=6), K=2; B=3, T=5, S=7 pairwise distinct.
SELF = BenchCase.of(3, 5, 5, 24, 4, "float32", kv_heads=2, rope="half", bias="none")
CROSS = BenchCase.of(3, 5, 7, 24, 4, "float32", kv_heads=2, rope="half", bias="none")
USER = ("parity.examples.llama_torch:layer", "parity.examples.llama_jax:hf_port")
OURS = ("ours-torch:eager:fused", "ours-jax:jit:fused")
SELF_REASON = "declares inputs='self' (one input for query, key and value): cross-attention"


def _impl(key):
    return next(im for im in IMPLS if im.bench_key == key)


def _user(spec):
    (impl,) = load_user_impl(spec)
    return impl


@pytest.fixture(scope="module")
def self_run(tmp_path_factory, monkeypatch_module):
    """One real sweep in one worker: ours in both frameworks and the two one-input Llama layers, both
    passes, on T = S = 5 (self-attention) and T = 5, S = 7 (cross-attention)."""
    out = tmp_path_factory.mktemp("self-run") / "b.json"
    console = _console()
    rc = cli.main(
        ["--seq", "5", "--kv-seq", "5,7", "--batch", "3", "--embed", "24", "--heads", "4", "--kv-heads", "2",
         "--rope", "half", "--bias", "none", "--budget", "0.02", "--min-repeats", "4", "--peak-sizes", "128",
         "--no-progress", "--impls", ",".join(OURS), *(f"--impl={spec}" for spec in USER),
         "--passes", "fwd,fwd+bwd", "--threads", "1", "--isolation", "run", "--processes", "1", "--json", str(out)],
        console=console,
    )
    return rc, console.file.getvalue(), json.loads(out.read_text())["rows"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    """The parent's interference checks see a quiet machine (as test_bench_cli's `quiet_machine`):
    rows are what this file asserts, and the verdicts' interference texts are not."""
    patch = pytest.MonkeyPatch()
    patch.setattr(cli, "_loadavg", lambda: [0.0, 0.0, 0.0])
    patch.setattr(cli, "calibrate", lambda: 0.01)
    patch.setattr(cli, "OthersCpu", lambda: (lambda: 0.0))
    yield patch
    patch.undo()


def test_self_layers_are_timed_on_the_self_attention_case_in_both_passes(self_run):
    rc, text, rows = self_run
    assert rc == 0, text
    on_self = [r for r in rows if r["seq_q"] == r["seq_k"] == 5]
    names = {r["impl"] for r in on_self}
    assert {"llama-torch-layer", "llama-jax-hf-port"} <= names and {"ours-torch", "ours-jax"} <= names, names
    for r in on_self:
        # Measured (a 2-core machine shared with other work may make tiny rows noisy, never a failure),
        # and computing what ours-torch does on the same x: the output check ran and passed.
        assert r["status"] in MEASURED, r
        assert r["median_s"] > 0 and r["kv_heads"] == 2 and r["rope"] == "half" and r["bias"] == "none"
        if r["impl"] != "ours-torch":
            assert r["out_max_diff"] is not None, r
    assert {(r["impl"], r["pass"]) for r in on_self} == {(n, p) for n in names for p in ("fwd", "fwd+bwd")}


def test_self_layers_skip_the_cross_attention_case_with_the_registrys_reason(self_run):
    rc, text, rows = self_run
    on_cross = {(r["impl"], r["pass"]): r for r in rows if (r["seq_q"], r["seq_k"]) == (5, 7)}
    for name in ("llama-torch-layer", "llama-jax-hf-port"):
        for pass_ in ("fwd", "fwd+bwd"):
            r = on_cross[name, pass_]
            assert r["status"] == "skip" and SELF_REASON in r["message"], r
    for name in ("ours-torch", "ours-jax"):  # the qkv layers still run cross-attention
        assert all(on_cross[name, p]["status"] in MEASURED for p in ("fwd", "fwd+bwd"))


def test_make_inputs_is_one_array_on_a_self_case_and_three_on_a_cross_case():
    q, k, v = make_inputs(SELF, 0)
    assert q is k is v and q.shape == (3, 5, 24) and q.dtype == np.float32
    q, k, v = make_inputs(CROSS, 0)
    assert q.shape == (3, 5, 24) and k.shape == v.shape == (3, 7, 24)
    assert not np.shares_memory(k, v) and not np.array_equal(k, v)
    # T == S without anything else differing is still one array, and a different one from T != S's keys.
    classic = BenchCase.of(3, 7, 7, 12, 3, "float32")
    assert classic.self_attention and not CROSS.self_attention
    x, k2, v2 = make_inputs(classic, 0)
    assert x is k2 is v2


def test_unsupported_follows_the_case_kind():
    for spec in USER:
        impl = _user(spec)
        assert why_not_in_bench(impl, SELF) is None, spec
        assert SELF_REASON in why_not_in_bench(impl, CROSS), spec
    # The built-in qkv layers run the self-attention cases they ran before: jax-dpa-gqa's and the
    # classic peers' runs_on leave some self-attention kinds to the harness's budget (self/none,
    # self/causal), not to what they can compute.
    causal = BenchCase.of(3, 5, 5, 24, 4, "float32", kv_heads=2, mask="causal")
    for key in ("jax-dpa-gqa:jit:fused", "torch-sdpa-gqa:eager:fused", "ours-torch:eager:fused"):
        assert why_not_in_bench(_impl(key), SELF) is None and why_not_in_bench(_impl(key), causal) is None, key
    classic_causal = BenchCase.of(3, 5, 5, 12, 3, "float32", mask="causal")
    for key in ("torch-sdpa-core:eager:fused", "jax-dpa-core:jit:fused", "torch-mha:eager:weights"):
        assert why_not_in_bench(_impl(key), classic_causal) is None, key
    # What a declaration really excludes still skips: jax-dpa-gqa declares float32/float64 only.
    assert "runs only where its runs_on" in why_not_in_bench(_impl("jax-dpa-gqa:jit:fused"), BenchCase.of(
        3, 5, 5, 24, 4, "bfloat16", kv_heads=2))


def test_torch_fwd_bwd_takes_one_input_gradient_on_a_self_case_the_sum_of_the_three():
    torch = pytest.importorskip("torch")
    from parity.bench import torch_bench

    impl = _impl("ours-torch:eager:fused")
    n_params = len(SELF.config.weight_shapes())  # no biases: the four weights
    grads = torch_bench.build(impl, SELF, "fwd+bwd", "cpu", 0).step()
    assert len(grads) == 1 + n_params and grads[0].shape == (3, 5, 24)
    assert len(torch_bench.build(impl, CROSS, "fwd+bwd", "cpu", 0).step()) == 3 + n_params
    # The same call with query, key and value as three leaves of x's values: d_x is their sum.
    from parity.bench.spec import canonical_weights, rope_positions
    from parity.impls.torch_impls import TorchRunner

    runner = TorchRunner("cpu")
    built = runner.build(impl, canonical_weights(SELF.config, "float32", 0), 4, masked_rows="nan",
                         problem=SELF.problem, positions=rope_positions(SELF))
    x = make_inputs(SELF, 0)[0]
    leaves = [torch.from_numpy(x.copy()).requires_grad_(True) for _ in range(3)]
    out, _ = runner.call(built, *leaves, None)
    apart = torch.autograd.grad(out.float().sum(), leaves)
    np.testing.assert_allclose(grads[0].numpy(), sum(apart).numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(grads[0].numpy(), apart[0].numpy(), atol=1e-3)  # not the query's alone


def test_jax_fwd_bwd_takes_one_input_gradient_on_a_self_case():
    from parity.bench import jax_bench

    bench = jax_bench.build(_user("parity.examples.llama_jax:hf_port"), SELF, "fwd+bwd", "cpu", 0)
    bench.aot_compile()
    param_grads, *input_grads = bench.step()
    assert len(input_grads) == 1 and input_grads[0].shape == (3, 5, 24)
    assert set(param_grads) == set(SELF.config.weight_shapes())
