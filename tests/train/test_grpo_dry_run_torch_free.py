"""`pipe train --grpo --dry-run` sizes the rollout engine without importing torch, to the
bytes the engine's own cache sizing gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import micro_model_config
from tests.train.test_grpo import task  # noqa: F401


def test_grpo_dry_run_does_not_import_torch(task: dict) -> None:  # noqa: F811
    args = [
        "--recipe",
        "tiny",
        "--grpo",
        "--dry-run",
        "--data",
        str(task["prompts"]),
        "--set",
        f"data.tokenizer={task['tokenizer']}",
        "--set",
        "grpo.max_completion_length=64",
    ]
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from pipeline.train.commands import train\n"
        f"r = CliRunner().invoke(train, {args!r})\n"
        "assert r.exit_code == 0 and 'rollout engine' in r.output, r.output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    cwd = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_torch_free_kv_bytes_are_the_cache_s(tp: int) -> None:
    """Against the bytes a built cache allocates per slot."""
    import torch

    from pipeline.core.model.kv_sizes import kv_bytes_per_token
    from pipeline.serve.engine.kv_cache import BlockKVCache

    config = micro_model_config()
    for dtype in (torch.bfloat16, torch.float32):
        cache = BlockKVCache(config, num_blocks=2, block_size=4, dtype=dtype, tp=tp)
        slots = cache.scratch_slot + 1
        allocated = sum(t.numel() * t.element_size() for pools in cache.pools for t in pools)
        assert kv_bytes_per_token(config, dtype.itemsize, tp) * slots == allocated > 0
