"""Encoding processes for `pipe preprocess`: copies of the process, forked once the tokenizer
is loaded, that parse and encode the batches they are sent.

Threads in one process share one interpreter lock, so the Python half of the work (parsing,
validating, packing) runs one batch at a time however many threads encode; separate processes
do not, and a fork shares the loaded tokenizer instead of loading it again (about 0.5 s and a
core each). With `--workers N` the runner keeps N - 1 copies busy and encodes in its own
process whenever every copy already holds enough work; it reads, hashes and writes as before.

A copy runs nothing but `DocumentEncoder` on the batches it receives, and answers in order
over a pipe; it ends when told, when its pipe closes (the runner died), or on a signal. The
runner kills and reaps every copy on any failure, so none outlives the command.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import pickle
import signal
import struct
import sys
import threading
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from queue import SimpleQueue

from pipeline.preprocess.encode import DocumentEncoder, EncodedBatch
from pipeline.preprocess.readers import Batch
from pipeline.tokenizer.engines import ALONE

# Batches a copy holds at once (one being encoded, the next waiting in its pipe): enough to
# keep it busy, few enough that memory does not depend on the input.
IN_FLIGHT = 2
# Pipe buffer asked for (Linux allows 1 MiB to unprivileged processes by default).
PIPE_BYTES = 1 << 20


class EncoderDied(RuntimeError):
    """An encoding process failed, or stopped without answering (killed, out of memory)."""


def can_fork() -> bool:
    """Whether forked encoding processes are used here: Linux only (macOS system libraries
    are not safe in a forked child, and Windows has no fork)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class EncodingProcess:
    """One forked copy of this process that encodes the batches submitted to it, in order.

    Two small threads (started by `start`, once every copy is forked, so that no copy inherits
    a running thread's state) move pickled batches and results through the pipes, so the
    caller never blocks on a full pipe while the copy waits for it to read.
    """

    def __init__(self, encoder: DocumentEncoder, others: list[EncodingProcess]) -> None:
        task_read, task_write = _pipe()
        result_read, result_write = _pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork in a process with threads (here only a BLAS pool's,
            # idle); the copy runs no code that could need their locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the copy: never returns
            for fd in [task_write, result_read] + [f for p in others for f in p._fds]:
                os.close(fd)
            _serve(encoder, task_read, result_write)
        os.close(task_read)
        os.close(result_write)
        self.pid = pid
        self.in_flight = 0
        self._fds = (task_write, result_read)
        self._tasks: SimpleQueue = SimpleQueue()
        self._results: SimpleQueue = SimpleQueue()
        self._threads = [
            threading.Thread(target=self._send, args=(task_write,), daemon=True),
            threading.Thread(target=self._receive, args=(result_read,), daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, batch: Batch) -> None:
        self.in_flight += 1
        self._tasks.put(_pack(batch))

    def has_result(self) -> bool:
        return not self._results.empty()

    def result(self) -> EncodedBatch:
        """The oldest submitted batch, encoded (waits for it)."""
        message = self._results.get()
        self.in_flight -= 1
        answer = _unpack(message) if message is not None else None
        if isinstance(answer, EncodedBatch):
            return answer
        raise EncoderDied(answer or f"an encoding process ({self._exit_status()}) stopped")

    def close(self) -> None:
        """Let the copy finish and reap it (after every result was taken)."""
        self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        os.waitpid(self.pid, 0)

    def kill(self) -> None:
        """Stop the copy now and reap it."""
        if self._threads[0].ident is None:  # never started: the threads own the pipes
            for fd in self._fds:
                os.close(fd)
        self._tasks.put(None)  # lets the sending thread end
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def _send(self, fd: int) -> None:
        try:
            while (message := self._tasks.get()) is not None:
                _write(fd, message)
        except OSError:
            pass  # the copy is gone; the receiving side reports it
        finally:
            os.close(fd)

    def _receive(self, fd: int) -> None:
        try:
            while (message := _read(fd)) is not None:
                self._results.put(message)
        except OSError:
            pass  # as the end of the pipe: the caller is told the copy stopped
        finally:
            self._results.put(None)
            os.close(fd)

    def _exit_status(self) -> str:
        """How the copy ended (it closed its pipe, so it is ending), for the error message."""
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            return f"pid {self.pid}"
        if os.WIFSIGNALED(status):
            return f"pid {self.pid}, killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"pid {self.pid}, exit status {os.waitstatus_to_exitcode(status)}"


def _pipe() -> tuple[int, int]:
    """A pipe with as large a buffer as the system allows (up to PIPE_BYTES): a batch crosses
    it in a few writes instead of one per 64 KiB, each of which waits for the other side."""
    read, write = os.pipe()
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read, write


def _serve(encoder: DocumentEncoder, task_fd: int, result_fd: int) -> None:
    """The copy's whole life: encode each batch received, answer with it (or with what went
    wrong), and leave with os._exit so that nothing of the runner's (its temporary files, its
    exit handlers) runs here."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the runner reports it
        while (message := _read(task_fd)) is not None:
            try:
                answer: object = encoder(_unpack(message), ALONE)
            except Exception as e:  # handed to the runner, which stops with it
                answer = f"encoding failed in a worker process: {type(e).__name__}: {e}"
            _write(result_fd, _pack(answer))
    except BaseException:
        code = 1
    finally:
        os._exit(code)


# ------------------------------------------------------------------------------ messages
# A message is an object pickled with its large buffers (numpy arrays) kept out of the
# pickle: a count, each part's length, then the parts. Only this process's own copies write
# to these pipes, so unpickling runs nothing foreign.


def _pack(obj: object) -> list:
    buffers: list = []
    header = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [memoryview(header).cast("B")] + [b.raw() for b in buffers]


def _unpack(parts: list) -> object:
    return pickle.loads(parts[0], buffers=parts[1:])


def _write(fd: int, parts: list) -> None:
    sizes = struct.pack(f"<{len(parts) + 1}Q", len(parts), *(p.nbytes for p in parts))
    for view in (memoryview(sizes), *parts):
        while view.nbytes:
            view = view[os.write(fd, view) :]


def _read(fd: int) -> list | None:
    """One message's parts, or None at the end of the pipe."""
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    (count,) = struct.unpack("<Q", head)
    sizes = _read_exactly(fd, 8 * count)
    if sizes is None:
        return None
    parts = [_read_exactly(fd, size) for size in struct.unpack(f"<{count}Q", sizes)]
    if any(part is None for part in parts):
        return None
    return parts


def _read_exactly(fd: int, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view.nbytes:
        got = os.readv(fd, [view])
        if got == 0:
            return None
        view = view[got:]
    return buffer


def encode_forked(
    batches: Iterable[Batch], encoder: DocumentEncoder, workers: int
) -> Iterator[EncodedBatch]:
    """Encoded batches in input order, from `workers - 1` forked copies and this process.

    Each batch goes to the copy with the least work if one holds fewer than IN_FLIGHT, else
    is encoded here; finished results are handed on as soon as all before them are.
    """
    helpers = _fork(encoder, workers - 1)
    done = False
    try:
        pending: deque = deque()  # an EncodedBatch, or the copy that will answer for it
        for batch in batches:
            helper = min(helpers, key=lambda h: h.in_flight)
            if helper.in_flight < IN_FLIGHT:
                helper.submit(batch)
                pending.append(helper)
            else:
                pending.append(encoder(batch, ALONE))
            yield from _finished(pending, wait=False)
        yield from _finished(pending, wait=True)
        done = True
    finally:
        for helper in helpers:
            if done:
                helper.close()
            else:
                helper.kill()


def _fork(encoder: DocumentEncoder, count: int) -> list[EncodingProcess]:
    """`count` started copies of this process (none left behind if one cannot be made)."""
    helpers: list[EncodingProcess] = []
    # Frozen objects are never scanned by the collector, which would otherwise write to (and
    # so make each process copy) every page the processes still share.
    frozen_already = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        for _ in range(count):
            helpers.append(EncodingProcess(encoder, helpers))
    except BaseException:
        for helper in helpers:
            helper.kill()
        raise
    finally:
        if not frozen_already:
            gc.unfreeze()
    for helper in helpers:
        helper.start()
    return helpers


def _finished(pending: deque, wait: bool) -> Iterator[EncodedBatch]:
    """Pop results off the front of `pending` while they are ready (or, with `wait`, all)."""
    while pending:
        head = pending[0]
        if isinstance(head, EncodingProcess):
            if not (wait or head.has_result()):
                return
            head = head.result()
        pending.popleft()
        yield head
