"""Five mha-parity reports taken before and after a refactor, compared row for row.

Beyond mha-bench and the tests: a change to how the harness is put together (checks as plug-ins,
one mask structure, ...) must not change a single row. This runs the default matrix,
`--cases modern`, `--cases masks`, `--checks decode` and `--checkpoint` (a tiny Mistral layer with
a sliding window, written by transformers' save_pretrained), writes each report's JSON, and with
`--compare` says which rows differ, appeared or went away. Rows are matched by what they judge
(case, check, implementation, reference, dtype, quantity, stage, device); their order may change.
Every other field must be equal; errors and margins may differ by a relative `--rtol` only
(default 0: the same machine, the same programs, the same bits).

    .venv/bin/python scripts/house_reports.py --out /tmp/before
    ... change the code ...
    .venv/bin/python scripts/house_reports.py --out /tmp/after --compare /tmp/before
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

RUNS = {
    "default": [],
    "modern": ["--cases", "modern"],
    "masks": ["--cases", "masks"],
    "decode": ["--checks", "decode"],
    "checkpoint": ["--checkpoint", "{checkpoint}", "--prefix", "model.layers.0.self_attn."],
}
KEY = ("case", "check", "impl", "reference", "dtype", "quantity", "stage", "device")
NUMBERS = ("max_abs_err", "max_rel_err", "atol", "rtol", "margin")


def write_checkpoint(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
                                        num_hidden_layers=1, intermediate_size=16, vocab_size=11,
                                        rope_theta=500.0, max_position_embeddings=64, sliding_window=3)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    return path


def take(out: Path, names) -> None:
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint(out / "mistral") if "checkpoint" in names else None
    for name in names:
        args = [a.replace("{checkpoint}", str(checkpoint)) for a in RUNS[name]]
        command = [sys.executable, "-m", "parity", "--no-progress", "--json", str(out / f"{name}.json"), *args]
        done = subprocess.run(command, capture_output=True, text=True)
        print(f"{name}: exit {done.returncode}", flush=True)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")


def _rows(path: Path) -> dict:
    rows = {}
    for row in json.loads(path.read_text())["rows"]:
        key = tuple(row.get(k) for k in KEY)
        if key in rows:
            raise SystemExit(f"{path}: two rows judge {key}")
        rows[key] = row
    return rows


def _same(a, b, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= rtol * max(abs(a), abs(b))
    return a == b


def compare(before: Path, after: Path, names, rtol: float) -> int:
    problems = 0
    for name in names:
        old, new = _rows(before / f"{name}.json"), _rows(after / f"{name}.json")
        gone, came = old.keys() - new.keys(), new.keys() - old.keys()
        changed = []
        for key in old.keys() & new.keys():
            fields = sorted(set(old[key]) | set(new[key]))
            diff = [f for f in fields
                    if not _same(old[key].get(f), new[key].get(f), rtol if f in NUMBERS else 0.0)]
            if diff:
                changed.append((key, {f: (old[key].get(f), new[key].get(f)) for f in diff}))
        print(f"{name}: {len(old)} rows before, {len(new)} after; {len(gone)} gone, {len(came)} new, "
              f"{len(changed)} changed")
        for key in sorted(gone, key=str)[:10]:
            print("  gone:", key)
        for key in sorted(came, key=str)[:10]:
            print("  new: ", key)
        for key, diff in changed[:10]:
            print("  changed:", key, diff)
        problems += len(gone) + len(came) + len(changed)
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the reports' JSON")
    parser.add_argument("--compare", type=Path, help="a folder of reports taken before: compare with it")
    parser.add_argument("--only", default=",".join(RUNS), help=f"which reports (default {','.join(RUNS)})")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative difference allowed in errors")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown reports {unknown}; choose from {sorted(RUNS)}")
    take(args.out, names)
    if args.compare is None:
        return 0
    problems = compare(args.compare, args.out, names, args.rtol)
    print("the same rows" if not problems else f"{problems} rows differ")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
