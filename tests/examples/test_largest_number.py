"""The GRPO example's task (`pipeline.examples.largest_number`): disjoint questions, right
answers in the prompts, the weak teacher's answers in the SFT data, a tokenizer that reads
numbers digit by digit and renders the chat template as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.examples.largest_number import make_task
from pipeline.tokenizer.chat_template import chat_prompt, load_chat_template
from pipeline.tokenizer.tokenizer import load_tokenizer
from pipeline.train.objectives.grpo.rewards import answer_matches


def _numbers(question: str) -> list[int]:
    return [int(n) for n in question.split(":")[1].strip(" ?").split(", ")]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    return make_task(tmp_path_factory.mktemp("task"), sft=300, train=300, heldout=50)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_questions_are_disjoint_and_prompts_hold_the_right_answer(task) -> None:
    sft = [c["messages"][0]["content"] for c in _lines(task["sft"])]
    train, heldout = _lines(task["train"]), _lines(task["heldout"])
    assert (len(sft), len(train), len(heldout)) == (300, 300, 50)
    seen = set(sft) | {p["prompt"] for p in train}
    assert not seen & {p["prompt"] for p in heldout}
    assert not set(sft) & {p["prompt"] for p in train}
    for prompt in train + heldout:
        assert prompt["answer"] == str(max(_numbers(prompt["prompt"])))


def test_the_teacher_is_right_about_a_third_of_the_time(task) -> None:
    right = second = 0
    for conversation in _lines(task["sft"]):
        question, reply = (m["content"] for m in conversation["messages"])
        ordered = sorted(_numbers(question), reverse=True)
        right += answer_matches(reply, str(ordered[0]))
        second += answer_matches(reply, str(ordered[1]))
    assert right + second == 300 and 0.25 < right / 300 < 0.42


def test_tokenizer_reads_digits_and_renders_like_transformers(task) -> None:
    transformers = pytest.importorskip("transformers")
    directory = task["tokenizer"]
    ours = load_tokenizer(directory)
    messages = [{"role": "user", "content": "Which is the largest: 37, 82, 15, 64?"}]
    text = chat_prompt(messages, load_chat_template(directory))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ours.encode_batch([text])[0]
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == text
    pieces = [ours.decode([i]) for i in ours.encode_batch(["#### 82"])[0]]
    assert pieces[-2:] == ["8", "2"]
