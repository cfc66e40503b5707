"""Sharded multi-head attention in PyTorch: tensor-, sequence- (ring) and data-parallel.

- Tensor parallel (heads): `tensor_parallel_plan()` is a DTensor plan for
  `parallelize_module` (ColwiseParallel for q/k/v, RowwiseParallel for out);
  `parallelize_heads(module, mesh)` applies it after checking that the query heads N and
  the key/value heads K both split over the mesh; the module then runs as it is (its head
  split infers the local head count from the projection's width). Rank r holds query
  heads r·N/n ... and key/value heads r·K/n ..., exactly the key/value heads its query
  heads read (query head h reads h // (N/K)). `tp_forward` is the same maths for a
  keep-mask with a head axis (N > 1), which it cuts to this rank's heads (the module's own
  mask check wants all N).
- Sequence parallel (ring attention): `sequence_parallel_forward` takes this rank's
  query block and key/value blocks; RoPE rotates each block with its global positions
  (rank r's query rows are r·T/n ..., its keys r·S/n ...) before the key blocks travel; the
  k/v blocks (K heads) travel around the ring with point-to-point send/recv (an autograd
  Function whose backward sends the gradients the other way round) and are merged with the
  online-softmax recurrence, each key/value head serving its group of query heads.
- Data parallel: `data_parallel_forward` runs this rank's batch rows; `all_reduce_grads`
  sums the parameters' gradients over the group (a sum, not DDP's mean, so that the
  gradients are those of the whole batch's loss).

Grouped key/value heads, RoPE and bias-free projections are the module's own
(`num_kv_heads`, `rope`, `qkv_bias`, `out_bias`); positions and masks are always given for
the whole problem, as to the one-device module. head_dim, scale and softcap run under every
sharding. qk_norm and sinks run under sequence and data parallelism (their parameters are
replicated there, like the projections'); tensor parallelism refuses them with a ValueError:
a "flat" norm needs the whole projection, and the replicated "head" norm weights and the sinks
would get only this rank's heads' share of their gradients. Partial and scaled RoPE (`rope_dim`,
`rope_scaling`) run under every sharding through the module's one `rotate`; LongRoPE's table follows
the whole problem's largest position (tp and sp see every position; dp refuses it with per-row (B, L)
positions, as a rank's call sees only its rows).

Gradients are torch autograd through these collectives. Sizes that do not split evenly
are a ValueError (nothing is padded); a process group that is not initialised is a
RuntimeError. Never imports jax.

Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mha_torch.attention import (
    LOW_PRECISION, apply_masked_row_policy, keep_mask_4d, positions_4d, attention_core, fused_attention_core, rotate,
    rope_max_position,
)
from mha_spec import check_qkv_shapes


def _require_group(group=None) -> tuple[int, int]:
    """(rank in group, group size); a RuntimeError if torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group('gloo' or 'nccl') "
            "first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_divisible(sharding: str, n: int, **sizes) -> None:
    for what, size in sizes.items():
        if size % n:
            raise ValueError(f"sharding {sharding!r}: {what}={size} is not divisible by the {n} ranks of the group")


# ---------------------------------------------------------------- tensor parallel


def tensor_parallel_plan() -> dict:
    """The DTensor plan: q/k/v split by output features (heads), out by input features."""
    return {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


def _refuse_under_tp(module) -> None:
    """ValueError for the layer features tensor parallelism does not shard (see the module docstring)."""
    c = module.config
    if c.qk_norm is not None or c.sinks:
        raise ValueError(f"tensor parallel (heads) does not run qk_norm={c.qk_norm!r}, sinks={c.sinks!r}: a 'flat' "
                         f"norm needs the whole projection, and replicated norm weights and sinks would get only "
                         f"this rank's share of their gradients; use sequence or data parallelism")


def parallelize_heads(module, mesh):
    """parallelize_module(module, mesh, tensor_parallel_plan()) after checking that N and K split over the mesh."""
    _refuse_under_tp(module)
    _require_group()
    if mesh.ndim != 1:
        raise ValueError(f"tensor parallel wants a 1-D device mesh, got mesh shape {tuple(mesh.shape)}")
    _check_divisible("tp", mesh.size(), **{"num_heads N": module.num_heads, "num_kv_heads K": module.num_kv_heads})
    return parallelize_module(module, mesh, tensor_parallel_plan())


def _check_positions_used(module, positions, key_positions) -> None:
    if module.config.rope is None and (positions is not None or key_positions is not None):
        raise ValueError("positions/key_positions are given but rope=None: they would be ignored")


def _rope_top(module, positions, key_positions, B: int, T: int, S: int, device):
    """LongRoPE's max over the WHOLE problem's positions and key_positions (every rank sees them all, so
    every block picks the table the one-device module picks); None without RoPE or when nothing switches."""
    if module.config.rope is None:
        return None
    return rope_max_position(module.config, positions_4d(positions, B, T, "positions", device),
                             positions_4d(key_positions, B, S, "key_positions", device))


def _rotated(module, x, pos, batch: int, length: int, start: int, name: str, top=None):
    """x (B, n, L_block, H) rotated with the positions of rows start ... of the whole problem's `length`
    (pos: (length,) | (B, length) | None = arange), top the call's `_rope_top`; x itself without RoPE."""
    if module.config.rope is None:
        return x
    block = positions_4d(pos, batch, length, name, x.device).narrow(2, start, x.shape[-2])  # (B|1, 1, L_block, 1)
    return rotate(x, block, module.config, top)


def tp_forward(module, query, key, value, mask=None, need_weights: bool = False, *, positions=None, key_positions=None):
    """The module's forward with the head count inferred from the local projection width.

    The same maths as `MultiHeadAttention.forward`, for a module run under
    `parallelize_heads` (its q/k/v projections return this rank's N/tp query heads and K/tp
    key/value heads). Returns (output [B, T, E], this rank's weights [B, N/tp, T, S] or None).
    """
    _refuse_under_tp(module)
    B, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, module.embed_dim)
    _check_positions_used(module, positions, key_positions)
    keep = None if mask is None else keep_mask_4d(mask, B, module.num_heads, T, S)
    options = module.core_options()  # scale and softcap; no sinks (refused above)
    top = _rope_top(module, positions, key_positions, B, T, S, query.device)
    q = _rotated(module, module._split_heads(module.q_proj(query)), positions, B, T, 0, "positions",
                 top)  # (B, N/tp, T, H)
    k = _rotated(module, module._split_heads(module.k_proj(key)), key_positions, B, S, 0, "key_positions",
                 top)  # (B, K/tp, S, H)
    v = module._split_heads(module.v_proj(value))  # (B, K/tp, S, H)
    if keep is not None and keep.shape[1] > 1:
        n_local = q.shape[1]  # a per-head mask: this rank's heads
        keep = keep.narrow(1, _tp_rank(module) * n_local, n_local)
    if need_weights:
        group = q.shape[1] // k.shape[1]  # query head h reads key/value head h // group: repeat, never tile
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        context, weights = attention_core(q, k, v, keep, masked_rows=module.masked_rows, **options)
    else:
        context, weights = fused_attention_core(q, k, v, keep, masked_rows=module.masked_rows, **options), None
    context = context.transpose(1, 2).reshape(B, T, -1)  # (B, T, N·H/tp)
    return module.out_proj(context), weights


def _tp_rank(module) -> int:
    weight = module.q_proj.weight
    return weight.device_mesh.get_local_rank() if isinstance(weight, DTensor) else 0


def full_grads(module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a plain tensor (DTensor shards gathered)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


# ---------------------------------------------------------------- sequence parallel (ring)


class _RingShift(torch.autograd.Function):
    """Send x to the next rank of the ring, receive the previous rank's; backward the other way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), ctx.group, -1), None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of every rank's input is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _shift(x, group, direction: int):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    to = dist.get_global_rank(group, (me + direction) % n) if group is not None else (me + direction) % n
    frm = dist.get_global_rank(group, (me - direction) % n) if group is not None else (me - direction) % n
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group), dist.P2POp(dist.irecv, received, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def key_block_start(src: int, n: int, block: int) -> int:
    """First key column of ring block `src` (of n blocks of `block` keys)."""
    return src * block


def _online_step(carry, s, vj, dtype):
    """One key block of flash attention's recurrence; scores s (B, N, T, S) in the accumulation dtype,
    vj (B, K, S, H) with K dividing N (query head h reads key/value head h // (N/K))."""
    ctx, run_max, run_sum = carry  # (B, N, T, H), (B, N, T, 1), (B, N, T, 1)
    B, N, T, S = s.shape
    K, H = vj.shape[1], vj.shape[-1]
    # The max only stabilises exp(); the result does not depend on it.
    new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True)).detach()
    # A row that has seen only masked keys keeps max -inf; use 0 so exp() gives 0, not NaN.
    safe_max = torch.where(torch.isfinite(new_max), new_max, 0.0)
    p = torch.exp(s - safe_max)
    rescale = torch.exp(run_max - safe_max)
    # A group's query heads stacked along the rows: (B, K, G·T, S) @ (B, K, S, H), K and V never repeated.
    # p rounded to the dtype (the weights path's dtype), the product summed in the accumulation
    # dtype: the running sum is not yet normalised, so a 16-bit one overflows once the kept
    # values add up past the dtype's largest (float16 V near 60000 over two keys).
    acc = ctx.dtype
    pv = torch.matmul(p.to(dtype).to(acc).reshape(B, K, -1, S), vj.to(acc)).reshape(B, N, T, H)
    return rescale * ctx + pv, new_max, rescale * run_sum + p.sum(dim=-1, keepdim=True)


def ring_attention(q, k, v, keep=None, *, group=None, masked_rows: str = "nan", S_total: int, scale=None,
                   softcap=None, sinks=None):
    """This rank's query block against every key block of the ring.

    q (B, N, T/n, H), k and v (B, K, S/n, H) with K dividing N: this rank's blocks (already
    rotated, for RoPE); keep bool (B|1, N|1, T/n, S): this rank's query rows, every key
    column. Returns the context (B, N, T/n, H). Whether a row is empty comes from its whole
    keep-mask row, never from one block (a row may be empty within a block and not overall).
    scale (None: 1/√H), softcap and sinks (N,) as `attention_core`'s: the sink starts the running max
    and sum (its column is in every row's denominator), and a row that keeps no key is then zeros.
    """
    me, n = _require_group(group)
    dtype = q.dtype
    acc = torch.float32 if dtype in LOW_PRECISION else dtype
    B, N, Tb, H = q.shape
    K, Sb = k.shape[1], k.shape[-2]
    if N % K or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"key/value heads must divide the query heads and key and value must have one shape: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (B, heads, L, H)")
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    q_grouped = q.to(acc).reshape(B, K, G * Tb, H)  # query head j·G + g reads key/value head j
    carry = _ring_start(q, sinks, acc)
    kv = torch.stack((k, v))  # (2, B, K, S/n, H): one message per step
    for i in range(n):
        src = (me - i) % n  # the block this rank holds at step i
        s = (torch.matmul(q_grouped, kv[0].to(acc).transpose(-1, -2)) * scale).reshape(B, N, Tb, Sb)  # (B, N, T/n, S/n)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if keep is not None:
            s = s.masked_fill(~keep.narrow(-1, key_block_start(src, n, Sb), Sb), -math.inf)
        carry = _online_step(carry, s, kv[1], dtype)
        if i < n - 1:
            kv = _RingShift.apply(kv, group)
    ctx, _, run_sum = carry
    ctx = ctx / torch.where(run_sum > 0, run_sum, 1.0)
    if keep is not None and sinks is None:  # with sinks an empty row is zeros: the sink took its weight
        row_any = keep.any(dim=-1, keepdim=True)  # (B|1, N|1, T/n, 1): the whole row
        mean_v = None
        if masked_rows != "zero":
            # mean(V) over the whole sequence as the sum of V·(1/S): a plain sum of finite values
            # near the dtype's largest could overflow before the division.
            total = _AllReduceSum.apply((v.to(acc) * (1.0 / S_total)).sum(dim=-2, keepdim=True), group)  # (B, K, 1, H)
            mean_v = total.repeat_interleave(G, dim=1) if G > 1 else total  # (B, N, 1, H)
        ctx = apply_masked_row_policy(ctx, row_any, masked_rows, mean_v)
    return ctx.to(dtype)


def _ring_start(q, sinks, acc):
    """The online softmax's carry before any key block: (context, running max, running sum), (B, N, T/n, H),
    (B, N, T/n, 1) x2; with sinks (N,) the sink's own column, exp(sink - sink) = 1 at max = sink."""
    B, N, Tb, H = q.shape
    ctx = q.new_zeros((B, N, Tb, H), dtype=acc)
    if sinks is None:
        return ctx, q.new_full((B, N, Tb, 1), -math.inf, dtype=acc), q.new_zeros((B, N, Tb, 1), dtype=acc)
    if sinks.ndim != 1 or sinks.shape[0] != N:
        raise ValueError(f"sinks must have shape (N,) = ({N},) (one logit per query head), got {tuple(sinks.shape)}")
    sink = sinks.to(acc).reshape(1, N, 1, 1).expand(B, N, Tb, 1)  # (B, N, T/n, 1)
    return ctx, sink, torch.ones_like(sink)


def _local_rows(mask, B: int, N: int, T: int, S: int, start: int, length: int, batch: bool):
    """The keep-mask (given for the whole problem) cut to this rank's query rows or batch rows."""
    if mask is None:
        return None
    keep = keep_mask_4d(mask, B, N, T, S)
    if batch:
        return keep if keep.shape[0] == 1 else keep.narrow(0, start, length)
    keep = keep.expand(keep.shape[0], keep.shape[1], T, S)
    return keep.narrow(2, start, length)


def sequence_parallel_forward(module, query, key, value, mask=None, *, positions=None, key_positions=None, group=None):
    """Ring attention: this rank's output block (B, T/n, E).

    query (B, T/n, E), key and value (B, S/n, E): this rank's blocks (rank r holds
    rows r·T/n ... (r+1)·T/n - 1). mask, positions ((T,) | (B, T)) and key_positions
    ((S,) | (B, S)): those of the whole problem, as for `MultiHeadAttention` (positions
    default to arange); each rank uses its rows, so every block rotates with its global
    positions. The module's parameters are replicated; call `all_reduce_grads` after backward.
    """
    me, n = _require_group(group)
    B, Tb, Sb = check_qkv_shapes(query.shape, key.shape, value.shape, module.embed_dim)
    _check_positions_used(module, positions, key_positions)
    T, S = Tb * n, Sb * n
    keep = _local_rows(mask, B, module.num_heads, T, S, me * Tb, Tb, batch=False)
    q, k, v, q_norm, k_norm = module.project(query, key, value)  # (B, N, T/n, H), (B, K, S/n, H) x2, ...
    top = _rope_top(module, positions, key_positions, B, T, S, query.device)  # the whole problem's, not the block's
    q = _rotated(module, q if q_norm is None else q_norm, positions, B, T, me * Tb, "positions", top)  # (B, N, T/n, H)
    k = _rotated(module, k if k_norm is None else k_norm, key_positions, B, S, me * Sb, "key_positions",
                 top)  # (B, K, S/n, H)
    context = ring_attention(q, k, v, keep, group=group, masked_rows=module.masked_rows, S_total=S,
                             **module.core_options())
    return module.out_proj(context.transpose(1, 2).reshape(B, Tb, -1))  # (B, T/n, E)


# ---------------------------------------------------------------- data parallel


def _batch_rows(pos, B: int, length: int, start: int, rows: int, name: str):
    """Positions given for the whole batch ((L,) | (B, L) | None) cut to this rank's batch rows."""
    if pos is None or not isinstance(pos, torch.Tensor) or pos.ndim != 2:
        return pos  # shared by the batch (the module checks the rest)
    positions_4d(pos, B, length, name, pos.device)  # the whole batch's shape, checked
    return pos.narrow(0, start, rows)


def _refuse_per_row_longrope(module, positions, key_positions) -> None:
    """ValueError for LongRoPE with per-row (B, L) positions under data parallelism: its table follows the
    largest position of the WHOLE batch, and a rank's module call sees only its rows (shared (L,) positions
    or the default arange are the same on every rank, so those run)."""
    scaling = module.config.rope_scaling
    per_row = [name for name, p in (("positions", positions), ("key_positions", key_positions))
               if isinstance(p, torch.Tensor) and p.ndim == 2]
    if scaling is not None and scaling.switches and per_row:
        raise ValueError(f"data parallel does not run rope_scaling kind {scaling.kind!r} with per-row "
                         f"{' and '.join(per_row)} (B, L): its long/short table follows the whole batch's largest "
                         f"position, which a rank holding only its rows cannot see; pass positions shared by the "
                         f"batch (L,) or use sequence or tensor parallelism")


def data_parallel_forward(module, query, key, value, mask=None, *, positions=None, key_positions=None, group=None):
    """This rank's batch rows (B/n, T, E) through the module; mask and positions given for the whole batch."""
    me, n = _require_group(group)
    Bb, T, S = check_qkv_shapes(query.shape, key.shape, value.shape, module.embed_dim)
    _refuse_per_row_longrope(module, positions, key_positions)
    keep = _local_rows(mask, Bb * n, module.num_heads, T, S, me * Bb, Bb, batch=True)
    pos = {"positions": _batch_rows(positions, Bb * n, T, me * Bb, Bb, "positions"),
           "key_positions": _batch_rows(key_positions, Bb * n, S, me * Bb, Bb, "key_positions")}
    output, _ = module(query, key, value, keep, need_weights=False, **pos)
    return output


def all_reduce_grads(module, group=None) -> None:
    """Sum every parameter's gradient over the group (each rank's loss is its share of the whole)."""
    _require_group(group)
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
