"""mha-bench with a real worker: Ctrl-C (a planted user implementation through --impl runs in
test_bench_cli's shared real sweep).

A torch-only selection keeps the worker's start-up to the torch import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

TINY = ["--seq", "16", "--batch", "1", "--embed", "12", "--heads", "3", "--passes", "fwd", "--budget", "0.01",
        "--min-repeats", "2", "--peak-sizes", "64", "--no-progress", "--threads", "1"]


def _scratch_dirs() -> set[str]:
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n.startswith("mha-bench-")}


def test_ctrl_c_ends_the_worker_writes_the_partial_report_and_exits_130(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C does. The worker ignores it, so the
    parent must end the worker itself: what SIGINT to the parent alone needs too (a worker left
    running fails the assertions below either way)."""
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
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
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
