"""Packed SFT samples: whole conversations, first-fit-decreasing packed into fixed-length samples.

An `SFTDataset` is one split of one chat prefix (`chat_shards.ChatIndexedDataset`). Its split's
conversations are packed once (`sft_packing.first_fit_decreasing`) into samples of
`sequence_length` tokens; one epoch is every packed sample once, in an order shuffled afresh for
each epoch (seeded), and as many epochs are indexed as the requested samples need. The packing
and the order are cached like the GPT indices (`index_cache.IndexCache`, keyed by everything
they depend on), so every rank and every later run maps the same files.

A sample holds each of its conversations whole, one after the other, then padding:

- `tokens` the conversation's ids, `labels` the next id within the same conversation;
- `loss_mask` the mask of the token a label position predicts (1 on assistant tokens), 0 on a
  conversation's last position (nothing follows it there) and on padding;
- `position_ids` restarting at 0 with each conversation, `document_ids` the conversation's
  place in the sample (padding has one of its own), so attention stays inside a conversation.

A conversation longer than the sample is dropped, or, with `truncate`, cut to the sample
length; either way it is counted (`dropped`, `truncated`) for the trainer to report.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.chat_shards import ChatIndexedDataset
from pipeline.data.gpt_dataset import SPLIT_NAMES, GPTDatasetConfig
from pipeline.data.index_cache import (
    CacheNotWritableError,
    IndexCache,
    remap,
    state_without_mapped,
)
from pipeline.data.sft_packing import PackedSequences, first_fit_decreasing

__all__ = ["SFT_INDEX_NAMES", "SFTDataset", "SFTDatasetConfig"]

logger = logging.getLogger(__name__)

SFT_INDEX_NAMES = ("offsets", "documents", "dropped", "truncated", "shuffle_index")


@dataclass(kw_only=True)
class SFTDatasetConfig(GPTDatasetConfig):
    """`GPTDatasetConfig` plus what packing adds; the EOD id pads sample tails. The GPT reset
    and EOD flags do not apply: conversations are always separated."""

    truncate: bool = False
    """Cut conversations longer than `sequence_length` to it instead of dropping them."""


class SFTDataset:
    """Packed samples of one split of a chat dataset (see the module docstring). The
    constructor's signature is `GPTDataset`'s, so blends and splits build both alike."""

    def __init__(
        self,
        dataset: ChatIndexedDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        split: str,
        config: GPTDatasetConfig,
    ):
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}, not {split!r}")
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.truncate = bool(getattr(config, "truncate", False))
        self.unique_identifiers = self._identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.unique_key = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self._index_files: dict[str, Path] | None = None
        arrays = self._load_or_build_indices()
        self.packed = PackedSequences(
            arrays["offsets"], arrays["documents"], arrays["dropped"], arrays["truncated"]
        )
        self.shuffle_index = arrays["shuffle_index"]

    def _identifiers(self) -> OrderedDict[str, Any]:
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.split
        ids["random_seed"] = self.config.random_seed
        ids["sequence_length"] = self.config.sequence_length
        ids["split"] = self.config.split
        ids["tokenizer"] = self.config.tokenizer_id
        ids["truncate"] = self.truncate
        ids["num_sequences"] = len(self.dataset)
        ids["sequence_range"] = (
            [int(self.indices[0]), int(self.indices[-1]) + 1] if len(self.indices) else []
        )
        return ids

    # ---- indices --------------------------------------------------------------------------

    def _load_or_build_indices(self) -> dict[str, np.ndarray]:
        if self.config.path_to_cache:
            directory, is_default = Path(self.config.path_to_cache), False
        elif self.dataset_path is not None:
            directory, is_default = Path(self.dataset_path) / "cache" / "SFTDataset_indices", True
        else:
            return self._build_indices()
        cache = IndexCache(
            directory, self.unique_key, type(self).__name__, self.split, SFT_INDEX_NAMES
        )
        try:
            arrays = cache.get_or_build(self._build_indices, self.unique_description)
        except CacheNotWritableError as err:
            if not is_default:
                raise
            logger.warning("%s; packing the %s split in memory", err, self.split)
            return self._build_indices()
        if isinstance(arrays["offsets"].base, np.memmap):
            self._index_files = {name: cache.array_path(name) for name in SFT_INDEX_NAMES}
        return arrays

    def _build_indices(self) -> dict[str, np.ndarray]:
        """The FFD packing of the split, and the order of its samples over the epochs."""
        packed = first_fit_decreasing(
            self.dataset.sequence_lengths,
            self.config.sequence_length,
            self.indices,
            self.truncate,
        )
        per_epoch, wanted = len(packed), self.num_samples
        if per_epoch == 0 and wanted:
            raise ValueError(self._empty_message(packed))
        epochs = 1 if not wanted or not per_epoch else -(-wanted // per_epoch)
        rng = np.random.RandomState(self.config.random_seed)
        order = [rng.permutation(per_epoch) for _ in range(epochs)]
        shuffle_index = np.concatenate(order).astype(np.int64) if order else np.empty(0, np.int64)
        logger.info(
            "packed %s %s: %d conversations into %d samples of %d tokens, %d epoch(s)",
            self.dataset_path,
            self.split,
            len(packed.documents),
            per_epoch,
            self.config.sequence_length,
            epochs,
        )
        return {
            "offsets": packed.offsets,
            "documents": packed.documents,
            "dropped": packed.dropped,
            "truncated": packed.truncated,
            "shuffle_index": shuffle_index,
        }

    def _empty_message(self, packed: PackedSequences) -> str:
        longer = (
            f", {len(packed.dropped)} of them longer than the sequence"
            if len(packed.dropped)
            else ""
        )
        return (
            f"{self.dataset_path}: the {self.split} split holds no conversation that fits "
            f"{self.config.sequence_length} tokens ({len(self.indices)} conversations{longer}), "
            f"but {self.num_samples} {self.split} samples were requested; raise data.seq_length, "
            "set data.sft_truncate = true, or give the split more of the data"
        )

    @property
    def dropped(self) -> int:
        """Conversations of this split left out for being longer than a sample."""
        return len(self.packed.dropped)

    @property
    def truncated(self) -> int:
        """Conversations of this split cut to the sample length (`truncate`)."""
        return len(self.packed.truncated)

    # ---- samples --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int | None) -> dict[str, np.ndarray]:
        """Packed sample `idx` (see the module docstring); None gives sample 0 with no loss."""
        size = len(self)
        if idx is not None and not -size <= idx < size:
            raise IndexError(f"sample {idx} out of range for {size} samples")
        conversations = self.packed.sequence(int(self.shuffle_index[0 if idx is None else idx]))
        sample = self._pack(conversations)
        if idx is None:
            sample["loss_mask"][:] = 0.0
        return sample

    def _pack(self, conversations: np.ndarray) -> dict[str, np.ndarray]:
        seq = self.config.sequence_length
        tokens = np.full(seq, self.config.eod_id, dtype=np.int64)
        labels = np.zeros(seq, dtype=np.int64)
        loss_mask = np.zeros(seq, dtype=np.float32)
        position_ids = np.zeros(seq, dtype=np.int64)
        document_ids = np.full(seq, len(conversations), dtype=np.int64)
        start = 0
        for k, conversation in enumerate(conversations.tolist()):
            length = min(int(self.dataset.sequence_lengths[conversation]), seq)
            ids = self.dataset.get(conversation, 0, length).astype(np.int64)
            mask = self.dataset.mask(conversation, 0, length)
            end = start + len(ids)
            tokens[start:end] = ids
            labels[start : end - 1] = ids[1:]
            loss_mask[start : end - 1] = mask[1:]
            position_ids[start:end] = np.arange(len(ids))
            document_ids[start:end] = k
            start = end
        position_ids[start:] = np.arange(seq - start)
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "document_ids": document_ids,
        }

    # ---- pickling (DataLoader workers map the cached files again) -------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = state_without_mapped(self.__dict__, self._index_files)
        if self._index_files is not None:
            state["packed"] = None  # rebuilt from the mapped files
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        remap(self, self._index_files)
        if self._index_files is not None:
            names = ("offsets", "documents", "dropped", "truncated")
            self.packed = PackedSequences(*(getattr(self, n) for n in names))
