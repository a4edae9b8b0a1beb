"""`pipe serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn.

The engine runs in its own process (`pipeline.serve.engine_process`); this process holds the HTTP
server and an `EngineClient`, which hands requests over and turns the engine's tokens into text.
Routes turn a body into prompt token ids and `SamplingParams` (`pipeline.serve.openai_api`),
hand each (prompt, choice) to the engine client's `submit` and build the answer, whole or
streamed, from the deltas that come back. A body asking for n choices of p prompts is p x n
engine requests (best_of: p x best_of, the n best kept); choice `i` of prompt `p` has index
p * n + i, as OpenAI numbers them.

Over capacity (the engine's batch full and `max_waiting` more in flight) a request gets 503 with
Retry-After instead of a longer queue. Every error is OpenAI's `{"error": {...}}` body: 400 for a
malformed body (bad JSON, unknown fields, values out of range, a prompt too long for the context)
with the field at fault as `param`, 404 for an unknown model or path, 405 for a wrong method. A
client that disconnects has its requests aborted, which frees their batch slots and cache blocks
at the next token boundary. On SIGTERM uvicorn stops accepting connections and waits for the
requests in flight; then the engine process is told to stop.

Besides the OpenAI routes: vLLM's /tokenize, /detokenize and /version, Prometheus' /metrics and
/health.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and those
# name classes imported inside `create_app`.
import asyncio
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pipeline import __version__
from pipeline.serve.engine import PromptTooLong, QueueFull
from pipeline.serve.engine_client import EngineClient
from pipeline.serve.engine_process import EngineSpec
from pipeline.serve.openai_api import (
    APIError,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    chat_logprobs,
    chat_prompt,
    completion_logprobs,
    completion_prompts,
    envelope,
    error_body,
    template_messages,
    usage,
)

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


@dataclass
class Job:
    """One engine request of a body: generation `number` for prompt `prompt_index`."""

    prompt_index: int
    number: int
    prompt_ids: list[int]
    params: object  # SamplingParams


@dataclass
class Generation:
    """What one engine request produced, gathered from its deltas."""

    job: Job
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0

    def add(self, delta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.completion_tokens = delta.completion_tokens

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.token_logprob for entry in self.logprobs)


def create_app(client: EngineClient, model_name: str):
    """The FastAPI application serving the engine behind `client` (module docstring)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from pipeline.serve.metrics import ServeMetrics

    ready, tokenizer = client.ready, client.tokenizer
    metrics = ServeMetrics(model_name, lambda: client.load)
    max_model_len = ready.max_context
    # what max_tokens null may use: a request reserves its whole length in the cache
    token_budget = min(ready.max_context, ready.cache_blocks * ready.block_size)
    vocab_size = ready.vocab_size
    text_codec = Codec(tokenizer, client.chat_template, vocab_size)
    ids = itertools.count()
    started = int(time.time())

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    @asynccontextmanager
    async def lifespan(_app):
        client.attach(asyncio.get_running_loop())
        yield
        client.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.engine_client = client

    # ---- errors -----------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, error: RequestValidationError):
        errors = error.errors()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors
        )
        loc = errors[0]["loc"] if errors else ()
        param = loc[1] if len(loc) > 1 and isinstance(loc[1], str) else None
        return JSONResponse(error_body(problems, 400, param), status_code=400)

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return JSONResponse(error_body(str(error), error.status, error.param), error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        body = error_body(str(error.detail), error.status_code)
        return JSONResponse(body, error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(QueueFull)
    async def overloaded(_request, error: QueueFull):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(error_body(str(error), 503), 503, headers=headers)

    @app.exception_handler(Exception)
    async def failed(_request, error: Exception):
        log.error("request failed", exc_info=error)
        return JSONResponse(error_body(f"internal error: {error}", 500), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(f"The model `{name}` does not exist.", 404, "model")

    # ---- engine requests --------------------------------------------------------------------

    def jobs_for(body, prompts: list[list[int]]) -> list[Job]:
        """Each prompt's engine requests, with their parameters (400 for a bad value)."""
        jobs = []
        for index, prompt in enumerate(prompts):
            for number in range(body.generations_per_prompt):
                try:
                    params = body.sampling(len(prompt), token_budget, ready.eos_ids, number)
                except ValueError as error:
                    raise APIError(str(error)) from None
                jobs.append(Job(index, number, prompt, params))
        return jobs

    def submit(jobs: list[Job], prompt_param: str) -> list:
        """The jobs' streams; none is left running if one is refused."""
        streams = []
        try:
            for job in jobs:
                streams.append(metrics.track(client.submit(job.prompt_ids, job.params)))
        except PromptTooLong as error:
            _abort(streams)
            raise APIError(str(error), param=prompt_param) from None
        except BaseException:
            _abort(streams)
            raise
        return streams

    async def gathered(http: HTTPRequest, jobs: list[Job], streams: list):
        """Every generation whole, or None when the client disconnected meanwhile."""
        task = asyncio.ensure_future(
            asyncio.gather(*(_collect(job, s) for job, s in zip(jobs, streams)))
        )
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await http.is_disconnected():
                    task.cancel()
                    return None
            return task.result()
        finally:
            _abort(streams)

    def disconnected():
        return JSONResponse(error_body("client disconnected", 499), status_code=499)

    def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        return StreamingResponse(_sse(chunks), media_type="text/event-stream")

    # ---- routes -----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        running, waiting = client.load
        finished = dict(client.finish_counts)
        if client.failure is not None:  # a load balancer must stop sending requests here
            body = {"status": "failed", "error": str(client.failure), "finished": finished}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "running": running, "waiting": waiting, "finished": finished}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_name, "object": "model", "created": started, "owned_by": "pipe",
                 "root": model_name, "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [entry]}

    async def respond(http: HTTPRequest, stream: bool, writer, ident: str, jobs, streams):
        """The answer, as server-sent events or whole (None if the client went away)."""
        if stream:
            return sse(writer.chunks(ident, model_name, jobs, streams))
        generations = await gathered(http, jobs, streams)
        if generations is None:
            return disconnected()
        return writer.whole(ident, model_name, generations)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        check_model(body.model)
        body.check(vocab_size)
        prompts = [text_codec.prompt(p) for p in completion_prompts(body.prompt)]
        jobs = jobs_for(body, prompts)
        streams = submit(jobs, "prompt")
        ident = f"cmpl-{next(ids)}"
        writer = CompletionWriter(body, prompts, token_text)
        return await respond(http, body.stream, writer, ident, jobs, streams)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        check_model(body.model)
        body.check(vocab_size)
        prompt = text_codec.encode(text_codec.chat(body.messages))
        jobs = jobs_for(body, [prompt])
        streams = submit(jobs, "messages")
        ident = f"chatcmpl-{next(ids)}"
        writer = ChatWriter(body, len(prompt), token_text)
        return await respond(http, body.stream, writer, ident, jobs, streams)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        if body.prompt is not None:
            text = body.prompt
        else:
            generation = body.add_generation_prompt is not False
            text = text_codec.chat(body.messages, generation)
        tokens = text_codec.encode(text)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        check_model(body.model)
        text_codec.prompt(body.tokens, param="tokens")  # checks the ids
        return {"prompt": tokenizer.decode(body.tokens)}

    return app


class Codec:
    """Text and chat messages to token ids and back, with the tokenizer of the served model."""

    def __init__(self, tokenizer, chat_template, vocab_size: int) -> None:
        self.tokenizer, self.template, self.vocab_size = tokenizer, chat_template, vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0]

    def prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt's token ids: a text encoded, or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("the prompt is empty", param=param)
            return self.encode(prompt)
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            limit = self.vocab_size - 1
            raise APIError(f"token id {bad[0]} is out of the vocabulary (0..{limit})", param=param)
        return list(prompt)

    def chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The chat prompt text (a template's own error is a 400 naming it)."""
        plain = template_messages(messages, self.template)
        try:
            return chat_prompt(plain, self.template, add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template's own error, reported as such
            raise APIError(f"chat template: {error}", param="messages") from None


def _abort(streams: list) -> None:
    for stream in streams:
        stream.abort()


async def _collect(job: Job, stream) -> Generation:
    generation = Generation(job)
    async for delta in stream:
        generation.add(delta)
    return generation


async def _merged(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(stream index, delta) from all `streams` as they come; aborts them all if stopped early."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
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
        _abort(streams)


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
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
        self.body, self.prompts, self.token_text = body, prompts, token_text
        texts = completion_prompts(body.prompt)
        # an echoed token-id prompt is its decoded text
        self.prompt_texts = [t if isinstance(t, str) else "".join(map(token_text, t))
                             for t in texts] if body.echo else []  # fmt: skip

    def choice_index(self, job: Job, rank: int) -> int:
        return job.prompt_index * self.body.choices_per_prompt + rank

    def _echo(self, job: Job, prompt_logprobs: list | None) -> tuple[str, list[int], list]:
        """What echo prepends: the prompt's text, ids and logprobs (the first one None)."""
        if not self.body.echo:
            return "", [], []
        ids = self.prompts[job.prompt_index]
        entries = list(prompt_logprobs or [])
        entries += [None] * (len(ids) - len(entries))
        return self.prompt_texts[job.prompt_index], ids, entries

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
                logprobs = self._logprobs(ids + g.token_ids, entries + g.logprobs, 0)
                choice = self._choice(self.choice_index(g.job, rank), text + g.text, logprobs,
                                      g.finish_reason)  # fmt: skip
                choices.append(choice)
        answer = envelope(ident, model, "text_completion", choices)
        # every generated token counts, also best_of's discarded ones
        generated = sum(g.completion_tokens for g in generations)
        answer["usage"] = usage(sum(map(len, self.prompts)), generated)
        return answer

    async def chunks(self, ident: str, model: str, jobs: list[Job], streams: list):
        """The streamed answer: a chunk per delta, then usage if asked."""
        offsets = [0] * len(jobs)
        started = [False] * len(jobs)
        generated = [0] * len(jobs)
        async for k, delta in _merged(streams):
            job, text = jobs[k], delta.text
            ids, entries = list(delta.token_ids), list(delta.logprobs)
            if not started[k]:
                started[k] = True
                echo_text, echo_ids, echo_entries = self._echo(job, delta.prompt_logprobs)
                text, ids, entries = echo_text + text, echo_ids + ids, echo_entries + entries
            logprobs = self._logprobs(ids, entries, offsets[k])
            offsets[k] += sum(len(self.token_text(t)) for t in ids)
            generated[k] = delta.completion_tokens
            choice = self._choice(self.choice_index(job, job.number), text, logprobs,
                                  delta.finish_reason)  # fmt: skip
            yield envelope(ident, model, "text_completion", [choice])
        if self.body.include_usage:
            last = envelope(ident, model, "text_completion", [])
            last["usage"] = usage(sum(map(len, self.prompts)), sum(generated))
            yield last


class ChatWriter:
    """The /v1/chat/completions answer of one body, whole or as chunks."""

    def __init__(self, body: ChatBody, prompt_tokens: int, token_text: Callable) -> None:
        self.body, self.prompt_tokens, self.token_text = body, prompt_tokens, token_text

    def _logprobs(self, ids: list[int], entries: list) -> dict | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(ids, entries, self.body.top_logprobs or 0, self.token_text)

    def whole(self, ident: str, model: str, generations: list[Generation]) -> dict:
        choices = [
            {
                "index": g.job.number,
                "message": {"role": "assistant", "content": g.text},
                "logprobs": self._logprobs(g.token_ids, g.logprobs),
                "finish_reason": g.finish_reason,
            }
            for g in generations
        ]
        answer = envelope(ident, model, "chat.completion", choices)
        generated = sum(g.completion_tokens for g in generations)
        answer["usage"] = usage(self.prompt_tokens, generated)
        return answer

    async def chunks(self, ident: str, model: str, jobs: list[Job], streams: list):
        """A first chunk per choice with the role, then one per delta (the last with the
        finish reason), then usage if asked."""
        kind = "chat.completion.chunk"
        for job in jobs:
            first = {"index": job.number, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}  # fmt: skip
            yield envelope(ident, model, kind, [first])
        generated = [0] * len(jobs)
        async for k, delta in _merged(streams):
            generated[k] = delta.completion_tokens
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            choice = {"index": jobs[k].number, "delta": content,
                      "logprobs": self._logprobs(delta.token_ids, delta.logprobs),
                      "finish_reason": delta.finish_reason}  # fmt: skip
            yield envelope(ident, model, kind, [choice])
        if self.body.include_usage:
            last = envelope(ident, model, kind, [])
            last["usage"] = usage(self.prompt_tokens, sum(generated))
            yield last


def run_server(spec: EngineSpec, *, host: str, port: int, max_waiting: int,
               model_name: str | None) -> None:  # fmt: skip
    """Load the model in the engine process, then serve until SIGTERM / Ctrl-C, drain the
    requests in flight and return. `LoadError` if the model cannot be loaded."""
    import uvicorn

    client = EngineClient(spec, max_waiting)
    ready = client.start()
    app = create_app(client, model_name or ready.name)
    uvicorn.run(app, host=host, port=port, log_level="warning")
