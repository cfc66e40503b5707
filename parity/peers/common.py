"""What several peers share: the optional-package skip, dtypes and casts, the classic-layer refusal,
the q/k/v and output projections of the peers that compute them around a library's attention core
(`jax_project`, `torch_project`, `jax_out`, `torch_out`), flax's per-head weight layout (Keras's MultiHeadAttention stores it too), and the wrappers that
plug canonical parameters into a flax module (`linear_leaves`, `merged`: our JAX module is an nnx
module too, so parity.impls.jax_impls uses them as well).

Framework-free at import: torch, jax and flax are imported inside the functions that use them,
so the registry can list every peer without loading a framework.
Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mha_spec import check_config
from parity.canonical import CANONICAL_KEYS, check_keys, check_mapping, check_shape, check_state_dict

# The default matrix's causal self-attention case has peers=True for GPT-2 (causal only); the
# framework peers skip it to keep the default run within a minute (~3 s of CPU, measured).
FRAMEWORK_PEER_CASES = ("cross/*/*", "self/none/*", "self/padding/*", "self/random/*")


class MissingPackage(ImportError):
    """The optional package a peer runs (the `.[ecosystem]` extra) is not installed: a skip, not an error.

    Only this exception is a skip: any other ImportError (a broken install, a bug in an
    adapter) stays an error row.
    """


def require(package: str) -> None:
    """A `MissingPackage` naming the extra unless `package` can be imported."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise MissingPackage(f"{package} is not installed (the optional extra: pip install 'mha-parity[ecosystem]')",
                             name=package)


def np_dtype(dtype) -> np.dtype:
    """A dtype or its name as a NumPy dtype; "bfloat16" is ml_dtypes.bfloat16."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)


def cast_state_dict(sd, dtype) -> dict[str, np.ndarray]:
    """Every tensor of `sd` as a NumPy array of `dtype` (the peers run in the unit's dtype, cast explicitly)."""
    return {k: np.asarray(v).astype(dtype) for k, v in sd.items()}


def classic_only(sd, target: str) -> None:
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


# ---------------------------------------------------------------- the input projections around an attention core


def jax_project(x, params, name: str, heads: int, head_dim: int):
    """x (B, L, E) through the canonical projection `name` (q_proj, k_proj, v_proj), split into heads:
    (B, L, heads, head_dim), the layout of jax.nn.dot_product_attention and the Pallas kernels' callers.

    x Wᵀ + b with the (out, in) weight, the bias when the layer has one; jax arrays, traced ones too.
    """
    import jax.numpy as jnp

    y = jnp.einsum("BLE,FE->BLF", x, params[f"{name}.weight"])
    if f"{name}.bias" in params:
        y = y + params[f"{name}.bias"]
    return y.reshape(x.shape[0], x.shape[1], heads, head_dim)


def torch_project(x, params, name: str, heads: int, head_dim: int):
    """`jax_project` in torch, heads first: (B, heads, L, head_dim), the layout of F.scaled_dot_product_attention.

    F.linear(x, W, b) with the (out, in) weight, the bias when the layer has one.
    """
    import torch.nn.functional as F

    y = F.linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))
    return y.view(x.shape[0], x.shape[1], heads, head_dim).transpose(1, 2)


def jax_out(ctx, params):
    """The context (B, L, N, H) or (B, L, N·H) through out_proj: (B, L, E); the bias when the layer has one.
    The one output projection of the peers that compute their projections around a library's core."""
    import jax.numpy as jnp

    ctx = ctx.reshape(ctx.shape[0], ctx.shape[1], -1)  # (B, L, N·H)
    out = jnp.einsum("BLF,EF->BLE", ctx, params["out_proj.weight"])
    return out + params["out_proj.bias"] if "out_proj.bias" in params else out


def torch_out(ctx, params):
    """`jax_out` in torch, from the heads-first context (B, N, L, H) that F.scaled_dot_product_attention returns."""
    import torch.nn.functional as F

    B, _, L, _ = ctx.shape
    return F.linear(ctx.transpose(1, 2).reshape(B, L, -1), params["out_proj.weight"], params.get("out_proj.bias"))


# ---------------------------------------------------------------- flax's per-head layout

# Our projection name -> the flax (linen and nnx) MultiHeadAttention submodule name.
FLAX_NAMES = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}


def to_flax_tree(sd, num_heads: int) -> dict[str, dict[str, np.ndarray]]:
    """Canonical -> {query|key|value|out: {kernel, bias}} in flax's per-head layout.

    Heads are split as feature index n * H + h, exactly as view(B, L, N, H) does.
      in-projections: weight (N*H, E) -> kernel (E, N, H);  bias (N*H,) -> (N, H)
      out-projection: weight (E, N*H) -> kernel (N, H, E);  bias (E,)   -> (E,)
    """
    classic_only(sd, "flax.linen.MultiHeadDotProductAttention")
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


def from_flax_tree(tree: Mapping, what: str) -> dict[str, np.ndarray]:
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


# ---------------------------------------------------------------- canonical parameters in a flax module


def linear_leaves(params, p: str, kernel_shape=None) -> dict:
    """Canonical (out, in) weight and bias as a flax layer's (in, out) kernel and bias, reshaped if asked.
    A projection without bias (no key) has only a kernel. Works on any array type (traced ones too)."""
    kernel = params[f"{p}.weight"].T  # (E_in, E_out)
    if kernel_shape is not None:
        kernel = kernel.reshape(kernel_shape)
    if f"{p}.bias" not in params:
        return {"kernel": kernel}
    bias = params[f"{p}.bias"]
    if kernel_shape is not None:
        bias = bias if p == "out_proj" else bias.reshape(kernel_shape[1:])
    return {"kernel": kernel, "bias": bias}


def merged(graphdef, state, layers: dict):
    """The flax.nnx module with `layers` ({submodule: {"kernel", "bias", ...}} or {parameter: array}) as its
    parameters, traceable.

    Works on copies: Variables created outside a jax transformation cannot be mutated inside it.
    """
    import jax
    from flax import nnx

    pure = jax.tree.map(lambda a: a, nnx.to_pure_dict(state))
    for name, leaves in layers.items():
        if isinstance(leaves, dict):
            pure[name].update(leaves)
        else:  # a parameter of the module itself (our sinks)
            pure[name] = leaves
    fresh = jax.tree.map(lambda a: a, state)
    nnx.replace_by_pure_dict(fresh, pure)
    return nnx.merge(graphdef, fresh)


def jax_peer(forward, package: str, sd, num_heads, *, dtype, device):
    """A `uses_params=False` peer of the JAX libraries: fn(query, key, value, keep) runs
    `forward(sd, num_heads, q, k, v, keep, dtype)` on NumPy copies and puts the output on `device`.

    `package` missing: a `MissingPackage` when the peer is built.
    """
    require(package)
    import jax

    def fn(query, key, value, keep):
        q, k, v = (np.asarray(x) for x in (query, key, value))
        keep = None if keep is None else np.asarray(keep)
        return jax.device_put(forward(sd, num_heads, q, k, v, keep, dtype), device)

    return fn
