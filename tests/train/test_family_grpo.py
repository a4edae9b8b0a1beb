"""GRPO on the 2026 families: a micro run of `tiny_glm4_moe` (partial RoPE, q/k/v biases, per-head
q/k norms, DeepSeek's MoE), `tiny_minimax_m2` (q/k norms over the whole projection) and
`tiny_mistral4` (latent attention with the query scale, softmax grouped routing) makes
its rollouts with the serving engine, rewards them and takes gradient steps, as `tiny` does in
tests/train/test_grpo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import records
from tests.train.test_grpo import _train, grpo_sets, task  # noqa: F401 (task is a fixture)


@pytest.mark.parametrize("flavor", ["tiny_glm4_moe", "tiny_minimax_m2", "tiny_mistral4"])
def test_grpo_steps_with_rollouts_of_the_family(tmp_path: Path, task: dict, flavor: str) -> None:  # noqa: F811
    result = _train(grpo_sets(tmp_path / "run", task, f"model.flavor={flavor}"))
    assert result.stop_reason == "finished"
    train = records(tmp_path / "run")
    for step in (1, 2, 3):
        figures = train[step]
        assert figures["grad_norm"] > 0, (flavor, step)
        assert 0 < figures["completions/mean_length"] <= 8, (flavor, step)
        assert figures["rewards/digits/std"] > 0, (flavor, step)
