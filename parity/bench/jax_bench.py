"""The JAX implementations under test, from the registry. Imports jax, never torch.

Every registered implementation is a pure function of (params, q, k, v) under jax.jit, of
(params, x) on a self-attention case (our module is split/merged inside the program rather
than called through nnx.jit: the same XLA program without nnx.jit's per-call Python graph
traversal, which would be timed as framework overhead).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import kernels
from mha_spec import Kernel

from parity import kernel_ran
from parity.bench.measure import Bench, CpuPeakRss
from parity.bench.spec import DTYPES, BenchCase, canonical_weights, impl_keep_mask, make_inputs, rope_positions, structure_for
from parity.env import pin_jax
from parity.impls import Implementation
from parity.impls.jax_impls import JaxRunner
from parity.impls.registry import mask_for


def setup(device: str, precision: str) -> dict:
    return {
        **pin_jax(precision == "highest"),
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


def _program(runner: JaxRunner, built, pass_: str, self_attention: bool):
    """The registered implementation (the harness's adapter) as a jitted program of the mask (the case's
    keep-mask in the implementation's convention, or None: an argument, not a constant) and of the
    inputs: f(params, q, k, v, mask), or f(params, x, mask) on a self-attention case, x given as
    query, key and value (`BenchCase.self_attention`)."""

    if self_attention:
        def f(params, x, mask):
            return runner.call(built, x, x, x, mask, params=params)
    else:
        def f(params, q, k, v, mask):
            return runner.call(built, q, k, v, mask, params=params)

    if pass_ == "fwd":
        return jax.jit(f)

    def loss(params, *inputs):
        out, _ = f(params, *inputs)
        return out.astype(jnp.float32).sum()

    # Gradient w.r.t. every input (x once, or query, key and value) and the parameters where fn computes
    # with them (uses_params; else it computes none, as torch's step: `gradient_names`).
    inputs = (1,) if self_attention else (1, 2, 3)
    return jax.jit(jax.grad(loss, argnums=(0, *inputs) if built.impl.uses_params else inputs))


def _args(built, case: BenchCase, seed: int, dev) -> tuple:
    """(params, q, k, v, mask), or (params, x, mask) on a self-attention case, on the device."""
    mask = mask_for(built.impl, impl_keep_mask(built.impl, case), case.heads, DTYPES[case.dtype])
    inputs = make_inputs(case, seed)[:1 if case.self_attention else 3]
    return (built.params, *jax.device_put(inputs, dev), None if mask is None else jax.device_put(mask, dev))


def build(impl: Implementation, case: BenchCase, pass_: str, device: str, seed: int) -> Bench:
    if impl.mode != "jit":
        raise ValueError(f"the benchmark runs JAX under jit, not {impl.mode!r}")
    dev = jax.devices(device)[0]
    runner = JaxRunner(dev)
    sd = canonical_weights(case.config, case.dtype, seed)

    def built_for(c: BenchCase):
        return runner.build(impl, sd, c.heads, masked_rows="nan", problem=c.problem, positions=rope_positions(c),
                            structure=structure_for(impl, c))

    built = built_for(case)
    args = _args(built, case, seed, dev)
    program = _program(runner, built, pass_, case.self_attention)
    holder = {}

    def aot_compile():
        with kernel_ran.jax_choices() as made:  # what our module's dispatch chose while tracing
            traced = program.trace(*args)  # its jaxpr says whether a Pallas or cuDNN kernel is in the program
        holder["jaxpr"], holder["choices"] = traced.jaxpr, made
        holder["compiled"] = traced.lower().compile()

    def step():
        return holder["compiled"](*args)

    shrunk = case.shrunk()
    args2 = _args(built, shrunk, seed, dev)
    # RoPE or a structured mask: the positions, window and segment ids (constants of the program) have
    # the new lengths, so it is built anew.
    anew = case.config.rope or built.structure
    program2 = _program(runner, built_for(shrunk), pass_, shrunk.self_attention) if anew else program

    def recompile(clock):
        t0 = clock()
        program2.lower(*args2).compile()
        return clock() - t0

    # fwd+bwd: its forward, for the check
    forward = None if pass_ == "fwd" else _program(runner, built, "fwd", case.self_attention)

    def output():
        out = holder["compiled"](*args) if forward is None else forward(*args)
        return np.asarray(out[0].astype(jnp.float32))

    requested = kernel_of(impl, case, dev)

    def mask_path():
        return None if "choices" not in holder else jax_mask_path(case, built, holder["choices"])

    return Bench(
        step=step, sync=sync, aot_compile=aot_compile, recompile=recompile, output=output,
        memory=_memory_probe(device, step, holder), mask_path=mask_path,
        kernel=kernel_ran.BenchKernel(requested, lambda: _ran(holder, requested, dev)),
        gradients=None if pass_ == "fwd" else functools.partial(gradient_names, case, built),
    )


def _memory_probe(device: str, step, holder: dict):
    """One call under the peak-memory probe: (bytes, source, the call's output). A CPU's RSS growth, else
    the compiled program's (holder["compiled"]) XLA memory analysis."""
    if device == "cpu":
        rss = CpuPeakRss()
        return lambda: rss(step, sync)

    def memory():
        out = step()
        sync(out)
        ma = holder["compiled"].memory_analysis()
        if ma is None:
            return None, "unavailable (no XLA memory analysis on this backend)", out
        total = ma.temp_size_in_bytes + ma.output_size_in_bytes
        return int(total), f"{device}: XLA memory_analysis temp + output bytes of the compiled program", out

    return memory


def gradient_names(case: BenchCase, built, grads) -> dict[str, np.ndarray]:
    """A fwd+bwd step's gradients (`_program`: the parameters' dict first where it computes them, then the
    inputs') by the names torch's step gives them (`torch_bench.gradient_names`)."""
    grads = list(grads)
    named = {}
    if built.impl.uses_params:
        named.update(grads.pop(0))
    inputs = ["x"] if case.self_attention else ["query", "key", "value"]
    if len(grads) != len(inputs):
        raise ValueError(f"{built.impl.name}: {len(grads)} input gradients for {inputs}")
    named = {**dict(zip(inputs, grads)), **named}
    return {n: np.asarray(g.astype(jnp.float32)) for n, g in named.items()}


def jax_mask_path(case: BenchCase, built, made: list) -> str:
    """The row's `mask_path` (`spec.MASK_PATHS`). Our module: by the kernel its dispatch chose while the program
    was traced (`kernel_ran.jax_choices`; none: the weights path's einsum core): the chunked kernel takes a causal or windowed
    band as structure and skips the key blocks a dense mask leaves empty (`mha_jax.chunked.block_census`), a
    Pallas kernel takes the structure, the others apply a dense mask to every score. Any other implementation:
    what it was given, the structure (a structured layer of the user's) or a dense mask."""
    if case.mask == "none":
        return "none"
    # a chunk is no band: the chunked kernel gets its keep-mask dense (`Structure.band` is None with one)
    band = any(k in built.structure for k in ("is_causal", "window")) and "chunk" not in built.structure
    if built.impl.family != "ours-jax":
        return "structure" if built.structure else "dense"
    kernel = made[0].kernel if made else kernels.EINSUM
    if kernel == kernels.CHUNKED:
        return "structure" if band else "blocks-skipped"
    if kernel in kernels.PALLAS_KERNELS:
        return "structure"
    return "dense"


def _ran(holder: dict, requested: str, dev) -> tuple[str, str] | None:
    """(kernel, message) from the compiled program (`kernel_ran.jax_engine`): read once, after the
    compile, outside the timed calls. A peer whose label is no kernel name gets the engine that ran. Our
    module's request is the choice its dispatch made while tracing (it sees the structure it was given)."""
    if "compiled" not in holder:
        return None
    made = holder.get("choices")
    if made:
        requested = kernels.kernel_label(made[0], source=True)
    ran = kernel_ran.jax_engine(holder["jaxpr"], holder["compiled"].as_text() or "", dev.platform)
    return kernel_ran.jax_verdict(requested, ran)


# The peers whose kernel is one of mha_jax's: both call jax.nn.dot_product_attention(implementation="xla").
PEER_KERNELS = {"jax-dpa-core": kernels.DPA_XLA, "jax-dpa-gqa": kernels.DPA_XLA}


def kernel_of(impl: Implementation, case: BenchCase, device) -> str:
    """What runs inside, as `mha_jax.kernels.kernel_label` spells it with its source. Our module: the
    choice `kernels.module_choice` makes for the case (what the module's dispatch asks), e.g.
    "chunked:512x512 (built-in)", "einsum (weights)"; a peer in PEER_KERNELS: its kernel; any other
    implementation: its family or name."""
    if impl.family == "ours-jax":
        c = kernels.module_choice(case.batch, case.heads, case.seq_q, case.seq_k, case.config.head_size,
                                  jnp.dtype(case.dtype), has_mask=case.mask != "none", need_weights=impl.returns_weights,
                                  device=device, kv_heads=case.config.kv_heads,
                                  score_mods=kernels.score_mods_of(scale=case.config.scale, softcap=case.config.softcap,
                                                                   sinks=case.config.sinks))
        return kernels.kernel_label(c, source=True)
    name = impl.family or impl.name
    return str(Kernel(PEER_KERNELS.get(name, name)))


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
