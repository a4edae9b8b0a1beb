"""Megatron's fused weight layouts and their inverses: q/k/v fused group by group under GQA,
SwiGLU's gate and up fused as `[gate; up]` (this repository's docs/file_layouts.md, section
"Megatron torch_dist checkpoints").
Pure functions, exact inverses of each other (tests check it), shared by the reader and any future
writer."""

from __future__ import annotations

import torch

__all__ = ["fuse_fc1", "fuse_qkv", "split_fc1", "split_qkv"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Megatron's `linear_qkv` from q `[nq*d, ...]`, k and v `[ng*d, ...]` (weights or biases):
    per query group g the rows `[q heads of g; k head g; v head g]`, groups in order."""
    rest = q.shape[1:]
    groups = [t.reshape(num_kv_heads, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`: q `[nq*d, ...]`, k and v `[ng*d, ...]` (fresh tensors)."""
    rest = qkv.shape[1:]
    rows_per_group = qkv.shape[0] // num_kv_heads
    head_dim = rows_per_group // (num_heads // num_kv_heads + 2)
    grouped = qkv.reshape(num_kv_heads, rows_per_group, *rest)
    q_rows = rows_per_group - 2 * head_dim
    q, k, v = torch.split(grouped, [q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).clone() for t in (q, k, v))


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Megatron's global SwiGLU `linear_fc1`: `[gate; up]` along the output rows."""
    return torch.cat([gate, up], dim=0)


def split_fc1(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_fc1`: (gate, up) as fresh tensors."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.clone(), up.clone()
