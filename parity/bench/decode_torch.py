"""`mha-bench --decode`'s torch steppers: our module with its immutable `KVCache` (eager and torch.compile),
transformers' LlamaAttention with its DynamicCache as generate runs it, and a decoder of the protocol
(`Implementation.decode=True`: one token per call).

Legend: B batch, S cached tokens, E embed, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import numpy as np
import torch

from parity import convert
from parity.bench.measure import Bench
from parity.impls.registry import layer_kwargs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _sync(_):
    return None  # CPU: torch's calls return when done


def _numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def ours(case, sd: dict, tokens: np.ndarray, form: str, pass_: str) -> tuple[Bench, dict]:
    """Our module: prefill (S tokens, causal, into an empty cache of S + 1 slots) or step (token S from the
    prefilled cache). form "eager" or "compile" (torch.compile of the module): the immutable `KVCache`, every
    step writes a new one, so every call does the same work from the same cache; "static": a `StaticKVCache`,
    the step writes slot S in place, and every call, given the same cache object (its lengths still S), writes
    slot S again: the same work too."""
    cfg = case.config
    m = convert.to_torch(sd, cfg.num_heads, masked_rows="nan", **layer_kwargs(sd, cfg.num_heads, case.problem)).eval()
    call = torch.compile(m) if form == "compile" else m
    x = torch.from_numpy(np.ascontiguousarray(tokens)).to(DTYPES[case.dtype])
    B, L, _ = x.shape  # L = S + 1
    pre, new = x[:, :L - 1], x[:, L - 1:]

    static = form == "static"

    def prefill():
        with torch.inference_mode():
            out, _, cache = call(pre, pre, pre, cache=m.init_cache(B, L, static=static), need_weights=False)
        return out, cache

    compiles = form == "compile"
    if pass_ == "prefill":
        return Bench(step=lambda: prefill()[0], sync=_sync, output=lambda: _numpy(prefill()[0]),
                     compiles_on_first_call=compiles), {"cache_bytes": nbytes(*_kv(m.init_cache(B, L)))}
    cache = prefill()[1]

    def step():
        with torch.inference_mode():
            return call(new, new, new, cache=cache, need_weights=False)[0]

    return (Bench(step=step, sync=_sync, output=lambda: _numpy(step()), compiles_on_first_call=compiles),
            {"cache_bytes": nbytes(*_kv(cache))})


def _kv(cache):
    return cache.k, cache.v


def hf_llama(case, sd: dict, tokens: np.ndarray, pass_: str) -> tuple[Bench, dict]:
    """transformers' LlamaAttention (eager) as generate runs it: the prefill into a new DynamicCache with the
    causal mask (`parity.peers.hf.hf_llama_prefill`), then a step at position S with its 2D attention mask
    (`hf_llama_decode_step`); every step starts from the prefill's cache (the step builds a new DynamicCache
    around its tensors and concatenates the new key and value: the copy DynamicCache makes at each step)."""
    from parity.peers.hf import hf_llama_decode_step, hf_llama_prefill, llama_parts

    cfg = case.config
    att, rotary = llama_parts(sd, cfg, case.dtype)
    x = torch.from_numpy(np.ascontiguousarray(tokens)).to(DTYPES[case.dtype])
    B, L, _ = x.shape
    pre, new = x[:, :L - 1], x[:, L - 1:]

    def prefill():
        with torch.inference_mode():
            return hf_llama_prefill(att, rotary, cfg, pre)

    if pass_ == "prefill":
        return Bench(step=lambda: prefill()[0], sync=_sync, output=lambda: _numpy(prefill()[0])), {"cache_bytes": None}
    cache = prefill()[1]
    position = torch.full((B,), L - 1, dtype=torch.int64)

    def step():
        with torch.inference_mode():
            return hf_llama_decode_step(att, rotary, cfg, new, cache, position)[0]

    layer = cache.past.layers[0]
    return Bench(step=step, sync=_sync, output=lambda: _numpy(step())), {"cache_bytes": nbytes(layer.keys, layer.values)}


def protocol(impl, case, sd: dict, tokens: np.ndarray) -> tuple[Bench, dict]:
    """A decoder of the protocol (fn(p, x_t, cache, position) -> (out, cache)): the S prompt tokens one per call
    (untimed), then the step at position S from that cache, every timed call from the same one. A decoder that
    changed its cache in place would decode another step at each call: its first two outputs must agree."""
    fn = impl.make(sd, case.config.num_heads, "nan", "cpu", case.problem)
    p = {k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()}
    x = torch.from_numpy(np.ascontiguousarray(tokens)).to(DTYPES[case.dtype])
    B, L, _ = x.shape
    cache = None
    with torch.no_grad():
        for t in range(L - 1):
            _, cache = fn(p, x[:, t:t + 1], cache, torch.full((B,), t, dtype=torch.int64))
    position = torch.full((B,), L - 1, dtype=torch.int64)

    def step():
        with torch.no_grad():
            return fn(p, x[:, L - 1:], cache, position)[0]

    def output():
        first, second = _numpy(step()), _numpy(step())
        if not np.array_equal(first, second):
            raise ValueError(f"{impl.name}: two calls from the same cache gave different outputs: the decoder "
                             "changes its cache in place, so a repeated step is not the same work")
        return first

    return Bench(step=step, sync=_sync, output=output), {"cache_bytes": None}


def read_rate() -> float:
    """Bytes per second torch reads summing a 256 MiB float32 tensor with its threads (best of 5)."""
    import time

    a = torch.ones(64 * 2**20)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum().item()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best
