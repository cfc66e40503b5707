"""What the console prints is text: names and messages as written, and no line ends in spaces.

A layer's name, a file path or an exception's message may hold `[bold]`, `[/]` or `:x:`; rich would
read the first as markup and turn the last into an emoji. And rich pads every table cell to its
column's width, so each table line would end in spaces (noise in a log, a diff, a copy-paste).
"""

from __future__ import annotations

import pytest
from rich.console import Console

from parity.harness import Case, Shape, run
from parity.harness.report import Report, Row, print_report

USER_TEXT = "[bold]boom[/bold] :x: :smile: [red]not red"


def _printed(report, width=80, **kw) -> str:
    console = Console(width=width, record=True, force_terminal=True, color_system="truecolor")
    print_report(report, console, **kw)
    return console.export_text()


def _rows():
    return [Row("self/random/nan", "forward", f"my:x:layer{USER_TEXT}", "oracle", "float32", "cpu", "fail", "output",
                2e-3, 1e-2, 1e-6, 0.0, "q", USER_TEXT),
            Row("self/random/nan", "forward", "torch", "oracle", "float32", "cpu", "pass", "output", 1e-7, 1e-7,
                1e-6, 0.0),
            Row("self/random/nan", "gradient", "jax-jit", "oracle", "float32", "cpu", "skip", message=USER_TEXT)]


@pytest.mark.parametrize("kw", [{}, {"details": True}, {"all_rows": True}, {"all_columns": True}])
def test_names_and_messages_are_printed_as_written(kw):
    text = _printed(Report({"seed": 0, "device": "cpu[0]"}, _rows()), width=400, **kw)
    assert USER_TEXT in text  # markup kept as text, emoji codes not replaced
    assert "my:x:layer" in text and "device=cpu[0]" in text
    assert "❌" not in text and "😄" not in text


@pytest.mark.parametrize("kw", [{}, {"details": True}, {"all_columns": True}])
def test_no_console_line_ends_in_spaces(kw):
    text = _printed(Report({"seed": 0}, _rows()), **kw)
    lines = text.splitlines()
    assert len(lines) > 5
    assert [line for line in lines if line != line.rstrip()] == []


def test_a_small_run_prints_no_trailing_spaces():
    report = run(cases=[Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "padding", "uniform")],
                 dtypes=("float32",), checks=("forward",), impls=("torch",), device="cpu")
    for kw in ({}, {"details": True}):
        lines = _printed(report, **kw).splitlines()
        assert any("torch" in line and "pass" in line for line in lines)
        assert [line for line in lines if line != line.rstrip()] == [], kw


def test_the_cli_prints_a_report_path_as_written(tmp_path, capsys):
    from parity.cli import main

    path = tmp_path / "run [bold]:x:.json"
    code = main(["--device", "cpu", "--no-progress", "--quick", "--impls", "torch", "--checks", "forward",
                 "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and path.exists()
    assert "run [bold]:x:.json" in out.replace("\n", "")  # a long path may wrap; its name is whole
    assert "❌" not in out
