"""mha-bench on a grouped, rotary, bias-free layer: the real builds of both frameworks, in process.

(The sweep through a worker, with skip rows for the implementations that do not declare the
features, is in test_bench_cli's shared real run.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from parity.bench.measure import same_output
from parity.bench.spec import IMPLS, BenchCase, canonical_weights, make_inputs, rope_positions

# Pairwise-distinct sizes; RoPE needs an even head size: E=24 N=4 (H=6), K=2.
CASE = BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2, rope="interleaved", bias="none")


def _impl(key):
    return next(im for im in IMPLS if im.bench_key == key)


def test_rope_cases_pass_the_default_positions_to_every_implementation():
    pos = rope_positions(CASE)
    assert pos["positions"].shape == (2, 5) and pos["key_positions"].shape == (2, 7)
    assert (pos["positions"] == np.arange(5)).all() and (pos["key_positions"] == np.arange(7)).all()
    assert rope_positions(BenchCase.of(2, 5, 7, 24, 4, "float32", kv_heads=2)) == {}


def test_the_weights_follow_the_layer():
    sd = canonical_weights(CASE.config, "bfloat16", seed=3)
    assert {k: v.shape for k, v in sd.items()} == CASE.config.weight_shapes()  # k/v (K·H, E), no biases
    assert {v.dtype.name for v in sd.values()} == {"bfloat16"}
    assert all(np.abs(v.astype(np.float32)).max() <= 1 / np.sqrt(24) for v in sd.values())


def test_both_frameworks_build_time_and_agree_on_a_grouped_rotary_bias_free_layer():
    """fwd+bwd: its step is the gradient program, its output check the forward one."""
    torch = pytest.importorskip("torch")
    from parity import convert
    from parity.bench import jax_bench, torch_bench

    outputs = {}
    for key, mod in (("ours-torch:eager:fused", torch_bench), ("ours-torch:eager:weights", torch_bench),
                     ("ours-jax:jit:fused", jax_bench)):
        bench = mod.build(_impl(key), CASE, "fwd+bwd", "cpu", 0)
        if bench.aot_compile is not None:
            bench.aot_compile()
        outputs[key] = bench.output()
        result = bench.step()
        bench.sync(result)
        # Gradients w.r.t. q, k, v and the four weights (no biases).
        leaves = result if key.startswith("ours-torch") else (*result[0].values(), *result[1:])
        assert len(leaves) == 3 + 4, key
        if bench.recompile is not None:  # the shrunk case gets positions of its own lengths
            assert bench.recompile(time.perf_counter) >= 0
    ref = outputs["ours-torch:eager:fused"]
    assert ref.shape == (2, 5, 24) and np.isfinite(ref).all()
    for key, out in outputs.items():
        diff, why = same_output(out, ref, "float32")
        assert why is None, (key, why)
    # The positions passed are the module's defaults: the layer called without any gives the same.
    q, k, v = make_inputs(CASE, 0)
    sd = canonical_weights(CASE.config, "float32", 0)
    m = convert.to_torch(sd, 4, num_kv_heads=2, rope="interleaved")
    with torch.no_grad():
        plain, _ = m(*(torch.from_numpy(x) for x in (q, k, v)), need_weights=False)
    assert np.array_equal(plain.numpy(), ref)
