"""What `training.attention_backend = auto` runs: a measured choice for this GPU and shape, else
a default that follows pipe's own measurement.

`scripts/bench/attention.py --record` times pipe's backends on this GPU at one shape and writes
the fastest into `attention_backends.json` in pipe's cache (`$PIPE_CACHE_DIR`, else
`~/.cache/pipe`), keyed by GPU name and shape: sequence length, query heads, kv heads, head dim,
dtype, document masking. `auto` on CUDA reads that file; without an entry for its GPU and shape
it takes the default measured on an H200 (seq 8192, 32/8 heads, head dim 128, bf16, documents
of mean length 1024, forward + backward: flex 10.7 ms, SDPA cuDNN with a dense mask 12.9 ms):
with document masking flex, without it flash_attn when installed, else sdpa; on a CPU, sdpa.

Nothing is measured when a model is built: every rank must pick the same kernel, and a timing
taken on each rank could differ. Each rank reads the file on its own machine, so on several
nodes put `$PIPE_CACHE_DIR` on shared storage (a mismatch would change kernels, not the result).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.common.atomic import write_json
from pipeline.common.cache_dir import pipe_cache_dir

__all__ = [
    "AttentionShape",
    "BackendChoice",
    "auto_backend",
    "cache_path",
    "default_backend",
    "device_name",
    "measured_choice",
    "record_choice",
]

CACHE_FILE = "attention_backends.json"


@dataclass(frozen=True)
class AttentionShape:
    """What one attention call looks like on one device (heads are this rank's)."""

    seq_length: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch's name: "bfloat16", "float32"
    document_masking: bool

    def key(self, gpu: str) -> str:
        """The cache file's key for this shape on `gpu`."""
        documents = "documents" if self.document_masking else "causal"
        return (
            f"{gpu}|seq {self.seq_length}|heads {self.heads}/{self.kv_heads}"
            f"|head_dim {self.head_dim}|{self.dtype}|{documents}"
        )

    def describe(self) -> str:
        documents = ", document masking" if self.document_masking else ""
        return (
            f"seq {self.seq_length}, {self.heads}/{self.kv_heads} heads, head dim "
            f"{self.head_dim}, {self.dtype}{documents}"
        )


@dataclass(frozen=True)
class BackendChoice:
    """A backend and why it was chosen (the reason goes into the run's log)."""

    backend: str
    reason: str

    def describe(self) -> str:
        return f"attention backend: {self.backend} ({self.reason})"


def cache_path() -> Path:
    """`$PIPE_CACHE_DIR/attention_backends.json`, else `~/.cache/pipe/attention_backends.json`."""
    return pipe_cache_dir() / CACHE_FILE


def device_name(device: torch.device) -> str:
    """The GPU's name as torch reports it ("NVIDIA H200"), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _load(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable attention choice file ({e}); delete it") from e
    if not isinstance(record, dict) or not isinstance(record.get("choices", {}), dict):
        raise ValueError(f"{path}: not an attention choice file (no 'choices' object); delete it")
    return record.get("choices", {})


def measured_choice(gpu: str, shape: AttentionShape, path: Path | None = None) -> dict | None:
    """The recorded entry for `gpu` and `shape` (backend, timings in ms), or None."""
    return _load(path or cache_path()).get(shape.key(gpu))


def record_choice(
    gpu: str, shape: AttentionShape, timings_ms: dict[str, float], path: Path | None = None
) -> dict:
    """Write the fastest of `timings_ms` (backend -> ms) as the choice for `gpu` and `shape`,
    keeping the file's other entries; returns the entry written."""
    if not timings_ms:
        raise ValueError("no backend was timed: nothing to record")
    path = path or cache_path()
    choices = _load(path)
    best = min(timings_ms, key=timings_ms.__getitem__)
    entry = {"backend": best, "ms": timings_ms, "shape": asdict(shape), "gpu": gpu}
    choices[shape.key(gpu)] = entry
    write_json(path, {"choices": dict(sorted(choices.items()))})
    return entry


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def default_backend(device: torch.device, document_masking: bool) -> BackendChoice:
    """The shipped rule (see the module docstring)."""
    if device.type != "cuda":
        return BackendChoice("sdpa", "default: not on CUDA")
    if document_masking:
        return BackendChoice("flex", "default: document masking on CUDA, flex measured fastest")
    if _flash_attn_installed():
        return BackendChoice("flash_attn", "default: causal on CUDA, flash-attn installed")
    return BackendChoice("sdpa", "default: causal on CUDA, flash-attn not installed")


def auto_backend(
    device: torch.device, document_masking: bool, shape: AttentionShape | None = None
) -> BackendChoice:
    """`auto`'s backend: this GPU's measured choice for `shape` when one is recorded (and its
    package is installed), else `default_backend`."""
    if device.type == "cuda" and shape is not None:
        gpu = device_name(device)
        entry = measured_choice(gpu, shape)
        backend = entry.get("backend") if isinstance(entry, dict) else None
        if backend is not None and (backend != "flash_attn" or _flash_attn_installed()):
            ms = entry.get("ms", {}).get(backend)
            timing = f": {ms:.2f} ms" if isinstance(ms, (int, float)) else ""
            return BackendChoice(backend, f"measured on {gpu} at {shape.describe()}{timing}")
    return default_backend(device, document_masking)
