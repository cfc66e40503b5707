"""The torch implementations under test. Imports torch, never jax."""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from mha_spec import Kernel
from parity import convert, kernel_ran
from parity.bench.measure import Bench, CpuPeakRss, first_call_overhead
from parity.bench.spec import DTYPES, BenchCase, canonical_weights, impl_keep_mask, make_inputs, rope_positions, structure_for
from parity.dtypes import torch_dtype
from parity.env import pin_torch
from parity.impls import Implementation
from parity.impls.registry import mask_for
from parity.impls.torch_impls import TorchRunner


def device_info(device: str) -> dict:
    if device == "cuda":
        return {"torch_device": f"cuda:0 ({torch.cuda.get_device_name(0)})"}
    return {"torch_device": "cpu"}


def setup(device: str, threads: int | None, precision: str, compiles: bool = True) -> dict:
    """Pin threads and matmul precision; returns what was set, for the environment block.

    compiles: whether a torch.compile implementation runs; only then is inductor imported (about
    as long again as torch itself) and its settings recorded."""
    if threads:
        torch.set_num_threads(threads)
    pinned = pin_torch(precision == "highest")
    inductor_settings = None
    if compiles:
        from torch._inductor import config as inductor

        inductor_settings = {
            "max_autotune": inductor.max_autotune,
            "freezing": inductor.freezing,
            "cpp.simdlen": inductor.cpp.simdlen,
            "fx_graph_cache": inductor.fx_graph_cache,
        }
    return {"torch_threads": torch.get_num_threads(), **pinned, "torch_inductor": inductor_settings,
            **device_info(device)}


def reset_compiled() -> None:
    """Called by the worker between (case, pass) groups: no compiled graph carries over. Without
    torch.compile in the run dynamo was never imported: nothing to reset, no import to pay."""
    if "torch._dynamo" in sys.modules:
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


def _tensors(case: BenchCase, device: str, seed: int, requires_grad: bool):
    """[query, key, value] on the device; on a self-attention case one leaf tensor, three times (so a
    layer that treats `query is key is value` as self-attention does so here, as in a model)."""
    q, k, v = make_inputs(case, seed)
    if case.self_attention:
        x = convert.numpy_to_tensor(q, device).requires_grad_(requires_grad)
        return [x, x, x]
    return [convert.numpy_to_tensor(a, device).requires_grad_(requires_grad) for a in (q, k, v)]


def _mask(runner: TorchRunner, built, case: BenchCase):
    """The dense mask the implementation is called with (`spec.impl_keep_mask`: none when it takes the
    structure), in its convention, on the device; None without one."""
    return runner.t(mask_for(built.impl, impl_keep_mask(built.impl, case), case.heads, DTYPES[case.dtype]))


def _step(runner: TorchRunner, built, case: BenchCase, pass_: str, device: str, seed: int):
    """One call of the registered implementation (the harness's adapter), forward or forward+backward."""
    mask = _mask(runner, built, case)
    if pass_ == "fwd":
        q, k, v = _tensors(case, device, seed, requires_grad=False)

        def step():
            with torch.inference_mode():
                return runner.call(built, q, k, v, mask)

        return step
    q, k, v = _tensors(case, device, seed, requires_grad=True)
    inputs = [q] if case.self_attention else [q, k, v]  # self-attention: d_x, one gradient (all three uses summed)
    params = list(built.params.values()) if built.impl.uses_params else []
    for p in params:
        p.requires_grad_(True)

    def step():
        out, _ = runner.call(built, q, k, v, mask)
        loss = out.float().sum()
        # autograd.grad, not .backward(): nothing accumulates between repeats.
        return torch.autograd.grad(loss, [*inputs, *params])

    return step


SDPA, BMM_SOFTMAX = kernel_ran.SDPA, kernel_ran.BMM_SOFTMAX  # the torch kernels' names: kernel_ran's
# Whose need_weights=False path is F.scaled_dot_product_attention and whose weights path is
# baddbmm + softmax (mha_torch's two cores; torch.nn.MultiheadAttention's fast and slow paths).
SDPA_FAMILIES = ("ours-torch", "torch-mha", "torch-sdpa-core", "torch-sdpa-gqa")
# Their kernel by need_weights: the weights path materialises them, the fused path asks SDPA.
SDPA_FAMILY_KERNELS = {True: Kernel(BMM_SOFTMAX, source="weights"), False: Kernel(SDPA)}


# What SDPA cannot compute: our fused path runs the materialised core instead where the layer has these.
SDPA_UNTAKEN = ("softcap", "sinks")


def kernel_label(impl: Implementation, config=None) -> str:
    """The benchmark row's `kernel` of a torch implementation: "sdpa" or "bmm-softmax (weights)" for
    SDPA_FAMILIES; a user's layer its name; any other (the eager transformers peers) its family or name.
    config: the unit's `mha_spec.AttentionConfig` (None: the classic layer's); our fused path on a layer
    with a soft-cap or sinks, which SDPA does not take, asks the materialised core, "bmm-softmax (softcap)"."""
    if impl.role == "user":
        return str(Kernel(impl.name))
    name = impl.family or impl.name
    if name not in SDPA_FAMILIES:
        return str(Kernel(name))
    untaken = [m for m in SDPA_UNTAKEN if config is not None and getattr(config, m) not in (None, False)]
    if name == "ours-torch" and not impl.returns_weights and untaken:
        return str(Kernel(BMM_SOFTMAX, source=", ".join(untaken)))
    return str(SDPA_FAMILY_KERNELS[impl.returns_weights])


def build(impl: Implementation, case: BenchCase, pass_: str, device: str, seed: int) -> Bench:
    """A Bench for one (implementation, case, pass) on `device` ("cpu" or "cuda")."""
    if case.dtype not in DTYPES:
        raise ValueError(f"the benchmark has no dtype {case.dtype}")
    runner = TorchRunner(device)
    sd = canonical_weights(case.config, case.dtype, seed)

    def built_for(c: BenchCase):
        return runner.build(impl, sd, c.heads, masked_rows="nan", problem=c.problem, positions=rope_positions(c),
                            structure=structure_for(impl, c))

    built = built_for(case)
    sync = _sync(device)
    recompile = None
    if impl.mode == "compile":
        shrunk = case.shrunk()  # RoPE or a structured mask: positions and ids of the new lengths, built anew
        anew = case.config.rope or built.structure
        step2 = _step(runner, built_for(shrunk) if anew else built, shrunk, pass_, device, seed)
        recompile = lambda clock: first_call_overhead(step2, sync, clock)  # noqa: E731
    step = _step(runner, built, case, pass_, device, seed)
    q, k, v = _tensors(case, device, seed, requires_grad=False)
    mask = _mask(runner, built, case)
    seen = {}

    def output():
        # The checked call, once, under the profiler: the SDPA backend it ran and the arguments its mask
        # came in (`kernel_ran.torch_observer`).
        with kernel_ran.torch_observer(record_shapes=True) as observed, torch.inference_mode():
            out, _ = runner.call(built, q, k, v, mask)
        seen["label"] = observed
        return out.detach().float().cpu().numpy()

    requested = kernel_label(impl, case.config)

    def ran():
        return None if "label" not in seen else kernel_ran.torch_verdict(requested, seen["label"].label)

    def mask_path():
        return None if "label" not in seen else torch_mask_path(case, bool(built.structure), seen["label"])

    return Bench(
        kernel=kernel_ran.BenchKernel(requested, ran),
        step=step, sync=sync, compiles_on_first_call=impl.mode == "compile", recompile=recompile,
        output=output, memory=_memory_probe(device, step, sync), mask_path=mask_path,
        gradients=None if pass_ == "fwd" else functools.partial(gradient_names, case, built),
    )


def gradient_names(case: BenchCase, built, grads) -> dict[str, np.ndarray]:
    """A fwd+bwd step's gradients (`_step`: the inputs', then the parameters' where it computes them) by name:
    "x" (a self-attention case) or "query", "key", "value", then the canonical parameter names."""
    names = ["x"] if case.self_attention else ["query", "key", "value"]
    if built.impl.uses_params:
        names += list(built.params)
    if len(grads) != len(names):
        raise ValueError(f"{built.impl.name}: {len(grads)} gradients for {len(names)} names {names}")
    return {n: g.detach().float().cpu().numpy() for n, g in zip(names, grads)}


# Where an SDPA op of the profiler takes its mask and its is_causal: (mask argument index or None, is_causal
# argument index), by the aten schemas. The public op first: it is what the layer called.
SDPA_MASK_ARGS = {
    "scaled_dot_product_attention": (3, 5),
    "_scaled_dot_product_flash_attention_for_cpu": (5, 4),
    "_scaled_dot_product_attention_math": (3, 5),
    "_scaled_dot_product_efficient_attention": (3, 6),
    "_scaled_dot_product_cudnn_attention": (3, 6),
    "_scaled_dot_product_flash_attention": (None, 4),
}


def sdpa_mask_path(calls) -> str | None:
    """How the mask reached SDPA in profiled calls [(op name, input shapes, concrete inputs)]: "dense" when a
    call got an attn_mask, "structure" when every call got is_causal=True and none a mask, "none" when no call
    got either; None when no call of SDPA_MASK_ARGS was recorded (the public op's calls when there are any)."""
    ops = [(n.split("::")[-1], shapes, values) for n, shapes, values in calls]
    ops = [c for c in ops if c[0] in SDPA_MASK_ARGS]
    public = [c for c in ops if c[0] == "scaled_dot_product_attention"]
    paths = set()
    for op, shapes, values in public or ops:
        at_mask, at_causal = SDPA_MASK_ARGS[op]
        if at_mask is not None and at_mask < len(shapes) and shapes[at_mask]:
            paths.add("dense")
        elif at_causal < len(values) and values[at_causal] is True:
            paths.add("structure")
        else:
            paths.add("none")
    for path in ("dense", "structure", "none"):
        if path in paths:
            return path
    return None


def torch_mask_path(case: BenchCase, given_structure: bool, observed) -> str:
    """The row's `mask_path` (`spec.MASK_PATHS`) from the profiled output call (`kernel_ran.TorchObserved`
    with record_shapes): what SDPA was given; a softmax outside SDPA applies the mask to every score
    ("dense"); else what the implementation was given (the structure, or a dense mask)."""
    if case.mask == "none":
        return "none"
    path = sdpa_mask_path(observed.sdpa_calls)
    if path is not None:
        return path
    if observed.label == BMM_SOFTMAX:
        return "dense"
    return "structure" if given_structure else "dense"


def peak_gflops(dtype: str, sizes, device: str, timing, clock) -> tuple[float, int]:
    """The best matmul rate over square sizes: (GFLOP/s from the fastest call, size)."""
    from parity.bench.measure import run_bench

    best = (0.0, 0)
    sync = _sync(device)
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(device=device, dtype=torch_dtype(dtype))
        b = torch.randn(n, n, generator=g).to(device=device, dtype=torch_dtype(dtype))
        res = run_bench(Bench(step=lambda: a @ b, sync=sync), timing, clock)
        rate = 2 * n**3 / res["min_s"] / 1e9
        best = max(best, (rate, n))
    return best
