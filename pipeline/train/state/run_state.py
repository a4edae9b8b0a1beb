"""`RunState`: what a training run keeps on disk and gets back from it.

One component owns a run's checkpoints, the way torchtitan's checkpointer does: the
`CheckpointManager` (periodic, background and final saves, rotation), the state a checkpoint
holds and the metadata recorded beside it, resuming (everything, `--finetune`'s weights only,
or a first start from a Hugging Face directory, `--load HF_DIR`), and `checkpoint.save_hf`.
The trainer keeps its counters and hands them over as a `Progress` to save; `resume` gives
them back.

Two hooks let other parts of a run shape what is saved and checked without this module
knowing them:

- a `StateAdapter` for runs whose checkpoints hold part of the model: it filters the state
  saved, reads the rest (a frozen base) before a resume, and adds its record to the metadata.
  LoRA's is `lora_run.LoRAState`: adapters only, the base from a pipe checkpoint or a Hugging
  Face directory, recorded with its checksum.
- `RunRecord`s: each records a small dict under its name in every checkpoint's metadata and
  checks, on a resume, that the run still matches what it recorded (one `ConfigError` line if
  not).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pipeline.checkpoint import (
    CheckpointManager,
    load,
    load_model_and_optimizer_state,
    model_and_optimizer_state,
)
from pipeline.common.quiet import quiet_dcp
from pipeline.train.config.schema import ConfigError
from pipeline.train.state.checkpoint_model import is_hf_directory

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pipeline.core.model.config import ModelConfig
    from pipeline.core.parallel.dims import ParallelDims
    from pipeline.train.config.schema import TrainConfig

__all__ = ["FoundCheckpoint", "Progress", "RunRecord", "RunState", "StateAdapter"]

log = logging.getLogger("pipeline.train")


@dataclass
class Progress:
    """How far a run has come: what a checkpoint saves of the loop and a resume restores."""

    iteration: int = 0
    consumed_train: int = 0
    """Training samples taken so far (the train loader restarts after them)."""
    consumed_valid: int = 0
    """Validation samples taken so far."""
    skipped: int = 0
    """Steps skipped for a non-finite loss or gradient norm, in all."""
    loss_scaler: dict[str, Any] | None = None
    """fp16: the loss scaler's state (`LossScaler.state_dict`); None without one."""


@dataclass(frozen=True)
class FoundCheckpoint:
    """The checkpoint a run's `checkpoint.load` leads to: its `iter_` directory and the metadata
    saved with it (`iteration` always set)."""

    directory: Path
    metadata: dict[str, Any]


class StateAdapter(Protocol):
    """A run whose checkpoints hold part of its model (LoRA: the adapters; the frozen base is
    read from its own place). `RunState` calls it at these points only."""

    def filter_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The part of the training state (`model`, `optimizer`, ...) a checkpoint holds."""
        ...

    def load_base(self, found: FoundCheckpoint | None, hf_start: Any | None) -> bool:
        """Before a resume: read what checkpoints do not hold into the model. `found`: the
        checkpoint `checkpoint.load` leads to, if any; `hf_start`: the Hugging Face model
        `checkpoint.load` names, if it names one. True when `found` holds this run's own
        state to resume; False when there is nothing more to load (it was the base, or none)."""
        ...

    def metadata(self) -> dict[str, Any]:
        """Keys added to every checkpoint's metadata (what the base is, to find and check it)."""
        ...


class RunRecord(Protocol):
    """Something a run records in its checkpoints and must still match when resumed (DPO's
    reference, for one). Its record is saved under `metadata[name]`."""

    name: str

    def record(self) -> dict[str, Any]:
        """What to save now (JSON values)."""
        ...

    def check(self, recorded: dict[str, Any] | None, resuming: bool) -> None:
        """Compare with what the checkpoint the run starts from recorded (None: nothing; a new
        run, or a checkpoint from before this record). `resuming`: the run continues that
        checkpoint (False: a fresh start, `--finetune`, or a LoRA base). Raises `ConfigError`,
        one line, when the run no longer matches."""
        ...


def open_hf_start(load: str | None) -> Any:
    """The Hugging Face model `checkpoint.load` names (an `HFSource`), or None."""
    if load is None or not is_hf_directory(load):
        return None
    from pipeline.train.state.hf_weights import open_hf

    return open_hf(load, "checkpoint.load")


def _is_iter_dir(path: str) -> bool:
    return (Path(path) / "pipe_metadata.json").is_file()


class RunState:
    """A run's checkpoints: save, resume and the Hugging Face save (see the module docstring).

    `model` is the whole (possibly parallelised) model, `parts` what `model_parts` gives (this
    rank's pipeline stages, or the model); `tokenizer` the data's, whose ids are recorded."""

    def __init__(
        self,
        cfg: TrainConfig,
        model_config: ModelConfig,
        layout: ParallelDims,
        *,
        model: Any,
        parts: list[Any],
        optimizer: Any,
        scheduler: Any,
        tokenizer: Any,
        adapter: StateAdapter | None = None,
        records: Sequence[RunRecord] = (),
    ) -> None:
        self.cfg, self.model_config, self.layout = cfg, model_config, layout
        self.model, self.parts, self.optimizer, self.scheduler = model, parts, optimizer, scheduler
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.records = list(records)
        self.hf_start = open_hf_start(cfg.checkpoint.load)
        self.checkpoints = self._build_manager()
        self.hf_saved_at: int | None = None
        """The iteration `save_hf` last wrote (None before it did)."""

    def _build_manager(self) -> CheckpointManager:
        c = self.cfg.checkpoint
        save_dir = Path(c.save) if c.save else Path(self.cfg.logging.run_dir) / "checkpoints"
        return CheckpointManager(
            save_dir,
            keep_last=c.keep_last or None,
            async_save=c.async_save,
            load_dir=save_dir if self.hf_start is not None else c.load,
            process_group=self.layout.world_group,
            verify_checksums=c.verify_checksums,
            save_interval=c.save_interval if c.enable else 0,
        )

    # ---- what a checkpoint holds ----------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state = {
            **model_and_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler,
        }
        return self.adapter.filter_state(state) if self.adapter is not None else state

    def _metadata(self, progress: Progress) -> dict[str, Any]:
        d = self.cfg.data
        return {
            "iteration": progress.iteration,
            "consumed_samples": progress.consumed_train,
            "consumed_valid_samples": progress.consumed_valid,
            "skipped_iterations": progress.skipped,
            **({"loss_scaler": progress.loss_scaler} if progress.loss_scaler else {}),
            "config": self.cfg.to_dict(),
            "model": dataclasses.asdict(self.model_config),
            "data": {
                "kind": d.kind,
                "mock": d.mock,
                "blend": d.blend,
                "train_blend": d.train_blend,
                "valid_blend": d.valid_blend,
                "test_blend": d.test_blend,
                "split": d.split,
                "seq_length": d.seq_length,
            },
            "tokenizer": self._tokenizer_record(),
            "layout": self.layout.describe(),
            **self._hf_start_record(),
            **(self.adapter.metadata() if self.adapter is not None else {}),
            **{record.name: record.record() for record in self.records},
        }

    def _tokenizer_record(self) -> dict[str, Any]:
        """The data's tokenizer ids, with the Hugging Face model's tokenizer files when the run
        started from one (`hf_weights.tokenizer_record`)."""
        from pipeline.train.state.hf_weights import tokenizer_record

        return tokenizer_record(self.tokenizer.to_metadata(), self.hf_start)

    def _hf_start_record(self) -> dict[str, Any]:
        from pipeline.train.state.hf_weights import start_record

        return start_record(self.hf_start)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, progress: Progress) -> Path | None:
        """Save the full training state at `progress`; returns its directory (None, saving
        nothing, with `checkpoint.enable` false).

        With `checkpoint.async_save` the call returns once the state is staged in memory and
        the files are written and committed in the background while training goes on;
        `collect_background_save` reports (or waits for) the commit."""
        if not self.cfg.checkpoint.enable:
            return None
        self.collect_background_save(block=True)  # one background save at a time
        self.checkpoints.save(progress.iteration, self._state(), self._metadata(progress))
        path = self.checkpoints.save_dir / f"iter_{progress.iteration:07d}"
        if self.checkpoints.pending is None:
            log.info("saved checkpoint %s", path)
        else:
            log.info("saving checkpoint %s in the background", path)
        return path

    def collect_background_save(self, block: bool = False) -> None:
        """Report a background save that has committed (with `block`, wait for it first);
        its failure is raised here."""
        pending = self.checkpoints.pending
        if pending is None or not (block or pending.done()):
            return
        self.checkpoints.wait()
        log.info(
            "saved checkpoint %s (written in the background in %.1f s)",
            pending.directory,
            pending.seconds,
        )

    def finish_background_save_after_error(self) -> None:
        """On the way out of a failed run: let a background save commit, so the newest
        resumable point survives; its own failure is logged, not raised over the first."""
        try:
            self.collect_background_save(block=True)
        except Exception as error:  # the run's error is the one to report
            log.error("the background checkpoint save failed too: %s", error)

    def save_hf(self, iteration: int) -> Path:
        """Write the model at `iteration` as a Hugging Face directory (every rank calls this;
        the first writes); older ones whose checkpoint was rotated away go."""
        from pipeline.train.state.hf_weights import hf_directory, prune_rotated, write_hf_from_model

        path = hf_directory(self.checkpoints.save_dir, iteration)
        with torch.no_grad():
            write_hf_from_model(
                self.parts,
                self.model_config,
                self.layout,
                self._hf_source_metadata(),
                path,
                self.cfg.checkpoint.save_hf_dtype,
            )
        self.hf_saved_at = iteration
        if self.layout.rank == 0:
            log.info("saved Hugging Face model %s", path)
            if self.cfg.checkpoint.keep_last:
                prune_rotated(self.checkpoints.save_dir, iteration)
        return path

    def _hf_source_metadata(self) -> dict[str, Any]:
        """What the Hugging Face writer reads from a source's metadata: the tokenizer record
        and, when the run started from one, the Hugging Face model's settings."""
        metadata = {"tokenizer": self._tokenizer_record()}
        return metadata | self._hf_start_record().get("hf", {})

    def save_hf_if_wanted(self, iteration: int, final: bool) -> None:
        """`save_hf` when `checkpoint.save_hf` asks for it now (`final`: the end of the run)
        and it has not written this iteration yet."""
        mode = self.cfg.checkpoint.save_hf
        wanted = mode == "every" or (mode == "final" and final)
        if wanted and self.hf_saved_at != iteration:
            self.save_hf(iteration)

    # ---- resuming -------------------------------------------------------------------------

    def resume(self, iteration: int | None) -> Progress:
        """Resume from `checkpoint.load` (everything) or, with `finetune`, take its weights only;
        start from the Hugging Face model it names; returns where the run stands.

        A load directory without a checkpoint starts from scratch, so a requeued job can always
        pass the same `--load` as `--save` (or the same `--load HF_DIR`: once the save directory
        holds a checkpoint, that is resumed).
        """
        c = self.cfg.checkpoint
        found = self._found(iteration)
        if self.adapter is not None and not self.adapter.load_base(found, self.hf_start):
            return self._started(found, from_hf=found is None and self.hf_start is not None)
        if c.load is None:
            return self._started(None)
        if self.hf_start is not None:
            if found is None:
                self._start_from_hf()
                return self._started(None, from_hf=True)
            log.info("%s holds a checkpoint: resuming it", self.checkpoints.load_dir)
        elif found is None:
            log.info("no checkpoint in %s yet: starting from scratch", c.load)
            return self._started(None)
        if c.finetune and self.hf_start is None:
            return self._finetune(found, iteration)
        return self._resume_all(found, iteration)

    def _found(self, iteration: int | None) -> FoundCheckpoint | None:
        """The checkpoint `checkpoint.load` leads to (in the save directory when it names a
        Hugging Face model), or None when there is none yet."""
        c = self.cfg.checkpoint
        if c.load is None or not (
            self.checkpoints.has_checkpoint() or iteration is not None or _is_iter_dir(c.load)
        ):
            return None
        from pipeline.checkpoint.loader import resolve_checkpoint

        directory, record = resolve_checkpoint(self.checkpoints.load_dir, iteration)
        metadata = dict(record.get("metadata") or {})
        metadata.setdefault("iteration", record.get("iteration"))
        return FoundCheckpoint(directory, metadata)

    def _started(self, found: FoundCheckpoint | None, from_hf: bool = False) -> Progress:
        """A run that starts at iteration 0 (from scratch, from weights or a base `found`)."""
        if from_hf:
            self._warn_on_other_tokenizer()
        self._check_records(found, resuming=False)
        return Progress()

    def _check_records(self, found: FoundCheckpoint | None, resuming: bool) -> None:
        recorded = found.metadata if found is not None else {}
        for record in self.records:
            record.check(recorded.get(record.name), resuming)

    def _start_from_hf(self) -> None:
        """This rank's shards of the Hugging Face model's weights; iteration 0, fresh optimizer."""
        from pipeline.train.state.hf_weights import load_hf_weights

        try:
            load_hf_weights(self.parts, self.hf_start)
        except ConfigError:
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.load {self.hf_start.directory}: {e}") from None
        log.info("starting from the Hugging Face model %s (iteration 0)", self.hf_start.directory)

    def _warn_on_other_tokenizer(self) -> None:
        """Warn when the data was tokenized with other vocabulary files than the model's."""
        from pipeline.train.state.hf_weights import tokenizer_mismatch

        mismatch = tokenizer_mismatch(
            {"fingerprint": self.tokenizer.fingerprint}, self.hf_start.metadata.get("tokenizer")
        )
        if mismatch is not None:
            log.warning("%s (%s): check data.blend", mismatch, self.hf_start.directory)

    def _finetune(self, found: FoundCheckpoint, iteration: int | None) -> Progress:
        """`--finetune`: the checkpoint's weights only, at iteration 0 with a fresh optimizer."""
        c = self.cfg.checkpoint
        self._check_records(found, resuming=False)
        state = model_and_optimizer_state(self.model)
        with quiet_dcp():
            load(
                c.load,
                iteration,
                state,
                restore_rng=False,
                process_group=self.layout.world_group,
                verify_checksums=c.verify_checksums,
            )
        load_model_and_optimizer_state(self.model, None, state)
        log.info("finetuning from the weights in %s (iteration 0)", c.load)
        return Progress()

    def _resume_all(self, found: FoundCheckpoint, iteration: int | None) -> Progress:
        """Everything back: weights, optimizer, scheduler, RNG states and the counters."""
        self._check_records(found, resuming=True)
        state = self._state()
        with quiet_dcp():
            meta = self.checkpoints.load(state, iteration)
        # An adapter's checkpoint holds part of the model; the rest was read by `load_base`.
        strict = self.adapter is None
        load_model_and_optimizer_state(self.model, self.optimizer, state, strict=strict)
        progress = Progress(
            iteration=int(meta["iteration"]),
            consumed_train=int(meta.get("consumed_samples", 0)),
            consumed_valid=int(meta.get("consumed_valid_samples", 0)),
            skipped=int(meta.get("skipped_iterations", 0)),
            loss_scaler=meta.get("loss_scaler"),
        )
        log.info("resumed from %s at iteration %d", self.checkpoints.load_dir, progress.iteration)
        return progress
