"""mha_torch.StaticKVCache: the KV cache written in place (as Hugging Face's StaticCache and serving loops write
theirs), against the immutable KVCache it must equal, and judged by the decode check as `torch-static`.

A layer of its own sizes (E=24, N=4 over K=2 key/value heads of H=6, rotate-half RoPE at 500), B=3 rows
left-padded by 0, 2, 1, a prompt of 4 tokens and 3 single-token steps into 9 slots, float64.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mha_torch
from mha_torch import KVCache, StaticKVCache

B, E, N, K, H, C = 3, 24, 4, 2, 6, 9
PROMPT, STEPS = 4, 3
STARTS = (0, 2, 1)


def _layer(**kw):
    torch.manual_seed(0)
    return mha_torch.MultiHeadAttention(E, N, num_kv_heads=K, rope="half", rope_theta=500.0, dtype=torch.float64,
                                        **kw).eval()


def _tokens():
    return torch.randn(B, PROMPT + STEPS, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _decode(m, cache, x, need_weights=False):
    """The prompt in one call, then one token per call: (outputs (B, PROMPT + STEPS, E), the caches returned)."""
    outs, caches = [], []
    calls = [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, PROMPT + STEPS)]
    with torch.no_grad():
        for lo, hi in calls:
            out, _, cache = m(x[:, lo:hi], x[:, lo:hi], x[:, lo:hi], cache=cache, need_weights=need_weights)
            outs.append(out)
            caches.append(cache)
    return torch.cat(outs, dim=1), caches


class _Writes(TorchDispatchMode):
    """The aten ops of a call, and which of them produced a tensor of the cache's shape (B, K, C, H)."""

    def __init__(self):
        super().__init__()
        self.cache_sized = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(o, torch.Tensor) and tuple(o.shape) == (B, K, C, H) for o in outs):
            self.cache_sized.append(func.__name__)
        return out


def _step_ops(m, cache, xt, need_weights):
    """(the aten ops of one step that made a tensor of the cache's shape, in order; the returned cache)."""
    seen = _Writes()
    with torch.no_grad(), seen:
        _, _, after = m(xt, xt, xt, cache=cache, need_weights=need_weights)
    return seen.cache_sized, after


def test_a_step_writes_the_preallocated_tensors_in_place_and_copies_no_cache():
    """The data_ptr of k and v is unchanged by the prompt and the steps; a step's ops that make a tensor of the
    cache's shape are the immutable cache's step's (the attention kernel's own reads of the cache) with its two
    out-of-place scatters (a new k and v) replaced by two in-place ones: no copy of the cache per step."""
    m, x = _layer(), _tokens()
    starts = torch.tensor(STARTS)
    cache = m.init_cache(B, C, starts=starts, static=True)
    assert type(cache) is StaticKVCache and isinstance(cache, KVCache) and tuple(cache.k.shape) == (B, K, C, H)
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
    with torch.no_grad():
        _, _, static = m(x[:, :PROMPT], x[:, :PROMPT], x[:, :PROMPT], cache=cache, need_weights=False)
        _, _, plain = m(x[:, :PROMPT], x[:, :PROMPT], x[:, :PROMPT], cache=m.init_cache(B, C, starts=starts))
    assert (static.k.data_ptr(), static.v.data_ptr()) == ptrs and static.lengths.tolist() == [PROMPT] * B
    for t, need_weights in zip(range(PROMPT, PROMPT + STEPS), (False, True, False)):  # both paths write alike
        xt = x[:, t:t + 1]
        ops, static = _step_ops(m, static, xt, need_weights)
        plain_ops, new = _step_ops(m, plain, xt, need_weights)
        assert (static.k.data_ptr(), static.v.data_ptr()) == ptrs
        assert plain_ops.count("scatter.src") == 2 and new.k.data_ptr() != plain.k.data_ptr()
        assert ops.count("scatter_.src") == 2 and "scatter.src" not in ops and "clone.default" not in ops
        assert ops == [o.replace("scatter.src", "scatter_.src") for o in plain_ops], (ops, plain_ops)
        plain = new
    assert type(static) is StaticKVCache and not isinstance(plain, StaticKVCache)


def test_it_equals_the_immutable_cache_over_a_left_padded_prompt_and_steps():
    """Every output and the final cache to 1e-12 in float64 (both paths), the spent cache sharing the last one's
    tensors (it holds the later tokens past its own lengths), and `clone` a prefix of its own."""
    m, x = _layer(), _tokens()
    starts = torch.tensor(STARTS)
    for need_weights in (False, True):
        want, plain = _decode(m, m.init_cache(B, C, starts=starts), x, need_weights)
        got, static = _decode(m, m.init_cache(B, C, starts=starts, static=True), x, need_weights)
        # the left-padding queries attend nothing: NaN (masked_rows="nan") in both, at the same places
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
        assert (got - want).nan_to_num().abs().max() <= 1e-12
        final, ref = static[-1], plain[-1]
        assert (final.k - ref.k).abs().max() <= 1e-12 and (final.v - ref.v).abs().max() <= 1e-12
        assert final.lengths.tolist() == ref.lengths.tolist() == [PROMPT + STEPS] * B
        assert final.starts.tolist() == list(STARTS)
        # the prompt's cache is spent: its lengths are the prompt's, its tensors the last step's
        assert static[0].lengths.tolist() == [PROMPT] * B and static[0].k is final.k
        assert not torch.equal(static[0].k, plain[0].k)  # the immutable prompt cache does not hold the steps
    # a clone taken before a step is a prefix of its own: continued after the original was, it gives the same step
    cache = m.init_cache(B, C, starts=starts, static=True)
    with torch.no_grad():
        _, _, prompt = m(x[:, :PROMPT], x[:, :PROMPT], x[:, :PROMPT], cache=cache)
        spare = prompt.clone()
        assert spare.k.data_ptr() != prompt.k.data_ptr() and type(spare) is StaticKVCache
        first, _, _ = m(x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], cache=prompt)
        again, _, _ = m(x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], cache=spare)
    assert torch.equal(first, again)


def test_a_write_past_capacity_is_a_value_error_and_leaves_the_cache_as_it_was():
    m, x = _layer(), _tokens()
    cache = m.init_cache(B, PROMPT + 1, starts=torch.tensor(STARTS), static=True)
    with torch.no_grad():
        _, _, cache = m(x[:, :PROMPT], x[:, :PROMPT], x[:, :PROMPT], cache=cache, need_weights=False)
        with pytest.raises(ValueError, match=r"holds 5 slots per row; rows \[0, 1, 2\] .* no room for 3 more tokens"):
            m(x[:, PROMPT:], x[:, PROMPT:], x[:, PROMPT:], cache=cache, need_weights=False)[:2]
        before = cache.k.clone()
        _, _, full = m(x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], x[:, PROMPT:PROMPT + 1], cache=cache)
        assert full.lengths.tolist() == [PROMPT + 1] * B and torch.equal(full.k[:, :, :PROMPT], before[:, :, :PROMPT])
        kept = full.k.clone()
        with pytest.raises(ValueError, match="no room for 1 more tokens"):
            m(x[:, -1:], x[:, -1:], x[:, -1:], cache=full)
        assert torch.equal(full.k, kept)  # refused before anything was written
    with pytest.raises(TypeError, match="static must be a bool"):
        m.init_cache(B, C, static="yes")


def test_a_step_compiles_as_one_graph_and_serves_every_position():
    """torch.compile(fullgraph=True) of one step (backend aot_eager: dynamo's capture and AOT's functionalization
    of the in-place write, without inductor's codegen, ~11 s on 2 cores): no graph break, one compiled frame
    for two steps at different lengths, and the same output and in-place cache as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m, x = _layer(), _tokens()
    starts = torch.tensor(STARTS)

    def step(xt, cache):
        out, _, new = m(xt, xt, xt, cache=cache, need_weights=False)
        return out, new

    with torch.no_grad():
        _, _, cache = m(x[:, :PROMPT], x[:, :PROMPT], x[:, :PROMPT], cache=m.init_cache(B, C, starts=starts, static=True))
        want, _ = _decode(m, m.init_cache(B, C, starts=starts), x)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, fullgraph=True, backend=counter)
        ptr = cache.k.data_ptr()
        for t in range(PROMPT, PROMPT + STEPS):
            out, cache = compiled(x[:, t:t + 1], cache)
            assert (out - want[:, t:t + 1]).abs().max() <= 1e-12, t
    assert counter.frame_count == 1 and type(cache) is StaticKVCache and cache.k.data_ptr() == ptr
    assert cache.lengths.tolist() == [PROMPT + STEPS] * B


def test_the_decode_check_judges_torch_static_green():
    """One in-process run: the default Llama decode case, float32, torch-static beside torch (no cross-framework
    row continues the static cache's prompt)."""
    from parity.harness import decode
    from parity.harness.matrix import default_matrix
    from parity.harness.runner import run

    case = next(c for c in default_matrix() if c.decode and c.shape.name == "decode-llama")
    report = run(cases=[case], checks=("decode",), dtypes=("float32",), impls=("torch-static",), device="cpu")
    rows = [r for r in report.rows if r.impl == "torch-static"]
    assert {r.quantity for r in rows} == {"prefill", "step 1", "step 2", "step 3", "cache"}
    assert all(r.status == "pass" for r in rows), [(r.quantity, r.status, r.message) for r in rows if r.status != "pass"]
    assert not any("->" in r.impl for r in report.rows)
    assert decode.STATIC_NOTE in next(r.message for r in rows if r.quantity == "step 3")
