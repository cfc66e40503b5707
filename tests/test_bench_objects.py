"""Objects to the edge: the benchmark's worker turns its spec's plan, keys and cases back into objects
once and passes them on; `runs_on` is parsed once, when an Implementation is made. The worker runs in
process on fake framework modules (no torch or jax import), forward only, tiny sizes."""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import signal

import numpy as np
import pytest

from mha_spec import DTYPE_NAMES
from parity import implementation as implementation_mod
from parity.bench import measure, sweep, worker
from parity.bench.records import Key
from parity.bench.spec import IMPLS, MASKS, PRESETS, BenchCase, select_impls
from parity.devices import DevicePlan, resolve_device
from parity.harness import MASK_KINDS
from parity.implementation import Implementation, RunsOn, unit_kind
from parity.impls import BUILTIN

# Two cases of pairwise-distinct sizes (two groups, so the plan is used by more than one), two torch
# implementations each.
CASES = (BenchCase.of(2, 6, 6, 12, 3, "float32"), BenchCase.of(3, 5, 7, 20, 4, "float32"))
KEYS = ("ours-torch:eager:fused", "torch-sdpa-core:eager:fused")


class FakeTorch:
    """torch_bench's surface as the worker uses it; every bench does a little work and gives one output."""

    REF = np.linspace(-1.0, 1.0, 24).reshape(2, 3, 4)

    def __init__(self):
        self.built = []

    def build(self, impl, case, pass_, device, seed):
        self.built.append((impl.bench_key, case, device))
        return measure.Bench(step=lambda: sum(range(200)), sync=lambda out: None, output=lambda: self.REF)

    def reset_compiled(self):
        pass

    def peak_gflops(self, dtype, sizes, device, timing, clock):
        raise AssertionError("the spec asks for no peak")


class Counter:
    """Wraps a callable attribute and counts its calls."""

    def __init__(self, monkeypatch, owner, name, classmethod_=False):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kw):
            self.calls += 1
            return original(*args, **kw)

        if classmethod_:
            monkeypatch.setattr(owner, name, classmethod(lambda cls, *a, **kw: counted(*a, **kw)))
        else:
            monkeypatch.setattr(owner, name, counted)


def _worker_spec(plan: DevicePlan) -> dict:
    cfg = sweep.RunConfig(preset=PRESETS["quick"], plan=plan, impls=select_impls(",".join(KEYS)), cases=CASES,
                          passes=("fwd",), available_bytes=2**40)
    items = sweep.plan(cfg)
    assert len(items) == 4 and not any(it.skip for it in items)
    return {"device": plan.to_dict(), "threads": None, "precision": "highest", "seed": 0,
            "timing": {"warmup": 0, "min_repeats": 2, "max_repeats": 2, "budget_s": 0.01, "round_repeats": 1},
            "peaks": [], "known_peaks": [], "items": [it.to_json() for it in items], "interleave": True,
            "user_impls": [], "verdict": None}


def test_the_worker_rebuilds_its_plan_once_and_each_case_and_implementation_once(monkeypatch, tmp_path):
    plan = DevicePlan("auto", "gpu", "cpu", "gpu", note="torch runs on cpu as the reference")
    spec = _worker_spec(plan)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    fake, emitted, plans_given = FakeTorch(), [], []
    monkeypatch.setattr(worker, "emit", lambda kind, payload: emitted.append((kind, payload)))
    monkeypatch.setattr(worker, "pin_threads", lambda threads: [0])
    monkeypatch.setattr(worker, "setup", lambda fw, device, spec, cpus, compiles: (fake, {"unavailable": None}))
    time_group = worker.time_group

    def recording(*args, **kw):
        plans_given.append(args[6] if len(args) > 6 else kw.get("plan"))
        return time_group(*args, **kw)

    monkeypatch.setattr(worker, "time_group", recording)
    from_dict = Counter(monkeypatch, DevicePlan, "from_dict", classmethod_=True)
    plan_inits = Counter(monkeypatch, DevicePlan, "__init__")
    from_fields = Counter(monkeypatch, BenchCase, "from_fields", classmethod_=True)
    case_inits = Counter(monkeypatch, BenchCase, "__init__")
    lookups = Counter(monkeypatch, Key, "find")
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert worker.main([str(path)]) == 0
    finally:
        signal.signal(signal.SIGINT, handler)  # main ignores SIGINT, as a worker process must
    n = len(spec["items"])
    assert (from_dict.calls, plan_inits.calls) == (1, 1)
    assert (from_fields.calls, case_inits.calls, lookups.calls) == (n, n, n)
    # The one plan object reaches every group, and it is the parent's plan.
    assert len(plans_given) == len(CASES) and all(p is plans_given[0] for p in plans_given)
    assert plans_given[0] == plan
    rows = [p for kind, p in emitted if kind == "ROW"]
    assert sorted(r["id"] for r in rows) == list(range(n))
    # Every row measured (so PeakBar.vet looked at each one's case) and on the plan's torch device.
    assert all(r["status"] in ("ok", "noisy") and r["median_s"] > 0 and r["device"] == "cpu" for r in rows)
    assert [(key, case) for key, case, _ in fake.built] == [(k, c) for c in CASES for k in KEYS]


@pytest.mark.parametrize("plan", [
    resolve_device("cpu", probe=False),
    DevicePlan("auto", "gpu", "cpu", "gpu", note="torch has no CUDA here"),
    DevicePlan("tpu", "tpu", None, None, skip_reason="device tpu not present: no /dev/accel*"),
])
def test_a_device_plan_round_trips_through_json(plan):
    data = json.loads(json.dumps(plan.to_dict()))
    assert data == dataclasses.asdict(plan)  # the spelling the worker specs and run files already hold
    assert DevicePlan.from_dict(data) == plan


def test_a_device_plan_that_is_not_one_names_what_is_wrong():
    good = resolve_device("cpu", probe=False).to_dict()
    with pytest.raises(ValueError, match=r"missing \['name'\], unknown \['gpu_count'\]"):
        DevicePlan.from_dict({**{k: v for k, v in good.items() if k != "name"}, "gpu_count": 1})
    with pytest.raises(TypeError, match="DevicePlan.name must be a string, got None"):
        DevicePlan.from_dict({**good, "name": None})
    with pytest.raises(TypeError, match="from a dict, got list"):
        DevicePlan.from_dict(list(good.values()))
    assert DevicePlan.from_dict({**good, "torch_device": None}).torch_device is None


def test_an_implementation_key_is_looked_up_by_one_function():
    for im in IMPLS:
        assert Key.parse(im.bench_key).find(IMPLS) is im and ":".join(im.bench_fields) == im.bench_key
    with pytest.raises(ValueError, match="'ours-torch:jit:fused' is not among the implementations: ours-torch:eager"):
        Key.parse("ours-torch:jit:fused").find(IMPLS)


# ---------------------------------------------------------------- runs_on


def _kinds():
    """Every unit kind: attention kind × every mask kind of the harness and the benchmark × dtype."""
    return list(itertools.product((False, True), MASK_KINDS, DTYPE_NAMES))


def test_the_mask_vocabulary_is_mha_specs_everywhere():
    import mha_spec

    assert MASK_KINDS is mha_spec.MASK_KINDS and set(MASKS) <= set(MASK_KINDS)


# Declarations a user may write beyond the peers': globs inside a part.
USER_PATTERNS = [("*/*/float*",), ("self/[pc]*/*",), ("cross/?one/bfloat16", "self/causal/float1?"), ("*/*/*",)]


@pytest.mark.parametrize("patterns", [im.runs_on for im in BUILTIN if im.runs_on] + USER_PATTERNS, ids=str)
def test_parsed_runs_on_admits_exactly_what_fnmatch_over_the_kind_admits(patterns):
    impl = Implementation("mine", "torch", "m:f", runs_on=patterns)
    assert impl.runs_on_rules and all(isinstance(r, RunsOn) for r in impl.runs_on_rules)
    for cross, mask, dtype in _kinds():
        expected = any(fnmatch.fnmatchcase(unit_kind(cross, mask, dtype), p) for p in patterns)
        assert impl.runs_unit(cross, mask, dtype) is expected, (patterns, cross, mask, dtype)
        assert impl.runs(unit_kind(cross, mask, dtype)) is expected


def test_every_builtin_parses_its_runs_on_once_and_asks_no_fnmatch_later(monkeypatch):
    declared = [im for im in BUILTIN if im.runs_on]
    assert len(declared) >= 5  # the framework peers, HF, keras, equinox, the grouped baselines
    expected = {(im.name, k): any(fnmatch.fnmatchcase(unit_kind(*k), p) for p in im.runs_on)
                for im in declared for k in _kinds()}

    def no_fnmatch(*args):
        raise AssertionError("runs_on is matched by fnmatch after construction")

    monkeypatch.setattr(implementation_mod.fnmatch, "fnmatchcase", no_fnmatch)
    skipped_by_runs_on = 0
    for im in declared:
        for cross, mask, dtype in _kinds():
            admitted = expected[(im.name, (cross, mask, dtype))]
            assert im.runs_unit(cross, mask, dtype) is admitted
            why = im.unsupported(dtype, cross=cross, mask=mask)
            # Another declaration (dtypes, inputs, requires) may skip the unit too; runs_on's own skip
            # comes exactly where fnmatch would not admit it, and a unit that runs is one it admits.
            if why is not None and "runs_on" in why:
                skipped_by_runs_on += 1
                assert not admitted
            if why is None:
                assert admitted
    assert skipped_by_runs_on > 0
    assert all(im.runs_on_rules is None for im in BUILTIN if not im.runs_on)


@pytest.mark.parametrize("pattern, part", [
    ("self/causl/*", "mask 'causl'"),
    ("both/*/*", "inputs 'both'"),
    ("*/*/float8", "dtype 'float8'"),
    ("*/*/int*", "dtype 'int*'"),
])
def test_a_bad_runs_on_pattern_is_an_error_at_construction_naming_it(pattern, part):
    with pytest.raises(ValueError) as e:
        Implementation("my-layer", "jax", "m:f", runs_on=("self/none/*", pattern))
    assert "'my-layer'" in str(e.value) and repr(pattern) in str(e.value) and part in str(e.value)


def test_runs_on_keeps_its_declared_spelling_and_replace_parses_it_again():
    impl = Implementation("mine", "torch", "m:f", runs_on=("self/causal/*", "*/*/float*"))
    assert impl.runs_on == ("self/causal/*", "*/*/float*")  # what users and skip messages read
    assert impl.runs_on_rules == (RunsOn("self", "causal", "*"), RunsOn("*", "*", "float64"),
                                  RunsOn("*", "*", "float32"), RunsOn("*", "*", "float16"))
    assert "self/causal/*, */*/float*" in impl.unsupported("bfloat16", cross=True, mask="none")
    assert dataclasses.replace(impl, runs_on=("cross/*/*",)).runs_on_rules == (RunsOn("cross", "*", "*"),)
    assert dataclasses.replace(impl, runs_on=None).runs_on_rules is None
    assert impl == dataclasses.replace(impl) and hash(impl) == hash(dataclasses.replace(impl))
    with pytest.raises(ValueError, match="RunsOn mask 'causl'"):
        RunsOn("self", "causl", "*")
    with pytest.raises(ValueError, match="unit kind 'self/causal'"):
        impl.runs("self/causal")
