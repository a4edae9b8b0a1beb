#!/usr/bin/env bash
# Set up a fresh machine (virtual environment, package, test tools) and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k preprocess`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh" dev
cd "$ROOT"
echo "[test] ruff"
ruff check .
ruff format --check .
echo "[test] pytest"
python -m pytest -m "not gpu" -q "$@"
