"""One conversion from start to finish: open the source, write the output, verify it.

`pipe convert` (commands.py) parses the command line and calls `run_conversion`; tests and
scripts may call it directly. See commands.py for what each format means.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.common.progress import byte_progress, increments
from pipeline.common.quiet import quiet_dcp
from pipeline.weights.formats import ConversionError, open_source

if TYPE_CHECKING:
    from pipeline.weights.source import TensorSource

__all__ = ["ConversionError", "run_conversion"]

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def run_conversion(
    source_path: Path,
    output: Path,
    from_format: str,
    to_format: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: str | None = None,
    shard_bytes: int = 5 * 10**9,
    iteration: int | None = None,
    verify: str = "auto",
    verify_layers: int | None = None,
    tokenizer_dir: Path | None = None,
    flavor: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    verify_checksums: bool = True,
) -> str:
    """Convert and verify; returns a one-paragraph summary. Raises `ConversionError`."""
    from pipeline.checkpoint.layout import CheckpointError
    from pipeline.weights.checks import VerifyError

    try:
        source, written_dtype = _open_cast(
            source_path,
            from_format,
            to_format,
            dtype,
            iteration=iteration,
            allow_pickle=allow_pickle,
            flavor=flavor,
            verify_checksums=verify_checksums,
        )
        total = sum(info.nbytes for info in source.tensors().values())
        start = time.perf_counter()
        with byte_progress(total, quiet, "convert") as advance, quiet_dcp():
            written = _write(
                source,
                output,
                to_format,
                (tp, pp, ep),
                shard_bytes,
                tokenizer_dir,
                advance,
                overwrite,
            )
        seconds = time.perf_counter() - start
        with quiet_dcp():
            verdict = _verify(
                source, source_path, from_format, written, to_format, verify, verify_layers
            )
    except (CheckpointError, VerifyError, ValueError, OSError) as e:
        raise ConversionError(str(e)) from e
    rate = total / max(seconds, 1e-9) / 1e9
    in_dtype = f" in {written_dtype.describe()}" if written_dtype is not None else ""
    return (
        f"wrote {written} ({len(source.tensors())} tensors, {total / 1e9:.2f} GB in "
        f"{seconds:.1f} s, {rate:.2f} GB/s){in_dtype}; {verdict}"
    )


def _open_cast(
    source_path: Path, from_format: str, to_format: str, dtype: str | None, **open_options: Any
) -> tuple[TensorSource, Any]:
    """The source's tensors, cast where the output has a dtype of its own (always for Hugging
    Face, else only when `dtype` is asked), and that dtype choice (None when not cast)."""
    from pipeline.weights.dtype_choice import choose_dtype
    from pipeline.weights.source import CastSource

    source = open_source(source_path, from_format, **open_options)
    if to_format != "hf" and dtype is None:
        return source, None
    written_dtype = choose_dtype(_TORCH_DTYPES.get(dtype), source)
    return CastSource(source, written_dtype.dtype), written_dtype


def _write(
    source: TensorSource,
    output: Path,
    to_format: str,
    layout: tuple[int, int, int],
    shard_bytes: int,
    tokenizer_dir: Path | None,
    advance: Any,
    overwrite: bool,
) -> Path:
    """Write `source` as `to_format` under `output`; returns what was written."""
    if to_format == "pipe":
        from pipeline.weights.pipe_checkpoint import TargetLayout, write_pipe_checkpoint

        return write_pipe_checkpoint(source, output, layout=TargetLayout(*layout), progress=advance)
    from pipeline.weights.hf_writer import recorded_tokenizer_dir, write_hf

    tokenizer_dir = tokenizer_dir or recorded_tokenizer_dir(source.metadata.get("tokenizer"))
    return write_hf(
        source,
        output,
        max_shard_bytes=shard_bytes,
        tokenizer_dir=tokenizer_dir,
        progress=increments(advance),
        overwrite=overwrite,
    )


def _verify(
    source: TensorSource,
    source_path: Path,
    from_format: str,
    written: Path,
    to_format: str,
    mode: str,
    layers: int | None,
) -> str:
    """Check the output against the source as `mode` asks; returns what was checked."""
    from pipeline.convert.verify import compare_tensors
    from pipeline.weights.checks import compare_hf_logits, fits_in_memory

    if mode == "off":
        return "not verified (--verify off)"
    notes = []
    if to_format == "pipe":
        from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

        output_source = PipeCheckpointSource(written)
        count = compare_tensors(source, output_source)
        notes.append(f"all {count} tensors read back bit-identical")
        if from_format != "hf":
            return "verified: " + "; ".join(notes)
        hf_dir, ours = source_path, output_source
    else:
        hf_dir, ours = written, source
    wrapper = source.metadata.get("text_model_of") if to_format == "pipe" else None
    if wrapper:
        if mode == "on":
            raise ConversionError(
                f"--verify on: transformers builds {wrapper} as a multimodal model, pipe reads "
                "its text model; use --verify auto"
            )
        notes.append(f"logits not compared (transformers builds {wrapper} as a multimodal model)")
    elif not _transformers_available():
        if mode == "on":
            raise ConversionError("--verify on needs transformers: pip install 'pipe-llm[hf]'")
        notes.append("logits not compared (transformers is not installed)")
    elif layers is None and not fits_in_memory(ours):
        if mode == "on":
            raise ConversionError("the model does not fit in memory twice; use --verify layers=N")
        notes.append("logits not compared (too large for memory; try --verify layers=N)")
    else:
        diff = compare_hf_logits(ours, hf_dir, layers=layers)
        sliced = f" (first {layers} layers)" if layers else ""
        notes.append(f"logits match transformers{sliced}: max abs difference {diff:.2e}")
    return "verified: " + "; ".join(notes)


def _transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
