"""What export verification shares across formats: the error it raises, the FP8 quality bar,
the tokens it checks on (held-out real text, else random), and its figures in words."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.weights.formats import ConversionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_FP8_TOP1",
    "ExportError",
    "fp8_figures",
    "logit_figures",
    "verification_tokens",
]

MIN_FP8_TOP1 = 0.95
VERIFY_TOKENS = 128  # per sequence, when real text is used


class ExportError(ConversionError):
    """An export that cannot be done or did not verify; the message says why."""


def verification_tokens(
    text: Path | None, skip_tokens: int, vocab_size: int
) -> tuple[torch.Tensor, str, bool]:
    """Real text from `text` after its first `skip_tokens` (those calibration saw) when there
    is some, else random tokens; a few words saying which; whether it is real text."""
    import torch

    from pipeline.export.calibration import calibration_sequences

    if text is not None:
        try:
            tokens = calibration_sequences(text, 8, VERIFY_TOKENS, skip_tokens=skip_tokens)
            return tokens, f"{tokens.numel()} held-out tokens of {text}", True
        except ValueError:
            warnings.warn(
                f"{text} has no text beyond the calibration sequences; verifying on random tokens",
                stacklevel=2,
            )
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (2, 32), generator=generator), "64 random tokens", False


def _top1(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.argmax(-1) == expected.argmax(-1)).float().mean())


def logit_figures(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    """The largest logit difference and the top-1 agreement, in words."""
    diff = float((actual - expected).abs().max())
    top1 = _top1(actual, expected)
    return f"max |logit difference| {diff:.3g}, top-1 agreement {top1:.1%} on {what}"


def fp8_figures(actual: torch.Tensor, expected: torch.Tensor, what: str, real_text: bool) -> str:
    """`logit_figures`, and an `ExportError` below `MIN_FP8_TOP1` on real text (on random
    tokens, a note saying the bar was not applied)."""
    figures = logit_figures(actual, expected, what)
    if real_text and _top1(actual, expected) < MIN_FP8_TOP1:
        raise ExportError(f"FP8 export below {MIN_FP8_TOP1:.0%} top-1 agreement: {figures}")
    note = "" if real_text else " (random tokens: pass --calib-data to check on real text)"
    return figures + note
