#!/usr/bin/env bash
# The benchmark's verdict runs: ours-torch fused, ours-jax fused and torch SDPA, fwd and fwd+bwd,
# under the quick preset, into $OUT/bench-verdict-NAME.{json,md,png}:
#
#   quiet              the default settings on an idle machine
#   busy               the same beside a process that keeps one core busy
#   quiet-torch-only   the torch implementations alone in their worker, and
#   quiet-jax-only     the JAX one alone: what sharing one process costs each framework
#   quiet-spinning     OMP_WAIT_POLICY=ACTIVE (the OpenMP setting mha-bench replaces), idle
#   quiet-torch-only-spinning   the torch implementations alone, spinning: against quiet-torch-only,
#                      what passive waiting costs torch on an idle machine
#   busy-spinning      the same beside the busy process
#
# Then it checks the default-setting runs (quiet, busy): no two conclusive verdicts disagree, and
# every conclusive interval excludes 1; it prints every run's verdicts and medians.
#
# Beyond one mha-bench run: it sets what a run does not set itself (a core kept busy beside it,
# OMP_WAIT_POLICY=ACTIVE) and holds seven runs' verdicts against each other; `mha-bench compare`
# compares two runs' medians, not their verdicts.
#
#   scripts/bench-verdict-runs.sh                     # B=2 T=S=512 E=256 N=4 float32 into docs/results
#   OUT=/tmp/v SEQ=16 EMBED=12 HEADS=3 BATCH=1 scripts/bench-verdict-runs.sh   # a tiny rehearsal
#
# Run it on an otherwise idle machine: the "quiet" runs are only quiet if nothing else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
COMMON=(--preset quick --seq "${SEQ:-512}" --batch "${BATCH:-2}" --embed "${EMBED:-256}" --heads "${HEADS:-4}"
        --dtypes float32 --passes fwd,fwd+bwd --no-progress)
ALL=ours-torch:eager:fused,ours-jax:jit:fused,torch-sdpa-core:eager:fused

busy_pid=""
stop_busy() { if [ -n "$busy_pid" ]; then kill "$busy_pid" 2>/dev/null || true; wait "$busy_pid" 2>/dev/null || true; busy_pid=""; fi; }
trap stop_busy EXIT

run() {  # run NAME IMPLS [ENV=VALUE ...]
  local name=$1 impls=$2; shift 2
  echo "== $name: $* mha-bench ${COMMON[*]} --impls $impls"
  env "$@" "$PY" -m parity.bench "${COMMON[@]}" --impls "$impls" --json "$OUT/bench-verdict-$name.json" \
    --markdown "$OUT/bench-verdict-$name.md" --plot "$OUT/bench-verdict-$name.png" || echo "(exit $?)"
}

run quiet "$ALL"
run quiet-torch-only ours-torch:eager:fused,torch-sdpa-core:eager:fused
run quiet-jax-only ours-jax:jit:fused
run quiet-spinning "$ALL" OMP_WAIT_POLICY=ACTIVE
run quiet-torch-only-spinning ours-torch:eager:fused,torch-sdpa-core:eager:fused OMP_WAIT_POLICY=ACTIVE
"$PY" -c 'while True: pass' &   # one core kept busy
busy_pid=$!
sleep 2
run busy "$ALL"
run busy-spinning "$ALL" OMP_WAIT_POLICY=ACTIVE
stop_busy

"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
names = ("quiet", "busy", "quiet-torch-only", "quiet-jax-only", "quiet-spinning", "quiet-torch-only-spinning",
         "busy-spinning")
runs = {n: json.load(open(f"{out}/bench-verdict-{n}.json")) for n in names}
for name, data in runs.items():
    env = data["environment"]
    print(f"-- {name}: load {env['loadavg_start'][0]:.2f} -> {env['loadavg_end'][0]:.2f}, "
          f"{env['thread_settings']['env']}, {len(env.get('interference') or [])} interference warning(s)")
    for r in data["rows"]:
        print(f"   {r['pass']:8s} {r['impl']:16s} {r['median_s'] * 1e3:9.2f} ms  IQR/median "
              f"{r['iqr_s'] / r['median_s']:5.1%}  {r['repeats']:3d} repeats  {r['status']}")
    for v in data["verdicts"]:
        print(f"   verdict {v['pass']:8s} {v['faster']} is {v['ratio']:.3f}x faster than {v['slower']} "
              + (f"CI [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]" if v.get("ci") else "no interval")
              + f", {v['repeats']} repeats, conclusive {v['conclusive']}")
seen, problems = {}, []
for name in ("quiet", "busy"):  # the default settings: what the verdict rules promise
    for v in runs[name]["verdicts"]:
        if not v["conclusive"]:
            continue
        if not v.get("ci") or not (v["ci"][0] > 1 or v["ci"][1] < 1):
            problems.append(f"{name}: a conclusive interval contains 1: {v}")
        pair = (v["pass"], frozenset((v["faster"], v["slower"])))
        if seen.setdefault(pair, (name, v["faster"]))[1] != v["faster"]:
            problems.append(f"{name} and {seen[pair][0]} disagree on {sorted(pair[1])} ({v['pass']})")
print("\n".join(problems) or "quiet and busy: no conclusive verdicts disagree; every conclusive interval excludes 1")
sys.exit(1 if problems else 0)
PYEOF
