"""Throughput and memory figures for the training log: TFLOP/s, MFU and memory in use.

FLOPs per token are Megatron's causal count (`pipeline.core.model.flavors.flops_per_token`).
MFU needs the device's dense bf16 peak; it is known for the GPUs listed in `PEAK_BF16_TFLOPS`
and left out (None) on a CPU or an unknown GPU rather than guessed.
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["PEAK_BF16_TFLOPS", "memory_gib", "peak_tflops"]

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, in TFLOP/s. Checked in
# order, so the more specific names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100", 989.0),  # SXM / HBM3
    ("A100", 312.0),
)


def peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of `device` in TFLOP/s, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, peak in PEAK_BF16_TFLOPS:
        if key in name:
            return peak
    return None


def memory_gib(device: torch.device) -> float:
    """CUDA: the peak allocated since the last reset (then reset); CPU: the process's peak RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
