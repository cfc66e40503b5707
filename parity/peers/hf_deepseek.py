"""transformers' DeepSeek multi-head latent attention as the latent harness's peer (`parity.harness.latent`).

    hf-deepseek-v3  DeepseekV3Attention: rope_interleave True (consecutive pairs, de-interleaved before
                    rotate_half: the same scores) or False (halves); YaRN's mscale_all_dim in its scaling
    hf-deepseek-v2  DeepseekV2Attention: consecutive pairs always (apply_rotary_emb's complex view); runs the
                    interleaved cases only. Its view_as_complex needs q's strides even: with an odd
                    qk_nope_head_dim + qk_rope_head_dim its float32 call raises (a float64 one copies first)

Built from a one-layer config of the case's sizes, eager attention, the case's canonical weights under
transformers' names (`parity.latent.to_hf_deepseek`); the mask is its additive float mask (0 / -inf: a
case's rows each keep a key); RoPE positions are its position_ids (cos/sin from its rotary embedding, float32).
Decode through its DynamicCache, which holds the latent (kv_a_layernorm's c) and the rotated k_pe: one path
(no absorbed form). Its cos/sin, norms and softmax are float32 even in a float64 module: computes_in float32.
"""

from __future__ import annotations

import numpy as np

from mha_spec import LatentAttentionConfig
from parity.canonical import tensor_to_numpy
from parity.peers.hf import transformers_module
from parity.reference import as_float64

# The modules no other file of parity/ names (tests/test_house.py); transformers itself through hf's one door.
OWNS = ("DeepseekV3Attention", "DeepseekV2Attention")
IMPLEMENTATIONS = ()  # its peers are the latent harness's (`parity.harness.latent.hf_peer`), not parity.impls'


def to_float64(t) -> np.ndarray:
    return as_float64(tensor_to_numpy(t))


def _hf_rope_parameters(c: LatentAttentionConfig) -> dict:
    s = c.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": c.rope_theta}
    keys = {f: getattr(s, f) for f in ("factor", "original_max_position_embeddings", "low_freq_factor",
                                       "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                       "attention_factor", "truncate") if getattr(s, f) is not None}
    return {"rope_type": s.kind, "rope_theta": c.rope_theta, **keys}


def hf_layer(c: LatentAttentionConfig, version: str = "v3"):
    """(transformers' DeepseekV3Attention | DeepseekV2Attention with `c`'s sizes (float32), its rotary embedding,
    its config), eager attention."""
    if version not in ("v3", "v2"):
        raise ValueError(f"version {version!r} is not 'v3' or 'v2'")
    module = transformers_module(f"models.deepseek_{version}.modeling_deepseek_{version}")
    Config = transformers_module(f"models.deepseek_{version}.configuration_deepseek_{version}").__dict__[
        f"Deepseek{version.upper()}Config"]
    rope = _hf_rope_parameters(c)
    original = rope.get("original_max_position_embeddings")
    longest = int(original * rope.get("factor", 1.0)) if original else 4096
    kw = dict(rope_interleave=c.rope == "interleaved") if version == "v3" else {}
    cfg = Config(hidden_size=c.embed_dim, num_attention_heads=c.num_heads, num_key_value_heads=c.num_heads,
                 q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                 qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, attention_bias=c.bias,
                 max_position_embeddings=longest, rope_parameters=rope, num_hidden_layers=1, vocab_size=8, **kw)
    cfg._attn_implementation = "eager"
    Attn = module.DeepseekV3Attention if version == "v3" else module.DeepseekV2Attention
    Rotary = module.DeepseekV3RotaryEmbedding if version == "v3" else module.DeepseekV2RotaryEmbedding
    return Attn(cfg, layer_idx=0), Rotary(cfg), cfg


def _additive(keep, is_causal: bool, T: int, S: int, offset: int, td):
    """(B|1, 1, T, S) additive float mask of `keep` AND causal: query i sits at slot offset + i."""
    import torch

    allowed = torch.ones(1, 1, T, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed & (torch.arange(S)[None, :] <= offset + torch.arange(T)[:, None])[None, None]
    if keep is not None:
        allowed = allowed & torch.as_tensor(keep)
    return torch.zeros(allowed.shape, dtype=td).masked_fill(~allowed, float("-inf"))


def _call(version: str, hf, rotary, x, pos, mask, cache=None):
    """One call of the transformers module: V3 takes (x, position_embeddings, mask), V2 (x, mask, ...)."""
    pe = rotary(x, pos)
    if version == "v3":
        return hf(x, pe, mask, past_key_values=cache)[0]
    return hf(x, mask, past_key_values=cache, position_embeddings=pe)[0]


def hf_deepseek(version: str = "v3") -> dict:
    """The pieces of `parity.harness.latent.LatentImpl` (name, forward, gradient, decode, applies) of transformers'
    Deepseek{V3,V2}Attention as a peer ("hf-deepseek-v3" / "hf-deepseek-v2"), the case's weights
    under transformers' names (`parity.latent.to_hf_deepseek`); masks as its additive float mask; decode through
    its DynamicCache. float32 and float64 (its cos/sin, norms and softmax in float32: judged at float32's bound).
    V2 rotates consecutive pairs only: it runs the interleaved cases."""
    import torch

    from parity.latent import HF_DEEPSEEK_NAMES, to_hf_deepseek

    canonical = {f"{hf}.{leaf}": f"{ours}.{leaf}" for ours, hf in HF_DEEPSEEK_NAMES.items() for leaf in ("weight", "bias")}

    def build(case, inputs, dtype):
        hf, rotary, cfg = hf_layer(case.config, version)
        td = getattr(torch, dtype)
        hf = hf.to(td).eval()
        hf.load_state_dict({k: torch.tensor(v, dtype=td) for k, v in to_hf_deepseek(inputs.sd).items()}, strict=True)
        return hf, rotary, td

    def call(hf, rotary, x, pos, mask, cache=None):
        return _call(version, hf, rotary, x, pos, mask, cache)

    def forward(case, inputs, dtype):
        hf, rotary, td = build(case, inputs, dtype)
        T = case.T
        with torch.no_grad():
            out = call(hf, rotary, torch.tensor(inputs.x).to(td), torch.as_tensor(inputs.positions),
                       _additive(inputs.keep, inputs.is_causal, T, T, 0, td))
        return to_float64(out), None

    def gradient(case, inputs, dtype):
        hf, rotary, td = build(case, inputs, dtype)
        x = torch.tensor(inputs.x).to(td).requires_grad_()
        out = call(hf, rotary, x, torch.as_tensor(inputs.positions),
                   _additive(inputs.keep, inputs.is_causal, case.T, case.T, 0, td))
        (out * torch.tensor(inputs.cotangent).to(td)).sum().backward()
        grads = {"x": to_float64(x.grad)}
        for n, p in hf.named_parameters():
            grads[canonical[n]] = to_float64(p.grad)
        return grads

    def decode(case, inputs, dtype, prefill, absorb):
        DynamicCache = transformers_module("cache_utils").DynamicCache
        hf, rotary, td = build(case, inputs, dtype)
        x = torch.tensor(inputs.x).to(td)
        T = x.shape[1]
        cache, outs = DynamicCache(config=hf.config), []
        with torch.no_grad():
            for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
                pos = torch.arange(lo, hi)[None].expand(x.shape[0], -1)
                outs.append(to_float64(call(hf, rotary, x[:, lo:hi], pos,
                                             _additive(None, True, hi - lo, hi, lo, td), cache)))
        return np.concatenate(outs, axis=1)

    name = f"hf-deepseek-{version}"
    applies = (lambda case: True) if version == "v3" else (lambda case: case.config.rope == "interleaved")
    return dict(name=name, forward=forward, gradient=gradient, decode=decode, applies=applies)


__all__ = ["hf_deepseek", "hf_layer", "OWNS", "IMPLEMENTATIONS"]
