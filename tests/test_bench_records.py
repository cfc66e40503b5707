"""The benchmark's typed records (`parity.bench.records`) and the kernel label value (`mha_spec.Kernel`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mha_spec import Kernel
from parity.bench import report
from parity.bench.records import (
    MATCH_KEY, ROW_FIELDS, VERDICT_FIELDS, Case, Key, Row, Verdict, empty_row, merge_rows,
)
from parity.bench.spec import IMPLS

RESULTS = sorted(p for p in Path("docs/results").glob("bench-*.json")
                 if json.loads(p.read_text()).get("schema", "").startswith("mha-bench/"))
LABEL_FIELDS = ("kernel", "candidate", "chosen", "best")


def _labels(node, out: set) -> set:
    """Every string under a key that holds a kernel label, anywhere in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in LABEL_FIELDS and isinstance(v, str):
                out.add(v)
            _labels(v, out)
    elif isinstance(node, list):
        for v in node:
            _labels(v, out)
    return out


def test_the_saved_runs_are_found():
    assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_saved_run_reads_into_rows_and_writes_back_the_same(path):
    data = report.load(str(path))
    for raw in data["rows"]:
        row = Row.from_json(raw)
        assert row.to_json() == {k: raw.get(k) for k in ROW_FIELDS}  # a field a file lacks is written null
        assert Row.from_json(row.to_json()) == row
        assert str(row.key) == f"{raw['impl']}:{raw['mode']}:{'weights' if raw['need_weights'] else 'fused'}"
    for raw in data.get("verdicts", []):
        v = Verdict.from_json(raw)
        assert v.to_json() == {k: raw.get(k) for k in VERDICT_FIELDS}
    again = report.to_json(data["rows"], data.get("environment", {}), data.get("verdicts", []))
    assert [Row.of(r) for r in again["rows"]] == [Row.of(r) for r in data["rows"]]


def test_every_kernel_label_saved_or_tested_prints_back_as_it_was():
    labels: set = set()
    for path in [*Path("docs/results").glob("*.json"), *Path("tests/data").glob("*.json")]:
        try:
            _labels(json.loads(path.read_text()), labels)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
    labels |= {"chunked:2048x512/h1", "pallas-gpu-flash (interpret, built-in)", "sdpa:flash+math", "einsum (weights)"}
    assert len(labels) > 20
    for label in labels:
        assert str(Kernel.parse(label)) == label


def test_a_kernel_label_reads_into_its_parts():
    assert Kernel.parse("chunked:2048x512/h1 (built-in)") == Kernel("chunked", (2048, 512), 1, "built-in")
    assert Kernel.parse("pallas-gpu-flash (interpret, user table)") == Kernel("pallas-gpu-flash", source="user table",
                                                                             interpret=True)
    assert Kernel.parse("sdpa:flash") == Kernel("sdpa:flash")  # a backend, not blocks: part of the name
    assert Kernel.parse("chunked:0512x512").blocks is None  # not as `str` writes blocks
    with pytest.raises(ValueError, match="head_chunk"):
        Kernel("chunked", None, 2)
    with pytest.raises(TypeError):
        Kernel.parse(5)


def test_an_implementation_key_reads_back_and_finds_its_implementation():
    for im in IMPLS:
        key = Key.of(im)
        assert Key.parse(str(key)) == key and key.find(IMPLS) is im and str(key) == im.bench_key
    for bad in ("ours-torch", "ours-torch:eager:both", "::fused", 3):
        with pytest.raises(ValueError, match="not an implementation key"):
            Key.parse(bad)


def test_a_case_round_trips_through_its_json():
    case = Case.of(2, 8, 16, 16, 4, "bfloat16", kv_heads=2, rope="half", bias="qkv", mask="causal")
    assert Case.from_json(json.loads(json.dumps(case.to_json()))) == case
    with pytest.raises(TypeError, match="JSON object"):
        Case.from_json([2, 8])


def _row(**kw) -> dict:
    im = Key.parse("ours-torch:eager:fused").find(IMPLS)
    return empty_row(im, Case.of(1, 16, 16, 32, 2, "float32"), "fwd", status="ok", median_s=1e-3, iqr_s=1e-5, **kw)


@pytest.mark.parametrize("field, value", [
    ("batch", 0), ("need_weights", "yes"), ("mask", "window"), ("status", "fine"), ("median_s", -1.0),
    ("ratio", float("nan")), ("kernel", 3), ("rounds", 0), ("mask_path", "causal"), ("param_grads", 1),
    ("process_medians_s", [1.0, -2.0]),
])
def test_a_bad_row_field_is_named(field, value):
    assert Row.problem(_row()) is None
    with pytest.raises(ValueError, match=field):
        Row.from_json({**_row(), field: value})


def test_a_row_missing_a_field_names_it():
    for name in ("impl", "status", "median_s"):
        data = {k: v for k, v in _row().items() if k != name}
        with pytest.raises(ValueError, match=f"missing field\\(s\\) {name}"):
            Row.from_json(data)
    assert MATCH_KEY[:3] == ("impl", "mode", "pass")


def test_a_bad_verdict_field_is_named():
    good = {"case": "c", "pass": "fwd", "faster": "a:b:fused", "slower": "c:d:fused", "ratio": 1.5, "ci": [1.2, 1.8],
            "conclusive": True, "repeats": 8}
    assert Verdict.from_json(good).to_json()["ci"] == [1.2, 1.8]
    for field, value in (("faster", None), ("ratio", 0.5), ("rounds", -1), ("note", 3)):
        with pytest.raises(ValueError, match=field):
            Verdict.from_json({**good, field: value})


def test_rows_of_several_worker_processes_merge_into_one():
    a, b = _row(samples=[[1.0, 1.2]], compile_s=2.0), _row(samples=[[1.1], [1.3]], compile_s=4.0)
    merged = merge_rows([a, b])
    assert merged["processes"] == 2 and merged["rounds"] == 3 and merged["repeats"] == 4
    assert merged["compile_s"] == 3.0 and merged["samples"] == [a["samples"], b["samples"]]
    failed = merge_rows([a, {**b, "status": "error", "message": "boom"}])
    assert failed["status"] == "error" and failed["message"] == "boom (worker process 2 of 2)"
