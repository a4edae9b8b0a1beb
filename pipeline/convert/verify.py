"""Checks that a conversion kept the model tensor for tensor.

`compare_tensors` streams both sides and requires bit-identical tensors (pipe -> pipe,
re-layout, and the pipe side of imports). The logit check against transformers, which export
shares, is `pipeline.weights.checks.compare_hf_logits`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.weights.checks import VerifyError

if TYPE_CHECKING:
    from pipeline.weights.source import TensorSource

__all__ = ["compare_tensors"]


def compare_tensors(expected: TensorSource, actual: TensorSource) -> int:
    """Require the same names, shapes, dtypes and bit-identical values; returns the count."""
    import torch

    want, have = expected.tensors(), actual.tensors()
    if want.keys() != have.keys():
        missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
        raise VerifyError(f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, info in want.items():
        if have[name] != info:
            raise VerifyError(f"{name}: {have[name]} after conversion, {info} before")
        if not torch.equal(expected.read(name), actual.read(name)):
            raise VerifyError(f"{name}: values differ after conversion")
    return len(want)
