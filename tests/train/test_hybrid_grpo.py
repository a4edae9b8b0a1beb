"""GRPO on a hybrid linear-attention model (Qwen3.5's shape): rollouts by the engine's state
slots, each prompt's completions starting from its prefill's state, and a gradient."""

from __future__ import annotations

from pathlib import Path

from pipeline.train.assembly.run_config import resolve_config
from tests.builders import records
from tests.train.test_grpo import _train, grpo_sets
from tests.train.test_grpo import task as task  # noqa: F401 (the fixture)


def test_grpo_steps_on_a_hybrid_model(tmp_path: Path, task: dict) -> None:  # noqa: F811
    sets = grpo_sets(tmp_path / "run", task, "model.flavor=tiny_qwen3_5", "model.num_layers=4")
    model = resolve_config(None, sets).model_config()
    assert model.layer_types.count("linear_attention") == 3 and model.hidden_size == 32
    assert _train(sets).stop_reason == "finished"
    for figures in records(tmp_path / "run").values():
        assert figures["grad_norm"] > 0 and figures["rollout_tokens_per_s"] > 0
        assert 0 < figures["completions/mean_length"] <= 8
        # Each prompt's four completions: the leader computes the prompt but its last token,
        # the three others copy its state (and read its keys and values) after it.
        computed, cached = figures["prompt_tokens_computed"], figures["prompt_tokens_cached"]
        assert cached > 0 and computed - 4 * 4 == cached / 3
