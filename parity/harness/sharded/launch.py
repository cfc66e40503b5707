"""Subprocess launchers for the sharded checks, and `run_sharded`.

JAX fixes its device count when it starts, so its checks run in a subprocess:
either one process with N simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
or P processes joined by jax.distributed.initialize (gloo collectives). torch runs N
processes (one per rank) joined by init_process_group("gloo") on 127.0.0.1, the environment
torchrun would give them. Every process gets OMP_NUM_THREADS=1 and a fresh interpreter
(spawned, never forked).
"""

from __future__ import annotations

import os
import sys
import warnings

from parity.harness.report import Row
from parity.harness.sharded.cases import FRAMEWORKS, MASK_POLICIES, PROBLEMS, SHARDINGS, Job, error_rows, jobs, unsplittable
from parity.workers import Group, free_port, read_rows, wait, worker_env

DEFAULT_JOB_TIMEOUT_S = 600.0
"""How long a worker group may go without finishing a job before it is killed (a rank stuck in a
collective never returns). The first job of a group also pays for imports and compilation."""


class CheckGroup(Group):
    """A worker group of the sharded check: also what it runs and the device label of its rows."""

    def __init__(self, prefix: str, spec: dict, commands, progress: str, *, runs, device: str):
        self.runs, self.device = runs, device
        super().__init__(prefix, spec, commands, progress)


def _jax_commands(spec_path, out_path, devices: int, processes: int):
    argv = [sys.executable, "-m", "parity.harness.sharded.jax_worker", spec_path, out_path]
    if devices % processes:
        raise ValueError(f"{devices} devices do not split over {processes} processes")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices // processes}".strip()
    env = worker_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    if processes == 1:
        return [(argv, env)]
    coordinator = f"127.0.0.1:{free_port()}"
    return [(argv + ["--coordinator", coordinator, "--num-processes", str(processes), "--process-id", str(i)], env) for i in range(processes)]


def _torch_commands(spec_path, out_path, devices: int):
    argv = [sys.executable, "-m", "parity.harness.sharded.torch_worker", spec_path, out_path]
    port = free_port()
    return [(argv, worker_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=devices, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(devices)]


def _jax_launch(devices: int, processes: int | None):
    """JAX: `processes` processes (default 1) sharing the simulated devices."""
    return lambda spec_path, out_path: _jax_commands(spec_path, out_path, devices, processes or 1)


def _torch_launch(devices: int, processes: int | None):
    """torch: one process per device."""
    if processes not in (None, devices):
        raise ValueError(f"torch runs one process per device: processes={processes}, devices={devices}")
    return lambda spec_path, out_path: _torch_commands(spec_path, out_path, devices)


LAUNCHES = {"jax": _jax_launch, "torch": _torch_launch}  # framework -> (devices, processes) -> commands


def start(framework: str, runs, *, devices: int, processes: int | None = None) -> CheckGroup:
    """Start a worker group on `runs`; collect its rows with `finish([group, ...])`.

    runs: [{"jobs": [Job, ...], "plant": None | name}, ...]. JAX: `processes` processes
    (default 1) sharing `devices` simulated devices; torch: one process per device.
    """
    if framework not in LAUNCHES:
        raise ValueError(f"unknown framework {framework!r}; known: {FRAMEWORKS}")
    commands = LAUNCHES[framework](devices, processes)
    spec = {"runs": [{"jobs": [j.to_dict() for j in run["jobs"]], "plant": run.get("plant")} for run in runs]}
    return CheckGroup(f"sharded-{framework}-", spec, commands, "rows.jsonl", runs=runs, device=f"{devices}xcpu")


def _rows(group: CheckGroup) -> list[list[Row]]:
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


def run_sharded(*, devices: int, shardings=SHARDINGS, frameworks=FRAMEWORKS, dtypes=("float64", "float32"), seed: int = 0,
                mask_policies=MASK_POLICIES, layers=tuple(PROBLEMS), jax_processes: int = 1,
                job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S, should_stop=None, layouts=None) -> list[Row]:
    """Every (framework, layer, sharding, mask kind and policy, dtype) over `devices` CPU devices, judged.

    Rows (check="sharded", impl "<framework>-<sharding>") compare output, d_inputs and d_params
    with the float64 oracle and with the framework's one-device module. JAX runs in one
    subprocess with `devices` simulated devices (or `jax_processes` processes joined by
    jax.distributed); torch runs `devices` gloo processes. The frameworks' groups run at
    the same time. A sharding whose sizes do not split over `devices` (tp: the query heads N and the
    key/value heads K; sp: T and S; dp: B) gives skip rows naming them. A repeated sharding,
    framework, dtype or layer runs once. layers: names of `PROBLEMS` (the classic layer, a
    grouped-query layer with RoPE and no biases). `layouts` is the old spelling of `shardings` (it warns).

    should_stop() is polled while the workers run: once true, they stop after their current
    job and the rows of the finished jobs are returned (the caller knows it asked). A group
    that finishes no job for job_timeout_s seconds is killed; its unfinished jobs are error rows.
    """
    if layouts is not None:
        warnings.warn("run_sharded(layouts=...) is spelled shardings=...", DeprecationWarning, stacklevel=2)
        shardings = layouts
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    bad_dtypes = [d for d in dtypes if d not in ("float64", "float32")]
    if bad_dtypes:
        raise ValueError(f"sharded checks run float64 and float32, got {bad_dtypes}")
    rows, pending = [], []
    try:
        for fw in dict.fromkeys(frameworks):
            runnable = []
            for job in jobs(devices=devices, shardings=shardings, frameworks=(fw,), dtypes=dtypes, mask_policies=mask_policies,
                            layers=layers, seed=seed):
                why = unsplittable(job)
                if why:
                    rows.append(Row(job.case, "sharded", job.impl, "oracle", job.dtype, f"{devices}xcpu", "skip", message=why))
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
