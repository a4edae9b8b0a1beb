#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package into it.
# Sourced by scripts/quickstart.sh and scripts/test.sh with the extras they use, comma-separated
# (`source scripts/setup_env.sh plot,hf`); "dev" adds the test tools and the test oracles.
#
# torch is installed first and pinned to 2.13.0 when missing: on these machines that is a local
# CPU build, while an unpinned install would pull the newest CUDA build (several GB). Every later
# install is constrained to the torch already there, so no extra's dependency can replace it: pip
# stops with a conflict instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PIPE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# -qq: errors only (a dependency conflict is one); pip's warnings about this machine's index
# configuration are not the user's concern.
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -qq)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU build)"
    "${PIP[@]}" "torch==2.13.0"
fi
TORCH_PIN="$(mktemp)"
trap 'rm -f "$TORCH_PIN"' EXIT
# -W ignore: torch warns that numpy is missing when it is imported before the package's deps.
"$VENV/bin/python" -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$TORCH_PIN"

if [[ ",$EXTRAS," == *",dev,"* ]]; then
    # megatron-core is the test oracle for the .bin/.idx format; --no-deps keeps it from touching torch.
    "$VENV/bin/python" -c "import megatron.core" 2>/dev/null \
        || "${PIP[@]}" --no-deps "megatron-core==0.16.1"
fi
echo "[setup] installing pipe-llm${EXTRAS:+[$EXTRAS]} into $VENV"
"${PIP[@]}" --constraint "$TORCH_PIN" -e "$ROOT${EXTRAS:+[$EXTRAS]}"
rm -f "$TORCH_PIN"
trap - EXIT
export PATH="$VENV/bin:$PATH"
