"""Resumable data loading: Megatron's pre-training sampler and a DataLoader built on it.

`PretrainingSampler` yields, for one data-parallel rank, the sample indices of each micro-batch
exactly as Megatron's `MegatronPretrainingSampler` does: indices run from the consumed count to
the end; every `micro_batch_size * data_parallel_size` of them form one global micro-batch, of
which rank r takes the contiguous slice `[r * mbs, (r + 1) * mbs)`. Its whole state is the
number of samples consumed, so resuming means starting from that count.

`build_data_loader` wraps it in a torch `DataLoader` that counts the micro-batches it actually
hands out (not the ones its workers prefetched), so `loader.state_dict()` is always the point to
resume from. torch is imported only inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


class PretrainingSampler:
    """Batch sampler of one data-parallel rank, resumable from a consumed-sample count.

    Iterating yields lists of dataset indices (this rank's micro-batch). With `drop_last`
    False the final incomplete global micro-batch is split the same way, so some ranks may get
    a short or empty list, as in Megatron.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, not {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be positive, not {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})"
            )
        self.total_samples = int(total_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last
        self.consumed_samples = self._checked_consumed(consumed_samples)

    @property
    def global_micro_batch_size(self) -> int:
        """Samples consumed across all data-parallel ranks per micro-batch."""
        return self.micro_batch_size * self.data_parallel_size

    def _checked_consumed(self, consumed: int) -> int:
        if not 0 <= consumed < self.total_samples:
            raise ValueError(
                f"consumed_samples {consumed} must be in [0, {self.total_samples}): the dataset "
                f"holds {self.total_samples} samples (all consumed, or a checkpoint from a run "
                "with more data)"
            )
        return int(consumed)

    def __len__(self) -> int:
        """Micro-batches one pass yields from the current position (Megatron's sampler returns
        the sample count here, which makes `len(DataLoader)` meaningless)."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_micro_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's slice of each global micro-batch, from `consumed_samples` on."""
        group = self.global_micro_batch_size
        begin = self.data_parallel_rank * self.micro_batch_size
        end = begin + self.micro_batch_size
        start = self.consumed_samples
        full_stop = start + (self.total_samples - start) // group * group
        for first in range(start, full_stop, group):
            yield list(range(first + begin, first + end))
        if full_stop < self.total_samples and not self.drop_last:
            yield list(range(full_stop, self.total_samples))[begin:end]

    def advance(self) -> None:
        """Count one global micro-batch as consumed (the loader calls this per delivered batch)."""
        group = self.global_micro_batch_size
        self.consumed_samples = min(self.consumed_samples + group, self.total_samples)

    def state_dict(self) -> dict[str, int]:
        return {
            "consumed_samples": self.consumed_samples,
            "total_samples": self.total_samples,
            "global_micro_batch_size": self.global_micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a saved state (only the consumed count matters; the rest is checked:
        a different micro-batch layout reads the same samples in the same order, but a smaller
        dataset cannot hold the position)."""
        if "consumed_samples" not in state:
            raise ValueError(f"not a sampler state (no 'consumed_samples'): {sorted(state)}")
        self.consumed_samples = self._checked_consumed(int(state["consumed_samples"]))


def collate_numpy(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack a list of sample dicts (numpy arrays or scalars) into a dict of torch tensors."""
    import torch

    if not batch:
        return {}
    return {
        key: torch.from_numpy(np.stack([np.asarray(sample[key]) for sample in batch]))
        for key in batch[0]
    }


def build_data_loader(
    dataset: Any,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    drop_last: bool = True,
) -> Any:
    """A torch DataLoader over `dataset` for one data-parallel rank, resuming after
    `consumed_samples` (None for a None dataset, as Megatron).

    `pin_memory` None pins when CUDA is available. Workers are persistent, as in Megatron. The
    loader's `state_dict()` / `load_state_dict()` hold the consumed count of the batches it
    delivered.
    """
    if dataset is None:
        return None
    import torch

    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    sampler = PretrainingSampler(
        len(dataset),
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
        drop_last,
    )
    return _loader_class()(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_numpy,
        persistent_workers=num_workers > 0,
        # Its own generator for the workers' base seed (the samples do not depend on it), so
        # starting a loader leaves the global RNG, which dropout draws from, untouched.
        generator=torch.Generator(),
    )


_LOADER_CLASS: type | None = None


def _loader_class() -> type:
    """`PretrainingDataLoader`, defined on first use so importing this module needs no torch."""
    global _LOADER_CLASS
    if _LOADER_CLASS is None:
        import torch.utils.data

        class PretrainingDataLoader(torch.utils.data.DataLoader):
            """A DataLoader whose state is the consumed count of the batches it delivered."""

            def __iter__(self) -> Iterator[Any]:
                for batch in super().__iter__():
                    self.batch_sampler.advance()
                    yield batch

            def state_dict(self) -> dict[str, int]:
                return self.batch_sampler.state_dict()

            def load_state_dict(self, state: dict[str, int]) -> None:
                self.batch_sampler.load_state_dict(state)

        _LOADER_CLASS = PretrainingDataLoader
    return _LOADER_CLASS
