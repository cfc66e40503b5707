"""A Llama attention layer written the Hugging Face way, checked as it is written.

    mha-parity --quick --impl parity.examples.llama_torch:layer

`LlamaAttention` is what a researcher has in a PyTorch model today: one input
(`forward(hidden_states, attention_mask, position_ids)`), `q_proj`/`k_proj`/`v_proj`/`o_proj`
(q/k/v biases only where the model has them: none in Llama and Mistral, present in Qwen2; no
bias on `o_proj`), K key/value heads repeated for their N/K query heads (`repeat_kv`), rotate-half
RoPE with cos/sin in float32, an additive mask (0 / -inf) and the softmax in float32 whatever
the model's dtype. Nothing in it was changed for the harness: the declaration says what it is
(one input, the hf-llama parameter names, the layer's features, float32 arithmetic) and the
harness calls it so.

Legend: B batch, L length, N query heads, K key/value heads, H head dim, E = N·H.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parity.impls import implementation

# The layer always has grouped heads, rotate-half RoPE and no o_proj bias; q/k/v biases are optional.
REQUIRES, RUNS_ALSO = ("grouped", "rope-half", "no-out-bias"), ("no-qkv-bias",)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(position_ids, head_dim: int, theta: float, dtype):
    """cos, sin (B, 1, L, H) for rotate-half, computed in float32 (as HF's rotary embedding), then cast to `dtype`."""
    H = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, H, 2, dtype=torch.float32) / H))
    freqs = position_ids[:, :, None].float() * inv_freq.to(position_ids.device)  # (B, L, H/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, H)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def repeat_kv(x, groups: int):
    """(B, K, L, H) -> (B, K·groups, L, H): query head h reads key/value head h // groups."""
    B, K, L, H = x.shape
    return x[:, :, None].expand(B, K, groups, L, H).reshape(B, K * groups, L, H)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, rope_theta: float, qkv_bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def rotary(self, position_ids, dtype):
        return rotary(position_ids, self.head_dim, self.rope_theta, dtype)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        B, L, _ = hidden_states.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(hidden_states).view(B, L, N, H).transpose(1, 2)  # (B, N, L, H)
        k = self.k_proj(hidden_states).view(B, L, K, H).transpose(1, 2)  # (B, K, L, H)
        v = self.v_proj(hidden_states).view(B, L, K, H).transpose(1, 2)  # (B, K, L, H)
        if position_ids is None:
            position_ids = torch.arange(L, device=hidden_states.device)[None].expand(B, L)
        cos, sin = self.rotary(position_ids, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, N // K), repeat_kv(v, N // K)  # (B, N, L, H)
        scores = q @ k.transpose(2, 3) / math.sqrt(H)  # (B, N, L, L)
        if attention_mask is not None:
            scores = scores + attention_mask  # additive: 0 where attended, -inf where masked
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (weights @ v).transpose(1, 2).reshape(B, L, N * H)  # (B, L, E)
        return self.o_proj(out), weights


# What the layer is, in the registry's words: the harness calls it as it is written.
DECLARED = dict(framework="torch", inputs="self", names="hf-llama", requires=REQUIRES, variants=RUNS_ALSO,
                computes_in="float32",
                mask="additive", masked_rows="nan", masked_row_grads="flow", returns_weights=True)


@implementation(name="llama-torch-layer", doc="parity.examples.llama_torch: an HF-style LlamaAttention", **DECLARED)
def layer(state_dict, num_heads, *, dtype, device, problem):
    c = problem.config
    module = LlamaAttention(c.embed_dim, c.num_heads, c.kv_heads, c.rope_theta, c.qkv_bias)
    module = module.to(device=device, dtype=getattr(torch, dtype))

    def fn(params, x, attention_mask, positions=None):  # params: hf-llama names (q_proj.weight, ..., o_proj.weight)
        return torch.func.functional_call(module, params, (x, attention_mask, positions))

    return fn
