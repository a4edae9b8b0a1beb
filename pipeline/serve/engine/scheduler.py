"""The engine's waiting queue and running batch: what joins the batch, and what each step runs.

Requests wait in a bounded queue (`QueueFull` over it) and join the running batch at a token
boundary, first come, first served, as soon as a batch slot is free and the cache can reserve
their blocks: prompt plus `max_new_tokens`, less what they read from another request's cache
(their leader's prompt, `pipeline.serve.engine.groups`, or the prefix cache's blocks,
`pipeline.serve.engine.prefix_cache`), so a running request never runs out of cache. A
request with an adapter also needs one of the adapters' slots. The head of the queue that
cannot join blocks those behind it, so no request waits forever.

Each step runs one token for every request already decoding, then at most `prefill_chunk`
prompt tokens (a long prompt is split over several steps, so it never stalls the requests
already generating). A hybrid model's request takes a state slot when admitted
(`pipeline.serve.engine.state_slots`); a leader of siblings prefills its prompt but the last
token first, so that they can start from its state there.

The scheduler holds no lock: the engine calls it under its own.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipeline.serve.engine.groups import link_group
from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.prefix_cache import PrefixCacheManager, chain_root
from pipeline.serve.engine.request import Request
from pipeline.serve.engine.sampling import SamplingParams, make_generator

if TYPE_CHECKING:
    from pipeline.serve.engine.lora_slots import LoRASlots

Rows = list[tuple[Request, int]]  # (request, tokens it runs this step)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; try again later."""


class Scheduler:
    """The queue and the batch (module docstring): at most `max_batch` requests running and
    `max_waiting` waiting; `device`: where their random generators live."""

    def __init__(
        self,
        cache: BlockKVCache,
        prefix_cache: PrefixCacheManager,
        *,
        max_batch: int,
        max_waiting: int,
        prefill_chunk: int,
        device: torch.device,
    ) -> None:
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.device = device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()

    def queue(
        self,
        prompt: list[int],
        params: Sequence[SamplingParams],
        lora_name: str | None,
        adapters: LoRASlots | None,
    ) -> list[Request]:
        """Queue one request per `params` entry on `prompt`, a group (`groups.link_group`),
        with the adapter `lora_name` of `adapters`, read now unless resident. `QueueFull` over
        the bound, ValueError (`LoRASlotError`) for an adapter it cannot serve; then nothing is
        queued."""
        if len(self.waiting) + len(params) > self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        if lora_name is not None:
            if adapters is None:
                raise ValueError(f"adapter {lora_name!r}: this engine serves no adapters")
            for _ in params:
                adapters.hold(lora_name)
        root = chain_root(lora_name, adapters, params[0].cache_salt if params else None)
        hashes = self.prefix_cache.prompt_hashes(prompt, root)
        group = []
        for each in params:
            request = Request(next(self._ids), list(prompt), each, lora_name=lora_name)
            request.hash_root, request.block_hashes = root, list(hashes)
            request.generator = make_generator(each, self.device)
            if each.prompt_logprobs is not None:
                request.prompt_logprobs.append(None)  # the first token's: it has no prefix
            group.append(request)
        for request in group:
            request.group = group[0].id
        link_group(self.cache, group)
        self.waiting.extend(group)
        return group

    def admit(self, adapters: LoRASlots | None) -> int:
        """Move waiting requests into the batch, first come, first served, reserving the cache
        of each one's positions beyond those it shares (a sibling's slots continue its
        leader's; a request's cached prefix is its first blocks). Returns how many prompt
        positions they took from the prefix cache."""
        taken = 0
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if request.leader is not None:
                if not request.leader.finished:
                    break  # wait for the leader's prefill
                request.leader = None  # it left before sharing: prefill alone
            hits = self.prefix_cache.lookup(request)
            total = len(request.prompt) + request.params.max_new_tokens
            need = total - request.cached_tokens - len(hits) * self.cache.block_size
            if self.cache.blocks_needed(need) > self.cache.free_blocks - self.cache.unheld(hits):
                break  # first come, first served: wait for blocks
            if request.lora_name is not None:
                request.lora_slot = adapters.acquire(request.lora_name)
                if request.lora_slot is None:
                    break  # every adapter slot is in use: wait for one
            taken += self.prefix_cache.take(request, hits)
            own = self.cache.allocate(need)
            slots = self.cache.slots(own, torch.arange(need))
            request.slots = slots if request.slots is None else torch.cat([request.slots, slots])
            request.blocks += own
            request.admitted = time.monotonic()
            if self.cache.states is not None:  # a hybrid model: the request's state slot
                request.state_slot = self.cache.states.acquire()
                if request.start_state is not None:  # a sibling: its leader's prompt state
                    self.cache.states.restore(request.state_slot, request.start_state)
                    request.start_state = None
            self.running.append(self.waiting.popleft())
        return taken

    def rows(self) -> tuple[Rows, Rows]:
        """This step's work: a decode row for each running request with one token left to run
        (generated, or its prompt's last), and prefill rows of at most `prefill_chunk` prompt
        tokens in all, first admitted first."""
        decoding = [(r, 1) for r in self.running if r.computed == len(r.tokens) - 1]
        prefill, budget = [], self.prefill_chunk
        for request in self.running:
            left = len(request.prompt) - request.computed
            if left > 1 and budget > 0:
                if request.siblings and self.cache.states is not None:
                    left -= 1  # stop before the last token: the siblings start from there
                prefill.append((request, min(left, budget)))
                budget -= prefill[-1][1]
        return decoding, prefill

    def remove(self, request: Request) -> None:
        """Take `request` out of the queue or the batch (it finished or was aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
