"""Greedy generation without a cache: every step runs the whole sequence through the model.

Quadratic and slow, but it has no cache to get wrong: the tests and the benchmark hold the
engine to it (and both to transformers' `generate`)."""

from __future__ import annotations

import torch

from pipeline.core.model.transformer import Transformer


@torch.no_grad()
def greedy_without_cache(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """The greedy continuation of `prompt` (up to and including an EOS token)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    output: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model.logits(tokens)[0, -1].argmax())
        output.append(token)
        if token in eos_ids:
            break
        tokens = torch.cat((tokens, torch.tensor([[token]], device=device)), dim=1)
    return output
