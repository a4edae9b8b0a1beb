"""ALiBi: attention with linear biases instead of rotary positions (Press et al., "Train Short,
Test Long", BLOOM, MPT).

Head h adds `slope_h * (key position - query position)` to its attention scores (after the
1/sqrt(head_dim) scaling), so a key further back costs linearly more; nothing is added to q or
k. The slopes are a geometric sequence: for n heads, a power of two, head h (0-based) has
2^(-bias_max * (h + 1) / n), bias_max being 8 in the paper. For other head counts the paper
takes the slopes of the power of two m just below n, then the odd-numbered slopes of 2m heads
for the remaining n - m heads: 2^(-bias_max * (2i + 1) / (2m)), i = 0, 1, ... BLOOM computes
exactly these; MPT writes the same numbers another way (and lets `alibi_bias_max` be other
than 8).

Only differences of positions enter, so any shift of both is the same bias; the attention
kernels take the slopes (`pipeline.core.kernels.attention`) and build the bias from the
positions they know: indices within the sequence in training, global positions under context
parallelism, cached positions in decoding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["AlibiSlopes", "alibi_bias", "alibi_slopes"]


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> list[float]:
    """The ALiBi slope of each of `num_heads` heads (see the module docstring)."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}")
    below = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * (h + 1) / below) for h in range(below)]
    slopes += [2.0 ** (-bias_max * (2 * i + 1) / (2 * below)) for i in range(num_heads - below)]
    return slopes


def alibi_bias(
    slopes: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """The additive score bias `[batch, heads, queries, keys]` (fp32) for `slopes` `[heads]`,
    query positions `[batch or 1, queries]` and key positions `[batch or 1, keys]`."""
    distance = key_positions[:, None, None, :] - query_positions[:, None, :, None]
    return slopes.float()[None, :, None, None] * distance.float()


class AlibiSlopes(nn.Module):
    """The slopes of an attention layer's heads, as a tensor on the layer's device.

    No parameters and no buffer (nothing to checkpoint, nothing for `to_empty` to lose): the
    slopes are computed from the config and kept per device. Under tensor parallelism each rank
    holds a contiguous share of the heads, and the parallel plan sets `heads` to that share, so
    the slopes follow their heads (`pipeline.core.parallel.tensor_parallel`)."""

    def __init__(self, num_heads: int, bias_max: float) -> None:
        super().__init__()
        self.all_slopes = alibi_slopes(num_heads, bias_max)
        self.heads = range(num_heads)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def set_heads(self, heads: range) -> None:
        """Keep the slopes of `heads` only (this rank's share under tensor parallelism)."""
        self.heads = heads
        self._on_device.clear()

    def forward(self, device: torch.device) -> torch.Tensor:
        """The slopes `[heads]` (fp32) of this layer's heads on `device` (made once per device,
        so a captured CUDA graph replays without copying from the host)."""
        slopes = self._on_device.get(device)
        if slopes is None:
            values = [self.all_slopes[h] for h in self.heads]
            slopes = self._on_device[device] = torch.tensor(values, device=device)
        return slopes

    def extra_repr(self) -> str:
        return f"heads={self.heads.start}..{self.heads.stop - 1} of {len(self.all_slopes)}"
