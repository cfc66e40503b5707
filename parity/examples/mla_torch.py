"""A user's multi-head latent attention layer in PyTorch with a bug planted, to show what the latent harness
(`parity.harness.latent`) says about each: `planted(bug)` is a `torch_impl` factory.

    from parity.harness.latent import latent_cases, run_latent, torch_impl
    from parity.examples.mla_torch import planted
    report = run_latent(impls=[torch_impl("mine", planted("rope-key-half"))])

or `mha-parity --cases latent --impl parity.examples.mla_torch:rope_key_half` (one attribute per bug).

BUGS (each the correct `mha_torch.MultiHeadLatentAttention` but for one thing):
  rope-key-half       the rope key rotated with the other RoPE convention than the query (half pairs for an
                      interleaved layer): forward red, first diverging stage k_rot;
  rope-key-per-head   each head's rope key taken from its own key rows of kv_b_proj (the last Dr of its k_nope,
                      as a per-head attention would), not the one k_pe shared by all heads (needs Dn >= Dr):
                      forward red at k_rot;
  no-mscale           the softmax scale without YaRN's mscale(factor, mscale_all_dim)² (a scaled RoPE with
                      mscale_all_dim): forward red at scores;
  cache-raw-latent    the latent cache holds c before kv_a_norm (the forward is right): decode red from the prefill,
                      and the decode no longer equals the layer's own causal forward;
  absorb-heads        the absorbed decode folds kv_b_proj's key half in with the heads reversed: the absorbed decode
                      red, and not equal to the naive one (the naive decode and the forward are right).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from mha_torch import MultiHeadLatentAttention
from mha_torch.attention import keep_mask_4d, positions_4d, rope_max_position, rotate, structured_keep
from parity.latent import HF_DEEPSEEK_NAMES

BUGS = ("rope-key-half", "rope-key-per-head", "no-mscale", "cache-raw-latent", "absorb-heads")
_FORWARD_BUGS = BUGS[:3]


class PlantedLatentAttention(MultiHeadLatentAttention):
    """MultiHeadLatentAttention with `bug` (one of BUGS) planted; self-attention only."""

    def __init__(self, *args, bug: str, **kwargs):
        if bug not in BUGS:
            raise ValueError(f"bug {bug!r} is not one of {BUGS}")
        super().__init__(*args, **kwargs)
        self.bug, self._in_cache = bug, False
        other = "half" if self.rope_config.rope == "interleaved" else "interleaved"
        self.other_rope = replace(self.rope_config, rope=other)
        if bug == "rope-key-per-head" and self.config.qk_nope_head_dim < self.config.qk_rope_head_dim:
            raise ValueError(f"rope-key-per-head needs qk_nope_head_dim >= qk_rope_head_dim, got "
                             f"{self.config.qk_nope_head_dim} < {self.config.qk_rope_head_dim}")

    def latents(self, x):
        c, k_pe = super().latents(x)
        if self.bug == "cache-raw-latent" and self._in_cache:  # the raw latent, before kv_a_norm
            c = self.kv_a_proj(x)[..., :self.config.kv_lora_rank]
        return c, k_pe

    def absorbed_weights(self):
        w_uk, w_uv = super().absorbed_weights()
        return (w_uk.flip(0), w_uv) if self.bug == "absorb-heads" else (w_uk, w_uv)

    def _forward_cached(self, *args, **kwargs):
        self._in_cache = True
        try:
            return super()._forward_cached(*args, **kwargs)
        finally:
            self._in_cache = False

    def forward(self, x, mask=None, need_weights: bool = True, *, positions=None, is_causal: bool = False,
                return_intermediates: bool = False, cache=None, absorb: bool = False):
        if cache is not None or self.bug not in _FORWARD_BUGS:
            return super().forward(x, mask, need_weights, positions=positions, is_causal=is_causal,
                                   return_intermediates=return_intermediates, cache=cache, absorb=absorb)
        cfg = self.config
        B, T = x.shape[:2]
        keep = None if mask is None else keep_mask_4d(mask, B, cfg.num_heads, T, T)
        if is_causal:
            tril = structured_keep(T, T, is_causal=True, device=x.device)
            keep = tril if keep is None else keep & tril
        q_nope, q_pe = self.queries(x)  # (B, N, T, Dn), (B, N, T, Dr)
        c, k_pe = self.latents(x)  # (B, T, C), (B, 1, T, Dr)
        pos = positions_4d(positions, B, T, "positions", x.device)
        top = rope_max_position(self.rope_config, pos, pos)
        q_rot = rotate(q_pe, pos, self.rope_config, top)
        if self.bug == "rope-key-half":
            k_rot = rotate(k_pe, pos, self.other_rope, top)
        elif self.bug == "rope-key-per-head":
            k_rot = rotate(self.expand(c)[0][..., -cfg.qk_rope_head_dim:], pos, self.rope_config, top)  # (B, N, T, Dr)
        else:
            k_rot = rotate(k_pe, pos, self.rope_config, top)
        f = (cfg.qk_head_dim ** -0.5) / cfg.softmax_scale if self.bug == "no-mscale" else 1.0
        context, weights, scores = self._attend(q_nope * f, q_rot * f, c, k_rot, keep, absorb=absorb,
                                                need_weights=need_weights, return_scores=return_intermediates)
        context = context.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.v_head_dim)
        output = self.out_proj(context)
        if return_intermediates:
            return output, weights, self._stages(q_nope, q_pe, c, k_pe, q_rot, k_rot, scores, weights, context, output)
        return output, weights


def planted(bug: str):
    """The `parity.harness.latent.torch_impl` factory of the layer with `bug` planted."""
    if bug not in BUGS:
        raise ValueError(f"bug {bug!r} is not one of {BUGS}")

    def make(config, state_dict, masked_rows):
        c = config
        m = PlantedLatentAttention(c.embed_dim, c.num_heads, kv_lora_rank=c.kv_lora_rank,
                                   qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                   v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank, rope=c.rope,
                                   rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps,
                                   bias=c.bias, masked_rows=masked_rows, dtype=next(iter(state_dict.values())).dtype,
                                   bug=bug)
        m.load_state_dict(state_dict, strict=True)
        return m

    return make


class HFNamedLatentAttention(nn.Module):
    """A port under transformers' names (q_a_layernorm, kv_a_proj_with_mqa, o_proj, ...): our layer's submodules
    registered under them, its forward and cache as they are. `hf_named` is its factory, declared
    `names = "hf-deepseek-v3"`: the harness hands it transformers' state dict and reads its gradients back."""

    def __init__(self, inner: MultiHeadLatentAttention):
        super().__init__()
        self._inner = [inner]  # not a submodule: its parameters are registered once, under the names below
        for ours, hf in HF_DEEPSEEK_NAMES.items():
            if hasattr(inner, ours):
                self.add_module(hf, getattr(inner, ours))

    def forward(self, *args, **kwargs):
        return self._inner[0](*args, **kwargs)

    def init_cache(self, *args, **kwargs):
        return self._inner[0].init_cache(*args, **kwargs)


def hf_named(config, state_dict, masked_rows):
    """`mha-parity --cases latent --impl parity.examples.mla_torch:hf_named`: the correct layer, its tensors under
    transformers' names."""
    c = config
    inner = MultiHeadLatentAttention(c.embed_dim, c.num_heads, kv_lora_rank=c.kv_lora_rank,
                                     qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                     v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank, rope=c.rope,
                                     rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, norm_eps=c.norm_eps,
                                     bias=c.bias, masked_rows=masked_rows, dtype=next(iter(state_dict.values())).dtype)
    m = HFNamedLatentAttention(inner)
    m.load_state_dict(state_dict, strict=True)
    return m


hf_named.names = "hf-deepseek-v3"


# `mha-parity --cases latent --impl parity.examples.mla_torch:no_mscale` (or --checkpoint DIR ... --impl ...)
rope_key_half = planted("rope-key-half")
rope_key_per_head = planted("rope-key-per-head")
no_mscale = planted("no-mscale")
cache_raw_latent = planted("cache-raw-latent")
absorb_heads = planted("absorb-heads")

__all__ = ["BUGS", "PlantedLatentAttention", "planted", "HFNamedLatentAttention", "hf_named", "rope_key_half", "rope_key_per_head", "no_mscale",
           "cache_raw_latent", "absorb_heads"]
