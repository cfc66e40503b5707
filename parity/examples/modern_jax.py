"""A hand-written JAX port of the attention after Llama (Qwen3, Gemma 2/3, OLMo 2, GPT-OSS), and the same
port with each slip these layers invite.

    mha-parity --cases modern --impl parity.examples.modern_jax:port
    mha-parity --cases "gemma3*" --impl parity.examples.modern_jax:norm_without_offset

`port` is written from the models' definitions in plain jax.numpy: q/k/v projections with torch's (out,
in) weights and a head dim of the layer's own (N·H ≠ E), the QK RMSNorm before RoPE (over each head's
H, or over the whole projection for OLMo 2's "flat" norm; Gemma's weight is 1 + w; computed in float32 at
least), rotate-half RoPE, the logits scaled (Gemma: query_pre_attn_scalar^-½) and soft-capped before the
mask (Gemma 2), a sink logit per head joining each row's softmax and dropped after (GPT-OSS). It takes
the parameters under their canonical names (q_norm.weight, k_norm.weight, sinks too) and exposes its
intermediates, so the harness names the first stage a slip reaches.

The slips (`BUGS`, each an implementation of its own): the norm after RoPE (first wrong stage q_rot),
the per-head and flattened norms swapped (q_norm), w instead of 1 + w (q_norm), the norm in bfloat16
(q_norm), the cap forgotten (scores) or applied after the mask (weights: masked keys get weight), the
sinks dropped or applied as a sigmoid gate on the softmax (weights), H^-½ instead of the layer's scale
(scores).
Legend: B batch, T query length, S key length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_spec import VARIANT_FEATURES
from parity.examples.llama_jax import apply_rope, rope_cos_sin
from parity.impls import implementation

BUGS = ("qk-norm-after-rope", "norm-axis-swapped", "norm-without-offset", "norm-in-bfloat16", "softcap-missing",
        "softcap-after-mask", "sinks-dropped", "sinks-sigmoid", "default-scale")


def _norm(p, name: str, x, heads: int, config, bug):
    """x (B, L, heads·H) through the layer's RMSNorm `name`, as (B, L, heads, H) in x's dtype."""
    B, L, _ = x.shape
    H = config.head_size
    flat = (config.qk_norm == "flat") != (bug == "norm-axis-swapped")
    at = jnp.bfloat16 if bug == "norm-in-bfloat16" else jnp.promote_types(x.dtype, jnp.float32)
    y = (x if flat else x.reshape(B, L, heads, H)).astype(at)  # the normalised axis last
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + config.qk_norm_eps)
    offset = 0.0 if bug == "norm-without-offset" else config.qk_norm_offset
    w = p[f"{name}.weight"].astype(at)
    w = w if config.qk_norm == "head" else w.reshape(heads, H)  # the weight keeps the layer's own layout
    return (y.reshape(B, L, heads, H) * (offset + w)).astype(x.dtype)


def _softmax(scores, keep, p, config, bug):
    """weights (B, N, T, S) from the capped, masked logits: with sinks, each head's sink logit in the row."""
    if config.sinks and bug not in ("sinks-dropped", "sinks-sigmoid"):
        sink = jnp.broadcast_to(p["sinks"].astype(scores.dtype)[None, :, None, None], (*scores.shape[:3], 1))
        return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    weights = jax.nn.softmax(scores, axis=-1)
    if config.sinks and bug == "sinks-sigmoid":  # the sink read as a gate on each head
        weights = weights * jax.nn.sigmoid(p["sinks"].astype(scores.dtype))[None, :, None, None]
    return weights


def make_attention(config, *, bug: str | None = None):
    """fn(params, query, key, value, keep, *, positions=None, key_positions=None) -> (output, weights) for
    `config` (the problem's `mha_spec.AttentionConfig`), with `bug` (one of `BUGS`) planted."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug {bug!r} is not one of {BUGS}")
    N, K, H = config.num_heads, config.kv_heads, config.head_size

    def linear(x, p, name):
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    def rotated(x, positions, length):  # (B, L, n, H)
        return apply_rope(x, *rope_cos_sin(positions, length, H, config.rope_theta, x.dtype))

    def stages(p, query, key, value, keep, *, positions=None, key_positions=None):
        B, T, _ = query.shape
        S = key.shape[1]
        q_in, k_in = linear(query, p, "q_proj"), linear(key, p, "k_proj")  # (B, T, N·H), (B, S, K·H)
        q, k = q_in.reshape(B, T, N, H), k_in.reshape(B, S, K, H)
        v = linear(value, p, "v_proj").reshape(B, S, K, H)
        out = {"q": q, "k": k, "v": v}
        norm_first = config.qk_norm is not None and bug != "qk-norm-after-rope"
        if norm_first:
            q = out["q_norm"] = _norm(p, "q_norm", q_in, N, config, bug)
            k = out["k_norm"] = _norm(p, "k_norm", k_in, K, config, bug)
        if config.rope is not None:
            q = rotated(q, positions, T)
            k = rotated(k, jnp.arange(S) if key_positions is None else key_positions, S)
            if config.qk_norm is not None and not norm_first:  # the slip: normalised after the rotation
                q = _norm(p, "q_norm", q.reshape(B, T, N * H), N, config, None)
                k = _norm(p, "k_norm", k.reshape(B, S, K * H), K, config, None)
            out.update(q_rot=q, k_rot=k)
        acc = jnp.promote_types(q.dtype, jnp.float32)  # logits and softmax in float32 at least
        k_all, v_all = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)  # (B, S, N, H)
        scale = H ** -0.5 if bug == "default-scale" else config.softmax_scale
        scores = jnp.einsum("BTNH,BSNH->BNTS", q.astype(acc), k_all.astype(acc)) * scale
        capped = config.softcap is not None and bug != "softcap-missing"
        if capped and bug != "softcap-after-mask":
            scores = config.softcap * jnp.tanh(scores / config.softcap)
        if keep is not None:
            scores = jnp.where(keep, scores, -jnp.inf)
        if capped and bug == "softcap-after-mask":  # -inf becomes -cap: the masked keys get weight
            scores = config.softcap * jnp.tanh(scores / config.softcap)
        weights = _softmax(scores, keep, p, config, bug).astype(q.dtype)
        context = jnp.einsum("BNTS,BSNH->BTNH", weights, v_all).reshape(B, T, N * H)
        heads_first = {n: a.transpose(0, 2, 1, 3) for n, a in out.items()}  # the harness's (B, heads, L, H)
        return {**heads_first, "scores": scores, "weights": weights, "context": context,
                "output": linear(context, p, "out_proj")}

    def attend(p, query, key, value, keep, *, positions=None, key_positions=None):
        s = stages(p, query, key, value, keep, positions=positions, key_positions=key_positions)
        return s["output"], s["weights"]

    attend.intermediates = stages
    return attend


# Every feature but the interleaved RoPE convention (this port rotates halves only): that case is a skip row.
DECLARED = {"framework": "jax", "mode": "jit", "mask": "keep", "masked_rows": "nan", "returns_weights": True,
            "variants": tuple(f for f in VARIANT_FEATURES if f != "rope-interleaved")}


@implementation(name="modern-jax-port", doc="parity.examples.modern_jax: a hand-written JAX port of the layers "
                "after Llama", **DECLARED)
def port(state_dict, num_heads, *, dtype, device, problem):
    return make_attention(problem.config)


def _planted(bug: str):
    @implementation(name=f"modern-jax-{bug}", doc=f"parity.examples.modern_jax: the port with the slip {bug!r}",
                    **DECLARED)
    def factory(state_dict, num_heads, *, dtype, device, problem):
        return make_attention(problem.config, bug=bug)

    return factory


qk_norm_after_rope, norm_axis_swapped, norm_without_offset, norm_in_bfloat16, softcap_missing, softcap_after_mask, \
    sinks_dropped, sinks_sigmoid, default_scale = (_planted(b) for b in BUGS)
PLANTED = dict(zip(BUGS, (qk_norm_after_rope, norm_axis_swapped, norm_without_offset, norm_in_bfloat16,
                          softcap_missing, softcap_after_mask, sinks_dropped, sinks_sigmoid, default_scale)))
