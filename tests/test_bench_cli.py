"""mha-bench end to end: a tiny real sweep in worker subprocesses, and absent devices."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from parity.bench import cli, runner
from parity.bench.spec import ROW_FIELDS

TINY = [
    "--seq", "16,32", "--batch", "1", "--embed", "32", "--heads", "2", "--budget", "0.02",
    "--peak-sizes", "256", "--no-progress",
]


def _console():
    return Console(file=io.StringIO(), width=200)


@pytest.mark.slow
def test_tiny_real_sweep_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "b.json"
    console = _console()
    rc = cli.main(
        [*TINY, "--impls", "ours-torch:eager:fused,torch-sdpa-core,ours-jax:jit:fused,jax-dpa-core",
         "--passes", "fwd,fwd+bwd", "--threads", "1", "--isolation", "framework",
         "--json", str(out), "--markdown", str(tmp_path / "b.md"), "--plot", str(tmp_path / "b.png")],
        console=console,
    )
    assert rc == 0, console.file.getvalue()
    data = json.loads(out.read_text())
    env = data["environment"]
    for key in ("python", "versions", "cpu_model", "threads", "precision_settings", "XLA_FLAGS", "inductor_env", "peaks"):
        assert key in env
    assert env["threads"] == {"torch": 1, "jax": 1}
    assert env["precision_settings"]["jax"]["jax_default_matmul_precision"] == "highest"
    rows = data["rows"]
    assert len(rows) == 2 * 4 * 2
    # Peak exceedance on these tiny shapes would be an error row too; anything but
    # "ok"/"error: exceeds" means the pipeline broke.
    broken = [r for r in rows if r["status"] != "ok" and "exceeds the measured" not in (r["message"] or "")]
    assert not broken, broken
    for r in rows:
        assert list(r) == list(ROW_FIELDS)
        assert r["mem_source"] and r["median_s"] > 0
        if r["framework"] == "jax":
            assert r["compile_s"] is not None and r["recompile_s"] is not None
    assert (tmp_path / "b.png").stat().st_size > 0
    assert "measured matmul peak" in (tmp_path / "b.md").read_text()


def test_absent_gpu_is_a_clean_skip(tmp_path):
    device, absent = runner.resolve_device("gpu")
    if absent is None:
        pytest.skip("a GPU is present: nothing to skip")
    out = tmp_path / "gpu.json"
    console = _console()
    rc = cli.main([*TINY, "--device", "gpu", "--passes", "fwd", "--json", str(out)], console=console)
    assert rc == 0
    assert "not present" in console.file.getvalue()
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["status"] == "skip" and "no GPU found" in r["message"] for r in rows)


def test_torch_without_cuda_reports_why():
    torch = pytest.importorskip("torch")
    from parity.bench import impl_torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert "no CUDA device" in impl_torch.check_device("cuda")
    assert impl_torch.check_device("cpu") is None


def test_auto_device_falls_back_to_cpu_without_accelerators():
    device, absent = runner.resolve_device("auto")
    assert absent is None
    found = runner.detect_devices()
    if found["gpu"] and found["tpu"]:
        assert device == "cpu"


def test_list_plans_without_running():
    console = _console()
    assert cli.main([*TINY, "--preset", "long", "--list"], console=console) == 0
    text = console.file.getvalue()
    assert "ours-jax:jit:fused" in text
