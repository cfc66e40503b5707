"""`mha-parity --plot`: every check has its own colour, and the legend names the colour of every check drawn
(the decode and leak rows included) and the red of a group with a failing row."""

from __future__ import annotations

import matplotlib
import matplotlib.axes
import pytest

from parity.harness.matrix import CHECKS
from parity.harness.plot import CHECK_COLOURS, FAILED_COLOUR, write_margin_plot
from parity.harness.report import Report, Row

matplotlib.use("Agg")


def _row(check, impl, status="pass", err=1e-7):
    return Row("c", check, impl, "oracle", "float32", "cpu:0", status, "output", err, err, 1e-6, 1e-5)


@pytest.fixture
def legend(monkeypatch):
    """What the plot's legend shows: [(label, face colour)]."""
    seen = []
    real = matplotlib.axes.Axes.legend

    def spy(self, *a, **kw):
        made = real(self, *a, **kw)
        seen.extend((t.get_text(), tuple(h.get_facecolor()[0])) for t, h in zip(made.get_texts(), made.legend_handles)
                    if hasattr(h, "get_facecolor"))  # the markers; the pass line is a line
        return made

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", spy)
    return seen


def test_every_check_has_a_colour_of_its_own_and_none_is_the_failure_red():
    assert set(CHECK_COLOURS) == set(CHECKS)
    colours = [matplotlib.colors.to_hex(c) for c in CHECK_COLOURS.values()]
    assert len(set(colours)) == len(colours) and matplotlib.colors.to_hex(FAILED_COLOUR) not in colours


def test_the_legend_names_the_decode_and_leak_colours(tmp_path, legend):
    rows = [_row("forward", "torch"), _row("decode", "jax-jit"), _row("leak", "torch"),
            _row("decode", "torch", "fail", err=1e-3)]
    write_margin_plot(Report({"seed": 0}, rows), tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 10_000
    shown = dict(legend)
    for check in ("forward", "decode", "leak"):
        assert shown[check] == matplotlib.colors.to_rgba(CHECK_COLOURS[check]), check
    assert shown["a row failed"] == matplotlib.colors.to_rgba(FAILED_COLOUR)
    assert "gradient" not in shown and "sharded" not in shown  # only the checks drawn
