"""Multi-head attention in PyTorch: the classic module, with explicit semantics.

Shapes (legend in `mha_spec`): B batch, T query length, S key length,
N heads, H head dim, E = N * H.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mha_spec import (AttentionConfig, check_cache_shapes, check_mask_values, check_positions, check_qkv_shapes,
                      mask_shape_4d, refuse_no_new_tokens, Stages, Structure)
from mha_spec.structure import check_segment_shape
from mha_torch.kv_cache import KVCache, StaticKVCache

LOW_PRECISION = (torch.float16, torch.bfloat16)


_FUNCTORCH = getattr(torch._C, "_functorch", None)  # torch.func's wrappers; private, so looked up softly


def _is_func_wrapped(x: torch.Tensor) -> bool:
    """Whether x is a torch.func wrapper (vmap's batched tensor, grad's tracking tensor)."""
    return _FUNCTORCH is not None and _FUNCTORCH.is_functorch_wrapped_tensor(x)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under torch.func wrappers.

    Under vmap a Python bool of a batched tensor is data-dependent control flow, which vmap
    refuses; the unwrapped tensor holds every vmapped instance's values, so a check on it
    covers all of them.
    """
    while _is_func_wrapped(x):
        x = _FUNCTORCH.get_unwrapped(x)
    return x


def keep_mask_4d(mask: torch.Tensor, B: int, N: int, T: int, S: int) -> torch.Tensor:
    """Any bool/int/float keep-mask (0 = masked) -> bool [B|1, N|1, T|1, S|1].

    A float mask's values are checked (no NaN, no negative value: an additive mask) in eager
    mode, under torch.func transforms too (vmap: on all instances at once). Under torch.compile
    the values are not known while tracing and nothing is checked.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool, int or float, got {mask.dtype}")
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    if mask.is_floating_point() and not torch.compiler.is_compiling():
        values = _plain(mask)
        check_mask_values(mask.shape, bool(values.isnan().any()), bool((values < 0).any()))
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.reshape(shape4)


def apply_masked_row_policy(x, row_any, masked_rows: str, uniform_value):
    """Overwrite the rows of x whose query may attend to nothing (row_any False).

    uniform_value is what such a row holds under "uniform" (1/S for weights, mean V for a
    context). Under "nan" the fill is uniform_value times a factor that is NaN on exactly
    those rows, so on the fused path the gradient meets NaN where the materialised path's
    NaN weights meet V (the same (batch, head) slices of V), and nowhere else.
    """
    if masked_rows == "zero":
        fill = torch.zeros((), dtype=x.dtype, device=x.device)
    elif masked_rows == "nan":
        fill = uniform_value * torch.where(row_any, 1.0, float("nan")).to(x.dtype)
    else:
        fill = uniform_value
    return torch.where(row_any, x, fill)


def _core_keep(keep, B: int, N: int, T: int, S: int):
    """A core's keep-mask of any shape the module takes -> (B|1, N|1, T|1, S|1); None stays None.

    [B, T, S] gets a head axis (`mha_spec.mask_shape_4d`) instead of being read as
    [1, B, T, S] by broadcasting; anything that does not fit is a ValueError naming the shapes.
    """
    return None if keep is None else keep.reshape(mask_shape_4d(keep.shape, B, N, T, S))


def attention_core(q, k, v, keep, *, masked_rows: str = "nan", return_scores: bool = False, scale=None,
                   softcap=None, sinks=None):
    """softmax(Q Kᵀ · scale) V with materialised weights.

    q (B, N, T, H), k and v (B, N, S, H), keep bool [T, S], [B, T, S] (a batch axis, as in
    the module) or (B|1, N|1, T|1, S|1), or None.
    Returns context (B, N, T, H) in q's dtype and weights (B, N, T, S) in q's dtype, and with
    return_scores also the scaled (and capped) scores (B, N, T, S), -inf where masked (a copy, only then).
    Scores and softmax run in float32 for 16-bit inputs (float64 stays float64).
    scale: the logits' factor (None: 1/√H); softcap=c: scores c·tanh(s/c) before the mask; sinks (N,): a
    logit per head joining each row's softmax, its column dropped after (then a row that keeps no key
    gets zeros, whatever masked_rows says).
    """
    dtype = q.dtype
    B, N, T, H = q.shape
    S = k.shape[-2]
    keep = _core_keep(keep, B, N, T, S)  # (B|1, N|1, T|1, S|1)
    if dtype in LOW_PRECISION:
        # Products of 16-bit numbers are exact in float32; rounding the scores to
        # 16 bits before the softmax would cost ~1e-2 relative error in the weights.
        q, k = q.float(), k.float()
    # baddbmm applies the scale in the GEMM epilogue: no extra pass over (B, N, T, S).
    scores = torch.baddbmm(
        torch.empty(B * N, T, S, dtype=q.dtype, device=q.device),
        q.reshape(B * N, T, H),
        k.reshape(B * N, S, H).transpose(1, 2),
        beta=0.0,
        alpha=1.0 / math.sqrt(H) if scale is None else scale,
    ).view(B, N, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    returned_scores = scores.clone() if return_scores else None  # before the row fix below
    if sinks is not None:
        weights = _softmax_with_sinks(scores, sinks)
    else:
        weights = _softmax_with_policy(scores, keep, masked_rows)
    weights = weights.to(dtype)
    context = torch.matmul(weights, v)  # (B, N, T, H)
    if return_scores:
        return context, weights, returned_scores
    return context, weights


def _softmax_with_policy(scores, keep, masked_rows: str):
    """softmax over the keys (in place on scores), a row that keeps no key set by the masked-row policy."""
    if keep is None:
        return torch.softmax(scores, dim=-1)
    row_any = keep.any(dim=-1, keepdim=True)  # (B|1, N|1, T|1, 1)
    # A fully masked row gets all-zero scores: its softmax is finite (uniform),
    # so no NaN reaches the backward pass; the policy then sets its value.
    scores.masked_fill_(~row_any, 0.0)
    weights = torch.softmax(scores, dim=-1)
    S = scores.shape[-1]
    return apply_masked_row_policy(
        weights, row_any, masked_rows, torch.full((), 1.0 / S, dtype=weights.dtype, device=weights.device)
    )


def _softmax_with_sinks(scores, sinks):
    """softmax of scores (B, N, T, S) with each head's sink logit (N,) as an extra column, dropped after.

    The sink is finite, so a row that keeps no key is all zeros (the sink takes its weight), never NaN.
    """
    B, N, T, S = scores.shape
    if sinks.ndim != 1 or sinks.shape[0] != N:
        raise ValueError(f"sinks must have shape (N,) = ({N},) (one logit per query head), got {tuple(sinks.shape)}")
    sink = sinks.to(scores.dtype).reshape(1, N, 1, 1).expand(B, N, T, 1)  # (B, N, T, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]


def _has_nan(x, dim: int):
    """bool flags: a NaN anywhere along dim, kept as a size-1 axis.

    A max reduction propagates NaN and, unlike a sum, cannot make one: a sum of finite
    values can overflow to +inf in one partial sum and -inf in another, and +inf + -inf is
    NaN. It costs about what a sum does on CPU and ~10x less than isnan().any(dim)
    (1 thread, (4, 8, 1024, 64) float32, medians: amax 0.5 ms, sum 0.5 ms, isnan().any 5 ms);
    flop counters count none.
    """
    return x.detach().amax(dim=dim, keepdim=True).isnan()


def _rows_keeping_nan_keys(keep, k_nan, dtype):
    """bool (B, N, T|1, 1): which rows keep at least one NaN key, without building (B, N, T, S).

    keep (B|1, N|1, T|1, S|1) bool, k_nan (B, N, S) bool. One matmul over S; keep's size-1
    axes are left out of the einsum, so nothing is broadcast to (B, N, T, S).
    """
    B, N, S = k_nan.shape
    keep = keep.reshape((1,) * (4 - keep.ndim) + tuple(keep.shape))  # a core caller may pass [T, S]
    sizes = keep.shape[:3]
    if keep.shape[3] == 1:  # one flag per row for every key: a row keeps all keys or none
        return (keep[..., 0] & k_nan.any(dim=-1)[:, :, None]).reshape(B, N, sizes[2], 1)
    kept_axes = "".join(c for c, d in zip("BNT", sizes) if d != 1)
    out_axes = "BNT" if sizes[2] != 1 else "BN"
    squeezed = keep.reshape([d for d in sizes if d != 1] + [S]).to(dtype)
    hits = torch.einsum(f"{kept_axes}S,BNS->{out_axes}", squeezed, k_nan.to(dtype))
    return (hits > 0).reshape(B, N, sizes[2], 1)


def _causal_rows_keeping_nan_keys(k_nan, T: int):
    """bool (B, N, T, 1) for the causal mask: row t keeps keys 0..min(t, S-1), a prefix. O(B·N·(S+T))."""
    S = k_nan.shape[-1]
    seen = k_nan.cumsum(dim=-1) > 0  # (B, N, S): a NaN key among 0..s
    last_key = torch.arange(T, device=k_nan.device).clamp_(max=S - 1)
    return seen[..., last_key].unsqueeze(-1)


def _nan_rows(q, k, keep, causal: bool = False):
    """(k with NaN keys zeroed when a mask is given, bool (B, N, T|1, 1) rows that must be NaN).

    causal=True: the mask is the causal triangle, whether or not keep holds it (keep may be None).

    The weights path gives NaN on a row whose query is NaN or that keeps a NaN key; a NaN key
    that the row masks out is dropped (its score is replaced by -inf). SDPA differs on both:
    on CPU a NaN query without a mask gives 0, and a masked NaN key still reaches every row
    (the mask is added: NaN + -inf = NaN). So NaN is put back here from per-row flags.
    """
    q_nan = _has_nan(q, -1)  # (B, N, T, 1)
    k_nan_kv = _has_nan(k, -1)  # (B, K, S, 1)
    group = q.shape[1] // k.shape[1]
    # Query head h reads key head h // group: the flags (not K itself) are repeated to N heads.
    k_nan = k_nan_kv.repeat_interleave(group, dim=1) if group > 1 else k_nan_kv  # (B, N, S, 1)
    if keep is None and not causal:
        return k, q_nan | k_nan.any(dim=-2, keepdim=True)
    k = torch.where(k_nan_kv, 0.0, k)
    if causal:
        return k, q_nan | _causal_rows_keeping_nan_keys(k_nan.squeeze(-1), q.shape[-2])
    dtype = q.dtype if q.dtype in LOW_PRECISION else torch.float32
    return k, q_nan | _rows_keeping_nan_keys(keep, k_nan.squeeze(-1), dtype)


_CAUSAL_CACHE_MAX_BYTES = 1 << 24  # cache reference triangles up to T·S = 16 Mi (4096²), 4 of them


@functools.lru_cache(maxsize=4)
def _cached_tril(T: int, S: int, device: torch.device) -> torch.Tensor:
    return torch.ones(T, S, dtype=torch.bool, device=device).tril_()


def _as_words(x: torch.Tensor, copies: int) -> torch.Tensor:
    """A bool tensor of `copies` (T, S) blocks as (copies, words): int64 words where the layout allows.

    equal() on int64 words is ~3x faster than on bools; a layout that does not allow them
    (not contiguous, T·S not a multiple of 8) is compared as (copies, T·S) bools.
    """
    if x.is_contiguous() and x.numel() % (8 * copies) == 0 and x.storage_offset() % 8 == 0:
        return x.reshape(-1).view(torch.uint8).view(torch.int64).reshape(copies, -1)
    return x.reshape(copies, -1)


def _is_causal(keep, T: int, S: int) -> bool:
    """Whether keep (bool, broadcastable to (B, N, T, S)) is exactly the causal mask tril(ones(T, S)).

    That is SDPA's is_causal (top-left aligned: query t keeps keys 0..t). Exact, and cheap:
    a shape test, then one comparison of the mask with a cached triangle (int64 words, early
    exit on the first difference: 2-11 ms for one [T, S] copy at T = S = 4096 on one CPU thread
    of a loaded machine, against 0.7-6 s for that attention's forward and backward). A mask
    with per-batch or per-head copies is compared copy by copy (the mask's own size; a
    stride-0 expand is one copy). Never under torch.compile or when the mask is a torch.func
    wrapper (the answer is a Python bool of the values); on an accelerator it costs a sync.
    """
    if keep is None or keep.dtype != torch.bool or keep.ndim < 2 or keep.numel() == 0:
        return False
    if tuple(keep.shape[-2:]) != (T, S) or torch.compiler.is_compiling() or _is_func_wrapped(keep):
        return False
    # A broadcast (stride-0) axis holds one copy: look at its first entry only.
    keep = keep[tuple(0 if stride == 0 else slice(None) for stride in keep.stride()[:-2])]
    copies = keep.numel() // (T * S)
    if T * S <= _CAUSAL_CACHE_MAX_BYTES:
        tril = _cached_tril(T, S, keep.device)
    else:
        tril = torch.ones(T, S, dtype=torch.bool, device=keep.device).tril_()
    a, b = _as_words(keep, copies), _as_words(tril, 1)
    if a.dtype != b.dtype:
        a, b = keep.reshape(copies, -1), tril.reshape(1, -1)
    return bool(torch.equal(a, b.expand_as(a)))


def fused_attention_core(q, k, v, keep, *, masked_rows: str = "nan", scale=None, softcap=None, sinks=None):
    """The same maths through F.scaled_dot_product_attention; never returns weights.

    scale passes to SDPA (None: 1/√H). SDPA has no soft-cap and no sinks: with softcap or sinks the
    materialised `attention_core` runs instead (`materialised_context`), and SDPA not at all.

    k and v may have K heads dividing q's N (query head h reads key/value head h // (N/K));
    SDPA then runs with enable_gqa=True, and only per-head flags and means are repeated.
    keep takes the shapes `attention_core` takes.

    SDPA gives zeros on fully masked rows; the policy is applied afterwards on the
    (B, N, T, H) context, so nothing of size (B, N, T, S) is built here. NaN lands where
    the weights path puts it (see `_nan_rows`); a NaN in V reaches every row of its
    (batch, head) and column, as weights (zero or not) times V does. A keep-mask that is
    exactly the causal triangle (`_is_causal`) runs as SDPA's is_causal=True, which skips
    the blocks above the diagonal; no row of it is fully masked, so no policy applies. Its
    outputs and their NaNs are the mask path's; so are the gradients, but for one place: with
    a NaN query, V's gradient at the keys that row masks out is finite here and NaN with the
    mask (there the row's masked weights are NaN too, times a zero cotangent).
    """
    keep = _core_keep(keep, q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # (B|1, N|1, T|1, S|1)
    if softcap is not None or sinks is not None:
        return materialised_context(q, k, v, keep, masked_rows=masked_rows, scale=scale, softcap=softcap,
                                    sinks=sinks)
    B, N, T, _ = q.shape
    if k.shape[1] == 1 < N and (keep is None or keep.shape[1] == keep.shape[2] == 1):
        # One key/value head (multi-query; MLA's absorbed form) and a mask alike for every query: the N heads are
        # N·T query rows of that one head. SDPA's enable_gqa on a CPU repeats K and V once per query head
        # (MLA's absorbed decode step, N=8, S=1025, C+Dr=144: 476 us against 132 us folded, 2-core AMD EPYC).
        context = _fused_core(q.reshape(B, 1, N * T, q.shape[-1]), k, v, keep, masked_rows=masked_rows,
                              causal=False, scale=scale)  # (B, 1, N·T, H)
        return context.reshape(B, N, T, context.shape[-1])
    return _fused_core(q, k, v, keep, masked_rows=masked_rows, causal=_is_causal(keep, T, k.shape[-2]),
                       scale=scale)


def materialised_context(q, k, v, keep, *, masked_rows: str, scale=None, softcap=None, sinks=None):
    """`attention_core`'s context for k and v of K heads dividing q's N (the fused path's calling
    convention): the fused path's stand-in where SDPA cannot take a feature (softcap, sinks)."""
    group = q.shape[1] // k.shape[1]
    if q.shape[1] != group * k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"key/value heads must divide the query heads: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if group > 1:  # query head h reads key/value head h // group: repeat, never tile
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, N, S, H)
    context, _ = attention_core(q, k, v, keep, masked_rows=masked_rows, scale=scale, softcap=softcap, sinks=sinks)
    return context  # (B, N, T, H)


def _fused_core(q, k, v, keep, *, masked_rows: str, causal: bool, scale=None):
    """`fused_attention_core` once it is known whether the mask is the causal triangle tril(ones(T, S)):
    causal=True runs SDPA's is_causal (keep may then be None: it is not read)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    if q.shape[1] != group * k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"key/value heads must divide the query heads: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    gqa = {"enable_gqa": True} if group > 1 else {}

    def per_query_head(x):  # (B, K, ...) -> (B, N, ...)
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    k, nan_rows = _nan_rows(q, k, keep, causal)
    if causal:
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    else:
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, **gqa)  # (B, N, T, H)
    context = torch.where(nan_rows, float("nan"), context)
    if keep is not None and not causal:
        row_any = keep.any(dim=-1, keepdim=True)  # (B|1, N|1, T|1, 1)
        # SDPA carries a NaN of V into every row itself; the policy's fill must too (0 x NaN).
        v_nan = per_query_head(torch.where(_has_nan(v, -2), float("nan"), 0.0).to(v.dtype))  # (B, N, 1, H)
        if masked_rows == "zero":
            context = torch.where(row_any, context, v_nan)
        else:  # only "nan" and "uniform" rows need mean(V)
            acc = torch.float32 if v.dtype in LOW_PRECISION else v.dtype
            # (1/S)·V summed, as the weights path's uniform row computes it: a plain sum of
            # finite values near the dtype's largest could overflow before the division.
            mean_v = per_query_head((v.to(acc) * (1.0 / v.shape[-2])).sum(dim=-2, keepdim=True).to(v.dtype))  # (B, N, 1, H)
            context = apply_masked_row_policy(context, row_any, masked_rows, mean_v + v_nan)
    return context


def positions_4d(pos, batch: int, length: int, name: str, device) -> torch.Tensor:
    """Integer positions (L,) | (B, L), default arange(L) -> int64 (B|1, 1, L, 1)."""
    if pos is None:
        return torch.arange(length, device=device).reshape(1, 1, length, 1)
    if not isinstance(pos, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pos).__name__}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got dtype {pos.dtype}")
    check_positions(pos.shape, batch, length, name)
    # The leading size from the shape, not -1: with L = 0 a reshape cannot infer it.
    lead = pos.shape[0] if pos.ndim == 2 else 1
    return pos.to(device=device, dtype=torch.int64).reshape(lead, 1, length, 1)


def rope_max_position(config: AttentionConfig, *positions: torch.Tensor):
    """LongRoPE's call length: the largest of the call's positions (each (B|1, 1, L, 1) int64), over the whole
    batch, as an int64 scalar tensor (no .item(): torch.compile traces it); None when the layer's frequencies do
    not depend on the call (no scaling, or a kind other than longrope). With no position at all (B = 0 or
    L = 0) it is -1: no token rotates, and the short table is as good as any."""
    scaling = config.rope_scaling
    if scaling is None or not scaling.switches:
        return None
    flat = torch.cat([p.reshape(-1) for p in positions])  # every position of the call
    if flat.numel() == 0:
        return torch.full((), -1, dtype=torch.int64, device=flat.device)
    return flat.amax()


def rope_inv_freq(config: AttentionConfig, max_position, device) -> torch.Tensor:
    """float64 (R/2,): the layer's inv_freq from `config.rope_frequencies` (never recomputed here); for LongRoPE
    the long or the short table by `scaling.uses_long(max_position)`, a select on a scalar tensor (no branch on
    data, so torch.compile has no graph break)."""
    inv_freq = torch.tensor(config.rope_frequencies(), dtype=torch.float64, device=device)
    scaling = config.rope_scaling
    if scaling is None or not scaling.switches:
        return inv_freq
    if max_position is None:
        raise ValueError(f"rope_scaling kind {scaling.kind!r} switches tables by the call's largest position: "
                         "rotate needs max_position (`rope_max_position`)")
    long = torch.tensor(config.rope_frequencies(long=True), dtype=torch.float64, device=device)
    return torch.where(scaling.uses_long(torch.as_tensor(max_position, device=device)), long, inv_freq)


def rotate(x, pos, config: AttentionConfig, max_position=None):
    """RoPE as `config` defines it (`mha_spec.rope`): x (B, n, L, H), pos int64 (B|1, 1, L, 1) -> (B, n, L, H).

    Only the first R = config.rotary_dim features rotate; features R..H-1 pass through unchanged. Within the
    rotated part "half" pairs feature i with i + R/2, "interleaved" 2i with 2i + 1; pair i turns by
    position * inv_freq[i] (`rope_inv_freq`; max_position: `rope_max_position` of the call, needed by
    LongRoPE only). cos and sin come from float64 angles, times config.rope_scale (float64), then cast to the
    accumulation dtype (float32 for 16-bit and float32 inputs, float64 stays float64), where the rotation
    runs; the result is in x's dtype. Differentiable in x (cos and sin are constants).
    """
    H, R = x.shape[-1], config.rotary_dim
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = pos.to(torch.float64) * rope_inv_freq(config, max_position, x.device)  # (B|1, 1, L, R/2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if config.rope_scale != 1.0:  # YaRN's and LongRoPE's attention factor, on cos and sin alike
        cos, sin = cos * config.rope_scale, sin * config.rope_scale
    cos, sin = cos.to(acc), sin.to(acc)
    xa = x[..., :R].to(acc)  # (B, n, L, R)
    if config.rope == "half":
        x1, x2 = xa[..., : R // 2], xa[..., R // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xa[..., 0::2], xa[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(xa.shape)
    out = out.to(x.dtype)
    return out if R == H else torch.cat([out, x[..., R:]], dim=-1)  # the other H - R features pass


def _refuse_unread_positions(config: AttentionConfig, positions, key_positions) -> None:
    """ValueError for positions a layer would not read: key positions without RoPE, query positions without RoPE
    or the NoPE temperature."""
    if config.rope is None and key_positions is not None:
        raise ValueError("positions/key_positions are given but rope=None: key_positions would be ignored")
    if not config.uses_positions and positions is not None:
        raise ValueError("positions/key_positions are given but rope=None (and no attn_temperature_tuning): "
                         "they would be ignored")


def _integer_tensor(x, name: str) -> torch.Tensor:
    """Segment ids as `Structure.of` checks them in torch: a tensor of integers (TypeError naming it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got dtype {x.dtype}")
    return x


def _structure(T: int, S: int, batch: int | None, **keywords) -> Structure:
    """The structured keywords checked (`mha_spec.Structure.of`). Nothing but shapes and dtypes is read,
    so it runs under torch.compile with no graph break."""
    return Structure.of(T, S, batch=batch, ids=_integer_tensor, **keywords)


def _build_keep(structure: Structure, device):
    """bool (B|1, 1, T, S) of a `mha_spec.Structure`, or None when it asks for nothing."""
    keep = None
    band = structure.band()
    if band is not None:
        (lo, hi), T, S = band, structure.T, structure.S
        d = torch.arange(S, device=device)[None, :] - torch.arange(T, device=device)[:, None]  # (T, S): s - t
        keep = (d <= hi if lo is None else d >= lo if hi is None else (d >= lo) & (d <= hi))[None, None]  # (1, 1, T, S)
    if structure.chunk is not None:  # not a band: causal AND a(t) // C == s // C (and the window, if any)
        keep = _chunk_keep(structure, device)  # (1, 1, T, S)
    if structure.segment_ids is not None:
        q_seg, k_seg = structure.segment_ids.to(device), structure.key_segment_ids.to(device)
        same = q_seg[:, None, :, None] == k_seg[:, None, None, :]  # (B, 1, T, S)
        keep = same if keep is None else keep & same
    return keep


def _chunk_keep(structure: Structure, device) -> torch.Tensor:
    """bool (1, 1, T, S) of a structure with a chunk C (Llama 4's chunked layers): query t at a(t) keeps key s
    when s <= a(t) and a(t) // C == s // C, within the window's sides where it has them."""
    C, T, S = structure.chunk, structure.T, structure.S
    a = torch.arange(T, device=device)[:, None] + structure.offset  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    keep = (s <= a) & (torch.div(a, C, rounding_mode="floor") == torch.div(s, C, rounding_mode="floor"))  # (T, S)
    if structure.left is not None:
        keep = keep & (s >= a - structure.left)
    if structure.right is not None:
        keep = keep & (s <= a + structure.right)
    return keep[None, None]


def structured_keep(T: int, S: int, *, is_causal: bool = False, window=None, segment_ids=None,
                    key_segment_ids=None, alignment: str = "top-left", device=None, chunk=None):
    """The keep-mask of the structured keywords (docs/semantics.md, "Packed sequences, sliding
    windows and causal alignment"), as `parity.reference.structured_keep` defines it: bool
    (B|1, 1, T, S) on `device` (default: the segment ids' device, else the CPU), or None when
    nothing is asked. Query t sits at key a(t) = t (top-left) or t + S - T (bottom-right);
    is_causal keeps s <= a(t); window (left, right) keeps a(t) - left <= s <= a(t) + right (an
    int w is (w, w), a side of None is unbounded); segment_ids (B, T) and key_segment_ids (B, S)
    keep equal ids (key_segment_ids defaults to segment_ids when T = S); chunk C (Llama 4) keeps
    a(t) // C == s // C and implies is_causal."""
    structure = _structure(T, S, None, is_causal=is_causal, window=window, segment_ids=segment_ids,
                           key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk)
    if device is None:
        device = segment_ids.device if segment_ids is not None else torch.device("cpu")
    return _build_keep(structure, device)


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) int64 positions that restart at 0 with each document (a run of equal ids), as
    `parity.reference.segment_positions`: a token's index minus where its run began (the
    cumulative max of the run starts' indices). For RoPE's positions= on packed rows."""
    seg = _integer_tensor(segment_ids, "segment_ids")
    check_segment_shape(seg.shape, "segment_ids", None, None, "L")
    B, L = seg.shape
    idx = torch.arange(L, device=seg.device).expand(B, L)  # (B, L)
    prev = torch.cat([seg[:, :1], seg[:, :-1]], dim=1)  # (B, L): the previous token's id (itself at 0)
    starts = (idx == 0) | (seg != prev)
    first = torch.where(starts, idx, 0).cummax(dim=1).values  # (B, L): where each run began
    return idx - first


def l2_norm(x, eps: float):
    """Llama 4's weightless L2Norm of each head's features: x · rsqrt(mean(x²) + eps) over the last axis,
    computed in float32 at least (float64 stays float64), returned in x's dtype (qk_norm="l2", after RoPE)."""
    at = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(at)
    return (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def temperature(q, pos, config: AttentionConfig):
    """Llama 4's NoPE-layer query temperature: q (B, N, T, H) times log(floor((pos + 1) / floor_scale) + 1) ·
    attn_scale + 1, pos int64 (B|1, 1, T, 1); the factor and the product in float32 at least (float64 stays
    float64), the result in q's dtype."""
    at = torch.promote_types(q.dtype, torch.float32)
    steps = torch.floor((pos.to(at) + 1.0) / config.floor_scale)  # (B|1, 1, T, 1)
    factor = torch.log1p(steps) * config.attn_scale + 1.0
    return (q.to(at) * factor).to(q.dtype)


class QKNorm(nn.Module):
    """The RMSNorm of q or k before RoPE: x / sqrt(mean(x²) + eps) · (offset + weight) over x's last axis.

    Computed in float32 at least (float64 stays float64), returned in x's dtype. weight (width,) starts
    at 1 - offset, so that offset + weight = 1.
    """

    def __init__(self, width: int, eps: float, offset: float, *, dtype=None, device=None):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((width,), 1.0 - offset, dtype=dtype, device=device))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}"

    def forward(self, x):
        at = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(at)
        rms = torch.sqrt(xf.square().mean(dim=-1, keepdim=True) + self.eps)
        return (xf / rms * (self.offset + self.weight.to(at))).to(x.dtype)


class MultiHeadAttention(nn.Module):
    """Classic multi-head attention: separate q/k/v/out projections with bias.

    forward(query [B, T, E], key [B, S, E], value [B, S, E], mask=None, need_weights=True)
      -> (output [B, T, E], weights [B, N, T, S] or None)
    With return_intermediates=True: (output, weights, mha_spec.Stages).

    mask is a keep-mask (0/False = masked out) of dtype bool, int or float, of shape
    [T, S], [B, T, S] or [B|1, N|1, T|1, S|1] (a key axis of 1: one flag per query row).
    masked_rows picks what a query that may attend to nothing returns: "nan" (classic),
    "zero" (SDPA) or "uniform" (flax). A float mask's values are checked in eager mode and
    under torch.func (vmap: all instances), not under torch.compile.
    need_weights=False takes the fused SDPA path and returns (output, None); a keep-mask
    equal to the causal triangle tril(ones(T, S)) runs there as SDPA's is_causal=True,
    with the same results, NaN placement and policy.
    Inputs must have the parameters' dtype (a floating dtype); T=0 or B=0 give empty
    outputs, S=0 is a ValueError.

    Structured masks (docs/semantics.md, "Packed sequences, sliding windows and causal
    alignment"), keyword-only, ANDed with each other and with mask=: is_causal=True keeps keys
    s <= a(t); window=w | (left, right) keeps a(t) - left <= s <= a(t) + right (None: unbounded);
    segment_ids [B, T] and key_segment_ids [B, S] (integers; the latter defaults to the former
    when T = S) keep equal ids; alignment "top-left" (a(t) = t) | "bottom-right" (t + S - T).
    They are built as a bool [B|1, 1, T, S] tensor from shapes alone (no graph break under
    torch.compile). is_causal alone with top-left alignment and no mask runs the fused path as
    SDPA's is_causal=True. `segment_positions(segment_ids)` gives RoPE positions per document.

    Incremental decoding (docs/semantics.md, "Decoding with a KV cache"): with
    cache=`KVCache` (from `init_cache`; a `StaticKVCache`, init_cache(..., static=True), is written in
    place, the same path otherwise: the cache decides how it writes), forward(x, x, x, cache=cache) is
    self-attention over T new tokens x [B, T, E] (key and value [B, S, E] with S = T) against the cache:
      -> (output [B, T, E], weights [B, N, T, C] or None, new cache)
    and with return_intermediates=True (output, weights, new cache, Stages). The new tokens'
    rotated keys and their values (K heads) go to each row's next T slots of the new cache;
    new token i of row b attends slots starts[b] <= s <= lengths[b] + i. RoPE positions
    default to `cache.positions(T)` (slot minus the row's left padding); positions= (T,) |
    (B, T) overrides them. mask=, key_positions= and the structured masks but chunk= with a cache are ValueErrors; a cache
    whose dtype is not the parameters' is a TypeError, one with other K, H or B a ValueError,
    and no room for T tokens in some row a ValueError (eager; not checked under torch.compile);
    T = 0 new tokens with a cache is a ValueError (nothing to write or attend).
    Stages with a cache: q, k, v, q_rot, k_rot are the NEW tokens' ((B, N, T, H) and
    (B, K, T, H)), scores and weights are over the cache's C slots (B, N, T, C).

    The layers after Llama (`mha_spec.AttentionConfig`, docs/semantics.md): head_dim=H (q_proj
    Linear(E, N·H), k/v Linear(E, K·H), out_proj Linear(N·H, E)); qk_norm "head" | "flat" (submodules
    q_norm, k_norm (`QKNorm`, weights (H,) or (N·H,)/(K·H,)), with qk_norm_eps, qk_norm_offset) on the
    projections before RoPE, "head" after the head split, "flat" before it; scale (default 1/√H);
    softcap=c (scores c·tanh(s/c) before the mask); sinks=True (Parameter sinks (N,), zeros: each row's
    softmax also holds its head's sink, a row that keeps no key then gets zero weights, whatever
    masked_rows says). Stages q_norm and k_norm (after the norm, before RoPE; None without qk_norm).
    RoPE as the models ship it (`mha_spec.rope`, `rotate`): rope_dim=R rotates the first R features of
    each head (the rest pass; Stages q_rot/k_rot keep all H); rope_scaling=`mha_spec.RopeScaling`
    (linear, llama3, yarn, longrope) scales the frequencies and cos/sin. LongRoPE takes its long factors
    when the call's largest position (over positions and key_positions, the whole batch; with a cache,
    the new tokens') + 1 passes original_max_position_embeddings: every token of the call, not the
    cached keys, which keep their rotation.
    Llama 4 (`mha_spec.AttentionConfig`): chunk=C keeps, besides the causal order, only the keys of the query's own
    chunk, a(t) // C == s // C (it implies is_causal; with a cache, the chunks of the cache's positions,
    slot - starts[b]: `KVCache.keep_mask`); qk_norm="l2" is a weightless
    x·rsqrt(mean(x²) + eps) of q and k AFTER RoPE (`l2_norm`; Stages q_rot/k_rot are after it, q_norm/k_norm
    None); attn_temperature_tuning (rope=None layers) multiplies q by log(floor((pos + 1) / floor_scale) + 1) ·
    attn_scale + 1 at positions= (default arange(T); with a cache `cache.positions(T)`) (`temperature`).
    Which kernel runs: need_weights=True is `attention_core` always; need_weights=False is SDPA (with
    scale=) unless the layer has softcap or sinks, which SDPA cannot take: then the fused path runs the
    materialised `attention_core` (no SDPA call, same results as need_weights=True). The cache path
    picks the same way.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, qkv_bias: bool = True, out_bias: bool = True,
                 rope: str | None = None, rope_theta: float = 10000.0, masked_rows: str = "nan",
                 qk_norm: str | None = None, qk_norm_eps: float = 1e-6, qk_norm_offset: float = 0.0,
                 scale: float | None = None, softcap: float | None = None, sinks: bool = False,
                 rope_dim: int | None = None, rope_scaling=None, attn_temperature_tuning: bool = False,
                 floor_scale: float = 8192.0, attn_scale: float = 0.1, dtype=None, device=None):
        super().__init__()
        self.config = AttentionConfig(embed_dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      qkv_bias=qkv_bias, out_bias=out_bias, rope=rope, rope_theta=rope_theta,
                                      masked_rows=masked_rows, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                                      qk_norm_offset=qk_norm_offset, scale=scale, softcap=softcap, sinks=sinks,
                                      rope_dim=rope_dim, rope_scaling=rope_scaling,
                                      attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale,
                                      attn_scale=attn_scale)
        self.head_dim = self.config.head_size
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (or None), got {dtype!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.masked_rows = masked_rows
        factory = {"dtype": dtype, "device": device}
        self.num_kv_heads = self.config.kv_heads
        q_width, kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, q_width, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_width, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_width, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(q_width, embed_dim, bias=out_bias, **factory)
        # Created after the projections: their random init draws what it always drew.
        if qk_norm in ("head", "flat"):  # "l2" has no weight (`l2_norm`)
            flat = qk_norm == "flat"
            norm = {"eps": qk_norm_eps, "offset": qk_norm_offset, **factory}
            self.q_norm = QKNorm(q_width if flat else self.head_dim, **norm)
            self.k_norm = QKNorm(kv_width if flat else self.head_dim, **norm)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, **factory))  # (N,)

    def extra_repr(self) -> str:
        c = self.config
        extra = "" if c.num_kv_heads is None else f", num_kv_heads={c.num_kv_heads}"
        if not c.qkv_bias:
            extra += ", qkv_bias=False"
        if not c.out_bias:
            extra += ", out_bias=False"
        if c.rope is not None:
            extra += f", rope={c.rope!r}, rope_theta={c.rope_theta}"
        if c.head_dim is not None:
            extra += f", head_dim={c.head_dim}"
        for name in ("qk_norm", "scale", "softcap"):
            if getattr(c, name) is not None:
                extra += f", {name}={getattr(c, name)!r}"
        if c.sinks:
            extra += ", sinks=True"
        if c.rope_dim is not None:
            extra += f", rope_dim={c.rope_dim}"
        if c.rope_scaling is not None:  # its RopeScaling.parse spelling
            extra += f", rope_scaling={str(c.rope_scaling)!r}"
        if c.attn_temperature_tuning:
            extra += f", attn_temperature_tuning=True, floor_scale={c.floor_scale}, attn_scale={c.attn_scale}"
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{extra}, masked_rows={self.masked_rows!r}"

    def _split_heads(self, x):
        # The head count comes from x's width, not num_heads: under a tensor-parallel plan
        # (ColwiseParallel projections) each rank holds only its share of the heads.
        B, L, width = x.shape
        return x.view(B, L, width // self.head_dim, self.head_dim).transpose(1, 2)  # (B, N, L, H)

    def project(self, query, key, value):
        """The projections split into heads, and q and k after the QK-norm (None without one):
        (q (B, N, T, H), k (B, K, S, H), v (B, K, S, H), q normed, k normed)."""
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)  # (B, L, n·H)
        norm = self.config.qk_norm
        if norm == "l2":  # after RoPE (`after_rope`), not here
            norm = None
        if norm == "flat":  # over each token's whole projection, before the head split
            return tuple(self._split_heads(x) for x in (q, k, v, self.q_norm(q), self.k_norm(k)))
        q, k, v = (self._split_heads(x) for x in (q, k, v))
        if norm is None:
            return q, k, v, None, None
        return q, k, v, self.q_norm(q), self.k_norm(k)

    def after_rope(self, q, k, q_pos):
        """Llama 4's steps between RoPE and the scores: the L2 QK-norm of q (B, N, T, H) and k (B, K, S, H)
        (qk_norm="l2"), then the NoPE layers' temperature of q at its positions q_pos (B|1, 1, T, 1)."""
        c = self.config
        if c.qk_norm == "l2":
            q, k = l2_norm(q, c.qk_norm_eps), l2_norm(k, c.qk_norm_eps)
        if c.attn_temperature_tuning:
            q = temperature(q, q_pos, c)
        return q, k

    def core_options(self) -> dict:
        """The attention cores' layer keywords: scale, softcap, sinks (the Parameter, or None)."""
        c = self.config
        return {"scale": c.scale, "softcap": c.softcap, "sinks": self.sinks if c.sinks else None}

    def _check_inputs(self, query, key, value):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        shapes = check_qkv_shapes(query.shape, key.shape, value.shape, self.embed_dim)
        param_dtype = self.q_proj.weight.dtype
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dtype != param_dtype:
                # No silent promotion: the caller converts the module or the inputs.
                raise TypeError(
                    f"{name} has dtype {x.dtype} but the module's parameters are {param_dtype}"
                )
        return shapes

    def init_cache(self, batch: int, capacity: int, starts=None, static: bool = False) -> KVCache:
        """An empty `KVCache` for this layer: K key/value heads of H, the parameters' dtype and device.
        starts (B,): the left-padding tokens each row's prompt begins with (default 0). static=True: a
        `StaticKVCache`, preallocated and written in place by every call (no copy of the cache per step; the
        cache a call was given is spent: its tensors are the returned cache's)."""
        if not isinstance(static, bool):
            raise TypeError(f"init_cache: static must be a bool, got {static!r}")
        w = self.k_proj.weight
        return (StaticKVCache if static else KVCache).empty(batch, capacity, self.num_kv_heads, self.head_dim,
                                                            dtype=w.dtype, device=w.device, starts=starts)

    def forward(self, query, key, value, mask=None, need_weights: bool = True, *, positions=None,
                key_positions=None, return_intermediates: bool = False, cache: KVCache | None = None,
                is_causal: bool = False, window=None, segment_ids=None, key_segment_ids=None,
                alignment: str = "top-left", chunk=None):
        if cache is not None:  # a chunk is the cache's too (Llama 4 decodes its chunked layers); the rest is refused
            Structure.refuse_with_cache(is_causal=is_causal, window=window, segment_ids=segment_ids,
                                        key_segment_ids=key_segment_ids, alignment=alignment)
            return self._forward_cached(query, key, value, cache, mask=mask, need_weights=need_weights,
                                        positions=positions, key_positions=key_positions,
                                        return_intermediates=return_intermediates, chunk=chunk)
        B, T, S = self._check_inputs(query, key, value)
        rope = self.config.rope
        _refuse_unread_positions(self.config, positions, key_positions)
        keep = None if mask is None else keep_mask_4d(mask, B, self.num_heads, T, S)
        structure = _structure(T, S, B, is_causal=is_causal, window=window, segment_ids=segment_ids,
                               key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk)
        # is_causal alone, top-left (the same as bottom-right when T = S), no mask: SDPA's own
        # is_causal on the fused path, without building or comparing a (T, S) triangle.
        options = self.core_options()
        materialised = options["softcap"] is not None or options["sinks"] is not None  # SDPA cannot take them
        causal = not need_weights and mask is None and structure.plain_causal and not materialised
        if not causal:
            built = _build_keep(structure, query.device)  # (B|1, 1, T, S) | None
            if built is not None:
                keep = built if keep is None else keep & built  # (B|1, N|1, T, S)

        q_in, k_in, v_in, q_norm, k_norm = self.project(query, key, value)  # (B, N, T, H), (B, K, S, H) x2, ...
        q, k, v = (q_in if q_norm is None else q_norm), (k_in if k_norm is None else k_norm), v_in
        q_pos = positions_4d(positions, B, T, "positions", q.device)  # (B|1, 1, T, 1)
        if rope is not None:
            k_pos = positions_4d(key_positions, B, S, "key_positions", k.device)  # (B|1, 1, S, 1)
            top = rope_max_position(self.config, q_pos, k_pos)  # LongRoPE: over queries and keys alike
            q, k = rotate(q, q_pos, self.config, top), rotate(k, k_pos, self.config, top)
        q, k = self.after_rope(q, k, q_pos)  # Llama 4: the L2 norm, the NoPE temperature
        # (B, N, T, H), (B, K, S, H); with qk_norm="l2" after the norm too (it follows RoPE)
        q_rot, k_rot = (q, k) if rope is not None else (None, None)
        group = q.shape[1] // k.shape[1]
        if group > 1 and need_weights:
            # Query head h uses key/value head h // group: repeat each head, never tile.
            # The fused path hands SDPA the K heads (enable_gqa) instead.
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = None
        if need_weights and return_intermediates:
            context, weights, scores = attention_core(q, k, v, keep, masked_rows=self.masked_rows, return_scores=True,
                                                      **options)
        elif need_weights:
            context, weights = attention_core(q, k, v, keep, masked_rows=self.masked_rows, **options)
        elif causal:
            context, weights = _fused_core(q, k, v, None, masked_rows=self.masked_rows, causal=True,
                                           scale=options["scale"]), None
        else:
            context, weights = fused_attention_core(q, k, v, keep, masked_rows=self.masked_rows, **options), None
        # (B, T, E), or this rank's N·H columns under tensor parallelism; no -1 (T or B may be 0).
        context = context.transpose(1, 2).reshape(B, T, context.shape[1] * self.head_dim)
        output = self.out_proj(context)
        if return_intermediates:
            return output, weights, Stages(q_in, k_in, v_in, scores, weights, context, output, q_rot, k_rot,
                                            q_norm, k_norm)
        return output, weights

    def _check_cache(self, cache, B: int, T: int, S: int, mask, key_positions) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a mha_torch.KVCache, got {type(cache).__name__}")
        if T != S:
            raise ValueError(f"with a cache, query, key and value are the same T new tokens: query has T={T}, "
                             f"key/value S={S}")
        if mask is not None:
            raise ValueError("mask= with a cache: the cache's keep-mask (starts[b] <= s <= lengths[b] + i) is the mask")
        if key_positions is not None:
            raise ValueError("key_positions= with a cache: the cached keys carry their positions; "
                             "positions= sets the new tokens' (keys and queries)")
        param_dtype = self.q_proj.weight.dtype
        if cache.k.dtype != param_dtype:
            raise TypeError(f"the cache holds {cache.k.dtype} but the module's parameters are {param_dtype}")
        if cache.k.shape[0] != B:
            raise ValueError(f"the cache {tuple(cache.k.shape)} (B, K, C, H) has B={cache.k.shape[0]} rows; "
                             f"the new tokens {B}")

    def _forward_cached(self, query, key, value, cache, *, mask, need_weights, positions, key_positions,
                        return_intermediates, chunk=None):
        """forward with a cache (see the class docstring): self-attention of T new tokens against it."""
        # Before the S = 0 check, whose words are about keys.
        refuse_no_new_tokens(**{n: getattr(x, "shape", ()) for n, x in (("query", query), ("key", key), ("value", value))})
        B, T, S = self._check_inputs(query, key, value)
        self._check_cache(cache, B, T, S, mask, key_positions)
        rope = self.config.rope
        if not self.config.uses_positions and positions is not None:
            raise ValueError("positions are given but rope=None (and no attn_temperature_tuning): they would be ignored")

        q_in, k_in, v_in, q_norm, k_norm = self.project(query, key, value)  # (B, N, T, H), (B, K, T, H) x2, ...
        # K from the projection's width, not num_kv_heads: a tensor-parallel rank holds its share.
        check_cache_shapes(cache.k.shape, cache.v.shape, cache.starts.shape, cache.lengths.shape, layout="BKCH",
                           kv_heads=k_in.shape[1], head_dim=self.head_dim)
        q, k = (q_in if q_norm is None else q_norm), (k_in if k_norm is None else k_norm)
        if self.config.uses_positions:
            pos = cache.positions(T) if positions is None else positions  # (B, T) | (T,)
            pos = positions_4d(pos, B, T, "positions", q.device)  # (B|1, 1, T, 1)
        if rope is not None:
            # LongRoPE: the new tokens' largest position; the cached keys keep the rotation they had.
            top = rope_max_position(self.config, pos)
            q, k = rotate(q, pos, self.config, top), rotate(k, pos, self.config, top)
        if self.config.uses_positions:
            q, k = self.after_rope(q, k, pos)  # Llama 4: the L2 norm (rope layers), the NoPE temperature
        q_rot, k_rot = (q, k) if rope is not None else (None, None)  # (B, N, T, H), (B, K, T, H)
        # The old cache's keep-mask: its lengths are where the new tokens went (a chunk: the cache's positions').
        keep = cache.keep_mask(T) if chunk is None else cache.keep_mask(T, chunk=chunk)  # (B, 1, T, C)
        new_cache = cache.write(k, v_in)
        k_all, v_all = new_cache.k, new_cache.v  # (B, K, C, H)
        group = q.shape[1] // k_all.shape[1]
        if group > 1 and need_weights:
            # Query head h uses key/value head h // group; the fused path passes the K heads (enable_gqa).
            k_all, v_all = k_all.repeat_interleave(group, dim=1), v_all.repeat_interleave(group, dim=1)  # (B, N, C, H)
        scores, options = None, self.core_options()
        if need_weights and return_intermediates:
            context, weights, scores = attention_core(q, k_all, v_all, keep, masked_rows=self.masked_rows,
                                                      return_scores=True, **options)
        elif need_weights:
            context, weights = attention_core(q, k_all, v_all, keep, masked_rows=self.masked_rows, **options)
        else:
            context, weights = fused_attention_core(q, k_all, v_all, keep, masked_rows=self.masked_rows,
                                                    **options), None
        context = context.transpose(1, 2).reshape(B, T, context.shape[1] * self.head_dim)  # (B, T, N·H)
        output = self.out_proj(context)
        if return_intermediates:
            stages = Stages(q_in, k_in, v_in, scores, weights, context, output, q_rot, k_rot, q_norm, k_norm)
            return output, weights, new_cache, stages
        return output, weights, new_cache
