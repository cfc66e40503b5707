"""Multi-head latent attention (DeepSeek V2/V3) in PyTorch, with a latent cache. Never imports jax.

The maths and the canonical weights are `mha_spec.LatentAttentionConfig`'s (mha_spec/mla.py). Shapes
(legend there): B batch, T query length, S key length, N heads, E embed_dim, C kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, Dqk = Dn + Dr, Cap the cache's capacity (slots).
The masks, the masked-row policies, RoPE and the RMSNorm are mha_torch.attention's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mha_spec import MASKED_ROWS_POLICIES, AttentionConfig, LatentAttentionConfig, Stages, refuse_no_new_tokens
from mha_torch.attention import (QKNorm, attention_core, fused_attention_core, keep_mask_4d, positions_4d,
                                 rope_max_position, rotate, structured_keep)


@dataclass(frozen=True)
class LatentStages(Stages):
    """`mha_spec.Stages` of an MLA layer. q (B, N, T, Dqk) = cat(q_nope, q_pe) before RoPE; k (B, N, S, Dqk) =
    cat(k_nope, k_pe) before RoPE, k_pe (one head) repeated to the N heads; v (B, N, S, Dv); q_rot (B, N, T, Dr)
    is q_pe rotated and k_rot (B, 1, S, Dr) k_pe rotated (the logits read cat(q_nope, q_rot) · cat(k_nope, k_rot));
    latent (B, S, C) is c after its RMSNorm; scores, weights (B, N, T, S); context (B, T, N·Dv) before out_proj.
    With a cache q, k, v, q_rot, k_rot, latent are the new tokens' (S = T), scores and weights over the Cap slots.
    q_norm and k_norm stay None (the RMSNorms here are on the low-rank projections, not on q and k)."""

    latent: Any = None


def _starts(x, batch: int, device) -> torch.Tensor:
    """(B,) left-padding counts as int64 on `device`; None -> zeros. TypeError/ValueError naming them."""
    if x is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"starts must be a torch.Tensor of integers, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"starts must have shape ({batch},) (one per batch row), got {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int64)


def _check_slot_counts(x: torch.Tensor, capacity: int, name: str) -> None:
    """ValueError naming the field unless every row's count lies in [0, capacity] (not while torch.compile traces
    or on the meta device: no values there)."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return
    bad = (x < 0) | (x > capacity)
    if bool(bad.any()):
        raise ValueError(f"LatentCache.{name} must lie in [0, capacity={capacity}] (one count of slots per row), "
                         f"got {x.tolist()}: rows {bad.nonzero().flatten().tolist()} out of range")


@dataclass(frozen=True)
class LatentCache:
    """An MLA layer's decode cache: per token the normed latent c (C numbers) and the rotated k_pe (Dr numbers),
    C + Dr per token (`LatentAttentionConfig.cache_width`), where a `KVCache` would hold N·(Dqk + Dv).

    c (B, Cap, C), k_pe (B, Cap, Dr), starts and lengths (B,) int64, with `mha_torch.KVCache`'s semantics:
    row b's valid slots are starts[b] <= s < lengths[b] (left padding before starts[b]); T new tokens go to slots
    lengths[b] .. lengths[b] + T - 1; new token i attends slots starts[b] <= s <= lengths[b] + i; the token in
    slot s has the RoPE position s - starts[b]. Immutable: `write` returns a new cache.
    """

    c: torch.Tensor  # (B, Cap, C), after kv_a_norm
    k_pe: torch.Tensor  # (B, Cap, Dr), after RoPE
    starts: torch.Tensor  # (B,) int64
    lengths: torch.Tensor  # (B,) int64

    def __post_init__(self):
        for name in ("c", "k_pe", "starts", "lengths"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"LatentCache.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        c, k_pe = tuple(self.c.shape), tuple(self.k_pe.shape)
        if len(c) != 3 or len(k_pe) != 3 or c[:2] != k_pe[:2]:
            raise ValueError(f"LatentCache c (B, Cap, C) and k_pe (B, Cap, Dr) must be 3-D with one (B, Cap): "
                             f"c {c}, k_pe {k_pe}")
        if self.c.dtype != self.k_pe.dtype or not self.c.dtype.is_floating_point:
            raise TypeError(f"LatentCache c and k_pe must share one floating dtype: c {self.c.dtype}, "
                            f"k_pe {self.k_pe.dtype}")
        for name in ("starts", "lengths"):
            x = getattr(self, name)
            if tuple(x.shape) != (c[0],):
                raise ValueError(f"LatentCache.{name} must have shape ({c[0]},) (one per batch row), "
                                 f"got {tuple(x.shape)}")
            if x.dtype != torch.int64:
                raise TypeError(f"LatentCache.{name} must be int64, got {x.dtype}")
            _check_slot_counts(x, self.capacity, name)

    @classmethod
    def empty(cls, batch: int, capacity: int, kv_lora_rank: int, rope_dim: int, *, dtype, device=None,
              starts=None) -> LatentCache:
        """A cache with nothing written: zeros, lengths 0. starts (B,): each row's left-padding slots (default 0)."""
        for name, n in (("batch", batch), ("capacity", capacity), ("kv_lora_rank", kv_lora_rank),
                        ("rope_dim", rope_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "batch" else 1):
                raise ValueError(f"LatentCache.empty: {name} must be a positive int, got {n!r}")
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"LatentCache.empty: dtype must be a floating torch.dtype, got {dtype!r}")
        c = torch.zeros(batch, capacity, kv_lora_rank, dtype=dtype, device=device)
        k_pe = torch.zeros(batch, capacity, rope_dim, dtype=dtype, device=c.device)
        starts = _starts(starts, batch, c.device)  # its values: checked by the constructor
        return cls(c, k_pe, starts, torch.zeros(batch, dtype=torch.int64, device=c.device))

    @property
    def capacity(self) -> int:
        return self.c.shape[1]

    @property
    def width(self) -> int:
        """Numbers held per token: C + Dr."""
        return self.c.shape[2] + self.k_pe.shape[2]

    def check_room(self, T: int) -> None:
        """ValueError if T more tokens do not fit in some row (eager only)."""
        if torch.compiler.is_compiling():
            return
        over = self.lengths + T > self.capacity
        if bool(over.any()):
            raise ValueError(f"the latent cache holds {self.capacity} slots per row; rows "
                             f"{over.nonzero().flatten().tolist()} with lengths {self.lengths[over].tolist()} "
                             f"have no room for {T} more tokens")

    def slots(self, T: int) -> torch.Tensor:
        """(B, T) int64: the slots T new tokens are written to, lengths[b] + i."""
        return self.lengths[:, None] + torch.arange(T, device=self.lengths.device)

    def positions(self, T: int) -> torch.Tensor:
        """(B, T) int64: the default RoPE positions of T new tokens, their slot minus the row's padding."""
        return self.slots(T) - self.starts[:, None]

    def keep_mask(self, T: int) -> torch.Tensor:
        """bool (B, 1, T, Cap): new token i of row b keeps slots starts[b] <= s <= lengths[b] + i."""
        s = torch.arange(self.capacity, device=self.lengths.device)  # (Cap,)
        last = self.slots(T)[:, None, :, None]  # (B, 1, T, 1)
        return (s >= self.starts[:, None, None, None]) & (s <= last)

    def write(self, c_new: torch.Tensor, k_pe_new: torch.Tensor) -> LatentCache:
        """A new cache holding c_new (B, T, C) and k_pe_new (B, T, Dr) at each row's next T slots, lengths + T."""
        B, Cap, C = self.c.shape
        Dr = self.k_pe.shape[2]
        if c_new.ndim != 3 or tuple(c_new.shape[::2]) != (B, C) or tuple(k_pe_new.shape) != (B, c_new.shape[1], Dr):
            raise ValueError(f"new latents c {tuple(c_new.shape)} (B, T, C) and k_pe {tuple(k_pe_new.shape)} "
                             f"(B, T, Dr) do not fit the cache c {tuple(self.c.shape)}, k_pe {tuple(self.k_pe.shape)}")
        if c_new.dtype != self.c.dtype or k_pe_new.dtype != self.c.dtype:
            raise TypeError(f"new c/k_pe are {c_new.dtype}/{k_pe_new.dtype}, the cache holds {self.c.dtype}")
        T = c_new.shape[1]
        self.check_room(T)
        slots = self.slots(T)[:, :, None]  # (B, T, 1)
        c = self.c.scatter(1, slots.expand(B, T, C), c_new)
        k_pe = self.k_pe.scatter(1, slots.expand(B, T, Dr), k_pe_new)
        # Not through the constructor: its value checks would read the lengths back at every step.
        cache = object.__new__(LatentCache)
        for name, x in (("c", c), ("k_pe", k_pe), ("starts", self.starts), ("lengths", self.lengths + T)):
            object.__setattr__(cache, name, x)
        return cache


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek V2/V3), `mha_spec.LatentAttentionConfig`'s maths and weights.

    Submodules under the canonical names (`config.weight_shapes()` are the state_dict's keys and shapes):
    q_proj, or q_a_proj, q_a_norm, q_b_proj (with q_lora_rank); kv_a_proj, kv_a_norm, kv_b_proj, out_proj.
    The RMSNorms are `QKNorm`s with offset 0 (weight starts at 1, computed in float32 at least).

    forward(x (B, T, E), mask=None, need_weights=True, *, key_value=None, positions=None, key_positions=None,
            is_causal=False, return_intermediates=False, cache=None, absorb=False)
      -> (output (B, T, E), weights (B, N, T, S) | None)   [+ new cache] [+ `LatentStages`]
    Self-attention over x; key_value (B, S, E) makes it cross-attention (the latents and k_pe from key_value).
    mask: a keep-mask as `MultiHeadAttention` takes it ([T, S], [B, T, S], [B|1, N|1, T|1, S|1]; bool, int or
    float); is_causal keeps keys s <= t (top-left), ANDed with mask. masked_rows ("nan", "zero", "uniform"):
    what a query that keeps no key returns. RoPE positions (T,) | (B, T) (default arange) are the queries' and,
    in self-attention, the keys'; with key_value, key_positions (S,) | (B, S) (default arange) are the keys'.
    Inputs must have the parameters' dtype.

    Kernels: need_weights=True materialises the scores (`attention_core`: baddbmm, softmax, matmul);
    need_weights=False is torch SDPA (`fused_attention_core`, SDPA's is_causal when the mask is exactly the causal
    triangle), with scale = config.softmax_scale. q and k have Dqk features and v Dv: CPU SDPA then runs its math
    backend (its flash kernel needs one head dim), as the profiler shows (aten::_scaled_dot_product_attention_math).

    absorb=False expands the latents through kv_b_proj into per-head k_nope (B, N, S, Dn) and v (B, N, S, Dv).
    absorb=True never builds them: the query's nope part goes through kv_b_proj's key half per head (q_nope · W_UK,
    a query in latent space (B, N, T, C)); the logits are that · c plus q_rot · k_rot, one key head shared by the N
    query heads (SDPA's enable_gqa on the fused path); the context in latent space (weights @ c) goes through the
    value half per head (· W_UVᵀ), then out_proj. Same results to rounding, with or without a cache.

    Decoding: cache=`LatentCache` (`init_cache`) appends the T new tokens' c and rotated k_pe (at positions=, default
    `cache.positions(T)`) and attends every written slot (new token i of row b: starts[b] <= s <= lengths[b] + i);
    returns (output, weights (B, N, T, Cap) | None, new cache[, stages]). With a cache, mask=, is_causal=,
    key_value= and key_positions= are ValueErrors (the cache's keep-mask is the mask), as is T = 0.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, rope: str = "interleaved",
                 rope_theta: float = 10000.0, rope_scaling=None, norm_eps: float = 1e-6, bias: bool = False,
                 masked_rows: str = "nan", dtype=None, device=None):
        super().__init__()
        self.config = c = LatentAttentionConfig(embed_dim, num_heads, kv_lora_rank, qk_nope_head_dim,
                                                qk_rope_head_dim, v_head_dim, q_lora_rank=q_lora_rank, rope=rope,
                                                rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps,
                                                bias=bias)
        if masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (or None), got {dtype!r}")
        self.masked_rows = masked_rows
        # The Dr rotated features as a one-head layer: `rotate` takes an AttentionConfig, whose frequencies and
        # cos/sin factor come from the same mha_spec.rope definitions as `config.rope_frequencies`.
        self.rope_config = AttentionConfig(embed_dim=qk_rope_head_dim, num_heads=1, rope=rope, rope_theta=rope_theta,
                                           rope_scaling=rope_scaling)
        f = {"dtype": dtype, "device": device}
        E, N, C, Dr, Q = embed_dim, num_heads, kv_lora_rank, qk_rope_head_dim, q_lora_rank
        if Q is None:
            self.q_proj = nn.Linear(E, N * c.qk_head_dim, bias=False, **f)
        else:
            self.q_a_proj = nn.Linear(E, Q, bias=bias, **f)
            self.q_a_norm = QKNorm(Q, eps=norm_eps, offset=0.0, **f)
            self.q_b_proj = nn.Linear(Q, N * c.qk_head_dim, bias=False, **f)
        self.kv_a_proj = nn.Linear(E, C + Dr, bias=bias, **f)
        self.kv_a_norm = QKNorm(C, eps=norm_eps, offset=0.0, **f)
        self.kv_b_proj = nn.Linear(C, N * (qk_nope_head_dim + v_head_dim), bias=False, **f)
        self.out_proj = nn.Linear(N * v_head_dim, E, bias=bias, **f)

    def extra_repr(self) -> str:
        c = self.config
        extra = f", q_lora_rank={c.q_lora_rank}" if c.q_lora_rank is not None else ""
        if c.rope_scaling is not None:
            extra += f", rope_scaling={str(c.rope_scaling)!r}"
        return (f"embed_dim={c.embed_dim}, num_heads={c.num_heads}, kv_lora_rank={c.kv_lora_rank}, "
                f"qk_nope_head_dim={c.qk_nope_head_dim}, qk_rope_head_dim={c.qk_rope_head_dim}, "
                f"v_head_dim={c.v_head_dim}{extra}, rope={c.rope!r}, rope_theta={c.rope_theta}, bias={c.bias}, "
                f"masked_rows={self.masked_rows!r}")

    @property
    def _param_dtype(self) -> torch.dtype:
        return self.kv_a_proj.weight.dtype

    def init_cache(self, batch: int, capacity: int, starts=None) -> LatentCache:
        """An empty `LatentCache` for this layer (the parameters' dtype and device); starts (B,): left padding."""
        w = self.kv_a_proj.weight
        return LatentCache.empty(batch, capacity, self.config.kv_lora_rank, self.config.qk_rope_head_dim,
                                 dtype=w.dtype, device=w.device, starts=starts)

    # ------------------------------------------------------------------ projections

    def queries(self, x):
        """x (B, T, E) -> (q_nope (B, N, T, Dn), q_pe (B, N, T, Dr)), before RoPE."""
        c = self.config
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        B, T = x.shape[:2]
        q = q.view(B, T, c.num_heads, c.qk_head_dim).transpose(1, 2)  # (B, N, T, Dqk)
        return q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)

    def latents(self, x):
        """x (B, S, E) -> (c (B, S, C) after kv_a_norm, k_pe (B, 1, S, Dr) before RoPE: one head for all N)."""
        c_raw, k_pe = self.kv_a_proj(x).split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        return self.kv_a_norm(c_raw), k_pe[:, None]

    def expand(self, c):
        """c (B, S, C) -> (k_nope (B, N, S, Dn), v (B, N, S, Dv)) through kv_b_proj (per head Dn key rows, then Dv)."""
        cfg = self.config
        B, S = c.shape[:2]
        kv = self.kv_b_proj(c).view(B, S, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim).transpose(1, 2)
        return kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)

    def absorbed_weights(self):
        """kv_b_proj's halves per head: (W_UK (N, Dn, C), W_UV (N, Dv, C)); k_nope = W_UK c, v = W_UV c."""
        cfg = self.config
        w = self.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    # ------------------------------------------------------------------ attention

    def _attend(self, q_nope, q_rot, c, k_rot, keep, *, absorb: bool, need_weights: bool, return_scores: bool):
        """The attention over latents c (B, S, C) and k_rot (B, 1, S, Dr) for q_nope (B, N, T, Dn), q_rot
        (B, N, T, Dr): (context (B, N, T, Dv), weights (B, N, T, S) | None, scores | None)."""
        if absorb:
            w_uk, w_uv = self.absorbed_weights()  # (N, Dn, C), (N, Dv, C)
            q = torch.cat([torch.einsum("bntd,ndc->bntc", q_nope, w_uk), q_rot], dim=-1)  # (B, N, T, C + Dr)
            k = torch.cat([c[:, None], k_rot], dim=-1)  # (B, 1, S, C + Dr): one key head for the N query heads
            v = c[:, None]  # (B, 1, S, C)
        else:
            k_nope, v = self.expand(c)  # (B, N, S, Dn), (B, N, S, Dv)
            q = torch.cat([q_nope, q_rot], dim=-1)  # (B, N, T, Dqk)
            k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, N, S, Dqk)
        options = {"masked_rows": self.masked_rows, "scale": self.config.softmax_scale}
        weights = scores = None
        if need_weights:
            N = q.shape[1]
            k, v = k.expand(-1, N, -1, -1), v.expand(-1, N, -1, -1)  # attention_core takes N key heads
            out = attention_core(q, k, v, keep, return_scores=return_scores, **options)
            context, weights = out[:2]
            scores = out[2] if return_scores else None
        else:
            context = fused_attention_core(q, k, v, keep, **options)  # K = 1 head when absorbed: enable_gqa
        if absorb:
            context = torch.einsum("bntc,nvc->bntv", context, w_uv)  # (B, N, T, Dv)
        return context, weights, scores

    def _check_x(self, name: str, x, batch: int | None = None) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        E = self.config.embed_dim
        if x.ndim != 3 or x.shape[-1] != E or (batch is not None and x.shape[0] != batch):
            want = f"({'B' if batch is None else batch}, L, {E})"
            raise ValueError(f"{name} must have shape {want} [batch, length, embed_dim], got {tuple(x.shape)}")
        if x.dtype != self._param_dtype:
            # No silent promotion: the caller converts the module or the inputs.
            raise TypeError(f"{name} has dtype {x.dtype} but the module's parameters are {self._param_dtype}")
        return x.shape[0], x.shape[1]

    def _stages(self, q_nope, q_pe, c, k_pe, q_rot, k_rot, scores, weights, context, output) -> LatentStages:
        k_nope, v = self.expand(c)  # (B, N, S, Dn), (B, N, S, Dv)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, N, T, Dqk), before RoPE
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, N, S, Dqk), before RoPE
        return LatentStages(q, k, v, scores, weights, context, output, q_rot, k_rot, latent=c)

    def forward(self, x, mask=None, need_weights: bool = True, *, key_value=None, positions=None,
                key_positions=None, is_causal: bool = False, return_intermediates: bool = False,
                cache: LatentCache | None = None, absorb: bool = False):
        if cache is not None:
            if mask is not None or is_causal or key_value is not None or key_positions is not None:
                raise ValueError("mask=, is_causal=, key_value= and key_positions= with a cache: the cache's keep-mask "
                                 "(starts[b] <= s <= lengths[b] + i) is the mask and the new tokens are the keys")
            return self._forward_cached(x, cache, need_weights=need_weights, positions=positions,
                                        return_intermediates=return_intermediates, absorb=absorb)
        B, T = self._check_x("x", x)
        if key_value is None and key_positions is not None:
            raise ValueError("key_positions= without key_value=: in self-attention positions= are the keys' too")
        kv_in, key_positions = (x, positions) if key_value is None else (key_value, key_positions)
        S = self._check_x("key_value", kv_in, batch=B)[1]
        if S == 0:
            raise ValueError(f"key length S=0: a query must have at least one key to attend to; got key_value "
                             f"{tuple(kv_in.shape)}")
        keep = None if mask is None else keep_mask_4d(mask, B, self.config.num_heads, T, S)  # (B|1, N|1, T|1, S|1)
        if is_causal:
            tril = structured_keep(T, S, is_causal=True, device=x.device)  # (1, 1, T, S)
            keep = tril if keep is None else keep & tril
        q_nope, q_pe = self.queries(x)  # (B, N, T, Dn), (B, N, T, Dr)
        c, k_pe = self.latents(kv_in)  # (B, S, C), (B, 1, S, Dr)
        q_pos = positions_4d(positions, B, T, "positions", x.device)  # (B|1, 1, T, 1)
        k_pos = positions_4d(key_positions, B, S, "key_positions", x.device)  # (B|1, 1, S, 1)
        top = rope_max_position(self.rope_config, q_pos, k_pos)  # None: LongRoPE is refused by the config
        q_rot, k_rot = rotate(q_pe, q_pos, self.rope_config, top), rotate(k_pe, k_pos, self.rope_config, top)
        context, weights, scores = self._attend(q_nope, q_rot, c, k_rot, keep, absorb=absorb,
                                                need_weights=need_weights, return_scores=return_intermediates)
        context = context.transpose(1, 2).reshape(B, T, context.shape[1] * self.config.v_head_dim)  # (B, T, N·Dv)
        output = self.out_proj(context)
        if return_intermediates:
            return output, weights, self._stages(q_nope, q_pe, c, k_pe, q_rot, k_rot, scores, weights, context, output)
        return output, weights

    def _check_cache(self, cache, B: int) -> None:
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a mha_torch.LatentCache, got {type(cache).__name__}")
        if cache.c.dtype != self._param_dtype:
            raise TypeError(f"the cache holds {cache.c.dtype} but the module's parameters are {self._param_dtype}")
        cfg = self.config
        if (cache.c.shape[0], cache.c.shape[2], cache.k_pe.shape[2]) != (B, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            raise ValueError(f"the cache c {tuple(cache.c.shape)} (B, Cap, C), k_pe {tuple(cache.k_pe.shape)} "
                             f"(B, Cap, Dr) does not fit B={B} new rows of a layer with C={cfg.kv_lora_rank}, "
                             f"Dr={cfg.qk_rope_head_dim}")

    def _forward_cached(self, x, cache, *, need_weights, positions, return_intermediates, absorb):
        """forward with a cache (see the class docstring): T new tokens appended, then attending every kept slot."""
        refuse_no_new_tokens(x=getattr(x, "shape", ()))
        B, T = self._check_x("x", x)
        self._check_cache(cache, B)
        q_nope, q_pe = self.queries(x)  # (B, N, T, Dn), (B, N, T, Dr)
        c, k_pe = self.latents(x)  # (B, T, C), (B, 1, T, Dr)
        pos = positions_4d(cache.positions(T) if positions is None else positions, B, T, "positions", x.device)
        top = rope_max_position(self.rope_config, pos)
        q_rot, k_rot = rotate(q_pe, pos, self.rope_config, top), rotate(k_pe, pos, self.rope_config, top)
        keep = cache.keep_mask(T)  # (B, 1, T, Cap): the old cache's lengths are where the new tokens go
        new_cache = cache.write(c, k_rot[:, 0])
        context, weights, scores = self._attend(q_nope, q_rot, new_cache.c, new_cache.k_pe[:, None], keep,
                                                absorb=absorb, need_weights=need_weights,
                                                return_scores=return_intermediates)
        context = context.transpose(1, 2).reshape(B, T, context.shape[1] * self.config.v_head_dim)  # (B, T, N·Dv)
        output = self.out_proj(context)
        if return_intermediates:
            stages = self._stages(q_nope, q_pe, c, k_pe, q_rot, k_rot, scores, weights, context, output)
            return output, weights, new_cache, stages
        return output, weights, new_cache
