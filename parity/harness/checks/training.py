"""The training check: our torch module and our JAX module (jitted) trained side by side, the same steps of
the same optimizer with the same hyperparameters, their losses and final parameters compared."""

from __future__ import annotations

import dataclasses

from parity.harness.checks.check import Check
from parity.harness.judge import judge, judge_grads, status
from parity.harness.report import Row, error_row
from parity.impls import builtin

TRAIN_STEPS = 5
TRAIN_DTYPES = ("float64", "float32")  # 16-bit training drifts by design; nothing sharp to compare
# Every hyperparameter set explicitly and equal on both sides: the libraries' defaults
# differ (AdamW weight decay is 1e-4 in optax, 1e-2 in torch).
OPTIMIZERS = {
    "adam": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8},
    "adamw": {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
    "sgd": {"lr": 1e-1, "momentum": 0.9},
}


def check_training(unit) -> list[Row]:
    torch_impl, jax_impl = builtin("torch"), builtin("jax-jit")
    if unit.dtype not in TRAIN_DTYPES:
        return [unit.row("training", jax_impl, "torch", "skip",
                         message=f"training is compared in {'/'.join(TRAIN_DTYPES)} only")]
    why = unit.why_not_here(torch_impl) or unit.why_not_here(jax_impl)
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


CHECK = Check("training", lambda unit, impls, peers: check_training(unit), flag="train", on_checkpoint="never")

__all__ = ["check_training", "TRAIN_STEPS", "TRAIN_DTYPES", "OPTIMIZERS", "CHECK"]
