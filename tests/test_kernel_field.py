"""The `kernel` field of parity and bench rows: which attention kernel a call really ran (`parity.kernel_ran`).

The torch reading is checked against the profiler's op names taken here, independently; the JAX
reading against the primitives in the program and our module's own dispatch (`kernels.module_choice`)."""

from __future__ import annotations

from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

from mha_jax import MultiHeadAttention, kernels
from parity import kernel_ran
from parity.bench import measure
from parity.bench.spec import IMPLS, BenchCase, Timing
from parity.devices import resolve_device

B, T, S, E, N = 3, 5, 7, 12, 3
H = E // N


def _profiled_attention_ops(call) -> set[str]:
    """The attention ops the torch profiler records for one call (this test's own reading)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name and e.name != "aten::scaled_dot_product_attention"}


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_the_torch_reading_names_the_backend_sdpa_ran_as_the_profiler_does(kind):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, L, H, generator=g) for L in (S if kind == "causal" else T, S, S))
    mask = torch.rand(T, S, generator=g) > 0.3
    kw = {"is_causal": True} if kind == "causal" else {"attn_mask": mask}

    def call():
        return F.scaled_dot_product_attention(q, k, v, **kw)

    with kernel_ran.torch_observer() as seen:
        call()
    ops = _profiled_attention_ops(call)
    backend = {"aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
               "aten::_scaled_dot_product_attention_math": "math"}
    assert len(ops) == 1, ops
    assert seen.label == f"sdpa:{backend[ops.pop()]}"


def test_a_pinned_math_backend_reads_as_math_and_a_softmax_outside_sdpa_as_materialised():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(B, N, T, H)
    with sdpa_kernel(SDPBackend.MATH):
        with kernel_ran.torch_observer() as seen:
            F.scaled_dot_product_attention(q, q, q)
        assert _profiled_attention_ops(lambda: F.scaled_dot_product_attention(q, q, q)) == {
            "aten::_scaled_dot_product_attention_math"}
    assert seen.label == "sdpa:math"
    with kernel_ran.torch_observer() as seen:
        torch.softmax(q @ q.transpose(-1, -2), -1) @ q
    assert seen.label == "bmm-softmax"
    with kernel_ran.torch_observer() as seen:
        q + 1
    assert seen.label == kernel_ran.UNKNOWN


def test_the_jax_reading_of_dot_product_attention_on_a_cpu_is_xla_and_a_pallas_kernel_interpret():
    from mha_jax import pallas

    q = jnp.ones((B, T, N, H), jnp.float32)
    assert kernel_ran.jax_program_engine(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="xla"), q) == "xla"
    q16 = jnp.ones((1, 16, 2, 16), jnp.float32)
    assert kernel_ran.jax_program_engine(lambda q: pallas.gpu_flash(q, q, q, is_causal=True), q16) == \
        kernel_ran.PALLAS_INTERPRET
    # The compiled text alone: a cuDNN custom call is named, plain HLO is XLA.
    assert kernel_ran.jax_engine(None, 'custom_call_target="__cudnn$fmhaSoftmax"', "gpu") == kernel_ran.CUDNN
    compiled = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q)).lower(q).compile().as_text()
    assert kernel_ran.jax_engine(None, compiled, "cpu") == "xla"


@pytest.mark.parametrize("need_weights", [False, True])
def test_our_module_reads_as_the_label_of_its_own_choice(need_weights):
    layer = MultiHeadAttention(E, N, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, E)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, E)), jnp.float32)

    def program(state, x, y):
        return nnx.merge(graphdef, state)(x, y, y, need_weights=need_weights)

    kernel, note = kernel_ran.jax_row_kernel(program, (state, x, y), jax.devices("cpu")[0], ours=True,
                                             need_weights=need_weights)
    choice = kernels.module_choice(B, N, T, S, H, jnp.float32, has_mask=False, need_weights=need_weights)
    assert (kernel, note) == (kernels.kernel_label(choice), "")


def test_a_request_that_did_not_run_says_so():
    assert kernel_ran.jax_verdict("dpa-cudnn", "xla") == ("xla", "requested dpa-cudnn, ran xla")
    assert kernel_ran.jax_verdict("chunked:8x16 (built-in)", "xla") == ("chunked:8x16 (built-in)", "")
    assert kernel_ran.jax_verdict("pallas-gpu-flash", kernel_ran.PALLAS_INTERPRET) == ("pallas-gpu-flash (interpret)", "")
    assert kernel_ran.torch_verdict("sdpa", "bmm-softmax") == ("bmm-softmax", "requested sdpa, ran bmm-softmax")
    assert kernel_ran.torch_verdict("hf-bert", "bmm-softmax") == ("bmm-softmax", "")
    q = jnp.ones((1, 8, 2, 8), jnp.float16)
    with pytest.raises(RuntimeError, match="cuDNN"):  # jax itself refuses a cuDNN request on a CPU
        jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")).trace(q).lower()


# ---------------------------------------------------------------- bench rows


def _impl(key):
    return next(i for i in IMPLS if i.bench_key == key)


CASE = BenchCase.of(B, T, S, E, N, "float32", mask="causal")


@pytest.mark.parametrize("key, expected", [
    ("ours-torch:eager:fused", "sdpa:flash"), ("ours-torch:eager:weights", "bmm-softmax (weights)"),
])
def test_a_torch_bench_reads_its_kernel_off_the_profiled_output_call(key, expected):
    from parity.bench import torch_bench

    bench = torch_bench.build(_impl(key), CASE, "fwd", "cpu", 0)
    assert kernel_ran.row_kernel(bench.kernel) == ("sdpa" if "fused" in key else expected, "")  # before: the request
    measure.prepare(bench, Timing(warmup=1, min_repeats=1, max_repeats=1), measure.time.perf_counter)
    assert kernel_ran.row_kernel(bench.kernel) == (expected, "")


def test_a_jax_bench_reads_its_kernel_off_the_compiled_program():
    from parity.bench import jax_bench

    dev = jax.devices("cpu")[0]
    for key in ("ours-jax:jit:fused", "jax-dpa-core:jit:fused"):
        bench = jax_bench.build(_impl(key), CASE, "fwd", "cpu", 0)
        measure.prepare(bench, Timing(warmup=1, min_repeats=1, max_repeats=1), measure.time.perf_counter)
        assert kernel_ran.row_kernel(bench.kernel) == (jax_bench.kernel_of(_impl(key), CASE, dev), "")


def test_every_bench_row_gets_what_ran_and_a_request_not_met_says_so(monkeypatch):
    from parity.bench import worker

    monkeypatch.setattr(worker, "emit", lambda kind, payload: None)
    now = [0.0]

    class Mod:
        @staticmethod
        def build(impl, case, pass_, device, seed):
            seen = {}

            def output():
                seen["ran"] = "bmm-softmax"  # as if SDPA had not run
                return np.ones((B, T, E))

            def step():
                now[0] += 1e-3

            return measure.Bench(step=step, sync=lambda out: None, output=output, kernel=kernel_ran.BenchKernel(
                "sdpa", lambda: kernel_ran.torch_verdict("sdpa", seen["ran"]) if seen else None))

        @staticmethod
        def reset_compiled():
            pass

    group = [(0, _impl("ours-torch:eager:fused"), CASE, "fwd")]
    spec = {"device": asdict(resolve_device("cpu", probe=False)), "precision": "highest", "seed": 0,
            "interleave": False, "verdict": None}
    rows, _ = worker.time_group({"torch": Mod}, group, spec, Timing(warmup=1, min_repeats=2, max_repeats=2),
                               lambda: now[0])
    row = rows[0][1]
    assert row["kernel"] == "bmm-softmax" and row["message"] == "requested sdpa, ran bmm-softmax"


def test_the_markdown_shows_the_kernel_and_a_file_without_it_still_reads():
    from parity.bench import report
    from parity.bench.records import empty_row

    row = empty_row(_impl("ours-torch:eager:fused"), CASE, "fwd", device="cpu", status="skip", message="x")
    row["kernel"] = "sdpa:flash"
    assert "| sdpa:flash |" in report.markdown([row], {})
    del row["kernel"]
    assert "| - |" in report.markdown([row], {})
    report.validate({"schema": report.SCHEMA, "rows": [row]})


# ---------------------------------------------------------------- parity rows


def test_parity_rows_that_ran_a_forward_carry_the_kernel(tmp_path):
    import json

    from parity.harness import run
    from parity.harness.matrix import quick_matrix

    (case,) = quick_matrix()
    report = run(dtypes=["float32"], checks=["forward"], impls=["torch", "torch-fused", "jax-jit", "jax-fused"],
                 quick=True, json_path=tmp_path / "r.json", markdown_path=tmp_path / "r.md")
    ran = {i.impl: {r.kernel for r in report.rows if r.impl == i.impl and r.status != "skip"} for i in report.rows}
    assert ran["torch-fused"] == {"sdpa:flash"} and ran["torch"] == {"bmm-softmax (weights)"}
    assert ran["jax-jit"] == {"einsum"}
    s = case.shape
    choice = kernels.module_choice(s.B, s.N, s.T, s.S, s.E // s.N, jnp.float32, has_mask=True, need_weights=False)
    assert ran["jax-fused"] == {kernels.kernel_label(choice)}
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert all("kernel" in r for r in rows) and any(r["kernel"] == "sdpa:flash" for r in rows)
    assert "| kernel |" in (tmp_path / "r.md").read_text()


def test_a_pallas_peer_that_reads_its_mask_as_causal_or_segments_names_its_kernel(monkeypatch):
    """The flash peers read the dense mask's values (causal? which documents?): the kernel is read from a
    trace in which the mask is a constant, as in the call that ran, so their rows say what ran."""
    from parity.harness import run, runner
    from parity.harness.matrix import default_matrix

    every = runner.select  # the peers check with this one peer only: the others cost seconds each
    monkeypatch.setattr(runner, "select", lambda role=None: tuple(
        p for p in every(role) if role != "peer" or p.name == "pallas-gpu-flash"))
    packed = next(c for c in default_matrix() if c.mask == "packed")
    report = run(cases=[packed], dtypes=["float32"], checks=["peers"], impls=["jax-jit"], device="cpu")
    rows = [r for r in report.rows if r.impl == "pallas-gpu-flash"]
    assert rows and all(r.status == "pass" for r in rows), rows
    assert {r.kernel for r in rows} == {kernel_ran.PALLAS_INTERPRET}
