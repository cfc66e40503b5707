"""`mha-parity` (also `python -m parity`): run the parity matrix, print a table, write reports.

Exit status: 0 when something was checked and nothing failed or errored (skips are
fine); 1 when a row failed or errored, or a report could not be written; 2 for a usage
error; 3 when nothing was checked (every requested row skipped, or every row of a user's
--impl: e.g. a layer declaring no variants on the variant cases); 130 when interrupted
(the reports of what finished are still written).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from parity.cli_args import add_alias, comma_separated, nonnegative_int, parse_layer, positive_float
from parity.devices import DEVICES
from parity.dtypes import DTYPES
from parity.harness import checkpoint
from parity.harness.matrix import CHECKS

EXIT_FAIL, EXIT_USAGE, EXIT_NOTHING, EXIT_INTERRUPTED = 1, 2, 3, 130


CASES_HELP = ("case sets or case name prefixes/globs (e.g. 'self/*,cross'); sets: 'latent' (DeepSeek's multi-head "
              "latent attention: its own cases and checks, docs/latent.md), 'modern' (grouped and multi-query heads, "
              "RoPE half/interleaved, projections without bias, a Llama layer, the layers after it, Llama 4's), 'rope' "
              "(partial and scaled RoPE: llama3, yarn, longrope, linear; also in 'modern'), 'masks' (packed documents, "
              "sliding windows and chunks, with padding and T != S), 'default', 'quick'")


def build_parser() -> argparse.ArgumentParser:
    from parity.impls import select
    from parity.harness.sharded.launch import DEFAULT_JOB_TIMEOUT_S

    ours = [i.name for i in select("ours")]
    p = argparse.ArgumentParser(
        prog="mha-parity",
        description="Check mha_torch and mha_jax (and your own attention: --impl) against each other, a float64 "
        "NumPy oracle and the ecosystem's attention layers: forward, gradients, training and divergence.",
    )
    p.add_argument("--device", choices=DEVICES, default="auto", help="where to run (auto = best present; default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small matrix that takes a few seconds")
    p.add_argument("--cases", type=comma_separated(), default=(), metavar="A,B", help=CASES_HELP)
    p.add_argument("--dtypes", type=comma_separated(DTYPES), default=None, metavar=",".join(DTYPES),
                   help="default: every dtype each case runs in")
    p.add_argument("--checks", type=comma_separated(CHECKS), default=None, metavar=",".join(CHECKS),
                   help="default: every check each case runs")
    p.add_argument("--impls", type=comma_separated(ours), default=None, metavar="torch,jax-jit,...",
                   help=f"which of our implementations to run ({', '.join(ours)}; default: all but the torch.compile ones)")
    p.add_argument("--impl", action="append", default=[], metavar="MODULE:ATTR",
                   help="your own implementation (a parity.impls.Implementation), e.g. parity.examples.jax_port:port; repeatable")
    p.add_argument("--layer", type=parse_layer, default=None, metavar="E=64,N=4,K=2,rope=half,bias=none",
                   help="check on this layer at --shape B,T,S (default 2,5,5) instead of the matrix: causal, padding and "
                   "random masks (--quick: causal), and with --checks decode a decode of the S tokens; keys E, N, K, rope "
                   "(none|half|interleaved), theta (with rope only), "
                   "bias (all|none|qkv|out); H, qk_norm, qk_norm_eps, qk_norm_offset, scale, softcap, sinks=yes; "
                   "rope_dim=R (partial rotary) and rope_scaling=kind:key=value,... (linear|llama3|yarn|longrope, "
                   "lists a;b;c), with rope only")
    p.add_argument("--compile", action="store_true", help="also run torch.compile of the selected torch implementations (slow on CPU)")
    p.add_argument("--framework-defaults", action="store_true",
                   help="keep the frameworks' default matmul precision (TF32 on GPU, bf16 passes on TPU) instead of 'highest'")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="also check the shardings over N simulated CPU devices / gloo processes (N >= 2)")
    # --shardings: how the sharded check splits the work (--layout names a checkpoint's tensors);
    # --layouts parses as it, with a warning.
    add_alias(p, "--layouts", p.add_argument(
        "--shardings", type=comma_separated(nonempty=True), default=None, metavar="tp,sp,dp",
        help="with --devices: which shardings (default: tp,sp,dp; tp-gspmd, JAX only, runs when named; a repeated one runs once)"))
    p.add_argument("--job-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="with --devices: kill a sharded worker group that finishes no job for this long "
                   f"(a rank stuck in a collective; default {DEFAULT_JOB_TIMEOUT_S:g}); its unfinished jobs become error rows")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the inputs' seed (a non-negative integer; default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the JSON report here (atomically)")
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown report here (atomically)")
    p.add_argument("--plot", metavar="PATH.png", help="draw every group's error ÷ bound (log scale, pass line at 1)")
    p.add_argument("--details", action="store_true",
                   help="print one line per (check, implementation, reference, dtype, quantity) and every skip reason, "
                   "not the summary per implementation, check and dtype")
    p.add_argument("--all-rows", action="store_true", help="print every row, not the summary")
    p.add_argument("--all-columns", action="store_true", help="also print max_rel_err, atol and rtol")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (in the user's cache directory, $MHA_PARITY_CACHE_DIR)")
    checkpoint.add_arguments(p)
    return p


class GracefulInterrupt:
    """The first Ctrl-C asks the run to stop after the current unit; a second one stops it at once.

    Raising KeyboardInterrupt from a signal handler lands wherever the main thread is,
    possibly inside XLA or torch internals that catch it or leave threads behind
    (measured: runs that ignored Ctrl-C, and segfaults at exit). A flag checked between
    units is never lost; the second press interrupts at once, for a stuck unit.
    """

    def __init__(self, console):
        self.console, self.requested = console, False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        # Plain bytes to stderr: the signal may arrive in the middle of an import (torch's takes
        # seconds), and rich's console imports lazily; an import from inside the handler then
        # breaks the interrupted import's module lock (importlib's KeyError), measured.
        os.write(2, b"interrupt: stopping after the current unit (Ctrl-C again to stop now)\n")

    def install(self):
        signal.signal(signal.SIGINT, self)
        return self


def _usage_problems(args) -> str | None:
    problem = checkpoint.usage_problem(args)
    if problem:
        return problem
    if args.layer is not None:
        clash = [f for f, given in (("--checkpoint", args.checkpoint), ("--cases", args.cases),
                                    ("--devices", args.devices)) if given]
        if clash:
            return f"--layer runs its own cases; it does not take {', '.join(clash)}"
        B, T, S = args.shape or checkpoint.DEFAULT_SHAPE
        if T > S:
            return f"--shape {B},{T},{S}: T <= S (T < S is cross-attention, causal bottom-right aligned)"
    if args.shape is not None and args.checks and "decode" in args.checks:
        from parity.harness.decode import tokens_problem

        few = tokens_problem(args.shape[2])  # the decode case runs the S tokens
        if few:
            return f"--shape {','.join(map(str, args.shape))} --checks decode: {few} (S)"
    if args.devices is not None and args.devices < 2:
        return f"--devices must be at least 2, got {args.devices}"
    if args.shardings and args.devices is None:
        return "--shardings selects the shardings of the sharded check: give --devices N too"
    if args.job_timeout is not None and args.devices is None:
        return "--job-timeout limits the sharded workers: give --devices N too"
    if args.shardings:
        from parity.harness.sharded.cases import JAX_ONLY_SHARDINGS, SHARDINGS

        unknown = sorted(set(args.shardings) - set(SHARDINGS) - set(JAX_ONLY_SHARDINGS))
        if unknown:
            return f"unknown --shardings {unknown}; choose from {', '.join(SHARDINGS + JAX_ONLY_SHARDINGS)}"
    paths = [os.path.realpath(p) for p in (args.json, args.markdown, args.plot) if p]  # a link and its target are one file
    if len(set(paths)) < len(paths):
        return "--json, --markdown and --plot must be different files"
    return None


def _run(args, console, stop, checkpoint_run=None, write: bool = True):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from parity.harness.runner import run
    from parity.impls import load_user_impl

    user = tuple(i for spec in args.impl for i in load_user_impl(spec))
    impls = None if args.impls is None and not user else (*(args.impls or _default_ours(args)), *user)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True, disable=args.no_progress)
    state = {"task": None, "started": False}

    def on_start(total):
        state["task"] = progress.add_task("starting", total=total)

    def on_progress(description):
        if state["started"]:
            progress.advance(state["task"])
        state["started"] = True
        progress.update(state["task"], description=description)

    kw = dict(case_filter=args.cases, dtypes=args.dtypes, checks=args.checks)
    if args.layer is not None:
        kw["cases"] = _layer_cases(args)
    if checkpoint_run is not None:  # its cases, weights and report entries (`checkpoint.prepare`)
        kw.update(checkpoint_run.run_kwargs)
        console.print(checkpoint_run.describe(), soft_wrap=True, markup=False)
    with progress:
        return run(
            **kw, impls=impls, device=args.device,
            seed=args.seed, quick=args.quick, compile=args.compile, framework_defaults=args.framework_defaults,
            **(dict(json_path=args.json, markdown_path=args.markdown, plot_path=args.plot) if write else {}),
            on_start=on_start,
            on_progress=on_progress, should_stop=lambda: stop.requested, devices=args.devices, shardings=args.shardings,
            job_timeout_s=args.job_timeout,
        )


def _layer_cases(args):
    """--layer at --shape: its own cases (`parity.harness.matrix.layer_cases`)."""
    from mha_spec import Problem
    from parity.harness.matrix import Shape, layer_cases

    B, T, S = args.shape or checkpoint.DEFAULT_SHAPE
    return layer_cases(Shape.of("layer", Problem(args.layer, B, T, S), cross=T != S), quick=args.quick,
                       decode="decode" in (args.checks or ()))


def _default_ours(args):
    from parity.harness.runner import select_impls

    return [i.name for i in select_impls(None, False)]


def main(argv=None) -> int:
    from rich.console import Console

    from parity.impls.registry import LoadError

    console = Console(highlight=False, emoji=False)  # names, paths and messages are printed as written
    stop = GracefulInterrupt(console).install()  # before the slow imports: an early Ctrl-C is still graceful
    args = build_parser().parse_args(argv)
    problem = _usage_problems(args)
    if problem:  # a usage error: on stderr, as argparse's own
        print(f"mha-parity: {problem}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    from parity.harness import latent

    if latent.is_latent_checkpoint(args) or "latent" in (args.cases or ()):
        return _run_latent(args, console, stop)
    checkpoint_run = None
    if args.checkpoint is not None:  # read (or refused) before anything compiles; a refusal goes to stderr
        try:
            checkpoint_run = checkpoint.prepare(args)
        except LoadError as e:
            print(f"mha-parity: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
    try:
        from parity import compile_cache

        cache_dir = None if args.no_compile_cache else compile_cache.enable()
        tally = compile_cache.start()
        report = _run(args, console, stop, checkpoint_run)
    except LoadError as e:  # --impl: any failure to load (SystemExit at import included), one line
        console.print(f"mha-parity: {e}", soft_wrap=True, markup=False, style="bold red")
        return EXIT_USAGE
    except (ValueError, TypeError, ImportError) as e:  # bad arguments, an unwritable path
        console.print(f"mha-parity: {type(e).__name__}: {e}", soft_wrap=True, markup=False, style="bold red")
        return EXIT_USAGE
    return _finish(report, args, console, tally.summary(cache_dir))


def _run_latent(args, console, stop) -> int:
    """A DeepSeek --checkpoint, or --cases naming 'latent': the latent harness (`parity.harness.latent`); with other
    case sets named too, its rows join the report those give."""
    from parity.harness import latent
    from parity.harness.runner import write_reports

    others = tuple(c for c in (args.cases or ()) if c != "latent")
    try:
        if args.checkpoint is not None:
            if args.cases:
                raise ValueError(f"--cases {','.join(args.cases)} with --checkpoint: a checkpoint runs its own cases")
            what, kw = latent.checkpoint_run(args)
            console.print(what, soft_wrap=True, markup=False)
        else:  # with other sets named, the latent run takes the dtypes, checks and --impls names it knows
            if args.layer is not None:
                raise ValueError("--cases latent runs its own layers; it takes no --layer")
            if others and args.impl:
                raise ValueError("--impl with --cases latent and other sets: a latent layer and an attention layer "
                                 "are different protocols; run the latent cases apart")
            dtypes, checks, names = (None if given is None else tuple(x for x in given if x in known or not others)
                                     for given, known in ((args.dtypes, latent.LATENT_DTYPES),
                                                          (args.checks, latent.LATENT_CHECKS),
                                                          (args.impls, [i.name for i in latent.ours()])))
            if dtypes is not None and (not dtypes or set(dtypes) - set(latent.LATENT_DTYPES)):
                raise ValueError(f"--dtypes {','.join(args.dtypes)}: the latent cases run "
                                 f"{','.join(latent.LATENT_DTYPES)}")
            kw = dict(dtypes=dtypes, checks=checks, seed=args.seed,
                      impls=(*latent.select_ours(names), *map(latent.load_latent_impl, args.impl),
                             latent.hf_peer("v3")))
    except (ValueError, OSError, NotImplementedError, TypeError) as e:
        print(f"mha-parity: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        base = None
        if others:
            args.cases = others
            base = _run(args, console, stop, write=False)
        rows = latent.run_latent(**kw, should_stop=lambda: stop.requested)
    except (ValueError, TypeError, ImportError) as e:
        console.print(f"mha-parity: {type(e).__name__}: {e}", soft_wrap=True, markup=False, style="bold red")
        return EXIT_USAGE
    report = rows if base is None else base
    if base is not None:
        base.rows += rows.rows
        base.users += rows.users
        base.interrupted = base.interrupted or rows.interrupted
        base.elapsed_s += rows.elapsed_s
    report.write_errors = write_reports(report, args.json, args.markdown, args.plot)
    return _finish(report, args, console)


def _finish(report, args, console, compile_summary: str = "") -> int:
    from parity.harness.report import print_report

    if report.environment.get("x64_enabled_for_run"):
        console.print("float64 in the run: jax_enable_x64 was enabled for it (recorded in the report's environment)")
    print_report(report, console, all_rows=args.all_rows, all_columns=args.all_columns, details=args.details)
    if compile_summary:
        console.print(compile_summary, markup=False)
    for label, path in (("JSON", args.json), ("Markdown", args.markdown), ("plot", args.plot)):
        if path and not any(path in e for e in report.write_errors):
            console.print(f"{label} report: {path}", markup=False)
    for err in report.write_errors:
        console.print(f"mha-parity: {err} (the results are printed above)", soft_wrap=True, markup=False, style="bold red")
    if report.interrupted:
        console.print("[bold red]interrupted: the reports hold what finished")
        return EXIT_INTERRUPTED
    if report.write_errors:
        return EXIT_FAIL
    nothing = report.checked_nothing or report.unchecked  # of what was asked: ours, or the user's layer
    if not report.ok and not report.summary()["fail"] and not report.summary()["error"] and nothing:
        return EXIT_NOTHING
    return 0 if report.ok else EXIT_FAIL


def entry() -> None:
    """The console script: main(), then after an interrupt a hard exit.

    Interpreter teardown with XLA and torch worker threads still alive has crashed
    (SIGSEGV after the report was written); by now everything is written and flushed.
    """
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()
