"""A block (paged) KV cache: fixed-size blocks of token slots shared by every running sequence.

Each layer holds pools of `num_blocks * block_size` slots (plus one scratch slot that padded
positions write to). A sequence owns a list of blocks; its token at position p lives in slot
`blocks[p // block_size] * block_size + p % block_size`, so sequences of any length share one
pool without copying, and a finished sequence's blocks go straight back to the free list.

Blocks are reference-counted so that sequences on the same prompt can read one copy of its
keys and values (the engine's groups, GRPO's completions of one prompt): `allocate` hands out
blocks with one reference, `share` takes another on blocks already allocated, and `release`
drops one, returning a block to the free list only when no sequence holds it any more.

Prefix caching keeps full blocks after their last release: `register` names a full block by a
chain hash of its tokens and of every token before it (`block_hashes`), `lookup` finds the
longest run of such blocks that begins a prompt, and `take` holds them for a new sequence. A
named block no sequence holds is cached but free: it counts in `free_blocks` and is evicted,
least recently released first, only when `allocate` finds the free list empty (vLLM's automatic
prefix caching). A block in use is never evicted; `reset_prefix_cache` forgets every name (new
weights make the cached keys and values stale).

What a slot holds depends on the attention: grouped-query attention caches each token's key
(after RoPE) and value, `[kv_heads, head_dim]` each; multi-head latent attention caches only the
normalised compressed latent `[kv_lora_rank]` and the shared RoPE key `[qk_rope_head_dim]`,
from which the heads' keys and values are recomputed (DeepSeek's memory saving).
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.kv_sizes import kv_bytes_per_token, slot_shapes
from pipeline.serve.engine.state_slots import StateSlots


def bytes_per_token(config: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Cache bytes one token takes over all layers (on one of `tp` ranks)."""
    return kv_bytes_per_token(config, dtype.itemsize, tp)


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The chain hash of each full block of `tokens`: block i's is sha256(block i-1's hash,
    block i's tokens), so equal hashes mean equal tokens from the first position on. `parent`:
    the hash of the block before `tokens[0]` (b"" at the start of a sequence)."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return hashes


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
        # Linear-attention layers keep a state per sequence (`state_slots`), no keys and values:
        # their pools are empty.
        self.pools = [
            [
                torch.zeros(
                    slots if config.layer_type(layer) != "linear_attention" else 0,
                    *shape,
                    dtype=dtype,
                    device=device,
                )
                for shape in slot_shapes(config, tp)
            ]
            for layer in range(config.num_layers)
        ]
        # A hybrid model's per-sequence states (`pipeline.serve.engine.state_slots`), set by
        # the engine; None without linear attention.
        self.states: StateSlots | None = None
        self._free = list(range(num_blocks - 1, -1, -1))
        self._references = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # a named (full, cached) block's chain hash
        self._block_of: dict[bytes, int] = {}  # and back
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unheld: LRU first
        self.evictions = 0  # cached blocks reused for other tokens, so far
        self._read_buffers: dict[int, torch.Tensor] = {}  # `read`'s output, by slot kind
        self._payloads: dict[int, object] = {}  # what a named block's user keeps with it

    @staticmethod
    def blocks_for_budget(
        config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype, tp: int = 1
    ) -> int:
        """How many blocks fit in `budget_bytes` (per rank)."""
        return budget_bytes // (bytes_per_token(config, dtype, tp) * block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks `allocate` can hand out: the free list and the cached blocks nobody holds."""
        return len(self._free) + len(self._evictable)

    @functools.cached_property
    def slot_bytes(self) -> int:
        """The bytes one slot (one token's entries) takes over every layer's pools (fixed at
        construction; read by every resident-rows step)."""
        return sum(
            pool.shape[1:].numel() * pool.element_size()
            for pools in self.pools
            for pool in pools
            if pool.shape[0]  # linear attention's empty pools hold no slot
        )

    @property
    def pool_bytes(self) -> int:
        """The bytes of every layer's pools (their slots and the scratch slot)."""
        return self.slot_bytes * (self.scratch_slot + 1)

    @property
    def cached_blocks(self) -> int:
        """Blocks named by a hash (held or not)."""
        return len(self._block_of)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int]:
        """Blocks for `tokens` slots, or `CacheFull` (nothing taken)."""
        count = self.blocks_needed(tokens)
        if count > self.free_blocks:
            raise CacheFull(f"{count} blocks needed, {self.free_blocks} free")
        blocks = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        for block in blocks:
            self._references[block] = 1
        return blocks

    def _evict(self) -> int:
        """The least recently released cached block, its name forgotten."""
        block, _ = self._evictable.popitem(last=False)
        self.evictions += 1
        del self._block_of[self._hash_of.pop(block)]
        self._payloads.pop(block, None)
        return block

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
        # a sequence's last blocks are the least likely to be shared: evicted first (vLLM's order)
        for block in reversed(unheld):
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        blocks.clear()

    # ---- prefix caching -------------------------------------------------------------------------

    def register(self, block: int, block_hash: bytes) -> None:
        """Name the full, held `block` by its chain hash, so later sequences find it. A hash
        already naming another block (two sequences computed the same tokens) keeps that one."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of `hashes` (a prompt's `block_hashes`)."""
        found = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def attach(self, block: int, payload: object) -> None:
        """Keep `payload` with the named `block` until its name goes (evicted, reset): what was
        computed with its tokens besides keys and values
        (`pipeline.serve.engine.prompt_logprob_cache`)."""
        if block in self._hash_of:
            self._payloads[block] = payload

    def payload(self, block: int) -> object | None:
        """What `attach` keeps with `block`, if anything."""
        return self._payloads.get(block)

    def unheld(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (found by `lookup`) no sequence holds: taking them takes them
        out of `free_blocks`."""
        return sum(1 for block in blocks if block in self._evictable)

    def take(self, blocks: Sequence[int]) -> None:
        """Take one reference on each of the cached `blocks` (found by `lookup`), held or not."""
        for block in blocks:
            self._evictable.pop(block, None)
            self._references[block] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every block's name: the unheld cached blocks become plain free blocks and
        nothing is found until blocks are registered again (after new weights)."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._payloads.clear()

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

    def read(self, layer: int, slots: torch.Tensor, fresh: bool = False) -> list[torch.Tensor]:
        """The cached tensors at `slots` `[batch, length]`: `[batch, length, *slot_shape]` each,
        views of buffers the next `read` overwrites (a layer attends over them before the next
        layer reads); with `fresh`, new tensors instead (a CUDA graph's step must not hold a
        buffer that an eager step may reallocate)."""
        flat = slots.reshape(-1)  # index_select: a quarter of the time of pool[slots] on a CPU
        out = []
        for kind, pool in enumerate(self.pools[layer]):
            if fresh:
                read = pool.index_select(0, flat)
            else:
                read = self._read_buffer(kind, pool, flat.numel())
                torch.index_select(pool, 0, flat, out=read)
            out.append(read.view(*slots.shape, *pool.shape[1:]))
        return out

    def _read_buffer(self, kind: int, pool: torch.Tensor, rows: int) -> torch.Tensor:
        """`rows` entries of `pool`'s shape from a buffer kept between reads: a fresh tensor of
        a batch's whole history each layer costs more in page faults than the copy itself."""
        row = pool[0].numel()
        buffer = self._read_buffers.get(kind)
        if buffer is None or buffer.numel() < rows * row:
            buffer = torch.empty(rows * row, dtype=pool.dtype, device=pool.device)
            self._read_buffers[kind] = buffer
        return buffer[: rows * row].view(rows, *pool.shape[1:])
