"""mha-bench compares what it times: a fwd+bwd row's gradients against the reference implementation's.

The end-to-end tests run the sweep's own code in this process (plan, `worker.time_group` with the real
torch and JAX builds, the parent's merge, ratios and verdicts), on tiny pairwise-distinct sizes: no
worker subprocess, one import of each framework for the whole file."""

from __future__ import annotations

import gc

import io
import time

import numpy as np
import pytest
from rich.console import Console

from parity.bench import measure, report, sweep, verdict, worker
from parity.bench.records import empty_row
from parity.bench.spec import NO_PARAM_GRADS, PRESETS, BenchCase, Timing, select_impls
from parity.impls import Implementation
from parity.tolerances import TOLERANCES

pytest.importorskip("torch")
pytest.importorskip("jax")

CROSS = BenchCase.of(3, 5, 7, 12, 3, "float32")  # T != S: query, key and value gradients
OURS_TORCH, OURS_JAX = "ours-torch:eager:fused", "ours-jax:jit:fused"


def run_in_process(impls, cases, passes=("fwd", "fwd+bwd"), monkeypatch=None):
    """(rows, verdicts, named) of a sweep run in this process: what `cli.run` computes from its workers' rows,
    one worker process, two timed calls per implementation (the samples' values do not matter here);
    named(A, B): the verdicts --verdict A,B would give from the same rows."""
    from dataclasses import replace

    from parity.bench import jax_bench, torch_bench

    cfg = sweep.RunConfig(preset=PRESETS["quick"], plan=sweep.device_plan("cpu"), impls=tuple(impls), cases=tuple(cases),
                          passes=passes, processes=1, available_bytes=2**40,
                          timing=Timing(warmup=0, min_repeats=2, max_repeats=2, round_repeats=1))
    items, out = sweep.plan(cfg), sweep.Collected()
    spec = {"device": cfg.plan.to_dict(), "precision": "highest", "seed": 0, "interleave": True, "verdict": None}
    monkeypatch.setattr(worker, "emit", lambda kind, payload: None)
    for it in items:
        if it.skip:
            out.add(it.id, empty_row(it.impl, it.case, it.pass_, device="cpu", status="skip", message=it.skip))
    todo = [(it.id, it.impl, it.case, it.pass_) for it in items if not it.skip]
    # As the worker does after its imports: what this process holds already is out of the collector's sight, so
    # the memory probe's full collection before each call is cheap (~0.2 s a call in a test process otherwise).
    gc.freeze()
    try:
        for group in worker.groups(todo):
            rows, _ = worker.time_group({"torch": torch_bench, "jax": jax_bench}, group, spec, cfg.timing,
                                        time.perf_counter)
            for item_id, row in rows:
                out.add(item_id, row)
    finally:
        gc.unfreeze()
    rows = sweep.finish(items, out)

    def named(a, b):
        return sweep.finish_verdicts(replace(cfg, verdict=(a, b)), items, rows, out)

    return rows, sweep.finish_verdicts(cfg, items, rows, out), named


def by_key(rows, pass_):
    return {f"{r['impl']}:{r['mode']}:{'weights' if r['need_weights'] else 'fused'}": r for r in rows if r["pass"] == pass_}


# ---------------------------------------------------------------- implementations of a user's


def _port_factory(detach: bool):
    """A hand-written JAX port of the classic layer; `detach`: its softmax probabilities under
    jax.lax.stop_gradient, so no gradient reaches the scores (no dq, no dk): the same forward output,
    half the backward."""
    import jax
    import jax.numpy as jnp

    def factory(state_dict, num_heads, *, dtype, device):
        def attend(p, query, key, value, keep):
            def heads(x, name):  # (B, L, E) -> (B, N, L, H)
                y = x @ p[f"{name}.weight"].T + p[f"{name}.bias"]
                return y.reshape(*x.shape[:2], num_heads, -1).transpose(0, 2, 1, 3)

            q, k, v = heads(query, "q_proj"), heads(key, "k_proj"), heads(value, "v_proj")
            scores = jnp.einsum("bnth,bnsh->bnts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
            if keep is not None:
                scores = jnp.where(keep, scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1)
            if detach:
                probs = jax.lax.stop_gradient(probs)
            context = jnp.einsum("bnts,bnsh->btnh", probs, v).reshape(query.shape)
            return context @ p["out_proj.weight"].T + p["out_proj.bias"]

        return attend

    return factory


PORT = Implementation("port", "jax", _port_factory(False), "jit", masked_rows="nan", role="user")
DETACHED = Implementation("detached-port", "jax", _port_factory(True), "jit", masked_rows="nan", role="user")


def _no_params_torch(state_dict, num_heads, *, dtype, device):
    """Our torch module with its own weights: fn(query, key, value, mask), no parameters handed in."""
    from parity import convert

    m = convert.to_torch(state_dict, num_heads, masked_rows="nan").to(device)
    return lambda query, key, value, mask: m(query, key, value, mask, need_weights=False)[0]


def _no_params_jax(state_dict, num_heads, *, dtype, device):
    """Our JAX module with its own weights, constants of the jitted program."""
    from parity import convert

    m = convert.to_jax(state_dict, num_heads, masked_rows="nan")
    return lambda query, key, value, mask: m(query, key, value, mask, need_weights=False)[0]


NO_PARAMS_TORCH = Implementation("no-params-torch", "torch", _no_params_torch, masked_rows="nan", role="user",
                                 uses_params=False)
NO_PARAMS_JAX = Implementation("no-params-jax", "jax", _no_params_jax, "jit", masked_rows="nan", role="user",
                               uses_params=False)


# ---------------------------------------------------------------- end to end


def test_a_port_with_detached_softmax_probabilities_is_an_error_fwd_bwd_row_out_of_every_verdict(monkeypatch):
    rows, vs, named = run_in_process((*select_impls(OURS_TORCH), PORT, DETACHED), [CROSS], passes=("fwd+bwd",),
                                     monkeypatch=monkeypatch)
    bwd = by_key(rows, "fwd+bwd")
    port, bad = bwd["port:jit:fused"], bwd["detached-port:jit:fused"]
    assert port["status"] in ("ok", "noisy") and port["grad_rel_diff"] < 1e-5, port  # no false red
    assert bad["status"] == "error", bad
    # Its forward is the layer's (checked on the same row); its gradients are not.
    assert bad["out_max_diff"] < 1e-5 and "output" not in bad["message"]
    assert bad["message"].startswith(f"not the same computation as {OURS_TORCH}: gradients differ: query")
    assert "key" in bad["message"]
    assert bad["grad_rel_diff"] > 0.1  # dq and dk are 0 where ours are not: a whole scale off
    assert bad["median_s"] > 0  # measured, kept, rejected
    (v,) = vs
    assert {v["faster"], v["slower"]} == {OURS_TORCH, "port:jit:fused"}  # never the detached port
    # Named, its verdict is not conclusive, and says why.
    (v,) = named("detached-port:jit:fused", OURS_TORCH)
    assert v["conclusive"] is False and v["reason"] == "detached-port:jit:fused is error"


def test_a_row_without_parameter_gradients_says_so_and_is_not_ranked_against_one_that_computes_them(monkeypatch):
    impls = (*select_impls(f"{OURS_TORCH},{OURS_JAX}"), NO_PARAMS_TORCH, NO_PARAMS_JAX)
    rows, vs, named = run_in_process(impls, [CROSS], passes=("fwd+bwd",), monkeypatch=monkeypatch)
    bwd = by_key(rows, "fwd+bwd")
    for key in ("no-params-torch:eager:fused", "no-params-jax:jit:fused"):
        r = bwd[key]
        # The gradients it computes (the inputs') are ours: no false red, and no zeros for parameters.
        assert r["status"] in ("ok", "noisy"), r
        assert r["param_grads"] is False and NO_PARAM_GRADS in r["message"]
        assert r["ratio"] is None  # not ranked against the baseline, which computes them
    for key in (OURS_TORCH, OURS_JAX):
        assert bwd[key]["param_grads"] is True and bwd[key]["ratio"] is not None
    (v,) = vs
    assert {v["faster"], v["slower"]} == {OURS_TORCH, OURS_JAX}
    # In words in the reports: the console under the table, the Markdown's column and message.
    console = Console(file=io.StringIO(), width=100)
    report.print_table(rows, console)
    text = " ".join(console.file.getvalue().split())
    assert f"note: no-params-torch:eager:fused fwd+bwd {CROSS.label}: {NO_PARAM_GRADS}" in text
    md = report.markdown(rows, {}, vs)
    line = next(ln for ln in md.splitlines() if "no-params-jax jit fused" in ln)
    assert "| no |" in line and NO_PARAM_GRADS in line
    # Named against ours, the verdict is not conclusive: not the same backward work.
    (v,) = named("no-params-torch:eager:fused", OURS_JAX)
    assert v["reason"] == "no-params-torch:eager:fused computes no parameter gradients: less backward work than the other row"


# ---------------------------------------------------------------- the rule


def _grads(rng, names, shape=(4, 6)):
    return {n: rng.standard_normal(shape) for n in names}


NAMES = ("query", "key", "value", "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
         "v_proj.weight", "v_proj.bias", "out_proj.weight", "out_proj.bias")


def test_the_float32_gradient_bound_is_twice_the_tables_at_each_gradients_scale():
    """Each implementation may be off by the table's gradient bound, so two by twice it, at the scale of
    the gradient (its largest |value|): 0.9x of that passes, 1.1x does not, on a near-zero element too."""
    tol = TOLERANCES["float32"].gradient
    ref = _grads(np.random.default_rng(0), NAMES)
    ref["q_proj.weight"][0, 0] = 0.0  # a gradient element that cancelled to zero
    scale = np.abs(ref["q_proj.weight"]).max()
    for factor, ok in ((0.9, True), (1.1, False)):
        got = {n: g.copy() for n, g in ref.items()}
        got["q_proj.weight"][0, 0] += factor * (2 * tol.atol + 2 * tol.rtol * scale)
        diff, why = measure.same_gradients(got, ref, "float32")
        assert (why is None) == ok, why
        assert diff == pytest.approx(factor * (2 * tol.atol + 2 * tol.rtol * scale) / scale)
    assert "q_proj.weight" in why


def test_a_bias_gradient_is_judged_at_its_projections_scale():
    """k_proj.bias's gradient is zero by the maths (softmax ignores a constant added to a row's scores): its
    values are rounding of the k_proj family's terms, judged at the family's scale, not at their own."""
    ref = _grads(np.random.default_rng(1), NAMES)
    ref["k_proj.bias"] *= 1e-7
    got = {n: g.copy() for n, g in ref.items()}
    got["k_proj.bias"] = -got["k_proj.bias"]  # 100 % off its own size, 2e-7 of the family's
    assert measure.same_gradients(got, ref, "float32")[1] is None
    got["k_proj.bias"] += 0.01 * np.abs(ref["k_proj.weight"]).max()  # 1 % of the family's scale
    assert "k_proj.bias" in measure.same_gradients(got, ref, "float32")[1]


def test_16_bit_bias_gradients_may_be_summed_in_the_dtype_other_gradients_may_not():
    """bfloat16: 2·k·eps at each gradient's scale (k the table's three_way_k), and for a bias gradient at least
    eps·√n, n the per-token terms it sums (rounding each partial sum of a bfloat16 sum)."""
    import ml_dtypes

    eps, k = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps), TOLERANCES["bfloat16"].three_way_k
    ref = _grads(np.random.default_rng(2), NAMES)
    for name in ("v_proj.bias", "v_proj.weight"):
        got = {n: g.copy() for n, g in ref.items()}
        family = max(np.abs(ref[n]).max() for n in ("value", "v_proj.weight", "v_proj.bias"))
        scale = family if name.endswith(".bias") else np.abs(ref[name]).max()
        got[name][0, 0] += 3 * k * eps * scale  # 1.5x the general bound
        why = measure.same_gradients(got, ref, "bfloat16", bias_terms=4096)[1]  # eps·√4096 = 64 eps > 3k eps
        assert (why is None) == name.endswith(".bias"), why
        assert measure.same_gradients(got, ref, "bfloat16", bias_terms=16)[1] is not None  # eps·√16 < 2k eps


def test_a_missing_input_gradient_differs_a_missing_parameter_gradient_is_less_work():
    ref = _grads(np.random.default_rng(3), NAMES)
    inputs_only = {n: ref[n] for n in ("query", "key", "value")}
    assert measure.same_gradients(inputs_only, ref, "float32") == (0.0, None)
    no_key = {n: g for n, g in ref.items() if n != "key"}
    assert measure.same_gradients(no_key, ref, "float32")[1].startswith("gradients differ: no gradient for key")
    nan = {n: g.copy() for n, g in ref.items()}
    nan["value"][1, 2] = np.nan
    assert "value has NaN at 1 place(s)" in measure.same_gradients(nan, ref, "float32")[1]


def test_verdict_rows_of_unequal_backward_work_never_pair_by_default():
    assert verdict.same_work({0: True, 1: False, 2: True}) == {0, 2}
    assert verdict.same_work({0: False, 1: False}) == {0, 1}  # none computes them: they compare alike
    assert verdict.same_work({0: None, 1: None}) == {0, 1}  # fwd
