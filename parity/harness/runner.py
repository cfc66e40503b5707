"""`run`: choose the implementations, loop over (case, dtype), account for what could not run.

A run that checked nothing is never a pass: a requested check, dtype or implementation
that no selected case can run becomes a `skip` row that says why, and `Report.ok` needs
at least one passing row.
"""

from __future__ import annotations

import fnmatch
import time
import warnings
from dataclasses import dataclass

from mha_spec.files import check_writable, write_atomic
from parity.devices import DevicePlan, device_label, resolve_device
from parity.dtypes import DTYPES, numpy_dtype
from parity.env import environment, pinned
from parity.harness.checks import CHECKS, Unit, checks_of, run_unit, user_checks
from parity.harness.matrix import (CASE_SETS, SHAPES, Case, all_cases, declared_shape, default_matrix, draw_inputs,
                                   layer_cases, quick_matrix)
from parity.harness.report import Report, Row, to_json, to_markdown
from parity.impls import Implementation, select


def select_impls(impls=None, compile: bool = False) -> tuple[Implementation, ...]:
    """Ours (by name) and the user's own (Implementation objects), in registry order.

    Default: every one of ours except the torch.compile ones. `compile=True` adds the
    torch.compile twin of each selected eager torch implementation of ours; naming a
    compile implementation in `impls` runs it with or without `compile`.
    """
    names, user = split_impls(impls)
    return _choose(names, user, compile)


def split_impls(impls) -> tuple[tuple[str, ...] | None, tuple[Implementation, ...]]:
    """(names of ours, or None when `impls` is None; the user's Implementation objects) of a sequence of both."""
    impls = list(impls) if impls is not None else None
    bad = [i for i in impls or () if not isinstance(i, (str, Implementation))]
    if bad:
        raise TypeError(f"impls must be names or parity.impls.Implementation objects, got {bad!r}")
    names = None if impls is None else tuple(i for i in impls if isinstance(i, str))
    return names, tuple(i for i in impls or () if isinstance(i, Implementation))


def _choose(names, user: tuple, compile: bool) -> tuple[Implementation, ...]:
    """`select_impls` of names of ours (None: the default selection) and the user's implementations."""
    ours = select("ours")
    chosen = [i for i in ours if (i.name in names if names is not None else i.mode != "compile")]
    unknown = sorted(set(names or ()) - {i.name for i in ours})
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; ours: {[i.name for i in ours]} "
                         "(your own: --impl module:attribute)")
    if compile:
        twins = {"torch": "torch-compile", "torch-fused": "torch-compile-fused"}
        wanted = {twins[i.name] for i in chosen if i.name in twins}
        if not wanted and not any(i.mode == "compile" for i in chosen):
            raise ValueError("--compile adds torch.compile runs of the selected torch implementations, but none is selected")
        chosen = [i for i in ours if i in chosen or i.name in wanted]
    # Built implementations are cached per name within a unit: a user's "torch" would silently
    # be judged as ours, so names must be unique across ours, the peers and the user's.
    every = [i.name for i in (*select(), *user)]
    repeated = sorted({n for n in every if every.count(n) > 1})
    if repeated:
        raise ValueError(f"implementation names must be unique; repeated: {repeated} (rename yours)")
    return (*chosen, *user)


def _select_cases(cases, patterns, pool=None) -> tuple[Case, ...]:
    """The cases to run: `cases` without patterns; else each pattern's, in order, each case once.

    A pattern that names a case set (`CASE_SETS`: default, quick, modern) selects the set; any other
    is a name prefix or glob matched against `pool` (default: `cases`)."""
    if not patterns:
        return tuple(cases)
    pool = tuple(cases) if pool is None else tuple(pool)
    chosen = {}
    for p in patterns:
        found = CASE_SETS[p]() if p in CASE_SETS else [c for c in pool if fnmatch.fnmatchcase(c.name, p) or c.name.startswith(p)]
        chosen.update((c.name, c) for c in found if c.name not in chosen)
    if not chosen:
        raise ValueError(f"no case matches {list(patterns)}; case sets: {', '.join(CASE_SETS)}; "
                         f"cases: {[c.name for c in pool]}")
    return tuple(chosen.values())


def _validate(dtypes, checks, paths) -> tuple[tuple, tuple]:
    """The dtypes and checks to run (None: all), validated; every output path tried before anything runs."""
    dtypes = DTYPES if dtypes is None else tuple(dtypes)
    known = tuple(CHECKS)
    checks = known if checks is None else tuple(checks)
    for path in paths:
        if path:
            check_writable(path)
    for d in dtypes:
        numpy_dtype(d)
    unknown = set(checks) - set(known)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; known: {known}")
    if not dtypes:
        raise ValueError(f"no dtype selected; choose from {DTYPES}")
    if not checks:
        raise ValueError(f"no check selected; choose from {known}")
    return dtypes, checks


def _runners(plan: DevicePlan) -> dict:
    import jax

    from parity.bench.torch_bench import kernel_label
    from parity.impls.jax_impls import JaxRunner
    from parity.impls.torch_impls import TorchRunner

    # torch's rows name the kernel the profiler saw against the one the benchmark's table says it asks for
    return {"torch": TorchRunner(plan.torch_device, requested_kernel=kernel_label),
            "jax": JaxRunner(jax.devices(plan.jax_platform)[0])}


@dataclass(frozen=True)
class RunRequest:
    """What `run` is asked to do (`run(request)`, or `run(**keywords)`: `RunRequest.of`).

    cases: a sequence of `Case`, or a case set's name ("default", "quick", "modern": the layers with
    grouped heads, RoPE, no biases) (default: the default matrix, or the quick one); case_filter:
    case set names, or name prefixes or globs (matched against the given cases, else every named
    case); state_dict: fixed weights (canonical names, any float dtype, e.g. a checkpoint's layer)
    for every case instead of the drawn ones (each case's layer must be theirs); environment: extra
    entries for the report's environment (e.g. the file checked); dtypes, checks: names to keep (None: whatever the
    cases run, all checks; named ones that nothing runs get a skip row saying why); impls: names of ours (None:
    every one but the torch.compile ones; see `select_impls`); user: your own `parity.impls.Implementation`s.
    on_start(total_units) and on_progress(description) drive a progress bar; should_stop() is asked between units (a
    graceful Ctrl-C). devices >= 2 adds the sharded check (`parity.harness.sharded`: tensor-, sequence- and
    data-parallel shardings over that many simulated CPU devices / gloo processes; `shardings` filters them;
    job_timeout_s: how long a sharded worker group may go without finishing a job, default
    parity.harness.sharded.launch.DEFAULT_JOB_TIMEOUT_S; should_stop() is polled while the workers run, and they
    stop between jobs). json_path, markdown_path, plot_path: the files to write.
    """

    cases: object = None
    case_filter: tuple = ()
    state_dict: dict | None = None
    environment: dict | None = None
    dtypes: tuple | None = None
    checks: tuple | None = None
    impls: tuple | None = None
    user: tuple = ()
    device: str = "auto"
    seed: int = 0
    quick: bool = False
    compile: bool = False
    framework_defaults: bool = False
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    on_progress: object = None
    on_start: object = None
    should_stop: object = None
    devices: int | None = None
    shardings: tuple | None = None
    job_timeout_s: float | None = None

    @classmethod
    def of(cls, *, impls=None, shardings=None, layouts=None, **kw) -> RunRequest:
        """The request of `run`'s keywords: impls names of ours and/or `parity.impls.Implementation` objects
        (your own), split into `impls` and `user`; `layouts`: the old spelling of `shardings` (warns)."""
        names, user = split_impls(impls)
        return cls(impls=names, user=user, shardings=_shardings(shardings, layouts), **kw)

    @property
    def paths(self) -> tuple:
        return self.json_path, self.markdown_path, self.plot_path

    def stopped(self) -> bool:
        return self.should_stop is not None and self.should_stop()


def run(request: RunRequest | None = None, /, **keywords) -> Report:
    """Run the parity matrix a `RunRequest` (or the keywords of one: `RunRequest.of`) asks for; return the report
    (and write it, if paths are given). A unit that raises becomes error rows; KeyboardInterrupt stops the loop,
    and the report of what finished is still written (report.interrupted is True)."""
    if request is None:
        request = RunRequest.of(**keywords)
    elif keywords:
        raise TypeError(f"run takes a RunRequest or its keywords, not both (got {sorted(keywords)})")
    r, started = request, time.perf_counter()
    p = plan_run(r)
    _check_weights(p.cases, r.seed, r.state_dict)
    with pinned(r.framework_defaults, p.x64):
        report = Report(_environment(p.device, r.seed, r.framework_defaults, _run_entries(p, r.environment)))
        if r.on_start is not None:
            r.on_start(len(p.units))
        try:
            _fill(report, p, r, lambda: _sharded(r, p.dtypes, p.checks))
        except KeyboardInterrupt:
            report.interrupted = True
        finally:
            _finish(report, p, started, r.paths)
    return report


def _check_weights(cases, seed: int, state_dict) -> None:
    """Every case's layer checked against the fixed weights (None: drawn ones) before anything runs."""
    if state_dict is not None:
        for c in cases:
            case_inputs(c, seed, state_dict)


def _run_entries(p, environment) -> dict:
    """The report's environment entries of this run: the caller's, then what the plan selected."""
    return {**(environment or {}), "dtypes": ",".join(p.dtypes), "checks": ",".join(p.checks), "cases": len(p.cases),
            "implementations": ",".join(i.name for i in p.impls), "x64_enabled_for_run": p.x64}


def _finish(report, p, started: float, paths) -> None:
    """Close the report, finished or interrupted: the coverage rows, the users, the time, then the files written."""
    if not report.interrupted:  # what an interrupted run did not reach is not a "cannot run"
        report.rows += coverage(report.rows, p.cases, *p.coverage_of, p.impls, device_label(p.device.name))
        report.unchecked = unchecked(report.rows, p.impls)
    report.users = [i for i in p.impls if i.role == "user"]
    report.elapsed_s = time.perf_counter() - started
    report.write_errors = write_reports(report, *paths)


def _fill(report, p, r: RunRequest, sharded) -> None:
    """The rows of every unit, then the sharded check's (`sharded()`); skip rows where the device is absent."""
    if p.device.skip_reason:
        report.rows += [Row(c.name, ch, "*", "*", d, device_label(p.device.name), "skip", message=p.device.skip_reason)
                        for c, d in p.units for ch in p.checks]
        return
    _loop(report, p, r, _runners(p.device))
    report.rows += sharded()
    if r.stopped():  # the sharded workers stopped between jobs
        report.interrupted = True


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, decided (and validated) before anything runs."""

    cases: tuple
    dtypes: tuple
    checks: tuple
    impls: tuple  # ours and the user's, for forward and gradient
    peers: tuple
    units: tuple  # (case, dtype) pairs
    device: DevicePlan
    coverage_of: tuple  # (dtypes, checks) the caller named: those that run nothing get a skip row

    @property
    def x64(self) -> bool:  # float64 needs jax_enable_x64: on for this run only
        return any(d == "float64" for _, d in self.units)


def plan_run(r: RunRequest) -> RunPlan:
    """What `r` asks for, decided and validated before anything runs (a ValueError naming what is wrong)."""
    cases, case_filter, quick = r.cases, r.case_filter, r.quick
    named = (r.dtypes if r.dtypes is not None else (), r.checks if r.checks is not None else ())
    dtypes, checks = _validate(r.dtypes, r.checks, r.paths)
    if isinstance(cases, str):
        if cases not in CASE_SETS:
            raise ValueError(f"unknown case set {cases!r}; case sets: {', '.join(CASE_SETS)}")
        cases = CASE_SETS[cases]()
    given = cases is not None
    cases = tuple(cases) if given else (quick_matrix() if quick else default_matrix())
    cases = _select_cases(cases, case_filter, pool=cases if given or quick else all_cases())
    chosen = _choose(r.impls, r.user, r.compile)
    if not given and all(pattern in CASE_SETS for pattern in case_filter):  # whole sets, not cases picked by name
        cases += own_cases([i for i in chosen if i.role == "user"], cases, dtypes, quick, whole=not case_filter)
    units = tuple((c, d) for c in cases for d in dtypes if d in c.dtypes)
    peers = tuple(p for p in select("peer") if p.harness)
    idle = [i for i in chosen if i.role == "user" and not set(checks_of(i)) & set(checks)]
    if idle:
        raise ValueError(f"{', '.join(i.name for i in idle)}: no selected check runs "
                         f"{'it' if len(idle) == 1 else 'them'} (--checks {','.join(checks)}); the checks that run "
                         + "; ".join(f"{i.name}: {', '.join(checks_of(i))}" for i in idle)
                         + " (a decoder, decode=True, runs in the decode check only)")
    return RunPlan(cases, dtypes, checks, chosen, peers, units, resolve_device(r.device), named)


def _runs_in(impl: Implementation, case: Case, dtypes) -> set:
    """The dtypes (of `dtypes`) in which `impl` runs `case`, by its own declarations (a decoder: decode cases only)."""
    if impl.decode and not case.decode:
        return set()
    return {d for d in dtypes if d in case.dtypes
            and impl.unsupported(d, case.config, cross=case.shape.cross, mask=case.mask) is None}


def own_cases(users, cases, dtypes, quick: bool, whole: bool) -> tuple[Case, ...]:
    """The cases of each user layer's declared layer (`requires`, `inputs="self"`) that a case set lacks.

    A correct layer is never red or unchecked because of the case set: when the set holds no case
    it runs (or, for the default or quick set, `whole`, none it runs in every dtype it declares),
    its own layer's cases are added at the sizes of the selection's first case
    (self-attention for a one-input layer): quick, one causal case; else causal, padding and random
    masks in every dtype it declares (`matrix.layer_cases`). A decoder (decode=True) gets one decode
    case of its layer, causal self-attention named "<your name>-decode/causal/nan", when the selection
    holds none it runs."""
    out, names = [], {c.name for c in cases}
    for impl in users:
        if impl.decode:
            out += [c for c in _decoder_cases(impl, cases, dtypes, quick, whole) if c.name not in names]
            names |= {c.name for c in out}
            continue
        if not impl.requires and impl.inputs == "qkv":  # the classic layer: every set holds its cases
            continue
        wanted = set(dtypes) & set(impl.dtypes or DTYPES)
        ran = set().union(*(_runs_in(impl, c, dtypes) for c in cases)) if cases else set()
        if not wanted or (ran >= wanted if whole else ran):
            continue
        like = next((c for c in cases if not c.shape.cross), cases[0]) if cases else None
        shape = declared_shape(impl.name, impl.requires, like.shape if like else SHAPES["self"],
                               self_attention=impl.inputs == "self" or not (like and like.shape.cross))
        if quick and like is not None:  # the quick set's dtypes: a few seconds
            wanted &= set(like.dtypes)
        for c in layer_cases(shape, quick, tuple(d for d in DTYPES if d in wanted)):
            if c.name not in names:
                names.add(c.name)
                out.append(c)
    return tuple(out)


def _decoder_cases(impl: Implementation, cases, dtypes, quick: bool, whole: bool) -> tuple[Case, ...]:
    """A decoder's own decode case (see `own_cases`), or () when the selection holds one it runs."""
    wanted = set(dtypes) & set(impl.dtypes or DTYPES)
    ran = set().union(*(_runs_in(impl, c, dtypes) for c in cases)) if cases else set()
    if not wanted or (ran >= wanted if whole else ran):
        return ()
    like = next((c for c in cases if not c.shape.cross), cases[0]) if cases else None
    if quick and like is not None:
        wanted &= set(like.dtypes)
    shape = declared_shape(f"{impl.name}-decode", impl.requires, like.shape if like else SHAPES["self"],
                           self_attention=True)
    return (Case(shape, "causal", "nan", jax_eager=False, decode=True,
                 dtypes=tuple(d for d in DTYPES if d in wanted)),)


def _loop(report, p: RunPlan, r: RunRequest, runners) -> None:
    for case, dtype in p.units:
        if r.stopped():
            report.interrupted = True
            return
        if r.on_progress is not None:
            r.on_progress(f"{case.name} {dtype}")
        report.rows += _run_unit(case, dtype, r.seed, p.checks, p.impls, p.peers, runners, r.state_dict)


def _shardings(shardings, layouts):
    if layouts is not None:
        warnings.warn("run(layouts=...) is spelled shardings=...", DeprecationWarning, stacklevel=4)
    return shardings if layouts is None else layouts


def _sharded(r: RunRequest, dtypes, checks) -> list[Row]:
    """The sharded check across `r.devices` processes/devices, when asked (float64 and float32 only)."""
    devices, shardings, should_stop, job_timeout_s = r.devices, r.shardings, r.should_stop, r.job_timeout_s
    if "sharded" not in checks or not devices or r.stopped():
        return []
    from parity.harness.sharded import SHARDINGS, run_sharded

    wide = tuple(d for d in dtypes if d in ("float64", "float32"))
    if devices < 2 or not wide:
        why = "--devices must be at least 2" if devices < 2 else "sharded checks run in float64/float32 only"
        return [Row("*", "sharded", "*", "*", "*", device_label("cpu"), "skip", message=why)]
    timeout = {} if job_timeout_s is None else {"job_timeout_s": job_timeout_s}
    return run_sharded(devices=devices, shardings=tuple(shardings or SHARDINGS), dtypes=wide, seed=r.seed,
                       should_stop=should_stop, **timeout)


def case_inputs(case, seed: int, state_dict=None):
    """A case's inputs: its own draw where it has one (`checkpoint.DecoderCase`), else the matrix's."""
    own = getattr(case, "draw_inputs", None)
    return own(seed, state_dict) if own is not None else draw_inputs(case, seed, state_dict)


def _run_unit(case, dtype, seed, checks, impls, peers, runners, state_dict=None) -> list[Row]:
    try:
        x = case_inputs(case, seed, state_dict).in_dtype(numpy_dtype(dtype))
        return run_unit(Unit(case, dtype, x, runners, checks), impls, peers)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # MemoryError included: one unit's failure must not end the run
        return [Row(case.name, "*", "*", "*", dtype, "-", "error", message=f"{type(e).__name__}: {e}"[:500])]


def coverage(rows, cases, dtypes, checks, impls, device: str) -> list[Row]:
    """A skip row for each requested dtype, check or implementation that nothing ran, saying why."""
    ran = [r for r in rows if r.status != "skip"]
    out = []
    for d in dtypes:
        if not any(r.dtype == d for r in ran):
            runs_in = sorted({x for c in cases for x in c.dtypes}, key=DTYPES.index)
            out.append(Row("*", "*", "*", "*", d, device, "skip",
                           message=f"nothing ran in {d}: the selected cases run in {', '.join(runs_in)}"))
    for ch in checks:
        if not any(r.check == ch for r in ran):
            out.append(Row("*", ch, "*", "*", "*", device, "skip", message=f"nothing ran for {ch}: {_idle_reason(ch, cases)}"))
    for impl in impls if set(user_checks()) & set(checks or CHECKS) else ():
        if not any(r.impl == impl.name for r in ran):
            out.append(Row("*", "*", impl.name, "*", "*", device, "skip",
                           message=f"nothing ran for {impl.name} (see its skip rows, or the dtype/check selection)"))
    return out


def _idle_reason(check: str, cases) -> str:
    """Why the check `check` ran nothing on `cases`: as the registry's check says."""
    return CHECKS[check].reason(cases) if check in CHECKS else "no selected implementation, case and dtype ran it"


def unchecked(rows, impls) -> list[str]:
    """The user's implementations for which no row was anything but a skip: the run did not check them."""
    return [i.name for i in impls if i.role == "user" and not any(r.impl == i.name and r.status != "skip" for r in rows)]


def _environment(plan: DevicePlan, seed: int, framework_defaults: bool, extra: dict) -> dict:
    import jax
    import torch

    env = environment()
    env["device"] = plan.name if not plan.skip_reason else f"{plan.name} (absent)"
    env["jax_device"] = str(jax.devices(plan.jax_platform)[0]) if plan.jax_platform else "none"
    if plan.torch_device == "cuda":
        env["torch_device"] = f"cuda: {torch.cuda.get_device_name(0)}"
    else:
        env["torch_device"] = plan.torch_device or "none"
    env["torch_threads"] = torch.get_num_threads()
    env["jax_enable_x64"] = bool(jax.config.jax_enable_x64)
    env["jax_default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
    env["torch_float32_matmul_precision"] = torch.get_float32_matmul_precision()
    env["torch_cuda_matmul_allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    env.update(framework_defaults=framework_defaults, seed=seed)
    if plan.note:
        env["device_note"] = plan.note
    env.update(extra)
    return env


def write_reports(report: Report, json_path=None, markdown_path=None, plot_path=None) -> list[str]:
    """Write what was asked; a failure is returned (and the rest still written), never raised:
    the results of a whole run must not be lost to a full disk or a wrong path."""
    from parity.harness.plot import write_margin_plot

    failures = []
    for path, write in ((json_path, lambda p: write_atomic(p, to_json(report))),
                        (markdown_path, lambda p: write_atomic(p, to_markdown(report))),
                        (plot_path, lambda p: write_margin_plot(report, p))):
        if not path:
            continue
        try:
            write(path)
        except OSError as e:
            failures.append(f"could not write {path}: {e.strerror or e}")
    return failures


__all__ = ["run", "RunRequest", "RunPlan", "plan_run", "select_impls", "split_impls", "coverage", "unchecked", "write_reports"]
