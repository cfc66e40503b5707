"""Sharded multi-head attention in JAX: tensor-, sequence- (ring) and data-parallel.

One entry point, `sharded_attention(params, query, key, value, mask, mesh=..., sharding=...)`,
runs the maths of `mha_jax.MultiHeadAttention` inside `jax.shard_map` over one mesh axis:

- "tp" (heads): q/k/v kernels split by output columns, the out kernel by input rows;
  each device attends with its own heads (N/n query heads and the K/n key/value heads
  they read: query head h reads h // (N/K)); one `psum` after the output projection,
  then the out bias is added once (not once per shard).
- "sp" (ring attention): queries and keys/values split along the sequence; each block is
  rotated (RoPE) with its global positions, then the k/v blocks (K heads) travel around
  the ring with `lax.ppermute` and are merged with the online-softmax recurrence of
  `mha_jax.chunked`, each key/value head serving its group of query heads. The keep-mask
  is split by query rows; each step slices the columns of the key block it holds.
- "dp" (batch): everything split along B (positions of shape (B, L) too), parameters
  replicated.

Grouped key/value heads (`num_kv_heads`), RoPE (`rope`, `rope_theta`, `rope_dim`, `rope_scaling`,
`positions`, `key_positions`, given for the whole problem as to the module) and projections without
bias (a params entry without "bias") are those of `mha_jax.MultiHeadAttention`. LongRoPE's switch is
decided once from the whole problem's positions, outside the shards (a device holding a block of
positions alone could not know the call's largest), and reaches every shard as a replicated scalar.

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

import warnings
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import numpy as np

from mha_jax.attention import attention_core, rope_cos_sin, rope_uses_long, rotate
from mha_jax.chunked import accumulation_dtype, fill_masked_rows, fold_scale
from mha_spec import PROJECTIONS, SHARDINGS, AttentionConfig, RopeScaling, check_positions, check_qkv_shapes, mask_shape_4d



# The layers after Llama (`mha_spec.AttentionConfig.features`) that `sharded_attention`'s own maths leaves out.
_NOT_SHARDED = ("head-dim", "qk-norm-head", "qk-norm-flat", "scale", "softcap", "sinks")


def _refuse_features(cfg: AttentionConfig, what: str, allowed=()) -> None:
    """A ValueError naming the features of cfg that `what` does not compute (all of _NOT_SHARDED but allowed)."""
    found = [f for f in _NOT_SHARDED if f in cfg.features and f not in allowed]
    if found:
        raise ValueError(f"{what} does not compute {', '.join(found)} (head_dim, qk_norm, scale, softcap, sinks of "
                         f"mha_spec.AttentionConfig); run this layer unsharded"
                         + (f" or with {', '.join(allowed)} only" if allowed else ""))


def params_of(module) -> dict:
    """{"q_proj": {"kernel": (E, N·H), "bias": (N·H,)}, "k_proj": {"kernel": (E, K·H), ...}, ...} from an
    `mha_jax.MultiHeadAttention`; a projection without bias has no "bias" entry. A layer with head_dim,
    qk_norm, scale, softcap or sinks is a ValueError: `sharded_attention` computes the classic maths."""
    _refuse_features(module.config, "sharded_attention")
    out = {}
    for p in PROJECTIONS:
        layer = getattr(module, p)
        out[p] = {"kernel": layer.kernel[...]} | ({} if layer.bias is None else {"bias": layer.bias[...]})
    return out


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


def check_sharding(sharding: str, n: int, *, B: int, T: int, S: int, N: int, K: int | None = None) -> None:
    """Sizes a sharding cannot split evenly over n shards are a ValueError (nothing is padded).
    tp splits the query heads N and the key/value heads K (None: N)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r} is not one of {SHARDINGS}")
    heads = {"num_heads N": N} | ({} if K is None else {"num_kv_heads K": K})
    sizes = {"tp": heads, "sp": {"query length T": T, "key length S": S}, "dp": {"batch B": B}}[sharding]
    for what, size in sizes.items():
        if size % n:
            raise ValueError(f"sharding {sharding!r}: {what}={size} is not divisible by the {n} shards of the mesh axis")


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
    return (y if "bias" not in p else y + p["bias"].astype(dtype)).astype(dtype)


def _keep4(mask, B: int, N: int, T: int, S: int):
    """Keep-mask -> bool (B|1, N|1, T, S): the T axis is always materialised, since sp splits it."""
    if mask is None:
        return None
    shape4 = mask_shape_4d(mask.shape, B, N, T, S)
    keep = jnp.asarray(mask)
    keep = (keep if keep.dtype == jnp.bool_ else keep != 0).reshape(shape4)
    return jnp.broadcast_to(keep, (shape4[0], shape4[1], T, S))


def reduce_then_add_bias(partial_out, bias, axis: str):
    """Sum the heads' partial outputs over the tp axis, then add the out bias once (None: no bias)."""
    out = lax.psum(partial_out, axis)
    return out if bias is None else out + bias


def key_block_start(src, n: int, block: int):
    """First key column of ring block `src` (of n blocks of `block` keys)."""
    return src * block


def _heads(params, query, key, value, cfg: AttentionConfig, precision, positions=None, key_positions=None, long=False):
    """The q/k/v projections split into heads, q and k rotated for RoPE: (B, L, n, H), n the heads
    this shard holds. positions (B|1, T') and key_positions (B|1, S'): this shard's rows' global
    positions (RoPE only); long: LongRoPE's switch of the whole call (`rope_uses_long`)."""
    H = cfg.head_size

    def split(x, name):
        y = _project(x, params[name], query.dtype, precision)  # (B, L, n·H)
        return y.reshape(y.shape[0], y.shape[1], -1, H)

    q, k, v = split(query, "q_proj"), split(key, "k_proj"), split(value, "v_proj")
    if cfg.rope is not None:
        acc = accumulation_dtype(query.dtype)
        q = rotate(q, *rope_cos_sin(cfg, positions, q.shape[1], acc, long), cfg.rope)
        k = rotate(k, *rope_cos_sin(cfg, key_positions, k.shape[1], acc, long), cfg.rope)
    return q, k, v


def _tp_body(params, query, key, value, keep, positions, key_positions, *, cfg, precision, axis, long=False):
    dtype = query.dtype
    B, T, _ = query.shape
    q, k, v = _heads(params, query, key, value, cfg, precision, positions, key_positions, long)  # (B, T, N/tp, H), (B, S, K/tp, H) x 2
    context, _ = attention_core(q, k, v, keep, masked_rows=cfg.masked_rows, precision=precision)  # (B, T, N/tp, H)
    acc = accumulation_dtype(dtype)
    kernel = params["out_proj"]["kernel"].astype(dtype)  # (N·H/tp, E): this shard's input rows
    partial_out = jnp.einsum("BTE,EF->BTF", context.reshape(B, T, -1), kernel, precision=precision, preferred_element_type=acc)
    bias = params["out_proj"].get("bias")
    return reduce_then_add_bias(partial_out, None if bias is None else bias.astype(acc), axis).astype(dtype)


def _online_step(carry, s, vj, dtype, acc, precision):
    """One key block of flash attention's recurrence (as in mha_jax.chunked), scores s (B, N, T, S),
    vj (B, S, K, H) with K dividing N (query head h reads key/value head h // (N/K))."""
    ctx, run_max, run_sum = carry  # (B, N, T, H), (B, N, T, 1), (B, N, T, 1)
    B, N, T, S = s.shape
    K, H = vj.shape[2], vj.shape[3]
    # The max only stabilises exp(); the result does not depend on it.
    new_max = lax.stop_gradient(jnp.maximum(run_max, s.max(axis=-1, keepdims=True)))
    # A row that has seen only masked keys keeps max -inf; use 0 so exp() gives 0, not NaN.
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(s - safe_max)
    rescale = jnp.exp(run_max - safe_max)
    pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(dtype).reshape(B, K, N // K, T, S), vj, preferred_element_type=acc,
                    precision=precision).reshape(B, N, T, H)
    return rescale * ctx + pv, new_max, rescale * run_sum + p.sum(axis=-1, keepdims=True)


def ring_attention(q, k, v, keep=None, *, axis: str, masked_rows="nan", S_total: int, precision=None):
    """Attention of this device's query block against every key block, inside shard_map.

    q (B, T/n, N, H), k and v (B, S/n, K, H) with K dividing N: this device's blocks
    (already rotated, for RoPE); keep bool (B|1, N|1, T/n, S): this device's query rows,
    every key column. Returns the context (B, T/n, N, H). Whether a row is empty comes from
    its whole keep-mask row, never from one block (a row may be empty within a block and
    not overall).
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    B, Tb, N, H = q.shape
    Sb, K = k.shape[1], k.shape[2]
    if N % K or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"key/value heads must divide the query heads and key and value must have one shape: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (B, L, heads, H)")
    G = N // K
    q, scores_scale = fold_scale(q)
    q = q.reshape(B, Tb, K, G, H)  # query head j·G + g reads key/value head j
    perm = [(j, (j + 1) % n) for j in range(n)]  # block j moves to device j + 1

    @jax.checkpoint
    def step(carry, kj, vj, src):
        s = jnp.einsum("BTKGH,BSKH->BKGTS", q, kj, preferred_element_type=acc, precision=precision).reshape(B, N, Tb, Sb)
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
        # Summed as V·(1/S): a plain sum of finite values near the dtype's largest could overflow.
        mean_v = lax.psum((v.astype(acc) * (1.0 / S_total)).sum(axis=1), axis)  # (B, K, H)
        mean_v = jnp.repeat(mean_v, G, axis=1)[:, :, None, :] if G > 1 else mean_v[:, :, None, :]  # (B, N, 1, H)
        ctx = fill_masked_rows(ctx, row_any, masked_rows, mean_v)
    return jnp.transpose(ctx, (0, 2, 1, 3)).astype(dtype)  # (B, T/n, N, H)


def _sp_body(params, query, key, value, keep, positions, key_positions, *, cfg, precision, axis, S_total, long=False):
    dtype = query.dtype
    B, Tb, _ = query.shape
    q, k, v = _heads(params, query, key, value, cfg, precision, positions, key_positions, long)  # (B, T/n, N, H), (B, S/n, K, H) x 2
    context = ring_attention(q, k, v, keep, axis=axis, masked_rows=cfg.masked_rows, S_total=S_total, precision=precision)
    return _project(context.reshape(B, Tb, -1), params["out_proj"], dtype, precision)  # (B, T/n, E)


def _dp_body(params, query, key, value, keep, positions, key_positions, *, cfg, precision, axis, long=False):
    dtype = query.dtype
    B, T, _ = query.shape
    q, k, v = _heads(params, query, key, value, cfg, precision, positions, key_positions, long)  # (B/n, T, N, H), (B/n, S, K, H) x 2
    context, _ = attention_core(q, k, v, keep, masked_rows=cfg.masked_rows, precision=precision)
    return _project(context.reshape(B, T, -1), params["out_proj"], dtype, precision)


def sharding_specs(sharding: str, axis: str, keep_shape=None, *, qkv_bias: bool = True, out_bias: bool = True):
    """(params spec, query spec, key/value spec, keep spec, output spec) of a sharding; the params
    spec has a "bias" entry where the layer has that bias."""
    if sharding == "tp":
        col = {"kernel": P(None, axis)} | ({"bias": P(axis)} if qkv_bias else {})
        row = {"kernel": P(axis, None)} | ({"bias": P()} if out_bias else {})
        params = {"q_proj": col, "k_proj": col, "v_proj": col, "out_proj": row}
        keep = P(None, axis if keep_shape and keep_shape[1] > 1 else None)
        return params, P(), P(), keep, P()
    if sharding == "sp":
        return P(), P(None, axis), P(None, axis), P(None, None, axis), P(None, axis)
    keep = P(axis if keep_shape and keep_shape[0] > 1 else None)
    return P(), P(axis), P(axis), keep, P(axis)


def _positions_spec(sharding: str, axis: str, shape):
    """Positions (B|1, L): sp splits L with the sequence, dp splits a per-row B with the batch."""
    if sharding == "sp":
        return P(None, axis)
    return P(axis if sharding == "dp" and shape[0] > 1 else None)


def _whole_positions(pos, batch: int, length: int, name: str):
    """The whole problem's positions as (B|1, L) integers (None: arange(L)); a TypeError or ValueError
    naming them otherwise. Every sharding then cuts the rows it holds, so each block keeps its global positions."""
    if pos is None:
        return jnp.arange(length)[None, :]
    if not isinstance(pos, (jax.Array, np.ndarray)) or np.dtype(pos.dtype).kind not in "iu":
        raise TypeError(f"{name} must be a jax or numpy array of integers, got "
                        f"{getattr(pos, 'dtype', type(pos).__name__)}")
    check_positions(pos.shape, batch, length, name)
    pos = jnp.asarray(pos)
    return pos.reshape(pos.shape[0] if pos.ndim == 2 else 1, length)  # not -1: the length may be 0


def _layer(params, num_heads, num_kv_heads, rope, rope_theta, masked_rows, rope_dim: int | None = None,
           rope_scaling: RopeScaling | None = None) -> AttentionConfig:
    """The layer the params describe, checked (a ValueError naming a parameter whose shape is off)."""
    missing = [p for p in PROJECTIONS if p not in params or "kernel" not in params[p]]
    if missing:
        raise ValueError(f"params lack {missing}: want {{'q_proj': {{'kernel', 'bias'?}}, ...}} for {PROJECTIONS}")
    E = params["q_proj"]["kernel"].shape[0]
    qkv_bias = ["bias" in params[p] for p in ("q_proj", "k_proj", "v_proj")]
    if len(set(qkv_bias)) > 1:
        raise ValueError(f"q/k/v biases come all three or none; present: {qkv_bias} for q_proj, k_proj, v_proj")
    cfg = AttentionConfig(E, num_heads, num_kv_heads=num_kv_heads, qkv_bias=qkv_bias[0], out_bias="bias" in params["out_proj"],
                          rope=rope, rope_theta=rope_theta, masked_rows=masked_rows, rope_dim=rope_dim,
                          rope_scaling=rope_scaling)
    shapes = cfg.weight_shapes()
    for name in sorted(shapes, key=lambda n: n.endswith(".bias")):  # a kernel's width says more than its bias's
        shape = shapes[name]
        proj, leaf = name.split(".")
        got = tuple(params[proj]["kernel" if leaf == "weight" else "bias"].shape)
        want = shape[::-1] if leaf == "weight" else shape  # kernels are (in, out)
        if got != want:
            raise ValueError(f"params[{proj!r}][{'kernel' if leaf == 'weight' else 'bias'!r}] has shape {got}, expected {want} "
                             f"(E={E}, N={cfg.num_heads}, K={cfg.kv_heads}, H={cfg.head_size})")
    return cfg


def _sharding_of(sharding, layout) -> str:
    if layout is not None:
        if sharding is not None:
            raise TypeError("give sharding= only (layout= is its old spelling)")
        warnings.warn("sharded_attention(layout=...) is spelled sharding=...", DeprecationWarning, stacklevel=3)
        return layout
    if sharding is None:
        raise TypeError(f"sharded_attention needs sharding=, one of {SHARDINGS}")
    return sharding


def sharded_attention(params, query, key, value, mask=None, *, mesh, sharding: str | None = None, num_heads: int,
                      num_kv_heads: int | None = None, rope: str | None = None, rope_theta: float = 10000.0,
                      positions=None, key_positions=None, masked_rows: str = "nan", axis: str = "x", precision=None,
                      layout: str | None = None, rope_dim: int | None = None, rope_scaling: RopeScaling | None = None):
    """The output (B, T, E) of multi-head attention run over `axis` of `mesh` in `sharding`.

    params as `params_of` returns (no "bias" entry: a projection without bias); query
    (B, T, E), key and value (B, S, E), mask a keep-mask, and num_kv_heads, rope,
    rope_theta, rope_dim, rope_scaling, positions (T,) | (B, T) and key_positions (S,) | (B, S) as for
    `mha_jax.MultiHeadAttention`, all of the whole problem. Call it under `jax.jit`;
    `jax.grad` through it gives every parameter's and input's gradient. `layout=` is the old
    spelling of `sharding=` (it warns).
    """
    sharding = _sharding_of(sharding, layout)
    cfg = _layer(params, num_heads, num_kv_heads, rope, rope_theta, masked_rows, rope_dim, rope_scaling)
    B, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, cfg.embed_dim)
    _check_dtypes(query, key, value)
    if rope is None and (positions is not None or key_positions is not None):
        raise ValueError("positions/key_positions are given but rope=None: they would be ignored")
    n = axis_size(mesh, axis)
    check_sharding(sharding, n, B=B, T=T, S=S, N=num_heads, K=cfg.kv_heads)
    keep = _keep4(mask, B, num_heads, T, S)
    pspec, qspec, kvspec, keepspec, outspec = sharding_specs(sharding, axis, None if keep is None else keep.shape,
                                                           qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias)
    kw = {"cfg": cfg, "precision": precision, "axis": axis}
    body = {"tp": _tp_body, "sp": partial(_sp_body, S_total=S), "dp": _dp_body}[sharding]
    args, specs = [params, query, key, value], [pspec, qspec, kvspec, kvspec]
    # keep, positions, key_positions: an argument each where present, None (a constant) where not.
    extra = {"keep": None, "positions": None, "key_positions": None, "long": None}
    if keep is not None:
        extra["keep"] = (keep, keepspec)
    if rope is not None:
        for name, pos, L in (("positions", positions, T), ("key_positions", key_positions, S)):
            whole = _whole_positions(pos, B, L, name)
            extra[name] = (whole, _positions_spec(sharding, axis, whole.shape))
        # LongRoPE: the whole call's largest position decides, before any shard sees only its block.
        long = rope_uses_long(cfg, (extra["positions"][0], T), (extra["key_positions"][0], S))
        if isinstance(long, bool):
            kw["long"] = long
        else:  # traced: every shard gets the one scalar, replicated
            extra["long"] = (long, P())
    present = [name for name, x in extra.items() if x is not None]
    args += [extra[name][0] for name in present]
    specs += [extra[name][1] for name in present]

    def body_of(*a):
        given = dict(zip(present, a[4:]))
        more = {"long": given["long"]} if "long" in given else {}
        return body(*a[:4], given.get("keep"), given.get("positions"), given.get("key_positions"), **kw, **more)

    if AxisType.Explicit in tuple(mesh.axis_types):
        # Explicit-sharding meshes (jax.make_mesh's default) want arguments already laid out.
        args = [_reshard(a, s, mesh) for a, s in zip(args, specs)]
    fn = jax.shard_map(body_of, mesh=mesh, in_specs=tuple(specs), out_specs=outspec)
    return fn(*args)


def _reshard(tree, spec, mesh):
    if isinstance(spec, dict):
        return {k: _reshard(tree[k], spec[k], mesh) for k in tree}
    return jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, spec)), tree)


def head_shardings(mesh, axis: str = "x", *, qkv_bias: bool = True, out_bias: bool = True) -> dict:
    """NamedShardings that split the heads: q/k/v kernels (E, N·H or K·H) by output columns (bias
    alike), the out kernel by input rows, the out bias replicated; no entry for an absent bias."""
    spec, _, _, _, _ = sharding_specs("tp", axis, qkv_bias=qkv_bias, out_bias=out_bias)
    return {p: {k: NamedSharding(mesh, s) for k, s in leaves.items()} for p, leaves in spec.items()}


def shard_heads(module, mesh, axis: str = "x"):
    """Place an `mha_jax.MultiHeadAttention`'s parameters head-sharded over `axis` (in place).

    Then the unchanged module, called under `jax.jit` (or `nnx.jit`), runs tensor-parallel:
    GSPMD propagates the shardings and inserts the collectives; per-head weights come back
    sharded by head. Returns the module. A head_dim of its own, scale, softcap and a "head" QK-norm
    need nothing more (the norm weights and the sinks are replicated); a "flat" QK-norm, over the
    whole projection, is a ValueError: its mean would cross the heads' split.
    """
    n = axis_size(mesh, axis)
    check_sharding("tp", n, B=n, T=n, S=n, N=module.num_heads, K=module.num_kv_heads)
    cfg = module.config
    _refuse_features(cfg, "shard_heads (tensor parallelism)", allowed=("head-dim", "qk-norm-head", "scale", "softcap",
                                                                       "sinks"))
    replicated = NamedSharding(mesh, P())
    for var in [getattr(module, name).weight for name in ("q_norm", "k_norm") if getattr(module, name) is not None] + (
            [] if module.sinks is None else [module.sinks]):
        var.set_value(jax.device_put(var.get_value(), replicated))
    for p, leaves in head_shardings(mesh, axis, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias).items():
        layer = getattr(module, p)
        for name, sharding in leaves.items():
            var = getattr(layer, name)
            var.set_value(jax.device_put(var.get_value(), sharding))
    return module
