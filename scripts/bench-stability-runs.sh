#!/usr/bin/env bash
# The benchmark's run-to-run check: the grouped RoPE bias-free layer at B=1 T=1024 three times on a
# quiet machine and once beside a process that keeps one core busy, then the classic layer with a
# causal mask at B=4 T=2048. Writes docs/results/bench-stability-*.{json,md,png,log}; prints the
# verdicts of every run side by side. Run it with nothing else on the machine (about 15 minutes on
# 2 cores).
#
# Beyond one mha-bench run: it repeats one mha-bench command on a quiet machine and beside a busy
# core and prints the runs' verdicts side by side; `mha-bench compare` flags median regressions
# between two runs, not whether their verdicts agree.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=.venv/bin/mha-bench
OUT=docs/results
GQA=(--batch 1 --embed 512 --heads 8 --kv-heads 2 --seq 1024 --dtypes float32 --passes fwd,fwd+bwd --rope half --bias none)
run() {  # name, args...
    local name=$1; shift
    lscpu | grep -m1 "Model name" > "$OUT/bench-stability-$name.log"
    uptime >> "$OUT/bench-stability-$name.log"
    "$BENCH" "$@" --json "$OUT/bench-stability-$name.json" --markdown "$OUT/bench-stability-$name.md" \
        --plot "$OUT/bench-stability-$name.png" 2>&1 | tee -a "$OUT/bench-stability-$name.log" || true
}
for r in quiet1 quiet2 quiet3; do run "gqa-$r" "${GQA[@]}"; done
python3 -c 'while True: pass' & BUSY=$!
trap 'kill $BUSY 2>/dev/null || true' EXIT
run gqa-busy "${GQA[@]}"
kill $BUSY; trap - EXIT
run causal-quiet --batch 4 --embed 512 --heads 8 --seq 2048 --mask causal --dtypes float32 --passes fwd,fwd+bwd \
    --impls 'ours-torch:eager:fused,ours-jax:jit:fused,torch-sdpa-core:*,jax-dpa-core:*'
.venv/bin/python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
for name in ("gqa-quiet1", "gqa-quiet2", "gqa-quiet3", "gqa-busy", "causal-quiet"):
    try:
        data = json.load(open(f"{out}/bench-stability-{name}.json"))
    except (OSError, ValueError) as e:
        print(f"{name}: no results ({e})")
        continue
    for v in data.get("verdicts", []):
        ci = v.get("ci")
        interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "no interval"
        print(f"{name:13s} {v['pass']:8s} {v['faster']} {v['ratio']:.3f}x faster than {v['slower']} {interval} "
              f"conclusive={v['conclusive']} {v.get('reason') or ''}")
EOF
