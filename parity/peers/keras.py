"""Keras 3 as a peer (JAX backend): MultiHeadAttention and GroupQueryAttention.

    from_keras / to_keras   a built keras.layers.MultiHeadAttention (num_kv_heads=None) or
                            keras.layers.GroupQueryAttention (num_kv_heads=K) <-> canonical
    keras-mha               MultiHeadAttention's default call, forward only (the layer holds its weights)
    keras-gqa               GroupQueryAttention on the harness's parameters (stateless_call), gradients too

What it does (measured by scripts/measure_ecosystem.py; docs/conversion.md). Every call takes
a bool attention_mask (B, T, S), True = attend:

    MultiHeadAttention, default call    runs jax.nn.dot_product_attention: a fully masked row is
                                        uniform; a float64 run has a float32 softmax (2e-7 off)
    ..., return_attention_scores=True   its own einsum + Softmax (dropout > 0 takes this path too,
                                        per its source): a fully masked row is zero (weights
                                        zeroed); softmax in the input dtype
    GroupQueryAttention                 key/value heads repeated per group (ops.repeat), then
                                        ops.dot_product_attention: as the default call

So both peers declare computes_in="float32". Keras has no RoPE and GroupQueryAttention one
use_bias for all four projections. keras is imported on first use, on its JAX backend
(`keras_backend`); a missing keras is a `MissingPackage` when a peer is built.
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

from parity.canonical import check_jax_dtype, check_shape, check_state_dict, check_variant_state_dict
from parity.implementation import Implementation
from parity.peers.common import cast_state_dict, classic_only, from_flax_tree, jax_peer, np_dtype, require, to_flax_tree


# What no other file of parity/ imports (tests/test_house.py).
OWNS = ("import keras",)

# ---------------------------------------------------------------- converters


def keras_backend():
    """keras on its JAX backend: set KERAS_BACKEND=jax before its first import, refuse any other backend."""
    if "keras" not in sys.modules:
        asked = os.environ.setdefault("KERAS_BACKEND", "jax")
        if asked != "jax":
            raise RuntimeError(f"KERAS_BACKEND={asked!r} is set; parity.convert runs Keras on its JAX backend: set KERAS_BACKEND=jax")
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"keras was imported with the {keras.backend.backend()!r} backend before parity.convert; "
            "it needs KERAS_BACKEND=jax set before keras is first imported"
        )
    return keras


def from_keras(layer) -> dict[str, np.ndarray]:
    """A built keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention -> canonical.

    The class is checked explicitly (isinstance), never read off the shapes.
    MultiHeadAttention: bias, no gate, key_dim = value_dim = E / N; Keras stores flax's
    layout: q/k/v kernel (E, N, H), bias (N, H); output kernel (N, H, E).
    GroupQueryAttention: see `_from_keras_gqa`.
    """
    keras = keras_backend()
    if isinstance(layer, keras.layers.GroupQueryAttention):
        return _from_keras_gqa(layer)
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise TypeError(f"expected keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention, got {type(layer).__name__}")
    if not layer.built:
        raise ValueError("the keras layer is not built yet: call it once or layer.build(query_shape, value_shape)")
    cfg = layer.get_config()
    unsupported = {k: cfg.get(k, want) for k, want in (("use_bias", True), ("use_gate", False), ("output_shape", None)) if cfg.get(k, want) != want}
    if unsupported or cfg["key_dim"] != cfg["value_dim"]:
        raise ValueError(f"keras MultiHeadAttention must have use_bias=True, use_gate=False, output_shape=None, key_dim == value_dim; got {cfg}")
    if tuple(layer._attention_axes) != (1,):
        raise ValueError(f"keras MultiHeadAttention must attend over axis 1 of [B, L, E], got attention_axes={layer._attention_axes}")
    dense = {"query": layer.query_dense, "key": layer.key_dense, "value": layer.value_dense, "out": layer.output_dense}
    tree = {name: {"kernel": np.array(d.kernel.value), "bias": np.array(d.bias.value)} for name, d in dense.items()}
    return from_flax_tree(tree, "keras.layers.MultiHeadAttention")


def to_keras(sd, num_heads: int, *, num_kv_heads: int | None = None):
    """Canonical -> a built Keras 3 attention layer in the weights' dtype.

    num_kv_heads=None: keras.layers.MultiHeadAttention(num_heads, key_dim=E/N), the classic
    layer (all four biases). num_kv_heads=K: keras.layers.GroupQueryAttention(head_dim=E/N,
    num_query_heads=N, num_key_value_heads=K), whose one use_bias is all four biases or
    none (see `_to_keras_gqa`); K = N is allowed. Call either as layer(query, value, key)
    -- keras's argument order -- with a keep-mask (True = attend) of shape (B, T, S) as
    attention_mask. Keras has no RoPE: a RoPE layer's weights convert, its rotation does not.
    """
    keras = keras_backend()
    if num_kv_heads is not None:
        return _to_keras_gqa(sd, num_heads, num_kv_heads)
    classic_only(sd, "keras.layers.MultiHeadAttention (to_keras without num_kv_heads)")
    E, dtype = check_state_dict(sd)
    check_jax_dtype(dtype)
    tree = to_flax_tree(sd, num_heads)
    # Zero initialisers: every weight is assigned below, and keras's random ones cost a ~5 s compile per dtype.
    layer = keras.layers.MultiHeadAttention(
        num_heads=num_heads, key_dim=E // num_heads, dtype=dtype.name, kernel_initializer="zeros", bias_initializer="zeros"
    )
    layer.build(query_shape=(None, None, E), value_shape=(None, None, E))
    dense = {"query": layer.query_dense, "key": layer.key_dense, "value": layer.value_dense, "out": layer.output_dense}
    for name, d in dense.items():
        d.kernel.assign(tree[name]["kernel"])
        d.bias.assign(tree[name]["bias"])
    return layer


# keras.layers.GroupQueryAttention's sublayers (EinsumDense) and their layouts, with N query heads,
# K key/value heads, H = head_dim; heads split as feature n*H + h, as our view(B, L, N, H) does:
#   _query_dense  kernel (E, N, H) "bqm,muh->bquh"  bias (N, H)   <- q_proj.weight (N*H, E).T
#   _key_dense    kernel (E, K, H) "bkm,mvh->bkvh"  bias (K, H)   <- k_proj.weight (K*H, E).T; v likewise
#   _output_dense kernel (N, H, E) "bquh,uhm->bqm"  bias (E,)     <- out_proj.weight (E, N*H).T
# Its key/value heads are repeated with ops.repeat(axis=2): query head n uses key/value head n // (N/K), as ours.
_KERAS_GQA = {"q_proj": "_query_dense", "k_proj": "_key_dense", "v_proj": "_value_dense", "out_proj": "_output_dense"}


def _from_keras_gqa(layer) -> dict[str, np.ndarray]:
    """keras.layers.GroupQueryAttention (built; no gate, no sliding window, N * head_dim = E) -> canonical.

    use_bias=False gives a state dict without bias keys; dropout acts only in training.
    """
    if not layer.built:
        raise ValueError("the keras layer is not built yet: call it once or layer.build(query_shape, value_shape)")
    N, K, H, E = layer.num_query_heads, layer.num_key_value_heads, layer.head_dim, layer.feature_dim
    if layer.use_gate or layer.sliding_window is not None or N * H != E:
        raise ValueError(f"keras GroupQueryAttention must have use_gate=False, sliding_window=None and "
                         f"num_query_heads * head_dim = the feature dim; got use_gate={layer.use_gate}, "
                         f"sliding_window={layer.sliding_window}, {N} * {H} vs {E}")
    sd = {}
    for p, attr in _KERAS_GQA.items():
        dense = getattr(layer, attr)
        kernel = np.array(dense.kernel.value)
        if p == "out_proj":
            check_shape(kernel, (N, H, E), "keras GroupQueryAttention output kernel")
            sd["out_proj.weight"] = np.ascontiguousarray(kernel.reshape(N * H, E).T)
        else:
            heads = N if p == "q_proj" else K
            check_shape(kernel, (E, heads, H), f"keras GroupQueryAttention {attr[1:]} kernel")
            sd[f"{p}.weight"] = np.ascontiguousarray(kernel.reshape(E, heads * H).T)
        if layer.use_bias:
            sd[f"{p}.bias"] = np.array(dense.bias.value).reshape(-1).copy()
    check_variant_state_dict(sd, N, K)
    return sd


def _to_keras_gqa(sd, num_heads: int, num_kv_heads: int):
    keras = keras_backend()
    cfg, dtype = check_variant_state_dict(sd, num_heads, num_kv_heads)
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError(f"keras GroupQueryAttention has one use_bias for all four projections; this layer has "
                         f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias} (keys {sorted(sd)})")
    check_jax_dtype(dtype)
    N, K, H, E = cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.embed_dim
    # Zero initialisers: every weight is assigned below (keras's random ones cost a compile).
    layer = keras.layers.GroupQueryAttention(head_dim=H, num_query_heads=N, num_key_value_heads=K, use_bias=cfg.qkv_bias,
                                             dtype=dtype.name, kernel_initializer="zeros", bias_initializer="zeros")
    layer.build(query_shape=(None, None, E), value_shape=(None, None, E))
    for attr, (kernel, bias) in _keras_gqa_tensors(sd, N, K).items():
        dense = getattr(layer, attr)
        dense.kernel.assign(kernel)
        if bias is not None:
            dense.bias.assign(bias)
    return layer


def _keras_gqa_tensors(sd, num_heads: int, num_kv_heads: int) -> dict:
    """Canonical -> {GroupQueryAttention sublayer: (kernel, bias or None)} by the table above.

    Only transposes and reshapes, so it maps NumPy arrays (to_keras) and traced JAX arrays
    alike (the keras-gqa peer differentiates through it).
    """
    N, K = num_heads, num_kv_heads
    E = sd["q_proj.weight"].shape[1]
    H = E // N
    heads = {"q_proj": N, "k_proj": K, "v_proj": K}
    out = {}
    for p, attr in _KERAS_GQA.items():
        w, b = sd[f"{p}.weight"], sd.get(f"{p}.bias")
        if p == "out_proj":
            out[attr] = (w.T.reshape(N, H, E), b)
        else:
            out[attr] = (w.T.reshape(E, heads[p], H), None if b is None else b.reshape(heads[p], H))
    return out


# ---------------------------------------------------------------- running the layers


def keras_mha_forward(sd, num_heads: int, query, key, value, keep=None, dtype="float32", *, return_attention_scores=False) -> np.ndarray:
    """keras.layers.MultiHeadAttention (JAX backend) called as layer(query, value, key, attention_mask=keep).

    Keras's attention_mask has our polarity (True = attend), shape (B, T, S). Keras takes two
    paths: by default jax.nn.dot_product_attention (its float64 softmax is float32, measured
    ~2e-7 off the oracle); with return_attention_scores=True its own einsum + Softmax layer
    (float64 throughout). Only the output is returned either way.
    """
    import jax.numpy as jnp

    dt = np_dtype(dtype)
    layer = to_keras(cast_state_dict(sd, dt), num_heads)
    q, k, v = (jnp.asarray(np.asarray(x).astype(dt)) for x in (query, key, value))
    mask = None if keep is None else jnp.asarray(np.asarray(keep, bool))
    out = layer(q, v, key=k, attention_mask=mask, training=False, return_attention_scores=return_attention_scores)
    return np.asarray(out[0] if return_attention_scores else out)


def keras_gqa_call(sd, num_heads: int, num_kv_heads: int):
    """keras.layers.GroupQueryAttention (JAX backend) as a pure function of canonical parameters.

    Returns call(params, query, key, value, keep) -> output, which JAX differentiates in every
    argument: the layer is built once from `sd` (its structure and dtype), and each call runs
    `layer.stateless_call` with `params` (canonical names, torch layout) mapped into its kernels
    and biases by `_keras_gqa_tensors`, the table `to_keras` assigns with.
    keep: bool (B, T, S), True = attend. Keras repeats the key/value heads per group
    (ops.repeat) and runs ops.dot_product_attention, i.e. jax.nn.dot_product_attention: a fully
    masked row is uniform, the softmax float32 even for float64 inputs. It has no RoPE and one
    use_bias for all four projections.
    """
    import jax.numpy as jnp

    layer = to_keras(sd, num_heads, num_kv_heads=num_kv_heads)
    where = {}  # id(keras variable) -> (sublayer, 0 kernel | 1 bias)
    for attr in _KERAS_GQA.values():
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
        tensors = _keras_gqa_tensors(params, num_heads, num_kv_heads)
        values = [tensors[attr][i] for attr, i in order]
        mask = None if keep is None else jnp.asarray(keep, bool)
        out, _ = layer.stateless_call(values, fixed, query, value, key=key, attention_mask=mask, training=False)
        return out

    return call


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def keras_mha(sd, num_heads, *, dtype, device):
    """keras.layers.MultiHeadAttention on the JAX backend, its default call (jax.nn.dot_product_attention)."""
    forward = functools.partial(keras_mha_forward, return_attention_scores=False)
    return jax_peer(forward, "keras", sd, num_heads, dtype=dtype, device=device)


def keras_gqa(sd, num_heads, *, dtype, device, problem):
    """keras.layers.GroupQueryAttention on the canonical parameters (stateless_call), jitted.

    fn(params, query, key, value, keep) -> output: it computes with the harness's parameters,
    so its JAX autodiff gradients (inputs and every parameter) are checked too.
    """
    require("keras")
    import jax

    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"keras-gqa: num_heads={num_heads} but the problem's config has {config.num_heads}")
    call = keras_gqa_call({k: np.asarray(v) for k, v in sd.items()}, num_heads, config.kv_heads)
    # Jitted here: the harness runs a peer's forward op by op, and keras's layer calls are many small ops.
    return jax.jit(call)


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    # Keras runs op by op: each new dtype costs ~0.5 s of compiles (measured), so the default run
    # checks it in float64/float32 (16-bit measured at 1.3-1.5x the yardstick).
    Implementation("keras-mha", "jax", f"{__name__}:keras_mha", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, computes_in="float32", role="peer", bench=False, runs_on=("*/*/float64", "*/*/float32"),
                   doc="keras.layers.MultiHeadAttention (JAX backend), default call = jax.nn.dot_product_attention; "
                   "bool mask True = attend; empty rows uniform; float32 softmax in float64 runs"),
    # GroupQueryAttention has no RoPE and one use_bias for all four projections: it runs grouped
    # layers with every bias (a bias-free one skips: "no-qkv-bias" alone is not its layer).
    Implementation("keras-gqa", "jax", f"{__name__}:keras_gqa", "jit", False, masked_rows="uniform", mask_shape="BTS",
                   computes_in="float32", role="peer", bench=True, materializes=True, runs_on=("*/*/float64", "*/*/float32"),
                   variants=("grouped",), classic=False,
                   doc="keras.layers.GroupQueryAttention (JAX backend) on the canonical parameters via stateless_call; "
                   "key/value heads repeated per group (ops.repeat), then jax.nn.dot_product_attention: bool mask "
                   "True = attend, empty rows uniform, float32 softmax in float64 runs"),
)
