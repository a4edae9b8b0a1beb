"""Verification of a Hugging Face export (`pipe export --trtllm | --vllm | --sglang`).

bf16/fp16/fp32: transformers loads the directory and its logits must equal our model's on the
source rounded to the export dtype (`compare_hf_logits`). FP8: the files are read back by
`ModelOptCheckpoint` (its format checks), every weight scale must cover the source weight it
quantizes (nothing saturates), and the dequantized model (inputs rounded through fp8 as an
engine does) is compared with our model on the unrounded source; on real text it must reach
`MIN_FP8_TOP1` top-1 agreement.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.convert.source import TensorSource
    from pipeline.export.modelopt_reader import ModelOptCheckpoint
    from pipeline.export.trtllm_config import ExportOptions

__all__ = ["check_no_saturation", "verify_hf_export"]


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

    from pipeline.convert.source import CastSource
    from pipeline.convert.verify import compare_hf_logits, our_model
    from pipeline.export.modelopt_reader import ModelOptCheckpoint
    from pipeline.export.run import fp8_figures, verification_tokens

    if not options.fp8:
        if importlib.util.find_spec("transformers") is None:
            return "not verified (needs transformers: pip install 'pipe-llm[hf]')"
        dtype = getattr(torch, options.dtype)
        diff = compare_hf_logits(CastSource(source, dtype), directory)
        return f"transformers loads it: max |logit difference| {diff:.3g} vs the source"
    checkpoint = ModelOptCheckpoint(directory)
    check_no_saturation(source, checkpoint)
    tokens, what, real_text = verification_tokens(text, skip_tokens, source.model_config.vocab_size)
    source_model = source_model if source_model is not None else our_model(source)
    with torch.no_grad():
        expected = source_model.logits(tokens)
        actual = checkpoint.model().logits(tokens)
    figures = fp8_figures(actual, expected, what, real_text)
    return f"format checks passed; dequantized FP8 model vs the source: {figures}"


def check_no_saturation(source: TensorSource, checkpoint: ModelOptCheckpoint) -> None:
    """ValueError naming the first quantized weight whose source values exceed 448 x its
    weight_scale (they would have been clipped)."""
    from pipeline.convert.hf_config import choose_architecture
    from pipeline.core.model.hf_names import pipe_to_hf_names
    from pipeline.export.fp8 import FP8_MAX

    config = source.model_config
    experts = config.moe.num_experts if config.moe is not None else None
    architecture = choose_architecture(config, source.metadata.get("hf_architecture"))
    quantized = set(checkpoint.quantized)
    for name in source.tensors():
        modules = [n.removesuffix(".weight") for n in pipe_to_hf_names(name, experts, architecture)]
        if not quantized.intersection(modules):
            continue
        tensor = source.read(name).float()
        for index, module in enumerate(modules):
            part = tensor if len(modules) == 1 else tensor[index]
            limit = FP8_MAX * float(checkpoint.scale(module, "weight_scale"))
            if float(part.abs().amax()) > limit * (1 + 1e-6):
                raise ValueError(f"{module}.weight saturates: |w| up to {float(part.abs().amax())}"
                                 f" > 448 x weight_scale = {limit}")  # fmt: skip
