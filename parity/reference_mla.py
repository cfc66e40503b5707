"""The oracle of multi-head latent attention (DeepSeek V2/V3): float64 NumPy, independent of both frameworks.

Written from transformers' DeepseekV3Attention (the maths in `mha_spec.mla`'s docstring), sharing with the
modules only the configuration's validation (`LatentAttentionConfig`): the RoPE frequencies and attention
factor are `parity.reference`'s own writing of the definition (`rope_inv_freq`, `rope_attention_factor`),
the softmax scale's mscale is written here again. `forward` returns every stage, `backward` is the
hand-derived vector-Jacobian product, `decode` runs the layer against a LATENT cache (c and the rotated
k_pe per token) and must equal one causal `forward` (`reference.decode_keep`, `reference.decode_positions`).

Legend: B batch, T query length, S key length (= T: MLA is self-attention), N heads, E embed dim,
C = kv_lora_rank, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim, Q = q_lora_rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, check_positions
from mha_spec.mla import LatentAttentionConfig
from parity.reference import (as_float64, check_starts, keep_mask, rope_attention_factor, rope_inv_freq, rotate,
                              structured_keep)

MLA_STAGES = ("q", "c", "k_pe", "q_rot", "k", "v", "scores", "weights", "context", "output")
"""The stages of `forward` in the order the data flows."""


@dataclass(frozen=True)
class LatentIntermediates:
    q: np.ndarray  # (B, N, T, Dn + Dr): the query projection, before RoPE
    c: np.ndarray  # (B, S, C): the latent after kv_a_norm (what the cache holds)
    k_pe: np.ndarray  # (B, 1, S, Dr): the shared rope key after RoPE (what the cache holds)
    q_rot: np.ndarray  # (B, N, T, Dn + Dr): the attended query, q_nope then the rotated q_pe
    k: np.ndarray  # (B, N, S, Dn + Dr): the attended key, k_nope (kv_b_proj of c) then k_pe for every head
    v: np.ndarray  # (B, N, S, Dv)
    scores: np.ndarray  # (B, N, T, S): scaled, -inf where masked
    weights: np.ndarray  # (B, N, T, S): after the masked-row policy
    context: np.ndarray  # (B, T, N·Dv), heads concatenated
    output: np.ndarray  # (B, T, E)
    q_latent: np.ndarray | None = None  # (B, T, Q): q_a_proj after q_a_norm; None without q_lora_rank


def mscale(factor: float, m: float) -> float:
    """DeepSeek's yarn_get_mscale: 0.1·m·ln(factor) + 1, and 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def softmax_scale(cfg: LatentAttentionConfig) -> float:
    """(Dn + Dr) ** -0.5, times mscale(factor, mscale_all_dim)² when the RoPE is scaled and sets
    mscale_all_dim (transformers' yarn_apply_mscale: a zero/absent mscale_all_dim leaves the scale)."""
    s = cfg.rope_scaling
    m = mscale(s.factor, s.mscale_all_dim) if s is not None and s.mscale_all_dim else 1.0
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * m * m


def config_of_mla(sd, num_heads: int, **fields) -> LatentAttentionConfig:
    """The MLA layer a canonical state dict describes. embed_dim is kv_a_proj.weight's input width, bias is
    read off kv_a_proj.bias; `fields` are LatentAttentionConfig's others (kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, q_lora_rank, rope, rope_theta, rope_scaling, norm_eps). ValueError naming
    the missing/unexpected keys or the tensor whose shape is not the layer's."""
    if "kv_a_proj.weight" not in sd:
        raise ValueError(f"state dict has no 'kv_a_proj.weight' (an MLA layer's latent projection); keys: {sorted(sd)}")
    if np.ndim(sd["kv_a_proj.weight"]) != 2:
        raise ValueError(f"kv_a_proj.weight must be 2-D (C + Dr, E), got shape {np.shape(sd['kv_a_proj.weight'])}")
    cfg = LatentAttentionConfig(np.shape(sd["kv_a_proj.weight"])[1], num_heads, bias="kv_a_proj.bias" in sd, **fields)
    expected = cfg.weight_shapes()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state dict keys do not describe the MLA layer: missing {missing}, unexpected {unexpected} "
                         f"(q_lora_rank={cfg.q_lora_rank}: q_proj without it, q_a_proj/q_a_norm/q_b_proj with it; "
                         "biases on q_a_proj, kv_a_proj, out_proj together)")
    for name, shape in expected.items():
        if tuple(np.shape(sd[name])) != shape:
            raise ValueError(f"{name} has shape {tuple(np.shape(sd[name]))}, expected {shape} (E={cfg.embed_dim}, "
                             f"N={num_heads}, C={cfg.kv_lora_rank}, Dn={cfg.qk_nope_head_dim}, "
                             f"Dr={cfg.qk_rope_head_dim}, Dv={cfg.v_head_dim}, Q={cfg.q_lora_rank})")
    return cfg


def _layer(sd, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank, rope,
           rope_theta, rope_scaling, norm_eps, masked_rows) -> tuple[LatentAttentionConfig, dict]:
    """(the config, the weights as float64) of forward/backward/decode's keywords; checks masked_rows."""
    if masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
    cfg = config_of_mla(sd, num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank,
                        rope=rope, rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps)
    return cfg, {k: as_float64(v) for k, v in sd.items()}


def _x(x, E: int) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 3 or x.shape[-1] != E:
        raise ValueError(f"x must have shape (B, T, E={E}), got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) and x.dtype.kind != "V":
        raise TypeError(f"x must be floating point, got {x.dtype}")
    return as_float64(x)


def _same(x):
    return x


def _rounding(dtype):
    """(r, r_acc): round float64 values to `dtype` and back ("stored in dtype"), and to the dtype a layer in it
    accumulates and normalises in (float32 for 16-bit); identities for float64."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        return _same, _same
    acc = np.dtype(np.float32) if dt.itemsize < 4 else dt

    def r(x):
        return np.asarray(x, dt).astype(np.float64)

    def r_acc(x):
        return np.asarray(x, acc).astype(np.float64)

    return r, r_acc


def _linear(x, W, name, r=_same):
    y = x @ W[f"{name}.weight"].T
    return r(y + W[f"{name}.bias"] if f"{name}.bias" in W else y)


def _rms_norm(x, w, eps, r=_same, r_acc=_same):
    """w · x / sqrt(mean(x²) + eps) over the last axis (DeepseekV3RMSNorm, float64 here; with a rounding, the
    normalised x in the accumulation dtype, the product stored in the dtype)."""
    return r(w * r_acc(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)))


def _rms_norm_backward(d_y, x, w, eps):
    """(dx, dw) of y = w·n, n = x / rms: dx = (dn - n·mean(dn·n)) / rms with dn = d_y·w."""
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    n = x / rms
    dn = d_y * w
    return (dn - n * np.mean(dn * n, axis=-1, keepdims=True)) / rms, (d_y * n).reshape(-1, n.shape[-1]).sum(axis=0)


def _cos_sin(pos, cfg: LatentAttentionConfig):
    """pos (B|1, 1, L, 1) float64 -> (cos, sin) (B|1, 1, L, Dr/2), times the attention factor."""
    angles = pos * rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    factor = rope_attention_factor(cfg.rope_scaling)
    return factor * np.cos(angles), factor * np.sin(angles)


def _positions(positions, B: int, T: int) -> np.ndarray:
    """Integer positions (T,) | (B, T) -> float64 (B|1, 1, T, 1), default arange(T)."""
    if positions is None:
        return np.arange(T, dtype=np.float64).reshape(1, 1, T, 1)
    p = np.asarray(positions)
    if not np.issubdtype(p.dtype, np.integer):
        raise TypeError(f"positions must be integers, got dtype {p.dtype}")
    check_positions(p.shape, B, T, "positions")
    return p.astype(np.float64).reshape(p.shape[0] if p.ndim == 2 else 1, 1, T, 1)


def _query(xs, W, cfg: LatentAttentionConfig, r=_same, r_acc=_same):
    """(q (B, N, T, Dn+Dr) before RoPE, the normalised q latent (B, T, Q) or None)."""
    B, T, _ = xs.shape
    if cfg.q_lora_rank is None:
        q, latent = _linear(xs, W, "q_proj", r), None
    else:
        latent = _rms_norm(_linear(xs, W, "q_a_proj", r), W["q_a_norm.weight"], cfg.norm_eps, r, r_acc)
        q = _linear(latent, W, "q_b_proj", r)
    return q.reshape(B, T, cfg.num_heads, cfg.qk_head_dim).transpose(0, 2, 1, 3), latent


def _latent(xs, W, cfg: LatentAttentionConfig, r=_same, r_acc=_same):
    """(c (B, S, C) after kv_a_norm, k_pe (B, 1, S, Dr) before RoPE)."""
    kv = _linear(xs, W, "kv_a_proj", r)  # (B, S, C + Dr)
    C = cfg.kv_lora_rank
    return _rms_norm(kv[..., :C], W["kv_a_norm.weight"], cfg.norm_eps, r, r_acc), kv[:, None, :, C:]


def _expand(c, k_pe, W, cfg: LatentAttentionConfig, r=_same):
    """The latent c (B, S, C) and the rotated k_pe (B, 1, S, Dr) -> keys (B, N, S, Dn+Dr), values (B, N, S, Dv):
    kv_b_proj per head (its Dn key rows then its Dv value rows), the one k_pe behind every head's k_nope."""
    B, S, _ = c.shape
    N, Dn = cfg.num_heads, cfg.qk_nope_head_dim
    kv = r(c @ W["kv_b_proj.weight"].T).reshape(B, S, N, Dn + cfg.v_head_dim).transpose(0, 2, 1, 3)
    k = np.concatenate([kv[..., :Dn], np.broadcast_to(k_pe, (B, N, S, cfg.qk_rope_head_dim))], axis=-1)
    return k, kv[..., Dn:]


def _softmax(scores, keep, masked_rows: str):
    """(scores -inf where masked, weights (B, N, T, S)); a row that keeps no key follows `masked_rows` as
    `reference.forward` applies it: NaN, zeros, or 1/S over its S keys (reference's helper is private)."""
    if keep is None:
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return scores, e / e.sum(axis=-1, keepdims=True)
    scores = np.where(keep, scores, -np.inf)
    row_any = keep.any(axis=-1, keepdims=True)
    safe = np.where(row_any, scores, 0.0)
    e = np.where(keep, np.exp(safe - safe.max(axis=-1, keepdims=True)), 0.0)
    e = e / np.where(row_any, e.sum(axis=-1, keepdims=True), 1.0)
    fill = np.nan if masked_rows == "nan" else 0.0 if masked_rows == "zero" else 1.0 / scores.shape[-1]
    return scores, np.where(row_any, e, fill)


def _attend(q_rot, k, v, keep, cfg, masked_rows, W, r=_same, r_acc=_same):
    """(scores, weights (B, N, T, S), context (B, T, N·Dv), output (B, T, E)) of the attended q and k; with a
    rounding the scores and the softmax in the accumulation dtype, the weights, context and output stored."""
    B, N, T, _ = q_rot.shape
    scores = r_acc(np.einsum("BNTD,BNSD->BNTS", q_rot, k) * softmax_scale(cfg))
    scores, weights = _softmax(scores, keep, masked_rows)
    weights = r(r_acc(weights))
    context = r(np.einsum("BNTS,BNSD->BTND", weights, v).reshape(B, T, N * cfg.v_head_dim))
    return scores, weights, context, _linear(context, W, "out_proj", r)


def forward(sd, x, mask=None, *, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
            v_head_dim: int, q_lora_rank: int | None = None, rope: str = "interleaved", rope_theta: float = 10000.0,
            rope_scaling=None, norm_eps: float = 1e-6, masked_rows: str = "nan", positions=None,
            is_causal: bool = False, dtype=np.float64) -> LatentIntermediates:
    """MLA self-attention over x (B, T, E), stage by stage, in float64.

    `mask` is a keep-mask as `reference.forward` takes it ((T, S), (B, T, S), (B|1, N|1, T, S), nonzero = keep),
    ANDed with the causal one under `is_causal`; a row that keeps nothing follows `masked_rows`. `positions`
    (T,) | (B, T) integers (default arange(T)) rotate q_pe and the shared k_pe over Dr by the layer's
    convention `rope`, frequencies and attention factor of `rope_scaling` (a `mha_spec.RopeScaling`).
    `dtype` other than float64 runs the same maths as a layer in that dtype stores it (the three-way judge's
    yardstick): inputs and weights rounded to it, each stage computed in float64 and rounded -- projections,
    the norms' product and rotated q_pe/k_pe to the dtype, the normalisation, cos/sin, scores and softmax to
    its accumulation dtype (float32 for 16-bit) --, the stages returned as float64.
    """
    cfg, W = _layer(sd, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank,
                    rope, rope_theta, rope_scaling, norm_eps, masked_rows)
    r, r_acc = _rounding(dtype)
    W = {n: r(w) for n, w in W.items()}
    xs = r(_x(x, cfg.embed_dim))
    B, T, _ = xs.shape
    keep = _keep(mask, is_causal, B, num_heads, T)
    cos, sin = (r_acc(a) for a in _cos_sin(_positions(positions, B, T), cfg))  # (B|1, 1, T, Dr/2)
    q, q_latent = _query(xs, W, cfg, r, r_acc)
    c, k_pe_raw = _latent(xs, W, cfg, r, r_acc)
    Dn = cfg.qk_nope_head_dim
    q_rot = np.concatenate([q[..., :Dn], r(rotate(q[..., Dn:], cos, sin, rope))], axis=-1)
    k_pe = r(rotate(k_pe_raw, cos, sin, rope))  # (B, 1, S, Dr)
    k, v = _expand(c, k_pe, W, cfg, r)
    scores, weights, context, output = _attend(q_rot, k, v, keep, cfg, masked_rows, W, r, r_acc)
    return LatentIntermediates(q, c, k_pe, q_rot, k, v, scores, weights, context, output, q_latent)


def _keep(mask, is_causal: bool, B: int, N: int, T: int):
    """bool (B|1, N|1, T, T) keep-mask of `mask` AND causal, or None."""
    keep = keep_mask(mask, B, N, T, T)
    causal = structured_keep(T, T, is_causal=is_causal)
    if causal is None:
        return keep
    return causal if keep is None else keep & causal


# ---------------------------------------------------------------- backward


def backward(sd, x, mask, cotangent, *, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
             qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, rope: str = "interleaved",
             rope_theta: float = 10000.0, rope_scaling=None, norm_eps: float = 1e-6, masked_rows: str = "nan",
             positions=None, is_causal: bool = False) -> dict[str, np.ndarray]:
    """Gradients of sum(output · cotangent) w.r.t. x ("x") and every canonical weight (its own name), float64.

    Each step's transpose: the out projection, the softmax (a row that keeps nothing is a constant of the
    policy: no gradient through its scores), the scale, the split of q·k into its nope and rope parts, RoPE
    (rotation by minus the angle, the same attention factor), the shared k_pe's gradient summed over the N
    heads, kv_b_proj, the RMSNorms, the a-projections; x's gradient sums the query's and the latent's paths.
    """
    layer = dict(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                 qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank, rope=rope,
                 rope_theta=rope_theta, rope_scaling=rope_scaling, norm_eps=norm_eps, masked_rows=masked_rows)
    f = forward(sd, x, mask, positions=positions, is_causal=is_causal, **layer)
    cfg, W = _layer(sd, **layer)
    xs = _x(x, cfg.embed_dim)
    B, T, E = xs.shape
    g = as_float64(cotangent)
    if g.shape != (B, T, E):
        raise ValueError(f"cotangent must have the output's shape {(B, T, E)}, got {g.shape}")
    grads = {"out_proj.weight": np.einsum("BTF,BTE->FE", g, f.context)}
    if "out_proj.bias" in W:
        grads["out_proj.bias"] = g.sum(axis=(0, 1))
    d_context = (g @ W["out_proj.weight"]).reshape(B, T, num_heads, v_head_dim).transpose(0, 2, 1, 3)  # (B,N,T,Dv)
    d_qk, d_v = _core_backward(f, d_context, _keep(mask, is_causal, B, num_heads, T), cfg)
    d_q_rot = d_qk @ f.k  # (B, N, T, Dn+Dr)
    d_k = np.einsum("BNTS,BNTD->BNSD", d_qk, f.q_rot)  # (B, N, S, Dn+Dr)
    cos, sin = _cos_sin(_positions(positions, B, T), cfg)
    Dn = qk_nope_head_dim
    d_q = np.concatenate([d_q_rot[..., :Dn], rotate(d_q_rot[..., Dn:], cos, -sin, rope)], axis=-1)
    d_k_pe = rotate(d_k[..., Dn:].sum(axis=1, keepdims=True), cos, -sin, rope)  # (B, 1, S, Dr): shared by N heads
    d_x = _latent_backward(d_k[..., :Dn], d_v, d_k_pe, f, xs, W, cfg, grads)
    d_x = d_x + _query_backward(d_q, f, xs, W, cfg, grads)
    grads["x"] = d_x
    return grads


def _core_backward(f: LatentIntermediates, d_context, keep, cfg):
    """(d of q·k (B, N, T, S) -- through the softmax and the scale --, d_v (B, N, S, Dv))."""
    d_weights = d_context @ f.v.transpose(0, 1, 3, 2)  # (B, N, T, S)
    d_v = np.einsum("BNTS,BNTD->BNSD", f.weights, d_context)
    row_any = np.ones((1, 1, 1, 1), bool) if keep is None else keep.any(axis=-1, keepdims=True)
    p = np.where(row_any, f.weights, 0.0)
    d_scores = np.where(row_any, p * (d_weights - (d_weights * p).sum(axis=-1, keepdims=True)), 0.0)
    return d_scores * softmax_scale(cfg), d_v


def _latent_backward(d_k_nope, d_v, d_k_pe, f: LatentIntermediates, xs, W, cfg, grads):
    """kv_b_proj's, kv_a_norm's and kv_a_proj's gradients into `grads`; returns x's share (B, S, E).
    d_k_nope (B, N, S, Dn), d_v (B, N, S, Dv), d_k_pe (B, 1, S, Dr) before RoPE."""
    B, N, S, _ = d_v.shape
    d_kv = np.concatenate([d_k_nope, d_v], axis=-1).transpose(0, 2, 1, 3).reshape(B, S, -1)  # (B, S, N(Dn+Dv))
    grads["kv_b_proj.weight"] = np.einsum("BSF,BSC->FC", d_kv, f.c)
    d_c = d_kv @ W["kv_b_proj.weight"]  # (B, S, C)
    kv_a = _linear(xs, W, "kv_a_proj")
    d_c_raw, grads["kv_a_norm.weight"] = _rms_norm_backward(d_c, kv_a[..., :cfg.kv_lora_rank],
                                                            W["kv_a_norm.weight"], cfg.norm_eps)
    d_kv_a = np.concatenate([d_c_raw, d_k_pe[:, 0]], axis=-1)  # (B, S, C + Dr)
    grads["kv_a_proj.weight"] = np.einsum("BSF,BSE->FE", d_kv_a, xs)
    if "kv_a_proj.bias" in W:
        grads["kv_a_proj.bias"] = d_kv_a.sum(axis=(0, 1))
    return d_kv_a @ W["kv_a_proj.weight"]


def _query_backward(d_q, f: LatentIntermediates, xs, W, cfg, grads):
    """The query path's gradients into `grads` from d_q (B, N, T, Dn+Dr) before RoPE; returns x's share."""
    B, N, T, D = d_q.shape
    d_proj = d_q.transpose(0, 2, 1, 3).reshape(B, T, N * D)
    if cfg.q_lora_rank is None:
        grads["q_proj.weight"] = np.einsum("BTF,BTE->FE", d_proj, xs)
        return d_proj @ W["q_proj.weight"]
    grads["q_b_proj.weight"] = np.einsum("BTF,BTQ->FQ", d_proj, f.q_latent)
    d_latent = d_proj @ W["q_b_proj.weight"]  # (B, T, Q)
    d_qa, grads["q_a_norm.weight"] = _rms_norm_backward(d_latent, _linear(xs, W, "q_a_proj"),
                                                        W["q_a_norm.weight"], cfg.norm_eps)
    grads["q_a_proj.weight"] = np.einsum("BTF,BTE->FE", d_qa, xs)
    if "q_a_proj.bias" in W:
        grads["q_a_proj.bias"] = d_qa.sum(axis=(0, 1))
    return d_qa @ W["q_a_proj.weight"]


# ---------------------------------------------------------------- decoding with a latent cache


@dataclass(frozen=True)
class LatentDecoded:
    """What `decode` computed: the outputs of every call stacked over the tokens, and the final latent cache
    (slot s of row b holds token s's c and rotated k_pe, left padding included)."""

    output: np.ndarray  # (B, L, E)
    c: np.ndarray  # (B, L, C)
    k_pe: np.ndarray  # (B, L, Dr)
    starts: np.ndarray  # (B,) int64


def decode(sd, x, *, prefill: int, starts=None, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
           qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, rope: str = "interleaved",
           rope_theta: float = 10000.0, rope_scaling=None, norm_eps: float = 1e-6, masked_rows: str = "nan",
           absorbed: bool = False) -> LatentDecoded:
    """MLA over x (B, L, E) run as a decoder: a prefill of the first `prefill` tokens, then one token per call.

    Each call projects only its new tokens, writes their c and rotated k_pe to the row's next slots of the
    latent cache (RoPE position slot - starts[b], starts[b] the row's left padding) and lets new token i
    attend the slots starts[b] <= s <= its own. The keys and values come from the cache through kv_b_proj
    (naive), or with `absorbed` kv_b_proj's key half is folded into the query and its value half applied
    after the weighted sum of latents (DeepSeek's inference form); the two are equal. A query that attends
    nothing (a padding column) follows `masked_rows` ("uniform" over the L slots of the cache as they stand
    after the call's write, unwritten slots holding zeros, as `reference.decode`). No code of `forward`'s
    masking or positions is shared: `forward` with decode_keep/decode_positions is an independent check.
    """
    cfg, W = _layer(sd, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank,
                    rope, rope_theta, rope_scaling, norm_eps, masked_rows)
    xs = _x(x, cfg.embed_dim)
    B, L, _ = xs.shape
    if isinstance(prefill, bool) or not isinstance(prefill, (int, np.integer)) or not 0 <= prefill <= L:
        raise ValueError(f"prefill must be an int in [0, L={L}], got {prefill!r}")
    starts = check_starts(starts, B, L)
    c_cache, pe_cache = np.zeros((B, L, kv_lora_rank)), np.zeros((B, 1, L, qk_rope_head_dim))
    outputs = []
    for lo, hi in ([(0, prefill)] if prefill else []) + [(t, t + 1) for t in range(prefill, L)]:
        slots = np.arange(lo, hi)  # (T,): every row writes the same slots
        pos = (slots[None, :] - starts[:, None]).astype(np.float64)[:, None, :, None]  # (B, 1, T, 1)
        cos, sin = _cos_sin(pos, cfg)
        q, _ = _query(xs[:, lo:hi], W, cfg)
        c, k_pe = _latent(xs[:, lo:hi], W, cfg)
        Dn = qk_nope_head_dim
        q = np.concatenate([q[..., :Dn], rotate(q[..., Dn:], cos, sin, rope)], axis=-1)
        c_cache[:, lo:hi], pe_cache[:, :, lo:hi] = c, rotate(k_pe, cos, sin, rope)
        s = np.arange(L)
        keep = (s >= starts[:, None, None, None]) & (s <= slots[None, None, :, None])  # (B, 1, T, L)
        attend = _attend_absorbed if absorbed else _attend_naive
        outputs.append(attend(q, c_cache, pe_cache, keep, cfg, masked_rows, W))
    return LatentDecoded(np.concatenate(outputs, axis=1), c_cache, pe_cache[:, 0], starts)


def _attend_naive(q_rot, c_cache, pe_cache, keep, cfg, masked_rows, W):
    """The call's output (B, T, E): keys and values expanded from the whole latent cache."""
    k, v = _expand(c_cache, pe_cache, W, cfg)
    return _attend(q_rot, k, v, keep, cfg, masked_rows, W)[3]


def _attend_absorbed(q_rot, c_cache, pe_cache, keep, cfg, masked_rows, W):
    """The call's output (B, T, E) with kv_b_proj absorbed: q_nope·k_nope = (q_nope·W_uk)·c per head and
    weights·v = (weights·c)·W_uvᵀ, so no per-head key or value is ever formed."""
    B, N, T, _ = q_rot.shape
    Dn, Dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    w_kv = W["kv_b_proj.weight"].reshape(N, Dn + Dv, cfg.kv_lora_rank)  # per head: Dn key rows, Dv value rows
    q_c = np.einsum("BNTD,NDC->BNTC", q_rot[..., :Dn], w_kv[:, :Dn])  # (B, N, T, C)
    logits = np.einsum("BNTC,BSC->BNTS", q_c, c_cache) + q_rot[..., Dn:] @ pe_cache.transpose(0, 1, 3, 2)
    _, weights = _softmax(logits * softmax_scale(cfg), keep, masked_rows)
    context = np.einsum("BNTS,BSC,NDC->BTND", weights, c_cache, w_kv[:, Dn:]).reshape(B, T, N * Dv)
    return _linear(context, W, "out_proj")
