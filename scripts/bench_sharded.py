"""Sharded attention: per-device peak memory and forward time for 1, 2, 4 devices (CPU, simulated).

    .venv/bin/python scripts/bench_sharded.py [--T 4096] [--E 256] [--N 4] [--out docs/results/sharded-bench-cpu]

Writes OUT.json (the rows of parity.sharded.bench.bench_sharded plus the environment) and
OUT.md (a table). Times on simulated CPU devices share the cores: overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from parity.sharded.bench import TIME_NOTE, bench_sharded


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--E", type=int, default=256)
    ap.add_argument("--N", type=int, default=4)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/sharded-bench-cpu")
    args = ap.parse_args()
    t0 = time.time()
    rows = bench_sharded(B=args.B, T=args.T, E=args.E, N=args.N, repeats=args.repeats)
    env = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "elapsed_s": round(time.time() - t0, 1)}
    with open(args.out + ".json", "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    lines = [f"# Sharded attention: per-device memory, B={args.B} T=S={args.T} E={args.E} N={args.N} float32 forward", "",
             f"{TIME_NOTE}.", "", "| framework | layout | devices | per-device peak | ratio to 1 device | median time | memory source |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {r['layout']} | {r['devices']} | {r['per_device_peak_bytes'] / 2**20:.1f} MiB | "
                     f"{r['ratio_to_1_device']:.3f} | {r['time_s'] * 1e3:.0f} ms | {r['mem_source']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
