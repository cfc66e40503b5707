"""A hand-written PyTorch port of Llama 4's text attention, and the same port with each slip it invites.

    mha-parity --cases "*llama4*" --impl parity.examples.llama4_torch:port
    mha-parity --cases "chunked-llama4*" --impl parity.examples.llama4_torch:chunk_off_by_one

`port` is written from transformers' Llama4TextAttention, not from `mha_spec`: q/k/v projections (K key/value
heads, a head dim of its own, the biases the layer has); on a RoPE layer, consecutive pairs rotated as complex
numbers (apply_rotary_emb: our rope="interleaved") by cos/sin of the positions, then the weightless L2 norm
x · rsqrt(mean(x²) + eps) of each head's q and k (Llama4TextL2Norm, use_qk_norm); on a NoPE layer with
attn_temperature_tuning, the queries times log(floor((pos + 1) / floor_scale) + 1) · attn_scale + 1; the
scores scaled by H^-1/2; the chunked mask built from chunk=C (structured, takes_chunk: a query keeps key s
iff s <= its key position a and s // C == a // C, chunks counted from key 0, a = t + S - T bottom-right);
softmax; o_proj. It computes in float64 for float64 and float32 otherwise, and exposes its stages (q, k, v
as projected; q_rot, k_rot after RoPE and the norm; scores, weights, context, output), so the harness names
the first stage a slip reaches.

The slips (`BUGS`, each an implementation of its own; tests/test_llama4_harness.py):
chunk-off-by-one        the chunks counted from key 1, (s + 1) // C == (a + 1) // C: each chunk's boundary one
                        token late: scores (a key the oracle keeps is -inf)
temperature-on-rope-layers  the temperature applied wherever attn_temperature_tuning is set in the model
                        (Llama4TextConfig's, with `MODEL_FLOOR_SCALE`), RoPE layers too, not only where
                        use_rope is false: scores (q_rot is before it)
norm-over-projection    the L2 norm over the whole q (N·H) and k (K·H) projection instead of each head: q_rot
norm-before-rope        the L2 norm before RoPE instead of after. Not a slip the harness can see, nor any
                        check on outputs: RoPE rotates each pair, so a head's sum of squares -- all the norm
                        reads -- is the same before and after it, and the two orders compute one function
                        (equal up to rounding); kept to show that, not planted as red
Legend: B batch, T query length, S key length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import math

import torch

from parity.impls import implementation

BUGS = ("chunk-off-by-one", "temperature-on-rope-layers", "norm-over-projection", "norm-before-rope")
# The model-wide temperature constants the slip "temperature-on-rope-layers" applies on a RoPE layer (whose
# layer description has none: on a RoPE layer the temperature is no part of Llama 4's attention); those of the
# matrix's NoPE case (nope-llama4), so that the drawn positions 1..~80 take several of its steps.
MODEL_FLOOR_SCALE, MODEL_ATTN_SCALE = 4.0, 0.1


def _linear(p, name, x):
    y = x @ p[f"{name}.weight"].transpose(0, 1)
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def _rotate_pairs(x, positions, theta: float, acc):
    """apply_rotary_emb: consecutive pairs (x0, x1) as x0 + i·x1 times e^(i·pos·θ^(-2j/H)). x (B, n, L, H)."""
    H = x.shape[-1]
    inv = theta ** (-torch.arange(0, H, 2, dtype=torch.float64) / H)  # (H/2,)
    angles = positions[:, None, :, None].to(torch.float64) * inv.to(positions.device)  # (B, 1, L, H/2)
    cos, sin = torch.cos(angles).to(acc), torch.sin(angles).to(acc)
    x0, x1 = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def _l2(x, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _temperature(positions, floor_scale: float, attn_scale: float, acc):
    """(B, 1, T, 1): log(floor((pos + 1) / floor_scale) + 1) · attn_scale + 1."""
    t = torch.log1p(torch.floor((positions.to(torch.float64) + 1.0) / floor_scale)) * attn_scale + 1.0
    return t.to(acc)[:, None, :, None]


def _chunk_keep(T: int, S: int, chunk: int, bug, device):
    """bool (T, S): query t (key position a = t + S - T) keeps key s <= a of its own chunk."""
    a = torch.arange(T, device=device)[:, None] + (S - T)
    s = torch.arange(S, device=device)[None, :]
    shift = 1 if bug == "chunk-off-by-one" else 0
    return (s <= a) & ((s + shift) // chunk == (a + shift) // chunk)


def _rope_and_norm(q, k, positions, key_positions, config, bug, acc):
    """q (B, N, T, H), k (B, K, S, H) rotated (RoPE layers) and L2-normed per head after RoPE (or as the bug has
    it: before RoPE -- the same numbers, RoPE keeps each head's norm --, or over the whole projection)."""
    if config.rope is None:
        return q, k
    eps = config.qk_norm_eps
    norm_first = bug == "norm-before-rope" and config.qk_norm == "l2"
    if norm_first:
        q, k = _l2(q, eps), _l2(k, eps)
    q, k = _rotate_pairs(q, positions, config.rope_theta, acc), _rotate_pairs(k, key_positions, config.rope_theta, acc)
    if config.qk_norm != "l2" or norm_first:
        return q, k
    if bug == "norm-over-projection":  # over every head's features at once
        (B, N, T, H), S, K = q.shape, k.shape[2], k.shape[1]
        q = _l2(q.transpose(1, 2).reshape(B, T, N * H), eps).view(B, T, N, H).transpose(1, 2)
        k = _l2(k.transpose(1, 2).reshape(B, S, K * H), eps).view(B, S, K, H).transpose(1, 2)
        return q, k
    return _l2(q, eps), _l2(k, eps)


def make_attention(config, *, bug: str | None = None):
    """fn(params, query, key, value, keep, *, positions=None, key_positions=None, is_causal=False, chunk=None,
    alignment="top-left") -> (output, weights) for `config` (an `mha_spec.AttentionConfig` of a Llama 4 layer),
    `fn.intermediates` its stages."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug {bug!r} is not one of {BUGS}")
    if config.rope not in (None, "interleaved") or config.qk_norm not in (None, "l2"):
        raise ValueError(f"the port is Llama 4's layer: rope interleaved or none, the L2 norm; got rope={config.rope!r}, "
                         f"qk_norm={config.qk_norm!r}")
    N, K, H = config.num_heads, config.kv_heads, config.head_size

    def stages(p, query, key, value, keep, *, positions=None, key_positions=None, is_causal=False, chunk=None,
               alignment="top-left"):
        B, T, _ = query.shape
        S = key.shape[1]
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        positions = torch.arange(T, device=query.device).expand(B, T) if positions is None else positions
        key_positions = torch.arange(S, device=query.device).expand(B, S) if key_positions is None else key_positions
        q = _linear(p, "q_proj", query).view(B, T, N, H).transpose(1, 2)  # (B, N, T, H)
        k = _linear(p, "k_proj", key).view(B, S, K, H).transpose(1, 2)  # (B, K, S, H)
        v = _linear(p, "v_proj", value).view(B, S, K, H).transpose(1, 2)  # (B, K, S, H)
        q_rot, k_rot = _rope_and_norm(q.to(acc), k.to(acc), positions, key_positions, config, bug, acc)
        q_hot = q_rot
        if config.rope is None and config.attn_temperature_tuning:
            q_hot = q_rot * _temperature(positions, config.floor_scale, config.attn_scale, acc)
        elif config.rope is not None and bug == "temperature-on-rope-layers":
            q_hot = q_rot * _temperature(positions, MODEL_FLOOR_SCALE, MODEL_ATTN_SCALE, acc)
        k_all, v_all = k_rot.repeat_interleave(N // K, dim=1), v.to(acc).repeat_interleave(N // K, dim=1)  # (B, N, S, H)
        scores = q_hot @ k_all.transpose(2, 3) * (1.0 / math.sqrt(H))  # (B, N, T, S)
        if chunk is not None:
            scores = scores.masked_fill(~_chunk_keep(T, S, chunk, bug, query.device), float("-inf"))
        elif is_causal:
            a = torch.arange(T, device=query.device)[:, None] + (S - T if alignment == "bottom-right" else 0)
            scores = scores.masked_fill(torch.arange(S, device=query.device)[None, :] > a, float("-inf"))
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        context = (weights @ v_all).transpose(1, 2).reshape(B, T, N * H)  # (B, T, N·H)
        out = _linear(p, "out_proj", context.to(query.dtype))
        return {"q": q, "k": k, "v": v, "q_rot": q_rot.to(query.dtype), "k_rot": k_rot.to(query.dtype),
                "scores": scores, "weights": weights.to(query.dtype), "context": context.to(query.dtype),
                "output": out}

    def attend(p, query, key, value, keep, **kw):
        s = stages(p, query, key, value, keep, **kw)
        return s["output"], s["weights"]

    attend.intermediates = stages
    return attend


# Llama 4's layers: grouped heads, a head dim of its own, any bias set (attention_bias), and on each layer the
# L2 norm after interleaved RoPE or the NoPE temperature. Not the classic layer (the port is of Llama 4's).
FEATURES = ("grouped", "rope-interleaved", "no-qkv-bias", "no-out-bias", "head-dim", "qk-norm-l2", "temperature")
DECLARED = {"framework": "torch", "mask": "keep", "masked_rows": "nan", "returns_weights": True,
            "variants": FEATURES, "classic": False, "structured": True, "takes_chunk": True}


def _declare(name: str, doc: str, bug: str | None = None):
    @implementation(name=name, doc=f"parity.examples.llama4_torch: {doc}", **DECLARED)
    def factory(state_dict, num_heads, *, dtype, device, problem):
        return make_attention(problem.config, bug=bug)

    return factory


port = _declare("llama4-torch-port", "a hand-written port of Llama 4's text attention")
PLANTED = {b: _declare(f"llama4-torch-{b}", f"the port with the slip {b!r}", b) for b in BUGS}
chunk_off_by_one, temperature_on_rope_layers, norm_over_projection, norm_before_rope = (PLANTED[b] for b in BUGS)
