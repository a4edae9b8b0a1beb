"""`Trainer`: builds a run (one device, or data parallel over processes) from a `TrainConfig`
and trains it.

Build order (DESIGN principle 2): process group and mesh (multi-process runs only) -> seed ->
model on `meta` -> `parallelize` (activation checkpointing, compile, FSDP2 when dp > 1) ->
`to_empty` -> `init_weights` -> optimizer and scheduler -> data -> checkpoint resume -> run
directory and metrics. Each piece has its own `_build_*` method; `train` is the loop,
`train_step` (in `train_step.py`) one step.

Data parallelism (launched by torchrun, `pipe train --nproc-per-node N`): every rank loads its
slice of each global micro-batch, the step divides by the global token count and reports the
global loss, evaluation losses are summed over the ranks, checkpoints are written by all ranks
(DCP, DTensor shards) and only rank 0 writes logs and metrics. On a CPU the FSDP model takes
its weights from a plain model initialised with the run's seed (DTensor has no CPU RNG
tracker), so dp=N starts from the single-process weights; on CUDA `init_weights` runs on the
sharded model directly (DTensor's RNG tracker), which differs from one device's draw.

Resuming restores weights, optimizer, scheduler, RNG states, the iteration and the consumed
sample counts, and the loaders restart from those counts, so on a CPU a resumed run repeats an
uninterrupted one bit for bit (DESIGN principle 6).
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
from pipeline.core.kernels.fp8 import apply_fp8
from pipeline.core.model.flavors import flops_per_token
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.dims import ParallelDims
from pipeline.core.parallel.fsdp import copy_full_weights_
from pipeline.preprocess.progress import terminal_bar
from pipeline.train import train_data
from pipeline.train.config import ConfigError, TrainConfig
from pipeline.train.guards import MAX_CONSECUTIVE_SKIPS, NonFiniteGuard, NonFiniteStop, StopSignals
from pipeline.train.metrics import MetricsLogger
from pipeline.train.optimizer import build_optimizer, build_scheduler
from pipeline.train.parallelize import (
    build_parallel_dims,
    init_distributed,
    parallelize,
    wants_distributed,
)
from pipeline.train.perf import memory_gib, peak_tflops
from pipeline.train.train_step import (
    StepResult,
    autocast_context,
    batch_to_device,
    evaluate,
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
    """A training run on one device or data parallel over processes; see the module docstring."""

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
        self.dims = self._build_parallel()
        seed_everything(cfg.training.seed, deterministic=self.device.type == "cpu")
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
        self.autocast = autocast_context(self.device, cfg.training.dtype)
        t = cfg.training
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        self.flops_per_token = flops_per_token(self.model_config, cfg.data.seq_length)
        self.peak_tflops = peak_tflops(self.device)

    # ---- building -----------------------------------------------------------------------------

    def _build_parallel(self) -> ParallelDims | None:
        """Process group and mesh of a multi-process run; None (and rank 0 of 1) otherwise."""
        self.rank, self.dp_rank, self.dp_size = 0, 0, 1
        self.dp_group: Any = None
        self.process_group: Any = None
        if not wants_distributed(self.cfg):
            return None
        try:
            self.device = init_distributed(self.device)
            dims = build_parallel_dims(self.cfg, self.device.type)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            raise ConfigError(str(e)) from e
        self.cfg.validate(world_size=dims.world_size)
        dp_mesh = dims.get_mesh("dp")
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), dims.dp
        self.dp_group = dp_mesh.get_group()
        self.process_group = dist.group.WORLD
        log.info("data parallel: rank %d of %d (dp=%d)", self.rank, dims.world_size, dims.dp)
        return dims

    def _build_model(self) -> Transformer:
        """Model on `meta`, parallelised, materialised on the device, initialised (fp32)."""
        self.model_config = self.cfg.model_config()
        with torch.device("meta"):
            model = Transformer(self.model_config)
        try:
            model = apply_fp8(model, self.cfg.fp8.recipe, self.device)
        except (ValueError, NotImplementedError) as e:  # a recipe asking for what is not here
            raise ConfigError(str(e)) from e
        model = parallelize(model, self.cfg, self.dims)
        self._select_attention(model)
        model.to_empty(device=self.device)
        self._init_weights(model)
        model.train()
        if self.device.type == "cpu" and self.cfg.training.dtype == "bf16":
            log.info("training.dtype = bf16 runs in fp32 on a CPU (autocast is for CUDA only)")
        return model

    def _init_weights(self, model: Transformer) -> None:
        """`init_weights`, except for a sharded model on a CPU: there every rank would draw the
        same shard, so the shards are filled from a plain model initialised with the seed (the
        RNG then stands where a single-process run leaves it)."""
        sharded = self.dims is not None and self.dims.dp_enabled
        if not sharded or self.device.type != "cpu":
            model.init_weights(buffer_device=self.device)
            return
        with torch.random.fork_rng(devices=[]):
            model.init_weights(buffer_device=self.device)  # buffers; the shards are replaced
        copy_full_weights_(model, self._plain_initial_weights())

    def _plain_initial_weights(self) -> dict[str, torch.Tensor]:
        """Parameters of an unsharded model initialised as a single-process run would be."""
        with torch.device("meta"):
            plain = Transformer(self.model_config)
        plain.to_empty(device=self.device)
        plain.init_weights(buffer_device=self.device)
        return dict(plain.named_parameters())

    def _select_attention(self, model: Transformer) -> None:
        backend = resolve_backend(
            self.cfg.training.attention_backend,
            device=self.device,
            document_masking=self.cfg.data.reset_attention_mask,
        )
        for block in model.layers.values():
            block.attention.backend = backend
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
            "layout": {
                "tp": 1,
                "pp": 1,
                "cp": 1,
                "ep": 1,
                "dp": self.dp_size,
                "world_size": self.dims.world_size if self.dims is not None else 1,
            },  # fmt: skip
        }

    def save_checkpoint(self) -> Path:
        """Save the full training state at the current iteration; returns its directory."""
        with warnings.catch_warnings():
            # DCP warns that it saves without a process group: expected on a single device.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            self.checkpoints.save(self.iteration, self._state(), self._metadata())
            self.checkpoints.wait()  # a resumable point must exist before we go on or exit
        path = self.checkpoints.save_dir / f"iter_{self.iteration:07d}"
        log.info("saved checkpoint %s", path)
        return path

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
            load(c.load, iteration, state, restore_rng=False, process_group=self.process_group)
            load_model_and_optimizer_state(self.model, None, state)
            log.info("finetuning from the weights in %s (iteration 0)", c.load)
            return
        state = self._state()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
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

    def _next_global_batch(self, iterator: Any) -> list[dict[str, torch.Tensor]]:
        return [
            batch_to_device(next(iterator), self.device, self.eod_for_documents)
            for _ in range(self.num_micro_batches)
        ]

    def train(self) -> TrainResult:
        """Train to `training.iters`; returns how it ended. Raises `NonFiniteStop` (after saving)
        when `max_consecutive_skips` steps in a row had a NaN/Inf loss or gradient norm."""
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
                    step = train_step(
                        self.model, self.optimizer, self.scheduler,
                        self._next_global_batch(iterator),
                        clip_grad=self.cfg.optimizer.clip_grad, autocast=self.autocast,
                        dp_group=self.dp_group,
                    )  # fmt: skip
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
        batches = (
            batch
            for _ in range(self.cfg.training.eval_iters)
            for batch in self._next_global_batch(self._valid_iterator)
        )
        self.consumed["valid"] += self.cfg.training.eval_iters * self.cfg.training.global_batch_size
        loss = self._global_eval_loss(*evaluate(self.model, batches, self.autocast))
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.metrics.log(self.iteration, {"loss": loss, "ppl": ppl}, split="valid")
        return loss

    def _global_eval_loss(self, loss: float, tokens: int) -> float:
        """The token-normalised loss over every data-parallel rank's evaluation batches."""
        if self.dp_group is None:
            return loss
        device = self.device if dist.get_backend(self.dp_group) == "nccl" else "cpu"
        sums = torch.tensor([loss * tokens, float(tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=self.dp_group)
        return float(sums[0] / sums[1].clamp(min=1.0))


def _is_iter_dir(path: str) -> bool:
    return (Path(path) / "pipe_metadata.json").is_file()
