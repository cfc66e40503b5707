"""Sharded multi-head attention in JAX: tensor-, sequence- (ring) and data-parallel.

One entry point, `sharded_attention(params, query, key, value, mask, mesh=..., layout=...)`,
runs the maths of `mha_jax.MultiHeadAttention` inside `jax.shard_map` over one mesh axis:

- "tp" (heads): q/k/v kernels split by output columns, the out kernel by input rows;
  each device attends with its own heads; one `psum` after the output projection,
  then the out bias is added once (not once per shard).
- "sp" (ring attention): queries and keys/values split along the sequence; the k/v
  blocks travel around the ring with `lax.ppermute` and are merged with the
  online-softmax recurrence of `mha_jax.chunked`. The keep-mask is split by query
  rows; each step slices the columns of the key block it holds.
- "dp" (batch): everything split along B, parameters replicated.

`shard_heads(module, mesh)` is the other tensor-parallel route: it places the module's
kernels head-sharded (NamedSharding) and the unchanged module runs under `jax.jit`, GSPMD
inserting the collectives.

tp and dp attend with `attention_core` (the materialised path): the chunked kernel's
`lax.scan` carries start unvarying and shard_map's type check rejects them.

Gradients come from autodiff through shard_map/ppermute/psum (shard_map's varying-axis
tracking inserts the psum of replicated parameters' gradients). Sizes that do not split
evenly are a ValueError (nothing is padded). Never imports torch.

Legend (see mha_spec): B T S N H E; einsum strings use it verbatim.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mha_jax.attention import attention_core
from mha_jax.chunked import accumulation_dtype, fill_masked_rows, fold_scale
from mha_spec import check_config, check_qkv_shapes, mask_shape_4d

LAYOUTS = ("tp", "sp", "dp")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def params_of(module) -> dict:
    """{"q_proj": {"kernel": (E, E), "bias": (E,)}, ...} from an `mha_jax.MultiHeadAttention`."""
    return {p: {"kernel": getattr(module, p).kernel[...], "bias": getattr(module, p).bias[...]} for p in PROJECTIONS}


def make_mesh(n: int, axis: str = "x", devices=None):
    """A 1-D mesh of the first n devices with an Auto axis (GSPMD places what shard_map does not)."""
    devices = jax.devices()[:n] if devices is None else devices
    if len(devices) != n:
        raise ValueError(f"a mesh of {n} devices needs {n}, have {len(devices)}: {devices}")
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def axis_size(mesh, axis: str) -> int:
    """The size of `axis` in `mesh`; a ValueError naming the mesh's axes if it has none such."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)}")
    return mesh.shape[axis]


def check_layout(layout: str, n: int, *, B: int, T: int, S: int, N: int) -> None:
    """Sizes a layout cannot split evenly over n shards are a ValueError (nothing is padded)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    sizes = {"tp": {"num_heads N": N}, "sp": {"query length T": T, "key length S": S}, "dp": {"batch B": B}}[layout]
    for what, size in sizes.items():
        if size % n:
            raise ValueError(f"layout {layout!r}: {what}={size} is not divisible by the {n} shards of the mesh axis")


def _check_dtypes(query, key, value) -> None:
    """The module's dtype rules: one floating dtype, and float64 only with x64 (never a silent float32)."""
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if not jnp.issubdtype(query.dtype, jnp.floating):
        raise TypeError(f"inputs must be floating point, got {query.dtype}")
    if query.dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise TypeError("float64 needs jax_enable_x64: jax.config.update('jax_enable_x64', True)")


def _project(x, p, dtype, precision):
    # Accumulate in >= float32, as mha_jax.MultiHeadAttention does.
    y = jnp.einsum("BTE,EF->BTF", x, p["kernel"].astype(dtype), precision=precision, preferred_element_type=accumulation_dtype(dtype))
    return (y + p["bias"].astype(dtype)).astype(dtype)


def _keep4(mask, B: int, N: int, T: int, S: int):
    """Keep-mask -> bool (B|1, N|1, T, S): the T axis is always materialised, since sp splits it."""
    if mask is None:
        return None
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    keep = jnp.asarray(mask)
    keep = (keep if keep.dtype == jnp.bool_ else keep != 0).reshape(shape4)
    return jnp.broadcast_to(keep, (shape4[0], shape4[1], T, S))


def reduce_then_add_bias(partial_out, bias, axis: str):
    """Sum the heads' partial outputs over the tp axis, then add the out bias once."""
    return lax.psum(partial_out, axis) + bias


def key_block_start(src, n: int, block: int):
    """First key column of ring block `src` (of n blocks of `block` keys)."""
    return src * block


def _heads(params, query, key, value, N: int, precision):
    """The q/k/v projections split into heads: (B, L, N', H), N' the heads this shard holds."""
    H = query.shape[-1] // N  # query is never split along E, so this is the global head dim

    def split(x, name):
        y = _project(x, params[name], query.dtype, precision)  # (B, L, N'·H)
        return y.reshape(y.shape[0], y.shape[1], -1, H)

    return split(query, "q_proj"), split(key, "k_proj"), split(value, "v_proj")


def _tp_body(params, query, key, value, keep=None, *, N, masked_rows, precision, axis):
    dtype = query.dtype
    B, T, _ = query.shape
    q, k, v = _heads(params, query, key, value, N, precision)  # (B, T, N/tp, H), (B, S, N/tp, H) x 2
    context, _ = attention_core(q, k, v, keep, masked_rows=masked_rows, precision=precision)  # (B, T, N/tp, H)
    acc = accumulation_dtype(dtype)
    kernel = params["out_proj"]["kernel"].astype(dtype)  # (E/tp, E): this shard's input rows
    partial_out = jnp.einsum("BTE,EF->BTF", context.reshape(B, T, -1), kernel, precision=precision, preferred_element_type=acc)
    return reduce_then_add_bias(partial_out, params["out_proj"]["bias"].astype(acc), axis).astype(dtype)


def _online_step(carry, s, vj, dtype, acc, precision):
    """One key block of flash attention's recurrence (as in mha_jax.chunked), scores s (B, N, T, S)."""
    ctx, run_max, run_sum = carry  # (B, N, T, H), (B, N, T, 1), (B, N, T, 1)
    # The max only stabilises exp(); the result does not depend on it.
    new_max = lax.stop_gradient(jnp.maximum(run_max, s.max(axis=-1, keepdims=True)))
    # A row that has seen only masked keys keeps max -inf; use 0 so exp() gives 0, not NaN.
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(s - safe_max)
    rescale = jnp.exp(run_max - safe_max)
    pv = jnp.einsum("BNTS,BSNH->BNTH", p.astype(dtype), vj, preferred_element_type=acc, precision=precision)
    return rescale * ctx + pv, new_max, rescale * run_sum + p.sum(axis=-1, keepdims=True)


def ring_attention(q, k, v, keep=None, *, axis: str, masked_rows="nan", S_total: int, precision=None):
    """Attention of this device's query block against every key block, inside shard_map.

    q (B, T/n, N, H), k and v (B, S/n, N, H): this device's blocks; keep bool
    (B|1, N|1, T/n, S): this device's query rows, every key column. Returns the
    context (B, T/n, N, H). Whether a row is empty comes from its whole keep-mask row,
    never from one block (a row may be empty within a block and not overall).
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    B, Tb, N, H = q.shape
    Sb = k.shape[1]
    q, scores_scale = fold_scale(q)
    perm = [(j, (j + 1) % n) for j in range(n)]  # block j moves to device j + 1

    @jax.checkpoint
    def step(carry, kj, vj, src):
        s = jnp.einsum("BTNH,BSNH->BNTS", q, kj, preferred_element_type=acc, precision=precision)
        if scores_scale != 1.0:
            s = s * scores_scale
        if keep is not None:
            keep_j = lax.dynamic_slice_in_dim(keep, key_block_start(src, n, Sb), Sb, axis=3)
            s = jnp.where(keep_j, s, -jnp.inf)  # (B, N, T/n, S/n)
        return _online_step(carry, s, vj, dtype, acc, precision)

    carry = (jnp.zeros((B, N, Tb, H), acc), jnp.full((B, N, Tb, 1), -jnp.inf, acc), jnp.zeros((B, N, Tb, 1), acc))
    kj, vj = k, v
    for i in range(n):
        carry = step(carry, kj, vj, (me - i) % n)  # device `me` holds block me - i at step i
        if i < n - 1:
            kj, vj = lax.ppermute((kj, vj), axis, perm)
    ctx, _, run_sum = carry
    ctx = ctx / jnp.where(run_sum > 0, run_sum, 1.0)
    if keep is not None:
        row_any = keep.any(axis=-1, keepdims=True)  # (B|1, N|1, T/n, 1): the whole row
        # mean(V) over the whole sequence; fill_masked_rows wants it for every policy ("zero": 0 x mean V).
        mean_v = lax.psum(v.astype(acc).sum(axis=1), axis)[:, :, None, :] / S_total  # (B, N, 1, H)
        ctx = fill_masked_rows(ctx, row_any, masked_rows, mean_v)
    return jnp.transpose(ctx, (0, 2, 1, 3)).astype(dtype)  # (B, T/n, N, H)


def _sp_body(params, query, key, value, keep=None, *, N, masked_rows, precision, axis, S_total):
    dtype = query.dtype
    B, Tb, E = query.shape
    q, k, v = _heads(params, query, key, value, N, precision)  # (B, T/n, N, H), (B, S/n, N, H) x 2
    context = ring_attention(q, k, v, keep, axis=axis, masked_rows=masked_rows, S_total=S_total, precision=precision)
    return _project(context.reshape(B, Tb, E), params["out_proj"], dtype, precision)  # (B, T/n, E)


def _dp_body(params, query, key, value, keep=None, *, N, masked_rows, precision, axis):
    dtype = query.dtype
    B, T, E = query.shape
    q, k, v = _heads(params, query, key, value, N, precision)  # (B/n, T, N, H), (B/n, S, N, H) x 2
    context, _ = attention_core(q, k, v, keep, masked_rows=masked_rows, precision=precision)
    return _project(context.reshape(B, T, E), params["out_proj"], dtype, precision)


def layout_specs(layout: str, axis: str, keep_shape=None):
    """(params spec, query spec, key/value spec, keep spec, output spec) of a layout."""
    if layout == "tp":
        col, row = {"kernel": P(None, axis), "bias": P(axis)}, {"kernel": P(axis, None), "bias": P()}
        params = {"q_proj": col, "k_proj": col, "v_proj": col, "out_proj": row}
        keep = P(None, axis if keep_shape and keep_shape[1] > 1 else None)
        return params, P(), P(), keep, P()
    if layout == "sp":
        return P(), P(None, axis), P(None, axis), P(None, None, axis), P(None, axis)
    keep = P(axis if keep_shape and keep_shape[0] > 1 else None)
    return P(), P(axis), P(axis), keep, P(axis)


def sharded_attention(params, query, key, value, mask=None, *, mesh, layout: str, num_heads: int,
                      masked_rows: str = "nan", axis: str = "x", precision=None):
    """The output (B, T, E) of multi-head attention run over `axis` of `mesh` in `layout`.

    params as `params_of` returns; query (B, T, E), key and value (B, S, E), mask a
    keep-mask as for `mha_jax.MultiHeadAttention`. Call it under `jax.jit`; `jax.grad`
    through it gives every parameter's and input's gradient.
    """
    E = params["q_proj"]["kernel"].shape[0]
    check_config(E, num_heads, masked_rows)
    B, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, E)
    _check_dtypes(query, key, value)
    n = axis_size(mesh, axis)
    check_layout(layout, n, B=B, T=T, S=S, N=num_heads)
    keep = _keep4(mask, B, num_heads, T, S)
    pspec, qspec, kvspec, keepspec, outspec = layout_specs(layout, axis, None if keep is None else keep.shape)
    kw = {"N": num_heads, "masked_rows": masked_rows, "precision": precision, "axis": axis}
    body = {"tp": _tp_body, "sp": partial(_sp_body, S_total=S), "dp": _dp_body}[layout]
    args, specs = [params, query, key, value], [pspec, qspec, kvspec, kvspec]
    if keep is not None:
        args.append(keep)
        specs.append(keepspec)
    if AxisType.Explicit in tuple(mesh.axis_types):
        # Explicit-sharding meshes (jax.make_mesh's default) want arguments already laid out.
        args = [_reshard(a, s, mesh) for a, s in zip(args, specs)]
    fn = jax.shard_map(partial(body, **kw), mesh=mesh, in_specs=tuple(specs), out_specs=outspec)
    return fn(*args)


def _reshard(tree, spec, mesh):
    if isinstance(spec, dict):
        return {k: _reshard(tree[k], spec[k], mesh) for k in tree}
    return jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, spec)), tree)


def head_shardings(mesh, axis: str = "x") -> dict:
    """NamedShardings that split the heads: q/k/v kernels (E, E) by output columns (bias alike),
    the out kernel by input rows, the out bias replicated."""
    spec, _, _, _, _ = layout_specs("tp", axis)
    return {p: {k: NamedSharding(mesh, s) for k, s in leaves.items()} for p, leaves in spec.items()}


def shard_heads(module, mesh, axis: str = "x"):
    """Place an `mha_jax.MultiHeadAttention`'s parameters head-sharded over `axis` (in place).

    Then the unchanged module, called under `jax.jit` (or `nnx.jit`), runs tensor-parallel:
    GSPMD propagates the shardings and inserts the collectives; per-head weights come back
    sharded by head. Returns the module.
    """
    n = axis_size(mesh, axis)
    check_layout("tp", n, B=n, T=n, S=n, N=module.num_heads)
    for p, leaves in head_shardings(mesh, axis).items():
        layer = getattr(module, p)
        for name, sharding in leaves.items():
            var = getattr(layer, name)
            var.set_value(jax.device_put(var.get_value(), sharding))
    return module
