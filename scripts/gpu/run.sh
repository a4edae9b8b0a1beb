#!/usr/bin/env bash
# One command for a GPU machine: install the wheels scripts/gpu/pack.sh put into .whl/ (no
# network needed), then measure everything pipe measures on a GPU (scripts/gpu/measure.py says
# what, step by step). The report is gpu_report.json + gpu_report.md (+ gpu_run.log) in $OUT,
# or in the folder given with --out, or in runs/gpu-report; it is rewritten after every step,
# so it holds what was measured even when a step fails or the call is cut short.
#
#   bash scripts/gpu/run.sh            the full run: within 300 s, the install included
#   bash scripts/gpu/run.sh --quick    within 150 s
#   bash scripts/gpu/run.sh --dry      on a CPU at tiny sizes, emulated FP8 (what CI runs)
#   ... [--out DIR] [--only STEP,STEP] [--skip STEP,STEP]   (measure.py lists the steps)
#
# With your own GPU and network, skip pack.sh: `pip install -e '.[dev]'` and run this script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/runs/gpu-report}"
ARGS=()
DRY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --dry) DRY=1; ARGS+=("$1"); shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done

# The rehearsal (--dry) runs in the current environment; carried wheels are for the GPU image.
if [ -z "$DRY" ] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE="${PIPE_WHEEL_TARGET:-/tmp/pipe-site}"
    echo "[gpu] installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE (no network)"
    started=$(date +%s%N)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$SITE" .whl/*.whl
    # The install counts against the run's budget: measure.py reports it with the environment.
    ARGS+=(--install-s "$(( ($(date +%s%N) - started) / 1000000000 + 1 ))")
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# pipe itself runs from this checkout (python -m pipeline), installed or not.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu/measure.py --out "$OUT_DIR" ${ARGS[@]+"${ARGS[@]}"}
