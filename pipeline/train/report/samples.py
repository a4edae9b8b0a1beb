"""A few greedy generations during training (`training.sample_prompts` every `sample_interval`
iterations), logged as text next to the loss: reading what the model writes is the first check
of a run.

Generation here is the plain quadratic loop (the whole sequence through the model per token, no
cache; `pipeline.core.model.greedy`, whose token choice `pipe generate --greedy` shares): a
handful of short prompts, on the training model itself. It runs where the model is one
ordinary module, a one-device run; under a parallel layout the samples are skipped with one
warning (`pipe generate` on a checkpoint works for any layout).

An SFT run (`chat`) asks its prompts as a user's message: each is rendered through the
tokenizer's chat template with the assistant's header after it (`add_generation_prompt`), and
generation also stops at the template's end-of-sequence token; a tokenizer without a template
gets its prompts continued as plain text, after one warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.core.model.greedy import greedy_without_cache
from pipeline.train.config.schema import ConfigError

log = logging.getLogger(__name__)


def sample_tokenizer_path(configured: str | None, fingerprint: dict[str, Any] | None) -> Path:
    """The tokenizer to encode prompts with: `data.tokenizer`, else the one the data's manifest
    recorded; `ConfigError` when neither is known (mock data)."""
    if configured is not None:
        return Path(configured)
    files = (fingerprint or {}).get("files") or []
    if files and Path(files[0]["path"]).exists():
        return Path(files[0]["path"]).parent
    raise ConfigError(
        "training.sample_prompts needs the data's tokenizer: set data.tokenizer "
        "(mock data and a manifest whose tokenizer files moved have none)"
    )


class TrainingSamples:
    """Greedy continuations of fixed prompts, as `{"sample_i": text}` for the metrics log."""

    def __init__(
        self, prompts: list[str], tokenizer_path: Path, max_new_tokens: int, chat: bool = False
    ) -> None:
        from pipeline.tokenizer.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.prompts = prompts
        self.chat = False
        ends = {self.tokenizer.eod} - {None}
        texts = prompts
        if chat:
            texts, ends = self._chat_prompts(prompts, tokenizer_path, ends)
        self.encoded = self.tokenizer.encode_batch(texts)
        self.ends = frozenset(ends)
        self.max_new_tokens = max_new_tokens
        self._warned = False

    def _chat_prompts(self, prompts: list[str], path: Path, ends: set) -> tuple[list[str], set]:
        """The prompts as a user's turn rendered by the chat template, and the end tokens with
        the template's end-of-sequence token added (the plain prompts without a template)."""
        from pipeline.tokenizer.chat_template import eos_token_ids, load_chat_template

        template = load_chat_template(path)
        if template is None:
            log.warning("%s has no chat template: sample prompts are continued as plain text", path)
            return prompts, ends
        self.chat = True
        rendered = [
            template.render([{"role": "user", "content": p}], add_generation_prompt=True).text
            for p in prompts
        ]
        return rendered, ends | eos_token_ids(template, self.tokenizer)

    def generate(self, model: torch.nn.Module, device: torch.device, one_device: bool) -> dict:
        """The samples (empty, after one warning, when the model is split over devices)."""
        if not one_device:
            if not self._warned:
                log.warning("training samples run on one device only; skipped in this layout")
                self._warned = True
            return {}
        was_training = model.training
        model.eval()
        try:
            return {
                f"sample_{i}": prompt
                + ("\n" if self.chat else "")
                + self.tokenizer.decode(self._greedy(model, ids, device))
                for i, (prompt, ids) in enumerate(zip(self.prompts, self.encoded))
            }
        finally:
            model.train(was_training)

    def _greedy(self, model: torch.nn.Module, prompt: list[int], device: torch.device) -> list:
        """The continuation of `prompt` up to (not including) an end token."""
        prompt = prompt or [self.tokenizer.eod or 0]
        output = greedy_without_cache(model, prompt, self.max_new_tokens, self.ends, device)
        return output[:-1] if output and output[-1] in self.ends else output
