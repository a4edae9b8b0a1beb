"""A request body's engine requests: one `Job` per (prompt, generation), submitted together and
read back whole (`gather_generations`) or delta by delta as they come (`merged_deltas`).

A body asking for n choices of p prompts is p x n jobs (best_of: p x best_of, the n best kept by
the response writer); a prompt's jobs go to the engine as one group, which prefills the prompt
once (`Engine.add_group`). Whatever happens to the HTTP request (a refused job, a client that went
away, a consumer that stops early), no job is left running in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pipeline.serve.engine.messages import Delta
from pipeline.serve.engine.request_checks import PromptTooLong
from pipeline.serve.engine.sampling import SamplingParams, TokenLogprobs
from pipeline.serve.http.openai_api import APIError, bad_word_ids
from pipeline.serve.http.token_limits import check_token_limit


@dataclass
class Job:
    """One engine request of a body: generation `number` for prompt `prompt_index`."""

    prompt_index: int
    number: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Generation:
    """What one engine request produced, gathered from its deltas (a whole, unstreamed answer)."""

    job: Job
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the engine's cache

    def add(self, delta: Delta) -> None:
        """Append what `delta` brought."""
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.completion_tokens = delta.completion_tokens
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the generated tokens' log-probabilities: what best_of ranks by."""
        return sum(entry.token_logprob for entry in self.logprobs)


def plan_jobs(
    body,
    prompts: list[list[int]],
    token_budget: int,
    eos_ids: frozenset[int],
    encode: Callable[[str], list[int]],
) -> list[Job]:
    """Each prompt's jobs with their parameters (`body.sampling`); a bad value is a 400.
    `encode` tokenizes the body's `bad_words`."""
    jobs = []
    bad = bad_word_ids(body.bad_words, encode) if body.bad_words else ()
    for index, prompt in enumerate(prompts):
        check_token_limit(body, len(prompt), token_budget)
        for number in range(body.generations_per_prompt):
            try:
                params = body.sampling(len(prompt), token_budget, eos_ids, number, bad)
            except ValueError as error:
                raise APIError(str(error)) from None
            jobs.append(Job(index, number, prompt, params))
    return jobs


def submit_jobs(
    submit: Callable[[list[int], list[SamplingParams]], list], jobs: list[Job], prompt_param: str
) -> list:
    """Each job's stream of deltas from `submit` (a prompt's jobs as one group, in order); none
    is left running if one is refused (a prompt that can never fit is a 400 naming
    `prompt_param`)."""
    streams = []
    try:
        for _, group in itertools.groupby(jobs, key=lambda job: job.prompt_index):
            group = list(group)
            streams += submit(group[0].prompt_ids, [job.params for job in group])
    except PromptTooLong as error:
        abort_streams(streams)
        raise APIError(str(error), param=prompt_param) from None
    except BaseException:
        abort_streams(streams)
        raise
    return streams


def abort_streams(streams: Sequence) -> None:
    """Stop every stream (those already finished ignore it)."""
    for stream in streams:
        stream.abort()


async def gather_generations(
    jobs: list[Job], streams: list, is_disconnected: Callable[[], Awaitable[bool]]
):
    """Every job's generation whole, or None when the client disconnected meanwhile (checked
    every quarter second, so an abandoned request stops using the engine soon)."""
    task = asyncio.ensure_future(
        asyncio.gather(*(_collect(job, s) for job, s in zip(jobs, streams)))
    )
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await is_disconnected():
                task.cancel()
                return None
        return task.result()
    finally:
        abort_streams(streams)


async def _collect(job: Job, stream) -> Generation:
    generation = Generation(job)
    async for delta in stream:
        generation.add(delta)
    return generation


async def merged_deltas(streams: list) -> AsyncIterator[tuple[int, Delta]]:
    """(stream index, delta) from all `streams` as they come; aborts them all if stopped early."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        # each stream's deltas, then its error if it failed, then None: its end
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except Exception as error:  # noqa: BLE001 - raised to the consumer below
            queue.put_nowait((index, error))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        abort_streams(streams)
