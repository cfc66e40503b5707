"""KV caches from one framework to the other, through NumPy, bit for bit.

`mha_torch.kv_cache.KVCache` holds k, v (B, K, C, H) (Hugging Face's DynamicCache layout) and
int64 starts/lengths; `mha_jax.kv_cache.KVCache` holds k, v (B, C, K, H) and int32 ones. The
semantics are one (docs/semantics.md, "Decoding with a KV cache"), so a prefill run in one
framework can be continued in the other. `NumpyKVCache` is the framework-free form, in torch's
layout (the oracle's, `parity.reference.decode`). Dtypes are kept: bfloat16 travels as
`ml_dtypes.bfloat16`; a float64 cache for JAX needs jax_enable_x64 (a TypeError otherwise, never
a silent float32). Hugging Face's DynamicCache converts in parity/peers/hf.py, with its library.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from mha_spec import check_cache_shapes
from parity.canonical import check_jax_dtype, numpy_to_tensor, tensor_to_numpy
from parity.implementation import FRAMEWORKS

__all__ = ["NumpyKVCache", "torch_to_jax", "jax_to_torch", "to_numpy", "from_numpy"]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class NumpyKVCache:
    """k, v (B, K, C, H) NumPy arrays of one floating dtype (bfloat16 as ml_dtypes.bfloat16), after RoPE;
    starts and lengths (B,) int64 in [0, C] (checked, as by the frameworks' caches)."""

    k: np.ndarray  # (B, K, C, H)
    v: np.ndarray  # (B, K, C, H)
    starts: np.ndarray  # (B,) int64
    lengths: np.ndarray  # (B,) int64

    def __post_init__(self):
        for name in ("k", "v", "starts", "lengths"):
            if not isinstance(getattr(self, name), np.ndarray):
                raise TypeError(f"NumpyKVCache.{name} must be a numpy array, got {type(getattr(self, name)).__name__}")
        check_cache_shapes(self.k.shape, self.v.shape, self.starts.shape, self.lengths.shape, layout="BKCH")
        if self.k.dtype != self.v.dtype or not _floating(self.k.dtype):
            raise TypeError(f"cache keys and values must share one floating dtype: k {self.k.dtype}, v {self.v.dtype}")
        for name in ("starts", "lengths"):
            x = getattr(self, name)
            if x.dtype != np.int64:
                raise TypeError(f"NumpyKVCache.{name} must be int64, got {x.dtype}")
            bad = (x < 0) | (x > self.capacity)
            if bad.any():  # the frameworks' caches refuse these too: a negative start shifts every RoPE position
                raise ValueError(f"NumpyKVCache.{name} must lie in [0, capacity={self.capacity}] (one count of slots "
                                 f"per row), got {x.tolist()}: rows {np.nonzero(bad)[0].tolist()} out of range")

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def _floating(dtype) -> bool:
    import ml_dtypes

    return np.dtype(dtype) == ml_dtypes.bfloat16 or np.issubdtype(dtype, np.floating)


def _kind(cache) -> str | None:
    """"torch", "jax", "numpy" for our caches (a framework counts only once imported), else None."""
    if isinstance(cache, NumpyKVCache):
        return "numpy"
    for framework in FRAMEWORKS:
        mod = sys.modules.get(f"mha_{framework}.kv_cache")
        if mod is not None and isinstance(cache, mod.KVCache):
            return framework
    return None


def _refuse(cache, wanted: str, hint: str) -> None:
    kind = _kind(cache)
    if kind == wanted:
        return
    name = f"{type(cache).__module__}.{type(cache).__qualname__}"
    extra = f" (a {kind} cache: {hint})" if kind else (
        " (Hugging Face's DynamicCache converts in parity.peers.hf)" if "DynamicCache" in name else "")
    label = {"torch": "mha_torch.kv_cache.KVCache", "jax": "mha_jax.kv_cache.KVCache"}.get(wanted, "NumpyKVCache")
    raise TypeError(f"expected a {label}, got {name}{extra}")


def _rows(x, name: str) -> np.ndarray:
    """(B,) integer counts as int64, values checked to fit int32 (JAX's dtype for them)."""
    x = np.asarray(x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"cache {name} must be integers, got dtype {x.dtype}")
    x = x.astype(np.int64)
    if ((x < 0) | (x > _INT32_MAX)).any():
        raise ValueError(f"cache {name} must lie in [0, {_INT32_MAX}], got {x.tolist()}")
    return x


def to_numpy(cache) -> NumpyKVCache:
    """Our torch or JAX cache (or a NumpyKVCache, copied) -> NumpyKVCache in the (B, K, C, H) layout."""
    kind = _kind(cache)
    if kind == "torch":
        k, v = tensor_to_numpy(cache.k), tensor_to_numpy(cache.v)
        starts, lengths = tensor_to_numpy(cache.starts), tensor_to_numpy(cache.lengths)
    elif kind == "jax":
        import jax

        if any(isinstance(getattr(cache, n), jax.core.Tracer) for n in ("k", "v", "starts", "lengths")):
            raise TypeError("a traced JAX cache (inside jit or vmap) has no values to convert: convert it outside")
        k, v = (np.asarray(a).transpose(0, 2, 1, 3) for a in (cache.k, cache.v))  # (B, C, K, H) -> (B, K, C, H)
        starts, lengths = np.asarray(cache.starts), np.asarray(cache.lengths)
    elif kind == "numpy":
        k, v, starts, lengths = cache.k, cache.v, cache.starts, cache.lengths
    else:
        name = f"{type(cache).__module__}.{type(cache).__qualname__}"
        hint = " (Hugging Face's DynamicCache converts in parity.peers.hf)" if "DynamicCache" in name else ""
        raise TypeError(f"expected mha_torch.kv_cache.KVCache, mha_jax.kv_cache.KVCache or NumpyKVCache, got {name}{hint}")
    k, v = np.ascontiguousarray(k).copy(), np.ascontiguousarray(v).copy()
    return NumpyKVCache(k, v, _rows(starts, "starts"), _rows(lengths, "lengths"))


def from_numpy(cache: NumpyKVCache, framework: str, *, device=None):
    """NumpyKVCache -> the cache of `framework` ("torch" or "jax"), dtype kept; `device` is a torch
    device or a jax.Device (default: the framework's default)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    _refuse(cache, "numpy", "convert it with to_numpy first")
    if framework == "torch":
        from mha_torch.kv_cache import KVCache

        return KVCache(numpy_to_tensor(cache.k, device), numpy_to_tensor(cache.v, device),
                       numpy_to_tensor(cache.starts, device), numpy_to_tensor(cache.lengths, device))
    import jax
    import jax.numpy as jnp

    from mha_jax.kv_cache import KVCache

    check_jax_dtype(cache.k.dtype)

    def put(a):
        a = jnp.asarray(a)
        return a if device is None else jax.device_put(a, device)

    k, v = (put(np.ascontiguousarray(a.transpose(0, 2, 1, 3))) for a in (cache.k, cache.v))  # (B, C, K, H)
    out = KVCache(k, v, put(cache.starts.astype(np.int32)), put(cache.lengths.astype(np.int32)))
    if out.k.dtype != cache.k.dtype:  # jnp.asarray narrows without x64; check_jax_dtype refuses that first
        raise TypeError(f"JAX stored the cache as {out.k.dtype}, not {cache.k.dtype}")
    return out


def torch_to_jax(cache, *, device=None):
    """mha_torch.kv_cache.KVCache -> mha_jax.kv_cache.KVCache, bit for bit (k, v transposed to (B, C, K, H),
    starts and lengths as int32). TypeError for a float64 cache without jax_enable_x64."""
    _refuse(cache, "torch", "use jax_to_torch")
    return from_numpy(to_numpy(cache), "jax", device=device)


def jax_to_torch(cache, device=None):
    """mha_jax.kv_cache.KVCache -> mha_torch.kv_cache.KVCache on `device` (default CPU), bit for bit
    (k, v transposed to (B, K, C, H), starts and lengths as int64)."""
    _refuse(cache, "jax", "use torch_to_jax")
    return from_numpy(to_numpy(cache), "torch", device=device)
