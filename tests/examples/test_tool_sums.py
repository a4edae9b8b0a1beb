"""The tool-use example's task (`pipeline.examples.tool_sums`): disjoint questions with right
answers, the teacher's conversations (a third with a calculator call whose result is right,
the others one digit off), the calculator tool and its schema, and a chat template whose tool
calls pipe's hermes parser reads back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.examples.tool_sums import calculator, make_task
from pipeline.serve.http.tool_parsers import HermesParser
from pipeline.tokenizer.chat_template import load_chat_template
from pipeline.tokenizer.tokenizer import load_tokenizer
from pipeline.train.objectives.grpo.rewards import answer_matches
from pipeline.train.objectives.grpo.tools import tool_schema


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return make_task(tmp_path_factory.mktemp("task"), sft=300, train=200, heldout=50)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _sum(question: str) -> int:
    a, b = map(int, re.findall(r"\d+", question))
    return a + b


def test_questions_answers_and_the_teachers_habit(task) -> None:
    sft = [c["messages"] for c in _lines(task["sft"])]
    train, heldout = _lines(task["train"]), _lines(task["heldout"])
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in heldout}
    assert not {c[0]["content"] for c in sft} & {p["prompt"] for p in train + heldout}
    for prompt in train + heldout:
        assert prompt["answer"] == str(_sum(prompt["prompt"]))
    with_tool = [c for c in sft if len(c) == 4]
    assert 0.25 < len(with_tool) / len(sft) < 0.42  # a third, by default
    for chat in sft:
        right = str(_sum(chat[0]["content"]))
        if len(chat) == 4:
            call = chat[1]["tool_calls"][0]["function"]
            assert calculator(**call["arguments"]) == chat[2]["content"] == right
            assert answer_matches(chat[3]["content"], right)
        else:
            assert not answer_matches(chat[1]["content"], right)  # a guess, one digit off


def test_the_calculator_and_its_schema() -> None:
    assert calculator("4821 + 7396") == "12217" and calculator("10*-3") == "-30"
    with pytest.raises(ValueError, match="not an expression"):
        calculator("two plus two")
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]


def test_the_template_renders_calls_the_hermes_parser_reads(task) -> None:
    template, tok = load_chat_template(task["tokenizer"]), load_tokenizer(task["tokenizer"])
    chat = next(c["messages"] for c in _lines(task["sft"]) if len(c["messages"]) == 4)
    text = template.render(chat).text
    assert tok.decode(tok.encode_batch([text])[0]) == text  # digits and specials round-trip
    turn = text.split("<|assistant|>\n")[1].split("<|end_of_text|>")[0]
    (call,) = HermesParser().extract(turn).calls
    assert call.name == "calculator"
    assert json.loads(call.arguments) == chat[1]["tool_calls"][0]["function"]["arguments"]
