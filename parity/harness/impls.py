"""Adapters: run every implementation on the same NumPy inputs, return NumPy results.

Ours are `mha_torch` and `mha_jax` in several modes; peers are the ecosystem's
own attention layers loaded with the same weights through `parity.convert`.
Each adapter returns plain NumPy arrays so the checks never see a framework.

`Fault` is the test-only injection hook: a planted bug in one framework's
implementation, so the harness's own tests can show a run turns red and the
divergence search names the right stage.

Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

import mha_jax.attention as jax_attention
import mha_torch.attention as torch_attention
from parity import convert
from parity.harness.matrix import Case, Inputs

FAULT_KINDS = ("transpose_q_weight", "wrong_scale", "flip_mask")


@dataclass(frozen=True)
class Fault:
    """A planted bug in one framework's implementation (used by the harness's tests only).

    transpose_q_weight  q_proj.weight is loaded transposed
    wrong_scale         the attention core scales scores by 2/sqrt(H) instead of 1/sqrt(H)
    flip_mask           the keep-mask reaches the module inverted (True = masked out)
    """

    framework: str  # "torch" | "jax"
    kind: str

    def __post_init__(self):
        if self.framework not in ("torch", "jax"):
            raise ValueError(f"fault framework must be 'torch' or 'jax', got {self.framework!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Impl:
    """One of our implementations in one execution mode."""

    name: str
    framework: str  # "torch" | "jax"
    mode: str  # "eager" | "jit" | "compile"
    fused: bool  # need_weights=False: SDPA / jax.nn.dot_product_attention / chunked path


OURS = (
    Impl("torch", "torch", "eager", False),
    Impl("torch-fused", "torch", "eager", True),
    Impl("torch-compile", "torch", "compile", False),
    Impl("jax", "jax", "eager", False),
    Impl("jax-jit", "jax", "jit", False),
    Impl("jax-fused", "jax", "jit", True),
)


@dataclass(frozen=True)
class Peer:
    name: str
    framework: str
    masked_rows: str  # the policy its fully masked rows follow
    note: str


PEERS = (
    Peer("torch.nn.MultiheadAttention", "torch", "nan", "bool attn_mask True = masked out; softmax of all -inf gives NaN rows"),
    Peer("F.scaled_dot_product_attention", "torch", "zero", "bool attn_mask True = attend; fully masked rows give 0"),
    Peer("flax.linen.MultiHeadDotProductAttention", "jax", "uniform", "mask True = attend; masked scores are finfo.min, so empty rows are uniform"),
    Peer("flax.nnx.MultiHeadAttention", "jax", "uniform", "mask True = attend; masked scores are finfo.min, so empty rows are uniform"),
    Peer("jax.nn.dot_product_attention", "jax", "uniform", "mask True = attend; softmax always in float32 (also for float64 inputs)"),
)


def _faulty_state_dict(sd: dict, faults, framework: str) -> dict:
    if Fault(framework, "transpose_q_weight") in faults:
        sd = dict(sd, **{"q_proj.weight": np.ascontiguousarray(sd["q_proj.weight"].T)})
    return sd


def _faulty_keep(keep, faults, framework: str):
    if keep is not None and Fault(framework, "flip_mask") in faults:
        return ~keep
    return keep


@contextlib.contextmanager
def planted(faults):
    """Swap the attention cores for wrong-scale ones while the run lasts (tests only).

    The modules look their core up as a module global at call time, so both the
    module's forward and the harness's stage-by-stage replay see the planted bug.
    """
    saved = []
    for fault in faults:
        if fault.kind != "wrong_scale":
            continue
        mod = torch_attention if fault.framework == "torch" else jax_attention
        for fn_name in ("attention_core", "fused_attention_core"):
            real = getattr(mod, fn_name)

            def wrong(q, k, v, keep=None, *, _real=real, **kwargs):
                return _real(q * 2, k, v, keep, **kwargs)

            saved.append((mod, fn_name, real))
            setattr(mod, fn_name, wrong)
    try:
        yield
    finally:
        for mod, fn_name, real in reversed(saved):
            setattr(mod, fn_name, real)


# ---------------------------------------------------------------- torch


class TorchSide:
    """Our torch module, torch.nn.MultiheadAttention and SDPA on one torch device."""

    def __init__(self, device: str, faults=()):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.faults = tuple(faults)

    def _t(self, x):
        return convert.numpy_to_tensor(x, self.device)

    def _keep(self, keep):
        keep = _faulty_keep(keep, self.faults, "torch")
        return None if keep is None else self._t(np.ascontiguousarray(keep))

    def module(self, sd, case: Case, masked_rows: str, mode: str = "eager"):
        m = convert.to_torch(_faulty_state_dict(sd, self.faults, "torch"), case.shape.N, masked_rows=masked_rows)
        m = m.to(self.device)
        if mode == "compile":
            m = self.torch.compile(m, fullgraph=True)
        return m

    def forward(self, impl: Impl, x: Inputs, case: Case, masked_rows: str):
        m = self.module(x.state_dict, case, masked_rows, impl.mode)
        with self.torch.no_grad():
            out, w = m(self._t(x.query), self._t(x.key), self._t(x.value), self._keep(x.keep), need_weights=not impl.fused)
        return convert.tensor_to_numpy(out), None if w is None else convert.tensor_to_numpy(w)

    def stages(self, impl: Impl, x: Inputs, case: Case, masked_rows: str) -> dict:
        """Replay the module stage by stage with its own layers and core (no hooks needed)."""
        s = case.shape
        m = self.module(x.state_dict, case, masked_rows)

        def heads(t):  # (B, L, E) -> (B, N, L, H)
            return t.view(t.shape[0], t.shape[1], s.N, s.H).transpose(1, 2)

        keep = self._keep(x.keep)
        with self.torch.no_grad():
            q, k, v = (heads(layer(self._t(a))) for layer, a in ((m.q_proj, x.query), (m.k_proj, x.key), (m.v_proj, x.value)))
            if impl.fused:
                context, w = torch_attention.fused_attention_core(q, k, v, keep, masked_rows=masked_rows), None
            else:
                context, w = torch_attention.attention_core(q, k, v, keep, masked_rows=masked_rows)
            context = context.transpose(1, 2).reshape(s.B, s.T, s.E)
            out = m.out_proj(context)
        got = {"q": q, "k": k, "v": v, "weights": w, "context": context, "output": out}
        return {name: convert.tensor_to_numpy(t) for name, t in got.items() if t is not None}

    def grads(self, impl: Impl, x: Inputs, case: Case, masked_rows: str) -> dict:
        m = self.module(x.state_dict, case, masked_rows, impl.mode)
        xs = [self._t(a).requires_grad_(True) for a in (x.query, x.key, x.value)]
        out, _ = m(*xs, self._keep(x.keep), need_weights=not impl.fused)
        (out * self._t(x.cotangent)).sum().backward()
        grads = {name: convert.tensor_to_numpy(t.grad) for name, t in zip(("query", "key", "value"), xs)}
        for name, p in m.named_parameters():
            grads[name.removeprefix("_orig_mod.")] = convert.tensor_to_numpy(p.grad)
        return grads

    def train(self, optimizer: str, hp: dict, steps: int, x: Inputs, case: Case, masked_rows: str):
        torch = self.torch
        m = self.module(x.state_dict, case, masked_rows)
        if optimizer == "adam":
            opt = torch.optim.Adam(
                m.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=0.0,
                amsgrad=False, maximize=False, foreach=False,
            )
        elif optimizer == "adamw":
            opt = torch.optim.AdamW(
                m.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["weight_decay"],
                amsgrad=False, maximize=False, foreach=False,
            )
        else:
            opt = torch.optim.SGD(
                m.parameters(), lr=hp["lr"], momentum=hp["momentum"], dampening=0.0, weight_decay=0.0,
                nesterov=False, maximize=False, foreach=False,
            )
        q, k, v, keep, target = self._t(x.query), self._t(x.key), self._t(x.value), self._keep(x.keep), self._t(x.target)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out, _ = m(q, k, v, keep)
            loss = ((out - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return np.array(losses), convert.from_torch(m)

    # ---- peers

    def peer(self, peer: Peer, x: Inputs, case: Case):
        torch = self.torch
        s = case.shape
        B, T, S, N, H, E = s.B, s.T, s.S, s.N, s.H, s.E
        q, k, v = self._t(x.query), self._t(x.key), self._t(x.value)
        keep = None if x.keep is None else self._t(np.ascontiguousarray(x.keep))
        with torch.no_grad():
            if peer.name == "torch.nn.MultiheadAttention":
                m = convert.to_torch_mha(x.state_dict, N).to(self.device)
                # Its bool mask has the opposite polarity, and a 3-D mask is [B*N, T, S].
                attn_mask = None if keep is None else (~keep).expand(B, N, T, S).reshape(B * N, T, S)
                out, w = m(q, k, v, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
                return convert.tensor_to_numpy(out), convert.tensor_to_numpy(w)
            sd = {name: self._t(a) for name, a in x.state_dict.items()}
            F = torch.nn.functional

            def proj(a, p, L):  # (B, L, E) -> (B, N, L, H)
                return F.linear(a, sd[f"{p}.weight"], sd[f"{p}.bias"]).view(B, L, N, H).transpose(1, 2)

            ctx = F.scaled_dot_product_attention(proj(q, "q_proj", T), proj(k, "k_proj", S), proj(v, "v_proj", S), attn_mask=keep)
            out = F.linear(ctx.transpose(1, 2).reshape(B, T, E), sd["out_proj.weight"], sd["out_proj.bias"])
            return convert.tensor_to_numpy(out), None


# ---------------------------------------------------------------- jax


class JaxSide:
    """Our nnx module (eager, jit, fused) and the flax/jax peers on one JAX device.

    The jitted functions are closures made per instance, so a run with planted
    faults never reuses a trace from a clean run in the same process.
    """

    def __init__(self, device, faults=()):
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        self.jax, self.jnp, self.nnx, self.optax = jax, jnp, nnx, optax
        self.device = device
        self.faults = tuple(faults)

        def forward_and_vjp(state, q, k, v, graphdef, keep, cot, paths):
            """For each path (need_weights True/False): output, weights and the gradients
            of sum(output * cot), all in one compiled program.

            XLA compiles dominate the run time on a CPU (~0.5 s each), so the jitted
            forward, the fused forward and their gradients share one compile.
            """
            results = []
            for need_weights in paths:

                def f(state, q, k, v, need_weights=need_weights):
                    return nnx.merge(graphdef, state)(q, k, v, keep, need_weights=need_weights)

                (out, w), vjp = jax.vjp(f, state, q, k, v)
                results.append((out, w, vjp((cot, None if w is None else jnp.zeros_like(w)))))
            return results

        self._jit = jax.jit(forward_and_vjp, static_argnums=(4, 7))
        self._results = {}  # (impl, case, dtype, policy) -> (out, w, grads) or the exception it raised

    def _a(self, x):
        return self.jax.device_put(np.asarray(x), self.device)

    def _keep(self, keep):
        keep = _faulty_keep(keep, self.faults, "jax")
        return None if keep is None else self._a(keep)

    def module(self, sd, case: Case, masked_rows: str):
        with self.jax.default_device(self.device):
            return convert.to_jax(_faulty_state_dict(sd, self.faults, "jax"), case.shape.N, masked_rows=masked_rows)

    def clear(self) -> None:
        self._results.clear()

    def _jitted(self, impl: Impl, x: Inputs, case: Case, masked_rows: str):
        """The jitted results of `impl`, computed together with the other jitted path.

        If the joint program fails, each path runs alone, so an error is charged
        to the path that raised it and the other still gets its rows.
        """
        def key(fused):
            return ("fused" if fused else "weights", case.name, x.query.dtype.name, masked_rows)

        if key(impl.fused) not in self._results:
            m = self.module(x.state_dict, case, masked_rows)
            graphdef, state = self.nnx.split(m)
            args = (self._a(x.query), self._a(x.key), self._a(x.value), graphdef, self._keep(x.keep), self._a(x.cotangent))

            def compute(paths):
                with self.jax.default_device(self.device):
                    results = self._jit(state, *args, paths)
                for need_weights, (out, w, (g_state, gq, gk, gv)) in zip(paths, results):
                    # A module holding the gradients as its parameters converts like any other.
                    grads = convert.from_jax(self.nnx.merge(graphdef, g_state))
                    grads.update(query=np.asarray(gq), key=np.asarray(gk), value=np.asarray(gv))
                    self._results[key(not need_weights)] = (np.asarray(out), None if w is None else np.asarray(w), grads)

            try:
                compute((True, False))
            except Exception:
                for need_weights in (True, False):
                    try:
                        compute((need_weights,))
                    except Exception as e:
                        self._results[key(not need_weights)] = e
        result = self._results[key(impl.fused)]
        if isinstance(result, Exception):
            raise result
        return result

    def forward(self, impl: Impl, x: Inputs, case: Case, masked_rows: str):
        if impl.mode != "eager":
            out, w, _ = self._jitted(impl, x, case, masked_rows)
            return out, w
        m = self.module(x.state_dict, case, masked_rows)
        with self.jax.default_device(self.device):
            out, w = m(self._a(x.query), self._a(x.key), self._a(x.value), self._keep(x.keep), need_weights=not impl.fused)
        return np.asarray(out), None if w is None else np.asarray(w)

    def stages(self, impl: Impl, x: Inputs, case: Case, masked_rows: str) -> dict:
        """Replay the module stage by stage with its own projections and core, eagerly."""
        s = case.shape
        m = self.module(x.state_dict, case, masked_rows)
        keep = self._keep(x.keep)
        with self.jax.default_device(self.device):
            dtype = self.jnp.dtype(x.query.dtype)
            q, k, v = (
                m._project(layer, self._a(a), dtype).reshape(s.B, a.shape[1], s.N, s.H)  # (B, L, N, H)
                for layer, a in ((m.q_proj, x.query), (m.k_proj, x.key), (m.v_proj, x.value))
            )
            if impl.fused:
                context = jax_attention.fused_attention_core(q, k, v, keep, masked_rows=masked_rows, precision=m.precision)
                w = None
            else:
                context, w = jax_attention.attention_core(q, k, v, keep, masked_rows=masked_rows, precision=m.precision)
            context = context.reshape(s.B, s.T, s.E)
            out = m._project(m.out_proj, context, dtype)
        got = {"q": q, "k": k, "v": v}
        got = {name: np.asarray(t).transpose(0, 2, 1, 3) for name, t in got.items()}  # (B, N, L, H) like the oracle
        got.update(context=np.asarray(context), output=np.asarray(out))
        if w is not None:
            got["weights"] = np.asarray(w)
        return got

    def grads(self, impl: Impl, x: Inputs, case: Case, masked_rows: str) -> dict:
        if impl.mode == "eager":
            raise ValueError("jax gradients are checked jitted only (eager jax.grad traces the same program op by op)")
        return self._jitted(impl, x, case, masked_rows)[2]

    def train(self, optimizer: str, hp: dict, steps: int, x: Inputs, case: Case, masked_rows: str):
        jax, jnp, nnx, optax = self.jax, self.jnp, self.nnx, self.optax
        if optimizer == "adam":
            tx = optax.adam(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], eps_root=0.0, nesterov=False)
        elif optimizer == "adamw":
            tx = optax.adamw(
                hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], eps_root=0.0,
                weight_decay=hp["weight_decay"], mask=None, nesterov=False,
            )
        else:
            tx = optax.sgd(hp["lr"], momentum=hp["momentum"], nesterov=False)
        m = self.module(x.state_dict, case, masked_rows)
        graphdef, params = nnx.split(m)
        q, k, v, keep, target = self._a(x.query), self._a(x.key), self._a(x.value), self._keep(x.keep), self._a(x.target)

        def loss_fn(params):
            out, _ = nnx.merge(graphdef, params)(q, k, v, keep)
            return jnp.mean((out - target) ** 2)

        @jax.jit
        def step(params, opt_state):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        losses = []
        with jax.default_device(self.device):
            opt_state = tx.init(params)
            for _ in range(steps):
                params, opt_state, loss = step(params, opt_state)
                losses.append(float(loss))
        return np.array(losses), convert.from_jax(nnx.merge(graphdef, params))

    # ---- peers

    def peer(self, peer: Peer, x: Inputs, case: Case):
        jax, jnp, nnx = self.jax, self.jnp, self.nnx
        s = case.shape
        B, T, S, N, H, E = s.B, s.T, s.S, s.N, s.H, s.E
        dtype = jnp.dtype(x.query.dtype)
        q, k, v = self._a(x.query), self._a(x.key), self._a(x.value)
        keep = None if x.keep is None else self._a(x.keep)  # (B, 1, T, S), True = attend
        with jax.default_device(self.device):
            if peer.name == "flax.linen.MultiHeadDotProductAttention":
                import flax.linen as nn

                m = nn.MultiHeadDotProductAttention(
                    num_heads=N, qkv_features=E, out_features=E, dtype=dtype, param_dtype=dtype, deterministic=True
                )
                variables = jax.tree.map(self._a, convert.to_flax_linen(x.state_dict, N))
                out, state = m.apply(variables, q, k, v, mask=keep, sow_weights=True, mutable=["intermediates"])
                (w,) = state["intermediates"]["attention_weights"]
                return np.asarray(out), np.asarray(w)
            if peer.name == "flax.nnx.MultiHeadAttention":
                m = convert.to_flax_nnx(x.state_dict, N, dtype=dtype)
                out, inter = nnx.capture(m, nnx.Intermediate)(q, k, v, mask=keep, deterministic=True, sow_weights=True)
                (w,) = inter["attention_weights"].get_value()
                return np.asarray(out), np.asarray(w)
            sd = {name: self._a(a) for name, a in x.state_dict.items()}

            def proj(a, p, L):  # (B, L, E) -> (B, L, N, H)
                return (jnp.einsum("BLE,FE->BLF", a, sd[f"{p}.weight"]) + sd[f"{p}.bias"]).reshape(B, L, N, H)

            ctx = jax.nn.dot_product_attention(proj(q, "q_proj", T), proj(k, "k_proj", S), proj(v, "v_proj", S), mask=keep)
            out = jnp.einsum("BTF,EF->BTE", ctx.reshape(B, T, E), sd["out_proj.weight"]) + sd["out_proj.bias"]
            return np.asarray(out), None
