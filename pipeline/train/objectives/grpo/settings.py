"""GRPO's settings: its `[grpo]` section, which the registry adds to the config
(`ObjectiveSpec.section`), read as `cfg.grpo`. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["GRPOSection"]


@dataclass
class GRPOSection:
    """Reinforcement learning with verifiable rewards (`data.kind = "grpo"`, `pipe train --grpo`):
    rollouts from the policy's current weights, rewards, and the clipped policy-gradient loss
    (pipeline.train.objectives.grpo). Names and defaults are TRL's `GRPOConfig`'s. A step's
    `training.global_batch_size` counts prompts; each gives `num_generations` completions."""

    num_generations: int = 8
    """Completions sampled per prompt (a group: advantages are relative within it)."""
    max_completion_length: int = 512
    """Most tokens a completion may have; one cut at this limit is flagged as truncated."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1: off)."""
    top_k: int = 0
    """Top-k sampling of the rollouts (0: off)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = (
        "dapo"
    )
    """The loss and how token losses are averaged: the clipped ratio times the advantage, grpo
    per sequence then over sequences; bnpo over the tokens of each micro-batch; dr_grpo over
    sequences x max_completion_length (a constant); dapo over the tokens of the whole global
    batch; luspo each sequence's sum, over sequences (sequence level is its paper's). cispo:
    the ratio clipped above at epsilon_high (5.0 is its paper's) and detached, times the
    advantage and the log-probability, averaged as dapo; sapo: a soft sigmoid gate of the
    ratio instead of the clip, averaged as grpo; vespo: a gamma weight of the sequence's ratio
    times the advantage and the log-probability, averaged as dapo."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token (GRPO); sequence: one length-normalised ratio per completion
    (GSPO)."""
    epsilon: float = 0.2
    """Lower clipping bound of the ratio: 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clipping bound: 1 + epsilon_high (DAPO's clip-higher; default: epsilon)."""
    delta: float | None = None
    """Two-sided clipping: the unclipped ratio is capped at delta too (None: off)."""
    sapo_temperature_neg: float = 1.05
    """sapo: the gate's temperature for tokens with a non-positive advantage."""
    sapo_temperature_pos: float = 1.0
    """sapo: the gate's temperature for tokens with a positive advantage."""
    vespo_k_pos: float = 2.0
    """vespo: the power k of the gamma weight w^k exp(-lambda w) for a non-negative advantage
    (how hard ratios below 1 are down-weighted)."""
    vespo_lambda_pos: float = 3.0
    """vespo: the decay lambda for a non-negative advantage (ratios above 1)."""
    vespo_k_neg: float = 3.0
    """vespo: the power k for a negative advantage."""
    vespo_lambda_neg: float = 2.0
    """vespo: the decay lambda for a negative advantage."""
    beta: float = 0.0
    """Weight of the KL term to the frozen start (k3 estimator); 0 keeps no reference."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio (TRL's default)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the standard deviation of the group's rewards, of the global
    batch's, or not at all (Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer steps taken on each batch of rollouts (TRL's mu); the log-probabilities of
    the rollouts' weights are kept for the ratios."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss."""
    mask_zero_std_groups: bool = False
    """Leave groups whose rewards are all equal out of the loss (their advantages are 0 anyway;
    with grpo and dr_grpo they still count in the normaliser, as masked completions do)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Rewards by name: accuracy (the final answer equals the prompt's `answer`), format (the
    completion matches `format_pattern`), length (a penalty past `length_target` tokens), or a
    user's function "module:function". Empty: accuracy when the prompts have an `answer`."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (empty: 1 each); the reward is their weighted sum."""
    format_pattern: str = r"(?s).*####\s*\S+\s*$"
    """The regular expression the format reward checks the whole completion against."""
    length_target: int = 0
    """The length reward is -(tokens past length_target) / max_completion_length (0: the
    limit itself)."""
    reasoning_parser: str = ""
    """The policy's thinking format, by vLLM's --reasoning-parser name (qwen3, deepseek_r1,
    glm45, mistral, openai_gptoss for gpt-oss's harmony channels): the rewards score each
    completion's content without its reasoning, and a user's function with a `reasoning`
    parameter also gets the reasoning. Empty: rewards see the whole completion."""
    reasoning_rewards: list[str] = field(default_factory=list)
    """With reasoning_parser: the rewards (names as in reward_funcs) that score the whole
    completion, reasoning included (a think-format reward, say)."""
    log_completions: bool = False
    """Log completions with their rewards at every log step."""
    num_completions_to_print: int | None = None
    """With log_completions: how many (None: every completion of the last step on rank 0)."""
    importance_sampling_correction: Literal["auto", "on", "off"] = "auto"
    """Weigh the loss by the ratio of the trainer's log-probabilities to the engine's that
    sampled the completions (TRL's `vllm_importance_sampling_correction`): auto is on where the
    two can differ (bf16 training, a rollout server) and off where they cannot (fp32, the
    engine in the trainer). The mismatch is logged either way (`sampling/*`)."""
    importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """The correction's ratio per token or per completion (the product of its tokens'), clamped
    to [clip_min, clip_max] (truncate) or set to 0 outside it (mask); TRL's
    `vllm_importance_sampling_mode`."""
    importance_sampling_clip_max: float = 3.0
    """The correction's upper bound C_max (inf: none, TRL's None); TRL's
    `vllm_importance_sampling_clip_max` (`_cap` before)."""
    importance_sampling_clip_min: float | None = None
    """The correction's lower bound C_min (None: none)."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, "module:function" each (`--tool`, repeatable): typed Python
    functions with a Google-style docstring, offered through the chat template with their JSON
    schema (as transformers makes one). A rollout then runs over several turns: the engine
    generates, pipe reads the calls, runs them and appends their results (TRL's `tools`)."""
    environment: str = ""
    """An environment class, "module:Class" (`--environment`; TRL's `environment_factory`):
    one instance per rollout, `reset(**prompt_fields)` returning None or text appended to the
    user turn, its public methods tools, an optional `get_reward()` a reward."""
    max_tool_calling_iterations: int | None = None
    """Most rounds of tool calls in one rollout (None: until a turn calls none or the
    completion is full)."""
    tool_timeout: float = 10.0
    """Seconds a tool call may run; past it the call's result is an error message."""
    tool_call_parser: str = "auto"
    """How calls are written: hermes, llama3_json or pythonic (`pipe serve
    --tool-call-parser`'s); auto: from the chat template's text."""
    rollout_server: str = ""
    """URL of a running `pipe serve` on this machine to generate the rollouts (`--rollout-server`;
    empty: pipe's engine in the training processes), or several, "URL1,URL2", sharing the
    requests (one that cannot be reached is left out). The policy's weights are pushed to each
    before each batch of rollouts."""
    max_staleness: int = 0
    """With a rollout server: 0 generates each batch's rollouts before its step (synchronous);
    >= 1 generates the next batch while the current one trains, each batch from the weights
    of the step before (staleness 1), a batch older than this bound dropped and generated
    again; the engine's log-probabilities are the old ones of the loss."""
    rollout_trainer_shapes: Literal["auto", "on", "off"] = "auto"
    """Decode the rollouts on the training pass's shapes (`grpo.invariant`: GEMMs of at least
    four rows, attention over the training rows' length), so that the engine's log-probabilities
    equal the trainer's to the bit; auto: on where that holds, the engine running on the fp32
    policy itself on a CPU with one thread (more threads split a product's rows by its shape).
    Off: the engine's own shapes (fp32 rounding apart)."""
    rollout_cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Replay the rollout engine's decode steps from CUDA graphs, one captured per batch size
    (`pipe serve --cuda-graphs`); auto: on when training on a CUDA device. A MoE model outside
    bf16 on a GPU of compute capability 9.0 or newer, or a policy that decodes on itself with
    activation checkpointing, decodes eagerly either way and says why in the log."""
