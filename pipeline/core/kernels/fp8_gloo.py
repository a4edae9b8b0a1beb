"""torchao's float8 all-gather on CPU process groups, whose backend (gloo) has no float8 types.

Under tensor parallelism torchao's float8 styles cast activations to fp8 before the
sequence-parallel all-gather, which then moves float8 tensors; gloo refuses them
(`RuntimeError: Invalid scalar type`). An fp8 value is one byte, so the same all-gather of the
bytes viewed as uint8, viewed back afterwards, moves exactly the same data. This module swaps
torchao's all-gather rule for float8 tensors for one that does so for CPU tensors and hands
every other tensor to torchao's own rule. On CPU the gather is waited for at once (gloo runs
it on the spot anyway); on a GPU nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["gather_cpu_float8_as_bytes"]


def gather_cpu_float8_as_bytes() -> None:
    """Install the uint8 all-gather for CPU float8 tensors in torchao's float8 op table, once
    (later calls do nothing)."""
    from torchao.float8 import float8_ops

    op = torch.ops._c10d_functional.all_gather_into_tensor.default
    rule = float8_ops.FLOAT8_OPS_TABLE[op]
    if not getattr(rule, "gathers_cpu_bytes", False):
        float8_ops.FLOAT8_OPS_TABLE[op] = _bytes_on_cpu(rule)


def _bytes_on_cpu(torchao_rule: Callable[..., Any]) -> Callable[..., Any]:
    """torchao's all-gather rule `torchao_rule`, except that a CPU float8 tensor's data is
    gathered as uint8 bytes."""

    def all_gather(aten_op: Any, args: tuple, kwargs: dict | None = None) -> torch.Tensor:
        fp8 = args[0]
        if fp8._data.device.type != "cpu":
            return torchao_rule(aten_op, args, kwargs)
        data = fp8._data.contiguous()
        gathered = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
        gathered = torch.ops._c10d_functional.wait_tensor(gathered).view(data.dtype)
        return type(fp8)(
            gathered, fp8._scale, fp8._orig_dtype, fp8._linear_mm_config, fp8._gemm_input_role
        )

    all_gather.gathers_cpu_bytes = True  # type: ignore[attr-defined]
    return all_gather
