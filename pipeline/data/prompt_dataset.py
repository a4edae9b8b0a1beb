"""GRPO's prompts as a dataset (`data.kind = "grpo"`): `PromptRecord`, one prompt rendered and
tokenized (by `pipeline.data.prompt_files`, which reads the JSONL files), and `PromptDataset`,
one split of them served in a seeded order per epoch: `num_samples` samples, each epoch every
prompt once in an order shuffled afresh, each sample the prompt's ids padded to the longest
prompt of the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PromptDataset", "PromptRecord", "PromptSet"]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its rendered text and token ids, the line's other fields (what rewards read),
    where it came from ("path:line"), and the prompt as written (what a user's reward function
    is handed, as TRL hands it)."""

    tokens: tuple[int, ...]
    fields: dict[str, Any]
    source: str
    text: str
    prompt: str | list = ""


@dataclass
class PromptSet:
    """The prompts of a file, and how many were skipped, by reason."""

    records: list[PromptRecord]
    skipped: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------ the dataset


class PromptDataset:
    """`num_samples` samples over `records`, epoch after epoch, each epoch a fresh seeded
    permutation (numpy RandomState(seed)). Sample i is a dict of numpy values: `prompt` (the ids,
    int64, padded with 0 to the longest record), `prompt_length`, `prompt_index` (into
    `records`) and `sample_index` (i); `pipeline.data.loader.build_data_loader` batches them."""

    def __init__(self, records: list[PromptRecord], num_samples: int, seed: int):
        if num_samples and not records:
            raise ValueError(f"no prompts to draw {num_samples} samples from")
        self.records = records
        self.num_samples = int(num_samples)
        per_epoch = len(records)
        epochs = -(-self.num_samples // per_epoch) if per_epoch else 0
        rng = np.random.RandomState(seed)
        order = [rng.permutation(per_epoch) for _ in range(epochs)]
        self.order = np.concatenate(order)[: self.num_samples] if order else np.empty(0, np.int64)
        self.width = max((len(r.tokens) for r in records), default=0)

    def __len__(self) -> int:
        return self.num_samples

    def prompt_index(self, idx: int) -> int:
        """The record sample `idx` draws."""
        return int(self.order[idx])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        index = self.prompt_index(idx)
        tokens = self.records[index].tokens
        prompt = np.zeros(self.width, dtype=np.int64)
        prompt[: len(tokens)] = tokens
        return {
            "prompt": prompt,
            "prompt_length": np.int64(len(tokens)),
            "prompt_index": np.int64(index),
            "sample_index": np.int64(idx),
        }
