"""Mixture of experts (Mixtral, Qwen3-MoE): a top-k softmax router over SwiGLU experts.

Tokens are grouped by expert (a stable sort of the (token, k) assignments) and each expert runs
one matmul over its group, so no token is dropped unless a capacity factor asks for it. The
router's auxiliary losses are kept on the module after each forward (`MoE.aux_loss`), and
per-expert token counts for logging.

The trainer does not add the auxiliary loss to the language-model loss. It builds the model
with `aux_loss_scale` (the weight of one micro-batch's loss) and each MoE attaches the gradient of
`scale * aux_loss` to its own output (`_AttachAuxLoss`, Megatron's "aux loss auto-scaler"), so
the router gets its load-balancing gradient wherever the layer runs: on any pipeline stage,
under any schedule, with activation checkpointing. With context parallelism a micro-batch's
tokens are split over ranks; `micro_batch_group` then makes the router statistics those of the whole
micro-batch (each rank adds its tokens' share of the single-device loss).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.core.model.config import MoEConfig


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights: w1 (gate) and w3 (up) `[E, ffn, hidden]`,
    w2 (down) `[E, hidden, ffn]`; the same layout as Hugging Face Mixtral's fused experts."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]` sorted by expert, `tokens_per_expert[e]` rows for expert e in turn."""
        return grouped_swiglu(x, tokens_per_expert, self.w1, self.w3, self.w2)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)


def grouped_swiglu(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of each group of rows of `x` with its expert's stacked weights (see
    `GroupedExperts`): rows are grouped by expert, `tokens_per_expert[e]` rows for expert e.

    A plain loop over experts: simple and exact on every device. `torch._grouped_mm` would do it
    in one kernel on recent GPUs; it belongs in a kernel backend tested against this.
    """
    # One host sync to learn the group sizes; unavoidable without a grouped kernel.
    groups = torch.split(x, tokens_per_expert.tolist())
    outputs = [(F.silu(g @ w1[e].t()) * (g @ w3[e].t())) @ w2[e].t() for e, g in enumerate(groups)]
    return torch.cat(outputs) if outputs else x.new_empty(0, w2.shape[1])


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Switch/Megatron load-balancing loss without its coefficient: E * sum_e f_e * P_e.

    f_e is the fraction of (token, k) assignments routed to expert e (no gradient), P_e the
    mean router probability of expert e; the minimum, 1, is reached by a uniform router.
    """
    num_experts = probs.shape[-1]
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)
    f = counts.float() / topk_idx.numel()
    p = probs.mean(dim=0)
    return num_experts * (f * p).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss without its coefficient: mean over tokens of logsumexp(logits)^2,
    which keeps router logits small and the softmax numerically tame."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, also gives `aux_loss` the gradient `scale`, as if
    `scale * aux_loss` had been added to the final loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux_loss.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device)
        return grad, aux_grad, None


class MoE(nn.Module):
    """Router (`router`, a bias-free linear) -> softmax -> top-k (renormalised when
    `config.norm_topk_prob`, as Mixtral does) -> experts; outputs are the weighted sum of each
    token's k expert outputs.

    `aux_loss_scale`: attach the aux-loss gradient with this weight (None: the caller adds
    `aux_loss` to its loss itself). `micro_batch_group`: the ranks one micro-batch's tokens are
    split over (context parallelism), None when this rank holds whole micro-batches.

    After each forward: `aux_loss` (coefficient-weighted load-balancing + z-loss, or None when
    both coefficients are 0), `tokens_per_expert` (assignments per expert, before dropping) and
    `num_dropped` (assignments over capacity, 0 when dropless).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        config: MoEConfig,
        *,
        aux_loss_scale: float | None = None,
        micro_batch_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(hidden_size, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, hidden_size, ffn_hidden_size)
        self.aux_loss_scale = aux_loss_scale
        self.micro_batch_group = micro_batch_group
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.num_dropped: torch.Tensor | None = None

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments each expert accepts per forward: ceil(factor * tokens * k / experts)."""
        c = self.config
        if c.capacity_factor is None:
            return None
        return math.ceil(c.capacity_factor * num_tokens * c.top_k / c.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs = torch.softmax(logits.float(), dim=-1)
        topk_probs, topk_idx = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        self.aux_loss = self._aux_loss(logits, probs, topk_idx)

        out = self._dispatch_and_combine(x, topk_idx, topk_probs.to(x.dtype))
        if self.aux_loss is not None and self.aux_loss_scale is not None and out.requires_grad:
            out = _AttachAuxLoss.apply(out, self.aux_loss, self.aux_loss_scale)
        return out.reshape(shape)

    def _dispatch_and_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        num_experts, top_k = self.config.num_experts, self.config.top_k
        flat_expert = topk_idx.reshape(-1)
        # Stable sort keeps tokens in sequence order within each expert, so capacity dropping
        # below keeps the earliest tokens (GShard's position policy).
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=num_experts)
        self.tokens_per_expert = counts.detach()

        capacity = self.capacity(x.shape[0])
        if capacity is not None:
            sorted_expert = flat_expert[order]
            group_start = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(len(order), device=x.device) - group_start[sorted_expert]
            order = order[rank_in_expert < capacity]
            kept = counts.clamp(max=capacity)
            self.num_dropped = (counts - kept).sum()
            counts = kept
        else:
            self.num_dropped = torch.zeros((), dtype=torch.long, device=x.device)

        token_idx = order // top_k
        expert_out = self.experts(x[token_idx], counts)
        expert_out = expert_out * topk_weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_idx, expert_out)

    def _aux_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor
    ) -> torch.Tensor | None:
        """Coefficient-weighted load-balancing + z-loss of this forward's tokens (with
        `micro_batch_group`: this rank's share of the loss over the whole group's tokens)."""
        c = self.config
        if c.aux_loss_coeff <= 0 and c.z_loss_coeff <= 0:
            return None
        if self.micro_batch_group is None:
            terms = []
            if c.aux_loss_coeff > 0:
                terms.append(c.aux_loss_coeff * load_balancing_loss(probs, topk_idx))
            if c.z_loss_coeff > 0:
                terms.append(c.z_loss_coeff * router_z_loss(logits))
            return sum(terms)
        return self._group_aux_loss(logits, probs, topk_idx)

    def _group_aux_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor
    ) -> torch.Tensor:
        """The single-device formulas with the expert counts and token count summed over
        `micro_batch_group`: the ranks' results add up to the loss of the whole micro-batch."""
        c = self.config
        counts = torch.bincount(topk_idx.reshape(-1), minlength=c.num_experts).float()
        stats = torch.cat([counts, counts.new_full((1,), float(probs.shape[0]))])
        dist.all_reduce(stats, group=self.micro_batch_group)
        counts, tokens = stats[:-1], stats[-1]
        loss = probs.new_zeros(())
        if c.aux_loss_coeff > 0:
            f = counts / (tokens * c.top_k)
            loss = loss + c.aux_loss_coeff * c.num_experts * (f * probs.sum(0) / tokens).sum()
        if c.z_loss_coeff > 0:
            lse = torch.logsumexp(logits.float(), dim=-1)
            loss = loss + c.z_loss_coeff * lse.pow(2).sum() / tokens
        return loss

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.experts.init_weights(std, out_std)
