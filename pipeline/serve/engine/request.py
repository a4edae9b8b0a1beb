"""What the engine keeps of one generation (`Request`) and what it says of it (`Event`).

A request's fields are read and written by the engine's parts, each under the engine's lock:
the scheduler (`pipeline.serve.engine.scheduler`) queues and admits it, the prefix-cache manager
(`pipeline.serve.engine.prefix_cache`) names and reuses its blocks, a group's leader shares its
prompt with its siblings (`pipeline.serve.engine.groups`), and the engine records its tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.serve.engine.sampling import SamplingParams, TokenLogprobs


@dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    """One generation: its prompt, parameters and progress."""

    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token), "length", "abort"
    generator: torch.Generator | None = None
    blocks: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None  # cache slot of each position, fixed at admission
    computed: int = 0  # tokens whose keys and values are in the cache
    cached_tokens: int = 0  # prompt positions read from another request's cache
    hash_root: bytes = b""  # what its chain of block hashes starts from (its adapter's files)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, so far
    registered: int = 0  # its first blocks named in the prefix cache
    aligned: bool = True  # position p is in blocks[p // block_size] (not so for a sibling
    # sharing a prefix that ends mid-block: its own slots start in a fresh block)
    group: int = -1  # its `add_group`'s leader's id (decode rows packed by it)
    leader: Request | None = None  # a sibling's, until it shares the leader's prompt
    siblings: list[Request] = field(default_factory=list)  # a leader's, until they share
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # when it left the queue for the batch (time.monotonic)
    # with params.prompt_logprobs: each prompt token's, filled as the prompt is prefilled (None
    # for the first token, which has no prefix)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    lora_name: str | None = None  # the adapter it runs with (`pipeline.serve.engine.lora_slots`)
    lora_slot: int | None = None  # the adapter's slot, once admitted
    guide: Any = None  # with params.structured_output: its matcher (GrammarBackend.guide)
    # A hybrid model's: its state slot once admitted, and a sibling's start (its leader's state
    # after the shared prompt) until then (`pipeline.serve.engine.state_slots`).
    state_slot: int | None = None
    start_state: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class Event:
    """A request produced `token`; `finished` when it is done.

    `logprobs`: the token's log-probabilities when the request asked (`params.logprobs`);
    `prompt_logprobs`: the whole prompt's, on a request's first event when it asked
    (`params.prompt_logprobs`; the first prompt token's is None)."""

    request: Request
    token: int
    finished: bool
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
