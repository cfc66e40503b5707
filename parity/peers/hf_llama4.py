"""Hugging Face transformers' Llama 4 text attention as a peer: Llama4TextAttention, run on canonical weights.

    hf-llama4       a RoPE layer (no_rope_layers [1]): apply_rotary_emb's complex pairs (our rope="interleaved",
                    no row permutation) from Llama4TextRotaryEmbedding (llama3 scaling included), then the
                    weightless L2 QK-norm (use_qk_norm); on the "chunk" cases (structured, takes_chunk) the mask
                    is transformers' own, create_chunked_causal_mask with attention_chunk_size = the case's chunk
                    (and generate's 2D attention mask for the padding); elsewhere our keep-mask, additive
    hf-llama4-nope  a NoPE layer (no_rope_layers [0]) with the query temperature (attn_temperature_tuning,
                    floor_scale, attn_scale)
    hf-llama4-decode  hf-llama4's module as a decoder (decode=True): one token per call against a DynamicCache,
                    generate's 2D attention mask and position_ids (`parity.peers.hf.hf_llama_decode_step`), its
                    mask create_causal_mask: a RoPE layer whose chunk keeps every causal key of the decode (on a
                    chunked decode case a skip row: the decode protocol fn(p, x_t, cache, position) gives no chunk,
                    and a decoder cannot declare takes_chunk). No NoPE decoder: with left padding its temperature counts
                    the cache's slots, padding included, where ours (and the oracle) count each row's positions

Llama4TextAttention computes the temperature from arange(T) plus the tokens its cache has seen
(past_key_values.get_seq_length()), never from position_ids: one list of positions for every row. A
case whose query positions are p0, p0 + 1, ... in every row (a --checkpoint case of a temperature layer:
`parity.harness.checkpoint.temperature_positions`) is run with a cache stand-in that says it has seen p0
tokens and hands the keys and values back unchanged (`_SeenTokens`): the module's own arithmetic at those
slots. Other positions (the matrix's drawn ones, which differ between rows) are a ValueError naming them:
the module cannot be given them.

Self-attention (one input), one position list for queries and keys (position_ids), as hf-llama. Its
rotation and temperature are float32 (apply_rotary_emb takes xq.float(); attn_scales is float32), its
eager softmax float32: computes_in="float32". The eager mask is additive 0 / finfo(dtype).min, so a fully
masked row is uniform in float32 and bfloat16 and NaN in float64 (finfo(float64).min is -inf in the float32
softmax): float64 runs only where no row is fully masked (none, causal), as hf-llama's. fn.vjp gives
transformers' own autograd gradients (input and every canonical weight).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from parity.canonical import numpy_to_tensor, tensor_to_numpy, torch_dtype_of
from parity.implementation import Implementation
from parity.layouts import to_layout
from parity.peers.common import np_dtype, require
from parity.peers.hf import (SMALL_VOCAB, additive_mask, decode_args, hf_llama_decode_step, hf_position_ids,
                             hf_rope_parameters, key_padding_2d, self_attention_peer, torch_inputs, transformers_module)

# The module no other file of parity/ names (tests/test_house.py); transformers itself through hf's one door.
OWNS = ("Llama4TextAttention",)

_HEADROOM = 4096  # max_position_embeddings: only the rotary table's bookkeeping reads it


def hf_llama4_config(config, chunk: int | None = None):
    """The one-layer transformers Llama4TextConfig of an mha_spec.AttentionConfig: no_rope_layers [1] for a RoPE
    layer (rope="interleaved": apply_rotary_emb's pairs) and [0] for a NoPE one, use_qk_norm for qk_norm="l2",
    the temperature's fields, attention_chunk_size = chunk (None: a full layer), every bias when the layer has
    any. A layer Llama4TextAttention cannot be (rotate-half, a norm with weights, a partial RoPE) is a ValueError."""
    if config.rope not in (None, "interleaved"):
        raise ValueError(f"rope={config.rope!r}: Llama4TextAttention rotates consecutive pairs (rope='interleaved')")
    if config.qk_norm not in (None, "l2") or config.sinks or config.softcap is not None or config.scale is not None:
        raise ValueError("Llama4TextAttention has only the weightless L2 QK-norm, no sinks, soft-cap or scale of its own")
    if config.rope is not None and config.rotary_dim != config.head_size:
        raise ValueError(f"rope_dim={config.rotary_dim} < head_dim={config.head_size}: apply_rotary_emb rotates the "
                         "whole head")
    rope = hf_rope_parameters(config) if config.rope is not None else {"rope_type": "default", "rope_theta": 500.0}
    floor = config.floor_scale
    kw = dict(hidden_size=config.embed_dim, num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
              head_dim=config.head_size, attention_bias=config.qkv_bias or config.out_bias, num_hidden_layers=1,
              intermediate_size=8, intermediate_size_mlp=8, num_local_experts=1, vocab_size=SMALL_VOCAB,
              max_position_embeddings=_HEADROOM, attention_dropout=0.0, attn_implementation="eager",
              rope_parameters=rope, no_rope_layers=[1 if config.rope is not None else 0],
              use_qk_norm=config.qk_norm == "l2", rms_norm_eps=config.qk_norm_eps if config.qk_norm else 1e-5,
              attn_temperature_tuning=config.attn_temperature_tuning,
              floor_scale=int(floor) if float(floor).is_integer() else floor, attn_scale=config.attn_scale,
              attention_chunk_size=chunk,
              layer_types=["chunked_attention" if chunk is not None else "full_attention"])
    return transformers_module("models.llama4.configuration_llama4").Llama4TextConfig(**kw)


class _SeenTokens:
    """What Llama4TextAttention asks of its cache, for a forward at slots p0, p0 + 1, ...: how many tokens it has
    seen (p0, which its temperature adds to arange(T)); the keys and values it is given, handed back as they are
    (no tokens were cached: the attention is over the T given)."""

    def __init__(self, seen: int):
        self.seen = seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return key_states, value_states


def seen_tokens(position_ids, config) -> int:
    """p0 of query positions p0 + t alike in every row (the slots Llama4TextAttention's temperature counts);
    0 for a layer without the temperature (its positions go to RoPE as position_ids). Other positions are a
    ValueError naming them."""
    if not config.attn_temperature_tuning:
        return 0
    pos = np.asarray(position_ids)
    B, T = pos.shape
    p0 = int(pos[0, 0])
    if not np.array_equal(pos, np.broadcast_to(p0 + np.arange(T), (B, T))):
        raise ValueError("Llama4TextAttention's temperature counts cache slots, arange(T) plus the tokens seen, alike "
                         f"in every row: the positions must be p0, p0 + 1, ... in every row, got {pos.tolist()}")
    return p0


def _parts(sd, config, dtype, chunk: int | None):
    """(Llama4TextAttention holding sd, Llama4TextRotaryEmbedding, its config, the canonical names sd has). An
    absent bias is a zero bias of the module with attention_bias=True (exactly no bias; not reported)."""
    modeling = transformers_module("models.llama4.modeling_llama4")
    dt = np_dtype(dtype)
    sd = {k: np.asarray(v).astype(dt) for k, v in sd.items()}
    names = tuple(sorted(sd))
    if any(k.endswith(".bias") for k in sd):
        every = dataclasses.replace(config, qkv_bias=True, out_bias=True).weight_shapes()
        sd = {**{k: np.zeros(s, dt) for k, s in every.items() if k.endswith(".bias")}, **sd}
    hf = hf_llama4_config(config, chunk)
    att = modeling.Llama4TextAttention(hf, layer_idx=0).to(torch_dtype_of(dt)).eval()
    att.load_state_dict({k: numpy_to_tensor(v) for k, v in to_layout(sd, "hf-llama").items()}, strict=True)
    return att, modeling.Llama4TextRotaryEmbedding(hf), hf, names


def _chunk_of(structure: dict) -> int | None:
    """The chunk of a chunked case's structured keywords; anything else structured is a ValueError naming it."""
    if not structure:
        return None
    other = sorted(k for k, v in structure.items() if v is not None and k not in ("is_causal", "chunk", "alignment"))
    if other or structure.get("chunk") is None or not structure.get("is_causal"):
        raise ValueError(f"hf-llama4 takes Llama 4's chunked causal mask only (chunk=, is_causal), got {sorted(structure)}")
    return int(structure["chunk"])


def _call(sd, config, keep, position_ids, structure: dict, dtype):
    """(module, call(x) -> Llama4TextAttention(x)): with a chunk, the mask transformers' Llama4TextModel builds
    (create_chunked_causal_mask over generate's 2D attention mask, the padding); else our keep-mask, additive."""
    create_chunked_causal_mask = transformers_module("masking_utils").create_chunked_causal_mask
    chunk = _chunk_of(structure)
    att, rotary, hf, _ = _parts(sd, config, dtype, chunk)
    past = _SeenTokens(seen_tokens(position_ids, config))
    B, T = position_ids.shape
    dense = None if keep is None or chunk is not None else numpy_to_tensor(additive_mask(np.asarray(keep, bool),
                                                                                         np_dtype(dtype)))
    mask2d = key_padding_2d(keep, B, T) if chunk is not None else None  # ones where nothing is padded: no packing

    def call(x):
        mask = dense
        if chunk is not None:
            mask = create_chunked_causal_mask(config=hf, inputs_embeds=x, attention_mask=mask2d, past_key_values=None,
                                              position_ids=position_ids)
        out, _ = att(x, position_embeddings=rotary(x, position_ids), attention_mask=mask, past_key_values=past)
        return out

    return att, call


def hf_llama4(sd, num_heads, *, dtype, device, problem):
    """transformers Llama4TextAttention (eager): see the module docstring."""
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-llama4: num_heads={num_heads} but the problem's config has {config.num_heads}")
    hf_llama4_config(config)  # a layer it cannot be is refused when built

    def make_call(keep, positions, key_positions, structure, B, T):
        if config.rope is None:  # NoPE: the queries' positions only (the temperature's)
            key_positions = positions
        return _call(sd, config, keep, hf_position_ids(positions, key_positions, B, T), structure, dtype)

    return self_attention_peer("HF Llama 4", tuple(sorted(sd)), dtype, device, make_call)


# float64 only where no row is fully masked (none, causal); no packed documents or windows (Llama 4 has neither).
def hf_llama4_decode(sd, num_heads, *, dtype, device, problem):
    """Llama4TextAttention as a decoder: fn(p, x_t, cache, position) -> (out, cache), the decode check's contract
    (`parity.peers.hf.hf_llama_decode_step`: a DynamicCache, generate's 2D mask, position_ids)."""
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-llama4-decode: num_heads={num_heads} but the problem's config has {config.num_heads}")
    if config.rope is None:
        raise ValueError("hf-llama4-decode decodes RoPE layers: a NoPE layer's temperature counts transformers' cache "
                         "slots, left padding included")
    hf_llama4_config(config)

    def fn(p, x_t, cache, position):
        import torch

        pos = decode_args("hf-llama4-decode", x_t, position, config.embed_dim)
        if x_t.dtype != torch_dtype_of(np_dtype(dtype)):
            raise TypeError(f"hf-llama4-decode was built for {dtype}; x_t is {x_t.dtype}")
        params = {k: tensor_to_numpy(v) if hasattr(v, "detach") else np.asarray(v) for k, v in p.items()}
        att, rotary, _, _ = _parts(params, config, dtype, None)
        with torch.no_grad():
            out, cache = hf_llama_decode_step(att, rotary, config, torch_inputs(tensor_to_numpy(x_t), np_dtype(dtype)),
                                              cache, pos)
        return out.to(x_t.device), cache

    return fn


_SHARED = dict(masked_rows="uniform", mask_shape="BTS", uses_params=False, computes_in="float32", role="peer",
               bench=False, masked_row_grads="flow",
               runs_on=("self/none/*", "self/causal/*", "self/[cr]*/float32", "self/[cr]*/bfloat16",
                        "self/padding/float32", "self/padding/bfloat16"))

IMPLEMENTATIONS = (
    # Llama 4's RoPE layers (the L2 norm always with them here: a RoPE layer without it is hf-llama's).
    Implementation("hf-llama4", "torch", f"{__name__}:hf_llama4", structured=True, takes_chunk=True,
                   variants=("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "rope-scaled"),
                   requires=("rope-interleaved", "qk-norm-l2"), **_SHARED,
                   doc="transformers Llama4TextAttention (eager) with Llama4TextRotaryEmbedding: apply_rotary_emb's "
                   "complex pairs, the L2 QK-norm after them; chunked cases with create_chunked_causal_mask "
                   "(attention_chunk_size = the chunk); cos/sin and softmax in float32; empty rows uniform, their "
                   "gradient flows"),
    Implementation("hf-llama4-nope", "torch", f"{__name__}:hf_llama4",
                   variants=("grouped", "no-qkv-bias", "no-out-bias", "head-dim"), requires=("temperature",),
                   **_SHARED,
                   doc="transformers Llama4TextAttention (eager) of a NoPE layer with the query temperature, at "
                   "cache slots p0 + t (positions alike in every row; a stand-in cache says p0 tokens were seen); "
                   "the temperature and softmax in float32"),
    # A decoder's only fully masked rows are its left-padding tokens, whose outputs are not judged: every dtype.
    Implementation("hf-llama4-decode", "torch", f"{__name__}:hf_llama4_decode", decode=True, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=False, masked_row_grads="flow",
                   variants=("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "rope-scaled"),
                   requires=("rope-interleaved", "qk-norm-l2"), runs_on=("self/*/*",),
                   doc="transformers Llama4TextAttention (eager) decoding one token per call with a DynamicCache, "
                   "generate's 2D attention mask turned into the additive mask by create_causal_mask, position_ids "
                   "= the positions; its RoPE, norm and softmax in float32"),
)
