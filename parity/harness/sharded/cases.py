"""What a sharded check runs and how it is judged; imports neither framework.

A `Job` is one (framework, sharding, device count, layer, mask kind, policy, dtype). The
layer and its sizes are an `mha_spec.Problem` (`PROBLEMS`): the classic layer and a
grouped-query layer with RoPE and bias-free projections. A job's inputs are a seeded draw
(`inputs`), and a worker computes the sharded output and gradients and the one-device
module's, and `judge_job` turns them into report rows: each quantity against the float64
oracle and against the one-device run, with the tolerance table (an all-reduce sums
partial products in another order, so nothing here is bitwise).

Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from mha_spec import SHARDINGS, AttentionConfig, Problem
from parity import draw, reference
from parity.dtypes import numpy_dtype
from parity.harness.judge import judge_grads, status
from parity.harness.report import Row
from parity.implementation import FRAMEWORKS
from parity.tolerances import tolerance_for

JAX_ONLY_SHARDINGS = ("tp-gspmd",)  # the unchanged module, parameters head-sharded, GSPMD under jit

# Within a layer, sizes pairwise distinct and divisible by 2 and 4 where a sharding splits them:
# dp splits B, tp the query heads N and the key/value heads K, sp T and S (cross-attention).
PROBLEMS = {
    "classic": Problem(AttentionConfig(24, 8), B=4, T=16, S=12),  # H=3
    # Llama-style: 2 query heads per key/value head, rotate-half RoPE (H even), no biases.
    "grouped-rope": Problem(AttentionConfig(96, 16, num_kv_heads=8, qkv_bias=False, out_bias=False, rope="half"),
                            B=4, T=20, S=12),  # H=6
}
"""The layers and sizes the sharded check runs (masked_rows is the job's)."""

SHARDED_MASK_KINDS = ("none", "random", "random-heads")
"""none; random: a keep-mask per batch row (B, 1, T, S) with a fully masked row, a full row and a row
empty in every ring block but the last; random-heads: one per head (B, N, T, S), tp cuts it with the heads."""

MASK_POLICIES = (("none", "nan"), ("random", "nan"), ("random", "zero"), ("random", "uniform"), ("random-heads", "zero"))
"""Every mask kind and every policy, each policy meeting fully masked rows. The policies matter for
sharding where a fill needs the whole sequence (mean V over the ring's blocks); the masks where a
sharding cuts them (query rows, heads, batch rows) and where the ring slices them per key block."""

PLANTS = {
    "bias_per_shard": "tp",  # the out bias added on every shard before the all-reduce
    "bias_grad_div": "tp",  # the out bias gradient divided by the shard count
    "ring_mask_offset": "sp",  # the key-block mask sliced one block off
    "ring_local_positions": "sp",  # each ring block rotated with positions counted from its own start
}
"""Planted bugs for the tests, and the sharding each one breaks."""


@dataclass(frozen=True)
class Job:
    framework: str
    sharding: str
    devices: int
    mask: str
    masked_rows: str
    dtype: str
    seed: int = 0
    layer: str = "classic"

    def __post_init__(self):
        if self.layer not in PROBLEMS:
            raise ValueError(f"unknown layer {self.layer!r}; known: {tuple(PROBLEMS)}")
        if self.mask not in SHARDED_MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.mask!r}; known: {SHARDED_MASK_KINDS}")

    @property
    def problem(self) -> Problem:
        """The layer with this job's masked-row policy, and its sizes."""
        p = PROBLEMS[self.layer]
        return dataclasses.replace(p, config=dataclasses.replace(p.config, masked_rows=self.masked_rows))

    @property
    def case(self) -> str:
        return f"{self.layer}/{self.mask}/{self.masked_rows}"

    @property
    def impl(self) -> str:
        return f"{self.framework}-{self.sharding}"

    def to_dict(self) -> dict:
        return asdict(self)


def jobs(*, devices: int, shardings=SHARDINGS, frameworks=FRAMEWORKS, dtypes=("float64", "float32"),
         mask_policies=MASK_POLICIES, layers=tuple(PROBLEMS), seed: int = 0) -> list[Job]:
    """Every (framework, dtype, layer, sharding, mask and policy) job, in that order; each selection is a
    set (a repeated name runs once, first-seen order), and an unknown sharding, framework or layer is a
    ValueError."""
    shardings, frameworks, dtypes, mask_policies, layers = (tuple(dict.fromkeys(x)) for x in (shardings, frameworks, dtypes, mask_policies, layers))
    for name, allowed, given in (("sharding", SHARDINGS + JAX_ONLY_SHARDINGS, shardings), ("framework", FRAMEWORKS, frameworks),
                                 ("layer", tuple(PROBLEMS), layers)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise ValueError(f"unknown {name}(s) {bad}; known: {allowed}")
    return [
        Job(fw, sharding, devices, mask, policy, dtype, seed, layer)
        for fw in frameworks for dtype in dtypes for layer in layers for sharding in shardings for mask, policy in mask_policies
        if fw == "jax" or sharding not in JAX_ONLY_SHARDINGS
    ]


def unsplittable(job: Job) -> str:
    """Why `job.devices` cannot split what the job's sharding splits ("" if it can). A RoPE whose table follows
    the call (LongRoPE) under dp: each rank's call sees only its rows of the per-row positions the jobs draw,
    and the module refuses it (its table follows the whole batch's largest position)."""
    p = job.problem
    scaling = p.config.rope_scaling
    if job.sharding == "dp" and scaling is not None and scaling.switches:
        return (f"data parallel does not run rope_scaling {scaling.kind!r} with per-row positions: a rank sees only "
                "its rows, the table follows the whole batch's largest position")
    heads = {"N": p.config.num_heads} | ({"K": p.config.kv_heads} if "grouped" in p.config.features else {})
    sizes = {"tp": heads, "sp": {"T": p.T, "S": p.S}, "dp": {"B": p.B}}
    bad = [f"{k}={v}" for k, v in sizes["tp" if job.sharding == "tp-gspmd" else job.sharding].items() if v % job.devices]
    return f"{', '.join(bad)} not divisible by {job.devices} devices" if bad else ""


@dataclass(frozen=True)
class JobInputs:
    """A job's inputs in its dtype (NumPy), the keep-mask and positions, and the float64 oracle's answers."""

    query: np.ndarray  # (B, T, E)
    key: np.ndarray  # (B, S, E)
    value: np.ndarray  # (B, S, E)
    keep: np.ndarray | None  # bool (B, 1|N, T, S)
    positions: np.ndarray | None  # int64 (B, T), RoPE only
    key_positions: np.ndarray | None  # int64 (B, S), RoPE only
    state_dict: dict  # canonical names, torch layout; only the biases the layer has
    cotangent: np.ndarray  # (B, T, E)
    oracle_output: np.ndarray
    oracle_grads: dict

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.state_dict))


def _keep_mask(kind: str, p: Problem, rng: np.random.Generator) -> np.ndarray | None:
    B, N, T, S = p.B, p.config.num_heads, p.T, p.S
    if kind == "none":
        return None
    keep = rng.random((B, N if kind == "random-heads" else 1, T, S)) < 0.7
    keep[-1, -1, 0, :] = False  # a fully masked row (in one head only, for a mask per head)
    keep[0, 0, -1, :] = True  # a full row
    # Row 2 of batch 0 keeps only the last key: empty in every key block but the last, so a
    # ring that took a block's emptiness for the row's would zero or NaN it.
    keep[0, :, 2, :] = False
    keep[0, :, 2, -1] = True
    return keep


def _positions(rng: np.random.Generator, B: int, L: int) -> np.ndarray:
    """Per batch row, increasing positions from a random offset with a gap: not arange(L), so a
    block rotated with positions counted from its own start (or from 0) is wrong."""
    steps = np.ones((B, L), dtype=np.int64)
    steps[:, L // 2] = 3
    return rng.integers(0, 50, size=(B, 1)) + np.cumsum(steps, axis=1) - 1


def inputs(job: Job) -> JobInputs:
    """A job's draw: a pure function of (seed, layer, mask kind), rounded to the job's dtype.
    Jobs that differ only in their sharding, policy or dtype see the same numbers."""
    p, dtype = job.problem, numpy_dtype(job.dtype)
    cfg = p.config
    rng = np.random.default_rng([job.seed, zlib.crc32(f"{job.layer}/{job.mask}".encode())])
    bound = 1.0 / np.sqrt(cfg.embed_dim)  # torch.nn.Linear's default init
    sd = {name: rng.uniform(-bound, bound, shape) for name, shape in cfg.weight_shapes().items()}
    query, key, value = (draw.activations(rng, p.B, L, cfg.embed_dim) for L in (p.T, p.S, p.S))
    keep = _keep_mask(job.mask, p, rng)
    cotangent = rng.standard_normal((p.B, p.T, cfg.embed_dim)) / np.sqrt(p.B * p.T)
    pos = (_positions(rng, p.B, p.T), _positions(rng, p.B, p.S)) if cfg.rope else (None, None)
    low = [np.asarray(x, dtype=dtype) for x in (query, key, value, cotangent)]
    sd_low = {k: np.asarray(v, dtype=dtype) for k, v in sd.items()}
    as64 = [reference.as_float64(x) for x in low]
    sd64 = {k: reference.as_float64(v) for k, v in sd_low.items()}
    kw = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "masked_rows": cfg.masked_rows, "rope": cfg.rope,
          "rope_theta": cfg.rope_theta, "positions": pos[0], "key_positions": pos[1], "rope_dim": cfg.rope_dim,
          "rope_scaling": cfg.rope_scaling}
    out = reference.forward(sd64, *as64[:3], keep, **kw).output
    grads = reference.backward(sd64, *as64[:3], keep, as64[3], **kw)
    return JobInputs(*low[:3], keep, *pos, sd_low, low[3], out, grads)


def judge_job(job: Job, inp: JobInputs, sharded: dict, one_device: dict, device: str) -> list[Row]:
    """Rows for output, d_inputs and d_params, against the oracle and the one-device run.

    sharded / one_device: {"output": (B, T, E), "query": ..., "q_proj.weight": ..., ...} as
    NumPy arrays in torch's layout (weight (out, in)), one entry per parameter the layer has.
    """
    tol = tolerance_for(numpy_dtype(job.dtype))
    rows = []
    groups = (("output", ("output",), tol.forward), ("d_inputs", ("query", "key", "value"), tol.gradient),
              ("d_params", inp.param_names, tol.gradient))
    for ref_name, expected in (("oracle", {"output": inp.oracle_output, **inp.oracle_grads}), ("one-device", one_device)):
        for quantity, names, t in groups:
            c, note = judge_grads(sharded, expected, t, names)
            rows.append(Row(
                job.case, "sharded", job.impl, ref_name, job.dtype, device, status(c), quantity,
                c.max_abs_err, c.max_rel_err, c.atol, c.rtol, margin=c.margin,
                stage="" if c.passed else f"{job.sharding}:{'forward' if quantity == 'output' else 'backward'}",
                message=f"{job.sharding} over {job.devices} devices; {note}",
            ))
    return rows


def error_rows(job: Job, device: str, message: str) -> list[Row]:
    return [Row(job.case, "sharded", job.impl, "oracle", job.dtype, device, "error", "", message=message)]
