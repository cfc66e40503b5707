"""Per-device peak memory and time of sharded attention for 1, 2, 4 devices at a long sequence.

    from parity.bench.sharded import bench_sharded
    rows = bench_sharded()          # list of plain dicts, one per (framework, layout, devices)

Memory is the headline. JAX: the compiled program's `memory_analysis()`, which is per
device (arguments + outputs + temporaries - aliased). torch: each rank is its own process;
the peak RSS growth of the rank during its first call (ru_maxrss after minus RSS before),
the largest over the ranks. Times are medians of a few calls; on simulated CPU devices
every device shares the same cores, so they measure overhead, not speed-up.

The 1-device row of a layout is the same program on one device (for sp: one ring block,
i.e. the whole score matrix), so the ratio shows what splitting buys; each layout's
block attention materialises its (B, N, T/n, S/n) scores (no flash kernel inside a block).
Forward pass only, float32, no mask.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

from parity.implementation import FRAMEWORKS
from parity.workers import Group, follow_parent, free_port, wait, worker_env

SHARDED_FRAMEWORKS = tuple(sorted(FRAMEWORKS))  # the order the sharded runs go in: jax, then torch

DEFAULTS = {"B": 1, "T": 4096, "E": 256, "N": 4, "repeats": 3}
TIMEOUT_S = 900.0
"""The longest one measurement's process group may run before it is killed."""
TIME_NOTE = "simulated CPU devices share this machine's cores: times are overhead measurements, not speed-ups"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shardings(spec, mesh):
    """A PartitionSpec tree (a dict for tp's parameters) as NamedShardings (a pytree prefix)."""
    from jax.sharding import NamedSharding

    if isinstance(spec, dict):
        return {k: _shardings(v, mesh) for k, v in spec.items()}
    return NamedSharding(mesh, spec)


def _jax_worker(cfg: dict) -> list[dict]:
    import jax
    import numpy as np

    from mha_jax.parallel import PROJECTIONS, make_mesh, sharded_attention, sharding_specs

    B, T, E, N, n = cfg["B"], cfg["T"], cfg["E"], cfg["N"], cfg["devices"]
    rng = np.random.default_rng(0)
    params = {p: {"kernel": rng.standard_normal((E, E), np.float32) / E**0.5, "bias": np.zeros(E, np.float32)} for p in PROJECTIONS}
    x = rng.standard_normal((B, T, E), np.float32)
    rows = []
    for layout in cfg["layouts"]:
        mesh = make_mesh(n)
        pspec, qspec, kvspec, _, outspec = sharding_specs(layout, "x")
        in_shardings = tuple(_shardings(spec, mesh) for spec in (pspec, qspec, kvspec, kvspec))

        def fwd(p, q, k, v, layout=layout, mesh=mesh):
            return sharded_attention(p, q, k, v, mesh=mesh, sharding=layout, num_heads=N)

        f = jax.jit(fwd, in_shardings=in_shardings, out_shardings=_shardings(outspec, mesh))
        args = jax.device_put((params, x, x, x), in_shardings)
        compiled = f.lower(*args).compile()
        m = compiled.memory_analysis()
        per_device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        compiled(*args).block_until_ready()
        t = _median_time(lambda: compiled(*args).block_until_ready(), cfg["repeats"])
        rows.append({"framework": "jax", "layout": layout, "devices": n, "per_device_peak_bytes": int(per_device),
                     "temp_bytes": int(m.temp_size_in_bytes), "mem_source": "jax compiled memory_analysis (per device)", "time_s": t})
    return rows


def _warm_up(layout: str, module, x, r: int, n: int) -> None:
    from mha_torch import parallel

    small = x[:, : 2 * n].contiguous()
    if layout == "sp":
        blk = small[:, 2 * r:2 * r + 2].contiguous()
        parallel.sequence_parallel_forward(module, blk, blk, blk)
    else:
        module(small, small, small, need_weights=False)


def _torch_worker(cfg: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    import mha_torch
    from mha_torch import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    B, T, E, N = cfg["B"], cfg["T"], cfg["E"], cfg["N"]
    torch.manual_seed(0)
    rows = []
    for layout in cfg["layouts"]:
        module = mha_torch.MultiHeadAttention(E, N)
        x = torch.randn(B, T, E)
        if layout == "sp":
            blk = x[:, r * (T // n):(r + 1) * (T // n)].contiguous()

            def call():
                return parallel.sequence_parallel_forward(module, blk, blk, blk)
        elif layout == "tp":
            from torch.distributed.device_mesh import init_device_mesh

            parallel.parallelize_heads(module, init_device_mesh("cpu", (n,)))

            def call():
                return module(x, x, x, need_weights=False)[0]
        else:
            raise ValueError(f"torch bench layouts are 'sp' and 'tp', got {layout!r}")
        with torch.no_grad():
            _warm_up(layout, module, x, r, n)  # one-time costs (lazy inits, first gloo buffers) out of the peak
            before = _rss_bytes()
            call()
            growth = _peak_rss_bytes() - before
            t = _median_time(call, cfg["repeats"])
        growths = [None] * n
        dist.all_gather_object(growths, growth)
        rows.append({"framework": "torch", "layout": layout, "devices": n, "per_device_peak_bytes": int(max(growths)),
                     "mem_source": "peak RSS growth of the rank during its first call (max over ranks)", "time_s": t})
    dist.destroy_process_group()
    return rows if r == 0 else []


def _run(framework: str, cfg: dict, timeout_s: float) -> list[dict]:
    n = cfg["devices"]

    def commands(spec_path, out_path):
        argv = [sys.executable, "-m", "parity.bench.sharded", framework, spec_path, out_path]
        if framework == "jax":
            return [(argv, worker_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu"))]
        port = free_port()
        return [(argv, worker_env(RANK=r, WORLD_SIZE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(n)]

    group = Group("sharded-bench-", cfg, commands, "rows.json")
    try:
        wait([group], timeout_s=timeout_s)
        problem = group.failure()
        if problem or not os.path.exists(group.out_path):
            raise RuntimeError(problem or "sharded bench worker wrote no rows")
        with open(group.out_path) as f:
            return json.load(f)["rows"]
    finally:
        group.close()


def check_sizes(*, devices, layouts, frameworks, B: int, T: int, E: int, N: int, repeats: int) -> None:
    """ValueError naming the first size that cannot be measured as asked (before anything starts).

    Every size is a positive integer; E splits into N heads; sp needs T divisible by each device
    count (each rank holds T/n rows: fewer rows would be measured than the label says) and tp
    needs N divisible by it (each rank holds N/n heads).
    """
    for name, v in (("B", B), ("T", T), ("E", E), ("N", N), ("repeats", repeats)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if E % N:
        raise ValueError(f"E={E} is not divisible by N={N} heads")
    unknown = [x for x in layouts if x not in ("sp", "tp")] + [x for x in frameworks if x not in FRAMEWORKS]
    if unknown:
        raise ValueError(f"unknown layouts/frameworks {unknown}; layouts: sp, tp; frameworks: jax, torch")
    for n in devices:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"device counts must be positive integers, got {n!r}")
        for layout, size, what in (("sp", T, "sequence length T"), ("tp", N, "head count N")):
            if layout in layouts and size % n:
                raise ValueError(f"layout {layout!r} over {n} devices: {what}={size} is not divisible by {n}")


def iter_bench_sharded(*, devices=(1, 2, 4), layouts=("sp", "tp"), frameworks=SHARDED_FRAMEWORKS, timeout_s: float = TIMEOUT_S,
                       **sizes):
    """Yield each (framework, layout, devices) row as it is measured (no `ratio_to_1_device`; see `with_ratios`).

    A repeated device count, layout or framework is measured once. timeout_s: the longest one
    measurement's process group may run before it is killed.
    """
    cfg0 = {**DEFAULTS, **sizes}
    devices, layouts, frameworks = (tuple(dict.fromkeys(x)) for x in (devices, layouts, frameworks))
    check_sizes(devices=devices, layouts=layouts, frameworks=frameworks, **cfg0)
    for fw in frameworks:
        for n, layout in ((n, layout) for n in devices for layout in layouts):
            # One process group per layout: a process's earlier peak (or the heap it kept) would blur the next.
            for row in _run(fw, {**cfg0, "devices": n, "layouts": [layout]}, timeout_s):
                yield {**row, **{k: cfg0[k] for k in ("B", "T", "E", "N")}, "S": cfg0["T"], "dtype": "float32",
                       "pass": "forward", "time_note": TIME_NOTE}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with `ratio_to_1_device`: its per-device memory over the same layout's 1-device row (None if not run)."""
    base = {(r["framework"], r["layout"]): r["per_device_peak_bytes"] for r in rows if r["devices"] == 1}
    out = []
    for r in rows:
        b = base.get((r["framework"], r["layout"]))
        out.append({**r, "ratio_to_1_device": round(r["per_device_peak_bytes"] / b, 4) if b else None})
    return out


def bench_sharded(*, devices=(1, 2, 4), layouts=("sp", "tp"), frameworks=SHARDED_FRAMEWORKS, timeout_s: float = TIMEOUT_S, **sizes) -> list[dict]:
    """Per-device peak memory (bytes) and median forward time for each (framework, layout, devices).

    sizes: B, T (= S), E, N, repeats (defaults in DEFAULTS; checked by `check_sizes` before
    anything starts). Each row also carries `ratio_to_1_device` (per-device memory over the
    same layout's 1-device row, when run), the sizes and `time_note`.
    """
    return with_ratios(list(iter_bench_sharded(devices=devices, layouts=layouts, frameworks=frameworks, timeout_s=timeout_s, **sizes)))


def main(argv=None) -> int:
    follow_parent()
    framework, spec, out = sys.argv[1:] if argv is None else argv
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_x64", False)
    with open(spec) as f:
        cfg = json.load(f)
    rows = _jax_worker(cfg) if framework == "jax" else _torch_worker(cfg)
    if framework == "jax" or os.environ.get("RANK") == "0":
        with open(out + ".tmp", "w") as f:
            json.dump({"rows": rows}, f)
        os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
