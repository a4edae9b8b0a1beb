"""GRPO on gpt-oss: the rollout engine (paged cache with the sliding window masked, sinks) makes
the completions of `tiny_gpt_oss`, rewards vary, and every step has a gradient (the micro run of
`tests/train/test_grpo.py`, the model kept at 4 layers so its sliding and full layers alternate
as gpt-oss's do)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import records
from tests.train.test_grpo import _train, grpo_sets, task  # noqa: F401 (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_gpt_oss_rollouts_rewards_and_gradients(tmp_path: Path, task: dict) -> None:  # noqa: F811
    sets = [s for s in grpo_sets(tmp_path / "run", task) if not s.startswith("model.num_layers")]
    sets += ["model.flavor=tiny_gpt_oss", "model.head_dim=8", "grpo.max_completion_length=12"]
    result = _train(sets)
    assert result.stop_reason == "finished"
    assert 'flavor = "tiny_gpt_oss"' in (tmp_path / "run" / "config.toml").read_text()
    train = records(tmp_path / "run")
    for step in (1, 2, 3):
        figures = train[step]
        assert figures["grad_norm"] > 0
        # Prompts of about 6 tokens and completions up to 12: past the window of 8.
        assert 0 < figures["completions/mean_length"] <= figures["completions/max_length"] <= 12
        assert figures["rewards/digits/std"] > 0
        assert figures["rollout_tokens_per_s"] > 0
