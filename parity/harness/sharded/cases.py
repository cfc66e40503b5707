"""What a sharded check runs and how it is judged; imports neither framework.

A `Job` is one (framework, layout, device count, case, dtype). Its inputs come from the
harness's seeded draw (`parity.harness.matrix.draw_inputs`), so a sharded row and a
one-device row of the same case see the same numbers. A worker computes the sharded
output and gradients and the one-device module's, and `judge_job` turns them into
report rows: each quantity against the float64 oracle and against the one-device run,
with the tolerance table (an all-reduce sums partial products in another order, so
nothing here is bitwise).

Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parity import reference
from parity.dtypes import numpy_dtype
from parity.harness.judge import judge_grads, status
from parity.harness.matrix import Case, Shape, draw_inputs
from parity.harness.report import Row
from parity.tolerances import tolerance_for

LAYOUTS = ("tp", "sp", "dp")
JAX_ONLY_LAYOUTS = ("tp-gspmd",)  # the unchanged module, parameters head-sharded, GSPMD under jit
FRAMEWORKS = ("torch", "jax")
HEAD_MASK = "random-heads"
"""A random keep-mask with a head axis (B, N, T, S): tp cuts it with the heads."""
MASK_POLICIES = (("none", "nan"), ("padding", "zero"), ("causal", "nan"), ("random", "nan"), ("random", "zero"),
                 ("random", "uniform"), (HEAD_MASK, "zero"))
"""Every mask kind and every policy, each policy meeting fully masked rows (as the harness's default)."""

# Pairwise distinct and divisible by 2 and 4 where a layout splits them:
# dp splits B=4, tp splits N=8 (H=3), sp splits T=16 and S=12 (cross-attention).
SHAPE = Shape("sharded", B=4, T=16, S=12, E=24, N=8, cross=True)

PLANTS = {
    "bias_per_shard": "tp",  # the out bias added on every shard before the all-reduce
    "bias_grad_div": "tp",  # the out bias gradient divided by the shard count
    "ring_mask_offset": "sp",  # the key-block mask sliced one block off
}
"""Planted bugs for the tests, and the layout each one breaks."""

GRAD_GROUPS = {
    "d_inputs": ("query", "key", "value"),
    "d_params": tuple(f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")),
}


@dataclass(frozen=True)
class Job:
    framework: str
    layout: str
    devices: int
    mask: str
    masked_rows: str
    dtype: str
    seed: int = 0

    @property
    def case(self) -> Case:
        return Case(SHAPE, "random" if self.mask == HEAD_MASK else self.mask, self.masked_rows,
                    name=f"{SHAPE.name}/{self.mask}/{self.masked_rows}")

    @property
    def impl(self) -> str:
        return f"{self.framework}-{self.layout}"

    def to_dict(self) -> dict:
        return asdict(self)


def jobs(*, devices: int, layouts=LAYOUTS, frameworks=FRAMEWORKS, dtypes=("float64", "float32"),
         mask_policies=MASK_POLICIES, seed: int = 0) -> list[Job]:
    """Every (framework, dtype, layout, mask and policy) job, in that order; each selection is a set
    (a repeated name runs once, first-seen order), and an unknown layout or framework is a ValueError."""
    layouts, frameworks, dtypes, mask_policies = (tuple(dict.fromkeys(x)) for x in (layouts, frameworks, dtypes, mask_policies))
    for name, allowed, given in (("layout", LAYOUTS + JAX_ONLY_LAYOUTS, layouts), ("framework", FRAMEWORKS, frameworks)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise ValueError(f"unknown {name}(s) {bad}; known: {allowed}")
    return [
        Job(fw, layout, devices, mask, policy, dtype, seed)
        for fw in frameworks for dtype in dtypes for layout in layouts for mask, policy in mask_policies
        if fw == "jax" or layout not in JAX_ONLY_LAYOUTS
    ]


@dataclass(frozen=True)
class Problem:
    """A job's inputs in its dtype (NumPy), the keep-mask, and the float64 oracle's answers."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    keep: np.ndarray | None  # bool (B, 1, T, S)
    state_dict: dict
    cotangent: np.ndarray
    oracle_output: np.ndarray
    oracle_grads: dict


def _row_empty_within_blocks(keep: np.ndarray) -> np.ndarray:
    """Make query row 2 of batch 0 keep only the last key: empty in every key block but the last,
    so a ring that took a block's emptiness for the row's would zero or NaN it."""
    keep = keep.copy()
    keep[0, :, 2, :] = False
    keep[0, :, 2, -1] = True
    return keep


def problem(job: Job) -> Problem:
    dtype = numpy_dtype(job.dtype)
    inp = draw_inputs(job.case, job.seed)
    keep = inp.keep
    if job.mask == HEAD_MASK:  # one random mask per head, from the case's own draw
        rng = np.random.default_rng([job.seed, SHAPE.N])
        keep = rng.random((SHAPE.B, SHAPE.N, SHAPE.T, SHAPE.S)) < 0.7
        keep[-1, 1, 0, :] = False  # a fully masked row in one head only
    keep = None if keep is None else _row_empty_within_blocks(keep)
    low = inp.in_dtype(dtype)
    as64 = [reference.as_float64(x) for x in (low.query, low.key, low.value, low.cotangent)]
    sd64 = {k: reference.as_float64(v) for k, v in low.state_dict.items()}
    kw = {"num_heads": SHAPE.N, "masked_rows": job.masked_rows}
    out = reference.forward(sd64, *as64[:3], keep, **kw).output
    grads = reference.backward(sd64, *as64[:3], keep, as64[3], **kw)
    return Problem(low.query, low.key, low.value, keep, low.state_dict, low.cotangent, out, grads)


def judge_job(job: Job, prob: Problem, sharded: dict, one_device: dict, device: str) -> list[Row]:
    """Rows for output, d_inputs and d_params, against the oracle and the one-device run.

    sharded / one_device: {"output": (B, T, E), "query": ..., "q_proj.weight": ..., ...} as
    NumPy arrays in torch's layout (weight (out, in)).
    """
    tol = tolerance_for(numpy_dtype(job.dtype))
    rows = []
    for ref_name, expected in (("oracle", {"output": prob.oracle_output, **prob.oracle_grads}), ("one-device", one_device)):
        for quantity, names, t in (("output", ("output",), tol.forward), ("d_inputs", GRAD_GROUPS["d_inputs"], tol.gradient),
                                   ("d_params", GRAD_GROUPS["d_params"], tol.gradient)):
            c, note = judge_grads(sharded, expected, t, names)
            passed = c.passed
            rows.append(Row(
                job.case.name, "sharded", job.impl, ref_name, job.dtype, device, status(c), quantity,
                c.max_abs_err, c.max_rel_err, c.atol, c.rtol,
                stage="" if passed else f"{job.layout}:{'forward' if quantity == 'output' else 'backward'}",
                message=f"{job.layout} over {job.devices} devices; {note}",
            ))
    return rows


def error_rows(job: Job, device: str, message: str) -> list[Row]:
    return [Row(job.case.name, "sharded", job.impl, "oracle", job.dtype, device, "error", "", message=message)]
