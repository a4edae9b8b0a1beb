"""`Objective`: what the training loop asks of a training objective.

The same object serves the plain path (`LocalStepRunner`: the whole model on this rank) and the
pipeline schedule (`PipelineRunner`: the last stage's hidden states reach `loss` through the
schedule's loss function), so an objective runs under every layout without knowing which:

- `device_batch` turns a loader batch into model rows on the device (the keys it needs);
- `count` is what the loss is a sum over (loss tokens, pairs): the step divides the summed
  loss by the count of the whole global batch, so any micro-batching equals one device;
- `prepare` runs before a step's or an evaluation's forward passes, on every rank of the
  layout together (a live reference's log-probabilities, say);
- `loss(model, hidden, batch)` is the summed loss of a micro-batch from the hidden states of
  the module holding the output layer (the model, or the last pipeline stage);
- `metrics` are its own figures beyond the loss, kept per split (`evaluating`);
- `setup` and `records` give it its reference and a record in every checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "Batch",
    "Objective",
    "batch_to_device",
    "document_ids_from_tokens",
    "evaluation_mode",
    "model_hidden",
]

Batch = dict[str, torch.Tensor]
"""One micro-batch on the device: tokens, labels, loss_mask, position_ids (and document_ids)."""

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def document_ids_from_tokens(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Document index of each position: the count of EOD tokens strictly before it, so an EOD
    belongs to the document it ends (Megatron's `reset_attention_mask` rule)."""
    is_eod = (tokens == eod_id).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def batch_to_device(
    batch: dict[str, torch.Tensor],
    device: torch.device,
    eod_id: int | None = None,
    keys: Sequence[str] = SEQUENCE_KEYS,
) -> Batch:
    """The `keys` of a loader batch, on `device`. Attention stops at document boundaries where
    the batch carries `document_ids` (packed SFT samples) or, with `eod_id`, at the documents
    its EOD tokens end (the dataset's dense mask is not used)."""
    out = {key: batch[key].to(device, non_blocking=True) for key in keys if key in batch}
    if eod_id is not None and "document_ids" not in out:
        out["document_ids"] = document_ids_from_tokens(out["tokens"], eod_id)
    return out


def model_hidden(model: Any, batch: Batch) -> torch.Tensor:
    """The hidden states after the final norm of the model's rows (`tokens`, `position_ids`,
    and `document_ids` where attention stops at document boundaries)."""
    return model(batch["tokens"], batch["position_ids"], batch.get("document_ids"))


class Objective:
    """A training objective; subclasses give `loss` and change what differs (module docstring).
    Built by `pipeline.train.objectives.build_objective` from the run's config, its registry
    entry (`spec`) and the run's `layout`."""

    batch_keys: tuple[str, ...] = SEQUENCE_KEYS
    reports_perplexity = True

    def __init__(self, cfg: Any = None, spec: Any = None, *, layout: Any = None) -> None:
        self.cfg, self.spec, self.layout = cfg, spec, layout

    def setup(self, run: Any) -> None:
        """Called once the model is built and any checkpoint loaded (`run`: the trainer)."""

    def records(self) -> list[Any]:
        """Run-state records this objective keeps in every checkpoint and checks on resume."""
        return []

    def device_batch(self, batch: dict[str, torch.Tensor], device: torch.device, eod_id: Any):
        """A loader batch's rows on `device` (see `batch_to_device`)."""
        return batch_to_device(batch, device, eod_id, self.batch_keys)

    def count(self, batch: Batch) -> torch.Tensor:
        """What the micro-batch's loss is a sum over: its loss tokens."""
        return batch["loss_mask"].sum()

    def prepare(self, micro_batches: Sequence[Batch], runner: Any) -> None:
        """Work every rank does before the forward passes of a step or an evaluation."""

    def loss(self, model: Any, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, Any]:
        """(summed loss, count) of a micro-batch from `hidden`, the output of `model` (the
        module holding the output layer). Differentiable when gradients are enabled."""
        raise NotImplementedError

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Inside the block the figures `metrics` returns are the evaluation's, kept apart from
        training's."""
        yield

    def metrics(self) -> dict[str, float]:
        """The objective's own figures since the last call (every rank calls it)."""
        return {}


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode inside the block, then back in the mode it was in (the loop's
    evaluation, and a reference's pass over the data)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
