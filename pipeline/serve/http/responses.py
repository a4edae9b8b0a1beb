"""The answers of the generation routes, built from the engine's deltas: whole JSON bodies, or
server-sent events (one chunk per delta, then `data: [DONE]`).

A writer (`CompletionWriter`, `ChatWriter`) knows one body's answer shape; `respond` picks whole
or streamed. Choice `i` of prompt `p` has index p * n + i, as OpenAI numbers them.

The usage counts each prompt once, whatever n is, and so do its cached tokens: those of the
prompt's first generation (its group's leader, which the others share).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.serve.http.jobs import Generation, Job, gather_generations, merged_deltas
from pipeline.serve.http.openai_api import (
    ChatBody,
    CompletionBody,
    chat_logprobs,
    completion_logprobs,
    completion_prompts,
    envelope,
    error_body,
    logprob_token_text,
    message_text,
    prompt_logprobs_list,
    usage,
)
from pipeline.serve.http.tool_calls import ToolReply
from pipeline.tokenizer.reasoning import ReasoningReader

log = logging.getLogger(__name__)


def error_response(
    message: str, status: int, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    """OpenAI's `{"error": {...}}` body with its status code."""
    return JSONResponse(error_body(message, status, param), status, headers=headers)


async def respond(
    writer,
    ident: str,
    model: str,
    jobs: list[Job],
    streams: list,
    stream: bool,
    is_disconnected: Callable[[], Awaitable[bool]],
    fingerprint: str | None = None,
):
    """The answer, as server-sent events or whole (499 if the client went away meanwhile), each
    object with `fingerprint` as its `system_fingerprint` (which weights answered)."""
    if stream:
        chunks = _fingerprinted(writer.chunks(ident, model, jobs, streams), fingerprint)
        return StreamingResponse(_events(chunks), media_type="text/event-stream")
    generations = await gather_generations(jobs, streams, is_disconnected)
    if generations is None:
        return error_response("client disconnected", 499)
    return {**writer.whole(ident, model, generations), "system_fingerprint": fingerprint}


def with_usage(chunk: dict, body, prompt_tokens: int, completion_tokens: int) -> dict:
    """`chunk` with the usage so far when the body asked for it on every chunk (vLLM's
    `continuous_usage_stats`: that choice's tokens, as vLLM counts them)."""
    if body.continuous_usage:
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
    return chunk


async def _fingerprinted(chunks: AsyncIterator[dict], fingerprint: str | None):
    async for chunk in chunks:
        yield {**chunk, "system_fingerprint": fingerprint}


def cached_tokens(jobs: Sequence[Job], cached: Sequence[int]) -> int:
    """The prompt tokens the usage reports as cached: each prompt's first generation's."""
    return sum(count for job, count in zip(jobs, cached) if job.number == 0)


def _cached_of(generations: list[Generation]) -> int:
    return cached_tokens([g.job for g in generations], [g.cached_tokens for g in generations])


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as error:  # noqa: BLE001 - the stream has begun: report in-band
        log.exception("generation failed mid-stream")
        yield f"data: {json.dumps(error_body(str(error), 500))}\n\n"
    yield "data: [DONE]\n\n"


class CompletionWriter:
    """The /v1/completions answer of one body, whole or as chunks."""

    def __init__(self, body: CompletionBody, prompts: list[list[int]], token_text: Callable):
        self.body, self.prompts = body, prompts
        self.token_text = logprob_token_text(body, token_text)
        texts = completion_prompts(body.prompt)
        # an echoed token-id prompt is its decoded text
        self.prompt_texts = (
            [t if isinstance(t, str) else "".join(map(token_text, t)) for t in texts]
            if body.echo
            else []
        )

    def choice_index(self, job: Job, rank: int) -> int:
        """The index of a prompt's choice `rank` among all the body's choices."""
        return job.prompt_index * self.body.choices_per_prompt + rank

    def _echo(self, job: Job, prompt_logprobs) -> tuple[str, list[int], list]:
        """What echo prepends: the prompt's text, ids and logprobs (the first one None). With
        `return_token_ids` the text is left out, as vLLM leaves it out (the prompt comes back
        as `prompt_token_ids` instead)."""
        if not self.body.echo:
            return "", [], []
        ids = self.prompts[job.prompt_index]
        entries = list(prompt_logprobs or [])
        entries += [None] * (len(ids) - len(entries))
        text = "" if self.body.return_token_ids else self.prompt_texts[job.prompt_index]
        return text, ids, entries

    def _generated(self, text: str, ids, entries) -> tuple[str, list[int], list]:
        """What the engine generated, as the answer shows it: nothing when max_tokens 0 asked
        for the prompt alone (`echo_only`)."""
        if self.body.echo_only:
            return "", [], []
        return text, list(ids), list(entries)

    def _logprobs(self, ids: list[int], entries: list, offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(ids, entries, self.body.logprobs, self.token_text, offset)

    def _choice(self, index: int, text: str, logprobs, finish: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, ident: str, model: str, generations: list[Generation]) -> dict:
        """The whole answer: per prompt its n choices (the n best of best_of)."""
        choices = []
        for index in range(len(self.prompts)):
            mine = [g for g in generations if g.job.prompt_index == index]
            if len(mine) > self.body.choices_per_prompt:
                mine.sort(key=lambda g: g.cumulative_logprob, reverse=True)
            for rank, g in enumerate(mine[: self.body.choices_per_prompt]):
                text, ids, entries = self._echo(g.job, g.prompt_logprobs)
                new_text, new_ids, new_entries = self._generated(g.text, g.token_ids, g.logprobs)
                logprobs = self._logprobs(ids + new_ids, entries + new_entries, 0)
                choice = self._choice(
                    self.choice_index(g.job, rank), text + new_text, logprobs, g.finish_reason
                )
                if self.body.return_token_ids:
                    choice["prompt_token_ids"] = self.prompts[index]
                    choice["token_ids"] = new_ids
                if self.body.prompt_logprobs_shown is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_list(
                        self.prompts[index], g.prompt_logprobs, self.token_text
                    )
                choices.append(choice)
        answer = envelope(ident, model, "text_completion", choices)
        # every generated token counts, also best_of's discarded ones
        generated = 0 if self.body.echo_only else sum(g.completion_tokens for g in generations)
        answer["usage"] = usage(sum(map(len, self.prompts)), generated, _cached_of(generations))
        return answer

    async def chunks(self, ident: str, model: str, jobs: list[Job], streams: list):
        """The streamed answer: a chunk per delta, then usage if asked."""
        offsets = [0] * len(jobs)
        started = [False] * len(jobs)
        generated, cached = [0] * len(jobs), [0] * len(jobs)
        async for k, delta in merged_deltas(streams):
            job = jobs[k]
            cached[k] = delta.cached_tokens or cached[k]
            text, ids, entries = self._generated(delta.text, delta.token_ids, delta.logprobs)
            new_ids, first = list(ids), not started[k]
            if not started[k]:
                started[k] = True
                echo_text, echo_ids, echo_entries = self._echo(job, delta.prompt_logprobs)
                text, ids, entries = echo_text + text, echo_ids + ids, echo_entries + entries
            logprobs = self._logprobs(ids, entries, offsets[k])
            offsets[k] += sum(len(self.token_text(t)) for t in ids)
            generated[k] = 0 if self.body.echo_only else delta.completion_tokens
            choice = self._choice(
                self.choice_index(job, job.number), text, logprobs, delta.finish_reason
            )
            if self.body.return_token_ids:  # vLLM's: the prompt's ids on a choice's first chunk
                choice["prompt_token_ids"] = self.prompts[job.prompt_index] if first else None
                choice["token_ids"] = new_ids
            chunk = envelope(ident, model, "text_completion", [choice])
            yield with_usage(chunk, self.body, len(self.prompts[job.prompt_index]), generated[k])
        if self.body.include_usage:
            last = envelope(ident, model, "text_completion", [])
            last["usage"] = usage(
                sum(map(len, self.prompts)), sum(generated), cached_tokens(jobs, cached)
            )
            yield last


class ChatWriter:
    """The /v1/chat/completions answer of one body, whole or as chunks."""

    def __init__(
        self,
        body: ChatBody,
        prompt: list[int],
        token_text: Callable,
        tools: ToolReply | None = None,
        prompt_text: str = "",
        reasoning: Callable[[], ReasoningReader] | None = None,
    ) -> None:
        """`prompt`: the prompt's token ids (`prompt_text`: as the template rendered it);
        `tools`: how to read the reply into tool calls (None: plain text); `reasoning`: a new
        reader of a reply's thinking per choice (None: no reasoning parser)."""
        self.body, self.prompt, self.prompt_text = body, prompt, prompt_text
        self.token_text = logprob_token_text(body, token_text)
        self.prompt_tokens = len(prompt)
        self.tools, self.reasoning = tools, reasoning
        # reasoning hidden (`include_reasoning: false`): its tokens' logprobs and ids too
        self.hide = reasoning is not None and body.include_reasoning is False
        # vLLM's: the reply's role is the last message's when no generation prompt opens an
        # assistant turn, and `echo` writes that message's text before the reply's
        last = body.messages[-1]
        self.role = "assistant" if body.add_generation_prompt is not False else last.role
        self.echoed = ""
        if body.echo and last.role == self.role:
            self.echoed = message_text(last.content, len(body.messages) - 1)

    def _message(self, g: Generation) -> tuple[dict, str | None]:
        text, thinking = g.text, None
        if self.reasoning is not None:
            thinking, text = self.reasoning().whole(g.text, g.token_ids)
            text = text or None  # vLLM's: no content after the thinking is null
        if self.tools is None:
            message, finish = {"role": self.role, "content": text}, g.finish_reason
        else:
            message, finish = self.tools.message(text or "", g.finish_reason)
            message["role"] = self.role
        if self.reasoning is not None:
            shown = None if self.hide else thinking
            message["reasoning"] = message["reasoning_content"] = shown
        if self.echoed:
            message["content"] = self.echoed + (message.get("content") or "")
        return message, finish

    def _logprobs(self, ids: list[int], entries: list) -> dict | None:
        if not self.body.logprobs or self.hide:
            return None
        return chat_logprobs(ids, entries, self.body.top_logprobs or 0, self.token_text)

    def whole(self, ident: str, model: str, generations: list[Generation]) -> dict:
        """The whole answer: one assistant message per choice."""
        choices = []
        for g in generations:
            message, finish_reason = self._message(g)
            choices.append(
                {
                    "index": g.job.number,
                    "message": message,
                    "logprobs": self._logprobs(g.token_ids, g.logprobs),
                    "finish_reason": finish_reason,
                }
            )
            if self.body.return_token_ids:
                choices[-1]["token_ids"] = list(g.token_ids)
        answer = envelope(ident, model, "chat.completion", choices)
        if self.body.return_token_ids:
            answer["prompt_token_ids"] = self.prompt
        if self.body.return_prompt_text:
            answer["prompt_text"] = self.prompt_text
        if self.body.prompt_logprobs_shown is not None:
            answer["prompt_logprobs"] = prompt_logprobs_list(
                self.prompt, generations[0].prompt_logprobs, self.token_text
            )
        generated = sum(g.completion_tokens for g in generations)
        answer["usage"] = usage(self.prompt_tokens, generated, _cached_of(generations))
        return answer

    async def chunks(self, ident: str, model: str, jobs: list[Job], streams: list):
        """A first chunk per choice with the role, then one per delta (the last with the
        finish reason), then usage if asked."""
        kind = "chat.completion.chunk"
        for job in jobs:
            first = {
                "index": job.number,
                "delta": {"role": self.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            first_chunk = envelope(ident, model, kind, [first])
            if self.body.return_token_ids:
                first_chunk["prompt_token_ids"] = self.prompt
            if self.body.return_prompt_text:
                first_chunk["prompt_text"] = self.prompt_text
            yield with_usage(first_chunk, self.body, self.prompt_tokens, 0)
        for job in jobs if self.echoed else ():
            echo = {
                "index": job.number,
                "delta": {"content": self.echoed},
                "logprobs": None,
                "finish_reason": None,
            }
            yield with_usage(envelope(ident, model, kind, [echo]), self.body, self.prompt_tokens, 0)
        generated, cached = [0] * len(jobs), [0] * len(jobs)
        tool_streams = [self.tools.stream() for _ in jobs] if self.tools else None
        readers = [self.reasoning() for _ in jobs] if self.reasoning else None
        async for k, delta in merged_deltas(streams):
            generated[k] = delta.completion_tokens
            cached[k] = delta.cached_tokens or cached[k]
            finish_reason = delta.finish_reason
            text, thinking = delta.text, ""
            if readers is not None:
                thinking, text = readers[k].push(delta.text, delta.token_ids)
                if finish_reason is not None:
                    text += readers[k].finish()
                thinking = "" if self.hide else thinking
            if tool_streams is None:
                content = {"content": text} if text or not (finish_reason or readers) else {}
            else:
                content, finish_reason = tool_streams[k].delta(text, finish_reason)
            if thinking:
                content = {"reasoning": thinking, "reasoning_content": thinking, **content}
            if tool_streams is not None or readers is not None:
                quiet = not (self.body.logprobs or self.body.return_token_ids) or self.hide
                if not content and finish_reason is None and quiet:
                    continue
            choice = {
                "index": jobs[k].number,
                "delta": content,
                "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                "finish_reason": finish_reason,
            }
            if self.body.return_token_ids and not self.hide:
                choice["token_ids"] = list(delta.token_ids)
            chunk = envelope(ident, model, kind, [choice])
            yield with_usage(chunk, self.body, self.prompt_tokens, generated[k])
        if self.body.include_usage:
            last = envelope(ident, model, kind, [])
            last["usage"] = usage(self.prompt_tokens, sum(generated), cached_tokens(jobs, cached))
            yield last
