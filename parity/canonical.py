"""The canonical state dict: its names, its check, and the bit-exact torch <-> NumPy bridge.

A plain ``dict[str, numpy.ndarray]`` with the classic state_dict names and torch's
layout (a Linear ``weight`` is (out, in)):

    q_proj.weight (E, E)  q_proj.bias (E,)   ... k_proj, v_proj, out_proj likewise

parity.convert, parity.layouts and the peers (parity.peers) build on this module; it imports
none of them. torch and jax are imported only inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mha_spec import PROJECTIONS, is_int

CANONICAL_KEYS = tuple(f"{p}.{w}" for p in PROJECTIONS for w in ("weight", "bias"))
# The tensors of the layers after Llama (`mha_spec.AttentionConfig`: qk_norm, sinks), after the projections'.
LAYER_KEYS = ("q_norm.weight", "k_norm.weight", "sinks")
PARAMETER_KEYS = CANONICAL_KEYS + LAYER_KEYS
SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))


def check_keys(found, expected, what: str) -> None:
    """Missing and unexpected keys, both named: a ValueError."""
    found, expected = set(found), set(expected)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")


def check_mapping(tree, what: str) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(f"{what} must be a mapping, got {type(tree).__name__}")


def check_shape(arr, shape, name: str) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")


def check_state_dict(sd) -> tuple[int, np.dtype]:
    """Validate a canonical state dict; return (embed_dim, dtype)."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"state dict must be a mapping of name -> numpy array, got {type(sd).__name__}")
    check_keys(sd.keys(), CANONICAL_KEYS, "state dict")
    for name in CANONICAL_KEYS:
        if not isinstance(sd[name], np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(sd[name]).__name__}")
    w = sd["q_proj.weight"]
    if w.ndim != 2:
        raise ValueError(f"q_proj.weight has shape {w.shape}, expected (E, E)")
    E = w.shape[0]
    for p in PROJECTIONS:
        check_shape(sd[f"{p}.weight"], (E, E), f"{p}.weight")
        check_shape(sd[f"{p}.bias"], (E,), f"{p}.bias")
    dtypes = {name: sd[name].dtype for name in CANONICAL_KEYS}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"state dict mixes dtypes: {dtypes}")
    dtype = w.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return E, dtype


def tensor_to_numpy(t) -> np.ndarray:
    """A torch tensor as a NumPy copy, bit for bit (bfloat16 via ml_dtypes)."""
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def numpy_to_tensor(a: np.ndarray, device=None):
    """A NumPy array as a torch tensor, bit for bit (bfloat16 via ml_dtypes)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a.copy())
    return t if device is None else t.to(device)


def torch_dtype_of(dtype: np.dtype):
    """A NumPy dtype (bfloat16 as ml_dtypes.bfloat16) -> the torch dtype of the same name."""
    import torch

    return {
        np.dtype(np.float16): torch.float16,
        np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float64): torch.float64,
    }[np.dtype(dtype)]


def numpy_dtype_of_torch(torch_dtype) -> np.dtype:
    """A torch dtype -> its NumPy dtype (bfloat16 as ml_dtypes.bfloat16); a TypeError for any other."""
    import torch

    table = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float32: np.float32, torch.float64: np.float64}
    if torch_dtype not in table:
        raise TypeError(f"unsupported torch dtype {torch_dtype}")
    return np.dtype(table[torch_dtype])


def refuse_dtype_change(kwargs: dict, key: str, dtype: np.dtype, as_numpy) -> None:
    """Pop `key` from a module's keyword arguments; a TypeError if it asks for another dtype than the
    weights' (a converter never casts silently). `as_numpy` maps the asked value to a NumPy dtype."""
    if key in kwargs:
        asked = kwargs.pop(key)
        if asked is not None and np.dtype(as_numpy(asked)) != dtype:
            raise TypeError(f"{key}={asked} differs from the weights' dtype {dtype}; convert the state dict explicitly")


def check_jax_dtype(dtype: np.dtype) -> None:
    """float64 weights for a JAX module need jax_enable_x64: without it jax would store float32, silently."""
    import jax

    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError("float64 weights need jax_enable_x64, or jax would silently store float32")


_BIAS_SETS = {  # the bias keys a layer may have -> (qkv_bias, out_bias)
    frozenset(f"{p}.bias" for p in PROJECTIONS): (True, True),
    frozenset(f"{p}.bias" for p in PROJECTIONS[:3]): (True, False),
    frozenset({"out_proj.bias"}): (False, True),
    frozenset(): (False, False),
}


def bias_flags(keys) -> tuple[bool, bool]:
    """(qkv_bias, out_bias) from a state dict's keys; a partial set is a ValueError naming it.

    Biases are all present, q/k/v only, out only, or none.
    """
    keys = set(keys)
    biases = frozenset(k for k in keys if k in CANONICAL_KEYS and k.endswith(".bias"))
    if biases not in _BIAS_SETS:
        nearest = min((s for s in _BIAS_SETS if s >= biases), key=len)
        missing = sorted(nearest - biases)
        unexpected = sorted(keys - set(CANONICAL_KEYS))
        raise ValueError(f"state dict: missing keys {missing}, unexpected keys {unexpected}; bias keys "
                         f"{sorted(biases)} are a partial set: a layer has all four biases, q/k/v only, "
                         f"out_proj only, or none")
    return _BIAS_SETS[biases]


LAYER_FIELDS = ("qk_norm", "qk_norm_eps", "qk_norm_offset", "scale", "softcap", "attn_temperature_tuning", "floor_scale",
                "attn_scale")
"""The `mha_spec.AttentionConfig` fields a state dict's tensors cannot say (head_dim and sinks they can)."""

ROPE_FIELDS = ("rope", "rope_theta", "rope_dim", "rope_scaling")
"""The `mha_spec.AttentionConfig` fields of RoPE, which the tensors cannot say either: rope_dim and rope_scaling
need rope, so wherever a layer's rope and rope_theta travel (module conversions, a checkpoint's layer) these do."""


def check_variant_state_dict(sd, num_heads: int, num_kv_heads=None, **layer):
    """Validate a canonical state dict of any supported layer; return (AttentionConfig, dtype).

    The keys say which biases exist (`bias_flags`) and whether the layer has sinks ("sinks" (N,)); k/v
    weights are (K*H, E); q_proj's rows say H (N*H rows: a head dim other than E/N is the config's
    head_dim). layer: the `mha_spec.AttentionConfig` fields the tensors cannot say (qk_norm, qk_norm_eps,
    qk_norm_offset, scale, softcap); q_norm/k_norm weights need qk_norm.
    """
    from mha_spec import AttentionConfig

    if not isinstance(sd, Mapping):
        raise TypeError(f"state dict must be a mapping of name -> numpy array, got {type(sd).__name__}")
    qkv_bias, out_bias = bias_flags(sd.keys())
    w = sd.get("q_proj.weight")
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        raise ValueError(f"q_proj.weight must be a 2-D numpy array (N*H, E), got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    unknown = sorted(set(layer) - set(LAYER_FIELDS) - set(ROPE_FIELDS))  # RoPE's: Llama 4's L2 norm needs a RoPE
    if unknown:
        raise TypeError(f"unexpected layer keywords {unknown}; the tensors say the rest (known: {list(LAYER_FIELDS)})")
    head_dim = None
    if is_int(num_heads) and num_heads > 0 and w.shape[0] != w.shape[1] and w.shape[0] % num_heads == 0:
        head_dim = w.shape[0] // num_heads  # N*H rows, not E: a head dim of its own
    cfg = AttentionConfig(w.shape[1], num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=qkv_bias,
                          out_bias=out_bias, sinks="sinks" in sd, **layer)
    expected = cfg.weight_shapes()
    check_keys(sd.keys(), expected, "state dict")
    for name, shape in sorted(expected.items(), key=lambda item: item[0].endswith(".bias")):  # weights first
        if not isinstance(sd[name], np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(sd[name]).__name__}")
        check_shape(sd[name], shape, name)
    dtypes = {name: sd[name].dtype for name in expected}
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"state dict mixes dtypes: {dtypes}")
    if w.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {w.dtype}; expected one of {[str(d) for d in SUPPORTED_DTYPES]}")
    return cfg, w.dtype
