"""The training objectives, one file each, found by `data.kind` in one registry.

An objective is what a run optimises: language modelling (pre-training, and supervised
fine-tuning, which is language modelling with a loss mask), DPO, and the next ones. Its class
(`pipeline.train.objectives.base.Objective`) owns the loss and what the loss is normalised by,
the batch keys it needs, its metrics, its setup (a reference model) and what it records in a
checkpoint; the loop (trainer, train step, step runners) calls it and names none.

This module is the registry and stays free of torch, so that `pipe train --dry-run` and the
config checks can ask what an objective is without importing it. Each entry gives the facts a
run needs before the model exists (sequences per sample, attention masking, how sample prompts
are asked, the config problems) and where the class lives; `build_objective` imports it.

To add an objective: write `objectives/NAME.py` with a subclass of `Objective`, and add one
`ObjectiveSpec` to `OBJECTIVES` below (docs/architecture.md walks through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "OBJECTIVES", "ROLLOUT_BLOCK", "ObjectiveSpec", "build_objective", "objective_problems",
    "objective_spec",
]  # fmt: skip

ROLLOUT_BLOCK = 16
"""Tokens per KV cache block of GRPO's rollout engine (`grpo_rollout.RolloutModel`); the dry
run's estimate rounds each completion's positions up to whole blocks of it."""


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the run knows of an objective before building it.

    `target` is "module:Class"; `sequences_per_sample` counts the sequences one sample holds
    (throughput counts them all; a function of the config where that decides it);
    `document_masking` stops attention at document boundaries;
    `chat_prompts` asks `training.sample_prompts` as a user's turn; `problems` lists what is
    wrong with a config for this objective (one line each, no torch); `held_bytes` says what
    the objective keeps on each device beside the model's training state, for `--dry-run`:
    (bytes, what they are) given the config, the `ModelConfig` and the data-parallel size."""

    kind: str
    target: str
    description: str
    sequences_per_sample: int | Callable[[TrainConfig], int] = 1
    document_masking: bool = False
    chat_prompts: bool = False
    problems: Callable[[TrainConfig], list[str]] = field(default=lambda cfg: [])
    held_bytes: Callable[[TrainConfig, Any, int], tuple[float, str]] | None = None

    def sequences(self, cfg: TrainConfig) -> int:
        """The sequences one sample of `cfg`'s run holds."""
        per_sample = self.sequences_per_sample
        return per_sample(cfg) if callable(per_sample) else per_sample


def _sft_problems(cfg: TrainConfig) -> list[str]:
    if cfg.data.mock:
        return [
            "data.kind = sft trains on chat data with a loss mask; mock data has none: pass "
            "--data PREFIX_messages_document (made by `pipe preprocess --chat`)"
        ]
    return []


def _dpo_problems(cfg: TrainConfig) -> list[str]:
    """DPO trains on whole preference pairs against a frozen reference."""
    problems = []
    if cfg.data.mock:
        problems.append(
            "data.kind = dpo trains on preference pairs; mock data has none: pass --data "
            "PREFIX (made by `pipe preprocess --preference`)"
        )
    k = cfg.dpo
    if k.beta <= 0 or not 0.0 <= k.label_smoothing < 0.5:
        problems.append("dpo.beta must be > 0 and dpo.label_smoothing in [0, 0.5)")
    if k.loss == "ipo" and k.label_smoothing:
        problems.append("dpo.label_smoothing applies to the sigmoid loss, not ipo")
    if cfg.model.mtp_num_layers:
        problems.append("data.kind = dpo trains no multi-token prediction: model.mtp_num_layers 0")
    return problems


def _grpo_problems(cfg: TrainConfig) -> list[str]:
    """GRPO generates from prompts with the data's tokenizer, on layouts that hold whole
    sequences on each rank."""
    g, p, problems = cfg.grpo, cfg.parallel, []
    if cfg.data.mock:
        problems.append("data.kind = grpo trains on prompts: pass --data prompts.jsonl")
    if cfg.data.tokenizer is None:
        problems.append(
            "data.kind = grpo renders prompts and reads completions with the tokenizer: set "
            "data.tokenizer (a Hugging Face tokenizer directory)"
        )
    if p.pp > 1 or p.cp > 1 or p.ep > 1:
        problems.append("data.kind = grpo runs without pipeline, context or expert parallelism "
                        "for now: parallel.pp, cp and ep 1")  # fmt: skip
    if g.num_generations < 2:
        problems.append("grpo.num_generations must be at least 2 (advantages compare a group)")
    if not 0 < g.max_completion_length < cfg.data.seq_length:
        problems.append("grpo.max_completion_length must be > 0 and leave room for a prompt in "
                        f"data.seq_length ({cfg.data.seq_length})")  # fmt: skip
    if g.num_iterations < 1:
        problems.append("grpo.num_iterations must be at least 1")
    elif cfg.checkpoint.save_interval % g.num_iterations:
        problems.append(
            f"checkpoint.save_interval must be a multiple of grpo.num_iterations "
            f"({g.num_iterations}): a checkpoint falls between batches of rollouts"
        )
    if g.reward_weights and len(g.reward_weights) != len(g.reward_funcs):
        problems.append(f"grpo.reward_weights has {len(g.reward_weights)} weights for "
                        f"{len(g.reward_funcs)} reward_funcs")  # fmt: skip
    if cfg.model.mtp_num_layers:
        problems.append("data.kind = grpo trains no multi-token prediction: model.mtp_num_layers 0")
    if g.rollout_server and cfg.lora.enabled:
        problems.append("grpo.rollout_server pushes whole weights: train without --lora, or "
                        "leave grpo.rollout_server empty")  # fmt: skip
    return problems


def _grpo_held_bytes(cfg: TrainConfig, model: Any, dp: int) -> tuple[float, str]:
    """The rollout engine's weights (a copy unless the engine runs on the policy itself: one
    fp32 process, not compiled; see `grpo_rollout`) and its KV cache, sized for every
    completion of this rank's share of its prompts at once (a tp rank draws 1/tp of them,
    `grpo_split`); nothing with a rollout server."""
    from pipeline.core.model.flavors import num_parameters
    from pipeline.core.model.kv_sizes import kv_bytes_per_token
    from pipeline.train.assembly.compile_setting import compile_enabled

    if cfg.grpo.rollout_server:  # the server holds them
        return 0.0, ""
    bf16 = cfg.training.dtype == "bf16"
    device_type = "cpu" if cfg.training.device == "cpu" else "cuda"  # "auto": a GPU's defaults
    compiled = compile_enabled(cfg.training.compile, device_type)
    shared = not bf16 and cfg.parallel.tp == 1 and dp == 1 and not compiled
    weights = 0 if shared else num_parameters(model) * (2 if bf16 else 4)
    prompts = -(-(cfg.training.global_batch_size // dp) // cfg.parallel.tp)
    rows = prompts * cfg.grpo.num_generations
    positions = -(-cfg.data.seq_length // ROLLOUT_BLOCK) * ROLLOUT_BLOCK
    kv = rows * positions * kv_bytes_per_token(model, 2 if bf16 else 4)
    what = "the KV cache" if shared else "a copy of the weights and the KV cache"
    return weights + kv, f"rollout engine ({what})"


_LM = "pipeline.train.objectives.language_model:LanguageModelling"

OBJECTIVES: dict[str, ObjectiveSpec] = {
    spec.kind: spec
    for spec in (
        ObjectiveSpec("gpt", _LM, "pre-training: next-token cross-entropy over every token"),
        ObjectiveSpec(
            "sft", _LM, "supervised fine-tuning: cross-entropy over the assistant's tokens",
            document_masking=True, chat_prompts=True, problems=_sft_problems,
        ),  # fmt: skip
        ObjectiveSpec(
            "dpo", "pipeline.train.objectives.dpo:DPO",
            "preference tuning: the DPO loss of chosen/rejected pairs against a frozen reference",
            sequences_per_sample=2, chat_prompts=True, problems=_dpo_problems,
        ),  # fmt: skip
        ObjectiveSpec(
            "grpo", "pipeline.train.objectives.grpo:GRPO",
            "reinforcement learning with verifiable rewards: GRPO on completions of prompts",
            sequences_per_sample=lambda cfg: cfg.grpo.num_generations, chat_prompts=True,
            problems=_grpo_problems, held_bytes=_grpo_held_bytes,
        ),  # fmt: skip
    )
}


def objective_spec(kind: str) -> ObjectiveSpec:
    """The registry entry of `data.kind` (KeyError for an unknown kind: config checks first)."""
    return OBJECTIVES[kind]


def objective_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with `cfg` for its objective, an unknown `data.kind` included."""
    spec = OBJECTIVES.get(cfg.data.kind)
    if spec is None:
        return [f"data.kind {cfg.data.kind!r}: one of {', '.join(OBJECTIVES)}"]
    return spec.problems(cfg)


def build_objective(cfg: TrainConfig, **context: Any) -> Any:
    """The objective of `cfg.data.kind`, its class imported now; `context` goes to it."""
    spec = objective_spec(cfg.data.kind)
    module, name = spec.target.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(cfg, spec, **context)
