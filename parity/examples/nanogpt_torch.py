"""A plain-function PyTorch attention written the nanoGPT way, checked by mha-parity.

    mha-parity --impl parity.examples.nanogpt_torch:nanogpt --quick

The layer is a pure function of its parameters (the canonical state dict: q_proj,
k_proj, v_proj, out_proj weight (out, in) and bias), so the harness can take
gradients with respect to them. It takes a keep-mask (True = attend) of shape
(B, 1, T, S) and does what the classic module does with a row that may attend to
nothing: softmax of all -inf, i.e. NaN (masked_rows="nan").
Legend: B batch, T query length, S key length, N heads, H head dim, E = N·H.
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from parity.impls import implementation


@implementation(name="nanogpt-torch", framework="torch", mask="keep", masked_rows="nan", returns_weights=True,
                doc="parity.examples.nanogpt_torch: plain-function attention, nanoGPT style")
def nanogpt(state_dict, num_heads, *, dtype, device):
    def attend(p, query, key, value, keep):
        B, T, E = query.size()
        S, N = key.size(1), num_heads
        q = F.linear(query, p["q_proj.weight"], p["q_proj.bias"]).view(B, T, N, E // N).transpose(1, 2)  # (B, N, T, H)
        k = F.linear(key, p["k_proj.weight"], p["k_proj.bias"]).view(B, S, N, E // N).transpose(1, 2)  # (B, N, S, H)
        v = F.linear(value, p["v_proj.weight"], p["v_proj.bias"]).view(B, S, N, E // N).transpose(1, 2)  # (B, N, S, H)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, N, T, S)
        if keep is not None:
            att = att.masked_fill(~keep, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, N, T, H)
        y = y.transpose(1, 2).contiguous().view(B, T, E)  # re-assemble all head outputs side by side
        return F.linear(y, p["out_proj.weight"], p["out_proj.bias"]), att

    return attend
