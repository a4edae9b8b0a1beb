"""Megatron's blending indices (`helpers.cpp` build_blending_indices and its exhaustive variant),
exactly, in vectorised numpy.

At step s the greedy draws from the dataset whose count lags `weight * max(s, 1)` the most (ties
to the lowest index). That schedule is inherently sequential, and megatron-core runs it in C++.
There is no closed form for three or more datasets (a dataset can lag its share by more than one
sample, so the state carries memory beyond the step number). Here the sequence is cut into many
blocks simulated side by side; a block whose true starting state is unknown starts from an
estimate and runs a short warm-up first, because the greedy forgets where it started within a few
dozen steps for ordinary weights. Every block's starting state is then checked against the state
its predecessor ended in, and any block that disagrees is re-run from the right state, so the
result is always identical to the sequential loop; only the speed depends on the weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.data.blend_spec import MAX_DATASETS

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------- blending indices

# Samples per segment: each segment is simulated block-parallel from an exactly known state.
_SEGMENT = 1 << 23
# Blocks advanced together; with a few ufunc calls per step, this many keep numpy efficient.
_MAX_LANES = 8192
# Steps a block started from an estimated state runs before its picks are kept. For ordinary
# weights the schedule forgets its starting state in well under this many steps; when it does
# not, the check after the pass finds the block and runs it again from the exact state.
_WARMUP = 64
# Below this many samples, a plain loop is faster than setting up blocks.
_SEQUENTIAL_BELOW = 1024
# Rows written to the output at a time (small, so the transposition stays in cache).
_RING = 16
# With at most this many lanes still wrong, they are fixed by one plain loop that runs ahead.
_RUN_AHEAD_BELOW = 8
# Up to this many datasets the argmax is a chain of pairwise comparisons; beyond, np.argmax.
_PAIRWISE_MAX = 32
# A penalty that sinks exhausted datasets below any live one in the exhaustive schedule.
_SPENT = -1e300


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's blending indices: for each of `size` samples, the dataset it comes from
    (int16) and that dataset's sample number (int64), equal to megatron-core's
    `helpers.build_blending_indices`.

    At step s, with x = max(s, 1) and c_d the samples drawn from dataset d so far, draw from the
    first dataset maximising `w_d * x - c_d` in float64. `weights` are used as given (Megatron
    passes normalised weights).
    """
    w = _check_weights(weights)
    if size < 0:
        raise ValueError(f"size must be >= 0, not {size}")
    return _greedy_indices(w, int(size), None)


def build_exhaustive_blending_indices(
    sizes: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Blending indices drawing exactly `sizes[d]` samples from dataset d (sum(sizes) in all),
    equal to megatron-core's `helpers.build_exhaustive_blending_indices`: the same greedy rule
    with weights `sizes / sum(sizes)`, over the datasets not yet exhausted."""
    limits = np.asarray(sizes, dtype=np.int64)
    if limits.ndim != 1 or not 1 <= len(limits) <= MAX_DATASETS:
        raise ValueError(f"need 1 to {MAX_DATASETS} dataset sizes, got {len(limits)}")
    if (limits <= 0).any():
        raise ValueError(
            f"every dataset must have at least one sample, got sizes {limits.tolist()}"
        )
    total = int(limits.sum())
    w = limits.astype(np.float64) / np.float64(total)
    return _greedy_indices(w, total, limits)


def _check_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not 1 <= len(w) <= MAX_DATASETS:
        raise ValueError(f"need 1 to {MAX_DATASETS} weights, got {w.size}")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"weights must be finite and greater than zero, got {w.tolist()}")
    return w


def _greedy_indices(
    w: np.ndarray, size: int, limits: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy schedule over `size` steps, segment by segment (bounded working memory)."""
    n = len(w)
    if n == 1:
        return np.zeros(size, np.int16), np.arange(size, dtype=np.int64)
    if size < _SEQUENTIAL_BELOW:
        return _greedy_sequential(w, size, limits)
    # Room for the last block to run past `size`; the extra picks are dropped.
    pad = _WARMUP + max(4 * _WARMUP, -(-_SEGMENT // _MAX_LANES))
    dataset_index = np.empty(size + pad, np.int16)
    sample_index = np.empty(size + pad, np.int64)
    counts = np.zeros(n, np.int64)
    start = 0
    while start < size:
        length = min(_SEGMENT, size - start)
        block = max(4 * _WARMUP, -(-(length - _WARMUP) // _MAX_LANES))
        lanes = max(1, -(-(length - _WARMUP) // block))
        end = start + _WARMUP + lanes * block
        counts = _greedy_segment(
            w,
            limits,
            start,
            counts,
            block,
            lanes,
            dataset_index[start:end],
            sample_index[start:end],
        )
        start = end
    return dataset_index[:size], sample_index[:size]


def _greedy_sequential(
    w: np.ndarray, size: int, limits: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The schedule as a plain loop, for small sizes."""
    counts = [0] * len(w)
    picks, numbers = _loop(
        w.tolist(),
        None if limits is None else limits.tolist(),
        counts,
        list(range(len(w))),
        0,
        size,
    )
    return np.array(picks, np.int16), np.array(numbers, np.int64)


def _greedy_segment(
    w: np.ndarray,
    limits: np.ndarray | None,
    start: int,
    counts: np.ndarray,
    block: int,
    lanes: int,
    dataset_index: np.ndarray,
    sample_index: np.ndarray,
) -> np.ndarray:
    """Fill `_WARMUP + lanes * block` steps from step `start`, whose counts are `counts` (exact).

    Lane 0 starts at `start` from the exact counts and keeps every pick. Lane b >= 1 starts at
    `start + b * block` from estimated counts, runs `_WARMUP` steps whose picks are dropped and
    keeps the next `block` picks. Afterwards each lane's state at the start of its kept range
    must equal the state its predecessor ended in; every lane where it does not is re-run from
    that end state, and this repeats until all agree. The first disagreeing lane always becomes
    exact, so this terminates. Usually a lane started from a wrong state drifts back to the
    true schedule within its block, so one or two rounds suffice; a dataset drawn so rarely
    that a wrong count persists over many lanes is left to a plain loop that runs on from the
    first wrong lane until it meets a stored state. Returns the exact counts at the end.
    """
    steps_from = start + np.arange(lanes, dtype=np.int64) * block
    estimate = _estimate_counts(w, limits, steps_from)
    estimate[:, 0] = counts
    kept_d = dataset_index[_WARMUP:].reshape(lanes, block)
    kept_s = sample_index[_WARMUP:].reshape(lanes, block)
    everyone = np.arange(lanes)
    begin, end = _run_kept(w, limits, steps_from, estimate, everyone, True, kept_d, kept_s)
    # Lane 0's warm-up steps are real: redo them into place with the plain loop.
    caps = None if limits is None else limits.tolist()
    start_counts = counts.tolist()
    live = [d for d in range(len(w)) if caps is None or start_counts[d] < caps[d]]
    picks, numbers = _loop(w.tolist(), caps, start_counts, live, start, _WARMUP)
    dataset_index[:_WARMUP], sample_index[:_WARMUP] = picks, numbers
    rounds = 0
    while True:
        wrong = np.flatnonzero((begin[:, 1:] != end[:, :-1]).any(axis=0)) + 1
        if len(wrong) == 0:
            break
        rounds += 1
        if len(wrong) <= _RUN_AHEAD_BELOW:
            # Few lanes left: the errors persist (a rare dataset's count), so fix them in one
            # go, running on from the first wrong lane until the schedule meets a stored state.
            _run_ahead(w, limits, int(wrong[0]), steps_from + _WARMUP, begin, end, kept_d, kept_s)
            continue
        exact = end[:, wrong - 1].copy()
        b, e = _run_kept(
            w, limits, steps_from[wrong] + _WARMUP, exact, wrong, False, kept_d, kept_s
        )
        begin[:, wrong], end[:, wrong] = b, e
    if rounds:
        logger.debug("blending indices: %d correction round(s) at step %d", rounds, start)
    return end[:, -1].copy()


def _run_ahead(
    w: np.ndarray,
    limits: np.ndarray | None,
    lane: int,
    kept_from: np.ndarray,
    begin: np.ndarray,
    end: np.ndarray,
    kept_d: np.ndarray,
    kept_s: np.ndarray,
) -> None:
    """Re-run lane `lane` from its predecessor's end state with a plain loop, and go on into
    the following lanes until the state at a lane's start equals the one stored for it."""
    lanes, block = kept_d.shape
    weights = w.tolist()
    caps = None if limits is None else limits.tolist()
    counts = end[:, lane - 1].tolist()
    while True:
        begin[:, lane] = counts
        live = [d for d in range(len(weights)) if caps is None or counts[d] < caps[d]]
        picks, numbers = _loop(weights, caps, counts, live, int(kept_from[lane]), block)
        kept_d[lane], kept_s[lane] = picks, numbers
        end[:, lane] = counts
        lane += 1
        if lane == lanes or (begin[:, lane] == end[:, lane - 1]).all():
            return


def _loop(
    weights: list[float],
    caps: list[int] | None,
    counts: list[int],
    live: list[int],
    first: int,
    steps: int,
) -> tuple[list[int], list[int]]:
    """`steps` steps of the schedule from step `first` as a plain loop (Python floats are the
    same IEEE doubles as the C++ helper's); `counts` and `live` are updated in place."""
    picks, numbers = [], []
    for s in range(first, first + steps):
        x = float(max(s, 1))
        best, best_error = live[0] if live else 0, -math.inf
        for d in live:
            error = weights[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        picks.append(best)
        numbers.append(counts[best])
        counts[best] += 1
        if caps is not None and best in live and counts[best] >= caps[best]:
            live.remove(best)
    return picks, numbers


def _run_kept(
    w: np.ndarray,
    limits: np.ndarray | None,
    first_step: np.ndarray,
    counts: np.ndarray,
    lanes: np.ndarray,
    warm_up: bool,
    kept_d: np.ndarray,
    kept_s: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Run `lanes` from `counts` at `first_step` (after a dropped warm-up if `warm_up`), store
    their kept picks in rows `lanes` of `kept_d`/`kept_s`, and return the counts at the start
    and at the end of the kept range."""
    state = counts.copy()
    block = kept_d.shape[1]
    if warm_up:
        scratch_d = np.empty((len(lanes), _WARMUP), np.int16)
        scratch_s = np.empty((len(lanes), _WARMUP), np.int64)
        _run_lanes(w, limits, first_step, state, _WARMUP, scratch_d, scratch_s)
        first_step = first_step + _WARMUP
    begin = state.copy()
    whole = len(lanes) == kept_d.shape[0]
    out_d = kept_d if whole else np.empty((len(lanes), block), np.int16)
    out_s = kept_s if whole else np.empty((len(lanes), block), np.int64)
    _run_lanes(w, limits, first_step, state, block, out_d, out_s)
    if not whole:
        kept_d[lanes], kept_s[lanes] = out_d, out_s
    return begin, state


def _estimate_counts(w: np.ndarray, limits: np.ndarray | None, steps: np.ndarray) -> np.ndarray:
    """Counts (n, lanes) near the schedule's true state at each step: floor(w*s) plus one for
    the datasets with the largest remainders, so they add up to s."""
    ideal = w[:, None] * steps.astype(np.float64)[None, :]
    counts = np.floor(ideal)
    short = steps - counts.sum(axis=0).astype(np.int64)
    rank = np.argsort(np.argsort(counts - ideal, axis=0, kind="stable"), axis=0, kind="stable")
    counts = counts.astype(np.int64) + (rank < short[None, :])
    if limits is not None:
        np.minimum(counts, limits[:, None], out=counts)
    return counts


def _run_lanes(
    w: np.ndarray,
    limits: np.ndarray | None,
    first_step: np.ndarray,
    counts: np.ndarray,
    steps: int,
    out_dataset: np.ndarray,
    out_sample: np.ndarray,
) -> None:
    """Advance every lane (column of `counts`, updated in place) by `steps` greedy steps,
    writing lane b's picks to row b of `out_dataset` / `out_sample`.

    Each step is a handful of whole-array operations (`_lane_stepper`); the picks gather in a
    small ring of rows, written out transposed every `_RING` steps.
    """
    lanes = counts.shape[1]
    # Counts as float64: exact below 2**53, and subtracting them needs no per-step cast.
    drawn_so_far = counts.astype(np.float64)
    step = _lane_stepper(w, limits, first_step, drawn_so_far)
    ring_d = np.empty((_RING, lanes), np.int16)
    ring_s = np.empty((_RING, lanes), np.float64)
    for first in range(0, steps, _RING):
        rows = min(_RING, steps - first)
        for r in range(rows):
            step(first + r, ring_d[r], ring_s[r])
        out_dataset[:, first : first + rows] = ring_d[:rows].T
        out_sample[:, first : first + rows] = ring_s[:rows].T
    counts[...] = drawn_so_far


def _lane_stepper(
    w: np.ndarray, limits: np.ndarray | None, first_step: np.ndarray, drawn_so_far: np.ndarray
) -> Callable[[int, np.ndarray, np.ndarray], None]:
    """`step(t, picks, samples)`: greedy step `t` of every lane (lane b at schedule step
    `first_step[b] + t`, its counts in column b of `drawn_so_far`, updated in place), writing
    each lane's dataset and its sample number there to `picks` / `samples`.

    Errors are computed exactly as the C++ helper does: `w_d * x - double(c_d)`, ties to the
    lowest dataset index. The step's arrays are allocated here, once, and reused at every step.
    """
    n, lanes = drawn_so_far.shape
    w_col = w[:, None]
    spent_col = None if limits is None else limits[:, None].astype(np.float64)
    base = first_step.astype(np.float64)
    flat_counts = drawn_so_far.reshape(-1)
    errors = np.empty((n, lanes))
    x = np.empty(lanes)
    pick = np.empty(lanes, np.int16)
    flat = np.empty(lanes, np.intp)
    after = np.empty(lanes)
    lane_offset = np.arange(lanes, dtype=np.intp)
    stride = np.intp(lanes)
    spent = None if limits is None else np.empty((n, lanes), bool)
    penalty = None if limits is None else np.empty((n, lanes))
    pick_first_best = _first_argmax(errors, pick)

    def step(t: int, picks: np.ndarray, samples: np.ndarray) -> None:
        np.add(base, t, out=x)
        if t == 0:
            np.maximum(x, 1.0, out=x)  # Megatron uses max(s, 1)
        np.multiply(w_col, x, out=errors)
        np.subtract(errors, drawn_so_far, out=errors)
        if spent is not None:
            np.greater_equal(drawn_so_far, spent_col, out=spent)
            np.multiply(spent, _SPENT, out=penalty)
            np.add(errors, penalty, out=errors)
        pick_first_best()
        np.multiply(pick, stride, out=flat)
        np.add(flat, lane_offset, out=flat)
        np.take(flat_counts, flat, out=samples)
        picks[...] = pick
        np.add(samples, 1.0, out=after)
        flat_counts[flat] = after

    return step


def _first_argmax(errors: np.ndarray, pick: np.ndarray) -> Callable[[], None]:
    """`pick_first_best()`: writes to `pick` the row of `errors` `[n, lanes]` holding each
    column's maximum, the lowest row on ties: for up to `_PAIRWISE_MAX` rows by a chain of
    pairwise comparisons into arrays allocated once here, beyond that by `np.argmax`."""
    n, lanes = errors.shape
    if n > _PAIRWISE_MAX:
        return lambda: np.copyto(pick, np.argmax(errors, axis=0), casting="unsafe")
    best = np.empty(lanes)
    greater = np.empty(lanes, bool)
    delta = np.empty(lanes, np.int16)

    def pick_first_best() -> None:
        np.greater(errors[1], errors[0], out=greater)
        np.copyto(pick, greater, casting="unsafe")
        if n > 2:
            np.maximum(errors[0], errors[1], out=best)
        for d in range(2, n):
            np.greater(errors[d], best, out=greater)
            np.subtract(d, pick, out=delta, casting="unsafe")  # pick = d where greater
            np.multiply(delta, greater, out=delta)
            np.add(pick, delta, out=pick)
            if d + 1 < n:
                np.maximum(best, errors[d], out=best)

    return pick_first_best
