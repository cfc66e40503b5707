"""`mha-bench --decode S`: the inference question -- the prefill of S tokens and the one-token step after them,
for any layer `mha-bench`'s flags make (`--embed/--heads/--kv-heads/--head-dim/--rope/--bias/...`, `--batch`).

    mha-bench --decode 2048 --batch 1 --embed 2048 --heads 16 --kv-heads 4 --rope half --bias none

Implementations (`parity.bench.decode_torch`, `decode_jax`): `ours-torch:eager` and `ours-torch:compile`
(our module with its immutable `KVCache`: every step writes a new cache), `ours-torch:static` (its
`StaticKVCache`, written in place), `ours-jax:jit` (one program, the
cache's buffers donated: the step writes its slot in place), `hf-llama:dynamic-cache` (transformers'
LlamaAttention with the DynamicCache generate uses, where the layer is a Llama one), `flax-nnx:decode`
(flax.nnx.MultiHeadAttention(decode=True), the classic layer only; step only: flax decodes one token per call)
and a user's decoder (`--impl`, `Implementation.decode=True`: the protocol's one token per call; step only).

Each pass's implementations are checked against the float64 oracle before they are timed (`parity.reference`:
the prefill against the causal forward over the S tokens, the step against its last row over S + 1), then
timed round-robin in `--processes` worker processes with the interference probe, every pair of a pass judged
by the hierarchical interval (`parity.bench.stepped`). Every timed step decodes the same token at slot S from
the same prefilled state (capacity S + 1), so every call does the same work. Reported: ms/token, tokens/s,
the cache's bytes, GFLOP/s, and the fraction of the machine's read bandwidth (measured in each worker, as
the matmul peak is: the best rate of summing 256 MiB in NumPy and in torch) the step's reads imply -- the K
and V of its S + 1 slots and the weights, read at least once per step.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from mha_spec import Problem
from parity.bench import stepped
from parity.bench.spec import BenchCase, canonical_weights, forward_flops

SCHEMA = "mha-bench-decode/1"
PASSES = ("prefill", "step")
# (key, framework, form): what `--decode` times, before the --impls filter and each one's own limits
BUILTIN = (("ours-torch:eager", "torch", "eager"), ("ours-torch:compile", "torch", "compile"),
           ("ours-torch:static", "torch", "static"), ("ours-jax:jit", "jax", "jit"), ("hf-llama:dynamic-cache", "torch", "hf"),
           ("flax-nnx:decode", "jax", "flax"))
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class DecodeBench:
    """One decode run: the case (its T = 1 query and S + 1 keys: the layer, B and the dtype), the implementations
    (keys; user decoders as "module:attr" specs), and how it is timed."""

    case: BenchCase
    impls: tuple = tuple(k for k, _, _ in BUILTIN)
    user: tuple = ()  # --impl specs of decoders
    passes: tuple = PASSES
    processes: int = 2
    budget_s: float = 1.0
    threads: int | None = None
    seed: int = 0

    @property
    def cached(self) -> int:
        """S: the tokens in the cache before the step."""
        return self.case.problem.S - 1

    def why_not(self, form: str) -> str | None:
        """Why a built-in peer does not run this layer (its registry entry's declarations: hf-llama's for the
        HF stepper, flax-nnx-mha-decode's for flax), or None."""
        from parity.impls.registry import builtin

        peer = {"hf": "hf-llama", "flax": "flax-nnx-mha-decode"}.get(form)
        return None if peer is None else builtin(peer).unsupported(self.case.dtype, self.case.config)

    def keys(self, pass_: str) -> list[tuple[str, str, str]]:
        out = [(k, fw, form) for k, fw, form in BUILTIN if k in self.impls and not self.why_not(form)]
        if pass_ == "prefill":  # flax and the protocol's decoders take one token per call
            return [t for t in out if t[2] != "flax"]
        return out + [(f"{user_impl(spec).name}:decoder", "user", spec) for spec in self.user]

    def skipped(self) -> list[tuple[str, str]]:
        return [(k, self.why_not(form)) for k, _, form in BUILTIN if k in self.impls and self.why_not(form)]

    def label(self, pass_: str) -> str:
        case = self.case.label.replace(f"T=1 S={self.case.problem.S} ", "")
        return f"{'prefill' if pass_ == 'prefill' else 'step'} S={self.cached} {case}"

    def to_json(self) -> dict:
        return {"case": self.case.to_json(), "impls": list(self.impls), "user": list(self.user),
                "passes": list(self.passes), "processes": self.processes, "budget_s": self.budget_s,
                "threads": self.threads, "seed": self.seed}

    @classmethod
    def from_json(cls, d: dict) -> DecodeBench:
        return cls(BenchCase.from_json(d["case"]), tuple(d["impls"]), tuple(d["user"]), tuple(d["passes"]),
                   d["processes"], d["budget_s"], d["threads"], d["seed"])


@functools.lru_cache(maxsize=None)
def user_impl(spec: str):
    """The decoder an --impl spec names (`parity.impls.load_user_impl`); TypeError for one that is not a decoder."""
    from parity.impls import load_user_impl

    impls = [i for i in load_user_impl(spec) if i.decode]
    if not impls:
        raise TypeError(f"--impl {spec}: no decoder (Implementation.decode=True) there; --decode times decoders")
    return impls[0]


def select(pattern: str | None) -> tuple[str, ...]:
    """The built-in keys an --impls pattern (comma-separated globs) names; all without one."""
    keys = [k for k, _, _ in BUILTIN]
    if not pattern:
        return tuple(keys)
    chosen = [k for k in keys if any(fnmatch.fnmatch(k, p.strip()) or k.startswith(p.strip()) for p in pattern.split(","))]
    if not chosen:
        raise ValueError(f"--impls {pattern!r} names none of the decode implementations {', '.join(keys)}")
    return tuple(chosen)


def tokens(spec: DecodeBench) -> np.ndarray:
    """(B, S + 1, E) float32 draws: the prompt, then the step's token; each framework rounds them to the dtype."""
    p = spec.case.problem
    return np.random.default_rng(spec.seed + 1).standard_normal((p.B, p.S, p.config.embed_dim)).astype(np.float32)


def oracle(spec: DecodeBench, sd: dict, x: np.ndarray) -> np.ndarray:
    """The causal forward over the S + 1 tokens in float64 (`parity.reference.forward`, the weights and tokens
    as the dtype rounds them): its first S rows are the prefill's output, its last the step's."""
    from parity import reference
    from parity.impls.registry import layer_kwargs

    c = spec.case.config
    xs = x.astype(sd["q_proj.weight"].dtype).astype(np.float64)
    kw = layer_kwargs(sd, c.num_heads, spec.case.problem)
    return reference.forward({k: np.asarray(v, np.float64) for k, v in sd.items()}, xs, xs, xs, num_heads=c.num_heads,
                             is_causal=True, **kw).output


def _bench(spec: DecodeBench, sd, x, key: str, fw: str, form: str, pass_: str):
    if fw == "user":
        impl = user_impl(form)
        mod = __import__(f"parity.bench.decode_{impl.framework}", fromlist=["_"])
        return mod.protocol(impl, spec.case, sd, x)
    mod = __import__(f"parity.bench.decode_{fw}", fromlist=["_"])
    if form == "hf":
        return mod.hf_llama(spec.case, sd, x, pass_)
    if form == "flax":
        return mod.flax_nnx(spec.case, sd, x)
    if fw == "torch":
        return mod.ours(spec.case, sd, x, form, pass_)
    return mod.ours(spec.case, sd, x, pass_)


def read_rate() -> float:
    """The machine's read bandwidth (bytes/s) as this worker measures it: the best of summing 256 MiB in NumPy
    (one thread) and in torch (its threads), five times each."""
    a = np.ones(64 * 2**20, np.float32)
    best = min(_timed(a.sum) for _ in range(5))
    rate = a.nbytes / best
    try:
        from parity.bench.decode_torch import read_rate as torch_rate
        rate = max(rate, torch_rate())
    except ImportError:
        pass
    return rate


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def work(spec: DecodeBench) -> dict:
    """One worker process (`stepped.work_passes`), with its measured read bandwidth."""
    from parity.bench.measure import same_output

    sd = canonical_weights(spec.case.config, spec.case.dtype, spec.seed)
    x = tokens(spec)
    exact = oracle(spec, sd, x)  # (B, S + 1, E)
    S = spec.cached
    refs = {"prefill": exact[:, :S], "step": exact[:, S:]}
    result = stepped.work_passes(spec, lambda key, fw, form, pass_: _bench(spec, sd, x, key, fw, form, pass_),
                                 refs.__getitem__,
                                 lambda pass_, prepared, ref: same_output(prepared.output, ref, spec.case.dtype))
    result["read_bytes_per_s"] = read_rate()
    return result


def spawn(spec: DecodeBench) -> dict:
    return stepped.spawn("parity.bench.decode", spec)


def step_reads(spec: DecodeBench) -> int:
    """Bytes a step must read at least: the K and V of its S + 1 slots and every weight, once."""
    c, p = spec.case.config, spec.case.problem
    item = np.dtype(canonical_weights(c, spec.case.dtype, 0)["q_proj.weight"].dtype).itemsize
    weights = sum(int(np.prod(s)) for s in c.weight_shapes().values())
    return item * (2 * p.B * c.kv_heads * p.S * c.head_size + weights)


def flops(spec: DecodeBench, pass_: str) -> int:
    """The prefill's and the step's FLOPs (`spec.forward_flops`'s count): the prefill is the causal forward over
    S tokens; the step projects one token and attends S + 1 keys (their k and v were projected before)."""
    c, B, S = spec.case.config, spec.case.problem.B, spec.cached
    if pass_ == "prefill":
        return forward_flops(Problem(c, B, S, S), kept=B * S * (S + 1) // 2)
    return forward_flops(Problem(c, B, 1, 1), kept=B * (S + 1))


def run(spec: DecodeBench, spawn_worker=spawn) -> dict:
    """The whole run: workers, rows (with ms/token, tokens/s, GFLOP/s and the bandwidth fraction), verdicts."""
    rates = []

    def spawn_and_keep(s):
        result = spawn_worker(s)
        rates.append(result.get("read_bytes_per_s"))
        return result

    reads = step_reads(spec)

    def derive(row):
        row["gflops"] = flops(spec, row["pass"]) / row["median_s"] / 1e9
        if row["pass"] == "step":
            row["ms_per_token"] = 1e3 * row["median_s"]
            row["tokens_per_s"] = spec.case.problem.B / row["median_s"]
            row["read_bytes"] = reads
            rate = max((r for r in rates if r), default=None)
            row["bandwidth_fraction"] = None if rate is None else reads / row["median_s"] / rate

    out = stepped.run(spec, spawn_and_keep, derive)
    out["environment"]["read_bytes_per_s"] = max((r for r in rates if r), default=None)
    out["skipped"] = [{"impl": k, "message": why} for k, why in spec.skipped()]
    return {"schema": SCHEMA, **out}


def markdown(report: dict) -> str:
    spec = DecodeBench.from_json(report["spec"])
    env = report["environment"]
    rate = env.get("read_bytes_per_s")
    lines = [f"# mha-bench --decode: {env.get('cpu_model')}, {env.get('threads')} threads", "",
             f"Measured read bandwidth: {rate / 1e9:.1f} GB/s" if rate else "Measured read bandwidth: n/a", ""]

    def opt(r, k, fmt):
        return "" if r.get(k) is None else fmt(r[k])

    columns = [("implementation", lambda r: r["impl"]), ("median", stepped.median_cell),
               ("IQR / median", stepped.iqr_cell), ("tokens/s", lambda r: opt(r, "tokens_per_s", lambda t: f"{t:.0f}")),
               ("GFLOP/s", lambda r: opt(r, "gflops", lambda g: f"{g:.2f}")),
               ("cache", lambda r: opt(r, "cache_bytes", lambda b: f"{b / 2**20:.2f} MiB")),
               ("% read bandwidth", lambda r: opt(r, "bandwidth_fraction", lambda f: f"{100 * f:.0f} %")),
               ("vs oracle", lambda r: opt(r, "out_max_diff", lambda d: f"{d:.2g}")),
               ("status", lambda r: r.get("message") or r["status"])]
    for pass_ in spec.passes:
        rows = [r for r in report["rows"] if r["pass"] == pass_]
        lines += [f"## {spec.label(pass_)}", "", *stepped.table(rows, columns), "",
                  *stepped.verdict_lines(report["verdicts"], pass_), ""]
    lines += [f"- not run: {s['impl']}: {s['message']}" for s in report.get("skipped", [])]
    return "\n".join(lines) + "\n"


def main_worker() -> int:
    print(json.dumps(work(DecodeBench.from_json(json.loads(sys.stdin.read())))))
    return EXIT_OK


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        raise SystemExit(main_worker())
    raise SystemExit("run it as mha-bench --decode S")
