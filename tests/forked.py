"""A fork server for tests that need processes of their own: gloo ranks (tests/distributed.py)
and runs that are killed or signalled (`run_forked`).

Starting a Python process that imports torch and pipe's training modules costs seconds of CPU;
on two cores shared by a whole suite that is most of such a test. The fork server imports them
once (PRELOAD), and each process is forked from it: a single-threaded process (forking the test
process instead would copy torch's threads). A forked process first takes the test process's
environment and working directory as they are at that moment, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Imported once by the fork server rather than by every process.
# `pipe serve`'s front end (tests/serve/test_server.py's `Server`) is forked too; without
# fastapi its modules are skipped (the fork server passes over a preload that cannot import).
PRELOAD = [
    "torch",
    "torch.distributed",
    "pipeline.train.loop.trainer",
    "tests.builders",
    "pipeline.cli",
    "fastapi",
    "uvicorn",
    "pipeline.serve.http.server",
    "pipeline.serve.http.startup",
    "pipeline.serve.http.tool_calls",
]


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


def _run_code(code: str, args: tuple[str, ...], parent: tuple, log: str, errors: str) -> None:
    """Run `code` as `python -c code *args` would, stdout into `log` and stderr into `errors`."""
    take_parent_state(*parent)
    for target, path in ((1, log), (2, errors)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = ["-c", *args]
    exec(compile(code, "<run_forked>", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    sys.stderr.flush()


class ForkedRun:
    """A process running Python code, forked from the fork server, with the part of the
    `subprocess.Popen` surface the tests use: `poll`, `send_signal`, `terminate`, `kill`,
    `wait`, `communicate`, `returncode` and `stdout` (its output so far; stderr goes there too
    unless `stderr` names a file of its own, which is then appended to)."""

    def __init__(
        self,
        code: str,
        args: tuple[str, ...],
        cwd: Path,
        env: dict[str, str],
        stderr: Path | None = None,
    ):
        handle, self._log = tempfile.mkstemp(prefix="forked-", suffix=".log")
        os.close(handle)
        self.stdout = open(self._log, encoding="utf-8", errors="replace")  # noqa: SIM115
        errors = self._log if stderr is None else str(stderr)
        self._process = fork_server().Process(
            target=_run_code, args=(code, args, (env, str(cwd)), self._log, errors)
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

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once ended (TimeoutExpired after `timeout` s), as Popen's `wait`."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("run_forked", timeout)
        return self._process.exitcode

    def discard_output(self) -> None:
        """Close and remove the file of its output (a run whose output nobody reads)."""
        self.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._log)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the end (TimeoutExpired after `timeout` s); return (all the output, None)."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("run_forked", timeout)
        output = Path(self._log).read_text(encoding="utf-8", errors="replace")
        self.stdout.close()
        os.unlink(self._log)
        return output, None


def run_forked(
    code: str, *args: str, cwd: Path, env: dict[str, str], stderr: Path | None = None
) -> ForkedRun:
    """`python -c code *args` in `cwd` under `env`, forked from the fork server: pipe's training
    modules already imported (not for a test of what a fresh interpreter imports); stderr into
    the file `stderr` when given, else with stdout."""
    return ForkedRun(textwrap.dedent(code), args, cwd, env, stderr)
