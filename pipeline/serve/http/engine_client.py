"""The HTTP server's side of the engine process: submit requests, receive their tokens as text.

`EngineClient` starts the engine process (`pipeline.serve.engine.process`), waits until the model
is loaded, and then lives in the server's event loop. A reader thread turns each message of the
engine (one per step, for the whole batch) into one callback on the loop, which appends each
token to its request's `RequestStream`. The text is made when the stream's consumer asks for it:
incremental detokenisation and stop strings (`pipeline.serve.engine.text.RequestText`, as for `pipe
generate`) run in the server process, off the engine's path, and a consumer slower than the
engine gets every token that arrived meanwhile in one `Delta` (several tokens per streamed chunk
instead of a growing backlog).

Admission is checked here, with the limits the engine reported when it started: a prompt that
can never fit is refused at once (`PromptTooLong`), and so is a request beyond the engine's batch
plus `max_waiting` requests in flight (`QueueFull`: 503 with Retry-After), and every request while
generation is paused for new weights (`GenerationPaused`, also 503 with Retry-After;
`pipeline.serve.http.weight_control` pauses, drains and resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import threading
from collections import Counter

from pipeline.serve.engine.loading import LoadError, open_tokenizer
from pipeline.serve.engine.messages import (
    AbortRequest,
    AddGroup,
    ControlDone,
    Delta,
    EngineExited,
    Failed,
    FromEngine,
    LoadReport,
    Ready,
    Rejected,
    StepFailed,
    StepOutputs,
    StopEngine,
    ToEngine,
    TokenOutput,
)
from pipeline.serve.engine.process import EngineSpec, run_engine
from pipeline.serve.engine.request_checks import PromptTooLong, fit_problem
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.scheduler import QueueFull
from pipeline.serve.engine.text import RequestText


class EngineFailed(RuntimeError):
    """The engine process failed a step or died; the requests in flight are lost."""


class GenerationPaused(QueueFull):
    """Generation is paused (new weights): no new request until it resumes; retry later."""


class RequestStream:
    """One request's output, an async iterator of `Delta`s ending with the one that carries a
    finish reason. `abort()` stops it (a client that went away)."""

    def __init__(
        self, client: EngineClient, request_id: int, prompt: list[int], params: SamplingParams
    ) -> None:
        self.client, self.request_id, self.prompt, self.params = client, request_id, prompt, params
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._text = RequestText(client.tokenizer.decode, params, prompt, client.keep_partial)
        self._arrived: list[TokenOutput] = []
        self._error: Exception | None = None
        self._wake = asyncio.Event()
        self._first = True
        self._cancelled = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.finish_reason is not None and not self._arrived:
            raise StopAsyncIteration
        while not self._arrived and self._error is None and not self._cancelled:
            self._wake.clear()
            await self._wake.wait()
        if self._error is not None:
            self._close("abort")
            raise self._error
        if not self._arrived:  # cancelled: a last delta says so
            self.finish_reason = "abort"
            return Delta(
                [],
                "",
                finish_reason="abort",
                prompt_tokens=len(self.prompt),
                completion_tokens=self.completion_tokens,
            )
        arrived, self._arrived = self._arrived, []
        return self._delta(arrived)

    def abort(self) -> None:
        """Stop the request now; its engine slot and cache blocks are freed at the next step."""
        if self.finish_reason is None:
            self.client._abort(self.request_id)
            self._close("abort")

    def cancel(self) -> None:
        """Abort the request from the server's side (a pause that aborts what runs): its
        consumer gets what already arrived, then a last delta with finish reason "abort"."""
        if self.finish_reason is None and not self._cancelled:
            self.client._abort(self.request_id)
            self.client._forget(self.request_id, "abort")
            self._cancelled = True
            self._wake.set()

    def _delta(self, arrived: list[TokenOutput]) -> Delta:
        tokens, text = [], ""
        for output in arrived:
            tokens.append(output.token)
            text += self._text.add(output.token, output.finish_reason)
            if self._text.stopped_by_text:  # a stop string: the engine need not go on
                self.client._abort(self.request_id)
            if self._text.finish_reason is not None:
                break
        finish = self._text.finish_reason
        self.completion_tokens += len(tokens)
        delta = Delta(
            tokens,
            text,
            [o.logprobs for o in arrived[: len(tokens)] if o.logprobs is not None],
            arrived[0].prompt_logprobs if self._first else None,
            finish,
            len(self.prompt),
            self.completion_tokens,
            arrived[0].queue_time if self._first else None,
            arrived[0].cached_tokens if self._first else None,
        )
        self._first = False
        if finish is not None:
            self._close(finish)
        return delta

    def _close(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.client._forget(self.request_id, reason)

    def _receive(self, output: TokenOutput) -> None:
        self._arrived.append(output)
        self._wake.set()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._wake.set()


class EngineClient:
    """The engine process seen from the HTTP server (module docstring). `keep_partial`: an
    output cut inside a character ends with U+FFFD, as lm-eval's Hugging Face backend writes
    it (`pipe eval`'s server), instead of without it, as vLLM writes it
    (`pipeline.serve.engine.text.TextStream`)."""

    def __init__(self, spec: EngineSpec, max_waiting: int, keep_partial: bool = False) -> None:
        self.spec = spec
        self.max_waiting = max_waiting
        self.keep_partial = keep_partial
        self.finish_counts: Counter = Counter()
        self._engine_running = 0  # as of the engine's last message
        self._streams: dict[int, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._dead: Exception | None = None
        self.paused = False  # new requests get `GenerationPaused`
        self._drained = asyncio.Event()  # set when the last request in flight has ended
        self._control: asyncio.Future | None = None  # the engine's answer to a control message
        self._control_lock = asyncio.Lock()  # one control message at a time, whoever sends it

    # ---- process life -------------------------------------------------------------------------

    def start(self) -> Ready:
        """Start the engine process and wait for its model; `LoadError` if it cannot load."""
        context = multiprocessing.get_context("spawn")  # fork would copy torch's threads
        if self.spec.device == "cpu":
            # The spawned process reads it as torch starts: its large tensors (weights, KV
            # cache) on transparent huge pages, which makes a decode step, bound by how fast
            # it walks them, about 4% faster (docs/serve.md, "The engine").
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        self._pipe, child = context.Pipe()
        self.process = context.Process(
            target=run_engine, args=(self.spec, child), name="pipe-engine", daemon=True
        )
        self.process.start()
        child.close()
        try:
            ready = self._pipe.recv()
        except EOFError:
            died = f"{self.spec.checkpoint}: the engine process died while loading"
            raise LoadError(died) from None
        if isinstance(ready, Failed):
            self.process.join()
            raise LoadError(ready.message)
        self.ready: Ready = ready
        if ready.tokenizer_path is None:
            self.stop()
            raise LoadError(
                f"{self.spec.checkpoint}: no tokenizer recorded or found beside it; "
                "pass --tokenizer DIR"
            )
        self.tokenizer, self.chat_template = open_tokenizer(ready.tokenizer_path)
        return ready

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver the engine's messages on `loop` from now on."""
        self._loop = loop
        if self._reader is None:
            self._reader = threading.Thread(
                target=self._read, name="pipe-engine-reader", daemon=True
            )
            self._reader.start()

    def stop(self) -> None:
        """Tell the engine process to exit and wait for it (the server has drained)."""
        with contextlib.suppress(OSError, ValueError):  # already gone
            self._pipe.send(StopEngine())
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        self._pipe.close()

    @property
    def failure(self) -> Exception | None:
        """Why the engine process is gone (None while it runs)."""
        return self._dead

    # ---- requests ----------------------------------------------------------------------------

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting): the requests in flight, those the engine last reported running
        counted as running (an aborted request leaves both at once)."""
        in_flight = len(self._streams)
        running = min(self._engine_running, in_flight)
        return running, in_flight - running

    def submit(
        self, prompt: list[int], params: SamplingParams, lora_name: str | None = None
    ) -> RequestStream:
        """Queue a request (run with the adapter `lora_name`, when given); `PromptTooLong` if it
        can never fit, `QueueFull` over capacity."""
        return self.submit_group(prompt, [params], lora_name)[0]

    def submit_group(
        self, prompt: list[int], params: list[SamplingParams], lora_name: str | None = None
    ) -> list[RequestStream]:
        """Queue one request per `params` entry on `prompt`, prefilled once (`Engine.add_group`),
        all with the adapter `lora_name`; errors as `submit`'s, for the whole group (then
        nothing is queued)."""
        if self._dead is not None:
            raise self._dead
        if self.paused:
            raise GenerationPaused("generation is paused for new weights; retry after resume")
        ready = self.ready
        for each in params:
            problem = fit_problem(
                len(prompt),
                each.max_new_tokens,
                ready.max_context,
                ready.block_size,
                ready.cache_blocks,
            )
            if problem is not None:
                raise PromptTooLong(problem)
        waiting = len(self._streams) - ready.max_batch
        if waiting + len(params) > self.max_waiting:
            raise QueueFull(f"{max(waiting, 0)} requests already waiting")
        streams = [RequestStream(self, next(self._ids), list(prompt), each) for each in params]
        for stream in streams:
            self._streams[stream.request_id] = stream
        ids = [stream.request_id for stream in streams]
        self._pipe.send(AddGroup(ids, list(prompt), list(params), lora_name))
        return streams

    def cancel_all(self) -> None:
        """Abort every request in flight (`RequestStream.cancel`)."""
        for stream in list(self._streams.values()):
            stream.cancel()

    async def drained(self) -> None:
        """Return once no request is in flight (those running finish as they would)."""
        while self._streams:
            self._drained.clear()
            await self._drained.wait()

    async def control(self, message: ToEngine) -> ControlDone:
        """Send a control message (new weights, a cache reset, an adapter load) and wait for
        the engine's answer. Messages from different routes (a weight push and an adapter load)
        wait for each other: the engine answers in order, and each waits for its own answer."""
        async with self._control_lock:
            if self._dead is not None:
                raise self._dead
            self._control = asyncio.get_running_loop().create_future()
            self._pipe.send(message)
            try:
                return await self._control
            finally:
                self._control = None

    def _abort(self, request_id: int) -> None:
        if request_id in self._streams:
            self._pipe.send(AbortRequest(request_id))

    def _forget(self, request_id: int, reason: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.finish_counts[reason] += 1
            if not self._streams:
                self._drained.set()

    # ---- the engine's messages ---------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._pipe.recv()
            except (EOFError, OSError):
                message = EngineExited()
            try:
                self._loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # the server's event loop is closed: nobody is listening
                return
            if isinstance(message, EngineExited):
                return

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, StepOutputs):
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream._receive(output)
            self._engine_running = message.running
        elif isinstance(message, LoadReport):
            self._engine_running = message.running
        elif isinstance(message, Rejected):
            stream = self._streams.get(message.request_id)
            if stream is not None:
                stream._fail(PromptTooLong(message.message))
        elif isinstance(message, EngineExited):
            self._fail_all(EngineFailed("the engine process exited"))
        elif isinstance(message, ControlDone):
            if self._control is not None and not self._control.done():
                self._control.set_result(message)
        elif isinstance(message, StepFailed):
            self._fail_all(EngineFailed(f"generation step failed: {message.message}"), dead=False)

    def _fail_all(self, error: Exception, dead: bool = True) -> None:
        if dead:
            self._dead = error
            if self._control is not None and not self._control.done():
                self._control.set_exception(error)
        for stream in list(self._streams.values()):
            stream._fail(error)
