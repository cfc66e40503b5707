"""A hand-written PyTorch port of RoPE as the models ship it (partial rotary, llama3, YaRN, LongRoPE, the
fused q/k/v projections of Phi-3, GPT-NeoX and Falcon), and the same port with each slip these layers invite.

    mha-parity --cases rope --impl parity.examples.rope_torch:port
    mha-parity --cases rope --impl parity.examples.rope_torch:longrope_wrong_length

`port` is written from the models' definitions (transformers' `modeling_rope_utils` and each family's
`apply_rotary_pos_emb`), not from `mha_spec`: it computes its own inverse frequencies in float64 (the default
theta^(-2i/R) over the R = rope_dim rotated features, then linear / llama3 / YaRN / LongRoPE scaling), cos and
sin times the attention factor, cast to the accumulation dtype (float32, float64 for float64), and rotates
the first R features of each head with rotate-half, the other H - R passing through. LongRoPE picks its
long factors when the call's largest position + 1 passes original_max_position_embeddings (transformers'
`dynamic_rope_update`), as a select on a scalar. It takes the canonical names; `phi3`, `neox` and `falcon`
take Phi-3's fused qkv_proj and GPT-NeoX's and Falcon's fused query_key_value (declared `names=`, one input,
as the models are written) and split it as the model does. Every one exposes its intermediates (q, k, v as projected; q_rot, k_rot;
scores, weights, context, output), so the harness names the first stage a slip reaches.

The slips (`BUGS`, each an implementation of its own; `WHERE` in tests/test_rope_examples.py):
rope-whole-head     rotary over all H features of a partial layer (the head dim where rope_dim belongs): q_rot
rope-last-dims      a partial layer's rotary over the last R features instead of the first R: q_rot
neox-split-qkv      GPT-NeoX's query_key_value, which holds (q, k, v) per head, split as [Q | K | V]: q
falcon-groups       Falcon's new-architecture query_key_value, which holds per key/value group its G
                    queries, its key and its value, read as [all the groups' first query | ...]: q
                    (with K >= 2 groups: one group reads the same either way)
llama3-every-frequency  llama3 scaling dividing every frequency by factor (the high ones are kept): q_rot
yarn-no-attention-factor  YaRN's cos and sin without the attention factor (0.1 ln(factor) + 1): q_rot
longrope-wrong-length  LongRoPE's factors picked by the call's length T (hidden_states.shape[1]) instead
                    of its largest position + 1: wrong on a prompt whose positions pass the original
                    context while its length does not (a chunk of a long sequence, a left-padded row): q_rot
Legend: B batch, T query length, S key length, L either, N query heads, K key/value heads, G = N/K,
H head dim, R rope_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from parity.impls import implementation

BUGS = ("rope-whole-head", "rope-last-dims", "neox-split-qkv", "falcon-groups", "llama3-every-frequency",
        "yarn-no-attention-factor", "longrope-wrong-length")
FUSED_BUGS = {"neox-split-qkv": "neox", "falcon-groups": "falcon"}
"""The slips of a fused projection, and the port (its layout) they are planted in."""

LAYOUTS = {"phi3": "hf-phi3", "neox": "hf-gpt-neox", "falcon": "hf-falcon"}
"""The fused ports and the `parity.layouts` layout each reads."""


# ------------------------------------------------------------------ frequencies (modeling_rope_utils)


def _llama3(inv_freq, s, bug):
    """Llama 3.1's wavelength bands: long ones divided by factor, short ones kept, the middle interpolated."""
    if bug == "llama3-every-frequency":  # the slip: the whole of inv_freq divided, as linear scaling does
        return inv_freq / s.factor
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq, s, theta: float, R: int):
    """YaRN: inv_freq kept (extrapolated) below the correction range, divided by factor above, a ramp between."""
    def correction_dim(rotations):
        return R * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # the definition's guard against a zero-width ramp
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation


def attention_factor(config, bug=None) -> float:
    """What cos and sin are multiplied by: YaRN's mscale, LongRoPE's sqrt(1 + ln(factor) / ln(original)), else 1."""
    s = config.rope_scaling
    if s is None or s.kind in ("linear", "llama3"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.kind == "yarn":
        if bug == "yarn-no-attention-factor":
            return 1.0

        def mscale(m):
            return 1.0 if s.factor <= 1 else 0.1 * m * math.log(s.factor) + 1.0
        return mscale(s.mscale) / mscale(s.mscale_all_dim) if s.mscale and s.mscale_all_dim else mscale(1.0)
    return 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def inv_frequencies(config, bug=None, long: bool = False):
    """(R/2,) float64: theta^(-2i/R) over the rotated features, scaled; LongRoPE's long_factor with `long`."""
    R = config.head_size if bug == "rope-whole-head" else config.rotary_dim  # the slip: the head dim
    theta, s = config.rope_theta, config.rope_scaling
    inv_freq = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    if s is None:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        return _llama3(inv_freq, s, bug)
    if s.kind == "yarn":
        return _yarn(inv_freq, s, theta, R)
    return inv_freq / torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float64)


# ------------------------------------------------------------------ apply_rotary_pos_emb


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(positions, inv_freq, factor: float, acc):
    """cos, sin (B, 1, L, R) in `acc`: float64 angles, times the attention factor, then cast."""
    freqs = positions[:, :, None].to(torch.float64) * inv_freq.to(positions.device)  # (B, L, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return (emb.cos() * factor).to(acc), (emb.sin() * factor).to(acc)


def apply_rotary(x, cos, sin, bug=None):
    """x (B, n, L, H): its first R = cos.shape[-1] features rotated (the last R with rope-last-dims), the rest
    passed; the rotation in cos's dtype, the result in x's."""
    R = cos.shape[-1]
    if bug == "rope-last-dims":
        x_pass, x_rot = x[..., : x.shape[-1] - R], x[..., x.shape[-1] - R:]
    else:
        x_rot, x_pass = x[..., :R], x[..., R:]
    y = x_rot.to(cos.dtype)
    y = (y * cos + rotate_half(y) * sin).to(x.dtype)
    return torch.cat((x_pass, y) if bug == "rope-last-dims" else (y, x_pass), dim=-1)


def _rope_tables(config, bug, positions, key_positions, T: int, acc):
    """(cos, sin) for the queries and for the keys: one inv_freq for the whole call (LongRoPE's choice by the
    call's largest position + 1, over queries and keys, as a select so it traces)."""
    inv = inv_frequencies(config, bug)
    s = config.rope_scaling
    if s is not None and s.kind == "longrope":
        longest = torch.maximum(positions.max(), key_positions.max()) + 1
        if bug == "longrope-wrong-length":  # the slip: the length of the prompt, not where it stands
            longest = torch.tensor(T, device=positions.device)
        inv = torch.where(longest.cpu() > s.original_max_position_embeddings, inv_frequencies(config, bug, True), inv)
    factor = attention_factor(config, bug)
    return cos_sin(positions, inv, factor, acc), cos_sin(key_positions, inv, factor, acc)


# ------------------------------------------------------------------ the layer


def _linear(p, name, x):
    return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))


def _project(p, query, key, value, config, fused, bug):
    """q (B, T, N, H), k and v (B, S, K, H): three projections, or one fused one split as its model does."""
    B, T, _ = query.shape
    S = key.shape[1]
    N, K, H = config.num_heads, config.kv_heads, config.head_size
    if fused is None:
        return (_linear(p, "q_proj", query).view(B, T, N, H), _linear(p, "k_proj", key).view(B, S, K, H),
                _linear(p, "v_proj", value).view(B, S, K, H))
    if fused == "phi3":  # Phi3Attention: qkv_proj's rows all of q, then k, then v
        q, k, v = _linear(p, "qkv_proj", query).split((N * H, K * H, K * H), dim=-1)
        return q.view(B, T, N, H), k.view(B, T, K, H), v.view(B, T, K, H)
    qkv = _linear(p, "query_key_value", query)  # one input: (B, L, (N + 2K)·H)
    if fused == "neox" and bug == "neox-split-qkv":  # the slip: the rows read as [Q | K | V], as Phi-3 stores them
        q, k, v = qkv.split(N * H, dim=-1)
        return q.view(B, T, N, H), k.view(B, T, K, H), v.view(B, T, K, H)
    if fused == "neox":  # GPTNeoXAttention: (q, k, v) of each head side by side
        q, k, v = qkv.view(B, T, N, 3 * H).chunk(3, dim=-1)
        return q, k, v
    G = N // K
    if bug == "falcon-groups":  # the slip: kinds outermost, each kind's K groups inside
        qkv = qkv.view(B, T, G + 2, K, H)
        return qkv[:, :, :G].transpose(2, 3).reshape(B, T, N, H), qkv[:, :, G], qkv[:, :, G + 1]
    qkv = qkv.view(B, T, K, G + 2, H)  # FalconAttention._split_heads (new architecture): per group G queries, k, v
    return qkv[:, :, :, :G].reshape(B, T, N, H), qkv[:, :, :, G], qkv[:, :, :, G + 1]


def _softmax(scores, p, config):
    """weights (B, N, T, S); with sinks, each head's sink logit joins the row and its column is dropped."""
    if not config.sinks:
        return torch.softmax(scores, dim=-1)
    sink = p["sinks"].to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def make_attention(config, *, fused: str | None = None, bug: str | None = None):
    """fn(params, query, key, value, keep, *, positions=None, key_positions=None) -> (output, weights) for
    `config` (an `mha_spec.AttentionConfig` with rotate-half RoPE), `fn.intermediates` its stages; `fused`
    "phi3" | "neox" | "falcon": params under that model's names, one input (the key and value are ignored)."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug {bug!r} is not one of {BUGS}")
    if config.rope != "half":
        raise ValueError(f"the port rotates halves (rope='half'); the layer has rope={config.rope!r}")
    N, K, H = config.num_heads, config.kv_heads, config.head_size
    out_name = {None: "out_proj", "phi3": "o_proj"}.get(fused, "dense")

    def stages(p, query, key, value, keep, *, positions=None, key_positions=None):
        B, T, _ = query.shape
        S = key.shape[1]
        positions = torch.arange(T, device=query.device).expand(B, T) if positions is None else positions
        key_positions = torch.arange(S, device=query.device).expand(B, S) if key_positions is None else key_positions
        q, k, v = (a.transpose(1, 2) for a in _project(p, query, key, value, config, fused, bug))  # (B, n, L, H)
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32  # the accumulation dtype
        (cos, sin), (key_cos, key_sin) = _rope_tables(config, bug, positions, key_positions, T, acc)
        q_rot, k_rot = apply_rotary(q, cos, sin, bug), apply_rotary(k, key_cos, key_sin, bug)
        k_all, v_all = k_rot.repeat_interleave(N // K, dim=1), v.repeat_interleave(N // K, dim=1)  # (B, N, S, H)
        scores = q_rot.to(acc) @ k_all.to(acc).transpose(2, 3) * config.softmax_scale  # (B, N, T, S)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        weights = _softmax(scores, p, config).to(query.dtype)
        context = (weights @ v_all).transpose(1, 2).reshape(B, T, N * H)  # (B, T, N·H)
        return {"q": q, "k": k, "v": v, "q_rot": q_rot, "k_rot": k_rot, "scores": scores, "weights": weights,
                "context": context, "output": _linear(p, out_name, context)}

    def attend(p, query, key, value, keep, *, positions=None, key_positions=None):
        s = stages(p, query, key, value, keep, positions=positions, key_positions=key_positions)
        return s["output"], s["weights"]

    if fused is None:
        attend.intermediates = stages
        return attend

    def one_input(f):  # the model's forward(hidden_states, mask, position_ids): self-attention
        def layer(p, x, keep, positions=None):
            return f(p, x, x, x, keep, positions=positions, key_positions=positions)
        return layer

    layer = one_input(attend)
    layer.intermediates = one_input(stages)
    return layer


# What the port runs: rotate-half RoPE (partial, scaled), grouped heads, its own head dim and scale, sinks,
# any bias set. Not the interleaved convention (the models here rotate halves), QK-norm or soft-capping.
FEATURES = ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "scale", "sinks", "rope-partial", "rope-scaled")
DECLARED = {"framework": "torch", "mask": "keep", "masked_rows": "nan", "returns_weights": True,
            "requires": ("rope-half",), "variants": FEATURES}
# The fused ports are the models' one-input layers under their checkpoints' names, with what each model is:
# Phi-3 has no biases; GPT-NeoX no grouped heads; GPT-NeoX's and Falcon's dense is (E, E), so H = E/N.
FUSED = {"phi3": dict(DECLARED, inputs="self", names=LAYOUTS["phi3"], requires=("rope-half", "no-qkv-bias",
                                                                                 "no-out-bias")),
         "neox": dict(DECLARED, inputs="self", names=LAYOUTS["neox"],
                      variants=tuple(f for f in FEATURES if f not in ("grouped", "head-dim"))),
         "falcon": dict(DECLARED, inputs="self", names=LAYOUTS["falcon"],
                        variants=tuple(f for f in FEATURES if f != "head-dim"))}


def _declare(name: str, doc: str, fused: str | None = None, bug: str | None = None):
    @implementation(name=name, doc=f"parity.examples.rope_torch: {doc}", **(FUSED[fused] if fused else DECLARED))
    def factory(state_dict, num_heads, *, dtype, device, problem):
        return make_attention(problem.config, fused=fused, bug=bug)

    return factory


port = _declare("rope-torch-port", "a hand-written port of RoPE as the models ship it")
phi3 = _declare("rope-torch-phi3", "the port reading Phi-3's fused qkv_proj", fused="phi3")
neox = _declare("rope-torch-neox", "the port reading GPT-NeoX's fused query_key_value", fused="neox")
falcon = _declare("rope-torch-falcon", "the port reading Falcon's fused query_key_value (new architecture)",
                  fused="falcon")
PLANTED = {b: _declare(f"rope-torch-{b}", f"the port with the slip {b!r}", FUSED_BUGS.get(b), b) for b in BUGS}
rope_whole_head, rope_last_dims, neox_split_qkv, falcon_groups, llama3_every_frequency, yarn_no_attention_factor, \
    longrope_wrong_length = (PLANTED[b] for b in BUGS)
