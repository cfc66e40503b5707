#!/usr/bin/env bash
# The benchmark's verdict runs: the same cases once on a quiet machine and once beside a process
# that keeps one core busy, with the default thread settings and with OpenMP's spin-waiting on
# (OMP_WAIT_POLICY=ACTIVE, the setting mha-bench replaces). Writes JSON, Markdown and a plot per
# run into $OUT, then checks that no two conclusive verdicts disagree and that every conclusive
# interval excludes 1.
#
#   scripts/bench-verdict-runs.sh                     # B=2 T=S=512 E=256 N=4 float32 into docs/results
#   OUT=/tmp/v SEQ=16 EMBED=12 HEADS=3 BATCH=1 scripts/bench-verdict-runs.sh   # a tiny rehearsal
#
# Run it on an otherwise idle machine: the "quiet" run is only quiet if nothing else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
SHAPE=(--seq "${SEQ:-512}" --batch "${BATCH:-2}" --embed "${EMBED:-256}" --heads "${HEADS:-4}" --dtypes float32)
COMMON=(--preset quick "${SHAPE[@]}" --passes fwd,fwd+bwd --no-progress
        --impls ours-torch:eager:fused,ours-jax:jit:fused,torch-sdpa-core:eager:fused)

busy_pid=""
stop_busy() { if [ -n "$busy_pid" ]; then kill "$busy_pid" 2>/dev/null || true; wait "$busy_pid" 2>/dev/null || true; busy_pid=""; fi; }
trap stop_busy EXIT

run() {  # run NAME [ENV=VALUE ...]: one mha-bench run into $OUT/bench-verdict-NAME.{json,md,png}
  local name=$1; shift
  echo "== $name: $* mha-bench ${COMMON[*]}"
  env "$@" "$PY" -m parity.bench "${COMMON[@]}" --json "$OUT/bench-verdict-$name.json" \
    --markdown "$OUT/bench-verdict-$name.md" --plot "$OUT/bench-verdict-$name.png" || echo "(exit $?)"
}

run quiet
run quiet-spinning OMP_WAIT_POLICY=ACTIVE
"$PY" -c 'while True: pass' &   # one core kept busy
busy_pid=$!
sleep 2
run busy
run busy-spinning OMP_WAIT_POLICY=ACTIVE
stop_busy

"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
runs = {n: json.load(open(f"{out}/bench-verdict-{n}.json")) for n in ("quiet", "quiet-spinning", "busy", "busy-spinning")}
seen, problems = {}, []
for name, data in runs.items():
    print(f"-- {name}: interference {data['environment'].get('interference')}")
    for v in data["verdicts"]:
        print(f"   {v['pass']:8s} {v['faster']} is {v['ratio']:.3f}x faster than {v['slower']} "
              f"CI [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}] repeats {v['repeats']} conclusive {v['conclusive']}")
        if v["conclusive"]:
            if not (v["ci"][0] > 1 or v["ci"][1] < 1):
                problems.append(f"{name}: a conclusive interval contains 1: {v}")
            pair, winner = (v["pass"], frozenset((v["faster"], v["slower"]))), v["faster"]
            if seen.setdefault(pair, (name, winner))[1] != winner:
                problems.append(f"{name} and {seen[pair][0]} disagree on {sorted(pair[1])} ({v['pass']})")
print("\n".join(problems) or "no conclusive verdicts disagree; every conclusive interval excludes 1")
sys.exit(1 if problems else 0)
PYEOF
