"""`pipe eval`: lm-evaluation-harness run against `pipe serve`'s engine, started for the run.

The engine serves on a free loopback port from a thread of this process (the model in its own
process, as `pipe serve` runs it); the harness's `local-completions` model (with `chat`:
`local-chat-completions`, generation tasks only) talks to it with its default settings: the
tokenizer comes from the server's /tokenizer_info and /tokenize, so the harness needs no copy of
the tokenizer files and no hub. Scores are what the same harness gives against vLLM.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pipeline.serve.engine.process import EngineSpec

_START_TIMEOUT_S = 120


@dataclass(frozen=True)
class HarnessRun:
    """What to evaluate: lm-eval's task names and its usual knobs."""

    tasks: list[str]
    num_fewshot: int | None = None
    limit: float | None = None
    task_manager: Any = None  # lm-eval's TaskManager (`task_manager`); None: its default one
    chat: bool = False
    batch_size: int = 1
    num_concurrent: int = 8
    log_samples: bool = False


@contextmanager
def serving(
    spec: EngineSpec, model_name: str, max_waiting: int = 1024, progress: bool = False
) -> Iterator[tuple[str, int]]:
    """`pipe serve` in a thread, on a free loopback port: yields its base URL and the model's
    context length; the server and the engine process stop on leaving. `LoadError` if the
    model cannot be loaded. `progress`: on a terminal, a bar of the requests answered."""
    import uvicorn

    from pipeline.serve.http.engine_client import EngineClient
    from pipeline.serve.http.server import create_app
    from pipeline.serve.http.startup import bind_socket

    # lm-eval's Hugging Face backend, what `pipe eval`'s scores are held to, keeps U+FFFD for
    # a generation cut inside a character; vLLM (and `pipe serve`) leave the partial one out.
    client = EngineClient(spec, max_waiting, keep_partial=True)
    ready = client.start()
    # bound as `pipe serve` binds, Nagle's algorithm off: with it on, every small reply (the
    # harness's tokenize calls, one at a time) waited ~40 ms for the client's delayed ACK
    listener = bind_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    config = uvicorn.Config(create_app(client, model_name), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        _wait_started(server, thread)
        with answered_bar(client) if progress else contextlib.nullcontext():
            yield f"http://127.0.0.1:{port}", ready.max_context
    finally:
        server.should_exit = True
        thread.join()
        client.stop()
        listener.close()


@contextmanager
def answered_bar(client) -> Iterator[None]:
    """On a terminal, pipe's bar of the requests `client`'s engine has answered, refreshed twice
    a second from another thread (the harness's own bars are held back; the total is the
    harness's to know)."""
    from pipeline.common.progress import terminal_bar

    bar = terminal_bar(None, desc="pipe eval", unit=" requests")
    if bar is None:
        yield
        return
    stop = threading.Event()

    def refresh() -> None:
        bar.n = sum(list(client.finish_counts.values()))  # a copy: the loop adds reasons
        bar.refresh()

    def keep_refreshing() -> None:
        while not stop.wait(0.5):
            refresh()

    refresher = threading.Thread(target=keep_refreshing, name="pipe-eval-progress", daemon=True)
    refresher.start()
    try:
        yield
    finally:
        stop.set()
        refresher.join()
        refresh()
        bar.close()


def _wait_started(server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the evaluation server did not start")


def harness_model_args(
    run: HarnessRun, base_url: str, model_name: str, max_length: int
) -> tuple[str, dict[str, Any]]:
    """lm-eval's model name and `model_args` for the server at `base_url`: the harness's
    defaults, with the server's context length and `run`'s batching."""
    route = "/v1/chat/completions" if run.chat else "/v1/completions"
    args = {
        "model": model_name,
        "base_url": base_url + route,
        "max_length": max_length,
        "num_concurrent": run.num_concurrent,
    }
    if not run.chat:
        args["batch_size"] = run.batch_size
    return ("local-chat-completions" if run.chat else "local-completions"), args


def run_harness(run: HarnessRun, base_url: str, model_name: str, max_length: int) -> dict:
    """lm-eval's `simple_evaluate` on the server at `base_url`: its results dict (`results`,
    `configs`, ... and `samples` with `log_samples`)."""
    import lm_eval

    model, args = harness_model_args(run, base_url, model_name, max_length)
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=run.tasks,
        num_fewshot=run.num_fewshot,
        limit=run.limit,
        task_manager=run.task_manager,
        log_samples=run.log_samples,
        apply_chat_template=run.chat,
    )
