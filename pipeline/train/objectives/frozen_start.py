"""The frozen start a preference or RL objective measures the policy against (DPO's reference,
GRPO's KL anchor), and its record in every checkpoint.

The reference is the weights the run began with: the policy itself with its adapters off in a
LoRA run (no second model), else a second model built like the policy, under the same layout,
holding those weights. A `ReferenceRecord` names them in every checkpoint (the directory
`checkpoint.load` gave, or None for the seeded initialisation, and a key over its files), so a
resumed run rebuilds the same reference, or refuses in one line when the files changed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import load as checkpoint_load
from pipeline.checkpoint import load_model_and_optimizer_state, model_and_optimizer_state
from pipeline.checkpoint.loader import CheckpointError, resolve_checkpoint_dir
from pipeline.common.quiet import quiet_dcp
from pipeline.core.model.lora import adapter_names, adapters_off
from pipeline.train.config.schema import ConfigError, TrainConfig
from pipeline.train.state.checkpoint_model import is_hf_directory

__all__ = [
    "AdaptersOffRunner",
    "BaseOfLoRA",
    "ReferenceRecord",
    "freeze",
    "frozen_start",
    "load_start",
    "start_directory",
    "start_key",
    "start_record",
]


class ReferenceRecord:
    """What a run's reference is, kept in every checkpoint under `name` (`dpo_reference`,
    `grpo_reference`): the starting weights and their key, and whatever the objective adds
    (DPO: the checksums of a precomputed reference's files). On resume the recorded start is
    rebuilt."""

    def __init__(self, name: str, objective: str) -> None:
        self.name, self.objective = name, objective
        self.value: dict[str, Any] = {}
        self.recorded: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        return dict(self.value)

    def check(self, recorded: dict[str, Any] | None, resuming: bool) -> None:
        if resuming and recorded is None:
            raise ConfigError(
                f"checkpoint.load holds no {self.objective} run to resume (no record of its "
                f"reference): to start {self.objective} from its weights, add --finetune"
            )
        self.recorded = recorded if resuming else None


def start_record(run: Any, record: ReferenceRecord) -> dict[str, Any]:
    """The start `record` holds (a resumed run), else this run's: the checkpoint directory (or
    Hugging Face directory) `checkpoint.load` gave, None for a seeded start, and its key. Kept
    in `record.value`, so every checkpoint carries it."""
    start = record.recorded
    if start is None:
        load = start_directory(run.cfg.checkpoint.load)
        start = {"key": start_key(run.cfg, run.model_config, load), "load": load}
    record.value = dict(start)
    return start


def frozen_start(run: Any, record: ReferenceRecord) -> Any:
    """A step runner whose model is the run's start (module docstring), for `run` (the
    trainer) once its model is built and any checkpoint loaded."""
    start = start_record(run, record)
    if adapter_names(run.model):  # the frozen base is the reference: no second model
        return AdaptersOffRunner(run.step_runner, run.model)
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the run's RNG untouched
        torch.manual_seed(run.cfg.training.seed)
        built = run.build_same_model()
    if record.recorded is None:  # a fresh run: the policy holds the start now
        built.model.load_state_dict(run.model.state_dict())
    else:
        load_start(built, start, run)
    freeze(built.model)
    return built.runner


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


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """`model` as a reference: no gradients, eval mode (no dropout)."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def start_key(cfg: TrainConfig, model_config: Any, load: str | None) -> str:
    """Names the reference's log-probabilities: the starting weights (the files under `load`,
    by name, size and modification time, or the seed of a fresh model), the model, the sample
    length and the compute dtype."""
    files = []
    if load is not None:
        root = Path(load)
        files = [
            [str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(root.rglob("*"))
            if f.is_file() and "cache" not in f.parts
        ]
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
            load,
            None,
            state,
            restore_rng=False,
            process_group=run.layout.world_group,
            verify_checksums=run.cfg.checkpoint.verify_checksums,
        )
    load_model_and_optimizer_state(built.model, None, state)
