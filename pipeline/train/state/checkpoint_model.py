"""The model a checkpoint records, for runs that take theirs from it or must match it.

Every pipe checkpoint (saved by `pipe train` or written by `pipe convert`) records its model
config in `pipe_metadata.json`, a small JSON file, so both uses below cost no tensor read, and
`resolve_config` reads it once per run (`read_recorded_model`) into `TrainConfig.recorded_model`:

- `model.flavor = "checkpoint"` builds the model recorded by the checkpoint `checkpoint.load`
  resumes from (other `model.*` settings still apply on top). `resolve_config` picks it when
  `--load` names a checkpoint and nothing names a model: no recipe, or a recipe without a
  `[model]` table, and no `--set model.flavor`.
- Otherwise the run's model must have the checkpoint's shapes: `check_checkpoint_model` refuses
  a mismatch in one line naming each differing field, before anything is built or read, and
  logs settings that change the model's function without changing a shape (a longer context,
  another RoPE base).

A Hugging Face model directory (`--load HF_DIR`, a directory with `config.json`) is read the same
way: its `config.json` (through `pipeline.weights`' config mapping, headers only) is the recorded
model, with `hf` set so the trainer starts from its weights at iteration 0. A directory that
cannot be read as one is refused in one line.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.train.config.schema import CHECKPOINT_FLAVOR, ConfigError, RecordedModel

if TYPE_CHECKING:
    from pipeline.core.model.config import ModelConfig
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "CHECKPOINT_FLAVOR",
    "check_checkpoint_model",
    "is_hf_directory",
    "read_recorded_model",
]

log = logging.getLogger(__name__)


def _checkpoint_record(
    load_dir: str | os.PathLike | None, iteration: int | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """(the checkpoint directory `--load load_dir` resumes from: an `iter_*` directory given
    directly, `iteration`'s, or the tracker's; its `pipe_metadata.json`), or None when there is
    none yet: a run that saves where it loads starts from scratch the first time."""
    from pipeline.checkpoint.layout import PIPE_METADATA, CheckpointError, read_tracker
    from pipeline.checkpoint.loader import resolve_checkpoint

    if load_dir is None:
        return None
    root = Path(load_dir)
    _refuse_weights_without_config(root)
    try:
        if (
            iteration is None
            and not (root / PIPE_METADATA).is_file()
            and read_tracker(root) is None
        ):
            return None
        return resolve_checkpoint(root, iteration)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e


def read_recorded_model(
    load_dir: str | os.PathLike | None, iteration: int | None = None
) -> RecordedModel | None:
    """The model config recorded by the checkpoint `load_dir` resumes from (one read of its
    `pipe_metadata.json`), or None when there is no checkpoint yet. A record without a usable
    model config gives a `RecordedModel` whose `problem` says so."""
    from pipeline.checkpoint.layout import PIPE_METADATA
    from pipeline.core.model.config import model_config_from_dict

    if load_dir is not None and is_hf_directory(load_dir):
        return _hf_model(Path(load_dir))
    found = _checkpoint_record(load_dir, iteration)
    if found is None:
        return None
    directory, record = found
    recorded = (record.get("metadata") or {}).get("model")
    if not isinstance(recorded, dict):
        problem = f"checkpoint {directory} records no model config in {PIPE_METADATA}"
        return RecordedModel(directory, problem=problem)
    try:
        return RecordedModel(directory, model_config_from_dict(recorded))
    except (TypeError, ValueError) as e:
        problem = f"checkpoint {directory}: unreadable model config: {e}"
        return RecordedModel(directory, problem=problem)


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether `path` is a Hugging Face model directory (it holds a `config.json`)."""
    return (Path(path) / "config.json").is_file()


def _hf_model(directory: Path) -> RecordedModel:
    """The model of the Hugging Face directory `--load` names, or one `ConfigError` line."""
    from pipeline.weights.hf_reader import HFSource

    try:
        source = HFSource(directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())
        raise ConfigError(
            f"checkpoint.load {directory}: not a usable Hugging Face model directory: {reason}"
        ) from None
    return RecordedModel(directory, source.model_config, hf=True)


def _refuse_weights_without_config(root: Path) -> None:
    """A directory of weights without `config.json` (a Hugging Face save missing a file) is
    neither a model to start from nor an empty save directory to start one in."""
    if not root.is_dir() or (root / "config.json").is_file():
        return
    weights = [p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin")]
    if weights:
        raise ConfigError(
            f"checkpoint.load {root}: holds {weights[0]} but no config.json, so it is neither a "
            "Hugging Face model directory nor a pipe checkpoint"
        )


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
        "qk_norm_scope": config.qk_norm_scope,
    }


def _numerics(config: ModelConfig) -> dict[str, Any]:
    """Fields that change what the model computes but no shape (a fine-tune may change them)."""
    return {
        "norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "partial_rotary_factor": config.partial_rotary_factor,
        "query_scale_beta": config.query_scale_beta,
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
    `ConfigError` line naming the fields); log shape-preserving changes. No-op without one.
    The checkpoint `resolve_config` found is not read again (`cfg.recorded_model`)."""
    recorded = cfg.recorded_model if iteration is None else None
    if recorded is None:
        recorded = read_recorded_model(cfg.checkpoint.load, iteration)
    if recorded is None:
        return
    directory = recorded.directory
    if recorded.hf:
        what, whose = f"Hugging Face model {directory} has", "the model"
    else:
        what, whose = f"checkpoint {directory} was saved with", "the checkpoint's model"
    saved, run = recorded.model_config(), cfg.model_config()
    fields, values = _differences(_shapes(saved), _shapes(run))
    if fields:
        raise ConfigError(
            f"{what} {fields}; this run has {values} "
            f"(--set model.flavor={CHECKPOINT_FLAVOR} trains {whose})"
        )
    fields, values = _differences(_numerics(saved), _numerics(run))
    if fields:
        log.warning("%s %s; this run uses %s", what, fields, values)
