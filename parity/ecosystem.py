"""The real libraries' attention, run on canonical weights: one pure function per library.

Each function takes a canonical state dict (parity.convert), NumPy inputs and a keep-mask
in OUR polarity (bool, True = attend), translates the mask to the library's own convention,
runs the library's module in `dtype` (weights and inputs are cast to it, explicitly) and
returns the output as a NumPy array. They are the peer adapters of the parity harness.

What each library does (measured by scripts/measure_ecosystem.py; docs/conversion.md):

    library                 mask it takes                            fully masked row          softmax
    HF BERT (eager)         additive (B, 1, T, S): 0 / finfo.min      uniform (mean of V)       input dtype
    HF ViT (eager)          additive, as BERT (ViT itself never masks) float32: uniform;       float32, cast back
                                                                      float64: NaN
    HF GPT-2 (eager)        additive, from create_causal_mask(padding) uniform over ALL keys   input dtype
    Keras 3 MHA, default    bool (B, T, S), True = attend             uniform                   float32 stage in a
                            (runs jax.nn.dot_product_attention)                                 float64 run (2e-7)
    Keras 3 MHA, return_attention_scores=True (measured; dropout > 0 takes the same path, per its source)
                            bool, True = attend (einsum + Softmax)    zero (weights zeroed)     input dtype
    Equinox MHA             bool (T, S), True = attend, unbatched     uniform (mean of V)       input dtype

The transformers imports are slow (~3 s), so they happen on first use.
"""

from __future__ import annotations

import numpy as np

from parity import convert

SMALL_VOCAB = 11  # the models are built only for their attention block; the vocabulary is never used


def _cast_sd(sd, dtype) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).astype(dtype) for k, v in sd.items()}


def _np_dtype(dtype) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)


def _torch_inputs(x, dtype):
    return convert.numpy_to_tensor(np.asarray(x).astype(dtype))


# ---------------------------------------------------------------- Hugging Face


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
    (tests/test_ecosystem.py checks it against the library's own function).
    """
    keep = np.asarray(keep)
    if keep.dtype != bool or keep.ndim != 3:
        raise ValueError(f"keep must be a bool (B, T, S) keep-mask, got {keep.dtype} {keep.shape}")
    import ml_dtypes

    dt = _np_dtype(dtype)
    return np.where(keep[:, None], np.zeros((), dt), ml_dtypes.finfo(dt).min).astype(dt)


def hf_bert_attention(sd, num_heads: int, dtype="float64"):
    """A transformers BertAttention (eval, dropout 0) holding `sd` (cast to dtype) via the hf-bert layout."""
    from transformers.models.bert.modeling_bert import BertAttention

    sd = _cast_sd(sd, _np_dtype(dtype))
    E, _ = convert.check_state_dict(sd)
    att = BertAttention(hf_bert_config(E, num_heads)).to(convert._torch_dtype(_np_dtype(dtype))).eval()
    tensors = {k: convert.numpy_to_tensor(v) for k, v in convert.to_layout(sd, "hf-bert").items()}
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
        return convert.tensor_to_numpy(call(_torch_inputs(query, _np_dtype(dtype))))


def _hf_bert(sd, num_heads: int, keep, dtype):
    """(BertAttention, call(x) -> output.dense(self(x))) with our keep-mask as BERT's additive mask."""
    att = hf_bert_attention(sd, num_heads, dtype)
    mask = None if keep is None else convert.numpy_to_tensor(additive_mask(keep, _np_dtype(dtype)))

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

    dt = _np_dtype(dtype)
    sd = _cast_sd(sd, dt)
    E, _ = convert.check_state_dict(sd)
    att = ViTAttention(hf_vit_config(E, num_heads)).to(convert._torch_dtype(dt)).eval()
    tensors = convert.to_layout(sd, "hf-vit", spelling=1)  # the module's own {q,k,v,o}_proj names
    att.load_state_dict({k: convert.numpy_to_tensor(v) for k, v in tensors.items()}, strict=True)
    mask = None if keep is None else convert.numpy_to_tensor(additive_mask(keep, dt))
    with torch.no_grad():
        out, _ = att(_torch_inputs(query, dt), attention_mask=mask)
    return convert.tensor_to_numpy(out)


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


def hf_gpt2_attention_forward(sd, num_heads: int, query, keep=None, dtype="float64") -> np.ndarray:
    """HF GPT-2 attention (GPT2Attention: c_attn, eager attention, c_proj) on `query` (B, T, E).

    keep: None (plain causal) or a causal keep-mask (B, T, T) = gpt2_keep_mask(padding); the
    library's own create_causal_mask turns the padding into GPT-2's additive mask, as GPT2Model does.
    """
    import torch

    _, call = _hf_gpt2(sd, num_heads, np.shape(query), keep, dtype)
    with torch.no_grad():
        return convert.tensor_to_numpy(call(_torch_inputs(query, _np_dtype(dtype))))


def _hf_gpt2(sd, num_heads: int, shape, keep, dtype):
    """(GPT2Attention, call(x) -> output) with GPT-2's own causal mask for this padding."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    dt = _np_dtype(dtype)
    sd = _cast_sd(sd, dt)
    E, _ = convert.check_state_dict(sd)
    B, T = shape[:2]
    config = hf_gpt2_config(E, num_heads, n_positions=max(T, 1))
    att = GPT2Attention(config, layer_idx=0).to(convert._torch_dtype(dt)).eval()
    att.load_state_dict({k: convert.numpy_to_tensor(v) for k, v in convert.to_layout(sd, "hf-gpt2").items()}, strict=True)
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

    dt = _np_dtype(dtype)
    if library == "hf-bert":
        att, call = _hf_bert(sd, num_heads, keep, dtype)
    elif library == "hf-gpt2":
        att, call = _hf_gpt2(sd, num_heads, np.shape(query), keep, dtype)
    else:
        raise ValueError(f"library must be 'hf-bert' or 'hf-gpt2', got {library!r}")
    x = _torch_inputs(query, dt).requires_grad_(True)
    with torch.enable_grad():
        (call(x) * _torch_inputs(cotangent, dt)).sum().backward()
    names = set(convert.to_layout(_cast_sd(sd, dt), library))
    grads = {n: convert.tensor_to_numpy(p.grad) for n, p in att.named_parameters() if n in names}
    return {"input": convert.tensor_to_numpy(x.grad), **convert.from_layout(grads, library)}


# ---------------------------------------------------------------- Keras 3, Equinox


def keras_mha_forward(sd, num_heads: int, query, key, value, keep=None, dtype="float32", *, return_attention_scores=False) -> np.ndarray:
    """keras.layers.MultiHeadAttention (JAX backend) called as layer(query, value, key, attention_mask=keep).

    Keras's attention_mask has our polarity (True = attend), shape (B, T, S). Keras takes two
    paths: by default jax.nn.dot_product_attention (its float64 softmax is float32, measured
    ~2e-7 off the oracle); with return_attention_scores=True its own einsum + Softmax layer
    (float64 throughout). Only the output is returned either way.
    """
    import jax.numpy as jnp

    dt = _np_dtype(dtype)
    layer = convert.to_keras(_cast_sd(sd, dt), num_heads)
    q, k, v = (jnp.asarray(np.asarray(x).astype(dt)) for x in (query, key, value))
    mask = None if keep is None else jnp.asarray(np.asarray(keep, bool))
    out = layer(q, v, key=k, attention_mask=mask, training=False, return_attention_scores=return_attention_scores)
    return np.asarray(out[0] if return_attention_scores else out)


def equinox_mha_forward(sd, num_heads: int, query, key, value, keep=None, dtype="float32") -> np.ndarray:
    """equinox.nn.MultiheadAttention, vmapped over the batch; mask (T, S) per example, True = attend."""
    import jax
    import jax.numpy as jnp

    dt = _np_dtype(dtype)
    m = convert.to_equinox(_cast_sd(sd, dt), num_heads)
    q, k, v = (jnp.asarray(np.asarray(x).astype(dt)) for x in (query, key, value))
    if keep is None:
        out = jax.vmap(lambda q, k, v: m(q, k, v, inference=True))(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, mask: m(q, k, v, mask=mask, inference=True))(q, k, v, jnp.asarray(np.asarray(keep, bool)))
    return np.asarray(out)


def keras_gqa_call(sd, num_heads: int, num_kv_heads: int):
    """keras.layers.GroupQueryAttention (JAX backend) as a pure function of canonical parameters.

    Returns call(params, query, key, value, keep) -> output, which JAX differentiates in every
    argument: the layer is built once from `sd` (its structure and dtype), and each call runs
    `layer.stateless_call` with `params` (canonical names, torch layout) mapped into its kernels
    and biases by `convert._keras_gqa_tensors`, the table `convert.to_keras` assigns with.
    keep: bool (B, T, S), True = attend. Keras repeats the key/value heads per group
    (ops.repeat) and runs ops.dot_product_attention, i.e. jax.nn.dot_product_attention: a fully
    masked row is uniform, the softmax float32 even for float64 inputs. It has no RoPE and one
    use_bias for all four projections.
    """
    import jax.numpy as jnp

    layer = convert.to_keras(sd, num_heads, num_kv_heads=num_kv_heads)
    where = {}  # id(keras variable) -> (sublayer, 0 kernel | 1 bias)
    for attr in convert._KERAS_GQA.values():
        dense = getattr(layer, attr)
        where[id(dense.kernel)] = (attr, 0)
        if layer.use_bias:
            where[id(dense.bias)] = (attr, 1)
    trainable = layer.trainable_variables
    if {id(v) for v in trainable} != set(where):
        raise ValueError(f"keras GroupQueryAttention's trainable variables {[v.path for v in trainable]} are not "
                         f"the {len(where)} kernels and biases of its four projections")
    order = [where[id(v)] for v in trainable]
    fixed = [v.value for v in layer.non_trainable_variables]

    def call(params, query, key, value, keep):
        tensors = convert._keras_gqa_tensors(params, num_heads, num_kv_heads)
        values = [tensors[attr][i] for attr, i in order]
        mask = None if keep is None else jnp.asarray(keep, bool)
        out, _ = layer.stateless_call(values, fixed, query, value, key=key, attention_mask=mask, training=False)
        return out

    return call
