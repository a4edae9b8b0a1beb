"""What a LoRA run (`[lora] enabled`, `pipe train --lora`) does beyond a plain one.

The model is built as usual and `parallelize` adds the adapters (`pipeline.core.model.lora`)
before any parallelism, freezing the rest: the optimizer then holds (and keeps state for) the
adapters only. The frozen base is a full pipe checkpoint or a Hugging Face model directory,
found in this order: `lora.base` (a pipe checkpoint); `checkpoint.load` when it holds a full
checkpoint (the run then starts at iteration 0 with fresh adapters); the base recorded by the
adapter checkpoint `checkpoint.load` resumes; the Hugging Face directory `--load HF_DIR` names
(`pipe train --lora --load HF_DIR`: its checkpoints go to `checkpoint.save`, and the same
command resumes them, reading the base again from the directory). A run with none of these
trains adapters on its seeded random initialisation (tests, experiments), which it records as
its base.

Checkpoints hold the adapters, their optimizer state and everything else a resume needs, never
the base (`LoRAState`, the run's `run_state.StateAdapter`); `pipe_metadata.json` records under
`lora` the adapter settings and the base: its directory, iteration and checksum. A pipe base's
checksum is the SHA-256 of its `pipe_metadata.json`, which lists the SHA-256 of every file of
the checkpoint; a Hugging Face base's is `hf_weights.hf_checksum` (every byte of its config and
weight files). Resuming refuses a base whose checksum differs.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.core.model.lora import ALL_TARGETS, LoRASpec, is_adapter_name
from pipeline.train.config.schema import ConfigError

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig
    from pipeline.train.state.run_state import FoundCheckpoint

__all__ = [
    "BaseRecord",
    "LoRAState",
    "adapter_only",
    "find_base",
    "load_base",
    "lora_metadata",
    "lora_spec",
]

log = logging.getLogger("pipeline.train")


def lora_spec(cfg: TrainConfig) -> LoRASpec:
    """The adapters `cfg.lora` asks for (`targets = ["all"]`: every target)."""
    lo = cfg.lora
    targets = ALL_TARGETS if "all" in lo.targets else tuple(lo.targets)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[lo.base_dtype]
    try:
        return LoRASpec(lo.rank, lo.alpha, lo.dropout, targets, dtype)
    except ValueError as e:
        raise ConfigError(f"[lora]: {e}") from e


@dataclass(frozen=True)
class BaseRecord:
    """The frozen base a LoRA run trains on: a checkpoint (`path`, `iteration`, `checksum`),
    or the run's seeded random initialisation (`path` None)."""

    path: str | None
    iteration: int | None = None
    checksum: str | None = None
    seed: int | None = None


def _checkpoint_base(path: str | Path) -> BaseRecord:
    """The base record of the pipe checkpoint `path` names (a save directory or `iter_*`)."""
    from pipeline.checkpoint.layout import PIPE_METADATA, CheckpointError
    from pipeline.checkpoint.loader import resolve_checkpoint

    try:
        directory, record = resolve_checkpoint(Path(path))
    except CheckpointError as e:
        raise ConfigError(f"LoRA base: {e}") from e
    checksum = hashlib.sha256((directory / PIPE_METADATA).read_bytes()).hexdigest()
    iteration = (record.get("metadata") or {}).get("iteration", record.get("iteration"))
    return BaseRecord(str(directory.resolve()), iteration, checksum)


def _hf_base(source: Any, process_group: Any | None) -> BaseRecord:
    """The base record of a Hugging Face model directory (its `HFSource`)."""
    from pipeline.train.state.hf_weights import hf_checksum

    return BaseRecord(str(source.directory.resolve()), checksum=hf_checksum(source, process_group))


def _recorded_base(path: str, process_group: Any | None) -> BaseRecord:
    """The base an adapter checkpoint recorded, as it is now: a Hugging Face directory (one
    with a `config.json`) or a pipe checkpoint."""
    from pipeline.train.state.checkpoint_model import is_hf_directory
    from pipeline.train.state.hf_weights import open_hf

    if is_hf_directory(path):
        return _hf_base(open_hf(path, "LoRA base"), process_group)
    return _checkpoint_base(path)


def find_base(
    cfg: TrainConfig,
    found: FoundCheckpoint | None,
    hf_start: Any | None = None,
    process_group: Any | None = None,
) -> tuple[BaseRecord, bool]:
    """(the run's base, whether the checkpoint `found` is that base rather than adapters to
    resume). `found`: the checkpoint `checkpoint.load` leads to, or None; `hf_start`: the
    Hugging Face model `checkpoint.load` names, the base when nothing else is."""
    recorded = found.metadata.get("lora") if found is not None else None
    if cfg.lora.base is not None and hf_start is not None:
        raise ConfigError(
            f"lora.base {cfg.lora.base} with --load {hf_start.directory}, a Hugging Face "
            "directory that is itself the base: give one of them"
        )
    if cfg.lora.base is not None:
        base = _checkpoint_base(cfg.lora.base)
    elif found is not None and recorded is None:
        return _checkpoint_base(found.directory), True
    elif recorded is not None and recorded["base"]["path"] is not None:
        base = _recorded_base(recorded["base"]["path"], process_group)
    elif recorded is None and hf_start is not None:
        return _hf_base(hf_start, process_group), False
    else:
        return BaseRecord(None, seed=cfg.training.seed), False
    if found is None or recorded is None:
        return base, False  # a full checkpoint to resume is not a LoRA run's: refused by caller
    expected = recorded.get("base", {}).get("checksum")
    if expected is not None and expected != base.checksum:
        raise ConfigError(_other_base(base, expected, cfg, found))
    return base, False


def _other_base(base: BaseRecord, expected: str, cfg: TrainConfig, found: FoundCheckpoint) -> str:
    """Why the base read now is not the one the adapters of `found` were trained on."""
    from pipeline.train.state.checkpoint_model import is_hf_directory

    checksums = f"(checksum {base.checksum[:12]}..., recorded {expected[:12]}...)"
    if is_hf_directory(base.path):
        return (
            f"the Hugging Face model {base.path} has changed since the adapters in "
            f"{found.directory} were trained on it {checksums}"
        )
    return (
        f"LoRA base {base.path} is not the one the adapters in {cfg.checkpoint.load} were "
        f"trained on {checksums}"
    )


def load_base(
    model: Any, parts: list[Any], base: BaseRecord, cfg: TrainConfig, process_group: Any
) -> None:
    """Read the base weights (every non-adapter parameter) of `base` into `model` (whose
    `parts`, this rank's pipeline stages or the model, a Hugging Face base is read into)."""
    from pipeline.checkpoint import load, load_model_and_optimizer_state, model_and_optimizer_state
    from pipeline.common.quiet import quiet_dcp
    from pipeline.train.state.checkpoint_model import is_hf_directory

    if base.path is None:
        log.warning("LoRA: no base checkpoint (lora.base or --load): adapting the random init")
        return
    if is_hf_directory(base.path):
        _load_hf_base(parts, base.path)
        return
    state = model_and_optimizer_state(model)
    state["model"] = {k: v for k, v in state["model"].items() if not is_adapter_name(k)}
    with quiet_dcp():
        load(
            base.path,
            None,
            state,
            restore_rng=False,
            process_group=process_group,
            verify_checksums=cfg.checkpoint.verify_checksums,
        )
    load_model_and_optimizer_state(model, None, state, strict=False)
    log.info("LoRA base: %s (iteration %s)", base.path, base.iteration)


def _load_hf_base(parts: list[Any], path: str) -> None:
    """This rank's shards of a Hugging Face model's weights; the adapters are left as they are."""
    from pipeline.train.state.hf_weights import load_hf_weights, open_hf

    try:
        load_hf_weights(parts, open_hf(path, "LoRA base"), skip=is_adapter_name)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"LoRA base {path}: {e}") from None
    log.info("LoRA base: the Hugging Face model %s", path)


def adapter_only(state: dict[str, Any]) -> dict[str, Any]:
    """A training state (`model`, `optimizer`, ...) whose model part holds the adapters only."""
    model = {k: v for k, v in state["model"].items() if is_adapter_name(k)}
    return {**state, "model": model}


def lora_metadata(cfg: TrainConfig, base: BaseRecord) -> dict[str, Any]:
    """What an adapter checkpoint records under `lora`: the adapter settings and the base."""
    spec = lora_spec(cfg)
    return {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "targets": list(spec.targets),
        "base_dtype": cfg.lora.base_dtype,
        "base": asdict(base),
    }


class LoRAState:
    """LoRA's `run_state.StateAdapter`: checkpoints hold the adapters and their optimizer state;
    the frozen base is found (`find_base`), read (`load_base`) and recorded (`lora_metadata`)."""

    def __init__(
        self, cfg: TrainConfig, model: Any, parts: list[Any], process_group: Any | None = None
    ) -> None:
        self.cfg, self.model, self.parts, self.process_group = cfg, model, parts, process_group
        self.base: BaseRecord | None = None
        """The base `load_base` read (None before)."""

    def filter_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The adapters of the model part; everything else as it is."""
        return adapter_only(state)

    def load_base(self, found: FoundCheckpoint | None, hf_start: Any | None) -> bool:
        """Find and read the frozen base; True when `found` holds adapters to resume."""
        self.base, load_is_base = find_base(self.cfg, found, hf_start, self.process_group)
        if found is not None and not load_is_base and "lora" not in found.metadata:
            raise ConfigError(
                f"--load {self.cfg.checkpoint.load} holds a full checkpoint while lora.base names "
                "the base: with --lora, --load takes the base or an adapter checkpoint"
            )
        load_base(self.model, self.parts, self.base, self.cfg, self.process_group)
        return found is not None and not load_is_base

    def metadata(self) -> dict[str, Any]:
        """`{"lora": ...}`: the adapter settings and the base (see `lora_metadata`)."""
        return {"lora": lora_metadata(self.cfg, self.base)} if self.base is not None else {}
