#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the package into it.
# Sourced by scripts/quickstart.sh and scripts/test.sh with the extras they use, comma-separated
# (`source scripts/setup_env.sh plot,hf`); "dev" adds the test tools and the test oracles.
#
# torch is installed first and pinned when missing, to $PIPE_TORCH (default 2.13.0): on these
# machines 2.13.0 is a local CPU build, while an unpinned install would pull the newest CUDA build
# (several GB); scripts/test_torch.sh sets PIPE_TORCH=2.11.0 (pipe supports 2.11 to 2.13). Every
# later install is constrained to the torch already there, so no extra's dependency can replace
# it: pip stops with a conflict instead.
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

TORCH_VERSION="${PIPE_TORCH:-2.13.0}"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==$TORCH_VERSION"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi
TORCH_PIN="$(mktemp)"
trap 'rm -f "$TORCH_PIN"' EXIT
# -W ignore: torch warns that numpy is missing when it is imported before the package's deps.
# The local part (+cpu, +cu130) is left out: pip cannot match a constraint that names it.
"$VENV/bin/python" -W ignore -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
    > "$TORCH_PIN"

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
