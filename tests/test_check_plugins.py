"""Checks are plug-ins: a check is one module and one registry line (`parity.harness.checks.registry`), and the
matrix's check names, the user checks, the skip reasons and a --checkpoint run's checks are views of it.
The harness holds no framework branch and calls no runner's private method: the runners read kernels."""

from __future__ import annotations

import pathlib
import re

import pytest

from parity.harness import checkpoint, matrix, runner
from parity.harness.checks import CHECKS, Check, checks_of, register, unregister, user_checks
from parity.harness.report import Row
from parity.impls import builtin

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARNESS = ROOT / "parity" / "harness"


def _toy(unit, impls, peers) -> list[Row]:
    """One pass row per implementation of ours that runs torch: enough to see the check ran, through the unit."""
    return [unit.row("toy", i, "nothing", "pass", "output", message="a toy check") for i in impls if i.name == "torch"]


@pytest.fixture
def toy():
    check = register(Check("toy", _toy))  # the one registry line a new check needs
    try:
        yield check
    finally:
        unregister("toy")
    assert "toy" not in CHECKS


def test_a_registered_check_runs_and_is_listed(toy):
    assert "toy" in CHECKS and "toy" in matrix.CHECKS and list(CHECKS)[-1] == "toy"
    report = runner.run(cases="quick", dtypes=("float32",), checks=("toy",),
                        impls=("torch",), device="cpu")
    rows = [r for r in report.rows if r.check == "toy"]
    assert rows and all(r.impl == "torch" and r.status == "pass" and r.message == "a toy check" for r in rows)
    assert {r.check for r in report.rows} == {"toy"}  # nothing else ran


def test_the_cli_accepts_a_registered_check_and_refuses_it_after(toy):
    from parity import cli

    assert cli.build_parser().parse_args(["--checks", "toy,forward"]).checks == ("toy", "forward")
    unregister("toy")
    try:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["--checks", "toy"])
        with pytest.raises(ValueError, match="unknown checks"):
            runner.run(checks=("toy",), impls=("torch",), device="cpu", quick=True)
    finally:
        register(toy)


def test_a_check_that_ran_nothing_says_why_by_its_declaration(toy):
    rows = runner.coverage([], [], (), ("toy", "decode", "sharded"), (), "cpu")
    reasons = {r.check: r.message for r in rows}
    assert reasons["toy"].endswith("no selected implementation, case and dtype ran it")
    assert "decode=True" in reasons["decode"] and "--devices" in reasons["sharded"]


def test_the_views_are_read_from_the_registry():
    assert tuple(CHECKS) == ("forward", "gradient", "leak", "training", "peers", "decode", "sharded")
    assert user_checks() == ("forward", "gradient", "leak", "decode")
    assert checks_of(builtin("torch")) == ("forward", "gradient", "leak")
    decoder = next(i for i in __import__("parity.impls", fromlist=["select"]).select("peer") if i.decode)
    assert checks_of(decoder) == ("decode",)
    assert checkpoint.CHECKS == ("forward", "gradient", "peers", "decode")
    assert checkpoint.WINDOW_CHECKS == ("forward", "gradient", "leak", "peers")
    with pytest.raises(ValueError, match="registered already"):
        register(Check("forward", _toy))


def _sources():
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(HARNESS.rglob("*.py"))}


def test_the_harness_holds_no_framework_branch():
    """Which framework runs an implementation is its runner's business (`unit.runner(impl)`): the harness asks
    the runner, never `impl.framework == ...`; the sharded check's launcher looks its worker program up by
    framework (`launch.LAUNCHES`)."""
    branch = re.compile(r"framework\s*[!=]=|[!=]=\s*\w*\.?framework\b")
    found = {path: line for path, text in _sources().items() for line in text.splitlines() if branch.search(line)}
    assert found == {}, found


def test_the_harness_calls_no_private_method_of_a_runner():
    call = re.compile(r"runners?(\([^)]*\)|\[[^\]]*\])?\._[a-z]\w*")
    found = {path: m.group(0) for path, text in _sources().items() for m in call.finditer(text)}
    assert found == {}, found


def test_run_takes_one_request(toy):
    from parity.harness.runner import RunRequest

    mine = __import__("dataclasses").replace(builtin("torch"), name="my-torch", role="user")
    request = RunRequest.of(cases="quick", dtypes=("float32",), checks=("toy",), impls=("torch", mine), device="cpu")
    assert request.impls == ("torch",) and request.user == (mine,)
    with pytest.raises(TypeError, match="not both"):
        runner.run(request, quick=True)
    with pytest.raises(TypeError, match="names or parity.impls.Implementation"):
        RunRequest.of(impls=(3,))
    report = runner.run(RunRequest(cases="quick", dtypes=("float32",), checks=("toy",), impls=("torch",), device="cpu"))
    assert {r.check for r in report.rows} == {"toy"} and any(r.status == "pass" for r in report.rows)
