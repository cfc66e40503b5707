"""Sharded attention: per-device peak memory and forward time for 1, 2, 4 devices (CPU, simulated).

    .venv/bin/python scripts/bench_sharded.py   # = mha-bench sharded, writing docs/results/sharded-bench-cpu.{json,md}
"""

from parity.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["sharded", "--json", "docs/results/sharded-bench-cpu.json",
                           "--markdown", "docs/results/sharded-bench-cpu.md"]))
