"""The parity harness: every implementation on the same seeded inputs, judged by one table.

    from parity.harness import run
    report = run(quick=True, json_path="parity.json")
    report.ok  # nothing failed or errored

The command line is `mha-parity` (parity.cli). Modules: `matrix` (cases and
inputs), `impls` (framework adapters and peers), `checks` (forward, gradient,
training, peers, divergence), `report` (rows and renderings), `runner` (`run`).
"""

from parity.harness.impls import FAULT_KINDS, OURS, PEERS, Fault
from parity.harness.matrix import CHECKS, DTYPES, MASK_KINDS, SHAPES, Case, Shape, default_matrix, draw_inputs, quick_matrix
from parity.harness.report import Report, Row
from parity.harness.runner import DEVICES, resolve_device, run

__all__ = [
    "run", "Report", "Row", "Case", "Shape", "Fault", "FAULT_KINDS", "OURS", "PEERS", "CHECKS", "DTYPES",
    "MASK_KINDS", "SHAPES", "DEVICES", "default_matrix", "quick_matrix", "draw_inputs", "resolve_device",
]
