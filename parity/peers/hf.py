"""Hugging Face transformers as a peer: BERT, ViT, GPT-2 and Llama attention, run on canonical weights.

    hf-bert    BertAttention (BertSelfAttention + output.dense), eager; self-attention
    hf-gpt2    GPT2Attention, eager; causal self-attention (its mask comes from create_causal_mask)
    hf-llama   LlamaAttention (eager) with LlamaRotaryEmbedding: grouped heads, RoPE, any bias set
    hf-llama-decode  the same LlamaAttention as a decoder (decode=True): one token per call against
               a DynamicCache, with generate's 2D attention mask (left padding masked) and position_ids
    hf-mistral MistralAttention (eager) with the mask MistralModel builds itself (structured=True): a
               sliding window from config.sliding_window (create_sliding_window_causal_mask, with
               generate's 2D attention mask), packed documents from position_ids alone (HF's packing:
               no attention_mask, documents where the positions restart)
    hf-qwen3, hf-gemma2, hf-gemma3, hf-olmo2, hf-gpt-oss
               each family's own attention module (eager) with its rotary embedding, on the layers
               with its feature (QK-norm per head or flat, soft-cap, sinks): self-attention, as hf-llama

    Scaled RoPE (linear, llama3, yarn, longrope) reaches every RoPE peer as transformers' rope_parameters
    (`hf_rope_parameters`: rope_type the kind, the RopeScaling's keys, LongRoPE's factor set explicitly), so each
    declares rope-scaled; their apply_rotary_pos_emb rotates the whole head, so none declares rope-partial
    (`full_rotary_parameters` refuses it). Phi-3, GPT-NeoX and Falcon: parity.peers.hf_fused.

    to_hf_cache / from_hf_cache     mha_torch.kv_cache.KVCache <-> a one-layer DynamicCache
    hf_attention_mask               the (B, L) 0/1 mask HF keeps beside it (its padding: HF has no
                                    per-row lengths)

The weights reach each module through its checkpoint layout (`parity.layouts`: "hf-bert",
"hf-vit", "hf-gpt2", "hf-llama"); the pure functions below take a canonical state dict,
NumPy inputs and a keep-mask in OUR polarity (bool, True = attend), translate the mask to
the library's own convention, run the module in `dtype` (weights and inputs cast to it,
explicitly) and return NumPy arrays. The factories wrap them in the registry's contract
with `uses_params=False` (the modules hold their own weights) and add
`fn.vjp(query, keep, cotangent)`, the library's own autograd gradients w.r.t. the input and
the weights (canonical names), which the peers check judges.

What each does (measured by scripts/measure_ecosystem.py and tests/test_modern_peers.py; docs/conversion.md):

    module              mask it takes                               fully masked row           softmax
    BERT (eager)        additive (B, 1, T, S): 0 / finfo.min        uniform (mean of V)        input dtype
    ViT (eager)         additive, as BERT (ViT itself never masks)  float32: uniform;          float32, cast back
                                                                    float64: NaN
    GPT-2 (eager)       additive, from create_causal_mask(padding)  uniform over ALL keys      input dtype
    Llama (eager)       additive, as BERT                           uniform in float32 and     float32, cast back
                                                                    16-bit; NaN in float64     (cos/sin too)

Llama's cos/sin come from LlamaRotaryEmbedding in float32, cast to the model dtype, and its
softmax is softmax(dtype=float32), cast back: a float64 run computes in float32
(computes_in="float32", 2e-8..5e-8 off the oracle) and is judged at the float32 entry. Its
eager mask is additive 0 / finfo(dtype).min, and finfo(float64).min becomes -inf in the
float32 softmax, so in float64 it runs only where no row is fully masked (unmasked and
causal self-attention). In float16 the same holds for a different reason: finfo(float16).min is
-65504, where float16's spacing is 32, so a fully masked row's scores s + min round to -65504 ± 32
or overflow to -inf wherever |s| exceeds 16 (weights of std 0.3 reach that), and the row is no
longer the uniform average its policy says (measured: margin 100-200 on `padding/uniform`);
BERT and Llama therefore run float16 only where no row is fully masked, Mistral's window cases
not in float16. torch and transformers are imported on first use (transformers takes ~3 s);
a missing transformers is a `MissingPackage` when a peer is built.
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from mha_spec import LLAMA_FEATURES
from parity.canonical import check_state_dict, numpy_to_tensor, tensor_to_numpy, torch_dtype_of
from parity.implementation import Implementation
from parity.layouts import from_layout, to_layout
from parity.peers.common import cast_state_dict, np_dtype, require
from parity.rope_layout import permute_rope

SMALL_VOCAB = 11  # the models are built only for their attention block; the vocabulary is never used


def torch_inputs(x, dtype):
    """x (NumPy or anything np.asarray takes) as a CPU tensor of the NumPy dtype `dtype`."""
    return numpy_to_tensor(np.asarray(x).astype(dtype))



# What no other file of parity/ imports (tests/test_house.py).
OWNS = ("import transformers",)


def transformers_module(name: str):
    """transformers' submodule `name` ("models.phi3.modeling_phi3", "cache_utils", ...), imported on first use:
    the one door to the library for the peers of its other modules (parity.peers.hf_fused), so that
    transformers is imported in this file only."""
    import importlib

    require("transformers")
    return importlib.import_module(f"transformers.{name}")

# ---------------------------------------------------------------- configs and masks


def hf_bert_config(embed_dim: int, num_heads: int):
    """A one-layer BertConfig whose attention block is E x E with N heads, eager attention, no dropout."""
    from transformers import BertConfig

    return BertConfig(
        hidden_size=embed_dim, num_attention_heads=num_heads, num_hidden_layers=1, intermediate_size=2 * embed_dim,
        vocab_size=SMALL_VOCAB, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, attn_implementation="eager",
    )


def hf_gpt2_config(embed_dim: int, num_heads: int, n_positions: int = 64):
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=embed_dim, n_head=num_heads, n_layer=1, vocab_size=SMALL_VOCAB, n_positions=n_positions,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )


def additive_mask(keep, dtype) -> np.ndarray:
    """Our keep-mask (B, T, S) -> HF's eager mask (B, 1, T, S): 0 where kept, finfo(dtype).min where masked.

    This is what transformers' create_bidirectional_mask builds for eager attention
    (tests/test_layouts.py checks it against the library's own function).
    """
    keep = np.asarray(keep)
    if keep.dtype != bool or keep.ndim != 3:
        raise ValueError(f"keep must be a bool (B, T, S) keep-mask, got {keep.dtype} {keep.shape}")
    import ml_dtypes

    dt = np_dtype(dtype)
    return np.where(keep[:, None], np.zeros((), dt), ml_dtypes.finfo(dt).min).astype(dt)


def gpt2_padding_of(keep) -> np.ndarray:
    """The (B, S) padding mask behind a GPT-2 keep-mask; ValueError unless keep == causal AND padding.

    GPT-2's causality is not in GPT2Attention: GPT2Model builds it into the attention mask
    (create_causal_mask). So the only keep-masks GPT-2 can express are tril(T, T) & padding[:, None, :].
    """
    keep = np.asarray(keep)
    if keep.dtype != bool or keep.ndim != 3 or keep.shape[1] != keep.shape[2]:
        raise ValueError(f"GPT-2 self-attention takes a bool (B, T, T) keep-mask, got {keep.dtype} {keep.shape}")
    padding = keep[:, -1, :]  # the last query sees every key that is not padding
    if not np.array_equal(keep, gpt2_keep_mask(padding)):
        raise ValueError("GPT-2 attention is causal: the keep-mask must be tril(T, T) & padding[:, None, :]")
    return padding


def gpt2_keep_mask(padding) -> np.ndarray:
    """Our keep-mask (B, T, T) equivalent to GPT-2 with this (B, T) padding mask (True = real token)."""
    padding = np.asarray(padding, bool)
    T = padding.shape[-1]
    return np.tril(np.ones((T, T), bool))[None] & padding[:, None, :]


# ---------------------------------------------------------------- BERT, ViT, GPT-2


def hf_bert_attention(sd, num_heads: int, dtype="float64"):
    """A transformers BertAttention (eval, dropout 0) holding `sd` (cast to dtype) via the hf-bert layout."""
    from transformers.models.bert.modeling_bert import BertAttention

    sd = cast_state_dict(sd, np_dtype(dtype))
    E, _ = check_state_dict(sd)
    att = BertAttention(hf_bert_config(E, num_heads)).to(torch_dtype_of(np_dtype(dtype))).eval()
    tensors = {k: numpy_to_tensor(v) for k, v in to_layout(sd, "hf-bert").items()}
    missing, unexpected = att.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) != {"output.LayerNorm.weight", "output.LayerNorm.bias"}:
        raise RuntimeError(f"BertAttention did not take the hf-bert layout: missing {missing}, unexpected {unexpected}")
    return att


def hf_bert_attention_forward(sd, num_heads: int, query, keep=None, dtype="float64") -> np.ndarray:
    """HF BERT self-attention (BertSelfAttention, then output.dense) on `query` (B, T, E).

    BertSelfOutput follows output.dense with dropout, LayerNorm and the residual: those are
    not attention and are left out -- the output is `output.dense(self(...))`.
    Mask: our keep (B, T, T) -> additive (B, 1, T, T), 0 kept / finfo(dtype).min masked.
    """
    import torch

    _, call = _hf_bert(sd, num_heads, keep, dtype)
    with torch.no_grad():
        return tensor_to_numpy(call(torch_inputs(query, np_dtype(dtype))))


def _hf_bert(sd, num_heads: int, keep, dtype):
    """(BertAttention, call(x) -> output.dense(self(x))) with our keep-mask as BERT's additive mask."""
    att = hf_bert_attention(sd, num_heads, dtype)
    mask = None if keep is None else numpy_to_tensor(additive_mask(keep, np_dtype(dtype)))

    def call(x):
        ctx, _ = att.self(x, attention_mask=mask)
        return att.output.dense(ctx)

    return att, call


def hf_vit_config(embed_dim: int, num_heads: int):
    from transformers import ViTConfig

    return ViTConfig(
        hidden_size=embed_dim, num_attention_heads=num_heads, num_hidden_layers=1, intermediate_size=2 * embed_dim,
        image_size=8, patch_size=4, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, attn_implementation="eager",
    )


def hf_vit_attention_forward(sd, num_heads: int, query, keep=None, dtype="float32") -> np.ndarray:
    """HF ViT attention (transformers 5.x ViTAttention: {q,k,v,o}_proj) on `query` (B, T, E).

    Its eager softmax runs in float32 and is cast back (even for float64 inputs). ViT itself
    never masks; a keep-mask is passed the BERT way (additive) to measure what the module does.
    """
    import torch
    from transformers.models.vit.modeling_vit import ViTAttention

    dt = np_dtype(dtype)
    sd = cast_state_dict(sd, dt)
    E, _ = check_state_dict(sd)
    att = ViTAttention(hf_vit_config(E, num_heads)).to(torch_dtype_of(dt)).eval()
    tensors = to_layout(sd, "hf-vit", spelling=1)  # the module's own {q,k,v,o}_proj names
    att.load_state_dict({k: numpy_to_tensor(v) for k, v in tensors.items()}, strict=True)
    mask = None if keep is None else numpy_to_tensor(additive_mask(keep, dt))
    with torch.no_grad():
        out, _ = att(torch_inputs(query, dt), attention_mask=mask)
    return tensor_to_numpy(out)


def hf_gpt2_attention_forward(sd, num_heads: int, query, keep=None, dtype="float64") -> np.ndarray:
    """HF GPT-2 attention (GPT2Attention: c_attn, eager attention, c_proj) on `query` (B, T, E).

    keep: None (plain causal) or a causal keep-mask (B, T, T) = gpt2_keep_mask(padding); the
    library's own create_causal_mask turns the padding into GPT-2's additive mask, as GPT2Model does.
    """
    import torch

    _, call = _hf_gpt2(sd, num_heads, np.shape(query), keep, dtype)
    with torch.no_grad():
        return tensor_to_numpy(call(torch_inputs(query, np_dtype(dtype))))


def _hf_gpt2(sd, num_heads: int, shape, keep, dtype):
    """(GPT2Attention, call(x) -> output) with GPT-2's own causal mask for this padding."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    dt = np_dtype(dtype)
    sd = cast_state_dict(sd, dt)
    E, _ = check_state_dict(sd)
    B, T = shape[:2]
    config = hf_gpt2_config(E, num_heads, n_positions=max(T, 1))
    att = GPT2Attention(config, layer_idx=0).to(torch_dtype_of(dt)).eval()
    att.load_state_dict({k: numpy_to_tensor(v) for k, v in to_layout(sd, "hf-gpt2").items()}, strict=True)
    padding = None if keep is None else torch.from_numpy(gpt2_padding_of(keep).astype(np.int64))
    position_ids = torch.arange(T)[None].expand(B, T)

    def call(x):
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=padding, past_key_values=None,
                                  position_ids=position_ids)
        out, _ = att(x, attention_mask=mask)
        return out

    return att, call


def hf_attention_vjp(library: str, sd, num_heads: int, query, keep, cotangent, dtype="float64") -> dict[str, np.ndarray]:
    """HF BERT or GPT-2 attention's gradients of sum(output * cotangent), as NumPy arrays.

    library: "hf-bert" | "hf-gpt2" (its layout's name). Keys: "input" -- the gradient
    w.r.t. its one input x (B, T, E), which as self-attention is the query, key and value
    at once -- and the canonical weight names (parity.convert), mapped back from the
    library's own parameters through the layout. A fully masked query row is uniform
    because finfo.min is ADDED to its scores, so its softmax is differentiated like any
    other: its gradient reaches the query and key gradients (reference.backward's
    masked_row_grads="flow").
    """
    import torch

    dt = np_dtype(dtype)
    if library == "hf-bert":
        att, call = _hf_bert(sd, num_heads, keep, dtype)
    elif library == "hf-gpt2":
        att, call = _hf_gpt2(sd, num_heads, np.shape(query), keep, dtype)
    else:
        raise ValueError(f"library must be 'hf-bert' or 'hf-gpt2', got {library!r}")
    x = torch_inputs(query, dt).requires_grad_(True)
    with torch.enable_grad():
        (call(x) * torch_inputs(cotangent, dt)).sum().backward()
    names = set(to_layout(cast_state_dict(sd, dt), library))
    grads = {n: tensor_to_numpy(p.grad) for n, p in att.named_parameters() if n in names}
    return {"input": tensor_to_numpy(x.grad), **from_layout(grads, library)}


# ---------------------------------------------------------------- Llama


_LLAMA_HEADROOM = 4096  # max_position_embeddings: the rotary cache is rebuilt past it, never truncated; any size works


def partial_rotary_factor(rope_dim: int, head_dim: int) -> float:
    """R/H as transformers' partial_rotary_factor, such that int(H * factor) == R: transformers truncates
    H * factor to the rotated features (modeling_rope_utils, GPTNeoXAttention.rotary_ndims), and R/H rounded
    to a float can land one ulp under R (R=30, H=44), so it is nudged up to the next float where it does."""
    factor = rope_dim / head_dim
    while int(head_dim * factor) < rope_dim:
        factor = math.nextafter(factor, 2.0)
    return factor


def hf_rope_parameters(config) -> dict:
    """The transformers rope_parameters of an mha_spec.AttentionConfig's RoPE: rope_type (the scaling's kind,
    "default" without one), rope_theta, partial_rotary_factor (R/H, only when R < H) and the RopeScaling's keys
    under their transformers names (lists for LongRoPE's factors). Every key the scaling has is passed, factor
    included: LongRoPE's factor otherwise comes from max_position_embeddings / original, which is not ours."""
    scaling = config.rope_scaling
    rope = {"rope_type": "default" if scaling is None else scaling.kind, "rope_theta": float(config.rope_theta)}
    if config.rotary_dim != config.head_size:
        rope["partial_rotary_factor"] = partial_rotary_factor(config.rotary_dim, config.head_size)
    if scaling is not None:
        for f in dataclasses.fields(scaling):
            value = getattr(scaling, f.name)
            if f.name != "kind" and value is not None:
                rope[f.name] = list(value) if isinstance(value, tuple) else value
    return rope


def full_rotary_parameters(config) -> dict:
    """hf_rope_parameters for the modules whose apply_rotary_pos_emb rotates the whole head (Llama, Mistral,
    Qwen3, Gemma 2/3, OLMo 2, GPT-OSS, Falcon: q * cos + rotate_half(q) * sin over all H features, so a cos of
    R < H features does not even broadcast): a partial layer is a ValueError (they do not declare rope-partial).
    A layer without RoPE gets the default table (the peers pass the identity rotation themselves)."""
    if config.rope is not None and config.rotary_dim != config.head_size:
        raise ValueError(f"rope_dim={config.rotary_dim} < head_dim={config.head_size}: this transformers module "
                         "rotates the whole head (no partial rotary)")
    if config.rope is None:
        return {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    return hf_rope_parameters(config)


def _llama_parts(sd, config, dtype):
    """(LlamaAttention holding sd, LlamaRotaryEmbedding, the canonical names sd has).

    An absent bias is a zero bias of LlamaAttention(attention_bias=True) (exactly no bias; its
    gradient is not reported); no bias at all is attention_bias=False. rope="interleaved"
    weights are Meta-style: HF runs them after its own conversion's q/k row permutation
    (`convert.permute_rope(to="half")`).
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    dt = np_dtype(dtype)
    sd = {k: np.asarray(v).astype(dt) for k, v in sd.items()}
    names = tuple(sorted(sd))
    N, K, H, E = config.num_heads, config.kv_heads, config.head_size, config.embed_dim
    if config.rope == "interleaved":
        sd = permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")
    any_bias = any(k.endswith(".bias") for k in sd)
    if any_bias:
        every = dataclasses.replace(config, qkv_bias=True, out_bias=True).weight_shapes()
        sd = {**{k: np.zeros(s, dt) for k, s in every.items() if k.endswith(".bias")}, **sd}
    hf = LlamaConfig(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, attention_bias=any_bias,
                     rope_parameters=full_rotary_parameters(config), num_hidden_layers=1, intermediate_size=2 * E,
                     vocab_size=SMALL_VOCAB, max_position_embeddings=_LLAMA_HEADROOM, attention_dropout=0.0,
                     attn_implementation="eager")
    att = LlamaAttention(hf, layer_idx=0).to(torch_dtype_of(dt)).eval()
    tensors = {k: numpy_to_tensor(v) for k, v in to_layout(sd, "hf-llama").items()}
    att.load_state_dict(tensors, strict=True)
    return att, LlamaRotaryEmbedding(hf), names


def llama_parts(sd, config, dtype):
    """(LlamaAttention holding the canonical weights sd, LlamaRotaryEmbedding) of an mha_spec.AttentionConfig,
    built once (mha-bench --decode times its calls); see `_llama_parts`."""
    return _llama_parts(sd, config, dtype)[:2]


def hf_position_ids(positions, key_positions, B: int, T: int):
    """HF's one position list (B, T) int64: LlamaAttention rotates queries and keys by the same position_ids."""
    import torch

    def as_np(p):
        return None if p is None else np.asarray(tensor_to_numpy(p) if hasattr(p, "detach") else p)

    pos, kpos = as_np(positions), as_np(key_positions)
    full = [np.broadcast_to(np.arange(T) if p is None else p, (B, T)) for p in (pos, kpos)]
    if not np.array_equal(full[0], full[1]):
        raise ValueError("HF LlamaAttention rotates queries and keys with one position list (position_ids): "
                         f"key_positions must equal positions, got {full[1].tolist()} and {full[0].tolist()}")
    return torch.from_numpy(np.ascontiguousarray(full[0]).astype(np.int64))


def _llama_call(att, rotary, config, keep, position_ids, dtype):
    """call(x) -> LlamaAttention(x) with HF's rotary cos/sin (identity when config.rope is None) and
    our keep-mask as its eager additive mask (0 kept / finfo(dtype).min)."""
    import torch

    dt = np_dtype(dtype)
    mask = None if keep is None else numpy_to_tensor(additive_mask(np.asarray(keep, bool), dt))

    def call(x):
        if config.rope is None:  # no rotary embedding: the identity rotation, cos 1, sin 0
            cos = torch.ones(*x.shape[:2], config.head_size, dtype=x.dtype)
            emb = (cos, torch.zeros_like(cos))
        else:
            emb = rotary(x, position_ids)
        out, _ = att(x, position_embeddings=emb, attention_mask=mask)
        return out

    return call


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def check_self_attention(query, key, value, library: str) -> None:
    """The HF modules are self-attention: refuse (clearly) a key or value that is not the query."""
    if not (np.array_equal(key, query) and np.array_equal(value, query)):
        raise ValueError(f"{library} attention is self-attention: key and value must equal query "
                         f"(got query {np.shape(query)}, key {np.shape(key)}, value {np.shape(value)})")


def _torch_peer(forward, library: str, sd, num_heads, *, dtype, device, layout: str):
    """fn(query, key, value, keep) of a uses_params=False HF peer (NumPy to the pure function and back), with fn.vjp."""
    require("transformers")

    def fn(query, key, value, keep):
        q, k, v = (tensor_to_numpy(x) for x in (query, key, value))
        check_self_attention(q, k, v, library)
        keep = None if keep is None else tensor_to_numpy(keep)
        return numpy_to_tensor(forward(sd, num_heads, q, keep, dtype), device)

    def vjp(query, keep, cotangent):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} (hf_attention_vjp)."""
        return hf_attention_vjp(layout, sd, num_heads, query, keep, cotangent, dtype)

    fn.vjp = vjp
    return fn


def hf_bert(sd, num_heads, *, dtype, device):
    """transformers BertAttention (BertSelfAttention + output.dense), eager; keep -> additive 0 / finfo.min."""
    return _torch_peer(hf_bert_attention_forward, "HF BERT", sd, num_heads, dtype=dtype, device=device, layout="hf-bert")


def hf_gpt2(sd, num_heads, *, dtype, device):
    """transformers GPT2Attention, eager; keep must be tril(T, T) & padding (its mask comes from create_causal_mask)."""
    return _torch_peer(hf_gpt2_attention_forward, "HF GPT-2", sd, num_heads, dtype=dtype, device=device, layout="hf-gpt2")


def hf_llama(sd, num_heads, *, dtype, device, problem):
    """transformers LlamaAttention (eager) with LlamaRotaryEmbedding; self-attention with one position list."""
    require("transformers")

    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-llama: num_heads={num_heads} but the problem's config has {config.num_heads}")

    def fn(query, key, value, keep, *, positions=None, key_positions=None):
        import torch

        q, k, v = (tensor_to_numpy(x) for x in (query, key, value))
        check_self_attention(q, k, v, "HF Llama")
        keep = None if keep is None else tensor_to_numpy(keep)
        ids = hf_position_ids(positions, key_positions, *q.shape[:2])
        att, rotary, _ = _llama_parts(sd, config, dtype)
        call = _llama_call(att, rotary, config, keep, ids, dtype)
        with torch.no_grad():
            out = call(torch_inputs(q, np_dtype(dtype)))
        return numpy_to_tensor(tensor_to_numpy(out), device)

    def vjp(query, keep, cotangent, *, positions=None, key_positions=None):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} of sum(output * cotangent)."""
        import torch

        dt = np_dtype(dtype)
        query = np.asarray(query)
        att, rotary, names = _llama_parts(sd, config, dtype)
        ids = hf_position_ids(positions, key_positions, *query.shape[:2])
        call = _llama_call(att, rotary, config, None if keep is None else np.asarray(keep), ids, dtype)
        x = torch_inputs(query, dt).requires_grad_(True)
        with torch.enable_grad():
            (call(x) * torch_inputs(cotangent, dt)).sum().backward()
        grads = from_layout({n: tensor_to_numpy(p.grad) for n, p in att.named_parameters()}, "hf-llama")
        if config.rope == "interleaved":  # a row permutation: the gradient's rows go back the same way
            grads = permute_rope(grads, num_heads=config.num_heads, num_kv_heads=config.kv_heads, to="interleaved")
        return {"input": tensor_to_numpy(x.grad), **{n: grads[n] for n in names}}

    fn.vjp = vjp
    return fn


# ---------------------------------------------------------------- Mistral: the mask MistralModel builds


def hf_mistral_config(config, sliding_window: int | None):
    """A one-layer MistralConfig for an mha_spec.AttentionConfig (eager attention, no dropout)."""
    from transformers import MistralConfig

    return MistralConfig(hidden_size=config.embed_dim, num_attention_heads=config.num_heads,
                         num_key_value_heads=config.kv_heads, head_dim=config.head_size,
                         rope_parameters=full_rotary_parameters(config),
                         sliding_window=sliding_window, num_hidden_layers=1, intermediate_size=2 * config.embed_dim,
                         vocab_size=SMALL_VOCAB, max_position_embeddings=_LLAMA_HEADROOM, attention_dropout=0.0,
                         attn_implementation="eager")


def mistral_sliding_window(is_causal: bool = False, window=None, segment_ids=None, key_segment_ids=None,
                           alignment: str = "top-left") -> int | None:
    """The structured masks as MistralConfig.sliding_window (None: no window), or a ValueError naming what
    Mistral cannot express: it is always causal, its window is the last W keys (window (W - 1, 0)), and its
    documents come from position_ids (self-attention: no key_segment_ids)."""
    from parity.reference import window_sides

    if not is_causal:
        raise ValueError("HF Mistral attention is always causal: the case must have is_causal=True")
    if key_segment_ids is not None:
        raise ValueError("HF Mistral packs one sequence (self-attention): key_segment_ids cannot be expressed")
    left, right = window_sides(window)
    if window is None:
        return None
    if right != 0 or left is None:
        raise ValueError(f"HF Mistral's sliding_window=W keeps the last W keys, window (W - 1, 0); got window {window!r}")
    return left + 1


def key_padding_2d(keep, B: int, S: int):
    """A key-padding keep-mask (B, T, S) as HF's 2D attention mask (B, S) int64; ValueError if its rows differ."""
    import torch

    if keep is None:
        return torch.ones(B, S, dtype=torch.int64)
    keep = np.asarray(keep, bool)
    if not (keep == keep[:, :1]).all():
        raise ValueError("HF's 2D attention_mask masks keys for every query alike: the padding must be the same for "
                         "every query of a row")
    return torch.from_numpy(keep[:, 0].astype(np.int64))


def _packed_from_positions(position_ids, segment_ids) -> None:
    """HF finds documents where position_ids do not step by 1 (find_packed_sequence_indices): they must be the
    case's documents, else a ValueError saying where they differ."""
    from transformers.masking_utils import find_packed_sequence_indices

    found = find_packed_sequence_indices(position_ids)
    found = np.zeros(tuple(position_ids.shape), np.int64) if found is None else found.numpy()
    seg = np.asarray(segment_ids)
    starts = np.ones(seg.shape, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    ours = np.cumsum(starts, axis=1) - 1
    if not np.array_equal(found, ours):
        raise ValueError(f"HF finds the documents {found.tolist()} in position_ids {position_ids.tolist()}, the case "
                         f"has {ours.tolist()}: HF packs by positions restarting, so each document's must")


def _mistral_call(sd, config, keep, position_ids, structure: dict, dtype):
    """(MistralAttention holding sd, call(x) -> its output) with MistralModel's own mask for `structure`."""
    import torch
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.mistral.modeling_mistral import MistralAttention, MistralRotaryEmbedding

    dt = np_dtype(dtype)
    window = mistral_sliding_window(**structure)
    hf = hf_mistral_config(config, window)
    att = MistralAttention(hf, layer_idx=0).to(torch_dtype_of(dt)).eval()
    att.load_state_dict({k: numpy_to_tensor(np.asarray(v).astype(dt)) for k, v in to_layout(sd, "hf-llama").items()},
                        strict=True)
    rotary = MistralRotaryEmbedding(hf)
    B, T = position_ids.shape
    if structure.get("segment_ids") is not None:
        if keep is not None:
            raise ValueError("HF packs documents from position_ids only when no attention_mask is given: packed "
                             "documents with padding cannot be expressed")
        _packed_from_positions(position_ids, structure["segment_ids"])
        mask2d = None  # the training path: documents from position_ids
    else:
        mask2d = key_padding_2d(keep, B, T)  # generate's path: a 2D mask, ones where nothing is padded
    make = create_causal_mask if window is None else create_sliding_window_causal_mask

    def call(x):
        mask = make(config=hf, inputs_embeds=x, attention_mask=mask2d, past_key_values=None, position_ids=position_ids)
        out, _ = att(x, position_embeddings=rotary(x, position_ids), attention_mask=mask)
        return out

    return att, call


def hf_mistral(sd, num_heads, *, dtype, device, problem):
    """transformers MistralAttention (eager) with the mask MistralModel builds: see `_mistral_call`."""
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-mistral: num_heads={num_heads} but the problem's config has {config.num_heads}")

    def make_call(keep, positions, key_positions, structure, B, T):
        return _mistral_call(sd, config, keep, hf_position_ids(positions, key_positions, B, T), structure, dtype)

    return self_attention_peer("HF Mistral", tuple(sorted(sd)), dtype, device, make_call)


def self_attention_peer(label: str, names: tuple, dtype, device, make_call):
    """fn(query, key, value, keep, *, positions=None, key_positions=None, **structure) -> output, with `fn.vjp`
    (the registry's contract) of a transformers self-attention module whose canonical weights are `names`, under
    hf-llama's names: make_call(keep (B, T, S) NumPy | None, positions, key_positions, structure {name: NumPy or
    a number}, B, T) -> (the module, call(x (B, T, E) tensor) -> output). The forward runs without gradients; the
    vjp gives {"input": d x, canonical weight name: gradient} of sum(output * cotangent), NumPy in and out."""
    def fn(query, key, value, keep, *, positions=None, key_positions=None, **structure):
        import torch

        q, k, v = (tensor_to_numpy(x) for x in (query, key, value))
        check_self_attention(q, k, v, label)
        keep = None if keep is None else tensor_to_numpy(keep)
        structure = {n: tensor_to_numpy(a) if hasattr(a, "detach") else a for n, a in structure.items()}
        _, call = make_call(keep, positions, key_positions, structure, *q.shape[:2])
        with torch.no_grad():
            out = call(torch_inputs(q, np_dtype(dtype)))
        return numpy_to_tensor(tensor_to_numpy(out), device)

    def vjp(query, keep, cotangent, *, positions=None, key_positions=None, **structure):
        import torch

        dt = np_dtype(dtype)
        query = np.asarray(query)
        att, call = make_call(None if keep is None else np.asarray(keep), positions, key_positions, structure,
                              *query.shape[:2])
        x = torch_inputs(query, dt).requires_grad_(True)
        with torch.enable_grad():
            (call(x) * torch_inputs(cotangent, dt)).sum().backward()
        grads = from_layout({n: tensor_to_numpy(p.grad) for n, p in att.named_parameters()}, "hf-llama")
        return {"input": tensor_to_numpy(x.grad), **{n: grads[n] for n in names}}

    fn.vjp = vjp
    return fn


# ---------------------------------------------------------------- decoding: DynamicCache


def _kv_cache_class():
    from mha_torch.kv_cache import KVCache

    return KVCache


def to_hf_cache(cache):
    """mha_torch.kv_cache.KVCache -> a one-layer transformers DynamicCache of its written slots.

    Both hold one layer's keys after RoPE and its values as (B, K, slots, H) (LlamaAttention
    rotates before `DynamicCache.update`). Only slots [0, max(lengths)) go to HF, copied: HF keeps
    one length for the whole batch, so a row's padding -- its left padding and, in a row shorter
    than the longest, the slots from its own length on -- lives in the 2D attention mask HF
    carries beside the cache (`hf_attention_mask`), which must keep them 0 for every later token.
    """
    from transformers import DynamicCache

    KVCache = _kv_cache_class()
    if not isinstance(cache, KVCache):
        raise TypeError(f"to_hf_cache takes an mha_torch.kv_cache.KVCache, got {type(cache).__name__}")
    L = int(cache.lengths.max()) if cache.lengths.numel() else 0
    return DynamicCache(ddp_cache_data=[(cache.k[:, :, :L].clone(), cache.v[:, :, :L].clone())])


def hf_attention_mask(cache):
    """(B, max(lengths)) int64, HF's 2D attention mask for `to_hf_cache(cache)`: 1 on a row's valid
    slots starts[b] <= s < lengths[b], 0 on its padding (generate's convention; append a 1 per new token)."""
    KVCache = _kv_cache_class()
    if not isinstance(cache, KVCache):
        raise TypeError(f"hf_attention_mask takes an mha_torch.kv_cache.KVCache, got {type(cache).__name__}")
    import torch

    L = int(cache.lengths.max()) if cache.lengths.numel() else 0
    s = torch.arange(L, device=cache.lengths.device)
    return ((s >= cache.starts[:, None]) & (s < cache.lengths[:, None])).to(torch.int64)


def _row_counts(x, batch: int, name: str):
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"from_hf_cache: {name} must be a torch.Tensor of integers, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"from_hf_cache: {name} must have shape ({batch},) (one per batch row), got {tuple(x.shape)}")
    return x.to(torch.int64)


def from_hf_cache(dynamic_cache, starts, lengths, *, capacity: int | None = None):
    """A one-layer transformers DynamicCache -> mha_torch.kv_cache.KVCache with these per-row counts.

    dynamic_cache: keys and values (B, K, L, H), keys after RoPE. starts, lengths (B,) integer
    tensors, 0 <= starts <= lengths <= L: the row's left padding and the slots it has written (HF
    keeps neither: its padding is in the attention mask). capacity: the cache's slots, >= L (default
    L). Slots from a row's length on are zeros, as in a cache our modules write (HF's entries there
    are dropped), so `from_hf_cache(to_hf_cache(c), c.starts, c.lengths, capacity=c.capacity)` is `c`
    bit for bit.
    """
    import torch
    from transformers import DynamicCache

    if not isinstance(dynamic_cache, DynamicCache):
        raise TypeError(f"from_hf_cache takes a transformers DynamicCache, got {type(dynamic_cache).__name__}")
    if len(dynamic_cache.layers) != 1 or not dynamic_cache.layers[0].is_initialized:
        raise ValueError(f"from_hf_cache converts one written layer; this DynamicCache has {len(dynamic_cache.layers)} "
                         "layers" + ("" if len(dynamic_cache.layers) != 1 else ", not initialized"))
    keys, values = dynamic_cache.layers[0].keys, dynamic_cache.layers[0].values
    if keys.ndim != 4 or tuple(values.shape) != tuple(keys.shape):
        raise ValueError(f"DynamicCache keys {tuple(keys.shape)} and values {tuple(values.shape)} are not both (B, K, L, H)")
    B, K, L, H = keys.shape
    starts, lengths = _row_counts(starts, B, "starts"), _row_counts(lengths, B, "lengths")
    C = L if capacity is None else capacity
    if isinstance(C, bool) or not isinstance(C, int) or C < max(L, 1):
        raise ValueError(f"from_hf_cache: capacity must be an int >= the DynamicCache's {L} slots (and >= 1), got {capacity!r}")
    if bool(((starts < 0) | (starts > lengths) | (lengths > L)).any()):
        raise ValueError(f"from_hf_cache: need 0 <= starts <= lengths <= {L} (the DynamicCache's slots); "
                         f"got starts {starts.tolist()}, lengths {lengths.tolist()}")
    written = (torch.arange(L, device=keys.device) < lengths[:, None].to(keys.device))[:, None, :, None]  # (B, 1, L, 1)
    k = torch.zeros(B, K, C, H, dtype=keys.dtype, device=keys.device)
    v = torch.zeros_like(k)
    k[:, :, :L] = torch.where(written, keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    v[:, :, :L] = torch.where(written, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return _kv_cache_class()(k, v, starts.to(keys.device), lengths.to(keys.device))


@dataclasses.dataclass(frozen=True)
class HFDecodeCache:
    """hf-llama-decode's own cache: what generate carries between steps for one layer.

    past            a one-layer DynamicCache: keys after RoPE and values, (B, K, L, H)
    attention_mask  (B, L) int64: 1 on a real token's slot, 0 on a left-padding one

    A step builds a new DynamicCache from `past`'s tensors (so a step leaves its argument as it
    was, and one prefix can be continued twice); `from_hf_cache(c.past, starts, lengths)` reads it
    as our KVCache.
    """

    past: object
    attention_mask: object


def _llama_run(att, x, emb, mask, past):
    return att(x, position_embeddings=emb, attention_mask=mask, past_key_values=past)[0]


def hf_llama_decode_step(att, rotary, config, x, cache, position, run=_llama_run):
    """One decode step of LlamaAttention: x (B, 1, E) torch, position (B,) int64 (-1: left padding).
    run(att, x, emb, mask, past) -> output calls the module (another family's attention with its own
    keywords: parity.peers.hf_fused); `att.config` is what create_causal_mask reads.

    As HF's generate does with left padding: the 2D attention mask gains a 0 for a padding token
    (1 for a real one), create_causal_mask turns it into the eager additive mask (B, 1, 1, L + 1)
    over the cache, 0 / finfo(dtype).min, and a padding token's position_id is 0 (masked, so
    never seen). Returns (output (B, 1, E), the next HFDecodeCache).
    """
    import torch
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    B = x.shape[0]
    if cache is None:
        past = DynamicCache()
        mask2d = torch.zeros(B, 0, dtype=torch.int64)
    else:
        if not isinstance(cache, HFDecodeCache):
            raise TypeError(f"hf-llama-decode: cache must be None or the HFDecodeCache it returned, got {type(cache).__name__}")
        layer = cache.past.layers[0]
        past = DynamicCache(ddp_cache_data=[(layer.keys, layer.values)])
        mask2d = cache.attention_mask
    real = position >= 0  # (B,)
    mask2d = torch.cat([mask2d, real[:, None].to(torch.int64)], dim=1)  # (B, L + 1)
    position_ids = torch.where(real, position, torch.zeros_like(position))[:, None]  # (B, 1)
    mask = create_causal_mask(config=att.config, inputs_embeds=x, attention_mask=mask2d, past_key_values=past,
                              position_ids=position_ids)
    if config.rope is None:  # no rotary embedding: the identity rotation
        cos = torch.ones(B, 1, config.head_size, dtype=x.dtype)
        emb = (cos, torch.zeros_like(cos))
    else:
        emb = rotary(x, position_ids)
    return run(att, x, emb, mask, past), HFDecodeCache(past, mask2d)


def hf_llama_prefill(att, rotary, config, x):
    """The prompt x (B, S, E) torch through `att` (`llama_parts`) into a new DynamicCache, with the causal mask
    create_causal_mask makes of an all-ones 2D attention mask and position_ids arange(S), as generate prefills
    a batch without padding: (output (B, S, E), the HFDecodeCache `hf_llama_decode_step` continues)."""
    import torch
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    B, S, _ = x.shape
    past, mask2d = DynamicCache(), torch.ones(B, S, dtype=torch.int64)
    pos = torch.arange(S)[None].expand(B, -1)  # (B, S)
    mask = create_causal_mask(config=att.config, inputs_embeds=x, attention_mask=mask2d, past_key_values=past,
                              position_ids=pos)
    if config.rope is None:  # no rotary embedding: the identity rotation
        cos = torch.ones(B, S, config.head_size, dtype=x.dtype)
        emb = (cos, torch.zeros_like(cos))
    else:
        emb = rotary(x, pos)
    return _llama_run(att, x, emb, mask, past), HFDecodeCache(past, mask2d)


def decode_args(name: str, x_t, position, E: int):
    """x_t (B, 1, E) floating tensor and position (B,) integer tensor, checked; position as int64 on CPU."""
    import torch

    if not isinstance(x_t, torch.Tensor) or x_t.ndim != 3 or x_t.shape[1] != 1 or x_t.shape[2] != E:
        raise ValueError(f"{name}: x_t must be a (B, 1, E={E}) tensor (one token per row), got "
                         f"{tuple(getattr(x_t, 'shape', ())) or type(x_t).__name__}")
    if not isinstance(position, torch.Tensor) or position.dtype.is_floating_point or position.dtype == torch.bool:
        raise TypeError(f"{name}: position must be a (B,) integer tensor, got {getattr(position, 'dtype', type(position).__name__)}")
    if tuple(position.shape) != (x_t.shape[0],):
        raise ValueError(f"{name}: position must have shape ({x_t.shape[0]},) (one per row), got {tuple(position.shape)}")
    return position.detach().cpu().to(torch.int64)


def hf_llama_decode(sd, num_heads, *, dtype, device, problem):
    """transformers LlamaAttention as a decoder: fn(p, x_t, cache, position) -> (out, cache).

    p: the canonical parameters (torch tensors or NumPy arrays), loaded into a LlamaAttention at
    each call (the step computes with them, on the CPU); cache: None on the first call, then the
    HFDecodeCache it returned. See hf_llama_decode_step for the mask and positions.
    """
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-llama-decode: num_heads={num_heads} but the problem's config has {config.num_heads}")

    def fn(p, x_t, cache, position):
        import torch

        pos = decode_args("hf-llama-decode", x_t, position, config.embed_dim)
        if x_t.dtype != torch_dtype_of(np_dtype(dtype)):
            raise TypeError(f"hf-llama-decode was built for {dtype}; x_t is {x_t.dtype}")
        if not isinstance(p, Mapping):
            raise TypeError(f"hf-llama-decode: p must be the canonical parameters (a mapping), got {type(p).__name__}")
        params = {k: tensor_to_numpy(v) if hasattr(v, "detach") else np.asarray(v) for k, v in p.items()}
        att, rotary, _ = _llama_parts(params, config, dtype)
        with torch.no_grad():
            out, cache = hf_llama_decode_step(att, rotary, config, torch_inputs(tensor_to_numpy(x_t), np_dtype(dtype)),
                                              cache, pos)
        return out.to(x_t.device), cache

    return fn


# ---------------------------------------------------------------- declarations

# ---------------------------------------------------------------- the layers after Llama: each family's own module


# peer -> (transformers config class, modeling module, attention class, rotary class, the features it runs,
# those its layer always has). Each runs its family's attention module as transformers ships it, on our weights.
_FAMILY_MODULES = {
    "hf-qwen3": ("Qwen3Config", "qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding",
                 ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "rope-scaled"), ("rope-half", "qk-norm-head")),
    "hf-gemma2": ("Gemma2Config", "gemma2", "Gemma2Attention", "Gemma2RotaryEmbedding",
                  ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "scale", "rope-scaled"),
                  ("rope-half", "softcap")),
    # transformers' Gemma3Attention stores attn_logit_softcapping but never applies it (5.x): no softcap here.
    "hf-gemma3": ("Gemma3TextConfig", "gemma3", "Gemma3Attention", "Gemma3RotaryEmbedding",
                  ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "scale", "rope-scaled"),
                  ("rope-half", "qk-norm-head")),
    "hf-olmo2": ("Olmo2Config", "olmo2", "Olmo2Attention", "Olmo2RotaryEmbedding",
                 ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "rope-scaled"), ("rope-half", "qk-norm-flat")),
    "hf-gpt-oss": ("GptOssConfig", "gpt_oss", "GptOssAttention", "GptOssRotaryEmbedding",
                   ("grouped", "no-qkv-bias", "no-out-bias", "head-dim", "rope-scaled"), ("rope-half", "sinks")),
}
_NORM_OFFSET = {"hf-qwen3": 0.0, "hf-gemma3": 1.0, "hf-olmo2": 0.0}  # the offset each module's RMSNorm adds to w
# Where a peer runs only cases without a fully masked row (none at present: a soft-capped layer's fully
# masked row, whose gradient flows through the cap at the key's own score, is the oracle's too).
_NO_EMPTY_ROWS: dict[str, tuple[str, ...]] = {}


def _family_config(name: str, config):
    """The one-layer transformers config of peer `name`'s family for an mha_spec.AttentionConfig (eager, full
    attention, the default RoPE at config.rope_theta, every bias when the layer has any)."""
    import transformers

    cls = _FAMILY_MODULES[name][0]
    rope = full_rotary_parameters(config)
    kw = dict(hidden_size=config.embed_dim, num_attention_heads=config.num_heads, num_key_value_heads=config.kv_heads,
              head_dim=config.head_size, attention_bias=config.qkv_bias or config.out_bias, num_hidden_layers=1,
              intermediate_size=2 * config.embed_dim, vocab_size=SMALL_VOCAB, max_position_embeddings=_LLAMA_HEADROOM,
              attention_dropout=0.0, attn_implementation="eager", rope_parameters=rope)
    if name != "hf-olmo2":
        kw["layer_types"] = ["full_attention"]
    if config.qk_norm is not None:
        kw["rms_norm_eps"] = config.qk_norm_eps
    if name in ("hf-gemma2", "hf-gemma3"):  # transformers scales by query_pre_attn_scalar**-0.5, an int field
        kw.update(query_pre_attn_scalar=max(1, round(config.softmax_scale ** -2)), attn_logit_softcapping=config.softcap)
    if name == "hf-gemma3":
        kw["rope_parameters"] = {"full_attention": rope}
    if name == "hf-gpt-oss":
        kw.update(num_local_experts=2, num_experts_per_tok=1)
    return getattr(transformers, cls)(**kw)


def _family_parts(name: str, sd, config, dtype):
    """(the family's attention module holding sd, its rotary embedding, the canonical names sd has).

    An absent bias is a zero bias of the module with attention_bias=True (exactly no bias; its gradient is
    not reported). A QK-norm weight w of the layer's offset o goes in as o + w - (the module's own offset),
    the same norm weight (offset + w) in the module's spelling; its gradient is the same.
    """
    import importlib

    _, module, attention, rotary = _FAMILY_MODULES[name][:4]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    dt = np_dtype(dtype)
    sd = {k: np.asarray(v).astype(dt) for k, v in sd.items()}
    names = tuple(sorted(sd))
    if any(k.endswith(".bias") for k in sd):
        every = dataclasses.replace(config, qkv_bias=True, out_bias=True).weight_shapes()
        sd = {**{k: np.zeros(s, dt) for k, s in every.items() if k.endswith(".bias")}, **sd}
    shift = config.qk_norm_offset - _NORM_OFFSET.get(name, 0.0) if config.qk_norm else 0.0
    if shift:
        sd.update({k: (sd[k].astype(np.float64) + shift).astype(dt) for k in ("q_norm.weight", "k_norm.weight")})
    hf = _family_config(name, config)
    att = getattr(modeling, attention)(hf, layer_idx=0).to(torch_dtype_of(dt)).eval()
    if hasattr(hf, "query_pre_attn_scalar"):  # a scale whose inverse square is no integer: the module's own field
        att.scaling = config.softmax_scale
    att.load_state_dict({k: numpy_to_tensor(v) for k, v in to_layout(sd, "hf-llama").items()}, strict=True)
    return att, getattr(modeling, rotary)(hf), names


def _family_call(name, att, rotary, keep, position_ids, dtype):
    """call(x) -> the family's attention of x with its rotary cos/sin and our keep-mask as its additive mask."""
    dt = np_dtype(dtype)
    mask = None if keep is None else numpy_to_tensor(additive_mask(np.asarray(keep, bool), dt))

    def call(x):
        emb = rotary(x, position_ids, "full_attention") if name == "hf-gemma3" else rotary(x, position_ids)
        out = att(x, position_embeddings=emb, attention_mask=mask)[0]
        return out

    return call


def _family_peer(name: str, sd, num_heads, *, dtype, device, problem):
    """fn(query, key, value, keep, positions=, key_positions=) running peer `name`'s module, with fn.vjp."""
    require("transformers")
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"{name}: num_heads={num_heads} but the problem's config has {config.num_heads}")

    def fn(query, key, value, keep, *, positions=None, key_positions=None):
        import torch

        q, k, v = (tensor_to_numpy(x) for x in (query, key, value))
        check_self_attention(q, k, v, name)
        keep = None if keep is None else tensor_to_numpy(keep)
        ids = hf_position_ids(positions, key_positions, *q.shape[:2])
        att, rotary, _ = _family_parts(name, sd, config, dtype)
        with torch.no_grad():
            out = _family_call(name, att, rotary, keep, ids, dtype)(torch_inputs(q, np_dtype(dtype)))
        return numpy_to_tensor(tensor_to_numpy(out), device)

    def vjp(query, keep, cotangent, *, positions=None, key_positions=None):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} of sum(output * cotangent)."""
        import torch

        dt = np_dtype(dtype)
        query = np.asarray(query)
        att, rotary, names = _family_parts(name, sd, config, dtype)
        ids = hf_position_ids(positions, key_positions, *query.shape[:2])
        call = _family_call(name, att, rotary, None if keep is None else np.asarray(keep), ids, dtype)
        x = torch_inputs(query, dt).requires_grad_(True)
        with torch.enable_grad():
            (call(x) * torch_inputs(cotangent, dt)).sum().backward()
        grads = from_layout({n: tensor_to_numpy(p.grad) for n, p in att.named_parameters()}, "hf-llama",
                            qk_norm=config.qk_norm, sinks=config.sinks)
        return {"input": tensor_to_numpy(x.grad), **{n: grads[n] for n in names}}

    fn.vjp = vjp
    return fn


def hf_qwen3(sd, num_heads, *, dtype, device, problem):
    """transformers Qwen3Attention (eager): QK-norm per head (w, offset 0)."""
    return _family_peer("hf-qwen3", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_gemma2(sd, num_heads, *, dtype, device, problem):
    """transformers Gemma2Attention (eager): query_pre_attn_scalar's scale, soft-capped logits."""
    return _family_peer("hf-gemma2", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_gemma3(sd, num_heads, *, dtype, device, problem):
    """transformers Gemma3Attention (eager): QK-norm per head (1 + w), scale."""
    return _family_peer("hf-gemma3", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_olmo2(sd, num_heads, *, dtype, device, problem):
    """transformers Olmo2Attention (eager): QK-norm over the whole q and k projections."""
    return _family_peer("hf-olmo2", sd, num_heads, dtype=dtype, device=device, problem=problem)


def hf_gpt_oss(sd, num_heads, *, dtype, device, problem):
    """transformers GptOssAttention (eager): a learned sink logit per head."""
    return _family_peer("hf-gpt-oss", sd, num_heads, dtype=dtype, device=device, problem=problem)


def _family_implementation(name: str, factory: str, doc: str) -> Implementation:
    variants, requires = _FAMILY_MODULES[name][4:]
    return Implementation(name, "torch", f"{__name__}:{factory}", masked_rows="uniform", mask_shape="BTS",
                          uses_params=False, computes_in="float32", role="peer", bench=False, masked_row_grads="flow",
                          variants=variants, requires=requires, classic=False,
                          runs_on=_NO_EMPTY_ROWS.get(name, ("self/none/*", "self/causal/*", "self/*/float32",
                                                            "self/*/bfloat16")), doc=doc)


# The float16 units without a fully masked row, where an additive finfo(float16).min mask is exact.
NO_EMPTY_ROWS_FLOAT16 = ("self/none/float16", "self/causal/float16")

IMPLEMENTATIONS = (
    # float16 only where no row is fully masked (none, causal self-attention): see the module docstring.
    Implementation("hf-bert", "torch", f"{__name__}:hf_bert", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, masked_row_grads="flow",
                   runs_on=("self/*/float64", "self/*/float32", "self/*/bfloat16", *NO_EMPTY_ROWS_FLOAT16),
                   doc="transformers BertAttention (self + output.dense), eager; additive mask 0 / finfo.min, "
                   "so empty rows are uniform, and their gradient flows into the query and key gradients"),
    Implementation("hf-gpt2", "torch", f"{__name__}:hf_gpt2", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, runs_on=("self/causal/*",), masked_row_grads="flow",
                   doc="transformers GPT2Attention, eager; causal by its mask (create_causal_mask), "
                   "a query with only padding is uniform over all keys"),
    # float64 and float16 only where no row is fully masked (none, causal self-attention): see the module docstring.
    Implementation("hf-llama", "torch", f"{__name__}:hf_llama", masked_rows="uniform", mask_shape="BTS", uses_params=False,
                   computes_in="float32", role="peer", bench=False, masked_row_grads="flow",
                   variants=(*LLAMA_FEATURES, "rope-scaled"),
                   runs_on=("self/none/*", "self/causal/*", "self/*/float32", "self/*/bfloat16"),
                   doc="transformers LlamaAttention (eager) with LlamaRotaryEmbedding, position_ids = the positions; "
                   "additive mask 0 / finfo.min, so empty rows are uniform and their gradient flows; cos/sin and softmax "
                   "in float32 (also for float64); interleaved RoPE via HF's q/k row permutation, absent biases as zeros"),
    # MistralModel's own masks on the structured cases. float64 on packed rows only: a padded window has fully
    # masked rows, NaN in float64 (finfo(float64).min is -inf in the float32 softmax), as for hf-llama.
    Implementation("hf-mistral", "torch", f"{__name__}:hf_mistral", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, computes_in="float32", role="peer", bench=False, masked_row_grads="flow",
                   variants=("grouped", "rope-scaled"), requires=("rope-half", "no-qkv-bias", "no-out-bias"),
                   structured=True,
                   runs_on=("self/packed/*", "self/window/float32", "self/window/bfloat16"),
                   doc="transformers MistralAttention (eager) with the mask MistralModel builds: sliding_window = W from "
                   "the window (W - 1, 0) through create_sliding_window_causal_mask and generate's 2D attention mask; "
                   "packed documents from position_ids alone (restarting positions, no attention_mask); cos/sin and "
                   "softmax in float32; empty rows uniform (finfo.min added), their gradient flows"),
    # A decoder's only fully masked rows are its left-padding tokens, whose outputs are not judged: it runs
    # in every dtype (in float64 such a row is NaN, finfo(float64).min being -inf in the float32 softmax).
    Implementation("hf-llama-decode", "torch", f"{__name__}:hf_llama_decode", decode=True, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=False, masked_row_grads="flow",
                   variants=(*LLAMA_FEATURES, "rope-scaled"),
                   runs_on=("self/*/*",),
                   doc="transformers LlamaAttention (eager) decoding one token per call with a DynamicCache "
                   "(past_key_values), generate's 2D attention mask (left padding 0) turned into the additive mask "
                   "over the cache by create_causal_mask, position_ids = the positions; cos/sin and softmax in float32"),
    # The layers after Llama, each run by its family's own module (self-attention, one position list, additive
    # finfo.min mask: where hf-llama runs). cos/sin in float32 (and the QK-norm, and all but GPT-OSS's softmax).
    _family_implementation("hf-qwen3", "hf_qwen3", "transformers Qwen3Attention (eager), QK-norm per head; "
                           "cos/sin, norm and softmax in float32"),
    _family_implementation("hf-gemma2", "hf_gemma2", "transformers Gemma2Attention (eager), query_pre_attn_scalar's "
                           "scale and attn_logit_softcapping; cos/sin and softmax in float32; a fully masked row's "
                           "gradient flows through the cap (finfo.min added after it)"),
    _family_implementation("hf-gemma3", "hf_gemma3", "transformers Gemma3Attention (eager), QK-norm per head "
                           "(1 + w; a layer's other offset goes in as its w), scale; float32 inside"),
    _family_implementation("hf-olmo2", "hf_olmo2", "transformers Olmo2Attention (eager), QK-norm over the whole "
                           "q and k projections; cos/sin, norm and softmax in float32"),
    _family_implementation("hf-gpt-oss", "hf_gpt_oss", "transformers GptOssAttention (eager), a sink logit per "
                           "head in the softmax (in the model's dtype); cos/sin in float32"),
)
