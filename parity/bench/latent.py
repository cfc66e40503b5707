"""`mha-bench latent`: DeepSeek's multi-head latent attention timed -- forward, forward+backward, and the decode
step from the latent cache against the cache of expanded keys and values (the time and the memory each holds).

    mha-bench latent [--batch B] [--seq T] [--decode S] [--embed E] [--heads N] [--q-lora-rank Q|none]
                     [--kv-lora-rank C] [--qk-nope-head-dim Dn] [--qk-rope-head-dim Dr] [--v-head-dim Dv]
                     [--rope interleaved|half] [--dtype float32|bfloat16] [--passes fwd,fwd+bwd,decode]
                     [--frameworks torch,jax] [--processes P] [--budget SECONDS] [--threads K] [--seed N]
                     [--json P] [--markdown P]

Implementations (`ours-<framework>:<form>`): fwd and fwd+bwd, causal over T tokens, `eager` (the weights
materialised) and `fused` (torch SDPA; JAX without the weights); decode, one token after S cached ones,
`latent` (the latent cache read naively: keys and values expanded through kv_b_proj at every step),
`absorbed` (kv_b_proj folded into the query and the output, DeepSeek's inference form) and, torch only, `kv`
(a cache of the expanded per-head keys and values, what a plain multi-head cache of this layer holds).

Every implementation gets the same canonical weights (norm weights and biases drawn away from their init) and
inputs; before timing, each one's output (and fwd+bwd's gradients) is held to the float64 oracle
(`parity.reference_mla`; decode: the last token of the causal forward over the S + 1 tokens) at the bench's
bounds (`measure.same_output`, `same_gradients`): one that computes something else is an error row, not timed.
Each worker process (`--processes`, one after the other) times every implementation of a pass round-robin
(`measure.sample`) with the interference probe at each round's end; verdicts for every pair of a pass come from
all processes' paired samples (`verdict.compute`, its hierarchical interval) and are conclusive only as
`verdict.finalize` rules (two processes, six rounds, no interference). Speed means something only on a quiet
machine; the processor is in the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np

from mha_spec import LatentAttentionConfig
from mha_spec.files import check_writable, write_atomic
from parity.bench import stepped
from parity.bench import verdict as verdicts
from parity.cli_args import comma_separated, positive_float, positive_int
from parity.implementation import FRAMEWORKS

SCHEMA = "mha-bench-latent/1"
PASSES = ("fwd", "fwd+bwd", "decode")
FORMS = {"fwd": ("eager", "fused"), "fwd+bwd": ("eager", "fused"), "decode": ("latent", "absorbed", "kv")}
DTYPES = ("float32", "bfloat16")
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class LatentBench:
    """What one run times: the layer, the sizes, the dtype, the passes and frameworks, and how."""

    layer: LatentAttentionConfig
    batch: int = 1
    seq: int = 256  # T of fwd and fwd+bwd
    decode: int = 1024  # S, the cached tokens of the decode step
    dtype: str = "float32"
    passes: tuple = PASSES
    frameworks: tuple = FRAMEWORKS
    processes: int = 2
    budget_s: float = 1.0
    threads: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        for name, known in (("passes", PASSES), ("frameworks", FRAMEWORKS)):
            bad = [x for x in getattr(self, name) if x not in known]
            if bad or not getattr(self, name):
                raise ValueError(f"{name} {list(getattr(self, name))} must be a non-empty subset of {known}")

    def keys(self, pass_: str) -> list[tuple[str, str, str]]:
        """(key, framework, form) of the implementations a pass times (JAX has no expanded-kv form)."""
        return [(f"ours-{fw}:{form}", fw, form) for fw in self.frameworks for form in FORMS[pass_]
                if not (fw == "jax" and form == "kv")]

    def label(self, pass_: str) -> str:
        """The case as rows and verdicts name it."""
        c = self.layer
        sizes = f"S={self.decode} (decode)" if pass_ == "decode" else f"T={self.seq}"
        q = f"Q={c.q_lora_rank}" if c.q_lora_rank is not None else "q_proj"
        return (f"B={self.batch} {sizes} E={c.embed_dim} N={c.num_heads} {q} C={c.kv_lora_rank} "
                f"Dn={c.qk_nope_head_dim} Dr={c.qk_rope_head_dim} Dv={c.v_head_dim} rope={c.rope} {self.dtype}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer"] = layer_json(self.layer)
        d["passes"], d["frameworks"] = list(self.passes), list(self.frameworks)
        return d

    @classmethod
    def from_json(cls, d: dict) -> LatentBench:
        return cls(**{**d, "layer": layer_of(d["layer"]), "passes": tuple(d["passes"]),
                      "frameworks": tuple(d["frameworks"])})


def layer_json(c: LatentAttentionConfig) -> dict:
    return {k: (str(v) if k == "rope_scaling" and v is not None else v) for k, v in asdict(c).items()}


def layer_of(d: dict) -> LatentAttentionConfig:
    from mha_spec import RopeScaling

    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling.parse(d["rope_scaling"])
    return LatentAttentionConfig(**d)


# ---------------------------------------------------------------- the same numbers for every implementation


def weights(cfg: LatentAttentionConfig, seed: int) -> dict[str, np.ndarray]:
    """Canonical weights (float32): projections U(-1/√in, 1/√in) as torch.nn.Linear draws them; the RMSNorm
    weights in [0.5, 1.5] and the biases standard normal/10, away from the ones and zeros they start at (a
    dropped norm weight or bias then computes something else)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.weight_shapes().items():
        if name.endswith("norm.weight"):
            out[name] = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(".bias"):
            out[name] = 0.1 * rng.standard_normal(shape)
        else:
            bound = 1.0 / np.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def inputs(spec: LatentBench) -> dict[str, np.ndarray]:
    """x (B, T, E) and its cotangent for fwd/fwd+bwd; tokens (B, S + 1, E) for decode (the prefill, then the
    step's token); float32 draws, rounded by each framework to the dtype alike."""
    rng = np.random.default_rng(spec.seed + 1)
    B, T, S, E = spec.batch, spec.seq, spec.decode, spec.layer.embed_dim
    return {"x": rng.standard_normal((B, T, E)).astype(np.float32),
            "cotangent": rng.standard_normal((B, T, E)).astype(np.float32),
            "tokens": rng.standard_normal((B, S + 1, E)).astype(np.float32)}


def _rounded(a, dtype: str) -> np.ndarray:
    import ml_dtypes

    return np.asarray(a).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32).astype(np.float64)


def oracle(spec: LatentBench, pass_: str, w: dict, x: dict) -> dict:
    """The float64 reference of a pass, from the weights and inputs as the dtype rounds them: {"output": ...,
    "gradients": {...}} (fwd+bwd), the decode step's output the last row of the causal forward over S + 1 tokens."""
    from parity import reference_mla

    c = spec.layer
    sd = {k: _rounded(v, spec.dtype) for k, v in w.items()}
    kw = dict(num_heads=c.num_heads, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
              qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank, rope=c.rope,
              rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps)
    if pass_ == "decode":
        return {"output": reference_mla.forward(sd, _rounded(x["tokens"], spec.dtype), is_causal=True,
                                                **kw).output[:, -1:]}
    xs = _rounded(x["x"], spec.dtype)
    out = {"output": reference_mla.forward(sd, xs, is_causal=True, **kw).output}
    if pass_ == "fwd+bwd":
        g = _rounded(x["cotangent"], spec.dtype)
        grads = reference_mla.backward(sd, xs, None, g, is_causal=True, **kw)
        out["gradients"] = grads
    return out


# ---------------------------------------------------------------- the worker and the run (`parity.bench.stepped`)


def _bench(spec: LatentBench, fw: str, form: str, pass_: str, w: dict, x: dict):
    """(measure.Bench, row fields: the cache's bytes on decode) of one implementation."""
    mod = __import__(f"parity.bench.latent_{fw}", fromlist=["_"])
    if pass_ == "decode":
        S = spec.decode
        bench, nbytes = mod.decode_bench(spec.layer, w, x["tokens"][:, :S], x["tokens"][:, S:], spec.dtype, form)
        return bench, {"cache_bytes": nbytes}
    return mod.pass_bench(spec.layer, w, x["x"], x["cotangent"], spec.dtype, form, pass_), {"cache_bytes": None}


def _checked(spec: LatentBench, pass_: str, prepared, ref: dict) -> tuple[float | None, str | None]:
    """(max |out - oracle|, why it is not the oracle's) of a prepared bench; fwd+bwd its gradients too."""
    from parity.bench.measure import same_gradients, same_output

    diff, why = same_output(prepared.output, ref["output"], spec.dtype)
    if why is None and pass_ == "fwd+bwd":
        _, why = same_gradients(prepared.gradients, ref["gradients"], spec.dtype,
                                bias_terms=spec.batch * spec.seq)
    return diff, why


def work(spec: LatentBench) -> dict:
    """One worker process (`stepped.work_passes`)."""
    w, x = weights(spec.layer, spec.seed), inputs(spec)
    return stepped.work_passes(spec, lambda key, fw, form, pass_: _bench(spec, fw, form, pass_, w, x),
                               lambda pass_: oracle(spec, pass_, w, x),
                               lambda pass_, prepared, ref: _checked(spec, pass_, prepared, ref))


def spawn(spec: LatentBench) -> dict:
    return stepped.spawn("parity.bench.latent", spec)


def run(spec: LatentBench, spawn_worker=spawn) -> dict:
    """The whole run: `spec.processes` workers, one after the other, combined; the report as JSON."""
    def derive(row):
        if row["pass"] == "decode":
            row["tokens_per_s"] = spec.batch / row["median_s"]
            row["cache_bytes_per_token"] = row["cache_bytes"] / (spec.batch * (spec.decode + 1))

    return {"schema": SCHEMA, **stepped.run(spec, spawn_worker, derive)}


# ---------------------------------------------------------------- report


def markdown(report: dict) -> str:
    spec = LatentBench.from_json(report["spec"])
    env = report["environment"]
    lines = [f"# mha-bench latent: {env.get('cpu_model')}, {env.get('threads')} threads", ""]

    def opt(r, k, fmt):
        return "" if r.get(k) is None else fmt(r[k])

    columns = [("implementation", lambda r: r["impl"]), ("median", stepped.median_cell),
               ("IQR / median", stepped.iqr_cell),
               ("cache", lambda r: opt(r, "cache_bytes", lambda b: f"{b / 2**20:.2f} MiB")),
               ("cache / token", lambda r: opt(r, "cache_bytes_per_token", lambda b: f"{b:.0f} B")),
               ("tokens/s", lambda r: opt(r, "tokens_per_s", lambda t: f"{t:.0f}")),
               ("vs oracle", lambda r: opt(r, "out_max_diff", lambda d: f"{d:.2g}")),
               ("status", lambda r: r.get("message") or r["status"])]  # a noisy or error row's message says why
    for pass_ in spec.passes:
        rows = [r for r in report["rows"] if r["pass"] == pass_]
        lines += [f"## {pass_}: {spec.label(pass_)}", "", *stepped.table(rows, columns), "",
                  *stepped.verdict_lines(report["verdicts"], pass_), ""]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mha-bench latent", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--seq", type=positive_int, default=256, help="T of the fwd and fwd+bwd passes (default 256)")
    p.add_argument("--decode", type=positive_int, default=1024, metavar="S",
                   help="tokens in the cache before the timed decode step (default 1024)")
    p.add_argument("--embed", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--q-lora-rank", default="192", metavar="Q|none", help="q_lora_rank (none: a plain q_proj)")
    p.add_argument("--kv-lora-rank", type=positive_int, default=128)
    p.add_argument("--qk-nope-head-dim", type=positive_int, default=32)
    p.add_argument("--qk-rope-head-dim", type=positive_int, default=16)
    p.add_argument("--v-head-dim", type=positive_int, default=32)
    p.add_argument("--rope", choices=("interleaved", "half"), default="interleaved")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--passes", type=comma_separated(PASSES, nonempty=True), default=PASSES)
    p.add_argument("--frameworks", type=comma_separated(FRAMEWORKS, nonempty=True), default=FRAMEWORKS)
    p.add_argument("--processes", type=positive_int, default=2,
                   help=f"worker processes, one after the other (a verdict needs {verdicts.MIN_PROCESSES})")
    p.add_argument("--budget", type=positive_float, default=stepped.TIMING.budget_s,
                   help="seconds of timed calls per implementation, pass and process")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def spec_of(args) -> LatentBench:
    """The run the arguments ask for; ValueError naming what cannot be (the layer's own checks included)."""
    q = None if args.q_lora_rank == "none" else args.q_lora_rank
    if q is not None:
        if not (q.isascii() and q.isdigit()) or int(q) <= 0:
            raise ValueError(f"--q-lora-rank {args.q_lora_rank!r}: a positive integer or none")
        q = int(q)
    layer = LatentAttentionConfig(args.embed, args.heads, args.kv_lora_rank, args.qk_nope_head_dim,
                                  args.qk_rope_head_dim, args.v_head_dim, q_lora_rank=q, rope=args.rope)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    return LatentBench(layer, args.batch, args.seq, args.decode, args.dtype, tuple(args.passes), tuple(args.frameworks),
                       args.processes, args.budget, args.threads, args.seed)


def main(argv=None, console=None, spawn_worker=spawn) -> int:
    from rich.console import Console

    console = console or Console(highlight=False)
    args = parser().parse_args(argv)
    if args.worker:  # a worker process: the spec on stdin, its result as the last stdout line
        print(json.dumps(work(LatentBench.from_json(json.loads(sys.stdin.read())))))
        return EXIT_OK
    try:
        spec = spec_of(args)
        for path in (args.json, args.markdown):
            if path:
                check_writable(path)
    except (ValueError, TypeError, OSError) as e:
        console.print(f"mha-bench latent: {e}", markup=False)
        return EXIT_USAGE
    report = run(spec, spawn_worker)
    text = markdown(report)
    console.print(text, markup=False, soft_wrap=True)
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1) + "\n")
    if args.markdown:
        write_atomic(args.markdown, text + "\n")
    measured = [r for r in report["rows"] if r["status"] in ("ok", "noisy")]
    return EXIT_OK if measured and not any(r["status"] == "error" for r in report["rows"]) else EXIT_FAIL


if __name__ == "__main__":
    raise SystemExit(main())
