"""`pipe serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn.

One thread runs `Engine.step` while there is work and hands each event to the waiting request's
asyncio queue. Over capacity (every batch slot busy and `max_waiting` queued) a request gets 503
with Retry-After instead of a longer queue; a malformed body (bad JSON, unknown fields, values out
of range, a prompt too long for the context) gets 400 with a message. A client that disconnects
has its request aborted, which frees its batch slot and cache blocks at the next token boundary.
On SIGTERM uvicorn stops accepting connections and waits for the requests in flight; then the
engine thread stops.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and those
# name classes imported inside `create_app`.
import asyncio
import itertools
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pipeline.serve.engine import Engine, Event, PromptTooLong, QueueFull, Request
from pipeline.serve.kv_cache import BlockKVCache
from pipeline.serve.loading import Generator
from pipeline.serve.openai_api import (
    ChatBody,
    CompletionBody,
    chat_prompt,
    completion_object,
    error_body,
)

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class EngineLoop:
    """Runs the engine on its own thread and routes events to asyncio queues by request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pipe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, prompt: list[int], params) -> tuple[Request, asyncio.Queue]:
        """Queue a request (QueueFull, PromptTooLong pass through) and its event queue."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request = self.engine.add(prompt, params)
            self._queues[request.id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        return request, queue

    def release(self, request: Request) -> None:
        """The client is gone or done: abort the request if it still runs, forget its queue."""
        self.engine.abort(request)
        with self._lock:
            self._queues.pop(request.id, None)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.busy:
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
                log.exception("generation step failed")
                self._fail_all(error)
                continue
            with self._lock:
                for event in events:
                    self._deliver(event.request.id, event)
                    if event.finished:  # even if its consumer never started
                        self._queues.pop(event.request.id, None)

    def _deliver(self, request_id: int, item: Event | Exception) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            for request_id in list(self._queues):
                self._deliver(request_id, error)
        self.engine.abort_all()


def create_app(gen: Generator, engine: Engine, model_name: str):
    """The FastAPI application serving `engine` (module docstring)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    loop_holder = EngineLoop(engine)
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(_app):
        loop_holder.start()
        yield
        loop_holder.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.engine_loop = loop_holder

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, error: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
            for e in error.errors()
        )
        return JSONResponse(error_body(problems), status_code=400)

    @app.get("/health")
    async def health():
        running, waiting = engine.load
        finished = dict(engine.finish_counts)
        return {"status": "ok", "running": running, "waiting": waiting, "finished": finished}

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_name, "object": "model", "owned_by": "pipe"}
        return {"object": "list", "data": [entry]}

    async def answer(http: HTTPRequest, body, prompt_text: str, chat: bool):
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}"
        try:
            params = body.sampling(gen.eos_ids)
            prompt = gen.encode(prompt_text)
            request, queue = loop_holder.submit(prompt, params)
        except QueueFull as error:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return JSONResponse(error_body(str(error), "overloaded"), 503, headers=headers)
        except (PromptTooLong, ValueError) as error:
            return JSONResponse(error_body(str(error)), status_code=400)
        stream = _events(loop_holder, request, queue)
        if body.stream:
            chunks = _sse(stream, ident, model_name, chat)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await _whole(http, loop_holder, request, stream, ident, model_name, chat)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        return await answer(http, body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        try:
            prompt = chat_prompt(body.messages, gen.chat_template)
        except Exception as error:  # noqa: BLE001 - a template's own error, reported as such
            return JSONResponse(error_body(f"chat template: {error}"), status_code=400)
        return await answer(http, body, prompt, chat=True)

    return app


async def _events(loop: EngineLoop, request: Request, queue: asyncio.Queue) -> AsyncIterator:
    """The request's events until it finishes; aborts it if the consumer stops early."""
    try:
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return
    finally:
        loop.release(request)


async def _sse(events: AsyncIterator, ident: str, model: str, chat: bool) -> AsyncIterator[str]:
    async for event in events:
        finish = event.request.finish_reason if event.finished else None
        chunk = completion_object(ident, model, event.text, finish, None, chat)
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _whole(http, loop: EngineLoop, request: Request, events, ident, model, chat):
    """The complete answer; a client that disconnects meanwhile has its request aborted."""
    from fastapi.responses import JSONResponse

    text = []
    consumer = asyncio.ensure_future(_collect(events, text))
    while not consumer.done():
        await asyncio.wait({consumer}, timeout=0.25)
        if not consumer.done() and await http.is_disconnected():
            consumer.cancel()
            loop.release(request)
            return JSONResponse(error_body("client disconnected"), status_code=499)
    consumer.result()
    usage = {
        "prompt_tokens": len(request.prompt),
        "completion_tokens": len(request.output),
        "total_tokens": len(request.prompt) + len(request.output),
    }
    body = completion_object(ident, model, "".join(text), request.finish_reason, usage, chat)
    return JSONResponse(body)


async def _collect(events: AsyncIterator, text: list[str]) -> None:
    async for event in events:
        text.append(event.text)


def build_engine(gen: Generator, *, kv_cache_bytes: int, block_size: int, **limits) -> Engine:
    """An engine whose KV cache fits `kv_cache_bytes`."""
    param = next(gen.model.parameters())
    blocks = BlockKVCache.blocks_for_budget(gen.model.config, kv_cache_bytes, block_size,
                                            param.dtype, gen.tp)  # fmt: skip
    if blocks < 1:
        raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds not one block")
    return Engine(gen.model, cache_blocks=blocks, block_size=block_size, decode=gen.decode,
                  tp=gen.tp, **limits)  # fmt: skip


def run_server(
    gen: Generator,
    *,
    host: str,
    port: int,
    kv_cache_bytes: int,
    block_size: int,
    max_batch: int,
    max_waiting: int,
    prefill_chunk: int,
    model_name: str | None,
) -> None:
    """Serve until SIGTERM / Ctrl-C, then drain the requests in flight and return."""
    import uvicorn

    engine = build_engine(
        gen, kv_cache_bytes=kv_cache_bytes, block_size=block_size, max_batch=max_batch,
        max_waiting=max_waiting, prefill_chunk=prefill_chunk,
    )  # fmt: skip
    app = create_app(gen, engine, model_name or gen.name)
    uvicorn.run(app, host=host, port=port, log_level="warning")
