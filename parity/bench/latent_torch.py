"""`mha-bench latent`'s torch benches: `mha_torch.MultiHeadLatentAttention` forward, forward+backward and one
decode step, the step reading the latent cache naively, absorbed, or a cache of expanded keys and values.

Legend: B batch, T query length, S cached tokens, N heads, E embed, C kv_lora_rank, Dn/Dr/Dv the nope, rope and
value head dims, Dqk = Dn + Dr.
"""

from __future__ import annotations

import numpy as np
import torch

import mha_torch
from mha_torch.attention import fused_attention_core, positions_4d, rotate
from parity.bench.measure import Bench

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def module(cfg, weights: dict, dtype: str):
    """The layer from the canonical weights (`LatentAttentionConfig.weight_shapes()`), in `dtype`, eval mode."""
    m = mha_torch.MultiHeadLatentAttention(
        cfg.embed_dim, cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, rope=cfg.rope,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, norm_eps=cfg.norm_eps, bias=cfg.bias)
    m.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()}, strict=True)
    return m.to(DTYPES[dtype]).eval()


def _numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _sync(_):
    return None  # CPU: torch's calls return when done


def pass_bench(cfg, weights: dict, x: np.ndarray, cotangent: np.ndarray, dtype: str, form: str, pass_: str) -> Bench:
    """fwd or fwd+bwd over x (B, T, E), causal: form "eager" materialises the weights (need_weights=True),
    "fused" is SDPA. fwd+bwd's gradients: x's and every parameter's (canonical names)."""
    m = module(cfg, weights, dtype)
    need = form == "eager"
    xt = torch.from_numpy(x).to(DTYPES[dtype])
    g = torch.from_numpy(cotangent).to(DTYPES[dtype])
    if pass_ == "fwd":
        def step():
            with torch.inference_mode():
                return m(xt, need_weights=need, is_causal=True)[0]

        return Bench(step=step, sync=_sync, output=lambda: _numpy(step()))
    params = dict(m.named_parameters())

    def step():
        xg = xt.detach().requires_grad_()
        out = m(xg, need_weights=need, is_causal=True)[0]
        grads = torch.autograd.grad(out, [xg, *params.values()], g)
        return grads

    def gradients(grads):
        return {n: _numpy(t) for n, t in zip(["x", *params], grads)}

    return Bench(step=step, sync=_sync, output=lambda: _numpy(m(xt, need_weights=need, is_causal=True)[0].detach()),
                 gradients=gradients)


def decode_bench(cfg, weights: dict, x_prefill: np.ndarray, x_new: np.ndarray, dtype: str, form: str) -> tuple[Bench, int]:
    """One decode step of x_new (B, 1, E) after x_prefill (B, S, E), and the bytes its cache holds.

    Every timed call starts from the same prefilled cache (capacity S + 1: the step's slot is its last) and
    returns a new one (our torch caches are immutable): each call does the same work. form: "latent" reads the
    latent cache naively (keys and values expanded through kv_b_proj at every step), "absorbed" folds kv_b_proj
    into the query and the output, "kv" keeps the expanded per-head keys (B, N, S, Dqk) and values (B, N, S, Dv)
    as a plain multi-head cache would (`_KVStep`)."""
    m = module(cfg, weights, dtype)
    B, S, _ = x_prefill.shape
    pre, new = (torch.from_numpy(a).to(DTYPES[dtype]) for a in (x_prefill, x_new))
    with torch.inference_mode():
        _, _, cache = m(pre, need_weights=False, cache=m.init_cache(B, S + 1))
    if form == "kv":
        stepper = _KVStep(m, cache)
        return Bench(step=lambda: stepper(new), sync=_sync, output=lambda: _numpy(stepper(new))), stepper.nbytes
    absorb = form == "absorbed"

    def step():
        with torch.inference_mode():
            return m(new, need_weights=False, cache=cache, absorb=absorb)[0]

    nbytes = sum(t.numel() * t.element_size() for t in (cache.c, cache.k_pe))
    return Bench(step=step, sync=_sync, output=lambda: _numpy(step())), nbytes


class _KVStep:
    """MLA decoded from a cache of expanded keys and values: k = [k_nope | k_rot] (B, N, Cap, Dqk) and v
    (B, N, Cap, Dv), built here from the prefilled latent cache through kv_b_proj (the numbers a plain KV cache of
    this layer holds). A step projects the new token, expands its own latent, writes k/v at its slot (a new
    tensor, as the latent cache's write) and attends with SDPA."""

    def __init__(self, m, cache):
        with torch.inference_mode():
            k_nope, v = m.expand(cache.c)  # (B, N, Cap, Dn), (B, N, Cap, Dv)
            k_rot = cache.k_pe[:, None].expand(-1, k_nope.shape[1], -1, -1)  # (B, N, Cap, Dr): shared by the heads
            self.k, self.v = torch.cat([k_nope, k_rot], dim=-1), v
        self.m, self.cache = m, cache
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def __call__(self, x):  # x (B, 1, E)
        m, cache = self.m, self.cache
        with torch.inference_mode():
            q_nope, q_pe = m.queries(x)  # (B, N, 1, Dn), (B, N, 1, Dr)
            c, k_pe = m.latents(x)  # (B, 1, C), (B, 1, 1, Dr)
            pos = positions_4d(cache.positions(1), x.shape[0], 1, "positions", x.device)  # (B, 1, 1, 1)
            q_rot, k_rot = rotate(q_pe, pos, m.rope_config), rotate(k_pe, pos, m.rope_config)
            k_nope, v_new = m.expand(c)  # (B, N, 1, Dn), (B, N, 1, Dv)
            k_new = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, N, 1, Dqk)
            slot = cache.slots(1)[:, None, :, None]  # (B, 1, 1, 1)
            k = self.k.scatter(2, slot.expand_as(k_new), k_new)
            v = self.v.scatter(2, slot.expand_as(v_new), v_new)
            q = torch.cat([q_nope, q_rot], dim=-1)  # (B, N, 1, Dqk)
            context = fused_attention_core(q, k, v, cache.keep_mask(1), masked_rows=m.masked_rows,
                                           scale=m.config.softmax_scale)  # (B, N, 1, Dv)
            B = x.shape[0]
            return m.out_proj(context.transpose(1, 2).reshape(B, 1, -1))  # (B, 1, E)
