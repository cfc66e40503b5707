"""Planted bugs for the harness's own tests: adapters that wrap one of ours and break one thing.

Each is an ordinary `Implementation` (role "user"), so a planted bug travels the same road
as a researcher's own layer: built from the canonical weights, judged by the oracle, and
localised to a stage through the wrapped module's intermediates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from mha_spec import VARIANT_FEATURES
from parity.impls import Implementation, builtin


def _wrap(base_name: str, name: str, around):
    """An Implementation running `base_name`'s fn and intermediates through `around(fn) -> fn`."""
    base = builtin(base_name)

    def factory(sd, num_heads, **kw):
        kw.setdefault("masked_rows", "uniform")  # the planted adapters follow the test case's policy
        fn = base.resolve_factory()(sd, num_heads, **kw)
        wrapped = around(fn)
        wrapped.intermediates = around(fn.intermediates)
        return wrapped

    return Implementation(name, base.framework, factory, base.mode, base.returns_weights, masked_rows="uniform",
                          role="user")


def _transpose_q(fn):
    @functools.wraps(fn)
    def call(params, *args):
        return fn({**params, "q_proj.weight": params["q_proj.weight"].T}, *args)

    return call


def _flip_mask(fn):
    @functools.wraps(fn)
    def call(params, q, k, v, keep):
        return fn(params, q, k, v, None if keep is None else ~keep)

    return call


@contextlib.contextmanager
def _doubled_q_in_core(module):
    """Swap the attention cores for ones that see 2·q: the scores are scaled by 2/√H."""
    saved = {n: getattr(module, n) for n in ("attention_core", "fused_attention_core")}
    for n, real in saved.items():
        setattr(module, n, lambda q, k, v, keep=None, _real=real, **kw: _real(q * 2, k, v, keep, **kw))
    try:
        yield
    finally:
        for n, real in saved.items():
            setattr(module, n, real)


def _wrong_scale(module):
    def around(fn):
        @functools.wraps(fn)
        def call(*args):
            with _doubled_q_in_core(module):
                return fn(*args)

        return call

    return around


def transposed_q_weight(framework="jax"):
    return _wrap("jax-jit" if framework == "jax" else "torch", f"{framework}-transposed-q", _transpose_q)


def flipped_mask(framework="jax"):
    return _wrap("jax-jit" if framework == "jax" else "torch", f"{framework}-flipped-mask", _flip_mask)


def wrong_scale(base_name="torch"):
    import importlib

    module = importlib.import_module("mha_torch.attention" if base_name.startswith("torch") else "mha_jax.attention")
    return _wrap(base_name, f"{base_name}-wrong-scale", _wrong_scale(module))


# ---------------------------------------------------------------- the classic Llama porting bugs


def _interleaved_rotation(x, cos, sin):
    """Meta's pairing (2i, 2i+1) applied with rotate-half's cos/sin: the RoPE conventions mixed up."""
    import jax.numpy as jnp

    H = x.shape[-1]
    c, s = cos[..., : H // 2], sin[..., : H // 2]  # rotate-half's tables repeat each angle twice
    xa = x.astype(cos.dtype)
    x1, x2 = xa[..., 0::2], xa[..., 1::2]
    return jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape).astype(x.dtype)


def _llama_port(name: str, **bug):
    """parity.examples.llama_jax's port with one classic bug planted (its own declarations)."""
    from parity.examples import llama_jax

    def factory(sd, num_heads, *, dtype, device, problem):
        return llama_jax.make_attention(problem.config, **bug)

    return Implementation(name, "jax", factory, "jit", True, masked_rows="nan", role="user",
                          variants=llama_jax.port.variants)


def llama_tile_kv():
    """K/V heads spread with jnp.tile (head h reads h % K) instead of jnp.repeat (h // (N/K))."""
    import jax.numpy as jnp

    return _llama_port("llama-tile-kv", repeat_kv=lambda x, g: jnp.tile(x, (1, 1, g, 1)))


def llama_rope_swapped():
    """Rotate-half weights rotated with Meta's interleaved pairs."""
    return _llama_port("llama-rope-swapped", rotate=_interleaved_rotation)


def llama_key_positions_off_by_one():
    """The keys rotated by position + 1."""
    return _llama_port("llama-key-pos-off-by-one", key_position_shift=1)


# ---------------------------------------------------------------- RoPE bugs in our torch module

# The variants of a rotate-half-only port (parity.examples.llama_jax:port's): the interleaved case is a skip row.
ROTATE_HALF_ONLY = ("grouped", "rope-half", "no-qkv-bias", "no-out-bias")


def wrap_torch_variants(name: str, around, variants: tuple[str, ...] = VARIANT_FEATURES):
    """Our torch module (the case's policy, its stages) declaring `variants`, with `around(fn) -> fn`."""
    base = builtin("torch")

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)
        wrapped = around(fn)
        wrapped.intermediates = around(fn.intermediates)
        return wrapped

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=variants)


@contextlib.contextmanager
def _rotation_at_theta_10000():
    import mha_torch.attention as attention

    real = attention.rotate
    attention.rotate = lambda x, pos, config, max_position=None: real(
        x, pos, dataclasses.replace(config, rope_theta=10000.0), max_position)
    try:
        yield
    finally:
        attention.rotate = real


def _at_theta_10000(fn):
    @functools.wraps(fn)
    def call(*args, **kw):
        with _rotation_at_theta_10000():
            return fn(*args, **kw)

    return call


def keys_at_query_positions(positions, S: int, xp):
    """(B, S) key positions made from the query positions (B, T), as a port with one position list
    makes them: the queries taken for the newest keys, the keys before them one step apart (T == S:
    the query positions themselves). xp: the array module (numpy, torch, jax.numpy)."""
    T = positions.shape[1]
    if S <= T:
        return positions[:, T - S:]
    before = positions[:, :1] - xp.arange(S - T, 0, -1)  # (B, S - T)
    return xp.concatenate([before, positions], 1)


def _keys_at_query_positions(fn):
    import torch

    @functools.wraps(fn)
    def call(params, query, key, *rest, positions=None, key_positions=None):
        if positions is not None:
            key_positions = keys_at_query_positions(positions, key.shape[1], torch)
        return fn(params, query, key, *rest, positions=positions, key_positions=key_positions)

    return call


def theta_10000(variants: tuple[str, ...] = VARIANT_FEATURES):
    """rope_theta hard-coded to 10000 (Llama 2's base), whatever the layer's is."""
    suffix = "-half-only" if "rope-interleaved" not in variants else ""
    return wrap_torch_variants(f"theta-10000{suffix}", _at_theta_10000, variants)


def keys_rotated_at_query_positions(variants: tuple[str, ...] = VARIANT_FEATURES):
    """The keys rotated with the query positions (`keys_at_query_positions`), not their own."""
    suffix = "-half-only" if "rope-interleaved" not in variants else ""
    return wrap_torch_variants(f"keys-at-query-positions{suffix}", _keys_at_query_positions, variants)
