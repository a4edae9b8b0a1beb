"""Greedy decoding, one definition for every command that generates: the token choice that `pipe
generate` and `pipe serve` make for greedy requests, and the plain loop without a cache that
training samples run on the training model (and that tests and benchmarks hold the cached engine
to, since it has no cache to get wrong)."""

from __future__ import annotations

import torch
from torch import nn


def greedy_token(logits: torch.Tensor) -> int:
    """The most likely token of one row of logits `[vocab]` (the first, on a tie)."""
    return int(logits.argmax())


@torch.no_grad()
def greedy_without_cache(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    device: torch.device | None = None,
) -> list[int]:
    """The greedy continuation of `prompt` (up to and including an EOS token) by `model`, a
    `Transformer` on `device` (default: its parameters'): every step runs the whole sequence
    through it, quadratic but cache-free."""
    device = device or next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    output: list[int] = []
    for _ in range(max_new_tokens):
        token = greedy_token(model.logits(tokens)[0, -1])
        output.append(token)
        if token in eos_ids:
            break
        tokens = torch.cat((tokens, torch.tensor([[token]], device=device)), dim=1)
    return output
