"""Verification of a Hugging Face export (`pipe export --trtllm | --vllm | --sglang`).

bf16/fp16/fp32: transformers loads the directory and its logits must equal our model's on the
source rounded to the export dtype (`compare_hf_logits`). FP8: the files are read back by
`ModelOptCheckpoint` (its format checks), every weight scale must cover the source weight it
quantizes (nothing saturates), and the dequantized model (inputs rounded through fp8 as an
engine does) is compared with our model on the unrounded source; on real text it must reach
`MIN_FP8_TOP1` top-1 agreement. DeepSeek's block FP8 is read back by `BlockFP8Checkpoint`, every
block scale must cover its block of the source weight, and transformers loads the export on a
CPU (dequantizing it) as the model compared with ours: when transformers is not installed, or
cannot read the shapes (its CPU dequantization handles no partial block after a whole one), our
model on the reader's dequantized weights is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.export.block_fp8_reader import BlockFP8Checkpoint
    from pipeline.export.modelopt_reader import ModelOptCheckpoint
    from pipeline.export.options import ExportOptions
    from pipeline.weights.source import TensorSource

__all__ = [
    "block_fp8_oracle",
    "check_no_saturation",
    "transformers_misread",
    "verify_hf_export",
]


def verify_hf_export(
    source: TensorSource,
    directory: Path,
    options: ExportOptions,
    *,
    text: Path | None = None,
    skip_tokens: int = 0,
    source_model: torch.nn.Module | None = None,
) -> str:
    """Check `directory` against `source` (see the module docstring); returns what was
    checked, raises `ExportError` on a mismatch."""
    import importlib.util

    import torch

    from pipeline.export.block_fp8 import uses_block_fp8
    from pipeline.export.block_fp8_reader import BlockFP8Checkpoint
    from pipeline.export.modelopt_reader import ModelOptCheckpoint
    from pipeline.export.verify_figures import fp8_figures, verification_tokens
    from pipeline.weights.checks import compare_hf_logits
    from pipeline.weights.model import model_from_source
    from pipeline.weights.source import CastSource

    if not options.fp8:
        if importlib.util.find_spec("transformers") is None:
            return "not verified (needs transformers: pip install 'pipe-llm[hf]')"
        dtype = getattr(torch, options.dtype)
        diff = compare_hf_logits(CastSource(source, dtype), directory)
        return f"transformers loads it: max |logit difference| {diff:.3g} vs the source"
    block = uses_block_fp8(source)
    checkpoint = BlockFP8Checkpoint(directory) if block else ModelOptCheckpoint(directory)
    check_no_saturation(source, checkpoint)
    tokens, what, real_text = verification_tokens(text, skip_tokens, source.model_config.vocab_size)
    source_model = source_model if source_model is not None else model_from_source(source)
    if block:
        logits, model = block_fp8_oracle(checkpoint)
    else:
        logits, model = checkpoint.model().logits, "dequantized FP8 model"
    with torch.no_grad():
        expected = source_model.logits(tokens)
        actual = logits(tokens)
    figures = fp8_figures(actual, expected, what, real_text)
    return f"format checks passed; {model} vs the source: {figures}"


def transformers_misread(checkpoint: BlockFP8Checkpoint) -> str | None:
    """The first weight transformers' CPU dequantization would misread, or None when it reads
    them all right: it takes the block size to be a dimension / its number of scales, which
    holds only for dimensions within one block or made of whole blocks."""
    for module in checkpoint.quantized:
        shape = checkpoint.tensors[f"{module}.weight"].shape
        if any(n > b and n % b for n, b in zip(shape, checkpoint.block, strict=True)):
            return f"{module}.weight {tuple(shape)}"
    return None


def block_fp8_oracle(checkpoint: BlockFP8Checkpoint) -> tuple[Callable, str]:
    """(logits of token ids, what computes them) for a block-FP8 export: transformers'
    dequantized model when it can read the export, else ours on the reader's weights."""
    import importlib.util

    import torch

    from pipeline.common.quiet import import_transformers

    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    misread = transformers_misread(checkpoint)
    if missing or misread:
        why = (
            f"{' and '.join(missing)} not installed: pip install 'pipe-llm[hf]'"
            if missing
            else f"transformers cannot dequantize {misread} (a partial block after whole ones)"
        )
        return checkpoint.model().logits, f"pipe's dequantized model ({why})"
    transformers = import_transformers()
    dequantize = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint.directory, dtype=torch.float32, quantization_config=dequantize
    )
    model = model.float().eval()  # the unquantized modules load in the export dtype
    return (lambda tokens: model(tokens).logits), "transformers' dequantized model"


def check_no_saturation(
    source: TensorSource, checkpoint: ModelOptCheckpoint | BlockFP8Checkpoint
) -> None:
    """ValueError naming the first quantized weight whose source values exceed 448 x its scale
    (per tensor, or per block in DeepSeek's format): they would have been clipped."""
    from pipeline.core.model.hf_names import linear_attention_layers, pipe_to_hf_names
    from pipeline.weights.hf_config import choose_architecture

    config = source.model_config
    experts = config.moe.num_experts if config.moe is not None else None
    architecture = choose_architecture(config, source.metadata.get("hf_architecture"))
    linear = linear_attention_layers(config)
    quantized = set(checkpoint.quantized)
    for name in source.tensors():
        hf_names = pipe_to_hf_names(name, experts, architecture, linear)
        modules = [n.removesuffix(".weight") for n in hf_names]
        if not quantized.intersection(modules):
            continue
        tensor = source.read(name).float()
        for index, module in enumerate(modules):
            part = tensor if len(modules) == 1 else tensor[index]
            amax, limit = _amax_and_limit(checkpoint, module, part)
            if bool((amax > limit * (1 + 1e-6)).any()):
                raise ValueError(
                    f"{module}.weight saturates: |w| up to {float(amax.max())}"
                    " > 448 x its weight scale"
                )


def _amax_and_limit(checkpoint, module: str, part: torch.Tensor) -> tuple:
    """(the source weight's |max|, the largest value its scale can hold): per tensor, or per
    block for DeepSeek's format."""
    from pipeline.export.block_fp8 import block_amax
    from pipeline.export.block_fp8_reader import BlockFP8Checkpoint
    from pipeline.export.fp8 import FP8_MAX

    if isinstance(checkpoint, BlockFP8Checkpoint):
        return block_amax(part, checkpoint.block), FP8_MAX * checkpoint.scale(module)
    return part.abs().amax(), FP8_MAX * checkpoint.scale(module, "weight_scale")
