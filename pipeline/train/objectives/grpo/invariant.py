"""Rollouts decoded on the trainer's shapes: the engine's sampled tokens' log-probabilities equal
to the bit those the training pass computes (fp32, the engine running on the policy itself).

The engine's cached decoding and the training pass run the same modules, but torch's CPU
kernels give a row a result that depends on the shapes around it, at two points only (the
embedding, rotary tables, RMSNorm, the activations and `log_softmax` are row by row):

- a GEMM with fewer than `MIN_ROWS` rows takes another kernel than one with more (a decode step
  with one to three requests left; the output head of one to three ready rows): about 1e-6
  apart on a row, where 4 to 1,024 rows give every row the same bits;
- attention: a query's output depends on how many queries share its call (one decode query
  against the 64 of a training row) and on how many keys the call holds, masked or not (the
  cache's keys so far against the row's `seq_length`), about 3e-7 apart.

Inside `trainer_shapes` every `nn.Linear` of the model pads its input to at least `MIN_ROWS`
rows and keeps its own rows' results, and attention over the cache pads its queries to at least
`MIN_ROWS` (copies of the last, whose outputs are dropped) and its keys to the training rows'
length (masked out); the engine then keeps each row's keys its own and in order
(`Engine.pack_decode` off). The logits the engine samples from are then those of the training
pass, so the rollout/trainer mismatch is exactly 0 (`tests/train/test_grpo_correction.py`);
the cost is a few padded rows and the masked keys (docs/rl.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.core.model.block import AttentionKernel

__all__ = ["MIN_ROWS", "trainer_shapes"]

MIN_ROWS = 4  # the fewest rows torch's CPU GEMM and attention treat as the training pass does


@contextlib.contextmanager
def trainer_shapes(model: nn.Module, key_length: int) -> Iterator[None]:
    """Inside the block the cached decoding of `model` runs its GEMMs on at least `MIN_ROWS`
    rows and its attention on at least `MIN_ROWS` queries over `key_length` keys (module
    docstring); everything as it was after it."""
    handles, kernels = [], []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(_pad_rows))
            handles.append(module.register_forward_hook(_own_rows))
        elif isinstance(module, AttentionKernel):
            original = module.over_cache
            module.over_cache = _padded_attention(original, key_length)
            kernels.append(module)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in kernels:
            del module.over_cache  # the class's method again


def _pad_rows(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return None
    module._own_shape = x.shape  # read back by `_own_rows`
    flat = x.reshape(rows, x.shape[-1])
    return (torch.cat((flat, flat.new_zeros(MIN_ROWS - rows, x.shape[-1]))), *args[1:])


def _own_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    shape = module.__dict__.pop("_own_shape", None)
    if shape is None:
        return None
    return out[: shape[:-1].numel()].reshape(*shape[:-1], out.shape[-1])


def _padded_attention(original, key_length: int):
    def over_cache(q, k, v, mask, **extra):
        batch, heads, queries, dim = q.shape
        keys = k.shape[2]
        if keys > key_length or extra:  # longer than a training row, or ALiBi / sinks
            return original(q, k, v, mask, **extra)
        if mask is None:
            mask = torch.ones(batch, 1, queries, keys, dtype=torch.bool, device=q.device)
        mask = F.pad(mask.expand(batch, 1, queries, keys), (0, key_length - keys), value=False)
        k, v = (F.pad(t, (0, 0, 0, key_length - keys)) for t in (k, v))
        if queries < MIN_ROWS:
            extra_rows = MIN_ROWS - queries
            q = torch.cat((q, q[:, :, -1:].expand(batch, heads, extra_rows, dim)), 2)
            mask = torch.cat((mask, mask[:, :, -1:].expand(batch, 1, extra_rows, key_length)), 2)
        return original(q, k, v, mask)[:, :, :queries]

    return over_cache
