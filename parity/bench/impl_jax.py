"""The JAX implementations under test. Imports jax, never torch.

Every implementation is a pure function of (params, rest, q, k, v) under jax.jit
(nnx.split/merge rather than nnx.jit: the same XLA program without nnx.jit's
per-call Python graph traversal, which would be timed as framework overhead).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from parity import convert
from parity.bench.measure import Bench, CpuPeakRss
from parity.bench.spec import Case, Impl, canonical_weights, make_inputs


def setup(device: str, precision: str) -> dict:
    if precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    return {
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "jax_device": str(jax.devices(device)[0].device_kind) if check_device(device) is None else None,
    }


def reset_compiled() -> None:
    """Called by the worker between (case, pass) groups; jit caches are keyed by shape anyway."""
    jax.clear_caches()


def check_device(device: str) -> str | None:
    try:
        jax.devices(device)
    except RuntimeError as e:
        return f"jax has no {device} backend: {str(e).splitlines()[0]}"
    return None


def sync(out):
    jax.block_until_ready(out)


def _dpa_core(num_heads: int):
    def proj(x, p, params):
        # Canonical (out, in) weights: x @ Wᵀ + b.
        return jnp.einsum("BTE,FE->BTF", x, params[f"{p}.weight"]) + params[f"{p}.bias"]

    def f(params, rest, q, k, v):
        B, T, E = q.shape
        S = k.shape[1]
        N, H = num_heads, E // num_heads
        qh = proj(q, "q_proj", params).reshape(B, T, N, H)
        kh = proj(k, "k_proj", params).reshape(B, S, N, H)
        vh = proj(v, "v_proj", params).reshape(B, S, N, H)
        ctx = jax.nn.dot_product_attention(qh, kh, vh, scale=1.0 / math.sqrt(H), implementation="xla")  # (B, T, N, H)
        return proj(ctx.reshape(B, T, E), "out_proj", params), None

    return f


def _function(impl: Impl, case: Case, seed: int):
    """(f(params, rest, q, k, v) -> (out, weights|None), params, rest)."""
    sd = canonical_weights(case.embed, case.dtype, seed)
    nw = impl.need_weights
    if impl.name == "jax-dpa-core":
        return _dpa_core(case.heads), {k: jnp.asarray(a) for k, a in sd.items()}, {}
    if impl.name == "ours-jax":
        m = convert.to_jax(sd, case.heads)
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def f(params, rest, q, k, v):
            return nnx.merge(graphdef, params, rest)(q, k, v, need_weights=nw)

        return f, params, rest
    if impl.name == "flax-nnx-mha":
        m = convert.to_flax_nnx(sd, case.heads)
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def f(params, rest, q, k, v):
            mod = nnx.merge(graphdef, params, rest)
            out = mod(q, k, v, sow_weights=nw)
            weights = None
            if nw:
                # sow stores the (B, N, T, S) weights as an intermediate: return them, as ours does.
                weights = jax.tree.leaves(nnx.pop(mod, nnx.Intermediate))
            return out, weights

        return f, params, rest
    raise ValueError(f"unknown jax implementation {impl.name!r}")


def _program(f, pass_: str):
    if pass_ == "fwd":
        return jax.jit(f)

    def loss(params, rest, q, k, v):
        out, _ = f(params, rest, q, k, v)
        return out.astype(jnp.float32).sum()

    # Gradient w.r.t. parameters and all three inputs.
    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


def build(impl: Impl, case: Case, pass_: str, device: str, seed: int) -> Bench:
    if impl.mode != "jit":
        raise ValueError(f"jax runs under jit, not {impl.mode!r}")
    dev = jax.devices(device)[0]
    f, params, rest = _function(impl, case, seed)
    params, rest = jax.device_put((params, rest), dev)
    args = (params, rest, *jax.device_put(make_inputs(case, seed), dev))
    program = _program(f, pass_)
    holder = {}

    def aot_compile():
        holder["compiled"] = program.lower(*args).compile()

    def step():
        return holder["compiled"](*args)

    args2 = (params, rest, *jax.device_put(make_inputs(case.shrunk(), seed), dev))

    def recompile(clock):
        t0 = clock()
        program.lower(*args2).compile()
        return clock() - t0

    fingerprint = None
    if pass_ == "fwd":
        fingerprint = lambda out: float(jnp.abs(out[0].astype(jnp.float32)).mean())  # noqa: E731
    if device == "cpu":
        rss = CpuPeakRss()
        memory = lambda: rss(step, sync)  # noqa: E731
    else:
        def memory():
            out = step()
            sync(out)
            ma = holder["compiled"].memory_analysis()
            if ma is None:
                return None, "unavailable (no XLA memory analysis on this backend)", out
            total = ma.temp_size_in_bytes + ma.output_size_in_bytes
            return int(total), f"{device}: XLA memory_analysis temp + output bytes of the compiled program", out
    return Bench(
        step=step, sync=sync, aot_compile=aot_compile, recompile=recompile, fingerprint=fingerprint, memory=memory,
    )


def peak_gflops(dtype: str, sizes, device: str, timing, clock) -> tuple[float, int]:
    from parity.bench.measure import run_bench

    dev = jax.devices(device)[0]
    best = (0.0, 0)
    mm = jax.jit(lambda a, b: a @ b)
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.device_put(jax.random.normal(ka, (n, n), jnp.float32).astype(dtype), dev)
        b = jax.device_put(jax.random.normal(kb, (n, n), jnp.float32).astype(dtype), dev)
        compiled = mm.lower(a, b).compile()
        res = run_bench(Bench(step=lambda: compiled(a, b), sync=sync), timing, clock)
        best = max(best, (2 * n**3 / res["min_s"] / 1e9, n))
    return best
