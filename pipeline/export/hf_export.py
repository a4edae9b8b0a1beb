"""The export current engines load: a Hugging Face checkpoint, FP8 in ModelOpt's format.

TensorRT-LLM's PyTorch backend (`trtllm-serve DIR`), vLLM (`vllm serve DIR`) and SGLang
(`python -m sglang.launch_server --model-path DIR`) all read a Hugging Face model directory, so
`pipe export --trtllm | --vllm | --sglang` write the same thing: the `pipe convert --to hf`
checkpoint in the export dtype, or with `--fp8` the ModelOpt FP8 checkpoint (`modelopt.py`;
DeepSeek-V3 models in DeepSeek's block FP8 format instead, `block_fp8.py`), plus the tokenizer
files when the source has them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.export.block_fp8 import (
    QUANT_CONFIG,
    DeepSeekBlockFP8,
    check_block_options,
    uses_block_fp8,
)
from pipeline.export.modelopt import ModelOptFP8, modelopt_configs
from pipeline.export.options import ExportOptions
from pipeline.weights.hf_writer import TOKENIZER_FILES, plan_hf_shards, write_hf
from pipeline.weights.source import TensorSource

__all__ = ["QUANT_CONFIG_FILE", "source_tokenizer_dir", "write_hf_export"]

QUANT_CONFIG_FILE = "hf_quant_config.json"


def source_tokenizer_dir(source_path: Path, source: TensorSource) -> Path | None:
    """Where the source's tokenizer files are: beside Hugging Face weights, or the tokenizer a
    pipe checkpoint recorded (when still unchanged); None when there are none."""
    from pipeline.weights.hf_writer import recorded_tokenizer_dir

    if any((source_path / name).is_file() for name in TOKENIZER_FILES):
        return source_path
    return recorded_tokenizer_dir(source.metadata.get("tokenizer"))


def write_hf_export(
    source: TensorSource,
    output_dir: str | os.PathLike,
    options: ExportOptions,
    *,
    amax: dict[str, float] | None = None,
    tokenizer_dir: Path | None = None,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `source` to `output_dir` in `options.dtype`, FP8 when `options.fp8` (then `amax`,
    the calibrated activation maxima, is required; `options.exclude_modules` are fnmatch
    patterns of Hugging Face module names kept unquantized). A DeepSeek-V3 source is written in
    its block format, which needs no `amax`."""
    from pipeline import __version__

    dtype = getattr(torch, options.dtype)
    common = dict(tokenizer_dir=tokenizer_dir, progress=progress, overwrite=overwrite)
    if not options.fp8:
        return write_hf(source, output_dir, dtype=dtype, **common)
    if uses_block_fp8(source):
        check_block_options(options)
        config = {"quantization_config": dict(QUANT_CONFIG)}
        return write_hf(
            source,
            output_dir,
            dtype=dtype,
            rewrite=DeepSeekBlockFP8(),
            config_extra=config,
            **common,
        )
    if amax is None:
        raise ValueError("an FP8 export needs calibrated activation ranges (amax)")
    patterns = tuple(p for p in options.exclude_modules if p != "lm_head")
    quantizer = ModelOptFP8(
        source,
        amax,
        kv_cache=options.fp8_kv_cache,
        exclude=patterns,
        quantize_lm_head="lm_head" not in options.exclude_modules,
    )
    groups = [group for shard in plan_hf_shards(source, dtype=dtype) for group in shard.groups]
    nested, flat = modelopt_configs(quantizer.ignored(groups), options.fp8_kv_cache, __version__)
    return write_hf(
        source,
        output_dir,
        dtype=dtype,
        rewrite=quantizer,
        config_extra={"quantization_config": flat},
        extra_json={QUANT_CONFIG_FILE: nested},
        **common,
    )
