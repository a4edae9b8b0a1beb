"""Decoding requests' keys and values kept row by row, so a decode step attends over them in place.

The block cache (`pipeline.serve.engine.kv_cache`) scatters a sequence over blocks; to attend,
each layer of each step gathers every row's whole history into one tensor, then attention reads
that copy. On a CPU the gather costs about as much as the attention itself (a 32-row step of the
56M benchmark model: 4.7 ms of index_select and 5 ms of attention in a 27 ms step), and it is
the same rows each step, one token longer. vLLM's CPU attention reads the blocks in place with
its own kernel; this module gets there with torch's own attention instead: each decoding
request also owns one row of a per-layer tensor `[rows, capacity, *entry]` holding its entries
at their positions, a step writes only its new token there (beside the block cache, which stays
the record for prefix caching and prefill), and attention reads `[:batch, :length]` as a view.

Rows stay packed at the front, so a step's batch is always rows 0..n-1 in row order (`arrange`
gives the order): a request that stops decoding leaves a hole that the last row moves into (one
row's copy), and a new request, or one whose row is out of date (a step it ran in another batch
shape), fills its row from the blocks once (one row's gather). Padding and stale entries past
a row's length are hidden by the causal mask, as the gathered batch's are.

The rows cost memory beside the block cache: `rows x capacity` positions of every layer, the
capacity growing with the longest running request. When that would exceed `budget_bytes`, the
step gathers as before and the rows are dropped (`arrange` returns None), to be refilled when
the batch fits again.

Attention reads each head's history on its own. Up to `BY_HEAD_CAPACITY` positions the rows keep
each position's heads together (`[rows, capacity, heads, head_dim]`), as the blocks do; longer
rows keep them head by head (`[rows, heads, capacity, head_dim]`, each head's history one
matrix), which torch's SDPA reads faster for one query per row: 0.56x its time at one row and
0.68-0.70x at 8 and 32 rows over 1,000 keys on the serving benchmark's model, where at 100 keys
the layout by position is as fast at one row and ~10% faster at 8 and 32
(`scripts/bench/decode_costs.py`). SDPA gives the same bits over either layout (every family
checked in `tests/serve/test_resident_rows.py`). `update` and `by_position` show every layout as
`[rows, positions, *entry]`. Entries without heads (latent attention's) keep the one layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.serve.engine.kv_cache import BlockKVCache

CAPACITY_STEP = 256  # positions: capacity grows in these steps, so it is rarely reallocated
# Rows of more positions keep entries of heads head by head (module docstring).
BY_HEAD_CAPACITY = 256


class ResidentRows:
    """Per-layer rows of the decoding requests' entries (module docstring): `max_rows` rows
    (the engine's batch), at most `budget_bytes` in all."""

    def __init__(self, cache: BlockKVCache, max_rows: int, budget_bytes: int) -> None:
        self.cache, self.max_rows, self.budget_bytes = cache, max_rows, budget_bytes
        # Per layer, per kind of entry: `[rows, capacity, *entry]`, rows and capacity growing
        # with the batch; none for layers without keys and values (linear attention keeps
        # states instead). Past `BY_HEAD_CAPACITY`, entries of heads (`[heads, head_dim]`)
        # are kept head by head, `[rows, heads, capacity, head_dim]` (`by_head`).
        self.buffers: list[list[torch.Tensor]] = [[] for _ in cache.pools]
        self.by_head = False
        self.rows = 0  # rows allocated
        self.capacity = 0  # positions each row holds
        self.requests: list[Any] = []  # the request in each row, rows packed at the front
        self.lengths: list[int] = []  # positions held by each row
        self.length = 0  # the longest row's, this step
        self.steps = self.fills = self.moves = 0  # steps run over the rows; rows filled, moved
        self._write_at: torch.Tensor | None = None  # this step's entry of each row, flat index

    def arrange(self, requests: Sequence[Any]) -> list[int] | None:
        """Make rows 0..n-1 hold `requests` (this step's decode rows: each with `computed`
        positions in the cache and one new token) and return the order of `requests` row by
        row; None when the rows would not fit in the budget (the step gathers instead)."""
        self.length = max(request.computed for request in requests) + 1
        if not self._fits(requests):
            self.requests, self.lengths = [], []
            return None
        current = {id(request) for request in requests}
        kept = [
            row
            for row, request in enumerate(self.requests)
            if id(request) in current and self.lengths[row] == request.computed
        ]
        self._compact(kept)
        held = {id(request) for request in self.requests}
        for request in requests:
            if id(request) not in held:
                self._fill(request)
        # the step writes each row's next position, at the same place in every layer
        at = [row * self.capacity + n for row, n in enumerate(self.lengths)]
        self._write_at = torch.tensor(at, device=self.cache.pools[0][0].device)
        self._write_by_head = {}
        self.lengths = [n + 1 for n in self.lengths]
        self.steps += 1
        index = {id(request): i for i, request in enumerate(requests)}
        return [index[id(request)] for request in self.requests]

    def update(self, layer: int, *new: torch.Tensor) -> list[torch.Tensor]:
        """Write the new tokens' entries (`[rows, 1, *entry]` each, rows in `arrange`'s order)
        at each row's next position; return each kind's `[rows, length, *entry]` view."""
        rows = len(self.requests)
        out = []
        for buffer, value in zip(self.buffers[layer], new):
            entry = value.shape[2:]
            if self._kept_by_head(entry):
                flat, at = buffer.view(-1, entry[1]), self._write_index(entry[0])
            else:
                flat, at = buffer.view(-1, *entry), self._write_at
            flat.index_copy_(0, at, value.reshape(-1, *flat.shape[1:]).to(buffer.dtype))
            out.append(self.by_position(buffer)[:rows, : self.length])
        return out

    def _kept_by_head(self, entry: torch.Size) -> bool:
        return self.by_head and len(entry) == 2

    def by_position(self, buffer: torch.Tensor) -> torch.Tensor:
        """`buffer` seen as `[rows, capacity, *entry]` (a view where it is kept head by head)."""
        return buffer.transpose(1, 2) if self.by_head and buffer.dim() == 4 else buffer

    def _write_index(self, heads: int) -> torch.Tensor:
        """This step's entry of each row and head in a buffer kept head by head, flat index
        (rows, then heads: the order of the new entries)."""
        index = self._write_by_head.get(heads)
        if index is None:
            row = self._write_at.div(self.capacity, rounding_mode="floor")[:, None]
            position = (self._write_at % self.capacity)[:, None]
            head = torch.arange(heads, device=row.device)
            index = ((row * heads + head) * self.capacity + position).reshape(-1)
            self._write_by_head[heads] = index
        return index

    # ---- rows -------------------------------------------------------------------------------

    def fits(self, requests: Sequence[Any]) -> bool:
        """Whether rows for `requests` (as `arrange` takes them) fit the budget."""
        return self._within_budget(*self._size(requests))

    def _within_budget(self, rows: int, capacity: int) -> bool:
        return rows * capacity * self.cache.slot_bytes <= self.budget_bytes

    def _size(self, requests: Sequence[Any]) -> tuple[int, int]:
        """The rows and capacity the buffers need for `requests`: rows to a power of two up to
        `max_rows`, positions to a multiple of CAPACITY_STEP, never fewer than now."""
        rows, positions = len(requests), max(request.computed for request in requests) + 1
        rows = max(self.rows, min(self.max_rows, 1 << (rows - 1).bit_length()))
        return rows, max(self.capacity, -(-positions // CAPACITY_STEP) * CAPACITY_STEP)

    def _fits(self, requests: Sequence[Any]) -> bool:
        """`fits`, growing the buffers if they must."""
        rows, capacity = self._size(requests)
        if not self._within_budget(rows, capacity):
            return False
        if (rows, capacity) != (self.rows, self.capacity):
            self._grow(rows, capacity)
        return True

    def _grow(self, rows: int, capacity: int) -> None:
        """Reallocate every layer's buffers at `rows x capacity`, keeping what rows hold (head
        by head past `BY_HEAD_CAPACITY`)."""
        held, longest = len(self.requests), max(self.lengths, default=0)
        before = [[self.by_position(buffer) for buffer in kinds] for kinds in self.buffers]
        self.by_head = capacity > BY_HEAD_CAPACITY
        for layer, pools in enumerate(self.cache.pools):
            self.buffers[layer] = [
                self._new_buffer(pool.new_zeros, rows, capacity, pool.shape[1:])
                for pool in pools
                if pool.shape[0]
            ]
            for buffer, old in zip(self.buffers[layer], before[layer]):
                self.by_position(buffer)[:held, :longest] = old[:held, :longest]
        self.rows, self.capacity = rows, capacity

    def _new_buffer(self, zeros, rows: int, capacity: int, entry: torch.Size) -> torch.Tensor:
        if self._kept_by_head(entry):
            return zeros(rows, entry[0], capacity, entry[1])
        return zeros(rows, capacity, *entry)

    def _compact(self, kept: list[int]) -> None:
        """Keep only rows `kept` (ascending), moving the last kept rows into the holes."""
        keep = set(kept)
        holes = [row for row in range(len(kept)) if row not in keep]
        movers = [row for row in reversed(kept) if row >= len(kept)]
        for hole, row in zip(holes, movers):
            for kinds in self.buffers:
                for buffer in map(self.by_position, kinds):
                    buffer[hole, : self.lengths[row]] = buffer[row, : self.lengths[row]]
            self.requests[hole], self.lengths[hole] = self.requests[row], self.lengths[row]
            self.moves += 1
        del self.requests[len(kept) :], self.lengths[len(kept) :]

    def _fill(self, request: Any) -> None:
        """Give `request` the next row, filled with its positions so far from the blocks."""
        row, length = len(self.requests), request.computed
        slots = request.slots[:length]
        for kinds, pools in zip(self.buffers, self.cache.pools):
            for buffer, pool in zip(kinds, [pool for pool in pools if pool.shape[0]]):
                self.by_position(buffer)[row, :length] = pool.index_select(0, slots)
        self.requests.append(request)
        self.lengths.append(length)
        self.fills += 1
