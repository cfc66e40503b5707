"""The tune CLIs (`python -m mha_jax.tune`, `mha-bench tune`): bad input is a usage error (exit 2)
before anything is measured, both outputs are tried first, nothing is left behind, and a file
that cannot be written after the run is exit 3 with the table left as it was.

The measurement is replaced by a fake (no timing here); `tests/test_bench_tune.py` and
`tests/test_kernel_table.py` run a tiny real one."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from mha_jax import tune
from parity.bench import cli

TINY = ["--sizes", "1x2x8x4", "--blocks", "8x8", "--passes", "fwd", "--min-repeats", "1"]


def _python_m(argv) -> int:
    return tune.main(argv)


def _mha_bench(argv) -> int:
    return cli.main(["tune", *argv], console=Console(file=io.StringIO(), width=200))


CLIS = pytest.mark.parametrize("tool", [_python_m, _mha_bench], ids=["python-m", "mha-bench"])


@pytest.fixture
def measured(monkeypatch):
    """tune.measure_size faked: the sizes it was asked for, with einsum the fastest at every pass."""
    calls = []

    def fake(B, N, T, H, blocks, passes, reps, dtype, budget_s, log=print, K=None):
        calls.append((B, N, T, H) if K is None else (B, N, T, H, K))
        cq, ck = (min(b, T) for b in blocks[0][:2])
        return [dict(B=B, N=N, T=T, S=T, H=H, pass_=p, candidate=c, min_s=t, median_s=t, reps=reps)
                for p in passes for c, t in (("einsum", 1e-3), (f"chunked:{cq}x{ck}", 2e-3))]

    monkeypatch.setattr(tune, "measure_size", fake)
    return calls


def _usage_error(tool, argv, capsys) -> str:
    """The one error line of a run that must exit 2."""
    with pytest.raises(SystemExit) as e:
        tool(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@CLIS
@pytest.mark.parametrize("argv, message", [
    (["--dtype", "nope"], "argument --dtype: expected one of float64, float32, bfloat16, float16, got 'nope'"),
    (["--dtype", "int32"], "argument --dtype"),
    (["--budget", "nan"], "argument --budget"), (["--budget", "inf"], "argument --budget"),
    (["--budget", "-1"], "argument --budget"),
    (["--min-repeats", "0"], "argument --min-repeats"), (["--min-repeats", "two"], "argument --min-repeats"),
    (["--sizes", "4x8"], "argument --sizes"), (["--sizes", "1x2x0x4"], "argument --sizes"),
    (["--blocks", "8"], "argument --blocks"), (["--blocks", "0x8"], "argument --blocks"),
    (["--blocks", "16384x16384"], "blocks are at most 8192 (the kernel table's bound)"),
    (["--passes", ""], "argument --passes"), (["--passes", "fwd,bwd"], "argument --passes"),
    (["--kv-heads", "0"], "argument --kv-heads"),
    (["--sizes", "1x2x8x4,1x3x8x4", "--kv-heads", "2"], "--kv-heads 2 must divide every size's N, not 3"),
])
def test_bad_arguments_are_usage_errors_before_measuring(tool, argv, message, measured, tmp_path, capsys):
    line = _usage_error(tool, [*TINY, "--out", str(tmp_path / "t.json"), *argv], capsys)
    assert message in line and not measured and not (tmp_path / "t.json").exists()


@CLIS
def test_combine_names_the_file_it_cannot_use(tool, tmp_path, capsys):
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "table.json").write_text(json.dumps({"schema": 1, "processors": {}}))
    (tmp_path / "bad-row.json").write_text(json.dumps({"rows": [{"B": 1, "N": 2, "T": 8, "S": 8, "pass_": "fwd"}]}))
    for name, why in (("absent.json", "no such file"), ("text.json", "not valid JSON"),
                      ("table.json", "not a tune run"), ("bad-row.json", "row 0 is not a tune row")):
        line = _usage_error(tool, ["--combine", str(tmp_path / name), "--out", str(tmp_path / "t.json")], capsys)
        assert f"--combine: {tmp_path / name}: {why}" in line


@CLIS
def test_unwritable_outputs_are_refused_before_measuring_and_leave_nothing(tool, measured, tmp_path, capsys):
    table = tmp_path / "table.json"
    table.write_text("the table before")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "dir").mkdir()
    for argv, message in (
        (["--out", str(tmp_path / "dir")], f"--out {tmp_path / 'dir'}: cannot write there: is a directory"),
        (["--out", str(table), "--json", str(tmp_path / "a-file" / "run.json")], "is not a directory"),
        (["--out", str(table), "--json", str(tmp_path / "." / "table.json")], "is the kernel table (--out)"),
    ):
        assert message in _usage_error(tool, [*TINY, *argv], capsys)
    assert not measured and table.read_text() == "the table before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dir", "table.json"]  # no temporary file
    assert list((tmp_path / "dir").iterdir()) == []


@CLIS
def test_json_into_a_missing_directory_is_created(tool, measured, tmp_path):
    run = tmp_path / "runs" / "today" / "run.json"
    assert tool([*TINY, "--out", str(tmp_path / "table.json"), "--json", str(run)]) == 0
    assert measured == [(1, 2, 8, 4)]
    assert [r["candidate"] for r in json.loads(run.read_text())["rows"]] == ["einsum", "chunked:8x8"]
    (entry,) = json.loads((tmp_path / "table.json").read_text())["processors"].values()
    assert entry["rows"][0]["fastest"] == "einsum"


@CLIS
def test_a_json_that_cannot_be_written_after_the_run_leaves_the_table_as_it_was(tool, measured, tmp_path, capsys):
    from test_report_paths import full_device

    full = full_device(tmp_path / "full")
    table = tmp_path / "table.json"
    table.write_text("the table before")
    assert tool([*TINY, "--out", str(table), "--json", str(full)]) == 3
    assert f"error: could not write {full}: No space left on device" in capsys.readouterr().err
    assert measured and table.read_text() == "the table before"
