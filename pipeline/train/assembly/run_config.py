"""A run's configuration, resolved and checked whole: defaults < recipe < `--set` < first-class
flags (`pipeline.train.config.loader`), the checkpoint `checkpoint.load` names read once, and
every problem named at once, the sections' own (`TrainConfig.validate`) and what the run's
objective and optimizer refuse (their registries' entries).

This sits in the assembly, above the config, the registries and the run state, because it asks
all three: the config room below them names none of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipeline.train.config.checks import config_problems, raise_problems
from pipeline.train.config.loader import apply_flags, apply_set, recipe_tables
from pipeline.train.config.schema import CHECKPOINT_FLAVOR, TrainConfig
from pipeline.train.objectives import objective_problems
from pipeline.train.optimizers import optimizer_problems
from pipeline.train.state.checkpoint_model import read_recorded_model

__all__ = ["check_config", "resolve_config", "run_problems"]


def run_problems(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """Every problem of `cfg` for `world_size` (None: not known yet), one line each: the
    sections' own, its objective's and its optimizer's."""
    return (
        config_problems(cfg, world_size)
        + objective_problems(cfg)
        + optimizer_problems(cfg, world_size)
    )


def check_config(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """`cfg` when nothing is wrong with it; else one `ConfigError` listing every problem."""
    raise_problems(run_problems(cfg, world_size))
    return cfg


def resolve_config(
    recipe: str | Path | None = None,
    sets: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    validate: bool = True,
) -> TrainConfig:
    """defaults < `recipe` < each of `sets` in order < `flags`, then checked for `world_size`.

    The checkpoint `checkpoint.load` resumes from, if any, is read here, once: its recorded
    model goes into `recorded_model`. When nothing names a model (no recipe or one without a
    `[model]` table, and no `--set model.flavor`) and there is such a checkpoint, the run takes
    its model (`model.flavor = "checkpoint"`); other `--set model.*` adjust it. A Hugging Face
    directory is read the same way, and its tokenizer is `data.tokenizer` unless one is set.
    """
    cfg, tables = TrainConfig(), {}
    if recipe is not None:
        path, tables = recipe_tables(recipe)
        cfg.update(tables, source=str(path))
    sets = list(sets)
    for assignment in sets:
        apply_set(cfg, assignment)
    apply_flags(cfg, flags or {})
    cfg.recorded_model = read_recorded_model(cfg.checkpoint.load)
    names_model = "model" in tables or any(_assigns(a, "model.flavor") for a in sets)
    if not names_model and cfg.recorded_model is not None:
        cfg.model.flavor = CHECKPOINT_FLAVOR
    if cfg.recorded_model is not None and cfg.recorded_model.hf and cfg.data.tokenizer is None:
        cfg.data.tokenizer = _tokenizer_beside(cfg.recorded_model.directory)
    if validate:
        check_config(cfg, world_size)
    return cfg


def _tokenizer_beside(directory: Path) -> str | None:
    """`directory` when it holds a tokenizer's vocabulary file, else None."""
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    return str(directory) if any((directory / n).is_file() for n in names) else None


def _assigns(assignment: str, dotted: str) -> bool:
    """Whether a `--set` assignment sets `dotted` (e.g. `model.flavor`)."""
    return assignment.partition("=")[0].strip() == dotted
