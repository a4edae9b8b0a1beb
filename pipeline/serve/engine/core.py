"""The inference engine: continuous batching over a block KV cache.

Requests wait in a bounded queue and join the running batch at a token boundary as soon as a
batch slot is free and the cache can reserve their blocks (prompt plus `max_new_tokens`, so a
running request never runs out of cache); they leave as soon as they finish or are aborted, and
their blocks return to the pool. Each `step` runs one token for every request already decoding,
then spends at most `prefill_chunk` tokens on prompts (a long prompt is split over several
steps, so it never stalls the requests already generating). Sampling is per request, with its
own parameters and random generator; logit biases, penalties and log-probabilities
(`pipeline.serve.engine.sampling.choose`) cost only the requests that ask for them. The engine
deals in token ids only: a request ends at a stop token or after `max_new_tokens`; its text, and
the stop strings, are its consumer's (`pipeline.serve.engine.text.RequestText`), which aborts it at
a stop string.

Completions of one prompt share its prefill (`add_group`; GRPO's `num_generations`): the group's
first request, its leader, prefills the prompt as any request does; the others, its siblings,
wait in the queue until the leader has computed all but the prompt's last token, then take a
reference on the leader's blocks of those positions (`BlockKVCache.share`, inside the lock, so
the leader finishing or aborted later frees nothing they read) and run only the last prompt
token, as a decode row (vLLM recomputes a fully cached prompt's last token the same way). A
sibling reserves cache for only its own positions. A leader that leaves before it gets that far
(aborted) leaves its siblings to prefill on their own.

Prefix caching (on unless `prefix_caching=False`, vLLM's automatic prefix caching): every full
block a request computes, prompt or generated, is named by the chain hash of its tokens and
everything before them (`pipeline.serve.engine.kv_cache.block_hashes`) and stays cached after the
request leaves, until an allocation needs its room (least recently used first). A request
admitted later takes the longest run of cached blocks that begins its prompt, never the whole
prompt (its last token is always run, so there are logits to sample), and computes only the
rest; the blocks it takes are free for admission's accounting only if nobody else holds them.
A request asking `prompt_logprobs` takes only the cached blocks that kept the
log-probabilities of their positions, which blocks computed by such a request do
(`pipeline.serve.engine.prompt_logprob_cache`).
`prompt_tokens_computed` and `prompt_tokens_cached` count the prompt positions run through the
model and those taken from another request's cache (a leader's or the prefix cache).

The engine is thread-safe: a server thread may `add` and `abort` while another thread calls
`step` in a loop.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.batching import forward_rows
from pipeline.serve.engine.kv_cache import BlockKVCache, block_hashes
from pipeline.serve.engine.prompt_logprob_cache import (
    keep_block_logprobs,
    prefix_logprobs,
    usable_prefix,
)
from pipeline.serve.engine.sampling import (
    BadSamplingValue,
    SamplingParams,
    TokenLogprobs,
    choose,
    make_generator,
)
from pipeline.serve.engine.static_decode import static_decoder

if TYPE_CHECKING:
    from pipeline.serve.engine.structured_output import GrammarBackend


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; try again later."""


class PromptTooLong(ValueError):
    """A request that can never fit the model's context or the cache (the message says why)."""


def fit_problem(
    prompt_tokens: int, max_new_tokens: int, max_context: int, block_size: int, num_blocks: int
) -> str | None:
    """Why a request can never run on an engine of these limits, or None if it can."""
    if prompt_tokens == 0:
        return "the prompt is empty (no tokens)"
    total = prompt_tokens + max_new_tokens
    if total > max_context:
        return (
            f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} "
            f"exceeds the model's context of {max_context} tokens"
        )
    if -(-total // block_size) > num_blocks:
        return f"{total} tokens do not fit the KV cache's {num_blocks * block_size} slots"
    return None


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


class Engine:
    """Continuous batching over `model` (module docstring).

    max_batch: requests running at once; cache_blocks x block_size: cache slots (see
    `BlockKVCache.blocks_for_budget` to size it by memory); max_waiting: the queue bound;
    max_context: the longest prompt + output allowed (default: the model's
    max_position_embeddings); tp: the model's tensor-parallel degree
    (`pipeline.serve.engine.tensor_parallel`); grammars: the tokenizer's structured-output backend
    (`pipeline.serve.engine.structured_output`; None: requests that ask for it are refused);
    prefix_caching: keep and reuse full blocks (module docstring); cuda_graphs: decode steps
    replayed from CUDA graphs (None: on a CUDA device), static_decode: their static-shape step
    even without graphs (None: with graphs; `pipeline.serve.engine.static_decode`)."""

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch: int = 8,
        cache_blocks: int = 256,
        block_size: int = 16,
        prefill_chunk: int = 256,
        max_waiting: int = 64,
        max_context: int | None = None,
        tp: int = 1,
        grammars: GrammarBackend | None = None,
        prefix_caching: bool = True,
        cuda_graphs: bool | None = None,
        static_decode: bool | None = None,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.cache = BlockKVCache(
            model.config, cache_blocks, block_size, dtype=param.dtype, device=param.device, tp=tp
        )
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_waiting = max_waiting
        self.max_context = max_context or model.config.max_position_embeddings
        self.grammars = grammars
        self.prefix_caching = prefix_caching
        self._ids = itertools.count()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._lock = threading.Lock()
        self.finish_counts = Counter()  # finish reason -> requests so far
        self.prompt_tokens_computed = 0  # prompt positions run through the model, so far
        self.prompt_tokens_cached = 0  # prompt positions read from another request's cache
        self.adapters = None  # `LoRASlots` when the engine serves adapters by name
        self.decoder = static_decoder(
            model,
            self.cache,
            max_batch=max_batch,
            max_context=self.max_context,
            tp=tp,
            cuda_graphs=cuda_graphs,
            static_decode=static_decode,
        )

    # ---- requests in and out ----------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams,
            lora_name: str | None = None) -> Request:  # fmt: skip
        """Queue a request (run with the adapter `lora_name` of `adapters`, when given);
        `QueueFull` over the bound, `PromptTooLong` if it can never fit, `BadSamplingValue`
        for a logit bias on a token outside the vocabulary, `LoRASlotError` for an unknown
        adapter."""
        return self.add_group(prompt, [params], lora_name)[0]

    def add_group(self, prompt: list[int], params: Sequence[SamplingParams],
                  lora_name: str | None = None) -> list[Request]:  # fmt: skip
        """Queue one request per `params` entry (each with its own settings and generator), all
        on `prompt`, prefilled once: the first (the leader) computes the prompt and the others
        read its cache (module docstring). Errors as `add`'s, for the whole group (then nothing
        is queued)."""
        if not params:
            raise ValueError("a group needs at least one SamplingParams")
        for each in params:
            self._check_vocabulary(each)
            problem = fit_problem(len(prompt), each.max_new_tokens, self.max_context,
                                  self.cache.block_size, self.cache.num_blocks)  # fmt: skip
            if problem is not None:
                raise PromptTooLong(problem)
        with self._lock:
            if len(self._waiting) + len(params) > self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests already waiting")
            if lora_name is not None:
                self._hold_adapter(lora_name, len(params))
            hashes = self._prompt_hashes(prompt, lora_name)
            group = [self._request(prompt, each, hashes) for each in params]
            leader = group[0]
            for request in group:
                request.lora_name, request.group = lora_name, leader.id
            leader.siblings = [r for r in group[1:] if self._can_share(leader, r)]
            for sibling in leader.siblings:
                sibling.leader = leader
            self._waiting.extend(group)
        return group

    def _hold_adapter(self, name: str, count: int) -> None:
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: this engine serves no adapters")
        for _ in range(count):
            self.adapters.hold(name)

    def _prompt_hashes(self, prompt: list[int], lora_name: str | None) -> list[bytes]:
        """The chain hashes of the prompt's full blocks that a request may read from the cache
        (never the block of its last token), none without prefix caching. An adapter's blocks
        chain from its name and files, so they are never another adapter's or the base's."""
        if not self.prefix_caching:
            return []
        return block_hashes(prompt[: len(prompt) - 1], self.cache.block_size,
                            self._hash_root(lora_name))  # fmt: skip

    def _hash_root(self, lora_name: str | None) -> bytes:
        """What a request's chain of block hashes starts from: the base model's empty root, or
        its adapter's name and files."""
        if lora_name is None:
            return b""
        source = f"lora\0{lora_name}\0{self.adapters.registered.get(lora_name)}"
        return hashlib.sha256(source.encode()).digest()

    def _request(self, prompt: list[int], params: SamplingParams, hashes: list[bytes]) -> Request:
        request = Request(next(self._ids), list(prompt), params, block_hashes=list(hashes))
        request.generator = make_generator(params, self.device)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs.append(None)
        return request

    def _can_share(self, leader: Request, sibling: Request) -> bool:
        """Whether `sibling` may read `leader`'s prompt: there is a prefix (the prompt's last
        token is always run), its prompt log-probabilities are the leader's, and the blocks it
        shares plus its own fit the cache (a prefix ending mid-block may cost one more)."""
        shared = len(leader.prompt) - 1
        total = len(sibling.prompt) + sibling.params.max_new_tokens
        blocks = self.cache.blocks_needed(shared) + self.cache.blocks_needed(total - shared)
        return (
            shared > 0
            and sibling.params.prompt_logprobs == leader.params.prompt_logprobs
            and blocks <= self.cache.num_blocks
        )

    def _check_vocabulary(self, params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        outside = [token for token, _ in params.logit_bias if token >= vocab]
        if outside:
            raise BadSamplingValue(
                f"logit_bias names token {outside[0]}, outside the vocabulary of {vocab} tokens"
            )
        if params.structured_output is not None:
            if self.grammars is None:
                raise BadSamplingValue("structured output needs a tokenizer.json beside the model")
            self.grammars.check(params.structured_output)

    def abort(self, request: Request) -> None:
        """Stop a request now (a client went away); its blocks return to the pool."""
        with self._lock:
            if request.finished:
                return
            if request in self._waiting:
                self._waiting.remove(request)
            self._finish(request, "abort")

    def abort_all(self) -> None:
        """Stop every request (after a failed step)."""
        with self._lock:
            for request in [*self._running, *self._waiting]:
                self._finish(request, "abort")
            self._waiting.clear()

    def weights_changed(self) -> None:
        """The model's weights were replaced in place (`pipe serve`'s /update_weights): the
        cached blocks the old weights computed must not serve a later prompt."""
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks (new weights make them stale); requests running keep theirs
        but leave nothing cached."""
        with self._lock:
            self.cache.reset_prefix_cache()
            for request in [*self._running, *self._waiting]:
                if request.computed:  # its blocks so far hold the old weights' keys
                    request.aligned = False

    @property
    def capacity(self) -> int:
        return self.cache.num_blocks * self.cache.block_size

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self._running), len(self._waiting)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Run `prompts` to completion (all queued at once) and return their requests."""
        groups = self.generate_groups(prompts, [[params]] * len(prompts))
        return [request for (request,) in groups]

    def generate_groups(
        self, prompts: list[list[int]], params: Sequence[Sequence[SamplingParams]]
    ) -> list[list[Request]]:
        """Run one group per prompt (`add_group`: prompt i, one request per entry of params[i])
        to completion, all queued at once, and return their requests group by group. GRPO's
        rollouts: `num_generations` entries per prompt, each with its own seed."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} lists of params")
        groups = [self.add_group(prompt, each) for prompt, each in zip(prompts, params)]
        for _ in self.run():
            pass
        return groups

    def run(self) -> Iterator[Event]:
        """Step until every queued request has finished, yielding the events."""
        while self.busy:
            yield from self.step()

    # ---- one step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One token for each decoding request, and up to `prefill_chunk` prompt tokens.

        The lock is held to schedule and to record results, not during the forward passes, so
        `add` and `abort` never wait for the model (an aborted request's blocks are reused only
        by a later step's admission)."""
        with self._lock:
            self._admit()
            # one token left to run, generated or the prompt's last: a decode row (and only that)
            decoding = [(r, 1) for r in self._running if r.computed == len(r.tokens) - 1]
            prefill, budget = [], self.prefill_chunk
            for request in self._running:
                left = len(request.prompt) - request.computed
                if left > 1 and budget > 0:
                    prefill.append((request, min(left, budget)))
                    budget -= prefill[-1][1]
        events = []
        for rows in (decoding, prefill):
            if rows:
                events += self._advance(rows)
        return events

    def _admit(self) -> None:
        """Move waiting requests into the batch, first come, first served, reserving the cache
        of each one's positions beyond those it shares (a sibling's slots continue its
        leader's; a request's cached prefix is its first blocks)."""
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            if request.leader is not None:
                if not request.leader.finished:
                    return  # wait for the leader's prefill
                request.leader = None  # it left before sharing: prefill alone
            hits = self._cached_prefix(request)
            total = len(request.prompt) + request.params.max_new_tokens
            need = total - request.cached_tokens - len(hits) * self.cache.block_size
            if self.cache.blocks_needed(need) > self.cache.free_blocks - self.cache.unheld(hits):
                return  # first come, first served: wait for blocks
            if request.lora_name is not None:
                request.lora_slot = self.adapters.acquire(request.lora_name)
                if request.lora_slot is None:
                    return  # every adapter slot is in use: wait for one
            self._take_prefix(request, hits)
            own = self.cache.allocate(need)
            slots = self.cache.slots(own, torch.arange(need))
            request.slots = slots if request.slots is None else torch.cat([request.slots, slots])
            request.blocks += own
            request.admitted = time.monotonic()
            self._running.append(self._waiting.popleft())

    def _cached_prefix(self, request: Request) -> list[int]:
        """The prefix cache's blocks of the start of `request`'s prompt (none for a sibling that
        shares its leader's; for one that needs its prompt's log-probabilities, those that kept
        them)."""
        if request.slots is not None:
            return []
        hits, top = self.cache.lookup(request.block_hashes), request.params.prompt_logprobs
        return hits if top is None else usable_prefix(self.cache, hits, request.prompt, top)

    def _take_prefix(self, request: Request, hits: list[int]) -> None:
        """Start `request` on the cached blocks `hits`: its first positions are computed."""
        if not hits:
            return
        self.cache.take(hits)
        cached = len(hits) * self.cache.block_size
        request.blocks = list(hits)
        request.slots = self.cache.slots(hits, torch.arange(cached))
        request.computed = request.cached_tokens = cached
        request.registered = len(hits)
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs += prefix_logprobs(self.cache, hits,
                                                       request.params.prompt_logprobs)  # fmt: skip
        self.prompt_tokens_cached += cached

    def _register_blocks(self, request: Request) -> None:
        """Name `request`'s blocks that are full now in the prefix cache."""
        size = self.cache.block_size
        full = request.computed // size
        if full <= request.registered:
            return
        known = len(request.block_hashes)
        if known < full:
            parent = request.block_hashes[-1] if known else self._hash_root(request.lora_name)
            request.block_hashes += block_hashes(request.tokens[known * size : full * size], size,
                                                 parent)  # fmt: skip
        top = request.params.prompt_logprobs
        for index in range(request.registered, full):
            self.cache.register(request.blocks[index], request.block_hashes[index])
            if top is not None:
                keep_block_logprobs(self.cache, request.block_hashes[index], request.prompt,
                                    request.prompt_logprobs, index, top)  # fmt: skip
        request.registered = full

    def _share_prompt(self, leader: Request) -> None:
        """Give `leader`'s waiting siblings its cached prompt but the last token: a reference on
        its blocks, their slots, and its prompt log-probabilities (theirs are the same)."""
        shared = len(leader.prompt) - 1
        blocks = leader.blocks[: self.cache.blocks_needed(shared)]
        for sibling in leader.siblings:
            if sibling.finished:
                continue
            self.cache.share(blocks)
            sibling.blocks = list(blocks)
            sibling.slots = leader.slots[:shared]
            sibling.computed = sibling.cached_tokens = shared
            sibling.registered = shared // self.cache.block_size  # the leader's, named by it
            sibling.aligned = shared % self.cache.block_size == 0
            if sibling.params.prompt_logprobs is not None:
                sibling.prompt_logprobs = list(leader.prompt_logprobs)
            sibling.leader = None
            self.prompt_tokens_cached += shared
        leader.siblings = []

    def _advance(self, rows: list[tuple[Request, int]]) -> list[Event]:
        """Run `rows` (request, new tokens) through the model; sample where a prompt is done."""
        logits, ready, prompt_logprobs = forward_rows(
            self.model, self.cache, rows, self.adapters, self.decoder
        )
        sampled = [rows[i][0] for i in ready]
        if self.grammars is not None:
            self.grammars.constrain(logits, sampled)  # only the rows that ask
        choices = dict(zip(ready, choose(logits, sampled)))
        events = []
        with self._lock:
            for index, (request, new) in enumerate(rows):
                self.prompt_tokens_computed += max(
                    0, min(new, len(request.prompt) - request.computed)
                )
                request.computed += new
                request.prompt_logprobs += prompt_logprobs.get(index, ())
                if self.prefix_caching and request.aligned and not request.finished:
                    self._register_blocks(request)
                shareable = request.computed >= len(request.prompt) - 1
                if request.siblings and shareable and not request.finished:
                    self._share_prompt(request)
                if index in choices and not request.finished:
                    events.append(self._emit(request, *choices[index]))
        return events

    def _emit(self, request: Request, token: int, logprobs: TokenLogprobs | None = None) -> Event:
        request.output.append(token)
        params, reason = request.params, None
        if token in params.stop_token_ids:
            reason = "stop"
        elif len(request.output) >= params.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._finish(request, reason)
        prompt_logprobs = None
        if params.prompt_logprobs is not None and len(request.output) == 1:
            prompt_logprobs = tuple(request.prompt_logprobs)
        return Event(request, token, reason is not None, logprobs, prompt_logprobs)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.finish_counts[reason] += 1
        self.cache.release(request.blocks)
        if request.lora_name is not None:
            self.adapters.release(request.lora_name, request.lora_slot)
        if request in self._running:
            self._running.remove(request)
