"""transformers' attention modules with fused q/k/v projections as peers: Phi-3, GPT-NeoX, Falcon.

    hf-phi3      Phi3Attention (eager) with Phi3RotaryEmbedding: one qkv_proj (q | k | v rows), no biases,
                 grouped heads, partial rotary (partial_rotary_factor), LongRoPE
    hf-gpt-neox  GPTNeoXAttention (eager) with GPTNeoXRotaryEmbedding: query_key_value interleaved per head,
                 biases on both projections or neither (an absent one goes in as zeros), rotary_pct
                 (partial_rotary_factor; GPT-NeoX's default is 0.25, so 1.0 is passed for a whole-head layer)
    hf-falcon    FalconAttention (eager, rotary, no ALiBi) with FalconRotaryEmbedding: K = N the classic per-head
                 query_key_value, K = 1 multi_query, 1 < K < N new_decoder_architecture; biases both or neither
    hf-phi3-decode, hf-gpt-neox-decode, hf-falcon-decode
                 the same modules as decoders: one token per call against a DynamicCache, generate's 2D
                 attention mask and position_ids (`parity.peers.hf.hf_llama_decode_step`)

Each takes the canonical state dict and fuses it into the module's own tensors through its checkpoint layout
(`parity.layouts.to_layout(sd, "hf-phi3" | "hf-gpt-neox" | "hf-falcon", num_heads=N)`); the gradients come back
through `from_layout`. RoPE reaches the module as transformers' rope_parameters (`hf_rope_parameters`): rope_type
the scaling's kind, partial_rotary_factor R/H, the scaling's keys (LongRoPE's factor set, and Phi-3's own
config.original_max_position_embeddings, which its config prefers over rope_parameters'). Phi3Config's validator
accepts only "default" and "longrope"; the other kinds are given to the config after it is built, where
Phi3RotaryEmbedding computes them through modeling_rope_utils as Llama's does (Phi-3 checkpoints ship longrope).

What they compute in, measured by tests/test_peer_hf_rope.py: cos/sin in float32 (all three), the softmax in
float32 (Phi-3, GPT-NeoX) or in the input dtype (Falcon: softmax(dtype=hidden_states.dtype)), so a float64 run
is judged at float32 (computes_in="float32"). Falcon's eager path needs a mask: an all-zero additive one when the
case has none. Falcon's apply_rotary_pos_emb rotates the whole head: no rope-partial. Phi-3 reads head_dim as
hidden_size / num_heads in its config's checks (the LongRoPE factor count): no head-dim.

transformers is imported in parity/peers/hf.py only (tests/test_house.py); this file reaches it through
`hf.transformers_module`. Legend (see mha_spec): B T S N K H E R.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from parity.canonical import numpy_to_tensor, tensor_to_numpy, torch_dtype_of
from parity.implementation import Implementation
from parity.layouts import from_layout, to_layout
from parity.peers.common import np_dtype, require
from parity.peers.hf import (
    SMALL_VOCAB,
    additive_mask,
    check_self_attention,
    decode_args,
    full_rotary_parameters,
    hf_llama_decode_step,
    hf_position_ids,
    hf_rope_parameters,
    transformers_module,
)

# The modules no other file of parity/ names (tests/test_house.py).
OWNS = ("Phi3Attention", "GPTNeoXAttention", "FalconAttention")

_HEADROOM = 4096  # max_position_embeddings: unused by the frequencies (every scaling's factor is passed)


def _phi3_modules(config, any_bias: bool):
    """(Phi3Attention, Phi3RotaryEmbedding) for the layer; its config's original_max_position_embeddings is the
    scaling's (Phi3Config prefers it over rope_parameters')."""
    if any_bias:
        raise ValueError("hf-phi3: Phi3Attention has no biases (qkv_proj and o_proj bias=False); this layer has some")
    m = transformers_module("models.phi3.modeling_phi3")
    rope = hf_rope_parameters(config)
    rope.setdefault("partial_rotary_factor", 1.0)
    scaling = config.rope_scaling
    original = getattr(scaling, "original_max_position_embeddings", None) or _HEADROOM
    own = rope["rope_type"] in ("default", "longrope")  # what Phi3Config.validate_rope accepts
    hf = m.Phi3Config(hidden_size=config.embed_dim, num_attention_heads=config.num_heads,
                      num_key_value_heads=config.kv_heads, num_hidden_layers=1, intermediate_size=2 * config.embed_dim,
                      vocab_size=SMALL_VOCAB, max_position_embeddings=_HEADROOM,
                      original_max_position_embeddings=original, attention_dropout=0.0, attn_implementation="eager",
                      pad_token_id=None, bos_token_id=None, eos_token_id=None,
                      rope_parameters=rope if own else {"rope_type": "default", "rope_theta": rope["rope_theta"],
                                                        "partial_rotary_factor": rope["partial_rotary_factor"]})
    if not own:
        hf.rope_parameters = rope
    return m.Phi3Attention(hf, layer_idx=0), m.Phi3RotaryEmbedding(hf)


def _gpt_neox_modules(config, any_bias: bool):
    """(GPTNeoXAttention, GPTNeoXRotaryEmbedding); partial_rotary_factor always given (its default is 0.25)."""
    m = transformers_module("models.gpt_neox.modeling_gpt_neox")
    rope = hf_rope_parameters(config)
    rope.setdefault("partial_rotary_factor", 1.0)
    hf = m.GPTNeoXConfig(hidden_size=config.embed_dim, num_attention_heads=config.num_heads, num_hidden_layers=1,
                         intermediate_size=2 * config.embed_dim, vocab_size=SMALL_VOCAB,
                         max_position_embeddings=_HEADROOM, attention_bias=any_bias, attention_dropout=0.0,
                         attn_implementation="eager", rope_parameters=rope)
    return m.GPTNeoXAttention(hf, layer_idx=0), m.GPTNeoXRotaryEmbedding(hf)


def falcon_architecture(num_heads: int, kv_heads: int) -> dict:
    """FalconConfig's fields for K key/value heads: K = N the classic layer (per-head q, k, v), K = 1 multi_query,
    else new_decoder_architecture (each key/value head's query heads, its k, its v)."""
    if kv_heads == num_heads:
        return dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=num_heads)
    if kv_heads == 1:
        return dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=1)
    return dict(new_decoder_architecture=True, multi_query=False, num_kv_heads=kv_heads)


def _falcon_modules(config, any_bias: bool):
    """(FalconAttention, FalconRotaryEmbedding): rotary, no ALiBi, the architecture K says."""
    m = transformers_module("models.falcon.modeling_falcon")
    hf = m.FalconConfig(hidden_size=config.embed_dim, num_attention_heads=config.num_heads,
                        **falcon_architecture(config.num_heads, config.kv_heads), alibi=False, bias=any_bias,
                        num_hidden_layers=1, vocab_size=SMALL_VOCAB, max_position_embeddings=_HEADROOM,
                        attention_dropout=0.0, hidden_dropout=0.0, attn_implementation="eager",
                        bos_token_id=None, eos_token_id=None, rope_parameters=full_rotary_parameters(config))
    return m.FalconAttention(hf, layer_idx=0), m.FalconRotaryEmbedding(hf)


def _phi3_run(att, x, emb, mask, past):
    return att(x, position_embeddings=emb, attention_mask=mask, past_key_values=past)[0]


def _gpt_neox_run(att, x, emb, mask, past):
    return att(x, attention_mask=mask, layer_past=past, position_embeddings=emb)[0]


def _falcon_run(att, x, emb, mask, past):
    """Falcon's eager path adds its mask unconditionally: none is an all-zero one over the keys it will see."""
    import torch

    if mask is None:
        S = x.shape[1] + (0 if past is None else past.get_seq_length())
        mask = torch.zeros(x.shape[0], 1, x.shape[1], S, dtype=x.dtype)
    return att(x, alibi=None, attention_mask=mask, layer_past=past, position_embeddings=emb)[0]


@dataclasses.dataclass(frozen=True)
class _Module:
    layout: str
    build: object  # (config, any_bias) -> (attention, rotary)
    run: object  # (att, x, emb, mask, past) -> output
    variants: tuple[str, ...]
    requires: tuple[str, ...]


_MODULES = {
    "hf-phi3": _Module("hf-phi3", _phi3_modules, _phi3_run, ("grouped", "rope-partial", "rope-scaled"),
                       ("rope-half", "no-qkv-bias", "no-out-bias")),
    "hf-gpt-neox": _Module("hf-gpt-neox", _gpt_neox_modules, _gpt_neox_run,
                           ("no-qkv-bias", "no-out-bias", "rope-partial", "rope-scaled"), ("rope-half",)),
    "hf-falcon": _Module("hf-falcon", _falcon_modules, _falcon_run,
                         ("grouped", "no-qkv-bias", "no-out-bias", "rope-scaled"), ("rope-half",)),
}


def fused_parts(name: str, sd, config, dtype):
    """(peer `name`'s attention module holding sd, its rotary embedding, the canonical names sd has).

    sd is fused into the module's layout by `to_layout`; an absent bias of a layer with some is a zero bias of
    the module with biases (exactly no bias; its gradient is not reported)."""
    spec = _MODULES[name]
    dt = np_dtype(dtype)
    sd = {k: np.asarray(v).astype(dt) for k, v in sd.items()}
    names = tuple(sorted(sd))
    any_bias = any(k.endswith(".bias") for k in sd)
    if any_bias:
        every = dataclasses.replace(config, qkv_bias=True, out_bias=True).weight_shapes()
        sd = {**{k: np.zeros(s, dt) for k, s in every.items() if k.endswith(".bias")}, **sd}
    att, rotary = spec.build(config, any_bias)
    att = att.to(torch_dtype_of(dt)).eval()
    tensors = to_layout(sd, spec.layout, num_heads=config.num_heads)
    att.load_state_dict({k: numpy_to_tensor(v) for k, v in tensors.items()}, strict=True)
    return att, rotary, names


def _call(name: str, att, rotary, keep, position_ids, dtype):
    """call(x) -> the module's attention of x with its rotary cos/sin and our keep-mask as its additive mask."""
    mask = None if keep is None else numpy_to_tensor(additive_mask(np.asarray(keep, bool), np_dtype(dtype)))
    run = _MODULES[name].run

    def call(x):
        return run(att, x, rotary(x, position_ids), mask, None)

    return call


def _check_problem(name: str, num_heads, problem):
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"{name}: num_heads={num_heads} but the problem's config has {config.num_heads}")
    return config


def _fused_peer(name: str, sd, num_heads, *, dtype, device, problem):
    """fn(query, key, value, keep, positions=, key_positions=) running peer `name`'s module, with fn.vjp."""
    config = _check_problem(name, num_heads, problem)
    dt = np_dtype(dtype)

    def fn(query, key, value, keep, *, positions=None, key_positions=None):
        import torch

        q, k, v = (tensor_to_numpy(x) for x in (query, key, value))
        check_self_attention(q, k, v, name)
        keep = None if keep is None else tensor_to_numpy(keep)
        ids = hf_position_ids(positions, key_positions, *q.shape[:2])
        att, rotary, _ = fused_parts(name, sd, config, dtype)
        with torch.no_grad():
            out = _call(name, att, rotary, keep, ids, dtype)(numpy_to_tensor(q.astype(dt)))
        return numpy_to_tensor(tensor_to_numpy(out), device)

    def vjp(query, keep, cotangent, *, positions=None, key_positions=None):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} of sum(output * cotangent)."""
        import torch

        query = np.asarray(query)
        att, rotary, names = fused_parts(name, sd, config, dtype)
        ids = hf_position_ids(positions, key_positions, *query.shape[:2])
        call = _call(name, att, rotary, None if keep is None else np.asarray(keep), ids, dtype)
        x = numpy_to_tensor(query.astype(dt)).requires_grad_(True)
        with torch.enable_grad():
            (call(x) * numpy_to_tensor(np.asarray(cotangent).astype(dt))).sum().backward()
        grads = from_layout({n: tensor_to_numpy(p.grad) for n, p in att.named_parameters()}, _MODULES[name].layout,
                            num_heads=config.num_heads)
        return {"input": tensor_to_numpy(x.grad), **{n: grads[n] for n in names}}

    fn.vjp = vjp
    return fn


def _fused_decoder(name: str, sd, num_heads, *, dtype, device, problem):
    """fn(p, x_t, cache, position) -> (out, cache): peer `name`'s module decoding one token per call (the decode
    check's contract; `hf_llama_decode_step`'s DynamicCache, mask and positions)."""
    config = _check_problem(name, num_heads, problem)
    label = f"{name}-decode"

    def fn(p, x_t, cache, position):
        import torch

        pos = decode_args(label, x_t, position, config.embed_dim)
        if x_t.dtype != torch_dtype_of(np_dtype(dtype)):
            raise TypeError(f"{label} was built for {dtype}; x_t is {x_t.dtype}")
        if not isinstance(p, Mapping):
            raise TypeError(f"{label}: p must be the canonical parameters (a mapping), got {type(p).__name__}")
        params = {k: tensor_to_numpy(v) if hasattr(v, "detach") else np.asarray(v) for k, v in p.items()}
        att, rotary, _ = fused_parts(name, params, config, dtype)
        x = numpy_to_tensor(tensor_to_numpy(x_t).astype(np_dtype(dtype)))
        with torch.no_grad():
            out, cache = hf_llama_decode_step(att, rotary, config, x, cache, pos, run=_MODULES[name].run)
        return out.to(x_t.device), cache

    return fn


def hf_phi3(sd, num_heads, *, dtype, device, problem):
    """transformers Phi3Attention (eager): fused qkv_proj, partial rotary, LongRoPE."""
    return _fused_peer("hf-phi3", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_gpt_neox(sd, num_heads, *, dtype, device, problem):
    """transformers GPTNeoXAttention (eager): query_key_value per head, rotary_pct, biases."""
    return _fused_peer("hf-gpt-neox", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_falcon(sd, num_heads, *, dtype, device, problem):
    """transformers FalconAttention (eager, rotary): classic, multi_query or new_decoder_architecture by K."""
    return _fused_peer("hf-falcon", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_phi3_decode(sd, num_heads, *, dtype, device, problem):
    """hf-phi3 as a decoder with a DynamicCache."""
    return _fused_decoder("hf-phi3", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_gpt_neox_decode(sd, num_heads, *, dtype, device, problem):
    """hf-gpt-neox as a decoder with a DynamicCache."""
    return _fused_decoder("hf-gpt-neox", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_falcon_decode(sd, num_heads, *, dtype, device, problem):
    """hf-falcon as a decoder with a DynamicCache (new_decoder_architecture caches N repeated key heads)."""
    return _fused_decoder("hf-falcon", sd, num_heads, dtype=dtype, device=device, problem=problem)


# Self-attention with one position list and an additive finfo.min mask, as hf-llama: float64 (computed at
# float32's entry) and float16 only where no row is fully masked (finfo(float64).min is -inf in a float32 softmax;
# see parity.peers.hf's docstring for float16).
_RUNS_ON = ("self/none/*", "self/causal/*", "self/*/float32", "self/*/bfloat16")


# Falcon's softmax runs in the input dtype (softmax(dtype=hidden_states.dtype)), unlike the oracle's float32 for
# 16-bit inputs: unmeasured there, so it runs float32 and float64 (where float64 has no fully masked row) only.
_FALCON_RUNS_ON = ("self/*/float32", "self/none/float64", "self/causal/float64")


def _forward_implementation(name: str, doc: str) -> Implementation:
    spec = _MODULES[name]
    return Implementation(name, "torch", f"{__name__}:{name.replace('-', '_')}", masked_rows="uniform",
                          mask_shape="BTS", uses_params=False, computes_in="float32", role="peer", bench=False,
                          masked_row_grads="flow", variants=spec.variants, requires=spec.requires, classic=False,
                          runs_on=_FALCON_RUNS_ON if name == "hf-falcon" else _RUNS_ON, doc=doc)


def _decode_implementation(name: str, doc: str) -> Implementation:
    # A decoder's only fully masked rows are its left-padding tokens, whose outputs are not judged (hf-llama-decode).
    spec = _MODULES[name]
    return Implementation(f"{name}-decode", "torch", f"{__name__}:{name.replace('-', '_')}_decode", decode=True,
                          masked_rows="uniform", computes_in="float32", role="peer", bench=False,
                          masked_row_grads="flow", variants=spec.variants, requires=spec.requires, classic=False,
                          runs_on=("self/*/float32", "self/*/float64") if name == "hf-falcon" else ("self/*/*",),
                          doc=doc)


IMPLEMENTATIONS = (
    _forward_implementation("hf-phi3", "transformers Phi3Attention (eager): qkv_proj fused by the hf-phi3 layout, "
                            "partial rotary and LongRoPE through its config; cos/sin and softmax in float32"),
    _forward_implementation("hf-gpt-neox", "transformers GPTNeoXAttention (eager): query_key_value per head "
                            "(hf-gpt-neox layout), rotary_pct, biases on both or neither (zeros for an absent one); "
                            "cos/sin and softmax in float32"),
    _forward_implementation("hf-falcon", "transformers FalconAttention (eager, rotary): classic, multi_query or "
                            "new_decoder_architecture by K (hf-falcon layout); cos/sin in float32, softmax in the "
                            "input dtype"),
    _decode_implementation("hf-phi3", "transformers Phi3Attention decoding one token per call with a DynamicCache, "
                           "generate's 2D attention mask and position_ids; LongRoPE's table per step"),
    _decode_implementation("hf-gpt-neox", "transformers GPTNeoXAttention decoding one token per call with a "
                           "DynamicCache (layer_past), generate's 2D attention mask and position_ids"),
    _decode_implementation("hf-falcon", "transformers FalconAttention decoding one token per call with a "
                           "DynamicCache (layer_past), generate's 2D attention mask and position_ids"),
)
