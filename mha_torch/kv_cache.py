"""A KV cache for incremental decoding: one layer's rotated keys and values, per-row lengths.

Semantics (docs/semantics.md, "Decoding with a KV cache"), the same in `mha_jax.kv_cache`:
row b's valid slots are starts[b] <= s < lengths[b]; slots before starts[b] are left padding,
slots from lengths[b] on are empty. T new tokens of row b go to slots lengths[b] .. lengths[b]+T-1;
new token i attends the slots starts[b] <= s <= lengths[b] + i; the token in slot s has the RoPE
position s - starts[b]. Llama 4's chunked layers (`keep_mask(T, chunk=C)`) keep of those only the slots of
the new token's own chunk of C positions (position // C), the positions counted from the row's start. Keys are
stored after the QK-norm (if the layer has one) and RoPE, with the layer's K key/value heads.

`KVCache` is immutable (`write` returns a new cache: a prefix can be continued twice); `StaticKVCache` is the
same cache written in place (no copy of the cache per step; the cache a call was given is spent).

Shapes (legend in `mha_spec`): B batch, K key/value heads, C capacity (slots), H head dim,
T new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mha_spec import check_cache_shapes
from mha_spec.structure import check_chunk


def _row_ints(x, batch: int, name: str, device) -> torch.Tensor:
    """(B,) integer per-row counts as int64 on `device`; None -> zeros. TypeError/ValueError naming them."""
    if x is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got dtype {x.dtype}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per batch row), got {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int64)


def check_slot_counts(x: torch.Tensor, capacity: int, name: str) -> None:
    """ValueError naming the field and its values unless every row's count lies in [0, capacity]: a negative
    `starts` would shift every RoPE position (slot - starts), a negative `lengths` write before slot 0.
    Not checked while torch.compile traces or on the meta device (no values there)."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return
    bad = (x < 0) | (x > capacity)
    if bool(bad.any()):
        raise ValueError(f"KVCache.{name} must lie in [0, capacity={capacity}] (one count of slots per row), got "
                         f"{x.tolist()}: rows {bad.nonzero().flatten().tolist()} out of range")


@dataclass(frozen=True)
class KVCache:
    """k, v (B, K, C, H) (HF's DynamicCache layout), starts and lengths (B,) int64.

    Immutable: `write` returns a new cache, so a step is a pure function of (cache, tokens) and a
    prefill can be continued twice (or in the other framework, `parity.cache_transfer`).

    The constructor checks the types, the shapes and the values: starts and lengths in [0, C]
    (a ValueError naming the field and its values; not while torch.compile traces, where there are
    no values). starts[b] > lengths[b] is allowed: row b's left padding is not all written yet.
    """

    k: torch.Tensor  # (B, K, C, H), after the QK-norm and RoPE
    v: torch.Tensor  # (B, K, C, H)
    starts: torch.Tensor  # (B,) int64: left-padding slots of each row
    lengths: torch.Tensor  # (B,) int64: slots written in each row (padding included)

    def __post_init__(self):
        for name in ("k", "v", "starts", "lengths"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"KVCache.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        check_cache_shapes(self.k.shape, self.v.shape, self.starts.shape, self.lengths.shape, layout="BKCH")
        if self.k.dtype != self.v.dtype or not self.k.dtype.is_floating_point:
            raise TypeError(f"KVCache keys and values must share one floating dtype: k {self.k.dtype}, v {self.v.dtype}")
        for name in ("starts", "lengths"):
            x = getattr(self, name)
            if x.dtype != torch.int64:
                raise TypeError(f"KVCache.{name} must be int64, got {x.dtype}")
        # Values: on the host where they can be read (not while torch.compile traces, not on the meta device).
        for name in ("starts", "lengths"):
            check_slot_counts(getattr(self, name), self.capacity, name)

    @classmethod
    def empty(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *, dtype, device=None,
              starts=None) -> KVCache:
        """A cache with nothing written: zeros, lengths 0. starts (B,): the left-padding slots each row's
        first write will begin with (default 0)."""
        for name, n in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "batch" else 1):
                raise ValueError(f"KVCache.empty: {name} must be a positive int, got {n!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"KVCache.empty: dtype must be a floating torch.dtype, got {dtype!r}")
        k = torch.zeros(batch, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        starts = _row_ints(starts, batch, "starts", k.device)  # its values: checked by the constructor
        return cls(k, torch.zeros_like(k), starts, torch.zeros(batch, dtype=torch.int64, device=k.device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def check_room(self, T: int) -> None:
        """ValueError if T more tokens do not fit in some row (eager; under torch.compile the index_put
        of `write` is not checked here, as the lengths are not known while tracing)."""
        if torch.compiler.is_compiling():
            return
        over = self.lengths + T > self.capacity
        if bool(over.any()):
            raise ValueError(f"the cache holds {self.capacity} slots per row; rows {over.nonzero().flatten().tolist()} "
                             f"with lengths {self.lengths[over].tolist()} have no room for {T} more tokens")

    def slots(self, T: int) -> torch.Tensor:
        """(B, T) int64: the slots T new tokens are written to, lengths[b] + i."""
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) int64: the default RoPE positions of T new tokens, their slot minus the row's padding."""
        return self.slots(T) - self.starts[:, None]

    def keep_mask(self, T: int, chunk: int | None = None) -> torch.Tensor:
        """bool (B, 1, T, C): new token i of row b keeps slots starts[b] <= s <= lengths[b] + i. chunk C (Llama 4's
        chunked layers): also only the slots of its own chunk, (s - starts[b]) // C == (lengths[b] + i -
        starts[b]) // C -- the chunks of the row's positions (slot - starts[b]), counted from its first token."""
        s = torch.arange(self.capacity, device=self.lengths.device)  # (C,)
        last = self.slots(T)[:, None, :, None]  # (B, 1, T, 1)
        start = self.starts[:, None, None, None]  # (B, 1, 1, 1)
        keep = (s >= start) & (s <= last)
        if chunk is None:
            return keep
        C = check_chunk(chunk)
        return keep & (torch.div(s - start, C, rounding_mode="floor") == torch.div(last - start, C, rounding_mode="floor"))

    def write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> KVCache:
        """A new cache holding k_new, v_new (B, K, T, H) at each row's next T slots, lengths + T."""
        B, K, T, H = k_new.shape
        if tuple(v_new.shape) != tuple(k_new.shape) or (B, K, H) != (self.k.shape[0], self.k.shape[1], self.k.shape[3]):
            raise ValueError(f"new keys {tuple(k_new.shape)} and values {tuple(v_new.shape)} do not fit the cache "
                             f"{tuple(self.k.shape)} (B, K, C, H)")
        if k_new.dtype != self.k.dtype or v_new.dtype != self.k.dtype:
            raise TypeError(f"new keys/values are {k_new.dtype}/{v_new.dtype}, the cache holds {self.k.dtype}")
        self.check_room(T)
        index = self.slots(T)[:, None, :, None].expand(B, K, T, H)  # (B, K, T, H)
        k, v = self._scatter(index, k_new, v_new)
        return _checked_elsewhere(type(self), k, v, self.starts, self.lengths + T)

    def _scatter(self, index, k_new, v_new):
        """(k, v) (B, K, C, H) with the new tokens at `index` (B, K, T, H): new tensors (the old cache is kept)."""
        return self.k.scatter(2, index, k_new), self.v.scatter(2, index, v_new)


@dataclass(frozen=True)
class StaticKVCache(KVCache):
    """A `KVCache` whose `write` updates k and v IN PLACE (as Hugging Face's StaticCache and serving loops do):
    the same fields (k, v (B, K, C, H), starts, lengths (B,) int64), the same slots, keep-masks and checks,
    preallocated once (`empty`, `MultiHeadAttention.init_cache(..., static=True)`), and no copy of the cache
    per step: `write` scatters the new keys and values into the tensors it holds (`Tensor.scatter_`, at slots
    lengths[b] + i) and returns a StaticKVCache sharing those tensors, with lengths + T. No `.item()` and no
    branch on tensor values in the step, so a step compiles under torch.compile(fullgraph=True) (the room
    check, eager only, is `KVCache.check_room`'s).

    In place means: the cache a call was given is spent. Its k and v ARE the returned cache's, so it now holds
    the new tokens too, past its own lengths; continuing it again (a second continuation of one prompt, a beam,
    a retry) overwrites the first continuation's slots in the shared tensors. Continue a prefix twice with the
    immutable `KVCache` (or a `clone()` of this one, taken before the step). Under autograd, the in-place write
    into tensors an earlier step's graph saved is an error: decode under torch.no_grad() (or
    torch.inference_mode()).
    """

    def _scatter(self, index, k_new, v_new):
        self.k.scatter_(2, index, k_new)  # (B, K, C, H), in place: no new cache tensor per step
        self.v.scatter_(2, index, v_new)
        return self.k, self.v

    def clone(self) -> StaticKVCache:
        """A StaticKVCache of its own tensors (a copy of every field): one more prefix to continue."""
        return _checked_elsewhere(StaticKVCache, self.k.clone(), self.v.clone(), self.starts.clone(),
                                  self.lengths.clone())


def _checked_elsewhere(cls, k, v, starts, lengths) -> KVCache:
    """A KVCache (cls: it or StaticKVCache) built without the constructor's checks: `write`'s, whose fields follow
    from a checked cache and `check_room`; reading the new lengths back would wait for the device at every step."""
    cache = object.__new__(cls)
    for name, x in (("k", k), ("v", v), ("starts", starts), ("lengths", lengths)):
        object.__setattr__(cache, name, x)
    return cache
