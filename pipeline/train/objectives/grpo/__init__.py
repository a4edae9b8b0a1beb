"""GRPO, the registry's entry `grpo` (`pipe train --grpo`): reinforcement learning with
verifiable rewards on completions of prompts. Torch-free: the class is `objective.py` (with
`loss.py`, `correction.py`, `logprobs.py`, `rewards.py`, `rollout.py`, `remote.py`, `ahead.py`,
`split.py`, `agent.py`, `tools.py`, `metrics.py`), the data
`data.py`; what the rollout engine holds in memory is estimated here, for `--dry-run`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.train.objectives import ObjectiveOption, ObjectiveSpec
from pipeline.train.objectives.grpo.settings import GRPOSection

if TYPE_CHECKING:
    from pipeline.train.config.schema import TrainConfig

__all__ = ["ROLLOUT_BLOCK", "SPECS"]

ROLLOUT_BLOCK = 16
"""Tokens per KV cache block of GRPO's rollout engine (`rollout.RolloutModel`); the dry run's
estimate rounds each completion's positions up to whole blocks of it."""


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
        problems.append(
            "data.kind = grpo runs without pipeline, context or expert parallelism for now: "
            "parallel.pp, cp and ep 1"
        )
    if g.num_generations < 2:
        problems.append("grpo.num_generations must be at least 2 (advantages compare a group)")
    if not 0 < g.max_completion_length < cfg.data.seq_length:
        problems.append(
            "grpo.max_completion_length must be > 0 and leave room for a prompt in "
            f"data.seq_length ({cfg.data.seq_length})"
        )
    if g.num_iterations < 1:
        problems.append("grpo.num_iterations must be at least 1")
    elif cfg.checkpoint.save_interval % g.num_iterations:
        problems.append(
            f"checkpoint.save_interval must be a multiple of grpo.num_iterations "
            f"({g.num_iterations}): a checkpoint falls between batches of rollouts"
        )
    if g.reward_weights and len(g.reward_weights) != len(g.reward_funcs):
        problems.append(
            f"grpo.reward_weights has {len(g.reward_weights)} weights for "
            f"{len(g.reward_funcs)} reward_funcs"
        )
    problems += _agent_problems(cfg)
    if cfg.model.mtp_num_layers:
        problems.append("data.kind = grpo trains no multi-token prediction: model.mtp_num_layers 0")
    if g.rollout_server and cfg.lora.enabled:
        problems.append(
            "grpo.rollout_server pushes whole weights: train without --lora, or leave "
            "grpo.rollout_server empty"
        )
    if g.rollout_server and g.rollout_cuda_graphs != "auto":
        problems.append(
            f"grpo.rollout_cuda_graphs = {g.rollout_cuda_graphs} has no effect with "
            "grpo.rollout_server: start the server with --cuda-graphs or --no-cuda-graphs"
        )
    if g.rollout_server and g.rollout_trainer_shapes == "on":
        problems.append(
            "grpo.rollout_trainer_shapes = on has no effect with grpo.rollout_server (another "
            "process decodes): leave it auto"
        )
    return problems


def _agent_problems(cfg: TrainConfig) -> list[str]:
    """The tools' and the rollouts-ahead settings that cannot run."""
    g, problems = cfg.grpo, []
    if g.max_tool_calling_iterations is not None and g.max_tool_calling_iterations < 1:
        problems.append("grpo.max_tool_calling_iterations must be at least 1 (or unset)")
    if not g.tool_timeout > 0:
        problems.append("grpo.tool_timeout must be > 0 seconds")
    if g.max_staleness < 0:
        problems.append("grpo.max_staleness must be >= 0")
    elif g.max_staleness and not g.rollout_server:
        problems.append(
            "grpo.max_staleness >= 1 generates ahead on a rollout server: set grpo.rollout_server"
        )
    elif g.max_staleness and (
        cfg.parallel.tp > 1 or g.num_iterations > 1 or g.tools or g.environment
    ):
        problems.append(
            "grpo.max_staleness >= 1 runs with parallel.tp 1, grpo.num_iterations 1 and no "
            "tools for now"
        )
    return problems


def _grpo_held_bytes(cfg: TrainConfig, model: Any, dp: int) -> tuple[float, str]:
    """The rollout engine's weights (a copy unless the engine runs on the policy itself: one
    fp32 process, not compiled; see `rollout`) and its KV cache (and linear attention's
    per-sequence states), sized for every completion of
    this rank's share of its prompts at once (a tp rank draws 1/tp of them, `split`); nothing
    with a rollout server."""
    from pipeline.core.model.flavors import num_parameters
    from pipeline.core.model.kv_sizes import kv_bytes_per_token, state_bytes_per_sequence
    from pipeline.train.config.compile_setting import compile_enabled

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
    kv += rows * state_bytes_per_sequence(model)  # linear attention's states, fp32
    what = "the KV cache" if shared else "a copy of the weights and the KV cache"
    return weights + kv, f"rollout engine ({what})"


_DATA = "pipeline.train.objectives.grpo.data"

SPECS = (
    ObjectiveSpec(
        "grpo",
        "pipeline.train.objectives.grpo.objective:GRPO",
        "reinforcement learning with verifiable rewards: GRPO on completions of prompts",
        datasets=f"{_DATA}:prompt_datasets",
        data_note=f"{_DATA}:skipped_prompts",
        sequences_per_sample=lambda cfg: cfg.grpo.num_generations,
        chat_prompts=True,
        problems=_grpo_problems,
        section=GRPOSection,
        held_bytes=_grpo_held_bytes,
        flag_help="Reinforcement learning with verifiable rewards (GRPO) on prompts (--data "
        "prompts.jsonl): completions generated from the current weights, the [grpo] loss "
        "(data.kind=grpo).",
        options=(
            ObjectiveOption(
                "--reward-function",
                "grpo.reward_funcs",
                "MODULE:FUNCTION",
                "With --grpo: a reward of your own, imported from MODULE (repeatable; adds to "
                "grpo.reward_funcs).",
                multiple=True,
            ),
            ObjectiveOption(
                "--tool",
                "grpo.tools",
                "MODULE:FUNCTION",
                "With --grpo: a tool the model may call in its rollouts (repeatable; adds to "
                "grpo.tools).",
                multiple=True,
            ),
            ObjectiveOption(
                "--environment",
                "grpo.environment",
                "MODULE:CLASS",
                "With --grpo: an environment class, one instance per rollout, whose methods are "
                "tools (grpo.environment).",
            ),
            ObjectiveOption(
                "--rollout-server",
                "grpo.rollout_server",
                "URL",
                "With --grpo: generate the rollouts on the `pipe serve` at URL (on this "
                "machine), pushing the new weights to it before each batch "
                "(grpo.rollout_server).",
            ),
        ),
    ),
)
