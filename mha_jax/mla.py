"""Multi-head latent attention (DeepSeek V2/V3) in Flax NNX, with a latent cache; same semantics as `mha_torch.mla`.

The layer is an `mha_spec.LatentAttentionConfig` (its docstring has the maths, the canonical weights and the
scale). Legend: B batch, T query length, S key length (= T: self-attention), N heads, C = kv_lora_rank,
Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim, Q = q_lora_rank, Cap the cache's slots.

The pieces come from `mha_jax.attention`: the RMSNorm (`QKNorm`, offset 0), RoPE (`rope_cos_sin` on a one-head
`AttentionConfig` of Dr features, `rotate`), the keep-masks and the masked-row policy. Only the core is new: the
scores are q_nope·k_nope + q_pe·k_pe with k_pe one head shared by all N, and keys and values have different widths
(Dn + Dr against Dv), which `attention_core` does not take.

Two ways through the same maths, `absorb=False | True`, with or without a cache:
naive     expand the latent c through kv_b_proj into k_nope (B, S, N, Dn) and v (B, S, N, Dv), attend;
absorbed  fold kv_b_proj's key half into the query (q_nope -> (B, T, N, C)) and its value half into the output
          (the context over c, (B, T, N, C), -> (B, T, N, Dv)): the keys and values are never built, a decode
          step reads C + Dr numbers per cached token instead of N·(Dn + Dv).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.attention import (QKNorm, check_dtype, positions_arg, keep_mask_of, softmax_by_policy,
                               torch_linear_init, rope_cos_sin, rotate, structured_keep)
from mha_jax.chunked import accumulation_dtype
from mha_jax.kv_cache import KVCache, concrete_values, register_cache, row_ints
from mha_spec import MASKED_ROWS_POLICIES, AttentionConfig, LatentAttentionConfig, Stages, refuse_no_new_tokens


@dataclasses.dataclass(frozen=True)
class LatentStages(Stages):
    """`mha_spec.Stages` of an MLA layer, as `mha_torch.mla.LatentStages` (heads first, the oracle's layouts).

    q (B, N, T, Dn+Dr) = cat(q_nope, q_pe) before RoPE; k (B, N, S, Dn+Dr) = cat(k_nope, k_pe) before RoPE, the
    one k_pe head repeated to the N heads; v (B, N, S, Dv); q_rot (B, N, T, Dr) is q_pe rotated and k_rot
    (B, 1, S, Dr) k_pe rotated; latent (B, S, C) is c after its RMSNorm; scores (scaled, -inf where masked) and
    weights (B, N, T, S), None with need_weights=False; context (B, T, N·Dv) before out_proj; output (B, T, E).
    With a cache q, k, v, q_rot, k_rot, latent are the new tokens' (S = T), scores and weights over the Cap
    slots. q_norm and k_norm stay None (the RMSNorms here are on the low-rank projections, not on q and k).
    """

    latent: Any = None


jax.tree_util.register_dataclass(LatentStages, data_fields=[f.name for f in dataclasses.fields(LatentStages)],
                                 meta_fields=[])


# ---------------------------------------------------------------------------------------------- the latent cache


@dataclasses.dataclass(frozen=True)
class LatentCache:
    """One MLA layer's cache: c (B, Cap, C) after its RMSNorm, k_pe (B, Cap, Dr) after RoPE, starts and lengths
    (B,) int32. Immutable: `write` returns a new cache.

    The rules are `mha_jax.kv_cache.KVCache`'s (its docstring): row b's valid slots are starts[b] <= s <
    lengths[b], new token i of row b goes to slot lengths[b] + i and attends starts[b] <= s <= lengths[b] + i,
    the token in slot s has the RoPE position s - starts[b]; T > Cap is a ValueError, a row without room one
    where the lengths are known (under jit it is left unwritten and the module returns NaN on it).
    """

    c: jax.Array  # (B, Cap, C)
    k_pe: jax.Array  # (B, Cap, Dr), rotated
    starts: jax.Array  # (B,) int32: left-padding slots of each row
    lengths: jax.Array  # (B,) int32: slots written in each row (padding included)

    def __post_init__(self):
        _check_latent_fields(self)

    @classmethod
    def empty(cls, batch: int, capacity: int, kv_lora_rank: int, rope_dim: int, *, dtype, starts=None) -> LatentCache:
        """A cache with nothing written: zeros, lengths 0; starts (B,) the left-padding slots (default 0)."""
        for name, n in (("batch", batch), ("capacity", capacity), ("kv_lora_rank", kv_lora_rank),
                        ("rope_dim", rope_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (0 if name == "batch" else 1):
                raise ValueError(f"LatentCache.empty: {name} must be a positive int, got {n!r}")
        dtype = jnp.dtype(dtype)
        check_dtype("LatentCache.empty dtype", dtype)
        starts = row_ints(starts, batch, "starts")
        return cls(jnp.zeros((batch, capacity, kv_lora_rank), dtype), jnp.zeros((batch, capacity, rope_dim), dtype),
                   starts, jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.c.shape[1]

    @property
    def width(self) -> int:
        """Numbers held per token: C + Dr (`LatentAttentionConfig.cache_width`)."""
        return self.c.shape[2] + self.k_pe.shape[2]

    # The slot rules read capacity, starts and lengths only: KVCache's own functions, so both caches keep one rule.
    fits = KVCache.fits
    slots = KVCache.slots
    positions = KVCache.positions
    keep_mask = KVCache.keep_mask

    def write(self, c_new, k_pe_new) -> LatentCache:
        """A new cache holding c_new (B, T, C) and k_pe_new (B, T, Dr) at each row's next T slots, lengths + T;
        a row without room (under jit) is left as it was."""
        cs, ks = tuple(c_new.shape), tuple(k_pe_new.shape)
        B, _, C = self.c.shape
        if len(cs) != 3 or len(ks) != 3 or cs[1] != ks[1] or (cs[0], cs[2], ks[0], ks[2]) != (B, C, B, self.k_pe.shape[2]):
            raise ValueError(f"new latents {tuple(c_new.shape)} (B, T, C) and k_pe {tuple(k_pe_new.shape)} (B, T, Dr) "
                             f"do not fit the cache c {tuple(self.c.shape)}, k_pe {tuple(self.k_pe.shape)}")
        if c_new.dtype != self.c.dtype or k_pe_new.dtype != self.c.dtype:
            raise TypeError(f"new latents/k_pe are {c_new.dtype}/{k_pe_new.dtype}, the cache holds {self.c.dtype}")
        T = cs[1]
        fits = self.fits(T)  # (B,)

        def put(row, new, at):  # row (Cap, D), new (T, D)
            return jax.lax.dynamic_update_slice(row, new, (at, jnp.zeros_like(at)))

        c = jax.vmap(put)(self.c, c_new, self.lengths)
        k_pe = jax.vmap(put)(self.k_pe, k_pe_new, self.lengths)
        keep_old = ~fits[:, None, None]
        return _unchecked(jnp.where(keep_old, self.c, c), jnp.where(keep_old, self.k_pe, k_pe), self.starts,
                          jnp.where(fits, self.lengths + T, self.lengths))


_LATENT_FIELDS = ("c", "k_pe", "starts", "lengths")


def _check_latent_fields(cache: LatentCache) -> None:
    """Types, shapes and (where known, not traced) starts and lengths in [0, Cap]: errors naming the field."""
    for name in _LATENT_FIELDS:
        x = getattr(cache, name)
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"LatentCache.{name} must be a jax or numpy array, got {type(x).__name__}")
    c, k_pe = tuple(cache.c.shape), tuple(cache.k_pe.shape)
    if len(c) != 3 or len(k_pe) != 3 or c[:2] != k_pe[:2]:
        raise ValueError(f"LatentCache c {c} (B, Cap, C) and k_pe {k_pe} (B, Cap, Dr) must share B and Cap")
    if cache.c.dtype != cache.k_pe.dtype or not jnp.issubdtype(cache.c.dtype, jnp.floating):
        raise TypeError(f"LatentCache c and k_pe must share one floating dtype: c {cache.c.dtype}, "
                        f"k_pe {cache.k_pe.dtype}")
    for name in ("starts", "lengths"):
        x = getattr(cache, name)
        if np.dtype(x.dtype).kind not in "iu":
            raise TypeError(f"LatentCache.{name} must be integers (int32), got dtype {x.dtype}")
        if tuple(x.shape) != (c[0],):
            raise ValueError(f"LatentCache.{name} must have shape ({c[0]},) (one per batch row), got {tuple(x.shape)}")
        known = concrete_values(x)
        if known is not None and ((known < 0) | (known > c[1])).any():
            raise ValueError(f"LatentCache.{name} must lie in [0, capacity={c[1]}], got {known.tolist()}")


_unchecked = register_cache(LatentCache, _LATENT_FIELDS)  # a pytree; the builder `write` uses


# ---------------------------------------------------------------------------------------------- the layer


class MultiHeadLatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek V2/V3) in Flax NNX: `self.config` an `mha_spec.LatentAttentionConfig`.

    Parameters under the canonical names (`mha_spec.MLA_KEYS`): q_proj, or q_a_proj, q_a_norm, q_b_proj with
    q_lora_rank; kv_a_proj, kv_a_norm, kv_b_proj, out_proj. The projections are nnx.Linear (kernel (in, out), the
    torch weight transposed; biases on q_a_proj, kv_a_proj, out_proj with bias=True), the norms `QKNorm`s (a
    `weight`, ones). Stored in `param_dtype`; `dtype` the computation dtype (None: the parameters'); inputs must
    have it (a TypeError otherwise, no silent cast).

    __call__(x [B, T, E], mask=None, need_weights=True, *, key_value=None, positions=None, key_positions=None,
             is_causal=False, return_intermediates=False, cache=None, absorb=False)
      -> (output [B, T, E], weights [B, N, T, S] | None)   [+ new cache] [+ `LatentStages`]
    as `mha_torch.MultiHeadLatentAttention.forward`. Self-attention over x; key_value [B, S, E] makes it
    cross-attention (the latents and k_pe from key_value). mask: a keep-mask (0 = masked) [T, S], [B, T, S] or
    [B|1, N|1, T|1, S|1], bool, int or float; is_causal keeps s <= t (top-left), ANDed with mask; a row that keeps
    no key follows masked_rows ("nan" | "zero" | "uniform"). RoPE positions (T,) | (B, T) (default arange) are the
    queries' and, in self-attention, the keys'; with key_value, key_positions (S,) | (B, S) (default arange) are
    the keys'. S = 0 is a ValueError. need_weights=False returns no weights (and no
    scores in the stages); the core is the same einsum one (jax's fused kernels take one head dim for keys and
    values, MLA has Dn + Dr and Dv). absorb: kv_b_proj folded into the query and the output instead of expanding
    the latent (the same numbers to rounding).

    Decoding: cache=`LatentCache` (`init_cache`) appends the T new tokens' c and rotated k_pe (at positions=,
    default `cache.positions(T)`) and attends every written slot (new token i of row b: starts[b] <= s <=
    lengths[b] + i); returns (output, weights [B, N, T, Cap] | None, new cache[, stages]). With a cache mask=,
    is_causal=, key_value= and key_positions= are ValueErrors (the cache's keep-mask is the mask), as is T = 0.
    Jit-able: Python branches on shapes and flags only.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, rngs: nnx.Rngs, q_lora_rank: int | None = None,
                 rope: str = "interleaved", rope_theta: float = 10000.0, rope_scaling=None, norm_eps: float = 1e-6,
                 bias: bool = False, masked_rows: str = "nan", dtype=None, param_dtype=jnp.float32, precision=None):
        self.config = cfg = LatentAttentionConfig(
            embed_dim, num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, rope=rope,
            rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps, bias=bias)
        if masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
        check_dtype("dtype", dtype)
        check_dtype("param_dtype", param_dtype)
        self.embed_dim, self.num_heads, self.masked_rows = embed_dim, num_heads, masked_rows
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        # RoPE over the Dr features as one head: rope_cos_sin/rotate take an AttentionConfig; the frequencies and
        # the cos/sin factor are the same functions of (Dr, theta, scaling) as cfg.rope_frequencies/rope_scale.
        self.rope_config = AttentionConfig(qk_rope_head_dim, 1, rope=rope, rope_theta=rope_theta,
                                           rope_scaling=rope_scaling)

        def linear(fan_in, n_out, use_bias):
            return nnx.Linear(fan_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              precision=precision, kernel_init=torch_linear_init(fan_in),
                              bias_init=torch_linear_init(fan_in), rngs=rngs)

        def norm(size):
            return QKNorm(size, eps=norm_eps, offset=0.0, param_dtype=param_dtype)

        N, C, Dr = num_heads, kv_lora_rank, qk_rope_head_dim
        Q, Dqk, Dn, Dv = q_lora_rank, cfg.qk_head_dim, qk_nope_head_dim, v_head_dim
        self.q_proj = linear(embed_dim, N * Dqk, False) if Q is None else None
        self.q_a_proj = None if Q is None else linear(embed_dim, Q, bias)
        self.q_a_norm = None if Q is None else norm(Q)
        self.q_b_proj = None if Q is None else linear(Q, N * Dqk, False)
        self.kv_a_proj = linear(embed_dim, C + Dr, bias)
        self.kv_a_norm = norm(C)
        self.kv_b_proj = linear(C, N * (Dn + Dv), False)
        self.out_proj = linear(N * Dv, embed_dim, bias)

    # ------------------------------------------------------------------ pieces

    def _dtype(self):
        return jnp.dtype(self.dtype or self.kv_a_proj.kernel[...].dtype)

    def _project(self, layer: nnx.Linear, x, dtype):
        """x (..., in) @ kernel (in, out) + bias, accumulated in >= float32, in dtype."""
        kernel = layer.kernel[...].astype(dtype)
        y = jnp.einsum("...i,io->...o", x, kernel, precision=self.precision,
                       preferred_element_type=accumulation_dtype(dtype))
        if layer.bias is not None:
            y = y + layer.bias[...].astype(dtype)
        return y.astype(dtype)

    def _query(self, x, dtype):
        """(q_nope (B, T, N, Dn), q_pe (B, T, N, Dr)) before RoPE."""
        cfg = self.config
        if self.q_proj is not None:
            q = self._project(self.q_proj, x, dtype)
        else:
            q = self._project(self.q_b_proj, self.q_a_norm(self._project(self.q_a_proj, x, dtype)), dtype)
        q = q.reshape(*x.shape[:2], cfg.num_heads, cfg.qk_head_dim)  # (B, T, N, Dn + Dr)
        return q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]

    def _latent(self, x, dtype):
        """(c (B, T, C) after its RMSNorm, k_pe (B, T, Dr) before RoPE)."""
        ckv = self._project(self.kv_a_proj, x, dtype)  # (B, T, C + Dr)
        C = self.config.kv_lora_rank
        return self.kv_a_norm(ckv[..., :C]), ckv[..., C:]

    def _rotate(self, x, positions, L: int, dtype):
        """x (B, L, n, Dr) rotated at positions (L,) | (B, L) (None: arange(L))."""
        cos, sin = rope_cos_sin(self.rope_config, positions, L, accumulation_dtype(dtype))  # (B|1, L, 1, Dr/2)
        return rotate(x, cos, sin, self.config.rope)

    def _kv_b_halves(self, dtype):
        """kv_b_proj's kernel (C, N·(Dn + Dv)) as its key half (C, N, Dn) and value half (C, N, Dv)."""
        cfg = self.config
        w = self.kv_b_proj.kernel[...].astype(dtype).reshape(cfg.kv_lora_rank, cfg.num_heads, -1)
        return w[..., :cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]

    def _expand(self, c, dtype):
        """The latent c (B, S, C) through kv_b_proj: (k_nope (B, S, N, Dn), v (B, S, N, Dv))."""
        cfg = self.config
        kv = self._project(self.kv_b_proj, c, dtype).reshape(*c.shape[:2], cfg.num_heads, -1)
        return kv[..., :cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]

    def _core(self, q_nope, q_pe, c, k_pe, keep, dtype, absorb: bool):
        """(context (B, T, N, Dv), weights (B, N, T, S), scores (B, N, T, S)) of queries q_nope (B, T, N, Dn),
        q_pe (B, T, N, Dr) (rotated) over latents c (B, S, C) and rotated k_pe (B, S, Dr), keep (B|1, N|1, T, S)
        or None. Scores and softmax in the accumulation dtype (float32 for 16-bit inputs)."""
        acc, prec = accumulation_dtype(dtype), self.precision
        if absorb:
            w_k, w_v = self._kv_b_halves(dtype)  # (C, N, Dn), (C, N, Dv)
            q_lat = jnp.einsum("BTND,CND->BTNC", q_nope, w_k, precision=prec, preferred_element_type=acc)
            nope = jnp.einsum("BTNC,BSC->BNTS", q_lat.astype(dtype), c, precision=prec, preferred_element_type=acc)
        else:
            k_nope, v = self._expand(c, dtype)  # (B, S, N, Dn), (B, S, N, Dv)
            nope = jnp.einsum("BTND,BSND->BNTS", q_nope, k_nope, precision=prec, preferred_element_type=acc)
        # k_pe is one head shared by all N: contracted as such, never repeated.
        pe = jnp.einsum("BTNR,BSR->BNTS", q_pe, k_pe, precision=prec, preferred_element_type=acc)
        scores = (nope + pe) * self.config.softmax_scale  # (B, N, T, S)
        if keep is not None:
            scores = jnp.where(keep, scores, -jnp.inf)
        weights = softmax_by_policy(scores, keep, self.masked_rows, c.shape[1]).astype(dtype)
        if absorb:
            # Heads stay ahead of T here: XLA's CPU dot refuses "BNTS,BSC->BTNC" for 16-bit inputs with a float32
            # result (jax 0.10.2: "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
            ctx_lat = jnp.einsum("BNTS,BSC->BNTC", weights, c, precision=prec, preferred_element_type=acc)
            context = jnp.einsum("BNTC,CNV->BTNV", ctx_lat.astype(dtype), w_v, precision=prec,
                                 preferred_element_type=acc)
        else:
            context = jnp.einsum("BNTS,BSNV->BTNV", weights, v, precision=prec, preferred_element_type=acc)
        return context.astype(dtype), weights, scores

    def _check_x(self, name: str, x, batch: int | None = None):
        """(B, L, computation dtype) of x (B, L, E); TypeError/ValueError naming it."""
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
        if len(x.shape) != 3 or x.shape[2] != self.embed_dim or (batch is not None and x.shape[0] != batch):
            want = f"({'B' if batch is None else batch}, L, {self.embed_dim})"
            raise ValueError(f"{name} must have shape {want} [batch, length, embed_dim], got {tuple(x.shape)}")
        dtype = self._dtype()
        if jnp.dtype(x.dtype) != dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but the module computes in {dtype}")
        return x.shape[0], x.shape[1], dtype

    # ------------------------------------------------------------------ calls

    def init_cache(self, batch: int, capacity: int, starts=None) -> LatentCache:
        """An empty LatentCache (c (B, Cap, C), k_pe (B, Cap, Dr)) in the computation dtype; starts (B,) the
        left-padding slots of each row (default 0)."""
        cfg = self.config
        return LatentCache.empty(batch, capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype=self._dtype(),
                                 starts=starts)

    def __call__(self, x, mask=None, need_weights: bool = True, *, key_value=None, positions=None,
                 key_positions=None, is_causal: bool = False, return_intermediates: bool = False,
                 cache: LatentCache | None = None, absorb: bool = False):
        if cache is not None:
            if mask is not None or is_causal or key_value is not None or key_positions is not None:
                raise ValueError("mask=, is_causal=, key_value= and key_positions= with a cache: the cache's keep-mask "
                                 "(starts[b] <= s <= lengths[b] + i) is the mask and the new tokens are the keys")
            return self._decode(x, need_weights, positions, return_intermediates, cache, absorb)
        B, T, dtype = self._check_x("x", x)
        if key_value is None and key_positions is not None:
            raise ValueError("key_positions= without key_value=: in self-attention positions= are the keys' too")
        kv_in, key_positions = (x, positions) if key_value is None else (key_value, key_positions)
        S = self._check_x("key_value", kv_in, batch=B)[1]
        if S == 0:
            raise ValueError(f"key length S=0: a query must have at least one key to attend to; got key_value "
                             f"{tuple(kv_in.shape)}")
        positions = positions_arg(positions, B, T, "positions")
        key_positions = positions_arg(key_positions, B, S, "key_positions")
        keep = None if mask is None else keep_mask_of(mask, B, self.num_heads, T, S)  # (B|1, N|1, T|1, S|1)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        if is_causal:
            causal = structured_keep(T, S, is_causal=True)  # (1, 1, T, S), top-left
            keep = causal if keep is None else keep & causal
        x, kv_in = jnp.asarray(x), jnp.asarray(kv_in)
        q_nope, q_pe = self._query(x, dtype)  # (B, T, N, Dn), (B, T, N, Dr)
        c, k_pe = self._latent(kv_in, dtype)  # (B, S, C), (B, S, Dr)
        q_rot = self._rotate(q_pe, positions, T, dtype)  # (B, T, N, Dr)
        k_rot = self._rotate(k_pe[:, :, None, :], key_positions, S, dtype)[:, :, 0, :]  # (B, S, Dr)
        context, weights, scores = self._core(q_nope, q_rot, c, k_rot, keep, dtype, absorb)
        context = context.reshape(B, T, -1)  # (B, T, N·Dv)
        output = self._project(self.out_proj, context, dtype)  # (B, T, E)
        weights, scores = (weights, scores) if need_weights else (None, None)
        if return_intermediates:
            raw = (q_nope, q_pe, c, k_pe, q_rot, k_rot)
            return output, weights, self._stages(raw, scores, weights, context, output, dtype)
        return output, weights

    def _decode(self, x, need_weights, positions, return_intermediates, cache, absorb):
        """__call__ with a cache: T new tokens are written into it, then attend it."""
        if not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a mha_jax.mla.LatentCache (see init_cache), got {type(cache).__name__}")
        refuse_no_new_tokens(x=getattr(x, "shape", ()))
        B, T, dtype = self._check_x("x", x)
        cfg = self.config
        if (cache.c.shape[0], cache.c.shape[2], cache.k_pe.shape[2]) != (B, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            raise ValueError(f"the cache c {tuple(cache.c.shape)} (B, Cap, C), k_pe {tuple(cache.k_pe.shape)} (B, Cap, "
                             f"Dr) does not fit B={B} new rows of a layer with C={cfg.kv_lora_rank}, "
                             f"Dr={cfg.qk_rope_head_dim}")
        if jnp.dtype(cache.c.dtype) != dtype:
            raise TypeError(f"the cache holds {cache.c.dtype} but the module computes in {dtype}")
        positions = positions_arg(positions, B, T, "positions")
        fits = cache.fits(T)  # (B,); a ValueError here where the lengths are known
        if positions is None:
            positions = cache.positions(T)  # (B, T): traced under jit
        x = jnp.asarray(x)
        q_nope, q_pe = self._query(x, dtype)  # (B, T, N, Dn), (B, T, N, Dr)
        c, k_pe = self._latent(x, dtype)  # (B, T, C), (B, T, Dr)
        q_rot = self._rotate(q_pe, positions, T, dtype)
        k_rot = self._rotate(k_pe[:, :, None, :], positions, T, dtype)[:, :, 0, :]  # (B, T, Dr)
        keep = cache.keep_mask(T)  # (B, 1, T, Cap): the old lengths say where the new tokens go
        new_cache = cache.write(c, k_rot)
        context, weights, scores = self._core(q_nope, q_rot, new_cache.c, new_cache.k_pe, keep, dtype, absorb)

        def nan_where_full(y):  # a row without room was not written: its numbers would be about the wrong slots
            return jnp.where(fits.reshape((-1,) + (1,) * (y.ndim - 1)), y, jnp.nan)

        context, weights, scores = (nan_where_full(y) for y in (context, weights, scores))
        context = context.reshape(B, T, -1)  # (B, T, N·Dv)
        output = self._project(self.out_proj, context, dtype)  # (B, T, E)
        weights, scores = (weights, scores) if need_weights else (None, None)
        if return_intermediates:
            raw = (q_nope, q_pe, c, k_pe, q_rot, k_rot)
            return output, weights, new_cache, self._stages(raw, scores, weights, context, output, dtype)
        return output, weights, new_cache

    def _stages(self, raw, scores, weights, context, output, dtype) -> LatentStages:
        """LatentStages from the call's pieces (q_nope, q_pe (B, T, N, ·), c, k_pe, k_rot (B, S, ·), q_rot), keys
        and values expanded from c here (the absorbed path never builds them)."""
        q_nope, q_pe, c, k_pe, q_rot, k_rot = raw
        k_nope, v = self._expand(c, dtype)  # (B, S, N, Dn), (B, S, N, Dv)
        shared = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], k_pe.shape[-1]))  # (B, S, N, Dr)

        def heads_first(y):  # (B, L, n, D) -> (B, n, L, D)
            return jnp.transpose(y, (0, 2, 1, 3))

        q = heads_first(jnp.concatenate([q_nope, q_pe], axis=-1))  # (B, N, T, Dn + Dr)
        k = heads_first(jnp.concatenate([k_nope, shared], axis=-1))  # (B, N, S, Dn + Dr)
        return LatentStages(q, k, heads_first(v), scores, weights, context, output, heads_first(q_rot),
                            k_rot[:, None], latent=c)
