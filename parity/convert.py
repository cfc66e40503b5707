"""One weight-conversion layer: every format to and from one canonical state dict.

The canonical format (parity.canonical, re-exported here) is a plain
``dict[str, numpy.ndarray]`` with the classic state_dict names and torch's layout
(a Linear ``weight`` is (out, in)):

    q_proj.weight (E, E)  q_proj.bias (E,)   ... k_proj, v_proj, out_proj likewise

Every conversion is an explicit table: name -> name and layout -> layout, every
shape checked, missing and unexpected keys named in the error, no layout guessed
from a suffix or an ndim. This module holds our two modules' pairs and the weight
file format; the peers' pairs live with their libraries in parity/peers/
(torch.nn.MultiheadAttention, flax linen and nnx, Keras 3 MultiHeadAttention and
GroupQueryAttention, Equinox) and are re-exported here, as are the checkpoint layouts
of real models (Hugging Face BERT, ViT, GPT-2, Llama/Mistral/Qwen2) and the
transformers checkpoint-directory readers of parity/layouts.py, which account for every
tensor under a block's prefix (`account`) and refuse what they would leave unread, and a
config.json describing attention the tool does not model (`unmodelled_features`), and
`permute_rope` (parity/rope_layout.py), the q/k row order between the two RoPE conventions.
Grouped key/value heads (k/v weights (K*H, E)) and absent biases (the keys say which)
convert wherever the target has them: our modules, Keras's GroupQueryAttention, the
"hf-llama" layout; flax's and torch's MultiheadAttention refuse them by name. Dtypes
pass through unchanged (bfloat16 as ``ml_dtypes.bfloat16`` NumPy arrays); asking for
another dtype is an error, never a silent cast. Weight files are safetensors, never pickle (parity/weight_file.py reads them).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, AttentionConfig
from mha_spec.files import atomic_path
from parity.canonical import (
    CANONICAL_KEYS,
    LAYER_FIELDS,
    PROJECTIONS,
    ROPE_FIELDS,
    SUPPORTED_DTYPES,
    bias_flags,
    check_jax_dtype,
    check_keys,
    check_state_dict,
    check_variant_state_dict,
    numpy_dtype_of_torch,
    numpy_to_tensor,
    refuse_dtype_change,
    tensor_to_numpy,
    torch_dtype_of,
)
from parity.layouts import (LAYOUTS, account, from_layout, read_checkpoint, read_hf_config, read_layout, to_layout,
                             unmodelled_features)
from parity.peers.common import FLAX_NAMES
from parity.peers.equinox import EQX_NAMES, from_equinox, to_equinox
from parity.peers.flax import from_flax_linen, from_flax_nnx, is_nnx_mha, to_flax_linen, to_flax_nnx
from parity.peers.keras import from_keras, to_keras
from parity.peers.torch_mha import from_torch_mha, is_torch_mha, to_torch_mha
from parity.rope_layout import ROPE_TARGETS, permute_rope
from parity.weight_file import open_weight_file

__all__ = [
    # the canonical state dict (parity.canonical)
    "CANONICAL_KEYS", "PROJECTIONS", "SUPPORTED_DTYPES", "check_state_dict", "tensor_to_numpy", "numpy_to_tensor",
    # our modules and their peers
    "from_torch", "to_torch", "from_jax", "to_jax", "torch_to_jax", "jax_to_torch",
    "from_torch_mha", "to_torch_mha", "from_flax_linen", "to_flax_linen", "from_flax_nnx", "to_flax_nnx",
    "from_keras", "to_keras", "from_equinox", "to_equinox", "FLAX_NAMES", "EQX_NAMES",
    # Hugging Face checkpoint layouts and directories (parity.layouts)
    "LAYOUTS", "from_layout", "to_layout", "read_layout", "read_checkpoint", "read_hf_config", "account",
    "unmodelled_features",
    # the RoPE row order (parity.rope_layout)
    "ROPE_TARGETS", "permute_rope",
    # weight files
    "Checkpoint", "save", "load", "FILE_FORMAT", "FILE_FORMAT_VERSION",
]

FILE_FORMAT = "mha-parity"
FILE_FORMAT_VERSION = "2"  # load reads 1 (the classic layer) and 2


# ---------------------------------------------------------------- torch


def from_torch(m) -> dict[str, np.ndarray]:
    """mha_torch.MultiHeadAttention -> canonical state dict."""
    from mha_torch import MultiHeadAttention

    if not isinstance(m, MultiHeadAttention):
        hint = ""
        if is_torch_mha(m):
            hint = "; for torch.nn.MultiheadAttention use sd = convert.from_torch_mha(m), then convert.to_jax(sd, m.num_heads, masked_rows=...)"
        raise TypeError(f"expected mha_torch.MultiHeadAttention, got {type(m).__name__}{hint}")
    state = m.state_dict()
    names = tuple(m.config.weight_shapes())
    check_keys(state.keys(), names, "mha_torch state_dict")
    sd = {name: tensor_to_numpy(state[name]) for name in names}
    check_variant_state_dict(sd, m.num_heads, m.config.num_kv_heads,
                             **{f: getattr(m.config, f) for f in (*LAYER_FIELDS, *ROPE_FIELDS)})
    return sd


def _refuse_tensor_fields(module_kwargs: dict, cfg) -> None:
    """head_dim and sinks are read off the tensors: a keyword that contradicts them is a ValueError."""
    for field in ("head_dim", "sinks"):
        if field in module_kwargs:
            said = cfg.head_size if field == "head_dim" else cfg.sinks
            given = module_kwargs.pop(field)
            if given is not None and given != said:
                raise ValueError(f"{field}={given!r} contradicts the state dict's tensors, which say {field}={said!r}")


def _module_layer(sd, num_heads: int, num_kv_heads, module_kwargs: dict):
    """(AttentionConfig, dtype, the module's layer keywords) of a canonical state dict for either module:
    the fields the tensors cannot say are taken out of module_kwargs (`LAYER_FIELDS`), a head_dim= or
    sinks= there must agree with the tensors (`_refuse_tensor_fields`)."""
    layer = {f: module_kwargs.pop(f) for f in LAYER_FIELDS if f in module_kwargs}
    rope = {f: module_kwargs[f] for f in ROPE_FIELDS if f in module_kwargs}  # read, left for the module
    cfg, dtype = check_variant_state_dict(sd, num_heads, num_kv_heads, **layer, **rope)
    _refuse_tensor_fields(module_kwargs, cfg)
    return cfg, dtype, dict(layer, num_kv_heads=num_kv_heads, head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                            out_bias=cfg.out_bias, sinks=cfg.sinks)


def to_torch(sd, num_heads: int, *, num_kv_heads: int | None = None, **module_kwargs):
    """Canonical state dict -> mha_torch.MultiHeadAttention in the weights' dtype.

    The keys say which biases the layer has and whether it has sinks; q_proj's rows say head_dim;
    k/v weights of K*H rows need num_kv_heads=K. rope, rope_theta, rope_dim, rope_scaling and masked_rows
    pass through to the module, and so do the fields the tensors cannot say (qk_norm, qk_norm_eps,
    qk_norm_offset, scale, softcap): q_norm.weight/k_norm.weight need qk_norm.
    """
    from mha_torch import MultiHeadAttention

    cfg, dtype, layer = _module_layer(sd, num_heads, num_kv_heads, module_kwargs)
    refuse_dtype_change(module_kwargs, "dtype", dtype, numpy_dtype_of_torch)
    m = MultiHeadAttention(cfg.embed_dim, num_heads, **layer, dtype=torch_dtype_of(dtype), **module_kwargs)
    device = m.q_proj.weight.device
    m.load_state_dict({name: numpy_to_tensor(sd[name], device) for name in cfg.weight_shapes()}, strict=True)
    return m


# ---------------------------------------------------------------- jax / flax


def from_jax(m) -> dict[str, np.ndarray]:
    """mha_jax.MultiHeadAttention -> canonical state dict (kernel (in, out) -> weight (out, in))."""
    from mha_jax import MultiHeadAttention

    if not isinstance(m, MultiHeadAttention):
        hint = ""
        if is_nnx_mha(m):
            hint = "; for flax.nnx.MultiHeadAttention use sd = convert.from_flax_nnx(m), then convert.to_torch(sd, m.num_heads, masked_rows=...)"
        raise TypeError(f"expected mha_jax.MultiHeadAttention, got {type(m).__name__}{hint}")
    sd = {}
    for p in PROJECTIONS:
        layer = getattr(m, p)
        sd[f"{p}.weight"] = np.ascontiguousarray(np.asarray(layer.kernel[...]).T)
        if layer.bias is not None:  # a bias-free projection has no key (the keys say which biases)
            sd[f"{p}.bias"] = np.array(layer.bias[...])
    for name in ("q_norm", "k_norm"):
        if getattr(m, name) is not None:
            sd[f"{name}.weight"] = np.array(getattr(m, name).weight[...])
    if m.sinks is not None:
        sd["sinks"] = np.array(m.sinks[...])
    check_variant_state_dict(sd, m.num_heads, m.config.num_kv_heads,
                             **{f: getattr(m.config, f) for f in (*LAYER_FIELDS, *ROPE_FIELDS)})
    return sd


def to_jax(sd, num_heads: int, *, num_kv_heads: int | None = None, **module_kwargs):
    """Canonical state dict -> mha_jax.MultiHeadAttention with param_dtype = the weights' dtype.

    The keys say which biases the layer has and whether it has sinks; q_proj's rows say head_dim;
    k/v weights of K*H rows need num_kv_heads=K. rope, rope_theta, rope_dim, rope_scaling and masked_rows
    pass through to the module, and so do the fields the tensors cannot say (qk_norm, qk_norm_eps,
    qk_norm_offset, scale, softcap): q_norm.weight/k_norm.weight need qk_norm.
    """
    import jax.numpy as jnp
    from flax import nnx

    from mha_jax import MultiHeadAttention

    cfg, dtype, layer = _module_layer(sd, num_heads, num_kv_heads, module_kwargs)
    check_jax_dtype(dtype)
    refuse_dtype_change(module_kwargs, "param_dtype", dtype, np.dtype)
    rngs = module_kwargs.pop("rngs", None) or nnx.Rngs(0)
    m = MultiHeadAttention(cfg.embed_dim, num_heads, rngs=rngs, **layer, param_dtype=dtype, **module_kwargs)
    for p in PROJECTIONS:
        proj = getattr(m, p)
        proj.kernel[...] = jnp.asarray(sd[f"{p}.weight"].T)  # (E_in, E_out)
        if proj.bias is not None:
            proj.bias[...] = jnp.asarray(sd[f"{p}.bias"])
    for name in ("q_norm", "k_norm"):
        if getattr(m, name) is not None:
            getattr(m, name).weight[...] = jnp.asarray(sd[f"{name}.weight"])
    if m.sinks is not None:
        m.sinks[...] = jnp.asarray(sd["sinks"])
    return m


def _layer_kwargs(m) -> dict:
    """What a module's weights do not say about its layer: masked_rows, num_kv_heads, its RoPE
    (`parity.canonical.ROPE_FIELDS`: rope, rope_theta and, when set, rope_dim and rope_scaling) and the fields of
    `parity.canonical.LAYER_FIELDS` (qk_norm, its eps and offset, scale, softcap); a field at its default is left
    out, so a module without the newer keywords still takes the result."""
    c = m.config
    kept = {f: getattr(c, f) for f in (*ROPE_FIELDS[2:], *LAYER_FIELDS) if getattr(c, f) != getattr(AttentionConfig, f)}
    return dict(masked_rows=c.masked_rows, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta, **kept)


def torch_to_jax(m):
    """mha_torch -> mha_jax, keeping num_heads, masked_rows, num_kv_heads and RoPE."""
    return to_jax(from_torch(m), m.num_heads, **_layer_kwargs(m))


def jax_to_torch(m):
    """mha_jax -> mha_torch, keeping num_heads, masked_rows, num_kv_heads and RoPE."""
    return to_torch(from_jax(m), m.num_heads, **_layer_kwargs(m))


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
        """The layer as an mha_spec.AttentionConfig (biases and a head dim other than E/N read off the tensors)."""
        shapes, _ = check_variant_state_dict(self.state_dict, self.num_heads, self.num_kv_heads)
        return AttentionConfig(shapes.embed_dim, self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=shapes.head_dim,
                               qkv_bias=shapes.qkv_bias, out_bias=shapes.out_bias, rope=self.rope,
                               rope_theta=self.rope_theta, masked_rows=self.masked_rows)

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
    unsaved = {f: getattr(cfg, f) for f in (*LAYER_FIELDS, "rope_dim", "rope_scaling", "sinks")
               if getattr(cfg, f) != getattr(AttentionConfig, f)}
    if unsaved:  # written without them, the file would load as a different layer (load takes no sinks)
        raise ValueError(f"save: the weight file format (version {FILE_FORMAT_VERSION}) does not carry "
                         f"{', '.join(f'{k}={v}' for k, v in unsaved.items())}; the file would load as a layer "
                         f"without them. Keep the layer's config beside the weights (e.g. a transformers "
                         f"config.json, read by --checkpoint)")
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
