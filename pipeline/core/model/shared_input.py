"""Linears that read one input: attention's query, key and value projections, a gated MLP's gate
and up projections.

Training applies them one by one: each may be split for tensor parallelism, cast for FP8 or
wrapped by an adapter. A serving engine may stack their weights and multiply the input by all of
them at once (`pipeline.serve.engine.cpu_linear`): one call instead of three, the input read once.
The linears then carry the same `stacked` object, which says whether it serves exactly these
linears as they stand (no adapter or hook added since) and, if so, returns their outputs,
equal to theirs one by one.
"""

from __future__ import annotations

import torch
from torch import nn


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """`tuple(linear(x) for linear in linears)`, as one product where the linears' `stacked`
    serves them (module docstring)."""
    stacked = linears[0].__dict__.get("stacked")  # a plain attribute where set, else none
    if stacked is not None and stacked.serves(linears):
        return stacked(x)
    return tuple(linear(x) for linear in linears)
