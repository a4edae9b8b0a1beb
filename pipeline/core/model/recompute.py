"""Activation recomputation (activation checkpointing) of one transformer block.

`full` keeps only the block's inputs and recomputes everything in backward; `selective` also
keeps the outputs of matmuls and attention (expensive to recompute) and recomputes what is
elementwise (norms, activations, RoPE), which is cheap. Both use torch's non-reentrant
`torch.utils.checkpoint`, so parameter names and hooks (FSDP2) are untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["RECOMPUTE_MODES", "recompute"]

RECOMPUTE_MODES = ("none", "full", "selective")

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, recomputed in backward as `mode` ("none", "full", "selective") says."""
    if mode == "none":
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
