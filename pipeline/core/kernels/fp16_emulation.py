"""fp16 GEMMs emulated on a CPU: fp16 training's numerics at about fp32's speed.

A CPU without AVX512-FP16 or AMX-FP16 runs torch's fp16 matrix products through a reference
kernel some 60x slower than fp32 (a tiny model's step goes from a second to a minute). Under
fp16 autocast on a CPU, `EmulatedFp16Gemms` (a torch function mode) runs each matrix product
autocast would run in fp16 as a GPU's fp16 GEMM computes it: its inputs rounded to fp16, the
products summed in fp32, the output rounded to fp16 (an fp16 tensor, as autocast returns).
Backward goes through the same casts, so every gradient that crosses a product is rounded to
fp16 too and overflows to Inf as it would on a GPU. Everything else (attention, norms, the
elementwise work) is autocast's own fp16 or fp32. Only the summation order differs from a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["EmulatedFp16Gemms", "fp16_autocast_on"]

_GEMMS = {
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
    torch.addmm,
    torch.baddbmm,
}


def fp16_autocast_on(device_type: str) -> bool:
    """Whether fp16 autocast is active on `device_type` here."""
    return torch.is_autocast_enabled(device_type) and (
        torch.get_autocast_dtype(device_type) == torch.float16
    )


def _through_fp16(value: Any) -> Any:
    """A floating tensor as fp32 holding fp16-rounded values; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float16).float()
    return value


class EmulatedFp16Gemms(TorchFunctionMode):
    """While active and fp16 autocast is on for the CPU, matrix products run as described in
    the module docstring; every other call is untouched."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _GEMMS or not fp16_autocast_on("cpu"):
            return func(*args, **kwargs)
        args = tuple(_through_fp16(a) for a in args)
        kwargs = {k: _through_fp16(v) for k, v in kwargs.items()}
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs).to(torch.float16)
