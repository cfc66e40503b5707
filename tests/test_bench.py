"""mha-bench methodology: deterministic checks with fake clocks and fake workers (no timing asserted);
and a grouped, rotary, bias-free layer through the real builds of both frameworks (TestVariants)."""

from __future__ import annotations

import io
import json
import time
from dataclasses import asdict, replace

import numpy as np
import pytest

from parity.bench import measure, report, sweep
from parity.bench.measure import same_output
from parity.devices import DevicePlan, resolve_device
from parity.bench.records import ROW_FIELDS, Key, empty_row
from parity.bench.spec import (
    IMPLS, PRESETS, BenchCase, Timing, canonical_weights, forward_flops, make_inputs, pass_flops, rope_positions,
    select_impls,
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


CASE = BenchCase.of(2, 16, 24, 32, 4, "float32")


# ---------------------------------------------------------------- FLOPs


# (need_weights, K, rope, bias): the classic layer on both paths; grouped and multi-query heads with
# RoPE and without biases (RoPE's and the biases' element-wise work is not counted, by either side).
FLOP_LAYERS = [(True, 4, None, "all"), (False, 4, None, "all"), (False, 2, "half", "none"), (True, 1, "interleaved", "qkv")]


@pytest.mark.parametrize("need_weights, kv_heads, rope, bias", FLOP_LAYERS)
def test_flop_formula_matches_torch_flop_counter(need_weights, kv_heads, rope, bias):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from mha_torch import MultiHeadAttention

    B, T, S, E, N = 2, 24, 40, 32, 4
    case = BenchCase.of(B, T, S, E, N, "float32", kv_heads=kv_heads, rope=rope, bias=bias)
    c = case.config
    m = MultiHeadAttention(E, N, num_kv_heads=c.num_kv_heads, qkv_bias=c.qkv_bias, out_bias=c.out_bias, rope=rope)
    q = torch.randn(B, T, E, requires_grad=True)
    k = torch.randn(B, S, E, requires_grad=True)
    v = torch.randn(B, S, E, requires_grad=True)
    # The math backend decomposes SDPA into counted bmms; the counter has no formula
    # for the CPU flash kernel, which would count the attention as zero.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            m(q, k, v, need_weights=need_weights)
        with FlopCounterMode(display=False) as both:
            out, _ = m(q, k, v, need_weights=need_weights)
            out.sum().backward()
    assert fwd.get_total_flops() == forward_flops(case.problem) == pass_flops(case, "fwd")
    assert both.get_total_flops() == pass_flops(case, "fwd+bwd") == 3 * pass_flops(case, "fwd")


def test_flop_formula_terms():
    # The classic layer: projections 2·B·E²·(2T + 2S) + attention 4·B·T·S·E.
    assert forward_flops(BenchCase.of(1, 1, 1, 1, 1, "float32").problem) == 2 * 4 + 4
    assert forward_flops(BenchCase.of(4, 2048, 2048, 512, 8, "float32").problem) == (
        2 * 4 * 512**2 * 4 * 2048 + 4 * 4 * 2048 * 2048 * 512)
    # B=1 T=3 S=5 E=8 N=4 K=2 (H=2), by hand: q and out projections 2·3·8·8 = 384 each, k and v
    # 2·5·8·(2·2) = 320 each, Q·Kᵀ and P·V over the 4 query heads 2·4·3·5·2 = 240 each.
    grouped = BenchCase.of(1, 3, 5, 8, 4, "float32", kv_heads=2)
    assert forward_flops(grouped.problem) == 384 + 384 + 320 + 320 + 240 + 240
    # RoPE and biases add element-wise work only: not counted.
    assert forward_flops(BenchCase.of(1, 3, 5, 8, 4, "float32", kv_heads=2, rope="half", bias="none").problem) == 1888
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
    from parity.bench import jax_bench

    class FakeArray:
        def __init__(self):
            self.blocked = 0

        def block_until_ready(self):
            self.blocked += 1
            return self

    a, b = FakeArray(), FakeArray()
    jax_bench.sync((a, [b]))
    assert a.blocked == 1 and b.blocked == 1


def test_budget_stops_repeats_but_not_before_min_repeats():
    clock = FakeClock()
    bench = measure.Bench(step=lambda: clock.advance(1.0), sync=lambda out: None)
    one = {"round_repeats": 1}
    times, _, _ = measure.sample({0: bench}, Timing(min_repeats=3, max_repeats=100, budget_s=0.5, **one), clock)
    assert times[0] == [[1.0]] * 3
    times, _, _ = measure.sample({0: bench}, Timing(min_repeats=2, max_repeats=100, budget_s=10.0, **one), clock)
    assert len(times[0]) == 10
    # Two benches share one budget of 2 × budget_s: both stop together, after the same rounds.
    times, _, _ = measure.sample({0: bench, 1: bench}, Timing(min_repeats=2, max_repeats=100, budget_s=3.0, **one), clock)
    assert len(times[0]) == len(times[1]) == 3
    # The budget is looked at when a round ends: rounds of 4 repeats, the last one cut by max_repeats.
    probes = []
    times, _, got = measure.sample({0: bench}, Timing(min_repeats=3, max_repeats=100, budget_s=0.5), clock,
                                   probe=lambda: probes.append(1) or {"round": len(probes)})
    assert times[0] == [[1.0] * 4] and got == [{"round": 1}]
    times, _, got = measure.sample({0: bench}, Timing(min_repeats=6, max_repeats=6, budget_s=1e9), clock, probe=dict)
    assert [len(r) for r in times[0]] == [4, 2] and len(got) == 2


def test_a_row_above_the_noise_threshold_is_noisy_never_ok():
    quiet = measure.summarize([1.0, 1.0, 1.01, 1.0, 0.99])
    assert quiet.noise() is None
    noisy = measure.summarize([1.0, 1.0, 1.5, 1.5, 1.0, 1.5])
    assert noisy.median_s == 1.25 and noisy.iqr_s == pytest.approx(0.5)
    assert "IQR/median = 40.0% > 10%" in noisy.noise()
    clock = FakeClock()
    durations = iter([1.0, 1.0, 2.0, 1.0, 2.0, 2.0])
    res = measure.run_bench(
        measure.Bench(step=lambda: clock.advance(next(durations)), sync=lambda out: None),
        Timing(warmup=0, min_repeats=6, max_repeats=6), clock,
    )
    assert res["status"] == "noisy" and "noisy" in res["message"]


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
    assert sweep.device_peak(peaks, "float32") == 95.0
    assert sweep.device_peak(peaks, "bfloat16") == 30.0
    assert sweep.device_peak(peaks, "float16") is None


# ---------------------------------------------------------------- sweep: failures, skips, equal work


class FakeProc:
    """Stands in for a worker Popen: scripted stdout lines and an exit code."""

    def __init__(self, lines, rc):
        self.stdout = io.StringIO("".join(f"{ln}\n" for ln in lines))
        self.stderr = io.StringIO("worker log line\nKilled\n" if rc else "")
        self.rc = rc

    def wait(self, timeout=None):
        return self.rc

    def poll(self):
        return self.rc

    def kill(self):
        pass

    terminate = kill


def _row_line(item, **kw):
    row = empty_row(item.impl, item.case, item.pass_, status="ok", median_s=1.0, **kw)
    return "@@ROW\t" + json.dumps({"id": item.id, **row})


def test_dead_worker_costs_one_error_row_and_the_sweep_continues(tmp_path):
    cfg = sweep.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager,torch-mha"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items = sweep.plan(cfg)
    assert len(items) == 4 and not any(it.skip for it in items)
    spawned = []

    def spawn(spec, env):
        spawned.append([i["id"] for i in spec["items"]])
        if len(spawned) == 1:  # dies (SIGKILL, as the OOM killer would) while on item 1
            return FakeProc(["@@START\t0", _row_line(items[0]), "@@START\t1"], rc=-9)
        return FakeProc([ln for it in items[2:] for ln in (f"@@START\t{it.id}", _row_line(it))], rc=0)

    out = sweep.Collected()
    sweep.spawn_group(cfg, items, [], out, lambda k, d: None, str(tmp_path), spawn)
    assert spawned == [[0, 1, 2, 3], [2, 3]]
    assert [[r["status"] for r in out.rows[i]] for i in range(4)] == [["ok"], ["error"], ["ok"], ["ok"]]
    assert "signal 9" in out.rows[1][0]["message"] and "Killed" in out.rows[1][0]["message"]


def test_failing_item_in_worker_becomes_error_row(monkeypatch):
    from parity.bench import worker

    monkeypatch.setattr(worker, "emit", lambda kind, payload: None)

    class Broken:
        @staticmethod
        def build(impl, case, pass_, device, seed):
            raise RuntimeError("out of memory: tried to allocate 64 GiB")

    group = [(0, _impl("ours-jax:jit:fused"), CASE, "fwd")]
    rows, probes = worker.time_group({"jax": Broken}, group, _worker_spec(), Timing(), FakeClock())
    row = rows[0][1]
    assert row["status"] == "error" and probes == []
    assert row["message"].startswith("RuntimeError: out of memory")
    assert set(ROW_FIELDS) <= set(row)


def test_items_that_cannot_fit_are_skip_rows_with_the_reason():
    big = BenchCase.of(1, 32768, 32768, 512, 8, "float32")
    cfg = sweep.RunConfig(preset=PRESETS["long"], impls=select_impls("ours-torch:eager"),
                           cases=(big,), passes=("fwd",), available_bytes=24 * 2**30)
    items = sweep.plan(cfg)
    by_key = {it.impl.bench_key: it for it in items}
    assert by_key["ours-torch:eager:fused"].skip is None
    assert "estimated memory" in by_key["ours-torch:eager:weights"].skip


def test_declared_dtypes_and_variants_make_skip_rows_naming_the_declaration():
    only_float32 = replace(_impl("ours-torch:eager:fused"), dtypes=("float32",), variants=("grouped",))
    classic = _impl("torch-sdpa-core:eager:fused")  # declares no variants
    plain, half = BenchCase.of(1, 8, 8, 12, 3, "float32"), BenchCase.of(1, 8, 8, 12, 3, "bfloat16")
    mqa_rope = BenchCase.of(1, 8, 8, 12, 3, "float32", kv_heads=1, rope="half", bias="none")
    cfg = sweep.RunConfig(preset=PRESETS["quick"], impls=(only_float32, classic), cases=(plain, half, mqa_rope),
                          passes=("fwd",), available_bytes=2**40)
    skips = {(it.impl.name, it.case): it.skip for it in sweep.plan(cfg)}
    assert skips[(only_float32.name, plain)] is None and skips[(classic.name, plain)] is None
    assert skips[(classic.name, half)] is None
    assert "declares dtypes=float32: bfloat16 is not among them" in skips[(only_float32.name, half)]
    # Each names the features it lacks, and only those.
    assert "rope-half, no-qkv-bias, no-out-bias" in skips[(only_float32.name, mqa_rope)]
    assert "grouped" not in skips[(only_float32.name, mqa_rope)].split("this layer uses")[1]
    assert "grouped, rope-half, no-qkv-bias, no-out-bias" in skips[(classic.name, mqa_rope)]


def test_the_worker_runs_each_framework_where_the_plan_it_was_given_says():
    """The parent's resolved plan reaches the worker as is: a GPU whose torch has no CUDA runs torch
    on the CPU (the plan says so), which the kind "gpu" alone would have made cuda."""
    plan = DevicePlan("auto", "gpu", "cpu", "gpu", note="torch has no CUDA here")
    built = {}

    class Recording(FakeMod):
        def build(self, impl, case, pass_, device, seed):
            built[impl.framework] = device
            return super().build(impl, case, pass_, device, seed)

    from parity.bench import worker

    clock, log = FakeClock(), []
    keys = ["ours-torch:eager:fused", "ours-jax:jit:fused"]
    mods = {fw: Recording(clock, log, dict.fromkeys(keys, 1.0)) for fw in ("torch", "jax")}
    group = [(i, _impl(k), CASE, "fwd") for i, k in enumerate(keys)]
    rows, _ = worker.time_group(mods, group, _worker_spec(device=asdict(plan)), Timing(min_repeats=2, max_repeats=2), clock)
    assert built == {"torch": "cpu", "jax": "gpu"}
    assert [row["device"] for _, row in rows] == ["cpu", "gpu"]


def test_the_sweep_sends_its_plan_to_every_worker(tmp_path):
    plan = sweep.device_plan("cpu")
    cfg = sweep.RunConfig(preset=PRESETS["quick"], plan=plan, impls=select_impls("ours-torch:eager:fused"),
                          cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items, specs = sweep.plan(cfg), []

    def spawn(spec, env):
        specs.append(spec)
        return FakeProc([ln for it in items for ln in (f"@@START\t{it.id}", _row_line(it))], rc=0)

    sweep.spawn_group(cfg, items, [], sweep.Collected(), lambda k, d: None, str(tmp_path), spawn)
    assert [s["device"] for s in specs] == [asdict(plan)] and DevicePlan(**specs[0]["device"]) == plan


def _worker_spec(**kw):
    return {"device": asdict(resolve_device("cpu", probe=False)), "precision": "highest", "seed": 0, "interleave": True, "verdict": None, **kw}


class FakeMod:
    """A framework module for the worker: benches whose step advances a fake clock and logs its name,
    and whose output is `outputs[key]` (default: the reference output)."""

    REF = np.linspace(-1.0, 1.0, 2 * 3 * 4).reshape(2, 3, 4)

    def __init__(self, clock, log, costs, outputs=None):
        self.clock, self.log, self.costs, self.outputs = clock, log, costs, outputs or {}

    def build(self, impl, case, pass_, device, seed):
        key = impl.bench_key

        def step():
            self.log.append(key)
            self.clock.advance(self.costs[key])

        return measure.Bench(step=step, sync=lambda out: None, output=lambda: self.outputs.get(key, self.REF))

    def reset_compiled(self):
        pass


def _fake_group(keys, costs, outputs=None, **spec):
    from parity.bench import worker

    clock, log = FakeClock(), []
    group = [(i, _impl(k), CASE, "fwd") for i, k in enumerate(keys)]
    mods = {fw: FakeMod(clock, log, costs, outputs) for fw in ("torch", "jax")}
    rows, _ = worker.time_group(mods, group, _worker_spec(**spec), Timing(warmup=1, min_repeats=8, max_repeats=8), clock)
    rows = dict(rows)
    timed = {s: r for s, r in rows.items() if r["status"] in ("ok", "noisy")}
    pair = verdict.choose_pair({s: keys[s] for s in timed}, {s: _impl(keys[s]).framework for s in timed},
                               {s: r["median_s"] for s, r in timed.items()}, spec.get("verdict"))
    v = None if pair is None else verdict.compute(
        "case", "fwd", keys[pair[0]], [rows[pair[0]]["samples"]], keys[pair[1]], [rows[pair[1]]["samples"]])
    return rows, v, log


@pytest.mark.parametrize("planted", ["negated", "time-reversed"])
def test_a_different_output_is_an_error_row(monkeypatch, planted):
    from parity.bench import worker

    monkeypatch.setattr(worker, "emit", lambda kind, payload: None)
    wrong = -FakeMod.REF if planted == "negated" else FakeMod.REF[:, ::-1]
    keys = ["ours-torch:eager:fused", "torch-sdpa-core:eager:fused", "ours-jax:jit:fused"]
    rows, _, _ = _fake_group(keys, dict.fromkeys(keys, 1.0), {"ours-jax:jit:fused": wrong})
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "ok" and rows[1]["out_max_diff"] == 0.0
    assert rows[2]["status"] == "error"
    assert "not the same computation as ours-torch:eager:fused" in rows[2]["message"]
    assert rows[2]["median_s"] == 1.0  # measured, kept, marked


def test_same_output_bounds_come_from_the_tolerance_table():
    from parity.tolerances import TOLERANCES

    ref = np.random.default_rng(0).standard_normal((3, 5, 12))
    f32 = TOLERANCES["float32"].forward
    assert measure.output_bound("float32") == (2 * f32.atol, 2 * f32.rtol, True)
    # float32: one float32 rounding of every element is far inside twice the table's bound ...
    assert measure.same_output(ref.astype(np.float32), ref, "float32")[1] is None
    # ... a negated or time-reversed output is not, nor a NaN where the reference has none.
    for wrong in (-ref, ref[:, ::-1]):
        diff, why = measure.same_output(wrong, ref, "float32")
        assert why and diff > 0.1
    nan = ref.copy()
    nan[0, 0, 0] = np.nan
    assert "NaN" in measure.same_output(nan, ref, "float32")[1]
    # bfloat16: a rounding to bfloat16 passes (3 units of rounding of max|ref| each side), a sign flip does not.
    import ml_dtypes

    rounded = ref.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert measure.same_output(rounded, ref, "bfloat16")[1] is None
    assert measure.same_output(-ref, ref, "bfloat16")[1]
    assert measure.output_bound("float32", "default") == measure.output_bound("bfloat16")


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
        case = BenchCase.of(1, seq, seq, 32, 4, "float32")
        for pass_ in ("fwd", "fwd+bwd"):
            row = empty_row(_impl("ours-torch:eager:fused"), case, pass_, status="ok", median_s=seq * 1e-5)
            rows.append(measure.apply_peak(row, pass_flops(case, pass_), None))
    path = tmp_path / "b.png"
    report.write_plot(str(path), rows)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- interleaving and pairing


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
    res = measure.time_group([make("a", 1.0), make("b", 1.0)], timing, clock)
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
    res = measure.time_group(
        [measure.Bench(step=bad, sync=lambda out: None), good], Timing(warmup=1, min_repeats=4, max_repeats=4), clock,
    )
    assert isinstance(res[0], RuntimeError)
    assert res[1]["repeats"] == 4 and res[1]["median_s"] == 1.0


def test_torch_and_jax_implementations_of_a_case_are_timed_in_one_rotation(monkeypatch):
    """Pairing: one worker runs both frameworks' benches in the same rounds, direction alternating,
    and the default verdict compares the fastest implementation of each framework."""
    from parity.bench import worker

    monkeypatch.setattr(worker, "emit", lambda kind, payload: None)
    keys = ["ours-torch:eager:fused", "torch-sdpa-core:eager:fused", "ours-jax:jit:fused", "ours-jax:jit:weights"]
    costs = {keys[0]: 3.0, keys[1]: 2.0, keys[2]: 1.0, keys[3]: 4.0}
    rows, v, log = _fake_group(keys, costs)
    rounds = [log[i:i + 4] for i in range(0, len(log), 4)]  # the output call is the one warm-up: no step before
    assert len(rounds) == 8 and all(sorted(r) == sorted(keys) for r in rounds)
    assert rounds[0] == keys and rounds[1] == keys[::-1] and rounds[2] == keys
    assert (v["faster"], v["slower"]) == ("ours-jax:jit:fused", "torch-sdpa-core:eager:fused")
    assert v["ratio"] == pytest.approx(2.0) and v["ci"] == [pytest.approx(2.0)] * 2 and v["repeats"] == 8
    assert rows[0]["samples"] == [[3.0] * 4] * 2 and (rows[0]["rounds"], rows[0]["processes"]) == (2, 1)
    # One worker process cannot show the run-to-run spread: the samples alone are not conclusive.
    assert not v["conclusive"] and "one worker process" in verdict.sample_reason(v)
    _, named, _ = _fake_group(keys, costs, verdict=["ours-torch:eager:fused", "ours-jax:jit:weights"])
    assert (named["faster"], named["slower"], named["ratio"]) == ("ours-torch:eager:fused", "ours-jax:jit:weights",
                                                                pytest.approx(4 / 3))


def test_one_worker_per_case_holds_both_frameworks():
    cfg = sweep.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:fused,ours-jax:jit:fused"),
                           cases=(CASE, BenchCase.of(1, 8, 8, 12, 3, "float32")), passes=("fwd", "fwd+bwd"),
                           available_bytes=2**40)
    items = sweep.plan(cfg)
    per_case = sweep._groups(items, "case")
    assert len(per_case) == 2
    assert all({it.impl.framework for it in g} == {"torch", "jax"} and len({it.case for it in g}) == 1 for g in per_case)
    assert [len(g) for g in sweep._groups(items, "run")] == [8]


def test_sampling_stops_once_the_interval_is_narrow_enough():
    clock = FakeClock()
    benches = {0: measure.Bench(step=lambda: clock.advance(1.0), sync=lambda out: None),
               1: measure.Bench(step=lambda: clock.advance(2.0), sync=lambda out: None)}
    checks = []

    def settled(rounds):  # rounds of 4 repeats
        checks.append(len(rounds[0]))
        return len(rounds[0]) >= 12

    times, _, _ = measure.sample(benches, Timing(min_repeats=8, max_repeats=400, budget_s=1e9), clock, settled=settled)
    assert checks[0] == 2 and len(times[0]) == len(times[1]) == checks[-1] >= 12
    assert len(measure.flat(times[0])) < 400  # the budget is far: the interval stopped it
    assert checks == sorted(set(checks)) and len(checks) < len(times[0]) - 2  # not after every round


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
    assert max(len(ln) for ln in text.splitlines()) <= 100 and "noisy: new 61.5%" in text


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
    (lambda d: d.update(schema="mha-bench/9"), "schema 'mha-bench/9' is not supported"),
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
    (lambda d: d["rows"][0].update(median_s=10**400), "median_s = an integer of 401 digits is not a finite"),
    (lambda d: d["rows"][0].update(batch=10**30), "batch=" + str(10**30)),
    (lambda d: d["rows"][0].update(status="noisy", iqr_s=0.4), None),  # a valid noisy row
    (lambda d: d.update(verdicts=5), "'verdicts' must be a list"),
    (lambda d: d.update(verdicts=[{"case": "x"}]), "verdict 0: missing field(s) pass"),
    (lambda d: d.update(verdicts=[{"case": "x", "pass": "fwd", "faster": "a", "slower": "b", "ratio": 10**400,
                                   "ci": [1, 2], "conclusive": True, "repeats": 8}]), "verdict 0: ratio"),
])
def test_load_rejects_a_malformed_run_with_a_reason(tmp_path, mutate, message):
    if message is None:
        assert report.load(_bench_json(tmp_path, mutate))["rows"]
        return
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


def test_a_case_round_trips_through_its_row_fields_and_a_row_without_them_is_the_classic_layer():
    mqa = BenchCase.of(2, 5, 7, 24, 4, "bfloat16", kv_heads=1, rope="half", bias="qkv")
    assert BenchCase.from_fields(mqa.fields()) == mqa
    assert mqa.label == "B=2 T=5 S=7 E=24 N=4 K=1 rope=half bias=qkv bfloat16"
    assert (mqa.config.num_kv_heads, mqa.config.qkv_bias, mqa.config.out_bias) == (1, True, False)
    classic = BenchCase.of(2, 5, 7, 24, 4, "bfloat16", kv_heads=4)  # K = N is the classic layer
    assert classic == BenchCase.of(2, 5, 7, 24, 4, "bfloat16") and classic.config.features == frozenset()
    assert classic.label == "B=2 T=5 S=7 E=24 N=4 bfloat16"  # the label rows had before the variant fields
    old = {k: v for k, v in classic.fields().items() if k not in ("kv_heads", "rope", "bias")}
    assert BenchCase.from_fields(old) == classic
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=3)
    with pytest.raises(ValueError, match="bias 'q'"):
        BenchCase.of(2, 5, 7, 24, 4, "float32", bias="q")
    with pytest.raises(ValueError, match="Problem.T must be a positive int"):
        BenchCase.of(2, 0, 7, 24, 4, "float32")


def test_a_file_before_the_variant_fields_compares_with_classic_rows_and_variants_are_rows_of_their_own(tmp_path):
    base = report.load("tests/data/bench-cpu.json")
    first = next(r for r in base["rows"] if r["status"] == "ok")
    assert "kv_heads" not in first  # written before the variant fields existed
    case = BenchCase.from_fields(first)
    im = next(i for i in IMPLS if str(Key.of_row(first)) == i.bench_key)
    classic = empty_row(im, case, first["pass"], status="ok", median_s=first["median_s"], iqr_s=first["iqr_s"])
    grouped = empty_row(im, BenchCase.from_fields({**first, "kv_heads": 1}), first["pass"], status="ok",
                        median_s=first["median_s"] * 5, iqr_s=first["iqr_s"])
    path = tmp_path / "new.json"
    report.write_json(str(path), [classic, grouped], {})
    new = report.load(str(path))  # two rows of the same sizes: not a repeat, the layers differ
    result = report.compare(base, new)
    assert result.compared == 1 and result.regressions == 0  # the classic row met its old self, the grouped none
    assert [e["kv_heads"] for e in result.only_new] == [1]
    bad = {**classic, "kv_heads": 3}
    report.write_json(str(path), [bad], {})
    with pytest.raises(report.BenchFileError, match="kv_heads=3"):
        report.load(str(path))


# ---------------------------------------------------------------- errored rows stay visible


def test_a_row_above_the_peak_keeps_its_numbers_marked_in_table_ratio_and_markdown():
    cfg = sweep.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:fused,torch-sdpa-core"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    items = sweep.plan(cfg)
    flops = pass_flops(CASE, "fwd")
    out = sweep.Collected(peaks=[{"dtype": "float32", "gflops": 100.0}])
    out.rows = {items[0].id: [_ok_row(median_s=flops / 50e9) | {"impl": "torch-sdpa-core"}],
                items[1].id: [_ok_row(median_s=flops / 150e9)]}  # 150 GFLOP/s > the 100 peak: planted
    rows = sweep.finish(items, out)
    assert [r["status"] for r in rows] == ["ok", "error"]
    # Against the measured row: ours-torch fused, the default baseline, is rejected, so not itself.
    assert rows[1]["ratio"] == pytest.approx(50 / 150) and rows[1]["baseline"] == "torch-sdpa-core:eager:fused"
    cells = report._cells(rows[1])
    assert cells[5] == "0.33× (error)" and cells[6] == "150.0 (error)"
    console = report.Console(file=io.StringIO(), width=300)
    report.print_table(rows, console)
    text = console.file.getvalue()
    line = next(ln for ln in text.splitlines() if "ours-torch eager fused" in ln)
    assert "0.33×" in line and line.rstrip().endswith("error")  # the console: the number, and its status
    assert "error: ours-torch:eager:fused fwd" in text and "exceeds the measured" in text  # the reason, below
    assert "0.33× (error)" in report.markdown(rows, _env())


@pytest.mark.parametrize("width", [100, 300])
def test_the_console_table_fits_100_columns_without_cutting_a_word(width):
    rows = []
    for im in select_impls("ours-torch:eager,torch-sdpa-core,ours-jax:jit,jax-dpa-core"):
        for pass_ in ("fwd", "fwd+bwd"):
            row = empty_row(im, BenchCase.of(16, 32768, 32768, 4096, 32, "bfloat16"), pass_, status="noisy",
                            median_s=123.456, iqr_s=98.7, ratio=12.345, gflops=12345.6, peak_fraction=0.99,
                            compile_s=12.3, message="noisy: IQR/median = 80% > 10%")
            rows.append(row)
    rows[0] |= {"status": "error", "message": "RuntimeError: " + "x" * 300}
    console = report.Console(file=io.StringIO(), width=width, force_terminal=width == 100)
    report.print_table(rows, console)
    text = console.file.getvalue()
    from rich.text import Text

    lines = [Text.from_ansi(ln).plain for ln in text.splitlines()]
    assert max(len(ln) for ln in lines) <= 100
    table = [ln for ln in lines if ln.startswith(("fwd ", "fwd+bwd "))]
    assert len(table) == len(rows)  # one line per row: nothing folds
    assert all("…" not in ln for ln in table) and all(ln.split()[-1] in ("noisy", "error") for ln in table)


# ---------------------------------------------------------------- the peak is re-measured


class FakePeakMod:
    """peak_gflops returns scripted rates, one per call."""

    def __init__(self, *rates):
        self.rates = list(rates)

        self.sizes = []

    def peak_gflops(self, dtype, sizes, device, timing, clock):
        self.sizes.append(list(sizes))
        return self.rates.pop(0), sizes[-1]


def _vet(monkeypatch, scratch, rates, row_gflops):
    """Run a worker's PeakBar on rows of the given rates; return the parent's verdicts."""
    from parity.bench import worker

    lines = []
    monkeypatch.setattr(worker, "emit", lambda kind, payload: lines.append(f"@@{kind}\t{json.dumps(payload)}"))
    cfg = sweep.RunConfig(preset=PRESETS["quick"], impls=select_impls("ours-torch:eager:fused"),
                           cases=(CASE,), passes=("fwd",), available_bytes=2**40)
    flops = pass_flops(CASE, "fwd")
    mod = FakePeakMod(*rates)
    bar = worker.PeakBar({"torch": mod}, {"torch": "cpu"}, [{"dtype": "float32", "sizes": [2048]}], [], FakeClock())
    bar.measure("float32")
    verdicts = []
    for gflops in row_gflops:
        item = sweep.plan(cfg)[0]
        row = empty_row(item.impl, item.case, item.pass_, status="ok", median_s=flops / (gflops * 1e9), iqr_s=0.0)
        bar.vet([(item.id, row)])
        out = sweep.Collected()
        sweep.spawn_group(cfg, [item], [], out, lambda k, d: None, str(scratch),
                         lambda spec, env: FakeProc([*lines, f"@@ROW\t{json.dumps({'id': item.id, **row})}"], rc=0))
        verdicts.append(sweep.finish([item], out)[0]["status"])
    return verdicts, [json.loads(ln.split("\t", 1)[1]) for ln in lines], mod


def test_a_row_above_the_startup_peak_triggers_a_remeasure_and_is_ok_below_the_new_one(monkeypatch, tmp_path):
    verdicts, peaks, mod = _vet(monkeypatch, tmp_path, [100.0, 200.0], [150.0])
    assert verdicts == ["ok"]
    assert [p["gflops"] for p in peaks] == [100.0, 200.0]
    assert "150.0 GFLOP/s > 100.0" in peaks[1]["remeasured_for"]
    # The re-measure adds a matmul of about the row's own work (2·n³ ≈ CASE's forward FLOPs).
    assert mod.sizes == [[2048], [64, 2048]]
    assert 0.5 < 2 * 64**3 / pass_flops(CASE, "fwd") < 2.0


def test_a_row_still_above_the_remeasured_peak_is_an_error_and_remeasures_are_capped(monkeypatch, tmp_path):
    verdicts, peaks, mod = _vet(monkeypatch, tmp_path, [100.0, 120.0, 110.0, 105.0, 999.0], [150.0] * 5)
    assert verdicts == ["error"] * 5
    assert len(peaks) == 1 + 3 and mod.rates == [999.0]  # start-up + MAX_REMEASURES, no more


def test_a_row_below_the_peak_costs_no_remeasure(monkeypatch, tmp_path):
    verdicts, peaks, _ = _vet(monkeypatch, tmp_path, [100.0], [90.0])
    assert verdicts == ["ok"] and len(peaks) == 1


# ---------------------------------------------------------------- plot


def _all_series_rows():
    rows = []
    for im in IMPLS:
        for dtype in ("float32", "bfloat16", "float16"):
            for b, e in ((1, 32), (2, 64), (4, 64)):
                for seq in (64, 128):
                    case = BenchCase.of(b, seq, seq, e, 4, dtype)
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
    v = {"case": "B=1 T=64 S=64 E=32 N=4 float32", "pass": "fwd", "faster": "a:jit:fused", "slower": "b:eager:fused",
         "ratio": 1.5, "ci": [1.4, 1.6], "conclusive": False, "repeats": 48, "reason": "interference during the run"}
    report.write_plot(str(path), rows, env, [v])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The rows: one implementation in float32 at (B, E) = (1, 32), (2, 64), (4, 64), T = S = 64, 128, and
    # the next dtype's first two; N = 4 everywhere, the classic layer without a mask.
    # the words in order, wrapped to the one-pass figure's width (tests/test_bench_table.py measures that it fits)
    assert len(titles) == 1 and titles[0].split() == (
        "mha-bench: E=32,64 N=4 K=4 RoPE=none bias=all mask=none B=1,2,4 T=64,128 S=64,128 bfloat16,float32 "
        "device cpu (Fake CPU), preset quick, precision highest "
        "fwd B=1 T=64 S=64 E=32 N=4 float32: a:jit:fused 1.5x faster than b:eager:fused, 95% CI 1.4-1.6, "
        "inconclusive (interference during the run)").split()
    assert max(map(len, titles[0].splitlines())) <= report.title_chars(report.PASS_WIDTH_IN)
    assert markers.count((1, "X")) == 4  # two error rows, each on the time and the GFLOP/s axes
    assert legends[0].count("error row (measured, not trusted)") == 1 and legends[0][-1].startswith("error row")


# ---------------------------------------------------------------- verdicts on synthetic samples

from parity.bench import verdict  # noqa: E402


def _nested(values, procs=2, rounds=5):
    """Flat per-pair values cut into processes -> rounds -> pairs."""
    values = list(values)
    n = len(values) // (procs * rounds)
    return [[values[(p * rounds + r) * n:(p * rounds + r + 1) * n] for r in range(rounds)] for p in range(procs)]


def _load(n, seed=0):
    """A common-mode load factor per pair, 1x to 5x: what a busy machine does to both calls of a pair."""
    return np.random.default_rng(seed).uniform(1.0, 5.0, n)


OK_ROWS = {"A": {"status": "ok"}, "B": {"status": "ok"}}


def test_a_clear_difference_is_conclusive_with_its_ratio_inside_the_interval():
    load = _load(40)
    jitter = np.random.default_rng(1).normal(1.0, 0.01, 40)
    a = 0.010 * load
    b = 0.013 * load * jitter  # B takes 1.3x A's time in every pair, within 1 %
    v = verdict.compute("case", "fwd", "A", _nested(a), "B", _nested(b))
    assert (v["faster"], v["slower"], v["repeats"], v["rounds"], v["processes"]) == ("A", "B", 40, 10, 2)
    assert v["ci"][0] < 1.3 < v["ci"][1] and v["ci"][0] > 1.25 and v["ci"][1] < 1.35
    assert v["conclusive"] and verdict.settled(v)
    assert verdict.finalize(v, OK_ROWS)["conclusive"]
    # Swapped arguments give the same verdict, oriented the same way.
    w = verdict.compute("case", "fwd", "B", _nested(b), "A", _nested(a))
    assert (w["faster"], w["slower"]) == ("A", "B") and w["ratio"] == pytest.approx(v["ratio"])
    assert w["ci"] == pytest.approx(v["ci"])


def test_pairing_cancels_a_common_load_that_unpaired_samples_cannot():
    load = _load(40, seed=2)
    a, b = 0.010 * load, 0.011 * load  # exactly 1.1x in every pair, under a 1x-5x load
    paired = verdict.compute("c", "fwd", "A", _nested(a), "B", _nested(b), paired=True)
    unpaired = verdict.compute("c", "fwd", "A", _nested(a), "B", _nested(b), paired=False)
    assert paired["ci"] == [pytest.approx(1.1), pytest.approx(1.1)] and paired["conclusive"]
    assert unpaired["ci"][0] < 1.0 < unpaired["ci"][1] and not unpaired["conclusive"]


def test_a_shift_between_rounds_widens_the_interval_that_resampling_pairs_alone_would_not():
    """The same pairs, 1 % apart within each round; in the second sample the rounds' ratios differ
    (1.2x or 1.4x, as the machine's state changed between them): the hierarchical interval must
    cover that spread. A bootstrap over the pooled pairs (what the interval was before) stays narrow."""
    rng = np.random.default_rng(4)
    noise = rng.normal(1.0, 0.01, 40)
    steady = verdict.compute("c", "fwd", "A", _nested([1.0] * 40), "B", _nested(1.3 * noise))
    shifts = np.repeat([1.2, 1.4] * 5, 4)  # a ratio per round of 4 pairs, alternating
    shifted = verdict.compute("c", "fwd", "A", _nested([1.0] * 40), "B", _nested(shifts * noise))
    width = lambda v: v["ci"][1] / v["ci"][0]  # noqa: E731
    assert width(steady) < 1.02 and width(shifted) > 1.10
    pooled = verdict.hierarchical_interval([[list(np.log(shifts * noise))]])  # one process, one round
    assert pooled[1] is None  # one round gives no interval at all: never a tight one


def test_a_shift_between_processes_makes_the_verdict_inconclusive():
    """Two worker processes, each tight on its own: B 1.3x slower in the first, 1.3x faster in the
    second (a run-to-run flip). Within either process the interval excludes 1; across them it must not."""
    noise = np.random.default_rng(5).normal(1.0, 0.01, 40)
    b = np.concatenate([1.3 * noise[:20], noise[20:] / 1.3])
    v = verdict.compute("c", "fwd", "A", _nested([1.0] * 40), "B", _nested(b))
    first = verdict.compute("c", "fwd", "A", _nested([1.0] * 20, procs=1), "B", _nested(b[:20], procs=1))
    assert verdict.excludes_one(first["ci"])
    assert v["ci"][0] < 1.0 < v["ci"][1] and not verdict.finalize(v, OK_ROWS)["conclusive"]
    assert verdict.finalize(v, OK_ROWS)["reason"].startswith("the interval contains 1")


def test_no_real_difference_is_inconclusive_and_says_why():
    rng = np.random.default_rng(3)
    a = 0.010 * rng.lognormal(0.0, 0.2, 40)
    b = 0.010 * rng.lognormal(0.0, 0.2, 40)  # the same distribution: the interval must contain 1
    v = verdict.compute("c", "fwd", "A", _nested(a), "B", _nested(b))
    assert v["ci"][0] < 1.0 < v["ci"][1] and not v["conclusive"]
    final = verdict.finalize(v, OK_ROWS)
    assert final["reason"] == verdict.why_inconclusive(final, OK_ROWS) and "interval contains 1" in final["reason"]
    assert verdict.sentence(final, OK_ROWS).startswith("inconclusive (the interval contains 1")


def test_too_few_processes_or_rounds_or_interference_or_an_error_row_is_never_conclusive_a_noisy_row_is():
    twice = [[[1.0] * 4] * 3] * 2  # 2 processes x 3 rounds x 4 pairs
    doubled = [[[2.0] * 4] * 3] * 2
    enough = verdict.compute("c", "fwd", "A", twice, "B", doubled)
    assert enough["ci"] == [2.0, 2.0] and verdict.finalize(enough, OK_ROWS)["conclusive"]
    one = verdict.compute("c", "fwd", "A", twice[:1], "B", doubled[:1])
    assert not one["conclusive"] and "one worker process" in verdict.finalize(one, OK_ROWS)["reason"]
    few = verdict.compute("c", "fwd", "A", [r[:2] for r in twice], "B", [r[:2] for r in doubled])
    assert verdict.finalize(few, OK_ROWS)["reason"] == f"too few rounds (4 < {verdict.MIN_ROUNDS})"
    # A row's own spread no longer vetoes a tight paired interval; it stays noisy for the reader.
    noisy = {"A": {"status": "ok"}, "B": {"status": "noisy"}}
    assert verdict.finalize(enough, noisy)["conclusive"]
    err = {"A": {"status": "ok"}, "B": {"status": "error"}}
    assert verdict.finalize(enough, err)["reason"] == "B is error"
    disturbed = verdict.finalize(enough, OK_ROWS, ["worker process 1: other processes used 1.00 cores"])
    assert not disturbed["conclusive"] and disturbed["reason"].startswith("interference during the run: worker process 1")
    assert verdict.sentence(disturbed).startswith("inconclusive (interference during the run")


def test_a_single_round_has_no_interval_and_writes_as_null(tmp_path):
    v = verdict.compute("B=1 T=16 S=16 E=32 N=2 float32", "fwd", "A", [[[1.0]]], "B", [[[2.0]]])
    assert v["ci"] is None and v["ratio"] == pytest.approx(2.0) and not verdict.settled(v)
    final = verdict.finalize(v, OK_ROWS)
    assert "no interval" in verdict.sentence(final)
    path = tmp_path / "v.json"
    row = _ok_row(median_s=1e-3)
    report.write_json(str(path), [row], _env(), [final])  # allow_nan=False: an infinite bound would raise here
    loaded = report.load(str(path))
    assert loaded["verdicts"][0]["ci"] is None and loaded["verdicts"][0]["reason"] == final["reason"]


def test_settled_is_a_half_width_within_five_percent_of_the_ratio():
    base = {"ratio": 2.0, "conclusive": True, "repeats": 20}
    assert verdict.settled({**base, "ci": [1.91, 2.09]})  # half-width 0.09 < 5 % of 2
    assert not verdict.settled({**base, "ci": [1.89, 2.11]})  # 0.11 > 0.1
    assert not verdict.settled({**base, "ci": None})
    with pytest.raises(ValueError, match="paired samples need the same processes"):
        verdict.compute("c", "fwd", "A", [[[1.0]], [[1.0]]], "B", [[[1.0]]])


def test_compare_calls_a_noisy_row_noisy_whatever_its_change():
    base, doubled = _ok_row(median_s=1.0, iqr_s=0.01), _ok_row(median_s=2.0, iqr_s=0.01)
    noisy_new = doubled | {"status": "noisy", "message": "noisy: IQR/median = 30.0% > 10%"}
    old_schema_noisy = doubled | {"iqr_s": 0.5}  # a file without the status: IQR/median 25 %
    for new in (noisy_new, old_schema_noisy):
        result = report.compare({"rows": [base]}, {"rows": [new]}, 0.10)
        assert [e["verdict"] for e in result.entries] == ["noisy"] and result.regressions == 0
        assert result.entries[0]["note"] == ("new 25.0%" if new is old_schema_noisy else "new 0.5%")
    assert report.compare({"rows": [base]}, {"rows": [doubled]}, 0.10).regressions == 1


def test_one_sequence_length_plots_bars_with_the_iqr_and_several_plot_lines_with_error_bars(tmp_path, monkeypatch):
    import matplotlib.axes

    calls = []
    real_barh, real_errorbar = matplotlib.axes.Axes.barh, matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "barh",
                        lambda self, y, w, **kw: calls.append(("barh", list(w), kw.get("xerr"))) or real_barh(self, y, w, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, **kw: calls.append(("errorbar", list(y), kw.get("yerr")))
                        or real_errorbar(self, x, y, **kw))

    def rows(seqs):
        out = []
        for key, median in (("ours-torch:eager:fused", 2.0), ("ours-jax:jit:fused", 1.0)):
            for seq in seqs:
                case = BenchCase.of(1, seq, seq, 32, 4, "float32")
                out.append(empty_row(_impl(key), case, "fwd", status="ok", median_s=median, iqr_s=0.4 * median))
        return out

    report.write_plot(str(tmp_path / "one.png"), rows([64]))
    times = [c for c in calls if c[0] == "barh" and c[2] is not None]
    assert times and sorted(times[0][1]) == [1.0, 2.0] and sorted(times[0][2]) == [0.2, 0.4]  # ± IQR / 2
    calls.clear()
    report.write_plot(str(tmp_path / "two.png"), rows([64, 128]))
    assert not any(c[0] == "barh" for c in calls)
    assert sorted(c[2][0] for c in calls if c[0] == "errorbar") == [0.2, 0.4]


def test_outputs_are_compared_with_the_preferred_reference_holding_at_most_its_array():
    from parity.bench import worker

    ref, wrong = FakeMod.REF, -FakeMod.REF
    keys = {0: "ours-jax:jit:fused", 1: "flax-nnx-mha:jit:fused", 2: "ours-torch:eager:fused", 3: "jax-dpa-core:jit:fused"}
    check = worker.OutputCheck(keys, "float32", "highest")
    check.add(0, ref)
    check.add(1, wrong)
    assert check.ref is None and set(check.held) == {0, 1}  # ours-torch, the preferred reference, may still come
    check.add(2, ref)
    assert check.ref == 2 and set(check.held) == {2}  # compared at once, only the reference kept
    check.add(3, ref)
    assert set(check.held) == {2} and set(check.diffs) == {0, 1, 3}
    assert list(check.mismatch) == [1] and "as ours-torch:eager:fused" in check.mismatch[1]
    # Without any of the preferred ones, the first implementation with an output is the reference.
    check = worker.OutputCheck({0: "a:jit:fused", 1: "b:jit:fused"}, "float32", "highest")
    check.add(0, None)  # failed to build
    check.add(1, ref)
    assert check.ref == 1 and not check.mismatch


# ---------------------------------------------------------------- a grouped, rotary, bias-free layer

# Pairwise-distinct sizes; RoPE needs an even head size: E=24 N=4 (H=6), K=2.
VARIANT_CASE = BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2, rope="interleaved", bias="none")


class TestVariants:
    """mha-bench on a grouped, rotary, bias-free layer: the real builds of both frameworks, in process.

    (The sweep through a worker, with skip rows for the implementations that do not declare the
    features, is in test_bench_cli's shared real run.)"""

    def test_rope_cases_pass_the_default_positions_to_every_implementation(self):
        pos = rope_positions(VARIANT_CASE)
        assert pos["positions"].shape == (2, 5) and pos["key_positions"].shape == (2, 7)
        assert (pos["positions"] == np.arange(5)).all() and (pos["key_positions"] == np.arange(7)).all()
        assert rope_positions(BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2)) == {}

    def test_the_weights_follow_the_layer(self):
        sd = canonical_weights(VARIANT_CASE.config, "bfloat16", seed=3)
        assert {k: v.shape for k, v in sd.items()} == VARIANT_CASE.config.weight_shapes()  # k/v (K·H, E), no biases
        assert {v.dtype.name for v in sd.values()} == {"bfloat16"}
        assert all(np.abs(v.astype(np.float32)).max() <= 1 / np.sqrt(24) for v in sd.values())

    def test_both_frameworks_build_time_and_agree_on_a_grouped_rotary_bias_free_layer(self):
        """fwd+bwd: its step is the gradient program, its output check the forward one."""
        torch = pytest.importorskip("torch")
        from parity import convert
        from parity.bench import jax_bench, torch_bench

        outputs = {}
        for key, mod in (("ours-torch:eager:fused", torch_bench), ("ours-torch:eager:weights", torch_bench),
                         ("ours-jax:jit:fused", jax_bench)):
            bench = mod.build(_impl(key), VARIANT_CASE, "fwd+bwd", "cpu", 0)
            if bench.aot_compile is not None:
                bench.aot_compile()
            outputs[key] = bench.output()
            result = bench.step()
            bench.sync(result)
            # Gradients w.r.t. q, k, v and the four weights (no biases).
            leaves = result if key.startswith("ours-torch") else (*result[0].values(), *result[1:])
            assert len(leaves) == 3 + 4, key
            if bench.recompile is not None:  # the shrunk case gets positions of its own lengths
                assert bench.recompile(time.perf_counter) >= 0
        ref = outputs["ours-torch:eager:fused"]
        assert ref.shape == (2, 5, 24) and np.isfinite(ref).all()
        for key, out in outputs.items():
            diff, why = same_output(out, ref, "float32")
            assert why is None, (key, why)
        # The positions passed are the module's defaults: the layer called without any gives the same.
        q, k, v = make_inputs(VARIANT_CASE, 0)
        sd = canonical_weights(VARIANT_CASE.config, "float32", 0)
        m = convert.to_torch(sd, 4, num_kv_heads=2, rope="interleaved")
        with torch.no_grad():
            plain, _ = m(*(torch.from_numpy(x) for x in (q, k, v)), need_weights=False)
        assert np.array_equal(plain.numpy(), ref)
