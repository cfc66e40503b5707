"""The oracle's layers after Llama (QK-norm per head and flat, Gemma's 1 + w norm, head dims of their own,
the softmax scale, logit soft-capping, attention sinks) against the families' own transformers modules:
Qwen3, Gemma 2, Gemma 3, OLMo 2 and GPT-OSS, tiny configs, float64, eager attention.

Forward: transformers' float64 modules compute RoPE's cos/sin, the QK RMSNorm (x.float()) and the eager
softmax in float32 (GPT-OSS's softmax is in the model's dtype), so they are float32-accurate: the bar is
float32's forward entry, as for Llama (tests/test_hf_llama.py). Measured on these inputs (outputs up to
|3.2|): worst forward error 2.4e-7 (Qwen3), at most 0.14 of the bar (OLMo 2); gradients at most 0.07 of
float32's gradient entry. Gradients: transformers' autograd of the same float64 module; and the oracle's
hand-derived backward against central differences of its own float64 forward (independent of
transformers, 1e-6 relative).
The planted slips (the norms dropped, no 1 + w offset, a sink dropped, the cap forgotten, another scale; a
flat norm's weight read per head is refused) are each more than 100x outside the bar. The weights transformers initialises to
constants (norm weights to 1 or 0, sinks to 0, biases to 0) are redrawn: a missing term hides behind them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from parity import reference
from parity.peers import hf
from parity.tolerances import compare, tolerance_for

B, T, E, N, K = 3, 5, 12, 3, 1
H = 8  # a head dim of its own: N·H = 24 != E
THETA = 500.0
HF_FORWARD = tolerance_for("float32").forward
HF_GRADIENT = tolerance_for("float32").gradient


def _common(**extra):
    return dict(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, num_hidden_layers=2,
                intermediate_size=8, vocab_size=16, rope_parameters={"rope_type": "default", "rope_theta": THETA},
                attn_implementation="eager", **extra)


def _families():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    full = ["full_attention", "full_attention"]
    return {  # family -> (config, attention class, rotary class, the oracle's keywords)
        "qwen3": (transformers.Qwen3Config(**_common(rms_norm_eps=1e-5, layer_types=full)), Qwen3Attention,
                  Qwen3RotaryEmbedding, dict(qk_norm="head", qk_norm_eps=1e-5)),
        "gemma2": (transformers.Gemma2Config(**_common(query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
                                                       layer_types=full)),
                   Gemma2Attention, Gemma2RotaryEmbedding, dict(scale=20 ** -0.5, softcap=2.0)),
        "gemma3": (transformers.Gemma3TextConfig(**dict(_common(rms_norm_eps=1e-6, query_pre_attn_scalar=20,
                                                                layer_types=full),
                                                        rope_parameters={"full_attention": {"rope_type": "default",
                                                                                            "rope_theta": THETA}})),
                   Gemma3Attention, Gemma3RotaryEmbedding,
                   dict(qk_norm="head", qk_norm_eps=1e-6, qk_norm_offset=1.0, scale=20 ** -0.5)),
        "olmo2": (transformers.Olmo2Config(**_common(rms_norm_eps=1e-6)), Olmo2Attention, Olmo2RotaryEmbedding,
                  dict(qk_norm="flat", qk_norm_eps=1e-6)),
        "gpt-oss": (transformers.GptOssConfig(**_common(layer_types=full, num_local_experts=2)), GptOssAttention,
                    GptOssRotaryEmbedding, dict()),
    }


FAMILIES = ("qwen3", "gemma2", "gemma3", "olmo2", "gpt-oss")
CANONICAL = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "out_proj",
             "q_norm": "q_norm", "k_norm": "k_norm", "sinks": "sinks"}


@pytest.fixture(scope="module")
def families():
    return _families()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(45)
    x = rng.standard_normal((B, T, E))
    positions = np.arange(T)[None] + np.array([[0], [3], [11]])  # (B, T): continuing sequences
    keep = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)  # causal
    keep[1, :, -2:] = False  # right padding
    keep[1, -2:, :] = np.tril(np.ones((T, T), bool))[-2:]  # padded queries keep their causal keys
    return x, positions, keep


def _redrawn(module):
    """Every parameter redrawn (norm weights around their family's resting value, sinks and biases not 0)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((torch.rand(p.shape, generator=g, dtype=p.dtype) - 0.5) * (0.8 if "norm" in name else 1.0))
            if "norm" in name and p.mean() < 0.2 and "Gemma" not in type(module).__name__:
                p.add_(1.0)  # Qwen3/OLMo2 norms rest at 1, Gemma's (1 + w) at w = 0
    return module.eval()


def _hf(family, families, inputs, grad: bool = False):
    """(canonical float64 state dict, transformers' output, its gradients or None) of one attention module."""
    config, attention, rotary, _ = families[family]
    att = _redrawn(attention(config, layer_idx=1).double())
    x, positions, keep = inputs
    xt = torch.from_numpy(x).requires_grad_(grad)
    cos, sin = (rotary(config)(xt, torch.from_numpy(positions), "full_attention") if family == "gemma3"
                else rotary(config)(xt, torch.from_numpy(positions)))
    mask = torch.from_numpy(hf.additive_mask(keep, np.float64))
    out = att(xt, position_embeddings=(cos.double(), sin.double()), attention_mask=mask)[0]
    sd = {}
    for name, p in att.named_parameters():
        module, _, leaf = name.partition(".")
        sd[f"{CANONICAL[module]}.{leaf}" if leaf else CANONICAL[module]] = p.detach().numpy().copy()
    if not grad:
        return sd, out.detach().numpy(), None
    cot = np.random.default_rng(46).standard_normal(out.shape)
    (out * torch.from_numpy(cot)).sum().backward()
    grads = {"query": xt.grad.numpy()}
    for name, p in att.named_parameters():
        module, _, leaf = name.partition(".")
        grads[f"{CANONICAL[module]}.{leaf}" if leaf else CANONICAL[module]] = p.grad.numpy()
    return sd, out.detach().numpy(), (grads, cot)


def _oracle_kw(family, families):
    return dict(num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA, **families[family][3])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_oracle_forward_is_the_family_module(family, families, inputs):
    sd, out, _ = _hf(family, families, inputs)
    x, positions, keep = inputs
    expected = {"gpt-oss": {"sinks"}, "olmo2": {"q_norm.weight"}}.get(family, set())
    assert expected <= set(sd)
    f = reference.forward(sd, x, x, x, keep, positions=positions, key_positions=positions,
                          **_oracle_kw(family, families))
    c = compare(out, f.output, HF_FORWARD)
    assert c.passed, (family, c)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_oracle_backward_is_the_family_modules_autograd(family, families, inputs):
    sd, _, (hf_grads, cot) = _hf(family, families, inputs, grad=True)
    x, positions, keep = inputs
    grads = reference.backward(sd, x, x, x, keep, cot, positions=positions, key_positions=positions,
                               **_oracle_kw(family, families))
    got = dict(grads, query=grads["query"] + grads["key"] + grads["value"])  # self-attention: one input
    assert set(hf_grads) <= set(got)
    for name, g in hf_grads.items():
        c = compare(g, got[name], HF_GRADIENT)
        assert c.passed, (family, name, c)


SLIPS = {  # family -> keywords of a port bug, each far outside transformers' precision
    "qwen3": dict(qk_norm=None, qk_norm_eps=1e-6),  # the norms dropped (read as a Llama layer)
    "gemma2": dict(softcap=None),  # the cap forgotten
    "gemma3": dict(qk_norm_offset=0.0),  # w instead of 1 + w
    "olmo2": dict(scale=None, qk_norm="head"),  # the norm over each head (with the wrong weight shape: refused)
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_port_slip_is_far_outside_the_bar(family, families, inputs):
    sd, out, _ = _hf(family, families, inputs)
    x, positions, keep = inputs
    kw = dict(_oracle_kw(family, families), positions=positions, key_positions=positions)
    if family == "gpt-oss":  # the sink dropped
        sd = {k: v for k, v in sd.items() if k != "sinks"}
    elif family == "qwen3":
        sd = {k: v for k, v in sd.items() if "norm" not in k}
        kw.update(SLIPS[family])
    elif family == "olmo2":  # the flat weight does not fit a per-head norm: refused by name
        with pytest.raises(ValueError, match="q_norm.weight"):
            reference.forward(sd, x, x, x, keep, **dict(kw, qk_norm="head"))
        kw.update(scale=0.5)  # a scale other than H**-0.5
    else:
        kw.update(SLIPS[family])
    wrong = reference.forward(sd, x, x, x, keep, **kw).output
    assert np.max(np.abs(wrong - out)) > 100 * HF_FORWARD.atol, family


def test_gemma2_has_head_dim_and_scale_of_its_own_and_the_cap_binds(families, inputs):
    """The premise of the Gemma 2 case: the cap changes the logits (|s| reaches cap's range)."""
    sd, _, _ = _hf("gemma2", families, inputs)
    x, positions, keep = inputs
    f = reference.forward(sd, x, x, x, keep, positions=positions, key_positions=positions,
                          **_oracle_kw("gemma2", families))
    assert sd["q_proj.weight"].shape == (N * H, E)
    finite = f.scores[np.isfinite(f.scores)]
    assert np.abs(finite).max() > 0.5 * 2.0  # tanh is visibly non-linear there


# ---------------------------------------------------------------- the oracle's own consistency


def _drawn(qk_norm=None, sinks=True, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    sd = {"q_proj.weight": rng.standard_normal((N * H, E)) * 0.4, "k_proj.weight": rng.standard_normal((K * H, E)) * 0.4,
          "v_proj.weight": rng.standard_normal((K * H, E)) * 0.4, "out_proj.weight": rng.standard_normal((E, N * H)) * 0.3}
    if bias:
        sd.update({f"{p}.bias": rng.standard_normal(w) * 0.3 for p, w in (("q_proj", N * H), ("k_proj", K * H),
                                                                        ("v_proj", K * H), ("out_proj", E))})
    if qk_norm:
        flat = qk_norm == "flat"
        sd["q_norm.weight"] = 1 + 0.3 * rng.standard_normal(N * H if flat else H)
        sd["k_norm.weight"] = 1 + 0.3 * rng.standard_normal(K * H if flat else H)
    if sinks:
        sd["sinks"] = rng.standard_normal(N)
    return sd


LAYERS = {
    "qk-norm-head+offset": dict(qk_norm="head", qk_norm_offset=1.0, qk_norm_eps=1e-3),
    "qk-norm-flat+softcap": dict(qk_norm="flat", softcap=1.5),
    "sinks+scale": dict(scale=0.2),
}


@pytest.mark.parametrize("name", LAYERS)
def test_the_oracle_backward_is_its_forwards_derivative(name, inputs):
    """Central differences of the float64 forward, on every weight (norm weights and sinks too) and input."""
    kw = LAYERS[name]
    sd = _drawn(kw.get("qk_norm"), sinks="sinks" in name)
    x, positions, keep = inputs
    keep = keep.copy()
    keep[2, 0] = False  # a row that keeps no key: zeros with sinks, NaN-free "zero" policy otherwise
    cot = np.random.default_rng(3).standard_normal((B, T, E))
    layer = dict(num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA, positions=positions,
                 key_positions=positions, masked_rows="zero", **kw)
    grads = reference.backward(sd, x, x, x, keep, cot, **layer)

    def loss(sd_, q=x):
        return float((reference.forward(sd_, q, x, x, keep, **layer).output * cot).sum())

    eps = 1e-6
    for key in sorted(sd):
        flat = sd[key].reshape(-1)
        for i in range(min(flat.size, 4)):
            j = (i * 7) % flat.size
            up, down = {k: v.copy() for k, v in sd.items()}, {k: v.copy() for k, v in sd.items()}
            up[key].reshape(-1)[j] += eps
            down[key].reshape(-1)[j] -= eps
            numeric = (loss(up) - loss(down)) / (2 * eps)
            analytic = grads[key].reshape(-1)[j]
            assert abs(numeric - analytic) <= 1e-6 * (1 + abs(numeric)), (name, key, j, numeric, analytic)
    xq = x.copy()
    xq[1, 2, 3] += eps
    xd = x.copy()
    xd[1, 2, 3] -= eps
    numeric = (loss(sd, xq) - loss(sd, xd)) / (2 * eps)
    assert abs(numeric - grads["query"][1, 2, 3]) <= 1e-6 * (1 + abs(numeric))


@pytest.mark.parametrize("name", LAYERS)
def test_decoding_is_the_one_causal_forward(name):
    """`decode` (its own masking, positions and cache) equals `forward` under decode_keep/decode_positions."""
    kw = LAYERS[name]
    sd = _drawn(kw.get("qk_norm"), sinks="sinks" in name, seed=4)
    L, starts = 6, np.array([0, 2, 1])
    x = np.random.default_rng(5).standard_normal((B, L, E))
    layer = dict(num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA, masked_rows="zero", **kw)
    got = reference.decode(sd, x, starts=starts, prefill=3, **layer)
    pos = reference.decode_positions(starts, L)
    want = reference.forward(sd, x, x, x, reference.decode_keep(starts, L), positions=pos, key_positions=pos, **layer)
    real = reference.decode_keep(starts, L)[:, 0].any(-1)  # (B, L): the columns that attend something
    np.testing.assert_allclose(got.output[real], want.output[real], rtol=1e-12, atol=1e-12)


def test_a_row_that_keeps_no_key_gives_its_weight_to_the_sink():
    sd = _drawn(sinks=True)
    x = np.random.default_rng(8).standard_normal((B, T, E))
    keep = np.ones((B, T, T), bool)
    keep[0, 1] = False
    f = reference.forward(sd, x, x, x, keep, num_heads=N, num_kv_heads=K)
    assert (f.weights[0, :, 1] == 0).all() and (f.sink_weights[0, :, 1] == 1).all()
    np.testing.assert_allclose(f.weights.sum(-1) + f.sink_weights, 1.0, atol=1e-15)
    assert (f.sink_weights[:, :, [0, 2]] > 0).all()  # a sink takes a share of every row


def test_norm_tensors_need_qk_norm_and_their_shapes():
    sd = _drawn(qk_norm="head", sinks=False)
    x = np.zeros((B, T, E))
    with pytest.raises(ValueError, match="q_norm.weight"):
        reference.forward(sd, x, x, x, None, num_heads=N, num_kv_heads=K)  # read everything or refuse
    with pytest.raises(ValueError, match=r"q_norm.weight has shape \(8,\), expected \(24,\)"):
        reference.forward(sd, x, x, x, None, num_heads=N, num_kv_heads=K, qk_norm="flat")
