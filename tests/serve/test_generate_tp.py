"""`pipe generate --nproc-per-node 2`: the model's heads split over two gloo processes give the
text one process gives (grouped-query attention, and latent attention with DeepSeekMoE)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.builders import ROOT, run_pipe

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

ARGS = ["--prompt", "line 3: value", "--greedy", "--max-new-tokens", "10"]


def _generate(model_dir, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pipeline", "generate", str(model_dir), *ARGS, *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.distributed.run --nproc-per-node 2" in done.stderr  # relaunched on 2 ranks
    return done.stdout


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tiny_hf_dir):
    """A tiny DeepSeek-V3 (latent attention, DeepSeekMoE) over the tiny tokenizer's vocabulary."""
    from tests.convert.test_deepseek_v3 import _case, _hf_model

    config = _case("moe_q_lora_yarn")[0]
    config.vocab_size = transformers.AutoConfig.from_pretrained(tiny_hf_dir).vocab_size
    directory = tmp_path_factory.mktemp("deepseek_tp")
    _hf_model(config).save_pretrained(directory)
    shutil.copy(tiny_hf_dir / "tokenizer.json", directory / "tokenizer.json")
    return directory


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_two_ranks_give_one_rank_text(family, tiny_hf_dir, request) -> None:
    model_dir = tiny_hf_dir if family == "llama" else request.getfixturevalue("deepseek_dir")
    alone = run_pipe("generate", model_dir, *ARGS).output
    assert len(alone) > len(ARGS[1]) + 3
    assert _generate(model_dir, "--nproc-per-node", "2") == alone
