"""The flags of Llama 4's layers. mha-bench: --qk-norm l2 and --attn-temperature-tuning (--floor-scale,
--attn-scale) set every case's layer, land in its rows (so rows are compared like with like), and a run with
them times our module; --mask chunk:C is Llama 4's chunked attention. mha-parity --layer: qk_norm=l2,
temperature=yes, floor_scale=, attn_scale=."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

from parity.bench import cli, report
from parity.bench.records import Row, empty_row, match_key
from parity.bench.spec import IMPLS, MEASURED, BenchCase
from parity.cli import main
from parity.cli_args import parse_layer
from test_bench_cli import FAST, fake_spawn

NOPE = ["--attn-temperature-tuning", "--floor-scale", "4", "--attn-scale", "0.25"]


def _console():
    return Console(file=io.StringIO(), width=200)


def _cases(argv):
    return cli.build_config(cli.run_parser().parse_args([*FAST, *argv])).cases


def test_the_temperature_flags_reach_the_case_and_every_row(tmp_path):
    (case, *_) = _cases(NOPE)
    c = case.config
    assert (c.rope, c.attn_temperature_tuning, c.floor_scale, c.attn_scale) == (None, True, 4.0, 0.25)
    assert "temperature" in c.features
    out, calls, console = tmp_path / "r.json", [], _console()
    assert cli.main([*FAST, *NOPE, "--json", str(out)], console=console, spawn=fake_spawn(calls)) == 0
    sent = {BenchCase.from_fields(item["case"]) for item in calls[0]["items"]}
    assert {(s.config.floor_scale, s.config.attn_scale) for s in sent} == {(4.0, 0.25)}
    rows = report.load(str(out))["rows"]
    assert rows and all((r["attn_temperature_tuning"], r["floor_scale"], r["attn_scale"]) == (True, 4.0, 0.25)
                        for r in rows)
    skipped = [r for r in rows if r["impl"] == "torch-sdpa-core"]  # it has no temperature: not timed on this layer
    assert skipped and all(r["status"] == "skip" and "temperature" in r["message"] for r in skipped)
    assert "temperature(floor_scale=4, attn_scale=0.25)" in " ".join(console.file.getvalue().split())


def test_l2_and_temperature_layers_are_rows_of_their_own_and_old_rows_have_neither():
    plain = BenchCase.of(1, 8, 8, 16, 2, "float32")
    nope = BenchCase.of(1, 8, 8, 16, 2, "float32", attn_temperature_tuning=True, floor_scale=4.0)
    l2 = BenchCase.of(1, 8, 8, 16, 2, "float32", rope="interleaved", qk_norm="l2")
    assert BenchCase.from_fields(nope.fields()) == nope and nope.fields()["floor_scale"] == 4.0
    assert BenchCase.of(1, 8, 8, 16, 2, "float32", attn_temperature_tuning=False) == plain
    old = {k: v for k, v in plain.fields().items() if k not in ("attn_temperature_tuning", "floor_scale", "attn_scale")}
    assert BenchCase.from_fields(old) == plain  # a row before the fields had no temperature
    assert BenchCase.from_fields(l2.fields()).config.qk_norm == "l2"
    im = next(i for i in IMPLS if i.bench_key == "ours-torch:eager:fused")
    assert len({match_key(empty_row(im, c, "fwd", status="ok")) for c in (plain, nope)}) == 2
    row = empty_row(im, nope, "fwd", status="skip", message="not timed")
    assert Row.problem(row) is None
    for bad in ({"attn_temperature_tuning": False}, {"floor_scale": 0.0}, {"attn_scale": float("nan")},
                {"attn_temperature_tuning": None}):  # constants without the temperature
        assert Row.problem({**row, **bad}) is not None, bad


@pytest.mark.parametrize("argv, words", [
    (["--floor-scale", "4"], "--floor-scale 4.0 is the temperature's"),
    (["--attn-temperature-tuning", "--rope", "half"], "--attn-temperature-tuning is Llama 4's NoPE"),
    (["--qk-norm-eps", "1e-5"], "add --qk-norm head|flat|l2"),
])
def test_a_layer_the_flags_cannot_make_is_a_usage_error(argv, words):
    calls, console = [], _console()
    assert cli.main([*FAST, "--embed", "16", "--heads", "4", *argv], console=console, spawn=fake_spawn(calls)) == 2
    assert not calls and words in " ".join(console.file.getvalue().split())


def test_a_run_times_our_torch_module_on_both_llama4_layers(monkeypatch):
    """The sweep's own code in this process (`test_bench_gradients.run_in_process`), fwd, torch only (no compile)."""
    from test_bench_gradients import run_in_process

    impls = [im for im in IMPLS if im.bench_key == "ours-torch:eager:fused"]
    cases = _cases([*NOPE, "--seq", "8"]) + _cases(["--rope", "interleaved", "--qk-norm", "l2", "--seq", "8"])
    rows, _, _ = run_in_process(impls, cases, passes=("fwd",), monkeypatch=monkeypatch)
    assert len(rows) == 2 and all(r["status"] in MEASURED for r in rows), rows
    assert {(r["qk_norm"], r["attn_temperature_tuning"]) for r in rows} == {(None, True), ("l2", None)}


def test_the_layer_flag_takes_both_and_refuses_what_the_layer_would_ignore():
    c = parse_layer("E=12,N=3,temperature=yes,floor_scale=2,attn_scale=0.5,bias=none")
    assert (c.rope, c.attn_temperature_tuning, c.floor_scale, c.attn_scale) == (None, True, 2.0, 0.5)
    assert parse_layer("E=12,N=3,rope=interleaved,qk_norm=l2").qk_norm == "l2"
    for text, words in (("E=12,N=3,floor_scale=8192", "floor_scale= the temperature's"),  # its default, still refused
                        ("E=12,N=3,rope=half,temperature=yes", "on a RoPE layer"),
                        ("E=12,N=3,temperature=maybe", "temperature='maybe'"),
                        ("E=12,N=3,qk_norm=l2", "qk_norm")):  # L2 norm after RoPE: a RoPE layer only
        with pytest.raises(Exception, match=None) as e:
            parse_layer(text)
        assert words in str(e.value), (text, str(e.value))


@pytest.mark.parametrize("dropped", [False, True])
def test_a_layer_run_judges_the_temperature(tmp_path, monkeypatch, dropped):
    """Positions 0..4 with floor_scale 2: temperatures 1, 1 + 0.5·log 2, ...: green for ours, red for ours with
    the temperature dropped (so the flag reached the layer the oracle judges)."""
    if dropped:
        import mha_torch.attention

        monkeypatch.setattr(mha_torch.attention, "temperature", lambda q, pos, config: q)
    out = tmp_path / "r.json"
    code = main(["--no-progress", "--layer", "E=12,N=3,temperature=yes,floor_scale=2,attn_scale=0.5", "--shape", "3,5,5",
                 "--impls", "torch", "--checks", "forward", "--dtypes", "float64", "--json", str(out)])
    judged = [r for r in json.loads(out.read_text())["rows"] if r["reference"] == "oracle" and r["quantity"] == "output"]
    assert judged and {r["status"] for r in judged} == ({"fail"} if dropped else {"pass"})
    assert code == (1 if dropped else 0)


@pytest.mark.parametrize("T, S, C", [(7, 7, 3), (5, 9, 4), (6, 6, 6), (4, 8, 1)])
def test_the_chunked_mask_is_the_structure_keeps_what_it_counts_and_reads_back(T, S, C):
    """--mask chunk:C: chunks of C positions counted from the first key, queries bottom-right (query t at
    t + S - T); written from the definition here, held to `BenchMask.keep`, `structure` and `kept`."""
    from parity.bench.spec import BenchMask
    from parity.reference import structured_keep

    B = 3
    mask = BenchMask.parse(f"chunk:{C}")
    assert str(mask) == f"chunk:{C}" and mask.unit_kind == "random"
    a = np.arange(T)[:, None] + S - T  # (T, 1) each query's position
    s = np.arange(S)[None, :]  # (1, S)
    want = (s <= a) & (s // C == a // C)  # (T, S)
    keep = mask.keep(B, T, S)
    assert keep.shape == (B, 1, T, S) and (keep == want).all()
    st = mask.structure(B, T, S)
    assert st.chunk == C and (structured_keep(T, S, **st.keywords())[0, 0] == want).all()
    assert mask.kept(B, T, S) == B * int(want.sum())


@pytest.mark.parametrize("text, words", [("chunk", "needs its parameter"), ("chunk:0", "C (positions per chunk)"),
                                         ("chunk:x", "positive integer")])
def test_a_bad_chunked_mask_is_refused_by_name(text, words):
    from parity.bench.spec import BenchMask

    with pytest.raises(ValueError, match=None) as e:
        BenchMask.parse(text)
    assert words in str(e.value)
    with pytest.raises(ValueError, match="T <= S"):
        BenchCase.of(1, 6, 4, 16, 2, "float32", mask="chunk:2")
