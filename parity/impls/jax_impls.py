"""Our JAX module's factories, and how JAX runs any registered implementation.

Imports jax (and flax, optax), never torch. The JAX peers' factories live with their
libraries (parity.peers). Every factory follows the contract in
`parity.impls.registry`: `factory(state_dict, num_heads, *, dtype, device[, masked_rows][, problem])
-> fn(params, q, k, v, mask)`, a pure function of the canonical parameters, so that
`jax.grad` and `jax.jit` apply to any of them alike.
Legend (see mha_spec): B T S N H E, K key/value heads.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity import convert
from parity.impls.registry import Implementation, layer_kwargs, mask_for
from parity.impls.validate import ImplementationError, check_decoder_signature, check_result, check_step, stages_dict
from parity.peers.common import MissingPackage, linear_leaves, merged

# ---------------------------------------------------------------- factories


def module_leaves(params: dict) -> dict:
    """Our JAX module's parameters from canonical ones (traced ones too): each projection's kernel and bias,
    the QK-norm weights and the sinks where the layer has them -- every one of them, so a gradient or a
    training step reaches each (a leaf left to the module's own copy would be a constant)."""
    leaves = {p: linear_leaves(params, p) for p in convert.PROJECTIONS}
    for name in ("q_norm", "k_norm"):
        if f"{name}.weight" in params:
            leaves[name] = {"weight": params[f"{name}.weight"]}
    if "sinks" in params:
        leaves["sinks"] = params["sinks"]
    return leaves


def _ours(sd, num_heads, *, dtype, device, masked_rows, need_weights, problem=None):
    # problem: the layer's grouped heads and RoPE (the biases are the state dict's keys); None, as a
    # direct call may pass, is the layer the state dict describes without RoPE.
    layer = layer_kwargs(sd, num_heads, problem)
    with jax.default_device(device):
        graphdef, state = nnx.split(convert.to_jax(sd, num_heads, masked_rows=masked_rows, **layer))

    def module(params):
        return merged(graphdef, state, module_leaves(params))

    def fn(params, query, key, value, mask, **positions):
        return module(params)(query, key, value, mask, need_weights=need_weights, **positions)

    def intermediates(params, query, key, value, mask, **positions):
        *_, stages = module(params)(query, key, value, mask, need_weights=need_weights, return_intermediates=True,
                                    **positions)
        return stages

    fn.intermediates = intermediates
    return fn


ours_weights = functools.partial(_ours, need_weights=True)
ours_fused = functools.partial(_ours, need_weights=False)


class OursDecoder:
    """Our JAX module decoding with its KV cache under ONE jax.jit: `empty` makes the cache, `call` runs
    T new tokens. The cache is a pytree of fixed shapes whose lengths are data, so every single-token
    step after the first reuses one compiled program; `traces` records each trace's T (a retrace of
    the step shows there). NumPy in, NumPy out, the cache as the module returns it. chunk: Llama 4's chunked
    layer's C (None: a full layer), a constant of the jitted programs (a shape, never data)."""

    framework = "jax"
    continues_twice = True  # the cache is immutable: a prefix can be continued again

    def __init__(self, impl: Implementation, module, params: dict, device, chunk: int | None = None):
        self.impl, self.module, self.params, self.device, self.chunk = impl, module, params, device, chunk
        self.traces: list[int] = []
        graphdef, state = nnx.split(module)
        need_weights = impl.returns_weights
        kw = {} if chunk is None else {"chunk": chunk}  # closed over: every trace's constant

        def step(params, cache, x):
            self.traces.append(x.shape[1])  # runs once per trace
            m = merged(graphdef, state, module_leaves(params))
            out, _, new, stages = m(x, x, x, cache=cache, need_weights=need_weights, return_intermediates=True, **kw)
            return out, new, stages_dict(impl, stages)

        self._step = jax.jit(step)
        self.program = self._step  # public: program(params, cache, x) -> (out, new cache, stages), traced by the decode check

    def empty(self, batch: int, capacity: int, starts):
        with jax.default_device(self.device):
            return self.module.init_cache(batch, capacity, starts=np.asarray(starts, np.int32))

    def call(self, cache, x):
        """x (B, T, E) NumPy -> (output (B, T, E), {stage: array}, the new cache)."""
        with jax.default_device(self.device):
            out, new, stages = self._step(self.params, cache, jax.device_put(np.asarray(x), self.device))
        return np.asarray(out), {n: np.asarray(a) for n, a in stages.items()}, new


# ---------------------------------------------------------------- running any implementation


@dataclass
class Built:
    impl: Implementation
    fn: object
    params: dict  # canonical name -> jax array on the device
    num_heads: int
    dtype: np.dtype
    cache: dict = field(default_factory=dict)  # (kind, inputs id) -> results of one compiled program
    changed: list = field(default_factory=list)  # always empty: JAX arrays cannot be changed in place
    positions: dict = field(default_factory=dict)  # {"positions", "key_positions"} int32 arrays on a RoPE unit
    structure: dict = field(default_factory=dict)  # a structured implementation's masks as keywords, passed to every call
    padding: object = None  # with `structure`: the keep-mask (NumPy) it gets instead of the unit's, the rest (or None)


class JaxRunner:
    """Builds and runs registered JAX implementations on one device; NumPy in, NumPy out.

    A jit implementation's forward pass and its gradients come from one compiled
    program (XLA compiles dominate a CPU run: ~0.5 s each), computed once per inputs.
    """

    framework = "jax"
    ours = "jax-jit"  # our implementation a JAX peer is judged against
    decode_how = "in one call, under jax.jit"  # how our decoder's prompt runs (the decode rows say it)

    def __init__(self, device):
        self.device = device

    def a(self, x):
        return None if x is None else jax.device_put(np.asarray(x), self.device)

    def build(self, impl: Implementation, sd: dict, num_heads: int, masked_rows: str, problem=None,
              positions: dict | None = None, structure: tuple | None = None) -> Built:
        """problem: the unit's mha_spec.Problem (required when impl declares variants); positions:
        {"positions": (B, T), "key_positions": (B, S)} integer NumPy arrays on a RoPE unit, given to every call
        (int32: JAX's integer without x64; positions are small); structure: (keywords, padding) of a structured
        unit for an implementation declaring structured=True: the keywords (segment ids as int32 arrays) go to
        every call, with the padding keep-mask as its mask."""
        dtype = next(iter(sd.values())).dtype
        fn = impl.make(sd, num_heads, masked_rows, self.device, problem)
        pos = {k: self.a(np.asarray(v, np.int32)) for k, v in (positions or {}).items() if v is not None}
        kw, padding = structure if structure is not None else ({}, None)
        kw = {k: self.a(np.asarray(v, np.int32)) if k.endswith("segment_ids") else v for k, v in kw.items()}
        return Built(impl, fn, {k: self.a(v) for k, v in sd.items()}, num_heads, dtype, positions=pos, structure=kw,
                     padding=padding)

    def _keep(self, b: Built, keep):
        """The mask `b` is given, in its convention: the unit's keep-mask, or a structured one's padding."""
        return self.a(mask_for(b.impl, b.padding if b.structure else keep, b.num_heads, b.dtype))

    def _call(self, b: Built, fn, params, xs, mask):
        kw = {**b.positions, **b.structure}
        return fn(params, *xs, mask, **kw) if b.impl.uses_params else fn(*xs, mask, **kw)

    def _checked(self, b: Built, result, q_shape, S):
        return check_result(b.impl, result, jax.Array, q_shape, S, b.num_heads, b.dtype)

    def _program(self, b: Built, with_grads: bool, q_shape, S):
        """f(params, q, k, v, mask, cot) -> (out, weights, grads | None); not yet jitted."""

        def forward(params, q, k, v, mask):
            return self._checked(b, self._call(b, b.fn, params, (q, k, v), mask), q_shape, S)

        def program(params, q, k, v, mask, cot):
            if not with_grads:
                return (*forward(params, q, k, v, mask), None)
            (out, w), vjp = jax.vjp(lambda p, q, k, v: forward(p, q, k, v, mask), params, q, k, v)
            d_params, dq, dk, dv = vjp((cot, None if w is None else jnp.zeros_like(w)))
            grads = {"query": dq, "key": dk, "value": dv, **(d_params if b.impl.uses_params else {})}
            return out, w, grads

        return program

    def _jit(self, b: Built, with_grads: bool) -> bool:
        """jit mode is jitted, except a peer's forward-only check: op by op is cheaper than an
        XLA compile for one call (the benchmark always jits)."""
        return b.impl.mode == "jit" and (with_grads or b.impl.role != "peer")

    def _store(self, b: Built, kind: str, query, result) -> tuple:
        result = self._numpy(result)
        b.cache[(kind, id(query))] = result
        return result

    def _device_args(self, b: Built, query, key, value, keep, cotangent):
        xs = [self.a(x) for x in (query, key, value)]
        return xs, self._keep(b, keep), None if cotangent is None else self.a(cotangent)

    def _results(self, b: Built, query, key, value, keep, cotangent=None):
        kind = "grads" if cotangent is not None else "forward"
        for k in ((kind, id(query)), ("grads", id(query))):  # a gradient run also answers the forward pass
            if k in b.cache:
                return b.cache[k]
        xs, mask, cot = self._device_args(b, query, key, value, keep, cotangent)
        program = self._program(b, cotangent is not None, query.shape, key.shape[1])
        if self._jit(b, cotangent is not None):
            program = jax.jit(program)
        with jax.default_device(self.device):
            return self._store(b, kind, query, program(b.params, *xs, mask, cot))

    def prefetch(self, builts, query, key, value, keep, cotangent) -> None:
        """Forward and gradients of several jit implementations in ONE compiled program, cached
        for the forward and gradient checks (XLA compiles dominate a CPU run: ~0.5 s each).
        If the joint program fails, nothing is cached and each computes alone (its own error)."""
        builts = [b for b in builts if self._jit(b, True) and ("grads", id(query)) not in b.cache]
        if not builts:
            return
        args = [self._device_args(b, query, key, value, keep, cotangent) for b in builts]
        try:
            with jax.default_device(self.device):
                results = self._joint(builts, query.shape, key.shape[1])([b.params for b in builts], args)
        except Exception:  # noqa: BLE001 - each implementation then reports its own error
            return
        for b, result in zip(builts, results):
            self._store(b, "grads", query, result)

    def _joint(self, builts, q_shape, S):
        """The jitted program of several jit implementations' forward and gradients together, made once per
        (implementations, shapes) and kept with the first one's results: a later call with other inputs of
        the same shapes (the leak check's) runs the same compiled program, without compiling again."""
        key = ("joint", tuple(id(b) for b in builts), tuple(q_shape), S)
        if key not in builts[0].cache:
            programs = [self._program(b, True, q_shape, S) for b in builts]

            def joint(params, args):
                return [p(ps, *xs, mask, cot) for p, ps, (xs, mask, cot) in zip(programs, params, args)]

            builts[0].cache[key] = jax.jit(joint)
        return builts[0].cache[key]

    def vjp_each(self, builts, inputs, keep, cotangent) -> list[list[tuple]]:
        """(output, weights, gradients) of each implementation on each of `inputs` [(query, key, value), ...]
        with the same keep-mask and cotangent, each implementation running ONE program for all of them: the
        jit implementations one compiled program together (`prefetch`'s, when it ran them), called once per
        input (so two calls differ only by their inputs, never by the program: the leak check compares them
        bit for bit); eager ones op by op. result[i][j]: builts[i] on inputs[j]. The results are not cached."""
        jitted = [b for b in builts if self._jit(b, True)]
        out = {id(b): [] for b in builts}
        q_shape, S = inputs[0][0].shape, inputs[0][1].shape[1]
        programs = {id(b): self._program(b, True, q_shape, S) for b in builts if not self._jit(b, True)}
        compiled = self._joint(jitted, q_shape, S) if jitted else None
        with jax.default_device(self.device):
            for query, key, value in inputs:
                if jitted:
                    args = [self._device_args(b, query, key, value, keep, cotangent) for b in jitted]
                    for b, result in zip(jitted, compiled([b.params for b in jitted], args)):
                        out[id(b)].append(self._numpy(result))
                for b in builts:
                    if not self._jit(b, True):
                        xs, mask, cot = self._device_args(b, query, key, value, keep, cotangent)
                        out[id(b)].append(self._numpy(programs[id(b)](b.params, *xs, mask, cot)))
        return [out[id(b)] for b in builts]

    @staticmethod
    def _numpy(result) -> tuple:
        out, w, grads = result
        return (np.asarray(out), None if w is None else np.asarray(w),
                None if grads is None else {n: np.asarray(g) for n, g in grads.items()})

    def call(self, b: Built, query, key, value, mask=None, params=None):
        """One traceable call on device arrays, unchecked: what the benchmark jits and times."""
        result = self._call(b, b.fn, b.params if params is None else params, (query, key, value), mask)
        return tuple(result) if isinstance(result, (tuple, list)) else (result, None)

    def forward(self, b: Built, query, key, value, keep):
        out, w, _ = self._results(b, query, key, value, keep)
        return out, w

    def grads(self, b: Built, query, key, value, keep, cotangent) -> dict:
        return self._results(b, query, key, value, keep, cotangent)[2]

    @contextlib.contextmanager
    def observe(self, impl: Implementation, expected: bool = True):
        """`with runner.observe(impl) as seen: call()`: nothing is observed around a JAX call (its kernel is
        read from its program's trace: `forward_reading_kernel`, `decode_call_kernel`); `seen.kernel` stays
        ("", "")."""
        yield types.SimpleNamespace(kernel=("", ""))

    def forward_reading_kernel(self, b: Built, query, key, value, keep):
        """((output, weights), (kernel, note)): `forward`, and the kernel read from its forward program's jaxpr
        (`parity.kernel_ran.jax_row_kernel`: a trace, no compile); ("", "") where the reading fails."""
        from parity import kernel_ran

        result = self.forward(b, query, key, value, keep)
        try:
            xs, mask, _ = self._device_args(b, query, key, value, keep, None)
            program = self._program(b, False, query.shape, key.shape[1])
            # The mask is a constant of the traced program, as in the forward that ran: a peer that reads
            # it as causal / segment ids (the Pallas kernels) can, and no kernel choice depends on its values.
            kernel = kernel_ran.jax_row_kernel(lambda params, *xs: program(params, *xs, mask, None), (b.params, *xs),
                                               self.device, ours=b.impl.role == "ours",
                                               need_weights=b.impl.returns_weights)
        except Exception:  # noqa: BLE001 - the forward ran; only the reading failed: the field stays ""
            kernel = ("", "")
        return result, kernel

    def replays_jit(self, impl: Implementation) -> bool:
        """Whether `impl` is our jitted program run op by op (our eager JAX): the jit one's rows check it."""
        return impl.role == "ours" and impl.mode == "eager"

    def joins(self, impl: Implementation) -> bool:
        """Whether `prefetch` computes `impl` with others in one compiled program: the jit implementations."""
        return impl.mode == "jit"

    def decode_call_kernel(self, impl: Implementation, dec, cache, x) -> tuple[str, str]:
        """The kernel one call of our decoder `dec` ran, from the given `cache` on x (B, T, E): read from the
        jaxpr of that call's program (`parity.kernel_ran`: a trace, no compile), checked against the module's
        own choice; ("", "") where the reading fails."""
        from parity import kernel_ran

        try:
            xs = jax.device_put(np.asarray(x), dec.device)
            return kernel_ran.jax_row_kernel(lambda p, c, x: dec.program(p, c, x)[0], (dec.params, cache, xs),
                                             dec.device, ours=True, need_weights=impl.returns_weights)
        except Exception:  # noqa: BLE001 - the calls ran; only the reading failed: the field stays ""
            return ("", "")

    def decoder_kernel(self, b: Built, x, observed: tuple[str, str]) -> tuple[str, str]:
        """The kernel of a decoder's run (decode=True): what its first step's trace runs (`decode_engine`)."""
        return self.decode_engine(b, x), ""

    def vjp(self, b: Built, query, key, value, keep, cotangent):
        """(output, weights, gradients) of one program: the output the gradients were taken from."""
        return self._results(b, query, key, value, keep, cotangent)

    def intermediates(self, b: Built, query, key, value, keep) -> dict | None:
        fn = getattr(b.fn, "intermediates", None)
        if fn is None:
            return None
        xs = [self.a(x) for x in (query, key, value)]
        mask = self._keep(b, keep)
        with jax.default_device(self.device):
            got = self._call(b, fn, b.params, xs, mask)
        return {n: np.asarray(t) for n, t in stages_dict(b.impl, got).items()}

    def decoder(self, impl: Implementation, sd: dict, num_heads: int, masked_rows: str, problem=None,
                chunk: int | None = None) -> OursDecoder:
        """Our module (impl: "jax-jit" or "jax-fused", whose returns_weights picks the path) as a jitted decoder;
        chunk: Llama 4's chunked layer's C, a constant of its programs."""
        layer = layer_kwargs(sd, num_heads, problem)
        with jax.default_device(self.device):
            module = convert.to_jax(sd, num_heads, masked_rows=masked_rows, **layer)
        return OursDecoder(impl, module, {k: self.a(v) for k, v in sd.items()}, self.device, chunk)

    def decode_tokens(self, b: Built, x, positions) -> np.ndarray:
        """A decoder (decode=True) fed x (B, L, E) one token per call, with position (B,) int32 (-1: left
        padding) and its own cache (None at first; mode "jit": the call under jax.jit): the outputs
        stacked (B, L, E). A call that raises or returns what the protocol does not allow is an
        ImplementationError naming the token."""
        check_decoder_signature(b.impl, b.fn)
        fn = jax.jit(b.fn) if b.impl.mode == "jit" else b.fn
        B, L, E = x.shape
        cache, outs = None, []
        with jax.default_device(self.device):
            for t in range(L):
                xt = self.a(np.ascontiguousarray(x[:, t:t + 1]))
                pos = self.a(np.asarray(positions[:, t], np.int32))
                try:
                    result = fn(b.params, xt, cache, pos) if b.impl.uses_params else fn(xt, cache, pos)
                    out, cache = check_step(b.impl, result, jax.Array, B, E, b.dtype)
                except MissingPackage:
                    raise
                except Exception as e:
                    raise ImplementationError(f"{b.impl.name}, token {t} of {L} (position {positions[:, t].tolist()}): "
                                              f"{type(e).__name__}: {e}") from e
                outs.append(np.asarray(out))
        return np.concatenate(outs, axis=1)

    def decode_engine(self, b: Built, x) -> str:
        """What a decoder's first step runs (`parity.kernel_ran.jax_engine` of its trace on x's first token
        from no cache, no compile), or "" when it cannot be traced."""
        from parity import kernel_ran

        xt = self.a(np.ascontiguousarray(x[:, :1]))
        pos = self.a(np.zeros(x.shape[0], np.int32))
        args = (b.params, xt, None, pos) if b.impl.uses_params else (xt, None, pos)
        try:
            with jax.default_device(self.device):
                # The inputs are constants of the trace, as in the eager calls that ran: a decoder that
                # reads them as values (the Pallas one reads its positions) can.
                return kernel_ran.jax_program_engine(lambda: b.fn(*args)[0], device=self.device)  # the output, not the cache
        except Exception:  # noqa: BLE001 - the decode ran; only the reading failed
            return ""

    def train(self, b: Built, optimizer: str, hp: dict, steps: int, query, key, value, keep, target):
        """`steps` of optax on mean((output - target)²); (losses, final parameters as NumPy)."""
        import optax

        if optimizer in ("adam", "adamw"):
            kw = {"b1": hp["b1"], "b2": hp["b2"], "eps": hp["eps"], "eps_root": 0.0, "nesterov": False}
            tx = optax.adam(hp["lr"], **kw) if optimizer == "adam" else optax.adamw(
                hp["lr"], weight_decay=hp["weight_decay"], mask=None, **kw)
        else:
            tx = optax.sgd(hp["lr"], momentum=hp["momentum"], nesterov=False)
        xs = [self.a(x) for x in (query, key, value)]
        mask = self._keep(b, keep)
        tgt = self.a(target)

        def loss_fn(params):
            out, _ = self._checked(b, self._call(b, b.fn, params, xs, mask), query.shape, key.shape[1])
            return jnp.mean((out - tgt) ** 2)

        @jax.jit
        def step(params, opt_state):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        params, losses = b.params, []
        with jax.default_device(self.device):
            opt_state = tx.init(params)
            for _ in range(steps):
                params, opt_state, loss = step(params, opt_state)
                losses.append(float(loss))
        return np.array(losses), {k: np.asarray(v) for k, v in params.items()}
