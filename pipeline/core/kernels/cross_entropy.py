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

Between the two matmuls of a chunk everything is elementwise over `chunk x vocab` values, bound
by memory traffic: done op by op (upcast, log-softmax, softmax, one-hot, mask, downcast) it reads
and writes the chunk's logits about ten times, some 19 GB per 4,096 tokens of a 128k vocabulary.
On a GPU `score_full_vocab` runs compiled instead (one reduction pass and one pass writing the
low-precision gradient, about 4 GB); elsewhere, and if compiling fails, the op-by-op
`loss_and_logit_grad`, which is the faster of the two uncompiled.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger(__name__)


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
        return _chunk_loss(logits, y, m, None), torch.softmax(logits, dim=-1), None
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


def _chunk_loss(
    logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor, shard: VocabShard | None
) -> torch.Tensor:
    """The masked loss sum of one chunk alone (evaluation: on a full vocabulary without the
    softmax `_score_chunk` also makes)."""
    if shard is None:
        return (F.cross_entropy(logits, y, reduction="none") * m).sum()
    return _score_chunk(logits, y, m, shard)[0]


def loss_and_logit_grad(
    logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor, shard: VocabShard | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked loss sum, its gradient with respect to `logits`, in their dtype) of one chunk, op
    by op in fp32: d(sum_i m_i CE_i) / d logits_i = m_i (softmax_i - onehot(y_i)). Eager this
    beats `score_full_vocab` (about 1.8x on a CPU); it also serves a vocabulary shard."""
    loss, grad, mine = _score_chunk(logits.float(), y, m, shard)
    hit = torch.arange(len(y), device=y.device) if mine is None else mine.nonzero()[:, 0]
    grad[hit, y[hit]] -= 1.0
    grad *= m[:, None]
    return loss, grad.to(logits.dtype)


def score_full_vocab(
    logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`loss_and_logit_grad` over the whole vocabulary written for a compiler: the gradient is
    one elementwise expression of the logits and their log-normaliser, so compiled it is one
    reduction pass and one pass writing the gradient."""
    x = logits.float()
    log_z = torch.logsumexp(x, dim=-1)
    loss = ((log_z - x.gather(1, y[:, None]).squeeze(1)) * m).sum()
    probs = torch.exp(x - log_z[:, None])
    label = torch.arange(x.shape[-1], device=x.device) == y[:, None]
    return loss, (torch.where(label, probs - 1.0, probs) * m[:, None]).to(logits.dtype)


class CompiledScorer:
    """`score_full_vocab`, compiled on first use on `devices` (a GPU: on a CPU compiling costs
    more than the short runs there save); `loss_and_logit_grad` elsewhere and, after a
    one-line warning, once compiling has failed."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.devices = devices
        self.compiled: Any = None
        self.failed = False

    def __call__(
        self, logits: torch.Tensor, y: torch.Tensor, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.device.type not in self.devices or self.failed:
            return loss_and_logit_grad(logits, y, m)
        if self.compiled is None:
            self.compiled = torch.compile(score_full_vocab, fullgraph=True)
        try:
            return self.compiled(logits, y, m)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a compiler problem costs speed, never the run
            log.warning("the loss runs eager: compiling it failed (%s)", str(e).splitlines()[0])
            self.failed = True
            return loss_and_logit_grad(logits, y, m)


_score_full_vocab_fast = CompiledScorer()


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
            logits = h @ weight.t()
            if not need_grad:
                loss_sum += _chunk_loss(logits.float(), y, m, shard)
                continue
            if shard is None:
                chunk_loss, grad_logits = _score_full_vocab_fast(logits, y, m)
            else:
                chunk_loss, grad_logits = loss_and_logit_grad(logits, y, m, shard)
            loss_sum += chunk_loss
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
