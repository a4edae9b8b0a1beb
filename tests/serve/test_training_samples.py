"""`training.sample_prompts`: greedy samples logged during training, the same text `pipe generate`
gives from the checkpoint saved at that iteration (which finds the run's tokenizer itself)."""

from __future__ import annotations

import pytest

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.loop.trainer import Trainer
from tests.builders import micro_sets, records, run_pipe, tokenized_corpus

TEXTS = [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(600)]
PROMPTS = ["line 1", "value="]


def test_samples_are_logged_and_equal_pipe_generate(tmp_path) -> None:
    prefix = tokenized_corpus(TEXTS, tmp_path)
    run_dir = tmp_path / "run"
    sets = micro_sets(
        run_dir,
        "data.mock=false",
        f"data.blend={prefix}",
        f"data.tokenizer={tmp_path / 'tok'}",
        "model.vocab_size=512",
        f"training.sample_prompts={PROMPTS!r}".replace("'", '"'),
        "training.sample_interval=4",
        "training.sample_tokens=6",
    )
    Trainer(resolve_config(None, sets), console=False).train()
    samples = records(run_dir, "sample")
    assert sorted(samples) == [4, 8]
    assert samples[8]["sample_0"].startswith("line 1") and samples[8]["sample_1"].startswith(
        "value="
    )
    assert samples[8]["sample_0"] != "line 1"  # something was generated
    for index, prompt in enumerate(PROMPTS):
        args = ["--prompt", prompt, "--greedy", "--max-new-tokens", 6]
        out = run_pipe("generate", run_dir / "checkpoints", *args).output
        assert out == samples[8][f"sample_{index}"] + "\n"


def test_samples_need_a_tokenizer(tmp_path) -> None:
    sets = micro_sets(tmp_path, 'training.sample_prompts=["x"]', "training.sample_interval=2")
    with pytest.raises(ConfigError, match="needs the data's tokenizer"):
        Trainer(resolve_config(None, sets), console=False)
