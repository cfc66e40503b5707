"""The oracle's partial and scaled RoPE (`reference.forward/backward/decode` with rope_dim and rope_scaling)
against the families' own transformers modules: Llama (llama3, yarn, linear), Phi-3 (longrope, partial
rotary 0.5, below and past its switch, and a DynamicCache decode across it), GPT-NeoX (rotary_pct 0.25,
fused per-head qkv with biases) and GPT-OSS (yarn, sinks). Tiny configs, float64 modules, eager attention,
positions just past a small original context (ORIG = 32) so the angles stay small.

transformers computes the rotary cos/sin in float32 even for float64 models (inv_freq a float32 buffer,
position * inv_freq in float32), and its eager softmax in float32, so these modules are float32-accurate.
The bar is HF_BAR below, set from a measurement written next to it; each slip (no scaling, the wrong
LongRoPE table, no attention factor, full instead of partial rotation) is checked to fall far outside it.
The oracle's frequencies are also held to transformers' ROPE_INIT_FUNCTIONS and to mha_spec's independent
writing of them, and its backward to central differences of its own forward. Last, our torch and JAX modules
(rope_dim < H, each scaling kind, float64) are held to the oracle within 1e-12.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from mha_spec import RopeScaling
from parity import reference
from parity.peers import hf
from parity.tolerances import Tolerance, compare

B, T, N, K = 2, 5, 3, 1
THETA = 500.0
ORIG = 32  # original_max_position_embeddings: small, so positions past it keep float32's angle error small
# Measured on this file's inputs (outputs up to |11|): forward max abs error <= 3.4e-7 (Llama, Phi-3, GPT-OSS),
# 7.4e-7 for GPT-NeoX at |out| 11 (the largest, 0.33 of the bar below); gradients <= 8.1e-7 (Llama) and 2.4e-6
# (Phi-3 k_proj.weight at |g| 22, 0.24 of its bar); the Phi-3 decode 4.9e-7. Every slip below is >= 0.1 away.
# So the bars are float32's elementwise entries (parity.tolerances): 3x over the worst measurement, ~1000x under
# the nearest slip.
HF_BAR = Tolerance(atol=1e-6, rtol=1e-5)
HF_GRAD_BAR = Tolerance(atol=1e-5, rtol=1e-4)
PAST = np.arange(T)[None] + np.array([[27], [31]])  # (B, T): positions 27..35, past ORIG (not from 0)
BELOW = np.arange(T)[None] + np.array([[27], [20]])  # (B, T): largest 31, max + 1 = ORIG: LongRoPE's short table

LLAMA_ROPE = {  # transformers' rope_parameters (without rope_type/rope_theta); ORIG = 32, theta 500, H = 8:
    # wavelengths 6.3 (kept, < 32/4), 29.7 (blended), 140 and 664 (slowed by factor)
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=ORIG),
    # the ramp runs over pairs 0..2 (ceil of beta_slow's correction dim 1.05); mscale ratio 1.065
    "yarn": dict(factor=4.0, original_max_position_embeddings=ORIG, mscale=1.0, mscale_all_dim=0.5),
    "linear": dict(factor=2.0),
}
PHI_ROPE = dict(short_factor=[1.0, 1.3], long_factor=[2.0, 5.0], original_max_position_embeddings=ORIG)
PHI_MAX_POSITIONS = 4 * ORIG  # Phi-3 leaves LongRoPE's factor implicit: max_position_embeddings / original
OSS_ROPE = dict(factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=ORIG)


def _common(E, **extra):
    return dict(hidden_size=E, num_attention_heads=N, num_hidden_layers=2, intermediate_size=8, vocab_size=16,
                attn_implementation="eager", pad_token_id=None, eos_token_id=None, bos_token_id=None, **extra)


def _family(name, kind=None):
    """(config, attention class, rotary class, E, the oracle's keywords) of one family's layer."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding

    if name == "llama":  # E = 12, H = 8: a head dim of its own, N·H = 24
        keys = LLAMA_ROPE[kind]
        config = transformers.LlamaConfig(**_common(12, num_key_value_heads=K, head_dim=8, attention_bias=True,
                                                    max_position_embeddings=4 * ORIG,
                                                    rope_parameters={"rope_type": kind, "rope_theta": THETA, **keys}))
        return config, LlamaAttention, LlamaRotaryEmbedding, 12, dict(rope_scaling=RopeScaling.from_mapping(kind, keys))
    if name == "phi3":  # E = 24, H = 8, R = 4: two rotated pairs, two LongRoPE factors per list
        config = transformers.Phi3Config(**_common(24, num_key_value_heads=K, max_position_embeddings=PHI_MAX_POSITIONS,
                                                   original_max_position_embeddings=ORIG,
                                                   rope_parameters={"rope_type": "longrope", "rope_theta": THETA,
                                                                    "partial_rotary_factor": 0.5, **PHI_ROPE}))
        scaling = RopeScaling.from_mapping("longrope", dict(PHI_ROPE, factor=PHI_MAX_POSITIONS / ORIG))
        return config, Phi3Attention, Phi3RotaryEmbedding, 24, dict(rope_dim=4, rope_scaling=scaling)
    if name == "neox":  # E = 48, H = 16, rotary_pct 0.25: R = 4
        config = transformers.GPTNeoXConfig(**_common(48, rotary_pct=0.25, rotary_emb_base=THETA, attention_bias=True))
        return config, GPTNeoXAttention, GPTNeoXRotaryEmbedding, 48, dict(rope_dim=4)
    rope = {"rope_type": "yarn", "rope_theta": THETA, **OSS_ROPE}
    config = transformers.GptOssConfig(**_common(12, num_key_value_heads=K, head_dim=8, num_local_experts=2,
                                                 layer_types=["full_attention"] * 2, max_position_embeddings=4 * ORIG,
                                                 rope_parameters=rope))
    return config, GptOssAttention, GptOssRotaryEmbedding, 12, dict(rope_scaling=RopeScaling.from_mapping("yarn",
                                                                                                          OSS_ROPE))


def _redrawn(module):
    """Every parameter redrawn (biases and sinks not 0: a missing term must not hide behind them)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.rand(p.shape, generator=g, dtype=p.dtype) - 0.5))
    return module.eval()


def _canonical(named: dict, name: str, E: int) -> dict[str, np.ndarray]:
    """The module's named tensors (parameters or their gradients) as the oracle's canonical state dict."""
    named = {n: t.detach().numpy().copy() for n, t in named.items()}
    H = E // N if name == "neox" else 8
    if name == "phi3":  # qkv_proj rows [Q (N·H) | K (K·H) | V (K·H)]
        qkv = named.pop("qkv_proj.weight")
        named.update({"q_proj.weight": qkv[:N * H], "k_proj.weight": qkv[N * H:(N + K) * H],
                      "v_proj.weight": qkv[(N + K) * H:]})
    if name == "neox":  # query_key_value rows interleaved per head: [q_h | k_h | v_h] for h < N
        for leaf in ("weight", "bias"):
            fused = named.pop(f"query_key_value.{leaf}").reshape(N, 3, H, *([E] if leaf == "weight" else []))
            named.update({f"{p}.{leaf}": fused[:, i].reshape(N * H, *fused.shape[3:])
                          for i, p in enumerate(("q_proj", "k_proj", "v_proj"))})
    rename = {"o_proj": "out_proj", "dense": "out_proj"}
    return {".".join([rename.get(k.split(".")[0], k.split(".")[0]), *k.split(".")[1:]]): v for k, v in named.items()}


def _keep():
    keep = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)  # (B, T, T) causal
    keep[1, :, -2:] = False  # right padding in row 1; its padded queries keep their causal keys
    keep[1, -2:, :] = np.tril(np.ones((T, T), bool))[-2:]
    return keep


def _call(att, name, rotary, x, positions, mask, past=None):
    """One call of the family's attention module on x (B, L, E) torch at positions (B, L)."""
    cos, sin = rotary(x, torch.from_numpy(positions))
    emb = (cos.double(), sin.double())
    if name == "neox":
        return att(x, attention_mask=mask, layer_past=past, position_embeddings=emb)[0]
    return att(x, position_embeddings=emb, attention_mask=mask, past_key_values=past)[0]


def _hf(name, kind=None, positions=PAST, grad=False):
    """(canonical sd, x, transformers' output, (its gradients, cotangent) or None, the oracle's layer keywords)."""
    config, attention, rotary, E, kw = _family(name, kind)
    att = _redrawn(attention(config, layer_idx=0).double())
    x = np.random.default_rng(45).standard_normal((B, T, E))
    xt = torch.from_numpy(x).requires_grad_(grad)
    out = _call(att, name, rotary(config), xt, positions, torch.from_numpy(hf.additive_mask(_keep(), np.float64)))
    sd = _canonical(dict(att.named_parameters()), name, E)
    layer = dict(num_heads=N, num_kv_heads=None if name == "neox" else K, rope="half", rope_theta=THETA, **kw)
    if not grad:
        return sd, x, out.detach().numpy(), None, layer
    cot = np.random.default_rng(46).standard_normal(out.shape)
    (out * torch.from_numpy(cot)).sum().backward()
    grads = dict(_canonical({n: p.grad for n, p in att.named_parameters()}, name, E), query=xt.grad.numpy())
    return sd, x, out.detach().numpy(), (grads, cot), layer


def _oracle(sd, x, positions, layer):
    return reference.forward(sd, x, x, x, _keep(), positions=positions, key_positions=positions, **layer).output


CASES = [("llama", "llama3", PAST), ("llama", "yarn", PAST), ("llama", "linear", PAST), ("phi3", None, BELOW),
         ("phi3", None, PAST), ("neox", None, PAST), ("gpt-oss", None, PAST)]
IDS = ["llama-llama3", "llama-yarn", "llama-linear", "phi3-longrope-short", "phi3-longrope-long", "neox-partial",
       "gpt-oss-yarn"]


@pytest.mark.parametrize("name, kind, positions", CASES, ids=IDS)
def test_the_oracle_forward_is_the_family_module(name, kind, positions):
    sd, x, out, _, layer = _hf(name, kind, positions)
    c = compare(out, _oracle(sd, x, positions, layer), HF_BAR)
    assert c.passed, (name, kind, c)


@pytest.mark.parametrize("name, kind", [("llama", "llama3"), ("llama", "yarn"), ("llama", "linear"), ("phi3", None)])
def test_the_oracle_backward_is_the_family_modules_autograd(name, kind):
    sd, x, _, (hf_grads, cot), layer = _hf(name, kind, PAST, grad=True)
    grads = reference.backward(sd, x, x, x, _keep(), cot, positions=PAST, key_positions=PAST, **layer)
    got = dict(grads, query=grads["query"] + grads["key"] + grads["value"])  # self-attention: one input
    assert set(hf_grads) == set(sd) | {"query"}
    for key, g in hf_grads.items():
        c = compare(g, got[key], HF_GRAD_BAR)
        assert c.passed, (name, kind, key, c)


def test_a_port_slip_is_far_outside_the_bar():
    """Each slip a port could make moves the output > 100x the bar's atol away from transformers' module: the
    comparisons above can fail (measured: >= 0.107 on every slip, Llama YaRN without its factor the nearest)."""
    slips = []
    for name, kind, positions in CASES:
        sd, x, out, _, layer = _hf(name, kind, positions)
        s = layer.get("rope_scaling")
        if s is not None and s.kind != "longrope":
            slips.append((name, kind, positions, sd, x, out, dict(layer, rope_scaling=None)))  # scaling forgotten
        if s is not None and s.kind in ("yarn", "longrope"):  # the attention factor forgotten
            slips.append((name, "no-factor", positions, sd, x, out,
                          dict(layer, rope_scaling=dataclasses.replace(s, attention_factor=1.0))))
        if s is not None and s.kind == "longrope":  # the other table (the switch misread)
            other = dataclasses.replace(s, short_factor=s.long_factor, long_factor=s.short_factor)
            slips.append((name, "other-table", positions, sd, x, out, dict(layer, rope_scaling=other)))
        if name == "neox":  # every feature rotated
            slips.append((name, "full", positions, sd, x, out, dict(layer, rope_dim=None)))
    assert len(slips) == 11
    for name, what, positions, sd, x, out, layer in slips:
        assert np.max(np.abs(_oracle(sd, x, positions, layer) - out)) > 100 * HF_BAR.atol, (name, what)


def test_the_oracle_decode_is_phi3_with_a_dynamic_cache_across_the_switch():
    """A prompt below original_max_position_embeddings, then steps past it (row 0 reaches 32, 33; row 1, left
    padded by 2, turns long with it: the rule takes the call's largest position over the batch), against
    Phi3Attention with transformers' DynamicCache. The cached prompt keys keep their short rotation, so the
    one causal forward (the long table for all) is far from it."""
    config, attention, rotary_cls, E, kw = _family("phi3")
    att, rotary = _redrawn(attention(config, layer_idx=0).double()), rotary_cls(config)
    L, P, starts = ORIG + 2, ORIG - 2, np.array([0, 2])
    x = np.random.default_rng(47).standard_normal((B, L, E))
    pos, keep = reference.decode_positions(starts, L), reference.decode_keep(starts, L)[:, 0]  # (B, L), (B, L, L)
    past, outs = transformers.DynamicCache(), []
    with torch.no_grad():
        for lo, hi in [(0, P)] + [(t, t + 1) for t in range(P, L)]:
            mask = torch.from_numpy(hf.additive_mask(keep[:, lo:hi, :hi], np.float64))
            outs.append(_call(att, "phi3", rotary, torch.from_numpy(x[:, lo:hi]), pos[:, lo:hi], mask, past))
    out = torch.cat(outs, 1).numpy()  # (B, L, E)
    sd = _canonical(dict(att.named_parameters()), "phi3", E)
    layer = dict(num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA, **kw)
    got = reference.decode(sd, x, starts=starts, prefill=P, **layer)
    real = keep.any(-1)  # (B, L): the columns that attend something (row 1's padding gives HF NaN)
    c = compare(out[real], got.output[real], HF_BAR)
    assert c.passed, c  # measured 4.9e-7 (outputs up to |5.2|)
    keys = past.layers[0].keys.numpy()  # (B, K, L, H), rotated as each call rotated them
    c = compare(keys[real[:, None, :]], got.k_rot[real[:, None, :]], HF_BAR)
    assert c.passed, c  # measured 3.8e-7
    # the premises, each measured >= 2.7 away: one call over all L tokens rotates the prompt long too; a
    # decode that never turns long misses the steps at slots 32, 33 in both rows (row 1 only at position 30, 31)
    one_call = reference.forward(sd, x, x, x, keep, positions=pos, key_positions=pos, **layer).output
    assert np.max(np.abs(one_call[real] - out[real])) > 100 * HF_BAR.atol
    s = kw["rope_scaling"]
    never = reference.decode(sd, x, starts=starts, prefill=P,
                             **dict(layer, rope_scaling=dataclasses.replace(s, long_factor=s.short_factor))).output
    assert (np.abs(never - out)[:, ORIG:].max(axis=(1, 2)) > 100 * HF_BAR.atol).all()


# ---------------------------------------------------------------- the oracle's frequencies


def _init_cases():
    """(config, kind, seq_len, the RopeScaling, R) for transformers' ROPE_INIT_FUNCTIONS."""
    cases = [(_family("llama", k)[0], k, None, _family("llama", k)[4]["rope_scaling"], 8) for k in LLAMA_ROPE]
    phi = _family("phi3")
    cases += [(phi[0], "longrope", n, phi[4]["rope_scaling"], 4) for n in (ORIG, ORIG + 1)]
    oss = _family("gpt-oss")
    return cases + [(oss[0], "yarn", None, oss[4]["rope_scaling"], 8)]


def test_the_oracle_frequencies_are_transformers_and_mha_specs():
    """inv_freq and the attention factor: transformers' (float32 inv_freq: 2e-7 relative measured) and
    mha_spec.rope's own float64 writing of the same definitions (two writings: 1e-15)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mha_spec import rope_frequencies

    for config, kind, seq_len, scaling, R in _init_cases():
        long = seq_len is not None and seq_len > ORIG
        ours = reference.rope_inv_freq(R, THETA, scaling, long)
        theirs, factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
        np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6, err_msg=f"{kind} {seq_len}")
        np.testing.assert_allclose(ours, rope_frequencies(R, THETA, scaling, long), rtol=1e-15, atol=0)
        assert reference.rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-15), kind
        assert reference.rope_attention_factor(scaling) == pytest.approx(scaling.scale, rel=1e-15), kind
    assert reference.rope_attention_factor(None) == 1.0


# ---------------------------------------------------------------- the oracle's own consistency

E_OWN, H_OWN, S = 12, 8, 7
KEY_PAST = np.arange(S)[None] + np.array([[26], [30]])  # (B, S): key positions 26..36
OWN = {  # rope_dim < H in both conventions, each scaling kind; ORIG = 32, theta 500
    # R = 6, wavelengths 6.3 (kept, < 32/4), 50 (blended, < 32/0.5), 395 (slowed): every llama3 branch
    "llama3-interleaved-R6": dict(rope="interleaved", rope_dim=6, rope_scaling=RopeScaling(
        "llama3", factor=8.0, low_freq_factor=0.5, high_freq_factor=4.0, original_max_position_embeddings=ORIG)),
    "yarn-half-R4": dict(rope="half", rope_dim=4, rope_scaling=RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=ORIG, truncate=False)),
    "linear-interleaved-R2": dict(rope="interleaved", rope_dim=2, rope_scaling=RopeScaling("linear", factor=2.0)),
    "longrope-half-R6": dict(rope="half", rope_dim=6, rope_scaling=RopeScaling(
        "longrope", factor=4.0, original_max_position_embeddings=ORIG, short_factor=(1.0, 1.2, 1.5),
        long_factor=(1.5, 3.0, 7.0))),
}


def _drawn(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (N * H_OWN, E_OWN), "k_proj": (K * H_OWN, E_OWN), "v_proj": (K * H_OWN, E_OWN),
              "out_proj": (E_OWN, N * H_OWN)}
    sd = {f"{p}.weight": rng.standard_normal(s) * 0.4 for p, s in shapes.items()}
    sd.update({f"{p}.bias": rng.standard_normal(s[0]) * 0.3 for p, s in shapes.items()})
    return sd


def _own(name):
    return dict(num_heads=N, num_kv_heads=K, rope_theta=THETA, masked_rows="zero", **OWN[name])


@pytest.mark.parametrize("name", OWN)
def test_the_oracle_backward_is_its_forwards_derivative(name):
    """Central differences of the float64 forward (cross-attention, key positions of their own past ORIG):
    every weight, the query and the key, 1e-6 relative. Partial RoPE's backward is the transposed rotation
    on the first R features, the identity on the rest, the attention factor included."""
    sd, rng = _drawn(), np.random.default_rng(3)
    q, kv, cot = (rng.standard_normal((B, L, E_OWN)) for L in (T, S, T))
    kw = dict(_own(name), positions=PAST, key_positions=KEY_PAST)
    grads = reference.backward(sd, q, kv, kv, None, cot, **kw)

    def loss(sd_=sd, q_=q, k_=kv):
        return float((reference.forward(sd_, q_, k_, kv, None, **kw).output * cot).sum())

    def nudged(x, j, eps):
        y = x.copy()
        y.reshape(-1)[j] += eps
        return y

    eps = 1e-6
    for key in sorted(sd):
        for j in (3 * i % sd[key].size for i in range(1, 4)):
            numeric = (loss(sd_=dict(sd, **{key: nudged(sd[key], j, eps)}))
                       - loss(sd_=dict(sd, **{key: nudged(sd[key], j, -eps)}))) / (2 * eps)
            assert abs(numeric - grads[key].reshape(-1)[j]) <= 1e-6 * (1 + abs(numeric)), (name, key, j)
    for arg, x in (("q_", q), ("k_", kv)):
        for j in (5, 29, x.size - 1):  # features in and past the rotated part
            numeric = (loss(**{arg: nudged(x, j, eps)}) - loss(**{arg: nudged(x, j, -eps)})) / (2 * eps)
            got = grads["query" if arg == "q_" else "key"].reshape(-1)[j]
            assert abs(numeric - got) <= 1e-6 * (1 + abs(numeric)), (name, arg, j)


@pytest.mark.parametrize("name", OWN)
def test_the_rotation_turns_the_first_rope_dim_features_by_the_factor(name):
    """q_rot and k_rot keep features R..H-1 exactly; each rotated pair's length is the attention factor
    times its length before (a rotation scaled by it), in float64 and, pass-through, in bfloat16."""
    kw = _own(name)
    R, scaling = kw["rope_dim"], kw["rope_scaling"]
    x = np.random.default_rng(4).standard_normal((B, T, E_OWN))
    for dtype in (np.float64, reference.ml_dtypes.bfloat16):
        f = reference.forward(_drawn(), x, x, x, None, positions=PAST, key_positions=PAST, dtype=dtype, **kw)
        for before, after in ((f.q, f.q_rot), (f.k, f.k_rot)):
            np.testing.assert_array_equal(after[..., R:], before[..., R:])
            assert not np.allclose(after[..., :R], before[..., :R])
            if dtype is np.float64:
                pairs = (np.r_[0:R // 2], np.r_[R // 2:R]) if kw["rope"] == "half" else (np.r_[0:R:2], np.r_[1:R:2])
                length = [np.hypot(t[..., pairs[0]], t[..., pairs[1]]) for t in (before, after)]
                np.testing.assert_allclose(length[1], reference.rope_attention_factor(scaling) * length[0], rtol=1e-12)


@pytest.mark.parametrize("name", OWN)
def test_decoding_is_the_one_causal_forward_while_the_table_stays(name):
    """`decode` (its own positions and per-call table) equals `forward` under decode_keep/decode_positions
    when every call is on one side of LongRoPE's switch (L = 6 < ORIG) and for the kinds that never switch."""
    L, starts = 6, np.array([0, 2])
    sd, x = _drawn(seed=5), np.random.default_rng(6).standard_normal((B, L, E_OWN))
    got = reference.decode(sd, x, starts=starts, prefill=3, **_own(name))
    pos, keep = reference.decode_positions(starts, L), reference.decode_keep(starts, L)
    want = reference.forward(sd, x, x, x, keep, positions=pos, key_positions=pos, **_own(name))
    np.testing.assert_allclose(got.output, want.output, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad, error, match", [
    (dict(rope="half", rope_dim=5), ValueError, "rope_dim must be an even int"),
    (dict(rope="half", rope_dim=10), ValueError, "rope_dim must be an even int"),
    (dict(rope_dim=4), ValueError, "rope_dim=4 is given with rope=None"),
    (dict(rope="half", rope_scaling="linear:factor=2"), TypeError, "rope_scaling must be an mha_spec.RopeScaling"),
    (dict(rope_scaling=RopeScaling("linear", factor=2.0)), ValueError, "given with rope=None"),
    (dict(rope="half", rope_dim=4, rope_scaling=OWN["longrope-half-R6"]["rope_scaling"]), ValueError,
     "rotates rope_dim / 2 = 2 pairs"),
])
def test_bad_rope_keywords_are_named_by_every_entry(bad, error, match):
    sd, x = _drawn(), np.zeros((B, T, E_OWN))
    layer = dict(num_heads=N, num_kv_heads=K, **bad)
    with pytest.raises(error, match=match):
        reference.forward(sd, x, x, x, None, **layer)
    with pytest.raises(error, match=match):
        reference.backward(sd, x, x, x, None, x, **layer)
    with pytest.raises(error, match=match):
        reference.decode(sd, x, prefill=2, **layer)
    with pytest.raises(error, match=match):
        reference.config_of(sd, **layer)


# ---------------------------------------------------------------- our modules held to the oracle

MODULE_BAR = Tolerance(atol=1e-12, rtol=1e-12)  # float64 against float64: the same maths, other sum orders
KEY_BELOW = np.arange(S)[None] + np.array([[25], [20]])  # (B, S): largest 31, with BELOW's: LongRoPE's short table
MODULE_CASES = [(name, PAST, KEY_PAST) for name in OWN] + [("longrope-half-R6", BELOW, KEY_BELOW)]
MODULE_IDS = [f"{name}-past" for name in OWN] + ["longrope-half-R6-below"]


def _module_inputs():
    rng = np.random.default_rng(9)
    q, kv = rng.standard_normal((B, T, E_OWN)), rng.standard_normal((B, S, E_OWN))
    keep = rng.random((B, T, S)) < 0.8
    keep[:, :, 0] = True  # no row without a key: the masked-row policy is not what is held here
    return _drawn(seed=8), q, kv, keep


@pytest.mark.parametrize("name, positions, key_positions", MODULE_CASES, ids=MODULE_IDS)
def test_our_torch_module_is_the_oracle(name, positions, key_positions):
    """mha_torch's MultiHeadAttention with rope_dim < H and each scaling, float64, positions past ORIG (and
    LongRoPE below its switch): output and autograd within 1e-12 of the oracle's forward and backward."""
    from parity import convert

    sd, q, kv, keep = _module_inputs()
    kw = dict(_own(name), positions=positions, key_positions=key_positions)
    m = convert.to_torch(sd, N, num_kv_heads=K, **{k: v for k, v in _own(name).items() if k not in ("num_heads",
                                                                                                    "num_kv_heads")})
    qt, kt = torch.from_numpy(q).requires_grad_(), torch.from_numpy(kv).requires_grad_()
    out, _ = m(qt, kt, kt, torch.from_numpy(keep), positions=torch.from_numpy(positions),
               key_positions=torch.from_numpy(key_positions))
    c = compare(out.detach().numpy(), reference.forward(sd, q, kv, kv, keep, **kw).output, MODULE_BAR)
    assert c.passed, (name, c)
    cot = np.random.default_rng(10).standard_normal(out.shape)
    (out * torch.from_numpy(cot)).sum().backward()
    want = reference.backward(sd, q, kv, kv, keep, cot, **kw)
    got = dict(query=qt.grad.numpy(), key=kt.grad.numpy(), **{n: p.grad.numpy() for n, p in m.named_parameters()})
    want = dict(want, key=want["key"] + want["value"])  # key and value are one tensor here: its gradient is the sum
    for key in got:
        c = compare(got[key], want[key], MODULE_BAR)
        assert c.passed, (name, key, c)


@pytest.mark.parametrize("name, positions, key_positions", MODULE_CASES, ids=MODULE_IDS)
def test_our_jax_module_is_the_oracle(name, positions, key_positions):
    """mha_jax's MultiHeadAttention, the same layers and inputs (x64 is on for the session): output within 1e-12."""
    import jax.numpy as jnp
    from flax import nnx

    from parity import convert

    sd, q, kv, keep = _module_inputs()
    layer = {k: v for k, v in _own(name).items() if k not in ("num_heads", "num_kv_heads")}
    m = convert.to_jax(sd, N, num_kv_heads=K, **layer)
    # one XLA compile per layer under nnx.jit (op by op, every primitive compiled: several seconds)
    call = nnx.jit(lambda m, q, kv, keep, pos, kpos: m(q, kv, kv, keep, positions=pos, key_positions=kpos)[0])
    out = call(m, *(jnp.asarray(a) for a in (q, kv, keep, positions, key_positions)))
    want = reference.forward(sd, q, kv, kv, keep, positions=positions, key_positions=key_positions, **_own(name))
    c = compare(np.asarray(out), want.output, MODULE_BAR)
    assert c.passed, (name, c)
