"""DPO's reference: the model training starts from, frozen, and its precomputed pass.

Either the reference runs beside the policy (a second model built like it, under the same
layout, holding a copy of the starting weights: one more model's memory; in a LoRA run the
policy with its adapters left out), or, with `dpo.precompute_reference`, its log-probabilities
of every pair are computed once before the first step and stored next to the data, as
`{prefix}_reference-{key}.npy` (float64 `[pairs, 2]`), `key` naming the starting weights, the
sample length and the compute dtype, so a later run from the same start reads them back. The
samples then carry them (`ref_logps`) and no reference model exists during training.

Under data parallelism the ranks share the reference pass (each its share of the pairs, the
results summed over the ranks); tensor-parallel ranks run the same pairs together, context-
parallel ranks each their part of every sequence (the parts summed), pipeline ranks pass hidden
states on and the last stage's results are summed into the others'.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.common.atomic import atomic_file
from pipeline.core.parallel.reduce import sum_over_groups
from pipeline.data.loader import collate_numpy
from pipeline.data.preference_dataset import PreferenceDataset, PreferencePairs
from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.objectives.dpo.loss import DPOOptions, pair_rows, row_logps

__all__ = [
    "dpo_options",
    "logps_checksum",
    "precompute_reference",
    "preference_members",
    "reference_logps",
]

log = logging.getLogger(__name__)

MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def dpo_options(cfg: TrainConfig) -> DPOOptions:
    k = cfg.dpo
    try:
        return DPOOptions(k.beta, k.loss, k.label_smoothing)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def reference_logps(runner: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """`[pairs, 2]` log-probabilities of `rows` by a reference `runner` on the rank holding
    the output layer (None elsewhere); under context parallelism this rank's partial sums."""
    out = runner.hidden_states(rows)
    if out is None:
        return None
    module, hidden = out
    return row_logps(hidden, module.output.weight, rows)[0]


def preference_members(datasets: Sequence[Any]) -> list[PreferenceDataset]:
    """Every `PreferenceDataset` of the split datasets (a blend's members, or the dataset)."""
    members = []
    for dataset in datasets:
        if dataset is not None:
            members += [m for m in getattr(dataset, "datasets", [dataset])]
    return [m for m in members if isinstance(m, PreferenceDataset)]


def reference_path(pairs: PreferencePairs, key: str) -> Path:
    return Path(f"{pairs.prefix}_reference-{key}.npy")


def logps_checksum(logps: np.ndarray) -> str:
    """SHA-256 of the reference log-probabilities' values (float64, in pair order): what a
    resumed run compares with the file it reads back."""
    return hashlib.sha256(np.ascontiguousarray(logps, dtype=np.float64).tobytes()).hexdigest()


def precompute_reference(
    runner: Any,
    members: Sequence[PreferenceDataset],
    key: str,
    layout: Any,
    device: torch.device,
    autocast: Any,
    pairs_per_batch: int,
) -> dict[str, str]:
    """Attach the reference's log-probabilities to every member, computing each prefix's once
    (or reading it back) with the reference `runner`; every rank calls this. Returns each
    file's `logps_checksum` by path."""
    by_prefix: dict[str, list[PreferenceDataset]] = {}
    for member in members:
        by_prefix.setdefault(member.dataset.prefix, []).append(member)
    checksums = {}
    for group in by_prefix.values():
        path = reference_path(group[0].dataset, key)
        if path.is_file():
            logps = np.load(path, allow_pickle=False)
            log.info("reference log-probabilities from %s", path)
        else:
            logps = _reference_pass(runner, group[0], layout, device, autocast, pairs_per_batch)
            if layout.rank == 0:
                with atomic_file(path) as f:
                    np.save(f, logps, allow_pickle=False)
                log.info("reference log-probabilities of %d pairs written to %s", len(logps), path)
        for member in group:
            member.attach_reference(logps)
        checksums[str(path)] = logps_checksum(logps)
    return checksums


@torch.no_grad()
def _reference_pass(runner, member, layout, device, autocast, pairs_per_batch: int) -> np.ndarray:
    """`[pairs, 2]` log-probabilities of every pair of `member`'s prefix, this data-parallel
    rank computing pairs dp_rank, dp_rank + dp, ... and the ranks summing their results."""
    total = len(member.dataset)
    dp, dp_rank = layout.dp, layout.dp_rank
    mine = np.arange(dp_rank, total, dp)
    per_rank = -(-total // dp)
    steps = -(-per_rank // pairs_per_batch)  # the same count on every rank
    out = torch.zeros(total, 2, dtype=torch.float64, device=device)
    for step in range(steps):
        chosen = mine[step * pairs_per_batch : (step + 1) * pairs_per_batch]
        wanted = list(chosen) or [0]  # a rank out of pairs still joins the collectives
        batch = collate_numpy([member.pair_sample(int(p)) for p in wanted])
        rows = pair_rows({k: batch[k].to(device) for k in MODEL_KEYS})
        with autocast:
            logps = reference_logps(runner, layout.shard_batch(rows))
        if logps is not None and len(chosen):
            out[torch.as_tensor(chosen, device=device)] = logps.double()
    return sum_over_groups(out, (layout.batch_group, layout.pipeline_group)).numpy()
