"""mha-bench on partial and scaled RoPE: --rope-dim and --rope-scaling set every case's layer, land in the case
and its rows (so rows are compared like with like), and a run with them times our module."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mha_spec import RopeScaling
from parity.bench import cli, report
from parity.bench.records import Row, empty_row, match_key
from parity.bench.spec import IMPLS, MEASURED, BenchCase
from test_bench_cli import FAST, fake_spawn

YARN = "yarn:factor=4.0,original_max_position_embeddings=8"
ROPE = ["--rope", "half", "--head-dim", "8", "--rope-dim", "4", "--rope-scaling", YARN]


def _console():
    return Console(file=io.StringIO(), width=200)


def _cases(argv):
    return cli.build_config(cli.run_parser().parse_args([*FAST, *argv])).cases


def test_the_flags_reach_the_case_and_every_row(tmp_path):
    (case, *_) = _cases(ROPE)
    c = case.config
    assert (c.rope, c.rotary_dim, c.head_size, c.rope_scaling) == ("half", 4, 8, RopeScaling.parse(YARN))
    assert {"rope-partial", "rope-scaled"} <= c.features
    out, calls, console = tmp_path / "r.json", [], _console()
    assert cli.main([*FAST, *ROPE, "--json", str(out)], console=console, spawn=fake_spawn(calls)) == 0
    sent = {BenchCase.from_fields(item["case"]) for item in calls[0]["items"]}
    assert {s.config.rope_scaling for s in sent} == {RopeScaling.parse(YARN)} and {s.config.rope_dim for s in sent} == {4}
    rows = report.load(str(out))["rows"]
    assert rows and all((r["rope_dim"], r["rope_scaling"]) == (4, YARN) for r in rows)
    skipped = [r for r in rows if r["impl"] == "torch-sdpa-core"]
    assert skipped and all(r["status"] == "skip" and "rope-partial" in r["message"] for r in skipped)
    assert f"rope_dim=4 rope_scaling={YARN}" in " ".join(console.file.getvalue().split())


def test_rows_of_other_rope_layers_are_not_compared_and_old_rows_are_unscaled():
    full = BenchCase.of(1, 8, 8, 16, 2, "float32", rope="half")
    partial = BenchCase.of(1, 8, 8, 16, 2, "float32", rope="half", rope_dim=4, rope_scaling=YARN)
    assert BenchCase.from_fields(partial.fields()) == partial and partial.fields()["rope_scaling"] == YARN
    assert BenchCase.of(1, 8, 8, 16, 2, "float32", rope="half", rope_dim=8) == full  # R = H: the whole head
    old = {k: v for k, v in full.fields().items() if k not in ("rope_dim", "rope_scaling")}
    assert BenchCase.from_fields(old) == full  # a row before the fields rotated whole heads, unscaled
    im = next(i for i in IMPLS if i.bench_key == "ours-torch:eager:fused")
    keys = {match_key(empty_row(im, c, "fwd", status="ok")) for c in (full, partial)}
    assert len(keys) == 2
    row = empty_row(im, partial, "fwd", status="ok")
    for bad in ({"rope_dim": 3}, {"rope_scaling": "dynamic:factor=2"}, {"rope_scaling": "yarn:factor=4"}):
        assert Row.problem({**row, **bad}) is not None, bad


@pytest.mark.parametrize("argv, words", [
    (["--rope-dim", "4"], "--rope-dim 4 is RoPE's"),  # no --rope: the layer has none
    (["--rope", "none,half", "--rope-scaling", YARN], "--rope-scaling"),
    (["--rope", "half", "--rope-dim", "6"], "rope_dim must be an even int"),  # H = E / N = 4 < 6
])
def test_a_layer_the_flags_cannot_make_is_a_usage_error(argv, words):
    calls, console = [], _console()
    assert cli.main([*FAST, "--embed", "16", "--heads", "4", *argv], console=console, spawn=fake_spawn(calls)) == 2
    assert not calls and words in " ".join(console.file.getvalue().split())


@pytest.mark.parametrize("text", ["dynamic:factor=2", "yarn:factor=4,beta=2", "longrope:factor=x"])
def test_a_bad_scaling_is_a_usage_error_naming_the_flag(text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*FAST, "--rope", "half", "--rope-scaling", text], console=_console(), spawn=fake_spawn([]))
    assert e.value.code == 2 and "argument --rope-scaling" in capsys.readouterr().err


def test_a_run_times_our_torch_module_on_the_layer(monkeypatch):
    """The sweep's own code in this process (`test_bench_gradients.run_in_process`), fwd, torch only (no compile)."""
    from test_bench_gradients import run_in_process

    impls = [im for im in IMPLS if im.bench_key in ("ours-torch:eager:fused", "ours-torch:eager:weights")]
    longrope = "longrope:factor=4.0,original_max_position_embeddings=4,short_factor=1;2,long_factor=3;5"
    cases = _cases(["--rope", "half", "--head-dim", "8", "--rope-dim", "4", "--rope-scaling", longrope, "--seq", "8"])
    rows, _, _ = run_in_process(impls, cases, passes=("fwd",), monkeypatch=monkeypatch)
    assert len(rows) == 2 and all(r["status"] in MEASURED and r["rope_scaling"] == longrope for r in rows), rows
