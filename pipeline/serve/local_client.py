"""The engine on a thread of the server's process, behind the `EngineClient` interface.

A stand-in until the engine runs in its own process (`pipeline.serve.engine_client`): the server
only calls `submit(prompt_ids, params) -> stream of Delta`, `load` and `finish_counts`, so this
module can be deleted once that client lands.

One thread runs `Engine.step` while there is work and hands each event to the waiting request's
asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from pipeline.serve.engine import Engine, Event, Request

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """What a request produced since its last delta (`EngineClient`'s shape)."""

    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)  # one TokenLogprobs per token, when asked
    prompt_logprobs: list | None = None  # on the first delta only, when asked
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_time: float | None = None  # seconds queued, on the first delta


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


class LocalStream:
    """One request's deltas (one per token); `abort` stops it."""

    def __init__(self, loop: EngineLoop, request: Request, queue: asyncio.Queue) -> None:
        self._loop, self._request, self._queue = loop, request, queue
        self._count = 0
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):
            self._done = True
            raise item
        self._count += 1
        request = self._request
        delta = Delta(
            token_ids=[item.token],
            text=item.text,
            logprobs=[] if item.logprobs is None else [item.logprobs],
            prompt_logprobs=None if item.prompt_logprobs is None else list(item.prompt_logprobs),
            finish_reason=request.finish_reason if item.finished else None,
            prompt_tokens=len(request.prompt),
            completion_tokens=self._count,
        )
        if self._count == 1 and request.admitted is not None:
            delta.queue_time = request.admitted - request.arrived
        if item.finished:
            self._done = True
            self._loop.release(self._request)
        return delta

    def abort(self) -> None:
        self._done = True
        self._loop.release(self._request)


class LocalEngineClient:
    """`EngineClient`'s interface over an engine thread in this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._loop = EngineLoop(engine)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def submit(self, prompt_ids: list[int], params) -> LocalStream:
        """Queue a generation (QueueFull / PromptTooLong pass through) and return its stream."""
        request, queue = self._loop.submit(prompt_ids, params)
        return LocalStream(self._loop, request, queue)

    @property
    def load(self) -> tuple[int, int]:
        return self.engine.load

    @property
    def finish_counts(self):
        return self.engine.finish_counts
