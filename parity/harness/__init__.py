"""The parity harness: every implementation on the same seeded inputs, judged by one table.

    from parity.harness import run
    report = run(quick=True, json_path="parity.json")
    report.ok  # something was checked, nothing failed or errored
    run(cases="modern")  # grouped/multi-query heads, RoPE, bias-free projections
    run(checks=("decode",))  # prefill + decode steps with a KV cache, vs one causal forward
    run(cases="masks")  # packed documents and sliding windows, with the leak check

The command line is `mha-parity` (parity.cli). Modules: `matrix` (cases and inputs),
`checks` (the registry of checks, `CHECKS`, one module each: forward, gradient, training, peers; the
unit and its oracle) on the implementations of `parity.impls`, `decode` (a prompt and single-token steps with a KV cache), `leak` (on the
structured mask cases: a perturbed document reaches nothing the mask keeps it from),
`judge` (the comparison), `report` (rows and renderings), `plot`
(the margin picture), `runner` (`run`).
"""

from parity.harness.matrix import (
    CASE_SETS,
    CHECKS,
    MASK_KINDS,
    MASK_SHAPES,
    SHAPES,
    STRUCTURED_MASKS,
    VARIANT_SHAPES,
    Case,
    Shape,
    default_matrix,
    draw_inputs,
    mask_matrix,
    modern_matrix,
    quick_matrix,
)
from parity.harness.report import Report, Row
from parity.harness.runner import RunRequest, run, select_impls

__all__ = [
    "run", "RunRequest", "Report", "Row", "Case", "Shape", "CHECKS", "MASK_KINDS", "STRUCTURED_MASKS", "SHAPES", "VARIANT_SHAPES",
    "MASK_SHAPES", "CASE_SETS", "default_matrix", "modern_matrix", "mask_matrix", "quick_matrix", "draw_inputs",
    "select_impls",
]
