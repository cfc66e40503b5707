"""A hand-written Llama-style JAX attention, and the same port with the classic grouped-heads bug.

    mha-parity --impl parity.examples.llama_jax:port --impl parity.examples.llama_jax:port_with_tile_bug --cases modern

`port` is what a researcher writes when moving a Llama/Mistral/Qwen2 attention block from
PyTorch to plain jax.numpy: q/k/v projections with torch's (out, in) weights (biases only
where the checkpoint has them), heads split as (B, L, heads, H) with K key/value heads,
rotate-half RoPE (Hugging Face's `rotate_half`) from integer positions, each key/value head
repeated for its N/K query heads as HF's `repeat_kv` does (`jnp.repeat`: head h reads
key/value head h // (N/K)), scores scaled by 1/√H, a keep-mask, softmax, weights @ V, o_proj.
It declares the variants it runs (grouped heads, rope-half, bias-free projections; the
interleaved convention is a skip row) and exposes its intermediates, so when it disagrees
the harness names the first stage that does.

`port_with_tile_bug` repeats the key/value heads with `jnp.tile` instead of `jnp.repeat`:
the shapes line up, nothing raises, and query head h reads key/value head h % K instead
of h // (N/K). q, k, v and their rotations are right; the scores are the first wrong stage.
Legend: B batch, T query length, S key length, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.impls import implementation


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_cos_sin(positions, length: int, head_dim: int, theta: float, dtype):
    """cos, sin (B|1, L, 1, H) for rotate-half; float32 for 16-bit inputs, else the inputs' dtype."""
    acc = jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype
    pos = jnp.arange(length) if positions is None else jnp.asarray(positions)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=acc) / head_dim))
    lead = pos.shape[0] if pos.ndim == 2 else 1  # not -1: the length may be 0
    freqs = pos.astype(acc).reshape(lead, length, 1, 1) * inv_freq  # (B|1, L, 1, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    return (x.astype(cos.dtype) * cos + _rotate_half(x.astype(cos.dtype)) * sin).astype(x.dtype)


def make_attention(config, *, repeat_kv=None, rotate=None, key_position_shift: int = 0):
    """fn(params, query, key, value, keep, *, positions=None, key_positions=None) -> (output, weights).

    `config` is the problem's `mha_spec.AttentionConfig`. The keywords exist to plant the
    classic porting bugs in tests: `repeat_kv(k, G)` spreads K heads over N (default: jnp.repeat
    on the heads axis), `rotate(x, cos, sin)` applies RoPE, `key_position_shift` moves the keys'
    positions.
    """
    N, K, H = config.num_heads, config.kv_heads, config.head_size
    G = N // K
    repeat_kv = repeat_kv or (lambda x, g: jnp.repeat(x, g, axis=2))
    rotate = rotate or apply_rope

    def linear(x, p, name):
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    def stages(p, query, key, value, keep, *, positions=None, key_positions=None):
        B, T, _ = query.shape
        S = key.shape[1]
        q = linear(query, p, "q_proj").reshape(B, T, N, H)
        k = linear(key, p, "k_proj").reshape(B, S, K, H)
        v = linear(value, p, "v_proj").reshape(B, S, K, H)
        q_rot, k_rot = q, k
        if config.rope is not None:
            if key_positions is None:
                key_positions = jnp.arange(S)
            q_rot = rotate(q, *rope_cos_sin(positions, T, H, config.rope_theta, q.dtype))
            k_rot = rotate(k, *rope_cos_sin(key_positions + key_position_shift, S, H, config.rope_theta, k.dtype))
        k_all, v_all = repeat_kv(k_rot, G), repeat_kv(v, G)  # (B, S, N, H)
        scores = jnp.einsum("BTNH,BSNH->BNTS", q_rot, k_all) / jnp.sqrt(jnp.asarray(H, q.dtype))
        if keep is not None:
            scores = jnp.where(keep, scores, -jnp.inf)
        weights = jax.nn.softmax(scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), axis=-1).astype(q.dtype)
        context = jnp.einsum("BNTS,BSNH->BTNH", weights, v_all).reshape(B, T, N * H)
        output = linear(context, p, "out_proj")
        heads_first = {"q": q, "k": k, "v": v}  # the harness's layout: (B, heads, L, H)
        if config.rope is not None:
            heads_first.update(q_rot=q_rot, k_rot=k_rot)
        return {**{n: a.transpose(0, 2, 1, 3) for n, a in heads_first.items()},
                "scores": scores, "weights": weights, "context": context, "output": output}

    def attend(p, query, key, value, keep, *, positions=None, key_positions=None):
        s = stages(p, query, key, value, keep, positions=positions, key_positions=key_positions)
        return s["output"], s["weights"]

    attend.intermediates = stages
    return attend


_DECLARED = {"framework": "jax", "mode": "jit", "mask": "keep", "masked_rows": "nan", "returns_weights": True,
             "variants": ("grouped", "rope-half", "no-qkv-bias", "no-out-bias")}


@implementation(name="llama-jax-port", doc="parity.examples.llama_jax: a hand-written Llama-style JAX port", **_DECLARED)
def port(state_dict, num_heads, *, dtype, device, problem):
    return make_attention(problem.config)


@implementation(name="llama-jax-port-tile-bug", doc="parity.examples.llama_jax: jnp.tile for the key/value heads",
                **_DECLARED)
def port_with_tile_bug(state_dict, num_heads, *, dtype, device, problem):
    return make_attention(problem.config, repeat_kv=lambda x, g: jnp.tile(x, (1, 1, g, 1)))


# ---------------------------------------------------------------- the HF-style layer, ported as it is written


def llama_attention(p, x, attention_mask, positions, *, config, rope_on_v: bool = False, use_biases: bool = True):
    """parity.examples.llama_torch.LlamaAttention.forward in jax.numpy: one input, hf-llama names
    (o_proj), q/k/v biases where present, additive mask, cos/sin and softmax in float32.
    Returns every stage (the harness's layout: heads first), output and weights among them.

    rope_on_v and use_biases=False plant two porting bugs: RoPE applied to the values too (first
    wrong stage: context), and the q/k/v biases ignored (right on Llama, which has none)."""
    B, L, _ = x.shape
    N, K, H = config.num_heads, config.kv_heads, config.head_size

    def proj(name, heads):  # (B, L, E) -> (B, heads, L, H); a bias where the model has one (Qwen2)
        y = x @ p[f"{name}.weight"].T + (p.get(f"{name}.bias", 0) if use_biases else 0)
        return y.reshape(B, L, heads, H).transpose(0, 2, 1, 3)

    q, k, v = proj("q_proj", N), proj("k_proj", K), proj("v_proj", K)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    freqs = positions[:, :, None].astype(jnp.float32) * inv_freq  # (B, L, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None]  # (B, 1, L, H)
    cos, sin = jnp.cos(emb).astype(q.dtype), jnp.sin(emb).astype(q.dtype)
    q_rot = q * cos + _rotate_half(q) * sin
    k_rot = k * cos + _rotate_half(k) * sin
    v_used = v * cos + _rotate_half(v) * sin if rope_on_v else v
    k_all, v_all = jnp.repeat(k_rot, N // K, axis=1), jnp.repeat(v_used, N // K, axis=1)  # (B, N, L, H), repeat_kv
    scores = q_rot @ k_all.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.asarray(H, q.dtype))  # (B, N, L, L)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    context = (weights @ v_all).transpose(0, 2, 1, 3).reshape(B, L, N * H)  # (B, L, E)
    output = context @ p["o_proj.weight"].T
    return dict(q=q, k=k, v=v, q_rot=q_rot, k_rot=k_rot, scores=scores, weights=weights, context=context, output=output)


# One input, HF's names, the Llama layer's features (q/k/v biases optional, as in Qwen2), float32
# arithmetic: as parity.examples.llama_torch.
HF_DECLARED = dict(framework="jax", mode="jit", inputs="self", names="hf-llama",
                   requires=("grouped", "rope-half", "no-out-bias"), variants=("no-qkv-bias",), computes_in="float32",
                   mask="additive", masked_rows="nan", masked_row_grads="flow", returns_weights=True)


def _hf(problem, **bug):
    def stages(p, x, attention_mask, positions=None):
        return llama_attention(p, x, attention_mask, positions, config=problem.config, **bug)

    def fn(p, x, attention_mask, positions=None):
        s = stages(p, x, attention_mask, positions)
        return s["output"], s["weights"]

    fn.intermediates = stages
    return fn


@implementation(name="llama-jax-hf-port", doc="parity.examples.llama_jax: LlamaAttention ported to jax.numpy as written",
                **HF_DECLARED)
def hf_port(state_dict, num_heads, *, dtype, device, problem):
    return _hf(problem)


@implementation(name="llama-jax-hf-port-rope-on-v", doc="parity.examples.llama_jax: RoPE applied to the values too",
                **HF_DECLARED)
def hf_port_with_rope_on_v(state_dict, num_heads, *, dtype, device, problem):
    return _hf(problem, rope_on_v=True)


@implementation(name="llama-jax-hf-port-no-biases", doc="parity.examples.llama_jax: the q/k/v biases ignored",
                **HF_DECLARED)
def hf_port_ignoring_biases(state_dict, num_heads, *, dtype, device, problem):
    return _hf(problem, use_biases=False)
