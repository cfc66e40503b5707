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
