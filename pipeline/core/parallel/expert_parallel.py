"""Expert parallelism: each rank of an ep group holds E/ep experts and tokens travel to them.

`apply_expert_parallel` swaps every `MoE` of a model for an `ExpertParallelMoE` built from it
(the same router, the experts re-wrapped as `ShardedGroupedExperts`). The
router stays replicated (each rank routes its own tokens); the stacked expert weights `w1`, `w3`,
`w2` become DTensors sharded on the expert dimension (`Shard(0)`) over the ep mesh, so their
names and global shapes in a state dict are those of the single-device model and DCP saves and
re-shards them like any other parameter. Rank r holds the contiguous experts
`[r * E/ep, (r + 1) * E/ep)`.

One forward, per rank (the ep ranks are data-parallel for the tokens):

1. route the local tokens and sort the (token, k) assignments by expert, dropping over-capacity
   ones exactly as the single-device `MoE` does on these tokens (capacity is per rank);
2. all-gather the per-expert counts (before and after dropping) of every rank: one small
   collective gives both the all-to-all split sizes and the global router statistics;
3. all-to-all the token copies to the ranks owning their experts (variable split sizes);
4. regroup the received rows by local expert, run the local experts, undo the regrouping;
5. all-to-all the results back and combine them with the routing weights.

torch has no autograd-aware all-to-all outside the deprecated `torch.distributed.nn` (and the
functional collectives' version is not differentiable on every backend), so `_AllToAll` is a
ten-line autograd Function whose backward is the reverse all-to-all.

Gradients: the router is replicated, so its gradient is this rank's tokens' share and needs the
usual data-parallel reduction over the ep ranks. An expert shard's gradient already holds the
contributions of every ep rank's tokens (the backward all-to-all brought them home): it must not
be summed over the ep group again, only scaled the same way (e.g. divided by the data-parallel
size when data-parallel gradients are averaged) and reduced over the ranks that hold replicas of
the same experts (the "edp" mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from pipeline.core.model.moe import EXPERT_BIASES, GroupedExperts, MoE, expert_counts
from pipeline.core.torch_compat import eager_before_2_13

EXPERT_WEIGHTS = ("w1", "w3", "w2")
# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable split sizes whose backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        output_splits, input_splits = ctx.splits
        # What came from rank r goes back to rank r: swap the split sizes.
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Send `x[rows of split r]` to rank r, receive `output_splits[r]` rows from rank r;
    differentiable."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (differentiably), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelMoE(MoE):
    """`moe` with its experts spread over an ep group: this rank keeps experts
    `[ep_rank * E/ep, (ep_rank + 1) * E/ep)` of `moe`'s (full or meta) expert weights as the
    local shards of `Shard(0)` DTensors over `mesh`, and shares `moe`'s router, shared experts,
    expert bias and options, so parameter names are those of `moe`.

    Statistics after each forward, for logging:
      `tokens_per_expert`  [E] assignments per expert summed over the ep group, before dropping
      `num_dropped`        assignments dropped over capacity, summed over the ep group
      `local_tokens_per_expert`, `local_num_dropped`  the same for this rank's tokens only (what
      the single-device `MoE` reports for them)
    """

    def __init__(self, moe: MoE, mesh: DeviceMesh) -> None:
        num_experts, ffn, hidden = moe.experts.w1.shape
        with torch.device("meta"):  # the router and experts below replace these
            super().__init__(
                hidden,
                ffn,
                moe.config,
                aux_loss_scale=moe.aux_loss_scale,
                micro_batch_group=moe.micro_batch_group,
            )
        self.ep_group = mesh.get_group()
        self.ep_rank, self.ep_size = mesh.get_local_rank(), mesh.size()
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not divide over ep {self.ep_size}")
        self.local_tokens_per_expert: torch.Tensor | None = None
        self.local_num_dropped: torch.Tensor | None = None
        self.router = moe.router
        if moe.config.num_shared_experts:  # replicated: every rank runs them on its own tokens
            self.shared_experts = moe.shared_experts
            if moe.config.shared_expert_gate:
                self.shared_expert_gate = moe.shared_expert_gate
        if moe.config.expert_bias:
            self.expert_bias = moe.expert_bias
        self.experts = ShardedGroupedExperts(moe.experts, mesh, *self.expert_range)

    @property
    def num_local_experts(self) -> int:
        return self.config.num_experts // self.ep_size

    @property
    def expert_range(self) -> tuple[int, int]:
        """The global indices [start, stop) of the experts this rank holds."""
        start = self.ep_rank * self.num_local_experts
        return start, start + self.num_local_experts

    @eager_before_2_13
    def _dispatch_and_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Same contract as `MoE._dispatch_and_combine`, with the experts on other ranks."""
        order, counts, kept = self._sort_assignments(topk_idx, x.shape[0])
        all_counts = self._exchange_counts(counts, kept)  # [ep, 2, E]
        send_splits, recv_splits, recv_counts = self._splits(all_counts[:, 1])

        token_idx = order // self.config.top_k
        received = all_to_all(x[token_idx], recv_splits, send_splits, self.ep_group)
        expert_out = self._run_local_experts(received, recv_counts)
        returned = all_to_all(expert_out, send_splits, recv_splits, self.ep_group)

        returned = returned * topk_weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_idx, returned)

    def _sort_assignments(
        self, topk_idx: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(order, counts, kept): the kept (token, k) assignments sorted by expert (stable, so
        dropping keeps the earliest tokens, as `MoE` does), per-expert counts before and after
        dropping. Experts are contiguous per rank, so the order is also by destination rank."""
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        counts = expert_counts(flat_expert, self.config.num_experts)
        capacity = self.capacity(num_tokens)
        if capacity is None:
            return order, counts, counts
        group_start = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(len(order), device=order.device)
        rank_in_expert = rank_in_expert - group_start[flat_expert[order]]
        return order[rank_in_expert < capacity], counts, counts.clamp(max=capacity)

    def _exchange_counts(self, counts: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's per-expert counts ([ep, 2, E]: before / after dropping) and
        record the router statistics. The kept counts size the token all-to-alls."""
        mine = torch.stack([counts, kept])
        gathered = mine.new_empty(self.ep_size * 2, mine.shape[1])
        _all_gather_single(gathered, mine, group=self.ep_group)
        gathered = gathered.view(self.ep_size, *mine.shape)
        self.local_tokens_per_expert = counts.detach()
        self.local_num_dropped = (counts - kept).sum()
        self.tokens_per_expert = gathered[:, 0].sum(0)
        self.num_dropped = (gathered[:, 0] - gathered[:, 1]).sum()
        return gathered

    def _splits(self, kept: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """From the kept counts of every rank ([ep, E]): rows this rank sends to each rank, rows
        it receives from each, and the received counts per (source rank, local expert)."""
        per_rank = kept.reshape(self.ep_size, self.ep_size, self.num_local_experts)
        send_splits = per_rank[self.ep_rank].sum(-1).tolist()
        start, stop = self.expert_range
        recv_counts = kept[:, start:stop]  # [source rank, local expert]
        return send_splits, recv_counts.sum(-1).tolist(), recv_counts

    def _run_local_experts(self, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run the local experts on rows grouped by (source rank, local expert); return the
        outputs in the same row order. Rows are regrouped by expert with a stable sort, so the
        experts see one contiguous group each (what `GroupedExperts.forward` expects)."""
        num_local = self.num_local_experts
        local_expert = torch.repeat_interleave(
            torch.arange(num_local, device=received.device).repeat(self.ep_size),
            recv_counts.reshape(-1),
            output_size=received.shape[0],
        )
        by_expert = torch.argsort(local_expert, stable=True)
        # Called as a module, so FSDP (experts sharded over edp) gathers the weights first.
        out = self.experts(received[by_expert], recv_counts.sum(0))
        return torch.empty_like(out).index_copy_(0, by_expert, out)


class ShardedGroupedExperts(GroupedExperts):
    """The weights of `experts` as DTensors sharded on the expert dimension over `mesh`, this
    rank's shard being experts [start, stop) of the current (full) tensors (meta works too);
    runs this rank's experts."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh, start: int, stop: int) -> None:
        num_experts, ffn, hidden = experts.w1.shape
        with torch.device("meta"):  # the parameters below replace these
            super().__init__(num_experts, hidden, ffn, experts.config)
        for name in self.parameter_names:  # the weights, and gpt-oss's biases with them
            full = getattr(experts, name)
            local = full.detach()[start:stop].clone()
            dtensor = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(self, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))
        if experts.lora is not None:  # LoRA adapters: one per expert, split like the experts
            self.lora = experts.lora
            for name, full in list(self.lora.named_parameters(recurse=False)):
                local = full.detach()[start:stop].clone()
                dtensor = DTensor.from_local(
                    local,
                    mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=full.shape,
                    stride=full.stride(),
                )
                setattr(self.lora, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))

    def gate_up_down(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's shards: `GroupedExperts.forward` runs its experts on them."""
        w1, w3, w2 = (_local(getattr(self, n)) for n in EXPERT_WEIGHTS)
        return w1, w3, w2

    def biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This rank's shards of the expert biases, None without."""
        if not self.config.expert_biases:
            return None
        b1, b3, b2 = (_local(getattr(self, n)) for n in EXPERT_BIASES)
        return b1, b3, b2


def apply_expert_parallel(
    model: nn.Module,
    ep_group: ProcessGroup | DeviceMesh,
    ep_rank: int | None = None,
    ep_size: int | None = None,
) -> nn.Module:
    """Swap every `MoE` in `model` (or `model` itself, when it is one) for an
    `ExpertParallelMoE` over `ep_group`; returns the model (or the new MoE).

    `ep_group` is a 1-D DeviceMesh (e.g. `ParallelDims.get_mesh("ep")`, preferred: the expert
    DTensors then live on a sub-mesh of the expert mesh) or a ProcessGroup (a 1-D mesh is built
    over it). `ep_rank` / `ep_size` default to this rank's place in the group and are checked
    against it. Call it on a model holding the full expert weights (or on the meta device,
    before materialising).
    """
    mesh = _ep_mesh(ep_group)
    rank, size = mesh.get_local_rank(), mesh.size()
    if (ep_rank is not None and ep_rank != rank) or (ep_size is not None and ep_size != size):
        raise ValueError(
            f"ep_rank/ep_size {ep_rank}/{ep_size} do not match the group's {rank}/{size}"
        )
    if isinstance(model, MoE):
        return model if isinstance(model, ExpertParallelMoE) else ExpertParallelMoE(model, mesh)
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE) and not isinstance(module, ExpertParallelMoE):
            parent_name, _, child = name.rpartition(".")
            try:
                swapped = ExpertParallelMoE(module, mesh)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            setattr(model.get_submodule(parent_name), child, swapped)
    return model


def _ep_mesh(ep_group: ProcessGroup | DeviceMesh) -> DeviceMesh:
    """`ep_group` as a 1-D DeviceMesh."""
    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(f"ep mesh must be 1-D, got {ep_group.ndim}-D")
        return ep_group
    device_type = "cuda" if dist.get_backend(ep_group) == "nccl" else "cpu"
    return DeviceMesh.from_group(ep_group, device_type)
