"""The four checks of one (case, dtype) unit, run on any registered implementation.

Every implementation — ours, a peer, or the user's own — is built from the same
canonical weights through the registry (`parity.impls`) and judged by one table
(`parity.harness.judge`). A failing forward or gradient names the first diverging
stage when the implementation exposes its intermediates.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from mha_spec import Problem
from parity import kernel_ran, reference
from parity.canonical import CANONICAL_KEYS
from parity.devices import device_label
from parity.harness.judge import NOTHING_COMPARED, judge, judge_grads, nan_note, status
from parity.harness.judge import margin as judge_margin
from parity.harness.matrix import Case, Inputs
from parity.harness.decode import check_decode
from parity.harness.leak import check_leak
from parity.harness.report import Row, error_row
from parity.impls import Implementation, builtin, mask_for
from parity.peers.common import MissingPackage
from parity.dtypes import coarser, numpy_dtype
from parity.tolerances import (TOLERANCES, Comparison, envelope, errors, gradient_floors, reduction_floors, yardstick_dtype,
                               yardstick_runs)

TRAIN_STEPS = 5
TRAIN_DTYPES = ("float64", "float32")  # 16-bit training drifts by design; nothing sharp to compare
# Every hyperparameter set explicitly and equal on both sides: the libraries' defaults
# differ (AdamW weight decay is 1e-4 in optax, 1e-2 in torch).
OPTIMIZERS = {
    "adam": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8},
    "adamw": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
    "sgd": {"lr": 1e-1, "momentum": 0.9},
}

# An implementation that computes in a lower precision than its inputs' dtype (`computes_in`, declared
# by its peer module in parity/peers: those running jax.nn.dot_product_attention, HF Llama's float32
# softmax) is judged with the table's entry for the dtype it really computes in, and the row says so.

GRAD_GROUPS = {
    # "x": a one-input layer's (inputs="self") gradient, judged against d_query + d_key + d_value
    "d_inputs": ("query", "key", "value", "x"),
    "d_params": CANONICAL_KEYS,
}


def _group(group: str, expected: dict) -> tuple[str, ...]:
    """A gradient group's names in this layer (the oracle's keys: a projection without bias has none)."""
    return tuple(n for n in GRAD_GROUPS[group] if n in expected)
# Our eager JAX implementation is jax-jit's program run op by op: it is checked where it is
# cheap. A user's eager JAX implementation is checked everywhere, gradients included.
EAGER_JAX_SKIP = "eager JAX compiles each op per shape (~1 s); ours runs on the base cases only, jax-jit runs the same program"
EAGER_JAX_GRAD_SKIP = "our eager JAX is jax-jit's program op by op: its gradients are checked under jit (jax-jit)"


@dataclass
class Unit:
    """One (case, dtype): the rounded inputs, the oracles and the built implementations, all lazily."""

    case: Case
    dtype: str
    x: Inputs  # in the run dtype
    runners: dict  # framework -> TorchRunner | JaxRunner
    checks: tuple = ()
    _oracle: dict = field(default_factory=dict)
    _low: dict = field(default_factory=dict)
    _grads: dict = field(default_factory=dict)
    _yard: dict = field(default_factory=dict)
    _built: dict = field(default_factory=dict)
    _terms: dict = field(default_factory=dict)
    _decoders: dict = field(default_factory=dict)
    decode_oracles: dict = field(default_factory=dict)  # policy -> the decode check's oracles (parity.harness.decode)
    results: dict = field(default_factory=dict)  # (check, impl name) -> what it returned: for check_pairs
    kernels: dict = field(default_factory=dict)  # impl name -> (kernel, message): what its forward call ran

    @property
    def tol(self):
        return TOLERANCES[self.dtype]

    def _args64(self):
        x = self.x
        sd = {k: reference.as_float64(v) for k, v in x.state_dict.items()}
        return sd, *(reference.as_float64(a) for a in (x.query, x.key, x.value))

    def _layer_kw(self) -> dict:
        """The oracle's keywords for the case's layer beyond the state dict (which says the biases)."""
        s = self.case.shape
        return {"num_heads": s.N, "num_kv_heads": s.num_kv_heads, "rope": s.rope, "rope_theta": s.rope_theta,
                **self.x.position_kw}

    def judged(self, impl: Implementation) -> str:
        """The dtype whose table and yardstick judge `impl` here: its `computes_in` where that is coarser."""
        return impl.judged_at(self.dtype)

    def oracle(self, policy: str, at: str | None = None):
        """(float64 intermediates, the yardstick judged at `at` (default: the run dtype): the same maths with
        each stage rounded to `parity.tolerances.yardstick_dtype(at)`, as one array per stage whose error is
        the largest of its runs' (`yardstick_runs`, `envelope`)), on the rounded inputs."""
        at = at or self.dtype
        if policy not in self._oracle or (policy, at) not in self._low:
            sd, q, k, v = self._args64()
            kw = {**self._layer_kw(), "masked_rows": policy}
            if policy not in self._oracle:
                self._oracle[policy] = reference.forward(sd, q, k, v, self.x.keep, **kw)
            runs = yardstick_runs(lambda sd, xs, dt: reference.forward(sd, *xs, self.x.keep, dtype=dt, **kw), sd,
                                  (q, k, v), at)
            self._low[(policy, at)] = envelope(self._oracle[policy], runs)
        return self._oracle[policy], self._low[(policy, at)]

    def oracle_grads(self, policy: str, masked_row_grads: str = "stop", at: str | None = None):
        """(float64 gradients, per-key errors of the yardstick judged at `at` (default: the run dtype)).

        masked_row_grads: what the implementation declares its fully masked rows do ("stop" | "flow")."""
        at = at or self.dtype
        key = (policy, masked_row_grads)
        if key not in self._grads or (*key, at) not in self._yard:
            sd, q, k, v = self._args64()
            cot = reference.as_float64(self.x.cotangent)
            kw = {**self._layer_kw(), "masked_rows": policy, "masked_row_grads": masked_row_grads}
            if key not in self._grads:
                self._grads[key] = reference.backward(sd, q, k, v, self.x.keep, cot, **kw)
            runs = yardstick_runs(lambda sd, xs, dt: reference.backward(sd, *xs[:3], self.x.keep, xs[3], dtype=dt, **kw),
                                  sd, (q, k, v, cot), at)
            exact = self._grads[key]
            self._yard[(*key, at)] = {n: max(errors(run[n], exact[n])[0] for run in runs) for n in exact}
        return self._grads[key], self._yard[(*key, at)]

    def bias_terms(self, policy: str, masked_row_grads: str = "stop", per_query_head: bool = False,
                   at: str | None = None) -> dict[str, np.ndarray]:
        """{bias gradient: its per-token terms (B·L, F), float64}: the gradient of that projection's output
        at each token, which the bias gradient sums (out_proj's: the cotangent), as the oracle's own maths in
        the run dtype stores it (`reference.backward(dtype=...)`). Read off the oracle with each input
        projection moved into its input -- x·Wᵀ + b fed as the input (zero-padded to E columns; F ≤ E), weight
        [I | 0], bias 0: the same layer and the same stored values, whose input gradient is then the
        projection's output gradient. per_query_head=True: on a grouped layer, k_proj's and v_proj's terms
        are each query head's share (B·G·S, F) before the sum over its group, which XLA folds into the
        same float16 reduction when it fuses repeat_kv's transpose with the bias gradient's sum.
        at: the dtype judged (default the run dtype): the terms are stored as its yardstick stores them."""
        sd, *xs = self._args64()
        cot = reference.as_float64(self.x.cotangent)
        moved, inputs, widths = dict(sd), [], {}
        for name, x in zip(("q_proj", "k_proj", "v_proj"), xs):
            W, b = sd[f"{name}.weight"], sd.get(f"{name}.bias")  # (F, E), (F,)
            F, E = W.shape
            out = x @ W.T + (0.0 if b is None else b)  # (B, L, F)
            inputs.append(np.concatenate([out, np.zeros((*out.shape[:2], E - F))], axis=-1))  # (B, L, E)
            moved[f"{name}.weight"] = np.eye(F, E)
            if b is not None:
                moved[f"{name}.bias"], widths[name] = np.zeros(F), F
        terms = {}
        if widths:  # a layer without q/k/v biases needs no second backward
            kw = {**self._layer_kw(), "masked_rows": policy, "masked_row_grads": masked_row_grads}
            grads = reference.backward(moved, *inputs, self.x.keep, cot, dtype=numpy_dtype(yardstick_dtype(at or self.dtype)),
                                       per_query_head=per_query_head, **kw)
            terms = {f"{n}.bias": grads[key][..., :widths[n]].reshape(-1, widths[n])
                     for n, key in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")) if n in widths}
            for n, key in (("k_proj", "key"), ("v_proj", "value")):
                shares = grads.get(f"{key}.per_query_head")  # (B, K, G, S, H)
                if n in widths and shares is not None and shares.shape[2] > 1:
                    terms[f"{n}.bias"] = shares.transpose(0, 2, 3, 1, 4).reshape(-1, widths[n])  # (B·G·S, K·H)
        if "out_proj.bias" in sd:
            terms["out_proj.bias"] = cot.reshape(-1, cot.shape[-1])
        return terms

    def floors(self, policy: str, masked_row_grads: str, expected: dict, at: str | None = None) -> dict[str, float]:
        """The gradient floors (parity.tolerances) of the dtype judged, `at` (default the run dtype): a true-zero
        gradient's, and each bias gradient's bound when its sum over tokens runs in the dtype -- over the
        tokens, or on a grouped layer's k/v biases over each query head's share of them
        (`bias_terms(per_query_head=True)`) -- the largest where several apply."""
        at = at or self.dtype
        floors = gradient_floors(expected, at)
        if TOLERANCES[at].three_way_k is None:
            return floors
        grouped = (self.case.shape.num_kv_heads or self.case.shape.N) < self.case.shape.N
        for per_query_head in (False, True) if grouped else (False,):
            key = (policy, masked_row_grads, per_query_head, yardstick_dtype(at))
            if key not in self._terms:
                self._terms[key] = self.bias_terms(policy, masked_row_grads, per_query_head, at)
            for n, f in reduction_floors(self._terms[key], expected, at).items():
                floors[n] = max(f, floors.get(n, 0.0))
        return floors

    def runner(self, impl: Implementation):
        return self.runners[impl.framework]

    def problem(self, policy: str) -> Problem:
        """The case's problem under the masked-row policy an implementation runs with."""
        return dataclasses.replace(self.case.problem, config=dataclasses.replace(self.case.config, masked_rows=policy))

    def unsupported(self, impl: Implementation) -> str | None:
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
        (`parity.kernel_ran`): torch by the profiler around this very call, JAX by its forward program's
        jaxpr (a trace, no compile). torch.compile runs are not read (the first call compiles): ""."""
        runner, built = self.runner(impl), self.built(impl, policy)
        if impl.name in self.kernels or impl.mode == "compile":
            return runner.forward(built, *self.inputs())
        if impl.framework == "torch":
            from parity.bench.torch_bench import kernel_label

            with kernel_ran.torch_observer() as seen:
                result = runner.forward(built, *self.inputs())
            self.kernels[impl.name] = kernel_ran.torch_verdict(kernel_label(impl), seen.label)
            return result
        result = runner.forward(built, *self.inputs())
        try:
            q, k, v, keep = self.inputs()
            xs, mask, _ = runner._device_args(built, q, k, v, keep, None)
            program = runner._program(built, False, q.shape, k.shape[1])
            # The mask is a constant of the traced program, as in the forward that ran: a peer that reads
            # it as causal / segment ids (the Pallas kernels) can, and no kernel choice depends on its values.
            self.kernels[impl.name] = kernel_ran.jax_row_kernel(
                lambda params, *xs: program(params, *xs, mask, None), (built.params, *xs), runner.device,
                ours=impl.role == "ours", need_weights=impl.returns_weights)
        except Exception:  # noqa: BLE001 - the forward ran; only the reading failed: the field stays ""
            self.kernels[impl.name] = ("", "")
        return result

    def decoder(self, impl: Implementation, policy: str):
        """Our module of `impl` as a decoder (the decode check), built once per unit: a JAX one keeps its
        compiled prompt and step for every run of the unit."""
        key = (impl.name, policy)
        if key not in self._decoders:
            sd = {k: v.copy() for k, v in self.x.state_dict.items()}
            self._decoders[key] = self.runner(impl).decoder(impl, sd, self.case.shape.N, policy, self.problem(policy))
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


# ---------------------------------------------------------------- divergence


def _stage_views(got: dict, exact, low, keep, shape4):
    """(got, expected, yardstick) per stage the implementation reports, as it reports it.

    Scores are compared where the case keeps a key on a row that attends to something:
    what an implementation puts at masked places (-inf, finfo.min, the raw score) is its own.
    """
    views = {}
    if "scores" in got:
        valid = np.ones(shape4, bool) if keep is None else np.broadcast_to(keep, shape4)
        valid = valid & valid.any(axis=-1, keepdims=True)

        def only_valid(s):
            s = reference.as_float64(s)
            return np.where(valid, s, 0.0) if np.shape(s) == shape4 else s

        views["scores"] = (only_valid(got["scores"]), only_valid(exact.scores), None if low is None else only_valid(low.scores))
    for stage in reference.STAGES:
        if stage in got and stage not in views:
            views[stage] = (got[stage], getattr(exact, stage), None if low is None else getattr(low, stage))
    return views


def divergence(unit: Unit, impl: Implementation, policy: str) -> dict:
    """{"stage": first stage (reference.STAGES order) off the oracle} or {"message": why none is named}."""
    try:
        got = unit.runner(impl).intermediates(unit.built(impl, policy), *unit.inputs())
    except Exception as e:  # the search is a diagnosis; its failure must not hide the row
        return {"message": f"divergence search failed: {type(e).__name__}: {e}"[:300]}
    if got is None:
        return {"message": f"{impl.name} exposes no intermediates (fn.intermediates), so no stage is named"}
    exact, low = unit.oracle(policy, unit.judged(impl))
    s = unit.case.shape
    views = _stage_views(got, exact, low, unit.x.keep, (s.B, s.N, s.T, s.S))
    for stage in reference.STAGES:
        if stage not in views:
            continue
        actual, expected, yard = views[stage]
        if np.shape(actual) != np.shape(expected):
            return {"stage": stage, "message": f"{stage} has shape {np.shape(actual)}, the oracle's is {np.shape(expected)}"}
        table = unit.table(impl)
        if not judge(actual, expected, table.forward, table.three_way_k, yard).passed:
            return {"stage": stage}
    return {"stage": "output"}


# ---------------------------------------------------------------- forward


def _skip_reason(unit: Unit, impl: Implementation, check: str) -> str | None:
    """Why `impl` does not run `check` in this unit: its own declaration, or our eager JAX's cost."""
    why = unit.unsupported(impl)
    if why:
        return why
    if impl.decode:
        return f"{impl.name} is a decoder (decode=True): the decode check judges it, one token per call"
    if impl.role == "ours" and impl.framework == "jax" and impl.mode == "eager":
        if check == "gradient":
            return EAGER_JAX_GRAD_SKIP
        if not unit.case.jax_eager:
            return EAGER_JAX_SKIP
    return None


def _changed_rows(unit: Unit, impl: Implementation, check: str, policy: str) -> list[Row]:
    """A fail row when a call changed its inputs or parameters in place (the runner notes it)."""
    built = unit.built(impl, policy)
    changed, built.changed[:] = list(built.changed), []
    if not changed:
        return []
    return [unit.row(check, impl, "inputs", "fail", "inputs",
                     message=f"{'; '.join(changed)}: an attention layer must not change its arguments")]


def _disagreement(c: Comparison, actual, expected) -> str:
    """What differs, the numbers first: values off the bound, then where NaNs differ."""
    parts = []
    if c.values_ok is False:
        parts.append(f"values off by up to {c.max_abs_err:.3g} where both are numbers "
                     f"(bound {c.atol:.3g}{f' + {c.rtol:.3g}·|expected|' if c.rtol else ''})")
    if c.nan_mismatch:
        parts.append("NaN placement differs: " + nan_note(actual, expected))
    return "; ".join(parts)


def _judge_forward(unit: Unit, impl: Implementation, policy: str, out, w, check: str = "forward", note: str = "") -> list[Row]:
    exact, low = unit.oracle(policy, unit.judged(impl))
    tol, k = unit.table(impl).forward, unit.table(impl).three_way_k
    note = "; ".join(n for n in (note, unit.judged_note(impl)) if n)
    quantities = [("output", out)] + ([] if w is None else [("weights", w)])
    cmps = [(q, a, judge(a, getattr(exact, q), tol, k, None if low is None else getattr(low, q))) for q, a in quantities]
    extra = divergence(unit, impl, policy) if any(not c.passed for *_, c in cmps) else {}
    rows = []
    for q, a, c in cmps:
        kw = dict(extra) if not c.passed else {}
        message = [note] if note else []
        if not c.passed:
            autograd = _autograd_note(unit, impl, q, c, tol, k, exact, low) if check == "gradient" else ""
            message += [_disagreement(c, a, getattr(exact, q)), autograd or extra.get("message", "")]
        kw["message"] = "; ".join(m for m in message if m)
        rows.append(unit.row(check, impl, "oracle", status(c), q, c, **kw))
    return rows


def _autograd_note(unit: Unit, impl: Implementation, q: str, c: Comparison, tol, k, exact, low) -> str:
    """Why the gradient call's `q` fails where it was measured: the forward check's call of the same
    implementation on the same inputs (autograd off) passing the same bound says the difference is autograd's;
    "" when the forward check did not run this implementation or failed it too (nothing apart was measured)."""
    plain = (unit.results.get(("forward", impl.name)) or {}).get(q)
    if plain is None:
        return ""
    off = judge(plain, getattr(exact, q), tol, k, getattr(low, q))
    if not off.passed:
        return ""
    return (f"its forward call (autograd off) passes the same bound (margin {judge_margin(off):.2g}) and this call "
            f"(autograd on) does not (margin {judge_margin(c):.2g}): it computes differently with autograd on")


def _ref_name(unit: Unit, policy: str) -> str:
    return "torch" if policy == unit.case.masked_rows else f"torch[{policy}]"


def _versus_torch(impl: Implementation) -> bool:
    """JAX implementations and the user's are also judged against our torch module (same policy)."""
    return impl.framework == "jax" or impl.role == "user"


def _torch_reference(unit: Unit, policy: str, what: str) -> dict:
    """Our torch module (eager, with weights) under `policy`: its forward or its gradients."""
    b, r = unit.built(builtin("torch"), policy), unit.runners["torch"]
    if what == "forward":
        out, w = r.forward(b, *unit.inputs())
        return {"output": out, "weights": w}
    return r.grads(b, *unit.inputs(), unit.x.cotangent)


def _forward_vs_torch(unit: Unit, impl: Implementation, policy: str, got: dict) -> list[Row]:
    ref = _ref_name(unit, policy)
    try:
        base = _torch_reference(unit, policy, "forward")
    except Exception as e:
        return [error_row(unit, "forward", impl, ref, e)]
    exact, low = unit.oracle(policy, unit.judged(impl))
    rows = []
    for q, a in got.items():
        if a is None or base[q] is None:
            continue
        yard_err = None if low is None else errors(getattr(low, q), getattr(exact, q))[0]
        table = unit.table(impl)
        c = judge(a, base[q], table.forward, table.three_way_k, yard_err=yard_err)
        message = [unit.judged_note(impl)] + ([] if c.passed else [_disagreement(c, a, base[q])])
        rows.append(unit.row("forward", impl, ref, status(c), q, c, message="; ".join(m for m in message if m)))
    return rows


def _prefetch(unit: Unit, impls) -> None:
    """JAX: the jit implementations' forward and gradients in one compiled program (see JaxRunner.prefetch)."""
    if "gradient" not in unit.checks:
        return
    jitted = [i for i in impls if i.framework == "jax" and i.mode == "jit" and not _skip_reason(unit, i, "gradient")]
    try:
        builts = [unit.built(i, i.policy(unit.case.masked_rows)) for i in jitted]
        unit.runners["jax"].prefetch(builts, *unit.inputs(), unit.x.cotangent)
    except Exception:  # noqa: BLE001 - each implementation then reports its own error
        pass


def check_forward(unit: Unit, impls) -> list[Row]:
    rows = []
    _prefetch(unit, impls)
    for impl in impls:
        why = _skip_reason(unit, impl, "forward")
        if why:
            rows.append(unit.row("forward", impl, "oracle", "skip", message=why))
            continue
        policy = impl.policy(unit.case.masked_rows)
        try:
            out, w = unit.forward(impl, policy)
        except Exception as e:
            rows.append(error_row(unit, "forward", impl, "oracle", e))
            continue
        rows += _changed_rows(unit, impl, "forward", policy)
        unit.results[("forward", impl.name)] = {"output": out, "weights": w}
        rows += _judge_forward(unit, impl, policy, out, w)
        if _versus_torch(impl):
            rows += _forward_vs_torch(unit, impl, policy, {"output": out, "weights": w})
        rows += _changed_rows(unit, impl, "forward", policy)  # the divergence search and our torch calls
    return rows


# ---------------------------------------------------------------- gradients


def _fully_masked_rows(unit: Unit) -> list[tuple[int, int]]:
    """(batch, query) of every query row that attends to no key."""
    keep = unit.x.keep
    if keep is None:
        return []
    return [(int(b), int(t)) for b, t in zip(*np.nonzero(~keep.any(axis=-1)[:, 0]))]


def _masked_row_note(unit: Unit, got: dict, expected: dict, failing) -> str:
    """Why q/k gradients differ on fully masked rows, when that is what they do (else "")."""
    rows = _fully_masked_rows(unit)
    q = got.get("query")
    if not rows or q is None or not ({"query", "key"} & set(failing)):
        return ""
    a, e = reference.as_float64(q), reference.as_float64(expected["query"])
    tensors = ", ".join(n for n in failing if n.split(".")[0] in ("query", "key", "q_proj", "k_proj"))
    where = ", ".join(f"({b}, {t})" for b, t in rows[:6]) + (" ..." if len(rows) > 6 else "")
    nan_rows = [r for r in rows if np.isnan(a[r]).any() and not np.isnan(e[r]).any()]
    if nan_rows:
        return (f"NaN in {tensors}, from the fully masked (batch, query) rows {where}, where the oracle is finite: "
                "their NaN softmax is differentiated through the scores, as with an additive mask (scores + 0/-inf); "
                "a select (where(keep, scores, -inf)) keeps that NaN in the value gradients, as the classic module does "
                "(declare masked_row_grads='flow' if the additive mask is meant)")
    bound = unit.tol.gradient.atol
    moved = [r for r in rows if np.all(e[r] == 0) and np.nanmax(np.abs(a[r])) > bound]
    if moved:
        return (f"non-zero gradients in {tensors} from the fully masked (batch, query) rows {where}, where the oracle's "
                "are 0: gradient flows through those rows' scores, as when a large finite value is added to masked scores "
                "(finfo.min, as Hugging Face does; declare masked_row_grads='flow' if that is meant): "
                "the forward is uniform, but not a constant")
    return ""


def _grad_rows(unit: Unit, impl: Implementation, ref: str, got: dict, expected: dict, yard_err, floors,
               extra=None, explain=None) -> list[Row]:
    rows = []
    tol, k = unit.table(impl).gradient, unit.table(impl).three_way_k
    for group in GRAD_GROUPS:
        names = _group(group, expected)
        if group == "d_params" and not impl.uses_params:
            rows.append(unit.row("gradient", impl, ref, "skip", group,
                                 message=f"{impl.name} declares uses_params=False: its parameters are its own"))
            continue
        missing = [n for n in names if got.get(n) is None]
        # A missing gradient is judged as zero: right only where the true gradient is zero.
        filled = {n: np.zeros_like(reference.as_float64(expected[n])) if got.get(n) is None else got[n] for n in names}
        c, note = judge_grads(filled, expected, tol, names, k, yard_err, floors)
        kw = dict(extra or {}) if not c.passed else {}
        message = [unit.judged_note(impl)]
        if names == ("x",):
            message.append("one input (inputs='self'): d_x judged against d_query + d_key + d_value")
        if missing:
            message.append(f"no gradient for {', '.join(missing)} (judged as zero)")
        message.append(note)
        if not c.passed:
            failing = [n for n in names if not judge(filled[n], expected[n], tol, k,
                                                     yard_err=None if yard_err is None else yard_err[n],
                                                     floor=floors.get(n, 0.0)).passed]
            message.insert(0, f"fails: {', '.join(failing)}")
            if explain is not None:
                message.append(explain(filled, failing))
            message.append(kw.get("message", ""))
        kw["message"] = "; ".join(m for m in message if m)
        rows.append(unit.row("gradient", impl, ref, status(c), group, c, **kw))
    return rows


def one_input(grads: dict | None) -> dict | None:
    """Gradients (or their yardstick errors) as a one-input layer has them: "x" for query, key and value
    (their sum: the errors of a sum add up at most); the parameters' as they are."""
    if grads is None:
        return None
    parts = [grads.get(n) for n in ("query", "key", "value")]
    rest = {n: g for n, g in grads.items() if n not in ("query", "key", "value")}
    if all(g is None for g in parts):
        return rest
    if isinstance(parts[0], float):
        return {**rest, "x": float(sum(g for g in parts if g is not None))}
    return {**rest, "x": sum(reference.as_float64(g) for g in parts if g is not None)}


def check_gradient(unit: Unit, impls) -> list[Row]:
    rows = []
    for impl in impls:
        why = _skip_reason(unit, impl, "gradient")
        if why:
            rows.append(unit.row("gradient", impl, "oracle", "skip", message=why))
            continue
        policy = impl.policy(unit.case.masked_rows)
        at = unit.judged(impl)
        expected, yard_err = unit.oracle_grads(policy, impl.masked_row_grads, at)
        floors = unit.floors(policy, impl.masked_row_grads, expected, at)
        try:
            out, w, got = unit.runner(impl).vjp(unit.built(impl, policy), *unit.inputs(), unit.x.cotangent)
        except Exception as e:
            rows.append(error_row(unit, "gradient", impl, "oracle", e))
            continue
        if impl.inputs == "self":
            got, expected, yard_err = one_input(got), one_input(expected), one_input(yard_err)
        unit.results[("gradient", impl.name)] = got
        rows += _changed_rows(unit, impl, "gradient", policy)
        # The call autograd differentiated is judged too: its output may differ from the forward check's.
        rows += _judge_forward(unit, impl, policy, out, w, check="gradient",
                               note="the output of the gradient call (autograd on)")

        def explain(filled, failing, expected=expected):
            return _masked_row_note(unit, filled, expected, failing)

        judged = _grad_rows(unit, impl, "oracle", got, expected, yard_err, floors, explain=explain)
        if any(r.status == "fail" for r in judged):
            # A wrong gradient with a right forward is the backward pass's own fault.
            extra = divergence(unit, impl, policy)
            if extra.get("stage") == "output":
                extra["stage"] = "backward"
            judged = _grad_rows(unit, impl, "oracle", got, expected, yard_err, floors, extra, explain)
        rows += judged
        if _versus_torch(impl):
            ref = _ref_name(unit, policy)
            if impl.masked_row_grads != "stop" and _fully_masked_rows(unit):
                rows.append(unit.row("gradient", impl, ref, "skip", message=(
                    f"{impl.name} declares masked_row_grads={impl.masked_row_grads} and this case has fully masked rows; "
                    "our torch module stops their gradient, so it is judged against the oracle only")))
                rows += _changed_rows(unit, impl, "gradient", policy)
                continue
            try:
                base = _torch_reference(unit, policy, "gradient")
            except Exception as e:
                rows.append(error_row(unit, "gradient", impl, ref, e))
                continue
            if impl.inputs == "self":
                base = one_input(base)
            rows += _grad_rows(unit, impl, ref, got, base, yard_err, floors)
        rows += _changed_rows(unit, impl, "gradient", policy)
    return rows


# ---------------------------------------------------------------- training


def check_training(unit: Unit) -> list[Row]:
    torch_impl, jax_impl = builtin("torch"), builtin("jax-jit")
    if unit.dtype not in TRAIN_DTYPES:
        return [unit.row("training", jax_impl, "torch", "skip",
                         message=f"training is compared in {'/'.join(TRAIN_DTYPES)} only")]
    why = unit.unsupported(torch_impl) or unit.unsupported(jax_impl)
    if why:
        return [unit.row("training", jax_impl, "torch", "skip", message=why)]
    rows = []
    policy = unit.case.masked_rows
    x = unit.x
    for opt, hp in OPTIMIZERS.items():
        name, ref = dataclasses.replace(jax_impl, name=f"jax-jit+optax.{opt}"), f"torch+torch.optim.{opt}"
        try:
            t_loss, t_sd = unit.runners["torch"].train(unit.built(torch_impl, policy), opt, hp, TRAIN_STEPS,
                                                       *unit.inputs(), x.target)
            j_loss, j_sd = unit.runners["jax"].train(unit.built(jax_impl, policy), opt, hp, TRAIN_STEPS,
                                                     *unit.inputs(), x.target)
        except Exception as e:
            rows.append(error_row(unit, "training", name, ref, e))
            continue
        c = judge(j_loss, t_loss, unit.tol.forward)
        rows.append(unit.row("training", name, ref, status(c), "loss", c, message=f"{TRAIN_STEPS} steps, final loss {t_loss[-1]:.6g}"))
        # k_proj.bias has an exactly zero gradient (softmax is shift-invariant along keys), so
        # Adam's g/sqrt(v) turns each side's rounding noise into its own +-lr steps: not comparable.
        names = tuple(n for n in t_sd if not (opt.startswith("adam") and n == "k_proj.bias"))
        c, note = judge_grads(j_sd, t_sd, unit.tol.gradient, names)
        if len(names) < len(t_sd):
            note += "; k_proj.bias excluded (true gradient 0: Adam amplifies rounding noise)"
        rows.append(unit.row("training", name, ref, status(c), "params", c, message=note))
    return rows


# ---------------------------------------------------------------- peers


def check_peers(unit: Unit, peers) -> list[Row]:
    rows = []
    for peer in peers:
        if peer.decode:  # a decoder: the decode check runs it
            continue
        why = unit.unsupported(peer)
        if why:
            rows.append(unit.row("peers", peer, "oracle", "skip", message=why))
            continue
        policy = peer.policy(unit.case.masked_rows)
        effective = unit.judged(peer)
        table = TOLERANCES[effective]
        tol, k = table.forward, table.three_way_k
        exact, low = unit.oracle(policy, effective)
        note = f"masked_rows={policy}: {peer.doc}"
        if effective != unit.dtype:
            note += f"; judged at the {effective} tolerance (the precision it computes in)"
        ours_impl = builtin("torch" if peer.framework == "torch" else "jax-jit")
        try:
            out, w = unit.forward(peer, policy)
            ours = unit.runner(peer).forward(unit.built(ours_impl, policy), *unit.inputs())
        except MissingPackage as e:
            rows.append(unit.row("peers", peer, "oracle", "skip", message=f"{peer.name} not run: {e}"))
            continue
        except Exception as e:
            rows.append(error_row(unit, "peers", peer, "oracle", e))
            continue
        for q, a, mine in (("output", out, ours[0]), ("weights", w, ours[1])):
            if a is None:
                continue
            yard = None if low is None else getattr(low, q)
            c = judge(a, getattr(exact, q), tol, k, yard)
            rows.append(unit.row("peers", peer, "oracle", status(c), q, c, message=note))
            yard_err = None if low is None else errors(yard, getattr(exact, q))[0]
            c = judge(a, mine, tol, k, yard_err=yard_err)
            rows.append(unit.row("peers", peer, f"{ours_impl.framework}[{policy}]", status(c), q, c, message=note))
        vjp = getattr(unit.built(peer, policy).fn, "vjp", None)
        # Autodiff of the parameters is checked for the peers that declare variants; the classic
        # framework peers stay forward-only (each gradient is one more XLA compile in the default run).
        if vjp is not None or (peer.uses_params and peer.variants):
            try:
                if vjp is not None:
                    rows += _peer_grad_rows(unit, peer, policy, vjp, TOLERANCES[effective], note)
                else:
                    rows += _peer_autodiff_rows(unit, peer, policy, TOLERANCES[effective], note)
            except Exception as e:
                rows.append(error_row(unit, "peers", peer, "oracle", e))
    return rows


def _peer_autodiff_rows(unit: Unit, peer: Implementation, policy: str, table, note: str) -> list[Row]:
    """A peer that computes with the canonical parameters (uses_params): its framework's autodiff gradients
    w.r.t. query, key, value and every parameter, against the oracle's under the masked-row gradient it declares."""
    at = unit.judged(peer)
    expected, yard = unit.oracle_grads(policy, peer.masked_row_grads, at)
    _, _, got = unit.runner(peer).vjp(unit.built(peer, policy), *unit.inputs(), unit.x.cotangent)
    missing = sorted(n for n in expected if got.get(n) is None)
    if missing:
        raise ValueError(f"{peer.name} gave no gradient for {', '.join(missing)}")
    floors = unit.floors(policy, peer.masked_row_grads, expected, at)
    note = f"{note}; masked_row_grads={peer.masked_row_grads}"
    rows = []
    for group in GRAD_GROUPS:
        c, worst = judge_grads(got, expected, table.gradient, _group(group, expected), table.three_way_k, yard, floors)
        rows.append(unit.row("peers", peer, "oracle", status(c), group, c, message=f"{worst}; {note}"))
    return rows


def _peer_grad_rows(unit: Unit, peer: Implementation, policy: str, vjp, table, note: str) -> list[Row]:
    """A self-attention peer's own gradients (fn.vjp: w.r.t. its one input and its weights) against the
    oracle's, under the masked-row gradient it declares. Its input is the query, key and value at once,
    so its input gradient is judged against the sum of the oracle's three."""
    at = unit.judged(peer)
    expected, yard = unit.oracle_grads(policy, peer.masked_row_grads, at)
    x = unit.x
    structure = unit.structure(peer)
    keep, kw = (x.keep, {}) if structure is None else (structure[1], structure[0])
    got = vjp(x.query, mask_for(peer, keep, unit.case.shape.N, x.query.dtype), x.cotangent,
              **(x.position_kw if peer.takes_problem else {}), **kw)
    expected = dict(expected, input=sum(reference.as_float64(expected[n]) for n in ("query", "key", "value")))
    if yard is not None:  # the sum's error is at most the sum of the three errors
        yard = dict(yard, input=sum(yard[n] for n in ("query", "key", "value")))
    floors = unit.floors(policy, peer.masked_row_grads, expected, at)
    note = f"{note}; masked_row_grads={peer.masked_row_grads}"
    rows = []
    for quantity, names in (("d_input", ("input",)), ("d_params", _group("d_params", expected))):
        c, worst = judge_grads(got, expected, table.gradient, names, table.three_way_k, yard, floors)
        rows.append(unit.row("peers", peer, "oracle", status(c), quantity, c, message=f"{worst}; {note}"))
    return rows


def check_pairs(unit: Unit, impls) -> list[Row]:
    """The user's layers of different frameworks (a torch layer and its JAX port) judged against each
    other, beside each against the oracle: the same bound as implementation-vs-implementation rows
    (each may be off the oracle by it, bias floors included), at the coarser of the two's `computes_in`."""
    users = [i for i in impls if i.role == "user"]
    rows = []
    for n, a in enumerate(users):
        for b in users[n + 1:]:
            if a.framework == b.framework:
                continue
            at = coarser(unit.judged(a), unit.judged(b))
            table = TOLERANCES[at]
            policy = a.policy(unit.case.masked_rows)
            if policy != b.policy(unit.case.masked_rows):
                continue  # fully masked rows differ by their declarations; each is judged against the oracle
            exact, low = unit.oracle(policy, at)
            for check in ("forward", "gradient"):
                ra, rb = unit.results.get((check, a.name)), unit.results.get((check, b.name))
                if ra is None or rb is None:
                    continue
                if check == "forward":
                    for q in ("output", "weights"):
                        if ra.get(q) is None or rb.get(q) is None:
                            continue
                        yard = None if low is None else errors(getattr(low, q), getattr(exact, q))[0]
                        c = judge(ra[q], rb[q], table.forward, table.three_way_k, yard_err=yard)
                        rows.append(unit.row(check, a, b.name, status(c), q, c,
                                             message="" if c.passed else _disagreement(c, ra[q], rb[q])))
                    continue
                if a.masked_row_grads != b.masked_row_grads and _fully_masked_rows(unit):
                    continue
                if "x" in ra or "x" in rb:
                    ra, rb = one_input(ra), one_input(rb)
                expected, yard = unit.oracle_grads(policy, a.masked_row_grads, at)
                floors = unit.floors(policy, a.masked_row_grads, expected, at)
                yard = one_input(yard) if "x" in ra else yard
                for group in GRAD_GROUPS:
                    names = tuple(n for n in _group(group, ra) if rb.get(n) is not None and ra[n] is not None)
                    if names:
                        c, note = judge_grads(ra, rb, table.gradient, names, table.three_way_k, yard, floors)
                        rows.append(unit.row(check, a, b.name, status(c), group, c, message=note))
    return rows


def run_unit(unit: Unit, impls, peers) -> list[Row]:
    rows = []
    if "decode" in unit.checks and unit.case.decode:
        rows += check_decode(unit, impls, peers)
    if "forward" in unit.checks:
        rows += check_forward(unit, impls)
    if "gradient" in unit.checks:
        rows += check_gradient(unit, impls)
    if "leak" in unit.checks:
        rows += check_leak(unit, impls)
    rows += check_pairs(unit, impls)
    if "training" in unit.checks and unit.case.train:
        rows += check_training(unit)
    if "peers" in unit.checks and unit.case.peers:
        rows += check_peers(unit, peers)
    return rows


__all__ = ["Unit", "run_unit", "divergence", "error_row", "check_forward", "check_gradient", "check_leak", "check_training",
           "check_peers"]
