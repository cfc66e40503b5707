"""The fused path's kernel table: processor identification, the order of the sources
(user table, built-in rows for this processor, other processors of the same device kind),
the user table's schema, a corrupt table (ignored with a warning), and `mha_jax.tune`."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax.attention as attention_module
import mha_jax.chunked as chunked_attention_module
import mha_jax.kernels as kernels
from mha_jax import attention_core, fused_attention_core, tune
from mha_jax.kernels import Measured, Processor
from mha_spec import allocator

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 sse4_2 avx avx2 fma avx512f avx512bw
"""
ARM = """processor\t: 0
Features\t: fp asimd evtstrm aes crc32
CPU implementer\t: 0x41
"""


def test_cpuinfo_gives_model_and_widest_vector_isa():
    assert kernels.parse_cpuinfo(X86) == ("Intel(R) Xeon(R) Processor", "avx512f")
    assert kernels.parse_cpuinfo(X86.replace(" avx512f avx512bw", "")) == ("Intel(R) Xeon(R) Processor", "avx2")
    assert kernels.parse_cpuinfo(ARM, fallback_model="aarch64") == ("aarch64", "asimd")
    assert kernels.parse_cpuinfo("", fallback_model="x86_64") == ("x86_64", "")


HERE = Processor("cpu", "Test CPU 9000", "avx2")
SIBLING = Processor("cpu", "Other CPU", "avx512f")
ROW = dict(BN=32, T=512, S=512, fastest="chunked")


def _choose(sources, **kw):
    args = dict(platform="cpu", dtype=jnp.float32, B=4, N=8, T=512, S=512, H=64, has_mask=False, materialize_limit=2**26)
    return kernels.choose(sources=sources, **{**args, **kw})


@pytest.fixture
def builtin(monkeypatch):
    """Built-in rows for HERE (blocks 16x16) and SIBLING (blocks 32x32) only."""
    table = {HERE.key: (Measured(**ROW, blocks=(16, 16)),), SIBLING.key: (Measured(**ROW, blocks=(32, 32)),)}
    monkeypatch.setattr(kernels, "BUILTIN", table)
    return table


def test_sources_in_order_user_then_builtin_then_same_device_kind(builtin):
    user = {HERE: (Measured(**ROW, blocks=(8, 8)),), SIBLING: (Measured(**ROW, blocks=(64, 64)),)}
    c = _choose(kernels.sources_for(HERE, user, "/x/kernels.json"))
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 8, 8)
    assert c.why.startswith("user table /x/kernels.json for Test CPU 9000") and c.source == "user table"
    c = _choose(kernels.sources_for(HERE, {SIBLING: user[SIBLING]}))  # another processor's user rows do not win
    assert (c.q_chunk, c.k_chunk) == (16, 16) and c.why.startswith("built-in rows for Test CPU 9000") and c.source == "built-in"
    stranger = Processor("cpu", "Unknown CPU", "avx2")
    c = _choose(kernels.sources_for(stranger, {}))
    assert c.kernel == "chunked" and "no rows for Unknown CPU" in c.why and c.source == "other cpu"
    assert (c.q_chunk, c.k_chunk) in ((16, 16), (32, 32))
    c = _choose(kernels.sources_for(stranger, {SIBLING: (Measured(BN=32, T=600, S=600, fastest="chunked", blocks=(64, 64)),)}))
    assert (c.q_chunk, c.k_chunk) == (16, 16)  # the nearest row among the same kind's, wherever it comes from
    c = _choose(kernels.sources_for(Processor("TPU v9", "TPU v9"), user))
    assert c.kernel == "einsum" and c.why == "no measured rows for this device kind" and c.source == "no rows"


def test_the_nearest_measured_row_chooses():
    rows = (
        Measured(BN=32, T=256, S=256, fastest="einsum", blocks=None),
        Measured(BN=32, T=2048, S=2048, fastest="chunked", blocks=(256, 2048)),
        Measured(BN=8, T=8192, S=8192, fastest="chunked", blocks=(512, 1024)),
    )
    src = (kernels.Source("fake", rows),)
    assert _choose(src, T=200, S=200).kernel == "einsum"
    c = _choose(src, T=2048, S=2048)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 256, 2048)
    c = _choose(src, B=1, T=32768, S=32768)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 512, 1024)
    assert "nearest measured B·N=8 T=8192" in c.why


def test_rules_that_no_measurement_overrules():
    src = (kernels.Source("fake", (Measured(BN=32, T=512, S=512, fastest="dpa-xla", blocks=(64, 128)),)),)
    assert _choose(src).kernel == "dpa-xla"
    assert _choose(src, dtype=jnp.bfloat16).kernel == "dpa-xla"
    assert _choose(src, dtype=jnp.float64).kernel == "einsum"  # float32 softmax: never for float64
    assert _choose(src, dtype=jnp.float16).kernel == "einsum"  # XLA:CPU rejects its float16 backward
    over = _choose(src, T=4096, S=4096, materialize_limit=2**20)
    assert (over.kernel, over.q_chunk, over.k_chunk) == ("chunked", 64, 128)  # the memory guard, blocks from the row
    assert _choose(src, T=0).kernel == "chunked"


def test_a_cuda_gpu_takes_cudnn_only_within_its_limits():
    def gpu(**kw):
        return _choose((), platform="gpu", **kw).kernel

    assert gpu(dtype=jnp.bfloat16) == "dpa-cudnn"
    assert gpu(dtype=jnp.float16, has_mask=True, T=512, S=256) == "dpa-cudnn"
    # Where cuDNN refuses, the Pallas rule (TestPallasRule) decides; with no rows for this kind
    # an accelerator falls back to chunked, never to the einsum.
    assert gpu(dtype=jnp.float32) == "pallas-gpu-flash"
    assert gpu(dtype=jnp.float64) == "chunked"
    assert gpu(dtype=jnp.bfloat16, H=12) == "chunked"  # head dim not a multiple of 8, and below Triton's 16
    assert gpu(dtype=jnp.bfloat16, H=256) == "pallas-gpu-flash"  # above cuDNN's 128
    assert gpu(dtype=jnp.bfloat16, has_mask=True, T=511) == "chunked"  # odd T with a (dense) mask
    big = _choose((), platform="gpu", dtype=jnp.float32, T=65536, S=65536)
    assert big.kernel == "pallas-gpu-flash"


def _table(proc: Processor, rows) -> dict:
    return {"schema": kernels.TABLE_SCHEMA, "processors": {proc.key: {
        "device_kind": proc.device_kind, "model": proc.model, "isa": proc.isa, "rows": rows}}}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA_PARITY_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_fused_choice_reads_the_user_table_in_the_cache_dir(cache_dir):
    assert not kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False).why.startswith("user table")
    path = cache_dir / "kernels.json"
    path.write_text(json.dumps(_table(kernels.processor(), [dict(BN=32, T=64, S=64, fastest="chunked", blocks=[24, 40])])))
    c = kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 24, 40)
    assert c.why.startswith(f"user table {path}")


GOOD_ROW = dict(BN=2, T=8, S=8, fastest="chunked", blocks=[4, 4])
CORRUPT = {
    "not JSON": "{not json",
    "a list": "[]",
    "another schema": json.dumps({**_table(HERE, [GOOD_ROW]), "schema": 99}),
    "no rows": json.dumps(_table(HERE, [])),
    "a zero block": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [0, 4]}])),
    "an unknown kernel": json.dumps(_table(HERE, [{**GOOD_ROW, "fastest": "magic"}])),
    "a float size": json.dumps(_table(HERE, [{**GOOD_ROW, "T": 8.5}])),
    "a key that does not match its fields": json.dumps(_table(HERE, [GOOD_ROW])).replace("Test CPU 9000 |", "Test CPU 1 |"),
    # Every number the parser accepts is bounded (sizes to [1, 2**31 - 1], blocks to [1, 8192]);
    # json reads 10**400 as an int and NaN/Infinity as floats.
    "a size of 10**400": json.dumps(_table(HERE, [{**GOOD_ROW, "BN": 10**400}])),
    "a block of 10**400": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [4, 10**400]}])),
    "a size above int32": json.dumps(_table(HERE, [{**GOOD_ROW, "S": 2**31}])),
    "a NaN size": json.dumps(_table(HERE, [{**GOOD_ROW, "T": math.nan}])),
    "an infinite size": json.dumps(_table(HERE, [{**GOOD_ROW, "S": math.inf}])),
    "a NaN block": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [math.nan, 4]}])),
    "an infinite block": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [4, -math.inf]}])),
    "a negative size": json.dumps(_table(HERE, [{**GOOD_ROW, "BN": -2}])),
    "a zero size": json.dumps(_table(HERE, [{**GOOD_ROW, "T": 0}])),
    "a negative block": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [-4, 4]}])),
    "a block larger than allowed": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [4, kernels.MAX_BLOCK + 1]}])),
    "a boolean size": json.dumps(_table(HERE, [{**GOOD_ROW, "T": True}])),
    "a float block": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": [4.0, 4]}])),
    "a zero head chunk": json.dumps(_table(HERE, [{**GOOD_ROW, "head_chunk": 0}])),
    "a float head chunk": json.dumps(_table(HERE, [{**GOOD_ROW, "head_chunk": 2.0}])),
    "a boolean head chunk": json.dumps(_table(HERE, [{**GOOD_ROW, "head_chunk": True}])),
    "a head chunk without blocks": json.dumps(_table(HERE, [{**GOOD_ROW, "blocks": None, "head_chunk": 2}])),
    "schema true": json.dumps({**_table(HERE, [GOOD_ROW]), "schema": True}),
    "schema 1.0": json.dumps({**_table(HERE, [GOOD_ROW]), "schema": 1.0}),
}


@pytest.mark.parametrize("what", CORRUPT)
def test_a_corrupt_table_is_ignored_with_a_warning(what, tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text(CORRUPT[what])
    with pytest.warns(UserWarning, match=f"kernel table {path} is ignored"):
        assert kernels.load_user_table(path) == {}


@pytest.mark.parametrize("row", [dict(BN=10**400), dict(T=math.nan), dict(S=math.inf), dict(BN=-32), dict(T=0),
                                 dict(blocks=[4, kernels.MAX_BLOCK + 1])],
                         ids=["BN 10**400", "T NaN", "S inf", "BN negative", "T zero", "block above MAX_BLOCK"])
def test_an_out_of_range_number_leaves_the_built_in_rows_and_the_fused_call_working(row, cache_dir, monkeypatch):
    proc = kernels.processor()
    monkeypatch.setattr(kernels, "BUILTIN", {proc.key: (Measured(BN=9, T=5, S=7, fastest="einsum", blocks=None),)})
    path = cache_dir / "kernels.json"
    path.write_text(json.dumps(_table(proc, [{**GOOD_ROW, **row}])))
    with pytest.warns(UserWarning, match=f"kernel table {path} is ignored"):
        c = kernels.fused_choice(3, 3, 5, 7, 4, jnp.float32, has_mask=False)
    assert (c.kernel, c.source) == ("einsum", "built-in")
    if "BN" in row:  # one real call (one compile) is enough to show the fused path runs on
        q, k = (jnp.ones((3, L, 3, 4), jnp.float32) for L in (5, 7))  # (B, T|S, N, H)
        with pytest.warns(UserWarning, match="is ignored"):
            out = fused_attention_core(q, k, k)
        assert out.shape == (3, 5, 3, 4) and bool(jnp.allclose(out, 1.0))  # softmax-weighted mean of ones


def test_the_largest_allowed_numbers_read_back(tmp_path):
    path = tmp_path / "kernels.json"
    big = dict(BN=kernels.MAX_SIZE, T=kernels.MAX_SIZE, S=1, fastest="chunked", blocks=[kernels.MAX_BLOCK, 1])
    path.write_text(json.dumps(_table(HERE, [big])))
    (row,) = kernels.load_user_table(path)[HERE]
    assert row.blocks == (8192, 1) and kernels.MAX_SIZE == 2**31 - 1
    c = _choose((kernels.Source("fake", (row,)),), T=4096, S=4096)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 8192, 1)


def test_a_good_table_reads_back_without_warning(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(_table(HERE, [GOOD_ROW, {**GOOD_ROW, "T": 16, "fastest": "einsum", "blocks": None},
                                             {**GOOD_ROW, "T": 32, "head_chunk": 3}, {**GOOD_ROW, "T": 64, "head_chunk": None}])))
    assert kernels.load_user_table(path) == {HERE: (Measured(2, 8, 8, "chunked", (4, 4)), Measured(2, 16, 8, "einsum", None),
                                                    Measured(2, 32, 8, "chunked", (4, 4), head_chunk=3),
                                                    Measured(2, 64, 8, "chunked", (4, 4)))}
    assert kernels.load_user_table(tmp_path / "absent.json") == {}


class TestHeadChunk:
    """A row's head chunk (how many of the kernel's B·K head blocks run a step) travels with its blocks:
    from the nearest row that timed the chunked kernel into the choice, the module's call, and tune's rows."""

    def test_the_choice_takes_the_head_chunk_of_the_row_its_blocks_come_from(self):
        rows = (Measured(BN=32, T=512, S=512, fastest="einsum", blocks=None),  # nearest, but no chunked timing
                Measured(BN=32, T=2048, S=2048, fastest="chunked", blocks=(2048, 512), head_chunk=1),
                Measured(BN=8, T=8192, S=8192, fastest="chunked", blocks=(512, 1024)))
        src = (kernels.Source("fake", rows),)
        c = _choose(src, B=4, N=8, T=4096, S=4096)  # above the memory guard: chunked, the blocks of the T=2048 row
        assert (c.kernel, c.q_chunk, c.k_chunk, c.head_chunk) == ("chunked", 2048, 512, 1)
        c = _choose(src, B=1, N=8, T=8192, S=8192)
        assert (c.kernel, c.q_chunk, c.k_chunk, c.head_chunk) == ("chunked", 512, 1024, None)
        einsum = _choose(src, B=4, N=8, T=512, S=512)
        assert (einsum.kernel, einsum.q_chunk, einsum.head_chunk) == ("einsum", None, None)

    def test_the_module_runs_the_chosen_head_chunk(self, cache_dir, monkeypatch):
        path = cache_dir / "kernels.json"
        path.write_text(json.dumps(_table(kernels.processor(), [dict(BN=4, T=5, S=7, fastest="chunked", blocks=[2, 3],
                                                                     head_chunk=2)])))
        seen = []
        real = chunked_attention_module.chunked_attention
        monkeypatch.setattr(attention_module, "chunked_attention",
                            lambda *a, **kw: seen.append(kw["head_chunk"]) or real(*a, **kw))
        rng = np.random.default_rng(0)
        q, k = (jnp.asarray(rng.standard_normal((2, L, 2, 4))) for L in (5, 7))  # B·N = 4 head blocks
        out = fused_attention_core(q, k, k)
        want = attention_core(q, k, k)[0]
        assert seen == [2] and bool(jnp.allclose(out, want, rtol=1e-12, atol=1e-12))
        assert kernels.kernel_label(kernels.fused_choice(2, 2, 5, 7, 4, jnp.float64, has_mask=False)) == "chunked:2x3/h2"

    def test_tune_names_its_candidates_as_they_run_and_keeps_the_fastest_head_chunk(self):
        names = list(tune.candidates(2, 4, 8, 4, [(4, 4, None), (4, 4, 2), (4, 4, 3), (4, 4, 8), (16, 4, 1)]))
        # 3 runs as 2 (a divisor of the 4 heads); 8 is all of B·K = 8 (one step, as no chunk); 16 rows clip to T = 8
        assert [n for n in names if n.startswith("chunked")] == ["chunked:4x4", "chunked:4x4/h2", "chunked:8x4/h1"]
        rows = [dict(B=2, N=4, T=8, S=8, pass_=p, candidate=c, min_s=t)
                for p in ("fwd", "fwd+bwd") for c, t in (("chunked:4x4", 2.0), ("chunked:4x4/h2", 1.0), ("einsum", 3.0))]
        (t,) = tune.summarise([rows])
        assert (t["fastest"], t["blocks"], t["head_chunk"]) == ("chunked", [4, 4], 2)
        assert tune.row_text(t["fastest"], t["blocks"], t["head_chunk"]) == "chunked:4x4/h2"
        (t,) = tune.summarise([[{**r, "min_s": 1 / r["min_s"]} for r in rows]])  # now all heads at once wins
        assert "head_chunk" not in t and t["blocks"] == [4, 4]


def test_a_corrupt_or_unreadable_table_never_stops_a_fused_call(cache_dir):
    (cache_dir / "kernels.json").write_text("{truncated")
    with pytest.warns(UserWarning, match="is ignored"):
        c = kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False)
    assert c.kernel in kernels.KERNELS and not c.why.startswith("user table")
    (cache_dir / "kernels.json").unlink()
    (cache_dir / "kernels.json").mkdir()  # a directory where the file should be
    with pytest.warns(UserWarning, match="cannot read"):
        assert kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False).kernel in kernels.KERNELS


def test_summarise_scores_by_geometric_mean_over_runs_and_passes():
    def rows(times):
        return [dict(B=1, N=2, T=8, S=8, pass_=p, candidate=c, min_s=t) for (c, p), t in times.items()]

    run1 = rows({("einsum", "fwd"): 1.0, ("chunked:4x4", "fwd"): 2.0, ("einsum", "fwd+bwd"): 4.0, ("chunked:4x4", "fwd+bwd"): 2.0,
                 ("chunked:8x8", "fwd"): 1.5})  # 8x8 measured in one of the two runs only: left out
    run2 = rows({("einsum", "fwd"): 3.0, ("chunked:4x4", "fwd"): 3.0})
    (t,) = tune.summarise([run1, run2])
    # einsum: ratios 1, 2, 1; chunked:4x4: 2, 1, 1 -> both 2^(1/3)
    assert t["scores"] == {"einsum": round(2 ** (1 / 3), 3), "chunked:4x4": round(2 ** (1 / 3), 3)}
    assert (t["BN"], t["T"], t["blocks"]) == (2, 8, [4, 4])
    (t,) = tune.summarise([run1])  # one run: every candidate counts; 8x8 only over the pass that measured it
    assert t["scores"] == {"einsum": round(math.sqrt(2), 3), "chunked:4x4": round(math.sqrt(2), 3), "chunked:8x8": 1.5}
    assert t["blocks"] == [4, 4]


def test_tune_writes_this_processors_rows_and_keeps_the_others(tmp_path, capsys):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(_table(SIBLING, [GOOD_ROW])))
    code = tune.main(["--sizes", "1x2x8x4", "--blocks", "4x4,8x8", "--passes", "fwd", "--min-repeats", "1", "--budget", "0", "--out", str(path)])
    assert code == 0
    data = json.loads(path.read_text())
    proc = kernels.processor()
    assert data["schema"] == kernels.TABLE_SCHEMA and set(data["processors"]) == {SIBLING.key, proc.key}
    entry = data["processors"][proc.key]
    assert (entry["device_kind"], entry["model"], entry["isa"]) == (proc.device_kind, proc.model, proc.isa)
    assert {"measured", "jax", "dtype", "precision", "load_average_start"} <= set(entry)
    assert entry["allocator"] in (allocator.worker_env(), {})  # pinned, the user's knobs, or not glibc
    (row,) = entry["rows"]
    assert (row["BN"], row["T"], row["S"]) == (2, 8, 8)
    assert set(row["scores"]) == {"einsum", "dpa-xla", "chunked:4x4", "chunked:8x8"}
    assert row["fastest"] == kernels.parse_label(min(row["scores"], key=row["scores"].get)).kernel
    assert row["blocks"] in ([4, 4], [8, 8])
    table = kernels.load_user_table(path)  # reads back, no warning
    assert table[proc][0].blocks == tuple(row["blocks"]) and table[SIBLING][0].blocks == (4, 4)
    tune.main(["--show", "--out", str(path)])
    assert f"user table {path}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--sizes", "2x3"], ["--blocks", "0x4"], ["--passes", "bwd"], ["--min-repeats", "0"]])
def test_tune_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        tune.main(argv + ["--out", "/nonexistent/never-written.json"])
    assert e.value.code == 2


class TestGroupedHeads:
    """A grouped layer (K key/value heads of G = N/K query heads) is looked up by the kernel's own
    shape, B·K head blocks of G·T query rows, which is what `mha_jax.tune --kv-heads` measures."""

    def test_kernel_space(self):
        assert kernels.kernel_space(3, 8, 5, 7) == (24, 5, 7)
        assert kernels.kernel_space(3, 8, 5, 7, kv_heads=2) == (6, 20, 7)
        assert kernels.kernel_space(3, 8, 5, 7, kv_heads=1) == (3, 40, 7)
        for bad in (3, 0, 2.0):
            with pytest.raises(ValueError, match="kv_heads must be a positive integer dividing num_heads N=8"):
                kernels.kernel_space(3, 8, 5, 7, kv_heads=bad)

    def test_choose_compares_rows_in_kernel_space(self):
        rows = (Measured(BN=8, T=1024, S=1024, fastest="chunked", blocks=(512, 512)),
                Measured(BN=2, T=4096, S=1024, fastest="chunked", blocks=(1024, 1024)))
        src = (kernels.Source("built-in rows", rows, "built-in"),)
        ungrouped = _choose(src, B=1, N=8, T=1024, S=1024)
        grouped = _choose(src, B=1, N=8, T=1024, S=1024, kv_heads=2)
        assert (ungrouped.q_chunk, ungrouped.k_chunk) == (512, 512) and "kernel's" not in ungrouped.why
        assert (grouped.q_chunk, grouped.k_chunk) == (1024, 1024)
        assert "to the kernel's B·K=2 G·T=4096 S=1024" in grouped.why
        assert _choose(src, B=1, N=8, T=1024, S=1024, kv_heads=8) == ungrouped  # K = N is the ungrouped layer
        with pytest.raises(ValueError, match="kv_heads"):
            _choose(src, N=8, kv_heads=3)

    def test_fused_attention_core_asks_with_its_key_value_heads(self, cache_dir):
        from parity.kernel_ran import jax_choices

        (cache_dir / "kernels.json").write_text(json.dumps(_table(kernels.processor(), [
            dict(BN=12, T=5, S=7, fastest="chunked", blocks=[8, 8]),  # B·N of the layer: the wrong key
            dict(BN=6, T=10, S=7, fastest="chunked", blocks=[4, 4])])))  # B·K, G·T: the kernel's
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((3, 5, 4, 8)), jnp.float32)  # (B, T, N, H)
        k, v = (jnp.asarray(rng.standard_normal((3, 7, 2, 8)), jnp.float32) for _ in range(2))  # (B, S, K, H)
        with jax_choices() as made:
            fused_attention_core(q, k, v)
            fused_attention_core(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
        assert [kernels.kernel_label(c) for c in made] == ["chunked:4x4", "chunked:8x8"]

    def test_summarise_keys_grouped_rows_by_the_kernels_shape(self):
        rows = [dict(B=1, N=8, K=2, T=64, S=64, pass_="fwd", candidate=c, min_s=t) for c, t in (("einsum", 2.0), ("chunked:64x64", 1.0))]
        rows += [dict(B=1, N=8, T=64, S=64, pass_="fwd", candidate="einsum", min_s=1.0)]  # no K: ungrouped (K = N)
        grouped, ungrouped = tune.summarise([rows])
        assert (grouped["BN"], grouped["T"], grouped["S"], grouped["fastest"]) == (2, 256, 64, "chunked")
        assert (ungrouped["BN"], ungrouped["T"], ungrouped["S"], ungrouped["fastest"]) == (8, 64, 64, "einsum")

    def test_tune_measures_a_grouped_layer(self, tmp_path):
        path, run = tmp_path / "kernels.json", tmp_path / "run.json"
        code = tune.main(["--sizes", "1x4x8x4", "--kv-heads", "2", "--blocks", "4x4,32x8", "--passes", "fwd",
                          "--min-repeats", "1", "--budget", "0", "--out", str(path), "--json", str(run)])
        assert code == 0
        assert {(r["K"], r["candidate"]) for r in json.loads(run.read_text())["rows"]} == {
            (2, "einsum"), (2, "dpa-xla"), (2, "chunked:4x4"), (2, "chunked:16x8")}  # 32 clipped to G·T = 16 rows
        (row,) = json.loads(path.read_text())["processors"][kernels.processor().key]["rows"]
        assert (row["BN"], row["T"], row["S"]) == (2, 16, 8)


class TestPallasRule:
    """The Pallas flash kernels on a TPU and a GPU, by rule, with fake platforms (no GPU or TPU here):
    each branch, each refusal's reason, and the fallback (the measured rows, else chunked)."""

    @staticmethod
    def pick(platform, sources=(), **kw):
        args = dict(T=512, S=512, H=64, dtype=jnp.float32)
        return _choose(sources, platform=platform, **{**args, **kw})

    @pytest.mark.parametrize("kind", ["none", "causal", "segments", "key-segments", "causal+segments",
                                      "causal+key-segments"])
    def test_a_tpu_runs_its_flash_kernel_for_every_mask_it_expresses(self, kind):
        for dtype in (jnp.float32, jnp.bfloat16):
            c = self.pick("tpu", dtype=dtype, has_mask=kind != "none", mask_kind=kind)
            assert (c.kernel, c.q_chunk, c.k_chunk, c.source) == (kernels.PALLAS_TPU, None, None, "rule")
            assert f"a {kind} mask fit pallas-tpu-flash" in c.why

    @pytest.mark.parametrize("kw, reason", [
        (dict(has_mask=True), "a dense mask: it expresses none, causal, segments"),  # has_mask alone: dense
        (dict(has_mask=True, mask_kind="dense"), "a dense mask"),
        (dict(dtype=jnp.float64), "float64: it runs float32 and bfloat16"),
        (dict(dtype=jnp.float16), "float16: it runs float32 and bfloat16"),
        (dict(T=500), "T=500, S=512: both must be multiples of its 128 blocks"),
        (dict(S=200), "T=512, S=200: both must be multiples of its 128 blocks"),
        (dict(H=192), "head dim 192: it takes H <= 128 or a multiple of 128"),
        (dict(precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT)),
         "precision (Precision.HIGHEST, Precision.DEFAULT) has no jax.default_matmul_precision name"),
    ])
    def test_a_tpu_takes_chunked_where_its_flash_kernel_refuses(self, kw, reason):
        c = self.pick("tpu", **kw)
        assert (c.kernel, c.q_chunk, c.k_chunk, c.source) == ("chunked", *kernels.DEFAULT_BLOCKS, "no rows")
        assert c.why.startswith(f"pallas-tpu-flash refused ({reason}")
        assert c.why.endswith("no measured rows for this device kind: chunked")

    def test_a_tpu_never_takes_the_einsum_without_rows_however_small(self):
        assert self.pick("tpu", T=8, S=8, H=4, has_mask=True).kernel == "chunked"  # a CPU takes einsum here
        assert self.pick("cpu", T=8, S=8, H=4, has_mask=True).kernel == "einsum"

    def test_shapes_at_the_tpu_kernels_edges(self):
        assert self.pick("tpu", T=128, S=256, has_mask=True, mask_kind="causal").kernel == kernels.PALLAS_TPU  # T != S
        assert self.pick("tpu", H=256).kernel == kernels.PALLAS_TPU  # a multiple of 128
        assert self.pick("tpu", H=100).kernel == kernels.PALLAS_TPU  # below 128: any
        assert self.pick("tpu", T=128, S=128, precision="highest").kernel == kernels.PALLAS_TPU
        assert self.pick("tpu", precision=jax.lax.Precision.HIGH).kernel == kernels.PALLAS_TPU

    def test_with_measured_rows_the_rows_decide_where_the_kernel_refuses(self):
        tpu_rows = (kernels.Source("tpu rows", (Measured(BN=32, T=512, S=512, fastest="einsum", blocks=(64, 64)),), "user table"),)
        c = self.pick("tpu", tpu_rows, has_mask=True)
        assert (c.kernel, c.source) == ("einsum", "user table")
        assert c.why.endswith("; pallas-tpu-flash refused (a dense mask: it expresses none, causal, segments, key-segments, "
                              "causal+segments, causal+key-segments)")
        big = self.pick("tpu", tpu_rows, has_mask=True, T=8192, S=8192)  # the memory guard still holds
        assert (big.kernel, big.q_chunk, big.k_chunk) == ("chunked", 64, 64)
        assert self.pick("tpu", tpu_rows, has_mask=True, mask_kind="causal").kernel == kernels.PALLAS_TPU  # the rule first

    @pytest.mark.parametrize("platform", ["gpu", "cuda"])
    def test_a_gpu_runs_cudnn_first_then_its_flash_kernel(self, platform):
        assert self.pick(platform, dtype=jnp.bfloat16, has_mask=True, mask_kind="causal").kernel == "dpa-cudnn"
        for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):  # H=20: not cuDNN's (a multiple of 8), Triton's
            for kind in ("none", "causal", "segments", "causal+segments"):
                c = self.pick(platform, dtype=dtype, H=20, has_mask=kind != "none", mask_kind=kind)
                assert (c.kernel, c.source) == (kernels.PALLAS_GPU, "rule"), (dtype, kind)
                assert c.why == f"{platform}: {jnp.dtype(dtype).name}, T=512, S=512, H=20 and a {kind} mask fit pallas-gpu-flash"

    @pytest.mark.parametrize("kw, reason", [
        (dict(has_mask=True, mask_kind="key-segments"), "a key-segments mask: it expresses none, causal, segments, "
                                                         "causal+segments"),
        (dict(has_mask=True, mask_kind="causal+key-segments"), "a causal+key-segments mask"),
        (dict(has_mask=True), "a dense mask"),
        (dict(dtype=jnp.float64), "float64: it runs float32, float16 and bfloat16"),
        (dict(T=256), "T=256 != S=512: its fused backward needs as many query blocks as key blocks"),
        (dict(T=48, S=48), "T=S=48: its blocks min(128, T) and min(32, T) must be powers of two >= 16 dividing T"),
        (dict(T=200, S=200), "T=S=200: its blocks"),
        (dict(T=8, S=8), "T=S=8: its blocks"),
        (dict(H=8), "head dim 8: it takes 16 <= H <= 256"),
        (dict(H=300), "head dim 300: it takes 16 <= H <= 256"),
        (dict(dtype=jnp.float16, H=12), "head dim 12"),  # refused by cuDNN (H % 8) and by Triton
        (dict(precision="bogus"), "precision 'bogus' has no jax.default_matmul_precision name"),
    ])
    def test_a_gpu_takes_chunked_where_both_refuse(self, kw, reason):
        c = self.pick("gpu", **kw)
        assert (c.kernel, c.q_chunk, c.k_chunk, c.source) == ("chunked", *kernels.DEFAULT_BLOCKS, "no rows")
        assert c.why.startswith(f"pallas-gpu-flash refused ({reason}")

    @pytest.mark.parametrize("L, blocks", [(16, (16, 16)), (32, (32, 32)), (64, (64, 32)), (128, (128, 32)),
                                           (384, (128, 32)), (48, None), (96, None), (8, None), (200, None)])
    def test_the_gpu_kernels_blocks(self, L, blocks):
        assert kernels.gpu_blocks(L) == blocks
        assert (self.pick("gpu", T=L, S=L).kernel == kernels.PALLAS_GPU) == (blocks is not None)

    def test_a_cpu_never_runs_a_pallas_kernel(self):
        for kind in ("none", "causal", "segments", "key-segments"):
            assert self.pick("cpu", has_mask=kind != "none", mask_kind=kind).kernel == "einsum"  # no rows: as before
            c = self.pick("cpu", kernels.sources_for(kernels.EPYC, {}), has_mask=kind != "none", mask_kind=kind)
            assert (c.kernel, c.source) == ("chunked", "built-in") and "pallas" not in c.why

    def test_b_or_t_zero_comes_first(self):
        assert self.pick("tpu", T=0, has_mask=True, mask_kind="causal").kernel == "chunked"
        assert self.pick("gpu", B=0).kernel == "chunked"

    def test_the_mask_kind_must_agree_with_has_mask(self):
        with pytest.raises(ValueError, match="has_mask=False contradicts mask_kind='causal'"):
            self.pick("tpu", mask_kind="causal")
        with pytest.raises(ValueError, match="has_mask=True contradicts mask_kind='none'"):
            self.pick("tpu", has_mask=True, mask_kind="none")
        with pytest.raises(ValueError, match="mask_kind='triangle' is not one of"):
            self.pick("tpu", has_mask=True, mask_kind="triangle")

    def test_fused_choice_on_a_fake_tpu_and_gpu_device(self, cache_dir):
        class Fake:
            def __init__(self, platform, kind):
                self.platform, self.device_kind = platform, kind

        tpu, gpu = Fake("tpu", "TPU v5 lite"), Fake("gpu", "NVIDIA H100 80GB HBM3")
        c = kernels.fused_choice(2, 8, 1024, 1024, 128, jnp.bfloat16, has_mask=True, mask_kind="causal+segments", device=tpu)
        assert kernels.kernel_label(c, source=True) == "pallas-tpu-flash (rule)"
        c = kernels.module_choice(2, 8, 1024, 1024, 128, jnp.bfloat16, has_mask=True, mask_kind="causal",
                                  need_weights=False, device=tpu)
        assert c.kernel == kernels.PALLAS_TPU
        assert kernels.module_choice(2, 8, 1024, 1024, 128, jnp.bfloat16, has_mask=True, need_weights=True,
                                     device=tpu).kernel == "einsum"  # the weights are returned
        c = kernels.fused_choice(2, 8, 1024, 1024, 64, jnp.float32, has_mask=True, mask_kind="causal", device=gpu)
        assert c.kernel == kernels.PALLAS_GPU
        with jax.default_matmul_precision("highest"):  # the global setting is the call's when it passes none
            assert kernels.fused_choice(2, 8, 1024, 1024, 64, jnp.float32, has_mask=False, device=gpu).kernel == kernels.PALLAS_GPU

    @pytest.mark.parametrize("precision, name", [(None, None), ("HIGHEST", "highest"), ("tensorfloat32", "tensorfloat32"),
                                                 (jax.lax.Precision.HIGH, "high"),
                                                 ((jax.lax.Precision.HIGHEST,) * 2, "highest")])
    def test_precision_names(self, precision, name):
        assert kernels.precision_name(precision) == name

    @pytest.mark.parametrize("precision", [(jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT), "bogus",
                                           jax.lax.DotAlgorithmPreset.F32_F32_F32])
    def test_a_precision_without_a_name_is_a_value_error(self, precision):
        with pytest.raises(ValueError, match="has no jax.default_matmul_precision name"):
            kernels.precision_name(precision)

    def test_pallas_labels_read_back_but_no_measured_row_may_name_them(self):
        for name in kernels.PALLAS_KERNELS:
            assert kernels.kernel_label(kernels.Choice(name)) == name
            assert kernels.parse_label(name) == kernels.Choice(name)
            with pytest.raises(ValueError, match="is not a kernel label"):
                kernels.parse_label(f"{name}:128x128")
            with pytest.raises(ValueError, match="row field fastest must be one of"):
                kernels.parse_table(_table(HERE, [{**GOOD_ROW, "fastest": name}]))
        assert kernels.ALL_KERNELS == kernels.KERNELS + ("pallas-gpu-flash", "pallas-tpu-flash")
