"""GRPO's rewards on a thinking policy (`grpo.reasoning_parser`): they score the content without
the reasoning, split as `pipe serve --reasoning-parser` splits a reply; a user's function can ask
for the reasoning, and `grpo.reasoning_rewards` see the whole completion."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from pipeline.data.prompt_dataset import PromptRecord
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.grpo.rewards import build_rewards
from pipeline.train.objectives.grpo.settings import GRPOSection
from tests.builders import with_think_tokens

REWARDS = """
seen = []

def plain(completions, **kwargs):
    seen.append(("plain", completions))
    return [0.0] * len(completions)

def thinking(completions, reasoning, **kwargs):
    seen.append(("thinking", completions, reasoning))
    return [float(r is not None) for r in reasoning]
"""


@pytest.fixture
def encode_batch(tiny_tokenizer_dir, tmp_path):
    from pipeline.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(with_think_tokens(tiny_tokenizer_dir, tmp_path / "tok")).encode_batch


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = f"reasoning_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord((1,), {"answer": "4"}, f"p.jsonl:{i + 1}", "text", "2+2?") for i in range(n)
    ]


def test_rewards_score_the_content_without_the_reasoning(encode_batch, module) -> None:
    texts = ["<think>\nmaybe 5\n</think>\n\n#### 4", "<think>\nit is 4, not 5"]
    grpo = replace(
        GRPOSection(),
        reward_funcs=["accuracy", "format", f"{module}:plain", f"{module}:thinking"],
        format_pattern=r"(?s)<think>.*</think>.*",
        reasoning_parser="qwen3",
        reasoning_rewards=["format"],
    )
    rewards = build_rewards(grpo, True, encode_batch)
    ids = [encode_batch([t])[0] for t in texts]
    scores = rewards.score(_records(2), texts, ids)
    # accuracy reads the content's 4 (the thinking's last number, 5, is not seen); unfinished
    # thinking leaves no content, so no answer
    assert scores[:, 0].tolist() == [1.0, 0.0]
    assert scores[:, 1].tolist() == [1.0, 0.0]  # format sees the whole completion
    assert scores[:, 3].tolist() == [1.0, 1.0]
    seen = importlib.import_module(module).seen
    assert seen[0] == ("plain", ["\n\n#### 4", ""])
    assert seen[1] == ("thinking", ["\n\n#### 4", ""], ["\nmaybe 5\n", "\nit is 4, not 5"])


def test_without_a_parser_rewards_see_the_whole_completion(encode_batch) -> None:
    rewards = build_rewards(replace(GRPOSection(), reward_funcs=["accuracy"]), True, encode_batch)
    text = "<think>\n4\n</think>\n\n#### 5"
    assert rewards.reasoning is None
    assert rewards.score(_records(1), [text], [encode_batch([text])[0]]).tolist() == [[0.0]]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reasoning_parser": "nope"}, "grpo.reasoning_parser: 'nope': choose from qwen3"),
        ({"reasoning_rewards": ["format"]}, "grpo.reasoning_rewards names 'format', not in"),
        (
            {"reasoning_rewards": ["accuracy"]},
            "grpo.reasoning_rewards needs grpo.reasoning_parser",
        ),
    ],
)
def test_reasoning_settings_errors_name_the_field(encode_batch, values, message) -> None:
    grpo = replace(GRPOSection(), reward_funcs=["accuracy"], **values)
    with pytest.raises(ConfigError, match=message):
        build_rewards(grpo, True, encode_batch)
