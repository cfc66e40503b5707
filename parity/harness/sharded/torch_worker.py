"""The torch side of the sharded checks: one process per rank (gloo on CPU).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m parity.harness.sharded.torch_worker SPEC.json OUT.jsonl

(torchrun sets those variables too.) Every job runs over the whole group; rank 0
computes the one-device module's answers, judges and appends each job's rows to OUT
(one JSON line per job, `parity.workers`). Started by the launcher, the ranks
agree between jobs whether it asked them to stop.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from parity import workers


def _tensors(inp):
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in (inp.query, inp.key, inp.value, inp.cotangent)]


def _positions(inp) -> dict:
    """The whole problem's positions as the module takes them (nothing without RoPE)."""
    pos = {"positions": inp.positions, "key_positions": inp.key_positions}
    return {k: torch.from_numpy(v) for k, v in pos.items() if v is not None}


def _module(job, inp):
    from parity import convert

    cfg = job.problem.config
    rope = {k: getattr(cfg, k) for k in ("rope_dim", "rope_scaling") if getattr(cfg, k) is not None}  # partial, scaled
    return convert.to_torch(inp.state_dict, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, rope=cfg.rope,
                            rope_theta=cfg.rope_theta, masked_rows=cfg.masked_rows, **rope)


def _gather(x, dim: int):
    """Concatenate every rank's block of x along dim (rank order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def _summed(x):
    """Sum over ranks (each rank holds its share of an input's gradient, zeros elsewhere)."""
    x = x.clone()
    dist.all_reduce(x)
    return x


def _run_sharded(job, inp, mesh) -> dict:
    from mha_torch import parallel

    r, n = dist.get_rank(), dist.get_world_size()
    module = _module(job, inp)
    q, k, v, cot = (x.clone().requires_grad_(i < 3) for i, x in enumerate(_tensors(inp)))
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    keep = None if inp.keep is None else torch.from_numpy(inp.keep)
    pos = _positions(inp)  # the whole problem's: each sharding cuts what it splits
    if job.sharding == "tp":
        parallel.parallelize_heads(module, mesh)
        if keep is not None and keep.shape[1] > 1:  # a per-head mask: tp_forward cuts it to this rank's heads
            output, _ = parallel.tp_forward(module, q, k, v, keep, **pos)
        else:
            output, _ = module(q, k, v, keep, need_weights=False, **pos)  # the module itself, under the DTensor plan
        (output * cot).sum().backward()
    else:
        cut = {"sp": lambda x, L: x[:, r * (L // n):(r + 1) * (L // n)], "dp": lambda x, L: x[r * (B // n):(r + 1) * (B // n)]}[job.sharding]
        forward = parallel.sequence_parallel_forward if job.sharding == "sp" else parallel.data_parallel_forward
        block = forward(module, cut(q, T), cut(k, S), cut(v, S), keep, **pos)
        (block * cut(cot, T)).sum().backward()
        parallel.all_reduce_grads(module)
        output = _gather(block.detach(), 1 if job.sharding == "sp" else 0)
    out = {"output": output, "query": q.grad, "key": k.grad, "value": v.grad}
    if job.sharding != "tp":
        out.update({name: _summed(out[name]) for name in ("query", "key", "value")})
    out.update(parallel.full_grads(module))
    return {name: x.detach().numpy() for name, x in out.items()}


def _run_one_device(job, inp) -> dict:
    module = _module(job, inp)
    q, k, v, cot = (x.clone().requires_grad_(i < 3) for i, x in enumerate(_tensors(inp)))
    keep = None if inp.keep is None else torch.from_numpy(inp.keep)
    output, _ = module(q, k, v, keep, need_weights=False, **_positions(inp))
    (output * cot).sum().backward()
    out = {"output": output, "query": q.grad, "key": k.grad, "value": v.grad}
    out.update({name: p.grad for name, p in module.named_parameters()})
    return {name: x.detach().numpy() for name, x in out.items()}


@contextlib.contextmanager
def planted(plant: str | None, n: int):
    """Patch mha_torch.parallel with one of parity.harness.sharded.cases.PLANTS for the duration."""
    from mha_torch import parallel

    if plant is None:
        yield
        return
    if plant in ("ring_mask_offset", "ring_local_positions"):
        name = {"ring_mask_offset": "key_block_start", "ring_local_positions": "_rotated"}[plant]
        original = getattr(parallel, name)

        def rotated_from_block_start(module, x, pos, batch, length, start, what, top=None):
            if x.shape[-2] == length:  # the whole sequence (tp): not a ring block
                return original(module, x, pos, batch, length, start, what, top)
            # A ring block rotated with positions counted from its own start (arange of the block).
            return original(module, x, None, batch, x.shape[-2], 0, what, top)

        setattr(parallel, name, {"ring_mask_offset": lambda src, n, block: ((src + 1) % n) * block,
                                 "ring_local_positions": rotated_from_block_start}[plant])
        try:
            yield
        finally:
            setattr(parallel, name, original)
        return
    original = parallel.parallelize_heads

    def parallelize_heads(module, mesh):
        module = original(module, mesh)
        bias = module.out_proj.bias
        if plant == "bias_per_shard":  # every shard adds the bias before the all-reduce
            module.out_proj.register_forward_hook(lambda m, args, out: out + (n - 1) * bias.to_local())
        else:  # "bias_grad_div": the bias gradient divided by the shard count
            bias.register_hook(lambda g: g / n)
        return module

    parallel.parallelize_heads = parallelize_heads
    try:
        yield
    finally:
        parallel.parallelize_heads = original


def run_jobs(jobs, plant=None):
    """Yield each job's rows in order (rank 0 judges; the other ranks yield [])."""
    from torch.distributed.device_mesh import init_device_mesh

    from parity.harness.sharded.cases import error_rows, inputs, judge_job

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    with planted(plant, n):
        for job in jobs:
            device = f"{n}xcpu ({n} processes, gloo)"
            try:
                if job.devices != n:
                    raise ValueError(f"job wants {job.devices} devices, the group has {n} ranks")
                inp = inputs(job)
                sharded = _run_sharded(job, inp, mesh)
                rows = judge_job(job, inp, sharded, _run_one_device(job, inp), device) if dist.get_rank() == 0 else []
            except Exception as exc:  # one job's failure is an error row; the rest still runs
                rows = error_rows(job, device, f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=-2)!r}")
            yield rows


def _stop_agreed() -> bool:
    """Whether the launcher asked the group to stop, as every rank agrees (a collective: all call it)."""
    if not workers.stoppable():
        return False
    flag = torch.tensor([int(workers.stop_requested())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(argv=None) -> int:
    workers.follow_parent()
    argv = sys.argv[1:] if argv is None else argv
    spec_path, out_path = argv
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from parity.harness.sharded.cases import Job

    with open(spec_path) as f:
        spec = json.load(f)
    stopped = False
    for i, run in enumerate(spec["runs"]):
        with contextlib.closing(run_jobs([Job(**j) for j in run["jobs"]], run.get("plant"))) as results:
            for j, rows in enumerate(results):
                if dist.get_rank() == 0:
                    workers.append_rows(out_path, i, j, [asdict(r) for r in rows])
                stopped = _stop_agreed()
                if stopped:
                    break
        if stopped:
            break
    # Every rank leaves together: tearing gloo down while a peer still talks to it can abort.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
