"""Worker process groups: how a launcher starts, watches and stops them, and how they report.

The launcher side: `Group` starts worker processes together (each in a session of its own, with
a scratch directory and a spec file), `wait` watches groups until they end, killing a group that
makes no progress for a time limit and asking every group to stop between jobs on request;
`worker_env` and `free_port` build the workers' environment. The sharded check
(`parity.harness.sharded`) and its benchmark (`parity.bench.sharded`) both run on it.

The worker side: the launcher gives each group a scratch directory and sets two environment
variables:

- STOP_ENV: a path. A worker asks `stop_requested()` between jobs; once the file exists it
  runs no further job (every rank of a group agrees first, so none is left in a collective).
- PARENT_ENV: the launcher's pid. `follow_parent()` makes the worker die with it (Linux:
  PR_SET_PDEATHSIG), so no worker outlives a launcher that was killed outright.

The process that judges (rank 0) appends one JSON line per finished job to the group's row
stream (`append_rows`): an interrupted or timed-out group keeps the rows of the jobs it
finished, and each new line tells the launcher the group is still making progress.

A worker started by hand (torchrun, or `python -m parity.harness.sharded.jax_worker`) has
neither variable: it cannot be asked to stop and keeps its default signal handling.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STOP_ENV = "PARITY_WORKERS_STOP_FILE"
PARENT_ENV = "PARITY_WORKERS_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stoppable() -> bool:
    """Whether this worker was started by the launcher, which may ask it to stop."""
    return bool(os.environ.get(STOP_ENV))


def stop_requested() -> bool:
    """Whether the launcher has asked this worker's group to run no further job."""
    path = os.environ.get(STOP_ENV)
    return bool(path) and os.path.exists(path)


def follow_parent() -> None:
    """End this process when the launcher that started it ends (a no-op when started by hand)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != int(parent):  # the launcher ended before the line above took effect
        os._exit(1)


def append_rows(path: str, run: int, job: int, rows: list[dict]) -> None:
    """Append one finished job's rows to the stream at `path` (one JSON line, flushed)."""
    with open(path, "a") as f:
        f.write(json.dumps({"run": run, "job": job, "rows": rows}) + "\n")
        f.flush()


def read_rows(path: str) -> dict[tuple[int, int], list[dict]]:
    """{(run, job): rows} from a row stream; a last line cut off by a killed writer is ignored."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[(entry["run"], entry["job"])] = entry["rows"]
    return out


# ---------------------------------------------------------------- the launcher side

_POLL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra) -> dict:
    """This process's environment for a worker: one OpenMP thread, unbuffered output, plus `extra` (as strings)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Group:
    """Worker processes started together, their logs and their scratch directory (removed by `close`).

    Each worker runs in a session of its own, so a terminal's Ctrl-C (SIGINT to the foreground
    process group) reaches only the launcher, which asks the group to stop between jobs (a worker
    interrupted inside a collective would leave its peers waiting). `progress` is the file the
    workers write as they finish jobs; a group whose file has not grown for `timeout_s` is killed.
    """

    def __init__(self, prefix: str, spec: dict, commands, progress: str):
        """commands(spec_path, out_path) -> [(argv, env), ...]; the spec is written as JSON first."""
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        self.out_path = os.path.join(self.tmp, progress)
        self.procs, self.logs = [], []
        self.stop_sent, self.timed_out = False, None
        try:
            spec_path = os.path.join(self.tmp, "spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            own = {STOP_ENV: os.path.join(self.tmp, "stop"), PARENT_ENV: str(os.getpid())}
            for argv, env in commands(spec_path, self.out_path):
                self.logs.append(tempfile.TemporaryFile(mode="w+"))  # unlinked: nothing left on disk
                self.procs.append(subprocess.Popen(argv, env={**env, **own}, stdout=self.logs[-1], stderr=subprocess.STDOUT,
                                                   text=True, start_new_session=True))
        except BaseException:
            self.close()
            raise
        self._size, self._progress_at = 0, time.monotonic()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def watch(self, timeout_s: float) -> None:
        """Note progress; kill the group if it made none for timeout_s."""
        size = os.path.getsize(self.out_path) if os.path.exists(self.out_path) else 0
        now = time.monotonic()
        if size != self._size:
            self._size, self._progress_at = size, now
        elif now - self._progress_at > timeout_s and self.running():
            self.timed_out = f"no job finished within the job timeout of {timeout_s:g} s (a rank stuck in a collective?)"
            self.kill()

    def request_stop(self) -> None:
        """Ask the workers to run no further job (they agree on it between jobs)."""
        if not self.stop_sent and os.path.isdir(self.tmp):
            open(os.path.join(self.tmp, "stop"), "w").close()
        self.stop_sent = True

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the worker's own session: it and anything it started
                p.wait()

    def failure(self) -> str | None:
        """None when every worker exited 0 in time; else what went wrong, with each worker's log tail."""
        if not self.timed_out and all(p.returncode == 0 for p in self.procs):
            return None
        tails = []
        for i, (p, log) in enumerate(zip(self.procs, self.logs)):
            log.seek(0)
            tails.append(f"[process {i}, exit {p.returncode}] {log.read()[-2000:]}")
        return "sharded worker failed: " + (f"{self.timed_out}: " if self.timed_out else "") + " | ".join(tails)

    def close(self) -> None:
        """Kill what still runs, drop the logs, remove the scratch directory."""
        self.kill()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def wait(groups, *, timeout_s: float, should_stop=None) -> bool:
    """Wait until every group has ended; returns whether should_stop() asked them to stop.

    should_stop() is polled while they run (a graceful Ctrl-C): once it is true, every group is
    asked to stop after its current job. A group that finishes no job for timeout_s is killed.
    """
    stopping = False
    while any(g.running() for g in groups):
        if not stopping and should_stop is not None and should_stop():
            stopping = True
            for g in groups:
                g.request_stop()
        for g in groups:
            g.watch(timeout_s)
        time.sleep(_POLL_S)
    return stopping
