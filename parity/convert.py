"""One weight-conversion layer: every format to and from one canonical state dict.

The canonical format (parity.canonical, re-exported here) is a plain
``dict[str, numpy.ndarray]`` with the classic state_dict names and torch's layout
(a Linear ``weight`` is (out, in)):

    q_proj.weight (E, E)  q_proj.bias (E,)   ... k_proj, v_proj, out_proj likewise

Every conversion below is an explicit table: name -> name and layout -> layout,
every shape checked, missing and unexpected keys named in the error, no layout
guessed from a suffix or an ndim. Checkpoint layouts of real models (Hugging Face
BERT, ViT, GPT-2, Llama/Mistral/Qwen2) and the transformers checkpoint-directory
readers live in parity/layouts.py and are re-exported here; Keras 3 (MultiHeadAttention,
GroupQueryAttention) and Equinox modules have pairs below like torch's and flax's.
Grouped key/value heads (k/v weights (K*H, E)) and absent biases (the keys say which)
convert wherever the target has them: our modules, Keras's GroupQueryAttention, the
"hf-llama" layout; flax's and torch's MultiheadAttention refuse them by name. Dtypes
pass through unchanged (bfloat16 as ``ml_dtypes.bfloat16`` NumPy arrays); asking for
another dtype is an error, never a silent cast. Weight files are safetensors, never pickle (parity/weight_file.py reads them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, AttentionConfig, check_config
from mha_spec.files import atomic_path
from parity.canonical import (
    CANONICAL_KEYS,
    PROJECTIONS,
    SUPPORTED_DTYPES,
    bias_flags,
    check_keys,
    check_mapping,
    check_shape,
    check_state_dict,
    check_variant_state_dict,
    numpy_to_tensor,
    tensor_to_numpy,
)
from parity.layouts import LAYOUTS, from_layout, read_checkpoint, read_hf_config, read_layout, to_layout
from parity.weight_file import open_weight_file

__all__ = [
    # the canonical state dict (parity.canonical)
    "CANONICAL_KEYS", "PROJECTIONS", "SUPPORTED_DTYPES", "check_state_dict", "tensor_to_numpy", "numpy_to_tensor",
    # our modules and their peers
    "from_torch", "to_torch", "from_jax", "to_jax", "torch_to_jax", "jax_to_torch",
    "from_torch_mha", "to_torch_mha", "from_flax_linen", "to_flax_linen", "from_flax_nnx", "to_flax_nnx",
    "from_keras", "to_keras", "from_equinox", "to_equinox", "FLAX_NAMES", "EQX_NAMES",
    # Hugging Face checkpoint layouts and directories (parity.layouts)
    "LAYOUTS", "from_layout", "to_layout", "read_layout", "read_checkpoint", "read_hf_config",
    # weight files
    "Checkpoint", "save", "load", "FILE_FORMAT", "FILE_FORMAT_VERSION",
]

# Our projection name -> the flax (linen and nnx) MultiHeadAttention submodule name.
FLAX_NAMES = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}

FILE_FORMAT = "mha-parity"
FILE_FORMAT_VERSION = "2"  # load reads 1 (the classic layer) and 2


# ---------------------------------------------------------------- checks


def _pop_dtype(kwargs: dict, key: str, dtype: np.dtype, as_numpy) -> None:
    """Reject a requested dtype that differs from the weights' (no silent cast)."""
    if key in kwargs:
        asked = kwargs.pop(key)
        if asked is not None and np.dtype(as_numpy(asked)) != dtype:
            raise TypeError(f"{key}={asked} differs from the weights' dtype {dtype}; convert the state dict explicitly")


# ---------------------------------------------------------------- torch


def _torch():
    import torch

    return torch


def _torch_dtype(dtype: np.dtype):
    torch = _torch()
    return {
        np.dtype(np.float16): torch.float16,
        np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float64): torch.float64,
    }[np.dtype(dtype)]


def _numpy_dtype_of_torch(torch_dtype) -> np.dtype:
    torch = _torch()
    table = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32, torch.float64: np.float64}
    if torch_dtype not in table:
        raise TypeError(f"unsupported torch dtype {torch_dtype}")
    return np.dtype(table[torch_dtype])


def from_torch(m) -> dict[str, np.ndarray]:
    """mha_torch.MultiHeadAttention -> canonical state dict."""
    from mha_torch import MultiHeadAttention

    if not isinstance(m, MultiHeadAttention):
        hint = ""
        if isinstance(m, _torch().nn.MultiheadAttention):
            hint = "; for torch.nn.MultiheadAttention use sd = convert.from_torch_mha(m), then convert.to_jax(sd, m.num_heads, masked_rows=...)"
        raise TypeError(f"expected mha_torch.MultiHeadAttention, got {type(m).__name__}{hint}")
    state = m.state_dict()
    names = tuple(m.config.weight_shapes())
    check_keys(state.keys(), names, "mha_torch state_dict")
    sd = {name: tensor_to_numpy(state[name]) for name in names}
    check_variant_state_dict(sd, m.num_heads, m.config.num_kv_heads)
    return sd


def to_torch(sd, num_heads: int, *, num_kv_heads: int | None = None, **module_kwargs):
    """Canonical state dict -> mha_torch.MultiHeadAttention in the weights' dtype.

    The keys say which biases the layer has; k/v weights of K*H rows need num_kv_heads=K.
    rope, rope_theta and masked_rows pass through to the module.
    """
    from mha_torch import MultiHeadAttention

    cfg, dtype = check_variant_state_dict(sd, num_heads, num_kv_heads)
    _pop_dtype(module_kwargs, "dtype", dtype, _numpy_dtype_of_torch)
    m = MultiHeadAttention(cfg.embed_dim, num_heads, num_kv_heads=num_kv_heads, qkv_bias=cfg.qkv_bias,
                           out_bias=cfg.out_bias, dtype=_torch_dtype(dtype), **module_kwargs)
    device = m.q_proj.weight.device
    m.load_state_dict({name: numpy_to_tensor(sd[name], device) for name in cfg.weight_shapes()}, strict=True)
    return m


def from_torch_mha(m) -> dict[str, np.ndarray]:
    """torch.nn.MultiheadAttention (packed in_proj_weight, bias) -> canonical.

    batch_first does not change the weights, so either value is accepted.
    """
    torch = _torch()
    if not isinstance(m, torch.nn.MultiheadAttention):
        raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(m).__name__}")
    if not m._qkv_same_embed_dim or m.in_proj_weight is None:
        raise ValueError("torch.nn.MultiheadAttention must use a packed in_proj_weight (kdim == vdim == embed_dim)")
    if m.in_proj_bias is None or m.out_proj.bias is None:
        raise ValueError("torch.nn.MultiheadAttention must have bias=True")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn have no counterpart in the classic module")
    E = m.embed_dim
    w_in, b_in = tensor_to_numpy(m.in_proj_weight), tensor_to_numpy(m.in_proj_bias)
    check_shape(w_in, (3 * E, E), "in_proj_weight")
    check_shape(b_in, (3 * E,), "in_proj_bias")
    sd = {}
    for i, p in enumerate(("q_proj", "k_proj", "v_proj")):  # in_proj rows are [q; k; v]
        sd[f"{p}.weight"] = w_in[i * E : (i + 1) * E].copy()
        sd[f"{p}.bias"] = b_in[i * E : (i + 1) * E].copy()
    sd["out_proj.weight"] = tensor_to_numpy(m.out_proj.weight)
    sd["out_proj.bias"] = tensor_to_numpy(m.out_proj.bias)
    check_state_dict(sd)
    return sd


def to_torch_mha(sd, num_heads: int, **module_kwargs):
    """Canonical state dict -> torch.nn.MultiheadAttention (batch_first=True unless asked) in the weights' dtype."""
    torch = _torch()
    _classic_only(sd, "torch.nn.MultiheadAttention")
    E, dtype = check_state_dict(sd)
    _pop_dtype(module_kwargs, "dtype", dtype, _numpy_dtype_of_torch)
    module_kwargs.setdefault("batch_first", True)  # our layout is [B, L, E]; the weights do not depend on it
    m = torch.nn.MultiheadAttention(E, num_heads, dtype=_torch_dtype(dtype), **module_kwargs)
    device = m.in_proj_weight.device
    state = {
        "in_proj_weight": np.concatenate([sd[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")], axis=0),
        "in_proj_bias": np.concatenate([sd[f"{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")], axis=0),
        "out_proj.weight": sd["out_proj.weight"],
        "out_proj.bias": sd["out_proj.bias"],
    }
    m.load_state_dict({k: numpy_to_tensor(v, device) for k, v in state.items()}, strict=True)
    return m


# ---------------------------------------------------------------- jax / flax


def _check_jax_dtype(dtype: np.dtype) -> None:
    import jax

    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError("float64 weights need jax_enable_x64, or jax would silently store float32")


def from_jax(m) -> dict[str, np.ndarray]:
    """mha_jax.MultiHeadAttention -> canonical state dict (kernel (in, out) -> weight (out, in))."""
    from mha_jax import MultiHeadAttention

    if not isinstance(m, MultiHeadAttention):
        hint = ""
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(m, nnx.MultiHeadAttention):
            hint = "; for flax.nnx.MultiHeadAttention use sd = convert.from_flax_nnx(m), then convert.to_torch(sd, m.num_heads, masked_rows=...)"
        raise TypeError(f"expected mha_jax.MultiHeadAttention, got {type(m).__name__}{hint}")
    sd = {}
    for p in PROJECTIONS:
        layer = getattr(m, p)
        sd[f"{p}.weight"] = np.ascontiguousarray(np.asarray(layer.kernel[...]).T)
        if layer.bias is not None:  # a bias-free projection has no key (the keys say which biases)
            sd[f"{p}.bias"] = np.array(layer.bias[...])
    check_variant_state_dict(sd, m.num_heads, m.config.num_kv_heads)
    return sd


def to_jax(sd, num_heads: int, *, num_kv_heads: int | None = None, **module_kwargs):
    """Canonical state dict -> mha_jax.MultiHeadAttention with param_dtype = the weights' dtype.

    The keys say which biases the layer has; k/v weights of K*H rows need num_kv_heads=K.
    rope, rope_theta and masked_rows pass through to the module.
    """
    import jax.numpy as jnp
    from flax import nnx

    from mha_jax import MultiHeadAttention

    cfg, dtype = check_variant_state_dict(sd, num_heads, num_kv_heads)
    _check_jax_dtype(dtype)
    _pop_dtype(module_kwargs, "param_dtype", dtype, np.dtype)
    rngs = module_kwargs.pop("rngs", None) or nnx.Rngs(0)
    m = MultiHeadAttention(cfg.embed_dim, num_heads, rngs=rngs, num_kv_heads=num_kv_heads, qkv_bias=cfg.qkv_bias,
                           out_bias=cfg.out_bias, param_dtype=dtype, **module_kwargs)
    for p in PROJECTIONS:
        layer = getattr(m, p)
        layer.kernel[...] = jnp.asarray(sd[f"{p}.weight"].T)  # (E_in, E_out)
        if layer.bias is not None:
            layer.bias[...] = jnp.asarray(sd[f"{p}.bias"])
    return m


def _layer_kwargs(m) -> dict:
    """What a module's weights do not say about its layer: masked_rows, num_kv_heads, rope, rope_theta."""
    c = m.config
    return dict(masked_rows=c.masked_rows, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta)


def torch_to_jax(m):
    """mha_torch -> mha_jax, keeping num_heads, masked_rows, num_kv_heads and RoPE."""
    return to_jax(from_torch(m), m.num_heads, **_layer_kwargs(m))


def jax_to_torch(m):
    """mha_jax -> mha_torch, keeping num_heads, masked_rows, num_kv_heads and RoPE."""
    return to_torch(from_jax(m), m.num_heads, **_layer_kwargs(m))


def _to_flax_layout(sd, num_heads: int) -> dict[str, dict[str, np.ndarray]]:
    """Canonical -> {query|key|value|out: {kernel, bias}} in flax's per-head layout.

    Heads are split as feature index n * H + h, exactly as view(B, L, N, H) does.
      in-projections: weight (N*H, E) -> kernel (E, N, H);  bias (N*H,) -> (N, H)
      out-projection: weight (E, N*H) -> kernel (N, H, E);  bias (E,)   -> (E,)
    """
    _classic_only(sd, "flax.linen.MultiHeadDotProductAttention")
    E, dtype = check_state_dict(sd)
    check_config(E, num_heads, "nan")
    N, H = num_heads, E // num_heads
    tree = {}
    for p in ("q_proj", "k_proj", "v_proj"):
        tree[FLAX_NAMES[p]] = {
            "kernel": np.ascontiguousarray(sd[f"{p}.weight"].T.reshape(E, N, H)),
            "bias": sd[f"{p}.bias"].reshape(N, H).copy(),
        }
    tree["out"] = {
        "kernel": np.ascontiguousarray(sd["out_proj.weight"].T.reshape(N, H, E)),
        "bias": sd["out_proj.bias"].copy(),
    }
    return tree


def _classic_only(sd, target: str) -> None:
    """A grouped or bias-free state dict for a peer that holds only the classic layer: a ValueError saying so."""
    if not isinstance(sd, Mapping):
        return  # check_state_dict names the type
    q, k = sd.get("q_proj.weight"), sd.get("k_proj.weight")
    grouped = hasattr(q, "shape") and hasattr(k, "shape") and tuple(k.shape) != tuple(q.shape)
    missing = [n for n in CANONICAL_KEYS if n.endswith(".bias") and n not in sd]
    if grouped or missing:
        what = [f"grouped key/value heads (k_proj.weight {tuple(k.shape)}, q_proj.weight {tuple(q.shape)})"] if grouped else []
        what += [f"no {', '.join(missing)}"] if missing else []
        raise ValueError(f"{target} has no grouped key/value heads and always has all four biases; this layer has "
                         f"{' and '.join(what)}: convert it with to_torch/to_jax, or to_keras(..., num_kv_heads=K) "
                         f"(keras.layers.GroupQueryAttention)")


def _from_flax_layout(tree: Mapping, what: str) -> dict[str, np.ndarray]:
    """{query|key|value|out: {kernel, bias}} (flax layout) -> canonical; the inverse table."""
    check_mapping(tree, what)
    check_keys(tree.keys(), FLAX_NAMES.values(), what)
    for name in FLAX_NAMES.values():
        check_mapping(tree[name], f"{what}[{name!r}]")
        check_keys(tree[name].keys(), ("kernel", "bias"), f"{what}[{name!r}]")
        for leaf in ("kernel", "bias"):
            if not hasattr(tree[name][leaf], "shape"):
                raise TypeError(f"{what}[{name!r}][{leaf!r}] must be an array, got {type(tree[name][leaf]).__name__}")
    qk = np.asarray(tree["query"]["kernel"])
    if qk.ndim != 3:
        raise ValueError(f"{what}['query']['kernel'] has shape {qk.shape}, expected (E, N, H)")
    E, N, H = qk.shape
    if N * H != E:
        raise ValueError(f"{what}: query kernel {qk.shape} has N*H={N * H} != E={E}; qkv_features must equal in_features")
    sd = {}
    for p in ("q_proj", "k_proj", "v_proj"):
        name = FLAX_NAMES[p]
        kernel, bias = np.asarray(tree[name]["kernel"]), np.asarray(tree[name]["bias"])
        check_shape(kernel, (E, N, H), f"{what}[{name!r}]['kernel']")
        check_shape(bias, (N, H), f"{what}[{name!r}]['bias']")
        sd[f"{p}.weight"] = np.ascontiguousarray(kernel.reshape(E, N * H).T)
        sd[f"{p}.bias"] = bias.reshape(N * H).copy()
    kernel, bias = np.asarray(tree["out"]["kernel"]), np.asarray(tree["out"]["bias"])
    check_shape(kernel, (N, H, E), f"{what}['out']['kernel']")
    check_shape(bias, (E,), f"{what}['out']['bias']")
    sd["out_proj.weight"] = np.ascontiguousarray(kernel.reshape(N * H, E).T)
    sd["out_proj.bias"] = bias.copy()
    check_state_dict(sd)
    return sd


def from_flax_linen(variables) -> dict[str, np.ndarray]:
    """Variables of flax.linen.MultiHeadDotProductAttention ({"params": ...}) -> canonical."""
    if not isinstance(variables, Mapping):
        raise TypeError(f"expected a mapping {{'params': ...}}, got {type(variables).__name__}")
    check_keys(variables.keys(), ("params",), "flax.linen variables")
    return _from_flax_layout(variables["params"], "flax.linen params")


def to_flax_linen(sd, num_heads: int) -> dict:
    """Canonical -> {"params": ...} for flax.linen.MultiHeadDotProductAttention(num_heads, ...).apply."""
    return {"params": _to_flax_layout(sd, num_heads)}


def from_flax_nnx(m) -> dict[str, np.ndarray]:
    """flax.nnx.MultiHeadAttention (bias, no qk-norm, no GQA, qkv_features = in = out) -> canonical."""
    from flax import nnx

    if not isinstance(m, nnx.MultiHeadAttention):
        raise TypeError(f"expected flax.nnx.MultiHeadAttention, got {type(m).__name__}")
    if not m.use_bias or m.normalize_qk:
        raise ValueError("flax.nnx.MultiHeadAttention must have use_bias=True and normalize_qk=False")
    if m.num_kv_heads != m.num_heads:
        raise ValueError(f"grouped heads (num_kv_heads={m.num_kv_heads} != num_heads={m.num_heads}) are not supported")
    tree = {
        FLAX_NAMES[p]: {"kernel": np.asarray(getattr(m, FLAX_NAMES[p]).kernel[...]), "bias": np.asarray(getattr(m, FLAX_NAMES[p]).bias[...])}
        for p in PROJECTIONS
    }
    return _from_flax_layout(tree, "flax.nnx.MultiHeadAttention")


def to_flax_nnx(sd, num_heads: int, **module_kwargs):
    """Canonical -> flax.nnx.MultiHeadAttention(num_heads, E) with param_dtype = the weights' dtype."""
    import jax.numpy as jnp
    from flax import nnx

    # flax.nnx.MultiHeadAttention has a num_kv_heads of its own; this converter builds the classic layer.
    _classic_only(sd, "to_flax_nnx's flax.nnx.MultiHeadAttention (built without num_kv_heads)")
    E, dtype = check_state_dict(sd)
    _check_jax_dtype(dtype)
    _pop_dtype(module_kwargs, "param_dtype", dtype, np.dtype)
    rngs = module_kwargs.pop("rngs", None) or nnx.Rngs(0)
    module_kwargs.setdefault("decode", False)
    m = nnx.MultiHeadAttention(num_heads, E, param_dtype=dtype, rngs=rngs, **module_kwargs)
    for name, params in _to_flax_layout(sd, num_heads).items():
        layer = getattr(m, name)
        layer.kernel[...] = jnp.asarray(params["kernel"])
        layer.bias[...] = jnp.asarray(params["bias"])
    return m


# ---------------------------------------------------------------- keras 3 / equinox


def _keras():
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
    keras = _keras()
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
    return _from_flax_layout(tree, "keras.layers.MultiHeadAttention")


def to_keras(sd, num_heads: int, *, num_kv_heads: int | None = None):
    """Canonical -> a built Keras 3 attention layer in the weights' dtype.

    num_kv_heads=None: keras.layers.MultiHeadAttention(num_heads, key_dim=E/N), the classic
    layer (all four biases). num_kv_heads=K: keras.layers.GroupQueryAttention(head_dim=E/N,
    num_query_heads=N, num_key_value_heads=K), whose one use_bias is all four biases or
    none (see `_to_keras_gqa`); K = N is allowed. Call either as layer(query, value, key)
    -- keras's argument order -- with a keep-mask (True = attend) of shape (B, T, S) as
    attention_mask. Keras has no RoPE: a RoPE layer's weights convert, its rotation does not.
    """
    keras = _keras()
    if num_kv_heads is not None:
        return _to_keras_gqa(sd, num_heads, num_kv_heads)
    _classic_only(sd, "keras.layers.MultiHeadAttention (to_keras without num_kv_heads)")
    E, dtype = check_state_dict(sd)
    _check_jax_dtype(dtype)
    tree = _to_flax_layout(sd, num_heads)
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
    keras = _keras()
    cfg, dtype = check_variant_state_dict(sd, num_heads, num_kv_heads)
    if cfg.qkv_bias != cfg.out_bias:
        raise ValueError(f"keras GroupQueryAttention has one use_bias for all four projections; this layer has "
                         f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias} (keys {sorted(sd)})")
    _check_jax_dtype(dtype)
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


EQX_NAMES = {"q_proj": "query_proj", "k_proj": "key_proj", "v_proj": "value_proj", "out_proj": "output_proj"}


def from_equinox(m) -> dict[str, np.ndarray]:
    """equinox.nn.MultiheadAttention (all four biases, sizes all E, qk = vo = E / N) -> canonical.

    Equinox's Linear weight is (out, in) like torch's, so the table is name -> name.
    """
    import equinox as eqx

    if not isinstance(m, eqx.nn.MultiheadAttention):
        raise TypeError(f"expected equinox.nn.MultiheadAttention, got {type(m).__name__}")
    off = [f"use_{w}_bias" for w in ("query", "key", "value", "output") if not getattr(m, f"use_{w}_bias")]
    if off:
        raise ValueError(f"equinox MultiheadAttention has {off} = False; the classic module has all four biases (build it with them on)")
    E = m.query_size
    sizes = {"key_size": m.key_size, "value_size": m.value_size, "output_size": m.output_size}
    if any(v != E for v in sizes.values()) or m.qk_size != m.vo_size or m.qk_size * m.num_heads != E:
        raise ValueError(f"equinox MultiheadAttention needs key/value/output size = query_size = {E} and qk_size = vo_size = E/num_heads; got {sizes}, qk_size={m.qk_size}, vo_size={m.vo_size}")
    sd = {}
    for p, name in EQX_NAMES.items():
        sd[f"{p}.weight"] = np.array(getattr(m, name).weight)
        sd[f"{p}.bias"] = np.array(getattr(m, name).bias)
    check_state_dict(sd)
    return sd


def to_equinox(sd, num_heads: int):
    """Canonical -> equinox.nn.MultiheadAttention(num_heads, E, all biases on) in the weights' dtype.

    Equinox is unbatched: call it per example, m(query (T, E), key (S, E), value (S, E), mask=(T, S) keep-mask),
    or jax.vmap it.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    E, dtype = check_state_dict(sd)
    _check_jax_dtype(dtype)
    check_config(E, num_heads, "nan")
    biases = {f"use_{w}_bias": True for w in ("query", "key", "value", "output")}
    m = eqx.nn.MultiheadAttention(num_heads, E, dtype=jnp.dtype(dtype), key=jax.random.PRNGKey(0), **biases)
    leaves = tuple(jnp.asarray(sd[f"{p}.{w}"]) for p in EQX_NAMES for w in ("weight", "bias"))
    where = lambda m: tuple(getattr(getattr(m, EQX_NAMES[p]), w) for p in EQX_NAMES for w in ("weight", "bias"))  # noqa: E731
    return eqx.tree_at(where, m, leaves)


# ---------------------------------------------------------------- files


@dataclass(frozen=True)
class Checkpoint:
    """A loaded weight file: the weights plus what is needed to rebuild the module.

    The state dict's keys say which biases the layer has; the rest of the layer
    (heads, key/value heads, RoPE, masked-row policy) is here. The defaults are the
    classic layer, which is what a format_version 1 file holds.
    """

    state_dict: dict
    num_heads: int
    masked_rows: str
    num_kv_heads: int | None = None
    rope: str | None = None
    rope_theta: float = 10000.0

    @property
    def config(self) -> AttentionConfig:
        """The layer as an mha_spec.AttentionConfig (biases read off the state dict's keys)."""
        qkv_bias, out_bias = bias_flags(self.state_dict.keys())
        return AttentionConfig(self.state_dict["q_proj.weight"].shape[1], self.num_heads, num_kv_heads=self.num_kv_heads,
                               qkv_bias=qkv_bias, out_bias=out_bias, rope=self.rope, rope_theta=self.rope_theta,
                               masked_rows=self.masked_rows)

    def layer_kwargs(self) -> dict:
        """The module keywords the weights do not say: masked_rows, num_kv_heads, rope, rope_theta."""
        return dict(masked_rows=self.masked_rows, num_kv_heads=self.num_kv_heads, rope=self.rope, rope_theta=self.rope_theta)

    def to_torch(self, **module_kwargs):
        return to_torch(self.state_dict, self.num_heads, **self.layer_kwargs(), **module_kwargs)

    def to_jax(self, **module_kwargs):
        return to_jax(self.state_dict, self.num_heads, **self.layer_kwargs(), **module_kwargs)


def _module_config(obj):
    """(state dict, AttentionConfig) of our torch or JAX module, or None for anything else."""
    for package, from_module in (("mha_torch", from_torch), ("mha_jax", from_jax)):
        mod = sys.modules.get(package)
        if mod is not None and isinstance(obj, mod.MultiHeadAttention):
            return from_module(obj), obj.config
    return None


_NO_ROPE = "none"  # the metadata spelling of rope=None


def save(obj, path, *, num_heads: int | None = None, masked_rows: str | None = None, num_kv_heads: int | None = None,
         rope: str | None = None, rope_theta: float | None = None) -> None:
    """Write weights to a safetensors file; the layer's description goes in its metadata.

    `obj` is our torch or JAX module (everything comes from it; a keyword that
    contradicts it is a ValueError) or a canonical state dict, which carries only the
    biases (its keys) and the shapes: then num_heads= and masked_rows= are required --
    the masked-row policy is part of what the weights compute, so it is never defaulted
    -- and num_kv_heads (None: num_heads), rope (None: no RoPE) and rope_theta (None:
    10000) describe the rest. Metadata (format_version 2): embed_dim, num_heads,
    num_kv_heads (K, always written), rope ("none", "half", "interleaved"), rope_theta
    (Python's repr of the float, exact), masked_rows.
    """
    from safetensors.numpy import save_file

    given = dict(num_heads=num_heads, masked_rows=masked_rows, num_kv_heads=num_kv_heads, rope=rope, rope_theta=rope_theta)
    module = _module_config(obj)
    if module is not None:
        sd, cfg = module
        own = dict(num_heads=cfg.num_heads, masked_rows=cfg.masked_rows, num_kv_heads=cfg.kv_heads, rope=cfg.rope,
                   rope_theta=cfg.rope_theta)
        for field, value in given.items():
            if value is not None and value != own[field]:
                raise ValueError(f"save: {field}={value!r} contradicts the module's {field}={own[field]!r}")
    else:
        sd = obj
        if not isinstance(sd, Mapping):
            raise TypeError(f"save takes our torch or JAX module or a canonical state dict, got {type(obj).__name__}")
        if num_heads is None or masked_rows is None:
            raise TypeError(
                "save(state_dict, path) needs num_heads= and masked_rows= (one of "
                f"{list(MASKED_ROWS_POLICIES)}: the policy the weights were used with); or pass the module itself"
            )
        shapes, _ = check_variant_state_dict(sd, num_heads, num_kv_heads)
        cfg = AttentionConfig(shapes.embed_dim, num_heads, num_kv_heads=num_kv_heads, qkv_bias=shapes.qkv_bias,
                              out_bias=shapes.out_bias, rope=rope,
                              rope_theta=10000.0 if rope_theta is None else rope_theta, masked_rows=masked_rows)
    check_variant_state_dict(sd, cfg.num_heads, cfg.num_kv_heads)
    metadata = {
        "format": FILE_FORMAT,
        "format_version": FILE_FORMAT_VERSION,
        "embed_dim": str(cfg.embed_dim),
        "num_heads": str(cfg.num_heads),
        "num_kv_heads": str(cfg.kv_heads),
        "rope": _NO_ROPE if cfg.rope is None else cfg.rope,
        "rope_theta": repr(float(cfg.rope_theta)),
        "masked_rows": cfg.masked_rows,
    }
    with atomic_path(path) as tmp:  # a reader never sees half a file
        save_file({k: np.ascontiguousarray(sd[k]) for k in cfg.weight_shapes()}, tmp, metadata=metadata)


# Each version's metadata fields; version 1 (the classic layer only) is still read.
_METADATA_FIELDS = {
    "1": ("format_version", "embed_dim", "num_heads", "masked_rows"),
    "2": ("format_version", "embed_dim", "num_heads", "num_kv_heads", "rope", "rope_theta", "masked_rows"),
}


def _metadata_int(metadata: dict, field: str, path: str) -> int:
    value = metadata[field]
    if not value.isdecimal() or int(value) <= 0:
        raise ValueError(f"{path}: metadata field {field!r} = {value!r} is not a positive integer")
    return int(value)


def _metadata_rope(metadata: dict, path: str) -> tuple[str | None, float]:
    """(rope, rope_theta) of a version 2 file; a ValueError naming the file and the field otherwise."""
    from mha_spec import ROPE_CONVENTIONS

    rope = metadata["rope"]
    if rope != _NO_ROPE and rope not in ROPE_CONVENTIONS:
        raise ValueError(f"{path}: metadata field 'rope' = {rope!r} is not one of {(_NO_ROPE, *ROPE_CONVENTIONS)}")
    try:
        theta = float(metadata["rope_theta"])
    except ValueError:
        theta = float("nan")
    if not (1.0 < theta < float("inf")):
        raise ValueError(f"{path}: metadata field 'rope_theta' = {metadata['rope_theta']!r} is not a finite number > 1")
    return (None if rope == _NO_ROPE else rope), theta


def load(path) -> Checkpoint:
    """Read a file written by `save`; everything needed to rebuild the module comes from the file.

    `path` is a str, bytes or os.PathLike. Every error names the file: a directory, a
    missing, truncated, pickle or foreign file, a tensor of another dtype, bad metadata.
    A format_version 1 file (no num_kv_heads, rope or rope_theta) is the classic layer.
    """
    with open_weight_file(path) as f:
        path, metadata = f.path, f.metadata
        if metadata.get("format") != FILE_FORMAT:
            raise ValueError(f"{path} has no {FILE_FORMAT!r} metadata (found {sorted(metadata)}); was it written by parity.convert.save?")
        if "format_version" not in metadata:
            raise ValueError(f"{path}: metadata lacks 'format_version'")
        version = metadata["format_version"]
        if version not in _METADATA_FIELDS:
            raise ValueError(f"{path}: metadata field 'format_version' = {version!r}; this version reads {sorted(_METADATA_FIELDS)}")
        for field in _METADATA_FIELDS[version]:
            if field not in metadata:
                raise ValueError(f"{path}: metadata lacks {field!r}")
        later = sorted(set(_METADATA_FIELDS["2"]) - set(_METADATA_FIELDS[version]) & set(metadata))
        if later:
            raise ValueError(f"{path}: metadata fields {later} are not part of format_version {version!r}")
        embed_dim, num_heads = _metadata_int(metadata, "embed_dim", path), _metadata_int(metadata, "num_heads", path)
        if metadata["masked_rows"] not in MASKED_ROWS_POLICIES:
            raise ValueError(f"{path}: metadata field 'masked_rows' = {metadata['masked_rows']!r} is not one of {MASKED_ROWS_POLICIES}")
        kv_heads, rope, rope_theta = num_heads, None, 10000.0
        if version != "1":
            kv_heads = _metadata_int(metadata, "num_kv_heads", path)
            rope, rope_theta = _metadata_rope(metadata, path)
        keys = CANONICAL_KEYS if version == "1" else tuple(k for k in CANONICAL_KEYS if k in f.keys)
        try:
            check_keys(f.keys, keys, "state dict")
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        sd = {k: f.get(k) for k in keys}
    try:
        E = sd["q_proj.weight"].shape[-1] if "q_proj.weight" in sd else None
        if E is not None and E != embed_dim:
            raise ValueError(f"metadata field 'embed_dim' = {embed_dim} but the weights are ({sd['q_proj.weight'].shape[0]}, {E})")
        if E is not None and E % num_heads:
            raise ValueError(f"metadata field 'num_heads' = {num_heads} does not divide embed_dim {E}")
        if num_heads % kv_heads:
            raise ValueError(f"metadata field 'num_kv_heads' = {kv_heads} does not divide num_heads {num_heads}")
        num_kv_heads = None if kv_heads == num_heads else kv_heads
        check_variant_state_dict(sd, num_heads, num_kv_heads)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from e
    return Checkpoint(sd, num_heads, metadata["masked_rows"], num_kv_heads, rope, rope_theta)


ROPE_TARGETS = ("half", "interleaved")


def permute_rope(sd, *, num_heads: int, num_kv_heads: int | None = None, to: str) -> dict[str, np.ndarray]:
    """Reorder the q/k projection rows between the two RoPE conventions; other entries unchanged.

    to="half" is Hugging Face's convert_llama_weights_to_hf permutation of Meta's rows
    (`w.view(n, rows // n // 2, 2, cols).transpose(1, 2).reshape(rows, cols)`), so weights
    run with rope="interleaved" give the same output as the permuted ones with rope="half";
    to="interleaved" is its exact inverse. q rows use num_heads, k rows num_kv_heads; q/k
    biases, when present, are reordered with their rows.

    num_kv_heads=None means num_heads, right only for a layer with as many key/value heads as
    query heads; a grouped checkpoint (Llama 2 70B, Llama 3: fewer key/value heads) needs its
    K, `n_kv_heads` in Meta's params.json (`num_key_value_heads` in a config.json). The head
    dim H comes from q: q_proj.weight must have num_heads * H rows with H even, k_proj's rows
    must be the key/value heads * H, else a ValueError names the tensor, its shape and the
    heads (a wrong head count would permute the rows within the wrong blocks, silently).
    """
    if to not in ROPE_TARGETS:
        raise ValueError(f"to={to!r} is not one of {ROPE_TARGETS}")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    for name, val in (("num_heads", num_heads), ("num_kv_heads", kv)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    H = _rope_head_dim(sd, num_heads)
    out = dict(sd)
    for proj, heads in (("q_proj", num_heads), ("k_proj", kv)):
        for suffix in ("weight", "bias"):
            key = f"{proj}.{suffix}"
            if key not in sd:
                continue
            w = np.asarray(sd[key])
            _check_rope_rows(key, w.shape, heads, H, num_heads, num_kv_heads)
            x = w.reshape((heads, H // 2, 2) + w.shape[1:]) if to == "half" \
                else w.reshape((heads, 2, H // 2) + w.shape[1:])
            out[key] = np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(w.shape))
    return out


def _rope_head_dim(sd, num_heads: int) -> int:
    """H from q_proj.weight's (num_heads * H, E) rows, H even; a ValueError naming the shape otherwise."""
    if "q_proj.weight" not in sd:
        raise ValueError(f"permute_rope needs q_proj.weight (its rows give the head dim); got keys {sorted(sd)}")
    shape = np.shape(sd["q_proj.weight"])
    if len(shape) != 2 or shape[0] % num_heads or (shape[0] // num_heads) % 2:
        raise ValueError(f"q_proj.weight has {shape[0] if shape else 0} rows, not {num_heads} heads of an even "
                         f"head_dim (shape {shape}, num_heads={num_heads})")
    return shape[0] // num_heads


def _check_rope_rows(key: str, shape: tuple, heads: int, H: int, num_heads: int, num_kv_heads) -> None:
    """key's rows must be heads * H (a weight 2-D, a bias 1-D); the ValueError names the heads used."""
    ndim = 2 if key.endswith(".weight") else 1
    if len(shape) == ndim and shape[0] == heads * H:
        return
    if key.startswith("q_proj"):
        expected = f"({heads * H}, E)" if ndim == 2 else f"({heads * H},)"
        raise ValueError(f"{key} has shape {shape}, expected {expected}: num_heads={num_heads} heads of "
                         f"head_dim {H} (from q_proj.weight)")
    given = f"num_kv_heads={num_kv_heads}" if num_kv_heads is not None else \
        f"num_kv_heads=None means num_heads={num_heads}"
    hint = ""
    if len(shape) == ndim and shape[0] % H == 0:
        where = "for a grouped checkpoint " if num_kv_heads is None else ""
        hint = (f"; its {shape[0]} rows are {shape[0] // H} heads: {where}pass num_kv_heads={shape[0] // H} "
                f"(n_kv_heads in Meta's params.json, num_key_value_heads in config.json)")
    raise ValueError(f"{key} has shape {shape}, but {given} key/value heads of head_dim {H} "
                     f"(from q_proj.weight) need {heads * H} rows{hint}")
