"""A block (paged) KV cache: fixed-size blocks of token slots shared by every running sequence.

Each layer holds pools of `num_blocks * block_size` slots (plus one scratch slot that padded
positions write to). A sequence owns a list of blocks; its token at position p lives in slot
`blocks[p // block_size] * block_size + p % block_size`, so sequences of any length share one
pool without copying, and a finished sequence's blocks go straight back to the free list.

Blocks are reference-counted so that sequences on the same prompt can read one copy of its
keys and values (the engine's groups, GRPO's completions of one prompt): `allocate` hands out
blocks with one reference, `share` takes another on blocks already allocated, and `release`
drops one, returning a block to the free list only when no sequence holds it any more.

What a slot holds depends on the attention: grouped-query attention caches each token's key
(after RoPE) and value, `[kv_heads, head_dim]` each; multi-head latent attention caches only the
normalised compressed latent `[kv_lora_rank]` and the shared RoPE key `[qk_rope_head_dim]`,
from which the heads' keys and values are recomputed (DeepSeek's memory saving).
"""

from __future__ import annotations

import torch

from pipeline.core.model.config import ModelConfig


def slot_shapes(config: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """The per-token shapes cached by one layer (key, value; or latent, RoPE key) on one of `tp`
    tensor-parallel ranks (each holds its own kv heads; the latent is replicated)."""
    if config.attention_kind == "mla":
        return [(config.mla.kv_lora_rank,), (config.mla.qk_rope_head_dim,)]
    return [(config.num_kv_heads // tp, config.head_dim)] * 2


def bytes_per_token(config: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Cache bytes one token takes over all layers (on one of `tp` ranks)."""
    per_layer = sum(torch.Size(shape).numel() for shape in slot_shapes(config, tp))
    return per_layer * config.num_layers * dtype.itemsize


class CacheFull(RuntimeError):
    """Not enough free blocks for a request's reservation."""


class BlockKVCache:
    """Pools of cache slots per layer and the free list of their blocks (module docstring).

    Sized either by `num_blocks` or by a memory budget (`blocks_for_budget`)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: int = 1,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a cache needs blocks: num_blocks={num_blocks}, size={block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size  # padded positions write here
        slots = self.scratch_slot + 1
        self.pools = [
            [
                torch.zeros(slots, *shape, dtype=dtype, device=device)
                for shape in slot_shapes(config, tp)
            ]
            for _ in range(config.num_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._references = [0] * num_blocks  # sequences holding each block

    @staticmethod
    def blocks_for_budget(
        config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype, tp: int = 1
    ) -> int:
        """How many blocks fit in `budget_bytes` (per rank)."""
        return budget_bytes // (bytes_per_token(config, dtype, tp) * block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int]:
        """Blocks for `tokens` slots, or `CacheFull` (nothing taken)."""
        count = self.blocks_needed(tokens)
        if count > len(self._free):
            raise CacheFull(f"{count} blocks needed, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._references[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take one more reference on `blocks`, already allocated (a sequence that reads another's
        cached prefix); each reference is dropped by one `release`."""
        self._check_held(blocks)
        for block in blocks:
            self._references[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each of `blocks` (and empty the list); a block no sequence holds
        any more goes back to the free list."""
        self._check_held(blocks)
        unheld = []
        for block in blocks:
            self._references[block] -= 1
            if self._references[block] == 0:
                unheld.append(block)
        self._free.extend(reversed(unheld))
        blocks.clear()

    def _check_held(self, blocks: list[int]) -> None:
        free = [block for block in blocks if self._references[block] == 0]
        if free:
            raise ValueError(f"block {free[0]} is free: it has no reference to share or release")

    def slots(self, blocks: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Slot indices of `positions` (any shape) in a sequence owning `blocks`."""
        table = torch.tensor(blocks, dtype=torch.long, device=positions.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        """Store per-token `values` (`[*slots.shape, *slot_shape]` each) at `slots`."""
        flat = slots.reshape(-1)
        for pool, value in zip(self.pools[layer], values):
            pool.index_copy_(0, flat, value.reshape(flat.numel(), *pool.shape[1:]).to(pool.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
        """The cached tensors at `slots` `[batch, length]`: `[batch, length, *slot_shape]` each."""
        flat = slots.reshape(-1)  # index_select: a quarter of the time of pool[slots] on a CPU
        return [pool.index_select(0, flat).view(*slots.shape, *pool.shape[1:])
                for pool in self.pools[layer]]  # fmt: skip
