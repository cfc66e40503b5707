"""Sharded attention checks: tensor-, sequence- (ring) and data-parallel, in both frameworks.

    from parity.sharded import run_sharded
    rows = run_sharded(devices=4)                  # list[parity.harness.report.Row], check="sharded"
    rows = run_sharded(devices=2, layouts=("sp",), frameworks=("jax",), dtypes=("float64",))

Modules: `cases` (jobs, inputs, judging; no framework), `jax_worker` and `torch_worker`
(run in subprocesses), `launch` (process groups, `run_sharded`), `control` (how the launcher
stops its workers between jobs and reads their rows), `bench` (per-device memory and time
for 1, 2, 4 devices).
"""

from parity.sharded.cases import FRAMEWORKS, LAYOUTS, MASK_POLICIES, PLANTS, SHAPE, Job
from parity.sharded.launch import run_sharded

__all__ = ["run_sharded", "Job", "LAYOUTS", "FRAMEWORKS", "MASK_POLICIES", "PLANTS", "SHAPE"]
