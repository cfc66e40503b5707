"""`mha-bench --decode S`: the prefill and the one-token step of every decode implementation held to the float64
oracle before timing, the bytes each cache holds and the FLOPs and reads of a step from the layer's definition,
the bandwidth fraction from the measured rate, verdicts for every pair, and the flags it refuses."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from parity.bench import cli, decode
from parity.bench.spec import BenchCase

B, S, E, N, K = 2, 7, 12, 3, 1  # H = 4; pairwise distinct


def _spec(impls=("ours-torch:eager", "ours-torch:static", "ours-jax:jit", "hf-llama:dynamic-cache"), user=(), **layer):
    layer = {"kv_heads": K, "rope": "half", "bias": "none", **layer}
    return decode.DecodeBench(BenchCase.of(B, 1, S + 1, E, N, "float32", **layer), impls=impls, user=user,
                              processes=1, budget_s=0.01)


def test_each_implementation_decodes_the_oracles_token_and_its_cache_holds_what_the_layer_says():
    result = decode.work(_spec(user=("parity.examples.decoders:decoder",)))
    rows = {(r["pass"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {(p, k) for p in ("prefill", "step") for k in ("ours-torch:eager", "ours-torch:static",
                                                                      "ours-jax:jit", "hf-llama:dynamic-cache")} | {
        ("step", "decoder-example:decoder")}
    assert all(r["status"] == "ok" and r["rounds"] for r in rows.values()), [r["message"] for r in rows.values()]
    H = E // N
    ours = 2 * B * K * (S + 1) * H * 4  # k and v, K heads of H, S + 1 slots, float32
    assert {rows["step", k]["cache_bytes"] for k in ("ours-torch:eager", "ours-torch:static", "ours-jax:jit")} == {ours}
    assert rows["step", "hf-llama:dynamic-cache"]["cache_bytes"] == 2 * B * K * S * H * 4  # the prefill's S tokens
    assert result["read_bytes_per_s"] > 1e8  # any machine reads more than 100 MB/s


def test_a_decoder_off_the_oracle_is_an_error_row_and_is_not_timed():
    result = decode.work(_spec(impls=(), user=("parity.examples.decoders:decoder_position_off_by_one",)))
    (row,) = result["rows"]
    assert row["status"] == "error" and "not the oracle's result" in row["message"] and not row["rounds"]


def test_flops_and_reads_of_a_step_are_the_layers():
    spec = _spec()
    H, weights = E // N, E * N * (E // N) + 2 * E * K * (E // N) + N * (E // N) * E  # q, k, v, out; no biases
    assert decode.step_reads(spec) == 4 * (2 * B * K * (S + 1) * H + weights)
    # one token projected (q: E -> N·H, k and v: E -> K·H, out: N·H -> E), S + 1 keys attended
    assert decode.flops(spec, "step") == 2 * B * E * H * (2 * N + 2 * K) + 4 * N * H * B * (S + 1)
    assert decode.flops(spec, "prefill") == 2 * B * E * H * (2 * N * S + 2 * K * S) + 4 * N * H * B * S * (S + 1) // 2


def _fake(spec):
    """A worker without frameworks: eager 2 ms, jit 1 ms a call (both passes), 6 rounds; read rate 10 GB/s."""
    ms = {"ours-torch:eager": 2e-3, "ours-jax:jit": 1e-3}
    rows = [{"impl": k, "framework": k.split("-")[1].split(":")[0], "form": k.split(":")[1], "pass": p, "status": "ok",
             "message": None, "cache_bytes": 1000, "compile_s": None, "out_max_diff": 1e-7,
             "rounds": [[t * (1 + 0.01 * i) for i in range(4)] for _ in range(6)]}
            for p in ("prefill", "step") for k, t in ms.items()]
    return {"rows": rows, "probes": {"prefill": [], "step": []}, "threads": 2, "read_bytes_per_s": 1e10}


def test_the_command_reports_each_pair_and_the_bandwidth_fraction(tmp_path):
    out, console = tmp_path / "d.json", Console(file=io.StringIO(), width=250)
    args = cli.run_parser().parse_args(["--decode", str(S), "--batch", str(B), "--embed", str(E), "--heads", str(N),
                                        "--kv-heads", str(K), "--rope", "half", "--bias", "none",
                                        "--impls", "ours-torch:eager,ours-jax:jit", "--json", str(out)])
    assert cli.run_decode(args, console, spawn_worker=_fake) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "mha-bench-decode/1"
    spec = decode.DecodeBench.from_json(report["spec"])
    step = {r["impl"]: r for r in report["rows"] if r["pass"] == "step"}
    median = step["ours-jax:jit"]["median_s"]
    assert step["ours-jax:jit"]["bandwidth_fraction"] == pytest.approx(decode.step_reads(spec) / median / 1e10)
    assert step["ours-jax:jit"]["tokens_per_s"] == pytest.approx(B / median)
    assert step["ours-jax:jit"]["ms_per_token"] == pytest.approx(1e3 * median)
    pairs = [(v["pass"], v["faster"], v["slower"]) for v in report["verdicts"]]
    assert sorted(pairs) == [("prefill", "ours-jax:jit", "ours-torch:eager"), ("step", "ours-jax:jit", "ours-torch:eager")]
    assert all(v["conclusive"] and v["ratio"] == pytest.approx(2.0) for v in report["verdicts"])  # 2 processes
    assert "% read bandwidth" in console.file.getvalue()


@pytest.mark.parametrize("argv, words", [
    (["--seq", "8"], "--seq cannot be given with it"),
    (["--batch", "1,4"], "--batch takes one value"),
    (["--impls", "nothing-here"], "names none of the decode implementations"),
    (["--impl", "parity.examples.jax_port:port"], "no decoder"),
])
def test_what_decode_cannot_take_is_a_usage_error(argv, words):
    console = Console(file=io.StringIO(), width=250)
    assert cli.main(["--decode", "8", "--embed", "12", "--heads", "3", *argv], console=console) == 2
    assert words in " ".join(console.file.getvalue().split())
