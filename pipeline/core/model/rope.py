"""Rotary position embedding (RoPE): inverse frequencies (with Llama 3.1 or YaRN scaling), the
cos/sin of given positions, and the rotation itself in the "rotate half" convention of Hugging
Face checkpoints. DeepSeek's interleaved RoPE is the same rotation after `deinterleave`. The
"rope" a block receives is (cos, sin), plus Llama 4's query scale when a model has one."""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.core.model.config import ModelConfig, RopeScaling, YarnScaling
from pipeline.core.model.rope_scaling import yarn_cos_sin_factor, yarn_inv_freq


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None
) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]`, with Llama 3.1 or YaRN scaling if configured.

    Llama 3.1 leaves high frequencies (wavelength < original_max / high_freq_factor) alone,
    divides low frequencies (wavelength > original_max / low_freq_factor) by `factor`, and
    interpolates linearly in between.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return yarn_inv_freq(head_dim, theta, scaling)
    orig = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = orig / scaling.low_freq_factor
    high_freq_wavelen = orig / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Produces cos/sin `[batch, 1, seq, rope_dim]` for given positions (rope_dim: head_dim, or
    latent attention's decoupled RoPE part); YaRN scales both by its mscale ratio.

    Only the inverse frequencies are kept (a non-persistent buffer, rebuilt by `init_weights`),
    so no table sized by the maximum context is stored and any position id works.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.rope_dim // 2), persistent=False)
        scaling = config.rope_scaling
        self.magnitude = yarn_cos_sin_factor(scaling) if isinstance(scaling, YarnScaling) else 1.0

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        c = self.config
        device = buffer_device or self.inv_freq.device
        self.inv_freq = rope_inv_freq(c.rope_dim, c.rope_theta, c.rope_scaling).to(device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        angles = position_ids[..., None].float() * self.inv_freq  # [batch, seq, rope_dim // 2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        if self.magnitude != 1.0:
            cos, sin = cos * self.magnitude, sin * self.magnitude
        beta = self.config.query_scale_beta
        if not beta:
            return cos, sin
        # A third tensor: the query scale `[batch, 1, seq, 1]` (see `query_scale`).
        original = self.config.rope_scaling.original_max_position_embeddings
        scale = 1 + beta * torch.log1p(torch.floor(position_ids.float() / original))
        return cos, sin, scale[:, None, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, heads, seq, head_dim]` in the "rotate half" convention.

    Dimension i is paired with i + rope_dim/2 (not with its neighbour as in Meta's original
    code), matching Hugging Face checkpoints so their q/k weights load without permutation.
    When cos/sin are narrower than the head (partial rotary, `rope_dim` < head_dim), only the
    first rope_dim dimensions turn, paired the same way within them; the rest pass through.
    """
    rope_dim = cos.shape[-1]
    if rope_dim < x.shape[-1]:
        turned, kept = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
        return torch.cat((apply_rope(turned, cos, sin), kept), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def query_scale(q: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`q` `[batch, heads, seq, dim]` times the position-dependent scale `RotaryEmbedding`
    appends to cos/sin when `query_scale_beta` is set (Llama 4, Mistral 4); else `q`."""
    return q if len(rope) == 2 else q * rope[2].to(q.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last dimension from neighbouring pairs (x0, x1), (x2, x3) ... to halves
    (x0, x2, ...), (x1, x3, ...), so "rotate half" RoPE rotates the pairs DeepSeek rotates.
    q and k get the same order, so their dot products are those of the interleaved layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
