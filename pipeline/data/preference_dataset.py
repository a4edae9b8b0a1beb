"""Preference samples for DPO: one sample is one chosen/rejected pair, whole.

`pipe preprocess --preference` writes two chat datasets per output prefix, pair i being
document i of both: `{prefix}_chosen_document` and `{prefix}_rejected_document`, each with its
loss mask (pipeline.data.chat_shards). `PreferencePairs` opens the four files and refuses two
sides with different numbers of pairs. A `PreferenceDataset` is one split of the pairs (the
constructor's signature is `GPTDataset`'s, so blends and splits build it alike); one epoch is
every pair of the split once, in an order shuffled afresh for each epoch (seeded).

A sample holds, for side 0 (chosen) and side 1 (rejected), `[2, seq]` arrays: `tokens`,
`labels` (the next id), `loss_mask` (the mask of the token a label predicts: 1 on the reply),
`position_ids`; a side longer than `seq + 1` tokens is cut to it. `pairs` is 1 (what the DPO
loss is a mean over); `pair` the pair's index in the prefix, and, once a reference pass has
attached them (`attach_reference`), `ref_logps` the reference's log-probabilities of both sides.
"""

from __future__ import annotations

import os

import numpy as np

from pipeline.data.chat_shards import ChatIndexedDataset
from pipeline.data.gpt_dataset import SPLIT_NAMES, GPTDatasetConfig
from pipeline.data.indexed import normalize_prefix

__all__ = ["PreferenceDataset", "PreferencePairs", "preference_prefix"]

SIDES = ("chosen", "rejected")


def preference_prefix(path: str | os.PathLike) -> str:
    """The output prefix of `pipe preprocess --preference` from it or one of its datasets."""
    text = normalize_prefix(path)
    for suffix in ("_chosen_document", "_rejected_document"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


class PreferencePairs:
    """The pairs of a preference prefix: `side(s)` is the chat dataset of side s (0 chosen,
    1 rejected). Pickles as its prefix."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = preference_prefix(prefix)
        try:
            self.sides = [ChatIndexedDataset(f"{self.prefix}_{s}_document") for s in SIDES]
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"{err}; DPO data is the output prefix of `pipe preprocess --preference`"
            ) from None
        if len(self.sides[0]) != len(self.sides[1]):
            raise ValueError(
                f"{self.prefix}: {len(self.sides[0])} chosen but {len(self.sides[1])} rejected "
                "conversations; pair i must be document i of both"
            )

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self.__init__(prefix)

    def __len__(self) -> int:
        return len(self.sides[0])


class PreferenceDataset:
    """The pairs of one split, in a seeded order per epoch (see the module docstring)."""

    def __init__(
        self,
        dataset: PreferencePairs,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        split: str,
        config: GPTDatasetConfig,
    ):
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}, not {split!r}")
        if num_samples and not len(indices):
            raise ValueError(
                f"{dataset_path}: the {split} split holds no pair, but {num_samples} {split} "
                "samples were requested; change data.split or give the split more pairs"
            )
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int64)
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.reference: np.ndarray | None = None  # [pairs of the prefix, 2], attach_reference
        per_epoch = len(self.indices)
        epochs = 1 if not num_samples or not per_epoch else -(-num_samples // per_epoch)
        rng = np.random.RandomState(config.random_seed)
        order = [rng.permutation(per_epoch) for _ in range(epochs)]
        self.order = np.concatenate(order) if order else np.empty(0, np.int64)

    def attach_reference(self, logps: np.ndarray) -> None:
        """The reference's `[pairs, 2]` log-probabilities of every pair of the prefix."""
        if logps.shape != (len(self.dataset), 2):
            raise ValueError(
                f"reference log-probabilities {logps.shape}: expected ({len(self.dataset)}, 2)"
            )
        self.reference = logps

    def __len__(self) -> int:
        return len(self.order)

    def pair_index(self, idx: int) -> int:
        return int(self.indices[self.order[idx]])

    def __getitem__(self, idx: int | None) -> dict[str, np.ndarray]:
        """Sample `idx`: pair `pair_index(idx)` (None: the first pair, with no loss)."""
        size = len(self)
        if idx is not None and not -size <= idx < size:
            raise IndexError(f"sample {idx} out of range for {size} samples")
        sample = self.pair_sample(self.pair_index(0 if idx is None else idx))
        if idx is None:
            sample["loss_mask"][:] = 0.0
            sample["pairs"] = np.float32(0.0)
        return sample

    def pair_sample(self, pair: int) -> dict[str, np.ndarray]:
        """The sample of pair `pair` of the prefix (whatever the split and order)."""
        sides = [self._side(side, pair) for side in self.dataset.sides]
        sample = {key: np.stack([s[key] for s in sides]) for key in sides[0]}
        sample["pairs"] = np.float32(1.0)
        sample["pair"] = np.int64(pair)
        if self.reference is not None:
            sample["ref_logps"] = self.reference[pair].astype(np.float64)
        return sample

    def _side(self, side: ChatIndexedDataset, pair: int) -> dict[str, np.ndarray]:
        seq = self.config.sequence_length
        length = min(int(side.sequence_lengths[pair]), seq + 1)
        ids = side.get(pair, 0, length).astype(np.int64)
        mask = side.mask(pair, 0, length).astype(np.float32)
        tokens = np.full(seq, self.config.eod_id, dtype=np.int64)
        labels = np.zeros(seq, dtype=np.int64)
        loss_mask = np.zeros(seq, dtype=np.float32)
        n = len(ids) - 1
        tokens[: min(len(ids), seq)] = ids[:seq]
        labels[:n] = ids[1:]
        loss_mask[:n] = mask[1:]
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": np.arange(seq, dtype=np.int64),
        }
