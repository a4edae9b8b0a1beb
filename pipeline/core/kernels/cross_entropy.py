"""Output projection fused with cross-entropy, in chunks of tokens.

With a 128k vocabulary the fp32 logits of one 8k-token micro-batch take 4 GiB, more than the rest
of a small model's activations. `chunked_linear_cross_entropy` never holds more than
`chunk_tokens x vocab` logits: the forward pass projects and scores one chunk at a time and, while
the chunk's logits are still at hand, also computes that chunk's gradients with respect to the
hidden states and the weight (softmax minus one-hot, times the mask). Backward then only scales the
stored gradients by the incoming gradient. This costs one `[tokens, hidden]` and one
`[vocab, hidden]` buffer instead of a second projection per chunk, the trade Liger-Kernel's fused
linear cross-entropy makes too. When no input needs a gradient, or grad mode is off (evaluation),
the gradient work is skipped. With a `VocabShard` the same pass runs on one rank's rows of a
vocabulary-parallel weight (tensor parallelism).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


class VocabShard(NamedTuple):
    """Where this rank's rows of a vocabulary-parallel output weight start, and its group."""

    start: int
    group: Any  # torch.distributed.ProcessGroup


def _score_chunk(
    logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor, shard: VocabShard | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(masked loss sum, softmax of the chunk's logits, the columns holding each row's label).

    On a vocabulary shard the softmax's max and denominator and the target logit (held by one
    rank) are combined with two all-reduces, so no rank holds more than its slice of logits.
    The third value is None for a full vocabulary, else a boolean of rows whose label is ours.
    """
    if shard is None:
        loss = (F.cross_entropy(logits, y, reduction="none") * m).sum()
        return loss, torch.softmax(logits, dim=-1), None
    local_vocab = logits.shape[-1]
    row_max = logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)
    exp = torch.exp(logits - row_max[:, None])
    mine = (y >= 0) & (y < local_vocab)
    target = logits.gather(1, y.clamp(0, local_vocab - 1)[:, None]).squeeze(1) * mine
    sums = torch.stack((exp.sum(dim=-1), target))
    dist.all_reduce(sums, group=shard.group)
    sum_exp, target = sums
    loss = ((sum_exp.log() + row_max - target) * m).sum()
    return loss, exp / sum_exp[:, None], mine


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and, when needed, its input gradients in one chunked pass (see the module docstring).

    With a `VocabShard` the weight is this rank's vocabulary rows: the weight gradient is this
    rank's shard and the hidden gradient this rank's partial sum (the caller reduces it).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        chunk_tokens: int,
        grad_enabled: bool,
        shard: VocabShard | None,
    ) -> torch.Tensor:
        # Autograd turns grad mode off inside forward, so the caller's mode arrives as an argument.
        need_hidden_grad = grad_enabled and ctx.needs_input_grad[0]
        need_weight_grad = grad_enabled and ctx.needs_input_grad[1]
        need_grad = need_hidden_grad or need_weight_grad
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None
        if shard is not None:
            labels = labels - shard.start  # label columns in this rank's slice

        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h, y, m = hidden[rows], labels[rows], loss_mask[rows]
            chunk_loss, grad_logits, mine = _score_chunk((h @ weight.t()).float(), y, m, shard)
            loss_sum += chunk_loss
            if not need_grad:
                continue
            # d(sum_i m_i * CE_i) / d logits_i = m_i * (softmax_i - onehot(y_i))
            hit = torch.arange(len(y), device=y.device) if mine is None else mine.nonzero()[:, 0]
            grad_logits[hit, y[hit]] -= 1.0
            grad_logits *= m[:, None]
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden_grad:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight_grad:
                grad_weight += (grad_logits.t() @ h).float()

        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


# Tokens scored per chunk: big enough for efficient matmuls, small enough that one chunk's fp32
# logits (chunk x vocab) stay a few hundred MB even for 128K vocabularies.
DEFAULT_CHUNK_TOKENS = 4096


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of masked token losses of `hidden @ weight.T` against `labels`, and the token count.

    hidden `[..., hidden]`, weight `[vocab, hidden]` (with `vocab_shard`: this rank's rows of a
    vocabulary-parallel weight), labels and loss_mask `[...]` (the leading shapes match). Masked
    positions may hold any label (e.g. -100). The mask may weigh positions by any real number
    (DPO weighs each sequence by its loss's derivative, of either sign). Returns `(loss_sum,
    num_tokens)` as fp32 scalars; only `loss_sum` carries gradients. Dividing by the token count
    is left to the caller, which knows the global count across micro-batches and ranks.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    loss_mask = loss_mask.reshape(-1).float()
    labels = torch.where(loss_mask != 0, labels, torch.zeros_like(labels))
    loss_sum = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, loss_mask, chunk_tokens, torch.is_grad_enabled(), vocab_shard
    )
    return loss_sum, loss_mask.sum()


@torch.no_grad()
def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability of its label under `hidden @ weight.T`, and the entropy of
    the distribution there: two fp32 tensors `[tokens]`, without gradients.

    What reinforcement learning needs per token (ratios, KL, entropy), computed as the loss
    above is, a chunk of logits at a time and, with `vocab_shard`, from this rank's slice of
    the vocabulary (max, normaliser, target logit and the logit-weighted sum combined over the
    group). The gradient of a function of these values is taken through
    `chunked_linear_cross_entropy` with the mask weighing each token by it (GRPO's surrogate)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    offset = 0 if vocab_shard is None else vocab_shard.start
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = (hidden[start : start + chunk_tokens] @ weight.t()).float()
        y = labels[start : start + chunk_tokens] - offset
        row_max = logits.max(dim=-1).values
        if vocab_shard is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=vocab_shard.group)
        exp = torch.exp(logits - row_max[:, None])
        mine = (y >= 0) & (y < logits.shape[-1])
        target = logits.gather(1, y.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1) * mine
        sums = torch.stack((exp.sum(dim=-1), target, (exp * logits).sum(dim=-1)))
        if vocab_shard is not None:
            dist.all_reduce(sums, group=vocab_shard.group)
        sum_exp, target, weighted = sums
        log_z = sum_exp.log() + row_max
        logps.append(target - log_z)
        entropies.append(log_z - weighted / sum_exp)  # -sum p log p = log Z - E_p[logit]
    return torch.cat(logps), torch.cat(entropies)
