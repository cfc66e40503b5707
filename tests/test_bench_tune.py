"""`mha-bench tune`: the check of the kernel table's choice against the run's own times.

The arithmetic is checked on fake timings; one tiny real run checks the wiring (the table is
written where asked, and the choice is read back from it). No speed is asserted."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from parity.bench import cli
from mha_jax.kernels import Choice
from parity.bench.tune_command import WITHIN, candidate_name, check_choices, mean_ratio, report_lines


def _row(T, pass_, candidate, min_s, B=2, N=4, H=8):
    return dict(B=B, N=N, T=T, S=T, H=H, pass_=pass_, candidate=candidate, min_s=min_s, median_s=2 * min_s, reps=3)


ROWS = [
    _row(256, "fwd", "einsum", 1.00), _row(256, "fwd", "chunked:128x256", 1.04), _row(256, "fwd", "chunked:256x256", 1.30),
    _row(256, "fwd+bwd", "einsum", 3.00), _row(256, "fwd+bwd", "chunked:128x256", 3.60), _row(256, "fwd+bwd", "chunked:256x256", 2.50),
    _row(2048, "fwd", "chunked:512x512", 8.0), _row(2048, "fwd", "chunked:256x256", 10.0),
]


def test_each_size_and_pass_compares_the_chosen_candidate_with_the_fastest_of_the_run():
    chosen = {256: "chunked:128x256", 2048: "chunked:512x512"}
    checks = check_choices(ROWS, lambda B, N, K, T, S, H: chosen[T])
    got = {(c.T, c.pass_): (c.chosen, c.best, c.ratio, c.within) for c in checks}
    assert got == {
        (256, "fwd"): ("chunked:128x256", "einsum", pytest.approx(1.04), True),
        (256, "fwd+bwd"): ("chunked:128x256", "chunked:256x256", pytest.approx(3.60 / 2.50), False),
        (2048, "fwd"): ("chunked:512x512", "chunked:512x512", 1.0, True),
    }
    per_size = [c for c in checks if c.T == 256]
    assert mean_ratio(per_size) == pytest.approx(math.sqrt(1.04 * 1.44))
    text = "\n".join(report_lines(checks))
    assert "1.440x the best (chunked:256x256" in text and f"above {WITHIN - 1:.0%}" in text
    assert "1 of 3 (size, pass) not within 5% of the best measured" in text


def test_a_choice_that_was_not_measured_is_never_within():
    checks = check_choices(ROWS[-2:], lambda *size: "dpa-cudnn")
    assert checks[0].ratio is None and not checks[0].within and mean_ratio(checks) is None
    assert "dpa-cudnn was not measured in this run" in "\n".join(report_lines(checks))


def test_all_within_says_so():
    checks = check_choices(ROWS[-2:], lambda *size: "chunked:512x512")
    assert report_lines(checks)[-1] == "all 1 chosen within 5% of the best measured"


def test_chosen_blocks_are_named_as_tune_names_its_candidates():
    chunked = lambda q, k, h=None: Choice("chunked", q, k, head_chunk=h)  # noqa: E731
    assert candidate_name(chunked(512, 1024), 1, 8, 8, 256, 300) == "chunked:256x300"  # clipped to T and S, as tune does
    assert candidate_name(chunked(512, 1024), 1, 8, 2, 256, 300) == "chunked:512x300"  # grouped: G·T = 1024 query rows
    assert candidate_name(chunked(128, 256), 1, 8, 8, 2048, 2048) == "chunked:128x256"
    assert candidate_name(Choice("einsum"), 1, 8, 8, 64, 64) == "einsum"
    # The head chunk as it runs (mha_jax.chunked.head_steps): heads of one batch element, or whole elements.
    assert candidate_name(chunked(64, 64, 4), 2, 8, 8, 64, 64) == "chunked:64x64/h4"
    assert candidate_name(chunked(64, 64, 3), 2, 8, 8, 64, 64) == "chunked:64x64/h2"  # 3 does not divide 8 heads
    assert candidate_name(chunked(64, 64, 12), 4, 4, 4, 64, 64) == "chunked:64x64/h8"  # two of four elements
    assert candidate_name(chunked(64, 64, 16), 2, 8, 8, 64, 64) == "chunked:64x64"  # all 16: one step
    assert candidate_name(chunked(64, 64, 1), 1, 8, 1, 64, 64) == "chunked:64x64"  # one head block in all


def test_a_tiny_tune_writes_the_table_where_asked_and_checks_the_choice_read_back_from_it(tmp_path, capsys):
    out = tmp_path / "table.json"
    console = Console(file=io.StringIO(), width=200)
    rc = cli.main(["tune", "--sizes", "1x2x16x8", "--blocks", "8x8", "--passes", "fwd", "--min-repeats", "1",
                   "--budget", "0.001", "--out", str(out)], console=console)
    text = console.file.getvalue()
    assert rc == 0, text
    table = json.loads(out.read_text())
    (entry,) = table["processors"].values()
    assert [r["T"] for r in entry["rows"]] == [16]
    assert "B=1 N=2 T=16 S=16 H=8: chosen " in text and f"kernel table: {out}" in text
    chosen = text.split("chosen ")[1].split(",")[0].split()[0]
    measured = {"einsum", "dpa-xla", "chunked:8x8"}
    assert chosen in measured  # the table's own fastest kind, read back through kernels.choose
    assert f"wrote 1 row(s)" in capsys.readouterr().out


def test_a_grouped_rows_choice_is_asked_with_its_key_value_heads():
    rows = [{**_row(256, "fwd", "chunked:512x256", 1.0, N=4), "K": 2}, _row(256, "fwd", "chunked:256x256", 1.0, N=4)]
    asked = []
    checks = check_choices(rows, lambda *size: asked.append(size) or "chunked:512x256")
    assert asked == [(2, 4, 2, 256, 256, 8), (2, 4, 4, 256, 256, 8)]  # (B, N, K, T, S, H): two sizes, not one
    assert [c.K for c in checks] == [2, 4]
    assert "B=2 N=4 K=2 T=256" in "\n".join(report_lines(checks))
