"""Subprocess launchers for the sharded checks, and `run_sharded`.

JAX fixes its device count when it starts, so its checks run in a subprocess:
either one process with N simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
or P processes joined by jax.distributed.initialize (gloo collectives). torch runs N
processes (one per rank) joined by init_process_group("gloo") on 127.0.0.1, the environment
torchrun would give them. Every process gets OMP_NUM_THREADS=1 and a fresh interpreter
(spawned, never forked).
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

from parity.harness.report import Row
from parity.sharded.control import PARENT_ENV, STOP_ENV, read_rows
from parity.sharded.cases import FRAMEWORKS, LAYOUTS, MASK_POLICIES, SHAPE, Job, error_rows, jobs

DEFAULT_JOB_TIMEOUT_S = 600.0
"""How long a worker group may go without finishing a job before it is killed (a rank stuck in a
collective never returns). The first job of a group also pays for imports and compilation."""
_POLL_S = 0.1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
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

    def __init__(self, prefix: str, spec: dict, commands, progress: str, *, runs=(), device: str = ""):
        """commands(spec_path, out_path) -> [(argv, env), ...]; the spec is written as JSON first.
        runs, device: what the group runs and the device label of its rows (`finish`)."""
        self.runs, self.device = runs, device
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


def wait(groups, *, timeout_s: float = DEFAULT_JOB_TIMEOUT_S, should_stop=None) -> bool:
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


def _jax_commands(spec_path, out_path, devices: int, processes: int):
    argv = [sys.executable, "-m", "parity.sharded.jax_worker", spec_path, out_path]
    if devices % processes:
        raise ValueError(f"{devices} devices do not split over {processes} processes")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices // processes}".strip()
    env = _env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    if processes == 1:
        return [(argv, env)]
    coordinator = f"127.0.0.1:{free_port()}"
    return [(argv + ["--coordinator", coordinator, "--num-processes", str(processes), "--process-id", str(i)], env) for i in range(processes)]


def _torch_commands(spec_path, out_path, devices: int):
    argv = [sys.executable, "-m", "parity.sharded.torch_worker", spec_path, out_path]
    port = free_port()
    return [(argv, _env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=devices, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(devices)]


def start(framework: str, runs, *, devices: int, processes: int | None = None) -> Group:
    """Start a worker group on `runs`; collect its rows with `finish([group, ...])`.

    runs: [{"jobs": [Job, ...], "plant": None | name}, ...]. JAX: `processes` processes
    (default 1) sharing `devices` simulated devices; torch: one process per device.
    """
    if framework == "jax":
        def commands(spec_path, out_path):
            return _jax_commands(spec_path, out_path, devices, processes or 1)
    elif framework == "torch":
        if processes not in (None, devices):
            raise ValueError(f"torch runs one process per device: processes={processes}, devices={devices}")

        def commands(spec_path, out_path):
            return _torch_commands(spec_path, out_path, devices)
    else:
        raise ValueError(f"unknown framework {framework!r}; known: {FRAMEWORKS}")
    spec = {"runs": [{"jobs": [j.to_dict() for j in run["jobs"]], "plant": run.get("plant")} for run in runs]}
    return Group(f"sharded-{framework}-", spec, commands, "rows.jsonl", runs=runs, device=f"{devices}xcpu")


def _rows(group: Group) -> list[list[Row]]:
    """One list of rows per run: each finished job's rows; a job that never finished is an error
    row, unless the group was asked to stop (an interrupted run reports what finished)."""
    got = read_rows(group.out_path)
    problem = group.failure() or "the worker group ended without rows for this job"
    out = []
    for i, run in enumerate(group.runs):
        rows = []
        for j, job in enumerate(run["jobs"]):
            if (i, j) in got:
                rows += [Row(**r) for r in got[(i, j)]]
            elif not group.stop_sent:
                rows += error_rows(job, group.device, problem)
        out.append(rows)
    return out


def finish(groups, *, timeout_s: float = DEFAULT_JOB_TIMEOUT_S, should_stop=None) -> list[list[list[Row]]]:
    """Wait for the groups (see `wait`), then their rows (per group, per run); no worker process and
    no scratch directory outlives this call, whatever ends it."""
    try:
        wait(groups, timeout_s=timeout_s, should_stop=should_stop)
        return [_rows(g) for g in groups]
    finally:
        for g in groups:
            g.close()


def _unsplittable(job: Job) -> str:
    sizes = {"tp": {"N": SHAPE.N}, "tp-gspmd": {"N": SHAPE.N}, "sp": {"T": SHAPE.T, "S": SHAPE.S}, "dp": {"B": SHAPE.B}}[job.layout]
    bad = [f"{k}={v}" for k, v in sizes.items() if v % job.devices]
    return f"{', '.join(bad)} not divisible by {job.devices} devices" if bad else ""


def run_sharded(*, devices: int, layouts=LAYOUTS, frameworks=FRAMEWORKS, dtypes=("float64", "float32"), seed: int = 0,
                mask_policies=MASK_POLICIES, jax_processes: int = 1, job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
                should_stop=None) -> list[Row]:
    """Every (framework, layout, mask kind and policy, dtype) over `devices` CPU devices, judged.

    Rows (check="sharded", impl "<framework>-<layout>") compare output, d_inputs and d_params
    with the float64 oracle and with the framework's one-device module. JAX runs in one
    subprocess with `devices` simulated devices (or `jax_processes` processes joined by
    jax.distributed); torch runs `devices` gloo processes. The frameworks' groups run at
    the same time. A layout whose sizes do not split over `devices` gives skip rows. A repeated
    layout, framework or dtype runs once.

    should_stop() is polled while the workers run: once true, they stop after their current
    job and the rows of the finished jobs are returned (the caller knows it asked). A group
    that finishes no job for job_timeout_s seconds is killed; its unfinished jobs are error rows.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    bad_dtypes = [d for d in dtypes if d not in ("float64", "float32")]
    if bad_dtypes:
        raise ValueError(f"sharded checks run float64 and float32, got {bad_dtypes}")
    rows, pending = [], []
    try:
        for fw in dict.fromkeys(frameworks):
            runnable = []
            for job in jobs(devices=devices, layouts=layouts, frameworks=(fw,), dtypes=dtypes, mask_policies=mask_policies, seed=seed):
                why = _unsplittable(job)
                if why:
                    rows.append(Row(job.case.name, "sharded", job.impl, "oracle", job.dtype, f"{devices}xcpu", "skip", message=why))
                else:
                    runnable.append(job)
            if runnable:
                pending.append(start(fw, [{"jobs": runnable}], devices=devices, processes=jax_processes if fw == "jax" else None))
    except BaseException:
        for g in pending:
            g.close()
        raise
    for runs in finish(pending, timeout_s=job_timeout_s, should_stop=should_stop):
        rows += runs[0]
    return rows
