"""mha-bench methodology: deterministic checks with fake clocks and fake workers (no timing asserted)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from parity.bench import measure, report, runner
from parity.bench.spec import (
    IMPLS, PRESETS, ROW_FIELDS, BenchCase, Timing, empty_row, forward_flops, pass_flops, select_impls,
)


class FakeClock:
    """A clock that only moves when a fake step says so."""

    def __init__(self):
        self.now = 0.0
        self.events = []

    def __call__(self):
        self.events.append(("clock", self.now))
        return self.now

    def advance(self, dt):
        self.now += dt


def _impl(key):
    return next(im for im in IMPLS if im.bench_key == key)


CASE = BenchCase(2, 16, 24, 32, 4, "float32")


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("need_weights", [True, False])
def test_flop_formula_matches_torch_flop_counter(need_weights):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mha_torch import MultiHeadAttention

    B, T, S, E, N = 2, 24, 40, 32, 4
    m = MultiHeadAttention(E, N)
    q = torch.randn(B, T, E, requires_grad=True)
    k = torch.randn(B, S, E, requires_grad=True)
    v = torch.randn(B, S, E, requires_grad=True)
    case = BenchCase(B, T, S, E, N, "float32")
    # The math backend decomposes SDPA into counted bmms; the counter has no formula
    # for the CPU flash kernel, which would count the attention as zero.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            m(q, k, v, need_weights=need_weights)
        with FlopCounterMode(display=False) as both:
            out, _ = m(q, k, v, need_weights=need_weights)
            out.sum().backward()
    assert fwd.get_total_flops() == forward_flops(B, T, S, E) == pass_flops(case, "fwd")
    assert both.get_total_flops() == pass_flops(case, "fwd+bwd") == 3 * pass_flops(case, "fwd")


def test_flop_formula_terms():
    # projections 2·B·E²·(2Nq + 2Nk) + attention 4·B·Nq·Nk·E
    assert forward_flops(1, 1, 1, 1) == 2 * 4 + 4
    assert forward_flops(4, 2048, 2048, 512) == 2 * 4 * 512**2 * 4 * 2048 + 4 * 4 * 2048 * 2048 * 512
    with pytest.raises(ValueError, match="pass"):
        pass_flops(CASE, "bwd")


# ---------------------------------------------------------------- timing methodology


def test_compile_on_first_call_is_separated_from_steady_state():
    clock = FakeClock()
    calls = []

    def step():
        calls.append(1)
        clock.advance(5.0 if len(calls) == 1 else 1.0)  # the first call compiles
        return None

    res = measure.run_bench(
        measure.Bench(step=step, sync=lambda out: None, compiles_on_first_call=True),
        Timing(warmup=2, min_repeats=4, max_repeats=4, budget_s=0.1), clock,
    )
    assert res["median_s"] == 1.0 and res["min_s"] == 1.0 and res["iqr_s"] == 0.0
    assert res["compile_s"] == pytest.approx(4.0)
    assert res["repeats"] == 4
    assert len(calls) == 1 + 1 + 4  # compiling call, one more warm-up, four timed


def test_aot_compile_is_timed_apart_and_warmup_excluded():
    clock = FakeClock()
    calls = []

    def step():
        calls.append(1)
        clock.advance(3.0 if len(calls) <= 2 else 2.0)  # two slow warm-up calls
        return None

    res = measure.run_bench(
        measure.Bench(step=step, sync=lambda out: None, aot_compile=lambda: clock.advance(7.0),
                      recompile=lambda c: 0.5),
        Timing(warmup=2, min_repeats=3, max_repeats=3, budget_s=0.1), clock,
    )
    assert res["compile_s"] == 7.0
    assert res["median_s"] == 2.0 and res["min_s"] == 2.0  # warm-up calls not in the stats
    assert res["recompile_s"] == 0.5


def test_every_timed_call_is_synchronised_before_the_clock_stops():
    clock = FakeClock()
    log = clock.events

    def step():
        log.append(("step",))
        clock.advance(1.0)
        return "out"

    def sync(out):
        assert out == "out"
        log.append(("sync",))

    measure.run_bench(measure.Bench(step=step, sync=sync), Timing(warmup=1, min_repeats=3, max_repeats=3), clock)
    kinds = [e[0] for e in log]
    assert kinds.count("step") == kinds.count("sync") == 4  # one warm-up + three timed
    for i, kind in enumerate(kinds):
        if kind == "step":
            assert kinds[i + 1] == "sync"  # sync right after every call, before the next clock read


def test_jax_sync_blocks_on_every_leaf():
    pytest.importorskip("jax")
    from parity.bench import impl_jax

    class FakeArray:
        def __init__(self):
            self.blocked = 0

        def block_until_ready(self):
            self.blocked += 1
            return self

    a, b = FakeArray(), FakeArray()
    impl_jax.sync((a, [b]))
    assert a.blocked == 1 and b.blocked == 1


def test_budget_stops_repeats_but_not_before_min_repeats():
    clock = FakeClock()
    step = lambda: clock.advance(1.0)  # noqa: E731
    times = measure.repeat(step, lambda out: None, Timing(min_repeats=3, max_repeats=100, budget_s=0.5), clock)
    assert len(times) == 3
    times = measure.repeat(step, lambda out: None, Timing(min_repeats=2, max_repeats=100, budget_s=10.0), clock)
    assert len(times) == 10


def test_iqr_warning():
    quiet = measure.summarize([1.0, 1.0, 1.01, 1.0, 0.99])
    assert quiet.warning(0.10) is None
    noisy = measure.summarize([1.0, 1.0, 1.5, 1.5, 1.0, 1.5])
    assert noisy.median_s == 1.25 and noisy.iqr_s == pytest.approx(0.5)
    assert "IQR/median" in noisy.warning(0.10)
    clock = FakeClock()
    durations = iter([1.0, 1.0, 2.0, 1.0, 2.0, 2.0])
    res = measure.run_bench(
        measure.Bench(step=lambda: clock.advance(next(durations)), sync=lambda out: None),
        Timing(warmup=0, min_repeats=6, max_repeats=6), clock,
    )
    assert res["warning"] and "noisy" in res["warning"]


# ---------------------------------------------------------------- peak


def _ok_row(median_s=1.0, **kw):
    kw.setdefault("iqr_s", 0.0)
    return empty_row(_impl("ours-torch:eager:fused"), CASE, "fwd", status="ok", median_s=median_s, **kw)


def test_rate_above_measured_peak_is_an_error_row():
    flops = pass_flops(CASE, "fwd")
    fine = measure.apply_peak(_ok_row(median_s=flops / 50e9), flops, peak_gflops=100.0)
    assert fine["status"] == "ok" and fine["gflops"] == pytest.approx(50.0)
    assert fine["peak_fraction"] == pytest.approx(0.5)
    too_fast = measure.apply_peak(_ok_row(median_s=flops / 150e9), flops, peak_gflops=100.0)  # planted
    assert too_fast["status"] == "error"
    assert "exceeds the measured" in too_fast["message"]


def test_device_peak_is_the_best_of_all_workers_and_frameworks():
    peaks = [
        {"framework": "torch", "dtype": "float32", "gflops": 80.0},
        {"framework": "jax", "dtype": "float32", "gflops": 95.0},
        {"framework": "torch", "dtype": "float32", "gflops": 60.0},
        {"framework": "jax", "dtype": "bfloat16", "gflops": 30.0},
    ]
    assert runner.device_peak(peaks, "float32") == 95.0
    assert runner.device_peak(peaks, "bfloat16") == 30.0
    assert runner.device_peak(peaks, "float16") is None


# ---------------------------------------------------------------- sweep: failures, skips, equal work


class FakeProc:
    """Stands in for a worker Popen: scripted stdout lines and an exit code."""

    def __init__(self, lines, rc):
        self.stdout = io.StringIO("".join(f"{ln}\n" for ln in lines))
        self.stderr = io.StringIO("worker log line\nKilled\n" if rc else "")
        self.rc = rc

    def wait(self):
        return self.rc

    def kill(self):
        pass


def _row_line(item, **kw):
    row = empty_row(item.impl, item.case, item.pass_, status="ok", median_s=1.0, **kw)
    return "@@ROW\t" + json.dumps({"id": item.id, **row})


def test_dead_worker_costs_one_error_row_and_the_sweep_continues():
    cfg = runner.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager,torch-mha"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items = runner.plan(cfg)
    assert len(items) == 4 and not any(it.skip for it in items)
    spawned = []

    def spawn(spec, env):
        spawned.append([i["id"] for i in spec["items"]])
        if len(spawned) == 1:  # dies (SIGKILL, as the OOM killer would) while on item 1
            return FakeProc(["@@START\t0", _row_line(items[0]), "@@START\t1"], rc=-9)
        return FakeProc([ln for it in items[2:] for ln in (f"@@START\t{it.id}", _row_line(it))], rc=0)

    out = runner.Collected()
    runner.run_group(cfg, "torch", items, [], out, lambda k, d: None, "/tmp", spawn)
    assert spawned == [[0, 1, 2, 3], [2, 3]]
    assert [out.rows[i]["status"] for i in range(4)] == ["ok", "error", "ok", "ok"]
    assert "signal 9" in out.rows[1]["message"] and "Killed" in out.rows[1]["message"]


def test_failing_item_in_worker_becomes_error_row():
    from parity.bench import worker

    class Broken:
        @staticmethod
        def build(impl, case, pass_, device, seed):
            raise RuntimeError("out of memory: tried to allocate 64 GiB")

    row = worker.run_item(Broken, _impl("ours-jax:jit:fused"), CASE, "fwd", "cpu", 0, Timing(), FakeClock())
    assert row["status"] == "error"
    assert row["message"].startswith("RuntimeError: out of memory")
    assert set(ROW_FIELDS) <= set(row)


def test_items_that_cannot_fit_are_skip_rows_with_the_reason():
    big = BenchCase(1, 32768, 32768, 512, 8, "float32")
    cfg = runner.RunConfig(preset=PRESETS["long"], impls=select_impls("ours-torch:eager"),
                           cases=(big,), passes=("fwd",), available_bytes=24 * 2**30)
    items = runner.plan(cfg)
    by_key = {it.impl.bench_key: it for it in items}
    assert by_key["ours-torch:eager:fused"].skip is None
    assert "estimated memory" in by_key["ours-torch:eager:weights"].skip


def test_different_outputs_are_flagged_as_unequal_work():
    cfg = runner.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:weights,ours-jax:jit:fused"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items = runner.plan(cfg)
    out = runner.Collected()
    out.rows = {
        items[0].id: _ok_row(out_fingerprint=0.5) | {"impl": "ours-torch", "need_weights": True},
        items[1].id: _ok_row(out_fingerprint=0.6) | {"impl": "ours-jax", "framework": "jax", "mode": "jit"},
    }
    rows = runner.finish(items, out)
    assert rows[0]["status"] == "ok" and rows[0]["ratio"] == 1.0
    assert rows[1]["status"] == "error" and "not the same computation" in rows[1]["message"]


def test_select_impls():
    assert [im.bench_key for im in select_impls("ours-torch:compile")] == [
        "ours-torch:compile:weights", "ours-torch:compile:fused"]
    assert all(not im.returns_weights for im in select_impls("*:*:fused"))
    with pytest.raises(ValueError, match="matches nothing"):
        select_impls("nope")


# ---------------------------------------------------------------- memory


def test_cpu_peak_rss_sees_a_transient_allocation():
    probe = measure.CpuPeakRss()
    if probe.reason:
        pytest.skip(probe.reason)

    def step():
        a = np.ones(16 * 2**20 // 8 * 4)  # 64 MiB, touched
        return float(a[::4096].sum())

    peak, source, out = probe(step, lambda out: None)
    assert out == float(np.ones(4096).sum()) or out > 0
    assert 60 * 2**20 <= peak <= 200 * 2**20
    assert source.startswith("cpu:")


# ---------------------------------------------------------------- outputs


def _env():
    return {"device": "cpu", "versions": {"torch": "x"}, "peaks": [{"dtype": "float32", "gflops": 100.0}]}


def test_json_is_atomic_and_has_all_fields(tmp_path):
    rows = [measure.apply_peak(_ok_row(median_s=0.01), pass_flops(CASE, "fwd"), 100.0),
            empty_row(_impl("ours-jax:jit:fused"), CASE, "fwd", status="error", message="boom")]
    path = tmp_path / "out" / "b.json"
    report.write_json(str(path), rows, _env())
    data = json.loads(path.read_text())
    assert data["environment"]["device"] == "cpu"
    for row in data["rows"]:
        assert list(row) == list(ROW_FIELDS)
        assert row["status"] in ("ok", "error", "skip")
    assert data["rows"][1]["message"] == "boom"
    assert [p.name for p in path.parent.iterdir()] == ["b.json"]  # no temp file left behind
    md = tmp_path / "b.md"
    report.write_markdown(str(md), rows, _env())
    assert "| case |" in md.read_text()


def test_compare_flags_a_planted_regression(tmp_path):
    from parity.bench import cli

    base_rows = [_ok_row(median_s=1.0), _ok_row(median_s=1.0) | {"impl": "torch-sdpa-core"}]
    new_rows = [_ok_row(median_s=1.05), _ok_row(median_s=1.5) | {"impl": "torch-sdpa-core"}]  # planted +50%
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(str(a), base_rows, _env())
    report.write_json(str(b), new_rows, _env())
    results = report.compare(report.load(str(a)), report.load(str(b)), 0.10)
    assert [e["regression"] for e in results.entries] == [False, True]
    assert [e["verdict"] for e in results.entries] == ["ok", "REGRESSION"]
    quiet = report.Console(file=io.StringIO(), width=200)
    assert cli.main(["compare", str(a), str(b)], console=quiet) == 1
    assert cli.main(["compare", str(a), str(a)], console=quiet) == 0
    md = tmp_path / "again.md"
    assert cli.main(["report", str(b), "--markdown", str(md)], console=quiet) == 0
    assert "torch-sdpa-core" in md.read_text()


def test_plot_writes_a_png(tmp_path):
    rows = []
    for seq in (64, 128):
        case = BenchCase(1, seq, seq, 32, 4, "float32")
        for pass_ in ("fwd", "fwd+bwd"):
            row = empty_row(_impl("ours-torch:eager:fused"), case, pass_, status="ok", median_s=seq * 1e-5)
            rows.append(measure.apply_peak(row, pass_flops(case, pass_), None))
    path = tmp_path / "b.png"
    report.write_plot(str(path), rows)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- interleaving


def test_interleaved_repeats_alternate_and_cancel_load_drift():
    clock = FakeClock()
    order = []

    def make(name, cost):
        def step():
            order.append(name)
            # The machine slows down steadily (load drift): every call costs more than the last.
            clock.advance(cost * (1 + 0.05 * len(order)))
        return measure.Bench(step=step, sync=lambda out: None)

    timing = Timing(warmup=1, min_repeats=4, max_repeats=4)
    res = measure.run_interleaved([make("a", 1.0), make("b", 1.0)], timing, clock)
    assert order[2:] == ["a", "b", "b", "a"] * 2  # after one warm-up each: a b, b a, a b, b a
    # Identical work keeps a ratio of 1 under a linear drift: a fixed a-b order would give
    # medians of calls (5, 7) against (6, 8), i.e. 1.30/1.35 = 0.963; a b b a gives (6, 7) vs (5, 8).
    assert res[0]["median_s"] / res[1]["median_s"] == pytest.approx(1.0, abs=1e-9)


def test_interleaved_failure_leaves_the_rotation_only():
    clock = FakeClock()
    calls = {"bad": 0}

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 2:
            raise RuntimeError("boom")
        clock.advance(1.0)

    good = measure.Bench(step=lambda: clock.advance(1.0), sync=lambda out: None)
    res = measure.run_interleaved(
        [measure.Bench(step=bad, sync=lambda out: None), good], Timing(warmup=1, min_repeats=4, max_repeats=4), clock,
    )
    assert isinstance(res[0], RuntimeError)
    assert res[1]["repeats"] == 4 and res[1]["median_s"] == 1.0


# ---------------------------------------------------------------- compare: the noise rule


def test_a_slowdown_inside_the_runs_iqr_is_noisy_not_a_regression():
    # The rule (report.verdict): REGRESSION needs new - base > threshold·base AND > (iqr_b + iqr_n) / 2.
    assert report.verdict(1.0, 2.0, 1.1, 2.0, 0.05) == "noisy"  # +10 % inside a 200 % IQR
    assert report.verdict(1.0, 0.01, 1.5, 0.01, 0.10) == "REGRESSION"  # +50 %, quiet runs
    assert report.verdict(1.0, 0.01, 1.05, 0.01, 0.10) == "ok"  # under the threshold
    assert report.verdict(1.0, 0.30, 1.2, 0.10, 0.10) == "noisy"  # +20 % = the mean IQR: not beyond it
    assert report.verdict(1.0, 0.01, 0.5, 0.01, 0.10) == "faster"
    with pytest.raises(ValueError, match="threshold"):
        report.compare({"rows": []}, {"rows": []}, 0.0)


def test_compare_lists_rows_present_in_one_file_only():
    torch_fused, sdpa, mha = _ok_row(), _ok_row() | {"impl": "torch-sdpa-core"}, _ok_row() | {"impl": "torch-mha"}
    noisy_new = _ok_row(median_s=1.3, iqr_s=0.8) | {"impl": "torch-sdpa-core"}
    result = report.compare({"rows": [torch_fused, sdpa, mha]},
                            {"rows": [torch_fused, noisy_new, _ok_row() | {"dtype": "bfloat16"}]}, 0.10)
    assert [e["verdict"] for e in result.entries] == ["ok", "noisy"]
    assert result.compared == 2 and result.regressions == 0
    assert [k["impl"] for k in result.only_base] == ["torch-mha"]
    assert [k["dtype"] for k in result.only_new] == ["bfloat16"]
    console = report.Console(file=io.StringIO(), width=200)
    report.print_compare(result, 0.10, console)
    text = console.file.getvalue()
    assert "1 row(s) only in BASE" in text and "torch-mha" in text and "1 row(s) only in NEW" in text


def test_a_row_no_longer_ok_is_a_regression_and_a_base_error_is_not_compared():
    err = _ok_row() | {"status": "error", "median_s": None, "message": "boom"}
    result = report.compare({"rows": [_ok_row(), err | {"impl": "torch-mha"}]},
                            {"rows": [err, _ok_row() | {"impl": "torch-mha"}]}, 0.10)
    assert [e["verdict"] for e in result.entries] == ["no longer ok", "not compared"]
    assert result.regressions == 1 and result.compared == 1


# ---------------------------------------------------------------- reading saved runs


def _bench_json(tmp_path, mutate):
    data = report.to_json([_ok_row(median_s=0.5, iqr_s=0.01)], _env())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(rows=5), "'rows' must be a list"),
    (lambda d: d.update(rows=[]), "'rows' is empty"),
    (lambda d: d.update(schema="mha-bench/2"), "schema 'mha-bench/2' is not supported"),
    (lambda d: d.pop("schema"), "no 'schema' field"),
    (lambda d: d["rows"][0].update(median_s=0), "median_s = 0 is not a finite positive"),
    (lambda d: d["rows"][0].update(median_s=None), "median_s = None"),
    (lambda d: d["rows"][0].update(median_s=float("nan")), "median_s = nan"),
    (lambda d: d["rows"][0].update(median_s="fast"), "median_s = 'fast'"),
    (lambda d: d["rows"][0].update(iqr_s=-1.0), "iqr_s = -1.0"),
    (lambda d: d["rows"][0].update(status="great"), "status 'great'"),
    (lambda d: d["rows"][0].pop("impl"), "missing field(s) impl"),
    (lambda d: d["rows"][0].update(batch=True), "batch=True"),
    (lambda d: d["rows"].append(dict(d["rows"][0])), "row 1 repeats row 0"),
])
def test_load_rejects_a_malformed_run_with_a_reason(tmp_path, mutate, message):
    with pytest.raises(report.BenchFileError, match="bad.json") as e:
        report.load(_bench_json(tmp_path, mutate))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_names_a_parity_report_and_broken_json(tmp_path):
    with pytest.raises(report.BenchFileError, match="looks like an mha-parity report"):
        report.load("tests/data/parity-quick.json")
    for text, message in (("", "empty file"), ("{", "not valid JSON"), ("[1]", "top level is a list")):
        (tmp_path / "x.json").write_text(text)
        with pytest.raises(report.BenchFileError, match=message):
            report.load(str(tmp_path / "x.json"))
    with pytest.raises(report.BenchFileError, match="cannot read"):
        report.load(str(tmp_path / "missing.json"))


def test_saved_results_still_load():
    for name in ("bench-cpu.json", "bench-cpu-long.json"):
        assert report.load(f"tests/data/{name}")["rows"]


# ---------------------------------------------------------------- errored rows stay visible


def test_a_row_above_the_peak_keeps_its_numbers_marked_in_table_ratio_and_markdown():
    cfg = runner.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:fused,torch-sdpa-core"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items = runner.plan(cfg)
    flops = pass_flops(CASE, "fwd")
    out = runner.Collected(peaks=[{"dtype": "float32", "gflops": 100.0}])
    out.rows = {items[0].id: _ok_row(median_s=flops / 50e9) | {"impl": "torch-sdpa-core"},
                items[1].id: _ok_row(median_s=flops / 150e9)}  # 150 GFLOP/s > the 100 peak: planted
    rows = runner.finish(items, out)
    assert [r["status"] for r in rows] == ["ok", "error"]
    assert rows[1]["ratio"] == pytest.approx(50 / 150)  # against the ok row, not itself
    cells = report._cells(rows[1])
    assert cells[5] == "0.33× (error)" and cells[6] == "150.0 (error)"
    console = report.Console(file=io.StringIO(), width=300)
    report.print_table(rows, console)
    assert "0.33× (error)" in console.file.getvalue()
    assert "0.33× (error)" in report.markdown(rows, _env())


# ---------------------------------------------------------------- the peak is re-measured


class FakePeakMod:
    """peak_gflops returns scripted rates, one per call."""

    def __init__(self, *rates):
        self.rates = list(rates)

        self.sizes = []

    def peak_gflops(self, dtype, sizes, device, timing, clock):
        self.sizes.append(list(sizes))
        return self.rates.pop(0), sizes[-1]


def _vet(monkeypatch, rates, row_gflops):
    """Run a worker's PeakBar on rows of the given rates; return the parent's verdicts."""
    from parity.bench import worker

    lines = []
    monkeypatch.setattr(worker, "emit", lambda kind, payload: lines.append(f"@@{kind}\t{json.dumps(payload)}"))
    cfg = runner.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:fused"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    flops = pass_flops(CASE, "fwd")
    mod = FakePeakMod(*rates)
    bar = worker.PeakBar(mod, "torch", "cpu", [{"dtype": "float32", "sizes": [2048]}], [], FakeClock())
    bar.measure("float32")
    verdicts = []
    for gflops in row_gflops:
        item = runner.plan(cfg)[0]
        row = empty_row(item.impl, item.case, item.pass_, status="ok", median_s=flops / (gflops * 1e9), iqr_s=0.0)
        bar.vet([(item.id, row)])
        out = runner.Collected()
        runner.run_group(cfg, "torch", [item], [], out, lambda k, d: None, "/tmp",
                         lambda spec, env: FakeProc([*lines, f"@@ROW\t{json.dumps({'id': item.id, **row})}"], rc=0))
        verdicts.append(runner.finish([item], out)[0]["status"])
    return verdicts, [json.loads(ln.split("\t", 1)[1]) for ln in lines], mod


def test_a_row_above_the_startup_peak_triggers_a_remeasure_and_is_ok_below_the_new_one(monkeypatch):
    verdicts, peaks, mod = _vet(monkeypatch, [100.0, 200.0], [150.0])
    assert verdicts == ["ok"]
    assert [p["gflops"] for p in peaks] == [100.0, 200.0]
    assert "150.0 GFLOP/s > 100.0" in peaks[1]["remeasured_for"]
    # The re-measure adds a matmul of about the row's own work (2·n³ ≈ CASE's forward FLOPs).
    assert mod.sizes == [[2048], [64, 2048]]
    assert 0.5 < 2 * 64**3 / pass_flops(CASE, "fwd") < 2.0


def test_a_row_still_above_the_remeasured_peak_is_an_error_and_remeasures_are_capped(monkeypatch):
    verdicts, peaks, mod = _vet(monkeypatch, [100.0, 120.0, 110.0, 105.0, 999.0], [150.0] * 5)
    assert verdicts == ["error"] * 5
    assert len(peaks) == 1 + 3 and mod.rates == [999.0]  # start-up + MAX_REMEASURES, no more


def test_a_row_below_the_peak_costs_no_remeasure(monkeypatch):
    verdicts, peaks, _ = _vet(monkeypatch, [100.0], [90.0])
    assert verdicts == ["ok"] and len(peaks) == 1


# ---------------------------------------------------------------- plot


def _all_series_rows():
    rows = []
    for im in IMPLS:
        for dtype in ("float32", "bfloat16", "float16"):
            for b, e in ((1, 32), (2, 64), (4, 64)):
                for seq in (64, 128):
                    case = BenchCase(b, seq, seq, e, 4, dtype)
                    row = empty_row(im, case, "fwd", status="ok", median_s=seq * 1e-5, iqr_s=0.0)
                    rows.append(measure.apply_peak(row, pass_flops(case, "fwd"), None))
    return rows


def test_no_two_plot_series_look_alike():
    styles = report.series_styles(_all_series_rows())
    assert len(styles) == len(IMPLS) * 3 * 3
    looks = {tuple(sorted((k, str(v)) for k, v in st.items())) for st in styles.values()}
    assert len(looks) == len(styles)
    # Same implementation and mode: same colour, so a reader can follow one implementation.
    by_variant: dict = {}
    for key, st in styles.items():
        by_variant.setdefault(key[:2], set()).add(st["color"])
    assert all(len(c) == 1 for c in by_variant.values())
    assert len({next(iter(c)) for c in by_variant.values()}) == len(by_variant)


def test_plot_has_a_title_and_draws_error_rows(tmp_path, monkeypatch):
    import matplotlib.axes
    import matplotlib.figure

    titles, markers, legends = [], [], []
    real_title, real_plot = matplotlib.figure.Figure.suptitle, matplotlib.axes.Axes.plot
    real_legend = matplotlib.figure.Figure.legend
    monkeypatch.setattr(matplotlib.figure.Figure, "legend",
                        lambda self, h, labels, **kw: legends.append(labels) or real_legend(self, h, labels, **kw))
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda self, t, **kw: titles.append(t) or real_title(self, t, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **kw: markers.append((len(a[0]), kw.get("marker"))) or real_plot(self, *a, **kw))
    rows = _all_series_rows()[:8]
    rows[1] = rows[1] | {"status": "error", "message": "exceeds"}
    rows[7] = rows[7] | {"status": "error", "message": "exceeds"}  # in another series
    env = {"device": "cpu", "cpu_model": "Fake CPU", "preset": "quick", "precision": "highest"}
    path = tmp_path / "b.png"
    report.write_plot(str(path), rows, env)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == ["mha-bench: device cpu (Fake CPU), preset quick, precision highest"]
    assert markers.count((1, "X")) == 4  # two error rows, each on the time and the GFLOP/s axes
    assert legends[0].count("error row (measured, not trusted)") == 1 and legends[0][-1].startswith("error row")
