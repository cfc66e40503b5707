"""How the launcher and its sharded worker processes talk: a stop file, a row stream, the parent's life.

The launcher (`parity.sharded.launch`) gives each worker group a scratch directory and sets
two environment variables:

- STOP_ENV: a path. A worker asks `stop_requested()` between jobs; once the file exists it
  runs no further job (every rank of a group agrees first, so none is left in a collective).
- PARENT_ENV: the launcher's pid. `follow_parent()` makes the worker die with it (Linux:
  PR_SET_PDEATHSIG), so no worker outlives a launcher that was killed outright.

The process that judges (rank 0) appends one JSON line per finished job to the group's row
stream (`append_rows`): an interrupted or timed-out group keeps the rows of the jobs it
finished, and each new line tells the launcher the group is still making progress.

A worker started by hand (torchrun, or `python -m parity.sharded.jax_worker`) has neither
variable: it cannot be asked to stop and keeps its default signal handling.
"""

from __future__ import annotations

import json
import os
import signal
import sys

STOP_ENV = "PARITY_SHARDED_STOP_FILE"
PARENT_ENV = "PARITY_SHARDED_PARENT_PID"
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
