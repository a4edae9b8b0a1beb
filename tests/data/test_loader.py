"""The pre-training sampler against Megatron's rule, data-parallel splitting, exact resume
(also with worker processes prefetching ahead), the collate function and bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pipeline.data.loader import PretrainingSampler, build_data_loader, collate_numpy


def megatron_batches(total, consumed, micro_batch_size, rank, size, drop_last=True):
    """Megatron's MegatronPretrainingSampler as described: accumulate indices from `consumed`
    into global micro-batches of mbs * dp and yield this rank's slice of each."""
    batches, batch = [], []
    begin, end = rank * micro_batch_size, (rank + 1) * micro_batch_size
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == micro_batch_size * size:
            batches.append(batch[begin:end])
            batch = []
    if batch and not drop_last:
        batches.append(batch[begin:end])
    return batches


class ArangeDataset:
    """Sample i holds the value i everywhere, so a batch shows which samples it holds."""

    def __init__(self, size: int, seq: int = 4):
        self.size, self.seq = size, seq

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {
            "dataset_id": np.int16(i % 3),
            "tokens": np.full(self.seq, i, np.int64),
            "loss_mask": np.ones(self.seq, np.float32),
            "attention_mask": np.tril(np.ones((1, self.seq, self.seq), bool)),
        }


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_matches_megatron(drop_last):
    for total, consumed, mbs, dp in itertools.product(
        (1, 7, 48, 50), (0, 3, 16), (1, 2, 4), (1, 3, 4)
    ):
        if consumed >= total:
            continue
        for rank in range(dp):
            sampler = PretrainingSampler(total, consumed, mbs, rank, dp, drop_last)
            expected = megatron_batches(total, consumed, mbs, rank, dp, drop_last)
            assert list(sampler) == expected, (total, consumed, mbs, rank, dp)
            assert len(sampler) == len(expected)


def test_global_batch_is_split_across_ranks_in_order():
    """Micro-batch k of all ranks together is the next mbs * dp consecutive samples, rank r
    holding the r-th contiguous slice; the tail is split the same way without drop_last."""
    total, mbs, dp = 50, 2, 4
    per_rank = [list(PretrainingSampler(total, 0, mbs, r, dp, drop_last=False)) for r in range(dp)]
    assert {len(batches) for batches in per_rank} == {7}
    for k in range(6):
        assert [i for r in range(dp) for i in per_rank[r][k]] == list(range(8 * k, 8 * k + 8))
    assert [per_rank[r][6] for r in range(dp)] == [[48, 49], [], [], []]
    assert all(len(list(PretrainingSampler(total, 0, mbs, r, dp))) == 6 for r in range(dp))


def test_sampler_state_and_resume():
    sampler = PretrainingSampler(100, 0, 2, 1, 3)
    uninterrupted = list(sampler)
    for batches_done in (0, 1, 5, 15):
        resumed = PretrainingSampler(100, 0, 2, 1, 3)
        for _ in range(batches_done):
            resumed.advance()
        state = resumed.state_dict()
        assert state["consumed_samples"] == 6 * batches_done
        fresh = PretrainingSampler(100, 0, 2, 1, 3)
        fresh.load_state_dict(state)
        assert list(fresh) == uninterrupted[batches_done:]
    # a consumed count that is not a whole number of global batches starts right there
    assert next(iter(PretrainingSampler(100, 7, 2, 0, 3))) == [7, 8]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), "no samples"),
        ((10, 10, 1, 0, 1), r"consumed_samples 10 must be in \[0, 10\)"),
        ((10, -1, 1, 0, 1), "consumed_samples -1"),
        ((10, 0, 0, 0, 1), "micro_batch_size must be positive"),
        ((10, 0, 1, 0, 0), "data_parallel_size must be positive"),
        ((10, 0, 1, 2, 2), r"data_parallel_rank 2 is outside \[0, 2\)"),
        ((10, 0, 1, -1, 2), "data_parallel_rank -1"),
    ],
)
def test_sampler_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(*args)


def test_load_state_refuses_bad_state():
    sampler = PretrainingSampler(10, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="not a sampler state"):
        sampler.load_state_dict({"consumed": 3})
    with pytest.raises(ValueError, match=r"consumed_samples 12 must be in \[0, 10\)"):
        sampler.load_state_dict({"consumed_samples": 12})


def batch_ids(batch) -> list[int]:
    return batch["tokens"][:, 0].tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_reads_the_identical_next_batch(num_workers):
    """Stop after N micro-batches (workers have prefetched further), save the loader state,
    build a new loader from it: its next batch is the uninterrupted run's next batch."""
    dataset, mbs, dp = ArangeDataset(103), 3, 2
    for rank in range(dp):
        full = [batch_ids(b) for b in build_data_loader(dataset, mbs, rank, dp, 0)]
        assert full == megatron_batches(103, 0, mbs, rank, dp)
        loader = build_data_loader(dataset, mbs, rank, dp, 0, num_workers=num_workers)
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        state = loader.state_dict()
        assert state["consumed_samples"] == 5 * mbs * dp
        resumed = build_data_loader(dataset, mbs, rank, dp, state["consumed_samples"])
        assert [batch_ids(b) for b in resumed] == full[5:]
        reloaded = build_data_loader(dataset, mbs, rank, dp, 0)
        reloaded.load_state_dict(state)
        assert batch_ids(next(iter(reloaded))) == full[5]
        # a new pass over the same loader continues where the last one stopped
        assert batch_ids(next(iter(loader))) == full[5]
        assert loader.state_dict()["consumed_samples"] == 6 * mbs * dp


def test_collate_and_loader_on_cpu():
    loader = build_data_loader(ArangeDataset(10, seq=5), 4, 0, 1, 0)
    assert loader.pin_memory is False and len(loader) == 2
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 5) and str(batch["tokens"].dtype) == "torch.int64"
    assert batch["loss_mask"].dtype.is_floating_point and batch["loss_mask"].shape == (4, 5)
    assert (
        batch["attention_mask"].shape == (4, 1, 5, 5)
        and str(batch["attention_mask"].dtype) == "torch.bool"
    )
    assert (
        batch["dataset_id"].tolist() == [0, 1, 2, 0]
        and str(batch["dataset_id"].dtype) == "torch.int16"
    )
    assert collate_numpy([]) == {}
    assert build_data_loader(None, 4, 0, 1, 0) is None


def test_resume_on_a_real_blend(tmp_path):
    """The same on a BlendedDataset of two files, two data-parallel ranks: the resumed loader's
    batches are the uninterrupted run's remaining batches, tensor for tensor."""
    from pipeline.data.blend_spec import Blend
    from pipeline.data.blended import build_datasets
    from pipeline.data.gpt_dataset import GPTDatasetConfig
    from pipeline.data.indexed import IndexedDatasetWriter

    prefixes = []
    for seed in range(2):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 40, 200).astype(np.int32)
        prefix = tmp_path / f"d{seed}"
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            tokens = rng.integers(2, 500, int(lengths.sum())).astype(np.uint16)
            writer.add_documents(tokens, lengths, np.ones(len(lengths), np.int64))
            writer.finalize()
        prefixes.append(str(prefix))
    config = GPTDatasetConfig(sequence_length=16, eod_id=0, tokenizer_id="t", split="1")
    dataset = build_datasets(Blend(prefixes, [0.4, 0.6]), config, [120, 0, 0])[0]
    for rank in range(2):
        full = list(build_data_loader(dataset, 4, rank, 2, 0))
        loader = build_data_loader(dataset, 4, rank, 2, 0)
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        resumed = build_data_loader(dataset, 4, rank, 2, loader.state_dict()["consumed_samples"])
        rest = list(resumed)
        assert len(rest) == len(full) - 3
        for a, b in zip(rest, full[3:]):
            assert a.keys() == b.keys()
            assert all(bool((a[k] == b[k]).all()) for k in a)
