"""Our torch module's factories, and how torch runs any registered implementation.

Imports torch, never jax. The torch peers' factories live with their libraries (parity.peers).
Every factory follows the contract in `parity.impls.registry`:
`factory(state_dict, num_heads, *, dtype, device[, masked_rows][, problem]) -> fn(params, q, k, v, mask)`.
Legend (see mha_spec): B T S N H E, K key/value heads.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call

from parity import convert
from parity.impls.registry import Implementation, layer_kwargs, mask_for
from parity.impls.validate import ImplementationError, check_decoder_signature, check_result, check_step, stages_dict
from parity.peers.common import MissingPackage

# ---------------------------------------------------------------- factories


def _ours(sd, num_heads, *, dtype, device, masked_rows, need_weights, problem=None):
    # problem: the layer's grouped heads and RoPE (the biases are the state dict's keys); None, as a
    # direct call may pass, is the layer the state dict describes without RoPE.
    layer = layer_kwargs(sd, num_heads, problem)
    m = convert.to_torch(sd, num_heads, masked_rows=masked_rows, **layer).to(device)

    def fn(params, query, key, value, mask, **positions):
        return functional_call(m, params, (query, key, value, mask), {"need_weights": need_weights, **positions})

    def intermediates(params, query, key, value, mask, **positions):
        kw = {"need_weights": need_weights, "return_intermediates": True, **positions}
        *_, stages = functional_call(m, params, (query, key, value, mask), kw)
        return stages

    fn.intermediates = intermediates
    return fn


ours_weights = functools.partial(_ours, need_weights=True)
ours_fused = functools.partial(_ours, need_weights=False)

# Our implementations whose decoder's cache is a StaticKVCache (written in place); a decoder only (decode=True): the
# decode check runs it, through `TorchRunner.decoder`, and its factory is the module's weights path.
STATIC_DECODERS = ("torch-static",)


class OursDecoder:
    """Our torch module decoding with its KV cache (eager): `empty` makes the cache, `call` runs T new tokens.

    NumPy in, NumPy out, the cache as the module returns it (mha_torch.kv_cache.KVCache). chunk: Llama 4's
    chunked layer's C, given to every call (None: a full layer). static: the cache is a `StaticKVCache`, written in
    place, so the cache a call was given is spent (its tensors are the returned one's): a prefix of it is
    continued once (`continues_twice` False)."""

    framework = "torch"

    def __init__(self, impl: Implementation, module, device, chunk: int | None = None, static: bool = False):
        self.impl, self.module, self.device, self.chunk, self.static = impl, module, device, chunk, static
        self.need_weights = impl.returns_weights

    @property
    def continues_twice(self) -> bool:
        """Whether a cache this decoder returned can be continued again after a call continued it (immutable)."""
        return not self.static

    def empty(self, batch: int, capacity: int, starts):
        return self.module.init_cache(batch, capacity, starts=torch.as_tensor(np.asarray(starts), dtype=torch.int64,
                                                                              device=self.device), static=self.static)

    def call(self, cache, x):
        """x (B, T, E) NumPy -> (output (B, T, E), {stage: array} with the new tokens' q..k_rot and the
        scores/weights over the cache's slots, the new cache)."""
        xt = convert.numpy_to_tensor(np.asarray(x), self.device)
        chunk = {} if self.chunk is None else {"chunk": self.chunk}
        with torch.no_grad():
            out, _, new, stages = self.module(xt, xt, xt, cache=cache, need_weights=self.need_weights,
                                              return_intermediates=True, **chunk)
        return (convert.tensor_to_numpy(out),
                {n: convert.tensor_to_numpy(t) for n, t in stages_dict(self.impl, stages).items()}, new)


# ---------------------------------------------------------------- running any implementation


@dataclass
class Built:
    impl: Implementation
    fn: object
    params: dict  # canonical name -> leaf tensor on the device
    num_heads: int
    dtype: np.dtype
    state: dict = field(default_factory=dict)  # the canonical NumPy state dict the parameters were made from
    changed: list = field(default_factory=list)  # what a call changed in place (inputs, parameters), until read
    positions: dict = field(default_factory=dict)  # {"positions", "key_positions"} tensors on a RoPE unit, passed to every call
    structure: dict = field(default_factory=dict)  # a structured implementation's masks as keywords, passed to every call
    padding: object = None  # with `structure`: the keep-mask (NumPy) it gets instead of the unit's, the rest (or None)


class TorchRunner:
    """Builds and runs registered torch implementations on one device; NumPy in, NumPy out.

    It reads the kernel a call ran by the profiler around that call (`observe`, `parity.kernel_ran`), checked
    against the kernel the implementation asks for: `requested_kernel(impl)` (the harness passes
    `parity.bench.torch_bench.kernel_label`); None: the reading alone."""

    framework = "torch"
    ours = "torch"  # our implementation a torch peer is judged against
    decode_how = "in one call"  # how our decoder's prompt runs (the decode rows say it)

    def __init__(self, device: str, requested_kernel=None):
        self.device = torch.device(device)
        self.requested_kernel = requested_kernel

    def t(self, a):
        return None if a is None else convert.numpy_to_tensor(np.asarray(a), self.device)

    def build(self, impl: Implementation, sd: dict, num_heads: int, masked_rows: str, problem=None,
              positions: dict | None = None, structure: tuple | None = None) -> Built:
        """problem: the unit's mha_spec.Problem (required when impl declares variants); positions:
        {"positions": (B, T), "key_positions": (B, S)} integer NumPy arrays on a RoPE unit, given to every call;
        structure: (keywords, padding) of a structured unit for an implementation declaring structured=True:
        the keywords (segment ids as int64 tensors) go to every call, with the padding keep-mask as its mask."""
        dtype = next(iter(sd.values())).dtype
        fn = impl.make(sd, num_heads, masked_rows, self.device, problem)
        if impl.mode == "compile":
            inner = fn
            fn = torch.compile(fn)
            fn.intermediates = getattr(inner, "intermediates", None)
        params = {k: self.t(a) for k, a in sd.items()}
        pos = {k: self.t(np.asarray(v, np.int64)) for k, v in (positions or {}).items() if v is not None}
        kw, padding = structure if structure is not None else ({}, None)
        kw = {k: self.t(np.asarray(v, np.int64)) if k.endswith("segment_ids") else v for k, v in kw.items()}
        return Built(impl, fn, params, num_heads, dtype, state=dict(sd), positions=pos, structure=kw, padding=padding)

    def _args(self, b: Built, query, key, value, keep, grad: bool = False):
        xs = [self.t(a).requires_grad_(grad) for a in (query, key, value)]
        mask = self.t(mask_for(b.impl, b.padding if b.structure else keep, b.num_heads, b.dtype))
        return xs, mask

    def _call(self, b: Built, xs, mask, fn=None, params=None):
        fn = fn or b.fn
        # Copies: a call that changes them spoils no other.
        kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in {**b.positions, **b.structure}.items()}
        if b.impl.uses_params:
            return fn(params or b.params, *xs, mask, **kw)
        return fn(*xs, mask, **kw)

    def _checked(self, b: Built, result, query, key):
        out, w = check_result(b.impl, result, torch.Tensor, query.shape, key.shape[1], b.num_heads, b.dtype)
        return out, w

    def call(self, b: Built, query, key, value, mask=None):
        """One call on tensors already on the device, unconverted and unchecked: what the benchmark times
        (with the positions given to `build`, if any)."""
        result = self._call(b, (query, key, value), mask)
        return tuple(result) if isinstance(result, (tuple, list)) else (result, None)

    def _fresh(self, b: Built, grad: bool = False) -> dict:
        """The parameters as new leaves: a call that changes them in place cannot spoil the next one."""
        return {k: p.detach().clone().requires_grad_(grad) for k, p in b.params.items()}

    def _record_changes(self, b: Built, call: str, xs, params, query, key, value) -> None:
        """Note (in b.changed) every input or parameter the call left different, bit for bit."""
        def same(t, a):
            return convert.tensor_to_numpy(t).tobytes() == np.ascontiguousarray(a).tobytes()

        names = [n for n, x, a in zip(("query", "key", "value"), xs, (query, key, value)) if not same(x, a)]
        if b.impl.uses_params:
            names += [n for n, p in params.items() if n in b.state and not same(p, b.state[n])]
        if names:
            b.changed.append(f"the {call} call changed {', '.join(names)} in place")

    def forward(self, b: Built, query, key, value, keep):
        out, w, _ = self._run(b, query, key, value, keep, None)
        return out, w

    @contextlib.contextmanager
    def observe(self, impl: Implementation, expected: bool = True):
        """`with runner.observe(impl) as seen: call()`; then `seen.kernel`: (kernel, note), the profiler's reading
        of what the calls in the block ran, checked against the kernel `impl` asks for where `expected` (by
        `requested_kernel`; else the reading alone)."""
        from parity import kernel_ran

        reading = types.SimpleNamespace(kernel=("", ""))
        with kernel_ran.torch_observer() as seen:
            yield reading
        requested = self.requested_kernel(impl) if expected and self.requested_kernel is not None else None
        reading.kernel = kernel_ran.torch_verdict(requested, seen.label)

    def forward_reading_kernel(self, b: Built, query, key, value, keep):
        """((output, weights), (kernel, note)): `forward`, with the kernel it ran read by the profiler around it."""
        with self.observe(b.impl) as seen:
            result = self.forward(b, query, key, value, keep)
        return result, seen.kernel

    def replays_jit(self, impl: Implementation) -> bool:
        """Whether `impl` is our jitted program run op by op (JAX's eager one): torch has none."""
        return False

    def joins(self, impl: Implementation) -> bool:
        """Whether `prefetch` computes `impl` with others in one program: torch runs each call on its own."""
        return False

    def prefetch(self, builts, query, key, value, keep, cotangent) -> None:
        """Nothing: each torch call runs eagerly when asked (see JaxRunner.prefetch)."""

    def decode_call_kernel(self, impl: Implementation, dec, cache, x):
        """None: a torch decode call's kernel is read around the call (`observe`)."""
        return None

    def decoder_kernel(self, b: Built, x, observed: tuple[str, str]) -> tuple[str, str]:
        """The kernel of a decoder's run (decode=True): the profiler's reading around it (`observed`)."""
        return observed

    def vjp(self, b: Built, query, key, value, keep, cotangent):
        """(output, weights, gradients) of ONE call: the output the gradients were taken from, and the
        gradients of sum(output * cotangent) w.r.t. query, key, value (and every parameter; None
        where autograd gave none)."""
        return self._run(b, query, key, value, keep, cotangent)

    def vjp_each(self, builts, inputs, keep, cotangent) -> list[list[tuple]]:
        """`vjp` of each implementation on each of `inputs` [(query, key, value), ...] with the same keep-mask
        and cotangent (eager: the same calls, differing only by their inputs). result[i][j]: builts[i] on inputs[j]."""
        return [[self.vjp(b, query, key, value, keep, cotangent) for query, key, value in inputs] for b in builts]

    def grads(self, b: Built, query, key, value, keep, cotangent) -> dict:
        """Gradients of sum(output * cotangent) w.r.t. query, key, value (and every parameter)."""
        return self.vjp(b, query, key, value, keep, cotangent)[2]

    def _run(self, b: Built, query, key, value, keep, cotangent):
        grad = cotangent is not None
        params = self._fresh(b, grad)
        xs, mask = self._args(b, query, key, value, keep, grad=grad)
        with torch.enable_grad() if grad else torch.no_grad():
            out, w = self._checked(b, self._call(b, xs, mask, params=params), query, key)
            grads = None
            if grad and out.requires_grad:  # an output cut off from every input and parameter has no gradients
                (out * self.t(cotangent)).sum().backward()
            if grad:
                grads = {n: x.grad for n, x in zip(("query", "key", "value"), xs)}
                if b.impl.uses_params:
                    grads.update({n: p.grad for n, p in params.items()})
                grads = {n: None if g is None else convert.tensor_to_numpy(g) for n, g in grads.items()}
        self._record_changes(b, "gradient" if grad else "forward", xs, params, query, key, value)
        return convert.tensor_to_numpy(out), None if w is None else convert.tensor_to_numpy(w), grads

    def intermediates(self, b: Built, query, key, value, keep) -> dict | None:
        fn = getattr(b.fn, "intermediates", None)
        if fn is None:
            return None
        params = self._fresh(b)
        xs, mask = self._args(b, query, key, value, keep)
        with torch.no_grad():
            got = self._call(b, xs, mask, fn, params=params)
        self._record_changes(b, "intermediates", xs, params, query, key, value)
        return {n: convert.tensor_to_numpy(t) for n, t in stages_dict(b.impl, got).items()}

    def decoder(self, impl: Implementation, sd: dict, num_heads: int, masked_rows: str, problem=None,
                chunk: int | None = None) -> OursDecoder:
        """Our module (impl: "torch", "torch-fused" or "torch-static", whose returns_weights picks the path) as a
        decoder; chunk: Llama 4's chunked layer's C (every call's); "torch-static" writes a `StaticKVCache` in place."""
        layer = layer_kwargs(sd, num_heads, problem)
        return OursDecoder(impl, convert.to_torch(sd, num_heads, masked_rows=masked_rows, **layer).to(self.device),
                           self.device, chunk, static=impl.name in STATIC_DECODERS)

    def decode_tokens(self, b: Built, x, positions) -> np.ndarray:
        """A decoder (decode=True) fed x (B, L, E) one token per call, with position (B,) int64 (-1: left
        padding) and its own cache (None at first): the outputs stacked (B, L, E). A call that raises or
        returns what the protocol does not allow is an ImplementationError naming the token."""
        check_decoder_signature(b.impl, b.fn)
        B, L, E = x.shape
        cache, outs = None, []
        with torch.no_grad():
            for t in range(L):
                xt = self.t(np.ascontiguousarray(x[:, t:t + 1]))
                pos = torch.as_tensor(np.asarray(positions[:, t], np.int64), device=self.device)
                try:
                    result = b.fn(b.params, xt, cache, pos) if b.impl.uses_params else b.fn(xt, cache, pos)
                    out, cache = check_step(b.impl, result, torch.Tensor, B, E, b.dtype)
                except MissingPackage:
                    raise
                except Exception as e:
                    raise ImplementationError(f"{b.impl.name}, token {t} of {L} (position {positions[:, t].tolist()}): "
                                              f"{type(e).__name__}: {e}") from e
                outs.append(convert.tensor_to_numpy(out))
        return np.concatenate(outs, axis=1)

    def train(self, b: Built, optimizer: str, hp: dict, steps: int, query, key, value, keep, target):
        """`steps` of torch.optim on mean((output - target)²); (losses, final parameters as NumPy)."""
        params = {k: p.detach().clone().requires_grad_(True) for k, p in b.params.items()}
        common = {"maximize": False, "foreach": False}
        if optimizer in ("adam", "adamw"):
            cls = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
            opt = cls(params.values(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
                      weight_decay=hp.get("weight_decay", 0.0), amsgrad=False, **common)
        else:
            opt = torch.optim.SGD(params.values(), lr=hp["lr"], momentum=hp["momentum"], dampening=0.0,
                                  weight_decay=0.0, nesterov=False, **common)
        xs, mask = self._args(b, query, key, value, keep)
        tgt = self.t(target)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out, _ = self._checked(b, self._call(b, xs, mask, params=params), query, key)
            loss = ((out - tgt) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return np.array(losses), {k: convert.tensor_to_numpy(p) for k, p in params.items()}
