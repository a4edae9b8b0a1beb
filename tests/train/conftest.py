"""Fixtures shared by several training test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def grpo_start(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """The Hugging Face directory saved after the first iteration of tests/train/test_grpo.py's
    micro GRPO run: the weights the rollout-server tests serve and train from. Trained once for
    all of them (the run is deterministic, so each test's own copy would be this one)."""
    from tests.train.test_grpo import _train, grpo_sets, write_task

    directory = tmp_path_factory.mktemp("grpo_start")
    task = write_task(directory, tiny_tokenizer_dir)
    _train(grpo_sets(directory / "start", task, "checkpoint.save_hf=final", "training.iters=1"))
    (start,) = (directory / "start" / "checkpoints" / "hf").iterdir()
    return start


@pytest.fixture(scope="session")
def grpo_default_run(tmp_path_factory, tiny_tokenizer_dir) -> tuple[object, Path]:
    """(what `Trainer.train` returned, the run directory) of tests/train/test_grpo.py's micro
    GRPO run with no setting changed: the run several tests read figures of, trained once."""
    from tests.train.test_grpo import _train, grpo_sets, write_task

    directory = tmp_path_factory.mktemp("grpo_default")
    result = _train(grpo_sets(directory / "run", write_task(directory, tiny_tokenizer_dir)))
    return result, directory / "run"
