#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package into it.
# Sourced by scripts/quickstart.sh and scripts/test.sh; pass "dev" to add the test tools.
#
# torch is installed first and pinned to 2.13.0 when missing: on these machines that is a local
# CPU build, while an unpinned install would pull the newest CUDA build (several GB).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PIPE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU build)"
    "${PIP[@]}" "torch==2.13.0"
fi

if [ "$EXTRAS" = "dev" ]; then
    # megatron-core is the test oracle for the .bin/.idx format; --no-deps keeps it from touching torch.
    "$VENV/bin/python" -c "import megatron.core" 2>/dev/null \
        || "${PIP[@]}" --no-deps "megatron-core==0.16.1"
    "${PIP[@]}" -e "$ROOT[dev]"
else
    "${PIP[@]}" -e "$ROOT"
fi
export PATH="$VENV/bin:$PATH"
