"""The oracle: the classic multi-head attention in NumPy, independent of both frameworks.

`forward` in float64 is the reference every implementation is judged against.
`forward(..., dtype=low)` runs the *same maths in a low dtype*: the inputs and
weights are rounded to that dtype, each stage is computed exactly (float64)
and its result rounded to the dtype the modules store it in (scores and
softmax in float32 for 16-bit dtypes, as the modules do). Its error against
float64 is the yardstick of the three-way judge for 16-bit dtypes.
`backward` is a hand-derived float64 vector-Jacobian product.
`decode` runs the layer the way a decoder does, against a NumPy KV cache (docs/semantics.md,
"Decoding with a KV cache"); `decode_keep` and `decode_positions` are the mask and positions
of the one causal `forward` it must equal.

Legend (see mha_spec): B T S N H E, and K key/value heads, G = N // K query heads per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mha_spec import ALIGNMENTS, window_sides, AttentionConfig, check_positions, check_qkv_shapes, mask_shape_4d

STAGES = ("q", "k", "v", "q_norm", "k_norm", "q_rot", "k_rot", "scores", "weights", "context", "output")
"""Intermediates in the order the data flows; the harness names the first that diverges."""


@dataclass(frozen=True)
class Intermediates:
    q: np.ndarray  # (B, N, T, H)
    k: np.ndarray  # (B, K, S, H)
    v: np.ndarray  # (B, K, S, H)
    scores: np.ndarray  # (B, N, T, S), scaled (and soft-capped), -inf where masked
    weights: np.ndarray  # (B, N, T, S), after the masked-row policy
    context: np.ndarray  # (B, T, N*H), heads concatenated
    output: np.ndarray  # (B, T, E)
    q_rot: np.ndarray | None = None  # (B, N, T, H), q after RoPE; None without RoPE
    k_rot: np.ndarray | None = None  # (B, K, S, H)
    q_norm: np.ndarray | None = None  # (B, N, T, H), q after its RMSNorm (before RoPE); None without qk_norm
    k_norm: np.ndarray | None = None  # (B, K, S, H)
    sink_weights: np.ndarray | None = None  # (B, N, T), the weight each row gives its sink; None without sinks
    q_temp: np.ndarray | None = None  # (B, N, T, H), q times Llama 4's NoPE temperature; None without it

    @property
    def attended_q(self) -> np.ndarray:
        """The queries the scores are taken with: after the norm, RoPE and the temperature the layer has (B, N, T, H)."""
        return next(x for x in (self.q_temp, self.q_rot, self.q_norm, self.q) if x is not None)

    @property
    def attended_k(self) -> np.ndarray:
        """The keys the scores are taken with (B, K, S, H)."""
        return next(x for x in (self.k_rot, self.k_norm, self.k) if x is not None)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """Round float64 values to dtype and back: 'stored in dtype', computed in float64."""
    return np.asarray(x, dtype=dtype).astype(np.float64)


def _accumulation_dtype(dtype) -> np.dtype:
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def keep_mask(mask, B: int, N: int, T: int, S: int):
    """Keep-mask (0 = masked) of any numeric dtype -> bool (B|1, N|1, T|1, S|1), or None."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    return (mask != 0).reshape(mask_shape_4d(mask.shape, B, N, T, S))


def config_of(sd, num_heads: int, *, masked_rows: str = "nan", num_kv_heads=None, rope=None,
              rope_theta: float = 10000.0, qk_norm=None, qk_norm_eps: float = 1e-6, qk_norm_offset: float = 0.0,
              scale=None, softcap=None, rope_dim=None, rope_scaling=None, attn_temperature_tuning: bool = False,
              floor_scale: float = 8192.0, attn_scale: float = 0.1) -> AttentionConfig:
    """The layer a canonical state dict describes; every key and shape checked (ValueError naming them).
    Biases and sinks are read off the keys; q_norm/k_norm weights need qk_norm (their shapes cannot say
    "head" from "flat" when N = K = 1)."""
    if "q_proj.weight" not in sd:
        raise ValueError(f"state dict has no 'q_proj.weight'; keys: {sorted(sd)}")
    width, E = np.shape(sd["q_proj.weight"])
    if isinstance(num_heads, int) and not isinstance(num_heads, bool) and num_heads > 0 and width % num_heads:
        raise ValueError(f"q_proj.weight has {width} rows, not a multiple of num_heads={num_heads}")
    head_dim = width // num_heads if isinstance(num_heads, int) and num_heads > 0 else None
    cfg = AttentionConfig(E, num_heads, num_kv_heads=num_kv_heads,
                          head_dim=None if head_dim is not None and head_dim * num_heads == E else head_dim,
                          qkv_bias=any(f"{p}.bias" in sd for p in ("q_proj", "k_proj", "v_proj")),
                          out_bias="out_proj.bias" in sd, rope=rope, rope_theta=rope_theta, masked_rows=masked_rows,
                          qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, qk_norm_offset=qk_norm_offset, scale=scale,
                          softcap=softcap, sinks="sinks" in sd, rope_dim=rope_dim, rope_scaling=rope_scaling,
                          attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale,
                          attn_scale=attn_scale)
    expected = cfg.weight_shapes()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state dict keys do not describe one layer: missing {missing}, unexpected {unexpected} "
                         "(q/k/v biases come all three or none; q_norm/k_norm weights with qk_norm= only)")
    for name, shape in expected.items():
        if tuple(np.shape(sd[name])) != shape:
            raise ValueError(f"{name} has shape {tuple(np.shape(sd[name]))}, expected {shape} "
                             f"(E={E}, N={cfg.num_heads}, K={cfg.kv_heads}, H={cfg.head_size})")
    return cfg


def _positions(pos, batch: int, length: int, name: str) -> np.ndarray:
    """Integer positions -> float64 (B|1, 1, L, 1), default arange(L)."""
    if pos is None:
        return np.arange(length, dtype=np.float64).reshape(1, 1, length, 1)
    pos = np.asarray(pos)
    if not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {pos.dtype}")
    check_positions(pos.shape, batch, length, name)
    return pos.astype(np.float64).reshape(pos.shape[0] if pos.ndim == 2 else 1, 1, length, 1)  # not -1: L may be 0


def rope_inv_freq(rope_dim: int, theta: float, scaling=None, long: bool = False) -> np.ndarray:
    """inv_freq (R/2,) float64 of a RoPE over R = rope_dim features: theta ** (-2i / R), scaled by `scaling`
    (a `mha_spec.RopeScaling`; LongRoPE's long factors with `long`). The oracle's own writing of transformers'
    modeling_rope_utils (`_compute_{linear_scaling,llama3,yarn,longrope}_parameters`), in float64: it reads
    the scaling's fields only, never mha_spec's frequencies, so the two are independent writings."""
    base = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)  # (R/2,)
    if scaling is None:
        return base
    kind = scaling.kind
    if kind == "linear":
        return base / scaling.factor
    if kind == "llama3":
        return _llama3_inv_freq(base, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(base, rope_dim, theta, scaling)
    if kind == "longrope":  # 1 / (ext_factor[i] * theta ** (2i / R))
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float64)
        if factors.shape != base.shape:
            raise ValueError(f"rope_scaling longrope has {factors.size} factors, the layer rotates {base.size} pairs")
        return base / factors
    raise ValueError(f"rope_scaling kind {kind!r} is not one the oracle knows (linear, llama3, yarn, longrope)")


def _llama3_inv_freq(base: np.ndarray, s) -> np.ndarray:
    """Llama 3.1: wavelengths past original/low_freq_factor slowed by factor, those under
    original/high_freq_factor kept, those between blended by how many turns fit the original context."""
    orig, lo, hi, factor = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor, s.factor
    wavelen = 2 * np.pi / base
    slow = np.where(wavelen > orig / lo, base / factor, base)
    smooth = (orig / wavelen - lo) / (hi - lo)
    between = ~(wavelen < orig / hi) & ~(wavelen > orig / lo)
    return np.where(between, (1 - smooth) * slow / factor + smooth * slow, slow)


def _yarn_inv_freq(base: np.ndarray, R: int, theta: float, s) -> np.ndarray:
    """YaRN: pairs below the correction dim of beta_fast keep their frequency (extrapolation), those past
    that of beta_slow are divided by factor (interpolation), a linear ramp between (transformers' defaults:
    beta_fast 32, beta_slow 1, truncate True)."""
    beta_fast = 32.0 if s.beta_fast is None else s.beta_fast
    beta_slow = 1.0 if s.beta_slow is None else s.beta_slow
    orig = s.original_max_position_embeddings

    def dim_turning(rotations):  # the (fractional) feature index whose wavelength turns `rotations` times in orig
        return R * np.log(orig / (rotations * 2 * np.pi)) / (2 * np.log(theta))
    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, R - 1.0)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # 1: interpolate
    return base / s.factor * ramp + base * (1.0 - ramp)


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by (transformers' attention_scaling): attention_factor if given, YaRN's
    mscale ratio, LongRoPE's sqrt(1 + ln(factor) / ln(original)); 1 otherwise (and without scaling)."""
    if scaling is None or scaling.kind in ("linear", "llama3"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    factor = scaling.factor
    if scaling.kind == "yarn":
        def mscale(m):
            return 1.0 if factor <= 1 else 0.1 * m * np.log(factor) + 1.0
        if scaling.mscale and scaling.mscale_all_dim:  # truthiness, as transformers tests them
            return float(mscale(scaling.mscale) / mscale(scaling.mscale_all_dim))
        return float(mscale(1.0))
    if factor <= 1.0:
        return 1.0
    return float(np.sqrt(1 + np.log(factor) / np.log(scaling.original_max_position_embeddings)))


def rope_angles(pos, head_dim: int, theta: float) -> np.ndarray:
    """pos (B|1, 1, L, 1) -> angles (B|1, 1, L, H/2): position * theta ** (-2i / H)."""
    return pos * rope_inv_freq(head_dim, theta)


def rotate(x, cos, sin, convention: str) -> np.ndarray:
    """Rotate the first R = 2 * cos.shape[-1] features of x (..., H) pairwise by the angles whose cos/sin
    (..., R/2) are given (times any factor they carry); features R..H-1 pass unchanged.

    Within the rotated part "half" pairs feature i with i + R/2, "interleaved" 2i with 2i + 1; passing -sin
    applies the transpose (undoes it when cos² + sin² = 1).
    """
    R = 2 * np.shape(cos)[-1]
    xr, rest = x[..., :R], x[..., R:]
    if convention == "half":
        x1, x2 = xr[..., : R // 2], xr[..., R // 2:]
        turned = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        pairs = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # (..., R/2, 2)
        turned = pairs.reshape(*pairs.shape[:-2], R)
    if rest.shape[-1] == 0:
        return turned
    return np.concatenate([turned, np.broadcast_to(rest, (*turned.shape[:-1], rest.shape[-1]))], axis=-1)


def _rope_table(cfg: AttentionConfig, max_position) -> tuple[np.ndarray, float]:
    """(inv_freq (R/2,), attention factor) of a call whose largest position is `max_position`: LongRoPE's
    long factors when max_position + 1 passes original_max_position_embeddings (transformers'
    `dynamic_rope_update`: the call's length is its largest position id plus one)."""
    s = cfg.rope_scaling
    long = s is not None and s.kind == "longrope" and max_position + 1 > s.original_max_position_embeddings
    return rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, s, bool(long)), rope_attention_factor(s)


def _cos_sin(pos, inv_freq, factor: float, acc):
    """pos (B|1, 1, L, 1) float64 -> (cos, sin) (B|1, 1, L, R/2): of float64 angles, times the attention
    factor in float64, then stored in `acc`."""
    angles = pos * inv_freq
    return _round(factor * np.cos(angles), acc), _round(factor * np.sin(angles), acc)


def _rope_cos_sin(positions, key_positions, B: int, T: int, S: int, cfg: AttentionConfig, acc):
    """((cos, sin) of the queries, (cos, sin) of the keys), each (B|1, 1, L, R/2), stored in `acc`; one table
    for the whole call, chosen (LongRoPE) by the largest of the positions and the key positions."""
    pq, pk = _positions(positions, B, T, "positions"), _positions(key_positions, B, S, "key_positions")
    top = max((p.max() for p in (pq, pk) if p.size), default=-1.0)
    table = _rope_table(cfg, top)
    return _cos_sin(pq, *table, acc), _cos_sin(pk, *table, acc)


def _linear(x, sd, name, dtype):
    y = x @ _round(sd[f"{name}.weight"], dtype).T
    if f"{name}.bias" in sd:
        y = y + _round(sd[f"{name}.bias"], dtype)
    return _round(y, dtype)


def _combined_keep(mask, B: int, N: int, T: int, S: int, structured: dict):
    """bool (B|1, N|1, T|1, S|1): the keep-mask `mask` AND `structured_keep(**structured)`, or None."""
    keep = keep_mask(mask, B, N, T, S)
    built = structured_keep(T, S, **structured)  # (B|1, 1, T, S) | None
    seg = structured.get("segment_ids")
    if seg is not None and np.shape(seg)[0] != B:
        raise ValueError(f"segment_ids {np.shape(seg)} has {np.shape(seg)[0]} rows, the query {B}")
    if built is None:
        return keep
    return built if keep is None else keep & built


def _rope_forward(qn, kn, positions, key_positions, sizes, cfg, acc, dtype):
    """(q_rot, k_rot): q and k rotated (None, None without RoPE), then Llama 4's L2 norm, which follows RoPE."""
    if cfg.rope is None:
        return None, None
    (cq, sq), (ck, sk) = _rope_cos_sin(positions, key_positions, *sizes, cfg, acc)
    q_rot, k_rot = _round(rotate(qn, cq, sq, cfg.rope), dtype), _round(rotate(kn, ck, sk, cfg.rope), dtype)
    return _l2_norm(q_rot, cfg, dtype), _l2_norm(k_rot, cfg, dtype)


def forward(sd, query, key, value, mask=None, *, num_heads: int, masked_rows: str = "nan", dtype=np.float64,
            num_kv_heads: int | None = None, rope: str | None = None, rope_theta: float = 10000.0,
            positions=None, key_positions=None, is_causal: bool = False, window=None, segment_ids=None,
            key_segment_ids=None, alignment: str = "top-left", qk_norm=None, qk_norm_eps: float = 1e-6,
            qk_norm_offset: float = 0.0, scale=None, softcap=None, rope_dim=None, rope_scaling=None,
            chunk=None, attn_temperature_tuning: bool = False, floor_scale: float = 8192.0,
            attn_scale: float = 0.1) -> Intermediates:
    """The layer's maths, stage by stage; returns every intermediate as float64 arrays.

    The layer (`mha_spec.AttentionConfig`) is read off the state dict's keys and shapes and the
    arguments: grouped key/value heads (`num_kv_heads`), missing biases, RoPE. `positions`
    (T,) | (B, T) and `key_positions` (S,) | (B, S) are integers, default arange. With a low
    `dtype`, RoPE's cos/sin are stored in the accumulation dtype and the rotated q/k in `dtype`.
    is_causal, window, segment_ids, key_segment_ids and alignment are the structured masks
    (`structured_keep`), ANDed with `mask`.
    The layers after Llama (`mha_spec.AttentionConfig`): qk_norm (with qk_norm_eps, qk_norm_offset and the
    state dict's q_norm.weight, k_norm.weight) normalises q and k before RoPE, `scale` replaces H**-0.5,
    `softcap` caps the scaled logits before the mask, a "sinks" tensor (N,) joins each row's softmax.
    RoPE as models ship it: `rope_dim` R rotates the first R features of each head only (the rest pass),
    `rope_scaling` (a `mha_spec.RopeScaling`) scales the frequencies and cos/sin (`rope_inv_freq`,
    `rope_attention_factor`; LongRoPE's long factors when the largest of positions and key_positions
    passes its original context).
    Llama 4: chunk=C (`structured_keep`); qk_norm="l2" after RoPE (q_rot/k_rot are after it; `_l2_norm`);
    attn_temperature_tuning on rope=None layers, q times `temperature_factor` at positions= (q_temp).
    """
    cfg = config_of(sd, num_heads, masked_rows=masked_rows, num_kv_heads=num_kv_heads, rope=rope,
                    rope_theta=rope_theta, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, qk_norm_offset=qk_norm_offset,
                    scale=scale, softcap=softcap, rope_dim=rope_dim, rope_scaling=rope_scaling,
                    attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale)
    E, N, K, H, G = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.group
    B, T, S = check_qkv_shapes(np.shape(query), np.shape(key), np.shape(value), E)
    _refuse_unread_positions(cfg, positions, key_positions)
    keep = _combined_keep(mask, B, N, T, S, dict(is_causal=is_causal, window=window, segment_ids=segment_ids,
                                                  key_segment_ids=key_segment_ids, alignment=alignment, chunk=chunk))
    acc = _accumulation_dtype(dtype)
    xq, xk, xv = (_round(np.asarray(x, np.float64), dtype) for x in (query, key, value))

    def heads(x, n):  # (B, L, n*H) -> (B, n, L, H)
        return x.reshape(x.shape[0], x.shape[1], n, H).transpose(0, 2, 1, 3)

    q = heads(_linear(xq, sd, "q_proj", dtype), N)  # (B, N, T, H)
    k = heads(_linear(xk, sd, "k_proj", dtype), K)  # (B, K, S, H)
    v = heads(_linear(xv, sd, "v_proj", dtype), K)  # (B, K, S, H)
    q_norm, k_norm = _qk_norm(q, sd, "q_norm", cfg, dtype), _qk_norm(k, sd, "k_norm", cfg, dtype)
    qn, kn = (x if y is None else y for x, y in ((q, q_norm), (k, k_norm)))
    q_rot, k_rot = _rope_forward(qn, kn, positions, key_positions, (B, T, S), cfg, acc, dtype)
    qs, ks = (qn if q_rot is None else q_rot), (kn if k_rot is None else k_rot)
    q_temp = _temperature(qs, _positions(positions, B, T, "positions"), cfg, dtype)  # None without it
    qg = (qs if q_temp is None else q_temp).reshape(B, K, G, T, H)  # query head h = j * G + g: key/value head h // G
    scores = _logits(np.einsum("BKGTH,BKSH->BKGTS", qg, ks).reshape(B, N, T, S), cfg, acc)
    scores, weights, sink_weights = _softmax(scores, keep, sd.get("sinks"), masked_rows, acc, dtype)
    context = _round(np.einsum("BKGTS,BKSH->BKGTH", weights.reshape(B, K, G, T, S), v), dtype)
    context = context.reshape(B, N, T, H).transpose(0, 2, 1, 3).reshape(B, T, N * H)
    output = _linear(context, sd, "out_proj", dtype)
    return Intermediates(q, k, v, scores, weights, context, output, q_rot, k_rot, q_norm, k_norm, sink_weights,
                         q_temp)


def _refuse_unread_positions(cfg: AttentionConfig, positions, key_positions) -> None:
    """ValueError for positions the layer would not read (key positions without RoPE, query positions without RoPE
    or the NoPE temperature)."""
    if cfg.rope is None and key_positions is not None:
        raise ValueError("positions/key_positions are given but rope=None: key_positions would be ignored")
    if cfg.rope is None and not cfg.attn_temperature_tuning and positions is not None:
        raise ValueError("positions/key_positions are given but rope=None (and no attn_temperature_tuning): "
                         "they would be ignored")


def _l2_norm(x, cfg: AttentionConfig, dtype) -> np.ndarray:
    """Llama 4's L2Norm of x (..., H) with qk_norm="l2" (x unchanged otherwise): x / sqrt(mean(x²) + eps) over the
    last axis, in `_norm_dtype`, stored in dtype."""
    if cfg.qk_norm != "l2":
        return x
    at = _norm_dtype(dtype)
    v = _round(x, at)
    return _round(v / np.sqrt(_round(np.mean(v * v, axis=-1, keepdims=True) + cfg.qk_norm_eps, at)), dtype)


def temperature_factor(pos, floor_scale: float, attn_scale: float) -> np.ndarray:
    """Llama 4's NoPE temperature at positions pos (float64): log(floor((pos + 1) / floor_scale) + 1)·attn_scale + 1."""
    return np.log(np.floor((np.asarray(pos, np.float64) + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


def _temperature(q, pos, cfg: AttentionConfig, dtype) -> np.ndarray | None:
    """q (B, N, T, H) times the temperature at its positions pos (B|1, 1, T, 1), in `_norm_dtype`, stored in dtype;
    None without attn_temperature_tuning."""
    if not cfg.attn_temperature_tuning:
        return None
    at = _norm_dtype(dtype)
    factor = _round(temperature_factor(pos, cfg.floor_scale, cfg.attn_scale), at)
    return _round(_round(q, at) * factor, dtype)


def _norm_dtype(dtype) -> np.dtype:
    """Where the QK RMSNorm is computed: float32 at least, as the models' x.float() (float64 stays float64)."""
    return np.promote_types(np.dtype(dtype), np.float32)


def _per_token(x, cfg: AttentionConfig):
    """x (B, n, L, H) as the vectors its RMSNorm normalises: each head's H ("head"), or each token's
    n*H projection ("flat", (B, L, n*H)); and the inverse."""
    if cfg.qk_norm == "head":
        return x, lambda y: y
    B, n, L, H = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, n * H), lambda y: y.reshape(B, L, n, H).transpose(0, 2, 1, 3)


def _qk_norm(x, sd, name: str, cfg: AttentionConfig, dtype):
    """x (B, n, L, H) after the layer's RMSNorm `name` (q_norm | k_norm) before RoPE, stored in dtype; None
    without qk_norm. x / sqrt(mean(x²) + eps) * (offset + w), computed in `_norm_dtype`."""
    if cfg.qk_norm in (None, "l2"):  # "l2" follows RoPE (`_l2_norm`)
        return None
    vectors, back = _per_token(x, cfg)
    at = _norm_dtype(dtype)
    v = _round(vectors, at)
    rms = np.sqrt(_round(np.mean(v * v, axis=-1, keepdims=True) + cfg.qk_norm_eps, at))
    w = _round(cfg.qk_norm_offset + _round(as_float64(sd[f"{name}.weight"]), dtype), at)
    return back(_round(_round(v / rms, at) * w, dtype))


def _qk_norm_backward(d_y, x, sd, name: str, cfg: AttentionConfig, r) -> tuple[np.ndarray, np.ndarray]:
    """(the gradient of the norm's input x (B, n, L, H), of its weight) from that of its output d_y; x is
    the projection before the norm. y = n·(offset + w), n = x / rms: dx = (dn - n·mean(dn·n)) / rms."""
    vectors, back = _per_token(x, cfg)
    d, _ = _per_token(d_y, cfg)
    rms = np.sqrt(np.mean(vectors * vectors, axis=-1, keepdims=True) + cfg.qk_norm_eps)
    n = vectors / rms
    d_w = r((d * n).reshape(-1, n.shape[-1]).sum(axis=0))
    dn = d * (cfg.qk_norm_offset + r(as_float64(sd[f"{name}.weight"])))
    return back(r((dn - n * np.mean(dn * n, axis=-1, keepdims=True)) / rms)), d_w


def _logits(qk, cfg: AttentionConfig, acc) -> np.ndarray:
    """q·k (B, N, T, S) scaled (H**-0.5 or `scale`) and, with softcap, capped: cap·tanh(s / cap), in acc."""
    s = _round(qk / np.sqrt(cfg.head_size) if cfg.scale is None else qk * cfg.scale, acc)
    return s if cfg.softcap is None else _round(cfg.softcap * np.tanh(s / cfg.softcap), acc)


def _softmax(scores, keep, sinks, masked_rows: str, acc, dtype):
    """(scores -inf where masked, weights (B, N, T, S) stored in dtype, the sinks' weights (B, N, T) or None).

    A row that keeps no key follows `masked_rows` (a uniform row spreads over the S keys) -- unless the
    layer has sinks (N,): each row's softmax then also holds its head's sink logit, whose column is dropped
    after, so such a row gives all its weight to the sink (zeros)."""
    S = scores.shape[-1]
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
        row_any = keep.any(axis=-1, keepdims=True)
        safe = np.where(row_any, scores, 0.0)
    else:
        row_any, safe = np.ones((1, 1, 1, 1), bool), scores
    if sinks is not None:
        sink = _round(as_float64(sinks), dtype).reshape(1, -1, 1, 1)  # (1, N, 1, 1)
        top = np.maximum(scores.max(axis=-1, keepdims=True), sink)  # the sink when the row keeps no key
        e, e_sink = np.exp(scores - top), np.exp(sink - top)
        total = e.sum(axis=-1, keepdims=True) + e_sink
        return scores, _round(_round(e / total, acc), dtype), _round(e_sink / total, acc)[..., 0]
    with np.errstate(invalid="ignore"):
        shifted = np.exp(safe - safe.max(axis=-1, keepdims=True))
        weights = shifted / shifted.sum(axis=-1, keepdims=True)
    fill = {"nan": np.nan, "zero": 0.0, "uniform": 1.0 / S}[masked_rows]
    return scores, _round(_round(np.where(row_any, weights, fill), acc), dtype), None


def _rope_backward(d_q, d_k, positions, key_positions, sizes, cfg, acc, r):
    """(d_q, d_k, the keys' (cos, sin) or None) before RoPE: the transpose of a rotation is the rotation by minus
    the angle (the same attention factor; the features past rope_dim pass)."""
    if cfg.rope is None:
        return d_q, d_k, None
    (cq, sq), key_angles = _rope_cos_sin(positions, key_positions, *sizes, cfg, acc)
    return r(rotate(d_q, cq, -sq, cfg.rope)), r(rotate(d_k, key_angles[0], -key_angles[1], cfg.rope)), key_angles


def backward(sd, query, key, value, mask, cotangent, *, num_heads: int, masked_rows: str = "nan", dtype=np.float64,
             num_kv_heads: int | None = None, rope: str | None = None, rope_theta: float = 10000.0,
             positions=None, key_positions=None, masked_row_grads: str = "stop",
             per_query_head: bool = False, is_causal: bool = False, window=None, segment_ids=None,
             key_segment_ids=None, alignment: str = "top-left", qk_norm=None, qk_norm_eps: float = 1e-6,
             qk_norm_offset: float = 0.0, scale=None, softcap=None, rope_dim=None,
             rope_scaling=None, chunk=None, attn_temperature_tuning: bool = False, floor_scale: float = 8192.0,
             attn_scale: float = 0.1) -> dict[str, np.ndarray]:
    """Gradients of sum(output * cotangent) w.r.t. query, key, value and every weight ("query", "key",
    "value" and the state dict's own names; the norm weights and the sinks too).

    A fully masked row's weights are a constant of the policy, so no gradient flows through its scores;
    under "nan" its NaN reaches V's gradients, as in the modules. masked_row_grads="flow" is what a layer
    that ADDS its mask to the scores computes: the row is differentiated as a softmax like any other, so its
    gradient reaches the query and key gradients -- with "uniform" a large finite fill (finfo.min), with
    "nan" -inf, whose NaN then spreads there. A key/value head's gradients sum over its group's query
    heads; RoPE's backward rotates back by the same angle (the first rope_dim features, times the same
    attention factor; the rest pass). With a low `dtype`: the same maths with each
    stored result rounded as the modules store it (the softmax backward in float32 as its forward), the
    yardstick of the three-way judge. per_query_head=True adds each query head's share of the k/v
    gradients (`_per_query_head_shares`). The masks and the layer's keywords are `forward`'s.
    """
    if masked_row_grads not in ("stop", "flow"):
        raise ValueError(f"masked_row_grads must be 'stop' or 'flow', got {masked_row_grads!r}")
    acc, flow = _accumulation_dtype(dtype), masked_row_grads == "flow"

    def r(x, dt=dtype):
        return _round(x, dt)

    structured = dict(is_causal=is_causal, window=window, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                      alignment=alignment, chunk=chunk)
    layer = dict(num_heads=num_heads, masked_rows=masked_rows, num_kv_heads=num_kv_heads, rope=rope,
                 rope_theta=rope_theta, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, qk_norm_offset=qk_norm_offset,
                 scale=scale, softcap=softcap, rope_dim=rope_dim, rope_scaling=rope_scaling,
                 attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale)
    f = forward(sd, query, key, value, mask, dtype=dtype, positions=positions, key_positions=key_positions,
                **structured, **layer)
    cfg = config_of(sd, **layer)
    (N, H), K, G = f.q.shape[1::2], f.k.shape[1], cfg.group
    W = {k: r(as_float64(v)) for k, v in sd.items()}
    xq, xk, xv = (r(as_float64(x)) for x in (query, key, value))
    g = r(as_float64(cotangent))  # (B, T, E)
    (B, T, _), S = g.shape, xk.shape[1]
    grads, d_context = _out_proj_backward(g, f.context, W, r)
    d_context = d_context.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, H)
    keep = _combined_keep(mask, B, N, T, S, structured)
    d_q, d_k, d_v, d_scores, d_sinks = _core_backward(f, d_context, keep, flow, cfg, acc, r)
    grads.update({} if d_sinks is None else {"sinks": d_sinks})
    d_q, d_k = _llama4_backward(d_q, d_k, f, positions, key_positions, cfg, dtype, r)
    d_q, d_k, key_angles = _rope_backward(d_q, d_k, positions, key_positions, (B, T, S), cfg, acc, r)
    if cfg.qk_norm in ("head", "flat"):  # the projections' gradients, through the norms
        (d_q, grads["q_norm.weight"]), (d_k, grads["k_norm.weight"]) = (
            _qk_norm_backward(d, x, sd, name, cfg, r) for d, x, name in ((d_q, f.q, "q_norm"), (d_k, f.k, "k_norm")))
    for name, d_heads, x, grad_key in (("q_proj", d_q, xq, "query"), ("k_proj", d_k, xk, "key"), ("v_proj", d_v, xv, "value")):
        grads.update(_projection_grads(name, grad_key, d_heads, x, W, r))
    if per_query_head:
        grads.update(_shares_of(f, d_scores, d_context, key_angles, rope, sd, cfg, r))
    return grads


def _llama4_backward(d_q, d_k, f: Intermediates, positions, key_positions, cfg: AttentionConfig, dtype, r):
    """d_q, d_k before Llama 4's steps after RoPE (the NoPE temperature, the L2 norm), from those of the attended
    q (B, N, T, H) and k (B, K, S, H); unchanged without them."""
    if cfg.attn_temperature_tuning:  # q·factor: d_q times the same factor (as stored in the norm dtype)
        pos = _positions(positions, f.q.shape[0], f.q.shape[2], "positions")  # (B|1, 1, T, 1)
        d_q = r(d_q * _round(temperature_factor(pos, cfg.floor_scale, cfg.attn_scale), _norm_dtype(dtype)))
    if cfg.qk_norm == "l2":  # the norm followed RoPE: its backward comes first
        d_q, d_k = _l2_backward(d_q, d_k, f, positions, key_positions, cfg, _accumulation_dtype(dtype), r)
    return d_q, d_k


def _l2_backward(d_q, d_k, f: Intermediates, positions, key_positions, cfg: AttentionConfig, acc, r):
    """d_q (B, N, T, H), d_k (B, K, S, H) before Llama 4's L2 norm, from those after it: with x the rotated q or k
    (recomputed), n = x / rms, dx = (dy - n·mean(dy·n)) / rms."""
    B, T, S = f.q.shape[0], f.q.shape[2], f.k.shape[2]
    (cq, sq), (ck, sk) = _rope_cos_sin(positions, key_positions, B, T, S, cfg, acc)
    out = []
    for d, x in ((d_q, rotate(f.q, cq, sq, cfg.rope)), (d_k, rotate(f.k, ck, sk, cfg.rope))):
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.qk_norm_eps)
        n = x / rms
        out.append(r((d - n * np.mean(d * n, axis=-1, keepdims=True)) / rms))
    return tuple(out)


def _out_proj_backward(g, context, W, r) -> tuple[dict, np.ndarray]:
    """({out_proj's gradients}, the context's gradient (B, T, N·H)) from the output's g (B, T, E)."""
    grads = {"out_proj.weight": r(np.einsum("BTF,BTE->FE", g, context))}
    if "out_proj.bias" in W:
        grads["out_proj.bias"] = r(g.sum(axis=(0, 1)))
    return grads, r(g @ W["out_proj.weight"])


def _shares_of(f: Intermediates, d_scores, d_context, key_angles, rope, sd, cfg: AttentionConfig, r) -> dict:
    """`_per_query_head_shares`, the key's shares taken through the key norm's backward (linear in them)."""
    if cfg.qk_norm == "l2":
        raise ValueError("per_query_head shares of a qk_norm='l2' layer are not derived in the oracle")
    shares = _per_query_head_shares(d_scores, f.attended_q, f.weights.reshape(d_scores.shape), d_context,
                                    key_angles, rope, r)
    if cfg.qk_norm in ("head", "flat"):
        B, K, G, S, H = shares["key.per_query_head"].shape
        per_g = shares["key.per_query_head"].transpose(0, 2, 1, 3, 4).reshape(B * G, K, S, H)
        k_pre = np.repeat(f.k[:, None], G, axis=1).reshape(B * G, K, S, H)  # (B·G, K, S, H)
        d, _ = _qk_norm_backward(per_g, k_pre, sd, "k_norm", cfg, r)
        shares["key.per_query_head"] = d.reshape(B, G, K, S, H).transpose(0, 2, 1, 3, 4)
    return shares


def _core_backward(f: Intermediates, d_context, keep, flow: bool, cfg: AttentionConfig, acc, r):
    """The attention core's backward, from the context's gradient d_context (B, K, G, T, H) to the attended
    q (B, N, T, H; before RoPE's and the norm's backward), k and v (B, K, S, H) gradients, d_scores
    (B, K, G, T, S), and the sinks' gradient (N,) (None without sinks)."""
    B, K, G, T, H = d_context.shape
    N, S = K * G, f.weights.shape[-1]
    w = f.weights.reshape(B, K, G, T, S)
    d_weights = r(np.einsum("BKGTH,BKSH->BKGTS", d_context, f.v)).reshape(B, N, T, S)
    d_v = r(np.einsum("BKGTS,BKGTH->BKSH", w, d_context))
    d_scores = _scores_backward(f, d_weights, keep, flow, cfg, acc, r).reshape(B, K, G, T, S)
    d_q = r(np.einsum("BKGTS,BKSH->BKGTH", d_scores, f.attended_k)).reshape(B, N, T, H)
    d_k = r(np.einsum("BKGTS,BKGTH->BKSH", d_scores, f.attended_q.reshape(B, K, G, T, H)))
    d_sinks = None
    if f.sink_weights is not None:  # the sink's column: its weight times (0 - sum_s d_weights·weights)
        d_sinks = r(-(f.sink_weights * (d_weights * f.weights).sum(axis=-1)).sum(axis=(0, 2)))
    return d_q, d_k, d_v, d_scores, d_sinks


def _scores_backward(f: Intermediates, d_weights, keep, flow: bool, cfg: AttentionConfig, acc, r) -> np.ndarray:
    """d of q·k (B, N, T, S) from the softmax's output and its gradient, through the soft-cap and the scale,
    in the accumulation dtype. Unless `flow`, a fully masked row is a constant of the policy: no gradient.
    (With sinks the softmax's real columns have the same backward: the dropped column's gradient is 0.)"""
    weights = f.weights
    row_any = np.ones((1, 1, 1, 1), bool) if keep is None else keep.any(axis=-1, keepdims=True)
    p = weights if flow else np.where(row_any, weights, 0.0)
    d_scores = r(p * (d_weights - (d_weights * p).sum(axis=-1, keepdims=True)), acc)
    d_scores = np.where(row_any | flow, d_scores, 0.0)
    if cfg.softcap is not None:  # d(cap·tanh(s/cap))/ds = 1 - tanh², tanh = capped / cap
        # the capped logits before the mask: a fully masked row's gradient flows ("flow") through the
        # cap of its own logits, as in a layer that adds its mask after the cap (Gemma 2)
        B, N, T, S = f.weights.shape
        K, H = f.attended_k.shape[1], f.attended_k.shape[-1]
        qk = np.einsum("BKGTH,BKSH->BKGTS", f.attended_q.reshape(B, K, N // K, T, H), f.attended_k)
        t = _logits(qk.reshape(B, N, T, S), cfg, acc) / cfg.softcap
        d_scores = r(d_scores * (1.0 - t * t), acc)
    return r(d_scores / np.sqrt(cfg.head_size) if cfg.scale is None else d_scores * cfg.scale, acc)


def _per_query_head_shares(d_scores, q, w, d_context, key_angles, rope, r) -> dict[str, np.ndarray]:
    """"key.per_query_head" and "value.per_query_head" (B, K, G, S, H): each query head's share of a
    key/value head's gradient, stored in the dtype before the sum over its group -- as the autodiff of
    repeat_kv stores them, and what XLA sums in one reduction with the k/v bias gradient's sum over
    tokens when it fuses the two. d_scores, w (B, K, G, T, S); q (B, N, T, H); d_context (B, K, G, T, H)."""
    B, K, G, T, _ = w.shape
    key = r(np.einsum("BKGTS,BKGTH->BKGSH", d_scores, q.reshape(B, K, G, T, -1)))
    if key_angles is not None:
        ck, sk = key_angles  # (B|1, 1, S, H/2): one angle per key, the same for every head
        key = r(rotate(key, ck[:, :, None], -sk[:, :, None], rope))
    return {"key.per_query_head": key, "value.per_query_head": r(np.einsum("BKGTS,BKGTH->BKGSH", w, d_context))}


def _projection_grads(name: str, grad_key: str, d_heads, x, W, r) -> dict[str, np.ndarray]:
    """The gradients of one input projection from its heads' gradient d_heads (B, n, L, H)."""
    d_proj = d_heads.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)  # (B, L, n*H)
    grads = {f"{name}.weight": r(np.einsum("BLF,BLE->FE", d_proj, x))}
    if f"{name}.bias" in W:
        grads[f"{name}.bias"] = r(d_proj.sum(axis=(0, 1)))
    grads[grad_key] = r(d_proj @ W[f"{name}.weight"])
    return grads


def as_float64(x) -> np.ndarray:
    """Any float array (bfloat16 included) as float64, for comparisons."""
    x = np.asarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)


# ---------------------------------------------------------------- decoding with a KV cache


def check_starts(starts, batch: int, top: int) -> np.ndarray:
    """(B,) int64 left-padding counts in [0, top]; None -> zeros. TypeError/ValueError naming them."""
    if starts is None:
        return np.zeros(batch, np.int64)
    starts = np.asarray(starts)
    if not np.issubdtype(starts.dtype, np.integer):
        raise TypeError(f"starts must be integers, got dtype {starts.dtype}")
    if starts.shape != (batch,):
        raise ValueError(f"starts must have shape ({batch},) (one per batch row), got {starts.shape}")
    if ((starts < 0) | (starts > top)).any():
        raise ValueError(f"starts must lie in [0, {top}], got {starts.tolist()}")
    return starts.astype(np.int64)


def _check_chunk(chunk) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


def decode_keep(starts, L: int, chunk=None) -> np.ndarray:
    """bool (B, 1, L, L): keep[b, 0, t, s] = starts[b] <= s <= t, the one causal forward a prefill
    and decode steps over L tokens equal (a query at a padding column t < starts[b] keeps nothing).
    chunk C (Llama 4's chunked layers): also (s - starts[b]) // C == (t - starts[b]) // C, the chunks of
    the row's positions (`decode_positions`), counted from its first token."""
    starts = check_starts(starts, np.shape(starts)[0] if starts is not None else 1, L)
    t = np.arange(L)[:, None]  # (L, 1)
    s = np.arange(L)[None, :]  # (1, L)
    keep = (s >= starts[:, None, None]) & (s <= t)  # (B, L, L)
    if chunk is not None:
        _check_chunk(chunk)
        p, q = s - starts[:, None, None], t - starts[:, None, None]  # the key's and the query's positions
        keep &= (p // chunk) == (q // chunk)
    return keep[:, None]


def decode_positions(starts, L: int) -> np.ndarray:
    """(B, L) int64: the RoPE position of the token in column t of row b, t - starts[b] (negative
    on left padding, which nothing attends)."""
    starts = check_starts(starts, np.shape(starts)[0] if starts is not None else 1, L)
    return np.arange(L, dtype=np.int64)[None, :] - starts[:, None]


@dataclass(frozen=True)
class Decoded:
    """What `decode` computed: outputs of every call stacked over the tokens, and the final cache.

    The cache is in torch's (Hugging Face's) layout; slots from `lengths` on hold zeros.
    `scores` and `weights` hold one array per call (the prefill, if any, then each step).
    """

    output: np.ndarray  # (B, L, E)
    k_rot: np.ndarray  # (B, K, C, H): the keys after RoPE (the keys themselves without RoPE)
    v: np.ndarray  # (B, K, C, H)
    starts: np.ndarray  # (B,) int64
    lengths: np.ndarray  # (B,) int64, L in every row
    scores: tuple[np.ndarray, ...]  # each (B, N, T_call, C), scaled, -inf where not attended
    weights: tuple[np.ndarray, ...]  # each (B, N, T_call, C), after the masked-row policy


def _slot_positions(slots: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(B, T) RoPE positions of the tokens written to `slots` (B, T): their slot minus the row's padding."""
    return slots - starts[:, None]


def _cache_keep(slots: np.ndarray, starts: np.ndarray, capacity: int, chunk=None) -> np.ndarray:
    """bool (B, 1, T, C): the token written to slots[b, i] attends slots starts[b] <= s <= slots[b, i]; with
    chunk C (Llama 4) only those whose position s - starts[b] is in its own chunk of C positions."""
    s = np.arange(capacity)
    start, last = starts[:, None, None, None], slots[:, None, :, None]
    keep = (s >= start) & (s <= last)
    return keep if chunk is None else keep & ((s - start) // chunk == (last - start) // chunk)


def _decode_sizes(x: np.ndarray, E: int, capacity, prefill) -> tuple[int, int, int]:
    """(B, L, C) of a decode of x (B, L, E) into a cache of `capacity` slots (default L); ValueErrors name
    a wrong shape, capacity or prefill."""
    if x.ndim != 3 or x.shape[-1] != E:
        raise ValueError(f"x must have shape (B, L, E={E}), got {x.shape}")
    B, L, _ = x.shape
    C = L if capacity is None else capacity
    if isinstance(C, bool) or not isinstance(C, (int, np.integer)) or C < L:
        raise ValueError(f"capacity must be an int >= L={L} (the tokens decoded), got {capacity!r}")
    if isinstance(prefill, bool) or not isinstance(prefill, (int, np.integer)) or not 0 <= prefill <= L:
        raise ValueError(f"prefill must be an int in [0, L={L}], got {prefill!r}")
    return B, L, C


def decode(sd, x, *, starts=None, prefill: int, num_heads: int, masked_rows: str = "nan",
           num_kv_heads: int | None = None, rope: str | None = None, rope_theta: float = 10000.0,
           dtype=np.float64, capacity: int | None = None, qk_norm=None, qk_norm_eps: float = 1e-6,
           qk_norm_offset: float = 0.0, scale=None, softcap=None, rope_dim=None, rope_scaling=None,
           attn_temperature_tuning: bool = False, floor_scale: float = 8192.0, attn_scale: float = 0.1,
           chunk=None) -> Decoded:
    """Self-attention over x (B, L, E) run as a decoder: a prefill of the first `prefill` tokens,
    then one token per call, each call projecting only its new tokens against a cache.

    The cache holds the K key/value heads' rotated keys and values in `capacity` slots per row
    (default L); row b's prompt is left-padded by starts[b] tokens. A call writes its T new tokens
    to the row's next slots, rotates their q and k at position slot - starts[b], and new token i
    attends the slots starts[b] <= s <= its own slot. A query that attends nothing (a padding
    column) follows `masked_rows` as `forward` does; "uniform" spreads its weight over the C slots
    of the cache as they stand after the call's write (unwritten slots hold zeros). This path
    shares no masking or position code with `forward`, so `forward` with `decode_keep` and
    `decode_positions` is an independent check of it. A low `dtype` rounds each stage as `forward`.
    qk_norm, scale, softcap, sinks, rope_dim and rope_scaling are `forward`'s (the cache holds the normalised,
    rotated keys). LongRoPE picks its table per call from the largest position of the call's new tokens
    (over the batch); the keys cached before keep the rotation they were written with. Llama 4's qk_norm="l2"
    (after RoPE) and NoPE temperature (at the new tokens' positions, slot - starts[b]) as `forward` has them;
    chunk C (its chunked layers): a new token attends only the slots whose position (slot - starts[b]) is in
    its own chunk, position // C.
    """
    if chunk is not None:
        _check_chunk(chunk)
    cfg = config_of(sd, num_heads, masked_rows=masked_rows, num_kv_heads=num_kv_heads, rope=rope,
                    rope_theta=rope_theta, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps, qk_norm_offset=qk_norm_offset,
                    scale=scale, softcap=softcap, rope_dim=rope_dim, rope_scaling=rope_scaling,
                    attn_temperature_tuning=attn_temperature_tuning, floor_scale=floor_scale, attn_scale=attn_scale)
    E, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.kv_heads, cfg.head_size
    x = np.asarray(x)
    B, L, C = _decode_sizes(x, E, capacity, prefill)
    starts = check_starts(starts, B, C)
    acc = _accumulation_dtype(dtype)
    xs = _round(x.astype(np.float64), dtype)

    k_cache = np.zeros((B, K, C, H))  # (B, K, C, H)
    v_cache = np.zeros((B, K, C, H))
    outputs, all_scores, all_weights = [], [], []
    calls = ([(0, prefill)] if prefill else []) + [(t, t + 1) for t in range(prefill, L)]
    for lo, hi in calls:
        T = hi - lo
        slots = np.broadcast_to(np.arange(lo, hi), (B, T))  # (B, T): every row has written lo slots
        q, k, v = _decode_qkv(xs[:, lo:hi], sd, cfg, _slot_positions(slots, starts), dtype, acc)
        k_cache[:, :, lo:hi], v_cache[:, :, lo:hi] = k, v
        # (B, 1, T, C); a full layer's call names no chunk (as the modules call keep_mask)
        keep = _cache_keep(slots, starts, C) if chunk is None else _cache_keep(slots, starts, C, chunk)
        scores, weights, context = _attend_cache(q, k_cache, v_cache, keep, masked_rows, dtype, acc, cfg,
                                                 sd.get("sinks"))
        outputs.append(_linear(context, sd, "out_proj", dtype))
        all_scores.append(scores)
        all_weights.append(weights)
    output = np.concatenate(outputs, axis=1) if outputs else np.zeros((B, 0, E))
    return Decoded(output, k_cache, v_cache, starts, np.full(B, L, np.int64), tuple(all_scores), tuple(all_weights))


def _decode_qkv(x, sd, cfg: AttentionConfig, positions, dtype, acc):
    """One decode call's new tokens x (B, T, E) at their positions (B, T) -> q (B, N, T, H) and the k, v
    (B, K, T, H) the cache stores: projected, QK-normed, rotated, Llama 4's L2 norm and temperature, as `forward`."""
    B, T = x.shape[:2]
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    q = _linear(x, sd, "q_proj", dtype).reshape(B, T, N, H).transpose(0, 2, 1, 3)  # (B, N, T, H)
    k = _linear(x, sd, "k_proj", dtype).reshape(B, T, K, H).transpose(0, 2, 1, 3)  # (B, K, T, H)
    v = _linear(x, sd, "v_proj", dtype).reshape(B, T, K, H).transpose(0, 2, 1, 3)
    if cfg.qk_norm in ("head", "flat"):
        q, k = _qk_norm(q, sd, "q_norm", cfg, dtype), _qk_norm(k, sd, "k_norm", cfg, dtype)
    pos = np.asarray(positions).astype(np.float64)[:, None, :, None]  # (B, 1, T, 1)
    if cfg.rope is not None:
        cos, sin = _cos_sin(pos, *_rope_table(cfg, pos.max() if pos.size else -1), acc)  # (B, 1, T, R/2)
        q, k = _round(rotate(q, cos, sin, cfg.rope), dtype), _round(rotate(k, cos, sin, cfg.rope), dtype)
    q, k = _l2_norm(q, cfg, dtype), _l2_norm(k, cfg, dtype)  # Llama 4: after RoPE ("l2" only)
    if cfg.attn_temperature_tuning:
        q = _temperature(q, pos, cfg, dtype)
    return q, k, v


def _attend_cache(q, k_cache, v_cache, keep, masked_rows: str, dtype, acc, cfg: AttentionConfig, sinks=None):
    """One decode call's attention of its queries q (B, N, T, H) over the cache (B, K, C, H) under keep
    (B, 1, T, C) -> scores, weights (B, N, T, C) and the context (B, T, N*H), each rounded as `forward` rounds it.
    A query that attends nothing spreads a "uniform" row over the cache's C slots."""
    B, N, T, H = q.shape
    K, C = k_cache.shape[1], k_cache.shape[2]
    G = N // K
    scores = np.einsum("BKGTH,BKCH->BKGTC", q.reshape(B, K, G, T, H), k_cache).reshape(B, N, T, C)
    scores, weights, _ = _softmax(_logits(scores, cfg, acc), keep, sinks, masked_rows, acc, dtype)
    context = _round(np.einsum("BKGTC,BKCH->BKGTH", weights.reshape(B, K, G, T, C), v_cache), dtype)
    return scores, weights, context.reshape(B, N, T, H).transpose(0, 2, 1, 3).reshape(B, T, N * H)


def structured_keep(T: int, S: int, *, is_causal: bool = False, window=None, segment_ids=None,
                    key_segment_ids=None, alignment: str = "top-left", chunk=None) -> np.ndarray | None:
    """The keep-mask the structured keywords stand for (docs/semantics.md, "Packed sequences,
    sliding windows and causal alignment"): bool (B|1, 1, T, S), or None when none is given.

    Query t sits at key position a(t) = t (top-left) or t + S - T (bottom-right); is_causal keeps
    s <= a(t); window (left, right) keeps a(t) - left <= s <= a(t) + right; segment_ids (B, T)
    and key_segment_ids (B, S) keep equal ids (key_segment_ids defaults to segment_ids when T = S).
    chunk C (Llama 4's chunked attention, transformers' chunked_overlay AND causal): keeps s <= a(t) with
    a(t) // C == s // C; it implies is_causal (a chunk is causal within it).
    """
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment={alignment!r} is not one of {ALIGNMENTS}")
    left, right = window_sides(window)
    keep = None
    a = np.arange(T)[:, None] + (S - T if alignment == "bottom-right" else 0)  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    if chunk is not None:
        _check_chunk(chunk)
        keep = (s <= a) & (a // chunk == s // chunk)
    elif is_causal:
        keep = s <= a
    if left is not None or right is not None:
        inside = np.ones((T, S), bool)
        if left is not None:
            inside &= s >= a - left
        if right is not None:
            inside &= s <= a + right
        keep = inside if keep is None else keep & inside
    keep = None if keep is None else keep[None, None]  # (1, 1, T, S)
    if segment_ids is None and key_segment_ids is not None:
        raise ValueError("key_segment_ids without segment_ids: pass the queries' segment ids too")
    if segment_ids is not None:
        q_seg = np.asarray(segment_ids)
        if key_segment_ids is None:
            if T != S:
                raise ValueError(f"segment_ids {q_seg.shape} with T={T} != S={S}: pass key_segment_ids (B, S) too")
            key_segment_ids = q_seg
        k_seg = np.asarray(key_segment_ids)
        for name, x, L in (("segment_ids", q_seg, T), ("key_segment_ids", k_seg, S)):
            if x.ndim != 2 or x.shape[1] != L or not np.issubdtype(x.dtype, np.integer):
                raise ValueError(f"{name} must be integers of shape (B, {L}), got {x.dtype} {x.shape}")
        if q_seg.shape[0] != k_seg.shape[0]:
            raise ValueError(f"segment_ids {q_seg.shape} and key_segment_ids {k_seg.shape} have different batches")
        same = (q_seg[:, None, :, None] == k_seg[:, None, None, :])  # (B, 1, T, S)
        keep = same if keep is None else keep & same
    return keep


def segment_positions(segment_ids) -> np.ndarray:
    """(B, L) int64 positions that restart at 0 with each document: the index of a token among the
    earlier tokens of its row with the same segment id, counted from the segment's first token
    (a segment is a run of equal ids)."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(f"segment_ids must be integers of shape (B, L), got {seg.dtype} {seg.shape}")
    B, L = seg.shape
    idx = np.broadcast_to(np.arange(L), (B, L))
    starts = np.ones((B, L), bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)  # (B, L): where each run began
    return (idx - first).astype(np.int64)
