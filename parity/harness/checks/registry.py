"""The registry of the harness's checks, in the order they are listed and run: one `Check` per line.

Adding a check is its module (a `run(unit, impls, peers) -> rows` and a `Check`) and one line here, or
`register(check)` from elsewhere (a test's toy check). The check names the CLI accepts (`--checks`), the
checks that run a user's implementation, the skip reasons of a check that ran nothing and a --checkpoint
run's default checks are all read from here.
"""

from __future__ import annotations

from types import MappingProxyType

from parity.harness import decode, leak
from parity.harness.checks import forward, gradient, peers, training
from parity.harness.checks.check import Check
from parity.harness.report import Row
from parity.implementation import STRUCTURED_MASKS


def _leak_idle(cases) -> str:
    enabled = [c.name for c in cases if c.structured]
    return (f"it runs on the structured mask cases ({', '.join(STRUCTURED_MASKS)}; --cases masks): "
            + (", ".join(enabled) if enabled else "none is selected"))


_REGISTRY: dict[str, Check] = {}
CHECKS = MappingProxyType(_REGISTRY)
"""name -> Check, in order: iterating it gives the names (`name in CHECKS`, `",".join(CHECKS)`)."""


def register(check: Check) -> Check:
    """Add `check` at the end of the registry (its name must be new); returns it."""
    if not isinstance(check, Check):
        raise TypeError(f"register takes a parity.harness.checks.Check, got {type(check).__name__}")
    if check.name in _REGISTRY:
        raise ValueError(f"a check named {check.name!r} is registered already; known: {tuple(_REGISTRY)}")
    _REGISTRY[check.name] = check
    return check


def unregister(name: str) -> Check:
    """Remove the check `name` from the registry; returns it."""
    if name not in _REGISTRY:
        raise ValueError(f"no check named {name!r}; known: {tuple(_REGISTRY)}")
    return _REGISTRY.pop(name)


register(forward.CHECK)
register(gradient.CHECK)
register(Check("leak", lambda unit, impls, peers: leak.check_leak(unit, impls), flag="structured",
               runs=lambda impl: not impl.decode, idle=_leak_idle, on_checkpoint="window"))
register(training.CHECK)
register(peers.CHECK)
register(Check("decode", decode.check_decode, flag="decode", runs=lambda impl: impl.decode, on_checkpoint="no window"))
register(Check("sharded", idle=lambda cases: "it runs with --devices N (N >= 2 simulated devices / processes)",
               on_checkpoint="never"))  # runs outside the units: parity.harness.sharded, with runner.run(devices=...)


def user_checks() -> tuple[str, ...]:
    """The checks that run a user's implementation (the others run ours and the peers)."""
    return tuple(n for n, c in CHECKS.items() if c.runs is not None)


def checks_of(impl) -> tuple[str, ...]:
    """The checks that run `impl`, one of the user's implementations (a decoder's: the decode check)."""
    return tuple(n for n, c in CHECKS.items() if c.runs_user(impl))


def checkpoint_checks(window: bool) -> tuple[str, ...]:
    """A --checkpoint run's default checks: where the layer's sliding window binds (`window`) or not."""
    scopes = ("always", "window") if window else ("always", "no window")
    return tuple(n for n, c in CHECKS.items() if c.on_checkpoint in scopes)


def run_unit(unit, impls, peers) -> list[Row]:
    """The rows of one unit: each selected check that applies to its case, in the registry's order."""
    rows = []
    for check in CHECKS.values():
        if check.name in unit.checks and check.applies(unit.case):
            rows += check.run(unit, impls, peers)
    return rows


__all__ = ["CHECKS", "register", "unregister", "user_checks", "checks_of", "checkpoint_checks", "run_unit"]
