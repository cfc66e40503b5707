"""The sharded check's command lines: stopping, time limits, argument checks, clean-up.

The first two tests start real worker groups (torch gloo ranks and a JAX process over 2
devices, the dp sharding only); the others check arguments and run nothing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from parity import cli
from parity.bench import sharded_cli
from parity.harness.sharded import MASK_POLICIES, PROBLEMS
from parity.harness.sharded.cases import jobs
from parity.harness.sharded.launch import run_sharded

ROOT = Path(__file__).resolve().parents[1]
ROWS_PER_JOB = 6  # (output, d_inputs, d_params) x (oracle, one-device)


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (the workers name their spec file)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_between_jobs_and_leaves_nothing_behind(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole foreground process group) once the workers have
    finished a job: exit 130, a report of whole jobs only (no error rows from killed workers),
    no worker process and no scratch directory left."""
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "parity", "--device", "cpu", "--no-progress", "--quick", "--checks", "sharded",
            "--devices", "2", "--shardings", "dp", "--dtypes", "float64", "--json", str(report)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(p.stat().st_size for p in tmp_path.glob("sharded-*/rows.jsonl")):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no sharded job finished within 240 s"
            time.sleep(0.1)
        workers = _processes_mentioning(str(tmp_path))
        assert workers  # the worker groups are running
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    data = json.loads(report.read_text())
    assert data["summary"]["interrupted"] is True
    sharded = [r for r in data["rows"] if r["check"] == "sharded"]
    every_job = 2 * len(PROBLEMS) * len(MASK_POLICIES) * ROWS_PER_JOB  # 2 frameworks x every layer, mask kind and policy
    assert 0 < len(sharded) < every_job and len(sharded) % ROWS_PER_JOB == 0, len(sharded)
    assert all(r["status"] == "pass" for r in sharded), [r["message"][:200] for r in sharded if r["status"] != "pass"]
    assert not list(tmp_path.glob("sharded-*"))
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not _processes_mentioning(str(tmp_path))


def test_a_group_that_finishes_no_job_within_the_job_timeout_is_killed(tmp_path, monkeypatch, capsys):
    """--job-timeout reaches the launcher: 0.5 s is shorter than any job's start-up, so every job
    of both groups becomes an error row that names the limit, and nothing is left behind."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = tmp_path / "r.json"
    code = cli.main(["--device", "cpu", "--no-progress", "--quick", "--checks", "sharded", "--devices", "2",
                     "--shardings", "dp", "--dtypes", "float64", "--job-timeout", "0.5", "--json", str(report)])
    assert code == 1, capsys.readouterr().out[-2000:]
    sharded = [r for r in json.loads(report.read_text())["rows"] if r["check"] == "sharded"]
    assert {r["impl"] for r in sharded} == {"torch-dp", "jax-dp"}
    assert len(sharded) == 2 * len(PROBLEMS) * len(MASK_POLICIES)  # one error row per unfinished job
    assert all(r["status"] == "error" and "job timeout of 0.5 s" in r["message"] for r in sharded)
    assert not list(tmp_path.glob("sharded-*"))
    assert not _processes_mentioning(str(tmp_path))


@pytest.mark.parametrize("argv", [
    ("--devices", "2", "--shardings", ""),  # an empty selection is not "every sharding"
    ("--devices", "2", "--job-timeout", "0"),
    ("--job-timeout", "5"),  # the limit applies to the sharded workers only
])
def test_sharded_arguments_of_mha_parity_are_usage_errors(argv):
    try:
        code = cli.main(["--device", "cpu", "--no-progress", "--quick", *argv])
    except SystemExit as e:  # argparse's own usage error
        code = e.code
    assert code == 2


def test_a_repeated_sharding_framework_or_dtype_runs_once():
    once = jobs(devices=2, shardings=("tp", "dp"), frameworks=("torch",), dtypes=("float64",))
    assert jobs(devices=2, shardings=("tp", "dp", "tp"), frameworks=("torch", "torch"), dtypes=("float64", "float64")) == once
    # 3 devices split no layer's heads: skip rows, one per job, without launching anything
    rows = run_sharded(devices=3, shardings=("tp", "tp"), frameworks=("torch",), dtypes=("float64",), layers=("classic", "classic"))
    assert len(rows) == len({(r.case, r.impl, r.dtype) for r in rows}) == len(MASK_POLICIES)


def _bench(*argv):
    console = Console(file=io.StringIO(), width=200)
    try:
        code = sharded_cli.main(list(argv), console)  # what `mha-bench sharded ARGV` runs
    except SystemExit as e:
        code = e.code
    return code, console.file.getvalue()


@pytest.mark.parametrize("argv, says", [
    (("--heads", "0"), "positive integer"),
    (("--seq", "0"), "positive integer"),
    (("--repeats", "0"), "positive integer"),
    (("--shardings", ""), ""),
    (("--job-timeout", "-1"), ""),
    (("--json", "same.out", "--markdown", "same.out"), "different files"),
    (("--seq", "64", "--shards", "3", "--shardings", "sp", "--frameworks", "torch"), "T=64 is not divisible by 3"),
    (("--heads", "4", "--embed", "32", "--shards", "3", "--shardings", "tp"), "N=4 is not divisible by 3"),
])
def test_mha_bench_sharded_usage_errors_start_nothing(argv, says, monkeypatch, tmp_path, capsys):
    from parity.bench import sharded as bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "_run", lambda *a: pytest.fail("a measurement started"))
    code, out = _bench(*argv)
    assert code == 2
    assert says in out + capsys.readouterr().err
    assert not (tmp_path / "same.out").exists()


def _fake_run(calls, interrupt_at=None):
    def run(framework, cfg, timeout_s):
        calls.append((framework, cfg["layouts"][0], cfg["devices"]))
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return [{"framework": framework, "layout": cfg["layouts"][0], "devices": cfg["devices"],
                 "per_device_peak_bytes": 2**20 * 8 // cfg["devices"], "mem_source": "fake", "time_s": 0.01}]

    return run


def test_mha_bench_sharded_measures_a_repeated_selection_once(monkeypatch, tmp_path):
    from parity.bench import sharded as bench

    calls = []
    monkeypatch.setattr(bench, "_run", _fake_run(calls))
    code, _ = _bench("--shards", "1,2,2", "--shardings", "sp,sp", "--frameworks", "jax,jax", "--json", str(tmp_path / "r.json"))
    assert code == 0
    assert calls == [("jax", "sp", 1), ("jax", "sp", 2)]


def test_mha_bench_sharded_ctrl_c_writes_what_finished_and_exits_130(monkeypatch, tmp_path):
    from parity.bench import sharded as bench

    calls = []
    monkeypatch.setattr(bench, "_run", _fake_run(calls, interrupt_at=2))
    out = tmp_path / "r.json"
    code, text = _bench("--shards", "1,2", "--shardings", "sp", "--frameworks", "jax", "--json", str(out))
    assert code == 130, text
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    assert [(r["layout"], r["devices"]) for r in data["rows"]] == [("sp", 1)]
