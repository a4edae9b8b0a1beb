"""`pipe serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn.

The engine runs in its own process (`pipeline.serve.engine.process`); this process holds the HTTP
server and an `EngineClient`, which hands requests over and turns the engine's tokens into text.
Routes (`pipeline.serve.http.routes`) turn a body into prompt token ids and `SamplingParams`
(`pipeline.serve.http.openai_api`), hand each (prompt, choice) to the engine client's `submit`
(`pipeline.serve.http.jobs`) and build the answer, whole or streamed, from the deltas that come back
(`pipeline.serve.http.responses`). A body asking for n choices of p prompts is p x n engine requests
(best_of: p x best_of, the n best kept); choice `i` of prompt `p` has index p * n + i, as OpenAI
numbers them.

Over capacity (the engine's batch full and `max_waiting` more in flight) a request gets 503 with
Retry-After instead of a longer queue. Every error is OpenAI's `{"error": {...}}` body
(`pipeline.serve.http.http_errors`): 400 for a malformed body (bad JSON, values out of range, a
prompt too long for the context; unknown fields are ignored and logged, as vLLM does) with the
field at fault as `param`, 404 for an unknown
model or path, 405 for a wrong method. A client that disconnects has its requests aborted, which
frees their batch slots and cache blocks at the next token boundary. On SIGTERM uvicorn stops
accepting connections and waits for the requests in flight; then the engine process is told to
stop.

Besides the OpenAI routes: vLLM's /tokenize, /detokenize and /version, Prometheus' /metrics and
/health.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from pipeline.serve.engine.process import EngineSpec
from pipeline.serve.http.engine_client import EngineClient


def create_app(
    client: EngineClient,
    model_name: str,
    tools=None,
    runtime_lora: bool = False,
    reasoning_parser: str | None = None,
):
    """The FastAPI application serving the engine behind `client` (module docstring): the engine
    client delivers on the server's event loop while it runs and is stopped when it ends.
    `tools`: the `ToolServing` options (tool-call parser), None for none. The engine's adapters
    are served by name (`pipeline.serve.http.lora_routes`), loaded and unloaded while serving when
    `runtime_lora`. `reasoning_parser`: vLLM's name of the model's thinking format
    (`pipeline.tokenizer.reasoning`), None for none."""
    from fastapi import FastAPI

    from pipeline.serve.http.http_errors import add_error_handlers
    from pipeline.serve.http.routes import ServedModel, add_routes

    @asynccontextmanager
    async def lifespan(_app):
        client.attach(asyncio.get_running_loop())
        yield
        client.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.engine_client = client
    add_error_handlers(app)
    served = ServedModel.of(client, model_name, tools, reasoning_parser)
    served.adapters.paths.update(dict(client.spec.lora_modules))
    served.adapters.runtime_updates = runtime_lora
    add_routes(app, served)
    return app


def run_server(
    spec: EngineSpec,
    *,
    host: str,
    port: int,
    max_waiting: int,
    model_name: str | None,
    tools=None,
    access_log: bool = False,
    runtime_lora: bool = False,
    reasoning_parser: str | None = None,
) -> None:
    """Take the address, load the model in the engine process, then serve until SIGTERM /
    Ctrl-C, drain the requests in flight and return. `LoadError` if the model cannot be
    loaded; a click error at once if the address is taken (`pipeline.serve.http.startup`)."""
    import uvicorn

    from pipeline.serve.http.startup import announce, bind_socket, enable_access_log, startup_line

    with bind_socket(host, port) as sock:
        client = EngineClient(spec, max_waiting)
        ready = client.start()
        name = model_name or ready.name
        try:
            app = create_app(client, name, tools, runtime_lora, reasoning_parser)
        except ValueError:
            client.stop()  # a parser the tokenizer cannot serve: the engine process goes too
            raise
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=access_log,
        )
        if access_log:
            enable_access_log()

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                announce(startup_line(sock, name))

        Server(config).run(sockets=[sock])
