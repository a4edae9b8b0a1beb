"""Generated GPT data for trying the pipeline without a corpus (megatron-core's mock data).

`MockGPTLowLevelDataset` is 100,000 sequences whose lengths come from a fixed random generator
and whose tokens are `1, 2, ..., L-1` (modulo the vocabulary) followed by EOD, exactly as
megatron-core generates them, so `MockGPTDataset` yields the samples of Megatron's
`--mock-data` in the same order. Tokens are computed on demand: nothing is stored but the
lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pipeline.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_splits

MOCK_SPLIT = "1,1,1"


class MockGPTLowLevelDataset:
    """100,000 synthetic sequences; sequence i is `(arange(L_i - 1) + 1) % vocab_size, eod_id`."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod_id: int):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, not {vocab_size}")
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of sequence i from token `offset` (to its end by default), int64."""
        total = int(self.sequence_lengths[i])
        stop = total if length is None else min(total, offset + length)
        positions = np.arange(offset, max(stop, offset), dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == total - 1] = self.eod_id
        return tokens


class MockGPTDataset(GPTDataset):
    """A GPTDataset over `MockGPTLowLevelDataset`; cached only with `config.path_to_cache`."""


def build_mock_gpt_datasets(
    config: GPTDatasetConfig, num_samples: Sequence[int | None], vocab_size: int
) -> list[GPTDataset | None]:
    """Train, valid and test mock datasets; the split is always "1,1,1", as in Megatron."""
    if len(num_samples) != 3:
        raise ValueError(f"num_samples needs one entry per split, got {num_samples}")
    config = dataclasses.replace(config, split=MOCK_SPLIT)
    low_level = MockGPTLowLevelDataset(vocab_size, config.eod_id)
    return build_splits(low_level, None, config, num_samples, None, MockGPTDataset)
