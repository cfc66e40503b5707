"""mha-bench: the cases researchers time (masks, T != S, the native grouped baselines), the interference
probe, and what a run writes when an output cannot be compared. Fake workers for the CLI; real
builds in process for the masks and the baselines (forward only, tiny sizes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity.bench import cli, measure, report
from parity.bench.measure import same_output
from parity.bench.records import empty_row
from parity.bench.spec import FLOPS_FORMULA, IMPLS, BenchCase, BenchMask, keep_mask, pass_flops, why_not_in_bench
from test_bench_cli import _console, _run, fake_spawn, FAST


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
        assert why_not_in_bench(_impl(key), grouped) is None, key
        assert "grouped-layer baseline" in why_not_in_bench(_impl(key), classic)
    assert why_not_in_bench(_impl("torch-sdpa-gqa:eager:fused"), rotary) is None
    assert "rope" in why_not_in_bench(_impl("keras-gqa:jit:fused"), rotary)  # Keras's layer has no RoPE
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


# ---------------------------------------------------------------- window:W and packed:D


def test_bench_masks_parse_once_into_kind_and_parameter_and_write_back_the_same_string():
    assert BenchMask.parse("window:1024") == BenchMask("window", 1024) and str(BenchMask("window", 1024)) == "window:1024"
    assert BenchMask.parse("packed:4") == BenchMask("packed", 4) and BenchMask.parse(" causal ") == BenchMask("causal")
    assert str(BenchMask.parse("window:032")) == "window:32"  # one spelling in rows and labels
    for text, message in (("window:0", "W .* must be a positive integer"), ("packed:0", "D .* must be a positive"),
                          ("window:x", "parameter must be a positive integer, got 'x'"), ("window:-3", "got '-3'"),
                          ("window:", "got ''"), ("window", "needs its parameter"), ("causal:2", "only window:W, packed:D and chunk:C"),
                          ("random", "is not one of none, padding, causal, window:W, packed:D or chunk:C"), ("window:３", "got '３'")):
        with pytest.raises(ValueError, match=message):
            BenchMask.parse(text)
    case = BenchCase.of(2, 8, 8, 12, 3, "float32", mask=BenchMask("window", 3))
    assert case.mask == "window:3" and case.fields()["mask"] == "window:3" and "mask=window:3" in case.label
    assert BenchCase.from_fields(case.fields()) == case
    with pytest.raises(ValueError, match="needs T divisible by D=3"):
        BenchCase.of(1, 8, 8, 12, 3, "float32", mask="packed:3")
    with pytest.raises(ValueError, match="needs T == S"):
        BenchCase.of(1, 8, 16, 12, 3, "float32", mask="packed:2")
    with pytest.raises(ValueError, match="window:4 mask needs T <= S"):
        BenchCase.of(1, 9, 8, 12, 3, "float32", mask="window:4")
    # The halved case of the recompile timing stays a valid packed case (T a multiple of D).
    assert BenchCase.of(1, 24, 24, 12, 3, "float32", mask="packed:4").shrunk().seq_q == 12
    assert BenchCase.of(1, 20, 20, 12, 3, "float32", mask="packed:4").shrunk().seq_q == 8


def test_the_window_and_packed_keep_masks_and_their_kept_fraction():
    window = keep_mask(BenchCase.of(2, 5, 7, 12, 3, "float32", mask="window:3"))
    assert window.shape == (2, 1, 5, 7) and window.dtype == bool and (window == window[:1]).all()
    # Bottom-right: query t is key position t + 2 and keeps the 3 keys t..t+2, itself the last.
    assert [set(np.flatnonzero(r)) for r in window[0, 0]] == [{t, t + 1, t + 2} for t in range(5)]
    packed = keep_mask(BenchCase.of(1, 6, 6, 12, 3, "float32", mask="packed:2"))[0, 0]
    # Documents 0..2 and 3..5, causal within each: query 4 sees 3 and 4, query 2 sees 0..2.
    assert set(np.flatnonzero(packed[4])) == {3, 4} and set(np.flatnonzero(packed[2])) == {0, 1, 2}
    assert int(packed.sum()) == 2 * (1 + 2 + 3)
    # window:W at T = S keeps W(W+1)/2 in the first W rows and W in each other: at T=8192, W=1024 that
    # is 11.7 % of T², against 50 % for causal; packed:D keeps D·L(L+1)/2, L = T/D: 12.5 % for 4 docs.
    T, W, D = 8192, 1024, 4
    L = T // D
    assert BenchMask("window", W).kept(1, T, T) == W * (W + 1) // 2 + (T - W) * W
    assert abs(BenchMask("window", W).kept(1, T, T) / T**2 - 0.1172) < 1e-4
    assert BenchMask("packed", D).kept(3, T, T) == 3 * D * L * (L + 1) // 2
    # The closed forms count what the dense masks keep, for T = S and T < S, every kind.
    for mask, B, Tq, Sk in (("window:3", 2, 5, 7), ("window:7", 1, 7, 7), ("window:100", 2, 5, 9), ("packed:3", 2, 9, 9),
                            ("packed:1", 1, 4, 4), ("causal", 2, 5, 7), ("padding", 3, 5, 7)):
        case = BenchCase.of(B, Tq, Sk, 12, 3, "float32", mask=mask)
        assert case.bench_mask.kept(B, Tq, Sk) == int(keep_mask(case).sum()), mask
    # A window as wide as the keys is causal; one document per row is causal.
    causal = keep_mask(BenchCase.of(2, 5, 7, 12, 3, "float32", mask="causal"))
    assert (keep_mask(BenchCase.of(2, 5, 7, 12, 3, "float32", mask="window:7")) == causal).all()
    assert (keep_mask(BenchCase.of(2, 7, 7, 12, 3, "float32", mask="packed:1")) ==
            keep_mask(BenchCase.of(2, 7, 7, 12, 3, "float32", mask="causal"))).all()


def test_structured_implementations_get_the_causal_window_and_packed_masks_as_keywords_for_the_same_mask():
    from parity.bench.spec import impl_keep_mask, structure_for
    from parity.impls import BUILTIN
    from parity.reference import structured_keep
    ours = next(im for im in BUILTIN if im.structured)
    dense = next(im for im in BUILTIN if not im.structured and not im.takes_is_causal)
    for mask, B, T, S in (("causal", 2, 5, 7), ("causal", 2, 6, 6), ("window:3", 2, 5, 7), ("window:100", 1, 5, 9),
                          ("packed:3", 2, 9, 9)):
        case = BenchCase.of(B, T, S, 12, 3, "float32", mask=mask)
        kw, padding = structure_for(ours, case)
        assert padding is None and impl_keep_mask(ours, case) is None  # the keywords are the whole mask
        # the same mask as the dense one every other implementation gets
        assert (np.broadcast_to(structured_keep(T, S, **kw), (B, 1, T, S)) == keep_mask(case)).all(), mask
        assert structure_for(dense, case) is None and (impl_keep_mask(dense, case) == keep_mask(case)).all()
    for mask in ("none", "padding"):  # the others stay dense masks (or none) for everyone
        case = BenchCase.of(2, 5, 7, 12, 3, "float32", mask=mask)
        assert structure_for(ours, case) is None


def test_flops_count_the_attention_over_the_kept_entries():
    # B=1 T=S=8 E=8 N=2 (H=4): projections 2·1·8·4·(2·2·8 + 2·2·8) = 4096; Q·Kᵀ and P·V 2·N·H = 16 FLOPs
    # each per kept (t, s) entry: 64 entries unmasked, 36 causal, window:3 3·4/2 + 5·3 = 21, packed:2
    # 2·(4·5/2) = 20, window:8 (as wide as the keys) causal's 36.
    for mask, kept in (("none", 64), ("causal", 36), ("window:3", 21), ("packed:2", 20), ("window:8", 36)):
        case = BenchCase.of(1, 8, 8, 8, 2, "float32", mask=mask)
        assert pass_flops(case, "fwd") == 4096 + 2 * 16 * kept, mask
        assert pass_flops(case, "fwd+bwd") == 3 * (4096 + 2 * 16 * kept), mask
    assert "kept" in FLOPS_FORMULA


def test_window_and_packed_on_the_command_line_reach_the_workers_the_json_and_compare(tmp_path):
    out = tmp_path / "w.json"
    rc, text, calls = _run([*FAST, "--seq", "16", "--mask", "none,window:4,packed:2,window:04", "--json", str(out)])
    assert rc == 0, text
    assert {BenchCase.from_fields(item["case"]).mask for item in calls[0]["items"]} == {"none", "window:4", "packed:2"}
    assert "B=1 T=16 S=16 E=32 N=2 mask=window:4 float32" in text and "mask=packed:2" in text
    data = report.load(str(out))  # the file's validation takes the parameterised masks
    rows = {(r["impl"], r["mask"]): r for r in data["rows"]}
    assert {m for _, m in rows} == {"none", "window:4", "packed:2"}
    assert "kept" in data["environment"]["flops_formula"]
    # GFLOP/s over the kept entries: window:4 at T=16 keeps 4·5/2 + 12·4 = 58 of 256 (t, s) entries.
    r = rows["ours-torch", "window:4"]
    projections = 2 * 1 * 32 * 16 * (2 * 2 * 16 + 2 * 2 * 16)
    assert r["gflops"] == pytest.approx((projections + 4 * 2 * 16 * 58) / r["median_s"] / 1e9)
    # compare matches rows by their mask string
    other = tmp_path / "o.json"
    _run([*FAST, "--seq", "16", "--mask", "window:4", "--json", str(other)])
    result = report.compare(data, report.load(str(other)))
    assert result.compared and {k["mask"] for k in result.only_base} == {"none", "packed:2"}


@pytest.mark.parametrize("argv, message", [
    (["--mask", "window:0"], "W (keys in the window) must be a positive integer"),
    (["--mask", "none,window:x"], "the parameter must be a positive integer, got 'x'"),
    (["--mask", "sliding"], "is not one of none, padding, causal"),
])
def test_a_bad_mask_is_a_usage_error_naming_it(argv, message, capsys):
    calls = []
    with pytest.raises(SystemExit) as e:
        cli.main([*FAST, *argv], console=_console(), spawn=fake_spawn(calls))
    assert e.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert "argument --mask" in err and message in err


def test_a_packed_mask_that_does_not_divide_t_is_a_usage_error():
    rc, text, calls = _run([*FAST, "--seq", "8", "--mask", "packed:3"])
    assert rc == 2 and not calls and "needs T divisible by D=3" in text and text.count("\n") == 1


def test_window_and_packed_reach_every_implementation_as_the_oracles_mask():
    """Ours in both frameworks and the torch and JAX peers, self-attention: each output equals the
    float64 oracle's on a mask written here from the definitions (not from `structured_keep`), and
    differs from the causal one (the window and the documents reach every program)."""
    pytest.importorskip("torch")
    from parity import reference
    from parity.bench import jax_bench, torch_bench
    from parity.bench.spec import canonical_weights, make_inputs

    B, T, E, N = 2, 8, 24, 4
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    masks = {"window:3": (s <= t) & (s > t - 3), "packed:2": (s <= t) & (s // 4 == t // 4), "causal": s <= t}
    keys = ("ours-torch:eager:fused", "torch-sdpa-core:eager:fused", "ours-jax:jit:fused", "jax-dpa-core:jit:fused")
    tol = 2e-5  # float32 implementations against the float64 oracle at these sizes
    for mask, keep in masks.items():
        case = BenchCase.of(B, T, T, E, N, "float32", mask=mask)
        sd = {k: reference.as_float64(v) for k, v in canonical_weights(case.config, "float32", 0).items()}
        x = reference.as_float64(make_inputs(case, 0)[0])
        want = reference.forward(sd, x, x, x, np.broadcast_to(keep, (B, 1, T, T)), num_heads=N).output
        for key in keys:
            assert why_not_in_bench(_impl(key), case) is None, key
            mod = torch_bench if _impl(key).framework == "torch" else jax_bench
            bench = mod.build(_impl(key), case, "fwd", "cpu", 0)
            if bench.aot_compile is not None:
                bench.aot_compile()
            got = bench.output()
            assert np.abs(got - want).max() < tol, (mask, key, np.abs(got - want).max())
            if mask != "causal":
                causal_keep = np.broadcast_to(masks["causal"], (B, 1, T, T))
                assert np.abs(got - reference.forward(sd, x, x, x, causal_keep, num_heads=N).output).max() > 1e-3
