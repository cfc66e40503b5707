"""mha-parity never passes what it did not check, and never loses a report.

An empty selection is not a pass, an unwritable report path is refused before the run,
a failed write keeps the printed results, Ctrl-C writes what finished and exits 130.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from parity.cli import main
from parity.harness import Case, Shape, run, select_impls
from parity.harness.matrix import SHAPES

SMALL = Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "random", "uniform")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*argv):
    return main(["--device", "cpu", "--no-progress", *argv])


@pytest.mark.parametrize("argv, code", [
    (("--dtypes", ""), 2),  # nothing selected: a usage error before anything runs
    (("--quick", "--dtypes", "float64"), 3),  # the quick case runs float32 only: nothing checked
    (("--cases", "cross", "--dtypes", "bfloat16", "--checks", "forward"), 3),
])
def test_an_empty_selection_is_not_a_pass(argv, code, capsys):
    assert _cli(*argv) == code
    out = capsys.readouterr().out
    if code == 3:
        assert "nothing was checked" in out and "skip:" in out


def test_a_user_layer_that_every_unit_skipped_is_not_a_pass(tmp_path, capsys):
    """The classic JAX port declares no variants: on a variant case alone ours pass and it skips,
    so the layer the user asked about was never checked: exit 3, saying so."""
    code = _cli("--cases", "mqa/random/uniform", "--dtypes", "float32", "--checks", "forward", "--impls", "torch",
                "--impl", "parity.examples.jax_port:port", "--json", str(tmp_path / "r.json"))
    out = " ".join(capsys.readouterr().out.split())
    assert code == 3, out
    assert "nothing was checked for jax-port" in out and "declares no variants" in out and "grouped" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["unchecked"] == ["jax-port"] and data["summary"]["pass"] > 0  # ours did pass


def test_requested_checks_that_cannot_run_are_skips_and_not_ok():
    report = run(cases=[SMALL], dtypes=("float32",), checks=("peers", "training"), device="cpu")
    assert not report.ok and report.checked_nothing
    why = {r.check: r.message for r in report.rows if r.status == "skip"}
    assert "runs only on cases with peers=True" in why["peers"] and "train=True" in why["training"]
    assert "nothing ran in float32" in why["*"]


def test_compile_selection_is_never_dropped():
    names = lambda impls: [i.name for i in impls]  # noqa: E731
    assert "torch-compile" in names(select_impls(["torch-compile"], compile=False))  # named: it runs
    assert names(select_impls(["torch"], compile=True)) == ["torch", "torch-compile"]
    assert "torch-compile-fused" in names(select_impls(None, compile=True))
    with pytest.raises(ValueError, match="none is selected"):
        select_impls(["jax-jit"], compile=True)


def test_unwritable_report_path_fails_before_running(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    started = time.perf_counter()
    assert _cli("--quick", "--json", str(blocker / "r.json")) == 2
    assert time.perf_counter() - started < 5, "it ran the matrix before checking the path"
    assert "cannot write" in capsys.readouterr().out


def test_same_path_twice_is_a_usage_error(tmp_path):
    p = str(tmp_path / "r")
    assert _cli("--quick", "--json", p, "--markdown", p) == 2


def test_a_failed_write_keeps_the_printed_results(tmp_path, monkeypatch, capsys):
    from parity.harness import runner

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "write_atomic", full_disk)
    code = _cli("--quick", "--checks", "forward", "--json", str(tmp_path / "r.json"))
    out = capsys.readouterr().out
    assert code == 1
    assert "No space left on device" in out and "pass" in out  # the table is printed, the failure said


def test_console_table_fits_80_columns():
    from parity.harness.report import Report, Row, print_report

    rows = [Row("self/random/nan", "gradient", "jax-port-head-split-bug", "torch[uniform]", "bfloat16", "cpu", "fail",
                "d_params", 1.2345e-3, 2.0, 5e-4, 0.0, "q", "worst: q_proj.weight (fails)"),
            Row("self/random/nan", "peers", "flax-linen-mha", "jax[uniform]", "float64", "cpu", "pass",
                "weights", 6.7e-17, 1e-16, 1e-12, 1e-12)]
    console = Console(width=80, record=True, force_terminal=False)
    print_report(Report({"seed": 0}, rows), console)
    text = console.export_text()
    table = text.split("failure(s)")[0]  # the failure lines below soft-wrap like any terminal text
    assert max(len(line) for line in table.splitlines()) <= 80
    assert "…" not in text
    assert "2.5" in text and "3.4e-05" in text  # both margins whole: 1.23e-3 / 5e-4 and 6.7e-17 / 2e-12


def test_margin_plot_is_written(tmp_path):
    from parity.harness.plot import margins

    report = run(cases=[SMALL], dtypes=("float32",), checks=("forward",), impls=("torch",), device="cpu",
                 plot_path=tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 10_000
    (check, impl, dtype, m, failed), = margins(report)
    worst = max(r.max_abs_err / (r.atol + r.rtol) for r in report.rows)
    assert (check, impl, dtype, failed) == ("forward", "torch", "float32", False) and m == pytest.approx(worst)


@pytest.mark.slow
def test_ctrl_c_stops_writes_the_partial_report_and_exits_130(tmp_path):
    report = tmp_path / "r.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "parity", "--device", "cpu", "--no-progress", "--json", str(report),
                             "--dtypes", "float64,float32", "--checks", "forward"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(6)  # imports and the first units
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    data = json.loads(report.read_text())
    assert data["summary"]["interrupted"] is True
    assert "stopping after the current unit" in out


# ---------------------------------------------------------------- the user's own implementation


def test_examples_run_and_the_porting_bug_is_localised():
    from parity.examples.jax_port import port, port_with_head_split_bug
    from parity.examples.nanogpt_torch import nanogpt

    report = run(cases=[Case(SHAPES["cross"], "random", "nan")], dtypes=("float32",), checks=("forward", "gradient"),
                 impls=("torch", port, port_with_head_split_bug, nanogpt), device="cpu")
    by = lambda name: [r for r in report.rows if r.impl == name]  # noqa: E731
    assert by("jax-port") and all(r.status == "pass" for r in by("jax-port"))
    assert by("nanogpt-torch") and all(r.status == "pass" for r in by("nanogpt-torch"))
    bad = [r for r in by("jax-port-head-split-bug") if r.reference == "oracle"]
    assert bad and all(r.status == "fail" and r.stage == "q" for r in bad)


def _user(factory, **kw):
    from parity.impls import Implementation

    return Implementation(kw.pop("name", "mine"), kw.pop("framework", "torch"), factory, role="user", **kw)


def _torch_returning(make):
    def factory(sd, num_heads, *, dtype, device):
        return lambda p, q, k, v, m: make(q)

    return factory


@pytest.mark.parametrize("factory, message", [
    (lambda sd, n, **kw: (_ for _ in ()).throw(RuntimeError("broken factory")), "broken factory"),
    (_torch_returning(lambda q: q[:, :1]), "shape"),
    (_torch_returning(lambda q: q.double()), "dtype"),
    (_torch_returning(lambda q: q.numpy()), "type ndarray"),
    (lambda sd, n, **kw: 42, "not a callable"),
])
def test_bad_user_code_is_an_error_row_and_the_run_completes(factory, message, tmp_path):
    report = run(cases=[SMALL], dtypes=("float32",), checks=("forward",), impls=("torch", _user(factory)),
                 device="cpu", json_path=tmp_path / "r.json")
    mine = [r for r in report.rows if r.impl == "mine"]
    assert mine and all(r.status == "error" and message in r.message for r in mine), mine
    assert any(r.impl == "torch" and r.status == "pass" for r in report.rows)
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["error"] == len(mine)


def test_cli_loads_a_user_module_and_rejects_a_non_implementation(capsys):
    assert _cli("--quick", "--checks", "forward", "--impls", "torch", "--impl", "parity.examples.jax_port:port") == 0
    assert "jax-port" in capsys.readouterr().out
    assert _cli("--quick", "--impl", "parity.examples.jax_port:_make") == 2
    assert "not a parity.impls.Implementation" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("--devices", "1"), ("--shardings", "sp"), ("--devices", "2", "--shardings", "xp")])
def test_sharded_arguments_are_checked_up_front(argv):
    assert _cli("--quick", *argv) == 2


def test_sharded_check_without_devices_is_a_skip_not_a_pass(capsys):
    assert _cli("--quick", "--checks", "sharded") == 3
    assert "it runs with --devices N" in capsys.readouterr().out


def test_a_user_implementation_cannot_take_the_name_of_ours():
    """Built implementations are cached by name: a user's "torch" must not be judged as ours."""
    from parity.examples.jax_port import port
    import dataclasses

    with pytest.raises(ValueError, match="repeated: \\['torch'\\]"):
        select_impls(["jax-jit", dataclasses.replace(port, name="torch")])
