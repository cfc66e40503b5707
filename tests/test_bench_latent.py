"""`mha-bench latent`: MLA's passes and its decode step from the latent cache (naive, absorbed) against a cache
of expanded keys and values -- each implementation held to the float64 oracle before it is timed, the bytes each
cache holds from the layer's definition, verdicts for every pair of a pass."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from mha_spec import LatentAttentionConfig
from parity.bench import latent
from parity.bench.cli import main as bench_main

LAYER = LatentAttentionConfig(24, 3, kv_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=7,
                              q_lora_rank=9)  # E=24 N=3 C=5 Dn=4 Dr=6 Dv=7 Q=9: every size distinct
B, T, S = 2, 5, 9


def _spec(**kw):
    return latent.LatentBench(LAYER, batch=B, seq=T, decode=S, processes=1, budget_s=0.01, **kw)


def test_every_implementation_is_the_oracles_and_each_cache_holds_what_the_definition_says():
    result = latent.work(_spec(passes=("decode", "fwd+bwd"), frameworks=("torch", "jax")))
    rows = {(r["pass"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {("decode", k) for k in ("ours-torch:latent", "ours-torch:absorbed", "ours-torch:kv",
                                                 "ours-jax:latent", "ours-jax:absorbed")} | {
        ("fwd+bwd", f"ours-{fw}:{form}") for fw in ("torch", "jax") for form in ("eager", "fused")}
    assert all(r["status"] == "ok" and r["rounds"] for r in rows.values()), [r["message"] for r in rows.values()]
    latent_bytes = B * (S + 1) * (5 + 6) * 4  # per token c (C) and the shared rotated k_pe (Dr), float32
    kv_bytes = B * 3 * (S + 1) * ((4 + 6) + 7) * 4  # per token and head a key (Dn + Dr) and a value (Dv)
    assert {k: r["cache_bytes"] for (p, k), r in rows.items() if p == "decode"} == {
        "ours-torch:latent": latent_bytes, "ours-torch:absorbed": latent_bytes, "ours-torch:kv": kv_bytes,
        "ours-jax:latent": latent_bytes, "ours-jax:absorbed": latent_bytes}


def test_an_implementation_that_computes_something_else_is_an_error_row_and_not_timed(monkeypatch):
    from parity.bench import latent_torch

    real = latent_torch.module

    def half_rope(cfg, weights, dtype):  # the interleaved layer read as rotate-half (Dr = 6: three pairs differ)
        import dataclasses
        return real(dataclasses.replace(cfg, rope="half"), weights, dtype)

    monkeypatch.setattr(latent_torch, "module", half_rope)
    result = latent.work(_spec(passes=("decode",), frameworks=("torch",)))
    assert [r["status"] for r in result["rows"]] == ["error"] * 3
    assert all("not the oracle's result" in r["message"] and not r["rounds"] for r in result["rows"])


def _fake(spec):
    """A worker's result without frameworks: torch's latent step 2 ms, absorbed 1 ms, kv 3 ms, six rounds."""
    ms = {"ours-torch:latent": 2e-3, "ours-torch:absorbed": 1e-3, "ours-torch:kv": 3e-3}
    rows = [{"impl": k, "framework": "torch", "form": k.split(":")[1], "pass": "decode", "status": "ok",
             "message": None, "cache_bytes": 100 if k != "ours-torch:kv" else 700, "compile_s": None,
             "out_max_diff": 1e-7, "rounds": [[t * (1 + 0.01 * i) for i in range(4)] for _ in range(6)]}
            for k, t in ms.items()]
    return {"rows": rows, "probes": {"decode": []}, "threads": 2}


def test_the_report_has_every_pair_of_a_pass_and_the_cache_per_token(tmp_path):
    out, console = tmp_path / "r.json", Console(file=io.StringIO(), width=200)
    argv = ["--batch", "2", "--decode", "9", "--embed", "24", "--heads", "3", "--kv-lora-rank", "5",
            "--qk-nope-head-dim", "4", "--qk-rope-head-dim", "6", "--v-head-dim", "7", "--q-lora-rank", "9",
            "--passes", "decode", "--frameworks", "torch", "--json", str(out)]
    code = latent.main(argv, console=console, spawn_worker=_fake)
    report = json.loads(out.read_text())
    assert code == 0 and report["schema"] == "mha-bench-latent/1"
    rows = {r["impl"]: r for r in report["rows"]}
    assert rows["ours-torch:kv"]["cache_bytes_per_token"] == 700 / (2 * 10)
    assert rows["ours-torch:absorbed"]["tokens_per_s"] == pytest.approx(2 / 1.015e-3, rel=0.02)
    pairs = {frozenset((v["faster"], v["slower"])) for v in report["verdicts"]}
    assert len(pairs) == 3 and len(report["verdicts"]) == 3
    v = next(v for v in report["verdicts"] if {v["faster"], v["slower"]} == {"ours-torch:absorbed", "ours-torch:kv"})
    assert v["faster"] == "ours-torch:absorbed" and v["ratio"] == pytest.approx(3.0, rel=1e-6) and v["conclusive"]


@pytest.mark.parametrize("argv, words", [(["--q-lora-rank", "x"], "--q-lora-rank 'x'"),
                                         (["--qk-rope-head-dim", "3"], "qk_rope_head_dim must be even")])
def test_a_layer_that_cannot_be_is_a_usage_error(argv, words):
    console = Console(file=io.StringIO(), width=200)
    assert bench_main(["latent", *argv], console=console) == 2
    assert words in console.file.getvalue()
