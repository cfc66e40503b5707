"""The torch implementations under test. Imports torch, never jax."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from parity import convert
from parity.bench.measure import Bench, CpuPeakRss, first_call_overhead
from parity.bench.spec import Case, Impl, canonical_weights, make_inputs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_info(device: str) -> dict:
    if device == "cuda":
        return {"torch_device": f"cuda:0 ({torch.cuda.get_device_name(0)})"}
    return {"torch_device": "cpu"}


def setup(device: str, threads: int | None, precision: str) -> dict:
    """Pin threads and matmul precision; returns what was set, for the environment block."""
    if threads:
        torch.set_num_threads(threads)
    if precision == "highest":
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from torch._inductor import config as inductor

    return {
        "torch_threads": torch.get_num_threads(),
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_inductor": {
            "max_autotune": inductor.max_autotune,
            "freezing": inductor.freezing,
            "cpp.simdlen": inductor.cpp.simdlen,
            "fx_graph_cache": inductor.fx_graph_cache,
        },
        **device_info(device),
    }


def reset_compiled() -> None:
    """Called by the worker between (case, pass) groups: no compiled graph carries over."""
    torch._dynamo.reset()


def check_device(device: str) -> str | None:
    """None if torch can run on `device`, else the reason it cannot."""
    if device == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def _sync(device: str):
    if device == "cuda":
        return lambda out: torch.cuda.synchronize()
    # CPU kernels run synchronously in the calling thread: nothing is in flight.
    return lambda out: None


def _memory_probe(device: str, step, sync):
    if device == "cuda":
        def probe():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = step()
            sync(out)
            peak = torch.cuda.max_memory_allocated() - base
            return peak, "gpu: torch.cuda.max_memory_allocated growth over one call", out
        return probe
    rss = CpuPeakRss()
    return lambda: rss(step, sync)


def _tensors(case: Case, device: str, seed: int, requires_grad: bool):
    return [
        convert.numpy_to_tensor(a, device).requires_grad_(requires_grad) for a in make_inputs(case, seed)
    ]


class _SdpaCore(torch.nn.Module):
    """The peer: the same four projections around F.scaled_dot_product_attention."""

    def __init__(self, sd, num_heads: int, device: str):
        super().__init__()
        self.num_heads = num_heads
        for name, a in sd.items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(convert.numpy_to_tensor(a, device)))

    def _proj(self, x, p):
        return F.linear(x, getattr(self, f"{p}_weight"), getattr(self, f"{p}_bias"))

    def forward(self, q, k, v):
        B, T, E = q.shape
        S = k.shape[1]
        N, H = self.num_heads, E // self.num_heads
        q = self._proj(q, "q_proj").view(B, T, N, H).transpose(1, 2)  # (B, N, T, H)
        k = self._proj(k, "k_proj").view(B, S, N, H).transpose(1, 2)  # (B, N, S, H)
        v = self._proj(v, "v_proj").view(B, S, N, H).transpose(1, 2)  # (B, N, S, H)
        ctx = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(H))  # (B, N, T, H)
        return self._proj(ctx.transpose(1, 2).reshape(B, T, E), "out_proj"), None


def _module(impl: Impl, case: Case, device: str, seed: int):
    sd = canonical_weights(case.embed, case.dtype, seed)
    if impl.name == "ours-torch":
        m = convert.to_torch(sd, case.heads).to(device).eval()
        nw = impl.need_weights
        return m, lambda mod, q, k, v: mod(q, k, v, need_weights=nw)
    if impl.name == "torch-mha":
        m = convert.to_torch_mha(sd, case.heads).to(device).eval()
        nw = impl.need_weights
        return m, lambda mod, q, k, v: mod(q, k, v, need_weights=nw, average_attn_weights=False)
    if impl.name == "torch-sdpa-core":
        return _SdpaCore(sd, case.heads, device).eval(), lambda mod, q, k, v: mod(q, k, v)
    raise ValueError(f"unknown torch implementation {impl.name!r}")


def _step(call, mod, case: Case, pass_: str, device: str, seed: int):
    if pass_ == "fwd":
        q, k, v = _tensors(case, device, seed, requires_grad=False)

        def step():
            with torch.inference_mode():
                return call(mod, q, k, v)

        return step
    q, k, v = _tensors(case, device, seed, requires_grad=True)
    params = [p for p in mod.parameters()]
    for p in params:
        p.requires_grad_(True)

    def step():
        out, _ = call(mod, q, k, v)
        loss = out.float().sum()
        # autograd.grad, not .backward(): nothing accumulates between repeats.
        return torch.autograd.grad(loss, [q, k, v, *params])

    return step


def build(impl: Impl, case: Case, pass_: str, device: str, seed: int) -> Bench:
    """A Bench for one (implementation, case, pass) on `device` ("cpu" or "cuda")."""
    if case.dtype not in _DTYPES:
        raise ValueError(f"torch has no dtype {case.dtype}")
    m, call = _module(impl, case, device, seed)
    sync = _sync(device)
    recompile = None
    if impl.mode == "compile":
        m = torch.compile(m)
        step2 = _step(call, m, case.shrunk(), pass_, device, seed)
        recompile = lambda clock: first_call_overhead(step2, sync, clock)  # noqa: E731
    elif impl.mode != "eager":
        raise ValueError(f"torch runs eager or compile, not {impl.mode!r}")
    step = _step(call, m, case, pass_, device, seed)
    fingerprint = None
    if pass_ == "fwd":
        fingerprint = lambda out: float(out[0].double().abs().mean())  # noqa: E731
    return Bench(
        step=step, sync=sync, compiles_on_first_call=impl.mode == "compile", recompile=recompile,
        fingerprint=fingerprint, memory=_memory_probe(device, step, sync),
    )


def peak_gflops(dtype: str, sizes, device: str, timing, clock) -> tuple[float, int]:
    """The best matmul rate over square sizes: (GFLOP/s from the fastest call, size)."""
    from parity.bench.measure import run_bench

    best = (0.0, 0)
    sync = _sync(device)
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(device=device, dtype=_DTYPES[dtype])
        b = torch.randn(n, n, generator=g).to(device=device, dtype=_DTYPES[dtype])
        res = run_bench(Bench(step=lambda: a @ b, sync=sync), timing, clock)
        rate = 2 * n**3 / res["min_s"] / 1e9
        best = max(best, (rate, n))
    return best
