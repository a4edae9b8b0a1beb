"""Decode rows that share a prefix, packed into one batch row: their common keys read once.

A decode step reads every row's whole history from the KV cache (`BlockKVCache.read`) and
attends over it; the `n` completions of one prompt (an RL step's rollouts) hold the same prompt
blocks, so one row per completion reads and attends over the same prompt keys `n` times. Packed,
a group's completions are one batch row whose queries are their next tokens (each at its own
position) and whose keys are the shared prefix once, then each completion's own positions; a
mask lets each query see the prefix and its own positions only. The attention is the same sum
over the same keys, so the tokens are the same as unpacked; what shrinks is the memory read,
which is what a CPU decode step waits on.

Rows are grouped by the engine's `group` (the requests of one `Engine.add_group`) and packed
when at least two share a prefix of a block or more; the others become rows of one query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pipeline.serve.engine.decode import CachedBatch


class DecodeRow(Protocol):
    """What packing reads of a request (the engine's `Request` is one)."""

    group: int
    computed: int
    slots: torch.Tensor | None

    @property
    def tokens(self) -> list[int]: ...


def common_prefix(histories: Sequence[torch.Tensor], block_size: int) -> int:
    """How many leading slots all `histories` share (whole blocks; 0 if under one block), each
    history's last slot excluded (the query's own)."""
    shortest = min(len(h) for h in histories) - 1
    if len(histories) < 2 or shortest < block_size:
        return 0
    stacked = torch.stack([h[:shortest] for h in histories])
    same = (stacked == stacked[0]).all(0).int().cumprod(0).sum().item()
    return int(same) // block_size * block_size


Packed = tuple[CachedBatch, torch.Tensor, torch.Tensor]


def packed_decode_batch(
    rows: Sequence[DecodeRow], block_size: int, scratch: int, device: torch.device
) -> Packed | None:
    """The batch of decode `rows` (one new token each) with each group sharing a prefix packed
    in one row (module docstring), and each row's (batch row, column) of its token; None when no
    group packs (the plain batch is then as good)."""
    groups: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(row.group, []).append(index)
    if all(len(members) < 2 for members in groups.values()):
        return None  # no group to pack
    histories = [row.slots[: row.computed + 1] for row in rows]
    packs = []
    for members in groups.values():
        shared = common_prefix([histories[i] for i in members], block_size)
        packs += [(members, shared)] if shared else [([i], 0) for i in members]
    if len(packs) == len(rows):
        return None
    width = max(len(members) for members, _ in packs)
    length = max(
        shared + sum(len(histories[i]) - shared for i in members) for members, shared in packs
    )
    tokens = torch.zeros(len(packs), width, dtype=torch.long)
    positions = torch.zeros(len(packs), width, dtype=torch.long)
    write = torch.full((len(packs), width), scratch, dtype=torch.long)
    read = torch.full((len(packs), length), scratch, dtype=torch.long)
    mask = torch.zeros(len(packs), 1, width, length, dtype=torch.bool)
    key_positions = torch.zeros(len(packs), length, dtype=torch.long)
    mask[:, :, :, 0] = True  # a padded query sees one key (no empty softmax)
    where_row = torch.zeros(len(rows), dtype=torch.long)
    where_col = torch.zeros(len(rows), dtype=torch.long)
    for p, (members, shared) in enumerate(packs):
        read[p, :shared] = histories[members[0]][:shared]
        key_positions[p, :shared] = torch.arange(shared)
        start = shared
        for column, i in enumerate(members):
            own = histories[i][shared:]
            read[p, start : start + len(own)] = own
            key_positions[p, start : start + len(own)] = torch.arange(shared, shared + len(own))
            mask[p, 0, column, :shared] = True
            mask[p, 0, column, start : start + len(own)] = True
            tokens[p, column] = rows[i].tokens[rows[i].computed]
            positions[p, column] = rows[i].computed
            write[p, column] = own[-1]
            where_row[i], where_col[i] = p, column
            start += len(own)
    batch = CachedBatch(
        tokens.to(device),
        positions.to(device),
        write.to(device),
        read.to(device),
        mask.to(device),
        key_positions.to(device),
    )
    return batch, where_row.to(device), where_col.to(device)


def batch_row_slots(
    slots: Sequence[int | None], where_row: torch.Tensor, rows: int
) -> list[int | None]:
    """Per batch row, the adapter slot of the requests in it, given each request's slot and
    batch row (`where_row`): requests packed into one row are one group, which runs with one
    adapter."""
    out: list[int | None] = [None] * rows
    for slot, row in zip(slots, where_row.tolist()):
        out[row] = slot
    return out
