"""`Trainer`: builds a run (one device, or any parallel layout over processes) from a
`TrainConfig` and trains it.

Build order (docs/architecture.md): process group and meshes (multi-process runs only) -> seed ->
model on `meta` -> this rank's pipeline stages -> `parallelize` each (TP/SP, EP, CP, activation
checkpointing, compile, FSDP2) -> `to_empty` -> `init_weights` -> optimizer and scheduler ->
data -> checkpoint resume -> run directory and metrics. Each piece has its own `_build_*`
method; `train` is the loop, `train_step` (in `train_step.py`) one step.

Parallel runs (launched by torchrun, `pipe train --nproc-per-node N`): each data-parallel rank
loads its slice of each global batch and each context-parallel rank keeps its chunks of every
sequence (`RunLayout`); the step divides by the global token count and reports the global loss;
checkpoints are written by all ranks (DCP, DTensor shards under the single-device names, so
they load under any other layout) and only rank 0 writes logs and metrics. On a CPU a sharded
or split model takes its weights from a plain model initialised with the run's seed (DTensor
has no CPU RNG tracker), so every layout starts from the single-process weights; on CUDA
`init_weights` runs on the parallel model directly (DTensor's RNG tracker; pipeline ranks offset
the seed so stages do not repeat each other's draws), which differs from one device's draw.

Resuming restores weights, optimizer, scheduler, RNG states, the iteration and the consumed
sample counts, and the loaders restart from those counts, so on a CPU a resumed run repeats an
uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import warnings
from dataclasses import dataclass, field
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
from pipeline.core.kernels.attention import resolve_backend
from pipeline.core.kernels.fp8 import Fp8Training, build_fp8
from pipeline.core.model.flavors import flops_per_token
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.fsdp import copy_full_weights_
from pipeline.preprocess.progress import terminal_bar
from pipeline.quiet import quiet_dcp
from pipeline.train import train_data
from pipeline.train.checkpoint_model import check_checkpoint_model
from pipeline.train.config import ConfigError, TrainConfig
from pipeline.train.guards import MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteStop, StopSignals
from pipeline.train.layout import RunLayout
from pipeline.train.metrics import MetricsLogger, router_statistics
from pipeline.train.model_parts import StageUnion, model_parts, set_moe_aux_loss_scale
from pipeline.train.optimizer import build_optimizer, build_scheduler
from pipeline.train.parallelize import (
    build_model_parts,
    build_parallel_dims,
    init_distributed,
    parallelize,
    wants_distributed,
)
from pipeline.train.perf import memory_gib, peak_tflops
from pipeline.train.pipeline_step import PipelineRunner
from pipeline.train.train_step import (
    StepResult,
    autocast_context,
    batch_to_device,
    evaluate,
    forward_backward,
    reduce_loss_sum,
    train_step,
)

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


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU; `cuda` without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = cuda, but torch sees no CUDA device")
    return torch.device(name)


@dataclass
class TrainResult:
    """How `Trainer.train` ended."""

    iteration: int
    stop_reason: str
    """"finished", or the signal's name (SIGTERM, SIGINT) when stopped by one."""
    checkpoint: Path | None = None
    skipped: int = 0
    losses: dict[int, float] = field(default_factory=dict)


@dataclass
class _Window:
    """Training statistics since the last log line."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, result: StepResult, tokens: int, seconds: float) -> None:
        if not result.skipped:
            self.losses.append(result.loss)
            self.grad_norms.append(result.grad_norm)
        self.tokens += tokens
        self.seconds += seconds


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
        self.device = resolve_device(cfg.training.device)
        self.layout = self._build_parallel()
        self.dims = self.layout.dims
        t = cfg.training
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        seed_everything(cfg.training.seed, deterministic=self.device.type == "cpu")
        check_checkpoint_model(cfg, load_iteration)  # before anything is built or read
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self._build_data()
        self.iteration = 0
        self.consumed = {"train": 0, "valid": 0}
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.run_dir = Path(cfg.logging.run_dir)
        self.checkpoints = self._build_checkpointing()
        self._resume(load_iteration)
        self.train_loader = self._build_loader(0, "train")
        self.valid_loader = self._build_loader(1, "valid")
        self._valid_iterator: Any = None
        self.metrics = self._build_logging(console)
        self.autocast = autocast_context(self.device, cfg.training.dtype, self.fp8)
        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_length)
        self.peak_tflops = peak_tflops(self.device)

    # ---- building -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    def _build_parallel(self) -> RunLayout:
        """Process group, meshes and this rank's place in them (a trivial layout for one
        process)."""
        self.process_group: Any = None
        if not wants_distributed(self.cfg):
            return RunLayout()
        try:
            self.device = init_distributed(self.device)
            dims = build_parallel_dims(self.cfg, self.device.type)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            raise ConfigError(str(e)) from e
        self.cfg.validate(world_size=dims.world_size)
        self.process_group = dist.group.WORLD
        layout = RunLayout.from_dims(dims)
        log.info("parallel layout: %s", layout.describe())
        return layout

    def _build_model(self) -> torch.nn.Module:
        """This rank's share of the model: built on `meta`, split into pipeline stages,
        parallelised, materialised on the device and initialised (fp32)."""
        self.model_config = self.cfg.model_config()
        with torch.device("meta"):
            model = Transformer(self.model_config)
        try:
            self.fp8 = self._build_fp8()
            if self.fp8 is not None:  # before any parallelism (float8 TP styles, fp8 all-gather)
                model = self.fp8.convert(model)
                log.info("%s", self.fp8.describe())
            parts, stage_indices, num_stages = build_model_parts(model, self.cfg, self.dims)
            parts = [
                parallelize(part, self.cfg, self.dims, device_type=self.device.type)
                for part in parts
            ]
        except (ValueError, NotImplementedError) as e:  # a layout or recipe we cannot build
            raise ConfigError(str(e)) from e
        model = StageUnion(parts) if num_stages > 1 else parts[0]
        self._select_attention(model)
        for part in parts:
            part.to_empty(device=self.device)
        self._init_weights(model)
        model.train()
        set_moe_aux_loss_scale(model, 1.0 / (self.num_micro_batches * self.dp_size))
        self.pipeline = None
        if num_stages > 1:
            self.pipeline = PipelineRunner(
                parts, stage_indices, num_stages, self.cfg.parallel.pipeline_schedule,
                self.num_micro_batches, self.device, self.layout.pp_group,
            )  # fmt: skip
        if self.device.type == "cpu" and self.cfg.training.dtype == "bf16":
            log.info("training.dtype = bf16 runs in fp32 on a CPU (autocast is for CUDA only)")
        return model

    def _build_fp8(self) -> Fp8Training | None:
        """The run's FP8 backend (None without `fp8.recipe`), told the layout it must fit."""
        f, p = self.cfg.fp8, self.cfg.parallel
        dims = self.dims
        fsdp = dims is not None and dims.fsdp_degree > 1 and p.dp_mode == "fsdp"
        amax_group = dims.get_mesh("dp_cp").get_group() if dims is not None else None
        return build_fp8(
            f.recipe,
            self.device,
            emulate=f.emulate,
            linear_filter=f.linear_filter,
            fsdp=fsdp,
            fsdp_float8_all_gather=f.fsdp_float8_all_gather,
            tp=p.tp,
            amax_group=amax_group,
        )

    def _after_optimizer_step(self) -> None:
        if self.fp8 is not None:
            self.fp8.after_optimizer_step(model_parts(self.model))

    def _init_weights(self, model: torch.nn.Module) -> None:
        """`init_weights` on each part, except for a parallel model on a CPU: there every rank
        would draw the same shard, so the parameters are filled from a plain model initialised
        with the seed (the RNG then stands where a single-process run leaves it)."""
        parts = model_parts(model)
        if self.dims is None or self.device.type != "cpu":
            if self.layout.pp_rank:  # stages must not repeat each other's draws
                torch.manual_seed(self.cfg.training.seed + self.layout.pp_rank)
            for part in parts:
                part.init_weights(buffer_device=self.device)
            return
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # Random init of DTensors on a CPU mesh warns; these draws are discarded anyway.
            warnings.filterwarnings("ignore", message="DTensor random operators")
            for part in parts:  # buffers; the parameters are replaced
                part.init_weights(buffer_device=self.device)
        copy_full_weights_(model, self._plain_initial_weights())

    def _plain_initial_weights(self) -> dict[str, torch.Tensor]:
        """Parameters of an unsharded model initialised as a single-process run would be."""
        with torch.device("meta"):
            plain = Transformer(self.model_config)
        plain.to_empty(device=self.device)
        plain.init_weights(buffer_device=self.device)
        return dict(plain.named_parameters())

    def _select_attention(self, model: torch.nn.Module) -> None:
        backend = resolve_backend(
            self.cfg.training.attention_backend,
            device=self.device,
            document_masking=self.cfg.data.reset_attention_mask,
        )
        for block in model.layers.values():
            block.attention.backend = backend  # context parallelism overrides the kernel
        log.info("attention backend: %s", backend)

    def _build_data(self) -> None:
        """The blend, the tokenizer's ids and the three split datasets."""
        vocab = self.model_config.vocab_size
        self.data_spec = train_data.data_spec(self.cfg, vocab)
        self.tokenizer = train_data.tokenizer_info(self.cfg, self.data_spec)
        if self.tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens ({self.tokenizer.source}) "
                f"but the model's vocabulary is {vocab}; set model.vocab_size"
            )
        self.datasets = train_data.build_split_datasets(self.cfg, self.data_spec, self.tokenizer)
        if self.datasets[0] is None or len(self.datasets[0]) == 0:
            raise ConfigError("the training split is empty: check data.split and the blend")
        self.eod_for_documents = (
            self.tokenizer.eod_id if self.cfg.data.reset_attention_mask else None
        )

    def _build_loader(self, split: int, name: str) -> Any:
        """This data-parallel rank's resumable loader of one split (None without data)."""
        return train_data.build_loader(
            self.datasets[split], self.cfg, self.consumed[name], self.dp_rank, self.dp_size
        )

    def _build_checkpointing(self) -> CheckpointManager:
        c = self.cfg.checkpoint
        save_dir = Path(c.save) if c.save else self.run_dir / "checkpoints"
        return CheckpointManager(
            save_dir,
            keep_last=c.keep_last or None,
            async_save=c.async_save,
            load_dir=c.load,
            process_group=self.process_group,
            verify_checksums=c.verify_checksums,
        )

    def _build_logging(self, console: bool) -> MetricsLogger:
        """The run directory with the resolved `config.toml`, and the metrics logger."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.cfg.save_toml(self.run_dir / "config.toml")
        lg = self.cfg.logging
        return MetricsLogger(
            self.run_dir,
            tensorboard=lg.tensorboard,
            wandb_project=lg.wandb_project if lg.wandb else None,
            config=self.cfg.to_dict(),
            rank=self.rank,
            console=console,
        )

    # ---- checkpoints --------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            **model_and_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler,
        }

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
                "mock": d.mock,
                "blend": d.blend,
                "train_blend": d.train_blend,
                "valid_blend": d.valid_blend,
                "test_blend": d.test_blend,
                "split": d.split,
                "seq_length": d.seq_length,
            },
            "tokenizer": self.tokenizer.to_metadata(),
            "layout": self.layout.describe(),
        }

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
        if c.load is None:
            return
        if not self.checkpoints.has_checkpoint() and iteration is None and not _is_iter_dir(c.load):
            log.info("no checkpoint in %s yet: starting from scratch", c.load)
            return
        if c.finetune:
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
        load_model_and_optimizer_state(self.model, self.optimizer, state)
        self.iteration = int(meta["iteration"])
        self.consumed = {
            "train": int(meta.get("consumed_samples", 0)),
            "valid": int(meta.get("consumed_valid_samples", 0)),
        }
        self.guard.total = int(meta.get("skipped_iterations", 0))
        log.info("resumed from %s at iteration %d", c.load, self.iteration)

    # ---- the loop -----------------------------------------------------------------------------

    def next_global_batch(self, iterator: Any) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global batch (its context-parallel chunks)."""
        return [
            self.layout.shard_batch(
                batch_to_device(next(iterator), self.device, self.eod_for_documents)
            )
            for _ in range(self.num_micro_batches)
        ]

    def compute_gradients(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """Forward and backward of one global batch (this rank's `next_global_batch`) without
        an optimizer step: the gradients stay in the parameters, for inspection. Returns the
        global loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = forward_backward(
            self.model, micro_batches, autocast=self.autocast,
            dp_group=self.layout.token_group, pipeline=self.pipeline,
        )  # fmt: skip
        reduce_loss_sum(loss_sum, self.layout.token_group, self.layout.pp_group)
        return float(loss_sum) / max(tokens, 1.0)

    def train_one_step(self, iterator: Any) -> StepResult:
        """One optimizer step on the next global batch of `iterator` (forward, backward, clip,
        step, FP8 post-step work), without logging or checkpointing; benchmarks time this."""
        return train_step(
            self.model, self.optimizer, self.scheduler, self.next_global_batch(iterator),
            clip_grad=self.cfg.optimizer.clip_grad, autocast=self.autocast,
            dp_group=self.layout.token_group, pipeline=self.pipeline,
            pp_group=self.layout.pp_group, after_optimizer_step=self._after_optimizer_step,
        )  # fmt: skip

    def train(self) -> TrainResult:
        """Train to `training.iters`; returns how it ended. Raises `NonFiniteStop` (after saving)
        when `max_consecutive_skips` steps in a row had a NaN/Inf loss or gradient norm.
        Periodic saves run in the background with `checkpoint.async_save`; the next save, a
        signal, the end of training and an error all wait for such a save to commit."""
        t = self.cfg.training
        result = TrainResult(self.iteration, "finished")
        window = _Window()
        saved_at = evaluated_at = None
        iterator = iter(self.train_loader)
        tokens_per_step = t.global_batch_size * self.cfg.data.seq_length
        bar = self._progress_bar()
        try:
            with StopSignals() as signals:
                while self.iteration < t.iters:
                    start = time.perf_counter()
                    step = self.train_one_step(iterator)
                    window.add(step, tokens_per_step, time.perf_counter() - start)
                    self._record_step(step, result)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"loss {step.loss:.4f}", refresh=False)
                    if self.iteration % t.log_interval == 0 or self.iteration == t.iters:
                        self._log_train(window)
                        window = _Window()
                    if t.eval_interval and self.iteration % t.eval_interval == 0:
                        self.run_evaluation()
                        evaluated_at = self.iteration
                    self._stop_if_diverged()
                    self._collect_background_save()
                    if signals.received is not None:
                        result.stop_reason = signals.name or "signal"
                        log.warning("%s received: saving and exiting", result.stop_reason)
                        result.checkpoint = self.save_checkpoint()
                        saved_at = self.iteration
                        break
                    interval = self.cfg.checkpoint.save_interval
                    if interval and self.iteration % interval == 0:
                        result.checkpoint = self.save_checkpoint()
                        saved_at = self.iteration
                if result.stop_reason == "finished":
                    if t.eval_interval and evaluated_at != self.iteration:
                        self.run_evaluation()
                    if saved_at != self.iteration:
                        result.checkpoint = self.save_checkpoint()
                self._collect_background_save(block=True)  # a resumable point before exiting
        except Exception:
            self._finish_background_save_after_error()
            raise
        finally:
            if bar is not None:
                bar.close()
            self.metrics.close()
        result.iteration = self.iteration
        result.skipped = self.guard.total
        return result

    def _progress_bar(self) -> Any:
        """A terminal progress bar on rank 0 (None elsewhere or off a terminal)."""
        if self.rank != 0:
            return None
        t = self.cfg.training
        return terminal_bar(t.iters, desc="train", initial=self.iteration, unit="it", leave=False)

    def _record_step(self, step: StepResult, result: TrainResult) -> None:
        """Advance the iteration and sample counts; count and report a skipped step."""
        self.iteration += 1
        self.consumed["train"] += self.cfg.training.global_batch_size
        self.guard.record(not step.skipped)
        result.losses[self.iteration] = step.loss
        if step.skipped:
            log.warning(
                "iteration %d: non-finite loss %s or grad norm %s: step skipped "
                "(%d in a row, %d in all)", self.iteration, step.loss, step.grad_norm,
                self.guard.consecutive, self.guard.total,
            )  # fmt: skip

    def _stop_if_diverged(self) -> None:
        """After too many non-finite steps in a row: save, then raise `NonFiniteStop`."""
        if not self.guard.should_stop:
            return
        path = self.save_checkpoint()
        self._collect_background_save(block=True)
        first = self.iteration - self.guard.consecutive + 1
        raise NonFiniteStop(
            f"stopping at iteration {self.iteration}: the last {self.guard.consecutive} steps "
            f"(from iteration {first}) had a NaN/Inf loss or gradient norm; state saved in {path}"
        )

    def _log_train(self, window: _Window) -> None:
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
        self.metrics.log(self.iteration, metrics)

    def run_evaluation(self) -> float | None:
        """`eval_iters` global batches of the valid split; logs and returns the loss."""
        if self.valid_loader is None or self.cfg.training.eval_iters == 0:
            return None
        if self._valid_iterator is None:
            self._valid_iterator = iter(self.valid_loader)
        self.consumed["valid"] += self.cfg.training.eval_iters * self.cfg.training.global_batch_size
        loss_sum, tokens = 0.0, 0.0
        for _ in range(self.cfg.training.eval_iters):
            batch_sum, batch_tokens = self._eval_global_batch(
                self.next_global_batch(self._valid_iterator)
            )
            loss_sum, tokens = loss_sum + batch_sum, tokens + batch_tokens
        loss = self._global_eval_loss(loss_sum, tokens)
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.metrics.log(self.iteration, {"loss": loss, "ppl": ppl}, split="valid")
        return loss

    def _eval_global_batch(
        self, micro_batches: list[dict[str, torch.Tensor]]
    ) -> tuple[float, float]:
        """(loss sum, loss tokens) of this rank's share of one global batch."""
        if self.pipeline is not None:
            self.model.eval()
            try:
                loss_sum, tokens = self.pipeline.evaluate(micro_batches, self.autocast)
            finally:
                self.model.train()
            return float(loss_sum), tokens
        loss, tokens = evaluate(self.model, micro_batches, self.autocast)
        return loss * tokens, float(tokens)

    def _global_eval_loss(self, loss_sum: float, tokens: float) -> float:
        """The token-normalised loss over every rank's evaluation batches: token counts are
        summed over the ranks holding different tokens, loss sums also over pipeline stages
        (only the last one has them)."""
        sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
        if self.layout.token_group is not None or self.layout.pp_group is not None:
            on_gpu = dist.get_backend() == "nccl"
            sums = sums.to(self.device if on_gpu else "cpu")
            if self.layout.token_group is not None:
                dist.all_reduce(sums, group=self.layout.token_group)
            if self.layout.pp_group is not None:
                dist.all_reduce(sums[:1], group=self.layout.pp_group)
        return float(sums[0] / sums[1].clamp(min=1.0))


def _is_iter_dir(path: str) -> bool:
    return (Path(path) / "pipe_metadata.json").is_file()
