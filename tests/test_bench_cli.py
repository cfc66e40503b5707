"""mha-bench end to end: a tiny real sweep in worker subprocesses, and absent devices."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from mha_spec import allocator
from parity.bench import cli, sweep, verdict
from parity.bench.records import ROW_FIELDS
from parity.bench.spec import PRESETS

TINY = [
    "--seq", "16,32", "--batch", "1", "--embed", "32", "--heads", "2", "--budget", "0.02",
    "--peak-sizes", "256", "--no-progress",
]


def _console():
    return Console(file=io.StringIO(), width=200)


# Old-style user implementations (no variants declared): the first computes what ours does, the
# other two a planted wrong output the run must reject though it times them.
PLANTED = '''
from torch.func import functional_call

from parity import convert
from parity.impls import Implementation


def _wrapped(name, change):
    def factory(sd, num_heads, *, dtype, device, masked_rows):
        m = convert.to_torch(sd, num_heads, masked_rows=masked_rows).to(device)  # ours-torch's fused path

        def call(params, q, k, v, mask):
            out, _ = functional_call(m, params, (q, k, v, mask), {"need_weights": False})
            return change(out)

        return call

    return Implementation(name, "torch", factory, "eager", False, masked_rows=None, role="user")


same = _wrapped("same", lambda out: out)
negated = _wrapped("negated", lambda out: -out)
time_reversed = _wrapped("time-reversed", lambda out: out.flip(1))
'''
REAL_IMPLS = ("ours-torch:eager:fused", "torch-sdpa-core:eager:fused", "ours-jax:jit:fused")
PLANTED_IMPLS = ("same", "negated", "time-reversed")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """One real sweep in one worker (--isolation run) holding both frameworks: ours in both, a torch
    peer and the planted implementations through --impl. Shared by the tests below: one start-up of
    torch and JAX. The forward pass of the classic layer only: fwd+bwd runs the same worker code with
    another program, and test_bench.py's TestVariants builds and runs both passes' programs in both frameworks
    on a grouped, rotary, bias-free layer."""
    tmp = tmp_path_factory.mktemp("real-run")
    (tmp / "bench_planted.py").write_text(PLANTED)
    patch = pytest.MonkeyPatch()
    patch.syspath_prepend(str(tmp))
    patch.setenv("PYTHONPATH", str(tmp))  # the worker imports it too
    out, console = tmp / "b.json", _console()
    try:
        rc = cli.main(
            ["--seq", "16", "--batch", "1", "--embed", "32", "--heads", "2", "--budget", "0.02",
             "--peak-sizes", "256", "--no-progress", "--impls", ",".join(REAL_IMPLS),
             *(f"--impl=bench_planted:{name.replace('-', '_')}" for name in PLANTED_IMPLS),
             "--passes", "fwd", "--threads", "1", "--isolation", "run", "--processes", "1",  # two: the fake-worker tests
             "--json", str(out), "--markdown", str(tmp / "b.md"), "--plot", str(tmp / "b.png")],
            console=console,
        )
    finally:
        patch.undo()
    return rc, console.file.getvalue(), json.loads(out.read_text()), tmp


def test_real_sweep_times_both_frameworks_in_one_worker_and_writes_every_report(real_run):
    rc, text, data, tmp = real_run
    env = data["environment"]
    for key in ("python", "versions", "cpu_model", "threads", "precision_settings", "XLA_FLAGS", "inductor_env", "peaks",
                "thread_settings", "interference", "calibration_s", "device_plan"):
        assert key in env
    assert env["device_plan"] == {"requested": "cpu", "name": "cpu", "torch_device": "cpu", "jax_platform": "cpu",
                                  "skip_reason": "", "note": ""}
    # One worker held both frameworks (--isolation run), each pinned to the same single CPU.
    assert env["threads"] == {"torch": 1, "jax": 1} and env["thread_settings"]["torch_threads"] == 1
    assert env["thread_settings"]["env"] == sweep.worker_settings()
    assert env["precision_settings"]["jax"]["jax_default_matmul_precision"] == "highest"
    rows = data["rows"]
    assert len(rows) == len(REAL_IMPLS) + len(PLANTED_IMPLS)
    # These tiny shapes run at a few GFLOP/s, far below the peak: every row that computes what ours
    # does is measured, and its output is within the bound of the reference's.
    good = [r for r in rows if r["impl"] not in ("negated", "time-reversed")]
    assert all(r["status"] in ("ok", "noisy") for r in good), good
    assert all(r["out_max_diff"] is not None for r in good if r["impl"] != "ours-torch")
    # One verdict per (case, pass), torch against JAX by default, over paired repeats.
    vs = data["verdicts"]
    assert len(vs) == 1
    for v in vs:
        sides = {v["faster"].split(":")[0], v["slower"].split(":")[0]}
        assert "ours-jax" in sides and sides & {"ours-torch", "torch-sdpa-core", "same"}
        assert v["ratio"] >= 1 and v["repeats"] >= 8
    for r in rows:
        assert list(r) == list(ROW_FIELDS)
        assert r["mem_source"] and r["median_s"] > 0
        assert (r["kv_heads"], r["rope"], r["bias"]) == (2, None, "all")
        if r["framework"] == "jax":
            assert r["compile_s"] is not None and r["recompile_s"] is not None
    assert (tmp / "b.png").stat().st_size > 0
    assert "measured matmul peak" in (tmp / "b.md").read_text()


def test_a_planted_wrong_output_through_impl_is_an_error_row_and_exit_1(real_run):
    rc, text, data, _ = real_run
    assert rc == 1, text
    rows = {r["impl"]: r for r in data["rows"]}
    assert rows["same"]["status"] in ("ok", "noisy") and rows["same"]["out_max_diff"] == 0.0  # no false red
    for name in ("negated", "time-reversed"):
        assert rows[name]["status"] == "error", rows[name]
        assert rows[name]["message"].startswith("not the same computation as ours-torch:eager:fused")
        assert rows[name]["median_s"] > 0  # measured, kept, rejected
    assert "2 item(s) failed" in text


def test_absent_gpu_is_a_clean_skip(tmp_path):
    if not sweep.device_plan("gpu").skip_reason:
        pytest.skip("a GPU is present: nothing to skip")
    out = tmp_path / "gpu.json"
    console = _console()
    rc = cli.main([*TINY, "--device", "gpu", "--passes", "fwd", "--json", str(out)], console=console)
    assert rc == 1  # nothing was measured: not a pass, but the reason is recorded
    assert "not present" in console.file.getvalue()
    assert "nothing was measured" in console.file.getvalue()
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["status"] == "skip" and "no GPU found" in r["message"] for r in rows)


def test_torch_without_cuda_reports_why():
    torch = pytest.importorskip("torch")
    from parity.bench import torch_bench

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert "no CUDA device" in torch_bench.check_device("cuda")
    assert torch_bench.check_device("cpu") is None


def test_auto_device_falls_back_to_cpu_without_accelerators():
    plan = sweep.device_plan("auto")
    assert plan.requested == "auto" and not plan.skip_reason
    from parity.devices import device_nodes

    found = device_nodes()
    if found["gpu"] and found["tpu"]:
        assert (plan.name, plan.torch_device, plan.jax_platform) == ("cpu", "cpu", "cpu")


def test_list_plans_without_running():
    console = _console()
    assert cli.main([*TINY, "--preset", "long", "--list"], console=console) == 0
    text = console.file.getvalue()
    assert "ours-jax:jit:fused" in text


# ---------------------------------------------------------------- exit codes (fake workers)

from parity.bench import measure, report  # noqa: E402
from parity.bench.records import empty_row  # noqa: E402
from parity.bench.spec import IMPLS, BenchCase  # noqa: E402
from test_bench import FakeProc  # noqa: E402

FAST = [*TINY, "--impls", "ours-torch:eager:fused,torch-sdpa-core", "--passes", "fwd", "--isolation", "run"]


def fake_spawn(calls, fail=(), load=(1.0,), cost=None, probes=()):
    """A worker launcher that runs nothing: rows of 3 rounds of 4 calls, each call `cost[key]` (default
    1 ms) times the load of its repeat (`load`, cycled: the same for every implementation, as a
    machine's load is for the calls of one repeat), or an error row for an implementation in `fail`;
    `probes` (the interference probe's records) follow every group."""
    impls = {im.bench_key: im for im in IMPLS}
    factors = [load[i % len(load)] for i in range(4)]

    def spawn(spec, env):
        calls.append(spec)
        lines = [f"@@PEAK\t{json.dumps({'framework': 'torch', 'dtype': p['dtype'], 'gflops': 1e6})}"
                 for p in spec["peaks"]]
        for item in spec["items"]:
            ok = item["impl"] not in fail
            samples = [[(cost or {}).get(item["impl"], 1e-3) * f for f in factors]] * 3
            stats = measure.summarize(measure.flat(samples))
            row = empty_row(impls[item["impl"]], BenchCase.of(**item["case"]), item["pass"], device=spec["device"]["name"],
                            status="error" if not ok else "noisy" if stats.noise() else "ok",
                            median_s=stats.median_s if ok else None, iqr_s=stats.iqr_s if ok else None,
                            message=stats.noise() if ok else "RuntimeError: boom", repeats=12, rounds=3, processes=1,
                            samples=samples if ok else None)
            lines += [f"@@START\t{item['id']}", f"@@ROW\t{json.dumps({'id': item['id'], **row})}"]
        record = {"items": [item["id"] for item in spec["items"]], "probes": list(probes), "threads": 1}
        lines.append(f"@@PROBES\t{json.dumps(record)}")
        return FakeProc(lines, rc=0)

    return spawn


def _run(argv, fail=(), **kw):
    calls, console = [], _console()
    rc = cli.main(argv, console=console, spawn=fake_spawn(calls, fail, **kw))
    return rc, console.file.getvalue(), calls


def test_all_ok_exits_0_and_skipped_float16_rows_do_not_fail_a_cpu_run():
    rc, text, calls = _run([*FAST, "--dtypes", "float32,float16"])
    assert rc == 0, text
    assert "float16 not benchmarked on CPU" in text and len(calls) == 2  # one worker per process (--processes 2)


def test_variant_flags_make_the_cases_and_each_implementation_runs_what_it_declares():
    rc, text, calls = _run([*FAST, "--impls", "ours-torch:eager:fused,torch-sdpa-core", "--heads", "4",
                            "--kv-heads", "4,1", "--rope", "none,interleaved", "--bias", "qkv"])
    assert rc == 0, text
    sent = [(item["impl"], BenchCase.from_fields(item["case"])) for item in calls[0]["items"]]
    layers = {(c.kv_heads, c.config.rope, c.bias) for _, c in sent}
    assert layers == {(4, None, "qkv"), (4, "interleaved", "qkv"), (1, None, "qkv"), (1, "interleaved", "qkv")}
    assert {impl for impl, _ in sent} == {"ours-torch:eager:fused"}  # the classic peer runs none of them
    # Each of its skip rows names what the layer uses: the bias set, and the heads and RoPE where they differ.
    assert "this layer uses no-out-bias, which" in " ".join(text.split())
    assert "this layer uses grouped, rope-interleaved, no-out-bias, which" in " ".join(text.split())
    assert "B=1 T=16 S=16 E=32 N=4 K=1 rope=interleaved bias=qkv float32" in text


@pytest.mark.parametrize("argv, message", [
    (["--heads", "4", "--kv-heads", "3"], "num_kv_heads=3 must divide num_heads=4"),
    (["--embed", "36", "--heads", "4", "--rope", "half"], "rope needs an even head_dim, got 9"),
])
def test_a_layer_that_cannot_be_is_a_usage_error(argv, message):
    rc, text, calls = _run([*FAST, *argv])
    assert rc == 2 and not calls and message in text


def test_a_failed_item_exits_1():
    rc, text, _ = _run(FAST, fail=("torch-sdpa-core:eager:fused",))
    assert rc == 1
    assert "2 item(s) failed" in text


def test_a_run_that_measured_nothing_exits_1():
    rc, text, calls = _run([*FAST, "--dtypes", "float16"])
    assert rc == 1 and not calls
    assert "nothing was measured: all 4 row(s) are skip rows (4× float16 not benchmarked on CPU" in text


@pytest.mark.parametrize("argv", [
    ["--item-timeout", "-5"], ["--item-timeout", "nan"], ["--seed", "-1"], ["--threads", "0"],
    ["--budget", "0"], ["--budget", "-1"], ["--budget", "nan"], ["--budget", "inf"], ["--min-repeats", "0"],
    ["--max-seq", "0"], ["--seq", "0"], ["--passes", ""],
])
def test_invalid_arguments_are_usage_errors_before_anything_runs(argv, capsys):
    calls = []
    with pytest.raises(SystemExit) as e:
        cli.main([*FAST, *argv], console=_console(), spawn=fake_spawn(calls))
    assert e.value.code == 2 and not calls
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err  # argparse names the bad flag


@pytest.mark.parametrize("argv, message", [
    (["--threads", "4096"], "only"),
    (["--max-seq", "8"], "drops every sequence length"),
    (["--embed", "30", "--heads", "4"], "not divisible"),
    (["--impls", "nope"], "matches nothing"),
])
def test_impossible_selections_are_usage_errors(argv, message):
    rc, text, calls = _run([*FAST, *argv])
    assert rc == 2 and not calls
    assert message in text and text.count("\n") == 1


def test_output_paths_are_checked_before_running(tmp_path):
    (tmp_path / "file").write_text("")
    for argv, message in (
        (["--json", str(tmp_path / "file" / "x.json")], "is not a directory"),
        (["--plot", str(tmp_path)], "is a directory"),
        (["--json", str(tmp_path / "x"), "--markdown", str(tmp_path / "." / "x")], "both name"),
    ):
        rc, text, calls = _run([*FAST, *argv])
        assert rc == 2 and not calls, text
        assert message in text


def test_a_failed_write_keeps_the_results(tmp_path, monkeypatch):
    def full_disk(path, rows, env, verdicts=()):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", full_disk)
    rc, text, _ = _run([*FAST, "--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md")])
    assert rc == 3
    assert text.index("torch-sdpa-core") < text.index("could not write --json")  # the table comes first
    assert "No space left on device" in text and (tmp_path / "b.md").exists()
    fallback = Path(text.split("the results are kept in ")[1].split()[0])
    try:
        assert len(json.loads(fallback.read_text())["rows"]) == 4  # 2 lengths × 2 implementations
    finally:
        fallback.unlink()


def test_a_high_load_average_is_a_note_and_other_processes_cpu_is_interference(monkeypatch):
    """The load average lags by minutes (a run that just ended still holds it): a note on the console,
    no veto. The CPU other processes used over the run is interference, and says so."""
    import os

    cores = os.cpu_count()
    monkeypatch.setattr(cli, "calibrate", lambda: 0.01)  # the calibration loop's own verdict: another test
    monkeypatch.setattr(cli, "OthersCpu", lambda: (lambda: 0.0))
    monkeypatch.setattr(os, "getloadavg", lambda: (cores / 2, 0.0, 0.0))  # half the cores
    rc, text, _ = _run(FAST)
    assert rc == 0
    assert f"note: load average {cores / 2:.2f} at the start of the run is at or above half" in text
    assert "interference:" not in text and "inconclusive (interference" not in text
    monkeypatch.setattr(os, "getloadavg", lambda: (cores / 2 - 0.01, 0.0, 0.0))
    assert "load average" not in _run(FAST)[1]
    monkeypatch.setattr(cli, "OthersCpu", lambda: (lambda: 0.75))
    assert "interference: other processes used 0.75 cores on average over the run" in " ".join(_run(FAST)[1].split())


def test_a_calibration_loop_that_changed_speed_is_interference():
    assert cli.calibration_warning(1.0, 1.2) is None
    assert "took 1.50x as long" in cli.calibration_warning(1.0, 1.5)
    assert "took 0.50x as long" in cli.calibration_warning(1.0, 0.5)
    assert cli.calibration_warning(1.0, None) is None


SDPA, OURS = "torch-sdpa-core:eager:fused", "ours-torch:eager:fused"


@pytest.fixture
def quiet_machine(monkeypatch):
    """The parent's own checks (load average, calibration before and after, other processes' CPU) see a quiet machine, whatever
    this one does while the tests run: what the fake workers' probes say is then all there is."""
    monkeypatch.setattr(cli, "_loadavg", lambda: [0.0, 0.0, 0.0])
    monkeypatch.setattr(cli, "calibrate", lambda: 0.01)
    monkeypatch.setattr(cli, "OthersCpu", lambda: (lambda: 0.0))


def test_noisy_rows_are_measured_and_do_not_veto_a_tight_paired_verdict(tmp_path, quiet_machine):
    """Both rows' calls swing by 60 % with the load of their repeat (IQR/median > 10 %: noisy), but
    ours takes 1.5x SDPA's time in every pair: the paired interval is tight and the verdict conclusive."""
    out = tmp_path / "b.json"
    seq16 = [a if a != "16,32" else "16" for a in FAST]
    rc, text, calls = _run([*seq16, "--json", str(out)], load=(1.0, 1.6), cost={OURS: 1.5e-3})
    assert rc == 0, text  # noisy is not a failure of the implementation: the exit code is unchanged
    data = json.loads(out.read_text())
    assert data["schema"] == "mha-bench/4" and len(calls) == 2
    assert [(r["status"], r["processes"], r["rounds"], r["repeats"]) for r in data["rows"]] == [("noisy", 2, 6, 24)] * 2
    v = data["verdicts"][0]
    assert (v["faster"], v["slower"], v["conclusive"], v["processes"], v["rounds"]) == (SDPA, OURS, True, 2, 6)
    assert v["ratio"] == pytest.approx(1.5) and v["ci"] == [pytest.approx(1.5)] * 2 and v["reason"] is None
    assert (f"{SDPA} is 1.5x faster than {OURS} (95% CI 1.5-1.5, 2 processes, 6 rounds, 24 repeats)"
            in " ".join(text.split()))  # the line folds at 100 columns
    assert list(v) == list(verdict.VERDICT_FIELDS)
    # One process: the same samples are not conclusive, and the verdict says why.
    rc, text, _ = _run([*seq16, "--processes", "1", "--json", str(out)], cost={OURS: 1.5e-3})
    v = json.loads(out.read_text())["verdicts"][0]
    assert not v["conclusive"] and "one worker process" in v["reason"] and "inconclusive (one worker" in text


def test_interference_during_the_run_makes_every_verdict_inconclusive_and_says_so(tmp_path, quiet_machine):
    """The probes of the rounds say another process used a core (others_cpu 1.0): the clear 1.5x of
    the test above is then not conclusive, the console warns, the JSON records why."""
    out = tmp_path / "b.json"
    seq16 = [a if a != "16,32" else "16" for a in FAST]
    busy = [{"calib_s": 1e-3, "loadavg": 0.0, "others_cpu": 1.0}] * 3
    rc, text, _ = _run([*seq16, "--json", str(out)], cost={OURS: 1.5e-3}, probes=busy)
    assert rc == 0, text
    data = json.loads(out.read_text())
    v = data["verdicts"][0]
    assert not v["conclusive"] and v["reason"].startswith("interference during the run: worker process 1: other processes")
    assert any("other processes used 1.00 cores" in w for w in data["environment"]["interference"])
    assert "interference: worker process 1: other processes used 1.00 cores" in " ".join(text.split())
    quiet = [{"calib_s": 1e-3, "loadavg": 0.0, "others_cpu": 0.1}] * 3
    _run([*seq16, "--json", str(out)], cost={OURS: 1.5e-3}, probes=quiet)
    assert json.loads(out.read_text())["verdicts"][0]["conclusive"]


@pytest.mark.parametrize("pair, message", [
    ("torch-sdpa-core:eager:fused", "name two different implementations"),
    ("torch-sdpa-core:eager:fused,torch-sdpa-core:eager:fused", "name two different implementations"),
    ("torch-sdpa-core:eager:fused,ours-jax:jit:fused", "ours-jax:jit:fused not among the selected"),
])
def test_verdict_pair_must_name_two_selected_implementations(pair, message):
    rc, text, calls = _run([*FAST, "--verdict", pair])
    assert rc == 2 and not calls and message in text
    rc, _, calls = _run([*FAST, "--verdict", "torch-sdpa-core:eager:fused,ours-torch:eager:fused"])
    assert rc == 0 and calls[0]["verdict"] == ["torch-sdpa-core:eager:fused", "ours-torch:eager:fused"]


def test_piped_output_fits_100_columns(capsys):
    calls = []
    assert cli.main(FAST, spawn=fake_spawn(calls, fail=("torch-sdpa-core:eager:fused",))) == 1
    out = capsys.readouterr().out
    assert "torch-sdpa-core eager fused" in out and max(len(ln) for ln in out.splitlines()) <= 100


# ---------------------------------------------------------------- compare and report: bad input


def _saved(tmp_path, name, rows):
    path = tmp_path / name
    report.write_json(str(path), rows, {"device": "cpu"})
    return str(path)


def _row(impl="torch-sdpa-core", median_s=1e-3, iqr_s=1e-5):
    im = next(i for i in IMPLS if (i.family or i.name) == impl and not i.returns_weights)
    return empty_row(im, BenchCase.of(1, 16, 16, 32, 2, "float32"), "fwd", status="ok", median_s=median_s, iqr_s=iqr_s)


@pytest.mark.parametrize("content", ["", "{not json", '{"schema": "mha-bench/1", "rows": 5}',
                                     '{"schema": "mha-bench/9", "rows": []}', "PARITY"])
def test_compare_and_report_reject_bad_input_in_one_line(tmp_path, content):
    good = _saved(tmp_path, "good.json", [_row()])
    bad = "tests/data/parity-quick.json" if content == "PARITY" else str(tmp_path / "bad.json")
    if content != "PARITY":
        (tmp_path / "bad.json").write_text(content)
    for argv in (["compare", good, bad], ["compare", bad, good], ["report", bad]):
        console = _console()
        assert cli.main(argv, console=console) == 2
        text = console.file.getvalue()
        assert text.count("\n") == 1 and "error:" in text and "Traceback" not in text, text


@pytest.mark.parametrize("threshold", ["0", "-0.1", "nan", "inf", "fast"])
def test_compare_threshold_must_be_positive_and_finite(tmp_path, threshold):
    good = _saved(tmp_path, "good.json", [_row()])
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", good, good, "--threshold", threshold], console=_console())
    assert e.value.code == 2


def test_compare_exit_codes(tmp_path):
    base = _saved(tmp_path, "base.json", [_row(), _row("ours-torch")])
    slower = _saved(tmp_path, "slower.json", [_row(median_s=2e-3), _row("ours-torch")])
    noisy = _saved(tmp_path, "noisy.json", [_row(median_s=1.2e-3, iqr_s=2e-3), _row("ours-torch")])
    other = _saved(tmp_path, "other.json", [_row("torch-mha")])
    for new, rc in ((base, 0), (slower, 1), (noisy, 0), (other, 2)):
        console = _console()
        assert cli.main(["compare", base, new], console=console) == rc, console.file.getvalue()
    text = console.file.getvalue()  # the last one: nothing in common
    assert "nothing was compared" in text and "only in BASE" in text and "only in NEW" in text


def test_report_rerenders_a_saved_run_with_a_titled_plot(tmp_path):
    console = _console()
    saved = tmp_path / "run.json"
    shutil.copyfile("tests/data/bench-cpu.json", saved)
    before = saved.read_bytes()
    rc = cli.main(["report", str(saved), "--plot", str(tmp_path / "p.png"),
                   "--markdown", str(tmp_path / "p.md")], console=console)
    assert rc == 0, console.file.getvalue()
    assert saved.read_bytes() == before, "report must not rewrite its input"
    assert (tmp_path / "p.png").stat().st_size > 0 and "| case |" in (tmp_path / "p.md").read_text()


def test_sharded_subcommand_reports_per_device_memory(tmp_path):
    """`mha-bench sharded`: sequence parallel over 2 simulated devices holds less per device than 1."""
    out = tmp_path / "sharded.json"
    console = _console()
    assert cli.main(["sharded", "--shards", "1,2", "--shardings", "sp", "--frameworks", "jax", "--seq", "512",
                     "--json", str(out)], console=console) == 0
    rows = {r["devices"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[1]["ratio_to_1_device"] == 1.0
    assert rows[2]["ratio_to_1_device"] < 0.75, rows[2]  # the ring holds a (B, N, T/2, S/2) score block
    assert "overhead" in console.file.getvalue()
    assert cli.main(["sharded", "--embed", "30", "--heads", "4"], console=_console()) == 2


def test_report_refuses_to_write_over_its_input(tmp_path):
    saved = tmp_path / "run.json"
    shutil.copyfile("tests/data/bench-cpu.json", saved)
    before = saved.read_bytes()
    for flag in ("--markdown", "--plot"):
        console = _console()
        assert cli.main(["report", str(saved), flag, str(tmp_path / "." / "run.json")], console=console) == 2
        assert "is the input file" in console.file.getvalue()
    assert saved.read_bytes() == before


def test_compare_rejects_a_huge_json_integer_in_one_line(tmp_path):
    good = _saved(tmp_path, "good.json", [_row()])
    text = (tmp_path / "good.json").read_text()
    for name, huge in (("digits.json", "1" + "0" * 5000), ("float.json", "1" + "0" * 400)):
        (tmp_path / name).write_text(text.replace('"median_s": 0.001', f'"median_s": {huge}'))
        for argv in (["compare", good, str(tmp_path / name)], ["compare", str(tmp_path / name), good]):
            console = _console()
            assert cli.main(argv, console=console) == 2
            out = console.file.getvalue()
            assert out.count("\n") == 1 and name in out and "Traceback" not in out, out


def test_thread_settings_default_to_passive_waiting_and_the_environment_wins(monkeypatch, tmp_path):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", *allocator.KNOBS):
        monkeypatch.delenv(name, raising=False)
    rc, _, calls = _run([*FAST, "--json", str(tmp_path / "a.json")])
    assert rc == 0 and json.loads((tmp_path / "a.json").read_text())["environment"]["thread_settings"]["env"] == {
        "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "33554432"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert sweep._worker_env(sweep.RunConfig(preset=PRESETS["quick"]), str(tmp_path))["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")  # an allocator knob of the user's replaces the pinned thresholds
    env = sweep._worker_env(sweep.RunConfig(preset=PRESETS["quick"]), str(tmp_path))
    assert env["MALLOC_MMAP_MAX_"] == "0" and "MALLOC_TRIM_THRESHOLD_" not in env
    rc, _, _ = _run([*FAST, "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text())["environment"]["thread_settings"]["env"] == {
        "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000", "MALLOC_MMAP_MAX_": "0"}
