"""Deprecated: the former name of `parity.cache_transfer` (KV caches between the frameworks); importing it
warns, and it is removed after 2027-03-01. `mha_torch.kv_cache` and `mha_jax.kv_cache` are the caches
themselves; this module only re-exports the transfer between them."""

import warnings

from parity.cache_transfer import NumpyKVCache, from_numpy, jax_to_torch, to_numpy, torch_to_jax

__all__ = ["NumpyKVCache", "torch_to_jax", "jax_to_torch", "to_numpy", "from_numpy"]

# stacklevel=2: the line that imported this module, as parity.ecosystem does.
warnings.warn("parity.kv_cache is deprecated and removed after 2027-03-01: import its names from "
              "parity.cache_transfer", DeprecationWarning, stacklevel=2)
