"""The three index arrays behind every GPT sample, built exactly as megatron-core 0.16.1 builds
them (docs/file_layouts.md, "Training samples"): how many epochs a request needs (`plan_epochs`),
the shuffled document index, the sample index (sample boundaries as document-index position and
token offset, megatron-core's C++ `build_sample_idx` in vectorised numpy) and the shuffle index.
`GPTDataset` builds them once per split and caches them; blends count samples with them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "EpochPlan",
    "build_document_index",
    "build_sample_index",
    "build_shuffle_index",
    "count_samples",
    "plan_epochs",
    "sample_index_dtype",
]

# The final epoch is shuffled on its own when it contributes less than this share of an epoch.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_INT32_MAX = np.iinfo(np.int32).max
# Document-index positions per step of the sample-index build: small enough that the temporaries
# stay in cache and are recycled by the allocator instead of page-faulted in afresh.
_CHUNK = 1 << 16


@dataclass(frozen=True)
class EpochPlan:
    """How many passes over a split a request needs, and whether the last is shuffled apart."""

    tokens_per_epoch: int
    num_epochs: int
    separate_final_epoch: bool
    samples_before_final_epoch: int


def plan_epochs(
    tokens_per_epoch: int, num_samples: int | None, sequence_length: int, add_extra: int
) -> EpochPlan:
    """The fewest whole epochs holding `num_samples * sequence_length + add_extra` tokens.

    The last epoch is shuffled separately when it contributes less than 80% of an epoch's
    samples, so a small tail is not spread thinly over the whole run (Megatron's rule).
    """
    if num_samples is None:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    needed = num_samples * sequence_length + add_extra
    if tokens_per_epoch <= 0:
        if needed > 0:
            raise ValueError("no tokens to draw samples from")
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    num_epochs = max(1, -(-needed // tokens_per_epoch))
    if num_epochs == 1:
        return EpochPlan(tokens_per_epoch, 1, False, 0)
    before_final = ((num_epochs - 1) * tokens_per_epoch - add_extra) // sequence_length
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - add_extra) // sequence_length
    if not 0 <= from_final <= per_epoch + 1:
        raise AssertionError(f"final epoch holds {from_final} samples of {per_epoch}")
    separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(tokens_per_epoch, num_epochs, separate, before_final)


def build_document_index(
    indices: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """The split's sequence ids repeated `num_epochs` times and shuffled (the last epoch on its
    own when `separate_final_epoch`), consuming `rng` as Megatron does."""
    dtype = np.int32 if len(indices) == 0 or int(indices.max()) <= _INT32_MAX else np.int64
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(indices, num_epochs - 1, rng, False)
        last = build_document_index(indices, 1, rng, False)
        return np.concatenate((first, last))
    document_index = np.tile(indices.astype(dtype, copy=False), num_epochs)
    rng.shuffle(document_index)
    return document_index


def count_samples(
    num_epochs: int, tokens_per_epoch: int, sequence_length: int, drop_last: bool, add_extra: int
) -> int:
    """Number of samples in the sample index, as megatron-core's C++ helper computes it.

    Without drop_last the partial sample is counted with a 32-bit float ceil, which for large
    token counts can differ from the exact ceil (T=33,554,435, S=2, X=1 gives 16,777,216).
    """
    tokens = num_epochs * tokens_per_epoch - add_extra
    if drop_last:
        count = tokens // sequence_length if tokens >= 0 else 0
    else:
        count = int(np.ceil(np.float32(tokens) / np.float32(sequence_length)))
    return max(count, 0)


def sample_index_dtype(sequence_lengths: np.ndarray, document_index_size: int) -> np.dtype:
    """int32 unless a position or an offset could exceed it (Megatron's rule)."""
    longest = int(sequence_lengths.max()) if len(sequence_lengths) else 0
    return np.dtype(np.int32 if max(document_index_size, longest) <= _INT32_MAX else np.int64)


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last: bool,
    add_extra: int,
) -> np.ndarray:
    """Sample boundaries as (document-index position, token offset) rows; equal to megatron-core's
    `helpers.build_sample_idx`, computed with vectorised numpy.

    Boundary r >= 1 sits at stream token r*S. Its row names the first position whose cumulative
    end reaches r*S + X (the sample's last token plus one), so a boundary at a sequence's end
    belongs to that sequence when X=0 and to the next non-empty one when X=1. Boundaries past
    the stream's end (the padded last sample) point X tokens before the end of the last
    sequence.
    """
    num_samples = count_samples(num_epochs, tokens_per_epoch, sequence_length, drop_last, add_extra)
    out = np.empty(
        (num_samples + 1, 2), dtype=sample_index_dtype(sequence_lengths, len(document_index))
    )
    out[0] = 0
    filled = _fill_sample_rows(out, sequence_lengths, document_index, sequence_length, add_extra)
    if filled < num_samples:
        out[filled + 1 :] = _end_of_stream_row(sequence_lengths, document_index, add_extra)
    return out


def _fill_sample_rows(
    out: np.ndarray,
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    add_extra: int,
) -> int:
    """Fill rows 1.. of `out` for every boundary inside the stream; return how many.

    Boundary r belongs to the first position p whose stream end reaches r*S + X. Per chunk of
    positions, `reached[p]` counts the chunk's boundaries satisfied by the end of p (a cumsum
    and a division), so boundary k of the chunk sits at the number of positions with
    `reached < k` (a bincount and a cumsum) and its offset is k*S minus that position's start.
    Stream positions are kept relative to the chunk's first boundary (minus X), and the
    per-position temporaries are allocated once and reused (fresh large arrays cost page faults).
    """
    num_rows = len(out) - 1
    # A power-of-two sequence length (the usual case) divides by shifting, which is much cheaper.
    shift = sequence_length.bit_length() - 1 if sequence_length & (sequence_length - 1) == 0 else -1
    size = min(_CHUNK, len(document_index))
    positions_buf = np.empty(size, dtype=np.intp)
    lengths_buf = np.empty(size, dtype=sequence_lengths.dtype)
    ends_buf = np.empty(size, dtype=np.int64)
    reached_buf = np.empty(size, dtype=np.int64)
    done, relative_start = 0, -add_extra
    for begin in range(0, len(document_index), _CHUNK):
        chunk = document_index[begin : begin + _CHUNK]
        m = len(chunk)
        positions, ends, reached = positions_buf[:m], ends_buf[:m], reached_buf[:m]
        positions[:] = chunk
        # mode="clip" skips numpy's slow bounds-checking path; the ids are valid by construction.
        lengths = np.take(sequence_lengths, positions, mode="clip", out=lengths_buf[:m])
        np.cumsum(lengths, dtype=np.int64, out=ends)
        ends += relative_start
        relative_start = int(ends[-1])
        if shift >= 0:
            np.right_shift(ends, shift, out=reached)
        else:
            np.floor_divide(ends, sequence_length, out=reached)
        if reached[0] < 0 or reached[-1] > num_rows - done:
            np.clip(reached, 0, num_rows - done, out=reached)
        count = int(reached[-1])
        if count == 0:
            continue
        position = np.bincount(reached, minlength=count)[:count]
        np.cumsum(position, out=position)
        rows = slice(done + 1, done + 1 + count)
        np.add(position, begin, out=out[rows, 0], casting="unsafe")
        ends -= lengths  # now each position's first token
        starts = np.take(ends, position, mode="clip")
        first = sequence_length - add_extra
        steps = np.arange(first, first + count * sequence_length, sequence_length)
        np.subtract(steps, starts, out=out[rows, 1], casting="unsafe")
        done += count
        relative_start -= count * sequence_length
        if done == num_rows:
            break
    return done


def _end_of_stream_row(
    sequence_lengths: np.ndarray, document_index: np.ndarray, add_extra: int
) -> tuple[int, int]:
    """The row of a boundary past the end: X tokens before the end of the last sequence.

    Megatron writes offset -1 (and then fails an assertion) when that last sequence is empty and
    X=1; we name the last non-empty sequence instead, so the sample reads to the stream's end.
    """
    last = len(document_index) - 1
    length = int(sequence_lengths[document_index[last]])
    if length - add_extra < 0:
        non_empty = np.flatnonzero(sequence_lengths[document_index] > 0)
        last = int(non_empty[-1])
        length = int(sequence_lengths[document_index[last]])
    return last, length - add_extra


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A shuffled `arange(total_size)`, whose first `num_samples` and the rest are shuffled
    separately (uint32, or int64 for very large indices)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))
