"""`pipe serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn.

The engine runs in its own process (`pipeline.serve.engine_process`); this process holds the HTTP
server and an `EngineClient`, which hands requests over and turns the engine's tokens into text.
Over capacity (the engine's batch full and `max_waiting` more in flight) a request gets 503 with
Retry-After instead of a longer queue; a malformed body (bad JSON, unknown fields, values out of
range, a prompt too long for the context) gets 400 with a message. A client that disconnects has
its request aborted, which frees its batch slot and cache blocks at the next step. On SIGTERM
uvicorn stops accepting connections and waits for the requests in flight; then the engine
process is told to stop.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations, and those
# name classes imported inside `create_app`.
import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pipeline.serve.engine import Engine, PromptTooLong, QueueFull
from pipeline.serve.engine_client import EngineClient, RequestStream
from pipeline.serve.engine_process import EngineSpec, batch_for_cache
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


def create_app(client: EngineClient, model_name: str):
    """The FastAPI application serving the engine behind `client` (module docstring)."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(_app):
        client.attach(asyncio.get_running_loop())
        yield
        client.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.engine_client = client

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, error: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
            for e in error.errors()
        )
        return JSONResponse(error_body(problems), status_code=400)

    @app.get("/health")
    async def health():
        running, waiting = client.load
        finished = dict(client.finish_counts)
        return {"status": "ok", "running": running, "waiting": waiting, "finished": finished}

    @app.get("/v1/models")
    async def models():
        entry = {"id": model_name, "object": "model", "owned_by": "pipe"}
        return {"object": "list", "data": [entry]}

    async def answer(http: HTTPRequest, body, prompt_text: str, chat: bool):
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{next(ids)}"
        try:
            params = body.sampling(client.ready.eos_ids)
            prompt = client.tokenizer.encode_batch([prompt_text])[0]
            stream = client.submit(prompt, params)
        except QueueFull as error:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return JSONResponse(error_body(str(error), "overloaded"), 503, headers=headers)
        except (PromptTooLong, ValueError) as error:
            return JSONResponse(error_body(str(error)), status_code=400)
        if body.stream:
            chunks = _sse(stream, ident, model_name, chat)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await _whole(http, stream, ident, model_name, chat)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionBody):
        return await answer(http, body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatBody):
        try:
            prompt = chat_prompt(body.messages, client.chat_template)
        except Exception as error:  # noqa: BLE001 - a template's own error, reported as such
            return JSONResponse(error_body(f"chat template: {error}"), status_code=400)
        return await answer(http, body, prompt, chat=True)

    return app


async def _sse(stream: RequestStream, ident: str, model: str, chat: bool) -> AsyncIterator[str]:
    """One server-sent event per delta (several tokens when the client reads slower than the
    engine writes); the request is aborted if the client goes away first."""
    try:
        async for delta in stream:
            chunk = completion_object(ident, model, delta.text, delta.finish_reason, None, chat)
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()


async def _whole(http, stream: RequestStream, ident, model, chat):
    """The complete answer; a client that disconnects meanwhile has its request aborted."""
    from fastapi.responses import JSONResponse

    text = []
    consumer = asyncio.ensure_future(_collect(stream, text))
    while not consumer.done():
        await asyncio.wait({consumer}, timeout=0.25)
        if not consumer.done() and await http.is_disconnected():
            consumer.cancel()
            stream.abort()
            return JSONResponse(error_body("client disconnected"), status_code=499)
    last = consumer.result()
    usage = {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }
    body = completion_object(ident, model, "".join(text), last.finish_reason, usage, chat)
    return JSONResponse(body)


async def _collect(stream: RequestStream, text: list[str]):
    """Gather the text of every delta; the last delta."""
    last = None
    async for last in stream:
        text.append(last.text)
    return last


def build_engine(gen: Generator, *, kv_cache_bytes: int, block_size: int, max_batch: int = 0,
                 **limits) -> Engine:  # fmt: skip
    """An engine whose KV cache fits `kv_cache_bytes`; `max_batch` 0 sizes the batch from the
    cache (`batch_for_cache`)."""
    param = next(gen.model.parameters())
    blocks = BlockKVCache.blocks_for_budget(gen.model.config, kv_cache_bytes, block_size,
                                            param.dtype, gen.tp)  # fmt: skip
    if blocks < 1:
        raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds not one block")
    # No `decode`: the server process makes the text, off the engine's path.
    return Engine(gen.model, cache_blocks=blocks, block_size=block_size, tp=gen.tp,
                  max_batch=max_batch or batch_for_cache(blocks), **limits)  # fmt: skip


def run_server(spec: EngineSpec, *, host: str, port: int, max_waiting: int,
               model_name: str | None) -> None:  # fmt: skip
    """Load the model in the engine process, then serve until SIGTERM / Ctrl-C, drain the
    requests in flight and return. `LoadError` if the model cannot be loaded."""
    import uvicorn

    client = EngineClient(spec, max_waiting)
    ready = client.start()
    app = create_app(client, model_name or ready.name)
    uvicorn.run(app, host=host, port=port, log_level="warning")
