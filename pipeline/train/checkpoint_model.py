"""The model a checkpoint records, for runs that take theirs from it or must match it.

Every pipe checkpoint (saved by `pipe train` or written by `pipe convert`) records its model
config in `pipe_metadata.json`, a small JSON file, so both uses below cost no tensor read:

- `model.flavor = "checkpoint"` builds the model recorded by the checkpoint `checkpoint.load`
  resumes from (other `model.*` settings still apply on top). `resolve_config` picks it when
  `--load` names a checkpoint and nothing names a model: no recipe, or a recipe without a
  `[model]` table, and no `--set model.flavor`.
- Otherwise the run's model must have the checkpoint's shapes: `check_checkpoint_model` refuses
  a mismatch in one line naming each differing field, before anything is built or read, and
  logs settings that change the model's function without changing a shape (a longer context,
  another RoPE base).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.train.config import ConfigError

if TYPE_CHECKING:
    from pipeline.core.model.config import ModelConfig
    from pipeline.train.config import TrainConfig

__all__ = [
    "CHECKPOINT_FLAVOR",
    "check_checkpoint_model",
    "checkpoint_to_load",
    "model_from_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_FLAVOR = "checkpoint"


def checkpoint_to_load(
    load_dir: str | os.PathLike | None, iteration: int | None = None
) -> Path | None:
    """The checkpoint directory `--load load_dir` resumes from (an `iter_*` directory given
    directly, `iteration`'s, or the tracker's), or None when there is none yet: a run that
    saves where it loads starts from scratch the first time."""
    from pipeline.checkpoint.layout import PIPE_METADATA, CheckpointError, read_tracker
    from pipeline.checkpoint.loader import resolve_checkpoint_dir

    if load_dir is None:
        return None
    root = Path(load_dir)
    try:
        if (
            iteration is None
            and not (root / PIPE_METADATA).is_file()
            and read_tracker(root) is None
        ):
            return None
        return resolve_checkpoint_dir(root, iteration)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e


def _recorded_model(directory: Path) -> ModelConfig:
    """The model config `directory`'s `pipe_metadata.json` records."""
    from pipeline.checkpoint.layout import PIPE_METADATA, read_pipe_metadata
    from pipeline.core.model.config import model_config_from_dict

    record = read_pipe_metadata(directory) or {}
    recorded = (record.get("metadata") or {}).get("model")
    if not isinstance(recorded, dict):
        raise ConfigError(f"checkpoint {directory} records no model config in {PIPE_METADATA}")
    try:
        return model_config_from_dict(recorded)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {directory}: unreadable model config: {e}") from e


def model_from_checkpoint(load_dir: str | None) -> ModelConfig:
    """The model recorded by the checkpoint `load_dir` resumes from (`model.flavor =
    "checkpoint"`); `ConfigError` when there is none to read."""
    directory = checkpoint_to_load(load_dir)
    if directory is None:
        where = f"{load_dir} holds no checkpoint yet" if load_dir else "no checkpoint.load is set"
        raise ConfigError(
            f"model.flavor = {CHECKPOINT_FLAVOR} takes the model from the loaded checkpoint, "
            f"but {where}; name a model flavor instead"
        )
    return _recorded_model(directory)


def _shapes(config: ModelConfig) -> dict[str, Any]:
    """The fields that decide the parameters' shapes and how they are wired, by the name
    `--set model.<name>` gives them."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "ffn_hidden_size": config.ffn_hidden_size,
        "moe_ffn_hidden_size": config.expert_ffn_hidden_size if config.moe is not None else None,
        "num_experts": config.moe.num_experts if config.moe is not None else 0,
        "moe_layer_step": config.moe.layer_step if config.moe is not None else None,
        "moe_dense_layers": config.moe.dense_layers if config.moe is not None else None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
    }


def _numerics(config: ModelConfig) -> dict[str, Any]:
    """Fields that change what the model computes but no shape (a fine-tune may change them)."""
    return {
        "norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "moe_top_k": config.moe.top_k if config.moe is not None else None,
        "moe_norm_topk_prob": config.moe.norm_topk_prob if config.moe is not None else None,
    }


def _differences(saved: dict[str, Any], run: dict[str, Any]) -> tuple[str, str]:
    """`model.a=1, model.b=2` (the saved values) and `3, 4` (the run's) for differing fields."""
    names = [name for name in saved if saved[name] != run[name]]
    return (
        ", ".join(f"model.{name}={saved[name]}" for name in names),
        ", ".join(str(run[name]) for name in names),
    )


def check_checkpoint_model(cfg: TrainConfig, iteration: int | None = None) -> None:
    """Refuse a run whose model does not have the shapes of the checkpoint it loads (one
    `ConfigError` line naming the fields); log shape-preserving changes. No-op without one."""
    directory = checkpoint_to_load(cfg.checkpoint.load, iteration)
    if directory is None:
        return
    saved, run = _recorded_model(directory), cfg.model_config()
    fields, values = _differences(_shapes(saved), _shapes(run))
    if fields:
        raise ConfigError(
            f"checkpoint {directory} was saved with {fields}; this run has {values} "
            f"(--set model.flavor={CHECKPOINT_FLAVOR} trains the checkpoint's model)"
        )
    fields, values = _differences(_numerics(saved), _numerics(run))
    if fields:
        log.warning("checkpoint %s was saved with %s; this run uses %s", directory, fields, values)
