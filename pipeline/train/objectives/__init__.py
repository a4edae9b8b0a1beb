"""The training objectives, one folder each, found by `data.kind` in one registry.

An objective is what a run optimises: language modelling (pre-training, and supervised
fine-tuning, which is language modelling with a loss mask), DPO, GRPO, and the next ones. Its
class (`pipeline.train.objectives.base.Objective`) owns the loss and what the loss is
normalised by, the batch keys it needs, its metrics, its setup (a reference model) and what it
records in a checkpoint; the loop (trainer, train step, step runners) calls it and names none.

This module is the registry and stays free of torch, so that `pipe train --help`, `--dry-run`
and the config checks can ask what an objective is without importing it. Each entry
(`ObjectiveSpec`) gives the facts a run needs before the model exists (sequences per sample,
attention masking, how sample prompts are asked, its config problems, what it holds in memory),
how its data is built, its CLI flag and options, and where its class lives; `build_objective`
imports the class. The assembly, the reports and `pipe train` ask these entries and name no
objective.

To add an objective: write the folder `objectives/NAME/` (its `__init__.py` holds `SPECS`, its
modules the class, its data and its settings), and add NAME to `OBJECTIVE_FOLDERS` below
(docs/architecture.md, "Adding an objective"). `pipeline.train` imports this registry as it is
imported itself, so every objective's settings are sections of any `TrainConfig`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.train.config.fields import ConfigError
from pipeline.train.config.registry import Registry, call_target
from pipeline.train.config.schema import add_section

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "OBJECTIVES",
    "OBJECTIVE_FOLDERS",
    "ObjectiveOption",
    "ObjectiveSpec",
    "build_objective",
    "objective_problems",
    "objective_spec",
    "register",
]


@dataclass(frozen=True)
class ObjectiveOption:
    """A `pipe train` option an objective brings beside its flag: `--NAME VALUE` sets `field`
    (`multiple`: repeatable, each value appended to the list `field` holds). Given for a run of
    another objective, it is refused in one line."""

    name: str
    """The option as typed, e.g. "--rollout-server"."""
    field: str
    """The config field it sets, "section.key"."""
    metavar: str
    help: str
    multiple: bool = False


@dataclass(frozen=True)
class ObjectiveSpec:
    """One registry entry: what the run knows of an objective before building it.

    `target` is "module:Class"; `datasets` is "module:function", called as
    `function(cfg, blend, tokenizer)` for the train, valid and test datasets (None for a split
    without data); `data_note` ("module:function" or None), called as `function(cfg, datasets)`,
    is one line for the log about what the data building left out (None: nothing);
    `manifest_dataset` maps the first prefix of the blend to the dataset beside which the
    preprocess manifest lies; `documents_at_eod`: with `data.reset_attention_mask`, documents
    are separated at EOD tokens (packed samples carry their own document ids);
    `sequences_per_sample` counts the sequences one sample holds (throughput and the memory
    estimate count them all; a function of the config where that decides it);
    `document_masking` stops attention at document boundaries; `chat_prompts` asks
    `training.sample_prompts` as a user's turn in the samples log; `problems` lists what is
    wrong with a config for this objective (one line each, no torch); `held_bytes` says what
    the objective keeps on each device beside the model's training state, for `--dry-run`:
    (bytes, what they are) given the config, the `ModelConfig` and the data-parallel size;
    `data_line` adds to the dry run's data line. `flag_help` gives the objective a `pipe train
    --KIND` flag (None: `--objective KIND` only); `options` are the CLI options it brings;
    `section` is its settings, a dataclass the registry adds to the config as `[KIND]`
    (`cfg.KIND`; None: it has none)."""

    kind: str
    target: str
    description: str
    datasets: str
    data_note: str | None = None
    manifest_dataset: Callable[[str], str] | None = None
    documents_at_eod: bool = False
    sequences_per_sample: int | Callable[[TrainConfig], int] = 1
    document_masking: bool = False
    chat_prompts: bool = False
    problems: Callable[[TrainConfig], list[str]] = field(default=lambda cfg: [])
    held_bytes: Callable[[TrainConfig, Any, int], tuple[float, str]] | None = None
    data_line: Callable[[TrainConfig], str] | None = None
    flag_help: str | None = None
    options: tuple[ObjectiveOption, ...] = ()
    section: type | None = None

    def sequences(self, cfg: TrainConfig) -> int:
        """The sequences one sample of `cfg`'s run holds."""
        per_sample = self.sequences_per_sample
        return per_sample(cfg) if callable(per_sample) else per_sample


OBJECTIVES: Registry[ObjectiveSpec] = Registry("data.kind", "{field} {name}: one of {known}")
"""Every objective `data.kind` may choose, by kind."""


def register(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Add `spec` to `OBJECTIVES`, and its settings to the config as `[KIND]`; a kind taken
    already is a programming error (ValueError)."""
    if spec.section is not None:
        add_section(spec.kind, spec.section)
    return OBJECTIVES.add(spec.kind, spec)


def objective_spec(kind: str) -> ObjectiveSpec:
    """The entry of `data.kind`; an unknown kind is a one-line `ConfigError` naming the known."""
    return OBJECTIVES.spec(kind)


def objective_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with `cfg` for its objective, an unknown `data.kind` included."""
    try:
        return objective_spec(cfg.data.kind).problems(cfg)
    except ConfigError as e:
        return [str(e)]


def build_objective(cfg: TrainConfig, **context: Any) -> Any:
    """The objective of `cfg.data.kind`, its class imported now; `context` goes to it."""
    spec = objective_spec(cfg.data.kind)
    return call_target(spec.target, cfg, spec, **context)


OBJECTIVE_FOLDERS = ("language_model", "dpo", "grpo")
"""The registry's one line per objective: the folders whose `SPECS` it holds, in order."""

for _folder in OBJECTIVE_FOLDERS:
    for _spec in importlib.import_module(f"{__name__}.{_folder}").SPECS:
        register(_spec)
