"""Sharded parity report: every layout, mask kind, policy and dtype on 2 and 4 devices, both frameworks.

    .venv/bin/python scripts/parity_sharded.py [--devices 2,4] [--out docs/results/sharded-parity-cpu]

Writes OUT.json and OUT.md (parity.harness.report format; check = "sharded"). Until the lead
wires `mha-parity --devices N --layouts ...`, this is the command line for parity.sharded.run_sharded.
"""

from __future__ import annotations

import argparse
import time

from parity.harness.report import Report, to_json, to_markdown
from parity.sharded import LAYOUTS, run_sharded
from parity.sharded.cases import JAX_ONLY_LAYOUTS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="2,4")
    ap.add_argument("--layouts", default=",".join(LAYOUTS + JAX_ONLY_LAYOUTS))
    ap.add_argument("--out", default="docs/results/sharded-parity-cpu")
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for n in (int(d) for d in args.devices.split(",")):
        rows += run_sharded(devices=n, layouts=tuple(args.layouts.split(",")))
    report = Report(environment={"devices": args.devices, "layouts": args.layouts, "platform": "cpu (simulated JAX devices; torch gloo processes)"},
                    rows=rows, elapsed_s=time.time() - t0)
    with open(args.out + ".json", "w") as f:
        f.write(to_json(report))
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(report))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
