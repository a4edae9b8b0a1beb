"""Weighted blends of GPT datasets, in megatron-core 0.16.1's exact sample order.

`build_datasets` turns a blend (see `blend_spec`) into the train, valid and test datasets exactly
as megatron-core's `BlendedMegatronDatasetBuilder` does (docs/file_layouts.md, "Training samples"):
each prefix becomes a `GPTDataset` sized with Megatron's target/buffer rule, and a
`BlendedDataset` interleaves them with Megatron's deterministic greedy schedule
(`blending_indices`). SFT runs blend `SFTDataset`s (packed conversations) the same way.
What a run will read from each dataset, before running it, is `blend_description.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.blend_spec import (
    MAX_DATASETS,
    Blend,
    MockData,
    PerSplitBlend,
    all_prefixes,
    check_compatible,
    check_prefixes_exist,
)
from pipeline.data.blending_indices import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from pipeline.data.chat_shards import ChatIndexedDataset
from pipeline.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    GPTDatasetConfig,
    build_splits,
)
from pipeline.data.index_cache import IndexCache, remap, state_without_mapped
from pipeline.data.indexed import (
    IndexedDataset,
    normalize_prefix,
)
from pipeline.data.preference_dataset import (
    SIDES,
    PreferenceDataset,
    PreferencePairs,
    preference_prefix,
)
from pipeline.data.sft_dataset import SFTDataset

logger = logging.getLogger(__name__)

DEFAULT_MID_LEVEL_DATASET_SURPLUS = 0.005
BLENDED_INDEX_NAMES = ("dataset_index", "dataset_sample_index")

# -------------------------------------------------------------------------- weights and sizes


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum in float64, as Megatron's `utils.normalize`."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def samples_per_dataset(
    weights: Sequence[float], size: int, surplus: float = DEFAULT_MID_LEVEL_DATASET_SURPLUS
) -> tuple[list[int], list[int]]:
    """Per dataset, the samples the blend plans to draw (`ceil(size * w)`) and the samples its
    GPTDataset is built for (`ceil(target * (1 + surplus))`), for normalised weights `weights`.

    The buffer leaves room for the greedy schedule drawing a sample or two above the target.
    """
    targets = [int(math.ceil(size * w)) for w in weights]
    buffers = [int(math.ceil(t * (1 + surplus))) for t in targets]
    return targets, buffers


# --------------------------------------------------------------------------- blended dataset


class BlendedDataset:
    """Samples drawn from several datasets by Megatron's blending schedule.

    `weights` are normalised when `size` is given; with `size` None they are per-dataset sample
    counts drawn exhaustively. `blended[k]` is `{"dataset_id": d, **datasets[d][j]}` with d, j
    from the dataset index and dataset sample index. The two index arrays are cached under
    `config.path_to_cache` when it is set (`{md5}-BlendedDataset-{split}-...`), else built in
    memory.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int | None,
        config: GPTDatasetConfig,
        split: str,
        *,
        mid_level_dataset_surplus: float = DEFAULT_MID_LEVEL_DATASET_SURPLUS,
    ):
        _check_blend_members(datasets, weights, size, split)
        self.datasets = list(datasets)
        self.split = split
        self.size = size
        self.config = config
        self.mid_level_dataset_surplus = mid_level_dataset_surplus
        self.weights: list[float] | list[int] = (
            normalize_weights(weights) if size is not None else [int(w) for w in weights]
        )
        self.unique_identifiers = self._identifiers()
        self.unique_description = json.dumps(self.unique_identifiers, indent=4, default=_identify)
        self.unique_key = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self._index_files: dict[str, Path] | None = None
        arrays = self._load_or_build_indices()
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _identifiers(self) -> OrderedDict[str, Any]:
        """Megatron's description keys, in its order."""
        ids: OrderedDict[str, Any] = OrderedDict()
        ids["class"] = type(self).__name__
        ids["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        ids["split"] = self.split
        ids["weights"] = self.weights
        ids["size"] = self.size
        return ids

    def _load_or_build_indices(self) -> dict[str, np.ndarray]:
        if not self.config.path_to_cache:
            return self._build_indices()
        cache = IndexCache(
            self.config.path_to_cache,
            self.unique_key,
            type(self).__name__,
            self.split,
            BLENDED_INDEX_NAMES,
        )
        arrays = cache.get_or_build(self._build_indices, self.unique_description)
        if isinstance(arrays["dataset_index"].base, np.memmap):
            self._index_files = {name: cache.array_path(name) for name in BLENDED_INDEX_NAMES}
        return arrays

    def _build_indices(self) -> dict[str, np.ndarray]:
        """Both index arrays, refused (before anything is cached) when they oversample a dataset."""
        if self.size is not None:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = build_exhaustive_blending_indices(self.weights)
        drawn = np.bincount(dataset_index, minlength=len(self.datasets))
        for d, (count, dataset) in enumerate(zip(drawn.tolist(), self.datasets)):
            if count > len(dataset):
                raise IndexError(
                    f"the {self.split} blend draws {count} samples from dataset {d} "
                    f"({_dataset_name(dataset)}), which has only {len(dataset)}; increase "
                    f"mid_level_dataset_surplus (now {self.mid_level_dataset_surplus}), e.g. "
                    "two- or ten-fold, so the datasets are built with more spare samples"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        size = len(self)
        if not -size <= idx < size:
            raise IndexError(f"sample {idx} out of range for {size} blended samples")
        dataset_id = self.dataset_index[idx]
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}

    def __getstate__(self) -> dict[str, Any]:
        return state_without_mapped(self.__dict__, self._index_files)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        remap(self, self._index_files)


def _identify(obj: Any) -> Any:
    """JSON fallback for the description (objects that carry `unique_identifiers`)."""
    if hasattr(obj, "unique_identifiers"):
        return obj.unique_identifiers
    raise TypeError(f"cannot describe {type(obj).__name__} in a cache key")


def _dataset_name(dataset: Any) -> str:
    path = getattr(dataset, "dataset_path", None)
    return f"{path or type(dataset).__name__}, {getattr(dataset, 'split', '?')} split"


def _check_blend_members(
    datasets: Sequence[Any], weights: Sequence[float], size: int | None, split: str
) -> None:
    """Megatron's BlendedDataset preconditions, as errors that say what is wrong."""
    if len(datasets) != len(weights):
        raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
    if not 1 <= len(datasets) <= MAX_DATASETS:
        raise ValueError(f"a blend holds 1 to {MAX_DATASETS} datasets, not {len(datasets)}")
    if split not in SPLIT_NAMES:
        raise ValueError(f"split must be one of {SPLIT_NAMES}, not {split!r}")
    for dataset in datasets:
        if getattr(dataset, "split", split) != split:
            raise ValueError(f"cannot blend {_dataset_name(dataset)} into the {split} split")
        if type(dataset) is not type(datasets[0]):
            raise ValueError(
                f"cannot blend {type(dataset).__name__} with {type(datasets[0]).__name__}"
            )
    for dataset, weight in zip(datasets, weights):
        if not (math.isfinite(weight) and weight > 0):
            what = "samples" if size is None else "weight"
            raise ValueError(
                f"{_dataset_name(dataset)}: {what} {weight} must be greater than zero (a dataset "
                "with no samples cannot be blended; check the split and the sequence length)"
            )
        if size is None and weight != int(weight):
            raise ValueError(f"an exhaustive blend needs whole sample counts, got {weight}")
    if size is not None and size < 0:
        raise ValueError(f"size must be >= 0, not {size}")


# ----------------------------------------------------------------------------------- builder

Dataset = GPTDataset | BlendedDataset


def build_datasets(
    data: Blend | PerSplitBlend | MockData,
    config: GPTDatasetConfig,
    sizes: Sequence[int | None],
    *,
    mid_level_dataset_surplus: float = DEFAULT_MID_LEVEL_DATASET_SURPLUS,
    dataset_class: type = GPTDataset,
) -> list[Dataset | None]:
    """The train, valid and test datasets of a blend, as megatron-core's
    `BlendedMegatronDatasetBuilder(GPTDataset, sizes, ..., config).build()`.

    `sizes` are the samples wanted per split (None: no excess sampling). With one blend, the
    splits come from `config.split`; with a `PerSplitBlend`, each split uses the whole of its
    own datasets. A split of zero width, or without a blend, is None. `dataset_class` builds
    each prefix's splits: `GPTDataset`, or `SFTDataset` (packed conversations) whose prefixes
    are chat datasets with a loss mask.
    """
    sizes = _check_sizes(sizes)
    if not mid_level_dataset_surplus >= 0:
        raise ValueError(f"mid_level_dataset_surplus must be >= 0, not {mid_level_dataset_surplus}")
    if isinstance(data, MockData):
        from pipeline.data.mock import build_mock_gpt_datasets

        return build_mock_gpt_datasets(config, sizes, data.vocab_size)
    prefixes = all_prefixes(data)
    if dataset_class is PreferenceDataset:  # a preference prefix names two datasets
        sides = [f"{preference_prefix(p)}_{side}_document" for p in prefixes for side in SIDES]
        check_prefixes_exist(sides)
        check_compatible(sides)
    else:
        check_prefixes_exist(prefixes)
        check_compatible(prefixes)
    if isinstance(data, Blend):
        return _build_from_one_blend(data, config, sizes, mid_level_dataset_surplus, dataset_class)
    return _build_per_split(data, config, sizes, mid_level_dataset_surplus, dataset_class)


def _check_sizes(sizes: Sequence[int | None]) -> list[int | None]:
    sizes = list(sizes)
    if len(sizes) != len(SPLIT_NAMES):
        raise ValueError(f"sizes needs one entry per split {SPLIT_NAMES}, got {sizes}")
    for name, size in zip(SPLIT_NAMES, sizes):
        if size is not None and (not isinstance(size, (int, np.integer)) or size < 0):
            raise ValueError(f"the {name} size must be None or an integer >= 0, not {size!r}")
    return [None if s is None else int(s) for s in sizes]


def _build_from_one_blend(
    blend: Blend, config: GPTDatasetConfig, sizes: list[int | None], surplus: float, cls: type
) -> list[Dataset | None]:
    """All splits from one blend and `config.split`."""
    matrix = config.split_matrix
    if matrix is None:
        raise ValueError("a blend with config.split None: give a split (e.g. '969,30,1')")
    prefixes = [normalize_prefix(p) for p in blend.prefixes]
    if len(prefixes) == 1 and blend.weights is None:
        return _build_prefix_splits(prefixes[0], config, sizes, matrix, cls)
    weights = None if blend.weights is None else normalize_weights(blend.weights)
    if weights is None:
        buffers: list[list[int | None]] = [[None] * 3 for _ in prefixes]
        targets: list[list[int]] = []
    else:
        missing = [n for n, s, m in zip(SPLIT_NAMES, sizes, matrix) if s is None and m]
        if missing:
            raise ValueError(
                f"a weighted blend needs a number of samples for every split; none given for "
                f"{', '.join(missing)}"
            )
        per_split = [
            samples_per_dataset(weights, s or 0, surplus) if m else ([0] * len(prefixes),) * 2
            for s, m in zip(sizes, matrix)
        ]
        targets = [list(t) for t in zip(*(p[0] for p in per_split))]
        buffers = [list(b) for b in zip(*(p[1] for p in per_split))]
    built = [
        _build_prefix_splits(prefix, config, buffer, matrix, cls)
        for prefix, buffer in zip(prefixes, buffers)
    ]
    result: list[Dataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if matrix[i] is None:
            result.append(None)
            continue
        members = [datasets[i] for datasets in built]
        split_targets = [t[i] for t in targets] if weights is not None else None
        result.append(
            _blend_split(members, weights, split_targets, sizes[i], config, name, surplus)
        )
    return result


def _build_per_split(
    data: PerSplitBlend,
    config: GPTDatasetConfig,
    sizes: list[int | None],
    surplus: float,
    cls: type,
) -> list[Dataset | None]:
    """Each split from its own blend, using the whole of each dataset.

    The config's split is cleared so the datasets' cache keys say the whole prefix is used (a
    prefix used whole for validation must not share a cache entry with its 3% valid split).
    """
    config = dataclasses.replace(config, split=None)
    result: list[Dataset | None] = []
    for i, (name, blend) in enumerate(zip(SPLIT_NAMES, data.splits())):
        if blend is None:
            result.append(None)
            continue
        matrix: list[tuple[float, float] | None] = [None, None, None]
        matrix[i] = (0.0, 1.0)
        prefixes = [normalize_prefix(p) for p in blend.prefixes]
        if len(prefixes) == 1:
            only = [0, 0, 0]
            only[i] = sizes[i]
            result.append(_build_prefix_splits(prefixes[0], config, only, matrix, cls)[i])
            continue
        weights = None if blend.weights is None else normalize_weights(blend.weights)
        targets: list[int] | None = None
        if weights is None:
            buffers: list[int | None] = [None] * len(prefixes)
        elif sizes[i] is None:
            raise ValueError(f"a weighted {name} blend needs a number of {name} samples")
        else:
            targets, buffers = samples_per_dataset(weights, sizes[i], surplus)
        members = []
        for prefix, buffer in zip(prefixes, buffers):
            wanted: list[int | None] = [0, 0, 0]
            wanted[i] = buffer
            members.append(_build_prefix_splits(prefix, config, wanted, matrix, cls)[i])
        result.append(_blend_split(members, weights, targets, sizes[i], config, name, surplus))
    return result


def _build_prefix_splits(
    prefix: str,
    config: GPTDatasetConfig,
    num_samples: Sequence[int | None],
    matrix: Sequence[tuple[float, float] | None],
    cls: type,
) -> list[Any]:
    """The `cls` datasets of one prefix's splits: a chat prefix (tokens and loss mask) for
    `SFTDataset`, the chosen/rejected pairs for `PreferenceDataset`, a plain indexed dataset
    otherwise."""
    low_level: Any
    if cls is SFTDataset:
        low_level = ChatIndexedDataset(prefix)
    elif cls is PreferenceDataset:
        low_level = PreferencePairs(prefix)
    else:
        low_level = IndexedDataset(prefix)
    return build_splits(low_level, prefix, config, num_samples, list(matrix), cls)


def _blend_split(
    members: list[Any],
    weights: list[float] | None,
    targets: list[int] | None,
    size: int | None,
    config: GPTDatasetConfig,
    split: str,
    surplus: float,
) -> BlendedDataset:
    """One split's BlendedDataset: by weight and target sizes, by dataset length up to `size`,
    or (no size) exhaustively over every sample of every dataset."""
    if weights is not None:
        assert targets is not None
        blend_weights: list[float] = weights
        blend_size: int | None = sum(targets)
    else:
        blend_weights = [len(m) for m in members]
        blend_size = size
        if size is not None:
            check_unweighted_size(split, size, sum(blend_weights))
    return BlendedDataset(
        members, blend_weights, blend_size, config, split, mid_level_dataset_surplus=surplus
    )


def check_unweighted_size(split: str, size: int, available: int) -> None:
    """Refuse more samples than an unweighted blend holds. Megatron shrinks the blend to what
    exists instead, so a run silently runs out of data part-way."""
    if size > available:
        raise ValueError(
            f"{split}: {size:,} samples requested, but the unweighted blend holds only "
            f"{available:,} (without weights each dataset is read once, not repeated); give "
            "weights so that datasets repeat, or request fewer samples"
        )
