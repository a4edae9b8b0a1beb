"""Proof of a legacy export: the reference forward (`reference.py`) on the written directory
against our own model on the source, on the same tokens.

- bf16/fp16/fp32 exports are compared with our model on the source weights rounded to the
  export dtype (`CastSource`; the router kept in fp32, as exported), computed in fp32: any
  difference beyond rounding of the arithmetic is a layout mistake, so the bar is
  `LOGIT_TOLERANCE`.
- FP8 exports are compared with our model on the unrounded source: the figures are the largest
  logit difference and how often the top-1 next token agrees; on real text (`--calib-data`,
  held-out sequences) at least `MIN_FP8_TOP1` agreement is required.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.export.verify_figures import (
    ExportError,
    fp8_figures,
    logit_figures,
    verification_tokens,
)

if TYPE_CHECKING:
    import torch

    from pipeline.export.options import ExportOptions
    from pipeline.weights.source import TensorSource

__all__ = ["verify_export"]


def verify_export(
    source: TensorSource,
    directory: Path,
    options: ExportOptions,
    *,
    text: Path | None = None,
    skip_tokens: int = 0,
    source_model: torch.nn.Module | None = None,
) -> str:
    """Check `directory` against `source` (see the module docstring) on real text from the
    dataset prefix `text` after its first `skip_tokens`, or on random tokens; returns what was
    checked, raises `ExportError` on a mismatch. `source_model`: our fp32 model of `source`
    when the caller already built one (FP8 calibration did), so it is not read again."""
    import torch

    from pipeline.export.legacy_trtllm.reference import ReferenceModel
    from pipeline.export.legacy_trtllm.writer import ROUTER_SUFFIX
    from pipeline.weights.checks import LOGIT_TOLERANCE
    from pipeline.weights.model import model_from_source
    from pipeline.weights.source import CastSource

    tokens, what, real_text = verification_tokens(text, skip_tokens, source.model_config.vocab_size)
    if not options.fp8:  # as stored: rounded to the export dtype, the router kept in fp32
        dtype = getattr(torch, options.dtype)
        source_model = model_from_source(CastSource(source, dtype, keep=(ROUTER_SUFFIX,)))
    elif source_model is None:
        source_model = model_from_source(source)
    with torch.no_grad():
        expected = source_model.logits(tokens)
    actual = ReferenceModel(directory).logits(tokens)
    if not options.fp8:
        figures = logit_figures(actual, expected, what)
        diff = float((actual - expected).abs().max())
        if diff > LOGIT_TOLERANCE * max(1.0, float(expected.abs().max())):
            raise ExportError(f"the export does not reproduce the source: {figures}")
        return f"reference forward matches the source: {figures}"
    figures = fp8_figures(actual, expected, what, real_text)
    return f"FP8 reference forward vs the unquantized source: {figures}"
