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
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.checkpoint import load as checkpoint_load
from pipeline.checkpoint import load_model_and_optimizer_state, model_and_optimizer_state
from pipeline.checkpoint.loader import CheckpointError, resolve_checkpoint_dir
from pipeline.common.atomic import atomic_file
from pipeline.common.quiet import quiet_dcp
from pipeline.core.model.lora import adapters_off
from pipeline.core.parallel.reduce import sum_over_groups
from pipeline.data.loader import collate_numpy
from pipeline.data.preference_dataset import PreferenceDataset, PreferencePairs
from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.objectives.dpo_loss import DPOOptions, pair_rows, row_logps
from pipeline.train.state.checkpoint_model import is_hf_directory

__all__ = [
    "AdaptersOffRunner", "BaseOfLoRA", "dpo_options", "logps_checksum", "precompute_reference",
    "load_start", "preference_members", "start_directory", "reference_logps", "start_key",
]

log = logging.getLogger(__name__)

MODEL_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def dpo_options(cfg: TrainConfig) -> DPOOptions:
    k = cfg.dpo
    try:
        return DPOOptions(k.beta, k.loss, k.label_smoothing)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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


class AdaptersOffRunner:
    """A LoRA run's reference as a step runner: the policy's own runner (whole model or
    pipeline stages) with the adapters of `policy` left out while it runs."""

    def __init__(self, runner: Any, policy: torch.nn.Module) -> None:
        self.runner, self.policy = runner, policy

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> Any:
        with adapters_off(self.policy):
            return self.runner.hidden_states(batch)


def reference_logps(runner: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """`[pairs, 2]` log-probabilities of `rows` by a reference `runner` on the rank holding
    the output layer (None elsewhere); under context parallelism this rank's partial sums."""
    out = runner.hidden_states(rows)
    if out is None:
        return None
    module, hidden = out
    return row_logps(hidden, module.output.weight, rows)[0]


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


def start_key(cfg: TrainConfig, model_config: Any, load: str | None) -> str:
    """Names the reference's log-probabilities: the starting weights (the files under `load`,
    by name, size and modification time, or the seed of a fresh model), the model, the sample
    length and the compute dtype."""
    files = []
    if load is not None:
        root = Path(load)
        files = [
            [str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(root.rglob("*")) if f.is_file() and "cache" not in f.parts
        ]  # fmt: skip
    record = {
        "load": load,
        "files": files,
        "seed": None if load else cfg.training.seed,
        "model": repr(model_config),
        "seq_length": cfg.data.seq_length,
        "dtype": cfg.training.dtype,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def start_directory(load: str | None) -> str | None:
    """Where a run's starting weights are: the checkpoint directory `load` resolves to (its
    newest, a fixed `iter_*` directory), a Hugging Face directory, or None (nothing there yet:
    the run starts from its seeded initialisation)."""
    if load is None:
        return None
    if is_hf_directory(load):
        return str(Path(load).resolve())
    try:
        return str(resolve_checkpoint_dir(load).resolve())
    except CheckpointError:
        return None


def load_start(built: Any, start: dict[str, Any], run: Any) -> None:
    """Read a resumed run's starting weights (as `DPO.setup` recorded them) into the reference
    model `built`, refusing in one line when they changed since the run began. A run that
    started from its seeded initialisation needs nothing: `built` was initialised the same."""
    load = start.get("load")
    if load is None:
        return
    if not Path(load).exists() or start_key(run.cfg, run.model_config, load) != start["key"]:
        raise ConfigError(
            f"{load}: the weights this run started from (its reference) are missing or "
            "have changed since it began; resume needs them as they were"
        )
    if is_hf_directory(load):
        from pipeline.train.state.hf_weights import load_hf_weights
        from pipeline.weights.hf_reader import HFSource

        load_hf_weights(built.parts, HFSource(load))
        return
    state = model_and_optimizer_state(built.model)
    with quiet_dcp():
        checkpoint_load(
            load, None, state, restore_rng=False, process_group=run.layout.world_group,
            verify_checksums=run.cfg.checkpoint.verify_checksums,
        )  # fmt: skip
    load_model_and_optimizer_state(built.model, None, state)


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
