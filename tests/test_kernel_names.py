"""The kernel names have one home: `mha_jax.kernels` (EINSUM, CHUNKED, DPA_XLA, DPA_CUDNN and
`kernel_label`) for JAX, `parity.kernel_ran` (SDPA, BMM_SOFTMAX; `parity.bench.torch_bench.kernel_label`) for torch. No other library
module spells a kernel name, the label reads back, and the benchmark's `kernel` field of our JAX
module names the kernel the module's dispatch actually runs."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mha_jax.attention as attention
from mha_jax import MultiHeadAttention, kernels
from mha_jax.kernels import CHUNKED, DPA_CUDNN, DPA_XLA, EINSUM, Choice, kernel_label, parse_label

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("mha_spec", "mha_torch", "mha_jax", "parity")
JAX_NAMES = (EINSUM, CHUNKED, DPA_XLA, DPA_CUDNN)
TORCH_NAMES = ("sdpa", "bmm-softmax")
HOMES = {"mha_jax/kernels.py": JAX_NAMES, "parity/kernel_ran.py": TORCH_NAMES}


def _spelled(path: Path, names) -> list[tuple[int, str]]:
    """(line, text) of every string literal (docstrings aside) that is a kernel name, or starts with
    one followed by ':' or ' ' (an f-string's "chunked:{q}x{k}" part, "einsum (weights)")."""
    pattern = re.compile(rf"^({'|'.join(map(re.escape, names))})([: ]|$)")
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted((n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings and pattern.match(n.value))


def test_no_library_module_but_the_names_home_spells_a_kernel_name():
    found = {}
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            names = tuple(n for n in JAX_NAMES + TORCH_NAMES if n not in HOMES.get(rel, ()))
            if hits := _spelled(path, names):
                found[rel] = hits
    assert not found, f"kernel names spelled outside their home (use mha_jax.kernels' constants): {found}"


def test_the_scan_sees_a_spelling_it_must_refuse(tmp_path):
    """The scan itself can fail: an f-string's chunked label and a plain name are found, a docstring is not."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""einsum in prose."""\nq = 4\nx = f"chunked:{q}x{q}"\ny = "dpa-xla"\nz = "einsumish"\n')
    assert _spelled(planted, JAX_NAMES) == [(3, "chunked:"), (4, "dpa-xla")]


def test_kernels_are_built_from_the_constants():
    assert kernels.KERNELS == (EINSUM, CHUNKED, DPA_XLA, DPA_CUDNN) == ("einsum", "chunked", "dpa-xla", "dpa-cudnn")
    assert set(kernels.DPA_IMPLEMENTATIONS) == {DPA_XLA, DPA_CUDNN}


@pytest.mark.parametrize("choice, label", [
    (Choice(EINSUM), "einsum"), (Choice(DPA_XLA), "dpa-xla"), (Choice(DPA_CUDNN), "dpa-cudnn"),
    (Choice(CHUNKED, 256, 512), "chunked:256x512"), (Choice(CHUNKED, 1, 8192), "chunked:1x8192"),
    (Choice(CHUNKED, 2048, 512, head_chunk=1), "chunked:2048x512/h1"),
    (Choice(CHUNKED, 8, 16, head_chunk=12), "chunked:8x16/h12"),
])
def test_a_label_reads_back_as_its_choice(choice, label):
    assert kernel_label(choice) == label
    assert parse_label(label) == choice


def test_the_source_is_appended_for_a_benchmark_row():
    assert kernel_label(Choice(CHUNKED, 256, 512, why="...", source="built-in"), source=True) == "chunked:256x512 (built-in)"
    assert kernel_label(Choice(EINSUM, source=kernels.WEIGHTS), source=True) == "einsum (weights)"
    assert kernel_label(Choice(CHUNKED, 8, 8, source="rule")) == "chunked:8x8"  # without source=True: the label alone
    assert kernel_label(Choice(DPA_XLA), source=True) == "dpa-xla"  # no source: nothing appended


@pytest.mark.parametrize("text", ["chunked", "chunked:", "chunked:8", "chunked:8x", "chunked:0x8", "chunked:08x8",
                                  "chunked:-8x8", "chunked:\u0663x8", "chunked 8x8", "einsum:8x8", "flash", "", None, 8,
                                  "chunked:8x8/", "chunked:8x8/h", "chunked:8x8/h0", "chunked:8x8/h01", "chunked:8x8/2",
                                  "chunked:8x8/hh2", "chunked:8x8/h2/h2", "chunked/h2", "einsum/h2", "chunked:8/h2x8"])
def test_what_is_not_a_label_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match="is not a kernel label"):
        parse_label(text)


def test_a_label_needs_a_known_kernel_and_the_chunked_blocks():
    with pytest.raises(ValueError, match="'flash' is not one of"):
        kernel_label(Choice("flash"))
    with pytest.raises(ValueError, match="needs its blocks"):
        kernel_label(Choice(CHUNKED))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"head_chunk must be a positive integer or None, got {bad!r}"):
            kernel_label(Choice(CHUNKED, 8, 8, head_chunk=bad))


def test_committed_tune_runs_reload_and_summarise_to_their_tables_and_the_built_in_rows():
    """Saved runs whose rows say "fwdbwd" (the earlier pass spelling) and "chunked:QxK" load, and
    give back the table they were saved with, and each processor's runs give its built-in rows."""
    from mha_jax import tune

    results = ROOT / "docs" / "results"
    # The Xeon's rows combine two runs of batch 1 and 4 and two of grouped layers (keyed B·K, G·T, S).
    xeon = (("kernel-table-xeon-avx512.json", "kernel-table-xeon-avx512-run2.json"),
            ("kernel-table-xeon-avx512-gqa.json", "kernel-table-xeon-avx512-gqa-run2.json"))
    epyc = (("kernel-table-epyc-avx512.json",), ("kernel-table-epyc-avx512-gqa.json",))
    for groups, proc in (((("kernel-table-epyc-avx2.json",),), kernels.EPYC_AVX2), (xeon, kernels.XEON), (epyc, kernels.EPYC)):
        tables = []
        for names in groups:
            for name in names:
                saved = json.loads((results / name).read_text())
                assert {r["pass_"] for r in saved["rows"]} in ({"fwd", "fwdbwd"}, {"fwd", "fwd+bwd"})
                assert tune.summarise([tune.load_run(results / name)]) == saved["table"]
            tables += tune.summarise([tune.load_run(results / name) for name in names])
        assert sorted((t["BN"], t["T"], t["S"], t["fastest"], tuple(t["blocks"]), t.get("head_chunk") or 0)
                      for t in tables) == sorted(
            (m.BN, m.T, m.S, m.fastest, m.blocks, m.head_chunk or 0) for m in kernels.BUILTIN[proc.key])


# ---------------------------------------------------------------- the bench's kernel field vs the dispatch


@pytest.fixture
def table_here(tmp_path, monkeypatch):
    """A user table for this processor: B·N=2 at T = S = 8 einsum, 16 dpa-xla, 32 chunked with 8x16 blocks."""
    monkeypatch.setenv("MHA_PARITY_CACHE_DIR", str(tmp_path))
    proc = kernels.processor()
    rows = [dict(BN=2, T=8, S=8, fastest=EINSUM, blocks=None), dict(BN=2, T=16, S=16, fastest=DPA_XLA, blocks=None),
            dict(BN=2, T=32, S=32, fastest=CHUNKED, blocks=[8, 16])]
    (tmp_path / "kernels.json").write_text(json.dumps({"schema": kernels.TABLE_SCHEMA, "processors": {
        proc.key: {"device_kind": proc.device_kind, "model": proc.model, "isa": proc.isa, "rows": rows}}}))


@pytest.fixture
def dispatched(monkeypatch):
    """The kernels `mha_jax.attention` ran, each as a Choice (the chunked one with the blocks it was given)."""
    ran = []
    core, chunked, dpa = attention.attention_core, attention.chunked_attention, jax.nn.dot_product_attention

    def spy_core(*a, **kw):
        ran.append(Choice(EINSUM))
        return core(*a, **kw)

    def spy_chunked(*a, **kw):
        ran.append(Choice(CHUNKED, kw["q_chunk"], kw["k_chunk"]))
        return chunked(*a, **kw)

    def spy_dpa(*a, implementation=None, **kw):
        ran.append(Choice(next(k for k, v in kernels.DPA_IMPLEMENTATIONS.items() if v == implementation)))
        return dpa(*a, implementation=implementation, **kw)

    monkeypatch.setattr(attention, "attention_core", spy_core)
    monkeypatch.setattr(attention, "chunked_attention", spy_chunked)
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy_dpa)
    return ran


def _ours_jax(weights: bool):
    from parity.bench.spec import IMPLS

    (impl,) = [i for i in IMPLS if i.family == "ours-jax" and i.mode == "jit" and i.returns_weights == weights]
    return impl


@pytest.mark.parametrize("T, weights, expected", [
    (8, False, "einsum (user table)"), (16, False, "dpa-xla (user table)"), (32, False, "chunked:8x16 (user table)"),
    (16, True, "einsum (weights)"),
])
def test_the_bench_kernel_field_is_what_the_module_dispatches_to(T, weights, expected, table_here, dispatched):
    from parity.bench.jax_bench import kernel_of
    from parity.bench.spec import BenchCase

    B, E, N = 1, 12, 2
    case = BenchCase.of(B, T, T, E, N, "float32", mask="causal")
    label = kernel_of(_ours_jax(weights), case, jax.devices("cpu")[0])
    layer = MultiHeadAttention(E, N, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, E)), jnp.float32)
    layer(x, x, x, mask=np.tril(np.ones((T, T), bool)), need_weights=weights)
    assert dispatched == [parse_label(label.split(" (")[0])]  # the one kernel that ran, with its blocks
    assert label == expected


def test_a_jax_peer_on_dot_product_attention_is_labelled_by_the_kernel_name():
    from parity.bench.jax_bench import PEER_KERNELS, kernel_of
    from parity.bench.spec import IMPLS, BenchCase

    case = BenchCase.of(1, 8, 8, 12, 2, "float32")
    by_name = {i.name: i for i in IMPLS}
    assert kernel_of(by_name["jax-dpa-core"], case, jax.devices("cpu")[0]) == DPA_XLA
    assert set(PEER_KERNELS.values()) <= set(kernels.KERNELS)


def test_torch_labels_come_from_one_function():
    from parity.bench.torch_bench import kernel_label as torch_label
    from parity.impls import BUILTIN, Implementation

    by_name = {i.name: i for i in BUILTIN}
    assert [torch_label(by_name[n]) for n in ("torch-fused", "torch", "torch-mha-fused", "torch-mha", "torch-sdpa-core")] == [
        "sdpa", "bmm-softmax (weights)", "sdpa", "bmm-softmax (weights)", "sdpa"]
    assert torch_label(by_name["hf-bert"]) == "hf-bert"  # eager attention in transformers, not SDPA
    mine = Implementation("my-layer", "torch", lambda *a, **kw: None, family="ours-torch")
    assert torch_label(mine) == "my-layer"  # a user's layer: its name, whatever its family
