"""A crash-safe, multi-process-safe cache of named numpy arrays (the dataset index cache).

Files are laid out as Megatron lays out its index cache, so users recognise them:

    {directory}/{key}-{class_name}-{split}-description.txt
    {directory}/{key}-{class_name}-{split}-{name}.npy        (one per array)

Unlike Megatron, the cache is committed atomically: every array is written under a temporary
name, flushed and renamed, and the description is renamed into place LAST. A cache whose
description is missing is partial (a crash mid-write) and is rebuilt, never loaded.

Several processes may ask for the same cache at once (ranks on one node, nodes sharing a file
system). Exactly one builds, holding a lock file created with O_CREAT|O_EXCL that records its
host, pid and start time and whose modification time a heartbeat thread keeps fresh; the others
poll until the description appears, then memory-map the files. A lock whose process is gone (same
host) or whose heartbeat stopped is broken with a warning. Even if two processes did build at
once, the result stays correct: the arrays are deterministic and every file appears by rename.

Arrays are loaded with `np.load(mmap_mode="r")` and never with pickle, so start-up is a few
file opens per rank.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from pipeline.common.atomic import TEMPORARY_MARK, atomic_file, temporary_owner

logger = logging.getLogger(__name__)

DESCRIPTION_AFFIX = "description.txt"
_MAX_POLL_S = 2.0


class CacheNotWritableError(OSError):
    """The cache directory cannot be created or written (read-only or permission denied)."""


class CacheWaitTimeout(TimeoutError):
    """Another process held the build lock for longer than the wait timeout."""


class IndexCache:
    """The cached arrays of one (key, class, split) in `directory`.

    `names`, when given, are the arrays a complete cache must hold (checked on load); otherwise
    every `{base}-*.npy` present at commit time is loaded.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        key: str,
        class_name: str,
        split: str,
        names: Sequence[str] | None = None,
        *,
        wait_timeout_s: float = 3600.0,
        stale_lock_s: float = 600.0,
        heartbeat_s: float = 30.0,
        poll_s: float = 0.1,
    ):
        self.directory = Path(directory)
        self.base = f"{key}-{class_name}-{split}"
        self.names = tuple(names) if names is not None else None
        self.wait_timeout_s = wait_timeout_s
        self.stale_lock_s = stale_lock_s
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s

    # ------------------------------------------------------------------------------ paths

    def path(self, affix: str) -> Path:
        return self.directory / f"{self.base}-{affix}"

    def array_path(self, name: str) -> Path:
        return self.path(f"{name}.npy")

    @property
    def description_path(self) -> Path:
        return self.path(DESCRIPTION_AFFIX)

    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.base}.lock"

    def array_paths(self) -> dict[str, Path]:
        """The committed arrays' files by name (all expected names when `names` is set)."""
        if self.names is not None:
            return {name: self.array_path(name) for name in self.names}
        prefix, paths = f"{self.base}-", {}
        for path in sorted(self.directory.glob(f"{self.base}-*.npy")):
            paths[path.name[len(prefix) : -len(".npy")]] = path
        return paths

    # ------------------------------------------------------------------------------ reading

    def load(self, description: str | None = None) -> dict[str, np.ndarray] | None:
        """The cached arrays memory-mapped read-only, or None when the cache is absent, partial,
        unreadable or (when `description` is given) describes something else."""
        try:
            committed = self.description_path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            logger.warning("cannot read %s (%s)", self.description_path, err)
            return None
        if description is not None and committed != description:
            logger.warning(
                "%s does not match the dataset it is named for; rebuilding", self.description_path
            )
            return None
        arrays = {}
        for name, path in self.array_paths().items():
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as err:
                logger.warning("cannot read cached index %s (%s); rebuilding", path, err)
                return None
        return arrays

    # ------------------------------------------------------------------------------ building

    def get_or_build(
        self, build_fn: Callable[[], Mapping[str, np.ndarray]], description: str
    ) -> dict[str, np.ndarray]:
        """Load the cache, or build it once across processes and return the arrays.

        Every process, the builder included, returns the committed files memory-mapped.
        Raises `CacheNotWritableError` when there is no cache and none can be written, and
        `CacheWaitTimeout` when another builder holds the lock for longer than the timeout.
        """
        arrays = self.load(description)
        if arrays is not None:
            return arrays
        self._make_directory()
        deadline = time.monotonic() + self.wait_timeout_s
        delay = self.poll_s
        while True:
            if self._try_lock():
                with self._heartbeat():
                    try:
                        return self._build_locked(build_fn, description)
                    finally:
                        self._unlock()
            arrays = self.load(description)
            if arrays is not None:
                return arrays
            if self._break_stale_lock():
                continue
            if time.monotonic() > deadline:
                raise CacheWaitTimeout(self._timeout_message())
            time.sleep(delay)
            # Back off, so thousands of waiting ranks do not hammer a shared file system.
            delay = min(delay * 1.5, _MAX_POLL_S)

    def _build_locked(
        self, build_fn: Callable[[], Mapping[str, np.ndarray]], description: str
    ) -> dict[str, np.ndarray]:
        """With the lock held: re-check (another process may have just finished), else build."""
        arrays = self.load(description)
        if arrays is not None:
            return arrays
        self._remove_dead_temporaries()
        built = dict(build_fn())
        if self.names is not None and set(built) != set(self.names):
            raise ValueError(f"cache {self.base}: built {sorted(built)}, expected {self.names}")
        self.write(built, description)
        mapped = self.load(description)  # serve the files, like every other process
        return mapped if mapped is not None else built

    def write(self, arrays: Mapping[str, np.ndarray], description: str) -> None:
        """Commit `arrays` and `description`: each file by rename, the description last."""
        # Un-commit first, so a reader never pairs an old description with new arrays.
        self.description_path.unlink(missing_ok=True)
        for name, array in arrays.items():
            with atomic_file(self.array_path(name)) as f:
                np.save(f, array, allow_pickle=False)
        with atomic_file(self.description_path) as f:
            f.write(description.encode("utf-8"))

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write-test-{_host()}-{os.getpid()}-{uuid.uuid4().hex}"
            probe.touch()
            probe.unlink()
        except OSError as err:
            raise CacheNotWritableError(
                err.errno or errno.EACCES,
                f"cannot write the dataset index cache in {self.directory} "
                f"({err.strerror or err}); pass a writable directory with --data-cache-path "
                "(config path_to_cache)",
            ) from err

    # ------------------------------------------------------------------------------ locking

    def _try_lock(self) -> bool:
        """Create the lock file atomically; False when another process holds it."""
        try:
            fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": _host(), "pid": os.getpid(), "time": time.time()}, f)
        return True

    def _unlock(self) -> None:
        self.lock_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _heartbeat(self) -> Iterator[None]:
        """Touch the lock file periodically so waiters can tell a long build from a dead one."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                with contextlib.suppress(OSError):
                    os.utime(self.lock_path)

        thread = threading.Thread(target=beat, name=f"cache-lock-{self.base}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _break_stale_lock(self) -> bool:
        """Remove the lock when its holder is gone; True when it was removed."""
        content = _read_text(self.lock_path)
        if content is None:
            return True  # released meanwhile: try to take it
        reason = _stale_reason(content, self.lock_path, self.stale_lock_s)
        if reason is None:
            return False
        aside = self.lock_path.with_name(f"{self.lock_path.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(self.lock_path, aside)
        except FileNotFoundError:
            return True
        if _read_text(aside) != content:
            # Another waiter broke it first and took a fresh lock that we just moved: put it back.
            with contextlib.suppress(OSError):
                os.link(aside, self.lock_path)
        else:
            logger.warning("broke the stale cache lock %s (%s)", self.lock_path, reason)
        aside.unlink(missing_ok=True)
        return True

    def _timeout_message(self) -> str:
        holder = _read_text(self.lock_path) or "unknown holder"
        return (
            f"waited {self.wait_timeout_s:.0f} s for another process to build {self.base} "
            f"(lock {self.lock_path}: {holder}); if no process is building it, delete the lock "
            "file and retry"
        )

    def _remove_dead_temporaries(self) -> None:
        """Delete temporary files left by builders that crashed mid-write."""
        for tmp in self.directory.glob(f".{self.base}-*{TEMPORARY_MARK}*"):
            host, pid = temporary_owner(tmp) or ("", -1)
            holder = json.dumps({"host": host, "pid": pid})
            if _stale_reason(holder, tmp, self.stale_lock_s) is not None:
                tmp.unlink(missing_ok=True)


def _stale_reason(holder_json: str, path: Path, stale_s: float) -> str | None:
    """Why the process named in `holder_json` (owner of `path`) is known dead, or None."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        holder = json.loads(holder_json)
        if holder.get("host") == _host() and not _pid_alive(int(holder["pid"])):
            return f"process {holder['pid']} on this host is gone"
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    if age > stale_s:
        return f"not refreshed for {age:.0f} s, holder {holder_json.strip() or 'unknown'}"
    return None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _host() -> str:
    return socket.gethostname()


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def state_without_mapped(state: dict, index_files: Mapping[str, Path] | None) -> dict:
    """A pickling state with cache-mapped arrays left out (their file paths travel instead), so
    DataLoader workers map the files again rather than receive copies."""
    return {**state, **dict.fromkeys(index_files or ())}


def remap(obj: object, index_files: Mapping[str, Path] | None) -> None:
    """Map each cached array back onto `obj` after unpickling (see `state_without_mapped`)."""
    for name, path in (index_files or {}).items():
        setattr(obj, name, np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray))
