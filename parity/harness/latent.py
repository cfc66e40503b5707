"""The latent harness: DeepSeek V2/V3 multi-head latent attention (MLA) judged as the rest is.

Cases (`LatentCase`: a `mha_spec.LatentAttentionConfig`, B, T, a mask, a masked-row policy, where the RoPE
positions start, whether to decode) draw their inputs seeded (`draw`: float64, each dtype rounds them). Every
implementation (`LatentImpl`: ours in torch -- eager and fused (SDPA) -- and JAX, transformers' DeepseekV3Attention
/ DeepseekV2Attention as a peer (`parity.peers.hf_deepseek`), a user's torch layer through `torch_impl`) is checked against the float64 oracle
`parity.reference_mla`:

  forward   the output vs `reference_mla.forward`; on failure the first diverging stage of the implementation's
            intermediates (`STAGES`, the names `mha_torch.LatentStages` uses) against the oracle's;
  gradient  d_inputs and every weight's gradient vs `reference_mla.backward`;
  decode    a prefill of T // 2 tokens then one token per call through a latent cache, naive and absorbed, vs
            `reference_mla.decode` (on failure the first call that diverges: "prefill", "step i"), the absorbed
            decode vs the naive one and the naive decode vs the implementation's own causal forward;
  peers     the same three for transformers' layer (float32 and float64; its cos/sin, norms and softmax are
            float32, so its float64 rows are judged at float32's bound: computes_in).

Judging is `parity.harness.judge.judge` with `parity.tolerances.TOLERANCES`: the three-way bound, k times the error
of the yardstick -- the oracle's maths in the dtype (`reference_mla.forward(dtype=...)`, each stage rounded as a
layer stores it), in float32/float64 also on inputs and weights nudged by eps (`tolerances.yardstick_runs`).
The gradients' yardstick is the float64 backward on inputs, weights and cotangent nudged by the yardstick dtype's
eps (GRADIENT_DRAWS runs): `reference_mla` has no rounded backward.
"""

from __future__ import annotations

import inspect
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, LatentAttentionConfig, RopeScaling
from parity import reference_mla
from parity.dtypes import eps, numpy_dtype
from parity.harness.judge import judge, margin
from parity.harness.report import Report, Row
from parity.tolerances import TOLERANCES, envelope, errors, yardstick_dtype, yardstick_runs

LATENT_CHECKS = ("forward", "gradient", "decode", "peers")
LATENT_DTYPES = ("float64", "float32", "bfloat16")
MASKS = ("causal", "padding", "left-padding", "none")
STAGES = ("q", "latent", "k", "v", "q_rot", "k_rot", "scores", "weights", "context", "output")
GRADIENT_DRAWS = 4  # nudged runs of the gradients' yardstick (module docstring)


@dataclass(frozen=True)
class LatentCase:
    """One latent case. mask: "causal" (is_causal), "padding" (causal AND right padding: row b keeps its first
    T - b keys, so no row is empty), "left-padding" (causal AND row b's first b keys masked: its first b queries
    keep nothing, so `masked_rows` decides them) or "none"; masked_rows: the modules' policy for a row that keeps
    nothing;
    positions_from: where the drawn RoPE positions start (None: as drawn, from 1..63); decode: run the decode
    check (causal cases); peers: run transformers' layer (False where a row keeps no key: it has no policy)."""

    name: str
    config: LatentAttentionConfig
    B: int
    T: int
    mask: str = "causal"
    masked_rows: str = "nan"
    positions_from: int | None = None
    decode: bool = False
    peers: bool = True
    prefill: int | None = None  # the decode check's prompt length (None: T // 2)

    def __post_init__(self):
        if not isinstance(self.config, LatentAttentionConfig):
            raise TypeError(f"LatentCase {self.name}: config must be a LatentAttentionConfig, got "
                            f"{type(self.config).__name__}")
        for n in ("B", "T"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LatentCase {self.name}: {n} must be a positive int, got {v!r}")
        if self.mask not in MASKS:
            raise ValueError(f"LatentCase {self.name}: mask {self.mask!r} is not one of {MASKS}")
        if self.masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"LatentCase {self.name}: masked_rows {self.masked_rows!r} is not one of "
                             f"{MASKED_ROWS_POLICIES}")
        if self.decode and (self.mask != "causal" or self.T < 2):
            raise ValueError(f"LatentCase {self.name}: decode runs on a causal case of T >= 2 tokens "
                             f"(mask {self.mask!r}, T={self.T})")
        if self.prefill is not None and not (isinstance(self.prefill, int) and 1 <= self.prefill < self.T):
            raise ValueError(f"LatentCase {self.name}: prefill must be an int in [1, T={self.T}), got {self.prefill!r}")

    def oracle_keywords(self) -> dict:
        """`reference_mla`'s layer keywords (its weights' keys say the bias)."""
        c = self.config
        return dict(num_heads=c.num_heads, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank,
                    rope=c.rope, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps,
                    masked_rows=self.masked_rows)


@dataclass(frozen=True)
class LatentInputs:
    sd: dict  # canonical float64 weights
    x: np.ndarray  # (B, T, E)
    cotangent: np.ndarray  # (B, T, E)
    keep: np.ndarray | None  # (B, 1, T, T) bool, ANDed with causal when is_causal
    positions: np.ndarray  # (B, T) int64
    is_causal: bool

    def rounded(self, dtype: str) -> LatentInputs:
        """The inputs as the dtype holds them (float64 values): what every implementation and the oracle get."""
        dt = numpy_dtype(dtype)

        def r(a):
            return np.asarray(a, dt).astype(np.float64)

        return replace(self, sd={n: r(w) for n, w in self.sd.items()}, x=r(self.x), cotangent=r(self.cotangent))


def draw_weights(rng: np.random.Generator, config: LatentAttentionConfig) -> dict[str, np.ndarray]:
    """Canonical float64 weights: projections U(-1/√fan_in, 1/√fan_in) (torch.nn.Linear's init); the norms'
    weights U(0.5, 1.5) and the biases U(-0.5, 0.5), away from their init (1 and ~0), so a layer that drops
    one cannot hide."""
    out = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            out[name] = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(".bias"):
            out[name] = rng.uniform(-0.5, 0.5, shape)
        else:
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, shape)
    return out


def check_weights(case: LatentCase, state_dict) -> dict[str, np.ndarray]:
    """Given weights as float64, exactly `case.config.weight_shapes()` (ValueError naming keys and shapes)."""
    expected = case.config.weight_shapes()
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"case {case.name}: the weights do not describe its layer: missing {missing}, "
                         f"unexpected {unexpected}")
    out = {}
    for name, shape in expected.items():
        a = np.asarray(state_dict[name])
        if a.shape != shape:
            raise ValueError(f"case {case.name}: {name} has shape {a.shape}, expected {shape}")
        out[name] = a.astype(np.float64)
    return out


def draw(case: LatentCase, seed: int, state_dict=None) -> LatentInputs:
    """The case's inputs, a pure function of (seed, case.name); state_dict: fixed weights (a checkpoint's)
    instead of drawn ones (everything else drawn the same)."""
    from parity import draw as drawing

    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode())])
    c, B, T = case.config, case.B, case.T
    x = drawing.activations(rng, B, T, c.embed_dim)
    sd = draw_weights(rng, c)
    if state_dict is not None:
        sd = check_weights(case, state_dict)
    cotangent = rng.standard_normal((B, T, c.embed_dim)) / np.sqrt(B * T)  # gradients O(1) whatever B, T
    positions = drawing.positions(rng, B, T)
    if case.positions_from is not None:
        positions = positions - positions.min() + case.positions_from
    keep = None
    if case.mask == "padding":
        lengths = np.maximum(T - np.arange(B), 1)  # (B,)
        keep = np.broadcast_to(np.arange(T)[None, None, None, :] < lengths[:, None, None, None], (B, 1, T, T)).copy()
    elif case.mask == "left-padding":
        pads = np.minimum(np.arange(B), T - 1)  # (B,)
        keep = np.broadcast_to(np.arange(T)[None, None, None, :] >= pads[:, None, None, None], (B, 1, T, T)).copy()
    return LatentInputs(sd, x, cotangent, keep, positions, case.mask != "none")


# ---------------------------------------------------------------- implementations


@dataclass(frozen=True)
class LatentImpl:
    """An implementation the latent harness runs. forward(case, inputs, dtype) -> (output (B, T, E) float64,
    stages dict {STAGES name: array in the oracle's layout} | None); gradient(case, inputs, dtype) -> {"x": ...,
    canonical weight name: ...}; decode(case, inputs, dtype, prefill, absorb) -> (B, T, E) outputs of the prefill
    and each step. None: not run. computes_in: the dtype its maths runs in where wider dtypes are asked (its rows
    judged at that dtype's bound). peer: its rows are the "peers" check's."""

    name: str
    forward: Callable
    gradient: Callable | None = None
    decode: Callable | None = None
    dtypes: tuple = LATENT_DTYPES
    computes_in: str | None = None
    peer: bool = False
    user: bool = False  # a user's layer (--impl): the report says in words how it came out
    applies: Callable = field(default=lambda case: True)  # which cases it can run (a peer's convention)

    def judged_at(self, dtype: str) -> str:
        if self.computes_in is not None and eps(self.computes_in) > eps(dtype):
            return self.computes_in
        return dtype


def to_float64(a) -> np.ndarray:
    from parity.reference import as_float64

    if hasattr(a, "detach"):
        from parity.canonical import tensor_to_numpy

        a = tensor_to_numpy(a)
    return as_float64(np.asarray(a))


def _stages_of(stages, cfg: LatentAttentionConfig) -> dict:
    """An implementation's `LatentStages` (or any object with those attributes) in the oracle's layout."""
    Dn = cfg.qk_nope_head_dim
    out = {}
    for name in STAGES:
        v = getattr(stages, name, None)
        if v is None:
            continue
        v = to_float64(v)
        out[name] = v[..., :Dn] if name == "k" else v
    return out


def _oracle_stages(f: reference_mla.LatentIntermediates, cfg: LatentAttentionConfig) -> dict:
    Dn = cfg.qk_nope_head_dim
    return {"q": f.q, "latent": f.c, "k": f.k[..., :Dn], "v": f.v, "q_rot": f.q_rot[..., Dn:], "k_rot": f.k_pe,
            "scores": f.scores, "weights": f.weights, "context": f.context, "output": f.output}


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _torch_call(m, inputs, x, stages: bool, fused: bool):
    """(output, stages or None) of a torch latent layer's forward over x with the unit's keep-mask, positions and
    causality; the stages where asked for and its forward takes return_intermediates."""
    import torch

    kw = {"positions": torch.as_tensor(inputs.positions), "is_causal": inputs.is_causal}
    if fused:
        kw["need_weights"] = False
    if stages and _accepts(m.forward, "return_intermediates"):
        kw["return_intermediates"] = True
    keep = None if inputs.keep is None else torch.as_tensor(inputs.keep)
    out = m(x, keep, **kw)
    if not isinstance(out, tuple):
        return out, None
    return out[0], (out[-1] if kw.get("return_intermediates") else None)


def _torch_decode(m, x, prefill: int, absorb: bool, fused: bool) -> np.ndarray:
    """A torch latent layer decoding x (B, T, E): the prefill of `prefill` tokens, then one token a call, through its
    own latent cache (`init_cache`); the outputs stacked (B, T, E), float64."""
    import torch

    B, T = x.shape[:2]
    cache, outs = m.init_cache(B, T), []
    kw = {"need_weights": False} if fused else {}
    with torch.no_grad():
        for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
            out, _, cache = m(x[:, lo:hi], cache=cache, absorb=absorb, **kw)[:3]
            outs.append(to_float64(out))
    return np.concatenate(outs, axis=1)


def torch_impl(name: str, make: Callable, *, fused: bool = False, dtypes: tuple = LATENT_DTYPES,
               names: str | None = None) -> LatentImpl:
    """A torch layer as a `LatentImpl`. make(config, state_dict, masked_rows) -> an nn.Module holding the canonical
    `state_dict` (torch tensors of the run's dtype; `mha_spec.MLA_KEYS` names) whose
      forward(x (B, T, E), mask=None, *, positions=None, is_causal=False) -> output or (output, ...)
    takes a keep-mask (B, 1, T, T) bool (True = attend) and RoPE positions (B, T) int64. Optional: forward's
    return_intermediates=True (the last element of the tuple then has `STAGES` attributes, as
    `mha_torch.LatentStages`: the first diverging stage of a failing forward); init_cache(batch, capacity) and
    forward(x, cache=..., absorb=...) -> (output, weights, new cache) (the decode check); named_parameters under
    the canonical names (the gradient check). fused: call with need_weights=False (SDPA). names: a layout of
    `parity.latent.LATENT_LAYOUTS` ("hf-deepseek-v3"): the state dict, and the parameters, under transformers'
    names (q_a_layernorm, kv_a_proj_with_mqa, o_proj, ...) instead; the gradients come back canonical."""
    import torch

    from parity.latent import LATENT_LAYOUTS, canonical_name, to_hf_deepseek

    if names is not None and names not in LATENT_LAYOUTS:
        raise ValueError(f"{name}: names={names!r} is not None or one of {LATENT_LAYOUTS}")

    def module(case, inputs, dtype):
        td = getattr(torch, dtype)
        sd = to_hf_deepseek(inputs.sd) if names else inputs.sd
        sd = {n: torch.tensor(np.asarray(w), dtype=torch.float64).to(td) for n, w in sd.items()}
        return make(case.config, sd, case.masked_rows), td

    def forward(case, inputs, dtype):
        m, td = module(case, inputs, dtype)
        with torch.no_grad():
            out, stages = _torch_call(m, inputs, torch.tensor(inputs.x).to(td), True, fused)
        return to_float64(out), None if stages is None else _stages_of(stages, case.config)

    def gradient(case, inputs, dtype):
        m, td = module(case, inputs, dtype)
        x = torch.tensor(inputs.x).to(td).requires_grad_()
        out, _ = _torch_call(m, inputs, x, False, fused)
        (out * torch.tensor(inputs.cotangent).to(td)).sum().backward()
        grads = {"x": to_float64(x.grad)}
        for n, p in m.named_parameters():
            grads[canonical_name(n) if names else n] = (to_float64(p.grad) if p.grad is not None
                                                        else np.zeros(tuple(p.shape)))
        return grads

    def decode(case, inputs, dtype, prefill, absorb):
        m, td = module(case, inputs, dtype)
        if not hasattr(m, "init_cache"):
            raise NotImplementedError(f"{name} has no init_cache: no latent cache to decode with")
        return _torch_decode(m, torch.tensor(inputs.x).to(td), prefill, absorb, fused)

    return LatentImpl(name, forward, gradient, decode, dtypes)


def ours_torch_module(config: LatentAttentionConfig, state_dict, masked_rows: str):
    """mha_torch.MultiHeadLatentAttention holding `state_dict` (the `torch_impl` factory of ours)."""
    from mha_torch import MultiHeadLatentAttention

    c = config
    dtype = next(iter(state_dict.values())).dtype
    m = MultiHeadLatentAttention(c.embed_dim, c.num_heads, kv_lora_rank=c.kv_lora_rank,
                                 qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                 v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank, rope=c.rope,
                                 rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps,
                                 bias=c.bias, masked_rows=masked_rows, dtype=dtype)
    m.load_state_dict(state_dict, strict=True)
    return m


def _jax_module(case: LatentCase, sd: dict, dtype: str):
    import jax.numpy as jnp
    from flax import nnx

    from mha_jax import MultiHeadLatentAttention

    c = case.config
    jd = jnp.dtype(numpy_dtype(dtype))
    m = MultiHeadLatentAttention(c.embed_dim, c.num_heads, kv_lora_rank=c.kv_lora_rank,
                                 qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                 v_head_dim=c.v_head_dim, rngs=nnx.Rngs(0), q_lora_rank=c.q_lora_rank, rope=c.rope,
                                 rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps,
                                 bias=c.bias, masked_rows=case.masked_rows, param_dtype=jd)
    for key, value in sd.items():
        module, leaf = key.rsplit(".", 1)
        layer = getattr(m, module)
        v = jnp.asarray(np.asarray(value, numpy_dtype(dtype)))
        if module.endswith("norm"):
            layer.weight[...] = v
        elif leaf == "weight":
            layer.kernel[...] = v.T  # torch (out, in) -> nnx.Linear's (in, out)
        else:
            layer.bias[...] = v
    return m, jd


def _jitted():
    """(forward with stages, one decode call) under nnx.jit, made once: its cache holds a compile per layer
    structure and shapes."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit(static_argnums=(4,))
    def forward(m, x, keep, pos, is_causal):
        out, _, stages = m(x, keep, positions=pos, is_causal=is_causal, return_intermediates=True)
        return out, stages

    @nnx.jit(static_argnums=(3,))
    def step(m, chunk, cache, absorb):
        out, _, cache = m(chunk, cache=cache, absorb=absorb, need_weights=False)[:3]
        return out, cache

    @nnx.jit(static_argnums=(5,))
    def grad(m, x, keep, pos, g, is_causal):
        def loss(m, x):
            out = m(x, keep, positions=pos, is_causal=is_causal, need_weights=False)[0]
            return jnp.sum((out * g).astype(jnp.promote_types(out.dtype, jnp.float32)))
        return nnx.grad(loss, argnums=(0, 1))(m, x)

    return forward, step, grad


_JITTED: list = []


def _jax_grad(m, x, keep, pos, g, is_causal):
    if not _JITTED:
        _JITTED.extend(_jitted())
    return _JITTED[2](m, x, keep, pos, g, is_causal)


def _jax_forward(m, x, keep, pos, is_causal):
    if not _JITTED:
        _JITTED.extend(_jitted())
    return _JITTED[0](m, x, keep, pos, is_causal)


def _jax_step(m, chunk, cache, absorb):
    if not _JITTED:
        _JITTED.extend(_jitted())
    return _JITTED[1](m, chunk, cache, absorb)


def ours_jax() -> LatentImpl:
    """mha_jax.MultiHeadLatentAttention (its need_weights=False path is the same einsum core: no fused twin)."""
    import jax.numpy as jnp
    from flax import nnx

    def args(inputs, jd):
        keep = None if inputs.keep is None else jnp.asarray(inputs.keep)
        return jnp.asarray(np.asarray(inputs.x, jd)), keep, jnp.asarray(inputs.positions)

    # Under jax.jit: op by op, JAX compiles every primitive of every call (measured: ~15 s per case and dtype
    # on 2 CPU cores; jitted, one compile per function, layer and shape).
    def forward(case, inputs, dtype):
        m, jd = _jax_module(case, inputs.sd, dtype)
        x, keep, pos = args(inputs, jd)
        out, stages = _jax_forward(m, x, keep, pos, inputs.is_causal)
        return to_float64(out), _stages_of(stages, case.config)

    def gradient(case, inputs, dtype):
        m, jd = _jax_module(case, inputs.sd, dtype)
        x, keep, pos = args(inputs, jd)
        g = jnp.asarray(np.asarray(inputs.cotangent, jd))
        d_params, d_x = _jax_grad(m, x, keep, pos, g, inputs.is_causal)
        grads = {"x": to_float64(d_x)}
        for path, leaf in nnx.to_flat_state(d_params):
            module, kind = path[0], path[-1]
            arr = to_float64(leaf[...])
            grads[f"{module}.{'weight' if kind in ('kernel', 'weight') else 'bias'}"] = arr.T if kind == "kernel" else arr
        return grads

    def decode(case, inputs, dtype, prefill, absorb):
        m, jd = _jax_module(case, inputs.sd, dtype)
        x = jnp.asarray(np.asarray(inputs.x, jd))
        B, T = x.shape[:2]

        cache, outs = m.init_cache(B, T), []
        for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
            out, cache = _jax_step(m, x[:, lo:hi], cache, absorb)
            outs.append(to_float64(out))
        return np.concatenate(outs, axis=1)

    return LatentImpl("jax-jit", forward, gradient, decode)


def ours() -> tuple[LatentImpl, ...]:
    """Our implementations: torch eager, torch fused (SDPA), JAX."""
    return (torch_impl("torch", ours_torch_module), torch_impl("torch-fused", ours_torch_module, fused=True),
            ours_jax())


def hf_peer(version: str = "v3") -> LatentImpl:
    """transformers' DeepseekV3Attention ("v3") or DeepseekV2Attention ("v2") as the peer (`parity.peers.hf_deepseek`):
    float32 and float64, judged at float32's bound (its cos/sin, norms and softmax are float32)."""
    from parity.peers.hf_deepseek import hf_deepseek

    return LatentImpl(**hf_deepseek(version), dtypes=("float64", "float32"), computes_in="float32", peer=True)


def load_latent_impl(spec: str) -> LatentImpl:
    """`mha-parity --impl MODULE:ATTR` for the latent cases: ATTR a `torch_impl` factory (make(config, state_dict,
    masked_rows) -> nn.Module), or a `LatentImpl`; ValueError naming what does not load."""
    import importlib

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"--impl {spec!r}: expected MODULE:ATTR")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--impl {spec!r}: {type(e).__name__}: {e}") from e
    if isinstance(found, LatentImpl):
        return replace(found, user=True)
    if not callable(found):
        raise ValueError(f"--impl {spec!r} is a {type(found).__name__}, not a latent layer factory")
    # a factory's `names` attribute (e.g. "hf-deepseek-v3"): its layer holds transformers' names
    return replace(torch_impl(attr, found, names=getattr(found, "names", None)), user=True)


def select_ours(names=None) -> tuple[LatentImpl, ...]:
    """Ours by the names `mha-parity --impls` uses (None: all); a name the latent harness does not run is a
    ValueError naming it (torch.compile and JAX's op-by-op and fused twins: the JAX layer runs jitted, and its
    need_weights=False path is the same einsum core)."""
    mine = ours()
    if names is None:
        return mine
    if bad := sorted(set(names) - {i.name for i in mine}):
        raise ValueError(f"--impls {','.join(bad)}: the latent harness runs {', '.join(i.name for i in mine)}")
    return tuple(i for i in mine if i.name in names)


# ---------------------------------------------------------------- the oracle, the yardsticks, the rows


class _Oracle:
    """The float64 oracle of one (case, inputs rounded to the dtype) and its yardsticks, each computed once."""

    def __init__(self, case: LatentCase, inputs: LatentInputs):
        self.case, self.inputs, self.kw = case, inputs, case.oracle_keywords()
        self._memo: dict = {}

    def _once(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def forward(self, dtype=np.float64, sd=None, x=None):
        i = self.inputs
        return reference_mla.forward(i.sd if sd is None else sd, i.x if x is None else x, i.keep,
                                     positions=i.positions, is_causal=i.is_causal, dtype=dtype, **self.kw)

    def exact(self):
        return self._once("exact", self.forward)

    def forward_yardstick(self, judged: str):
        """The envelope of the oracle's maths at `judged`'s yardstick dtype (`tolerances.yardstick_runs`)."""
        def runs():
            r = yardstick_runs(lambda sd, arrays, dt: self.forward(dt, sd, arrays[0]), self.inputs.sd,
                               (self.inputs.x,), judged)
            return envelope(self.exact(), r)
        return self._once(("fy", judged), runs)

    def backward(self, sd=None, x=None, g=None):
        i = self.inputs
        return reference_mla.backward(i.sd if sd is None else sd, i.x if x is None else x, i.keep,
                                      i.cotangent if g is None else g, positions=i.positions,
                                      is_causal=i.is_causal, **self.kw)

    def grads(self):
        return self._once("grads", self.backward)

    def gradient_yardstick(self, judged: str):
        """The float64 backward on sd, x and the cotangent nudged by a relative uniform(-eps, eps) of the
        yardstick dtype, GRADIENT_DRAWS times (seeded); the envelope of those runs."""
        def runs():
            e = eps(yardstick_dtype(judged))
            rng = np.random.default_rng(0)

            def nudge(a):
                return a * (1.0 + e * rng.uniform(-1.0, 1.0, np.shape(a)))

            i = self.inputs
            out = [self.backward({n: nudge(w) for n, w in i.sd.items()}, nudge(i.x), nudge(i.cotangent))
                   for _ in range(GRADIENT_DRAWS)]
            return envelope(self.grads(), out)
        return self._once(("gy", judged), runs)

    def decoded(self, prefill: int, absorbed: bool):
        i = self.inputs
        return self._once(("dec", prefill, absorbed), lambda: reference_mla.decode(
            i.sd, i.x, prefill=prefill, absorbed=absorbed, **self.kw).output)

    def causal_forward(self):
        """The causal forward at positions arange(T) (what a decode from slot 0 computes)."""
        i = self.inputs
        return self._once("causal", lambda: reference_mla.forward(i.sd, i.x, None, is_causal=True, **self.kw))

    def causal_yardstick(self, judged: str):
        i = self.inputs

        def runs():
            r = yardstick_runs(lambda sd, arrays, dt: reference_mla.forward(sd, arrays[0], None, is_causal=True,
                                                                               dtype=dt, **self.kw),
                               i.sd, (i.x,), judged)
            return envelope(self.causal_forward(), r)
        return self._once(("cy", judged), runs)


def _tol(judged: str, check: str):
    t = TOLERANCES[judged]
    return (t.forward if check != "gradient" else t.gradient), t.three_way_k


def _mask_infinite(stage, exact):
    """Scores: -inf where masked in the oracle; an implementation may hold any number there."""
    fin = np.isfinite(exact)
    return np.where(fin, stage, 0.0), np.where(fin, exact, 0.0)


def first_diverging_stage(stages: dict | None, exact: dict, yard: dict, judged: str) -> str:
    """The first of `STAGES` whose array is off the oracle's by more than its three-way bound (judged at
    `judged`), "" when none is (or no stages were given)."""
    if not stages:
        return ""
    tol, k = _tol(judged, "forward")
    for name in STAGES:
        if name not in stages or name not in exact:
            continue
        got, want, y = stages[name], exact[name], yard[name]
        try:
            want_b, y_b = np.broadcast_to(want, got.shape), np.broadcast_to(y, got.shape)
        except ValueError:
            return name  # another shape than the oracle's: it diverges here
        if name == "scores":
            got, want_b = _mask_infinite(got, want_b)
            y_b = np.where(np.isfinite(y_b), y_b, 0.0)
        if not judge(got, want_b, tol, k, yardstick=y_b).passed:
            return name
    return ""


@dataclass(frozen=True)
class _Unit:
    case: LatentCase
    dtype: str
    device: str = "cpu"

    def row(self, check, impl, ref, status, quantity="", cmp=None, stage="", message=""):
        extra = {}
        if cmp is not None:
            extra = dict(max_abs_err=cmp.max_abs_err, max_rel_err=cmp.max_rel_err, atol=cmp.atol, rtol=cmp.rtol,
                         margin=margin(cmp))
        return Row(self.case.name, check, impl, ref, self.dtype, self.device, status, quantity, stage=stage,
                   message=message, **extra)

    def judged(self, check, impl, ref, quantity, cmp, stage="", message=""):
        return self.row(check, impl, ref, "pass" if cmp.passed else "fail", quantity, cmp,
                        "" if cmp.passed else stage, message)


def _error(unit: _Unit, check, impl, exc: BaseException, quantity="") -> Row:
    return unit.row(check, impl, "oracle", "error", quantity, message=f"{type(exc).__name__}: {exc}"[:500])


def _check_forward(unit, impl: LatentImpl, oracle: _Oracle, inputs, judged, check) -> list[Row]:
    try:
        out, stages = impl.forward(unit.case, inputs, unit.dtype)
    except Exception as e:  # noqa: BLE001 -- a unit that raises is an error row
        return [_error(unit, check, impl.name, e, "output")]
    exact = oracle.exact()
    yard = oracle.forward_yardstick(judged)
    tol, k = _tol(judged, "forward")
    cmp = judge(out, exact.output, tol, k, yardstick=yard.output)
    stage = "" if cmp.passed else first_diverging_stage(
        stages, _oracle_stages(exact, unit.case.config), _oracle_stages(yard, unit.case.config), judged)
    note = f" (judged at {judged}'s bound: computes_in)" if judged != unit.dtype else ""
    return [unit.judged(check, impl.name, "oracle", "output", cmp, stage or ("output" if stages else ""),
                        note.strip())]


def _check_gradient(unit, impl: LatentImpl, oracle: _Oracle, inputs, judged, check) -> list[Row]:
    try:
        got = impl.gradient(unit.case, inputs, unit.dtype)
    except Exception as e:  # noqa: BLE001
        return [_error(unit, check, impl.name, e, "d_inputs")]
    exact, yard = oracle.grads(), oracle.gradient_yardstick(judged)
    tol, k = _tol(judged, "gradient")
    rows = []
    for name in ["x", *sorted(n for n in exact if n != "x")]:
        quantity = "d_inputs" if name == "x" else f"d_{name}"
        if name not in got:
            rows.append(unit.row(check, impl.name, "oracle", "fail", quantity,
                                 message=f"{impl.name} returned no gradient for {name}"))
            continue
        cmp = judge(got[name], exact[name], tol, k, yardstick=yard[name])
        rows.append(unit.judged(check, impl.name, "oracle", quantity, cmp))
    return rows


def _calls(T: int, prefill: int) -> list[tuple[str, int, int]]:
    return [("prefill", 0, prefill)] + [(f"step {t - prefill + 1}", t, t + 1) for t in range(prefill, T)]


def _check_decode(unit, impl: LatentImpl, oracle: _Oracle, inputs, judged, check) -> list[Row]:
    T = unit.case.T
    prefill = unit.case.prefill or max(1, T // 2)
    tol, k = _tol(judged, "forward")
    yard = oracle.causal_yardstick(judged).output
    exact = oracle.causal_forward().output
    yard_err = errors(yard, exact)[0]
    rows, got = [], {}
    for absorb in (False, True):
        quantity = "decode absorbed" if absorb else "decode naive"
        try:
            got[absorb] = out = impl.decode(unit.case, inputs, unit.dtype, prefill, absorb)
        except Exception as e:  # noqa: BLE001
            rows.append(_error(unit, check, impl.name, e, quantity))
            continue
        expected = oracle.decoded(prefill, absorb)
        cmp = judge(out, expected, tol, k, yardstick=yard)
        stage = ""
        if not cmp.passed:
            stage = next((label for label, lo, hi in _calls(T, prefill)
                          if not judge(out[:, lo:hi], expected[:, lo:hi], tol, k, yardstick=yard[:, lo:hi]).passed),
                         "")
        rows.append(unit.judged(check, impl.name, "oracle", quantity, cmp, stage))
        if impl.peer:  # a peer's cache has one path: absorb is ours
            break
    if True in got and False in got:
        cmp = judge(got[True], got[False], tol, k, yard_err=yard_err)
        rows.append(unit.judged(check, impl.name, f"{impl.name} naive decode", "decode absorbed", cmp,
                                "absorbed"))
    if False in got:
        try:
            own = _own_causal_forward(impl, unit, inputs)
        except Exception as e:  # noqa: BLE001
            return rows + [_error(unit, check, impl.name, e, "decode vs forward")]
        cmp = judge(got[False], own, tol, k, yard_err=yard_err)
        rows.append(unit.judged(check, impl.name, f"{impl.name} causal forward", "decode naive", cmp, "cache"))
    return rows


def _own_causal_forward(impl: LatentImpl, unit: _Unit, inputs: LatentInputs):
    B, T = inputs.x.shape[:2]
    at_slots = replace(inputs, keep=None, is_causal=True, positions=np.broadcast_to(np.arange(T), (B, T)).copy())
    return impl.forward(unit.case, at_slots, unit.dtype)[0]


_CHECKS = {"forward": _check_forward, "gradient": _check_gradient, "decode": _check_decode}


def run_unit(case: LatentCase, dtype: str, impls, checks=LATENT_CHECKS, seed: int = 0, state_dict=None,
             device: str = "cpu") -> list[Row]:
    """The rows of one (case, dtype): every implementation's selected checks (a peer's under "peers")."""
    inputs = draw(case, seed, state_dict).rounded(dtype)
    oracle, unit, rows = _Oracle(case, inputs), _Unit(case, dtype, device), []
    for impl in impls:
        if impl.peer and "peers" not in checks:
            continue
        why = (f"{impl.name} runs {', '.join(impl.dtypes)}" if dtype not in impl.dtypes
               else f"{impl.name} cannot be this case's layer (rope={case.config.rope!r})" if not impl.applies(case)
               else f"{impl.name} has no masked-row policy (a row that keeps no key is NaN, its gradients too)"
               if impl.peer and not case.peers else "")
        if why:  # said, not silently left out
            rows.append(unit.row("peers" if impl.peer else "forward", impl.name, "oracle", "skip", message=why))
            continue
        judged = impl.judged_at(dtype)
        for check in ("forward", "gradient", "decode"):
            if not impl.peer and check not in checks:
                continue
            fn = {"forward": impl.forward, "gradient": impl.gradient, "decode": impl.decode}[check]
            if fn is None or (check == "decode" and not case.decode):
                continue
            rows += _CHECKS[check](unit, impl, oracle, inputs, judged, "peers" if impl.peer else check)
    return rows


# ---------------------------------------------------------------- the drawn cases, the run


YARN = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)


def latent_cases() -> tuple[LatentCase, ...]:
    """`mha-parity --cases latent`: q_lora and plain q, interleaved and half RoPE, YaRN with mscale (positions
    past its original context), biases, a padded batch; tiny pairwise-distinct sizes (E, N, C, Dn, Dr, Dv, Q)."""
    def cfg(**kw):
        base = dict(embed_dim=12, num_heads=3, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=8, v_head_dim=5,
                    q_lora_rank=7)
        return LatentAttentionConfig(**{**base, **kw})

    return (
        LatentCase("latent/q_lora/interleaved/causal", cfg(), 2, 5, decode=True),
        LatentCase("latent/plain_q/half/causal", cfg(q_lora_rank=None, rope="half", embed_dim=10, num_heads=2), 3, 4,
                   decode=True),
        LatentCase("latent/yarn/mscale/causal", cfg(rope_scaling=YARN, qk_nope_head_dim=9), 2, 6, decode=True,
                   positions_from=YARN.original_max_position_embeddings),
        LatentCase("latent/bias/padding", cfg(bias=True, v_head_dim=11), 3, 5, mask="padding"),
        LatentCase("latent/plain_q/bias/none", cfg(q_lora_rank=None, bias=True, rope="half"), 2, 3, mask="none"),
        # transformers has no masked-row policy (a row of -inf is NaN, and NaN gradients everywhere): ours only
        LatentCase("latent/left-padding/zero", cfg(v_head_dim=13), 3, 4, mask="left-padding", masked_rows="zero",
                   peers=False),
        LatentCase("latent/left-padding/uniform", cfg(q_lora_rank=None), 3, 4, mask="left-padding",
                   masked_rows="uniform", peers=False),
    )


def run_latent(cases=None, impls=None, dtypes=None, checks=None, seed: int = 0, state_dict=None,
               environment: dict | None = None, should_stop=None) -> Report:
    """A `Report` of the latent cases (default `latent_cases()`), implementations (default ours and transformers'
    DeepseekV3Attention; V2's too where the case is interleaved), dtypes (default LATENT_DTYPES) and checks
    (default LATENT_CHECKS). state_dict: fixed canonical weights for every case (a checkpoint's layer)."""
    import time

    import jax
    import torch

    from parity.env import environment as env_of
    from parity.env import pinned

    started = time.perf_counter()
    cases = latent_cases() if cases is None else tuple(cases)
    impls = (*ours(), hf_peer("v3")) if impls is None else tuple(impls)
    dtypes = LATENT_DTYPES if dtypes is None else tuple(dtypes)
    checks = LATENT_CHECKS if checks is None else tuple(checks)
    if unknown := sorted(set(dtypes) - set(LATENT_DTYPES)):
        raise ValueError(f"the latent cases run {LATENT_DTYPES}; not {unknown}")
    if unknown := sorted(set(checks) - set(LATENT_CHECKS)):
        raise ValueError(f"the latent cases run the checks {LATENT_CHECKS}; not {unknown}")
    with pinned(False, "float64" in dtypes):
        env = env_of()
        env.update(device="cpu", seed=seed, jax_enable_x64=bool(jax.config.jax_enable_x64),
                   jax_default_matmul_precision=str(jax.config.jax_default_matmul_precision),
                   torch_float32_matmul_precision=torch.get_float32_matmul_precision(), **(environment or {}),
                   latent_cases=len(cases), dtypes=",".join(dtypes), checks=",".join(checks),
                   implementations=",".join(i.name for i in impls))
        report = Report(env)
        try:
            for case in cases:
                for dtype in dtypes:
                    if should_stop is not None and should_stop():
                        report.interrupted = True
                        break
                    report.rows += run_unit(case, dtype, impls, checks, seed, state_dict)
        except KeyboardInterrupt:
            report.interrupted = True
    report.users = [i for i in impls if i.user]
    report.elapsed_s = time.perf_counter() - started
    return report


# ---------------------------------------------------------------- mha-parity --checkpoint (DeepSeek) and --cases latent


def checkpoint_cases(config: LatentAttentionConfig, B: int, T: int, S: int) -> tuple[LatentCase, ...]:
    """A DeepSeek checkpoint's cases at --shape B,T,S: MLA is self-attention over S tokens, so forward and gradient
    run on (B, S) tokens, causal and right-padded; T < S is the decode of T new tokens one at a time after a
    prompt of S - T (T == S: a prompt of S // 2). A scaled RoPE's forward/gradient positions start at its
    original_max_position_embeddings (past the original context, as `checkpoint.past_original`); the decode
    check's positions are the cache slots 0..S-1."""
    if T > S:
        raise ValueError(f"--shape {B},{T},{S}: T <= S (T new tokens of S)")
    if S < 2:
        raise ValueError(f"--shape {B},{T},{S}: the latent checkpoint cases need S >= 2 tokens (a prompt and a step)")
    past = None if config.rope_scaling is None else config.rope_scaling.original_max_position_embeddings
    prefill = S - T if T < S else max(1, S // 2)
    return (LatentCase("checkpoint/causal", config, B, S, "causal", "nan", past, decode=True, prefill=prefill),
            LatentCase("checkpoint/padding", config, B, S, "padding", "nan", past))


CHECKPOINT_CHECKS = LATENT_CHECKS


def is_latent_checkpoint(args) -> bool:
    """`mha-parity --checkpoint` of a DeepSeek V2/V3 model: --layout hf-deepseek-v3/-v2, or no --layout and a
    config.json (the directory's, or beside the file) whose model_type is deepseek_v2/deepseek_v3."""
    from parity.latent import LATENT_LAYOUTS, layout_of

    if args.checkpoint is None:
        return False
    return args.layout in LATENT_LAYOUTS or (args.layout is None and layout_of(args.checkpoint) is not None)


def checkpoint_run(args) -> tuple[str, dict]:
    """(a line saying what is checked, `run_latent` keywords) of a DeepSeek --checkpoint; ValueError/OSError naming
    what is refused (the caller's usage error)."""
    from parity.harness.checkpoint import DEFAULT_SHAPE, DTYPES_DEFAULT
    from parity.latent import read_deepseek_checkpoint

    extra = [f for f, v in (("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--rope-theta", args.rope_theta))
             if v is not None]
    if extra:
        raise ValueError(f"{', '.join(extra)}: a DeepSeek checkpoint's config.json gives the layer")
    mine = (*select_ours(args.impls), *(load_latent_impl(spec) for spec in args.impl))
    sd, config, layout = read_deepseek_checkpoint(args.checkpoint, args.prefix, args.layout)
    B, T, S = args.shape or DEFAULT_SHAPE
    checks = tuple(args.checks) if args.checks is not None else CHECKPOINT_CHECKS
    if bad := sorted(set(checks) - set(LATENT_CHECKS)):
        raise ValueError(f"--checks {','.join(bad)}: a DeepSeek (latent attention) checkpoint runs "
                         f"{','.join(LATENT_CHECKS)}")
    dtypes = tuple(args.dtypes) if args.dtypes is not None else DTYPES_DEFAULT
    if bad := sorted(set(dtypes) - set(LATENT_DTYPES)):
        raise ValueError(f"--dtypes {','.join(bad)}: the latent harness runs {','.join(LATENT_DTYPES)}")
    cases = checkpoint_cases(config, B, T, S)
    peer = hf_peer("v3" if layout == "hf-deepseek-v3" else "v2")
    what = (f"{args.checkpoint} [{layout}] {args.prefix or '(no prefix)'}: multi-head latent attention E="
            f"{config.embed_dim} N={config.num_heads} C={config.kv_lora_rank} Dn={config.qk_nope_head_dim} "
            f"Dr={config.qk_rope_head_dim} Dv={config.v_head_dim} Q={config.q_lora_rank} rope={config.rope}"
            f"{' ' + str(config.rope_scaling) if config.rope_scaling else ''} bias={config.bias}; {B} x {S} tokens"
            f" (decode: a prompt of {cases[0].prefill}, then {S - cases[0].prefill} single-token steps)")
    env = {"checkpoint": str(args.checkpoint), "checkpoint_layout": layout, "checkpoint_prefix": args.prefix,
           "checkpoint_tokens": S, "checkpoint_decode_prompt": cases[0].prefill}
    return what, dict(cases=cases, impls=(*mine, peer), dtypes=dtypes, checks=checks, seed=args.seed,
                      state_dict=sd, environment=env)


__all__ = ["LatentCase", "LatentInputs", "LatentImpl", "LATENT_CHECKS", "LATENT_DTYPES", "STAGES", "draw",
           "draw_weights", "torch_impl", "load_latent_impl", "ours", "select_ours", "hf_peer", "ours_jax", "ours_torch_module",
           "first_diverging_stage", "run_unit", "latent_cases", "run_latent", "checkpoint_cases", "checkpoint_run",
           "is_latent_checkpoint"]
