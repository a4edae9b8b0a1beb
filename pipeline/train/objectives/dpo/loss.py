"""Direct preference optimisation: the loss of chosen/rejected pairs against a frozen reference.

A preference micro-batch holds whole pairs: `tokens`, `labels`, `loss_mask` and `position_ids`
of shape `[pairs, 2, seq]` (side 0 the chosen conversation, side 1 the rejected one), taken as
rows `[pairs * 2, seq]` by the model (`pair_rows`), so a pair is never split across micro-batches
or data-parallel ranks (context parallelism splits every sequence, and sums its parts). A
side's log-probability is the sum, over the positions whose loss mask is 1 (the assistant's
reply), of the log-probability of the label (`sequence_logps`). With policy log-probabilities
`pc, pr` and the reference's `rc, rr`:

- rewards: `beta * (pc - rc)` (chosen) and `beta * (pr - rr)` (rejected); margin their
  difference, accuracy whether it is positive;
- `sigmoid` (the DPO paper): `-log sigmoid(beta * d)` with `d = (pc - rc) - (pr - rr)`; with
  `label_smoothing = e` (conservative DPO, cDPO) `-(1 - e) log sigmoid(beta d) - e log
  sigmoid(-beta d)`;
- `ipo`: `((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))^2`, the log-ratios averaged over
  the `nc`, `nr` mask tokens of each side (as TRL computes IPO).

`DPOLoss` returns the summed per-pair losses and the number of pairs (the DPO objective,
`objective.py`, hands it to the loop), so the step's division by the pairs of
the global batch gives the mean over pairs whatever the micro-batch size or layout. It keeps
running sums of the rewards, margins and accuracies for the objective to log (`take_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.core.parallel.tensor_parallel import tp_linear_cross_entropy

__all__ = [
    "DPOLoss",
    "DPOOptions",
    "PairTerms",
    "dpo_terms",
    "pair_rows",
    "row_logps",
    "sequence_logps",
    "sum_over",
]

LOSSES = ("sigmoid", "ipo")
ROW_FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")
STATS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")


@dataclass(frozen=True)
class DPOOptions:
    """The `[dpo]` loss settings: `beta`, `loss` ("sigmoid" | "ipo"), `label_smoothing`."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"dpo.loss {self.loss!r}: one of {', '.join(LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"dpo.beta {self.beta}: must be > 0")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing {self.label_smoothing}: must be in [0, 0.5)")
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("dpo.label_smoothing applies to the sigmoid loss, not ipo")


@dataclass
class PairTerms:
    """Per pair: the loss, the chosen and rejected rewards (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def stats(self, weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Sums over the pairs (each weighted by `weights`, default 1) of the logged figures."""
        w = torch.ones_like(self.chosen_rewards) if weights is None else weights
        margin = self.chosen_rewards - self.rejected_rewards
        return {
            "rewards_chosen": (w * self.chosen_rewards).sum(),
            "rewards_rejected": (w * self.rejected_rewards).sum(),
            "margin": (w * margin).sum(),
            "accuracy": (w * (margin > 0).to(w)).sum(),
        }


def dpo_terms(
    policy: torch.Tensor,
    reference: torch.Tensor,
    options: DPOOptions,
    mask_tokens: torch.Tensor | None = None,
) -> PairTerms:
    """The per-pair DPO terms from `[pairs, 2]` log-probabilities (side 0 chosen); `mask_tokens`
    `[pairs, 2]` (the mask-1 tokens of each side) is needed by `ipo` only."""
    ratios = policy - reference.to(policy)
    beta = options.beta
    if options.loss == "ipo":
        if mask_tokens is None:
            raise ValueError("the ipo loss needs each side's mask-token count")
        averaged = ratios / mask_tokens.to(ratios).clamp(min=1.0)
        losses = (averaged[:, 0] - averaged[:, 1] - 1.0 / (2.0 * beta)) ** 2
    else:
        logits = beta * (ratios[:, 0] - ratios[:, 1])
        e = options.label_smoothing
        losses = -(1.0 - e) * F.logsigmoid(logits) - e * F.logsigmoid(-logits)
    rewards = beta * ratios.detach()
    return PairTerms(losses, rewards[:, 0], rewards[:, 1])


def pair_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A preference batch with its sequence fields as rows `[pairs * 2, seq]` (pair-major:
    chosen, rejected, chosen, ...), the form the model and the layouts take; a batch already
    in that form is returned as it is."""
    if batch["tokens"].dim() == 2:
        return batch
    return {
        key: value.reshape(-1, value.shape[-1]) if key in ROW_FIELDS else value
        for key, value in batch.items()
    }


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[pairs, 2]` summed log-probabilities of the mask-1 labels of each side, and the mask-1
    counts, without gradients (the reference, the precomputed pass, evaluation)."""
    rows = pair_rows(batch)
    with torch.no_grad():
        return row_logps(_hidden(model, rows), model.output.weight, rows)


def _hidden(model: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(rows["tokens"], rows["position_ids"], None)


@torch.no_grad()
def row_logps(hidden: torch.Tensor, weight: Any, rows: dict[str, torch.Tensor]):
    """Per-side log-probabilities `[pairs, 2]` (and mask counts) of the model output `hidden`
    of `rows`: the output projection fused with the loss, one sequence at a time, so neither
    full-vocabulary logits nor a weight-gradient buffer per sequence ever exist. Under context
    parallelism these are this rank's partial sums."""
    labels, mask = rows["labels"], rows["loss_mask"]
    logps, counts = [], []
    for row in range(labels.shape[0]):
        part = slice(row, row + 1)
        nll, count = tp_linear_cross_entropy(hidden[part], weight, labels[part], mask[part])
        logps.append(-nll)
        counts.append(count)
    return torch.stack(logps).view(-1, 2), torch.stack(counts).view(-1, 2)


def sum_over(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """`tensor` summed over `group` (a context-parallel group: each rank holds part of every
    sequence), on a copy; as it is without a group."""
    if group is None:
        return tensor
    import torch.distributed as dist

    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


class DPOLoss:
    """The DPO objective's arithmetic: (summed pair losses, number of pairs) of a micro-batch.

    The reference log-probabilities come from the batch (`ref_logps`: precomputed, or put there
    by the objective before the step) or, when `reference` is given, from that frozen model
    run under no_grad on the same micro-batch."""

    def __init__(self, options: DPOOptions, reference: Any | None = None) -> None:
        self.options = options
        self.reference = reference
        self._stats: dict[str, torch.Tensor] = {}
        self._pairs = 0.0

    def reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "ref_logps" in batch:
            return batch["ref_logps"]
        if self.reference is None:
            raise ValueError("DPO needs a reference: a frozen model or precomputed ref_logps")
        with torch.no_grad():
            return sequence_logps(self.reference, batch)[0]

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]):
        """(summed pair losses, pairs) of the whole `model` on `batch`."""
        rows = pair_rows(batch)
        return self.from_hidden(model.output.weight, _hidden(model, rows), rows)

    def from_hidden(
        self,
        weight: Any,
        hidden: torch.Tensor,
        rows: dict[str, torch.Tensor],
        context_group: Any = None,
        share: float = 1.0,
    ):
        """(summed pair losses, pairs) from the output `hidden` of `rows` and the output
        layer's `weight`. Under context parallelism (`context_group`) each rank holds part of
        every sequence: the per-side sums are added over the group, and only the rank with
        `share` 1 counts the pairs' losses, so the group counts each pair once.

        The gradient is taken in a second fused pass: with `g` the loss's derivative by each
        sequence's log-probability, the gradient of the sum is that of the cross-entropy with
        each sequence's mask weighed by `-g`, so one weight-gradient buffer serves the whole
        micro-batch (and each context-parallel rank its own positions)."""
        policy, counts = row_logps(hidden, weight, rows)
        policy, counts = sum_over(policy, context_group), sum_over(counts, context_group)
        reference = self.reference_logps(rows)  # whole sequences' sums, under any layout
        weights = rows.get("pairs")  # 0 for a filler pair, which counts for nothing
        if weights is None:
            weights = torch.ones(policy.shape[0], device=policy.device)
        weights = weights.to(policy.dtype)
        with torch.enable_grad():
            leaf = policy.detach().requires_grad_(True)
            terms = dpo_terms(leaf, reference, self.options, counts)
            total = (terms.losses * weights).sum()
            slope = torch.autograd.grad(total, leaf)[0] if hidden.requires_grad else None
        counted = weights * share
        for name, value in terms.stats(counted).items():
            self._stats[name] = self._stats.get(name, 0.0) + value.detach().double()
        self._pairs = self._pairs + counted.sum().detach().double()
        if slope is None:  # evaluation: no gradient wanted
            return total.detach() * share, counted.sum()
        weighed = rows["loss_mask"] * -slope.to(rows["loss_mask"].dtype).reshape(-1, 1)
        surrogate, _ = tp_linear_cross_entropy(hidden, weight, rows["labels"], weighed)
        return total.detach() * share + (surrogate - surrogate.detach()), counted.sum()

    def swap_stats(self, stats: tuple | None = None) -> tuple:
        """The running sums now held, replaced by `stats` (a value this returned, or empty):
        evaluation keeps its figures apart from training's."""
        held = (self._stats, self._pairs)
        self._stats, self._pairs = stats if stats is not None else ({}, 0.0)
        return held

    def take_stats(self, groups: Any = ()) -> dict[str, float]:
        """The means over the pairs seen since the last call (sums over the ranks of each of
        `groups` in turn), then reset. Every rank of the groups calls it."""
        from pipeline.core.parallel.reduce import sum_over_groups

        names = list(STATS)
        values = [torch.as_tensor(self._stats.get(n, 0.0)).double().cpu() for n in names]
        totals = torch.stack([*values, torch.as_tensor(self._pairs).double().cpu()])
        totals = sum_over_groups(totals, groups)
        self._stats, self._pairs = {}, 0.0
        pairs = float(totals[-1])
        if pairs == 0:
            return {}
        return {n: float(v) / pairs for n, v in zip(names, totals[:-1])}
