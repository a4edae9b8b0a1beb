"""DPO in the trainer: the loss, its reference, and the reference pass (`data.kind = "dpo"`).

The reference is the model training starts from, frozen. Either it runs beside the policy (a
second model built like it, under the same layout, holding a copy of the starting weights: one
more model's memory), or, with `dpo.precompute_reference`, its log-probabilities of every pair
are computed once before the first step and stored next to the data, as
`{prefix}_reference-{key}.npy` (float64 `[pairs, 2]`), `key` naming the starting weights, the
sample length and the compute dtype, so a later run from the same start reads them back. The
samples then carry them (`ref_logps`) and no reference model exists during training.

Under data parallelism the ranks share the reference pass (each its share of the pairs, the
results summed over the ranks); tensor-parallel ranks run the same pairs together.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.common.atomic import atomic_file
from pipeline.core.model.lora import adapters_off
from pipeline.data.loader import collate_numpy
from pipeline.data.preference_dataset import PreferenceDataset, PreferencePairs
from pipeline.train.config import ConfigError, TrainConfig
from pipeline.train.dpo_loss import DPOLoss, DPOOptions, sequence_logps
from pipeline.train.step_runner import evaluation_mode

__all__ = ["build_dpo_loss", "dpo_options", "precompute_reference", "preference_members"]

log = logging.getLogger(__name__)

MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def dpo_options(cfg: TrainConfig) -> DPOOptions:
    k = cfg.dpo
    try:
        return DPOOptions(k.beta, k.loss, k.label_smoothing)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_dpo_loss(cfg: TrainConfig, reference: Any | None) -> DPOLoss:
    """The DPO objective with a live `reference` model, or None to read `ref_logps`."""
    return DPOLoss(dpo_options(cfg), reference)


class BaseOfLoRA:
    """A LoRA run's reference: the policy itself with its adapters left out, which is the frozen
    base the run started from, so no second model is held in memory. Called as the model is
    (`sequence_logps` reads `output` and calls it)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy

    @property
    def output(self) -> torch.nn.Module:
        return self.policy.output

    def __call__(self, *inputs: Any) -> torch.Tensor:
        with adapters_off(self.policy):
            return self.policy(*inputs)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """`model` as a reference: no gradients, eval mode (no dropout)."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def preference_members(datasets: Sequence[Any]) -> list[PreferenceDataset]:
    """Every `PreferenceDataset` of the split datasets (a blend's members, or the dataset)."""
    members = []
    for dataset in datasets:
        if dataset is not None:
            members += [m for m in getattr(dataset, "datasets", [dataset])]
    return [m for m in members if isinstance(m, PreferenceDataset)]


def start_key(cfg: TrainConfig, model_config: Any) -> str:
    """Names the reference's log-probabilities: the starting weights (the loaded checkpoint's
    files, by name, size and modification time, or the seed of a fresh model), the model, the
    sample length and the compute dtype."""
    load = cfg.checkpoint.load
    files = []
    if load is not None:
        root = Path(load)
        files = [
            [str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(root.rglob("*")) if f.is_file() and "cache" not in f.parts
        ]  # fmt: skip
    record = {
        "load": str(Path(load).resolve()) if load else None,
        "files": files,
        "seed": None if load else cfg.training.seed,
        "model": repr(model_config),
        "seq_length": cfg.data.seq_length,
        "dtype": cfg.training.dtype,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def reference_path(pairs: PreferencePairs, key: str) -> Path:
    return Path(f"{pairs.prefix}_reference-{key}.npy")


def precompute_reference(
    model: torch.nn.Module,
    members: Sequence[PreferenceDataset],
    key: str,
    layout: Any,
    device: torch.device,
    autocast: Any,
    pairs_per_batch: int,
) -> list[Path]:
    """Attach the reference's log-probabilities to every member, computing each prefix's once
    (or reading it back); every rank calls this. Returns the files."""
    by_prefix: dict[str, list[PreferenceDataset]] = {}
    for member in members:
        by_prefix.setdefault(member.dataset.prefix, []).append(member)
    paths = []
    for group in by_prefix.values():
        path = reference_path(group[0].dataset, key)
        if path.is_file():
            logps = np.load(path, allow_pickle=False)
            log.info("reference log-probabilities from %s", path)
        else:
            logps = _reference_pass(model, group[0], layout, device, autocast, pairs_per_batch)
            if layout.rank == 0:
                with atomic_file(path) as f:
                    np.save(f, logps, allow_pickle=False)
                log.info("reference log-probabilities of %d pairs written to %s", len(logps), path)
        for member in group:
            member.attach_reference(logps)
        paths.append(path)
    return paths


@torch.no_grad()
def _reference_pass(model, member, layout, device, autocast, pairs_per_batch: int) -> np.ndarray:
    """`[pairs, 2]` log-probabilities of every pair of `member`'s prefix, this data-parallel
    rank computing pairs dp_rank, dp_rank + dp, ... and the ranks summing their results."""
    total = len(member.dataset)
    dp, dp_rank = layout.dp, layout.dp_rank
    mine = np.arange(dp_rank, total, dp)
    per_rank = -(-total // dp)
    steps = -(-per_rank // pairs_per_batch)  # the same count on every rank
    out = torch.zeros(total, 2, dtype=torch.float64, device=device)
    with evaluation_mode(model), adapters_off(model):  # a LoRA run's reference: its base
        for step in range(steps):
            chosen = mine[step * pairs_per_batch : (step + 1) * pairs_per_batch]
            wanted = list(chosen) or [0]  # a rank out of pairs still joins the collectives
            batch = collate_numpy([member.pair_sample(int(p)) for p in wanted])
            batch = {
                k: batch[k].to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")
            }
            with autocast:
                logps, _ = sequence_logps(model, batch)
            if len(chosen):
                out[torch.as_tensor(chosen, device=device)] = logps.double()
    group = layout.batch_group
    if group is not None:
        on_gpu = dist.get_backend() == "nccl"
        out = out.to(device if on_gpu else "cpu")
        dist.all_reduce(out, group=group)
    return out.cpu().numpy()
