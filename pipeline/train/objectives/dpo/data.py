"""DPO's data: each prefix is the output prefix of `pipe preprocess --preference` and a sample is
one chosen/rejected pair (`pipeline.data.preference_dataset`)."""

from __future__ import annotations

from typing import Any

from pipeline.data.preference_dataset import PreferenceDataset
from pipeline.train.config.schema import TrainConfig
from pipeline.train.objectives.datasets import blend_datasets

__all__ = ["preference_datasets"]


def preference_datasets(cfg: TrainConfig, blend: Any, tok: Any) -> list[Any]:
    """Train, valid and test datasets of preference pairs (None for a split without data)."""
    return blend_datasets(cfg, blend, tok, PreferenceDataset)
