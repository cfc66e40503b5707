"""The checks of one (case, dtype) unit, run on any registered implementation.

Every implementation -- ours, a peer, or the user's own -- is built from the same canonical weights through
the registry (`parity.impls`) and judged by one table (`parity.harness.judge`). A failing forward or gradient
names the first diverging stage when the implementation exposes its intermediates.

Modules: `unit` (the unit: case, dtype, inputs, built implementations, rows), `oracle` (its float64 oracle),
`check` (what a check declares), `registry` (the checks, in order: `CHECKS`, `register`, `run_unit`), one
module per check (`forward`, `gradient`, `training`, `peers`; `parity.harness.decode` and
`parity.harness.leak`), `pairs` (the user's layers against each other) and `divergence`.
"""

from parity.harness.checks.check import Check
from parity.harness.checks.common import GRAD_GROUPS, one_input
from parity.harness.checks.divergence import divergence
from parity.harness.checks.forward import check_forward
from parity.harness.checks.gradient import check_gradient
from parity.harness.checks.oracle import Oracle
from parity.harness.checks.pairs import check_pairs
from parity.harness.checks.peers import check_peers
from parity.harness.checks.registry import (CHECKS, checkpoint_checks, checks_of, register, run_unit, unregister,
                                            user_checks)
from parity.harness.checks.training import OPTIMIZERS, TRAIN_DTYPES, TRAIN_STEPS, check_training
from parity.harness.checks.unit import Unit
from parity.harness.decode import check_decode
from parity.harness.leak import check_leak
from parity.harness.report import error_row

__all__ = ["Unit", "Oracle", "Check", "CHECKS", "register", "unregister", "run_unit", "user_checks", "checks_of",
           "checkpoint_checks", "divergence", "error_row", "check_forward", "check_gradient", "check_leak",
           "check_training", "check_peers", "check_pairs", "check_decode", "one_input", "GRAD_GROUPS", "OPTIMIZERS",
           "TRAIN_STEPS", "TRAIN_DTYPES"]
