"""Causal is causal on every side: each bench row records how its mask reached the kernel (`mask_path`), the
torch implementations that take SDPA's is_causal get it, and a verdict between rows whose masks reached their
kernels differently says so. Real builds of both frameworks, in this process, at tiny sizes (fwd only)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from parity.bench import report, verdict
from parity.bench.records import ROW_FIELDS, Key
from parity.bench.spec import IMPLS as BENCH_IMPLS
from parity.bench.spec import MASK_PATHS, BenchCase, select_impls, structure_for
from test_bench_gradients import by_key, run_in_process

pytest.importorskip("torch")
pytest.importorskip("jax")

IMPLS = ("ours-torch:eager:fused", "ours-torch:eager:weights", "torch-sdpa-core:eager:fused", "ours-jax:jit:fused",
         "ours-jax:jit:weights", "jax-dpa-core:jit:fused")


def _ours_jax_fused(row, given_structure: bool) -> str:
    """What ours-jax's fused path's row must say, by the kernel its dispatch chose for this processor (the row's
    `kernel`): the chunked kernel takes a causal band as structure, and skips the key blocks a dense mask leaves
    empty; the einsum core and dot_product_attention apply a dense mask to every score."""
    if row["kernel"].startswith("chunked"):
        return "structure" if given_structure else "blocks-skipped"
    return "dense"


# (case, the mask_path of each row but ours-jax fused, whether ours-jax fused is given the structure).
CASES = {
    # T = S causal: SDPA's own is_causal is the case's mask. Our torch module's fused path runs it as SDPA's
    # is_causal, the SDPA peer is given it; the weights paths and jax's dot_product_attention apply a dense mask.
    "causal": (BenchCase.of(3, 5, 5, 12, 3, "float32", mask="causal"),
               {"ours-torch:eager:fused": "structure", "ours-torch:eager:weights": "dense",
                "torch-sdpa-core:eager:fused": "structure", "ours-jax:jit:weights": "dense",
                "jax-dpa-core:jit:fused": "dense"}, True),
    # T < S causal is bottom-right: not SDPA's top-left triangle, so a dense mask on the torch side.
    "causal-cross": (BenchCase.of(3, 5, 7, 12, 3, "float32", mask="causal"),
                     {"ours-torch:eager:fused": "dense", "ours-torch:eager:weights": "dense",
                      "torch-sdpa-core:eager:fused": "dense", "ours-jax:jit:weights": "dense",
                      "jax-dpa-core:jit:fused": "dense"}, True),
    "padding": (BenchCase.of(3, 5, 7, 12, 3, "float32", mask="padding"),
                {"ours-torch:eager:fused": "dense", "ours-torch:eager:weights": "dense",
                 "torch-sdpa-core:eager:fused": "dense", "ours-jax:jit:weights": "dense",
                 "jax-dpa-core:jit:fused": "dense"}, False),
    "none": (BenchCase.of(3, 5, 7, 12, 3, "float32"), dict.fromkeys(IMPLS, "none"), None),
}


@pytest.fixture(scope="module")
def swept():
    """One in-process sweep of every case (the rows and verdicts of each are its own: a verdict is per case)."""
    with pytest.MonkeyPatch.context() as mp:
        rows, vs, _ = run_in_process(select_impls(",".join(IMPLS)), [c for c, _, _ in CASES.values()], passes=("fwd",),
                                     monkeypatch=mp)
    return rows, vs


@pytest.mark.parametrize("name", CASES)
def test_each_row_records_how_its_mask_reached_the_kernel(name, swept):
    case, expected, structure = CASES[name]
    rows = [r for r in swept[0] if r["seq_k"] == case.seq_k and r["seq_q"] == case.seq_q and r["mask"] == case.mask]
    vs = [v for v in swept[1] if v["case"] == case.label]
    got = by_key(rows, "fwd")
    assert all(r["status"] in ("ok", "noisy") for r in got.values()), got  # the same output on every side
    if structure is not None:
        expected = {**expected, "ours-jax:jit:fused": _ours_jax_fused(got["ours-jax:jit:fused"], structure)}
    assert {k: r["mask_path"] for k, r in got.items()} == expected
    # The verdict pairs each framework's fastest; where their masks came differently it says so, in words.
    (v,) = vs
    paths = (got[v["faster"]]["mask_path"], got[v["slower"]]["mask_path"])
    if paths[0] != paths[1]:
        assert v["note"] == (f"the mask reached the kernels differently: {v['faster']} {paths[0]}, "
                             f"{v['slower']} {paths[1]}")
    else:
        assert v["note"] is None


def test_the_sdpa_peers_take_is_causal_only_where_it_is_the_cases_mask():
    sdpa, gqa = Key.parse("torch-sdpa-core:eager:fused").find(BENCH_IMPLS), Key.parse("torch-sdpa-gqa:eager:fused").find(BENCH_IMPLS)
    square = BenchCase.of(1, 8, 8, 16, 4, "float32", kv_heads=2, rope="half", mask="causal")
    assert structure_for(sdpa, BenchCase.of(1, 8, 8, 16, 4, "float32", mask="causal")) == ({"is_causal": True}, None)
    assert structure_for(gqa, square) == ({"is_causal": True}, None)
    for mask, T in (("causal", 5), ("window:3", 8), ("packed:2", 8), ("padding", 8)):  # bottom-right, or not causal
        assert structure_for(sdpa, BenchCase.of(1, T, 8, 16, 4, "float32", mask=mask)) is None, mask
    # Our modules take every structured mask, causal included, bottom-right aligned as the case is.
    ours = Key.parse("ours-torch:eager:fused").find(BENCH_IMPLS)
    assert structure_for(ours, BenchCase.of(1, 5, 8, 16, 4, "float32", mask="causal")) == (
        {"is_causal": True, "alignment": "bottom-right"}, None)


def _rows(paths):
    return {key: {"status": "ok", "mask_path": path, "param_grads": None} for key, path in paths.items()}


def test_a_verdict_between_rows_whose_masks_reached_the_kernel_differently_says_so_in_words():
    v = verdict.compute("B=1 T=8 S=8 E=16 N=4 mask=causal float32", "fwd", "a:jit:fused", [[[1.0, 1.0]] * 6],
                        "b:eager:fused", [[[2.0, 2.0]] * 6])
    rows = _rows({"a:jit:fused": "blocks-skipped", "b:eager:fused": "structure"})
    done = verdict.finalize(v, rows)
    assert done["note"] == "the mask reached the kernels differently: a:jit:fused blocks-skipped, b:eager:fused structure"
    assert verdict.sentence(done, rows).endswith(f"; {done['note']}")
    assert verdict.finalize(v, _rows({"a:jit:fused": "structure", "b:eager:fused": "structure"}))["note"] is None
    # In the reports: the console's verdict line, the Markdown's, the JSON's field.
    table_rows = [{**dict.fromkeys(ROW_FIELDS), "impl": k.split(":")[0], "mode": k.split(":")[1], "need_weights": False,
                   "pass": "fwd", "batch": 1, "seq_q": 8, "seq_k": 8, "embed": 16, "heads": 4, "dtype": "float32",
                   "mask": "causal", **r} for k, r in rows.items()]
    console = Console(file=io.StringIO(), width=100)
    report.print_verdicts([done], table_rows, console)
    assert done["note"] in " ".join(console.file.getvalue().split())
    assert done["note"] in report.markdown(table_rows, {}, [done])
    assert report.to_json(table_rows, {}, [done])["verdicts"][0]["note"] == done["note"]


def test_a_saved_row_with_an_unknown_mask_path_is_refused():
    row = {"impl": "a", "mode": "jit", "pass": "fwd", "batch": 1, "seq_q": 8, "seq_k": 8, "embed": 16, "heads": 4,
           "dtype": "float32", "need_weights": False, "status": "skip", "median_s": None, "iqr_s": None, "min_s": None,
           "ratio": None, "gflops": None, "peak_fraction": None, "compile_s": None, "recompile_s": None,
           "peak_mem_bytes": None}
    for path in MASK_PATHS:
        report.validate({"schema": report.SCHEMA, "rows": [{**row, "mask_path": path}]})
    with pytest.raises(report.BenchFileError, match="mask_path = 'causal'"):
        report.validate({"schema": report.SCHEMA, "rows": [{**row, "mask_path": "causal"}]})
