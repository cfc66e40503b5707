"""The real libraries as peers: Hugging Face BERT and GPT-2 (torch), Keras 3 and Equinox (JAX).

Each factory follows the contract in `parity.impls.registry` with `uses_params=False`:
`factory(state_dict, num_heads, *, dtype, device) -> fn(query, key, value, keep)`. The
libraries' modules hold their own weights, so the harness's gradient path does not apply;
the HF peers add `fn.vjp(query, keep, cotangent)`, their own autograd gradients (w.r.t.
the input and the weights, canonical names), which the peers check judges.
`keep` is the case's keep-mask (B, T, S), True = attend (declared mask="keep",
mask_shape="BTS"), or None. Each fn hands NumPy copies to the pure functions of
`parity.ecosystem` -- which translate the mask to the library's own convention and run the
library's module in `dtype` -- and returns the output as the framework's array.

Imports nothing at module level: torch, jax, transformers, keras and equinox are imported
on first use, so a missing library is a `MissingPackage` when the peer is built (check_peers
turns it into a skip row naming the package), and a bench worker that imports this table
loads one framework only.
Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


class MissingPackage(ImportError):
    """The optional package a peer runs (the `.[ecosystem]` extra) is not installed: a skip, not an error.

    Only this exception is a skip: any other ImportError (a broken install, a bug in an
    adapter) stays an error row.
    """


def _require(package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise MissingPackage(f"{package} is not installed (the optional extra: pip install 'mha-parity[ecosystem]')",
                             name=package)


def _self_attention(query, key, value, library: str) -> None:
    """The HF modules are self-attention: refuse (clearly) a key or value that is not the query."""
    if not (np.array_equal(key, query) and np.array_equal(value, query)):
        raise ValueError(f"{library} attention is self-attention: key and value must equal query "
                         f"(got query {np.shape(query)}, key {np.shape(key)}, value {np.shape(value)})")


def _torch_peer(forward, library: str, package: str, sd, num_heads, *, dtype, device, layout: str):
    _require(package)
    from parity import convert, ecosystem

    def fn(query, key, value, keep):
        q, k, v = (convert.tensor_to_numpy(x) for x in (query, key, value))
        _self_attention(q, k, v, library)
        keep = None if keep is None else convert.tensor_to_numpy(keep)
        return convert.numpy_to_tensor(forward(sd, num_heads, q, keep, dtype), device)

    def vjp(query, keep, cotangent):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} (parity.ecosystem.hf_attention_vjp)."""
        return ecosystem.hf_attention_vjp(layout, sd, num_heads, query, keep, cotangent, dtype)

    fn.vjp = vjp
    return fn


def _jax_peer(forward, package: str, sd, num_heads, *, dtype, device):
    _require(package)
    import jax

    def fn(query, key, value, keep):
        q, k, v = (np.asarray(x) for x in (query, key, value))
        keep = None if keep is None else np.asarray(keep)
        return jax.device_put(forward(sd, num_heads, q, k, v, keep, dtype), device)

    return fn


def hf_bert(sd, num_heads, *, dtype, device):
    """transformers BertAttention (BertSelfAttention + output.dense), eager; keep -> additive 0 / finfo.min."""
    from parity import ecosystem

    return _torch_peer(ecosystem.hf_bert_attention_forward, "HF BERT", "transformers", sd, num_heads,
                       dtype=dtype, device=device, layout="hf-bert")


def hf_gpt2(sd, num_heads, *, dtype, device):
    """transformers GPT2Attention, eager; keep must be tril(T, T) & padding (its mask comes from create_causal_mask)."""
    from parity import ecosystem

    return _torch_peer(ecosystem.hf_gpt2_attention_forward, "HF GPT-2", "transformers", sd, num_heads,
                       dtype=dtype, device=device, layout="hf-gpt2")


def keras_mha(sd, num_heads, *, dtype, device):
    """keras.layers.MultiHeadAttention on the JAX backend, its default call (jax.nn.dot_product_attention)."""
    from parity import ecosystem

    forward = functools.partial(ecosystem.keras_mha_forward, return_attention_scores=False)
    return _jax_peer(forward, "keras", sd, num_heads, dtype=dtype, device=device)


def equinox_mha(sd, num_heads, *, dtype, device):
    """equinox.nn.MultiheadAttention, vmapped over the batch; keep (T, S) per example."""
    from parity import ecosystem

    return _jax_peer(ecosystem.equinox_mha_forward, "equinox", sd, num_heads, dtype=dtype, device=device)


# ---------------------------------------------------------------- grouped-query/RoPE peers


def keras_gqa(sd, num_heads, *, dtype, device, problem):
    """keras.layers.GroupQueryAttention on the canonical parameters (stateless_call), jitted.

    fn(params, query, key, value, keep) -> output: it computes with the harness's parameters,
    so its JAX autodiff gradients (inputs and every parameter) are checked too.
    """
    _require("keras")
    import jax

    from parity import ecosystem

    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"keras-gqa: num_heads={num_heads} but the problem's config has {config.num_heads}")
    call = ecosystem.keras_gqa_call({k: np.asarray(v) for k, v in sd.items()}, num_heads, config.kv_heads)
    # Jitted here: the harness runs a peer's forward op by op, and keras's layer calls are many small ops.
    return jax.jit(call)


# What transformers' LlamaAttention and Keras's GroupQueryAttention do (measured; tests/test_modern_peers.py):
#
#   HF Llama (eager)  cos/sin from LlamaRotaryEmbedding in float32, cast to the model dtype; softmax in
#                     float32 (softmax(dtype=float32)), cast back. So a float64 run computes in float32:
#                     judged at the float32 entry. Its eager mask is additive 0 / finfo(dtype).min: a fully
#                     masked row is uniform in float32 and 16-bit, but NaN in float64 (finfo(float64).min
#                     becomes -inf in the float32 softmax), so in float64 it runs only where no row is
#                     fully masked (unmasked and causal self-attention).

_LLAMA_HEADROOM = 4096  # max_position_embeddings: the rotary cache is rebuilt past it, never truncated; any size works


def _llama_parts(sd, config, dtype):
    """(LlamaAttention holding sd, LlamaRotaryEmbedding, the canonical names sd has).

    An absent bias is a zero bias of LlamaAttention(attention_bias=True) (exactly no bias; its
    gradient is not reported); no bias at all is attention_bias=False. rope="interleaved"
    weights are Meta-style: HF runs them after its own conversion's q/k row permutation
    (`convert.permute_rope(to="half")`).
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from parity import convert, ecosystem

    dt = ecosystem._np_dtype(dtype)
    sd = {k: np.asarray(v).astype(dt) for k, v in sd.items()}
    names = tuple(sorted(sd))
    N, K, H, E = config.num_heads, config.kv_heads, config.head_size, config.embed_dim
    if config.rope == "interleaved":
        sd = convert.permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")
    any_bias = any(k.endswith(".bias") for k in sd)
    if any_bias:
        every = dataclasses.replace(config, qkv_bias=True, out_bias=True).weight_shapes()
        sd = {**{k: np.zeros(s, dt) for k, s in every.items() if k.endswith(".bias")}, **sd}
    hf = LlamaConfig(hidden_size=E, num_attention_heads=N, num_key_value_heads=K, head_dim=H, attention_bias=any_bias,
                     rope_theta=float(config.rope_theta), num_hidden_layers=1, intermediate_size=2 * E,
                     vocab_size=ecosystem.SMALL_VOCAB, max_position_embeddings=_LLAMA_HEADROOM, attention_dropout=0.0,
                     attn_implementation="eager")
    att = LlamaAttention(hf, layer_idx=0).to(convert._torch_dtype(dt)).eval()
    tensors = {k: convert.numpy_to_tensor(v) for k, v in convert.to_layout(sd, "hf-llama").items()}
    att.load_state_dict(tensors, strict=True)
    return att, LlamaRotaryEmbedding(hf), names


def _llama_position_ids(positions, key_positions, B: int, T: int):
    """HF's one position list (B, T) int64: LlamaAttention rotates queries and keys by the same position_ids."""
    import torch

    from parity import convert

    def as_np(p):
        return None if p is None else np.asarray(convert.tensor_to_numpy(p) if hasattr(p, "detach") else p)

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

    from parity import convert, ecosystem

    dt = ecosystem._np_dtype(dtype)
    mask = None if keep is None else convert.numpy_to_tensor(ecosystem.additive_mask(np.asarray(keep, bool), dt))

    def call(x):
        if config.rope is None:  # no rotary embedding: the identity rotation, cos 1, sin 0
            cos = torch.ones(*x.shape[:2], config.head_size, dtype=x.dtype)
            emb = (cos, torch.zeros_like(cos))
        else:
            emb = rotary(x, position_ids)
        out, _ = att(x, position_embeddings=emb, attention_mask=mask)
        return out

    return call


def hf_llama(sd, num_heads, *, dtype, device, problem):
    """transformers LlamaAttention (eager) with LlamaRotaryEmbedding; self-attention with one position list."""
    _require("transformers")
    from parity import convert, ecosystem

    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"hf-llama: num_heads={num_heads} but the problem's config has {config.num_heads}")

    def fn(query, key, value, keep, *, positions=None, key_positions=None):
        import torch

        q, k, v = (convert.tensor_to_numpy(x) for x in (query, key, value))
        _self_attention(q, k, v, "HF Llama")
        keep = None if keep is None else convert.tensor_to_numpy(keep)
        ids = _llama_position_ids(positions, key_positions, *q.shape[:2])
        att, rotary, _ = _llama_parts(sd, config, dtype)
        call = _llama_call(att, rotary, config, keep, ids, dtype)
        with torch.no_grad():
            out = call(ecosystem._torch_inputs(q, ecosystem._np_dtype(dtype)))
        return convert.numpy_to_tensor(convert.tensor_to_numpy(out), device)

    def vjp(query, keep, cotangent, *, positions=None, key_positions=None):
        """NumPy in and out: {"input": d x, canonical weight name: gradient} of sum(output * cotangent)."""
        import torch

        dt = ecosystem._np_dtype(dtype)
        query = np.asarray(query)
        att, rotary, names = _llama_parts(sd, config, dtype)
        ids = _llama_position_ids(positions, key_positions, *query.shape[:2])
        call = _llama_call(att, rotary, config, None if keep is None else np.asarray(keep), ids, dtype)
        x = ecosystem._torch_inputs(query, dt).requires_grad_(True)
        with torch.enable_grad():
            (call(x) * ecosystem._torch_inputs(cotangent, dt)).sum().backward()
        grads = convert.from_layout({n: convert.tensor_to_numpy(p.grad) for n, p in att.named_parameters()}, "hf-llama")
        if config.rope == "interleaved":  # a row permutation: the gradient's rows go back the same way
            grads = convert.permute_rope(grads, num_heads=config.num_heads, num_kv_heads=config.kv_heads, to="interleaved")
        return {"input": convert.tensor_to_numpy(x.grad), **{n: grads[n] for n in names}}

    fn.vjp = vjp
    return fn
