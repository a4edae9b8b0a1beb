"""Which format a weights path holds, and the `TensorSource` that reads it.

`pipe convert`, `pipe export`, `pipe generate` and `pipe serve` open their input here: a pipe
checkpoint, a Hugging Face directory or a Megatron `torch_dist` save, each read lazily, one
tensor at a time (`pipeline.weights.model.model_from_source` builds our model from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.weights.source import TensorSource

__all__ = ["ConversionError", "detect_format", "open_source"]


class ConversionError(RuntimeError):
    """A conversion that cannot be done or did not verify; the message says why."""


def open_source(
    path: Path,
    fmt: str,
    *,
    iteration: int | None = None,
    allow_pickle: bool = False,
    flavor: str | None = None,
    verify_checksums: bool = True,
) -> TensorSource:
    """A `TensorSource` over `path` read as `fmt` (pipe, hf or megatron); a pipe checkpoint's
    files are checked against their recorded SHA-256 as read unless not `verify_checksums`."""
    if fmt == "pipe":
        from pipeline.weights.lora_files import MergedLoRASource, lora_record
        from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

        source = PipeCheckpointSource(path, iteration, verify_checksums=verify_checksums)
        record = lora_record(source.directory)
        if record is None:
            return source
        # A LoRA adapter checkpoint: its base with the adapters merged in.
        if record["base"]["path"] is None:
            raise ConversionError(
                f"{source.directory} holds LoRA adapters trained on a random initialisation "
                "(no base checkpoint recorded): there is no base to merge them into"
            )
        base_path = Path(record["base"]["path"])  # a pipe checkpoint or a Hugging Face model
        base = open_source(base_path, detect_format(base_path), verify_checksums=verify_checksums)
        return MergedLoRASource(base, source, record)
    if fmt == "hf":
        from pipeline.weights.hf_reader import HFSource

        return HFSource(path, allow_pickle=allow_pickle)
    if fmt == "megatron":
        from pipeline.weights.megatron import MegatronSource

        config = None
        if flavor is not None:
            from pipeline.core.model.flavors import get_flavor

            config = get_flavor(flavor)
        return MegatronSource(path, model_config=config)
    raise ConversionError(f"unknown source format {fmt!r}")


def detect_format(path: Path) -> str:
    """`hf` for a directory with a `config.json`, `megatron` for a Megatron save directory or
    iteration (its tracker, or `common.pt` beside `metadata.json`), `pipe` otherwise."""
    from pipeline.checkpoint.layout import MEGATRON_TRACKER

    if (path / "config.json").is_file():
        return "hf"
    if (path / MEGATRON_TRACKER).is_file() or (path / "common.pt").is_file():
        return "megatron"
    return "pipe"
