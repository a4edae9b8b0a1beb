"""Per-tensor FP8 (e4m3) quantization as TensorRT-LLM's `quant_algo: FP8` stores it.

Scales are *dequantization* scales: scale = amax / 448 (448 is e4m3's largest value), a weight is
stored as fp8(w / scale) and read back as fp8 * scale; an activation x enters the GEMM as
fp8(x / activation_scale). Tensors fused at inference (q/k/v, or fc and gate) share one scale,
the largest of their parts', so a single scalar covers the fused tensor.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_MAX",
    "dequantize",
    "fake_quantize",
    "fp8_scale",
    "quantize",
    "scales_from_amax",
]

FP8_MAX = 448.0
_TINY = 1e-12  # an all-zero tensor still gets a usable (non-zero) scale


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 dequantization scales amax / 448, elementwise (a calibrated amax `[1]`, or per
    expert `[E]`)."""
    return (amax.float() / FP8_MAX).clamp(min=_TINY)


def fp8_scale(*tensors: torch.Tensor) -> torch.Tensor:
    """The fp32 `[1]` scale covering all `tensors`: max |value| / 448."""
    amax = torch.stack([t.detach().abs().amax().float() for t in tensors]).amax()
    return scales_from_amax(amax).reshape(1)


def quantize(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`tensor` as float8_e4m3fn under the dequantization `scale` (saturating at +-448)."""
    return (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of an fp8 tensor; `scale` broadcasts (a `[1]` or per-expert `[E, 1, 1]`)."""
    return tensor.float() * scale


def fake_quantize(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded through fp8 and back (what an FP8 GEMM sees of an activation)."""
    return dequantize(quantize(tensor, scale), scale).to(tensor.dtype)
