"""A Qwen3 attention layer written the Hugging Face way, checked as it is written.

    mha-parity --cases "qwen3*" --impl parity.examples.qwen3_torch:layer --impl parity.examples.modern_jax:port

`Qwen3Attention` is what a researcher has in a PyTorch model: one input, `q_proj`/`k_proj`/`v_proj`/`o_proj`
without biases and with a head dim of its own (N·H ≠ E), an RMSNorm of each head's q and k before RoPE
(`q_norm`, `k_norm`: weight (H,), computed in float32 and cast back, as Qwen3RMSNorm), K key/value
heads repeated for their N/K query heads, rotate-half RoPE with cos/sin in float32, an additive mask and
the softmax in float32. The declaration says what it is (one input, the hf-llama parameter names with
its norms, the features it always has, float32 arithmetic); `parity.examples.modern_jax:port` is a JAX
port of the same maths.
Legend: B batch, L length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from parity.examples.llama_torch import repeat_kv, rotary, rotate_half
from parity.impls import implementation

# Qwen3's layer always has grouped heads, rotate-half RoPE, no biases and its QK-norm per head.
REQUIRES, RUNS_ALSO = ("grouped", "rope-half", "no-qkv-bias", "no-out-bias", "qk-norm-head"), ("head-dim",)


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: x / sqrt(mean(x²) + eps) in float32, cast back, times the weight."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float,
                 eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = num_heads, num_kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        B, L, _ = hidden_states.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(B, L, N, H)).transpose(1, 2)  # (B, N, L, H)
        k = self.k_norm(self.k_proj(hidden_states).view(B, L, K, H)).transpose(1, 2)  # (B, K, L, H)
        v = self.v_proj(hidden_states).view(B, L, K, H).transpose(1, 2)  # (B, K, L, H)
        if position_ids is None:
            position_ids = torch.arange(L, device=hidden_states.device)[None].expand(B, L)
        cos, sin = rotary(position_ids, H, self.rope_theta, q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, N // K), repeat_kv(v, N // K)  # (B, N, L, H)
        scores = q @ k.transpose(2, 3) * H ** -0.5  # (B, N, L, L)
        if attention_mask is not None:
            scores = scores + attention_mask  # additive: 0 where attended, -inf where masked
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ v).transpose(1, 2).reshape(B, L, N * H)  # (B, L, N·H)
        return self.o_proj(out), weights


DECLARED = dict(framework="torch", inputs="self", names="hf-llama", requires=REQUIRES, variants=RUNS_ALSO,
                computes_in="float32", mask="additive", masked_rows="nan", masked_row_grads="flow",
                returns_weights=True)


@implementation(name="qwen3-torch-layer", doc="parity.examples.qwen3_torch: an HF-style Qwen3Attention", **DECLARED)
def layer(state_dict, num_heads, *, dtype, device, problem):
    c = problem.config
    module = Qwen3Attention(c.embed_dim, c.num_heads, c.kv_heads, c.head_size, c.rope_theta, c.qk_norm_eps)
    module = module.to(device=device, dtype=getattr(torch, dtype))

    def fn(params, x, attention_mask, positions=None):  # params: hf-llama names (o_proj.weight), q_norm/k_norm
        return torch.func.functional_call(module, params, (x, attention_mask, positions))

    return fn
