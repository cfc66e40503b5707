"""The classic multi-head attention in Flax NNX, same semantics as `mha_torch`. Never imports torch."""

from mha_jax.attention import (MultiHeadAttention, attention_core, cached_attention, fused_attention_core,
                               segment_positions, structured_keep)
from mha_jax.chunked import chunked_attention
from mha_jax.kv_cache import KVCache
from mha_jax.mla import LatentCache, MultiHeadLatentAttention

__all__ = ["MultiHeadAttention", "attention_core", "fused_attention_core", "chunked_attention", "KVCache",
           "cached_attention", "segment_positions", "structured_keep", "MultiHeadLatentAttention", "LatentCache"]
