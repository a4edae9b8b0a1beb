"""The frozen start a preference or RL objective measures the policy against (DPO's reference,
GRPO's KL anchor), and its record in every checkpoint.

The reference is the weights the run began with: the policy itself with its adapters off in a
LoRA run (no second model), else a second model built like the policy, under the same layout,
holding those weights. A `ReferenceRecord` names them in every checkpoint (the directory
`checkpoint.load` gave, or None for the seeded initialisation, and a key over its files), so a
resumed run rebuilds the same reference, or refuses in one line when the files changed.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.core.model.lora import adapter_names
from pipeline.train.config.schema import ConfigError
from pipeline.train.objectives import dpo_reference as ref

__all__ = ["ReferenceRecord", "frozen_start", "start_record"]


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
        load = ref.start_directory(run.cfg.checkpoint.load)
        start = {"key": ref.start_key(run.cfg, run.model_config, load), "load": load}
    record.value = dict(start)
    return start


def frozen_start(run: Any, record: ReferenceRecord) -> Any:
    """A step runner whose model is the run's start (module docstring), for `run` (the
    trainer) once its model is built and any checkpoint loaded."""
    start = start_record(run, record)
    if adapter_names(run.model):  # the frozen base is the reference: no second model
        return ref.AdaptersOffRunner(run.step_runner, run.model)
    devices = [run.device] if run.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the run's RNG untouched
        torch.manual_seed(run.cfg.training.seed)
        built = run.build_same_model()
    if record.recorded is None:  # a fresh run: the policy holds the start now
        built.model.load_state_dict(run.model.state_dict())
    else:
        ref.load_start(built, start, run)
    ref.freeze(built.model)
    return built.runner
