"""`Trainer`: builds a run (one device, or any parallel layout over processes) from a
`TrainConfig` and trains it.

Build order (docs/architecture.md), each step a function returning what it built: the layout
(`build_layout`: process group, the config validated once for the world size, meshes) -> the
objective -> seed -> FP8 backend -> the model (`build_model`: on `meta`, this rank's pipeline
stages, `parallelize` each, `to_empty`, initialised as one device would) -> optimizer and
scheduler -> data -> checkpoints and resume -> the objective's setup -> loaders -> metrics.
`train` is the loop, `train_step` one step, its forward and backward a step runner's.

Parallel runs (launched by torchrun, `pipe train --nproc-per-node N`): each data-parallel rank
loads its slice of each global batch and each context-parallel rank keeps its chunks of every
sequence (`ParallelDims.shard_batch`); the step divides by the objective's global count and
reports the global loss; checkpoints are written by all ranks (DCP, DTensor shards under the
single-device names, so they load under any other layout) and only rank 0 writes logs and
metrics.

Between log steps nothing waits for the device: each step's loss, gradient norm and skip flag
stay tensors, read at the next log step (skips counted, the learning rate held back for them).

The objective (`pipeline.train.objectives`, chosen by `data.kind`) is the one object the loop
asks about the loss: what a batch holds, what the loss is normalised by, its reference, its
metrics and checkpoint records; the loop names none. `training.skip_train` evaluates only.

Checkpoints are the run's `RunState` (`state/run_state.py`): saving, resuming, `--finetune`, the
start from a Hugging Face directory (`--load HF_DIR`), `checkpoint.save_hf`, and adapter-only
checkpoints through the adapters' hook (`state/adapters.py`). The trainer keeps the counters
(iteration, consumed samples, skipped steps) and hands them over as a `Progress`. Resuming
restores weights, optimizer, scheduler, RNG states and those counters, and the loaders restart
from the consumed counts, so on a CPU a resumed run repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.common.progress import terminal_bar
from pipeline.core.model.flavors import flops_per_token
from pipeline.core.parallel.fsdp import gather_parameters
from pipeline.train.assembly import train_data
from pipeline.train.assembly.layout import (
    build_layout,
    micro_batches_per_step,
    resolve_device,
    seed_everything,
    zero1_active,
)
from pipeline.train.assembly.model_build import build_fp8_backend, build_model, model_options
from pipeline.train.assembly.model_parts import model_parts
from pipeline.train.config.loader import save_config_toml
from pipeline.train.config.schema import TrainConfig
from pipeline.train.loop.guards import (
    MAX_CONSECUTIVE_SKIPS,
    NonFiniteGuard,
    NonFiniteStop,
    StopSignals,
)
from pipeline.train.loop.loop_state import LogWindow, LoopState, TrainResult
from pipeline.train.loop.step_runner import Batch, build_runner, prepare_micro_batches
from pipeline.train.loop.train_step import StepResult, autocast_context, global_mean, train_step
from pipeline.train.objectives import build_objective
from pipeline.train.objectives.base import evaluation_mode
from pipeline.train.optimizers import build_optimizer
from pipeline.train.optimizers.loss_scaler import build_loss_scaler
from pipeline.train.optimizers.lr_scheduler import build_scheduler
from pipeline.train.report.lm_eval_scores import build_lm_eval
from pipeline.train.report.metrics import MetricsLogger, router_statistics
from pipeline.train.report.perf import memory_gib, peak_tflops
from pipeline.train.report.samples import TrainingSamples, sample_tokenizer_path
from pipeline.train.state.adapters import state_adapter
from pipeline.train.state.checkpoint_model import check_checkpoint_model
from pipeline.train.state.run_state import Progress, RunState

__all__ = ["TrainResult", "Trainer"]

log = logging.getLogger("pipeline.train")


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
        self.objective = build_objective(cfg, layout=self.layout)
        self.num_micro_batches = micro_batches_per_step(cfg, self.layout)
        seed_everything(cfg.training.seed, deterministic=self.device.type == "cpu")
        check_checkpoint_model(cfg, load_iteration)  # before anything is built or read
        self.model_config = cfg.model_config()
        self.fp8 = build_fp8_backend(cfg, self.layout, self.device)
        built = self.build_same_model()
        self.model, self.step_runner, self.parts = built.model, built.runner, built.parts
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.loss_scaler = build_loss_scaler(cfg, self.device)  # fp16 only
        data = train_data.build_run_data(cfg, self.model_config)
        self.tokenizer, self.datasets = data.tokenizer, data.datasets
        self.eod_for_documents = data.eod_for_documents
        if self.rank == 0 and (note := train_data.long_conversations(cfg, self.datasets)):
            log.warning(note)
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.diverged_at: int | None = None
        self.run_dir = Path(cfg.logging.run_dir)
        self.run_state = self._build_run_state()
        self.checkpoints = self.run_state.checkpoints
        self._restore(self.run_state.resume(load_iteration))
        self.autocast = autocast_context(self.device, cfg.training.dtype, self.fp8)
        self.objective.setup(self)
        self.train_loader = self._build_loader(0, "train")
        self.valid_loader = self._build_loader(1, "valid")
        self._valid_iterator: Iterator[Any] | None = None
        self._evaluated_at: int | None = None
        self._signals: StopSignals | None = None
        self.metrics = self._build_logging(console)
        self.samples = self._build_samples()
        self.lm_eval = build_lm_eval(cfg, self.model_config, self.tokenizer, self.layout.world_size)
        sequences = self.objective.spec.sequences(cfg)  # each counts in tokens/s
        self.tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_length * sequences
        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_length)
        self.peak_tflops = peak_tflops(self.device)

    # ---- building -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.layout.rank

    def _after_optimizer_step(self) -> None:
        if self.fp8 is not None:
            self.fp8.after_optimizer_step(model_parts(self.model))
        if zero1_active(self.cfg, self.layout):  # ZeRO-1: the updated parameters, whole again
            gather_parameters(self.model)

    def _build_loader(self, split: int, name: str) -> Any:
        """This data-parallel rank's resumable loader of one split (None without data)."""
        return train_data.build_loader(
            self.datasets[split], self.cfg, self.consumed[name], self.layout.dp_rank, self.layout.dp
        )

    def build_same_model(self) -> Any:
        """A model built as this run's is (layout, options, FP8, initialisation), with its step
        runner: the run's own, or a frozen reference beside it."""
        opts = model_options(self.cfg, self.layout, self.device, self.num_micro_batches)
        built = build_model(self.cfg, self.model_config, opts, self.layout, self.device, self.fp8)
        built.runner = build_runner(built, self.objective, self.layout, self.device, self.cfg)
        return built

    def _build_run_state(self) -> RunState:
        """The run's checkpoints (`run_state.py`), with the adapters' hook when the model has
        adapters on a frozen base, and what the objective records in every checkpoint."""
        adapter = state_adapter(self.cfg, self.model, self.parts, self.layout.world_group)
        return RunState(
            self.cfg,
            self.model_config,
            self.layout,
            model=self.model,
            parts=self.parts,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            tokenizer=self.tokenizer,
            adapter=adapter,
            records=self.objective.records(),
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
        chat = self.objective.spec.chat_prompts  # prompts asked as a user's turn
        return TrainingSamples(t.sample_prompts, path, t.sample_tokens, chat=chat)

    def log_samples(self) -> dict[str, str]:
        """Greedy continuations of `training.sample_prompts`, logged with split "sample"."""
        with self.autocast:
            texts = self.samples.generate(self.model, self.device, self.layout.world_size == 1)
        if texts:
            self.metrics.log(self.iteration, texts, split="sample")
        return texts

    # ---- checkpoints (run_state.py) -----------------------------------------------------------

    def _restore(self, progress: Progress) -> None:
        """Take back the counters a resume read (all 0 for a run that starts)."""
        self.iteration = progress.iteration
        self.consumed = {"train": progress.consumed_train, "valid": progress.consumed_valid}
        self.guard.total = progress.skipped
        if self.loss_scaler is not None and progress.loss_scaler is not None:
            self.loss_scaler.load_state_dict(progress.loss_scaler)

    def save_checkpoint(self) -> Path | None:
        """Save the full training state at the current iteration; returns its directory (in
        the background with `checkpoint.async_save`: `RunState.save`)."""
        done = self.consumed
        scaler = self.loss_scaler.state_dict() if self.loss_scaler is not None else None
        progress = Progress(
            self.iteration, done["train"], done["valid"], self.guard.total, loss_scaler=scaler
        )
        return self.run_state.save(progress)

    def save_hf(self) -> Path:
        """Write the model at the current iteration as a Hugging Face directory (every rank
        calls this; the first writes)."""
        return self.run_state.save_hf(self.iteration)

    # ---- the loop -----------------------------------------------------------------------------

    def next_global_batch(self, iterator: Iterator[Any]) -> list[Batch]:
        """This rank's micro-batches of the next global batch (its context-parallel chunks)."""
        return [
            self.layout.shard_batch(
                self.objective.device_batch(next(iterator), self.device, self.eod_for_documents)
            )
            for _ in range(self.num_micro_batches)
        ]

    def train_one_step(self, iterator: Iterator[Any]) -> StepResult:
        """One optimizer step on the next global batch of `iterator` (forward, backward, clip,
        step, FP8 post-step work), without logging or checkpointing; benchmarks time this."""
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            self.next_global_batch(iterator),
            clip_grad=self.cfg.optimizer.clip_grad,
            autocast=self.autocast,
            dp_group=self.layout.batch_group,
            runner=self.step_runner,
            pp_group=self.layout.pipeline_group,
            after_optimizer_step=self._after_optimizer_step,
            loss_scaler=self.loss_scaler,
        )

    def train(self) -> TrainResult:
        """Train to `training.iters`; returns how it ended. Raises `NonFiniteStop` (after saving)
        when `max_consecutive_skips` steps in a row had a NaN/Inf loss or gradient norm (seen at
        the log step that reads them). Periodic saves run in the background with
        `checkpoint.async_save`; the next save, a signal, the end of training and an error all
        wait for such a save to commit."""
        t = self.cfg.training
        if t.skip_train:  # Megatron's --skip-train: the loaded weights' figures, nothing saved
            self.run_evaluation()
            self.metrics.close()
            return TrainResult(self.iteration, "evaluated")
        loop = LoopState(TrainResult(self.iteration, "finished"), bar=self._progress_bar())
        iterator = iter(self.train_loader)
        try:
            with StopSignals() as signals:
                self._signals = signals
                while self.iteration < t.iters:
                    self._timed_step(iterator, loop)
                    if self._due(t.log_interval) or self.iteration == t.iters:
                        self._log_window(loop)
                    if self._due(t.eval_interval):
                        self.run_evaluation()
                    if self.samples is not None and self._due(t.sample_interval):
                        self.log_samples()
                    if self.lm_eval is not None and self._due(self.cfg.eval.lm_eval_interval):
                        with self.autocast:
                            scores = self.lm_eval.scores(self.model, self.device)
                        self.metrics.log(self.iteration, scores, split="valid")
                    if self._save_if_due(loop, signals):
                        break
                if loop.result.stop_reason == "finished":
                    self._finish(loop)
                self.run_state.collect_background_save(block=True)  # resumable on exit
        except Exception:
            self.run_state.finish_background_save_after_error()
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
        self.run_state.collect_background_save()
        if stop:
            loop.result.stop_reason = signals.name or "signal"
            log.warning("%s received: saving (if enabled) and exiting", loop.result.stop_reason)
        if stop or due:
            loop.result.checkpoint = self.save_checkpoint()
        if due and not stop:
            self.run_state.save_hf_if_wanted(self.iteration, final=False)
        return stop

    def _finish(self, loop: LoopState) -> None:
        """The end of a finished run: evaluate and save the last iteration unless done already."""
        if self.cfg.training.eval_interval and self._evaluated_at != self.iteration:
            self.run_evaluation()
        if not self.checkpoints.saved(self.iteration):
            loop.result.checkpoint = self.save_checkpoint()
        self.run_state.save_hf_if_wanted(self.iteration, final=True)

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
        for offset, step in enumerate(window.read_pending()):
            iteration = first + offset
            result.losses[iteration] = step.loss
            self.guard.account(iteration, step, self.loss_scaler)
            self.diverged_at = self.diverged_at or (iteration if self.guard.should_stop else None)
            skipped_now += step.skipped
        self.scheduler.rewind(skipped_now)

    def _stop_if_diverged(self) -> None:
        """After too many non-finite steps in a row: save, then raise `NonFiniteStop`."""
        if self.diverged_at is None:
            return
        path = self.save_checkpoint()
        self.run_state.collect_background_save(block=True)
        first = self.diverged_at - self.guard.max_consecutive + 1
        raise NonFiniteStop(
            f"stopping at iteration {self.iteration}: the {self.guard.max_consecutive} steps "
            f"from iteration {first} had a NaN/Inf loss or grad norm; saved: {path or 'nothing'}"
        )

    def _log_train(self, window: LogWindow, bar: Any) -> None:
        metrics = {
            **window.figures(self.flops_per_token, self.peak_tflops),
            "lr": self.scheduler.get_last_lr()[0],
            "mem_gib": memory_gib(self.device),
            "skipped": self.guard.total,
            **({"loss_scale": float(self.loss_scaler.scale)} if self.loss_scaler else {}),
            "iters": self.cfg.training.iters,
            **router_statistics(self.model),
            **self.objective.metrics(),
        }
        self.metrics.log(self.iteration, metrics)
        if bar is not None:
            bar.set_postfix_str(f"loss {metrics['loss']:.4f}", refresh=False)

    def run_evaluation(self) -> float | None:
        """`eval_iters` global batches of the valid split; logs and returns the loss. A stop
        signal is noticed between batches: the evaluation ends there, unlogged (None), and
        the loop saves and exits as it does during training."""
        self._evaluated_at = self.iteration
        if self.valid_loader is None or self.cfg.training.eval_iters == 0:
            return None
        if self._valid_iterator is None:
            self._valid_iterator = iter(self.valid_loader)
        loss_sum, count = 0.0, 0.0
        with self.objective.evaluating():
            for _ in range(self.cfg.training.eval_iters):
                if self._signals is not None and self._signals.received is not None:
                    log.warning("%s received: evaluation stopped", self._signals.name)
                    return None
                micro_batches = self.next_global_batch(self._valid_iterator)
                self.consumed["valid"] += self.cfg.training.global_batch_size
                with evaluation_mode(self.model):
                    prepare_micro_batches(self.step_runner, micro_batches, self.autocast)
                    batch_sum, batch_count = self.step_runner.evaluate(micro_batches, self.autocast)
                loss_sum, count = loss_sum + float(batch_sum), count + batch_count
            loss = global_mean(loss_sum, count, self.layout, self.device)
            figures = {"loss": loss, **self.objective.metrics()}
        if self.objective.reports_perplexity:
            figures["ppl"] = math.exp(loss) if loss < 700 else math.inf
        self.metrics.log(self.iteration, figures, split="valid")
        return loss
