"""A task with a checkable answer, for trying reinforcement learning: name the largest number.

The question lists four two-digit numbers ("Which is the largest: 37, 82, 15, 64?"); the answer
ends with a line `#### 82`, the convention GRPO's built-in accuracy reward reads. The SFT data
comes from a weak teacher, one that names the largest number only `--teacher-accuracy` of the
time (a third, by default) and the second largest otherwise: a model fine-tuned on it learns the
format and the teacher's habit. Its own completions are sometimes right, which is all that
reinforcement learning with a verifiable reward needs: GRPO then trains the habit away, and the
held-out accuracy (questions never seen in SFT or GRPO) shows by how much.

    python -m pipeline.examples.largest_number --output runs/grpo/data [--seed 0]

writes, into the output folder: `tokenizer/` (a byte-level BPE of the task's text, every digit
its own token, with a chat template), `sft.jsonl` (chat conversations, what `pipe preprocess
--chat` reads), `train_prompts.jsonl` and `heldout_prompts.jsonl` (`{"prompt", "answer"}`, what
`pipe train --grpo` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.examples.stdlib_corpus import train_tokenizer

NUMBERS_PER_QUESTION = 4


def question(numbers: list[int]) -> str:
    return f"Which is the largest: {', '.join(map(str, numbers))}?"


def answer(value: int) -> str:
    """The reply's text: the answer on a `####` line."""
    return f"#### {value}"


def questions(count: int, rng: random.Random) -> Iterator[tuple[int, ...]]:
    """`count` distinct questions: four distinct numbers from 10 to 99, in a random order."""
    seen: set[tuple[int, ...]] = set()
    while len(seen) < count:
        numbers = tuple(rng.sample(range(10, 100), NUMBERS_PER_QUESTION))
        if numbers not in seen:
            seen.add(numbers)
            yield numbers


def teacher(numbers: tuple[int, ...], accuracy: float, rng: random.Random) -> int:
    """The weak teacher's answer: the largest with probability `accuracy`, else the second."""
    ordered = sorted(numbers, reverse=True)
    return ordered[0] if rng.random() < accuracy else ordered[1]


def make_task(
    output: str | os.PathLike,
    seed: int = 0,
    sft: int = 4000,
    train: int = 4000,
    heldout: int = 200,
    teacher_accuracy: float = 1 / 3,
) -> dict[str, Path]:
    """Write the task's files (module docstring) under `output`; returns their paths. The three
    sets of questions are disjoint."""
    rng = random.Random(seed)
    every = list(questions(sft + train + heldout, rng))
    split = {"sft": every[:sft], "train": every[sft : sft + train], "heldout": every[sft + train :]}
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "sft": out / "sft.jsonl",
        "train": out / "train_prompts.jsonl",
        "heldout": out / "heldout_prompts.jsonl",
    }
    conversations = [
        {
            "messages": [
                {"role": "user", "content": question(list(q))},
                {"role": "assistant", "content": answer(teacher(q, teacher_accuracy, rng))},
            ]
        }
        for q in split["sft"]
    ]
    _write_jsonl(paths["sft"], conversations)
    for name in ("train", "heldout"):
        prompts = [{"prompt": question(list(q)), "answer": str(max(q))} for q in split[name]]
        _write_jsonl(paths[name], prompts)
    texts = [question(list(q)) + " " + answer(max(q)) for q in every]
    paths["tokenizer"] = train_digit_tokenizer(texts, out / "tokenizer")
    return paths


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def train_digit_tokenizer(texts: list[str], output_dir: Path, vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer of `texts` in which every digit is a token of its own (so a
    number is read digit by digit), with BOS/EOS and the example chat template."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    return train_tokenizer(texts, output_dir, vocab_size, pre_tokenizer=split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder for the task's files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-accuracy", type=float, default=1 / 3)
    args = parser.parse_args()
    paths = make_task(args.output, args.seed, teacher_accuracy=args.teacher_accuracy)
    for name, path in paths.items():
        print(f"{name:10s} {path}")


if __name__ == "__main__":
    main()
