"""A task for trying reinforcement learning with a tool: add two four-digit numbers.

A tiny model cannot add "4821 + 7396" in its head, but it can with a `calculator` tool. The SFT
data comes from a teacher that calls the calculator only `--teacher-tool-share` of the time (a
third, by default) and otherwise answers in its head, usually wrongly (one digit of the sum off):
a model fine-tuned on it learns the tool-call format, the answer format (`#### 12217`) and the
teacher's habit. GRPO with the tool (`pipe train --grpo --tool
pipeline.examples.tool_sums:calculator`) rewards the right answers, which mostly come from
calling the tool, and the share of answers that call it rises (`tools/used` in the log).

    python -m pipeline.examples.tool_sums --output runs/tools/data [--seed 0]

writes, into the output folder: `tokenizer/` (a byte-level BPE of the task's text, every digit
its own token, with a chat template that writes tool calls as `<tool_call>{json}</tool_call>`,
hermes style), `sft.jsonl` (conversations with tool calls and tool messages, what `pipe
preprocess --chat` reads), `train_prompts.jsonl` and `heldout_prompts.jsonl` (`{"prompt",
"answer"}`, what `pipe train --grpo` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.examples.stdlib_corpus import train_tokenizer

__all__ = ["CHAT_TEMPLATE", "calculator", "make_task"]

# Each turn `<|role|>\n...EOS\n`; an assistant's tool calls follow its text as
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool's result is its own turn.
# The tools' schemas are not printed: the tiny model learns the one tool from the SFT data.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}{{ '<tool_call>' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_EXPRESSION = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")


def calculator(expression: str) -> str:
    """Compute an arithmetic expression of two whole numbers.

    Args:
        expression: Two whole numbers joined by +, - or *, e.g. "4821 + 7396".
    """
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"not an expression of two whole numbers: {expression!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def answer(value: int) -> str:
    return f"#### {value}"


def _guess(total: int, rng: random.Random) -> int:
    """A sum worked out in the head: one digit off."""
    digits = list(str(total))
    at = rng.randrange(len(digits))
    digits[at] = str((int(digits[at]) + rng.randrange(1, 10)) % 10)
    guessed = int("".join(digits))
    return guessed if guessed != total and guessed >= 1000 else total + 10


def conversation(a: int, b: int, use_tool: bool, rng: random.Random) -> list[dict]:
    """The teacher's conversation for `a + b`: with the calculator, or a guess."""
    user = {"role": "user", "content": question(a, b)}
    if not use_tool:
        return [user, {"role": "assistant", "content": answer(_guess(a + b, rng))}]
    call = {"type": "function", "function": {"name": "calculator"}}
    call["function"]["arguments"] = {"expression": f"{a}+{b}"}
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": calculator(f"{a}+{b}")},
        {"role": "assistant", "content": answer(a + b)},
    ]


def make_task(
    output: str | os.PathLike,
    seed: int = 0,
    sft: int = 2000,
    train: int = 4000,
    heldout: int = 200,
    teacher_tool_share: float = 1 / 3,
) -> dict[str, Path]:
    """Write the task's files (module docstring) under `output`; returns their paths. The three
    sets of questions are disjoint."""
    from pipeline.tokenizer.chat_template import ChatTemplate

    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < sft + train + heldout:
        pair = (rng.randrange(1000, 10000), rng.randrange(1000, 10000))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "sft": out / "sft.jsonl",
        "train": out / "train_prompts.jsonl",
        "heldout": out / "heldout_prompts.jsonl",
    }
    chats = [conversation(a, b, rng.random() < teacher_tool_share, rng) for a, b in pairs[:sft]]
    _write_jsonl(paths["sft"], [{"messages": c} for c in chats])
    splits = {"train": pairs[sft : sft + train], "heldout": pairs[sft + train :]}
    for name, chosen in splits.items():
        _write_jsonl(
            paths[name], [{"prompt": question(a, b), "answer": str(a + b)} for a, b in chosen]
        )
    template = ChatTemplate.from_string(
        CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    )
    both = [conversation(a, b, True, rng) for a, b in pairs[:200]]
    both += [conversation(a, b, False, rng) for a, b in pairs[:200]]
    texts = [template.render(c).text for c in both]
    paths["tokenizer"] = _tokenizer(texts, out / "tokenizer")
    config_path = paths["tokenizer"] / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    return paths


def _tokenizer(texts: list[str], output_dir: Path) -> Path:
    """A byte-level BPE of `texts`, every digit a token of its own (the model copies numbers
    digit by digit into the call and out of the result), the rest merged by GPT-2's split so
    the tool call's JSON takes few tokens."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    return train_tokenizer(texts, output_dir, 384, pre_tokenizer=split)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder for the task's files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-tool-share", type=float, default=1 / 3)
    args = parser.parse_args()
    paths = make_task(args.output, args.seed, teacher_tool_share=args.teacher_tool_share)
    for name, path in paths.items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
