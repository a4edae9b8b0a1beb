"""A small chat corpus made from the embedded default corpus, for trying supervised fine-tuning.

Each conversation asks about functions and classes of one standard-library module: the user
names one ("What does `json.dumps` do?"), the assistant answers with the first paragraph of its
docstring, and some conversations go on for a few more turns or open with a system message. The
lines are OpenAI-style `{"messages": [...]}`, what `pipe preprocess --chat` reads.

    python -m pipeline.examples.stdlib_chat --corpus runs/sft/data/stdlib_docs.jsonl \\
        --output runs/sft/data/chat.jsonl

With `--preference` it writes preference pairs instead, what `pipe preprocess --preference`
reads: `{"prompt": question, "chosen": the right docstring paragraph, "rejected": another
function's}`, one pair per documented name.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

from pipeline.common.atomic import atomic_file

SYSTEM = "You answer questions about Python's standard library in a sentence or two."
QUESTIONS = ("What does `{}` do?", "Explain `{}`.", "What is `{}` for?", "And `{}`?")
MAX_ANSWER_CHARS = 400

# The template the example tokenizer carries (stdlib_corpus.train_tokenizer): Llama 3's shape
# with the tokenizer's own two special tokens, the assistant's turns marked for the loss mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def answers(text: str) -> Iterator[tuple[str, str]]:
    """(qualified name, first paragraph) of each documented name in a corpus document."""
    for block in text.split("\n\n"):
        name, _, doc = block.partition("\n")
        public = not any(part.startswith("_") for part in name.split("."))
        if name and " " not in name and public and doc.strip():
            yield name, doc.strip().split("\n\n")[0][:MAX_ANSWER_CHARS]


def conversations(corpus: str | os.PathLike, seed: int = 0) -> Iterator[dict]:
    """One to four question-and-answer turns per module, a system message on a third."""
    rng = random.Random(seed)
    with open(corpus, encoding="utf-8") as lines:
        for line in lines:
            module = json.loads(line)["id"].removesuffix(".py").replace("/", ".")
            pairs = list(answers(json.loads(line)["text"]))
            if not pairs or any(part.startswith("_") for part in module.split(".")):
                continue
            rng.shuffle(pairs)
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
            for turn, (name, doc) in enumerate(pairs[: rng.randint(1, 4)]):
                question = QUESTIONS[3 if turn else rng.randrange(3)]
                messages.append({"role": "user", "content": question.format(f"{module}.{name}")})
                messages.append({"role": "assistant", "content": doc})
            yield {"messages": messages}


def preference_pairs(corpus: str | os.PathLike, seed: int = 0) -> Iterator[dict]:
    """One pair per documented public name: the question about it, its own first docstring
    paragraph (chosen) and the paragraph of another name of the same module (rejected)."""
    rng = random.Random(seed)
    with open(corpus, encoding="utf-8") as lines:
        for line in lines:
            module = json.loads(line)["id"].removesuffix(".py").replace("/", ".")
            pairs = list(answers(json.loads(line)["text"]))
            if len(pairs) < 2 or any(part.startswith("_") for part in module.split(".")):
                continue
            for k, (name, doc) in enumerate(pairs):
                other = pairs[(k + rng.randrange(1, len(pairs))) % len(pairs)][1]
                if other == doc:
                    continue
                question = QUESTIONS[rng.randrange(3)].format(f"{module}.{name}")
                yield {"prompt": question, "chosen": doc, "rejected": other}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="stdlib_docs.jsonl (stdlib_corpus)")
    parser.add_argument("--output", required=True, help="the chat JSONL file to write")
    parser.add_argument(
        "--preference",
        action="store_true",
        help="write chosen/rejected pairs (pipe preprocess --preference) instead",
    )
    args = parser.parse_args()
    count = 0
    records = preference_pairs if args.preference else conversations
    with atomic_file(Path(args.output), "w", encoding="utf-8") as out:
        for record in records(args.corpus):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    what = "preference pairs" if args.preference else "conversations"
    print(f"chat: {count} {what} about the standard library -> {args.output}")


if __name__ == "__main__":
    main()
