"""The model's forward pass over new tokens, with the rest of each sequence read from a KV cache.

The model runs its own modules (`Transformer.forward` with a cache, `pipeline.core.model.
kv_seam`); this module only says where a batch's entries go and what its tokens see. Each
attention layer hands over its new tokens' entries, which are written to their slots of the
`BlockKVCache` first; then each row's whole history is read back and attended to under a causal
mask by position. Decode rows over resident rows (`pipeline.serve.engine.resident_rows`) read
their history in place there instead of out of the blocks. `tests/serve` checks this path
against transformers' `generate` for every family.

A batch is `[batch, new]` tokens, each row one sequence: a prompt chunk (prefill) or one token
(decode). Rows shorter than the longest are padded; padded positions write to the cache's scratch
slot and are never read. A hybrid model's linear-attention layers read and write each row's
state slot instead (`LayerStates`), and leave their state as it is over the padding.

Sliding-window layers (`ModelConfig.layer_types`, gpt-oss) see the same cache under a narrower
mask: keys fewer than `window` positions before the query (`CachedBatch.window_mask`); the keys
outside stay in the cache (nothing is evicted yet). Attention sinks need nothing here: the
attention module passes them to its kernel with the cached keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipeline.core.model.kv_seam import attend
from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.resident_rows import ResidentRows


@dataclass
class CachedBatch:
    """Where a batch's tokens go and what they see.

    tokens, positions, write_slots: `[batch, new]`; read_slots `[batch, length]`: the slots of
    positions 0..length-1 of each row (padded with any slot; the mask hides them), or, when the
    rows attend over resident rows (`resident`, `pipeline.serve.engine.resident_rows`), None and
    `key_length` the longest row's length. `attend`:
    which keys each query sees, when the read slots are not positions in order (rows packed by
    `pipeline.serve.engine.packing`), and `key_positions` `[batch, length]` the position of each
    read slot's token then (None: 0..length-1; ALiBi's biases and sliding windows need them)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor | None
    attend: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    # A hybrid model's rows: each row's state slot `[batch]` (`pipeline.serve.engine.
    # state_slots`) and which new tokens are real `[batch, new]` (None: all of them).
    state_slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    resident: ResidentRows | None = None
    key_length: int = 0

    @property
    def length(self) -> int:
        """Keys each row attends over (its history padded to the longest row's)."""
        return self.key_length if self.read_slots is None else self.read_slots.shape[1]

    def read_positions(self) -> torch.Tensor:
        """The position of each read slot's token, `[batch or 1, length]`."""
        if self.key_positions is not None:
            return self.key_positions
        return torch.arange(self.length, device=self.positions.device)[None]

    def mask(self) -> torch.Tensor | None:
        """`[batch, 1, new, length]`: query at position p sees keys at positions <= p; None when
        that is every key (one new token per row, all rows as long: the common decode step)."""
        if self.attend is not None:
            return self.attend
        length = self.length
        if self.positions.shape[1] == 1 and bool((self.positions == length - 1).all()):
            return None
        keys = torch.arange(length, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)

    def window_mask(self, window: int, mask: torch.Tensor | None) -> torch.Tensor:
        """`mask` (this batch's, None: every key) narrowed to keys fewer than `window`
        positions before each query; built from the positions alone (no host sync)."""
        keys = self.read_positions()
        near = ((self.positions[:, :, None] - keys[:, None, :]) < window).unsqueeze(1)
        return near if mask is None else mask & near


class LayerSlots:
    """One layer of a `BlockKVCache` seen by one batch: the model's `LayerKVCache`. `fresh`:
    read the history into new tensors, not the cache's reused read buffer (a captured step's,
    `pipeline.serve.engine.static_decode`)."""

    def __init__(
        self,
        cache: BlockKVCache,
        layer: int,
        batch: CachedBatch,
        mask: torch.Tensor | None,
        fresh: bool = False,
    ) -> None:
        self.cache, self.index, self.batch, self.mask = cache, layer, batch, mask
        self.fresh = fresh

    @property
    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.positions, self.batch.read_positions()

    def update(self, *new: torch.Tensor) -> Sequence[torch.Tensor]:
        self.cache.write(self.index, self.batch.write_slots, *new)
        dtype = new[0].dtype
        resident = self.batch.resident
        if resident is not None:
            read = resident.update(self.index, *new)
        else:
            read = self.cache.read(self.index, self.batch.read_slots, fresh=self.fresh)
        return [t.to(dtype) for t in read]


class LayerStates:
    """One linear-attention layer's state slots seen by one batch: the model's
    `LayerStateCache` (`pipeline.core.model.linear_attention`)."""

    def __init__(self, cache: BlockKVCache, layer: int, batch: CachedBatch) -> None:
        self.states, self.index, self.batch = cache.states, layer, batch
        self.valid = batch.valid

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states.read(self.index, self.batch.state_slots)

    def write(self, window: torch.Tensor, state: torch.Tensor) -> None:
        self.states.write(self.index, self.batch.state_slots, window, state)


class BatchSlots:
    """A `BlockKVCache` seen by one batch: the model's `KVCache` (`pipeline.core.model.kv_seam`),
    its mask computed once for all layers, and once per window for sliding-window layers
    (`windows`: layer -> window; `fresh`: as `LayerSlots`')."""

    def __init__(
        self,
        cache: BlockKVCache,
        batch: CachedBatch,
        fresh: bool = False,
        windows: dict[int, int] | None = None,
    ) -> None:
        self.cache, self.batch, self.mask, self.fresh = cache, batch, batch.mask(), fresh
        self.windows = windows or {}
        self._windowed: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> LayerSlots | LayerStates:
        states = self.cache.states
        if states is not None and states.is_linear(index):
            return LayerStates(self.cache, index, self.batch)
        window = self.windows.get(index)
        if window is None:
            return LayerSlots(self.cache, index, self.batch, self.mask, self.fresh)
        if window not in self._windowed:
            self._windowed[window] = self.batch.window_mask(window, self.mask)
        return LayerSlots(self.cache, index, self.batch, self._windowed[window], self.fresh)


@dataclass
class MixedBatch:
    """Batches run as one row of tokens: `parts` (an engine step's decode rows, then each
    prompt chunk as a batch of one row), their tokens and positions laid end to end,
    `[1, total]`. Every product sees all of the step's tokens at once; attention runs part by
    part (`MixedSlots`)."""

    parts: list[CachedBatch]

    @property
    def tokens(self) -> torch.Tensor:
        return torch.cat([part.tokens.reshape(-1) for part in self.parts])[None]

    @property
    def positions(self) -> torch.Tensor:
        return torch.cat([part.positions.reshape(-1) for part in self.parts])[None]


class MixedSlots:
    """A `MixedBatch`'s cache: the model's `KVCache`, one `BatchSlots` per part."""

    def __init__(self, cache: BlockKVCache, batch: MixedBatch, windows: dict[int, int]) -> None:
        self.parts = [BatchSlots(cache, part, windows=windows) for part in batch.parts]

    def layer(self, index: int) -> MixedLayerSlots:
        return MixedLayerSlots([part.layer(index) for part in self.parts])


class MixedLayerSlots:
    """One layer of a `MixedBatch`: each part's new tokens are cut out of the one row, stored
    and attended over by that part's `LayerSlots`, and the outputs laid end to end again."""

    def __init__(self, parts: list[LayerSlots]) -> None:
        self.parts = parts

    def attend(
        self,
        kernel: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        outs, start = [], 0
        for part in self.parts:
            rows, new = part.batch.tokens.shape
            end = start + rows * new
            # [1, heads, total, dim] -> this part's [rows, heads, new, dim]
            cut = [t[0, :, start:end].unflatten(1, (rows, new)).transpose(0, 1) for t in (q, k, v)]
            out = attend(part, kernel, *cut, **extra)
            outs.append(out.transpose(0, 1).flatten(1, 2))
            start = end
        return torch.cat(outs, dim=1)[None]


def layer_windows(model: Transformer) -> dict[int, int]:
    """The sliding window of each sliding-window layer of `model`, by layer index."""
    config = model.config
    windows = {i: config.attention_window(i) for i in range(config.num_layers)}
    return {i: w for i, w in windows.items() if w is not None}


@torch.no_grad()
def forward_cached(
    model: Transformer, cache: BlockKVCache, batch: CachedBatch | MixedBatch
) -> torch.Tensor:
    """Hidden states `[batch, new, hidden]` after the final norm, updating the cache."""
    if isinstance(batch, MixedBatch):
        slots = MixedSlots(cache, batch, layer_windows(model))
    else:
        slots = BatchSlots(cache, batch, windows=layer_windows(model))
    return model(batch.tokens, batch.positions, cache=slots)
