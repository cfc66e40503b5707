"""`run`: devices, precision settings, the loop over (case, dtype), the environment block."""

from __future__ import annotations

import contextlib
import fnmatch
import platform
import time
from dataclasses import dataclass
from importlib import metadata

from parity.atomic import write_atomic
from parity.harness import checks as _checks
from parity.harness.impls import Fault, JaxSide, TorchSide, planted
from parity.harness.matrix import CHECKS, DTYPES, Case, default_matrix, draw_inputs, numpy_dtype, quick_matrix
from parity.harness.report import Report, Row, to_json, to_markdown

DEVICES = ("auto", "cpu", "gpu", "tpu")


@dataclass(frozen=True)
class DevicePlan:
    requested: str
    name: str  # what runs: cpu | gpu | tpu
    jax_device: object | None
    torch_device: str | None
    skip_reason: str = ""
    note: str = ""


def _jax_devices(platform_name: str):
    import jax

    try:
        return jax.devices(platform_name)
    except RuntimeError:  # jax raises when the backend is absent
        return []


def resolve_device(requested: str) -> DevicePlan:
    """The best present device for 'auto'; for an absent one, a plan that says why it is skipped."""
    import torch

    if requested not in DEVICES:
        raise ValueError(f"device {requested!r} is not one of {DEVICES}")
    cuda = torch.cuda.is_available()
    if requested == "auto":
        requested_eff = next((d for d in ("tpu", "gpu") if _jax_devices(d) or (d == "gpu" and cuda)), "cpu")
    else:
        requested_eff = requested
    if requested_eff == "cpu":
        return DevicePlan(requested, "cpu", _jax_devices("cpu")[0], "cpu")
    found = _jax_devices(requested_eff)
    if requested_eff == "gpu":
        if not found and not cuda:
            return DevicePlan(requested, "gpu", None, None, skip_reason=(
                "device gpu not present: jax has no gpu backend and torch.cuda.is_available() is False"))
        if not found:
            return DevicePlan(requested, "gpu", None, "cuda", skip_reason=(
                "device gpu: torch sees CUDA but jax has no gpu backend (install jax[cuda13])"))
        note = "" if cuda else "torch has no CUDA here, so torch runs on cpu as the reference"
        return DevicePlan(requested, "gpu", found[0], "cuda" if cuda else "cpu", note=note)
    if not found:
        return DevicePlan(requested, "tpu", None, None, skip_reason="device tpu not present: jax has no tpu backend")
    return DevicePlan(requested, "tpu", found[0], "cpu", note="torch has no TPU backend here: it runs on cpu as the reference")


@contextlib.contextmanager
def precision_settings(framework_defaults: bool, x64: bool):
    """Pin matmul precision (unless asked for the frameworks' defaults) and x64; restore afterwards."""
    import jax
    import torch

    saved = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision())
    cuda_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if x64:
            jax.config.update("jax_enable_x64", True)
        if not framework_defaults:
            jax.config.update("jax_default_matmul_precision", "highest")
            torch.set_float32_matmul_precision("highest")
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        jax.config.update("jax_enable_x64", saved[0])
        jax.config.update("jax_default_matmul_precision", saved[1])
        torch.set_float32_matmul_precision(saved[2])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cuda_tf32


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(plan: DevicePlan, seed: int, framework_defaults: bool, extra: dict) -> dict:
    import jax
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("jax", "jaxlib", "flax", "optax", "torch", "numpy", "ml_dtypes"):
        env[dist] = _version(dist)
    env["device"] = plan.name if not plan.skip_reason else f"{plan.name} (absent)"
    env["jax_device"] = str(plan.jax_device) if plan.jax_device is not None else "none"
    if plan.torch_device == "cuda":
        env["torch_device"] = f"cuda: {torch.cuda.get_device_name(0)}"
    else:
        env["torch_device"] = plan.torch_device or "none"
    env["torch_threads"] = torch.get_num_threads()
    env["jax_enable_x64"] = bool(jax.config.jax_enable_x64)
    env["jax_default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
    env["torch_float32_matmul_precision"] = torch.get_float32_matmul_precision()
    env["torch_cuda_matmul_allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    env["framework_defaults"] = framework_defaults
    env["seed"] = seed
    if plan.note:
        env["device_note"] = plan.note
    env.update(extra)
    return env


def _select_cases(cases, patterns) -> tuple[Case, ...]:
    if not patterns:
        return tuple(cases)
    chosen = tuple(c for c in cases if any(fnmatch.fnmatchcase(c.name, p) or c.name.startswith(p) for p in patterns))
    if not chosen:
        raise ValueError(f"no case matches {list(patterns)}; cases: {[c.name for c in cases]}")
    return chosen


def run(
    *,
    cases=None,
    case_filter=(),
    dtypes=DTYPES,
    checks=CHECKS,
    impls=None,
    device: str = "auto",
    seed: int = 0,
    quick: bool = False,
    compile: bool = False,
    framework_defaults: bool = False,
    json_path=None,
    markdown_path=None,
    faults: tuple[Fault, ...] = (),
    on_progress=None,
    on_start=None,
) -> Report:
    """Run the parity matrix; return the report (and write it, if paths are given).

    cases: a sequence of `Case` (default: the default matrix, or the quick one);
    case_filter: name prefixes or globs; dtypes, checks, impls: names to keep.
    faults: planted bugs, for the harness's own tests only.
    on_start(total_units) and on_progress(description) drive a progress bar.
    A unit that raises becomes error rows; Ctrl-C stops the loop, and the report of
    what finished is still written (report.interrupted is True).
    """
    started = time.perf_counter()
    for d in dtypes:
        numpy_dtype(d)
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; known: {CHECKS}")
    if not isinstance(faults, (tuple, list)) or not all(isinstance(f, Fault) for f in faults):
        raise TypeError("faults must be a tuple of parity.harness.Fault")
    cases = tuple(cases) if cases is not None else (quick_matrix() if quick else default_matrix())
    cases = _select_cases(cases, case_filter)
    selected = _checks.select_impls(impls, compile)
    units = [(c, d) for c in cases for d in dtypes if d in c.dtypes]
    x64 = any(d == "float64" for _, d in units)  # float64 needs jax_enable_x64: on for this run only
    plan = resolve_device(device)
    extra = {"dtypes": ",".join(dtypes), "checks": ",".join(checks), "cases": len(cases),
             "implementations": ",".join(i.name for i in selected)}
    if faults:
        extra["planted_faults"] = ", ".join(f"{f.framework}:{f.kind}" for f in faults)
    extra["x64_enabled_for_run"] = x64
    with precision_settings(framework_defaults, x64):
        report = Report(environment(plan, seed, framework_defaults, extra))
        if on_start is not None:
            on_start(len(units))
        try:
            if plan.skip_reason:
                report.rows += [Row(c.name, ch, "*", "*", d, plan.name, "skip", message=plan.skip_reason)
                                for c, d in units for ch in checks]
            else:
                with planted(faults):
                    sides = {"torch": TorchSide(plan.torch_device, faults), "jax": JaxSide(plan.jax_device, faults)}
                    for case, dtype in units:
                        if on_progress is not None:
                            on_progress(f"{case.name} {dtype}")
                        report.rows += _run_unit(case, dtype, seed, plan, sides, checks, selected)
                        sides["jax"].clear()
        except KeyboardInterrupt:
            report.interrupted = True
        finally:
            report.elapsed_s = time.perf_counter() - started
            write_reports(report, json_path, markdown_path)
    return report


def _run_unit(case, dtype, seed, plan, sides, checks, impls) -> list[Row]:
    from parity.harness.checks import Unit

    try:
        x = draw_inputs(case, seed).in_dtype(numpy_dtype(dtype))
        unit = Unit(case, dtype, x, str(plan.torch_device), str(plan.jax_device).lower())
        return _checks.run_unit(unit, sides, checks, impls)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # MemoryError included: one unit's failure must not end the run
        return [Row(case.name, "*", "*", "*", dtype, plan.name, "error", message=f"{type(e).__name__}: {e}"[:500])]


def write_reports(report: Report, json_path=None, markdown_path=None) -> None:
    if json_path:
        write_atomic(json_path, to_json(report))
    if markdown_path:
        write_atomic(markdown_path, to_markdown(report))


__all__ = ["run", "resolve_device", "write_reports", "DEVICES", "DevicePlan"]
