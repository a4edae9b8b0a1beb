"""A small harness for tier-B tests: run a function on `world_size` gloo processes on this CPU.

    def check(rank, world_size, tmp):        # runs in every process, process group initialised
        ...                                  # raise (or assert) to fail; return picklable results
    results = run_distributed(check, world_size=2, tmp_path=tmp_path)   # one result per rank

Processes are forked from the fork server of tests/forked.py (torch and pipe's training modules
imported once, not by every rank) and take the test process's environment and directory; they
use a FileStore rendezvous in `tmp_path` (no ports), and `destroy_process_group` runs in each.
An exception in any rank fails the test with that rank's traceback. Mark such tests
`@pytest.mark.dist`; each costs a second or two of process start-up.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.forked import fork_server, parent_state, take_parent_state

TIMEOUT_S = 240


def _entry(
    rank: int, fn: Callable, world_size: int, tmp: str, args: tuple, queue: Any, parent: tuple
) -> None:
    import torch
    import torch.distributed as dist

    try:
        take_parent_state(*parent)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, Path(tmp), *args)
        # Leave together: a rank destroying the group while another is still in a collective
        # aborts the late one's gloo threads.
        dist.barrier()
        # Plain pickle copies tensors by value; torch's queue would share their memory, which
        # is gone once this process exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report every failure, then let the process end
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, tmp_path, *args)` on `world_size` gloo ranks; return results in
    rank order. `fn` must be importable (a module-level function of a test module)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = fork_server()
    queue = ctx.Queue()
    parent = parent_state()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, str(tmp_path), args, queue, parent))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures = []
    reported: set[int] = set()
    while len(reported) < world_size:
        report = _next_report(queue, procs, reported)
        if isinstance(report, str):  # no report will come
            failures.append(report)
            break
        rank, ok, value = report
        reported.add(rank)
        if ok:
            results[rank] = pickle.loads(value)
        else:
            failures.append(f"rank {rank} failed:\n{value}")
    for p in procs:
        p.join(TIMEOUT_S if not failures else 5)
        if p.is_alive():
            p.kill()
            failures.append(f"process {p.pid} did not exit")
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def _next_report(queue: Any, procs: list, reported: set[int]) -> tuple | str:
    """The next rank's report, or why none will come: a rank whose process ended with an error
    (a crash, told at once with its signal, instead of after the timeout) or no report within
    `TIMEOUT_S` (a hang)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1)
        except queue_module.Empty:
            for rank, process in enumerate(procs):
                if rank not in reported and process.exitcode not in (None, 0):
                    return f"rank {rank} died before reporting ({_exit_reason(process.exitcode)})"
    return f"a rank reported nothing within {TIMEOUT_S} s (hung)"


def _exit_reason(exitcode: int) -> str:
    """`exitcode` of a process in words: the signal that killed it, or its exit status."""
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"
