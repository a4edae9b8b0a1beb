"""`Trainer`: builds a run (one device, or any parallel layout over processes) from a
`TrainConfig` and trains it.

Build order (docs/architecture.md), each step a function returning what it built: the layout
(`build_layout`: process group, the config validated once for the world size, meshes) -> seed
-> model options and FP8 backend -> the model (`build_model`: on `meta`, this rank's pipeline
stages, `parallelize` each, `to_empty`, initialised as one device would) -> optimizer and
scheduler -> data -> checkpoints and resume -> loaders -> run directory and metrics. `train` is
the loop, `train_step` (in `train_step.py`) one step, whose forward and backward work a step
runner does (`step_runner.py`: the whole model, or this rank's pipeline stages).

Parallel runs (launched by torchrun, `pipe train --nproc-per-node N`): each data-parallel rank
loads its slice of each global batch and each context-parallel rank keeps its chunks of every
sequence (`ParallelDims.shard_batch`); the step divides by the global token count and reports
the global loss; checkpoints are written by all ranks (DCP, DTensor shards under the
single-device names, so they load under any other layout) and only rank 0 writes logs and
metrics.

Between log steps nothing waits for the device: each step's loss, gradient norm and skip flag
stay tensors and are read together at the next log step, where skipped steps are counted, the
learning rate is held back for them and the divergence guard is checked.

Resuming restores weights, optimizer, scheduler, RNG states, the iteration and the consumed
sample counts, and the loaders restart from those counts, so on a CPU a resumed run repeats an
uninterrupted one bit for bit.

`--load HF_DIR` (a Hugging Face model directory) starts from its weights at iteration 0 with a
fresh optimizer (`hf_weights.py`), records its tokenizer and Hugging Face settings in every
checkpoint, and saves to `checkpoint.save`: once that holds a checkpoint, the same command
resumes from it instead (a requeued job continues). `checkpoint.save_hf` also writes the model
as a Hugging Face directory, `<save>/hf/iter_XXXXXXX`, at the end of the run or with every
checkpoint (not with the save a stop signal makes: that one must be quick).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.checkpoint import (
    CheckpointManager,
    load,
    load_model_and_optimizer_state,
    model_and_optimizer_state,
)
from pipeline.common.progress import terminal_bar
from pipeline.common.quiet import quiet_dcp
from pipeline.core.model.flavors import flops_per_token
from pipeline.core.parallel.dims import ParallelDims
from pipeline.train import lora_run, train_data
from pipeline.train.checkpoint_model import check_checkpoint_model, is_hf_directory
from pipeline.train.config import ConfigError, TrainConfig
from pipeline.train.config_loader import save_config_toml
from pipeline.train.guards import MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteStop, StopSignals
from pipeline.train.layout import build_layout, resolve_device
from pipeline.train.loop_state import LogWindow, LoopState, TrainResult
from pipeline.train.metrics import MetricsLogger, router_statistics
from pipeline.train.model_build import build_fp8_backend, build_model, model_options
from pipeline.train.model_parts import model_parts
from pipeline.train.optimizers import build_optimizer
from pipeline.train.optimizers.lr_scheduler import build_scheduler
from pipeline.train.perf import memory_gib, peak_tflops
from pipeline.train.samples import TrainingSamples, sample_tokenizer_path
from pipeline.train.step_runner import Batch, LocalStepRunner, evaluation_mode
from pipeline.train.train_step import StepResult, autocast_context, batch_to_device, train_step

__all__ = ["TrainResult", "Trainer", "seed_everything"]

log = logging.getLogger("pipeline.train")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, numpy and torch (all devices); with `deterministic`, refuse
    nondeterministic torch kernels (used on CPU, where resumed runs must match bit for bit)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def micro_batches_per_step(cfg: TrainConfig, layout: ParallelDims) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step (gradient accumulation)."""
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


class Trainer:
    """A training run on one device or a parallel layout over processes; see the module
    docstring."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        load_iteration: int | None = None,
        max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
        console: bool = True,
    ) -> None:
        self.cfg = cfg
        self.layout, self.device = build_layout(cfg, resolve_device(cfg.training.device))
        self.num_micro_batches = micro_batches_per_step(cfg, self.layout)
        seed_everything(cfg.training.seed, deterministic=self.device.type == "cpu")
        check_checkpoint_model(cfg, load_iteration)  # before anything is built or read
        self.model_config = cfg.model_config()
        options = model_options(cfg, self.layout, self.device, self.num_micro_batches)
        self.fp8 = build_fp8_backend(cfg, self.layout, self.device)
        built = build_model(
            cfg, self.model_config, options, self.layout, self.device, self.fp8,
            self.num_micro_batches,
        )  # fmt: skip
        self.model, self.step_runner, self.parts = built.model, built.runner, built.parts
        self.hf_start = self._open_hf_start()
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        data = train_data.build_run_data(cfg, self.model_config)
        self.tokenizer, self.datasets = data.tokenizer, data.datasets
        self.eod_for_documents = data.eod_for_documents
        if self.rank == 0 and (note := train_data.long_conversations(cfg, self.datasets)):
            log.warning(note)
        self.iteration = 0
        self.consumed = {"train": 0, "valid": 0}
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.diverged_at: int | None = None
        self.hf_saved_at: int | None = None
        self.run_dir = Path(cfg.logging.run_dir)
        self.process_group = self.layout.world_group
        self.checkpoints = self._build_checkpointing()
        self.lora_base: lora_run.BaseRecord | None = None
        self._resume(load_iteration)
        self.autocast = autocast_context(self.device, cfg.training.dtype, self.fp8)
        self.dpo = self._setup_dpo(options) if cfg.data.kind == "dpo" else None
        self.train_loader = self._build_loader(0, "train")
        self.valid_loader = self._build_loader(1, "valid")
        self._valid_iterator: Iterator[Any] | None = None
        self._evaluated_at: int | None = None
        self.metrics = self._build_logging(console)
        self.samples = self._build_samples()
        sides = 2 if cfg.data.kind == "dpo" else 1  # a DPO sample is a pair of sequences
        self.tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_length * sides
        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_length)
        self.peak_tflops = peak_tflops(self.device)

    # ---- building -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.layout.rank

    def _after_optimizer_step(self) -> None:
        if self.fp8 is not None:
            self.fp8.after_optimizer_step(model_parts(self.model))

    def _build_loader(self, split: int, name: str) -> Any:
        """This data-parallel rank's resumable loader of one split (None without data)."""
        return train_data.build_loader(
            self.datasets[split], self.cfg, self.consumed[name], self.layout.dp_rank, self.layout.dp
        )

    def _setup_dpo(self, options: Any) -> Any:
        """The DPO loss as the step runner's objective, with its reference (pipeline.train.dpo):
        a frozen second model holding the starting weights, the base itself in a LoRA run (its
        adapters left out), or their log-probabilities computed once now and stored next to the
        data (`dpo.precompute_reference`)."""
        from pipeline.train import dpo

        cfg = self.cfg
        if self.iteration > 0:
            raise ConfigError(
                "resuming a DPO run is not supported yet: its reference (the weights it started "
                "from) is no longer what checkpoint.load holds; start again from those weights"
            )
        reference = None
        if cfg.dpo.precompute_reference:
            key = dpo.start_key(cfg, self.model_config)
            members = dpo.preference_members(self.datasets)
            dpo.precompute_reference(
                self.model, members, key, self.layout, self.device, self.autocast,
                cfg.training.micro_batch_size,
            )  # fmt: skip
        elif cfg.lora.enabled:  # the frozen base is the reference: no second model
            reference = dpo.BaseOfLoRA(self.model)
        else:
            built = build_model(
                cfg, self.model_config, options, self.layout, self.device, self.fp8,
                self.num_micro_batches,
            )  # fmt: skip
            built.model.load_state_dict(self.model.state_dict())
            reference = dpo.freeze(built.model)
        loss = dpo.build_dpo_loss(cfg, reference)
        self.step_runner = LocalStepRunner(self.model, loss)
        return loss

    def _open_hf_start(self) -> Any:
        """The Hugging Face model `checkpoint.load` names (an `HFSource`), or None."""
        load = self.cfg.checkpoint.load
        if load is None or not is_hf_directory(load):
            return None
        from pipeline.weights.hf_reader import HFSource

        try:
            return HFSource(load)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.load {load}: {' '.join(str(e).split())}") from None

    def _build_checkpointing(self) -> CheckpointManager:
        c = self.cfg.checkpoint
        save_dir = Path(c.save) if c.save else self.run_dir / "checkpoints"
        return CheckpointManager(
            save_dir,
            keep_last=c.keep_last or None,
            async_save=c.async_save,
            load_dir=save_dir if self.hf_start is not None else c.load,
            process_group=self.process_group,
            verify_checksums=c.verify_checksums,
            save_interval=c.save_interval,
        )

    def _build_logging(self, console: bool) -> MetricsLogger:
        """The run directory with the resolved `config.toml`, and the metrics logger."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            save_config_toml(self.cfg, self.run_dir / "config.toml")
        lg = self.cfg.logging
        return MetricsLogger(
            self.run_dir,
            tensorboard=lg.tensorboard,
            wandb_project=lg.wandb_project if lg.wandb else None,
            config=self.cfg.to_dict(),
            rank=self.rank,
            console=console,
        )

    def _build_samples(self) -> TrainingSamples | None:
        t = self.cfg.training
        if not (t.sample_prompts and t.sample_interval):
            return None
        path = sample_tokenizer_path(self.cfg.data.tokenizer, self.tokenizer.fingerprint)
        chat = self.cfg.data.kind in ("sft", "dpo")  # prompts asked as a user's turn
        return TrainingSamples(t.sample_prompts, path, t.sample_tokens, chat=chat)

    def log_samples(self) -> dict[str, str]:
        """Greedy continuations of `training.sample_prompts`, logged with split "sample"."""
        with self.autocast:
            texts = self.samples.generate(self.model, self.device, self.layout.world_size == 1)
        if texts:
            self.metrics.log(self.iteration, texts, split="sample")
        return texts

    # ---- checkpoints --------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state = {
            **model_and_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler,
        }
        return lora_run.adapter_only(state) if self.cfg.lora.enabled else state

    def _metadata(self) -> dict[str, Any]:
        d = self.cfg.data
        return {
            "iteration": self.iteration,
            "consumed_samples": self.consumed["train"],
            "consumed_valid_samples": self.consumed["valid"],
            "skipped_iterations": self.guard.total,
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
            **(
                {"lora": lora_run.lora_metadata(self.cfg, self.lora_base)} if self.lora_base else {}
            ),
        }

    def _tokenizer_record(self) -> dict[str, Any]:
        """The data's tokenizer ids, with the Hugging Face model's tokenizer files when the run
        started from one (`hf_weights.tokenizer_record`)."""
        from pipeline.train.hf_weights import tokenizer_record

        return tokenizer_record(self.tokenizer.to_metadata(), self.hf_start)

    def _hf_start_record(self) -> dict[str, Any]:
        from pipeline.train.hf_weights import start_record

        return start_record(self.hf_start)

    def save_checkpoint(self) -> Path:
        """Save the full training state at the current iteration; returns its directory.

        With `checkpoint.async_save` the call returns once the state is staged in memory and
        the files are written and committed in the background while training goes on;
        `_collect_background_save` reports (or waits for) the commit."""
        self._collect_background_save(block=True)  # one background save at a time
        self.checkpoints.save(self.iteration, self._state(), self._metadata())
        path = self.checkpoints.save_dir / f"iter_{self.iteration:07d}"
        if self.checkpoints.pending is None:
            log.info("saved checkpoint %s", path)
        else:
            log.info("saving checkpoint %s in the background", path)
        return path

    def _collect_background_save(self, block: bool = False) -> None:
        """Report a background save that has committed (with `block`, wait for it first);
        its failure is raised here."""
        pending = self.checkpoints.pending
        if pending is None or not (block or pending.done()):
            return
        self.checkpoints.wait()
        log.info(
            "saved checkpoint %s (written in the background in %.1f s)",
            pending.directory, pending.seconds,
        )  # fmt: skip

    def _finish_background_save_after_error(self) -> None:
        """On the way out of a failed run: let a background save commit, so the newest
        resumable point survives; its own failure is logged, not raised over the first."""
        try:
            self._collect_background_save(block=True)
        except Exception as error:  # the run's error is the one to report
            log.error("the background checkpoint save failed too: %s", error)

    def _resume(self, iteration: int | None) -> None:
        """Resume from `checkpoint.load` (everything) or, with `finetune`, take its weights only.

        A load directory without a checkpoint starts from scratch, so a requeued job can always
        pass the same `--load` as `--save`.
        """
        c = self.cfg.checkpoint
        found = c.load is not None and (
            self.checkpoints.has_checkpoint() or iteration is not None or _is_iter_dir(c.load)
        )
        if self.cfg.lora.enabled and self.hf_start is not None:
            raise ConfigError(
                f"--lora with --load {c.load} (a Hugging Face directory): convert it first "
                "(pipe convert DIR --from hf --output CKPT) and pass --lora-base CKPT"
            )
        if self.cfg.lora.enabled and not self._load_lora_base(iteration if found else None, found):
            return
        if c.load is None:
            return
        if self.hf_start is not None:
            if not found:
                self._start_from_hf()
                return
            log.info("%s holds a checkpoint: resuming it", self.checkpoints.load_dir)
        elif not found:
            log.info("no checkpoint in %s yet: starting from scratch", c.load)
            return
        if c.finetune and self.hf_start is None:
            state = model_and_optimizer_state(self.model)
            load(
                c.load, iteration, state, restore_rng=False, process_group=self.process_group,
                verify_checksums=c.verify_checksums,
            )  # fmt: skip
            load_model_and_optimizer_state(self.model, None, state)
            log.info("finetuning from the weights in %s (iteration 0)", c.load)
            return
        state = self._state()
        with quiet_dcp():
            meta = self.checkpoints.load(state, iteration)
        # A LoRA checkpoint holds the adapters only; the base was read from its own checkpoint.
        strict = not self.cfg.lora.enabled
        load_model_and_optimizer_state(self.model, self.optimizer, state, strict=strict)
        self.iteration = int(meta["iteration"])
        self.consumed = {
            "train": int(meta.get("consumed_samples", 0)),
            "valid": int(meta.get("consumed_valid_samples", 0)),
        }
        self.guard.total = int(meta.get("skipped_iterations", 0))
        log.info("resumed from %s at iteration %d", self.checkpoints.load_dir, self.iteration)

    def _start_from_hf(self) -> None:
        """This rank's shards of the Hugging Face model's weights; iteration 0, fresh optimizer."""
        from pipeline.train.hf_weights import load_hf_weights, tokenizer_mismatch

        try:
            load_hf_weights(self.parts, self.hf_start)
        except ConfigError:
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.load {self.hf_start.directory}: {e}") from None
        log.info("starting from the Hugging Face model %s (iteration 0)", self.hf_start.directory)
        mismatch = tokenizer_mismatch(
            {"fingerprint": self.tokenizer.fingerprint}, self.hf_start.metadata.get("tokenizer")
        )
        if mismatch is not None:
            log.warning("%s (%s): check data.blend", mismatch, self.hf_start.directory)

    def save_hf(self) -> Path:
        """Write the model at the current iteration as a Hugging Face directory (every rank
        calls this; the first writes); older ones whose checkpoint was rotated away go."""
        from pipeline.train.hf_weights import hf_directory, prune_rotated, write_hf_from_model

        path = hf_directory(self.checkpoints.save_dir, self.iteration)
        with torch.no_grad():
            write_hf_from_model(
                self.parts, self.model_config, self.layout, self._hf_source_metadata(), path,
                self.cfg.checkpoint.save_hf_dtype,
            )  # fmt: skip
        self.hf_saved_at = self.iteration
        if self.rank == 0:
            log.info("saved Hugging Face model %s", path)
            if self.cfg.checkpoint.keep_last:
                prune_rotated(self.checkpoints.save_dir, self.iteration)
        return path

    def _hf_source_metadata(self) -> dict[str, Any]:
        """What the Hugging Face writer reads from a source's metadata: the tokenizer record
        and, when the run started from one, the Hugging Face model's settings."""
        metadata = {"tokenizer": self._tokenizer_record()}
        return metadata | self._hf_start_record().get("hf", {})

    def _save_hf_if_wanted(self, final: bool) -> None:
        mode = self.cfg.checkpoint.save_hf
        wanted = mode == "every" or (mode == "final" and final)
        if wanted and self.hf_saved_at != self.iteration:
            self.save_hf()

    def _load_lora_base(self, iteration: int | None, found: bool) -> bool:
        """A LoRA run: find and read its frozen base (`lora_run`); True when `checkpoint.load`
        holds adapters to resume, False when there is nothing more to load."""
        from pipeline.checkpoint.loader import resolve_checkpoint

        c = self.cfg.checkpoint
        loaded = None
        if found:
            loaded = resolve_checkpoint(c.load, iteration)[1].get("metadata") or {}
        self.lora_base, load_is_base = lora_run.find_base(self.cfg, loaded)
        if loaded is not None and not load_is_base and "lora" not in loaded:
            raise ConfigError(
                f"--load {c.load} holds a full checkpoint while lora.base names the base: "
                "with --lora, --load takes the base or an adapter checkpoint"
            )
        lora_run.load_base(self.model, self.lora_base, self.cfg, self.process_group)
        return found and not load_is_base

    # ---- the loop -----------------------------------------------------------------------------

    def next_global_batch(self, iterator: Iterator[Any]) -> list[Batch]:
        """This rank's micro-batches of the next global batch (its context-parallel chunks)."""
        return [
            self.layout.shard_batch(
                batch_to_device(next(iterator), self.device, self.eod_for_documents)
            )
            for _ in range(self.num_micro_batches)
        ]

    def train_one_step(self, iterator: Iterator[Any]) -> StepResult:
        """One optimizer step on the next global batch of `iterator` (forward, backward, clip,
        step, FP8 post-step work), without logging or checkpointing; benchmarks time this."""
        return train_step(
            self.model, self.optimizer, self.scheduler, self.next_global_batch(iterator),
            clip_grad=self.cfg.optimizer.clip_grad, autocast=self.autocast,
            dp_group=self.layout.batch_group, runner=self.step_runner,
            pp_group=self.layout.pipeline_group, after_optimizer_step=self._after_optimizer_step,
        )  # fmt: skip

    def train(self) -> TrainResult:
        """Train to `training.iters`; returns how it ended. Raises `NonFiniteStop` (after saving)
        when `max_consecutive_skips` steps in a row had a NaN/Inf loss or gradient norm (seen at
        the log step that reads them). Periodic saves run in the background with
        `checkpoint.async_save`; the next save, a signal, the end of training and an error all
        wait for such a save to commit."""
        t = self.cfg.training
        loop = LoopState(TrainResult(self.iteration, "finished"), bar=self._progress_bar())
        iterator = iter(self.train_loader)
        try:
            with StopSignals() as signals:
                while self.iteration < t.iters:
                    self._timed_step(iterator, loop)
                    if self._due(t.log_interval) or self.iteration == t.iters:
                        self._log_window(loop)
                    if self._due(t.eval_interval):
                        self.run_evaluation()
                    if self.samples is not None and self._due(t.sample_interval):
                        self.log_samples()
                    if self._save_if_due(loop, signals):
                        break
                if loop.result.stop_reason == "finished":
                    self._finish(loop)
                self._collect_background_save(block=True)  # a resumable point before exiting
        except Exception:
            self._finish_background_save_after_error()
            raise
        finally:
            loop.close()
            self.metrics.close()
        loop.result.iteration, loop.result.skipped = self.iteration, self.guard.total
        return loop.result

    def _due(self, interval: int) -> bool:
        """Whether the current iteration is a multiple of `interval` (0: never)."""
        return bool(interval) and self.iteration % interval == 0

    def _timed_step(self, iterator: Iterator[Any], loop: LoopState) -> None:
        """Take one step, note it (unread) in the log window, and count it."""
        start = time.perf_counter()
        step = self.train_one_step(iterator)
        loop.window.add(step, self.tokens_per_step, time.perf_counter() - start)
        self.iteration += 1
        self.consumed["train"] += self.cfg.training.global_batch_size
        if loop.bar is not None:
            loop.bar.update(1)

    def _log_window(self, loop: LoopState) -> None:
        """A log step: read the window's steps, log them, start a new window; stop (after
        saving) when too many steps in a row were skipped."""
        self._account(loop.window, loop.result)
        self._log_train(loop.window, loop.bar)
        loop.window = LogWindow()
        self._stop_if_diverged()

    def _save_if_due(self, loop: LoopState, signals: StopSignals) -> bool:
        """Save when the checkpoint manager says the iteration is due or a stop signal came
        (the window's steps read first, so skip counts and the lr go into the checkpoint);
        collect a background save that has committed. True: a signal, stop now."""
        stop, due = signals.received is not None, self.checkpoints.save_due(self.iteration)
        if stop or due:
            self._account(loop.window, loop.result)
        self._collect_background_save()
        if stop:
            loop.result.stop_reason = signals.name or "signal"
            log.warning("%s received: saving and exiting", loop.result.stop_reason)
        if stop or due:
            loop.result.checkpoint = self.save_checkpoint()
        if due and not stop:
            self._save_hf_if_wanted(final=False)
        return stop

    def _finish(self, loop: LoopState) -> None:
        """The end of a finished run: evaluate and save the last iteration unless done already."""
        if self.cfg.training.eval_interval and self._evaluated_at != self.iteration:
            self.run_evaluation()
        if not self.checkpoints.saved(self.iteration):
            loop.result.checkpoint = self.save_checkpoint()
        self._save_hf_if_wanted(final=True)

    def _progress_bar(self) -> Any:
        """A terminal progress bar on rank 0 (None elsewhere or off a terminal)."""
        if self.rank != 0:
            return None
        t = self.cfg.training
        return terminal_bar(t.iters, desc="train", initial=self.iteration, unit="it", leave=False)

    def _account(self, window: LogWindow, result: TrainResult) -> None:
        """Read the window's unread steps from the device (the one host sync of a log step):
        record each loss, count and report skipped steps and hold the learning rate back for
        them (the scheduler stepped for every step on the host)."""
        first = self.iteration - len(window.pending) + 1
        skipped_now = 0
        for offset, (loss, norm, skipped) in enumerate(window.read_pending()):
            iteration = first + offset
            result.losses[iteration] = loss
            self.guard.record(not skipped)
            self.diverged_at = self.diverged_at or (iteration if self.guard.should_stop else None)
            if skipped:
                skipped_now += 1
                log.warning(
                    "iteration %d: non-finite loss %s or grad norm %s: step skipped "
                    "(%d in a row, %d in all)", iteration, loss, norm,
                    self.guard.consecutive, self.guard.total,
                )  # fmt: skip
        self.scheduler.rewind(skipped_now)

    def _stop_if_diverged(self) -> None:
        """After too many non-finite steps in a row: save, then raise `NonFiniteStop`."""
        if self.diverged_at is None:
            return
        path = self.save_checkpoint()
        self._collect_background_save(block=True)
        first = self.diverged_at - self.guard.max_consecutive + 1
        raise NonFiniteStop(
            f"stopping at iteration {self.iteration}: the {self.guard.max_consecutive} steps "
            f"from iteration {first} had a NaN/Inf loss or gradient norm; state saved in {path}"
        )

    def _log_train(self, window: LogWindow, bar: Any) -> None:
        seconds = max(window.seconds, 1e-9)
        tflops = self.flops_per_token * window.tokens / seconds / 1e12
        metrics = {
            "loss": float(np.mean(window.losses)) if window.losses else math.nan,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(np.mean(window.grad_norms)) if window.grad_norms else math.nan,
            "tokens_per_s": window.tokens / seconds,
            "tflops": tflops,
            "mem_gib": memory_gib(self.device),
            "skipped": self.guard.total,
            "iters": self.cfg.training.iters,
            **router_statistics(self.model),
        }
        if self.peak_tflops is not None:
            metrics["mfu"] = tflops / self.peak_tflops
        if self.dpo is not None:
            metrics |= self.dpo.take_stats(self.layout.batch_group, self._reduce_device())
        self.metrics.log(self.iteration, metrics)
        if bar is not None:
            bar.set_postfix_str(f"loss {metrics['loss']:.4f}", refresh=False)

    def run_evaluation(self) -> float | None:
        """`eval_iters` global batches of the valid split; logs and returns the loss."""
        self._evaluated_at = self.iteration
        if self.valid_loader is None or self.cfg.training.eval_iters == 0:
            return None
        if self._valid_iterator is None:
            self._valid_iterator = iter(self.valid_loader)
        self.consumed["valid"] += self.cfg.training.eval_iters * self.cfg.training.global_batch_size
        loss_sum, tokens = 0.0, 0.0
        held = self.dpo.swap_stats() if self.dpo is not None else None
        for _ in range(self.cfg.training.eval_iters):
            micro_batches = self.next_global_batch(self._valid_iterator)
            with evaluation_mode(self.model):
                batch_sum, batch_tokens = self.step_runner.evaluate(micro_batches, self.autocast)
            loss_sum, tokens = loss_sum + float(batch_sum), tokens + batch_tokens
        loss = self._global_eval_loss(loss_sum, tokens)
        if self.dpo is not None:  # a mean over pairs: no perplexity
            figures = self.dpo.take_stats(self.layout.batch_group, self._reduce_device())
            self.dpo.swap_stats(held)
            self.metrics.log(self.iteration, {"loss": loss, **figures}, split="valid")
            return loss
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.metrics.log(self.iteration, {"loss": loss, "ppl": ppl}, split="valid")
        return loss

    def _reduce_device(self) -> torch.device:
        """Where small all-reduces run: the device under NCCL, else the CPU."""
        on_gpu = dist.is_initialized() and dist.get_backend() == "nccl"
        return self.device if on_gpu else torch.device("cpu")

    def _global_eval_loss(self, loss_sum: float, tokens: float) -> float:
        """The token-normalised loss over every rank's evaluation batches: token counts are
        summed over the ranks holding different tokens, loss sums also over pipeline stages
        (only the last one has them)."""
        sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        batch_group, pipeline_group = self.layout.batch_group, self.layout.pipeline_group
        if batch_group is not None or pipeline_group is not None:
            on_gpu = dist.get_backend() == "nccl"
            sums = sums.to(self.device if on_gpu else "cpu")
            if batch_group is not None:
                dist.all_reduce(sums, group=batch_group)
            if pipeline_group is not None:
                dist.all_reduce(sums[:1], group=pipeline_group)
        return float(sums[0] / sums[1].clamp(min=1.0))


def _is_iter_dir(path: str) -> bool:
    return (Path(path) / "pipe_metadata.json").is_file()
