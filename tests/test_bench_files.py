"""Saved mha-bench files: whatever `compare` and `report` read from a row, a verdict or the
environment is validated on load, so a corrupt field is one line naming the file and the row,
exit 2, never a traceback (docs/benchmark.md, "Input is validated")."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from parity.bench import cli, report
from parity.bench.records import Key
from parity.bench.spec import STATUSES, case_label


NUMBERS = ("median_s", "iqr_s", "ratio", "gflops", "peak_fraction", "compile_s", "recompile_s", "peak_mem_bytes",
           "out_max_diff")


def _valid() -> tuple[list[dict], dict, list[dict]]:
    """Rows of one case (ok, noisy, error with its numbers kept, skip), the environment of a real
    run (tests/data/bench-cpu.json) and one verdict: what the writer saves, every status present."""
    data = json.loads(Path("tests/data/bench-cpu.json").read_text())
    ok, noisy, error, skip = (dict(r) for r in data["rows"][:4])
    noisy.update(status="noisy", iqr_s=0.4 * noisy["median_s"], message="noisy: IQR/median 40%")
    error.update(status="error", message="error: output differs from the reference's")
    skip.update(dict.fromkeys(NUMBERS), status="skip", message="skip: float16 on a CPU")
    verdict = {"case": case_label(ok), "pass": ok["pass"], "faster": str(Key.of_row(ok)), "slower": str(Key.of_row(noisy)),
               "ratio": 1.4, "ci": [1.3, 1.5], "conclusive": False, "repeats": 8}
    return [ok, noisy, error, skip], data["environment"], [verdict]


def _write(path: Path, rows, env, vs) -> str:
    report.write_json(str(path), rows, env, vs)  # the code's own writer: schema mha-bench/2
    return str(path)


def _row(i, **fields):
    return lambda data: data["rows"][i].update(fields)


def _without(i, name):
    return lambda data: data["rows"][i].pop(name)


def _verdict(**fields):
    return lambda data: data["verdicts"][0].update(fields)


def _env(**fields):
    return lambda data: data["environment"].update(fields)


# (mutation, what the message must name besides the file). Rows: 0 ok, 1 noisy, 2 error, 3 skip.
CORRUPT = {
    "noisy median_s null": (_row(1, median_s=None), "row 1 (", "median_s = None"),
    "noisy iqr_s null": (_row(1, iqr_s=None), "row 1 (", "iqr_s = None"),
    "no ratio": (_without(0, "ratio"), "row 0 (", "missing field(s) ratio"),
    "no compile_s": (_without(2, "compile_s"), "row 2 (", "missing field(s) compile_s"),
    "no status": (_without(1, "status"), "row 1 (", "missing field(s) status"),
    "gflops 'x'": (_row(0, gflops="x"), "row 0 (", "gflops = 'x'"),
    "gflops NaN": (_row(0, gflops=math.nan), "row 0 (", "gflops = nan"),
    "peak_fraction inf": (_row(1, peak_fraction=math.inf), "row 1 (", "peak_fraction = inf"),
    "compile_s NaN": (_row(2, compile_s=math.nan), "row 2 (", "compile_s = nan"),
    "compile_s true": (_row(0, compile_s=True), "row 0 (", "compile_s = True"),
    "recompile_s a string": (_row(0, recompile_s="1 s"), "row 0 (", "recompile_s = '1 s'"),
    "ratio negative": (_row(2, ratio=-1.0), "row 2 (", "ratio = -1.0"),
    "peak_mem_bytes 10**400": (_row(0, peak_mem_bytes=10**400), "row 0 (", "peak_mem_bytes = an integer of 401 digits"),
    "out_max_diff a list": (_row(0, out_max_diff=[1]), "row 0 (", "out_max_diff = [1]"),
    "skip median_s 'x'": (_row(3, median_s="x"), "row 3 (", "median_s = 'x'"),
    "message a number": (_row(3, message=5), "row 3 (", "message = 5"),
    "message a list": (_row(3, message=["skip"]), "row 3 (", "message = ['skip']"),
    "kernel a number": (_row(0, kernel=7), "row 0 (", "kernel = 7"),
    "verdict case a list": (_verdict(case=["B=4"]), "verdict 0", "case = ['B=4']"),
    "verdict ci NaN": (_verdict(ci=[math.nan, 1.5]), "verdict 0", "ci [nan, 1.5]"),
    "verdict ci 10**400": (_verdict(ci=[1.3, 10**400]), "verdict 0", "ci [1.3, 1000"),
    "verdict ci reversed": (_verdict(ci=[1.5, 1.3]), "verdict 0", "ci [1.5, 1.3]"),
    "verdict ratio below 1": (_verdict(ratio=0.5), "verdict 0", "ratio 0.5"),
    "verdict repeats negative": (_verdict(repeats=-1), "verdict 0", "repeats -1"),
    "peaks gflops 'x'": (_env(peaks=[{"dtype": "float32", "gflops": "x"}]), "'environment'", "gflops = 'x'"),
    "versions null": (_env(versions=None), "'environment'", "versions"),
    "interference a number": (_env(interference=5), "'environment'", "interference"),
    "peak_measurements of numbers": (_env(peak_measurements=[5]), "'environment'", "peak_measurements"),
}


def _console():
    return Console(file=io.StringIO(), width=200)


@pytest.mark.parametrize("what", CORRUPT)
def test_compare_and_report_reject_a_corrupt_field_in_one_line_naming_file_and_row(what, tmp_path):
    mutate, where, message = CORRUPT[what]
    good = _write(tmp_path / "good.json", *_valid())
    data = json.loads(Path(good).read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    for argv in (["report", str(bad), "--markdown", str(tmp_path / "out.md")], ["compare", good, str(bad)],
                 ["compare", str(bad), good]):
        console = _console()
        assert cli.main(argv, console=console) == 2, (argv, console.file.getvalue())
        text = console.file.getvalue()
        assert text.count("\n") == 1 and "Traceback" not in text, text
        assert f"{bad}: {where}" in text and message in text, text
    assert not (tmp_path / "out.md").exists()


def test_a_valid_file_of_every_status_compares_and_rerenders(tmp_path):
    rows, env, vs = _valid()
    good = _write(tmp_path / "good.json", rows, env, vs)
    console = _console()
    assert cli.main(["report", good, "--markdown", str(tmp_path / "out.md")], console=console) == 0, console.file.getvalue()
    md = (tmp_path / "out.md").read_text()
    assert "× (error)" in md and "| noisy: IQR/median 40% |" in md and "skip: float16 on a CPU" in md
    console = _console()
    assert cli.main(["compare", good, good], console=console) == 0, console.file.getvalue()
    assert "2 row(s) compared: 0 regression(s), 1 noisy" in console.file.getvalue()


# Values that break a reader somewhere when it meets them in the wrong field.
BAD_VALUES = (None, "x", math.nan, math.inf, -1, 0, 10**400, True, [], {})
ENV_READ = ("device", "cpu_model", "threads", "precision", "preset", "versions", "python", "peaks", "peak_measurements",
            "loadavg_start", "loadavg_end", "cpu_count", "flops_formula", "thread_settings", "interference")


def _mutations(good: dict):
    """(mutate, group, what) for every field a reader touches: each row's fields (and each status),
    each verdict field, the environment's fields, a peak's fields and the environment itself.
    Mutations of one group (one row or object, one value) can be applied together."""
    row_fields = [k for k in good["rows"][0] if k not in ("framework", "device", "min_s", "repeats", "peak_gflops",
                                                          "mem_source")]
    targets = [(f"row {i}", lambda d, i=i: d["rows"][i], row_fields) for i in range(len(good["rows"]))]
    targets += [("verdict 0", lambda d: d["verdicts"][0], list(good["verdicts"][0])),
                ("environment", lambda d: d["environment"], ENV_READ),
                ("peak 0", lambda d: d["environment"]["peaks"][0], ("dtype", "gflops"))]
    for name, get, fields in targets:
        for k in fields:
            for v in BAD_VALUES:
                yield (lambda d, get=get, k=k, v=v: get(d).__setitem__(k, v)), f"{name} {v!r:.20}", f"{name} {k}={v!r:.20}"
    for i in range(len(good["rows"])):
        for status in STATUSES:
            what = f"row {i} status {status}"
            yield (lambda d, i=i, s=status: d["rows"][i].__setitem__("status", s)), what, what
    for v in BAD_VALUES:
        yield (lambda d, v=v: d.__setitem__("environment", v)), f"environment={v!r:.20}", f"environment={v!r:.20}"


def _read_everything(good: dict, data: dict, group: str) -> None:
    """Every reader of what `group` changed: the verdicts and the environment reach only the
    verdict lines and the Markdown (and compare's note), a row every reader."""
    console = _console()
    report.markdown(data["rows"], data.get("environment", {}), data.get("verdicts", []))
    report.print_verdicts(data.get("verdicts", []), data["rows"], console)
    for base, new in ((good, data), (data, good)):
        report.environment_differences(base, new)
    if group.startswith("row"):
        report.print_table(data["rows"], console)
        report.print_compare(report.compare(good, data), 0.1, console)  # shows data's medians and messages
        report.compare(data, good)  # data as the base: its noise rule and statuses


def test_a_file_either_fails_to_load_or_every_reader_works():
    """Each field a reader touches set to each bad value: validation refuses it (BenchFileError, one
    line), or the console table, the verdicts, the Markdown and compare (either way round) all run.
    The accepted mutations of one group are read together: one render per group keeps this fast."""
    rows, env, vs = _valid()
    good = report.to_json(rows, {k: env[k] for k in ENV_READ if k in env}, vs)  # what the readers read
    report.validate(good, "good.json")
    groups: dict = {}
    for mutate, group, what in _mutations(good):
        data = json.loads(json.dumps(good))
        mutate(data)
        try:
            report.validate(data, "bad.json")
        except report.BenchFileError as e:
            assert "\n" not in str(e) and str(e).startswith("bad.json: "), (what, str(e))
            continue
        groups.setdefault(group, []).append((mutate, what))
    assert sum(map(len, groups.values())) > 50  # the nulls, flags and strings that are valid values still load
    for group, members in groups.items():
        data = json.loads(json.dumps(good))
        for mutate, _ in members:
            mutate(data)
        report.validate(data, "bad.json")  # what passes one at a time passes together
        try:
            _read_everything(good, data, group)
        except Exception as e:  # noqa: BLE001 - the point: name the fields that got through
            pytest.fail(f"{[w for _, w in members]} passed validation and then {type(e).__name__}: {e}")
