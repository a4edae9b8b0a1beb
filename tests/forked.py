"""A fork server for tests that need processes of their own: gloo ranks (tests/distributed.py)
and runs that are killed or signalled (`run_forked`).

Starting a Python process that imports torch and pipe's training modules costs seconds of CPU;
on two cores shared by a whole suite that is most of such a test. The fork server imports them
once (PRELOAD), and each process is forked from it: a single-threaded process (forking the test
process instead would copy torch's threads). A forked process first takes the test process's
environment and working directory as they are at that moment, as a spawned one would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Imported once by the fork server rather than by every process.
PRELOAD = ["torch", "torch.distributed", "pipeline.train.loop.trainer", "tests.builders"]


def fork_server() -> Any:
    """The forkserver context, its server importing PRELOAD when it starts (on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def parent_state() -> tuple[dict[str, str], str]:
    """What a forked process takes from the test process: its environment and directory."""
    return dict(os.environ), os.getcwd()


def take_parent_state(environ: dict[str, str], cwd: str) -> None:
    """Take the test process's environment and working directory (see `parent_state`): a process
    forked from the server would otherwise have the server's, from when it started."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def _run_code(code: str, args: tuple[str, ...], parent: tuple, log: str) -> None:
    """Run `code` as `python -c code *args` would, stdout and stderr into `log`."""
    take_parent_state(*parent)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = ["-c", *args]
    exec(compile(code, "<run_forked>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    sys.stderr.flush()


class ForkedRun:
    """A process running Python code, forked from the fork server, with the part of the
    `subprocess.Popen` surface the tests use: `poll`, `send_signal`, `kill`, `communicate`,
    `returncode` and `stdout` (its output so far; stderr goes there too)."""

    def __init__(self, code: str, args: tuple[str, ...], cwd: Path, env: dict[str, str]):
        handle, self._log = tempfile.mkstemp(prefix="forked-", suffix=".log")
        os.close(handle)
        self.stdout = open(self._log, encoding="utf-8", errors="replace")  # noqa: SIM115
        self._process = fork_server().Process(
            target=_run_code, args=(code, args, (env, str(cwd)), self._log)
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once ended, negative for the signal that ended it (as Popen's)."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the end (TimeoutExpired after `timeout` s); return (all the output, None)."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("run_forked", timeout)
        output = Path(self._log).read_text(encoding="utf-8", errors="replace")
        self.stdout.close()
        os.unlink(self._log)
        return output, None


def run_forked(code: str, *args: str, cwd: Path, env: dict[str, str]) -> ForkedRun:
    """`python -c code *args` in `cwd` under `env`, forked from the fork server: pipe's training
    modules already imported (not for a test of what a fresh interpreter imports)."""
    return ForkedRun(textwrap.dedent(code), args, cwd, env)
