"""The four checks of one (case, dtype) unit, the judge, and the divergence search.

Judging (tolerances from `parity.tolerances`, the one table):
  float64/float32  elementwise atol + rtol * |oracle|, NaNs at the same places.
  16-bit forward   three-way: err(candidate, float64 oracle) <= k * err(oracle's own
                   maths in that dtype, float64 oracle) + atol.
  16-bit gradient  three-way as well, the yardstick being `reference.backward(dtype=...)`:
                   the oracle's backward with every stored stage rounded as the modules
                   store it.
Implementation-vs-implementation rows use the same bound, with the 16-bit yardstick
measured on the oracle (so two candidates may each be off by it).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import numpy as np

from parity import reference
from parity.harness.impls import OURS, PEERS, Impl, Peer
from parity.harness.matrix import Case, Inputs
from parity.harness.report import Row
from parity.tolerances import TOLERANCES, Comparison, Tolerance, compare, compare_three_way, errors

TRAIN_STEPS = 5
TRAIN_DTYPES = ("float64", "float32")  # 16-bit training drifts by design; nothing sharp to compare
# Every hyperparameter set explicitly and equal on both sides: the libraries' defaults
# differ (AdamW weight decay is 1e-4 in optax, 1e-2 in torch).
OPTIMIZERS = {
    "adam": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8},
    "adamw": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
    "sgd": {"lr": 1e-1, "momentum": 0.9},
}

# A peer that computes in a lower precision than its inputs' dtype is judged with
# the table's entry for the dtype it really computes in, and the row says so.
# Measured (seed 0, default matrix): jax.nn.dot_product_attention's float64 output
# is off the float64 oracle by ~1e-8 because its softmax always runs in float32.
PEER_EFFECTIVE_DTYPE = {("jax.nn.dot_product_attention", "float64"): "float32"}

GRAD_GROUPS = {
    "d_inputs": ("query", "key", "value"),
    "d_params": tuple(f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")),
}


def judge(actual, expected, tol: Tolerance, k: float | None = None, yardstick=None, yard_err: float | None = None) -> Comparison:
    """The table's judgement; three-way when k is set and a yardstick is known."""
    if k is None or (yardstick is None and yard_err is None):
        return compare(actual, expected, tol)
    if yardstick is not None:
        return compare_three_way(actual, expected, yardstick, k, tol.atol)
    # Against another candidate: each may be k yardsticks off the oracle, in opposite
    # directions (one 16-bit ulp apart is normal), so the bound is doubled.
    max_abs, max_rel, nan_mismatch = errors(actual, expected)
    atol = 2 * k * yard_err + tol.atol
    return Comparison(max_abs, max_rel, atol, 0.0, nan_mismatch, bool(max_abs <= atol and nan_mismatch == 0))


def _logits(weights, keep, shape4) -> np.ndarray:
    """The scores a softmax saw, up to a per-row constant: log(weights) centred over kept keys.

    Exact for softmax outputs, so the scores stage can be read off any implementation
    that returns weights, with its own core's scale and mask included.
    """
    w = reference.as_float64(weights)
    valid = np.ones(shape4, bool) if keep is None else np.broadcast_to(keep, shape4)
    valid = valid & valid.any(axis=-1, keepdims=True)  # rows that attend to something
    with np.errstate(divide="ignore", invalid="ignore"):
        lw = np.log(np.where(valid, w, 1.0))
    lw = np.where(np.isfinite(lw), lw, np.nan)  # a kept key with weight 0 is a divergence
    n = np.maximum(valid.sum(axis=-1, keepdims=True), 1)
    mean = np.where(valid, lw, 0.0).sum(axis=-1, keepdims=True) / n
    return np.where(valid, lw - mean, 0.0)


@dataclass
class Unit:
    """One (case, dtype): the rounded inputs and the oracles, computed lazily per policy."""

    case: Case
    dtype: str
    x: Inputs  # in the run dtype
    torch_device: str
    jax_device: str
    _oracle: dict = field(default_factory=dict)
    _grads: dict = field(default_factory=dict)

    @property
    def tol(self):
        return TOLERANCES[self.dtype]

    def _args64(self):
        x = self.x
        sd = {k: reference.as_float64(v) for k, v in x.state_dict.items()}
        return sd, *(reference.as_float64(a) for a in (x.query, x.key, x.value))

    def oracle(self, policy: str):
        """(float64 intermediates, same maths in the run dtype or None), on the rounded inputs."""
        if policy not in self._oracle:
            sd, q, k, v = self._args64()
            kw = {"num_heads": self.case.shape.N, "masked_rows": policy}
            exact = reference.forward(sd, q, k, v, self.x.keep, **kw)
            low = None
            if self.tol.three_way_k is not None:
                low = reference.forward(sd, q, k, v, self.x.keep, dtype=self.x.query.dtype, **kw)
            self._oracle[policy] = (exact, low)
        return self._oracle[policy]

    def oracle_grads(self, policy: str):
        """(float64 gradients, per-key yardstick errors of the same maths in the run dtype or None)."""
        if policy not in self._grads:
            sd, q, k, v = self._args64()
            cot = reference.as_float64(self.x.cotangent)
            kw = {"num_heads": self.case.shape.N, "masked_rows": policy}
            exact = reference.backward(sd, q, k, v, self.x.keep, cot, **kw)
            yard = None
            if self.tol.three_way_k is not None:
                low = reference.backward(sd, q, k, v, self.x.keep, cot, dtype=self.x.query.dtype, **kw)
                yard = {n: errors(low[n], exact[n])[0] for n in exact}
            self._grads[policy] = (exact, yard)
        return self._grads[policy]

    def device(self, framework: str) -> str:
        return self.torch_device if framework == "torch" else self.jax_device

    def row(self, check, impl, ref, status, quantity="", cmp: Comparison | None = None, **kw) -> Row:
        framework = "jax" if impl.startswith(("jax", "flax")) else "torch"
        nums = {}
        if cmp is not None:
            nums = dict(max_abs_err=cmp.max_abs_err, max_rel_err=cmp.max_rel_err, atol=cmp.atol, rtol=cmp.rtol)
            if cmp.nan_mismatch and "NaN" not in kw.get("message", ""):
                kw["message"] = (f"{cmp.nan_mismatch} NaN-placement mismatches; " + kw.get("message", "")).strip("; ")
        return Row(self.case.name, check, impl, ref, self.dtype, self.device(framework), status, quantity, **nums, **kw)


def nan_note(actual, expected) -> str:
    """Which way NaN placements differ, e.g. a fused path with finite gradients where the oracle has NaN."""
    a, e = np.isnan(reference.as_float64(actual)), np.isnan(reference.as_float64(expected))
    parts = []
    if (n := int(np.count_nonzero(~a & e))):
        parts.append(f"{n} finite where the reference is NaN")
    if (n := int(np.count_nonzero(a & ~e))):
        parts.append(f"{n} NaN where the reference is finite")
    return ", ".join(parts)


def _status(c: Comparison) -> str:
    return "pass" if c.passed else "fail"


def _error_row(unit: Unit, check: str, name: str, ref: str, exc: BaseException) -> Row:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return unit.row(check, name, ref, "error", message=f"{type(exc).__name__}: {exc}"[:500] + where)


def divergence(side, impl: Impl, unit: Unit, policy: str) -> str:
    """The first stage (reference.STAGES order) where the implementation leaves the oracle."""
    exact, low = unit.oracle(policy)
    tol, k = unit.tol.forward, unit.tol.three_way_k
    s = unit.case.shape
    got = side.stages(impl, unit.x, unit.case, policy)
    if "weights" in got:
        shape4 = (s.B, s.N, s.T, s.S)
        got["scores"] = _logits(got["weights"], unit.x.keep, shape4)
        exact_scores = _logits(exact.weights, unit.x.keep, shape4)
        low_scores = None if low is None else _logits(low.weights, unit.x.keep, shape4)
    for stage in reference.STAGES:
        if stage not in got:
            continue
        if stage == "scores":
            expected, yard = exact_scores, low_scores
        else:
            expected, yard = getattr(exact, stage), None if low is None else getattr(low, stage)
        if not judge(got[stage], expected, tol, k, yard).passed:
            return stage
    return "output"


def _diverge_or_note(side, impl, unit, policy) -> dict:
    try:
        return {"stage": divergence(side, impl, unit, policy)}
    except Exception as e:  # the search is a diagnosis; its failure must not hide the row
        return {"message": f"divergence search failed: {type(e).__name__}: {e}"}


# ---------------------------------------------------------------- forward


def check_forward(unit: Unit, sides: dict, impls) -> list[Row]:
    rows = []
    policy = unit.case.masked_rows
    exact, low = unit.oracle(policy)
    tol, k = unit.tol.forward, unit.tol.three_way_k
    yard_err = {q: (None if low is None else errors(getattr(low, q), getattr(exact, q))[0]) for q in ("output", "weights")}
    results = {}
    for impl in impls:
        if impl.framework == "jax" and impl.mode == "eager" and not unit.case.jax_eager:
            continue
        side = sides[impl.framework]
        try:
            out, w = side.forward(impl, unit.x, unit.case, policy)
        except Exception as e:
            rows.append(_error_row(unit, "forward", impl.name, "oracle", e))
            continue
        results[impl.name] = {"output": out, "weights": w}
        failed = False
        quantities = [("output", out)] + ([] if w is None else [("weights", w)])
        cmps = [(q, judge(a, getattr(exact, q), tol, k, None if low is None else getattr(low, q))) for q, a in quantities]
        failed = any(not c.passed for _, c in cmps)
        extra = _diverge_or_note(side, impl, unit, policy) if failed else {}
        for q, c in cmps:
            kw = dict(extra) if not c.passed else {}
            if c.nan_mismatch:
                kw["message"] = "NaN placement differs: " + nan_note(dict(quantities)[q], getattr(exact, q))
            rows.append(unit.row("forward", impl.name, "oracle", _status(c), q, c, **kw))
    # ours-jax against ours-torch (eager, materialised weights) on the same inputs.
    base = results.get("torch")
    for impl in impls:
        if impl.framework != "jax" or impl.name not in results or base is None:
            continue
        for q in ("output", "weights"):
            a = results[impl.name][q]
            if a is None:
                continue
            c = judge(a, base[q], tol, k, yard_err=yard_err[q])
            rows.append(unit.row("forward", impl.name, "torch", _status(c), q, c))
    return rows


# ---------------------------------------------------------------- gradients


def _judge_grads(got: dict, expected: dict, tol: Tolerance, names, k=None, yard_err=None) -> tuple[Comparison, str]:
    """Judge several arrays as one row; the row shows the worst (by error over its bound)."""
    cmps = {n: judge(got[n], expected[n], tol, k, yard_err=None if yard_err is None else yard_err[n]) for n in names}

    def badness(n):
        c = cmps[n]
        return (not c.passed, c.max_abs_err / (c.atol + c.rtol * 1.0 or 1e-300))

    worst = max(names, key=badness)
    c = cmps[worst]
    total_nan = sum(x.nan_mismatch for x in cmps.values())
    merged = Comparison(c.max_abs_err, c.max_rel_err, c.atol, c.rtol, total_nan, all(x.passed for x in cmps.values()))
    note = f"worst: {worst}" + ("" if c.passed else " (fails)")
    nans = [f"{n}: {nan_note(got[n], expected[n])}" for n in names if cmps[n].nan_mismatch]
    if nans:
        note += f"; NaN placement differs in {'; '.join(nans)}"
    return merged, note


def check_gradient(unit: Unit, sides: dict, impls) -> list[Row]:
    rows = []
    policy = unit.case.masked_rows
    tol, k = unit.tol.gradient, unit.tol.three_way_k
    expected, yard_err = unit.oracle_grads(policy)
    results = {}
    for impl in impls:
        if impl.mode == "eager" and impl.framework == "jax":
            continue  # eager jax.grad traces the same program as jax-jit, op by op: slow, adds nothing
        side = sides[impl.framework]
        try:
            got = side.grads(impl, unit.x, unit.case, policy)
        except Exception as e:
            rows.append(_error_row(unit, "gradient", impl.name, "oracle", e))
            continue
        results[impl.name] = got
        judged = [(g, *_judge_grads(got, expected, tol, names, k, yard_err)) for g, names in GRAD_GROUPS.items()]
        extra = {}
        if any(not c.passed for _, c, _ in judged):
            # A wrong gradient with a right forward is the backward pass's own fault.
            extra = _diverge_or_note(side, impl, unit, policy)
            if extra.get("stage") == "output":
                extra["stage"] = "backward"
        for g, c, note in judged:
            kw = dict(extra) if not c.passed else {}
            kw["message"] = (kw.get("message", "") + " " + note).strip()
            rows.append(unit.row("gradient", impl.name, "oracle", _status(c), g, c, **kw))
    base = results.get("torch")
    for impl in impls:
        if impl.framework != "jax" or impl.name not in results or base is None:
            continue
        for g, names in GRAD_GROUPS.items():
            c, note = _judge_grads(results[impl.name], base, tol, names, k, yard_err)
            rows.append(unit.row("gradient", impl.name, "torch", _status(c), g, c, message=note))
    return rows


# ---------------------------------------------------------------- training


def check_training(unit: Unit, sides: dict) -> list[Row]:
    rows = []
    if unit.dtype not in TRAIN_DTYPES:
        return [unit.row("training", "jax-jit+optax", "torch+torch.optim", "skip",
                         message=f"training is compared in {'/'.join(TRAIN_DTYPES)} only")]
    policy = unit.case.masked_rows
    for opt, hp in OPTIMIZERS.items():
        name, ref = f"jax-jit+optax.{opt}", f"torch+torch.optim.{opt}"
        try:
            t_loss, t_sd = sides["torch"].train(opt, hp, TRAIN_STEPS, unit.x, unit.case, policy)
            j_loss, j_sd = sides["jax"].train(opt, hp, TRAIN_STEPS, unit.x, unit.case, policy)
        except Exception as e:
            rows.append(_error_row(unit, "training", name, ref, e))
            continue
        c = compare(j_loss, t_loss, unit.tol.forward)
        rows.append(unit.row("training", name, ref, _status(c), "loss", c, message=f"{TRAIN_STEPS} steps, final loss {t_loss[-1]:.6g}"))
        # k_proj.bias has an exactly zero gradient (softmax is shift-invariant along keys), so
        # Adam's g/sqrt(v) turns each side's rounding noise into its own +-lr steps: not comparable.
        names = tuple(n for n in t_sd if not (opt.startswith("adam") and n == "k_proj.bias"))
        c, note = _judge_grads(j_sd, t_sd, unit.tol.gradient, names)
        if len(names) < len(t_sd):
            note += "; k_proj.bias excluded (true gradient 0: Adam amplifies rounding noise)"
        rows.append(unit.row("training", name, ref, _status(c), "params", c, message=note))
    return rows


# ---------------------------------------------------------------- peers


def check_peers(unit: Unit, sides: dict, peers=PEERS) -> list[Row]:
    rows = []
    for peer in peers:
        policy = peer.masked_rows
        effective = PEER_EFFECTIVE_DTYPE.get((peer.name, unit.dtype), unit.dtype)
        table = TOLERANCES[effective]
        tol, k = table.forward, table.three_way_k
        exact, low = unit.oracle(policy)
        note = f"masked_rows={policy}: {peer.note}"
        if effective != unit.dtype:
            note += f"; judged at the {effective} tolerance (the precision it computes in)"
        side = sides[peer.framework]
        try:
            out, w = side.peer(peer, unit.x, unit.case)
            ours = side.forward(Impl("ours", peer.framework, "eager", False), unit.x, unit.case, policy)
        except Exception as e:
            rows.append(_error_row(unit, "peers", peer.name, "oracle", e))
            continue
        ours_name = "torch" if peer.framework == "torch" else "jax"
        for q, a, mine in (("output", out, ours[0]), ("weights", w, ours[1])):
            if a is None:
                continue
            yard = None if low is None else getattr(low, q)
            c = judge(a, getattr(exact, q), tol, k, yard)
            rows.append(unit.row("peers", peer.name, "oracle", _status(c), q, c, message=note))
            yard_err = None if low is None else errors(yard, getattr(exact, q))[0]
            c = judge(a, mine, tol, k, yard_err=yard_err)
            rows.append(unit.row("peers", peer.name, f"{ours_name}[{policy}]", _status(c), q, c, message=note))
    return rows


def run_unit(unit: Unit, sides: dict, checks, impls) -> list[Row]:
    rows = []
    if "forward" in checks:
        rows += check_forward(unit, sides, impls)
    if "gradient" in checks:
        rows += check_gradient(unit, sides, impls)
    if "training" in checks and unit.case.train:
        rows += check_training(unit, sides)
    if "peers" in checks and unit.case.peers:
        rows += check_peers(unit, sides)
    return rows


def select_impls(names=None, compile: bool = False) -> tuple[Impl, ...]:
    impls = [i for i in OURS if compile or i.mode != "compile"]
    if names:
        unknown = set(names) - {i.name for i in OURS}
        if unknown:
            raise ValueError(f"unknown implementations {sorted(unknown)}; known: {[i.name for i in OURS]}")
        impls = [i for i in OURS if i.name in names and (compile or i.mode != "compile")]
    return tuple(impls)


__all__ = ["Peer", "Unit", "run_unit", "select_impls", "judge", "divergence"]
