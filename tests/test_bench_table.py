"""`mha-bench table` (one run as one cross-framework Markdown table), `--list`'s estimate of a run's wall time,
and a plot title that fits its figure (every verdict whole, wrapped between words)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from parity.bench import cli, report
from parity.bench.records import empty_row
from parity.bench.spec import FLOPS_FORMULA, IMPLS, BenchCase
from test_bench_cli import FAST, _console

FWD_ONLY = next(i for i in IMPLS if i.bench_key == "ours-torch:eager:fused")
JAX = next(i for i in IMPLS if i.bench_key == "ours-jax:jit:fused")


def _rows():
    """Two shapes, two implementations, both passes; every number distinct so a swapped column shows."""
    out = []
    for b, case in enumerate((BenchCase.of(1, 512, 512, 64, 4, "float32"), BenchCase.of(4, 512, 512, 64, 4, "float32"))):
        for i, impl in enumerate((FWD_ONLY, JAX)):
            for p, pass_ in enumerate(("fwd", "fwd+bwd")):
                k = 1 + b + 10 * i + 100 * p  # 1, 2, 11, 12, 101, ...
                out.append(empty_row(impl, case, pass_, status="ok", median_s=k * 1e-3, iqr_s=0.0, gflops=k * 1e3,
                                     peak_fraction=k / 1000, peak_mem_bytes=k * 2**20, compile_s=k / 100,
                                     kernel=f"kernel-{k}"))
    return out


ENV = {"device": "cpu", "cpu_model": "AMD EPYC test", "threads": {"torch": 2, "jax": 2}, "precision": "highest",
       "flops_formula": FLOPS_FORMULA, "peaks": [{"dtype": "float32", "gflops": 123.0}]}


def test_the_table_has_a_line_per_shape_and_implementation_with_each_pass_in_its_columns(tmp_path):
    text = report.cross_table(_rows(), ENV)
    assert FLOPS_FORMULA in text and "AMD EPYC test" in text and "float32 123 GFLOP/s" in text
    body = [ln for ln in text.splitlines() if ln.startswith("| ") and "implementation" not in ln]
    assert len(body) == 4
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in body]
    # B=4, ours-jax: k = 12 (fwd) and 112 (fwd+bwd); the shape is written on its first line only
    jax_b4 = cells[3]
    assert cells[2][0].startswith("B=4") and jax_b4[0] == "" and jax_b4[1] == "ours-jax:jit:fused"
    assert jax_b4[2:8] == ["12", "12", "1 %", "112", "112", "11 %"]  # ms, TFLOP/s, % peak per pass
    assert jax_b4[8:] == ["12 / 112", "0.12 / 1.1", "kernel-12"]


def test_a_pass_not_timed_shows_its_status_and_the_command_writes_the_table(tmp_path):
    rows = _rows()
    rows[1].update(status="skip", median_s=None, gflops=None, peak_fraction=None, message="declared not to run")
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"schema": "mha-bench/4", "environment": ENV, "rows": rows, "verdicts": []}))
    text = report.cross_table(rows, ENV)
    first = [c.strip() for c in text.splitlines()[6].strip("|").split("|")]
    assert first[5:8] == ["skip", "", ""]
    out = tmp_path / "table.md"
    console = Console(file=io.StringIO(), width=300)
    code = cli.main(["table", str(run), "--markdown", str(out)], console=console)
    assert code == 0, console.file.getvalue()
    assert out.read_text() == text
    assert cli.main(["table", str(run), "--markdown", str(run)], console=console) == 2  # never over the run


def test_list_says_how_many_rows_are_timed_and_how_long_the_run_takes():
    console = _console()
    assert cli.main([*FAST, "--list"], console=console) == 0
    last = " ".join(console.file.getvalue().split()).rsplit(" items: ", 1)
    n_items = int(last[0].rsplit(" ", 1)[-1])
    lines = [ln for ln in console.file.getvalue().splitlines() if ln.startswith("B=")]
    skips = sum("(skip:" in ln for ln in lines)
    assert f"{n_items} items: {n_items - skips} timed, {skips} skip; estimated wall time ~" in " ".join(
        console.file.getvalue().split())
    cfg = cli.build_config(cli.run_parser().parse_args(FAST))
    from parity.bench import sweep
    items = sweep.plan(cfg)
    timed, seconds = cli.estimate_s(cfg, items)
    # never below the budget the timed calls may spend, per worker process
    assert timed == n_items - skips and seconds >= cfg.processes * timed * cfg.timing.budget_s
    # a slow item counts its min_repeats calls, each its FLOPs at the assumed rate (the grid of
    # docs/results/bench-grid-epyc-before-tune.md: estimated 16.1 min, measured 15.7; after the tune 13.2)
    from parity.bench.spec import pass_flops
    big = cli.build_config(cli.run_parser().parse_args([*FAST, "--seq", "4096", "--batch", "4", "--embed", "512",
                                                        "--heads", "8"]))
    big_items = [it for it in sweep.plan(big) if not it.skip]
    slowest = max(pass_flops(it.case, it.pass_) for it in big_items) / (cli.ESTIMATE_GFLOPS["cpu"] * 1e9)
    assert cli.estimate_s(big, big_items)[1] >= big.processes * big.timing.min_repeats * slowest > big.timing.budget_s


def test_the_plot_title_fits_its_figure_and_wraps_between_words():
    pytest.importorskip("matplotlib")
    rows = [r for r in _rows() if r["pass"] == "fwd"]  # one pass: the narrowest figure
    reason = "the interval contains 1 (no measurable difference at this noise) " * 3
    v = {"case": rows[0]["impl"] + " " + "B=1 T=512 S=512 E=64 N=4 float32", "pass": "fwd",
         "faster": "ours-torch:eager:fused", "slower": "ours-jax:jit:fused", "ratio": 1.01, "ci": [0.98, 1.04],
         "conclusive": False, "reason": reason, "note": "the mask reached the kernels differently: " + "x " * 40}
    fig = report.plot_figure(rows, ENV, [v, v])
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    lines = fig._suptitle.get_text().splitlines()
    words = set(" ".join(report.verdictshort(v, 10**6).split()).split())
    assert all(w in words or w in report.plot_title(rows, ENV, width=10**6).split() for ln in lines
               for w in ln.split())  # every line is made of whole words
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_many_verdicts_leave_the_plots_their_height_below_the_title():
    """A verdict per case (16 in the B=1,4 grid) makes a tall title; the plots keep their room under it
    (tight_layout once reserved the title's height twice: the axes shrank to the bottom 1.5 inches)."""
    pytest.importorskip("matplotlib")
    rows = _rows()
    v = {"case": "B=1 T=512 S=512 E=64 N=4 float32", "pass": "fwd", "faster": "ours-torch:eager:fused",
         "slower": "ours-jax:jit:fused", "ratio": 1.01, "ci": [0.98, 1.04], "conclusive": False,
         "reason": "the interval contains 1 (no measurable difference at this noise)"}
    fig = report.plot_figure(rows, ENV, [v] * 16)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    assert max(b.y1 for b in boxes) <= title.y0  # no plot under the title's lines
    inches = (max(b.y1 for b in boxes) - min(b.y0 for b in boxes)) / fig.dpi
    assert inches >= 6.5, inches  # of the 8.5 the plots are given
    import matplotlib.pyplot as plt
    plt.close(fig)


@pytest.mark.parametrize("lengths", [(512,), (512, 1024)], ids=["bars", "lines"])
def test_the_rate_plots_draw_the_measured_peak_of_each_dtype(lengths):
    """How close to the machine: the GFLOP/s axes carry the run's measured matmul peak (a line at its value,
    named), beside the rows' rates."""
    pytest.importorskip("matplotlib")
    rows = []
    for T in lengths:
        for n, impl in enumerate((FWD_ONLY, JAX)):
            case = BenchCase.of(1, T, T, 64, 4, "float32")
            rows.append(empty_row(impl, case, "fwd", status="ok", median_s=1e-3 * (n + 1), iqr_s=0.0,
                                  gflops=50.0 + n, peak_gflops=221.0, peak_fraction=0.2, kernel="k"))
    fig = report.plot_figure(rows, ENV)
    rate = fig.axes[1]
    values = {float(v) for ln in rate.get_lines() if ln.get_linestyle() == ":"
              for v in (ln.get_xdata() if len(lengths) == 1 else ln.get_ydata())}
    assert values == {221.0}
    assert any(t.get_text() == "float32 matmul peak 221" for t in rate.texts)
    import matplotlib.pyplot as plt
    plt.close(fig)
