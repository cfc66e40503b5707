"""Measure the fused-attention kernels and chunk sizes on this machine and write the user's kernel table.

    python -m mha_jax.tune                         # default sizes: ~5 min on an idle 2-core CPU
    python -m mha_jax.tune --sizes 4x8x2048x64 --blocks 256x256,512x512,2048x512/h1
    python -m mha_jax.tune --sizes 1x8x1024x64 --kv-heads 2   # a grouped layer: 2 key/value heads
    python -m mha_jax.tune --show                  # which rows this processor uses, and from where
    python -m mha_jax.tune --combine RUN1.json RUN2.json   # summarise saved runs (no timing)

For every size (B x N x T x H, S = T; --kv-heads K key/value heads, default N) it compiles
each candidate (glibc's allocator thresholds pinned first, `mha_spec.allocator`, as in
`mha-bench`'s workers: otherwise a candidate's per-call cost follows what the process ran
before), then times them round-robin (the direction reversed each round, so a load
drift hits all alike) and keeps the min and
the median of the repeats; only ratios within one size of one run mean anything on a shared
machine. Candidates, named by `mha_jax.kernels.kernel_label` as benchmark rows name them: our
einsum core without weights ("einsum", materialises (B, N, T, S)), `jax.nn.dot_product_attention`'s
XLA path ("dpa-xla", materialises too) and the chunked kernel at each block size, all B·K
head blocks a step ("chunked:256x512") or C of them ("chunked:2048x512/h1"; `--blocks` takes
both spellings); materialising candidates are skipped above `mha_jax.kernels.MATERIALIZE_LIMIT`
scores. Passes (`mha_spec.PASSES`): "fwd" (the context) and "fwd+bwd" (gradient of its sum
w.r.t. q, k, v). A candidate's score is the geometric mean of its time / the fastest's over
the passes (1.00 = fastest in both).

A grouped layer's row is keyed by the kernel's shape, B·K head blocks of G·T query rows
(`mha_jax.kernels.kernel_space`, G = N/K), which is how the choice looks it up.

The rows go into the user's table (`mha_jax.cache.kernel_table_path()`, `--out` to
choose another file) under this processor's key, next to any other processor's rows in
that file; `mha_jax.kernels` reads them first from then on. `--json` also saves every
time, the load average and the processor.

Exit 0 done; 2 a usage error, found before anything is measured: a bad --sizes, --blocks,
--passes, --min-repeats, --budget, --dtype or --kv-heads, an output (--out, --json) that cannot be written or
both naming one file, a --combine file that is absent, not JSON or not a tune run; 3 the
run was measured but a file could not be written (--json is written first: when it fails,
the table is left as it was).

Deprecated spellings, parsed the same with a warning on stderr (`mha_spec.flags`): --reps for
--min-repeats (as `mha-bench` spells it), --passes fwdbwd for fwd+bwd. Saved runs whose rows say
"fwdbwd" still load (--combine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import kernels
from mha_jax.attention import attention_core
from mha_jax.cache import kernel_table_path
from mha_jax.chunked import chunked_attention, head_steps
from mha_spec import DTYPE_NAMES, PASSES, allocator
from mha_spec.files import read_json, writable_problem, write_atomic
from mha_spec.flags import add_alias, warn_deprecated

DEFAULT_SIZES = "4x8x256x64,4x8x512x64,4x8x1024x64,4x8x2048x64,1x8x8192x64"
DEFAULT_BLOCKS = "128x256,256x256,256x512,512x512,512x1024,1024x1024,1024x512/h1,2048x512/h1,2048x1024/h1,1024x1024/h2"
OLD_PASSES = {"fwdbwd": "fwd+bwd"}  # a deprecated --passes value, and what saved runs' rows may say
DTYPES = DTYPE_NAMES
EXIT_WRITE = 3  # measured, but a file could not be written (as mha-bench's reports)


def chunked_candidate(B: int, N: int, T: int, S: int, q_chunk: int, k_chunk: int, head_chunk: int | None = None,
                      K: int | None = None) -> kernels.Choice:
    """The chunked kernel as it runs these sizes (K key/value heads, None: N) with these blocks: a block
    larger than the kernel's query rows (G·T) or keys (S) is the whole axis, and the head chunk is the
    piece of the B·K head blocks a step runs (`mha_jax.chunked.head_steps`; None when that is all of
    them), so two requests that run alike have one name."""
    BK, rows, _ = kernels.kernel_space(B, N, T, S, K)
    bc, kc = head_steps(B, BK // B, head_chunk)
    return kernels.Choice(kernels.CHUNKED, min(q_chunk, rows), min(k_chunk, S),
                          head_chunk=None if bc * kc == BK else bc * kc)


def candidates(B: int, N: int, T: int, H: int, blocks, K: int | None = None) -> dict:
    """{name: f(q, k, v) -> context (B, T, N, H)}, k and v with K heads (None: N); blocks: (q_chunk,
    k_chunk, head_chunk or None), each named as it runs (`chunked_candidate`)."""
    out = {}
    if B * N * T * T <= kernels.MATERIALIZE_LIMIT:
        out[kernels.kernel_label(kernels.Choice(kernels.EINSUM))] = lambda q, k, v: attention_core(q, k, v)[0]
        out[kernels.kernel_label(kernels.Choice(kernels.DPA_XLA))] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=1.0 / math.sqrt(H), implementation=kernels.DPA_IMPLEMENTATIONS[kernels.DPA_XLA])
    for c in dict.fromkeys(chunked_candidate(B, N, T, T, *b, K=K) for b in blocks):
        out[kernels.kernel_label(c)] = lambda q, k, v, c=c: chunked_attention(q, k, v, q_chunk=c.q_chunk, k_chunk=c.k_chunk,
                                                                              head_chunk=c.head_chunk)
    return out


def _program(f, pass_: str):
    if pass_ == "fwd":
        return jax.jit(f)
    return jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def measure_size(B, N, T, H, blocks, passes, reps, dtype, budget_s, log=print, K=None) -> list[dict]:
    """Timed rows (one per candidate and pass) for one size, K key/value heads (None: N)."""
    K = N if K is None else K
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), dtype) for _ in range(2))
    rows = []
    for pass_ in passes:
        compiled, first = {}, []
        for name, f in candidates(B, N, T, H, blocks, K).items():
            compiled[name] = _program(f, pass_).lower(q, k, v).compile()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](q, k, v))  # warm-up
            first.append(time.perf_counter() - t0)
        # Small problems get more repeats (up to ~budget_s per candidate, at most 50).
        reps_here = max(reps, min(50, int(budget_s / max(min(first), 1e-4))))
        times = {name: [] for name in compiled}
        order = list(compiled)
        for r in range(reps_here):
            for name in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[name](q, k, v))
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            rows.append(dict(B=B, N=N, K=K, T=T, S=T, H=H, pass_=pass_, candidate=name, min_s=min(ts),
                             median_s=float(np.median(ts)), reps=len(ts)))
            log(f"B={B} N={N} K={K} T={T} H={H} {pass_:7s} {name:18s} min {1e3 * min(ts):9.1f} ms  "
                f"median {1e3 * np.median(ts):9.1f} ms")
    return rows


def row_space(r: dict) -> tuple[int, int, int]:
    """A timed row's kernel shape (B·K, G·T, S), the key of its table row; rows saved without K are ungrouped."""
    return kernels.kernel_space(r["B"], r["N"], r["T"], r["S"], r.get("K"))


def summarise(runs) -> list[dict]:
    """Per kernel shape (B·K, G·T, S; `row_space`): the fastest kernel and the chunked kernel's fastest
    blocks and head chunk.

    runs: a list of runs (each a list of rows). Absolute times from different runs on a shared
    machine are not comparable, so a candidate's score is the geometric mean of its time / the
    fastest candidate's time over every (run, pass) that measured it: forward and forward+backward
    count alike (the fused path serves inference and training). Where two or more runs measured a
    size, a candidate seen in only one of them is left out.
    """
    out = []
    sizes = sorted({row_space(r) for run in runs for r in run})
    for key in sizes:
        ratios, seen = {}, {}
        for n, run in enumerate(runs):
            for pass_ in PASSES:
                pick = [r for r in run if row_space(r) == key and OLD_PASSES.get(r["pass_"], r["pass_"]) == pass_]
                for r in pick:
                    ratios.setdefault(r["candidate"], []).append(r["min_s"] / min(x["min_s"] for x in pick))
                    seen.setdefault(r["candidate"], set()).add(n)
        need = 2 if max(len(v) for v in seen.values()) >= 2 else 1
        score = {c: math.exp(np.mean(np.log(v))) for c, v in ratios.items() if len(seen[c]) >= need}
        fastest = kernels.parse_label(min(score, key=score.get))
        chunked = [c for c in score if kernels.parse_label(c).kernel == kernels.CHUNKED]
        best = kernels.parse_label(min(chunked, key=score.get)) if chunked else None
        blocks = [best.q_chunk, best.k_chunk] if best else None
        heads = {"head_chunk": best.head_chunk} if best and best.head_chunk is not None else {}  # absent: all at once
        out.append(dict(BN=key[0], T=key[1], S=key[2], fastest=fastest.kernel, blocks=blocks, **heads,
                        scores={c: round(v, 3) for c, v in sorted(score.items(), key=lambda kv: kv[1])}))
    return out


def write_table(path: Path, proc: kernels.Processor, rows: list[dict], meta: dict) -> None:
    """Put `rows` under `proc` in the table at `path`, keeping other processors' entries.

    An unreadable or corrupt file is replaced (kernels.load_user_table warns about it). The
    write goes through `mha_spec.files.write_atomic`: a reader never sees half a file.
    OSError when it cannot be written."""
    entries = {}
    try:
        existing = read_json(path)
        kernels.parse_table(existing)
        entries = existing["processors"]
    except (OSError, ValueError):
        pass
    kernels.parse_table({"schema": kernels.TABLE_SCHEMA, "processors": {proc.key: {
        "device_kind": proc.device_kind, "model": proc.model, "isa": proc.isa, "rows": rows}}})  # what we write must read back
    entries[proc.key] = {"device_kind": proc.device_kind, "model": proc.model, "isa": proc.isa, **meta, "rows": rows}
    write_atomic(path, json.dumps({"schema": kernels.TABLE_SCHEMA, "processors": entries}, indent=1) + "\n")


def show(path: Path, console=print) -> None:
    proc = kernels.processor()
    console(f"processor: {proc.key}")
    console(f"user table: {path}" + ("" if path.exists() else " (absent)"))
    for src in kernels.sources_for(proc, kernels.load_user_table(path), str(path)):
        console(src.where)
        for r in src.rows:
            console(f"    B·N={r.BN} T={r.T} S={r.S}: {row_text(r.fastest, r.blocks, r.head_chunk)}")


def row_text(fastest: str, blocks, head_chunk: int | None = None) -> str:
    """A table row's choice as `show` and a run print it: the fastest kernel, and the chunked
    kernel's fastest blocks by `kernels.kernel_label` ("chunked:256x512", "chunked:2048x512/h1";
    alone when chunked is fastest)."""
    chunked = kernels.kernel_label(kernels.Choice(kernels.CHUNKED, *blocks, head_chunk=head_chunk)) if blocks else None
    if fastest == kernels.CHUNKED and chunked:
        return chunked
    return fastest + (f", fastest chunked {chunked}" if chunked else "")


def _sizes(text: str, n: int, what: str) -> list[tuple[int, ...]]:
    try:
        out = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != n or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} of positive integers, got {text!r}")
    return out


def _blocks(text: str) -> list[tuple[int, int, int | None]]:
    """--blocks: QxK or QxK/hC (C head blocks a step), as `kernels.kernel_label` spells them after
    "chunked:", within what the kernel table reads back (else the table written would be ignored)."""
    out = []
    for item in text.split(","):
        try:
            c = kernels.parse_label(f"{kernels.CHUNKED}:{item}")
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated QxK or QxK/hC of positive integers "
                                             f"(256x512, 2048x512/h1), got {text!r}") from None
        out.append((c.q_chunk, c.k_chunk, c.head_chunk))
    if max(max(b[:2]) for b in out) > kernels.MAX_BLOCK:
        raise argparse.ArgumentTypeError(f"blocks are at most {kernels.MAX_BLOCK} (the kernel table's bound), got {text!r}")
    return out


def _passes(text: str) -> tuple[str, ...]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    for old in dict.fromkeys(t for t in items if t in OLD_PASSES):
        warn_deprecated(f"--passes {old}", OLD_PASSES[old])
    items = tuple(dict.fromkeys(OLD_PASSES.get(t, t) for t in items))  # each once, in order
    if not items or not set(items) <= set(PASSES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(PASSES)}, got {text!r}")
    return items


def _number(convert, ok, what: str):
    """An argparse `type`: `convert(text)`, refused as "expected <what>" unless `ok(value)`."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
# 0: --min-repeats repeats; NaN or inf: no repeat count at all
_budget = _number(float, lambda v: math.isfinite(v) and v >= 0, "a finite number of seconds >= 0")


def _dtype(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    if text == "float64" and not jax.config.jax_enable_x64:  # else jnp.asarray would time float32 under that name
        raise argparse.ArgumentTypeError("float64 needs JAX_ENABLE_X64=1 (without it JAX computes in float32)")
    return text


def _is_label(x) -> bool:
    try:
        kernels.parse_label(x)
    except ValueError:
        return False
    return True


def load_run(path: Path) -> list[dict]:
    """The rows of a saved `--json` run; ValueError naming the file for one that is absent,
    not JSON, or whose rows `summarise` cannot use."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: not a tune run (expected an object with a non-empty 'rows' list, as --json writes)")
    rows = [{**r, "pass_": OLD_PASSES[r["pass_"]]} if isinstance(r, dict) and r.get("pass_") in OLD_PASSES else r
            for r in rows]
    for n, r in enumerate(rows):
        ok = (isinstance(r, dict) and all(isinstance(r.get(k), int) and not isinstance(r.get(k), bool) for k in "BNTS")
              and r.get("pass_") in PASSES and _is_label(r.get("candidate"))
              and isinstance(r.get("min_s"), (int, float)) and math.isfinite(r["min_s"]) and r["min_s"] > 0
              and ("K" not in r or (type(r["K"]) is int and r["K"] >= 1 and r["N"] % r["K"] == 0)))
        if not ok:
            raise ValueError(f"{path}: row {n} is not a tune row (integers B, N, T, S, and K dividing N where given; "
                             f"pass_ in {', '.join(PASSES)}; a candidate kernels.kernel_label names; min_s a positive time)")
    return rows


def parser(prog: str = "python -m mha_jax.tune") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, type=lambda s: _sizes(s, 4, "BxNxTxH"), help="comma-separated BxNxTxH (S = T)")
    p.add_argument("--kv-heads", type=_positive_int, default=None, metavar="K",
                   help="key/value heads of every size (default N; it must divide each size's N)")
    p.add_argument("--blocks", default=DEFAULT_BLOCKS, type=_blocks,
                   help="comma-separated q_chunk x k_chunk, each with /hC to run C head blocks a step")
    p.add_argument("--passes", default=PASSES, type=_passes, help=f"comma-separated: {', '.join(PASSES)} (default both)")
    add_alias(p, "--reps", p.add_argument("--min-repeats", type=_positive_int, default=3,
                                          help="repeats at least (more for small sizes, see --budget)"))
    p.add_argument("--budget", type=_budget, default=0.5, help="seconds per candidate that set the repeats of small sizes")
    p.add_argument("--dtype", type=_dtype, default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--out", type=Path, default=None, help="the table to write (default: the user's kernel table)")
    p.add_argument("--json", type=Path, default=None, help="also save every time here")
    p.add_argument("--show", action="store_true", help="print the rows this processor uses and where they come from")
    p.add_argument("--combine", nargs="+", type=Path, metavar="RUN.json", help="summarise saved --json runs (no timing, nothing written)")
    return p


def check_outputs(args, p: argparse.ArgumentParser) -> Path:
    """The table's path; every output tried before anything is measured (p.error, exit 2)."""
    out = args.out or kernel_table_path()
    paths = [("--out", out)] + ([("--json", args.json)] if args.json else [])
    if len(paths) == 2 and os.path.realpath(out) == os.path.realpath(args.json):
        p.error(f"--json {args.json} is the kernel table (--out): each needs its own file")
    for flag, path in paths:
        problem = writable_problem(path)
        if problem:
            p.error(f"{flag} {path}: cannot write there: {problem}")
    return out


def run(args, p: argparse.ArgumentParser) -> dict | None:
    """What `main` does for parsed `args`; for a measuring run, {"path", "processor", "rows",
    "table", "meta", "write_error"} (write_error: None, or why a file could not be written)."""
    if args.show:
        show(args.out or kernel_table_path())
        return None
    if args.combine:
        try:
            runs = [load_run(path) for path in args.combine]
        except ValueError as e:
            p.error(f"--combine: {e}")
        print(json.dumps(summarise(runs), indent=1))
        return None
    bad = [n for _, n, _, _ in args.sizes if args.kv_heads is not None and n % args.kv_heads]
    if bad:
        p.error(f"--kv-heads {args.kv_heads} must divide every size's N, not {', '.join(map(str, bad))}")
    out = check_outputs(args, p)
    proc = kernels.processor()
    alloc = allocator.pin_this_process()  # before anything is compiled or timed
    load_start = os.getloadavg()
    print(f"processor {proc.key!r}, load average {load_start}, {os.cpu_count()} cores", flush=True)
    rows = []
    with jax.default_matmul_precision("highest"):  # as mha-bench pins it
        for B, N, T, H in args.sizes:
            rows += measure_size(B, N, T, H, args.blocks, args.passes, args.min_repeats, jnp.dtype(args.dtype), args.budget,
                                 log=lambda s: print(s, flush=True), K=args.kv_heads)
    table = summarise([rows])
    meta = dict(measured=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), jax=jax.__version__,
                dtype=args.dtype, precision="highest", cores=os.cpu_count(), allocator=alloc,
                load_average_start=list(load_start),
                load_average_end=list(os.getloadavg()))
    result = dict(path=out, processor=proc, rows=rows, table=table, meta=meta,
                  write_error=write_outputs(args.json, out, proc, rows, table, meta))
    for t in table:
        print(f"  B·K={t['BN']} G·T={t['T']} S={t['S']}: {row_text(t['fastest'], t['blocks'], t.get('head_chunk'))}  {t['scores']}")
    return result


def write_outputs(json_path, out: Path, proc, rows, table, meta) -> str | None:
    """The run's --json first, then the table, which stays as it was when the run's file cannot
    be written; None when every file is written, else the error (said on stderr)."""
    run_text = json.dumps(dict(processor=proc.key, **meta, rows=rows, table=table), indent=1) + "\n"
    for path, write, done in (
            (json_path, lambda: write_atomic(json_path, run_text), f"wrote every time to {json_path}"),
            (out, lambda: write_table(out, proc, table, meta), f"wrote {len(table)} row(s) for {proc.key!r} to {out}")):
        if not path:
            continue
        try:
            write()
        except OSError as e:
            error = f"error: could not write {path}: {e.strerror or e}"
            print(error, file=sys.stderr)
            return error
        print(done)
    return None


def main(argv=None) -> int:
    """Exit 0 written, 2 a usage error (before anything is measured), 3 a file could not be written."""
    p = parser()
    result = run(p.parse_args(argv), p)
    return EXIT_WRITE if result is not None and result["write_error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
