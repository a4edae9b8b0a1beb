"""GRPO's rewards: final-answer extraction and normalisation, the built-in rewards, a user's
function called as TRL calls it (TRL's own reward functions run through it), and every error
named in one line (the field at build time, the prompt's file:line at scoring)."""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import replace

import numpy as np
import pytest

from pipeline.data.prompt_dataset import PromptRecord
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.grpo.rewards import (
    RewardError,
    answer_matches,
    build_rewards,
    extract_final_answer,
    normalize_answer,
)
from pipeline.train.objectives.grpo.settings import GRPOSection


def record(line: int, prompt="q", **fields) -> PromptRecord:
    return PromptRecord((1, 2), fields, f"p.jsonl:{line}", "text", prompt)


def section(**values) -> GRPOSection:
    return replace(GRPOSection(), **values)


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{\frac{1}{2}} it is", r"\frac{1}{2}"),
        (r"\boxed{1} first, then \boxed{x^{2}+1}", "x^{2}+1"),
        (r"\boxed{7} and \boxed{unclosed", "7"),  # the last balanced one
        ("steps\n#### 1,234\n", "1,234"),
        ("#### 3\nmore\n#### -12\n", "-12"),
        (r"#### 5 but \boxed{6}", "6"),  # boxed wins over ####
        ("#### \nthen 9", "9"),  # an empty #### line: the last number
        ("5-3 = 2", "2"),
        ("it is -4.5.", "-4.5"),
        ("got 1,000 apples", "1,000"),
        ("x=3, y=-7", "-7"),
        ("from 3-5 it is", "5"),  # a dash between numbers is no sign
        ("totals 1,2345", "2345"),  # not a grouped number
        ("half is .5", ".5"),
        ("no answer here", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("3.0", "3"),
        ("0.50", "0.5"),
        ("1,000", "1000"),
        ("$1,000.00", "1000"),
        ("+5", "5"),
        ("-0.0", "0"),
        ("42.", "42"),
        ("100", "100"),
        (r"\text{Yes}.", "yes"),
        (r"\text{\mathrm{ Paris }}", "paris"),
        ("  New   York ", "new york"),
        ("1,2", "1,2"),  # a list, not a number
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_answer_matches():
    assert answer_matches(r"thus \boxed{3.0}", "3")
    assert answer_matches("so 1,000 in all.\n#### $1000", 1000)
    assert answer_matches("the total is -2.50", "-2.5")
    assert not answer_matches("the total is 25", "2.5")
    assert not answer_matches("no idea", "0")


def test_builtin_rewards():
    rewards = build_rewards(
        section(
            reward_funcs=["accuracy", "format", "length"],
            reward_weights=[1, 0.5, 2],
            max_completion_length=10,
            length_target=4,
        ),
        has_answers=True,
    )
    assert rewards.names == ["accuracy", "format", "length"]
    assert rewards.weights == [1.0, 0.5, 2.0]
    records = [record(1, answer="12"), record(2, answer=7), record(3, answer="x")]
    texts = ["5 + 7\n#### 12", "7 apples, or 8", "#### x "]
    scores = rewards.score(records, texts, [[0] * 3, [0] * 4, [0] * 9])
    assert scores.dtype == np.float64 and scores.shape == (3, 3)
    assert scores.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -0.5]]


def test_length_target_defaults_to_the_limit():
    rewards = build_rewards(section(reward_funcs=["length"], max_completion_length=8), False)
    scores = rewards.score([record(1)] * 2, ["a", "b"], [[0] * 8, [0] * 12])
    assert scores[:, 0].tolist() == [0.0, -0.5]


def test_default_reward_is_accuracy_when_prompts_have_answers():
    rewards = build_rewards(GRPOSection(), has_answers=True)
    assert rewards.names == ["accuracy"] and rewards.weights == [1.0]
    with pytest.raises(ConfigError, match=r"name the rewards in \[grpo\] reward_funcs"):
        build_rewards(GRPOSection(), has_answers=False)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reward_funcs": ["length"], "length_target": -1}, "grpo.length_target -1: must be"),
        ({"reward_funcs": ["exact"]}, "grpo.reward_funcs: unknown reward 'exact'"),
        ({"reward_funcs": ["format", "format"]}, "grpo.reward_funcs names 'format' twice"),
        ({"reward_funcs": ["accuracy"]}, "grpo.reward_funcs: accuracy compares"),
        ({"reward_funcs": ["format"], "reward_weights": [1, 2]}, "grpo.reward_weights has 2"),
        ({"reward_funcs": ["format"], "format_pattern": "(a"}, "grpo.format_pattern '(a': not a"),
        ({"reward_funcs": ["no_such_module_x:f"]}, "cannot import 'no_such_module_x:f' (Module"),
        ({"reward_funcs": ["math:no_such"]}, "cannot import 'math:no_such' (AttributeError"),
        ({"reward_funcs": ["math:pi"]}, "grpo.reward_funcs: 'math:pi' is float, not a function"),
        ({"reward_funcs": ["missing.py:f"]}, "cannot import 'missing.py:f' (FileNotFoundError"),
    ],
)
def test_build_errors_name_the_field(values, message):
    with pytest.raises(ConfigError) as err:
        build_rewards(section(**values), has_answers=False)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(
        ("grpo.reward_funcs", "grpo.reward_weights", "grpo.format", "grpo.length")
    )


def test_accuracy_without_an_answer_names_the_prompt():
    rewards = build_rewards(GRPOSection(), has_answers=True)
    with pytest.raises(RewardError, match=r"^p.jsonl:8: reward accuracy: the prompt has no"):
        rewards.score([record(7, answer="1"), record(8)], ["1", "1"], [[1], [1]])


USER_REWARDS = """
calls = []

def echo(prompts, completions, completion_ids, **kwargs):
    calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      **kwargs))
    return [len(c) if isinstance(c, str) else None for c in completions]

def boom(prompts, completions, **kwargs):
    raise KeyError("level")

def short(completions, **kwargs):
    return [1.0]

def word(completions, **kwargs):
    return [1.0, "high"]

def scalar(completions, **kwargs):
    return 1.0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_user_function_is_called_as_trl_calls_it(user_module):
    rewards = build_rewards(section(reward_funcs=[f"{user_module}:echo", "format"]), False)
    messages = [{"role": "user", "content": "hi"}]
    records = [record(1, "abc", answer="1", level=2), record(2, messages, hint="h")]
    scores = rewards.score(records, ["xyz1", "q"], [[5, 6], [7]])
    assert scores[0, 0] == 4.0 and math.isnan(scores[1, 0])  # None becomes NaN
    (call,) = importlib.import_module(user_module).calls
    assert call == {
        "prompts": ["abc", messages],
        "completions": ["xyz1", [{"role": "assistant", "content": "q"}]],
        "completion_ids": [[5, 6], [7]],
        "answer": ["1", None],
        "level": [2, None],
        "hint": [None, "h"],
    }


def test_trl_reward_functions_run_unchanged():
    pytest.importorskip("trl")
    from trl.rewards import think_format_reward

    rewards = build_rewards(section(reward_funcs=["trl.rewards:think_format_reward"]), False)
    messages = [{"role": "user", "content": "2+2?"}]
    texts = ["<think>\nfour\n</think>\n4", "4"]
    scores = rewards.score([record(1, messages), record(2, messages)], texts, [[1], [1]])
    trl_completions = [[{"role": "assistant", "content": t}] for t in texts]
    assert scores[:, 0].tolist() == think_format_reward(trl_completions) == [1.0, 0.0]


def test_user_module_in_the_working_directory(tmp_path, monkeypatch):
    name = f"cwd_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("def f(completions, **kw):\n    return [0.5]\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    rewards = build_rewards(section(reward_funcs=[f"{name}:f"]), False)
    assert sys.path == path_before
    assert rewards.score([record(1)], ["a"], [[1]]).tolist() == [[0.5]]


def test_user_function_from_a_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def f(completions, **kw):\n    return [float(len(completions))] * 2\n")
    rewards = build_rewards(section(reward_funcs=[f"{path}:f"]), False)
    assert rewards.score([record(1)] * 2, ["a", "b"], [[1], [2]])[:, 0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "func, message",
    [
        ("boom", r"^p.jsonl:4: reward {m}:boom raised KeyError: 'level'$"),
        ("short", r"^p.jsonl:4: reward {m}:short returned 1 rewards for 2 completions$"),
        ("word", r"^p.jsonl:5: reward {m}:word returned 'high' \(str\), not a number or None$"),
        ("scalar", r"^p.jsonl:4: reward {m}:scalar returned float, not a list with one reward"),
    ],
)
def test_user_function_failures_name_the_prompt(user_module, func, message):
    rewards = build_rewards(section(reward_funcs=[f"{user_module}:{func}"]), False)
    with pytest.raises(RewardError, match=message.format(m=user_module)):
        rewards.score([record(4), record(5)], ["a", "b"], [[1], [2]])
