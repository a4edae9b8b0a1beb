"""A C source of pipe's own, compiled once per machine with the system's C compiler and loaded.

pipe ships as Python; the few hot loops that torch has no fast operation for (attention of one
query per row on a CPU: `pipeline.core.kernels.cpu_decode_attention`) are plain C with no
dependency, built the first time they are needed with the system's C compiler (`$CC`, else the
one Python was built with, else `cc`) for this machine's CPU (`-march=native`), and
kept in pipe's cache (`$PIPE_CACHE_DIR`, else `~/.cache/pipe`) under `native/NAME-HASH.so`. The
hash covers the source, the compiler command, the flags and the CPU's model and features, so an
edited source, another compiler or a cache shared by machines with other CPUs each get their
own library. The library is written under a temporary name and renamed, so a process that dies
while compiling, or two that compile at once, never leave a broken library under the final
name.

Without a compiler (or when it fails) `load` logs one line and returns None, and the caller
keeps its torch path; `PIPE_NATIVE_KERNELS=0` asks for that path without trying.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path

from pipeline.common.atomic import temporary_path
from pipeline.common.cache_dir import pipe_cache_dir

log = logging.getLogger(__name__)

# -march=native first; a compiler that does not know it (some ARM toolchains) builds without.
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
COMMON_FLAGS = ("-shared", "-fPIC")
COMPILE_SECONDS = 120


def native_kernels_enabled() -> bool:
    """False when `PIPE_NATIVE_KERNELS` is 0 (or "false", "no", "off")."""
    value = os.environ.get("PIPE_NATIVE_KERNELS", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def compiler() -> list[str] | None:
    """The C compiler's command (`$CC`, Python's `CC`, `cc`), or None when it is not found."""
    for command in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        words = shlex.split(command) if command else []
        if words and shutil.which(words[0]):
            return words
    return None


def cpu_identity() -> str:
    """The CPU's model and feature flags (what `-march=native` compiles for), as text."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            seen.setdefault(key.strip(), value.strip())
    return f"{platform.machine()} {sorted(seen.items())}"


@cache
def load(source: Path) -> ctypes.CDLL | None:
    """`source` compiled for this machine (module docstring), loaded; None when native kernels
    are off or no library could be built (logged once)."""
    if not native_kernels_enabled():
        return None
    if not source.is_file():  # an install that left the package's C files out
        log.warning("%s is missing from pipe's install; torch's slower path is used", source)
        return None
    command = compiler()
    if command is None:
        log.warning(
            "no C compiler found ($CC, cc): %s is not built; torch's slower path is used",
            source.name,
        )
        return None
    failures = []
    for flags in FLAG_SETS:
        library = _library_path(source, command, flags)
        if not library.exists():
            error = _compile(source, library, [*command, *flags, *COMMON_FLAGS])
            if error:
                failures.append(error)
                continue
        try:
            return ctypes.CDLL(str(library))
        except OSError as e:
            failures.append(f"loading {library} failed: {e}")
            library.unlink(missing_ok=True)  # built again by the next process
    log.warning("%s was not built (%s); torch's slower path is used", source.name, failures[-1])
    return None


def _library_path(source: Path, command: list[str], flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(command), " ".join(flags), cpu_identity()):
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return pipe_cache_dir() / "native" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _compile(source: Path, library: Path, command: list[str]) -> str | None:
    """Build `library` from `source` with `command`; the compiler's first error line, or None."""
    partial = temporary_path(library)
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [*command, "-o", str(partial), str(source)],
            capture_output=True,
            text=True,
            timeout=COMPILE_SECONDS,
        )
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if line.strip()), "")
            return f"{' '.join(command)} failed: {first or f'exit status {done.returncode}'}"
        os.replace(partial, library)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(command)} failed: {e}"
    finally:
        partial.unlink(missing_ok=True)
