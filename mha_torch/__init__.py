"""The classic multi-head attention in PyTorch. Never imports jax."""

from mha_torch.attention import (MultiHeadAttention, QKNorm, attention_core, fused_attention_core,
                                 materialised_context, segment_positions, structured_keep)
from mha_torch.kv_cache import KVCache, StaticKVCache
from mha_torch.mla import LatentCache, LatentStages, MultiHeadLatentAttention
from mha_torch.parallel import tensor_parallel_plan

__all__ = ["KVCache", "LatentCache", "LatentStages", "MultiHeadAttention", "MultiHeadLatentAttention", "QKNorm",
           "StaticKVCache", "attention_core", "fused_attention_core", "materialised_context", "segment_positions",
           "structured_keep", "tensor_parallel_plan"]
