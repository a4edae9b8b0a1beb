"""GPT pre-training samples from an indexed dataset, in megatron-core 0.16.1's exact order.

A `GPTDataset` serves fixed-length samples cut from the concatenation of one split's sequences,
repeated over as many epochs as the requested number of samples needs. Three index arrays,
built once (`sample_index.py`) and cached, make every sample an O(1) lookup:

- document index: the split's sequence ids tiled over the epochs and shuffled (int32);
- sample index: for each sample boundary, (position in the document index, token offset);
- shuffle index: a permutation of the samples.

Everything here reproduces megatron-core's `GPTDataset` (docs/file_layouts.md, "Training samples"):
the same split rounding, epoch count, separate final epoch, random stream, dtypes, partial
last sample (including its float32 rounding) and masks, so a run can switch between the two
mid-way. Deliberate differences: a split with no tokens is refused instead of looping forever
(NVIDIA/Megatron-LM#957); the cache key also covers `add_extra_token_to_sequence`, the
effective drop-last flag, the sequence count and the split's sequence range (Megatron silently
reuses stale caches); the
cache is committed atomically and built once per cache directory rather than once per job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.data.index_cache import (
    CacheNotWritableError,
    IndexCache,
    remap,
    state_without_mapped,
)
from pipeline.data.indexed import IndexedDataset, normalize_prefix
from pipeline.data.sample_index import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    plan_epochs,
)

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
# Megatron's pad id when the tokenizer has no usable one: never a real token id.
NO_PAD_ID = -1
_INT32_MAX = np.iinfo(np.int32).max

SplitMatrix = list[tuple[float, float] | None]


class LowLevelDataset(Protocol):
    """What a GPTDataset reads from: per-sequence lengths and token slices."""

    sequence_lengths: np.ndarray

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...

    def __len__(self) -> int: ...


@dataclass(kw_only=True)
class GPTDatasetConfig:
    """How samples are cut and shaped; field names follow megatron-core's `GPTDatasetConfig`."""

    sequence_length: int
    """Tokens per sample (`--seq-length`)."""
    eod_id: int
    """The end-of-document token id (reset flags and `eod_mask_loss` look for it)."""
    tokenizer_id: str
    """Identifies the tokenizer in the cache key (e.g. its path or hash)."""
    random_seed: int = 1234
    """Seeds the document and sample shuffles (`--seed`)."""
    split: str | None = "969,30,1"
    """Train/valid/test weights (`--split`); None when each split has its own blend."""
    add_extra_token_to_sequence: bool = True
    """Read sequence_length + 1 tokens so inputs and labels both have sequence_length tokens."""
    reset_position_ids: bool = False
    """Restart position ids after every EOD (`--reset-position-ids`)."""
    reset_attention_mask: bool = False
    """Stop attention across EOD tokens (`--reset-attention-mask`)."""
    eod_mask_loss: bool = False
    """Give EOD input positions zero loss weight (`--eod-mask-loss`)."""
    create_attention_mask: bool = True
    """Return the (1, S, S) causal mask (off: `--no-create-attention-mask-in-dataloader`)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the padded last sample of the valid split (the other splits always drop it)."""
    path_to_cache: str | None = None
    """Index cache directory (`--data-cache-path`); None: `{prefix}/cache/GPTDataset_indices`."""
    pad_id: int | None = None
    """The tokenizer's pad id; None, or equal to the EOD id, means none (-1 internally)."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_length, int) or self.sequence_length < 1:
            raise ValueError(
                f"sequence_length must be a positive integer, not {self.sequence_length!r}"
            )
        if not 0 <= self.random_seed < 2**32:
            raise ValueError(f"random_seed must be in [0, 2**32), not {self.random_seed}")
        if self.split is not None:
            parse_split(self.split)  # fail early on a malformed split

    @property
    def effective_pad_id(self) -> int:
        """The pad id samples use: the tokenizer's when it is distinct from EOD, else -1."""
        if self.pad_id is None or self.pad_id == self.eod_id:
            return NO_PAD_ID
        return self.pad_id

    @property
    def split_matrix(self) -> SplitMatrix | None:
        return None if self.split is None else parse_split(self.split)


# ------------------------------------------------------------------------------------- splits


def parse_split(split: str) -> SplitMatrix:
    """Turn a split string ("969,30,1", "98/2/0", ...) into train/valid/test bookends.

    The numbers are read with the regex `[.0-9]+`, padded with zeros to three, normalised to sum
    1 and accumulated from the integer 0 (so the matrix prints as Megatron's does). A split of
    zero width is None: it is not built.
    """
    try:
        weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    except ValueError as err:
        raise ValueError(f"split {split!r}: {err}") from err
    if len(weights) > len(SPLIT_NAMES):
        raise ValueError(f"split {split!r}: at most three weights (train, valid, test)")
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = float(np.sum(np.array(weights, dtype=np.float64)))
    if not total > 0:
        raise ValueError(f"split {split!r}: the weights must not all be zero")
    normalized = (np.array(weights, dtype=np.float64) / total).tolist()
    matrix: SplitMatrix = []
    low: float = 0
    for weight in normalized:
        high = low + weight
        matrix.append((low, high) if high > low else None)
        low = high
    return matrix


def split_sequence_indices(
    split_matrix: SplitMatrix, num_sequences: int
) -> list[np.ndarray | None]:
    """The sequence ids of each split: `[round(lo*N), round(hi*N))` with Python's banker's
    rounding, no correction (so a narrow split can be empty), or None for a missing split."""
    dtype = np.int32 if num_sequences <= _INT32_MAX else np.int64
    result: list[np.ndarray | None] = []
    for bounds in split_matrix:
        if bounds is None:
            result.append(None)
            continue
        begin = int(round(bounds[0] * float(num_sequences)))
        end = int(round(bounds[1] * float(num_sequences)))
        result.append(np.arange(begin, end, dtype=dtype))
    return result


# ------------------------------------------------------------------------------------- masks


def ltor_masks_and_position_ids(
    tokens: np.ndarray,
    eod_id: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Left-to-right attention mask ((1, S, S) bool, True = masked), loss mask and positions.

    With the reset flags every EOD closes a document: positions restart after it, and tokens
    after it cannot attend to it or anything before it.
    """
    size = len(tokens)
    is_eod = tokens == eod_id
    loss_mask = np.ones(size, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(size, dtype=np.int64)
    if reset_position_ids:
        # Each position minus the first position of its document (the one after the last EOD).
        starts = np.zeros(size, dtype=np.int64)
        starts[1:] = np.where(is_eod[:-1], position_ids[1:], 0)
        position_ids = position_ids - np.maximum.accumulate(starts)
    attention_mask = None
    if create_attention_mask:
        attention_mask = np.triu(np.ones((size, size), dtype=bool), k=1)
        if reset_attention_mask:
            document = np.concatenate(([0], np.cumsum(is_eod[:-1])))
            attention_mask |= document[:, None] != document[None, :]
        attention_mask = attention_mask[None]
    return attention_mask, loss_mask, position_ids


# ----------------------------------------------------------------------------------- dataset


class GPTDataset:
    """Samples of one split of one low-level dataset (megatron-core's `GPTDataset`).

    `dataset` is any object with `sequence_lengths`, `get(i, offset, length)` and `len()`;
    `dataset_path` is its prefix (None for generated data, which is then cached only with
    `config.path_to_cache`); `indices` the split's sequence ids, a contiguous increasing range
    (the cache key records its ends); `num_samples` the samples wanted (None: one epoch).
    `len()` may exceed `num_samples`: whole epochs are indexed.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        split: str,
        config: GPTDatasetConfig,
    ):
        if split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {SPLIT_NAMES}, not {split!r}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, not {num_samples}")
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.add_extra = int(config.add_extra_token_to_sequence)
        self.drop_last = split != "valid" or config.drop_last_partial_validation_sequence
        self.pad_id = config.effective_pad_id
        self.unique_identifiers = self._identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self.unique_key = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self._index_files: dict[str, Path] | None = None
        arrays = self._load_or_build_indices()
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._cacheable_masks = not (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        )
        self._mask_cache: tuple[np.ndarray | None, np.ndarray, np.ndarray] | None = None

    # --------------------------------------------------------------------------- identity

    def _identifiers(self) -> OrderedDict[str, Any]:
        """Megatron's description keys in its order, then what Megatron forgets to key on."""
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = self.dataset_path
        ids["num_samples"] = self.num_samples
        ids["index_split"] = self.split
        ids["random_seed"] = self.config.random_seed
        ids["sequence_length"] = self.config.sequence_length
        ids["split"] = self.config.split
        ids["split_matrix"] = self.config.split_matrix
        ids["tokenizer"] = self.config.tokenizer_id
        ids["add_extra_token_to_sequence"] = self.config.add_extra_token_to_sequence
        ids["drop_last_partial_sequence"] = self.drop_last
        ids["num_sequences"] = len(self.dataset)
        # The split's sequences themselves, so a split_matrix override never shares a key.
        ids["sequence_range"] = (
            [int(self.indices[0]), int(self.indices[-1]) + 1] if len(self.indices) else []
        )
        return ids

    # --------------------------------------------------------------------------- indices

    def _cache_directory(self) -> tuple[Path | None, bool]:
        """Where the indices are cached and whether that is the default place."""
        if self.config.path_to_cache:
            return Path(self.config.path_to_cache), False
        if self.dataset_path is None:
            return None, False
        return Path(self.dataset_path) / "cache" / f"{type(self).__name__}_indices", True

    def _load_or_build_indices(self) -> dict[str, np.ndarray]:
        directory, is_default = self._cache_directory()
        if directory is None:
            return self._build_indices()
        cache = IndexCache(directory, self.unique_key, type(self).__name__, self.split, INDEX_NAMES)
        try:
            arrays = cache.get_or_build(self._build_indices, self.unique_description)
        except CacheNotWritableError as err:
            if not is_default:
                raise
            logger.warning("%s; building the %s indices in memory", err, self.split)
            return self._build_indices()
        if isinstance(arrays["sample_index"].base, np.memmap):
            self._index_files = {name: cache.array_path(name) for name in INDEX_NAMES}
        return arrays

    def _build_indices(self) -> dict[str, np.ndarray]:
        """The three indices, from one RandomState consumed in Megatron's order."""
        config = self.config
        lengths = self.dataset.sequence_lengths
        tokens = int(lengths[self.indices].sum(dtype=np.int64)) if len(self.indices) else 0
        wanted = self.num_samples
        if tokens == 0 and wanted:
            raise ValueError(self._empty_split_message())
        # A split with no tokens and no samples asked of it (a small dataset's test split) is
        # an empty dataset: one epoch of nothing.
        plan = plan_epochs(
            tokens, wanted if tokens else None, config.sequence_length, self.add_extra
        )
        rng = np.random.RandomState(config.random_seed)
        document_index = build_document_index(
            self.indices, plan.num_epochs, rng, plan.separate_final_epoch
        )
        sample_index = build_sample_index(
            lengths,
            document_index,
            config.sequence_length,
            plan.num_epochs,
            tokens,
            self.drop_last,
            self.add_extra,
        )
        total = len(sample_index) - 1
        first = plan.samples_before_final_epoch if plan.separate_final_epoch else total
        shuffle_index = build_shuffle_index(first, total, rng)
        logger.info(
            "built %s %s indices: %d samples over %d epoch(s)",
            self.dataset_path or type(self).__name__,
            self.split,
            total,
            plan.num_epochs,
        )
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def _empty_split_message(self) -> str:
        where = (
            f"sequences [{int(self.indices[0])}, {int(self.indices[-1]) + 1})"
            if len(self.indices)
            else "no sequences"
        )
        return (
            f"{self.dataset_path or type(self).__name__}: the {self.split} split ({where} of "
            f"{len(self.dataset)}, split {self.config.split!r}) holds no tokens, but "
            f"{self.num_samples} {self.split} samples were requested. Choose a --split that gives "
            f"the {self.split} split more of the data (or request no {self.split} samples)."
        )

    # --------------------------------------------------------------------------- samples

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, idx: int | None) -> dict[str, np.ndarray]:
        """Sample `idx` as numpy arrays; None gives sample 0 with zero loss (batch padding)."""
        text = self._sample_tokens(0 if idx is None else idx)
        if self.add_extra:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = self.pad_id
        attention_mask, loss_mask, position_ids = self._masks(tokens)
        loss_mask[labels == self.pad_id] = 0.0
        tokens[tokens == self.pad_id] = 0
        labels[labels == self.pad_id] = 0
        if idx is None:
            loss_mask[:] = 0.0
        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _masks(self, tokens: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Masks and positions; without reset/EOD flags they are the same for every sample, so
        they are computed once (the attention mask is then shared: do not modify it)."""
        config = self.config
        if not self._cacheable_masks:
            return ltor_masks_and_position_ids(
                tokens,
                config.eod_id,
                config.reset_position_ids,
                config.reset_attention_mask,
                config.eod_mask_loss,
                config.create_attention_mask,
            )
        if self._mask_cache is None:
            self._mask_cache = ltor_masks_and_position_ids(
                tokens, config.eod_id, False, False, False, config.create_attention_mask
            )
        attention_mask, loss_mask, position_ids = self._mask_cache
        return attention_mask, loss_mask.copy(), position_ids.copy()

    def _sample_tokens(self, idx: int) -> np.ndarray:
        """The S+X token ids of sample `idx` (int64), right-padded with the pad id if short."""
        size = len(self)
        if not -size <= idx < size:
            raise IndexError(f"sample {idx} out of range for {size} samples")
        j = int(self.shuffle_index[idx])
        first, first_offset = (int(v) for v in self.sample_index[j])
        last, last_offset = (int(v) for v in self.sample_index[j + 1])
        get, doc = self.dataset.get, self.document_index
        if first == last:
            parts = [
                get(int(doc[first]), first_offset, last_offset - first_offset + self.add_extra)
            ]
        else:
            parts = [get(int(doc[first]), first_offset)]
            parts += [get(int(doc[p])) for p in range(first + 1, last)]
            parts.append(get(int(doc[last]), 0, last_offset + self.add_extra))
        wanted = self.config.sequence_length + self.add_extra
        text = np.full(wanted, self.pad_id, dtype=np.int64)
        position = 0
        for part in parts:
            text[position : position + len(part)] = part
            position += len(part)
        return text

    # --------------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict[str, Any]:
        state = state_without_mapped(self.__dict__, self._index_files)
        state["_mask_cache"] = None  # the attention mask alone can be S*S bytes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        remap(self, self._index_files)


# ----------------------------------------------------------------------------------- building


def build_gpt_datasets(
    prefix: str,
    config: GPTDatasetConfig,
    num_samples: Sequence[int | None],
    split_matrix: SplitMatrix | None = None,
) -> list[GPTDataset | None]:
    """Train, valid and test GPTDatasets of one indexed dataset, split by `config.split`.

    `num_samples` holds the samples wanted per split (None: one epoch). `split_matrix` overrides
    the config's split (e.g. `[None, (0.0, 1.0), None]` to use all of a prefix for one split).
    A split of zero width is None.
    """
    if len(num_samples) != len(SPLIT_NAMES):
        raise ValueError(f"num_samples needs one entry per split {SPLIT_NAMES}, got {num_samples}")
    prefix = normalize_prefix(prefix)
    low_level = IndexedDataset(prefix)
    return build_splits(low_level, prefix, config, num_samples, split_matrix, GPTDataset)


def build_splits(
    low_level: LowLevelDataset,
    dataset_path: str | None,
    config: GPTDatasetConfig,
    num_samples: Sequence[int | None],
    split_matrix: SplitMatrix | None,
    cls: type[GPTDataset],
) -> list[GPTDataset | None]:
    """One `cls` per split of `low_level` that has a width in the split matrix.

    When an explicit `split_matrix` differs from the config's split, that split string does not
    apply, so the datasets' config says None there, as Megatron's per-split datasets do.
    """
    matrix = config.split_matrix if split_matrix is None else list(split_matrix)
    if matrix is None:
        raise ValueError("config.split is None: pass a split_matrix")
    if config.split is not None and matrix != config.split_matrix:
        config = dataclasses.replace(config, split=None)
    datasets: list[GPTDataset | None] = []
    for name, indices, wanted in zip(
        SPLIT_NAMES, split_sequence_indices(matrix, len(low_level)), num_samples
    ):
        if indices is None:
            datasets.append(None)
        else:
            datasets.append(cls(low_level, dataset_path, indices, wanted, name, config))
    return datasets
