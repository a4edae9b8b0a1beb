"""Sharded `pipe preprocess`: which shard this process is, which part of the input it reads, and
what its files are called.

A shard is chosen by `--num-shards N --shard-index I`, else by the launcher's environment
(torchrun's RANK/WORLD_SIZE, else a Slurm array's SLURM_ARRAY_TASK_ID/COUNT/MIN).

The partition depends only on the list of inputs and their sizes on disk, so every machine plans
the same one without talking to the others:

- Lay the inputs end to end (T bytes in all). Shard k owns bytes [k*T//N, (k+1)*T//N).
- A cut that falls inside a file moves to that file's nearest boundary (the file stays whole)
  when the file cannot be split (compressed `.zst`/`.gz` and tabular inputs) or when the move is
  at most 1/16 of a shard's share (many files: each stays whole, shards stay within ~6% of each
  other). Otherwise the file is split there.
- A split plain JSONL file is read by line: a line belongs to the shard whose byte range holds
  its first byte. The reader moves a range's start forward to the next line start and reads the
  range's last line to its end (`readers.InputRange`), so every line is read exactly once.
- An empty file goes to the shard whose range starts at or before its offset, so a run's errors
  about it match the unsharded run's. A shard may own nothing (it writes empty outputs).

Shards therefore cover the document sequence in input order: shard k's documents all precede
shard k+1's, and merging the shards in order gives the unsharded run's `.bin/.idx` byte for byte.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.preprocess.inputs import InputFile, InputRange

# Kinds a cut may fall inside: plain JSON lines, read from any byte offset.
SPLITTABLE_KINDS = frozenset({"jsonl"})
# A cut moves to a file boundary when that shifts it by at most share / SNAP_FRACTION bytes.
SNAP_FRACTION = 16

_SHARD_NAME = re.compile(
    r"^(?P<base>.+)\.shard-(?P<index>\d{5,})-of-(?P<count>\d{5,})(?P<rest>.*)$"
)


class ShardError(ValueError):
    """Inconsistent shard settings, or shards that cannot be merged; the message says which."""


@dataclass(frozen=True)
class ShardSpec:
    """Shard `index` of `count` (0-based), and where that came from (flags or which launcher)."""

    index: int
    count: int
    source: str = "--shard-index/--num-shards"

    def __str__(self) -> str:
        return f"shard {self.index} of {self.count}"


def shard_prefix(output_prefix: str, index: int, count: int) -> str:
    """`{prefix}.shard-{I:05d}-of-{N:05d}`: outputs `{that}_{key}_document.*`, manifest `.json`."""
    return f"{output_prefix}.shard-{index:05d}-of-{count:05d}"


def parse_shard_name(path: str) -> tuple[str, int, int] | None:
    """(base prefix, index, count) of a shard file or prefix name, or None for another name."""
    match = _SHARD_NAME.match(os.fspath(path))
    if match is None:
        return None
    return match["base"], int(match["index"]), int(match["count"])


# --------------------------------------------------------------------------------- which shard


def resolve_shard(
    num_shards: int | None, shard_index: int | None, environ: Mapping[str, str] | None = None
) -> ShardSpec | None:
    """The shard this process runs: explicit flags win, then torchrun, then a Slurm array;
    None for an unsharded run. Raises ShardError on inconsistent values."""
    env = os.environ if environ is None else environ
    if (num_shards is None) != (shard_index is None):
        raise ShardError("--num-shards and --shard-index go together: give both or neither")
    if num_shards is not None:
        return _checked(shard_index, num_shards, "--shard-index/--num-shards")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        return _checked(rank, world, f"torchrun RANK={rank} WORLD_SIZE={world}")
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = _env_int(env, "SLURM_ARRAY_TASK_ID"), _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        low = _env_int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        source = f"Slurm array SLURM_ARRAY_TASK_ID={task} MIN={low} COUNT={count}"
        if task - low >= count:
            raise ShardError(
                f"{source}: task {task} is not below MIN + COUNT; submit a contiguous array "
                "(--array=0-N-1, no step) so that every task is one shard"
            )
        return _checked(task - low, count, source)
    return None


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ShardError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _checked(index: int | None, count: int, source: str) -> ShardSpec:
    assert index is not None
    if count < 1:
        raise ShardError(f"{source}: the shard count must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ShardError(f"{source}: shard index {index} is not in 0..{count - 1}")
    return ShardSpec(index, count, source)


# --------------------------------------------------------------------------------- partition


def plan_shards(inputs: Sequence[InputFile], count: int) -> list[list[InputRange]]:
    """Each shard's input ranges, in input order (see the module docstring for the rule)."""
    if count < 1:
        raise ShardError(f"the shard count must be at least 1, got {count}")
    offsets = list(itertools.accumulate((f.size for f in inputs), initial=0))
    total = offsets.pop()
    cuts = [_place_cut(k * total // count, inputs, offsets, total, count) for k in range(1, count)]
    bounds = [0, *cuts, total]
    shards: list[list[InputRange]] = [[] for _ in range(count)]
    for f, offset in zip(inputs, offsets):
        if f.size == 0:
            shards[bisect.bisect_right(bounds, offset, 0, count) - 1].append(InputRange.whole(f))
            continue
        k = bisect.bisect_right(bounds, offset, 0, count) - 1
        while k < count and bounds[k] < offset + f.size:
            lo, hi = max(bounds[k], offset), min(bounds[k + 1], offset + f.size)
            if lo < hi:
                shards[k].append(InputRange(f, lo - offset, hi - offset))
            k += 1
    return shards


def _place_cut(
    cut: int, inputs: Sequence[InputFile], offsets: list[int], total: int, count: int
) -> int:
    """The ideal cut, or the nearest boundary of the file it falls in (see the docstring)."""
    i = bisect.bisect_right(offsets, cut) - 1
    if i < 0:
        return cut
    f, start = inputs[i], offsets[i]
    end = start + f.size
    if not start < cut < end:
        return cut
    nearest = start if cut - start <= end - cut else end
    if f.kind not in SPLITTABLE_KINDS or abs(cut - nearest) * SNAP_FRACTION * count <= total:
        return nearest
    return cut


def describe_ranges(ranges: Sequence[InputRange]) -> str:
    """`reads 3 inputs (1 of them in part), 12.3 MB` for the run's opening line."""
    partial = sum(1 for r in ranges if not r.is_whole)
    size = sum(r.size for r in ranges) / 1e6
    noun = "input" if len(ranges) == 1 else "inputs"
    part = f" ({partial} in part)" if partial else ""
    return f"reads {len(ranges)} {noun}{part}, {size:,.1f} MB"
