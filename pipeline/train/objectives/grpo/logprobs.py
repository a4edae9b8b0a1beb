"""The trainer's token log-probabilities for GRPO, computed as the rollout engine computes its
own where the output layer is whole on this rank: a chunk of logits at a time, each through
`log_softmax`, the same kernel the engine samples behind (`pipeline.serve.engine.sampling`).
Given the same hidden states the two log-probabilities are then equal (`log_softmax` gives a row
the same result whatever the rows around it). On its own shapes the engine's
hidden states are not the training pass's to the bit (attention of one query over the cache
against a causal pass over the row, and GEMMs of fewer than four rows, run other kernels), so
where it runs on the fp32 policy itself on a CPU it decodes on the training pass's shapes
(`invariant`) and the mismatch is 0; elsewhere it is fp32 rounding or more (docs/rl.md). A
vocabulary-parallel output layer (tensor parallelism) takes `tp_token_logprobs`, which combines
the shards' partial sums."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from pipeline.core.kernels.cross_entropy import DEFAULT_CHUNK_TOKENS
from pipeline.core.parallel.tensor_parallel import tp_token_logprobs

__all__ = ["token_logprobs"]


@torch.no_grad()
def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability of its label under `hidden @ weight.T` and the entropy
    there, two fp32 tensors `[tokens]` without gradients (as `tp_token_logprobs`)."""
    if isinstance(weight, DTensor):
        return tp_token_logprobs(hidden, weight, labels, chunk_tokens)
    hidden = hidden.full_tensor() if isinstance(hidden, DTensor) else hidden
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        table = (hidden[start : start + chunk_tokens] @ weight.t()).float().log_softmax(-1)
        logps.append(table.gather(1, labels[start : start + chunk_tokens, None])[:, 0])
        entropies.append(-(table.exp() * table).sum(-1))
    return torch.cat(logps), torch.cat(entropies)
