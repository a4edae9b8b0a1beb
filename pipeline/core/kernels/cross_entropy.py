"""Output projection fused with cross-entropy, in chunks of tokens.

With a 128k vocabulary the fp32 logits of one 8k-token micro-batch take 4 GiB, more than the rest
of a small model's activations. `chunked_linear_cross_entropy` never holds more than
`chunk_tokens x vocab` logits: the forward pass projects and scores one chunk at a time and, while
the chunk's logits are still at hand, also computes that chunk's gradients with respect to the
hidden states and the weight (softmax minus one-hot, times the mask). Backward then only scales the
stored gradients by the incoming gradient. This costs one `[tokens, hidden]` and one
`[vocab, hidden]` buffer instead of a second projection per chunk, the trade Liger-Kernel's fused
linear cross-entropy makes too. When no input needs a gradient, or grad mode is off (evaluation),
the gradient work is skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and, when needed, its input gradients in one chunked pass (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        chunk_tokens: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # Autograd turns grad mode off inside forward, so the caller's mode arrives as an argument.
        need_hidden_grad = grad_enabled and ctx.needs_input_grad[0]
        need_weight_grad = grad_enabled and ctx.needs_input_grad[1]
        need_grad = need_hidden_grad or need_weight_grad
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight_grad else None

        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h, y, m = hidden[rows], labels[rows], loss_mask[rows]
            logits = (h @ weight.t()).float()
            loss_sum += (F.cross_entropy(logits, y, reduction="none") * m).sum()
            if not need_grad:
                continue
            # d(sum_i m_i * CE_i) / d logits_i = m_i * (softmax_i - onehot(y_i))
            grad_logits = torch.softmax(logits, dim=-1)
            grad_logits[torch.arange(len(y), device=y.device), y] -= 1.0
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
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of masked token losses of `hidden @ weight.T` against `labels`, and the token count.

    hidden `[..., hidden]`, weight `[vocab, hidden]`, labels and loss_mask `[...]` (the leading
    shapes match). Masked positions may hold any label (e.g. -100). Returns `(loss_sum,
    num_tokens)` as fp32 scalars; only `loss_sum` carries gradients. Dividing by the token count
    is left to the caller, which knows the global count across micro-batches and ranks.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    loss_mask = loss_mask.reshape(-1).float()
    labels = torch.where(loss_mask > 0, labels, torch.zeros_like(labels))
    loss_sum = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, loss_mask, chunk_tokens, torch.is_grad_enabled()
    )
    return loss_sum, loss_mask.sum()
