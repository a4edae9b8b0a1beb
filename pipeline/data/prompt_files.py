"""Prompts for GRPO (`data.kind = "grpo"`): a JSONL file of prompts, rendered and tokenized once
when a run starts (no preprocessing step: prompts are few), for `pipeline.data.prompt_dataset`.

A line is a JSON object with `prompt`, either a string (one user turn) or a list of OpenAI-style
messages (`{"role", "content"}`, checked as `pipe preprocess --chat` checks them,
`chat_records.py`), plus whatever fields the rewards read (`answer`, ...). The prompt is rendered
by `render` (the caller's: the tokenizer's chat template with the assistant's turn opened, as
`pipe generate --chat` renders it; `pipeline.preprocess.prompts` gives it one), and encoded
without adding special tokens. A line that cannot be used is a
`PromptFileError` naming its file:line; a prompt longer than `max_prompt_tokens` is skipped and
counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.data.chat_records import BadRecord, check_message, check_text, type_name
from pipeline.data.gpt_dataset import SPLIT_NAMES, parse_split, split_sequence_indices
from pipeline.data.prompt_dataset import PromptRecord, PromptSet

__all__ = ["PromptFileError", "Render", "read_prompt_splits", "read_prompts", "split_records"]

Render = Callable[[list[dict[str, Any]]], str]
"""A prompt's messages -> its text, the assistant's turn opened; raises ValueError (one line)
for messages it cannot render."""

# The arguments a reward function is called with (TRL's convention): a field of these names
# could not be handed to it as well.
RESERVED_FIELDS = ("prompts", "completions", "completion_ids")


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message is one line naming file:line."""


def read_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    render: Render,
    max_prompt_tokens: int | None = None,
) -> PromptSet:
    """Every usable prompt of the JSONL file at `path` (see the module docstring), rendered by
    `render`; `tokenizer` is a `pipeline.tokenizer.tokenizer.TextTokenizer` loaded without
    special tokens. Raises
    PromptFileError (one line) for a bad line, an empty file, or when no prompt is short enough."""
    path = str(path)
    parsed = [(line, *_parse_line(path, line, raw)) for line, raw in _lines(path)]
    if not parsed:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    texts = [_render(path, line, messages, render) for line, _, messages, _ in parsed]
    records, skipped = [], {}
    for (line, prompt, _, fields), text, ids in zip(parsed, texts, tokenizer.encode_batch(texts)):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            reason = f"longer than {max_prompt_tokens} tokens"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        records.append(PromptRecord(tuple(ids), fields, f"{path}:{line}", text, prompt))
    if not records:
        raise PromptFileError(
            f"{path}: all {len(parsed)} prompts are longer than {max_prompt_tokens} tokens"
        )
    return PromptSet(records, skipped)


def _lines(path: str) -> list[tuple[int, str]]:
    """The file's non-blank lines with their 1-based numbers."""
    try:
        with open(path, encoding="utf-8") as f:
            return [(n, raw) for n, raw in enumerate(f, start=1) if raw.strip()]
    except FileNotFoundError:
        raise PromptFileError(f"{path}: prompt file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read the prompt file ({e})") from None


def _parse_line(path: str, line: int, raw: str) -> tuple[str | list, list[dict], dict[str, Any]]:
    """The line's prompt as written, its messages, and its other fields; PromptFileError naming
    path:line for anything wrong."""
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise PromptFileError(f"{path}:{line}: not valid JSON ({e})") from None
    try:
        if not isinstance(record, dict):
            raise BadRecord(f"{type_name(record)}, expected a JSON object with a 'prompt'")
        if "prompt" not in record:
            raise BadRecord("no 'prompt' key")
        reserved = [k for k in RESERVED_FIELDS if k in record]
        if reserved:
            raise BadRecord(f"field '{reserved[0]}' is a name reward functions are called with")
        messages = prompt_messages(record["prompt"])
    except BadRecord as e:
        raise PromptFileError(f"{path}:{line}: {e}") from None
    fields = {k: v for k, v in record.items() if k != "prompt"}
    return record["prompt"], messages, fields


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """The messages of a prompt (a string is one user turn), validated; raises BadRecord naming the
    part at fault. The last turn may not be the assistant's: the reply is what is sampled."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        if not prompt:
            raise BadRecord("'prompt' is empty")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise BadRecord(f"'prompt' is {type_name(prompt)}, expected a string or a list of messages")
    if not prompt:
        raise BadRecord("'prompt' is an empty list of messages")
    messages = [check_message(m, f"prompt[{i}]") for i, m in enumerate(prompt)]
    if messages[-1]["role"] == "assistant":
        last = len(messages) - 1
        raise BadRecord(f"prompt[{last}] is the assistant's: a prompt ends before a reply")
    return messages


def _render(path: str, line: int, messages: list[dict], render: Render) -> str:
    try:
        return render(messages)
    except ValueError as e:  # the template's error (ChatTemplateError), one line
        raise PromptFileError(f"{path}:{line}: chat template: {e}") from None


# ------------------------------------------------------------------------------ splits


def split_records(records: list[PromptRecord], split: str) -> list[list[PromptRecord] | None]:
    """The records of each split (train, valid, test) by Megatron-style proportions ("969,30,1"):
    contiguous ranges in file order, rounded as `GPTDataset` rounds them; None for a split of
    zero weight."""
    ranges = split_sequence_indices(parse_split(split), len(records))
    return [None if r is None else [records[i] for i in r] for r in ranges]


def read_prompt_splits(
    blend: str | None,
    split: str,
    per_split: Sequence[str | None],
    tokenizer: Any,
    render: Render,
    max_prompt_tokens: int | None = None,
) -> list[PromptSet | None]:
    """The prompts of train, valid and test: one file (`blend`, the `data.blend` of a GRPO run)
    cut by `split`, or one file per split (`per_split`: data.train_blend, valid_blend,
    test_blend). A split with no file, or of zero weight, is None."""
    if blend is not None:
        whole = read_prompts(_one_path(blend, "data.blend"), tokenizer, render, max_prompt_tokens)
        return [
            None if part is None else PromptSet(part, dict(whole.skipped) if i == 0 else {})
            for i, part in enumerate(split_records(whole.records, split))
        ]
    names = [f"data.{name}_blend" for name in SPLIT_NAMES]
    return [
        None
        if value is None
        else read_prompts(_one_path(value, name), tokenizer, render, max_prompt_tokens)
        for value, name in zip(per_split, names)
    ]


def _one_path(value: str, name: str) -> str:
    parts = value.split()
    if len(parts) != 1:
        raise PromptFileError(
            f"{name} {value!r}: GRPO prompts are one JSONL file per split, not a weighted blend"
        )
    return parts[0]
