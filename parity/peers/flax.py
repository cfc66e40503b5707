"""flax's attention as a peer: linen's MultiHeadDotProductAttention and nnx's MultiHeadAttention.

    from_flax_linen / to_flax_linen   linen variables {"params": {query|key|value|out: {kernel, bias}}}
    from_flax_nnx / to_flax_nnx       a flax.nnx.MultiHeadAttention module
    flax-linen-mha                    linen, sow_weights=True: its weights too (not benchmarked)
    flax-nnx-mha                      nnx, sow_weights=True
    flax-nnx-mha-fused                nnx without weights, benchmark only
    flax-nnx-mha-decode               nnx, decode=True: one token per call against its cache
    flax-nnx-mha-decode-causal        the same with is_causal=True at every call (flax >= 0.12.11:
                                      `CAUSAL_DECODE_FIXED`; older flax: a skip row saying why)

Both store q/k/v kernels (E, N, H), biases (N, H), the output kernel (N, H, E)
(`parity.peers.common.to_flax_tree`). Mask True = attend; masked scores are finfo.min, so a
fully masked row is uniform (the "uniform" policy). Each factory computes with the harness's
canonical parameters (plugged into the module), so its gradients are checked too. jax and
flax are imported on first use.
Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping

import numpy as np

from parity.canonical import PROJECTIONS, check_jax_dtype, check_keys, check_state_dict, refuse_dtype_change
from parity.implementation import Implementation
from parity.peers.common import (
    FLAX_NAMES,
    FRAMEWORK_PEER_CASES,
    MissingPackage,
    classic_only,
    from_flax_tree,
    linear_leaves,
    merged,
    to_flax_tree,
)


# What no other file of parity/ uses (tests/test_house.py): flax's attention modules. flax itself
# (nnx) is our JAX module's framework too, so importing it is not the flax peer's alone.
OWNS = ("import flax.linen", "nn.MultiHeadDotProductAttention", "nnx.MultiHeadAttention")

# ---------------------------------------------------------------- converters


def is_nnx_mha(obj) -> bool:
    """Whether obj is a flax.nnx.MultiHeadAttention (False without importing flax when flax.nnx is not loaded)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(obj, nnx.MultiHeadAttention)


def from_flax_linen(variables) -> dict[str, np.ndarray]:
    """Variables of flax.linen.MultiHeadDotProductAttention ({"params": ...}) -> canonical."""
    if not isinstance(variables, Mapping):
        raise TypeError(f"expected a mapping {{'params': ...}}, got {type(variables).__name__}")
    check_keys(variables.keys(), ("params",), "flax.linen variables")
    return from_flax_tree(variables["params"], "flax.linen params")


def to_flax_linen(sd, num_heads: int) -> dict:
    """Canonical -> {"params": ...} for flax.linen.MultiHeadDotProductAttention(num_heads, ...).apply."""
    return {"params": to_flax_tree(sd, num_heads)}


def from_flax_nnx(m) -> dict[str, np.ndarray]:
    """flax.nnx.MultiHeadAttention (bias, no qk-norm, no GQA, qkv_features = in = out) -> canonical."""
    from flax import nnx

    if not isinstance(m, nnx.MultiHeadAttention):
        raise TypeError(f"expected flax.nnx.MultiHeadAttention, got {type(m).__name__}")
    if not m.use_bias or m.normalize_qk:
        raise ValueError("flax.nnx.MultiHeadAttention must have use_bias=True and normalize_qk=False")
    if m.num_kv_heads != m.num_heads:
        raise ValueError(f"grouped heads (num_kv_heads={m.num_kv_heads} != num_heads={m.num_heads}) are not supported")
    tree = {
        FLAX_NAMES[p]: {"kernel": np.asarray(getattr(m, FLAX_NAMES[p]).kernel[...]), "bias": np.asarray(getattr(m, FLAX_NAMES[p]).bias[...])}
        for p in PROJECTIONS
    }
    return from_flax_tree(tree, "flax.nnx.MultiHeadAttention")


def to_flax_nnx(sd, num_heads: int, **module_kwargs):
    """Canonical -> flax.nnx.MultiHeadAttention(num_heads, E) with param_dtype = the weights' dtype."""
    import jax.numpy as jnp
    from flax import nnx

    # flax.nnx.MultiHeadAttention has a num_kv_heads of its own; this converter builds the classic layer.
    classic_only(sd, "to_flax_nnx's flax.nnx.MultiHeadAttention (built without num_kv_heads)")
    E, dtype = check_state_dict(sd)
    check_jax_dtype(dtype)
    refuse_dtype_change(module_kwargs, "param_dtype", dtype, np.dtype)
    rngs = module_kwargs.pop("rngs", None) or nnx.Rngs(0)
    module_kwargs.setdefault("decode", False)
    m = nnx.MultiHeadAttention(num_heads, E, param_dtype=dtype, rngs=rngs, **module_kwargs)
    for name, params in to_flax_tree(sd, num_heads).items():
        layer = getattr(m, name)
        layer.kernel[...] = jnp.asarray(params["kernel"])
        layer.bias[...] = jnp.asarray(params["bias"])
    return m


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def _flax_shapes(E: int, N: int) -> dict:
    """flax's MultiHeadAttention layout: q/k/v kernels (E, N, H), out kernel (N, H, E)."""
    H = E // N
    return {"q_proj": (E, N, H), "k_proj": (E, N, H), "v_proj": (E, N, H), "out_proj": (N, H, E)}


def flax_linen(sd, num_heads, *, dtype, device):
    import flax.linen as nn

    E = sd["q_proj.weight"].shape[0]
    m = nn.MultiHeadDotProductAttention(num_heads=num_heads, qkv_features=E, out_features=E, dtype=dtype,
                                        param_dtype=dtype, deterministic=True)
    shapes = _flax_shapes(E, num_heads)

    def fn(params, query, key, value, keep):
        tree = {flax_name: linear_leaves(params, p, shapes[p]) for p, flax_name in FLAX_NAMES.items()}
        out, state = m.apply({"params": tree}, query, key, value, mask=keep, sow_weights=True, mutable=["intermediates"])
        (w,) = state["intermediates"]["attention_weights"]
        return out, w

    return fn


def _flax_nnx(sd, num_heads, *, dtype, device, need_weights):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    E = sd["q_proj.weight"].shape[0]
    with jax.default_device(device):
        graphdef, state = nnx.split(to_flax_nnx(sd, num_heads, dtype=jnp.dtype(dtype)))
    shapes = _flax_shapes(E, num_heads)

    def fn(params, query, key, value, keep):
        m = merged(graphdef, state, {f: linear_leaves(params, p, shapes[p]) for p, f in FLAX_NAMES.items()})
        if not need_weights:
            return m(query, key, value, mask=keep, deterministic=True)
        out, inter = nnx.capture(m, nnx.Intermediate)(query, key, value, mask=keep, deterministic=True, sow_weights=True)
        (w,) = inter["attention_weights"].get_value()
        return out, w

    return fn


flax_nnx_weights = functools.partial(_flax_nnx, need_weights=True)
flax_nnx_fused = functools.partial(_flax_nnx, need_weights=False)


# ---------------------------------------------------------------- decoding: MultiHeadAttention(decode=True)

_DECODE_CAPACITY = 16  # the first cache's slots; a full cache is doubled (zeros appended), which flax's mask ignores

CAUSAL_DECODE_FIXED = (0, 12, 11)
"""The first flax whose MultiHeadAttention ignores is_causal at decode (`is_causal and not decode`).
Before it, flax overlays tril(ones(1, C)) on the one query's row: slot 0 only, so every token of a
row attends its first slot alone (measured on 0.12.8: tests/test_peer_decode.py). flax 0.12.9 and
later need Python >= 3.12 and jax >= 0.11.1."""


def flax_version() -> tuple[int, ...]:
    """The installed flax's release as integers (0, 12, 8); pre-release suffixes dropped."""
    import flax

    return tuple(int(re.match(r"\d+", p).group()) for p in flax.__version__.split(".")[:3] if re.match(r"\d+", p))


def flax_nnx_decode_step(graphdef, state, params, x_t, cache, real, *, is_causal: bool = False,
                         mask_padding: bool = True):
    """One step of flax.nnx.MultiHeadAttention(decode=True) (traceable): x_t (B, 1, E), cache
    {"key", "value": (B, C, N, H), "index": int32 ()}, real (B, C) bool: the slots holding a real token,
    this step's included. Returns (output (B, 1, E), the next cache).

    flax writes every row's token at one shared `cache_index` and masks the slots after it
    (`arange(C) <= cache_index`); it has no per-row lengths or positions. mask_padding: also pass
    `real` as the mask (B, 1, 1, C), so no query attends a left-padding slot; False measures what flax
    does alone (it attends them). is_causal: flax's own causal flag at decode time (measured:
    tril(ones(1, C)) keeps slot 0 only).
    """
    m = merged(graphdef, state, params)
    B, C = cache["key"].shape[:2]
    m.init_cache((B, C, m.in_features), cache["key"].dtype)
    m.cached_key[...] = cache["key"]
    m.cached_value[...] = cache["value"]
    m.cache_index[...] = cache["index"]
    mask = real[:, None, None, :] if mask_padding else None  # (B, 1, 1, C)
    out = m(x_t, mask=mask, decode=True, deterministic=True, is_causal=is_causal)
    return out, {"key": m.cached_key[...], "value": m.cached_value[...], "index": m.cache_index[...]}


def flax_nnx_decode(sd, num_heads, *, dtype, device, is_causal: bool = False, mask_padding: bool = True):
    """flax.nnx.MultiHeadAttention(decode=True) as a decoder: fn(p, x_t, cache, position) -> (out, cache).

    Its cache is flax's own (init_cache: key, value (B, C, N, H), one cache_index for the batch) and
    `real` (B, C), the slots holding a real token (position >= 0), passed as the mask so that no
    query attends left padding; the positions are otherwise unused (no RoPE). p: the canonical
    parameters as JAX arrays, plugged into the module (the step is jax.jit-compiled, one compile per
    capacity). is_causal, mask_padding: see flax_nnx_decode_step (the defaults are the peer; the
    others measure flax alone).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    E = sd["q_proj.weight"].shape[0]
    with jax.default_device(device):
        graphdef, state = nnx.split(to_flax_nnx(sd, num_heads, dtype=jnp.dtype(dtype), decode=True))
    shapes = _flax_shapes(E, num_heads)

    @jax.jit
    def step(params, x_t, cache, real):
        layers = {f: linear_leaves(params, p, shapes[p]) for p, f in FLAX_NAMES.items()}
        return flax_nnx_decode_step(graphdef, state, layers, x_t, cache, real, is_causal=is_causal,
                                    mask_padding=mask_padding)

    def fn(p, x_t, cache, position):
        """cache: None on the first call, then {"key", "value", "index", "real"} as it returned."""
        x_t, position = jnp.asarray(x_t), jnp.asarray(position)
        if x_t.ndim != 3 or x_t.shape[1:] != (1, E):
            raise ValueError(f"flax-nnx-mha-decode: x_t must be (B, 1, E={E}) (one token per row), got {x_t.shape}")
        if x_t.dtype != jnp.dtype(dtype):
            raise TypeError(f"flax-nnx-mha-decode was built for {dtype}; x_t is {x_t.dtype}")
        B = x_t.shape[0]
        if not jnp.issubdtype(position.dtype, jnp.integer) or position.shape != (B,):
            raise ValueError(f"flax-nnx-mha-decode: position must be ({B},) integers, got {position.dtype} {position.shape}")
        if cache is None:
            zeros = jnp.zeros((B, _DECODE_CAPACITY, num_heads, E // num_heads), x_t.dtype)
            cache = {"key": zeros, "value": zeros, "index": jnp.zeros((), jnp.int32),
                     "real": jnp.zeros((B, _DECODE_CAPACITY), bool)}
        index = int(cache["index"])
        if index == cache["key"].shape[1]:  # full: twice the slots
            grow = lambda a: jnp.concatenate([a, jnp.zeros_like(a)], axis=1)  # noqa: E731
            cache = {**cache, "key": grow(cache["key"]), "value": grow(cache["value"]), "real": grow(cache["real"])}
        real = cache["real"].at[:, index].set(position >= 0)
        out, kv = step(p, x_t, {k: cache[k] for k in ("key", "value", "index")}, real)
        return out, {**kv, "real": real}

    return fn


def flax_nnx_decode_causal(sd, num_heads, *, dtype, device):
    """`flax_nnx_decode` with is_causal=True at every call, as a model that prefills with is_causal=True keeps
    it while decoding. flax older than `CAUSAL_DECODE_FIXED` keeps slot 0 only at decode: a `MissingPackage`
    (a skip row) naming that release, not a run whose rows would be red for flax's reason."""
    have = flax_version()
    if have < CAUSAL_DECODE_FIXED:
        fixed, installed = (".".join(map(str, v)) for v in (CAUSAL_DECODE_FIXED, have))
        raise MissingPackage(
            f"flax >= {fixed} is not installed (flax {installed} is): before {fixed}, is_causal=True at decode keeps "
            "slot 0 only (tril(ones(1, C)) over the cache), so every token attends its row's slot 0 alone (nothing "
            "where slot 0 is left padding); flax 0.12.9 and later need Python >= 3.12 and jax >= 0.11.1")
    return flax_nnx_decode(sd, num_heads, dtype=dtype, device=device, is_causal=True)


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    Implementation("flax-linen-mha", "jax", f"{__name__}:flax_linen", "jit", True, masked_rows="uniform", role="peer",
                   runs_on=FRAMEWORK_PEER_CASES, bench=False,
                   doc="flax.linen.MultiHeadDotProductAttention; mask True = attend; masked scores are finfo.min, "
                   "so empty rows are uniform"),
    Implementation("flax-nnx-mha", "jax", f"{__name__}:flax_nnx_weights", "jit", True, masked_rows="uniform", role="peer",
                   runs_on=FRAMEWORK_PEER_CASES,
                   doc="flax.nnx.MultiHeadAttention, sow_weights=True; mask True = attend; empty rows uniform"),
    Implementation("flax-nnx-mha-fused", "jax", f"{__name__}:flax_nnx_fused", "jit", False, masked_rows="uniform",
                   role="peer", family="flax-nnx-mha", harness=False, materializes=True,
                   doc="flax.nnx.MultiHeadAttention without weights"),
    # Without sow_weights flax calls jax.nn.dot_product_attention, whose softmax is float32 (float64: 1.4e-7 off).
    Implementation("flax-nnx-mha-decode", "jax", f"{__name__}:flax_nnx_decode", decode=True, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=False, runs_on=("self/*/*",),
                   doc="flax.nnx.MultiHeadAttention(decode=True), init_cache, one token per call, one cache_index for "
                   "the batch; left padding masked by a (B, 1, 1, C) mask of the real slots (flax has no per-row "
                   "lengths); a padding query is uniform over the C slots; the classic layer only (no RoPE)"),
    Implementation("flax-nnx-mha-decode-causal", "jax", f"{__name__}:flax_nnx_decode_causal", decode=True,
                   masked_rows="uniform", computes_in="float32", role="peer", bench=False, runs_on=("self/*/*",),
                   doc="flax-nnx-mha-decode with is_causal=True at every call (flax >= 0.12.11 ignores it at decode; "
                   "older flax keeps slot 0 only: a skip row)"),
)
