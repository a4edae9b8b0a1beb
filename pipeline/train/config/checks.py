"""The training config's cross-field checks: what no single field's type can say.

`TrainConfig.validate` calls `config_problems`, which lists every problem of the sections
at once (batch geometry, data sources, the optimizer's ranges, the schedule, FP8 recipe, LoRA)
and adds the layout rules of `pipeline.core.parallel.layout_rules` for the run's model, so one
`ConfigError` names them all. What an objective or an optimizer refuses is its registry entry's
to say (`ObjectiveSpec.problems`, `OptimizerSpec.problems`): the config sits below both
registries, so a run's whole check, `pipeline.train.assembly.run_config.check_config`, adds
theirs.
Reads no file: a model taken from a checkpoint was read once by the config loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.core.kernels.fp8 import normalize_recipe
from pipeline.core.parallel.layout_rules import layout_problems
from pipeline.train.config.fields import ConfigError

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["config_problems", "raise_problems"]


def raise_problems(problems: list[str]) -> None:
    """One `ConfigError` listing every problem, one a line (nothing when there is none)."""
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def config_problems(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """Every cross-field problem of `cfg` for `world_size` (None: not known yet), as lines."""
    problems: list[str] = []
    t, d, o, s = cfg.training, cfg.data, cfg.optimizer, cfg.scheduler

    for name in ("iters", "micro_batch_size", "global_batch_size", "log_interval"):
        if getattr(t, name) <= 0:
            problems.append(f"training.{name} must be positive, got {getattr(t, name)}")
    if t.eval_interval < 0 or t.eval_iters < 0:
        problems.append("training.eval_interval and training.eval_iters must be >= 0")
    if t.sample_interval < 0 or t.sample_tokens <= 0:
        problems.append("training.sample_interval must be >= 0 and sample_tokens positive")
    e = cfg.eval
    if e.lm_eval_interval < 0 or (e.lm_eval_max_length or 1) <= 0:
        problems.append("eval.lm_eval_interval must be >= 0 and lm_eval_max_length positive")
    if e.lm_eval_limit is not None and e.lm_eval_limit <= 0:
        problems.append("eval.lm_eval_limit must be positive")
    if d.seq_length <= 0:
        problems.append(f"data.seq_length must be positive, got {d.seq_length}")
    if cfg.fp8.recipe is not None:
        try:
            normalize_recipe(cfg.fp8.recipe)
        except ValueError as e:
            problems.append(str(e))
    if d.num_workers < 0:
        problems.append(f"data.num_workers must be >= 0, got {d.num_workers}")

    split_blends = [b for b in (d.train_blend, d.valid_blend, d.test_blend) if b is not None]
    if d.blend is not None and split_blends:
        problems.append("data.blend excludes data.train_blend/valid_blend/test_blend")
    if d.mock and (d.blend is not None or split_blends):
        problems.append("data.mock is set together with a data blend; set one or the other")
    if not d.mock and d.blend is None and d.train_blend is None:
        problems.append("no training data: pass --data, set data.blend, or set data.mock=true")
    problems += _split_problems(d.split)

    problems += _optimizer_problems(cfg)
    if not 0 <= s.warmup_init_lr <= o.lr:
        problems.append(f"scheduler.warmup_init_lr ({s.warmup_init_lr}) must be in [0, lr]")

    decay = cfg.decay_iters
    if s.warmup_iters < 0:
        problems.append(f"scheduler.warmup_iters must be >= 0, got {s.warmup_iters}")
    if decay <= 0 or s.warmup_iters >= decay:
        # Megatron asserts both: the decay phase must exist and start after warmup.
        problems.append(
            f"need 0 <= scheduler.warmup_iters ({s.warmup_iters}) < decay iters ({decay})"
        )
    if s.decay_style == "wsd":
        if s.wsd_decay_iters is None:
            problems.append("scheduler.decay_style = wsd needs scheduler.wsd_decay_iters")
        elif not 0 < s.wsd_decay_iters <= decay - s.warmup_iters:
            problems.append(
                f"scheduler.wsd_decay_iters ({s.wsd_decay_iters}) must be in "
                f"(0, decay iters - warmup_iters = {decay - s.warmup_iters}]"
            )

    if not cfg.checkpoint.enable and cfg.checkpoint.save_hf != "off":
        problems.append(
            "checkpoint.save_hf writes with the checkpoints: checkpoint.enable is false"
        )
    problems += _lora_problems(cfg)
    problems += _fp16_problems(cfg)
    problems += _layout_problems(cfg, world_size)
    return problems


def _fp16_problems(cfg: TrainConfig) -> list[str]:
    """fp16's loss-scale settings in range (Megatron's asserts), a constant `loss_scale` only
    with fp16, and the paths fp16 is not one of: FP8 (its high precision is bf16) and a LoRA
    base stored in bf16."""
    t = cfg.training
    problems = []
    if t.dtype != "fp16":
        if t.loss_scale is not None:
            problems.append(
                f"training.loss_scale is set but training.dtype is {t.dtype}: loss scaling is "
                "for fp16 only"
            )
        return problems
    if t.loss_scale is not None and t.loss_scale <= 0:
        problems.append(f"training.loss_scale must be positive, got {t.loss_scale}")
    if not 0 < t.min_loss_scale <= t.initial_loss_scale:
        problems.append(
            f"need 0 < training.min_loss_scale ({t.min_loss_scale}) <= "
            f"training.initial_loss_scale ({t.initial_loss_scale})"
        )
    if t.loss_scale_window <= 0 or t.hysteresis <= 0:
        problems.append(
            f"training.loss_scale_window ({t.loss_scale_window}) and training.hysteresis "
            f"({t.hysteresis}) must be positive"
        )
    if cfg.fp8.recipe is not None:
        problems.append(
            "fp8.recipe trains beside bf16, not fp16: set training.dtype = bf16 for FP8"
        )
    if cfg.lora.enabled and cfg.lora.base_dtype == "bf16":
        problems.append(
            "lora.base_dtype = bf16 under training.dtype = fp16: keep the base in fp32 (unset "
            "lora.base_dtype) or train in bf16"
        )
    return problems


def _optimizer_problems(cfg: TrainConfig) -> list[str]:
    """`[optimizer]`: hyper-parameters in range (the name and what the chosen optimizer refuses
    are its registry's: `pipeline.train.optimizers.optimizer_problems`)."""
    o = cfg.optimizer
    problems = []
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        problems.append(f"need 0 <= optimizer.min_lr ({o.min_lr}) <= optimizer.lr ({o.lr})")
    if o.weight_decay < 0 or o.eps <= 0 or o.clip_grad < 0:
        problems.append("optimizer.weight_decay, clip_grad must be >= 0 and eps > 0")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        problems.append(f"optimizer.beta1/beta2 must be in [0, 1), got {o.beta1}, {o.beta2}")
    return problems


def _lora_problems(cfg: TrainConfig) -> list[str]:
    """The `[lora]` settings of a LoRA run: targets known, rank positive, dropout in [0, 1);
    no `checkpoint.save_hf`, whose writer knows the base weights only (not the adapters)."""
    lo = cfg.lora
    if not lo.enabled:
        return []
    from pipeline.core.model.lora import ALL_TARGETS  # torch: only for LoRA runs

    problems = []
    unknown = [t for t in lo.targets if t != "all" and t not in ALL_TARGETS]
    if unknown or not lo.targets:
        problems.append(
            f"lora.targets: unknown {', '.join(unknown) or '(empty)'}; choose from all, "
            f"{', '.join(ALL_TARGETS)}"
        )
    if lo.rank <= 0 or lo.alpha <= 0 or not 0 <= lo.dropout < 1:
        problems.append(
            f"need lora.rank > 0, alpha > 0 and 0 <= dropout < 1, got {lo.rank}, "
            f"{lo.alpha}, {lo.dropout}"
        )
    if cfg.checkpoint.save_hf != "off":
        problems.append(
            "checkpoint.save_hf would write the base without the adapters under --lora: export "
            "them (pipe export CKPT --peft) or merge them in (pipe convert CKPT --to hf)"
        )
    return problems


def _layout_problems(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """The layout rules (`pipeline.core.parallel.layout_rules`, their one home) for
    this run's parallel section, model, sequence and batch."""
    problems = []
    try:
        model = cfg.model_config()
    except ConfigError as e:
        problems.append(str(e))
        model = None
    t = cfg.training
    return problems + layout_problems(
        cfg.parallel,
        world_size=world_size,
        model=model,
        seq_length=cfg.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        model_name=cfg.model.flavor,
    )


def _split_problems(split: str) -> list[str]:
    """`data.split` must be up to three non-negative numbers with a positive sum."""
    parts = [x.strip() for x in split.replace("/", ",").split(",")]
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        return [f"data.split {split!r} must be up to three comma-separated numbers"]
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        return [f"data.split {split!r}: up to three non-negative numbers with a positive sum"]
    return []
