"""A KV cache for incremental decoding: one layer's rotated keys and values, per-row lengths.

Semantics (docs/semantics.md, "Decoding with a KV cache"), the same in `mha_torch.kv_cache`:
row b's valid slots are starts[b] <= s < lengths[b]; slots before starts[b] are left padding,
slots from lengths[b] on are empty. T new tokens of row b go to slots lengths[b] .. lengths[b]+T-1;
new token i attends the slots starts[b] <= s <= lengths[b] + i; the token in slot s has the RoPE
position s - starts[b]. Keys are stored after RoPE, with the layer's K key/value heads. Llama 4's chunked
layers (`keep_mask(T, chunk=C)`) keep of those only the slots of the new token's own chunk of C positions
(position // C), the positions counted from the row's start.

A pytree of fixed shapes: the lengths are data, so one jitted step serves every position
without recompiling. Writes are `jax.lax.dynamic_update_slice` per row. More new tokens than
the cache has slots (T > C) is a ValueError everywhere, under jit too (both are shapes). A
row without room for the new tokens is an error where the lengths are known (outside jit);
under jit it is left unwritten and `fits` says so (the module returns NaN on that row: never
a silent overwrite, which dynamic_update_slice's clamped index would be).

The constructor checks the types, the shapes and, where they are known (not tracers), the
values: starts and lengths in [0, C] (a ValueError naming the field and its values). Under
jit the values are data: a cache made inside a jitted function is checked for its types and
shapes only, so make caches outside (`init_cache`, or `KVCache(...)` eagerly). A cache JAX
rebuilds from its leaves (a jitted function's output, `jax.tree.map`) is not re-checked:
reading the lengths back would wait for the device at every step.

The attention over a cache, `mha_jax.attention.cached_attention` (the pure core on head
tensors, exported as `mha_jax.cached_attention`), writes into it; this module holds the cache
alone and imports nothing of the attention.

Internal layout BTNH (legend in `mha_spec`): B batch, C capacity (slots), K key/value heads,
H head dim, T new tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mha_spec import check_cache_shapes
from mha_spec.structure import check_chunk


def row_ints(x, batch: int, name: str):
    """(B,) integer per-row counts as int32; None -> zeros. TypeError/ValueError naming them."""
    if x is None:
        return jnp.zeros((batch,), jnp.int32)
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax or numpy array of integers, got {type(x).__name__}")
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {x.dtype}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per batch row), got {tuple(x.shape)}")
    return jnp.asarray(x, jnp.int32)


def concrete_values(x) -> np.ndarray | None:
    """x's values where they are known (an array, not a tracer), else None."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray)):
        return None
    return np.asarray(x)


_FIELDS = ("k", "v", "starts", "lengths")


def _check_fields(cache) -> None:
    """The constructor's checks (see the module docstring)."""
    for name in _FIELDS:
        x = getattr(cache, name)
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"KVCache.{name} must be a jax or numpy array, got {type(x).__name__}")
    check_cache_shapes(cache.k.shape, cache.v.shape, cache.starts.shape, cache.lengths.shape, layout="BCKH")
    if cache.k.dtype != cache.v.dtype or not jnp.issubdtype(cache.k.dtype, jnp.floating):
        raise TypeError(f"KVCache keys and values must share one floating dtype: k {cache.k.dtype}, v {cache.v.dtype}")
    capacity = cache.k.shape[1]
    for name in ("starts", "lengths"):
        x = getattr(cache, name)
        if np.dtype(x.dtype).kind not in "iu":
            raise TypeError(f"KVCache.{name} must be integers (int32), got dtype {x.dtype}")
        known = concrete_values(x)
        if known is None:
            continue
        bad = (known < 0) | (known > capacity)
        if bad.any():
            raise ValueError(f"KVCache.{name} must lie in [0, capacity={capacity}] (one count of slots per row), got "
                             f"{known.tolist()}: rows {np.nonzero(bad)[0].tolist()} out of range")


@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v (B, C, K, H), starts and lengths (B,) int32. Immutable: `write` returns a new cache.

    starts[b] > lengths[b] is allowed: row b's left padding is not all written yet."""

    k: jax.Array  # (B, C, K, H), after RoPE
    v: jax.Array  # (B, C, K, H)
    starts: jax.Array  # (B,) int32: left-padding slots of each row
    lengths: jax.Array  # (B,) int32: slots written in each row (padding included)

    def __post_init__(self):
        _check_fields(self)

    @classmethod
    def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *, dtype, starts=None) -> KVCache:
        """A cache with nothing written: zeros, lengths 0. starts (B,): the left-padding slots each row's
        first write will begin with (default 0)."""
        for name, n in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "batch" else 1):
                raise ValueError(f"KVCache.empty: {name} must be a positive int, got {n!r}")
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"KVCache.empty: dtype must be floating, got {dtype}")
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            raise TypeError("KVCache.empty: float64 needs jax_enable_x64")
        starts = row_ints(starts, batch, "starts")  # its values: checked by the constructor where known
        k = jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype)
        return cls(k, jnp.zeros_like(k), starts, jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def fits(self, T: int) -> jax.Array:
        """bool (B,): whether T more tokens fit in each row. ValueError when T exceeds the capacity
        (shapes: under jit too), and where the lengths are known and some row has no room."""
        if T > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} slots per row: {T} new tokens do not fit in any row "
                             f"(more tokens than slots)")
        fits = self.lengths + T <= self.capacity
        known = concrete_values(self.lengths)
        if known is not None and (known + T > self.capacity).any():
            rows = np.nonzero(known + T > self.capacity)[0].tolist()
            raise ValueError(f"the cache holds {self.capacity} slots per row; rows {rows} with lengths "
                             f"{known[rows].tolist()} have no room for {T} more tokens")
        return fits

    def slots(self, T: int) -> jax.Array:
        """(B, T) int32: the slots T new tokens are written to, lengths[b] + i."""
        return self.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)

    def positions(self, T: int) -> jax.Array:
        """(B, T) int32: the default RoPE positions of T new tokens, their slot minus the row's padding."""
        return self.slots(T) - self.starts[:, None]

    def keep_mask(self, T: int, chunk: int | None = None) -> jax.Array:
        """bool (B, 1, T, C): new token i of row b keeps slots starts[b] <= s <= lengths[b] + i. chunk C (Llama 4's
        chunked layers, a Python int): also only the slots of its own chunk, (s - starts[b]) // C ==
        (lengths[b] + i - starts[b]) // C -- the chunks of the row's positions, counted from its first token."""
        s = jnp.arange(self.capacity, dtype=jnp.int32)  # (C,)
        last = self.slots(T)[:, None, :, None]  # (B, 1, T, 1)
        start = self.starts[:, None, None, None]  # (B, 1, 1, 1)
        keep = (s >= start) & (s <= last)
        if chunk is None:
            return keep
        C = check_chunk(chunk)
        return keep & ((s - start) // C == (last - start) // C)

    def write(self, k_new, v_new) -> KVCache:
        """A new cache holding k_new, v_new (B, T, K, H) at each row's next T slots, lengths + T;
        a row without room (under jit) is left as it was."""
        B, T, K, H = k_new.shape
        if tuple(v_new.shape) != tuple(k_new.shape) or (B, K, H) != (self.k.shape[0], self.k.shape[2], self.k.shape[3]):
            raise ValueError(f"new keys {tuple(k_new.shape)} and values {tuple(v_new.shape)} do not fit the cache "
                             f"{tuple(self.k.shape)} (B, C, K, H)")
        if k_new.dtype != self.k.dtype or v_new.dtype != self.k.dtype:
            raise TypeError(f"new keys/values are {k_new.dtype}/{v_new.dtype}, the cache holds {self.k.dtype}")
        fits = self.fits(T)  # (B,)

        def put(row, new, at):  # row (C, K, H), new (T, K, H)
            zero = jnp.zeros_like(at)  # one index dtype: a Python 0 is int64 under x64, at is int32
            return jax.lax.dynamic_update_slice(row, new, (at, zero, zero))

        k = jax.vmap(put)(self.k, k_new, self.lengths)
        v = jax.vmap(put)(self.v, v_new, self.lengths)
        keep_old = ~fits[:, None, None, None]
        return _unchecked(jnp.where(keep_old, self.k, k), jnp.where(keep_old, self.v, v), self.starts,
                          jnp.where(fits, self.lengths + T, self.lengths))


def register_cache(cls, fields: tuple[str, ...]):
    """Make a frozen cache class (KVCache, mha_jax.mla.LatentCache) a JAX pytree of its `fields`, and return
    its builder without the constructor's checks: JAX rebuilding one from its leaves (which may be tracers or
    JAX's placeholders), and `write`, whose fields follow from a checked cache."""

    def unchecked(*leaves):
        cache = object.__new__(cls)
        for name, x in zip(fields, leaves):
            object.__setattr__(cache, name, x)
        return cache

    jax.tree_util.register_pytree_with_keys(
        cls,
        lambda c: (tuple((jax.tree_util.GetAttrKey(n), getattr(c, n)) for n in fields), None),
        lambda _, leaves: unchecked(*leaves),
        flatten_func=lambda c: (tuple(getattr(c, n) for n in fields), None),
    )
    return unchecked


_unchecked = register_cache(KVCache, _FIELDS)

