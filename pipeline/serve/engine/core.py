"""The inference engine: continuous batching over a block KV cache.

`Engine` takes requests in (`add`, `add_group`, `abort`), runs the model a step at a time
(`step`, `run`) and records what each step produced (`Event`s). Its parts, each a module with
one job, all called under the engine's lock:

* `request_checks`: why a request can never run (refused before it is queued);
* `scheduler.Scheduler`: the bounded waiting queue, admission to the running batch (a batch
  slot, the cache of its positions and, with an adapter, an adapter slot, first come, first
  served), and each step's rows: one token for every request already decoding, then at most
  `prefill_chunk` prompt tokens (a long prompt is split over several steps, so it never stalls
  the requests already generating);
* `prefix_cache.PrefixCacheManager`: the prefix cache's policy (on unless
  `prefix_caching=False`, vLLM's automatic prefix caching): full blocks named by chain hashes
  stay cached after their request leaves, and a later request takes the longest cached run that
  begins its prompt, never its last token;
* `groups`: completions of one prompt share its prefill (`add_group`; GRPO's
  `num_generations`): the leader computes the prompt, its siblings read its blocks;
* `request`: the `Request` record and the `Event`s.

A hybrid model's linear-attention layers keep a state per request instead of keys and values
(`state_slots`): there, prefix caching is off and decoding runs eagerly.

A request leaves the batch as soon as it finishes or is aborted, and its blocks return to the
pool (or stay cached). Sampling is per request, with its own parameters and random generator;
logit biases, penalties and log-probabilities (`pipeline.serve.engine.sampling.choose`) cost
only the requests that ask for them. The engine deals in token ids only: a request ends at a
stop token or after `max_new_tokens`; its text, and the stop strings, are its consumer's
(`pipeline.serve.engine.text.RequestText`), which aborts it at a stop string.
`prompt_tokens_computed` and `prompt_tokens_cached` count the prompt positions run through the
model and those taken from another request's cache (a leader's or the prefix cache).

The engine is thread-safe: a server thread may `add` and `abort` while another thread calls
`step` in a loop. One lock guards the queue, the batch, the cache's bookkeeping and the
requests' fields; it is held to schedule and to record a step's results, never during the
forward pass.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from pipeline.core.model.transformer import Transformer
from pipeline.serve.engine.batching import can_mix, forward_rows
from pipeline.serve.engine.groups import share_prompt
from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.prefix_cache import PrefixCacheManager
from pipeline.serve.engine.request import Event, Request
from pipeline.serve.engine.request_checks import check_request
from pipeline.serve.engine.resident_rows import ResidentRows
from pipeline.serve.engine.sampling import SamplingParams, TokenLogprobs, choose
from pipeline.serve.engine.scheduler import Scheduler
from pipeline.serve.engine.state_slots import StateSlots
from pipeline.serve.engine.static_decode import static_decoder

if TYPE_CHECKING:
    from pipeline.serve.engine.structured_output import GrammarBackend

log = logging.getLogger(__name__)


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
    even without graphs (None: with graphs; `pipeline.serve.engine.static_decode`); pack_decode:
    decode rows of a group packed into one batch row (`pipeline.serve.engine.packing`), off where
    each row's keys must be its own and in order (GRPO's trainer-shaped rollouts,
    `pipeline.train.objectives.grpo.invariant`); resident_decode: decoding requests' keys and
    values also kept row by row, at most the cache's size again, so an eager decode step
    attends over them in place instead of gathering them from the blocks
    (`pipeline.serve.engine.resident_rows`; None: on a CPU); mix_prompts: with resident rows,
    a step's decode rows and prompt chunks run as one pass of the model (vLLM's mixed batches:
    the weights are read once for both; `batching.can_mix` says when)."""

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
        pack_decode: bool = True,
        resident_decode: bool | None = None,
        mix_prompts: bool = True,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.cache = BlockKVCache(
            model.config, cache_blocks, block_size, dtype=param.dtype, device=param.device, tp=tp
        )
        self.cache.states = StateSlots.for_model(model.config, max_batch, param.device, tp)
        if self.cache.states is not None:
            prefix_caching, static_decode, cuda_graphs = _hybrid_settings(
                prefix_caching, static_decode, cuda_graphs
            )
        self.max_context = max_context or model.config.max_position_embeddings
        self.grammars = grammars
        self.prefix_cache = PrefixCacheManager(self.cache, prefix_caching)
        self.scheduler = Scheduler(
            self.cache,
            self.prefix_cache,
            max_batch=max_batch,
            max_waiting=max_waiting,
            prefill_chunk=prefill_chunk,
            device=self.device,
        )
        self._lock = threading.Lock()
        self.finish_counts = Counter()  # finish reason -> requests so far
        self.prompt_tokens_computed = 0  # prompt positions run through the model, so far
        self.prompt_tokens_cached = 0  # prompt positions read from another request's cache
        self.adapters = None  # `LoRASlots` when the engine serves adapters by name
        self.pack_decode = pack_decode
        self.decoder = static_decoder(
            model,
            self.cache,
            max_batch=max_batch,
            max_context=self.max_context,
            tp=tp,
            cuda_graphs=cuda_graphs,
            static_decode=static_decode,
        )
        self.resident = self._resident_rows(resident_decode, max_batch)
        # Decode rows and prompt chunks in one pass need every attention to hand its kernel to
        # the cache (latent attention reads its cache itself).
        self.mix = mix_prompts and model.config.mla is None
        self.mixed_steps = 0  # steps that ran decode rows and prompt chunks in one pass

    def _resident_rows(self, resident_decode: bool | None, max_batch: int) -> ResidentRows | None:
        """The decoding requests' resident rows (`resident_decode`; None: on a CPU), where
        decoding is eager and every layer keeps keys and values."""
        if resident_decode is None:
            resident_decode = self.device.type == "cpu"
        if resident_decode and self.decoder is None and self.cache.states is None:
            return ResidentRows(self.cache, max_batch, self.cache.pool_bytes)
        return None

    # ---- requests in and out ----------------------------------------------------------------

    def add(
        self, prompt: list[int], params: SamplingParams, lora_name: str | None = None
    ) -> Request:
        """Queue a request (run with the adapter `lora_name` of `adapters`, when given);
        `QueueFull` over the bound, `PromptTooLong` if it can never fit, `BadSamplingValue`
        for a logit bias on a token outside the vocabulary, `LoRASlotError` for an unknown
        adapter."""
        return self.add_group(prompt, [params], lora_name)[0]

    def add_group(
        self, prompt: list[int], params: Sequence[SamplingParams], lora_name: str | None = None
    ) -> list[Request]:
        """Queue one request per `params` entry (each with its own settings and generator), all
        on `prompt`, prefilled once: the first (the leader) computes the prompt and the others
        read its cache (module docstring). Errors as `add`'s, for the whole group (then nothing
        is queued)."""
        if not params:
            raise ValueError("a group needs at least one SamplingParams")
        for each in params:
            check_request(
                prompt,
                each,
                vocab_size=self.model.config.vocab_size,
                max_context=self.max_context,
                cache=self.cache,
                grammars=self.grammars,
            )
        with self._lock:
            return self.scheduler.queue(prompt, params, lora_name, self.adapters)

    def abort(self, request: Request) -> None:
        """Stop a request now (a client went away); its blocks return to the pool."""
        with self._lock:
            if not request.finished:
                self._finish(request, "abort")

    def abort_all(self) -> None:
        """Stop every request (after a failed step)."""
        with self._lock:
            for request in [*self.scheduler.running, *self.scheduler.waiting]:
                self._finish(request, "abort")

    def weights_changed(self) -> None:
        """The model's weights were replaced in place (`pipe serve`'s /update_weights): the
        cached blocks the old weights computed must not serve a later prompt."""
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks (new weights make them stale); requests running keep theirs
        but leave nothing cached."""
        with self._lock:
            self.prefix_cache.reset([*self.scheduler.running, *self.scheduler.waiting])

    @property
    def capacity(self) -> int:
        return self.cache.num_blocks * self.cache.block_size

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

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
            self.prompt_tokens_cached += self.scheduler.admit(self.adapters)
            decoding, prefill = self.scheduler.rows()
        if can_mix(decoding, prefill, self.resident, self.adapters is None and self.mix):
            self.mixed_steps += 1
            return self._advance(decoding + prefill, mixed=len(decoding))
        events = []
        for rows in (decoding, prefill):
            if rows:
                events += self._advance(rows)
        return events

    def _advance(self, rows: list[tuple[Request, int]], mixed: int = 0) -> list[Event]:
        """Run `rows` (request, new tokens) through the model; sample where a prompt is done.
        `mixed`: the first `mixed` rows are decode rows run in one pass with the prompt chunks
        after them (`batching.mixed_batch`)."""
        logits, ready, prompt_logprobs = forward_rows(
            self.model,
            self.cache,
            rows,
            self.adapters,
            self.decoder,
            self.pack_decode,
            self.resident,
            mixed,
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
                if not request.finished:
                    self.prefix_cache.register(request)
                    self.prompt_tokens_cached += share_prompt(self.cache, request)
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
        if self.cache.states is not None:
            self.cache.states.release(request.state_slot)
            request.state_slot = None
        if request.lora_name is not None:
            self.adapters.release(request.lora_name, request.lora_slot)
        self.scheduler.remove(request)


def _hybrid_settings(
    prefix_caching: bool, static_decode: bool | None, cuda_graphs: bool | None
) -> tuple[bool, bool, bool]:
    """(prefix_caching, static_decode, cuda_graphs) for a hybrid model: a linear-attention
    state is per sequence, not per block, so no prefix is cached; decoding runs eagerly."""
    if prefix_caching:
        log.info(
            "prefix caching off: a hybrid model's linear-attention state is kept per sequence, "
            "not per block of positions"
        )
    if static_decode or cuda_graphs:
        log.warning("static decoding and CUDA graphs off: this model has linear attention")
    return False, False, False
