"""mha-bench with real workers: a planted user implementation through --impl, and Ctrl-C.

Torch-only selections keep each worker's start-up to the torch import."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from rich.console import Console

from parity.bench import cli

TINY = ["--seq", "16", "--batch", "1", "--embed", "12", "--heads", "3", "--passes", "fwd", "--budget", "0.01",
        "--min-repeats", "2", "--peak-sizes", "64", "--no-progress", "--threads", "1"]

PLANTED = '''
from parity.impls import Implementation, builtin

_base = builtin("torch-fused")


def _wrapped(name, change):
    def factory(sd, num_heads, **kw):
        fn = _base.resolve_factory()(sd, num_heads, **kw)

        def call(params, q, k, v, mask):
            out = fn(params, q, k, v, mask)
            out = out[0] if isinstance(out, (tuple, list)) else out
            return change(out)

        return call

    return Implementation(name, "torch", factory, "eager", False, masked_rows=None, role="user")


same = _wrapped("same", lambda out: out)
negated = _wrapped("negated", lambda out: -out)
time_reversed = _wrapped("time-reversed", lambda out: out.flip(1))
'''


def test_a_planted_wrong_output_through_impl_is_an_error_row_and_exit_1(tmp_path, monkeypatch):
    (tmp_path / "bench_planted.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the worker imports it too
    out = tmp_path / "b.json"
    console = Console(file=io.StringIO(), width=200)
    rc = cli.main([*TINY, "--impls", "ours-torch:eager:fused", "--impl", "bench_planted:same",
                   "--impl", "bench_planted:negated", "--impl", "bench_planted:time_reversed", "--json", str(out)],
                  console=console)
    text = console.file.getvalue()
    assert rc == 1, text
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ours-torch"]["status"] in ("ok", "noisy")
    assert rows["same"]["status"] in ("ok", "noisy") and rows["same"]["out_max_diff"] == 0.0  # no false red
    for name in ("negated", "time-reversed"):
        assert rows[name]["status"] == "error", rows[name]
        assert rows[name]["message"].startswith("not the same computation as ours-torch:eager:fused")
        assert rows[name]["median_s"] > 0  # measured, kept, rejected
    assert "2 item(s) failed" in text


def _scratch_dirs() -> set[str]:
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n.startswith("mha-bench-")}


@pytest.mark.parametrize("group", [False, True], ids=["parent", "process-group"])
def test_ctrl_c_ends_the_worker_writes_the_partial_report_and_exits_130(tmp_path, group):
    """SIGINT to the parent alone, or to the whole process group as a terminal's Ctrl-C does."""
    before = _scratch_dirs()
    out = tmp_path / "partial.json"
    # The item never finishes in the test's time (its repeats and budget are far off): Ctrl-C comes mid-timing.
    argv = [*TINY, "--budget", "600", "--min-repeats", "100000", "--impls", "ours-torch:eager:fused", "--json", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "parity.bench", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    parent = psutil.Process(proc.pid)
    worker = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (worker and _timing(worker)):
        kids = parent.children()
        worker = kids[0] if kids else None
        time.sleep(0.2)
    assert worker is not None and _timing(worker), "the worker did not start timing"
    time.sleep(1.0)
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert "interrupted" in stdout + stderr
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert _scratch_dirs() - before == set()  # no scratch directory or spec file left behind
    rows = json.loads(out.read_text())["rows"]
    assert [r["message"] for r in rows] == ["not measured: interrupted (Ctrl-C)"]


def _timing(worker) -> bool:
    """The worker is past its start-up: it uses CPU (timing calls)."""
    try:
        return worker.cpu_times().user > 2.0
    except psutil.Error:
        return False
