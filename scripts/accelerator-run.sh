#!/usr/bin/env bash
# One prepared accelerator run: on a machine with a GPU (or TPU), run the parity matrix there,
# the Pallas kernels' peers natively (pallas-gpu-flash, pallas-tpu-flash, pallas-gpu-decode: the
# packed and decode cases), and a mha-bench sweep, and write
#   docs/results/parity-gpu.{json,md,png}  docs/results/pallas-gpu.{json,md}  docs/results/bench-gpu.{json,md,png}
# within about 8 minutes (parity <= 150 s, Pallas peers <= 90 s, bench <= 240 s; each is stopped
# with SIGINT at its limit, and the tools write the report of what finished when interrupted).
# On CPU (--device cpu) the same steps run, the Pallas peers in interpret mode: the rehearsal.
# It measures nothing of its own: it installs the accelerator builds (unless --system or
# --no-install), then runs mha-parity, the Pallas peers and mha-bench, each under its time limit.
#
#   scripts/accelerator-run.sh                  # .venv from requirements.lock, plus the CUDA builds
#   scripts/accelerator-run.sh --system         # the frameworks already installed on the machine
#   scripts/accelerator-run.sh --device cpu --tiny --out /tmp/dry   # CPU dry run of the same steps
#
# Options:
#   --system            no downloads: a venv with --system-site-packages ($SYSTEM_VENV, default
#                       .venv-system) and `pip install --no-deps --no-build-isolation -e .`, so
#                       torch, jax, flax, ... are the ones the machine has (they must be within
#                       pyproject.toml's ranges: torch 2.11-2.15, jax 0.10.2-0.11.x)
#   --device gpu|tpu|cpu  where parity, the Pallas peers and bench run (default gpu; nothing is
#                       installed for tpu: use --system on a TPU machine)
#   --tiny              a tiny plan (parity --quick, bench T=64, float32, fwd) for a dry run
#   --out DIR           where the reports go (default docs/results)
#   --tag NAME          report names parity-NAME.*, bench-NAME.* (default: the device)
#   --no-install        skip the CUDA installs (already done, or a CPU dry run)
#   --wheelhouse DIR    install from local wheels (pip --no-index --find-links DIR), for a
#                       machine that cannot reach the package indexes
# Environment: TORCH_CUDA_INDEX (default https://download.pytorch.org/whl/cu128),
#   PARITY_LIMIT_S (150), PALLAS_LIMIT_S (90), BENCH_LIMIT_S (240), PYTHON (python3, for --system),
#   SYSTEM_VENV (.venv-system).
#
# Without --system the venv is .venv (make): installing torch's CUDA build there replaces the
# pinned CPU build of the same version (torch==2.13.0); requirements.lock is never changed.
set -euo pipefail

DEVICE=gpu
TINY=0
OUT=docs/results
TAG=""
INSTALL=1
WHEELHOUSE=""
SYSTEM=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --tag) TAG="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
        --system) SYSTEM=1; shift ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "accelerator-run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in gpu|tpu|cpu) ;; *) echo "accelerator-run.sh: --device must be gpu, tpu or cpu, got $DEVICE" >&2; exit 2 ;; esac
TAG="${TAG:-$DEVICE}"
PARITY_LIMIT_S="${PARITY_LIMIT_S:-150}"
PALLAS_LIMIT_S="${PALLAS_LIMIT_S:-90}"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-240}"
TORCH_CUDA_INDEX="${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}"

cd "$(dirname "$0")/.."
mkdir -p "$OUT"
START=$(date +%s)
log() { echo "[accelerator-run $(( $(date +%s) - START ))s] $*"; }

if [[ "$SYSTEM" == 1 ]]; then
    SYSTEM_VENV="${SYSTEM_VENV:-.venv-system}"
    BIN="$SYSTEM_VENV/bin"
    log "venv $SYSTEM_VENV over the installed frameworks (${PYTHON:-python3}, no downloads)"
    # Without ensurepip (python3-venv missing) the venv still gets the machine's own pip.
    [[ -x "$BIN/python" ]] || "${PYTHON:-python3}" -m venv --system-site-packages "$SYSTEM_VENV" \
        || "${PYTHON:-python3}" -m venv --system-site-packages --without-pip "$SYSTEM_VENV"
    if "$BIN/python" -c "import setuptools" 2>/dev/null; then
        PIP_NO_INDEX=1 "$BIN/python" -m pip install --quiet --no-deps --no-build-isolation -e .
        MHA_PARITY=("$BIN/mha-parity"); MHA_BENCH=("$BIN/mha-bench")
    else
        # Nothing to build the editable install with: the checkout goes on the venv's path.
        log "no setuptools here: the checkout goes on the venv's path (a .pth file), tools via python -m"
        "$BIN/python" -c "import os, pathlib, sysconfig; pathlib.Path(sysconfig.get_path('purelib'), 'mha-parity-checkout.pth').write_text(os.getcwd() + '\\n')"
        MHA_PARITY=("$BIN/python" -m parity); MHA_BENCH=("$BIN/python" -m parity.bench)
    fi
    # Every dependency pyproject.toml declares must be there already (nothing can be downloaded);
    # one outside its range is a warning: the run goes on and the reports name the versions.
    "$BIN/python" - <<'EOF'
import importlib.metadata as m, sys, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
missing, outside = [], []
with open("pyproject.toml", "rb") as f:
    for r in map(Requirement, tomllib.load(f)["project"]["dependencies"]):
        try:
            v = m.version(r.name)
        except m.PackageNotFoundError:
            missing.append(str(r))
            continue
        print(f"  {r.name} {v}")
        if not r.specifier.contains(v, prereleases=True):
            outside.append(f"{r.name} {v} (pyproject.toml: {r.specifier})")
for o in outside:
    print(f"warning: {o} is outside the supported range", file=sys.stderr)
if missing:
    sys.exit(f"accelerator-run.sh --system: not installed on this machine: {', '.join(missing)}")
EOF
    INSTALL=0
else
    BIN=.venv/bin
    MHA_PARITY=("$BIN/mha-parity"); MHA_BENCH=("$BIN/mha-bench")
    log "venv (pinned CPU wheels) via make"
    make --no-print-directory .venv/.installed
fi

if [[ "$DEVICE" == gpu && "$INSTALL" == 1 ]]; then
    PIP=("$BIN/pip" install --quiet)
    [[ -n "$WHEELHOUSE" ]] && PIP+=(--no-index --find-links "$WHEELHOUSE")
    log "installing JAX's CUDA wheels (.[cuda])"
    "${PIP[@]}" -e '.[cuda]'
    log "installing torch 2.13.0's CUDA build"
    if [[ -n "$WHEELHOUSE" ]]; then "${PIP[@]}" torch==2.13.0; else "${PIP[@]}" --index-url "$TORCH_CUDA_INDEX" torch==2.13.0; fi
fi

log "devices"
"$BIN/python" - "$DEVICE" <<'EOF'
import sys
import jax, torch
want = sys.argv[1]
print("jax", jax.__version__, jax.devices(), "| torch", torch.__version__, "cuda", torch.cuda.is_available())
if want in ("gpu", "tpu") and jax.default_backend() != want:
    sys.exit(f"accelerator-run.sh: JAX sees no {want.upper()} (backend {jax.default_backend()}; is the jax wheel for it installed?)")
if want == "gpu" and not torch.cuda.is_available():
    print("warning: torch sees no CUDA device: its rows will be skip rows", file=sys.stderr)
import mha_jax.kernels as k
for T in (512, 4096, 16384):
    for dt in ("float32", "bfloat16", "float16"):
        c = k.fused_choice(4, 8, T, T, 64, dt, has_mask=False)
        print(f"fused kernel B=4 N=8 T=S={T} {dt}: {c.kernel} {c.q_chunk}x{c.k_chunk} ({c.why})")
EOF

if [[ "$TINY" == 1 ]]; then
    PARITY_ARGS=(--quick)
    BENCH_ARGS=(--preset quick --seq 64 --dtypes float32 --passes fwd --impls 'ours-jax:*,ours-torch:eager:fused' --budget 0.2)
else
    PARITY_ARGS=()
    BENCH_ARGS=(--preset default --seq 512,2048,4096,16384 --dtypes float32,bfloat16,float16 --passes fwd,fwd+bwd
                --impls 'ours-jax:*,ours-torch:eager:*,jax-dpa-core,torch-sdpa-core' --budget 0.3)
fi

status=0
log "mha-parity on $DEVICE (limit ${PARITY_LIMIT_S}s)"
timeout -s INT -k 20 "$PARITY_LIMIT_S" "${MHA_PARITY[@]}" --device "$DEVICE" "${PARITY_ARGS[@]}" --no-progress \
    --json "$OUT/parity-$TAG.json" --markdown "$OUT/parity-$TAG.md" --plot "$OUT/parity-$TAG.png" || status=$?
log "mha-parity exit $status"

pstatus=0
log "Pallas kernels' peers on $DEVICE (limit ${PALLAS_LIMIT_S}s; interpret mode on cpu)"
timeout -s INT -k 20 "$PALLAS_LIMIT_S" "${MHA_PARITY[@]}" --device "$DEVICE" --cases 'packed-llama*,decode*' \
    --checks peers,decode --dtypes float32 --no-progress \
    --json "$OUT/pallas-$TAG.json" --markdown "$OUT/pallas-$TAG.md" || pstatus=$?
log "Pallas peers exit $pstatus"

bstatus=0
log "mha-bench on $DEVICE (limit ${BENCH_LIMIT_S}s)"
timeout -s INT -k 20 "$BENCH_LIMIT_S" "${MHA_BENCH[@]}" --device "$DEVICE" "${BENCH_ARGS[@]}" --no-progress \
    --json "$OUT/bench-$TAG.json" --markdown "$OUT/bench-$TAG.md" --plot "$OUT/bench-$TAG.png" || bstatus=$?
log "mha-bench exit $bstatus"

ls -l "$OUT"/parity-"$TAG".* "$OUT"/pallas-"$TAG".* "$OUT"/bench-"$TAG".* 2>/dev/null || true
log "done (parity exit $status, Pallas peers exit $pstatus, bench exit $bstatus)"
[[ $status == 0 && $pstatus == 0 && $bstatus == 0 ]]
