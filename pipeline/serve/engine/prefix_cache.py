"""The prefix cache's policy (vLLM's automatic prefix caching): which blocks a request names,
which cached blocks it may take, and what taking them gives it.

The cache itself (`pipeline.serve.engine.kv_cache.BlockKVCache`) keeps named blocks after their
last release and evicts them least recently used first; this manager decides, per request:

* names: every full block a request computes, prompt or generated, is named by the chain hash
  of its tokens and everything before them (`kv_cache.block_hashes`). The chain starts from the
  base model's empty root or from the request's adapter (its name and files), so an adapter's
  blocks are never another adapter's or the base model's; a request's `cache_salt` is mixed
  into the root, so salted requests share blocks only with requests of the same salt.
* lookup: a request takes the longest run of cached blocks that begins its prompt, never the
  whole prompt (its last token is always run, so there are logits to sample). A request asking
  `prompt_logprobs` takes only the cached blocks that kept the log-probabilities of their
  positions, which blocks computed by such a request do
  (`pipeline.serve.engine.prompt_logprob_cache`).
* taking: the blocks taken are the request's first blocks, their positions computed.

Only a request whose position p lies in its block p // block_size names its blocks (not a
sibling sharing a prefix that ends mid-block, nor a request whose first blocks were computed
by weights since replaced). The manager holds no lock: the engine calls it under its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pipeline.serve.engine.kv_cache import BlockKVCache, block_hashes
from pipeline.serve.engine.prompt_logprob_cache import (
    keep_block_logprobs,
    prefix_logprobs,
    usable_prefix,
)
from pipeline.serve.engine.request import Request

if TYPE_CHECKING:
    from pipeline.serve.engine.lora_slots import LoRASlots


def chain_root(
    lora_name: str | None, adapters: LoRASlots | None, cache_salt: str | None = None
) -> bytes:
    """What a request's chain of block hashes starts from: the base model's empty root, or its
    adapter's name and files (as `adapters` has it registered now); a `cache_salt` (vLLM's)
    mixed in, so only requests with the same salt share blocks."""
    root = b""
    if lora_name is not None:
        source = f"lora\0{lora_name}\0{adapters.registered.get(lora_name)}"
        root = hashlib.sha256(source.encode()).digest()
    if cache_salt:
        root = hashlib.sha256(root + b"salt\0" + cache_salt.encode()).digest()
    return root


class PrefixCacheManager:
    """The prefix cache's policy over `cache` (module docstring); `enabled` False (the engine's
    `prefix_caching=False`): nothing is named, so nothing is ever found."""

    def __init__(self, cache: BlockKVCache, enabled: bool) -> None:
        self.cache = cache
        self.enabled = enabled

    def prompt_hashes(self, prompt: list[int], root: bytes) -> list[bytes]:
        """The chain hashes from `root` of the prompt's full blocks that a request may read from
        the cache (never the block of its last token); none when disabled."""
        if not self.enabled:
            return []
        return block_hashes(prompt[: len(prompt) - 1], self.cache.block_size, root)

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks of the start of `request`'s prompt (none for a sibling that shares
        its leader's; for one that needs its prompt's log-probabilities, those that kept
        them)."""
        if request.slots is not None:
            return []
        hits, top = self.cache.lookup(request.block_hashes), request.params.prompt_logprobs
        if top is None:
            return hits
        ranks = request.params.logprob_ranks
        return usable_prefix(self.cache, hits, request.prompt, top, ranks)

    def take(self, request: Request, hits: list[int]) -> int:
        """Start `request` on the cached blocks `hits` (from `lookup`): its first positions are
        computed, and their prompt log-probabilities known when it asks. Returns how many
        prompt positions it took."""
        if not hits:
            return 0
        self.cache.take(hits)
        cached = len(hits) * self.cache.block_size
        request.blocks = list(hits)
        request.slots = self.cache.slots(hits, torch.arange(cached))
        request.computed = request.cached_tokens = cached
        request.registered = len(hits)
        top = request.params.prompt_logprobs
        if top is not None:
            request.prompt_logprobs += prefix_logprobs(self.cache, hits, top)
        return cached

    def register(self, request: Request) -> None:
        """Name `request`'s blocks that are full now (those of a request whose blocks are not
        its positions' are never named: module docstring)."""
        if not (self.enabled and request.aligned):
            return
        size = self.cache.block_size
        full = request.computed // size
        if full <= request.registered:
            return
        known = len(request.block_hashes)
        if known < full:
            parent = request.block_hashes[-1] if known else request.hash_root
            fresh = request.tokens[known * size : full * size]
            request.block_hashes += block_hashes(fresh, size, parent)
        top = request.params.prompt_logprobs
        for index in range(request.registered, full):
            self.cache.register(request.blocks[index], request.block_hashes[index])
            if top is not None:
                hashed = request.block_hashes[index]
                keep_block_logprobs(
                    self.cache,
                    hashed,
                    request.prompt,
                    request.prompt_logprobs,
                    index,
                    top,
                    request.params.logprob_ranks,
                )
        request.registered = full

    def reset(self, requests: Iterable[Request]) -> None:
        """Forget every cached block (new weights make them stale); of `requests` (those running
        or waiting), the ones that computed something name nothing more."""
        self.cache.reset_prefix_cache()
        for request in requests:
            if request.computed:  # its blocks so far hold the old weights' keys
                request.aligned = False
