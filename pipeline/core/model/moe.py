"""Mixture of experts (Mixtral, Qwen3-MoE, DeepSeekMoE): a top-k router over SwiGLU experts,
plus shared experts that see every token (DeepSeek).

Tokens are grouped by expert (a stable sort of the (token, k) assignments) and each expert runs
one matmul over its group, so no token is dropped unless a capacity factor asks for it: in
training a loop over the experts; where no gradient flows, one grouped product per projection
(`torch._grouped_mm`, `grouped_mm_serves` says where), which reads the groups' sizes on the
device, so that a decode step never waits on the host and a CUDA graph can hold it. The
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

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from pipeline.core.model.config import MoEConfig
from pipeline.core.model.feed_forward import FeedForward, init_linear

EXPERT_BIASES = ("b1", "b3", "b2")


def is_bias(name: str) -> bool:
    """Whether the parameter `name` is a bias: a linear's `.bias`, or an expert stack's biases
    (`experts.b1`, 2-D `[E, ffn]`, which optimizers must not take for a matrix)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "bias" or (module.endswith("experts") and leaf in EXPERT_BIASES)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs with stacked weights: w1 (gate) and w3 (up) `[E, ffn, hidden]`,
    w2 (down) `[E, hidden, ffn]`; the same layout as Hugging Face Mixtral's fused experts.

    With `config.expert_biases` (gpt-oss) each projection has a bias: b1, b3 `[E, ffn]`, b2
    `[E, hidden]`; `config.activation` "swiglu_clamped" is gpt-oss's clamped SwiGLU."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        config: MoEConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config or MoEConfig(num_experts=num_experts)
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        if self.config.expert_biases:
            self.b1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size))
            self.b3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size))
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size))
        # LoRA adapters of the stacks (`pipeline.core.model.lora.ExpertAdapters`), when added.
        self.lora: nn.Module | None = None

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The stacked tensors, each `[E, ...]`: expert parallelism splits them all on dim 0."""
        return ("w1", "w3", "w2") + (EXPERT_BIASES if self.config.expert_biases else ())

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]` sorted by expert, `tokens_per_expert[e]` rows for expert e in turn.
        The one place the expert projections are applied, whatever holds the weights."""
        return grouped_swiglu(
            x,
            tokens_per_expert,
            *self.gate_up_down(),
            lora=self.lora,
            biases=self.biases(),
            activation=expert_activation(self.config),
        )

    def gate_up_down(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked weights (w1, w3, w2) of the experts this module runs."""
        return self.w1, self.w3, self.w2

    def hidden(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s activation of rows `x`, the input of its down projection (what FP8
        calibration measures); no LoRA."""
        w1, w3, _ = self.gate_up_down()
        gate, up = x @ w1[expert].t(), x @ w3[expert].t()
        biases = self.biases()
        if biases is not None:
            gate, up = gate + biases[0][expert], up + biases[1][expert]
        return expert_activation(self.config)(gate, up)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The stacked biases (b1, b3, b2) of the experts this module runs, None without."""
        return (self.b1, self.b3, self.b2) if self.config.expert_biases else None

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)
        if self.config.expert_biases:
            for name in EXPERT_BIASES:
                nn.init.zeros_(getattr(self, name))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float):
    """gpt-oss's expert activation: the gate clamped above at `limit`, the up projection to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def expert_activation(config: MoEConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The experts' gated activation, f(gate, up), that `config.activation` names."""
    if config.activation == "swiglu_clamped":
        return functools.partial(
            clamped_swiglu, limit=config.swiglu_limit, alpha=config.swiglu_alpha
        )
    return swiglu


def grouped_swiglu(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    lora: nn.Module | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """SwiGLU of each group of rows of `x` with its expert's stacked weights (see
    `GroupedExperts`): rows are grouped by expert, `tokens_per_expert[e]` rows for expert e.
    `lora` (an `ExpertAdapters`) adds each adapted stack's low-rank update; `biases` (b1, b3,
    b2) are added to the projections; `activation(gate, up)` replaces silu(gate) * up.

    Each projection runs as one grouped product (`torch._grouped_mm`) where `grouped_mm_serves`
    says it may, else as a loop over the experts (`looped_swiglu`, the reference).
    """
    if grouped_mm_serves(x, w1, w3, w2, *adapter_stacks(lora)):
        return _grouped_swiglu(x, tokens_per_expert, w1, w3, w2, lora, biases, activation)
    return looped_swiglu(x, tokens_per_expert, w1, w3, w2, lora, biases, activation)


def adapter_stacks(lora: nn.Module | None) -> list[torch.Tensor]:
    """The stacked low-rank factors of `lora` (an `ExpertAdapters`, or None: none)."""
    return [t for pair in lora.local().values() for t in pair] if lora is not None else []


def grouped_mm_serves(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs the experts' products of rows `x` by the stacks
    `weights`: where no gradient flows (serving, generation, evaluation), on a CPU in float32
    or bf16 and on a CUDA GPU of compute capability 9.0 or newer in bf16 with every inner size
    a multiple of 8 (its 16-byte alignment); never for sharded weights (DTensor has no rule for
    it). They agree with the loop to the dtype's rounding, not always to the bit (a group of
    one row may take another kernel). Training keeps the loop: on a GPU the grouped weight
    gradient needs each expert's rows padded to a multiple of 8, which is not written, and on
    a CPU training's numbers stay what they were."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    if any(isinstance(w, DTensor) for w in weights):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)):
        return False
    dtype = _compute_dtype(x)
    if x.device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(size % 8 == 0 for w in weights for size in w.shape[1:])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' products run in: autocast's where it is on, else `x`'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grouped_swiglu(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    lora: nn.Module | None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`grouped_swiglu` with one `torch._grouped_mm` per projection: the group ends are read on
    the device, so the host never waits (a CUDA graph can hold the step)."""
    # The loop's products run in autocast's dtype where it is on, else in their inputs' (the
    # adapters' own for the low-rank update); here autocast is off and the casts are explicit.
    dtype = _compute_dtype(x)
    adapters = lora.local() if lora is not None else {}
    adapter_dtype = {name: _compute_dtype(a) for name, (a, _) in adapters.items()}
    bias = dict(zip(("w1", "w3", "w2"), biases)) if biases is not None else {}
    ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    if bias:  # each row's expert: how many groups end at or before it
        row_expert = torch.searchsorted(ends, torch.arange(len(x), device=x.device), right=True)

    def grouped(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(rows, w.to(rows.dtype).transpose(-2, -1), offs=ends)

    def project(name: str, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = grouped(rows.to(dtype), w)
        if name in bias:
            out = out + bias[name].to(dtype)[row_expert]
        if name not in adapters:
            return out
        a, b = adapters[name]
        low_rank = lora.dropout(rows.to(a.dtype)).to(adapter_dtype[name])
        delta = grouped(grouped(low_rank, a), b) * lora.scaling
        return out + delta.to(out.dtype)

    with torch.autocast(x.device.type, enabled=False):
        hidden = activation(project("w1", w1, x), project("w3", w3, x))
        return project("w2", w2, hidden)


def looped_swiglu(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    lora: nn.Module | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
) -> torch.Tensor:
    """`grouped_swiglu` as a plain loop over the experts, one product per group: simple and
    exact on every device, the reference the grouped products are tested against."""
    # One host sync to learn the group sizes; unavoidable without a grouped kernel.
    groups = torch.split(x, tokens_per_expert.tolist())
    adapters = lora.local() if lora is not None else {}
    bias = dict(zip(("w1", "w3", "w2"), biases)) if biases is not None else {}

    def project(name: str, w: torch.Tensor, e: int, g: torch.Tensor) -> torch.Tensor:
        out = g @ w[e].to(g.dtype).t()  # a base stored in another dtype (LoRA)
        if name in bias:
            out = out + bias[name][e].to(out.dtype)
        if name not in adapters:
            return out
        a, b = adapters[name]
        delta = (lora.dropout(g.to(a.dtype)) @ a[e].t()) @ b[e].t() * lora.scaling
        return out + delta.to(out.dtype)

    outputs = [
        project("w2", w2, e, activation(project("w1", w1, e, g), project("w3", w3, e, g)))
        for e, g in enumerate(groups)
    ]
    return torch.cat(outputs) if outputs else x.new_empty(0, w2.shape[1])


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `expert_ids` name each expert, `[num_experts]` long. Counted into a tensor of
    fixed size: `torch.bincount`'s size depends on the values, so a CUDA device would wait for
    them and torch.compile would break its graph there."""
    ids = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Switch/Megatron load-balancing loss without its coefficient: E * sum_e f_e * P_e.

    f_e is the fraction of (token, k) assignments routed to expert e (no gradient), P_e the
    mean router probability of expert e; the minimum, 1, is reached by a uniform router.
    """
    num_experts = probs.shape[-1]
    counts = expert_counts(topk_idx, num_experts)
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


def grouped_topk_mask(scores: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """True for the experts of each token's `topk_groups` best groups (of `num_groups` equal
    groups), a group scoring the sum of its two best experts (DeepSeek-V3's rule)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    best = group_scores.topk(topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)


class MoE(nn.Module):
    """Router (`router`, a bias-free linear) -> softmax or sigmoid scores -> top-k (grouped
    when `config.num_groups` > 1; chosen on scores + `expert_bias` when it exists) -> experts.
    Outputs are each token's k expert outputs weighed by their scores (renormalised when
    `config.norm_topk_prob`, times `routed_scaling_factor`), plus `shared_experts(x)` when
    `config.num_shared_experts` > 0 (weighed by sigmoid(`shared_expert_gate`(x)) when
    `config.shared_expert_gate`: Qwen3-Next, Qwen3.5-MoE).

    `aux_loss_scale`: attach the aux-loss gradient with this weight (None: the caller adds
    `aux_loss` to its loss itself). `micro_batch_group`: the ranks one micro-batch's tokens are
    split over (context parallelism, and tp under sequence parallelism), None when this rank
    holds whole micro-batches.

    After each forward: `aux_loss` (coefficient-weighted load-balancing + z-loss, or None when
    both coefficients are 0; the balance term per micro-batch or, with `config.aux_loss_type`
    "sequence", per sequence and averaged), `tokens_per_expert` (assignments per expert,
    before dropping) and `num_dropped` (assignments over capacity, 0 when dropless). With
    `expert_bias`, training forwards also add this rank's assignments per expert to
    `expert_load` (float32 `[E]`), which the bias update reads and resets
    (`pipeline.train.loop.expert_bias`).
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
        self.router = nn.Linear(hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = GroupedExperts(config.num_experts, hidden_size, ffn_hidden_size, config)
        if config.num_shared_experts:
            shared_width = config.shared_expert_ffn_hidden_size or (
                ffn_hidden_size * config.num_shared_experts
            )
            self.shared_experts = FeedForward(hidden_size, shared_width)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        self.expert_load: torch.Tensor | None = None
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
        probs, topk_weights, topk_idx = self.route(logits)
        sequences = shape[0] if len(shape) == 3 else 1
        self.aux_loss = self._aux_loss(logits, probs, topk_idx, sequences)
        if self.config.expert_bias and self.training:
            self._add_load(topk_idx)

        out = self._dispatch_and_combine(x, topk_idx, topk_weights.to(x.dtype))
        if self.aux_loss is not None and self.aux_loss_scale is not None and out.requires_grad:
            out = _AttachAuxLoss.apply(out, self.aux_loss, self.aux_loss_scale)
        if self.config.num_shared_experts:
            shared = self.shared_experts(x)
            if self.config.shared_expert_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(shape)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities `[n, E]` for the auxiliary loss, weights `[n, k]`, expert indices
        `[n, k]`) from router logits, in float32. Sigmoid scores are normalised over experts
        for the auxiliary loss (DeepSeek-V3's balance loss)."""
        c = self.config
        if c.score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores.detach()
        if c.expert_bias:
            choice = choice + self.expert_bias
        if c.num_groups > 1:
            mask = grouped_topk_mask(choice, c.num_groups, c.topk_groups)
            choice = choice.masked_fill(~mask, float("-inf"))
        topk_idx = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, topk_idx)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if c.routed_scaling_factor != 1.0:
            weights = weights * c.routed_scaling_factor
        return probs, weights, topk_idx

    def _add_load(self, topk_idx: torch.Tensor) -> None:
        counts = expert_counts(topk_idx, self.config.num_experts).float()
        self.expert_load = counts if self.expert_load is None else self.expert_load + counts

    def _dispatch_and_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        num_experts, top_k = self.config.num_experts, self.config.top_k
        flat_expert = topk_idx.reshape(-1)
        # Stable sort keeps tokens in sequence order within each expert, so capacity dropping
        # below keeps the earliest tokens (GShard's position policy).
        order = torch.argsort(flat_expert, stable=True)
        counts = expert_counts(flat_expert, num_experts)
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
        self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor, sequences: int
    ) -> torch.Tensor | None:
        """Coefficient-weighted load-balancing + z-loss of this forward's tokens, `sequences`
        sequences of equal length (with `micro_batch_group`: this rank's share of the loss over
        the whole group's tokens)."""
        c = self.config
        if c.aux_loss_coeff <= 0 and c.z_loss_coeff <= 0:
            return None
        if c.aux_loss_type == "sequence" or self.micro_batch_group is not None:
            rows = sequences if c.aux_loss_type == "sequence" else 1
            return self._group_aux_loss(logits, probs, topk_idx, rows)
        terms = []
        if c.aux_loss_coeff > 0:
            terms.append(c.aux_loss_coeff * load_balancing_loss(probs, topk_idx))
        if c.z_loss_coeff > 0:
            terms.append(c.z_loss_coeff * router_z_loss(logits))
        return sum(terms)

    def _group_aux_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """The single-device formulas over `rows` equal runs of tokens (1: the micro-batch;
        the sequences for the sequence-wise loss, whose balance terms are averaged), with the
        expert and token counts summed over `micro_batch_group` when set: the ranks' results
        then add up to the loss of the whole micro-batch."""
        c = self.config
        assignments = topk_idx.reshape(rows, -1)
        counts = probs.new_zeros(rows, c.num_experts)
        counts.scatter_add_(1, assignments, torch.ones_like(assignments, dtype=counts.dtype))
        tokens = counts.new_full((rows, 1), probs.shape[0] / rows)
        stats = torch.cat([counts, tokens], dim=1)
        if self.micro_batch_group is not None:
            dist.all_reduce(stats, group=self.micro_batch_group)
        counts, tokens = stats[:, :-1], stats[:, -1:]
        loss = probs.new_zeros(())
        if c.aux_loss_coeff > 0:
            f = counts / (tokens * c.top_k)
            p = probs.reshape(rows, -1, c.num_experts).sum(1) / tokens
            loss = loss + c.aux_loss_coeff * c.num_experts * (f * p).sum(1).mean()
        if c.z_loss_coeff > 0:
            lse = torch.logsumexp(logits.float(), dim=-1)
            loss = loss + c.z_loss_coeff * lse.pow(2).sum() / tokens.sum()
        return loss

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        if self.router.bias is not None:
            nn.init.zeros_(self.router.bias)
        self.experts.init_weights(std, out_std)
        if self.config.num_shared_experts:
            self.shared_experts.init_weights(std, out_std)
            if self.config.shared_expert_gate:
                init_linear(self.shared_expert_gate, std)
        if self.config.expert_bias:
            nn.init.zeros_(self.expert_bias)
        self.expert_load = None
