#!/usr/bin/env bash
# The tests where torch releases differ, on another torch than the main suite's 2.13, in a
# virtual environment of its own: `scripts/test_torch.sh 2.11.0` (the GPU machine's release; its
# wheel is the CUDA build, about 3 GB, and runs on a CPU). Runs the pipeline-parallel, parallel
# layout, checkpoint and FP8 tests, the engine process of `pipe serve` (oneDNN-packed linears),
# then the GPU kit's CPU rehearsal (scripts/gpu/run.sh --dry).
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:?usage: scripts/test_torch.sh TORCH_VERSION [pytest args]}"
shift
export PIPE_VENV="${PIPE_VENV:-$ROOT/.venv-torch-$VERSION}" PIPE_TORCH="$VERSION"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh" dev
cd "$ROOT"
python -c "import torch; assert torch.__version__.startswith('$VERSION'), torch.__version__"
echo "[test torch $VERSION] pipeline, layouts, checkpoints, FP8, serve's engine process, DPO"
python -m pytest -m "not gpu" -q -p no:cacheprovider \
    tests/core/test_pipeline_parallel.py tests/train/test_schedules.py \
    tests/train/test_layouts.py tests/train/test_gpu_defaults_on_cpu.py \
    tests/checkpoint tests/core/test_fp8.py tests/core/test_tensor_parallel.py \
    tests/core/test_fsdp.py tests/core/test_context_parallel.py \
    tests/core/test_expert_parallel.py tests/core/test_torch_compat.py \
    tests/serve/test_engine_process.py tests/train/test_dpo.py "$@"
echo "[test torch $VERSION] scripts/gpu/run.sh --dry"
bash scripts/gpu/run.sh --dry --out "$ROOT/runs/gpu-dry-torch-$VERSION"
