"""GRPO's prompt files read with a tokenizer's chat template: the reader is
`pipeline.data.prompt_files` (training reads it from there); this gives it the rendering
`pipe generate --chat` and `pipe serve` use (`chat_prompt`: the template with the assistant's
turn opened; without a template, `role: content` lines)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from typing import Any

from pipeline.data import prompt_files
from pipeline.data.prompt_dataset import PromptSet
from pipeline.data.prompt_files import PromptFileError, Render, split_records
from pipeline.tokenizer.chat_template import ChatTemplate, chat_prompt

__all__ = ["PromptFileError", "read_prompt_splits", "read_prompts", "renderer", "split_records"]


def renderer(template: ChatTemplate | str | None) -> Render:
    """The prompt renderer of `template` (a chat template, its source, or None)."""
    return partial(chat_prompt, template=template, add_generation_prompt=True)


def read_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    template: ChatTemplate | str | None,
    max_prompt_tokens: int | None = None,
) -> PromptSet:
    """`prompt_files.read_prompts` with the prompts rendered by `template`."""
    return prompt_files.read_prompts(path, tokenizer, renderer(template), max_prompt_tokens)


def read_prompt_splits(
    blend: str | None,
    split: str,
    per_split: Sequence[str | None],
    tokenizer: Any,
    template: ChatTemplate | str | None,
    max_prompt_tokens: int | None = None,
) -> list[PromptSet | None]:
    """`prompt_files.read_prompt_splits` with the prompts rendered by `template`."""
    render = renderer(template)
    return prompt_files.read_prompt_splits(
        blend, split, per_split, tokenizer, render, max_prompt_tokens
    )
