"""Completions of one prompt share its prefill (`Engine.add_group`; GRPO's `num_generations`).

The group's first request, its leader, prefills the prompt as any request does; the others,
its siblings, wait in the queue until the leader has computed all but the prompt's last token,
then take a reference on the leader's blocks of those positions (`BlockKVCache.share`, under
the engine's lock, so the leader finishing or aborted later frees nothing they read) and run
only the last prompt token, as a decode row (vLLM recomputes a fully cached prompt's last
token the same way). A sibling reserves cache for only its own positions. A hybrid model's
sibling also starts from a copy of the leader's linear-attention state after that prefix
(`pipeline.serve.engine.state_slots`), which the leader stops its prefill at for them. A
leader that leaves before it gets that far (aborted) leaves its siblings to prefill on their
own (the scheduler lets them go).
"""

from __future__ import annotations

from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.request import Request


def link_group(cache: BlockKVCache, group: list[Request]) -> None:
    """Make `group`'s first request the leader of those of the others that may share its
    prompt (`can_share`)."""
    leader = group[0]
    leader.siblings = [sibling for sibling in group[1:] if can_share(cache, leader, sibling)]
    for sibling in leader.siblings:
        sibling.leader = leader


def can_share(cache: BlockKVCache, leader: Request, sibling: Request) -> bool:
    """Whether `sibling` may read `leader`'s prompt: there is a prefix (the prompt's last token
    is always run), its prompt log-probabilities are the leader's, and the blocks it shares
    plus its own fit the cache (a prefix ending mid-block may cost one more)."""
    shared = len(leader.prompt) - 1
    total = len(sibling.prompt) + sibling.params.max_new_tokens
    blocks = cache.blocks_needed(shared) + cache.blocks_needed(total - shared)
    return (
        shared > 0
        and sibling.params.prompt_logprobs == leader.params.prompt_logprobs
        and blocks <= cache.num_blocks
    )


def share_prompt(cache: BlockKVCache, leader: Request) -> int:
    """Once `leader` has computed its prompt but the last token, give its waiting siblings that
    prefix: a reference on its blocks, their slots, and its prompt log-probabilities (theirs
    are the same). Returns the prompt positions they took (0 before that, or without
    siblings)."""
    shared = len(leader.prompt) - 1
    if not leader.siblings or leader.computed < shared:
        return 0
    states = cache.states
    if states is not None and leader.computed > shared:
        # A hybrid model's state is the leader's after all it computed: past the prefix.
        for sibling in leader.siblings:
            sibling.leader = None  # prefill alone
        leader.siblings = []
        return 0
    blocks = leader.blocks[: cache.blocks_needed(shared)]
    taken = 0
    for sibling in leader.siblings:
        if sibling.finished:
            continue
        cache.share(blocks)
        if states is not None:  # linear attention's state after the prefix
            sibling.start_state = states.snapshot(leader.state_slot)
        sibling.blocks = list(blocks)
        sibling.slots = leader.slots[:shared]
        sibling.computed = sibling.cached_tokens = shared
        sibling.registered = shared // cache.block_size  # the leader's, named by it
        sibling.aligned = shared % cache.block_size == 0
        if sibling.params.prompt_logprobs is not None:
            sibling.prompt_logprobs = list(leader.prompt_logprobs)
        sibling.leader = None
        taken += shared
    leader.siblings = []
    return taken
