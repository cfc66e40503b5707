"""mha-bench: the cases researchers time (masks, T != S, the native grouped baselines), the interference
probe, and what a run writes when an output cannot be compared. Fake workers for the CLI; real
builds in process for the masks and the baselines (forward only, tiny sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.bench import cli, measure, report
from parity.bench.measure import same_output
from parity.bench.spec import IMPLS, BenchCase, empty_row, keep_mask, unsupported
from test_bench_cli import _console, _run, FAST


def _impl(key):
    return next(im for im in IMPLS if im.bench_key == key)


def test_the_keep_masks_are_causal_bottom_right_and_padding_without_an_empty_row():
    causal = keep_mask(BenchCase.of(3, 5, 7, 12, 3, "float32", mask="causal"))
    assert causal.shape == (3, 1, 5, 7) and causal.dtype == bool
    # Query t is key position t + S - T = t + 2: it sees keys 0..t+2 (the last query sees all 7).
    assert [int(n) for n in causal[0, 0].sum(-1)] == [3, 4, 5, 6, 7] and (causal == causal[:1]).all()
    padding = keep_mask(BenchCase.of(3, 5, 7, 12, 3, "float32", mask="padding"))
    # Row b keeps its first 7 - floor(7b / 6) keys: 7, 6, 5; the same for every query.
    assert [int(n) for n in padding[:, 0, 0].sum(-1)] == [7, 6, 5] and (padding[:, :, :1] == padding).all()
    assert padding[:, 0, 0, 0].all() and keep_mask(BenchCase.of(3, 5, 7, 12, 3, "float32")) is None
    with pytest.raises(ValueError, match="causal mask needs T <= S"):
        BenchCase.of(3, 7, 5, 12, 3, "float32", mask="causal")


def test_mask_and_kv_seq_make_cases_whose_fields_reach_the_json_and_compare(tmp_path):
    out = tmp_path / "m.json"
    rc, text, calls = _run([*FAST, "--seq", "16", "--kv-seq", "24", "--mask", "none,causal", "--json", str(out)])
    assert rc == 0, text
    cases = {BenchCase.from_fields(item["case"]) for item in calls[0]["items"]}
    assert {(c.seq_q, c.seq_k, c.mask) for c in cases} == {(16, 24, "none"), (16, 24, "causal")}
    rows = json.loads(out.read_text())["rows"]
    assert {(r["seq_q"], r["seq_k"], r["mask"]) for r in rows} == {(16, 24, "none"), (16, 24, "causal")}
    assert "B=1 T=16 S=24 E=32 N=2 mask=causal float32" in text
    # compare matches rows by their mask too: a causal row is not the unmasked one.
    other = tmp_path / "o.json"
    _run([*FAST, "--seq", "16", "--kv-seq", "24", "--mask", "padding", "--json", str(other)])
    result = report.compare(report.load(str(out)), report.load(str(other)))
    assert not result.entries and {k["mask"] for k in result.only_base} == {"none", "causal"}
    assert {k["mask"] for k in result.only_new} == {"padding"}


def test_a_causal_case_with_more_queries_than_keys_is_a_usage_error():
    rc, text, calls = _run([*FAST, "--seq", "32", "--kv-seq", "16", "--mask", "causal"])
    assert rc == 2 and not calls and "causal mask needs T <= S" in text and text.count("\n") == 1


def test_the_native_grouped_baselines_run_the_variant_layers_they_hold_and_skip_the_classic_one():
    grouped = BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2, mask="causal")
    classic = BenchCase.of(2, 5, 7, 24, 4, "float32")
    rotary = BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2, rope="half", bias="none")
    for key in ("torch-sdpa-gqa:eager:fused", "jax-dpa-gqa:jit:fused", "keras-gqa:jit:fused"):
        assert unsupported(_impl(key), grouped) is None, key
        assert "grouped-layer baseline" in unsupported(_impl(key), classic)
    assert unsupported(_impl("torch-sdpa-gqa:eager:fused"), rotary) is None
    assert "rope" in unsupported(_impl("keras-gqa:jit:fused"), rotary)  # Keras's layer has no RoPE
    rc, text, calls = _run([*FAST, "--impls", "ours-torch:eager:fused,torch-sdpa-gqa,jax-dpa-gqa", "--heads", "4",
                            "--kv-heads", "2"])
    assert rc == 0, text
    assert {item["impl"] for item in calls[0]["items"]} == {
        "ours-torch:eager:fused", "torch-sdpa-gqa:eager:fused", "jax-dpa-gqa:jit:fused"}


def test_masked_grouped_cases_build_in_both_frameworks_with_the_mask_applied():
    """Ours and the native baselines, causal with T < S and padding: the same output as ours-torch's,
    and not the unmasked one (the mask reaches every program)."""
    pytest.importorskip("torch")
    from parity.bench import jax_bench, torch_bench

    base = dict(kv_heads=2)
    outs = {}
    for mask, keys in (("causal", ("ours-torch:eager:fused", "torch-sdpa-gqa:eager:fused", "ours-jax:jit:fused",
                                   "jax-dpa-gqa:jit:fused")),
                       ("padding", ("ours-torch:eager:fused", "ours-jax:jit:fused")), ("none", ("ours-torch:eager:fused",))):
        case = BenchCase.of(2, 5, 7, 24, 4, "float32", mask=mask, **base)
        for key in keys:
            mod = torch_bench if _impl(key).framework == "torch" else jax_bench
            bench = mod.build(_impl(key), case, "fwd", "cpu", 0)
            if bench.aot_compile is not None:
                bench.aot_compile()
            outs[mask, key] = bench.output()
    plain = outs["none", "ours-torch:eager:fused"]
    for (mask, key), out in outs.items():
        ref = outs[mask, "ours-torch:eager:fused"]
        assert same_output(out, ref, "float32")[1] is None, (mask, key)
        if mask != "none":
            assert np.abs(out - plain).max() > 1e-3, (mask, key)


def test_an_output_of_another_shape_has_a_null_difference_and_the_run_still_writes_its_json(tmp_path):
    ref = np.zeros((3, 5, 12))
    diff, why = same_output(np.zeros((3, 5, 13)), ref, "float32")
    assert diff is None and "output shape (3, 5, 13) differs" in why
    nan = ref.copy()
    nan[0, 0, 0] = np.nan
    assert same_output(nan, ref, "float32")[0] is None
    inf = ref.copy()
    inf[1, 2, 3] = np.inf
    diff, why = same_output(inf, ref, "float32")  # an infinity where the reference is finite: a mismatch
    assert diff is None and "1 of 180 elements" in why
    assert same_output(inf, inf, "float32") == (0.0, None)  # the same infinity matches itself
    row = empty_row(_impl("ours-jax:jit:fused"), BenchCase.of(3, 5, 5, 12, 3, "float32"), "fwd", status="error",
                    median_s=1e-3, iqr_s=0.0, out_max_diff=diff, message=f"not the same computation: {why}")
    path = tmp_path / "e.json"
    report.write_json(str(path), [row], {"device": "cpu"})  # allow_nan=False: an infinity raised here
    assert report.load(str(path))["rows"][0]["out_max_diff"] is None


def test_a_fallback_that_cannot_be_written_either_is_one_line_and_exit_3(tmp_path, monkeypatch):
    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    def markdown_on_a_full_disk(*a, **kw):
        monkeypatch.setattr(cli.tempfile, "mkstemp", full_disk)  # the temporary directory is full too, from now
        full_disk()

    monkeypatch.setattr(report, "write_markdown", markdown_on_a_full_disk)
    rc, text, _ = _run([*FAST, "--markdown", str(tmp_path / "b.md")])
    assert rc == 3 and "Traceback" not in text
    assert "the results could not be kept either: OSError" in text


def test_the_interference_probe_reads_other_processes_cpu_and_its_rules():
    # Read at the start, then at each probe and again after its calibration loop (not the next round's).
    clock = iter([0.0, 2.0, 2.0, 4.0, 4.0])
    busy = iter([10.0, 13.0, 13.0, 14.0, 14.0])  # the system's busy CPU seconds
    own = iter([1.0, 2.0, 2.0, 3.0, 3.0])  # this process's
    probe = measure.InterferenceProbe(clock=lambda: next(clock), busy=lambda: next(busy), own=lambda: next(own),
                                      loadavg=lambda: 1.5, calibrate=lambda: 1e-3)
    first, second = probe(), probe()
    assert first == {"calib_s": 1e-3, "loadavg": 1.5, "others_cpu": 1.0}  # (3 - 1) s of others over 2 s
    assert second["others_cpu"] == 0.0
    quiet = [{"calib_s": 1e-3, "loadavg": 2.4, "others_cpu": 0.2}] * 8
    assert measure.interference(quiet, cores=2, own_threads=2) == []
    assert measure.interference_notes(quiet, cores=2, own_threads=2) == []  # 2.4 - 2 threads < 1
    assert "other processes used 0.60 cores" in measure.interference([{**quiet[0], "others_cpu": 0.6}], 2, 2)[0]
    # The calibration loop's jitter and the lagging load average are reported, never a veto.
    slow = quiet[:6] + [{**quiet[0], "calib_s": 2e-3}] * 3
    assert measure.interference(slow, 2, 2) == []
    assert "slower than its fastest in 3 of 9 rounds" in measure.interference_notes(slow, 2, 2)[0]
    assert "in 2 of" not in " ".join(measure.interference_notes(quiet[:6] + slow[-2:], 2, 2))  # a quarter, no more
    loaded = [{**quiet[0], "loadavg": 3.0}]
    assert measure.interference(loaded, 2, 2) == [] and "load average 3.00" in measure.interference_notes(loaded, 2, 2)[0]


def test_other_processes_cpu_over_the_run_counts_what_this_process_and_its_workers_did_not_use():
    clock, busy, own = iter([0.0, 4.0]), iter([10.0, 17.0]), iter([1.0, 6.0])
    others = measure.OthersCpu(clock=lambda: next(clock), busy=lambda: next(busy), own=lambda: next(own))
    assert others() == 0.5  # (7 - 5) busy seconds not ours over 4 s
    clock, busy, own = iter([0.0, 2.0]), iter([10.0, 11.0]), iter([1.0, 3.0])  # own > busy by tick rounding: 0
    assert measure.OthersCpu(clock=lambda: next(clock), busy=lambda: next(busy), own=lambda: next(own))() == 0.0

    def unreadable():
        raise OSError("no /proc")

    assert measure.OthersCpu(busy=unreadable)() is None


def test_the_plot_title_names_the_whole_layer_and_the_markdown_starts_with_the_verdicts():
    case = BenchCase.of(1, 1024, 4096, 512, 8, "float32", kv_heads=2, rope="half", bias="none", mask="causal")
    row = empty_row(_impl("ours-jax:jit:fused"), case, "fwd", status="ok", median_s=1e-3, iqr_s=0.0, ratio=1.0,
                    baseline="ours-torch:eager:fused")
    assert report.layer_title([row]) == "E=512 N=8 K=2 RoPE=half bias=none mask=causal B=1 T=1024 S=4096 float32"
    v = {"case": case.label, "pass": "fwd", "faster": "a", "slower": "b", "ratio": 2.0, "ci": [1.9, 2.1],
         "conclusive": True, "repeats": 48, "rounds": 12, "processes": 2, "interference": [], "reason": None}
    md = report.markdown([row], {}, [v])
    assert md.index("## Verdicts") < md.index("## Run") < md.index("## Rows")
    assert "a is 2x faster than b (95% CI 1.9-2.1, 2 processes, 12 rounds, 48 repeats)" in md
    assert "ratio to baseline" in md and f"fwd {case.label}: ours-torch:eager:fused" in md
    console = _console()
    report.print_table([row], console)
    assert "ratio to ours-torch:eager:fused" in console.file.getvalue()
