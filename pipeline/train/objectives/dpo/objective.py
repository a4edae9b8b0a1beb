"""The DPO objective (`data.kind = "dpo"`, `pipe train --dpo`): preference pairs against a frozen
reference, under every layout.

A sample is one pair; the model sees its two sides as rows (`pair_rows`), so tensor, data,
context and pipeline parallelism take it as they take any batch. The loss is `DPOLoss`'s (the
arithmetic, exact against TRL); this file adds what a run needs around it:

- the reference (`setup`): a second model built like the policy under the same layout holding
  the starting weights, the policy itself with its adapters off in a LoRA run, or the
  log-probabilities computed once and stored next to the data (`dpo.precompute_reference`).
  A live reference's log-probabilities are computed before each step's forward passes
  (`prepare`), through the reference's own runner, so a pipelined reference walks its stages
  like the policy's evaluation does;
- under context parallelism the per-side sums are added over the context group and one rank
  of the group counts the pair;
- its metrics (rewards, margin, accuracy), kept apart for training and evaluation;
- a record in every checkpoint (`frozen_start.ReferenceRecord`) naming the reference, so that
  a resumed run rebuilds the same one, or refuses in one line when it has changed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives.base import Batch, Objective, batch_to_device, evaluation_mode
from pipeline.train.objectives.dpo import reference as ref
from pipeline.train.objectives.dpo.loss import DPOLoss, pair_rows, sum_over
from pipeline.train.objectives.frozen_start import (
    AdaptersOffRunner,
    ReferenceRecord,
    frozen_start,
    start_record,
)

__all__ = ["DPO"]

log = logging.getLogger("pipeline.train")

PAIR_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "pairs", "ref_logps")


class DPO(Objective):
    """Direct preference optimisation; see the module docstring."""

    batch_keys = PAIR_KEYS
    reports_perplexity = False  # a mean over pairs

    def __init__(self, cfg: Any, spec: Any, *, layout: Any) -> None:
        super().__init__(cfg, spec, layout=layout)
        self.loss_fn = DPOLoss(ref.dpo_options(cfg))
        self.reference: Any = None  # a runner whose hidden states are the reference's
        self.record = ReferenceRecord("dpo_reference", "DPO")
        self._share = 1.0 if layout is None or layout.cp_rank == 0 else 0.0

    def records(self) -> list[Any]:
        return [self.record]

    # ---- the reference ----------------------------------------------------------------------

    def setup(self, run: Any) -> None:
        """The reference, as the module docstring says; `run` is the trainer."""
        if self.cfg.dpo.precompute_reference:
            self._precompute(run, start_record(run, self.record))
        else:
            self.reference = frozen_start(run, self.record)

    def _precompute(self, run: Any, start: dict[str, Any]) -> None:
        members = ref.preference_members(run.datasets)
        runner = AdaptersOffRunner(run.step_runner, run.model)
        with evaluation_mode(run.model):
            sums = ref.precompute_reference(
                runner,
                members,
                start["key"],
                self.layout,
                run.device,
                run.autocast,
                self.cfg.training.micro_batch_size,
            )
        recorded = start.get("files")
        if recorded is not None and recorded != sums:
            changed = next(p for p in sums if recorded.get(p) != sums[p])
            raise ConfigError(
                f"{changed}: the reference log-probabilities this DPO run started with have "
                "changed since (checksum differs); resume with the file it was made with"
            )
        self.record.value["files"] = sums

    # ---- the loop's calls -------------------------------------------------------------------

    def device_batch(self, batch: dict[str, torch.Tensor], device: torch.device, eod_id: Any):
        return pair_rows(batch_to_device(batch, device, None, self.batch_keys))

    def count(self, batch: Batch) -> torch.Tensor:
        return batch["pairs"].sum() * self._share

    def prepare(self, micro_batches: Sequence[Batch], runner: Any) -> None:
        """A live reference's whole-sequence log-probabilities into each micro-batch."""
        if self.reference is None:
            return
        with torch.no_grad():
            for batch in micro_batches:
                logps = ref.reference_logps(self.reference, batch)
                if logps is not None:
                    batch["ref_logps"] = sum_over(logps, self.layout.context_group)

    def loss(self, model: Any, hidden: torch.Tensor, batch: Batch):
        return self.loss_fn.from_hidden(
            model.output.weight, hidden, batch, self.layout.context_group, self._share
        )

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Inside the block the running sums are the evaluation's; training's are put back."""
        held = self.loss_fn.swap_stats()
        try:
            yield
        finally:
            self.loss_fn.swap_stats(held)

    def metrics(self) -> dict[str, float]:
        """Rewards, margin and accuracy: means over the pairs since the last call, summed over
        the ranks holding other pairs and the pipeline stages (only the last has them)."""
        return self.loss_fn.take_stats((self.layout.batch_group, self.layout.pipeline_group))
