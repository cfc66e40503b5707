"""Multi-head attention in Flax NNX, with the semantics of `mha_torch`.

Internal layout BTNH (legend in `mha_spec`); einsum strings use the legend verbatim, with
K key/value heads and G = N // K query heads per key/value head: query head h = j·G + g
reads key/value head j = h // G.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.chunked import (accumulation_dtype, band_keep, chunked_attention, fill_masked_rows, fold_scale, keep_4d,
                             mean_over_keys)
from mha_jax import kernels, pallas
from mha_jax.kv_cache import KVCache
from mha_spec import (MASKED_ROWS_POLICIES, AttentionConfig, check_cache_shapes, check_mask_values, check_positions,
                      check_qkv_shapes, mask_shape_4d, refuse_no_new_tokens, RopeScaling, Stages, Structure)
from mha_spec.structure import check_segment_shape

# Stages (framework-free, in mha_spec) as a pytree, so return_intermediates works under jit.
jax.tree_util.register_dataclass(Stages, data_fields=[f.name for f in dataclasses.fields(Stages)], meta_fields=[])
_STAGE_FIELDS = frozenset(f.name for f in dataclasses.fields(Stages))


def torch_linear_init(fan_in: int):
    """U(-1/√fan_in, 1/√fan_in): torch.nn.Linear's default, for weights and biases alike."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def keep_mask_of(mask, B: int, N: int, T: int, S: int):
    """Any bool/int/float keep-mask (0 = masked) -> bool (B|1, N|1, T|1, S|1)."""
    if not isinstance(mask, (jax.Array, np.ndarray)):
        raise TypeError(f"mask must be a jax or numpy array, got {type(mask).__name__}")
    kind = np.dtype(mask.dtype).kind
    if kind not in "biuf" and mask.dtype != jnp.bfloat16:
        raise TypeError(f"mask must be bool, int or float, got {mask.dtype}")
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    if kind == "f" or mask.dtype == jnp.bfloat16:
        _check_concrete_mask_values(mask)
    mask = jnp.asarray(mask)
    keep = mask if mask.dtype == jnp.bool_ else mask != 0
    return keep.reshape(shape4)


def _check_concrete_mask_values(mask):
    """NaN or negative values in a float keep-mask are errors, where the values are known.

    Under jit (a tracer) nothing is checked: a value check there would need a host round trip
    (or checkify); the README says so.
    """
    if isinstance(mask, jax.core.Tracer):
        return
    mask = np.asarray(mask).astype(np.float32)  # bfloat16/float16 too; NaN and sign survive
    check_mask_values(mask.shape, bool(np.isnan(mask).any()), bool((mask < 0).any()))


def check_dtype(name: str, dtype) -> None:
    """A computation or parameter dtype must be floating, and float64 needs x64 (no silent float32)."""
    if dtype is None:
        return
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dt}")
    if dt == jnp.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{name}=float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")


def _row_attends(keep):
    return keep.any(axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1)


def _groups(q, k, v) -> int:
    """G = N // K: query heads per key/value head; a ValueError naming the shapes unless K divides N."""
    N, K = q.shape[2], k.shape[2]
    if K == 0 or N % K or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"key/value heads must divide the query heads and key and value must have one shape: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (B, L, heads, H)")
    return N // K


def attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None, return_scores=False, scale=None,
                   softcap=None, sinks=None):
    """softmax(Q Kᵀ / √H) V with materialised weights.

    q (B, T, N, H), k and v (B, S, K, H) with K dividing N (query head h reads key/value
    head h // (N/K); the grouped einsums below never repeat K or V), keep bool [T, S],
    [B, T, S] (a batch axis, as in the modules) or (B|1, N|1, T|1, S|1), or None.
    Returns context (B, T, N, H) and weights (B, N, T, S), both in q's dtype, and with
    return_scores also the scaled scores (B, N, T, S), -inf where masked.
    Scores and softmax run in float32 for 16-bit inputs (float64 stays float64).
    scale replaces 1/√H; softcap caps the scaled scores to softcap·tanh(s / softcap) before the mask;
    sinks (N,) joins each row's softmax as its head's extra logit, dropped after (`_sink_softmax`).
    """
    dtype = q.dtype
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = _groups(q, k, v)
    keep = keep_4d(keep, B, N, T, S)  # (B|1, N|1, T|1, S|1)
    acc = accumulation_dtype(dtype)
    q, scores_scale = fold_scale(q, scale)
    if G == 1:
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=acc, precision=precision)
    else:
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q.reshape(B, T, K, G, H), k, preferred_element_type=acc,
                            precision=precision).reshape(B, N, T, S)
    if scores_scale != 1.0:
        scores = scores * scores_scale
    if softcap is not None:  # before the mask: the capped logits are what is masked
        scores = softcap * jnp.tanh(scores / softcap)
    if keep is not None:
        scores = jnp.where(keep, scores, -jnp.inf)
    returned_scores = scores  # before the row fix below
    if sinks is not None:
        weights = _sink_softmax(scores, sinks).astype(dtype)
    else:
        weights = softmax_by_policy(scores, keep, masked_rows, S).astype(dtype)
    if G == 1:
        context = jnp.einsum("BNTS,BSNH->BTNH", weights, v, precision=precision, preferred_element_type=acc)
    else:
        context = jnp.einsum("BKGTS,BSKH->BTKGH", weights.reshape(B, K, G, T, S), v, precision=precision,
                             preferred_element_type=acc).reshape(B, T, N, H)
    context = context.astype(dtype)
    if return_scores:
        return context, weights, returned_scores
    return context, weights


def softmax_by_policy(scores, keep, masked_rows: str, S: int):
    """softmax over the keys of scores (B, N, T, S) (-inf where masked); a row that keeps no key follows
    masked_rows."""
    if keep is None:
        return jax.nn.softmax(scores, axis=-1)
    row_any = _row_attends(keep)
    # A fully masked row gets all-zero scores: its softmax is finite (uniform),
    # so no NaN reaches the backward pass; the policy then sets its value.
    weights = jax.nn.softmax(jnp.where(row_any, scores, 0.0), axis=-1)
    return fill_masked_rows(weights, row_any, masked_rows, 1.0 / S)


def _sink_softmax(scores, sinks):
    """exp(s - m) / (sum exp(s - m) + exp(sink - m)), m = max(max s, sink): scores (B, N, T, S) (-inf where
    masked) with sinks (N,) as one more column per row, dropped after; a row that keeps no key is 0."""
    sink = sinks.astype(scores.dtype).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
    # The max only shifts the exponents (the weights do not depend on it), so no gradient flows through it.
    top = jax.lax.stop_gradient(jnp.maximum(scores.max(axis=-1, keepdims=True), sink))  # (B, N, T, 1)
    e = jnp.exp(scores - top)
    return e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))


def _chunked_structured(q, k, v, keep, structure, choice, masked_rows, precision, logits: dict):
    """The chunked kernel with the causal triangle and the window as structure (no (T, S) mask;
    its cost follows the blocks they touch), segment ids as a mask ANDed with keep; logits: scale,
    softcap and sinks as `chunked_attention` takes them."""
    segments = _build_keep(structure.segments_only())  # (B, 1, T, S) | None
    if segments is not None:
        keep = segments if keep is None else keep & segments
    return chunked_attention(q, k, v, keep, masked_rows=masked_rows, q_chunk=choice.q_chunk, k_chunk=choice.k_chunk,
                             head_chunk=choice.head_chunk, precision=precision, structure=structure.band_only(),
                             **logits)


def fused_attention_core(q, k, v, keep=None, *, masked_rows="nan", precision=None, is_causal: bool = False,
                         window=None, segment_ids=None, key_segment_ids=None, alignment: str = "top-left",
                         scale=None, softcap=None, sinks=None, chunk=None):
    """The same context as `attention_core`, without returning (or, when large, building) weights.

    q (B, T, N, H), k and v (B, S, K, H) with K dividing N; keep as for `attention_core`
    (bool [T, S], [B, T, S] or (B|1, N|1, T|1, S|1)), the same on every kernel. The structured
    keywords are the module's (is_causal, window, segment_ids (B, T), key_segment_ids (B, S),
    alignment; `structured_keep`), ANDed with keep: the kernel choice sees their structure
    (`kernels.MASK_STRUCTURES`), so a causal triangle or segment ids without keep can run a
    Pallas flash kernel that builds no (T, S) mask. The kernel and its chunk sizes come from
    `mha_jax.kernels.fused_choice` (measured per processor, a rule on a GPU or TPU; it also says
    why, for a benchmark row): our einsum core, the chunked kernel (flash backward, O(T + S)
    memory), jax.nn.dot_product_attention (XLA, or cuDNN on a CUDA GPU for 16-bit), or jax's
    Pallas flash kernels on a GPU or TPU (`mha_jax.pallas`). None of them repeats K or V to N
    heads: the einsum core and dot_product_attention contract per group, the chunked kernel
    stacks a group's query heads along its query axis, the Pallas kernels run once per group.
    Whichever runs, fully masked rows follow `masked_rows` (mean V of the row's own key/value
    head) and which rows those are comes from the mask alone, so NaN inputs give NaN outputs.
    S = 0 is a ValueError; T = 0 gives an empty context.
    scale, softcap and sinks (N,) as `attention_core` takes them: the choice hears which are given
    (`kernels.score_mods_of`) and keeps to the kernels that take them (the einsum core and the
    chunked kernel take all three, dot_product_attention the scale, the Pallas kernels none).
    chunk C (Llama 4's chunked attention; implies is_causal) is no band: the kernels take it as a dense
    keep-mask (`Structure.segments_only`), never as a structure they could skip blocks by.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    if S == 0:
        raise ValueError(f"fused_attention_core needs at least one key: got key shape {k.shape} (S=0)")
    _groups(q, k, v)
    structure = _structure(T, S, B, is_causal=is_causal, window=window, segment_ids=segment_ids,
                           key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk)
    keep = keep_4d(keep, B, N, T, S)  # (B|1, N|1, T|1, S|1): what every kernel below indexes
    kind = _mask_kind(keep, structure)
    logits = {"scale": scale, "softcap": softcap, "sinks": sinks}
    choice = _fused_choice(q, k, kind, precision, kernels.score_mods_of(**logits))
    if choice.kernel in kernels.PALLAS_KERNELS:
        return pallas.flash(choice.kernel, q, k, v, is_causal=structure.is_causal, segment_ids=structure.segment_ids,
                            key_segment_ids=None if structure.shared_ids else structure.key_segment_ids,
                            masked_rows=masked_rows, precision=precision)
    if choice.kernel == kernels.CHUNKED:
        return _chunked_structured(q, k, v, keep, structure, choice, masked_rows, precision, logits)
    built = _build_keep(structure)  # (B|1, 1, T, S) | None
    if built is not None:
        keep = built if keep is None else keep & built  # (B|1, N|1, T, S)
    if choice.kernel == kernels.EINSUM:
        return attention_core(q, k, v, keep, masked_rows=masked_rows, precision=precision, **logits)[0]
    return _dot_product_attention(q, k, v, keep, choice, masked_rows, scale)


def _fused_choice(q, k, kind: str, precision, mods: tuple[str, ...]) -> kernels.Choice:
    """`kernels.fused_choice` for q (B, T, N, H) against k (B, S, K, H) with a mask of structure `kind`
    and the score mods `mods`; a ValueError when the kernel chosen (forced past the rule) cannot express
    the mask or compute the mods."""
    B, T, N, H = q.shape
    S = k.shape[1]
    choice = kernels.fused_choice(B, N, T, S, H, q.dtype, has_mask=kind != kernels.MASK_NONE, mask_kind=kind,
                                  precision=precision, kv_heads=k.shape[2], **({"score_mods": mods} if mods else {}))
    untaken = kernels.untaken_score_mods(choice.kernel, mods)
    refusal = f"it cannot take {', '.join(untaken)}" if untaken else None
    if refusal is None and choice.kernel in kernels.PALLAS_KERNELS:
        refusal = kernels.pallas_refusal(choice.kernel, dtype=q.dtype, T=T, S=S, H=H, mask_kind=kind, precision=precision)
    if refusal is not None:  # a kernel forced past the rule would drop what it cannot compute
        raise ValueError(f"{choice.kernel} was chosen for q {tuple(q.shape)}, k {tuple(k.shape)}, but {refusal}")
    return choice


def _dot_product_attention(q, k, v, keep, choice, masked_rows: str, scale):
    """jax.nn.dot_product_attention as the dpa-* kernel `choice` names, with our masked-row policy: the context
    (B, T, N, H). It takes no precision argument (the global default applies) and K key/value heads dividing N."""
    G = q.shape[2] // k.shape[2]
    implementation = kernels.DPA_IMPLEMENTATIONS[choice.kernel]
    context = jax.nn.dot_product_attention(q, k, v, mask=keep, implementation=implementation,
                                           scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)  # (B, T, N, H)
    if keep is not None:
        # jax gives fully masked rows uniform weights; apply our policy on (B, T, N, H).
        row_any = jnp.transpose(_row_attends(keep), (0, 2, 1, 3))  # (B|1, T|1, N|1, 1)
        mean_v = jnp.repeat(mean_over_keys(v), G, axis=2) if G > 1 else mean_over_keys(v)  # (B, 1, N, H)
        context = fill_masked_rows(context, row_any, masked_rows, mean_v)
    return context


def _mask_kind(keep, structure) -> str:
    """The mask's structure as `kernels.fused_choice` takes it, from what the caller asked (a
    keep-mask given as data is MASK_DENSE whatever it holds)."""
    if (keep is not None or structure.window is not None or (structure.is_causal and structure.offset != 0)
            or structure.chunk is not None):
        return kernels.MASK_DENSE
    if structure.segment_ids is None:
        return kernels.MASK_CAUSAL if structure.is_causal else kernels.MASK_NONE
    if structure.shared_ids:  # key_segment_ids defaulted to segment_ids
        return kernels.MASK_CAUSAL_SEGMENTS if structure.is_causal else kernels.MASK_SEGMENTS
    return kernels.MASK_CAUSAL_KEY_SEGMENTS if structure.is_causal else kernels.MASK_KEY_SEGMENTS


def cached_attention(q, k_new, v_new, cache: KVCache, *, masked_rows: str = "nan", need_weights: bool = False,
                     precision=None, return_scores: bool = False, scale=None, softcap=None, sinks=None, chunk=None):
    """Attention of T new tokens over a cache that they are written into first.

    q (B, T, N, H), k_new and v_new (B, T, K, H) (keys already rotated), cache holding
    (B, C, K, H) with K dividing N, all of one dtype. New token i of row b is written to slot
    lengths[b] + i and attends the slots starts[b] <= s <= lengths[b] + i of the written cache.
    Returns (context (B, T, N, H), weights (B, N, T, C) or None, new_cache); with return_scores
    also the scaled scores (B, N, T, C), -inf where masked (None on the fused path).
    need_weights=True runs `attention_core`, False `fused_attention_core` (whichever kernel it
    picks). T = 0 and T > C are ValueErrors (under jit too). A row without room is a ValueError
    where the lengths are known; under jit its context, weights and scores are NaN and the new
    cache leaves it as it was. scale, softcap and sinks (N,) as `attention_core` takes them. chunk C (Llama 4's
    chunked layers, a Python int): only the slots of the new token's own chunk of the row's positions
    (`KVCache.keep_mask`).
    """
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a mha_jax.kv_cache.KVCache, got {type(cache).__name__}")
    if masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
    qs, ks, vs, cs = (tuple(x.shape) for x in (q, k_new, v_new, cache.k))
    if (len(qs) != 4 or ks != vs or len(ks) != 4 or ks[:2] != qs[:2] or ks[3] != qs[3]
            or (ks[0], ks[2], ks[3]) != (cs[0], cs[2], cs[3]) or ks[2] == 0 or qs[2] % ks[2]):
        raise ValueError(f"q {qs} (B, T, N, H), new keys {ks} and values {vs} (B, T, K, H) and the cache {cs} "
                         f"(B, C, K, H) do not fit together (K must divide N)")
    for name, x in (("q", q), ("new keys", k_new), ("new values", v_new)):
        if x.dtype != cache.k.dtype:
            raise TypeError(f"{name} have dtype {x.dtype}, the cache holds {cache.k.dtype}")
    refuse_no_new_tokens(q=qs, k=ks, v=vs)
    T = qs[1]
    fits = cache.fits(T)  # (B,); a ValueError here where the lengths are known
    # (B, 1, T, C): the old lengths say where the new tokens go
    keep = cache.keep_mask(T) if chunk is None else cache.keep_mask(T, chunk=chunk)
    new_cache = cache.write(k_new, v_new)
    kw = {"masked_rows": masked_rows, "precision": precision, "scale": scale, "softcap": softcap, "sinks": sinks}
    weights = scores = None
    if need_weights:
        context, weights, scores = attention_core(q, new_cache.k, new_cache.v, keep, return_scores=True, **kw)
    else:
        context = fused_attention_core(q, new_cache.k, new_cache.v, keep, **kw)

    # A row without room was not written: its numbers would be about the wrong slots.
    def nan_where_full(x):  # x (B, ...)
        return None if x is None else jnp.where(fits.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan)

    context, weights, scores = (nan_where_full(x) for x in (context, weights, scores))
    if return_scores:
        return context, weights, new_cache, scores
    return context, weights, new_cache


def positions_arg(pos, batch: int, length: int, name: str):
    """Integer positions (L,) | (B, L) as given (None stays None); TypeError/ValueError naming them."""
    if pos is None:
        return None
    if not isinstance(pos, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax or numpy array of integers, got {type(pos).__name__}")
    if np.dtype(pos.dtype).kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {pos.dtype}")
    check_positions(pos.shape, batch, length, name)
    return pos


def _lead(pos) -> int:
    """The batch axis of (L,) | (B, L) positions as (B|1, L): from the shape, since with L = 0 a
    reshape cannot infer it."""
    return pos.shape[0] if pos.ndim == 2 else 1


def _positions_max(pos, length: int):
    """The largest of (L,) | (B, L) positions (None: arange(L)) as a Python int, or a traced scalar;
    None when there are none (L = 0 or B = 0)."""
    if length == 0 or (pos is not None and pos.size == 0):
        return None
    if pos is None:
        return length - 1
    if isinstance(pos, jax.core.Tracer):
        return jnp.max(pos)
    return int(np.max(np.asarray(pos)))


def rope_uses_long(config: AttentionConfig, *calls):
    """LongRoPE's switch for one call (`mha_spec.RopeScaling.uses_long`): whether the largest position of
    the call, over every (positions, length) pair in `calls` (positions (L,) | (B, L) or None for
    arange(L)) and the whole batch, passes original_max_position_embeddings.

    False when the layer's frequencies do not switch; a Python bool when every position is known
    here, else a traced bool scalar (a select under jit, never a branch on data)."""
    scaling = config.rope_scaling
    if scaling is None or not scaling.switches:
        return False
    maxima = [m for m in (_positions_max(pos, length) for pos, length in calls) if m is not None]
    if not maxima:  # no positions at all: nothing rotates, either table will do
        return False
    if all(isinstance(m, int) for m in maxima):
        return scaling.uses_long(max(maxima))
    top = jnp.max(jnp.stack([jnp.asarray(m) for m in maxima]))
    return top + 1 > scaling.original_max_position_embeddings  # uses_long, traced


def _angle_cos_sin(inv_freq: np.ndarray, scale: float, pos, length: int, acc):
    """cos and sin of position · inv_freq times `scale`, (B|1, L, 1, R/2) in acc; float64 angles where
    they exist (on the device with x64, on the host for known positions), else float32 ones."""
    if jax.config.jax_enable_x64:
        p = jnp.arange(length) if pos is None else jnp.asarray(pos)
        angles = p.astype(jnp.float64).reshape(_lead(p), length, 1, 1) * jnp.asarray(inv_freq)
        return (jnp.cos(angles) * scale).astype(acc), (jnp.sin(angles) * scale).astype(acc)
    if pos is None or not isinstance(pos, jax.core.Tracer):
        p = np.arange(length) if pos is None else np.asarray(pos)
        angles = p.astype(np.float64).reshape(_lead(p), length, 1, 1) * inv_freq
        return jnp.asarray(np.cos(angles) * scale, acc), jnp.asarray(np.sin(angles) * scale, acc)
    angles = pos.astype(jnp.float32).reshape(_lead(pos), length, 1, 1) * jnp.asarray(inv_freq, jnp.float32)
    return (jnp.cos(angles) * np.float32(scale)).astype(acc), (jnp.sin(angles) * np.float32(scale)).astype(acc)


def rope_cos_sin(config: AttentionConfig, pos, length: int, acc, long=False):
    """RoPE's cos and sin for the layer `config` at positions (L,) | (B, L) (None: arange(L)):
    (B|1, L, 1, R/2) in the accumulation dtype `acc`, R = `config.rotary_dim`.

    The frequencies are `config.rope_frequencies(long)` (float64 on the host, never recomputed), cos
    and sin are multiplied by `config.rope_scale`. The angles and their cos/sin are float64 where that
    exists: on the device with x64, on the host when the positions are known; only traced positions
    without x64 take float32 angles (an angle error up to |angle|·2⁻²⁴). `long` is LongRoPE's switch
    (`rope_uses_long`): a Python bool picks one table; a traced bool selects between both.
    """
    scale = config.rope_scale

    def table(use_long: bool):
        return _angle_cos_sin(np.asarray(config.rope_frequencies(use_long), np.float64), scale, pos, length, acc)

    if isinstance(long, (bool, np.bool_)):
        return table(bool(long))
    (cos_l, sin_l), (cos_s, sin_s) = table(True), table(False)
    return jnp.where(long, cos_l, cos_s), jnp.where(long, sin_l, sin_s)


def rotate(x, cos, sin, convention: str):
    """RoPE: rotate the first R = 2·cos.shape[-1] features of each head of x (B, L, n, H) by the angles
    whose cos/sin (B|1, L, 1, R/2) are given; features R..H-1 pass through unchanged.

    Within the rotated part "half" pairs feature i with i + R/2, "interleaved" 2i with 2i + 1. The
    rotation runs in cos's dtype (the accumulation dtype); the result is in x's dtype.
    """
    H, R = x.shape[-1], 2 * cos.shape[-1]
    if R > H:
        raise ValueError(f"RoPE tables for {R} features, the heads of x {tuple(x.shape)} have {H}")
    xa = x[..., :R].astype(cos.dtype)  # (B, L, n, R)
    if convention == "half":
        x1, x2 = xa[..., : R // 2], xa[..., R // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xa[..., 0::2], xa[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xa.shape)
    out = out.astype(x.dtype)
    return out if R == H else jnp.concatenate([out, x[..., R:]], axis=-1)  # (B, L, n, H)


def _integer_array(x, name: str):
    """Segment ids as `Structure.of` checks them in JAX: a jax or numpy array of integers (TypeError
    naming it). Only the dtype is read, so they may be traced."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax or numpy array of integers, got {type(x).__name__}")
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {x.dtype}")
    return x


def _narrows(x) -> bool:
    """Whether jnp.asarray would narrow these host ids into other values: 64-bit integers without x64
    become 32-bit, so ids 7 and 2**32 + 7 would become one document."""
    if jax.config.jax_enable_x64 or not isinstance(x, np.ndarray) or x.dtype.itemsize <= 4 or x.size == 0:
        return False
    info = np.iinfo(np.int32 if x.dtype.kind == "i" else np.uint32)
    return bool(x.min() < info.min or x.max() > info.max)


def _segment_ids_to_device(*ids):
    """The segment ids as jax arrays with every equality kept: host ids that 32 bits cannot hold (no
    x64) are renumbered together (only equal ids and runs of them mean anything), never narrowed."""
    present = [x for x in ids if x is not None]
    if not any(_narrows(x) for x in present):
        return tuple(None if x is None else jnp.asarray(x) for x in ids)
    traced = [x for x in present if not isinstance(x, np.ndarray)]
    if traced:
        raise ValueError("segment_ids hold 64-bit ids beyond int32's range and JAX runs without x64: with the other "
                         "side's ids a jax array they cannot be renumbered together; pass both as numpy arrays, "
                         "ids that fit in int32, or enable x64")
    _, inverse = np.unique(np.concatenate([x.ravel() for x in present]), return_inverse=True)
    out, at = [], 0
    for x in ids:
        if x is not None:
            out.append(jnp.asarray(inverse[at:at + x.size].reshape(x.shape).astype(np.int32)))
            at += x.size
        else:
            out.append(None)
    return tuple(out)


def _structure(T: int, S: int, batch: int | None, **keywords) -> Structure:
    """The structured keywords checked (`mha_spec.Structure.of`, from shapes and dtypes alone), the
    segment ids as jax arrays (`_segment_ids_to_device`)."""
    structure = Structure.of(T, S, batch=batch, ids=_integer_array, **keywords)
    if structure.segment_ids is None:
        return structure
    shared = structure.shared_ids
    q_seg, k_seg = _segment_ids_to_device(structure.segment_ids, None if shared else structure.key_segment_ids)
    return dataclasses.replace(structure, segment_ids=q_seg, key_segment_ids=q_seg if shared else k_seg)


def _build_keep(structure: Structure):
    """bool (B|1, 1, T, S) of a `mha_spec.Structure`, or None when it asks for nothing."""
    band = structure.band()
    keep = None if band is None else band_keep(structure.T, structure.S, band)  # (1, 1, T, S)
    if structure.chunk is not None:  # not a band: its causal (and window) band AND a(t) // C == s // C
        C, T, S = structure.chunk, structure.T, structure.S
        a = jnp.arange(T)[:, None] + structure.offset  # (T, 1)
        same_chunk = (a // C == jnp.arange(S)[None, :] // C)[None, None]  # (1, 1, T, S)
        keep = band_keep(T, S, dataclasses.replace(structure, chunk=None).band()) & same_chunk
    if structure.segment_ids is not None:
        same = structure.segment_ids[:, None, :, None] == structure.key_segment_ids[:, None, None, :]  # (B, 1, T, S)
        keep = same if keep is None else keep & same
    return keep


def structured_keep(T: int, S: int, *, is_causal: bool = False, window=None, segment_ids=None,
                    key_segment_ids=None, alignment: str = "top-left", chunk=None):
    """The keep-mask of the structured keywords (docs/semantics.md, "Packed sequences, sliding
    windows and causal alignment"), as `parity.reference.structured_keep` defines it: bool
    (B|1, 1, T, S), or None when nothing is asked; jit-safe (segment ids may be traced).
    Query t sits at key a(t) = t (top-left) or t + S - T (bottom-right); is_causal keeps
    s <= a(t); window (left, right) keeps a(t) - left <= s <= a(t) + right (an int w is (w, w),
    a side of None is unbounded); segment_ids (B, T) and key_segment_ids (B, S) keep equal ids
    (key_segment_ids defaults to segment_ids when T = S); chunk C (Llama 4) keeps a(t) // C == s // C
    and implies is_causal."""
    return _build_keep(_structure(T, S, None, is_causal=is_causal, window=window, segment_ids=segment_ids,
                                  key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk))


def segment_positions(segment_ids):
    """(B, L) positions that restart at 0 with each document (a run of equal ids), as
    `parity.reference.segment_positions`: a token's index minus where its run began (the
    cumulative max of the run starts' indices); jit-safe. Integers of jnp's default int dtype
    (int64 with x64, else int32). For RoPE's positions= on packed rows."""
    check_segment_shape(_integer_array(segment_ids, "segment_ids").shape, "segment_ids", None, None, "L")
    (seg,) = _segment_ids_to_device(segment_ids)
    B, L = seg.shape
    idx = jnp.broadcast_to(jnp.arange(L), (B, L))  # (B, L)
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)  # (B, L): the previous token's id (itself at 0)
    starts = (idx == 0) | (seg != prev)
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)  # (B, L): where each run began
    return idx - first


def l2_norm(x, eps: float):
    """Llama 4's weightless L2Norm over x's last axis: x · rsqrt(mean(x²) + eps), in float32 at least (float64
    stays float64), the result in x's dtype (qk_norm="l2", after RoPE)."""
    at = jnp.promote_types(x.dtype, jnp.float32)
    xa = x.astype(at)
    return (xa * jax.lax.rsqrt(jnp.mean(xa * xa, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature(q, pos, config: AttentionConfig):
    """Llama 4's NoPE-layer temperature: q (B, T, N, H) times log(floor((pos + 1) / floor_scale) + 1) · attn_scale
    + 1 at positions pos (T,) | (B, T) (None: arange(T)); in float32 at least (float64 with x64 for float64
    inputs), the result in q's dtype."""
    at = jnp.promote_types(q.dtype, jnp.float32)
    T = q.shape[1]
    p = jnp.arange(T) if pos is None else jnp.asarray(pos)
    steps = jnp.floor((p.astype(at) + 1.0) / config.floor_scale).reshape(_lead(p), T, 1, 1)  # (B|1, T, 1, 1)
    factor = jnp.log1p(steps) * config.attn_scale + 1.0
    return (q.astype(at) * factor).astype(q.dtype)


def _after_rope(q, k, pos, config: AttentionConfig):
    """Llama 4's steps between RoPE and the scores: the L2 QK-norm of q (B, T, N, H) and k (B, S, K, H), then the
    NoPE temperature of q at its positions pos (T,) | (B, T) | None."""
    if config.qk_norm == "l2":
        q, k = l2_norm(q, config.qk_norm_eps), l2_norm(k, config.qk_norm_eps)
    if config.attn_temperature_tuning:
        q = temperature(q, pos, config)
    return q, k


class QKNorm(nnx.Module):
    """The RMSNorm of q or k before RoPE (`mha_spec.AttentionConfig.qk_norm`): `weight` (H,) for "head"
    (each head's H features) or (n·H,) for "flat" (the whole projection), initialised to 1 - offset.

    y = x / sqrt(mean(x²) + eps) · (offset + weight) over the last axis, computed in float32 at
    least (float64 stays float64), the result in x's dtype; the weight is first cast to x's dtype."""

    def __init__(self, size: int, *, eps: float, offset: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.full((size,), 1.0 - offset, param_dtype))
        self.eps = float(eps)
        self.offset = float(offset)

    def __call__(self, x):
        at = jnp.promote_types(x.dtype, jnp.float32)
        xa = x.astype(at)
        rms = jnp.sqrt(jnp.mean(xa * xa, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(x.dtype).astype(at) + self.offset  # (size,)
        return ((xa / rms) * w).astype(x.dtype)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention in Flax NNX: q/k/v/out projections, optionally grouped, rotary, bias-free.

    __call__(query [B, T, E], key [B, S, E], value [B, S, E], mask=None, need_weights=True,
             *, positions=None, key_positions=None, return_intermediates=False, cache=None)
      -> (output [B, T, E], weights [B, N, T, S] or None)
    With return_intermediates=True: (output, weights, mha_spec.Stages); with a cache, the new
    cache after the weights (below).

    Same semantics as `mha_torch.MultiHeadAttention`: keep-mask (0 = masked) of
    dtype bool, int or float and shape [T, S], [B, T, S] or [B|1, N|1, T, S];
    masked_rows "nan" | "zero" | "uniform". The layer is an `mha_spec.AttentionConfig`
    (`self.config`): num_kv_heads K dividing N (None: N; 1: multi-query), the k/v
    projections E -> K·H and query head h reading key/value head h // (N/K); qkv_bias and
    out_bias; rope None | "half" | "interleaved" with rope_theta, rotating q and k after the
    head split at integer `positions` (T,) | (B, T) and `key_positions` (S,) | (B, S)
    (default arange; positions without rope are a ValueError); rope_dim R rotates the first R
    features of each head only (None: all H), rope_scaling a `mha_spec.RopeScaling` (linear,
    llama3, yarn, longrope: the frequencies and the cos/sin factor of `mha_spec.rope`; LongRoPE's
    long factors when the call's largest position, over queries and keys or with a cache over the
    new tokens, passes original_max_position_embeddings, `rope_uses_long`). The layers after Llama, as
    `mha_spec.AttentionConfig` defines them: head_dim H (None: E/N; q_proj E -> N·H, out_proj
    N·H -> E); qk_norm None | "head" | "flat" with qk_norm_eps and qk_norm_offset, an RMSNorm
    (`QKNorm`: attributes `q_norm`, `k_norm`, each with a `weight` initialised to 1 - offset) of
    q and k before RoPE; scale (None: H**-0.5); softcap, the scaled logits capped to
    softcap·tanh(s / softcap) before the mask; sinks=True, a parameter `sinks` (N,) (zeros)
    whose logit joins each row's softmax (a row that keeps no key is then 0, whatever
    masked_rows says). Every path takes them: the weights path, the fused path (the kernel
    choice keeps to kernels that compute them, `kernels.score_mods_of`) and the cache.
    Parameters are stored in
    `param_dtype`, kernels (in, out) as in nnx.Linear. `dtype` is the computation dtype; None
    means the parameters' dtype. Inputs must have the computation dtype (a mismatch is a
    TypeError, as in torch), and outputs have it. T=0 or B=0 give empty outputs, S=0 is a
    ValueError.

    Structured masks (docs/semantics.md, "Packed sequences, sliding windows and causal
    alignment"), keyword-only and as in torch, ANDed with each other and with mask=:
    is_causal=True keeps keys s <= a(t); window=w | (left, right) keeps
    a(t) - left <= s <= a(t) + right (None: unbounded; Python ints); segment_ids [B, T] and
    key_segment_ids [B, S] (integers, may be traced; the latter defaults to the former when
    T = S) keep equal ids; alignment "top-left" (a(t) = t) | "bottom-right" (t + S - T). They
    are built as a bool [B|1, 1, T, S] keep-mask inside the program and go through the same
    kernels as mask= does. With a cache they are a ValueError (but chunk=). `segment_positions(segment_ids)`
    gives RoPE positions per document.
    Llama 4: chunk=C keeps only the keys of the query's own chunk, a(t) // C == s // C (implies is_causal;
    a dense keep-mask on every kernel; with a cache, the chunks of the cache's positions, `KVCache.keep_mask`); qk_norm="l2" a weightless L2 norm of q and k after
    RoPE (`l2_norm`); attn_temperature_tuning (rope=None layers) scales q at positions= (`temperature`).

    Decoding (docs/semantics.md, "Decoding with a KV cache"): with `cache=` (a
    `mha_jax.kv_cache.KVCache` from `init_cache`) the call is self-attention over T new tokens
    (query, key, value [B, T, E]) against the cache, and returns (output, weights [B, N, T, C]
    or None, new cache), plus Stages with return_intermediates (k, v, k_rot: the new tokens'
    [B, K, T, H]). RoPE positions default to `cache.positions(T)`, the slot minus the row's
    left padding; under jit those are traced, so without jax_enable_x64 their angles are
    float32 (an angle error up to |angle|·2⁻²⁴, see `rope_cos_sin`); with x64 they are float64.
    T = 0 new tokens, or more than the cache's C slots, is a ValueError (under jit too); a row
    without room for T tokens is a ValueError where the lengths are known, NaN under jit.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rngs: nnx.Rngs,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        out_bias: bool = True,
        rope: str | None = None,
        rope_theta: float = 10000.0,
        masked_rows: str = "nan",
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_offset: float = 0.0,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        rope_dim: int | None = None,
        rope_scaling: RopeScaling | None = None,
        attn_temperature_tuning: bool = False, floor_scale: float = 8192.0, attn_scale: float = 0.1,  # Llama 4
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
    ):
        self.config = AttentionConfig(embed_dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                      qkv_bias=qkv_bias, out_bias=out_bias, rope=rope, rope_theta=rope_theta,
                                      masked_rows=masked_rows, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                                      qk_norm_offset=qk_norm_offset, scale=scale, softcap=softcap, sinks=sinks,
                                      rope_dim=rope_dim, rope_scaling=rope_scaling,
                                      attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale,
                                      attn_scale=attn_scale)
        self.head_dim = self.config.head_size
        check_dtype("dtype", dtype)
        check_dtype("param_dtype", param_dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = self.config.kv_heads
        self.masked_rows = masked_rows
        self.dtype = dtype
        self.precision = precision

        def linear(n_out, fan_in, use_bias):
            return nnx.Linear(
                fan_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
                kernel_init=torch_linear_init(fan_in), bias_init=torch_linear_init(fan_in), rngs=rngs,
            )

        width, kv_width = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = linear(width, embed_dim, qkv_bias)
        self.k_proj = linear(kv_width, embed_dim, qkv_bias)
        self.v_proj = linear(kv_width, embed_dim, qkv_bias)
        self.out_proj = linear(embed_dim, width, out_bias)
        flat, norm = qk_norm == "flat", dict(eps=qk_norm_eps, offset=qk_norm_offset, param_dtype=param_dtype)
        weighted = qk_norm in ("head", "flat")  # "l2" has no weight (`l2_norm`, after RoPE)
        self.q_norm = QKNorm(width if flat else self.head_dim, **norm) if weighted else None
        self.k_norm = QKNorm(kv_width if flat else self.head_dim, **norm) if weighted else None
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None

    def _logits(self, dtype) -> dict:
        """scale, softcap and sinks (N,) in the computation dtype, as the cores take them."""
        c = self.config
        return {"scale": c.scale, "softcap": c.softcap, "sinks": None if self.sinks is None else self.sinks[...].astype(dtype)}

    def _project(self, layer: nnx.Linear, x, dtype):
        kernel = layer.kernel[...].astype(dtype)  # (E_in, E_out)
        # Accumulate in >= float32 (XLA's CPU dot would otherwise accumulate float16 in float16).
        y = jnp.einsum("BTE,EF->BTF", x, kernel, precision=self.precision, preferred_element_type=accumulation_dtype(dtype))
        if layer.bias is not None:
            y = y + layer.bias[...].astype(dtype)
        return y.astype(dtype)

    def _heads(self, layer: nnx.Linear, x, dtype, norm: QKNorm | None = None):
        """(projection (B, L, n, H), after the QK-norm `norm` or None without one)."""
        # The head count comes from the projected width, not num_heads: under a sharded
        # (tensor-parallel) layout a device may hold only its share of the heads.
        y = self._project(layer, x, dtype)  # (B, L, n·H)
        B, L, width = y.shape
        flat = norm is not None and self.config.qk_norm == "flat"
        normed = norm(y) if flat else None  # (B, L, n·H): over the whole projection
        y, normed = (None if z is None else z.reshape(B, L, width // self.head_dim, self.head_dim) for z in (y, normed))
        if norm is not None and not flat:
            normed = norm(y)  # over each head's H
        return y, normed

    def _check_inputs(self, query, key, value):
        """(B, T, S, computation dtype); inputs must have that dtype: no silent cast."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
        shapes = check_qkv_shapes(query.shape, key.shape, value.shape, self.embed_dim)
        param_dtype = jnp.dtype(self.q_proj.kernel[...].dtype)
        dtype = jnp.dtype(self.dtype or param_dtype)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if jnp.dtype(x.dtype) != dtype:
                what = f"the module computes in dtype={dtype}" if self.dtype else f"the module's parameters are {dtype}"
                raise TypeError(f"{name} has dtype {x.dtype} but {what}")
        if dtype == jnp.float64 and not jax.config.jax_enable_x64:
            # Without x64 jax would silently compute in float32.
            raise TypeError("float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")
        return shapes + (dtype,)

    def init_cache(self, batch: int, capacity: int, starts=None) -> KVCache:
        """An empty KVCache (B, C, K, H) for this layer: its K key/value heads, head dim and
        computation dtype; starts (B,) the left-padding slots of each row (default 0)."""
        dtype = jnp.dtype(self.dtype or self.q_proj.kernel[...].dtype)
        return KVCache.empty(batch, capacity, self.num_kv_heads, self.head_dim, dtype=dtype, starts=starts)

    def __call__(self, query, key, value, mask=None, need_weights: bool = True, *, positions=None,
                 key_positions=None, return_intermediates: bool = False, cache: KVCache | None = None,
                 is_causal: bool = False, window=None, segment_ids=None, key_segment_ids=None,
                 alignment: str = "top-left", chunk=None):
        if cache is not None:  # a chunk is the cache's too (Llama 4 decodes its chunked layers); the rest is refused
            Structure.refuse_with_cache(is_causal=is_causal, window=window, segment_ids=segment_ids,
                                        key_segment_ids=key_segment_ids, alignment=alignment)
            return self._decode(query, key, value, mask, need_weights, positions, key_positions,
                                return_intermediates, cache, chunk)
        B, T, S, dtype = self._check_inputs(query, key, value)
        rope = self.config.rope
        if rope is None and key_positions is not None:
            raise ValueError("positions/key_positions are given but rope=None: key_positions would be ignored")
        if not self.config.uses_positions and positions is not None:
            raise ValueError("positions/key_positions are given but rope=None (and no attn_temperature_tuning): "
                             "they would be ignored")
        positions = positions_arg(positions, B, T, "positions")
        key_positions = positions_arg(key_positions, B, S, "key_positions")
        keep = None if mask is None else keep_mask_of(mask, B, self.num_heads, T, S)
        structure = _structure(T, S, B, is_causal=is_causal, window=window, segment_ids=segment_ids,
                               key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk)
        if need_weights:
            built = _build_keep(structure)  # (B|1, 1, T, S) | None
            if built is not None:
                keep = built if keep is None else keep & built  # (B|1, N|1, T, S)
        query, key, value = (jnp.asarray(x) for x in (query, key, value))

        q_in, q_normed = self._heads(self.q_proj, query, dtype, self.q_norm)  # (B, T, N, H)
        k_in, k_normed = self._heads(self.k_proj, key, dtype, self.k_norm)  # (B, S, K, H)
        v, _ = self._heads(self.v_proj, value, dtype)  # (B, S, K, H)
        q, k = (x if y is None else y for x, y in ((q_in, q_normed), (k_in, k_normed)))
        if rope is not None:
            acc, cfg = accumulation_dtype(dtype), self.config
            long = rope_uses_long(cfg, (positions, T), (key_positions, S))  # over queries and keys
            q = rotate(q, *rope_cos_sin(cfg, positions, T, acc, long), rope)
            k = rotate(k, *rope_cos_sin(cfg, key_positions, S, acc, long), rope)
        q, k = _after_rope(q, k, positions, self.config)  # Llama 4: the L2 norm, the NoPE temperature
        # K key/value heads all the way down: query head h reads key/value head h // (N/K)
        # in every core (grouped contractions; never a tile, never a copy per query head).
        kw = {"masked_rows": self.masked_rows, "precision": self.precision, **self._logits(dtype)}
        scores = weights = None
        if need_weights and return_intermediates:
            context, weights, scores = attention_core(q, k, v, keep, return_scores=True, **kw)
        elif need_weights:
            context, weights = attention_core(q, k, v, keep, **kw)
        elif T == 0:  # no queries: nothing for any fused kernel to do
            context = jnp.zeros(q.shape, dtype)
        else:
            # mask= and the structured keywords go separately: the kernel choice sees the structure.
            context = fused_attention_core(q, k, v, keep, is_causal=is_causal, window=window, segment_ids=segment_ids,
                                           key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk, **kw)
        context = context.reshape(B, T, q.shape[2] * self.head_dim)  # (B, T, N·H), or this device's share
        output = self._project(self.out_proj, context, dtype)  # (B, T, E)
        if return_intermediates:
            return output, weights, _stages(q_in, k_in, v, q, k, rope, scores, weights, context, output, q_normed,
                                            k_normed)
        return output, weights

    def _decode(self, query, key, value, mask, need_weights, positions, key_positions, return_intermediates,
                cache, chunk=None):
        """__call__ with a cache: T new tokens attend the cache after being written into it."""
        if mask is not None:
            raise ValueError("mask= with a cache: the cache's rule is the mask (new token i of row b keeps slots "
                             "starts[b] <= s <= lengths[b] + i)")
        if key_positions is not None:
            raise ValueError("key_positions= with a cache: the cached keys are stored rotated at their positions")
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a mha_jax.kv_cache.KVCache (see init_cache), got {type(cache).__name__}")
        # Before the S = 0 check, whose words are about keys.
        refuse_no_new_tokens(**{n: getattr(x, "shape", ()) for n, x in (("query", query), ("key", key), ("value", value))})
        B, T, S, dtype = self._check_inputs(query, key, value)
        if T != S:
            raise ValueError(f"with a cache, query, key and value are the same new tokens: got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} (T != S)")
        rope = self.config.rope
        if not self.config.uses_positions and positions is not None:
            raise ValueError("positions are given but rope=None (and no attn_temperature_tuning): they would be ignored")
        positions = positions_arg(positions, B, T, "positions")
        query, key, value = (jnp.asarray(x) for x in (query, key, value))

        q_in, q_normed = self._heads(self.q_proj, query, dtype, self.q_norm)  # (B, T, N, H)
        k_in, k_normed = self._heads(self.k_proj, key, dtype, self.k_norm)  # (B, T, K, H)
        v, _ = self._heads(self.v_proj, value, dtype)  # (B, T, K, H)
        check_cache_shapes(cache.k.shape, cache.v.shape, cache.starts.shape, cache.lengths.shape, layout="BCKH",
                           kv_heads=k_in.shape[2], head_dim=self.head_dim)
        if cache.k.shape[0] != B:
            raise ValueError(f"the cache {tuple(cache.k.shape)} (B, C, K, H) holds {cache.k.shape[0]} rows, "
                             f"the new tokens {tuple(query.shape)} {B}")
        if jnp.dtype(cache.k.dtype) != dtype:
            raise TypeError(f"the cache holds {cache.k.dtype} but the module computes in {dtype}")
        q, k = (x if y is None else y for x, y in ((q_in, q_normed), (k_in, k_normed)))
        if self.config.uses_positions and positions is None:
            positions = cache.positions(T)  # (B, T): traced under jit
        if rope is not None:
            # LongRoPE: over the new tokens only; the cached keys keep the rotation they were written with.
            acc, cfg = accumulation_dtype(dtype), self.config
            cos, sin = rope_cos_sin(cfg, positions, T, acc, rope_uses_long(cfg, (positions, T)))
            q, k = rotate(q, cos, sin, rope), rotate(k, cos, sin, rope)
        q, k = _after_rope(q, k, positions, self.config)  # Llama 4: the L2 norm, the NoPE temperature
        context, weights, new_cache, scores = cached_attention(
            q, k, v, cache, masked_rows=self.masked_rows, need_weights=need_weights, precision=self.precision,
            return_scores=True, chunk=chunk, **self._logits(dtype))
        context = context.reshape(B, T, q.shape[2] * self.head_dim)  # (B, T, N·H)
        output = self._project(self.out_proj, context, dtype)  # (B, T, E)
        if return_intermediates:
            st = _stages(q_in, k_in, v, q, k, rope, scores, weights, context, output, q_normed, k_normed)
            return output, weights, new_cache, st
        return output, weights, new_cache


def _stages(q_in, k_in, v, q, k, rope, scores, weights, context, output, q_norm=None, k_norm=None) -> Stages:
    """The intermediates in the oracle's layouts: heads first, (B, n, L, H); q_norm/k_norm (after the
    QK-norm, before RoPE) where `mha_spec.Stages` has those stages."""

    def heads_first(x):  # (B, L, n, H) -> (B, n, L, H)
        return None if x is None else jnp.transpose(x, (0, 2, 1, 3))

    rotated = (q, k) if rope is not None else (None, None)
    normed = {n: heads_first(x) for n, x in (("q_norm", q_norm), ("k_norm", k_norm)) if n in _STAGE_FIELDS}
    return Stages(heads_first(q_in), heads_first(k_in), heads_first(v), scores, weights, context, output,
                  *(heads_first(x) for x in rotated), **normed)
