"""Language modelling's data: GPT samples of token shards (`pipeline.data.gpt_dataset`), or, for
supervised fine-tuning, whole conversations of chat shards packed together
(`pipeline.data.sft_dataset`), which carry their own document ids; both through the same blends
and splits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.data.gpt_dataset import GPTDataset
from pipeline.data.sft_dataset import SFTDataset, SFTDatasetConfig
from pipeline.train.config.schema import TrainConfig
from pipeline.train.objectives.datasets import blend_datasets

__all__ = ["gpt_datasets", "long_conversations", "sft_datasets"]


def gpt_datasets(cfg: TrainConfig, blend: Any, tok: Any) -> list[Any]:
    """Train, valid and test GPT datasets of `blend` (None for a split without data)."""
    return blend_datasets(cfg, blend, tok, GPTDataset)


def sft_datasets(cfg: TrainConfig, blend: Any, tok: Any) -> list[Any]:
    """Train, valid and test datasets of packed conversations (`data.sft_truncate` cuts a long
    one to the sample length instead of dropping it)."""
    truncate = cfg.data.sft_truncate
    return blend_datasets(cfg, blend, tok, SFTDataset, SFTDatasetConfig, truncate=truncate)


def long_conversations(cfg: TrainConfig, datasets: Sequence[Any]) -> str | None:
    """One line saying how many SFT conversations were longer than a sample and so dropped or
    truncated, per split (None when none were, or for GPT data)."""
    counts = []
    for name, dataset in zip(("train", "valid", "test"), datasets):
        members = getattr(dataset, "datasets", [dataset])  # a blend's members, or the dataset
        n = sum(getattr(m, "truncated" if cfg.data.sft_truncate else "dropped", 0) for m in members)
        if n:
            counts.append(f"{n} in {name}")
    if not counts:
        return None
    seq = cfg.data.seq_length
    if cfg.data.sft_truncate:
        return f"truncated conversations longer than {seq} tokens to {seq}: {', '.join(counts)}"
    return (
        f"dropped conversations longer than {seq} tokens: {', '.join(counts)}; "
        "data.sft_truncate = true keeps their first tokens instead"
    )
