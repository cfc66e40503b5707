"""The JAX side of the sharded checks, run in its own process (devices are fixed when JAX starts).

    python -m parity.harness.sharded.jax_worker SPEC.json OUT.jsonl [--coordinator HOST:PORT --num-processes P --process-id I]

Simulated devices: the launcher sets XLA_FLAGS=--xla_force_host_platform_device_count=N.
Several processes: each calls jax.distributed.initialize (gloo collectives on CPU) and the
mesh spans every process's devices. Process 0 computes the one-device run, judges and
appends each job's rows to OUT (one JSON line per job, `parity.workers`). Started
by the launcher, the processes agree between jobs whether it asked them to stop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from dataclasses import asdict
from functools import partial

import jax

from parity import workers

def _start(args) -> None:
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    jax.config.update("jax_enable_x64", True)


def _global(x, sharding):
    """A host array (the same on every process) as a global array with `sharding`."""
    x = jax.numpy.asarray(x) if not hasattr(x, "shape") else x
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _torch_layout(grads_params, d_query, d_key, d_value, output) -> dict:
    """{"output", "query", ..., "q_proj.weight" (out, in), ...} as NumPy from JAX's (in, out) kernels."""
    import numpy as np

    out = {"output": np.asarray(output), "query": np.asarray(d_query), "key": np.asarray(d_key), "value": np.asarray(d_value)}
    for p, leaves in grads_params.items():
        out[f"{p}.weight"] = np.asarray(leaves["kernel"]).T
        if leaves.get("bias") is not None:
            out[f"{p}.bias"] = np.asarray(leaves["bias"])
    return out


def _params(sd) -> dict:
    from mha_jax.parallel import PROJECTIONS

    return {p: {"kernel": sd[f"{p}.weight"].T.copy()} | ({"bias": sd[f"{p}.bias"]} if f"{p}.bias" in sd else {})
            for p in PROJECTIONS}


def _layer_kwargs(job) -> dict:
    """The layer beyond num_heads, as the module and sharded_attention take it."""
    cfg = job.problem.config
    rope = {k: getattr(cfg, k) for k in ("rope_dim", "rope_scaling") if getattr(cfg, k) is not None}  # partial, scaled
    return {"num_kv_heads": cfg.num_kv_heads, "rope": cfg.rope, "rope_theta": cfg.rope_theta, "masked_rows": cfg.masked_rows,
            **rope}


def _module(job, inp):
    from parity import convert

    return convert.to_jax(inp.state_dict, job.problem.config.num_heads, **_layer_kwargs(job))


_COMPILED: dict = {}
"""Jitted programs by (kind, layer, sharding, devices, policy, dtype, mask?, plant): jobs that differ
only in their numbers (mask kinds, seeds) reuse one compilation."""


def _compiled(key, make):
    if key not in _COMPILED:
        _COMPILED[key] = make()
    return _COMPILED[key]


def _sharded_program(job, mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_jax.parallel import sharded_attention

    def fwd_bwd(params, q, k, v, keep, pos, cot):
        def fwd(p, q, k, v):
            return sharded_attention(p, q, k, v, keep, mesh=mesh, sharding=job.sharding, num_heads=job.problem.config.num_heads,
                                     **pos, **_layer_kwargs(job))

        out, vjp = jax.vjp(fwd, params, q, k, v)
        return out, vjp(cot)

    return jax.jit(fwd_bwd, out_shardings=NamedSharding(mesh, P()))


def _positions(inp) -> dict:
    """The whole problem's positions (nothing without RoPE)."""
    pos = {"positions": inp.positions, "key_positions": inp.key_positions}
    return {k: v for k, v in pos.items() if v is not None}


def _run_sharded(job, inp, mesh, plant) -> dict:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(mesh, P())
    from parity.harness.sharded.cases import PLANTS

    # A plant patches a function only its own sharding traces; the others reuse their programs.
    key = ("sharded", job.layer, job.sharding, job.devices, job.masked_rows, job.dtype, inp.keep is None,
           plant if PLANTS.get(plant) == job.sharding else None)
    program = _compiled(key, lambda: _sharded_program(job, mesh))
    args = (_params(inp.state_dict), inp.query, inp.key, inp.value, inp.keep, _positions(inp), inp.cotangent)
    out, (gp, gq, gk, gv) = program(*jax.tree.map(lambda x: _global(x, rep), args))
    return _torch_layout(gp, gq, gk, gv, out)


def _one_device_program(graphdef, out_shardings=None):
    from flax import nnx

    def fwd_bwd(state, q, k, v, keep, pos, cot):
        def fwd(state, q, k, v):
            return nnx.merge(graphdef, state)(q, k, v, keep, need_weights=False, **pos)[0]

        out, vjp = jax.vjp(fwd, state, q, k, v)
        return out, vjp(cot)

    return jax.jit(fwd_bwd, out_shardings=out_shardings)


def _run_gspmd(job, inp, mesh) -> dict:
    """The unchanged module with head-sharded parameters (mha_jax.parallel.shard_heads) under jit."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_jax.parallel import shard_heads

    rep = NamedSharding(mesh, P())
    module = shard_heads(_module(job, inp), mesh)
    graphdef, state = nnx.split(module)
    key = ("gspmd", job.layer, job.devices, job.masked_rows, job.dtype, inp.keep is None)
    program = _compiled(key, lambda: _one_device_program(graphdef, out_shardings=rep))
    args = jax.tree.map(lambda x: _global(x, rep), (inp.query, inp.key, inp.value, inp.keep, _positions(inp), inp.cotangent))
    out, (gs, gq, gk, gv) = program(state, *args)
    return _torch_layout(nnx.to_pure_dict(gs), gq, gk, gv, out)


def _run_one_device(job, inp) -> dict:
    from flax import nnx

    graphdef, state = nnx.split(_module(job, inp))
    program = _compiled(("one-device", job.layer, job.masked_rows, job.dtype, inp.keep is None), lambda: _one_device_program(graphdef))
    with jax.default_device(jax.local_devices()[0]):
        out, (gs, gq, gk, gv) = program(state, inp.query, inp.key, inp.value, inp.keep, _positions(inp), inp.cotangent)
    return _torch_layout(nnx.to_pure_dict(gs), gq, gk, gv, out)


@contextlib.contextmanager
def planted(plant: str | None):
    """Patch mha_jax.parallel with one of parity.harness.sharded.cases.PLANTS for the duration."""
    import mha_jax.parallel as par
    from jax import lax

    if plant is None:
        yield
        return
    name, original = {
        "bias_per_shard": ("reduce_then_add_bias", par.reduce_then_add_bias),
        "bias_grad_div": ("reduce_then_add_bias", par.reduce_then_add_bias),
        "ring_mask_offset": ("key_block_start", par.key_block_start),
        "ring_local_positions": ("_sp_body", par._sp_body),
    }[plant]

    def bias_per_shard(partial_out, bias, axis):
        return lax.psum(partial_out + bias, axis)

    def bias_grad_div(partial_out, bias, axis):
        n = lax.axis_size(axis)
        return lax.psum(partial_out, axis) + (bias / n + lax.stop_gradient(bias - bias / n))

    def ring_mask_offset(src, n, block):
        return ((src + 1) % n) * block

    def ring_local_positions(params, query, key, value, keep, positions, key_positions, **kw):
        # Each block rotated with positions counted from its own start (arange of the block).
        return original(params, query, key, value, keep, None, None, **kw)

    plants = {"bias_per_shard": bias_per_shard, "bias_grad_div": bias_grad_div, "ring_mask_offset": ring_mask_offset,
              "ring_local_positions": ring_local_positions}
    setattr(par, name, plants[plant])
    try:
        yield
    finally:
        setattr(par, name, original)


def run_jobs(jobs, plant=None):
    """Yield each job's rows in order (process 0 judges; the others yield [])."""
    from mha_jax.parallel import make_mesh
    from parity.harness.sharded.cases import error_rows, inputs, judge_job

    platform = jax.devices()[0].platform
    with planted(plant):
        for job in jobs:
            device = f"{job.devices}x{platform}" + (f" ({jax.process_count()} processes)" if jax.process_count() > 1 else "")
            try:
                inp = inputs(job)
                run = _run_gspmd if job.sharding == "tp-gspmd" else partial(_run_sharded, plant=plant)
                sharded = run(job, inp, make_mesh(job.devices))
                rows = judge_job(job, inp, sharded, _run_one_device(job, inp), device) if jax.process_index() == 0 else []
            except Exception as exc:  # one job's failure is an error row; the rest still runs
                rows = error_rows(job, device, f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=-2)!r}")
            yield rows


def _stop_agreed() -> bool:
    """Whether the launcher asked the group to stop, as every process agrees (a collective: all call it)."""
    if not workers.stoppable():
        return False
    flag = workers.stop_requested()
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
    return flag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--coordinator")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    args = ap.parse_args(argv)
    workers.follow_parent()
    _start(args)
    from parity.harness.sharded.cases import Job

    with open(args.spec) as f:
        spec = json.load(f)
    stopped = False
    for i, run in enumerate(spec["runs"]):
        with contextlib.closing(run_jobs([Job(**j) for j in run["jobs"]], run.get("plant"))) as results:
            for j, rows in enumerate(results):
                if jax.process_index() == 0:
                    workers.append_rows(args.out, i, j, [asdict(r) for r in rows])
                stopped = _stop_agreed()
                if stopped:
                    break
        if stopped:
            break
    if args.coordinator:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
