"""The parity harness: every implementation on the same seeded inputs, judged by one table.

    from parity.harness import run
    report = run(quick=True, json_path="parity.json")
    report.ok  # something was checked, nothing failed or errored

The command line is `mha-parity` (parity.cli). Modules: `matrix` (cases and inputs),
`checks` (forward, gradient, training, peers, divergence) on the implementations of
`parity.impls`, `judge` (the comparison), `report` (rows and renderings), `plot`
(the margin picture), `runner` (`run`).
"""

from parity.harness.matrix import CHECKS, MASK_KINDS, SHAPES, Case, Shape, default_matrix, draw_inputs, quick_matrix
from parity.harness.report import Report, Row
from parity.harness.runner import run, select_impls

__all__ = [
    "run", "Report", "Row", "Case", "Shape", "CHECKS", "MASK_KINDS", "SHAPES", "default_matrix", "quick_matrix",
    "draw_inputs", "select_impls",
]
