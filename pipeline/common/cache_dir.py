"""Where pipe keeps what it can make again but would rather not: measured choices, built code."""

from __future__ import annotations

import os
from pathlib import Path


def pipe_cache_dir() -> Path:
    """`$PIPE_CACHE_DIR`, else `~/.cache/pipe`. Nodes of a cluster may share it: every entry
    is keyed by what it depends on (the GPU's name, the CPU's features)."""
    return Path(os.environ.get("PIPE_CACHE_DIR") or Path.home() / ".cache" / "pipe")
