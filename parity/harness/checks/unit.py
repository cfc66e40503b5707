"""One (case, dtype) unit: its rounded inputs, its oracle, the implementations built for it and its rows."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from mha_spec import Problem
from parity import reference
from parity.devices import device_label
from parity.harness.checks.oracle import Oracle
from parity.harness.judge import NOTHING_COMPARED
from parity.harness.judge import margin as judge_margin
from parity.harness.report import Row
from parity.impls import Implementation
from parity.tolerances import TOLERANCES, Comparison


@dataclass
class Unit:
    """One (case, dtype): the rounded inputs, the oracle (`oracle`) and the built implementations, all lazily.

    case: a `matrix.Case`; x: its `matrix.Inputs` in the run dtype; runners: framework -> TorchRunner | JaxRunner;
    checks: the names of the checks the run selected."""

    case: object
    dtype: str
    x: object
    runners: dict
    checks: tuple = ()
    oracle: Oracle = field(init=False)
    results: dict = field(default_factory=dict)  # (check, impl name) -> what it returned: for the pairs rows
    kernels: dict = field(default_factory=dict)  # impl name -> (kernel, message): what its forward call ran
    _built: dict = field(default_factory=dict)
    _decoders: dict = field(default_factory=dict)

    def __post_init__(self):
        self.oracle = Oracle(self.case.shape, self.x, self.dtype)

    @property
    def tol(self):
        return TOLERANCES[self.dtype]

    def judged(self, impl: Implementation) -> str:
        """The dtype whose table and yardstick judge `impl` here: its `computes_in` where that is coarser."""
        return impl.judged_at(self.dtype)

    def runner(self, impl: Implementation):
        return self.runners[impl.framework]

    def problem(self, policy: str) -> Problem:
        """The case's problem under the masked-row policy an implementation runs with."""
        return dataclasses.replace(self.case.problem, config=dataclasses.replace(self.case.config, masked_rows=policy))

    def why_not_here(self, impl: Implementation) -> str | None:
        """Why impl does not run this unit, by its declarations (dtypes, variants, requires, inputs, runs_on)."""
        return impl.unsupported(self.dtype, self.case.config, cross=self.case.shape.cross, mask=self.case.mask)

    def table(self, impl: Implementation):
        """The tolerance entry `impl` is judged with here: its `computes_in` where that is coarser."""
        return TOLERANCES[self.judged(impl)]

    def judged_note(self, impl: Implementation) -> str:
        at = impl.judged_at(self.dtype)
        return "" if at == self.dtype else f"judged at the {at} bound ({impl.name} declares computes_in={impl.computes_in})"

    def structure(self, impl: Implementation) -> tuple | None:
        """(keywords, padding) for an implementation that takes the structured masks (`structured`) on a
        structured case; None otherwise (it gets the whole mask, dense)."""
        if not (impl.structured and self.x.structure):
            return None
        return self.x.structure_kw, self.x.padding

    def built(self, impl: Implementation, policy: str):
        key = (impl.name, policy)
        if key not in self._built:
            sd = {k: v.copy() for k, v in self.x.state_dict.items()}  # a factory that edits its copy spoils nothing
            positions = self.x.position_kw if impl.takes_problem else {}
            self._built[key] = self.runner(impl).build(impl, sd, self.case.shape.N, policy, self.problem(policy),
                                                       positions, self.structure(impl))
        return self._built[key]

    def forward(self, impl: Implementation, policy: str):
        """impl's forward call (output, weights), reading the kernel it ran the first time in this unit
        (the runner's `forward_reading_kernel`). torch.compile runs are not read (the first call compiles): ""."""
        runner, built = self.runner(impl), self.built(impl, policy)
        if impl.name in self.kernels or impl.mode == "compile":
            return runner.forward(built, *self.inputs())
        result, self.kernels[impl.name] = runner.forward_reading_kernel(built, *self.inputs())
        return result

    def decoder(self, impl: Implementation, policy: str):
        """Our module of `impl` as a decoder (the decode check), built once per unit: a JAX one keeps its
        compiled prompt and step for every run of the unit. A chunked case's chunk (Llama 4's) goes to every
        call (`case.chunk`; None elsewhere)."""
        key = (impl.name, policy)
        if key not in self._decoders:
            sd = {k: v.copy() for k, v in self.x.state_dict.items()}
            self._decoders[key] = self.runner(impl).decoder(impl, sd, self.case.shape.N, policy, self.problem(policy),
                                                            chunk=self.case.chunk)
        return self._decoders[key]

    def inputs(self):
        return self.x.query, self.x.key, self.x.value, self.x.keep

    @functools.cached_property
    def nonfinite_inputs(self) -> tuple[str, ...]:
        """The inputs and weights holding NaN/inf at the run dtype (fixed weights with a NaN, or a
        weight beyond float16's range): from these the oracle's NaN is not the masked-row policy's."""
        x = self.x
        named = {"query": x.query, "key": x.key, "value": x.value, **x.state_dict}
        return tuple(n for n, a in named.items() if not np.isfinite(reference.as_float64(a)).all())

    def nonfinite_verdict(self, st: str, cmp: Comparison, message: str) -> tuple[str, str]:
        """The rule for a reference that is not finite everywhere (parity.tolerances, NON-FINITE REFERENCES):
        with non-finite inputs a reference value left uncompared fails the row; from finite inputs a reference
        NaN everywhere is the policy's (masked_rows="nan"), and the passing row says nothing was compared."""
        bad = self.nonfinite_inputs
        if bad and cmp.not_compared:
            why = (f"{cmp.not_compared} of {cmp.size} reference values are NaN/inf and were not compared: the inputs "
                   f"hold NaN/inf ({', '.join(bad)}), so that NaN is theirs, not the masked-row policy's")
            return "fail", "; ".join(m for m in (why, message) if m)
        if st == "pass" and cmp.nothing_compared:
            why = f"{NOTHING_COMPARED} (from finite inputs the oracle is NaN only where masked_rows='nan' makes it)"
            return st, "; ".join(m for m in (why, message) if m)
        return st, message

    def row(self, check, impl: Implementation, ref, st, quantity="", cmp: Comparison | None = None, *,
            kernel: tuple[str, str] | None = None, **kw) -> Row:
        """kernel: (kernel, note) of the call this row judges; None: the unit's forward call's (`forward`)."""
        nums = {}
        if cmp is not None:
            nums = dict(max_abs_err=cmp.max_abs_err, max_rel_err=cmp.max_rel_err, atol=cmp.atol, rtol=cmp.rtol,
                        margin=judge_margin(cmp))  # Row raises it above 1 where the row fails for another reason
            if cmp.size is not None:
                st, kw["message"] = self.nonfinite_verdict(st, cmp, kw.get("message", ""))
            if cmp.nan_mismatch and "NaN" not in kw.get("message", ""):
                kw["message"] = (kw.get("message", "") + f"; {cmp.nan_mismatch} NaN-placement mismatches").strip("; ")
        device = device_label(self.runner(impl).device)
        kernel, note = self.kernels.get(impl.name, ("", "")) if kernel is None else kernel
        if note and st != "skip":
            kw["message"] = "; ".join(m for m in (kw.get("message", ""), note) if m)
        return Row(self.case.name, check, impl.name, ref, self.dtype, device, st, quantity, **nums,
                   kernel="" if st == "skip" else kernel, **kw)


__all__ = ["Unit"]
