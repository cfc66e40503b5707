"""Multi-head latent attention (DeepSeek V2/V3) as a layer of its own: the configuration both modules share.

The maths, from transformers' DeepseekV3Attention (legend: B batch, T query length, S key length, N heads,
C = kv_lora_rank, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim, Q = q_lora_rank):

    q       = q_b_proj(RMSNorm_qa(q_a_proj(x)))  (or q_proj(x) without q_lora)    # (B, T, N, Dn + Dr)
    q_nope, q_pe = split(q, [Dn, Dr])
    c, k_pe = split(kv_a_proj(x), [C, Dr]);  c = RMSNorm_kva(c)                  # (B, S, C), (B, S, Dr)
    q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)       # k_pe ONE head, shared by all N; the rotation over Dr
    k_nope, v = split(kv_b_proj(c), [Dn, Dv]) per head                            # (B, S, N, Dn), (B, S, N, Dv)
    scores  = (q_nope · k_nope + q_pe · k_pe) · scale                             # (B, N, T, S)
    out     = out_proj(softmax(scores) @ v)                                       # (B, T, E)

scale = (Dn + Dr) ** -0.5, times mscale(factor, mscale_all_dim)² when the RoPE is scaled and sets
mscale_all_dim (transformers' `yarn_apply_mscale`). The RMSNorms compute in float32 at least (weight times
x·rsqrt(mean(x²) + eps), cast back). The latent cache holds c and the rotated k_pe per token (C + Dr
numbers, against N·(Dn + Dv) for keys and values): a decode step reads it either by expanding it through
kv_b_proj (naive) or by absorbing kv_b_proj's key half into the query and its value half into the output
(absorbed); both must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mha_spec.rope import ROPE_CONVENTIONS, RopeScaling, rope_frequencies

MLA_KEYS = ("q_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj", "out_proj")
"""The canonical modules of an MLA layer (each `<name>.weight`, the projections' `.bias` with `bias`)."""


def _positive(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class LatentAttentionConfig:
    """One MLA layer. rope is "interleaved" (DeepSeek's rope_interleave=True, the default) or "half"; rope_scaling
    a `RopeScaling` (DeepSeek V3 ships YaRN); bias is config.attention_bias (q_a_proj, kv_a_proj and out_proj;
    q_b_proj, kv_b_proj and q_proj never have one); norm_eps the RMSNorms' rms_norm_eps. The masked-row
    policy is the module's keyword, as for the other layers (`MASKED_ROWS_POLICIES`).

    Canonical weights (torch layout, (out, in)): q_proj (N·(Dn+Dr), E) without q_lora_rank, else q_a_proj
    (Q, E), q_a_norm (Q,), q_b_proj (N·(Dn+Dr), Q); kv_a_proj (C+Dr, E), kv_a_norm (C,), kv_b_proj
    (N·(Dn+Dv), C) -- per head its Dn key rows then its Dv value rows --, out_proj (E, N·Dv).
    """

    embed_dim: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: str = "interleaved"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    bias: bool = False

    def __post_init__(self):
        for name in ("embed_dim", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE turns pairs), got {self.qk_rope_head_dim}")
        if self.rope not in ROPE_CONVENTIONS:
            raise ValueError(f"rope={self.rope!r} is not one of {ROPE_CONVENTIONS} (an MLA layer always rotates q_pe, k_pe)")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1.0 < theta < math.inf:
            raise ValueError(f"rope_theta must be a finite number > 1, got {theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be an mha_spec.RopeScaling, got {type(self.rope_scaling).__name__}")
        if self.rope_scaling is not None and self.rope_scaling.switches:
            raise ValueError("rope_scaling longrope on an MLA layer: DeepSeek's layers ship YaRN; not modelled")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps >= 0:
            raise ValueError(f"norm_eps must be a number >= 0, got {self.norm_eps!r}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be a bool, got {self.bias!r}")

    @property
    def qk_head_dim(self) -> int:
        """Dn + Dr, the query/key head dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(Dn + Dr) ** -0.5, times mscale(factor, mscale_all_dim)² for a scaled RoPE that sets mscale_all_dim."""
        scale = self.qk_head_dim ** -0.5
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            m = 1.0 if s.factor <= 1 else 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale *= m * m
        return scale

    def rope_frequencies(self) -> tuple[float, ...]:
        """inv_freq over the Dr rotated features (float64)."""
        return rope_frequencies(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)

    @property
    def rope_scale(self) -> float:
        """What cos and sin are multiplied by (the scaling's attention factor; 1 without one)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.scale

    @property
    def cache_width(self) -> int:
        """Numbers the latent cache holds per token: C + Dr (keys and values would take N·(Dn + Dr + Dv))."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical state-dict entry of the layer and its shape."""
        E, N, C = self.embed_dim, self.num_heads, self.kv_lora_rank
        Dqk, Dr, Dv, Q = self.qk_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.q_lora_rank
        shapes = {"kv_a_proj.weight": (C + Dr, E), "kv_a_norm.weight": (C,),
                  "kv_b_proj.weight": (N * (self.qk_nope_head_dim + Dv), C), "out_proj.weight": (E, N * Dv)}
        if Q is None:
            shapes["q_proj.weight"] = (N * Dqk, E)
        else:
            shapes.update({"q_a_proj.weight": (Q, E), "q_a_norm.weight": (Q,), "q_b_proj.weight": (N * Dqk, Q)})
        if self.bias:
            shapes.update({"kv_a_proj.bias": (C + Dr,), "out_proj.bias": (E,)})
            if Q is not None:
                shapes["q_a_proj.bias"] = (Q,)
        return dict(sorted(shapes.items()))
