"""Subprocess launchers for the sharded checks, and `run_sharded`.

JAX fixes its device count when it starts, so its checks run in a subprocess:
either one process with N simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)
or P processes joined by jax.distributed.initialize (gloo collectives). torch runs N
processes (one per rank) joined by init_process_group("gloo") on 127.0.0.1, the environment
torchrun would give them. Every process gets OMP_NUM_THREADS=1 and a fresh interpreter
(spawned, never forked).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from parity.harness.report import Row
from parity.sharded.cases import FRAMEWORKS, LAYOUTS, MASK_POLICIES, SHAPE, Job, error_rows, jobs

DEFAULT_TIMEOUT_S = 600


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _launch(commands, out_path: str, timeout_s: float) -> dict:
    """Run the (argv, env) pairs together; the JSON written to out_path by the first one.

    A process that fails, or a group that outlives timeout_s (a rank stuck in a
    collective), raises RuntimeError with the tail of every process's stderr.
    """
    logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    procs = [subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True) for (argv, env), log in zip(commands, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        tails.append(f"[process {i}, exit {p.returncode}] {log.read()[-2000:]}")
        log.close()
    if any(p.returncode != 0 for p in procs) or not os.path.exists(out_path):
        raise RuntimeError("sharded worker failed: " + " | ".join(tails))
    with open(out_path) as f:
        return json.load(f)


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


def start(framework: str, runs, *, devices: int, processes: int | None = None):
    """Start a worker group; returns a `finish(timeout_s) -> list[list[Row]]` (one list per run).

    runs: [{"jobs": [Job, ...], "plant": None | name}, ...]. JAX: `processes` processes
    (default 1) sharing `devices` simulated devices; torch: one process per device.
    """
    tmp = tempfile.mkdtemp(prefix=f"sharded-{framework}-")
    spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "rows.json")
    with open(spec_path, "w") as f:
        json.dump({"runs": [{"jobs": [j.to_dict() for j in run["jobs"]], "plant": run.get("plant")} for run in runs]}, f)
    if framework == "jax":
        commands = _jax_commands(spec_path, out_path, devices, processes or 1)
    elif framework == "torch":
        if processes not in (None, devices):
            raise ValueError(f"torch runs one process per device: processes={processes}, devices={devices}")
        commands = _torch_commands(spec_path, out_path, devices)
    else:
        raise ValueError(f"unknown framework {framework!r}; known: {FRAMEWORKS}")

    def finish(timeout_s: float = DEFAULT_TIMEOUT_S) -> list[list[Row]]:
        try:
            result = _launch(commands, out_path, timeout_s)
            return [[Row(**r) for r in rows] for rows in result["runs"]]
        except RuntimeError as exc:
            return [[row for job in run["jobs"] for row in error_rows(job, f"{devices}xcpu", str(exc))] for run in runs]

    return finish


def _unsplittable(job: Job) -> str:
    sizes = {"tp": {"N": SHAPE.N}, "tp-gspmd": {"N": SHAPE.N}, "sp": {"T": SHAPE.T, "S": SHAPE.S}, "dp": {"B": SHAPE.B}}[job.layout]
    bad = [f"{k}={v}" for k, v in sizes.items() if v % job.devices]
    return f"{', '.join(bad)} not divisible by {job.devices} devices" if bad else ""


def run_sharded(*, devices: int, layouts=LAYOUTS, frameworks=FRAMEWORKS, dtypes=("float64", "float32"), seed: int = 0,
                mask_policies=MASK_POLICIES, jax_processes: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Row]:
    """Every (framework, layout, mask kind and policy, dtype) over `devices` CPU devices, judged.

    Rows (check="sharded", impl "<framework>-<layout>") compare output, d_inputs and d_params
    with the float64 oracle and with the framework's one-device module. JAX runs in one
    subprocess with `devices` simulated devices (or `jax_processes` processes joined by
    jax.distributed); torch runs `devices` gloo processes. The frameworks' groups run at
    the same time. A layout whose sizes do not split over `devices` gives skip rows.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    bad_dtypes = [d for d in dtypes if d not in ("float64", "float32")]
    if bad_dtypes:
        raise ValueError(f"sharded checks run float64 and float32, got {bad_dtypes}")
    rows, pending = [], []
    for fw in frameworks:
        runnable = []
        for job in jobs(devices=devices, layouts=layouts, frameworks=(fw,), dtypes=dtypes, mask_policies=mask_policies, seed=seed):
            why = _unsplittable(job)
            if why:
                rows.append(Row(job.case.name, "sharded", job.impl, "oracle", job.dtype, f"{devices}xcpu", "skip", message=why))
            else:
                runnable.append(job)
        if runnable:
            pending.append(start(fw, [{"jobs": runnable}], devices=devices, processes=jax_processes if fw == "jax" else None))
    for finish in pending:
        rows += finish(timeout_s)[0]
    return rows
