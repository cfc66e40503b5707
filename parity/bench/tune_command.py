"""`mha-bench tune`: measure the JAX fused-attention kernels on this machine and check the choice.

    mha-bench tune [--sizes 4x8x2048x64,..] [--kv-heads K] [--blocks 256x256,512x512,..] [--passes fwd,fwd+bwd]
                   [--min-repeats R] [--budget S] [--dtype float32] [--out TABLE.json] [--json RUN.json]
    mha-bench tune --show        the rows this processor uses and where they come from

It runs `mha_jax.tune` (every candidate kernel and block size, timed round-robin per size)
and writes the user's kernel table, then asks `mha_jax.kernels.choose` what it now picks
for every measured size, from the table just written, and reports that candidate's time
over the fastest candidate's time of the same run, per pass. Times from one run of one
size are the only comparable ones on a shared machine, so this is the whole check: a
choice is within 5 % when its ratio is at most 1.05 in every pass. The choice optimises
the geometric mean over the passes, so one pass may exceed 5 % while the mean does not;
both are shown.

Exit codes as `python -m mha_jax.tune`'s: 2 a usage error (before anything is measured), 3 a
file could not be written after the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

WITHIN = 1.05  # the chosen candidate's time / the best's, per pass, that counts as "within 5 %"


@dataclass(frozen=True)
class ChoiceCheck:
    """For one measured size (K key/value heads) and pass: the candidate chosen, the fastest measured, and their times."""

    B: int
    N: int
    K: int
    T: int
    S: int
    H: int
    pass_: str
    chosen: str  # a candidate, by `mha_jax.kernels.kernel_label` ("chunked:512x512", "einsum", ...), or a kernel tune does not time
    best: str
    chosen_s: float | None  # None: the chosen kernel was not measured in this run
    best_s: float

    @property
    def ratio(self) -> float | None:
        return None if self.chosen_s is None else self.chosen_s / self.best_s

    @property
    def within(self) -> bool:
        return self.ratio is not None and self.ratio <= WITHIN


def candidate_name(choice, B: int, N: int, K: int, T: int, S: int) -> str:
    """The name `mha_jax.tune.candidates` gives what `choose` picked for these sizes: its
    `kernel_label`, a chunked choice as it runs them (`mha_jax.tune.chunked_candidate`: blocks
    clipped to the kernel's query rows G·T and keys S, the head chunk to the piece a step runs)."""
    from mha_jax.kernels import CHUNKED, Choice, kernel_label
    from mha_jax.tune import chunked_candidate

    if choice.kernel == CHUNKED:
        return kernel_label(chunked_candidate(B, N, T, S, choice.q_chunk, choice.k_chunk, choice.head_chunk, K=K))
    return kernel_label(Choice(choice.kernel))


def _size(r: dict) -> tuple:
    return r["B"], r["N"], r.get("K", r["N"]), r["T"], r["S"], r["H"], r["pass_"]


def check_choices(rows: list[dict], choose: Callable[[int, int, int, int, int, int], str]) -> list[ChoiceCheck]:
    """One `ChoiceCheck` per (size, pass) of a tune run's rows, timed by the min over repeats as tune
    ranks them; `choose(B, N, K, T, S, H)` names the candidate the kernel table now picks."""
    checks = []
    for key in dict.fromkeys(_size(r) for r in rows):
        here = {r["candidate"]: r["min_s"] for r in rows if _size(r) == key}
        best = min(here, key=here.get)
        chosen = choose(*key[:6])
        checks.append(ChoiceCheck(*key, chosen=chosen, best=best, chosen_s=here.get(chosen), best_s=here[best]))
    return checks


def mean_ratio(checks: list[ChoiceCheck]) -> float | None:
    """The geometric mean of the ratios over the passes (what the choice optimises); None if one is missing."""
    ratios = [c.ratio for c in checks]
    if not ratios or any(r is None for r in ratios):
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def report_lines(checks: list[ChoiceCheck]) -> list[str]:
    """The check as printed: one line per size and pass, then the verdict."""
    lines = ["the choice after tune vs the fastest candidate of this run (min over repeats):"]
    sizes: dict = {}
    for c in checks:
        sizes.setdefault((c.B, c.N, c.K, c.T, c.S, c.H), []).append(c)
    for (B, N, K, T, S, H), group in sizes.items():
        mean = mean_ratio(group)
        lines.append(f"  B={B} N={N}" + (f" K={K}" if K != N else "") + f" T={T} S={S} H={H}: chosen {group[0].chosen}"
                     + (f", mean over passes {mean:.3f}x" if mean is not None else ""))
        for c in group:
            if c.ratio is None:
                lines.append(f"    {c.pass_:7s} {c.chosen} was not measured in this run (best {c.best})")
            else:
                mark = "" if c.within else f"  above {WITHIN - 1:.0%}"
                lines.append(f"    {c.pass_:7s} {c.ratio:.3f}x the best ({c.best}, {c.best_s * 1e3:.3g} ms){mark}")
    off = [c for c in checks if not c.within]
    lines.append(f"all {len(checks)} chosen within {WITHIN - 1:.0%} of the best measured" if not off else
                 f"{len(off)} of {len(checks)} (size, pass) not within {WITHIN - 1:.0%} of the best measured")
    return lines


def main(argv, console: Console) -> int:
    import jax

    from mha_jax import kernels, tune

    p = tune.parser(prog="mha-bench tune")
    args = p.parse_args(argv)
    result = tune.run(args, p)
    if result is None:  # --show, --combine: nothing measured
        return 0
    if result["write_error"]:  # said on stderr; the table may not hold this run's rows
        return tune.EXIT_WRITE
    path, proc, dtype = result["path"], result["processor"], args.dtype
    sources = kernels.sources_for(proc, kernels.load_user_table(path), str(path))
    platform = jax.devices()[0].platform

    def choose(B, N, K, T, S, H):
        c = kernels.choose(platform=platform, sources=sources, dtype=dtype, B=B, N=N, T=T, S=S, H=H,
                           has_mask=False, materialize_limit=kernels.MATERIALIZE_LIMIT, kv_heads=K)
        return candidate_name(c, B, N, K, T, S)

    for line in report_lines(check_choices(result["rows"], choose)):
        console.print(line, markup=False, soft_wrap=True)
    console.print(f"kernel table: {path}", markup=False, soft_wrap=True)
    return 0
