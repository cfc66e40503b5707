"""`mha-bench`: the command line.

    mha-bench [--preset quick|default|long] [--device cpu|gpu|tpu|auto] [--impls PATTERNS]
              [--passes fwd,fwd+bwd] [--dtypes ...] [--seq ...] [--batch ..] [--embed ..] [--heads ..]
              [--kv-heads K,..] [--rope none,half,interleaved] [--bias all|qkv|out|none]
              [--head-dim H] [--qk-norm none|head|flat|l2] [--qk-norm-eps X] [--qk-norm-offset X]
              [--scale X] [--softcap X] [--sinks] [--rope-dim R] [--rope-scaling KIND:KEY=VALUE,..]
              [--attn-temperature-tuning [--floor-scale X] [--attn-scale X]]
              [--kv-seq S,..] [--mask none,causal,padding,window:W,packed:D,chunk:C] [--processes P] [--baseline KEY]
              [--threads K] [--precision highest|default] [--verdict A,B]
              [--json P] [--markdown P] [--plot P.png]
    mha-bench compare BASE.json NEW.json [--threshold 0.10]
    mha-bench report RUN.json [--markdown P] [--plot P.png]
    mha-bench table RUN.json [--markdown P]   (one cross-framework Markdown table of a run)
    mha-bench sharded [--shards 1,2,4] [--shardings sp,tp] [--seq 4096] [--json P] [--markdown P]
    mha-bench tune [--sizes BxNxTxH,..] [--blocks QxK,..] [--out P] [--show]   (the JAX kernel table)
    mha-bench --decode S [--batch B] [--embed E] [--heads N] [--kv-heads K] [--rope ..] [--bias ..] ...
                                                      (prefill and one-token step: parity.bench.decode)
    mha-bench latent [--decode S] [--embed E] [--heads N] [--kv-lora-rank C] ...   (DeepSeek's MLA: parity.bench.latent)

Exit codes (a run is a pass only if it measured something and nothing failed):

    0  every row ok or skip, and at least one row measured (compare: no regression)
    1  an item failed (an `error` row), or nothing was measured: every row a skip
       (a device that is not present, float16 on a CPU, ...) (compare: a regression)
    2  usage error, found before anything runs: a bad argument, an empty selection, an
       output path that cannot be written or given twice; compare/report: an input file
       that is not a valid mha-bench JSON, or no row to compare
    3  the run finished but a report file could not be written: the table was printed
       and the results were saved as JSON in the temporary directory (the path is printed)
  130  interrupted (Ctrl-C): the worker was ended, the rows measured so far were printed
       and written to the requested reports, the others say they were not run

A `noisy` row (IQR/median above spec.NOISY_IQR) is measured, not failed: it does not
change the exit code and it is never `ok`; a verdict rests on the paired interval over the
worker processes (`verdict`), which a noisy row does not veto, and any interference does.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mha_spec.files import check_writable, writable_problem, write_atomic
from parity.bench import report, sweep, verdict
from parity.bench.measure import CALIBRATION_DRIFT, OTHERS_CPU, OthersCpu
from parity.bench.records import Key
from parity.bench.spec import BIASES, DTYPES, IMPLS, MASKS, MEASURED, PASSES, PRESETS, BenchCase, BenchMask, select_impls
from mha_spec import QK_NORMS, ROPE_CONVENTIONS
from parity.impls import load_user_impl
from parity.cli_args import comma_separated, nonnegative_int, positive_float, positive_int
from parity.cli_args import positive_ints as _ints

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_WRITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
OUTPUTS = (("--json", "json"), ("--markdown", "markdown"), ("--plot", "plot"))


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mha-bench",
        description="Jit benchmark of multi-head attention across torch and JAX "
        "(also: `mha-bench compare BASE.json NEW.json`, `mha-bench report RUN.json`, `mha-bench tune`, "
        "`mha-bench sharded`).",
        epilog="implementations: " + ", ".join(str(Key.of(im)) for im in IMPLS)
        + ". Exit: 0 pass, 1 an item failed or nothing was measured, 2 usage error, 3 a report could not be written, "
        "130 interrupted (partial report written).",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="grid and timing preset (default quick)")
    p.add_argument("--device", choices=("cpu", "gpu", "tpu", "auto"), default="cpu",
                   help="the device kind; auto = best present (gpu, tpu, cpu); torch runs on cpu beside a TPU")
    _add_grid_arguments(p)
    _add_timing_arguments(p)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="print the planned items and exit")
    return p


def _add_grid_arguments(p: argparse.ArgumentParser) -> None:
    """What is measured: the implementations, passes, dtypes and the grid of cases (shapes, masks, layers)."""
    p.add_argument("--impls", help="comma-separated name[:mode[:weights|fused]] patterns, e.g. ours-torch:eager,jax-dpa-core")
    p.add_argument("--impl", action="append", default=[], metavar="MODULE:ATTR",
                   help="also time your own implementation (a parity.impls.Implementation), e.g. parity.examples.jax_port:port")
    p.add_argument("--passes", type=comma_separated(PASSES, nonempty=True), help="fwd,fwd+bwd")
    p.add_argument("--dtypes", type=comma_separated(tuple(DTYPES), nonempty=True), help="float32,bfloat16,float16")
    p.add_argument("--seq", type=_ints, help="query lengths T (and key lengths S = T unless --kv-seq), e.g. 256,1024")
    p.add_argument("--kv-seq", type=_ints, metavar="S,..", help="key/value lengths S (default: S = T): T != S cases")
    p.add_argument("--mask", type=bench_masks, metavar="none,causal,padding,window:W,packed:D,chunk:C",
                   help="keep-mask of every case: none (default); causal, bottom-right aligned (needs T <= S); "
                   "padding (batch row b keeps its first S - floor(b*S/2B) keys); window:W, causal over the last "
                   "W keys, itself included (Mistral's sliding_window; bottom-right, T <= S); packed:D, D equal "
                   "causal documents per row (T = S, T divisible by D); chunk:C, causal within chunks of C positions "
                   "(Llama 4's attention_chunk_size; bottom-right, T <= S)")
    p.add_argument("--max-seq", type=positive_int, help="drop preset lengths above this")
    p.add_argument("--decode", type=positive_int, metavar="S",
                   help="time the inference path instead: the prefill of S tokens and the one-token step after "
                   "them, for the layer the other flags make (one value each); parity.bench.decode")
    p.add_argument("--batch", type=_ints)
    p.add_argument("--embed", type=_ints)
    p.add_argument("--heads", type=_ints, help="query heads N")
    p.add_argument("--kv-heads", type=_ints, metavar="K,..",
                   help="key/value heads (each must divide every N; 1 = multi-query; default N): grouped-query cases")
    p.add_argument("--rope", type=comma_separated(("none", *ROPE_CONVENTIONS), nonempty=True), metavar="none,half,..",
                   help="rotary embedding of q and k (positions arange): none, half (rotate-half) or interleaved")
    p.add_argument("--bias", choices=tuple(BIASES), default="all",
                   help="projections with a bias: all (default), qkv (q/k/v only), out (out_proj only), none")
    _add_modern_arguments(p)


def _add_modern_arguments(p: argparse.ArgumentParser) -> None:
    """The layers after Llama, as `mha-parity --layer` spells them (H=, qk_norm=, ..., sinks=yes): every case's layer."""
    p.add_argument("--head-dim", type=positive_int, metavar="H", help="a head dim of its own (N*H need not be E; default E/N)")
    p.add_argument("--qk-norm", choices=("none", *QK_NORMS), default="none",
                   help="RMSNorm of q and k before RoPE: over each head's H (head: Qwen3, Gemma 3) or the whole "
                   "projection (flat: OLMo 2); or Llama 4's weightless L2 norm of each head after RoPE (l2)")
    p.add_argument("--qk-norm-eps", type=nonnegative_float, metavar="X", help="the QK-norm's epsilon (default 1e-6)")
    p.add_argument("--qk-norm-offset", type=finite_float, metavar="X",
                   help="the QK-norm's weight is offset + w (Gemma: 1; default 0)")
    p.add_argument("--scale", type=positive_float, metavar="X", help="the softmax scale (default H**-0.5)")
    p.add_argument("--softcap", type=positive_float, metavar="X", help="cap the logits to X*tanh(s/X) (Gemma 2)")
    p.add_argument("--sinks", action="store_true", help="a learned sink logit per query head (GPT-OSS)")
    p.add_argument("--rope-dim", type=positive_int, metavar="R",
                   help="partial rotary: RoPE rotates the first R features of each head (even; needs --rope)")
    p.add_argument("--rope-scaling", type=_rope_scaling, metavar="KIND:KEY=VALUE,..",
                   help="scaled RoPE as mha-parity --layer rope_scaling= spells it: linear, llama3, yarn or longrope "
                   "with transformers' keys, lists a;b;c, e.g. yarn:factor=32,original_max_position_embeddings=4096 "
                   "(needs --rope)")
    p.add_argument("--attn-temperature-tuning", action="store_true",
                   help="Llama 4's NoPE layers: queries times log(floor((pos + 1) / floor_scale) + 1)·attn_scale + 1 "
                   "(needs --rope none)")
    p.add_argument("--floor-scale", type=positive_float, metavar="X",
                   help="the temperature's floor_scale (default 8192; needs --attn-temperature-tuning)")
    p.add_argument("--attn-scale", type=finite_float, metavar="X",
                   help="the temperature's attn_scale (default 0.1; needs --attn-temperature-tuning)")


def _rope_scaling(text: str):
    """--rope-scaling's argparse `type`: `mha_spec.RopeScaling.parse` (a usage error naming what does not parse)."""
    from mha_spec import RopeScaling

    try:
        return RopeScaling.parse(text)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def finite_float(text: str) -> float:
    """An argparse `type`: a finite number (a usage error naming the flag otherwise)."""
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}") from None
    if not math.isfinite(val):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return val


def nonnegative_float(text: str) -> float:
    """An argparse `type`: a finite number >= 0."""
    val = finite_float(text)
    if val < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return val


def modern_layer(args) -> dict:
    """The `spec.LAYER_FIELDS` keywords of `BenchCase.of` from the flags; ValueError naming a flag the layer
    would ignore (--qk-norm-eps or --qk-norm-offset without --qk-norm)."""
    qk_norm = None if args.qk_norm == "none" else args.qk_norm
    for flag, value in (("--qk-norm-eps", args.qk_norm_eps), ("--qk-norm-offset", args.qk_norm_offset)):
        if value is not None and qk_norm is None:
            raise ValueError(f"{flag} {value} is the QK-norm's, but the layer has none: add --qk-norm head|flat|l2")
    ropes = args.rope or ("none",)
    for flag, value in (("--rope-dim", args.rope_dim), ("--rope-scaling", args.rope_scaling)):
        if value is not None and "none" in ropes:
            raise ValueError(f"{flag} {value} is RoPE's, but --rope {','.join(ropes)} has a layer without it: "
                             "give --rope half and/or interleaved only")
    for flag, value in (("--floor-scale", args.floor_scale), ("--attn-scale", args.attn_scale)):
        if value is not None and not args.attn_temperature_tuning:
            raise ValueError(f"{flag} {value} is the temperature's, but the layer has none: add --attn-temperature-tuning")
    if args.attn_temperature_tuning and ropes != ("none",):
        raise ValueError(f"--attn-temperature-tuning is Llama 4's NoPE layers', but --rope {','.join(ropes)} rotates: "
                         "give --rope none (or leave --rope out)")
    return {"head_dim": args.head_dim, "qk_norm": qk_norm, "qk_norm_eps": args.qk_norm_eps,
            "qk_norm_offset": args.qk_norm_offset, "scale": args.scale, "softcap": args.softcap, "sinks": args.sinks,
            "rope_dim": args.rope_dim, "rope_scaling": args.rope_scaling,
            "attn_temperature_tuning": args.attn_temperature_tuning or None, "floor_scale": args.floor_scale,
            "attn_scale": args.attn_scale}


def _add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """How it is measured: threads, precision, repeats, worker processes, the verdict's pair and the seed."""
    p.add_argument("--threads", type=positive_int, help="CPU threads per worker (affinity + framework thread pools)")
    p.add_argument("--precision", choices=("highest", "default"), default="highest",
                   help="highest: pin float32 matmuls to full precision in both frameworks (default)")
    p.add_argument("--budget", type=positive_float, help="seconds of timed repeats per item (overrides the preset)")
    p.add_argument("--min-repeats", type=positive_int)
    p.add_argument("--processes", type=positive_int, default=2,
                   help="independent worker processes per case, one after the other (default 2; a verdict needs "
                   f"at least {verdict.MIN_PROCESSES} to be conclusive)")
    p.add_argument("--baseline", metavar="KEY",
                   help="the implementation (full key) the ratio column is taken against (default: ours-torch fused, "
                   "else ours-jax fused, else the first measured)")
    p.add_argument("--peak-sizes", type=_ints, help="square matmul sizes for the measured peak (overrides the preset)")
    p.add_argument("--isolation", choices=("case", "run"),
                   help="one worker (both frameworks) per case, or one for the whole run (default: the preset's)")
    p.add_argument("--sequential", action="store_true",
                   help="time implementations one after another instead of round-robin per (case, pass): "
                   "samples are then not paired")
    p.add_argument("--verdict", metavar="A,B",
                   help="the two implementations (full keys, e.g. ours-jax:jit:fused,torch-sdpa-core:eager:fused) every "
                   "verdict compares (default: the fastest of each framework)")
    p.add_argument("--item-timeout", type=positive_float, default=1800.0, help="seconds before a stuck item is killed")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="NumPy seed for weights and inputs (>= 0)")


def bench_masks(text: str) -> tuple[str, ...]:
    """--mask's argparse `type`: 'none,window:1024' -> ('none', 'window:1024'), each read once by
    `spec.BenchMask.parse` (a bad one is a usage error naming it) and kept as its canonical string."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: empty list; choose from {','.join(MASKS)},window:W,packed:D")
    try:
        return tuple(dict.fromkeys(str(BenchMask.parse(t)) for t in items))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cpus_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_config(args) -> sweep.RunConfig:
    """The run's configuration; ValueError for a combination that argparse cannot see is wrong."""
    preset = PRESETS[args.preset]
    plan = sweep.device_plan(args.device)
    device = plan.name
    seqs = args.seq or preset.seqs
    if args.max_seq:
        seqs = tuple(s for s in seqs if s <= args.max_seq)
        if not seqs:
            raise ValueError(f"--max-seq {args.max_seq} drops every sequence length {args.seq or preset.seqs}: nothing to run")
    dtypes = args.dtypes or preset.dtypes
    if not args.dtypes and device == "gpu" and "bfloat16" in dtypes:
        dtypes = (*dtypes, "float16")  # native half matmuls on GPUs; CPU runs skip float16
    ropes = tuple(None if r == "none" else r for r in (args.rope or ("none",)))
    modern = modern_layer(args)
    cases = tuple(dict.fromkeys(
        BenchCase.of(b, s, kv_s or s, e, h, d, kv_heads=kv or h, rope=rope, bias=args.bias, mask=mask, **modern)
        for d in dtypes for b in (args.batch or preset.batch) for e in (args.embed or preset.embed)
        for h in (args.heads or preset.heads) for kv in (args.kv_heads or (None,)) for rope in ropes
        for mask in (args.mask or ("none",)) for s in seqs for kv_s in (args.kv_seq or (None,))
    ))
    timing = preset.timing
    if args.budget is not None:
        timing = replace(timing, budget_s=args.budget)
    if args.min_repeats is not None:
        timing = replace(timing, min_repeats=args.min_repeats, max_repeats=max(timing.max_repeats, args.min_repeats))
    if args.threads is not None and args.threads > _cpus_available():
        raise ValueError(f"--threads {args.threads} but only {_cpus_available()} CPUs are available to this process")
    impls = select_impls(args.impls) if args.impls else select_impls(preset.impls)
    user = tuple(i for spec in args.impl for i in load_user_impl(spec))  # loaded here too: a bad spec fails now
    impls = (*impls, *(u for u in user if Key.of(u) not in {Key.of(i) for i in impls}))
    if args.peak_sizes:
        preset = replace(preset, peak_sizes=args.peak_sizes)
    pair = _verdict_pair(args.verdict, impls) if args.verdict is not None else None
    if args.baseline is not None:
        try:
            Key.parse(args.baseline).find(impls)
        except ValueError:
            raise ValueError(f"--baseline {args.baseline} is not among the selected implementations: "
                             f"{', '.join(str(Key.of(im)) for im in impls)}") from None
    return sweep.RunConfig(
        preset=preset, plan=plan, impls=impls, cases=cases, user_impls=tuple(args.impl),
        passes=args.passes or preset.passes, threads=args.threads, precision=args.precision, seed=args.seed,
        isolation=args.isolation or preset.isolation, interleave=not args.sequential, item_timeout_s=args.item_timeout, timing=timing,
        verdict=pair, processes=args.processes, baseline=args.baseline,
    )


def _verdict_pair(spec: str, impls) -> tuple[str, str]:
    """--verdict A,B: the keys of two different selected implementations, each looked up once
    (`records.Key.find`); the keys stay the spelling the workers and the JSON compare by."""
    keys = [k.strip() for k in spec.split(",")]
    known = [str(Key.of(im)) for im in impls]
    if len(keys) != 2 or not all(keys) or keys[0] == keys[1]:
        raise ValueError(f"--verdict {spec!r}: name two different implementations, e.g. {','.join(known[:2])}")
    found, missing = [], []
    for key in keys:
        try:
            found.append(Key.parse(key).find(impls))
        except ValueError:
            missing.append(key)
    if missing:
        raise ValueError(f"--verdict: {', '.join(missing)} not among the selected implementations: {', '.join(known)}")
    return str(Key.of(found[0])), str(Key.of(found[1]))


def check_outputs(args) -> list[tuple[str, str]]:
    """[(flag, path)] of the requested reports; ValueError if one cannot be written or repeats another."""
    outputs = [(flag, getattr(args, name, None)) for flag, name in OUTPUTS]
    outputs = [(flag, path) for flag, path in outputs if path]
    seen: dict[str, str] = {}
    for flag, path in outputs:
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{seen[real]} and {flag} both name {path}: each report needs its own path")
        seen[real] = flag
        problem = writable_problem(path)
        if problem:
            raise ValueError(f"{flag} {path}: cannot write there: {problem}")
    return outputs


def _error(console: Console, text: str) -> None:
    console.print(text, style="red", markup=False, soft_wrap=True)  # one line, never folded


def _warn(console: Console, text: str) -> None:
    console.print(text, style="yellow", markup=False, width=min(console.width, report.CONSOLE_WIDTH))


def load_note(when: str, load, cores: int | None, own: int = 0) -> str | None:
    """The 1-minute load average, less `own` (the threads of the run's own workers, whose load it still
    holds at the end), at or above half the cores. Reported, never a veto: it decays over minutes, so
    it still holds a run that ended before this one started (`others_warning` measures what is now)."""
    if not load or not cores or load[0] - own < cores / 2:
        return None
    less = f", less the workers' {own} thread(s)," if own else ""
    return (f"note: load average {load[0]:.2f} at the {when} of the run{less} is at or above half the {cores} cores "
            "(it lags by minutes; the other processes' CPU, measured, decides interference)")


def others_warning(others: float | None) -> str | None:
    """Interference: other processes used OTHERS_CPU cores or more on average over the whole run
    (`measure.OthersCpu`: compiles and warm-ups included, which the rounds' probes do not see)."""
    if others is None or others < OTHERS_CPU:
        return None
    return (f"interference: other processes used {others:.2f} cores on average over the run: they competed for "
            "the CPU; verdicts are inconclusive")


def calibrate(repeats: int = 5) -> float:
    """Seconds for a fixed pure-Python loop (the fastest of a few): how fast one core is right now."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i * i
        best = min(best, time.perf_counter() - t0)
    return best


def calibration_warning(start: float | None, end: float | None) -> str | None:
    if not start or not end or abs(end / start - 1) <= CALIBRATION_DRIFT:
        return None
    return (f"interference: a fixed calibration loop took {end / start:.2f}x as long at the end of the run as at the "
            "start: the machine's speed changed while it ran")


def _loadavg():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _execute(cfg, items, no_progress: bool, console: Console, spawn):
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=no_progress, transient=True,
    )
    with progress:
        task = progress.add_task("mha-bench", total=sum(1 if it.skip else cfg.processes for it in items))

        def on_event(kind, data):
            if kind == "start":
                progress.update(task, description=f"{data.case.label} {data.pass_} {Key.of(data.impl)}")
            else:
                progress.advance(task)

        kw = {"spawn": spawn} if spawn is not None else {}
        return sweep.execute(cfg, items, on_event, **kw)


def write_outputs(outputs, rows, env: dict, console: Console, keep_results: bool = True, verdicts=()) -> bool:
    """Write every requested report; True if all were written. On a failure say so and, unless
    a JSON was written (or `keep_results` is off: `report` re-renders a file that exists), save
    the results as JSON in the temporary directory and say where."""
    writers = {"--json": report.write_json, "--markdown": report.write_markdown, "--plot": report.write_plot}
    failed, json_written = [], False
    for flag, path in outputs:
        try:
            writers[flag](path, rows, env, verdicts)
            json_written = json_written or flag == "--json"
        except Exception as e:  # noqa: BLE001 - a full disk or a plotting bug must not lose the results
            failed.append(flag)
            _error(console, f"mha-bench: error: could not write {flag} {path}: {type(e).__name__}: {e}")
    if failed and keep_results and not json_written:
        try:
            fd, fallback = tempfile.mkstemp(prefix="mha-bench-results-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(report.to_json(rows, env, verdicts), f, indent=1, allow_nan=False)
            _error(console, f"mha-bench: the results are kept in {fallback}")
        except Exception as e:  # noqa: BLE001 - the temporary directory may be full too: say so, no traceback
            _error(console, f"mha-bench: error: the results could not be kept either: {type(e).__name__}: {e}")
    return not failed


def exit_code(rows, console: Console) -> int:
    """EXIT_FAILED when an item failed or nothing was measured, else EXIT_OK; says which."""
    counts = collections.Counter(r["status"] for r in rows)
    if counts["error"]:
        _error(console, f"{counts['error']} item(s) failed; see the status column")
        return EXIT_FAILED
    if not sum(counts[s] for s in MEASURED):
        reasons = collections.Counter(r.get("message") or "" for r in rows if r["status"] == "skip")
        why = "; ".join(f"{n}× {msg}" for msg, n in reasons.most_common(3))
        _error(console, f"mha-bench: nothing was measured: all {len(rows)} row(s) are skip rows ({why})")
        return EXIT_FAILED
    return EXIT_OK


def decode_spec(args):
    """The `--decode S` run (`parity.bench.decode.DecodeBench`) the flags ask for; ValueError naming a flag it
    cannot take (the sequence and mask flags, or several values of a layer flag: one decode case a run)."""
    from parity.bench import decode

    given = [f for f, v in (("--seq", args.seq), ("--kv-seq", args.kv_seq), ("--mask", args.mask),
                            ("--passes", args.passes), ("--max-seq", args.max_seq), ("--list", args.list or None),
                            ("--plot", args.plot)) if v]
    if given:
        raise ValueError(f"--decode S sets the lengths (S cached tokens, one new): {', '.join(given)} cannot be given "
                         "with it")
    preset = PRESETS[args.preset]
    one = {}
    for flag, values, default in (("--batch", args.batch, (1,)), ("--embed", args.embed, preset.embed),
                                  ("--heads", args.heads, preset.heads), ("--kv-heads", args.kv_heads, (None,)),
                                  ("--rope", args.rope, ("none",)), ("--dtypes", args.dtypes, ("float32",))):
        values = values or default
        if len(values) != 1:
            raise ValueError(f"--decode times one layer: {flag} takes one value, got {','.join(map(str, values))}")
        one[flag] = values[0]
    heads = one["--heads"]
    rope = None if one["--rope"] == "none" else one["--rope"]
    case = BenchCase.of(one["--batch"], 1, args.decode + 1, one["--embed"], heads, one["--dtypes"],
                        kv_heads=one["--kv-heads"] or heads, rope=rope, bias=args.bias, **modern_layer(args))
    for user in args.impl:
        decode.user_impl(user)  # loads, or names what it is not
    return decode.DecodeBench(case, impls=decode.select(args.impls), user=tuple(args.impl), processes=args.processes,
                              budget_s=args.budget or PRESETS[args.preset].timing.budget_s, threads=args.threads,
                              seed=args.seed)


def run_decode(args, console: Console, spawn_worker=None) -> int:
    """`mha-bench --decode S`: `parity.bench.decode`'s run, printed, its JSON and Markdown written."""
    from parity.bench import decode

    try:
        spec = decode_spec(args)
        for path in (args.json, args.markdown):
            if path:
                check_writable(path)
    except (ValueError, TypeError, ImportError) as e:  # an --impl that does not load included
        _error(console, f"mha-bench: error: {e}")
        return EXIT_USAGE
    result = decode.run(spec, spawn_worker or decode.spawn)
    text = decode.markdown(result)
    console.print(text, markup=False, soft_wrap=True)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    if args.markdown:
        write_atomic(args.markdown, text)
    measured = [r for r in result["rows"] if r["status"] in MEASURED]
    return EXIT_OK if measured and not any(r["status"] == "error" for r in result["rows"]) else EXIT_FAIL


def run(argv, console: Console, spawn=None) -> int:
    args = run_parser().parse_args(argv)
    if args.decode is not None:
        return run_decode(args, console)
    try:
        cfg = build_config(args)
        outputs = check_outputs(args)
    except (ValueError, TypeError, ImportError) as e:  # bad arguments, or an --impl that does not load
        _error(console, f"mha-bench: error: {e}")
        return EXIT_USAGE
    items = sweep.plan(cfg)
    if args.list:
        for it in items:
            line = f"{it.case.label}  {it.pass_:8s} {Key.of(it.impl)}" + (f"  (skip: {it.skip})" if it.skip else "")
            console.print(line, markup=False)
        console.print(estimate_line(cfg, items), markup=False, soft_wrap=True)
        return EXIT_OK
    if cfg.plan.skip_reason:
        _warn(console, f"mha-bench: {cfg.plan.skip_reason}: every item is a skip row")
    cores = os.cpu_count()
    load_start, calib_start, others = _loadavg(), calibrate(), OthersCpu()
    collected = _execute(cfg, items, args.no_progress, console, spawn)
    others_cpu = others()  # the workers have been waited for: their CPU is this process's children's
    if collected.interrupted:
        _warn(console, "mha-bench: interrupted: the worker was ended; the items not run are reported as such")
        load_end, calib_end = _loadavg(), None
    else:
        load_end, calib_end = _loadavg(), calibrate()
    rows = sweep.finish(items, collected, cfg.baseline)
    own = max((len(e.get("cpus") or ()) for e in collected.envs.values()), default=0)
    interference = [t for t in (others_warning(others_cpu), calibration_warning(calib_start, calib_end)) if t]
    vs = sweep.finish_verdicts(cfg, items, rows, collected, interference, cores)
    interference += list(dict.fromkeys(t for v in vs for t in v["interference"] if t not in interference))
    notes = [t for t in (load_note("start", load_start, cores), load_note("end", load_end, cores, own)) if t]
    notes += sweep.run_notes(collected, cores)
    env = {"loadavg_start": load_start, **sweep.bench_environment(cfg, collected), "loadavg_end": load_end,
           "calibration_s": [calib_start, calib_end], "others_cpu": others_cpu,
           "interference": interference, "interference_notes": notes, "probes": collected.probes,
           "interrupted": collected.interrupted}
    report.print_table(rows, console)
    report.print_verdicts(vs, rows, console)
    for text in interference:
        _warn(console, text if text.startswith("interference") else f"interference: {text}")
    for text in notes:
        _warn(console, text if text.startswith("note") else f"note: {text}")
    written = write_outputs(outputs, rows, env, console, verdicts=vs)
    if collected.interrupted:
        return EXIT_INTERRUPTED
    code = exit_code(rows, console)
    return code if written else EXIT_WRITE


def _load_inputs(paths, console: Console, prog: str):
    """The validated files, or None after a one-line error."""
    try:
        return [report.load(p) for p in paths]
    except report.BenchFileError as e:
        _error(console, f"{prog}: error: {e}")
        return None


def compare_main(argv, console: Console) -> int:
    p = argparse.ArgumentParser(
        prog="mha-bench compare",
        description="Flag regressions between two mha-bench JSON files. A row regressed when its median "
        "grew by more than THRESHOLD of the base median and by more than the mean IQR of the two runs; "
        "beyond the threshold but within that noise it is 'noisy'.",
        epilog="Exit: 0 no regression, 1 a regression, 2 bad input or nothing to compare.",
    )
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--threshold", type=positive_float, default=0.10, help="relative slow-down counted as a regression")
    args = p.parse_args(argv)
    loaded = _load_inputs((args.base, args.new), console, "mha-bench compare")
    if loaded is None:
        return EXIT_USAGE
    base, new = loaded
    for diff in report.environment_differences(base, new):
        _warn(console, f"note: the runs differ in {diff}")
    result = report.compare(base, new, args.threshold)
    report.print_compare(result, args.threshold, console)
    if not result.compared:
        _error(console, f"mha-bench compare: error: no row of {args.new} matches an ok row of {args.base} "
               "(same case, pass and implementation): nothing was compared")
        return EXIT_USAGE
    n = result.regressions
    console.print(f"{result.compared} row(s) compared: {n} regression(s), {result.count('noisy')} noisy, "
                  f"{result.count('faster')} faster; {len(result.only_base)} only in base, "
                  f"{len(result.only_new)} only in new", markup=False)
    return EXIT_FAILED if n else EXIT_OK


def report_main(argv, console: Console) -> int:
    p = argparse.ArgumentParser(prog="mha-bench report", description="Re-render a saved mha-bench JSON.",
                                epilog="Exit: 0 written, 2 bad input or output path, 3 a report could not be written.")
    # dest "input", not "json": check_outputs/write_outputs treat an attribute named json as the
    # --json output; report writes none.
    p.add_argument("input", metavar="RUN.json")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    args = p.parse_args(argv)
    args.json = None  # report writes no JSON
    try:
        outputs = check_outputs(args)
        for flag, path in outputs:
            if os.path.realpath(path) == os.path.realpath(args.input):
                raise ValueError(f"{flag} {path} is the input file: it would overwrite the saved run")
    except ValueError as e:
        _error(console, f"mha-bench report: error: {e}")
        return EXIT_USAGE
    loaded = _load_inputs((args.input,), console, "mha-bench report")
    if loaded is None:
        return EXIT_USAGE
    data = loaded[0]
    report.print_table(data["rows"], console)
    report.print_verdicts(data.get("verdicts", []), data["rows"], console)
    written = write_outputs(outputs, data["rows"], data.get("environment", {}), console, keep_results=False,
                            verdicts=data.get("verdicts", []))
    return EXIT_OK if written else EXIT_WRITE


# What --list's estimate adds to the timed calls, measured on a 2-core AMD EPYC (rounded up): a worker process's
# start (importing torch, JAX and flax: 2.8 s), torch.compile's first compile in a process (~20 s; ~3 s for each
# further item), and an XLA compile of any other item (~1 s). A call's time is guessed from its FLOPs at
# ESTIMATE_GFLOPS (our fused layers ran 100-160 GFLOP/s float32 on that EPYC, measured peak 221: the grid of
# docs/results/bench-grid-epyc-before-tune.md; 110-170 after the tune, bench-grid-epyc.md), so that a slow item's
# min_repeats count, as they do in a run.
WORKER_START_S, COMPILE_FIRST_S, COMPILE_MORE_S, PREPARE_S = 3.0, 20.0, 3.0, 1.0
ESTIMATE_GFLOPS = {"cpu": 100.0, "gpu": 20_000.0, "tpu": 50_000.0}
CHECK_CALLS = 3  # untimed calls of an item besides its warm-up: the output, the memory probe, the gradients


def estimate_s(cfg, items) -> tuple[int, float]:
    """(timed rows, estimated wall seconds) of a planned run: per worker process, each timed item's timed calls --
    the preset's budget (`Timing.budget_s`: sampling stops there, or once the verdict settles), or min_repeats
    calls where those take longer --, its warm-up and check calls, plus worker starts and compiles (the constants
    above). A call's time is its FLOPs (`spec.pass_flops`) at ESTIMATE_GFLOPS: an estimate, off by what the
    implementations' rate is off from it."""
    from parity.bench.spec import pass_flops

    timed = [it for it in items if not it.skip]
    rate = ESTIMATE_GFLOPS.get(cfg.device, ESTIMATE_GFLOPS["cpu"]) * 1e9
    t = cfg.timing
    calls = 0.0
    for it in timed:
        call = pass_flops(it.case, it.pass_) / rate
        calls += max(t.budget_s, t.min_repeats * call) + (t.warmup + CHECK_CALLS) * call
    compiled = [it for it in timed if it.impl.mode == "compile"]
    workers = (1 if cfg.isolation == "run" else len({it.case for it in timed})) if timed else 0
    prepare = (len(timed) - len(compiled)) * PREPARE_S + len(compiled) * COMPILE_MORE_S
    prepare += COMPILE_FIRST_S * (min(1, len(compiled)) if cfg.isolation == "run" else len({it.case for it in compiled}))
    return len(timed), cfg.processes * (calls + prepare + workers * WORKER_START_S)


def estimate_line(cfg, items) -> str:
    n, seconds = estimate_s(cfg, items)
    return (f"{len(items)} items: {n} timed, {len(items) - n} skip; estimated wall time ~{seconds / 60:.1f} min "
            f"({cfg.processes} worker process(es) per group; per timed item {cfg.timing.budget_s:g} s of timed calls "
            f"or {cfg.timing.min_repeats} calls where longer, a call's time from its FLOPs at "
            f"{ESTIMATE_GFLOPS.get(cfg.device, ESTIMATE_GFLOPS['cpu']):g} GFLOP/s; plus worker starts, compiles and "
            "warm-ups)")


def table_main(argv, console: Console) -> int:
    """`mha-bench table RUN.json [--markdown P]`: the cross-framework table of a saved run (`report.cross_table`)."""
    p = argparse.ArgumentParser(prog="mha-bench table", description="One saved run as one cross-framework Markdown "
                                "table: per shape and implementation, fwd and fwd+bwd time, TFLOP/s, % of the measured "
                                "peak, peak memory, compile time and kernel.",
                                epilog="Exit: 0 printed (and written), 2 bad input or output path, 3 not written.")
    p.add_argument("input", metavar="RUN.json")
    p.add_argument("--markdown", metavar="PATH")
    args = p.parse_args(argv)
    try:
        if args.markdown:
            check_writable(args.markdown)
            if os.path.realpath(args.markdown) == os.path.realpath(args.input):
                raise ValueError(f"--markdown {args.markdown} is the input file: it would overwrite the saved run")
    except (ValueError, OSError) as e:
        _error(console, f"mha-bench table: error: {e}")
        return EXIT_USAGE
    loaded = _load_inputs((args.input,), console, "mha-bench table")
    if loaded is None:
        return EXIT_USAGE
    text = report.cross_table(loaded[0]["rows"], loaded[0].get("environment", {}))
    console.print(text, markup=False, soft_wrap=True)
    if args.markdown:
        try:
            write_atomic(args.markdown, text)
        except OSError as e:
            _error(console, f"mha-bench table: {args.markdown} could not be written: {e}")
            return EXIT_WRITE
    return EXIT_OK


def main(argv=None, console: Console | None = None, spawn=None) -> int:
    """Entry point; `spawn` replaces the worker launcher (tests run fake workers through it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=100)  # redirected to a file or a CI log: the table is made for 100 columns
    try:
        if argv[:1] == ["compare"]:
            return compare_main(argv[1:], console)
        if argv[:1] == ["sharded"]:
            from parity.bench import sharded_cli

            return sharded_cli.main(argv[1:], console)
        if argv[:1] == ["report"]:
            return report_main(argv[1:], console)
        if argv[:1] == ["table"]:
            return table_main(argv[1:], console)
        if argv[:1] == ["latent"]:
            from parity.bench import latent

            return latent.main(argv[1:], console)
        if argv[:1] == ["tune"]:
            from parity.bench import tune_command

            return tune_command.main(argv[1:], console)
        return run(argv, console, spawn)
    except KeyboardInterrupt:  # outside the sweep (which reports what it measured): nothing to save
        _error(console, "mha-bench: interrupted")
        return EXIT_INTERRUPTED
