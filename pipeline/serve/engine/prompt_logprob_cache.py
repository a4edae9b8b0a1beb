"""Prompt log-probabilities kept with the prefix cache's blocks.

A scoring request (`echo` with `logprobs`, as lm-evaluation-harness sends a loglikelihood
request) needs every prompt token's log-probability, which keys and values alone cannot give: so
without more, it would compute its whole prompt even when a long few-shot prefix is cached (vLLM
does so). Here a block a scoring request computed keeps its positions' entries (`BlockLogprobs`:
the log-probability of each next token and the `top` most likely ones) beside its keys and
values, dropped with them (`BlockKVCache.attach`). A later scoring request takes the cached
blocks whose entries serve it, as a generation takes cached keys and values, and computes only
the rest. A block's last entry predicts the token after the block, outside its hash: it serves
only a prompt that goes on with that same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.sampling import TokenLogprobs


@dataclass(frozen=True)
class BlockLogprobs:
    """One block's prompt log-probabilities: `entries[i]` of the token after its position i
    (`next_token` after its last), each with the `top` most likely tokens."""

    top: int
    entries: tuple[TokenLogprobs, ...]
    next_token: int
    ranks: bool = False  # the entries carry their tokens' ranks


def keep_block_logprobs(
    cache: BlockKVCache,
    block_hash: bytes,
    prompt: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprobs | None],
    index: int,
    top: int,
    ranks: bool = False,
) -> None:
    """Keep the entries of block `index` of a request's prompt with the cached block named
    `block_hash` (the request's, or an equal one computed before), once each of its positions
    predicts a prompt token, unless that block keeps as many tops (and ranks, when the entries
    have them) already. `prompt_logprobs[p]`: token p's entry (None for the first)."""
    size = cache.block_size
    end = (index + 1) * size + 1  # entries index * size + 1 .. end - 1
    named = cache.lookup([block_hash])
    if not named or end > len(prompt_logprobs) or end > len(prompt):
        return
    block = named[0]
    kept = cache.payload(block)
    if isinstance(kept, BlockLogprobs) and kept.top >= top and (kept.ranks or not ranks):
        return
    entries = tuple(prompt_logprobs[index * size + 1 : end])
    kept = BlockLogprobs(top, entries, prompt[end - 1], ranks)  # type: ignore[arg-type]
    cache.attach(block, kept)


def usable_prefix(
    cache: BlockKVCache, blocks: list[int], prompt: Sequence[int], top: int, ranks: bool = False
) -> list[int]:
    """The leading run of `blocks` (cached blocks that begin `prompt`) whose kept entries serve
    a request asking `top` most likely tokens (and the tokens' ranks)."""
    size = cache.block_size
    for i, block in enumerate(blocks):
        kept = cache.payload(block)
        if (
            not isinstance(kept, BlockLogprobs)
            or kept.top < top
            or (ranks and not kept.ranks)
            or kept.next_token != prompt[(i + 1) * size]
        ):
            return blocks[:i]
    return blocks


def prefix_logprobs(cache: BlockKVCache, blocks: list[int], top: int) -> list[TokenLogprobs]:
    """The kept entries of `blocks` (from `usable_prefix`), `top` tokens each."""
    entries = []
    for block in blocks:
        kept = cache.payload(block)
        assert isinstance(kept, BlockLogprobs)
        entries += [TokenLogprobs(e.token_logprob, e.top[:top], e.rank) for e in kept.entries]
    return entries
