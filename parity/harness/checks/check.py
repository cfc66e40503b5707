"""What a check declares to the registry (`parity.harness.checks.registry`): its name, when it applies,
whom of the user's it runs, why it ran nothing, and how a unit runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CHECKPOINT_SCOPES = ("always", "never", "window", "no window")


@dataclass(frozen=True)
class Check:
    """One check of the harness.

    run(unit, impls, peers) -> rows: the check on one unit (`Unit`); None for a check that runs outside
    the units (the sharded one: `runner.run(devices=...)`).
    flag: the case attribute that enables it (`Case.decode`, `train`, `peers`, `structured`); None: every case.
    runs: which of the user's implementations it runs (`impl -> bool`); None: none of them (it runs ours
    and the peers).
    idle: why it ran nothing, given the selected cases (`cases -> str`); None: said by its flag.
    on_checkpoint: whether a --checkpoint run selects it by default: "always", "never", "window" (only
    where the layer's sliding window binds) or "no window" (only where it does not).
    """

    name: str
    run: Callable | None = None
    flag: str | None = None
    runs: Callable | None = None
    idle: Callable | None = None
    on_checkpoint: str = "always"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a check's name is a non-empty str, got {self.name!r}")
        if self.on_checkpoint not in CHECKPOINT_SCOPES:
            raise ValueError(f"check {self.name}: on_checkpoint={self.on_checkpoint!r}; known: {CHECKPOINT_SCOPES}")

    def applies(self, case) -> bool:
        """Whether a unit of `case` runs this check (by its flag)."""
        return self.run is not None and (self.flag is None or bool(getattr(case, self.flag)))

    def runs_user(self, impl) -> bool:
        """Whether it runs `impl`, one of the user's implementations."""
        return self.runs is not None and bool(self.runs(impl))

    def reason(self, cases) -> str:
        """Why nothing ran for it, given the selected cases."""
        if self.idle is not None:
            return self.idle(cases)
        if self.flag is not None:
            enabled = [c.name for c in cases if getattr(c, self.flag)]
            return (f"it runs only on cases with {self.flag}=True: "
                    + (", ".join(enabled) + " (in float64/float32 for training)" if enabled else "none is selected"))
        return "no selected implementation, case and dtype ran it"


__all__ = ["Check", "CHECKPOINT_SCOPES"]
