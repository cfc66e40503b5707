"""mha-bench on the layers after Llama: --head-dim, --qk-norm (eps, offset), --scale, --softcap, --sinks set every
case's layer, reach the rows, and only the implementations that declare the features run them (ours)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

from parity.bench import cli, report
from parity.bench.records import Row, empty_row
from parity.bench.spec import (
    IMPLS, MEASURED, MODERN_FIELDS, BenchCase, canonical_weights, forward_flops, variant_fields, why_not_in_bench,
)
from test_bench_cli import FAST, fake_spawn

GEMMA2 = ["--head-dim", "8", "--scale", "0.25", "--softcap", "1.0"]  # E=32, N=2: N·H = 16 != E
GPT_OSS = ["--sinks"]
OURS = ("ours-torch", "ours-jax")


def _console():
    return Console(file=io.StringIO(), width=200)


def _cases(argv):
    args = cli.run_parser().parse_args([*FAST, *argv])
    return cli.build_config(args).cases


def test_the_flags_set_the_layer_and_reach_every_row(tmp_path):
    out = tmp_path / "m.json"
    calls, console = [], _console()
    argv = [*FAST, "--head-dim", "8", "--qk-norm", "head", "--qk-norm-eps", "1e-5", "--qk-norm-offset", "1",
            "--scale", "0.25", "--softcap", "30", "--sinks", "--json", str(out)]
    assert cli.main(argv, console=console, spawn=fake_spawn(calls)) == 0, console.file.getvalue()
    sent = {BenchCase.from_fields(item["case"]) for item in calls[0]["items"]}
    c = next(iter(sent)).config
    assert (c.head_size, c.qk_norm, c.qk_norm_eps, c.qk_norm_offset, c.scale, c.softcap, c.sinks) == (
        8, "head", 1e-5, 1.0, 0.25, 30.0, True)
    rows = report.load(str(out))["rows"]
    for r in rows:
        assert {k: r[k] for k in MODERN_FIELDS} == {"head_dim": 8, "qk_norm": "head", "qk_norm_eps": 1e-5,
                                                    "qk_norm_offset": 1.0, "scale": 0.25, "softcap": 30.0, "sinks": True}
    skipped = [r for r in rows if r["impl"] == "torch-sdpa-core"]
    assert skipped and all(r["status"] == "skip" for r in skipped)
    assert "this layer uses head-dim, qk-norm-head, scale, softcap, sinks, which it does not run" in skipped[0]["message"]
    label = "B=1 T=16 S=16 E=32 N=2 H=8 qk_norm=head qk_norm_eps=1e-05 qk_norm_offset=1 scale=0.25 softcap=30 sinks float32"
    assert label in " ".join(console.file.getvalue().split())


@pytest.mark.parametrize("argv, flag", [
    (["--head-dim", "0"], "--head-dim"), (["--qk-norm", "rms"], "--qk-norm"), (["--qk-norm-eps", "-1"], "--qk-norm-eps"),
    (["--qk-norm-eps", "nan"], "--qk-norm-eps"), (["--qk-norm-offset", "inf"], "--qk-norm-offset"),
    (["--scale", "0"], "--scale"), (["--softcap", "-2"], "--softcap"), (["--softcap", "x"], "--softcap"),
])
def test_a_bad_value_is_a_usage_error_naming_its_flag(argv, flag, capsys):
    calls = []
    with pytest.raises(SystemExit) as e:
        cli.main([*FAST, *argv], console=_console(), spawn=fake_spawn(calls))
    assert e.value.code == 2 and not calls
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--qk-norm-eps", "1e-5"], "--qk-norm-eps 1e-05 is the QK-norm's, but the layer has none"),
    (["--qk-norm-offset", "1"], "--qk-norm-offset 1.0 is the QK-norm's, but the layer has none"),
    (["--head-dim", "9", "--rope", "half"], "rope needs an even head_dim, got 9"),
])
def test_a_layer_the_flags_cannot_make_is_a_usage_error(argv, message):
    calls, console = [], _console()
    assert cli.main([*FAST, *argv], console=console, spawn=fake_spawn(calls)) == 2 and not calls
    assert message in " ".join(console.file.getvalue().split())


def test_a_case_round_trips_and_a_row_without_the_fields_is_the_classic_layer():
    gemma = BenchCase.of(2, 5, 7, 24, 4, "bfloat16", head_dim=16, qk_norm="flat", qk_norm_offset=1.0, scale=0.0625,
                         softcap=50.0)
    assert BenchCase.from_fields(gemma.fields()) == gemma
    assert gemma.label == "B=2 T=5 S=7 E=24 N=4 H=16 qk_norm=flat qk_norm_offset=1 scale=0.0625 softcap=50 bfloat16"
    classic = BenchCase.of(2, 5, 7, 24, 4, "bfloat16")
    assert BenchCase.of(2, 5, 7, 24, 4, "bfloat16", head_dim=6) == classic  # N·H = E: the classic head dim
    old = {k: v for k, v in classic.fields().items() if k not in MODERN_FIELDS}
    assert BenchCase.from_fields(old) == classic and classic.label == "B=2 T=5 S=7 E=24 N=4 bfloat16"
    assert variant_fields(old) == variant_fields(classic.fields()) != variant_fields(gemma.fields())
    with pytest.raises(TypeError, match="unknown layer field"):
        BenchCase.of(2, 5, 7, 24, 4, "float32", head_size=8)
    with pytest.raises(ValueError, match="qk_norm 'rms'"):
        BenchCase.of(2, 5, 7, 24, 4, "float32", qk_norm="rms")


def test_an_old_file_still_loads_and_compares_with_classic_rows_only(tmp_path):
    base = report.load("tests/data/bench-cpu.json")
    first = next(r for r in base["rows"] if r["status"] == "ok")
    assert not any(k in first for k in MODERN_FIELDS)  # written before the fields existed
    im = next(i for i in IMPLS if i.bench_key == f"{first['impl']}:{first['mode']}:"
              f"{'weights' if first['need_weights'] else 'fused'}")
    rows = [empty_row(im, BenchCase.from_fields({**first, **layer}), first["pass"], status="ok",
                      median_s=first["median_s"], iqr_s=first["iqr_s"])
            for layer in ({}, {"softcap": 30.0}, {"sinks": True})]
    path = tmp_path / "new.json"
    report.write_json(str(path), rows, {})
    result = report.compare(base, report.load(str(path)))
    assert result.compared == 1  # the classic row met its old self; the other layers are rows of their own
    assert sorted(((e["softcap"], e["sinks"]) for e in result.only_new), key=str) == [(30.0, False), (None, True)]
    for bad in ({"scale": -1.0}, {"sinks": 1}, {"qk_norm_eps": 1e-5}, {"qk_norm": "rms"}, {"head_dim": 0}):
        assert Row.problem({**rows[0], **bad}) is not None, bad
        report.write_json(str(path), [{**rows[0], **bad}], {})
        with pytest.raises(report.BenchFileError, match=next(iter(bad))):
            report.load(str(path))


def test_the_flop_count_uses_the_head_dim():
    case = BenchCase.of(1, 16, 16, 32, 2, "float32", head_dim=8)  # N·H = 16, E = 32
    B, T, S, E, N, H = 1, 16, 16, 32, 2, 8
    projections = 2 * B * T * E * N * H * 2 + 2 * B * S * E * N * H * 2  # q and out; k and v (K = N)
    attention = 2 * (2 * B * N * T * S * H)  # Q·Kᵀ and P·V
    assert forward_flops(case.problem) == projections + attention == 81920


def test_the_canonical_weights_draw_the_norms_and_sinks_away_from_their_init():
    classic = canonical_weights(BenchCase.of(1, 4, 4, 32, 2, "float32").config, "float32", 0)
    for offset in (0.0, 1.0):
        case = BenchCase.of(1, 4, 4, 32, 2, "float32", qk_norm="head", qk_norm_offset=offset, sinks=True)
        sd = canonical_weights(case.config, "float32", 0)
        assert all(np.array_equal(sd[k], a) for k, a in classic.items())  # the projections keep their bits
        for name in ("q_norm.weight", "k_norm.weight"):
            scale = offset + sd[name]
            assert sd[name].shape == (16,) and np.all((scale >= 0.5) & (scale <= 1.5)) and np.ptp(scale) > 0.1
        assert sd["sinks"].shape == (2,) and np.all(sd["sinks"] != 0)


def test_only_ours_run_the_layers_and_every_peer_skip_names_the_features():
    for argv, features in ((GEMMA2, "head-dim, scale, softcap"), (GPT_OSS, "sinks")):
        (case,) = _cases([*argv, "--seq", "16"])
        for im in IMPLS:
            why = why_not_in_bench(im, case)
            if im.family in OURS:
                assert why is None, (im.name, why)
            else:
                assert why is not None and f"this layer uses {features}, which it does not run" in why, (im.name, why)


def test_our_fused_torch_path_asks_the_materialised_core_where_sdpa_takes_no_softcap_or_sinks():
    pytest.importorskip("torch")
    from parity.bench.torch_bench import kernel_label

    fused = next(im for im in IMPLS if im.bench_key == "ours-torch:eager:fused")
    config = lambda **kw: BenchCase.of(1, 4, 4, 32, 2, "float32", **kw).config  # noqa: E731
    assert kernel_label(fused) == kernel_label(fused, config(scale=0.5)) == "sdpa"  # SDPA takes scale=
    assert kernel_label(fused, config(softcap=5.0)) == "bmm-softmax (softcap)"
    assert kernel_label(fused, config(softcap=5.0, sinks=True)) == "bmm-softmax (softcap, sinks)"


# One timed run (a second, Gemma 2's, took 19 s of the suite): the skip reasons and the soft-cap's kernel of
# Gemma 2's layer are checked above without timing.
@pytest.mark.parametrize("argv, features, kernel", [
    ([*GPT_OSS, "--kv-heads", "1", "--qk-norm", "head", "--mask", "causal"], "qk-norm-head, sinks", "bmm-softmax (sinks)"),
], ids=["gpt-oss"])
def test_ours_time_the_layer_in_both_frameworks_and_the_peers_skip_it(argv, features, kernel, monkeypatch):
    """The sweep's own code in this process (`test_bench_gradients.run_in_process`), fwd+bwd (its forward output
    is checked too): the output and gradient checks against ours-torch, the norm weights' and sinks' included."""
    from test_bench_gradients import run_in_process

    impls = [im for im in IMPLS if im.mode != "compile" and (im.family in OURS or im.name in (
        "torch-sdpa-core", "jax-dpa-core", "torch-sdpa-gqa", "jax-dpa-gqa"))]
    rows, _, _ = run_in_process(impls, _cases([*argv, "--seq", "8"]), passes=("fwd+bwd",), monkeypatch=monkeypatch)
    ours = [r for r in rows if r["impl"] in OURS]
    assert len(ours) == 4  # weights and fused in both frameworks
    for r in ours:
        assert r["status"] in MEASURED and r["param_grads"] is True, r
        if (r["impl"], r["need_weights"]) != ("ours-torch", True):  # the reference
            assert r["out_max_diff"] is not None and r["grad_rel_diff"] is not None, r
    assert [r["kernel"] for r in ours if r["impl"] == "ours-torch" and not r["need_weights"]] == [kernel]
    peers = [r for r in rows if r["impl"] not in OURS]
    assert len(peers) == 4 and all(r["status"] == "skip" for r in peers)
    assert all(f"{features}, which it does not run" in r["message"] for r in peers), [r["message"] for r in peers]
    assert json.dumps(rows, allow_nan=False)
