"""Small sums over process groups of figures that are read on the host (logged statistics,
precomputed tables): one place for the rule that NCCL reduces on the GPU and gloo on the CPU."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["sum_over_groups"]


def sum_over_groups(tensor: torch.Tensor, groups: Iterable[Any]) -> torch.Tensor:
    """`tensor` summed over each process group of `groups` in turn (None entries: nothing to
    sum), reduced on this rank's GPU where a group is NCCL's; returned on the CPU."""
    for group in groups:
        if group is None:
            continue
        on_gpu = dist.get_backend(group) == "nccl"
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
        dist.all_reduce(tensor, group=group)
    return tensor.cpu()
