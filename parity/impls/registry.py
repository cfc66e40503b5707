"""The registry: every built-in implementation, the contract they follow, and loading the user's own.

Framework-free: a benchmark's parent process and the harness's planning read this
table without importing torch or jax; the factories it names are imported lazily.
The table is our modules' entries and, one line per module, the peers' (`parity.peers`:
each library's module declares its own `Implementation`s). `Implementation` itself is
defined in `parity.implementation` and re-exported here.

The adapter contract (the same for ours, the peers and a user's own layer):

    factory(state_dict, num_heads, *, dtype, device[, masked_rows][, problem]) -> fn
    fn(params, query, key, value, mask[, *, positions, key_positions]) -> output | (output, weights)

`state_dict` is the canonical dict of NumPy arrays (`parity.convert` names, torch
layout, already in `dtype`); `dtype` is its name ("float32", ...); `device` is the
framework's device (a `torch.device` or a `jax.Device`). `masked_rows` is passed only
to implementations whose policy is configurable (`masked_rows=None`). `params` is
that state dict as framework arrays on `device` — the harness differentiates with
respect to it, so `fn` must compute with it (a module can be called through
`torch.func.functional_call`); with `uses_params=False` the signature is
`fn(query, key, value, mask)` and parameter gradients are not checked.
query (B, T, E), key and value (B, S, E); `mask` follows the declared convention
(`mask`, `mask_shape`) or is None; output (B, T, E) in the inputs' dtype;
weights (B, N, T, S) when `returns_weights`.

Attention variants (`mha_spec.VARIANT_FEATURES`: "grouped", "rope-half",
"rope-interleaved", "no-qkv-bias", "no-out-bias") are declared in `variants`, the
features the implementation runs. A case whose layer uses a feature not declared is a
skip row naming it, for every check (`Implementation.unsupported`). The default, no
declaration (`variants=()`), is the classic layer and the classic call above: a layer
written before variants existed runs unchanged and skips the variant cases. An
implementation that declares at least one feature also receives the problem:
`problem` (keyword) is an `mha_spec.Problem` — `problem.config` the layer (num_heads,
num_kv_heads, biases, rope, rope_theta, and its masked_rows policy) and problem.B/T/S
the sizes of the case. Weights follow `problem.config.weight_shapes()`: k/v (K·H, E),
absent biases absent from `state_dict` and `params`. On a RoPE case `fn` (and
`fn.intermediates`) also get `positions=` (B, T) and `key_positions=` (B, S), integer
framework arrays (torch int64, JAX int32), the positions the oracle rotates by (not the
default arange); elsewhere neither keyword is passed. A peer's `fn.vjp(input, mask,
cotangent)` gets them as NumPy arrays, as keywords, likewise.

Optionally `fn.intermediates(params, query, key, value, mask) -> dict` with any of
q (B, N, T, H), k, v (B, K, S, H), q_rot (B, N, T, H) and k_rot (B, K, S, H) (after RoPE),
scores, weights (B, N, T, S), context (B, T, N·H), output (a dict, or a dataclass such
as `mha_spec.Stages`): then a failing check names the first stage where it leaves the
oracle, in the order q, k, v, q_rot, k_rot, scores, weights, context, output (so a
projection bug, a RoPE bug and a key/value-head bug are told apart). Stages are
judged as reported: scores are compared where the oracle's key is kept on a row that
attends to something (so -inf, finfo.min or unmasked values at masked places all pass);
weights, context and output everywhere. A stage of another shape than the oracle's (a
k with N heads, repeated before it is reported) is named with both shapes.

Structured masks (the harness's packed, window and chunk cases, `parity.implementation.STRUCTURED_MASKS`):
by default `mask` is the whole mask, dense (`reference.structured_keep` of the case's segment ids,
window, chunk and causality, AND its padding). An implementation declaring `structured=True` (ours do) gets
the structure as keywords instead -- `is_causal=True`, `window=(left, right)`, `segment_ids=` (B, T),
`key_segment_ids=` (B, S), `alignment="bottom-right"`, and `chunk=C` when it also declares `takes_chunk=True`
(a structured one without it skips the chunk cases), those the case uses, segment ids as framework
integer arrays (torch int64, JAX int32; NumPy to a peer's `fn.vjp`) -- and `mask` is the rest of the
case's mask (its padding, or None).

`fn` must not change its arguments: the harness checks after every call that the inputs
and parameters it passed are bit for bit what they were (a change is a fail row).

What an implementation supports is declared, never guessed: `dtypes` (None: every dtype)
and `variants` make the other units skip rows that say so. `Implementation.unsupported(dtype,
config)` is the one place that reads these declarations, and every check (and the
benchmark) skips by it alike.
"""

from __future__ import annotations

import numpy as np

from mha_spec import VARIANT_FEATURES, AttentionConfig, Problem
from parity.canonical import LAYER_FIELDS
from parity.implementation import (
    FRAMEWORKS,
    INPUTS,
    MASK_CONVENTIONS,
    MASK_SHAPES,
    MODES,
    ROLES,
    Implementation,
    LoadError,
    import_attr,
    unit_kind,
)
from parity.peers import equinox, flax, hf, hf_fused, hf_llama4, jax_dpa, keras, pallas, sdpa, torch_mha


def implementation(**declared):
    """Decorator for a user's factory: `@implementation(name=..., framework=..., mask=..., ...)`.

    Returns the `Implementation` (with the decorated function as its factory), so
    `mha-parity --impl my_pkg.my_module:my_factory` finds everything it needs.
    """
    declared.setdefault("role", "user")

    def wrap(factory):
        return Implementation(factory=factory, **{"name": factory.__name__, **declared})

    return wrap


def load_user_impl(spec: str) -> tuple[Implementation, ...]:
    """'module:attribute' -> the Implementation(s) it names (one, or a tuple/list of them).

    Any failure to load -- an exception or a SystemExit at import, a missing attribute,
    an object that is not an Implementation -- is a `LoadError` (a ValueError) with a
    one-line message naming the module.
    """
    obj = import_attr(spec)
    items = obj if isinstance(obj, (tuple, list)) else (obj,)
    if not items or not all(isinstance(i, Implementation) for i in items):
        raise LoadError(
            f"cannot load {spec!r}: it is {type(obj).__name__}, not a parity.impls.Implementation: declare it with "
            f"@parity.impls.implementation(framework=..., mask=..., masked_rows=..., returns_weights=...)"
        )
    return tuple(items)


# ---------------------------------------------------------------- masks


def mask_for(impl: Implementation, keep: np.ndarray | None, num_heads: int, dtype: np.dtype):
    """The case's keep-mask (B, 1, T, S) bool, in the implementation's convention (NumPy)."""
    if keep is None:
        return None
    if keep.ndim != 4 or keep.shape[1] != 1:
        raise ValueError(f"keep-mask must be (B, 1, T, S), got {keep.shape}")
    if impl.mask_shape == "BNTS":
        keep = np.broadcast_to(keep, (keep.shape[0], num_heads, *keep.shape[2:]))
    elif impl.mask_shape == "BTS":
        keep = keep[:, 0]
    keep = np.ascontiguousarray(keep)
    if impl.mask == "drop":
        return ~keep
    if impl.mask == "additive":
        return np.where(keep, 0.0, -np.inf).astype(dtype)
    return keep


# What a layer passes by name beyond num_kv_heads, rope and rope_theta: the fields the tensors cannot say, and
# RoPE's partial rotary and scaling (once each, should LAYER_FIELDS come to name them).
_LAYER_KEYWORDS = tuple(dict.fromkeys((*LAYER_FIELDS, "rope_dim", "rope_scaling")))


def layer_kwargs(state_dict: dict, num_heads: int, problem: Problem | None) -> dict:
    """num_kv_heads, rope, rope_theta and the fields the tensors cannot say (`parity.canonical.LAYER_FIELDS`:
    qk_norm, its eps and offset, scale, softcap; and rope_dim, rope_scaling; those at their defaults are left
    out) for our modules' converters (`parity.convert.to_torch/to_jax`): the problem's; without one, the state
    dict's key/value heads (k_proj rows / H) and no RoPE."""
    if problem is not None:
        c = problem.config
        extra = {f: getattr(c, f) for f in _LAYER_KEYWORDS if getattr(c, f) != getattr(AttentionConfig, f)}
        return {"num_kv_heads": c.num_kv_heads, "rope": c.rope, "rope_theta": c.rope_theta, **extra}
    q_rows, kv_rows = np.shape(state_dict["q_proj.weight"])[0], np.shape(state_dict["k_proj.weight"])[0]
    K = kv_rows * num_heads // q_rows if q_rows else num_heads
    return {"num_kv_heads": None if K == num_heads else K}


# ---------------------------------------------------------------- built-ins

_T = "parity.impls.torch_impls"
_J = "parity.impls.jax_impls"


# What our modules run (mha_spec.VARIANT_FEATURES): both run every variant.
_OURS_VARIANTS = {"torch": VARIANT_FEATURES, "jax": VARIANT_FEATURES}


def _ours(name, framework, factory, mode, weights, doc, **kw):
    # structured: our modules take is_causal, window, segment_ids, key_segment_ids, alignment and chunk themselves.
    return Implementation(name, framework, factory, mode, weights, masked_rows=None, role="ours",
                          family=f"ours-{framework}", doc=doc, variants=_OURS_VARIANTS[framework], structured=True,
                          takes_chunk=True, **kw)


OURS = (
    _ours("torch", "torch", f"{_T}:ours_weights", "eager", True, "mha_torch.MultiHeadAttention"),
    _ours("torch-fused", "torch", f"{_T}:ours_fused", "eager", False, "mha_torch, need_weights=False (SDPA)"),
    _ours("torch-compile", "torch", f"{_T}:ours_weights", "compile", True, "torch.compile(mha_torch.MultiHeadAttention)"),
    _ours("torch-compile-fused", "torch", f"{_T}:ours_fused", "compile", False, "torch.compile(mha_torch), need_weights=False"),
    # A decoder of ours only (decode=True: the decode check runs it, through TorchRunner.decoder; its factory is the
    # weights path, which no other check calls): the cache a StaticKVCache written in place.
    Implementation("torch-static", "torch", f"{_T}:ours_weights", "eager", True, masked_rows=None, role="ours",
                   family="ours-torch", variants=_OURS_VARIANTS["torch"], decode=True, bench=False,
                   doc="mha_torch.MultiHeadAttention decoding with a StaticKVCache (init_cache(static=True)): each "
                   "call writes the preallocated cache in place"),
    _ours("jax", "jax", f"{_J}:ours_weights", "eager", True, "mha_jax.MultiHeadAttention, op by op", bench=False),
    _ours("jax-jit", "jax", f"{_J}:ours_weights", "jit", True, "mha_jax.MultiHeadAttention under jax.jit"),
    _ours("jax-fused", "jax", f"{_J}:ours_fused", "jit", False, "mha_jax, need_weights=False, under jax.jit"),
)

# The peers: one module of parity.peers per library, each declaring its IMPLEMENTATIONS (what they
# run, their masks and masked-row policies, the precision they compute in). The libraries beyond
# torch and JAX (transformers, keras, equinox) are the optional `.[ecosystem]` extra: absent, a
# skip row. Adding a peer is one module and one line here (docs/adding-a-peer.md).
PEERS = (
    *torch_mha.IMPLEMENTATIONS,
    *sdpa.IMPLEMENTATIONS,
    *flax.IMPLEMENTATIONS,
    *jax_dpa.IMPLEMENTATIONS,
    *hf.IMPLEMENTATIONS,
    *hf_fused.IMPLEMENTATIONS,
    *hf_llama4.IMPLEMENTATIONS,
    *keras.IMPLEMENTATIONS,
    *equinox.IMPLEMENTATIONS,
    *pallas.IMPLEMENTATIONS,
)

BUILTIN = OURS + PEERS
_BY_NAME = {i.name: i for i in BUILTIN}
if len(_BY_NAME) != len(BUILTIN):  # a peer module that reuses a name would shadow another implementation
    raise ValueError(f"built-in implementation names are not unique: "
                     f"{sorted(n for n in _BY_NAME if sum(i.name == n for i in BUILTIN) > 1)}")


def builtin(name: str) -> Implementation:
    if name not in _BY_NAME:
        raise ValueError(f"unknown implementation {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def select(role: str | None = None) -> tuple[Implementation, ...]:
    """The built-ins of a role ("ours" | "peer"; None: all), in table order."""
    return tuple(i for i in BUILTIN if role is None or i.role == role)


__all__ = ["Implementation", "implementation", "load_user_impl", "LoadError", "mask_for", "BUILTIN", "builtin", "select",
           "FRAMEWORKS", "MODES", "MASK_CONVENTIONS", "MASK_SHAPES", "ROLES", "INPUTS", "unit_kind", "OURS", "PEERS"]
