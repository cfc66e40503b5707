"""Sharded attention checks: tensor-, sequence- (ring) and data-parallel, in both frameworks.

    from parity.harness.sharded import run_sharded
    rows = run_sharded(devices=4)                  # list[parity.harness.report.Row], check="sharded"
    rows = run_sharded(devices=2, shardings=("sp",), frameworks=("jax",), dtypes=("float64",))

Modules: `cases` (jobs, inputs, judging; no framework), `jax_worker` and `torch_worker`
(run in subprocesses), `launch` (the check's worker groups, `run_sharded`). The process
groups themselves (start, watch, stop, row stream) are `parity.workers`; the per-device
memory benchmark is `parity.bench.sharded` (`mha-bench sharded`).
"""

from parity.harness.sharded.cases import FRAMEWORKS, MASK_POLICIES, PLANTS, PROBLEMS, SHARDED_MASK_KINDS, SHARDINGS, Job
from parity.harness.sharded.launch import run_sharded

__all__ = ["run_sharded", "Job", "SHARDINGS", "FRAMEWORKS", "SHARDED_MASK_KINDS", "MASK_POLICIES", "PLANTS", "PROBLEMS"]
