"""GRPO's rollouts: completions of a step's prompts by pipe's own engine, in the training
processes, from the weights the policy has now (no copy on disk).

The engine (`pipeline.serve.engine.core.Engine`: continuous batching over a block KV cache) runs the
model's own cached decoding. Where the policy is one ordinary fp32 module on this rank (one
process, no tensor or data sharding, not compiled, fp32 training) the engine runs on the policy
itself; otherwise on a plain copy of the model held beside it (`RolloutModel`), refreshed from
the policy's full weights before each batch of rollouts (under tensor parallelism and FSDP every
rank gathers the full weights together; an FSDP rank then generates its own prompts, and the tp
ranks, which hold the same prompts, each generate a share of them and exchange the
completions, `split`). A LoRA policy's copy carries the same adapters, so the copy is the
adapted model.

With bf16 training the copy is in bf16, as `pipe serve` holds a model on a GPU, and the engine
runs outside the training step's autocast: under autocast every decoding step pays casts (the
fp32 KV cache read back and cast at every layer, activations around every matmul; extra
kernels in a loop bound by kernel launches; the first GPU run measured rollouts in the step at
0.85x the engine alone), while the copy is cast once per step, when refreshed, and its KV cache
is bf16: half the bytes.

In fp32 with the engine on the policy itself on a CPU the decoding runs on the training pass's
shapes (`invariant`, `grpo.rollout_trainer_shapes`): the engine samples from the logits the
training pass computes, bit for bit, and its log-probabilities are the trainer's.

Sampling is reproducible whatever the layout: completion `g` of the prompt at global sample
index `s` draws from its own generator, seeded by (training.seed, s, g) (`completion_seed`). A
step's rollouts are thus a function of the weights and the samples alone: one process, tensor
and data parallelism give the same completions, and a resumed run draws what the killed one
would have (the sampling state is the iteration, which the checkpoint holds).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.train.objectives.base import evaluation_mode
from pipeline.train.objectives.grpo import ROLLOUT_BLOCK
from pipeline.train.objectives.grpo.invariant import trainer_shapes

__all__ = ["Rollouts", "RolloutModel", "completion_seed", "named_full_tensors", "rollout_rows"]


def completion_seed(seed: int, sample: int, generation: int) -> int:
    """The sampling seed of completion `generation` of the prompt at global sample index
    `sample`: the same on every rank and layout, different for every completion."""
    words = np.random.SeedSequence([seed, sample, generation]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


@dataclass
class Rollouts:
    """One batch of rollouts on this rank, row-major: the completions of each prompt in turn
    (`num_generations` rows per prompt)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    truncated: list[bool]
    """Cut at `max_completion_length` without an end-of-sequence token."""
    seconds: float = 0.0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    logprobs: list[list[float]] = field(default_factory=list)
    """Each completion token's log-probability under the engine that sampled it (the model's
    own, before the temperature), when the requests asked (`SamplingParams.logprobs`); empty
    otherwise."""
    tool_masks: list[list[int]] = field(default_factory=list)
    """With tools (`agent`): per completion token, 1 where the model wrote it, 0 in a tool
    message (left out of the loss); empty otherwise."""

    @property
    def generated_tokens(self) -> int:
        return sum(len(c) for c in self.completions)


class RolloutModel:
    """The module the engine runs on: the policy itself when it is one plain module on this
    rank, else a plain copy on the same device (see the module docstring)."""

    def __init__(self, policy: torch.nn.Module, cfg: Any, device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.dtype = torch.bfloat16 if cfg.training.dtype == "bf16" else torch.float32
        self.shared = self.dtype == torch.float32 and _is_plain(policy)
        self.module = policy if self.shared else _plain_copy(policy, cfg, device, self.dtype)
        self.cuda_graphs = {"auto": None, "on": True, "off": False}[cfg.grpo.rollout_cuda_graphs]
        shapes = cfg.grpo.rollout_trainer_shapes
        # the training rows' length: the keys every attention call over the cache is padded to
        self.trainer_shapes = (
            cfg.data.seq_length
            if shapes == "on" or (shapes == "auto" and self.shared and _one_cpu_thread(device))
            else None
        )
        self.engine: Any = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the policy's current weights into the copy (every rank of the layout calls this
        at the same point: gathering a sharded weight is a collective); nothing to copy when
        the engine runs on the policy itself. Either way the engine's prefix cache, computed by
        the weights before, is dropped."""
        if self.engine is not None:
            self.engine.weights_changed()
        if self.shared:
            return
        target = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        for name, full in named_full_tensors(self.policy):
            if name in target:
                target[name].copy_(full)

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[Sequence[Any]],
    ) -> Rollouts:
        """The completions of `prompts` (one group per prompt, one completion per entry of its
        `params` list, each with its own seed), all queued at once."""
        engine = self._engine(prompts, max(len(p) for p in params), params[0][0].max_new_tokens)
        computed, cached = engine.prompt_tokens_computed, engine.prompt_tokens_cached
        start = time.perf_counter()
        groups = [engine.add_group(list(p), group) for p, group in zip(prompts, params)]
        rows = [request for group in groups for request in group]
        logprobs: dict[int, list[float]] = {id(r): [] for r in rows}
        with (
            evaluation_mode(self.module),
            torch.autocast(self.device.type, enabled=False),
            self._shapes(),
        ):
            for event in engine.run():
                if event.logprobs is not None:
                    logprobs[id(event.request)].append(event.logprobs.token_logprob)
        seconds = time.perf_counter() - start
        return Rollouts(
            prompts=[list(r.prompt) for r in rows],
            completions=[list(r.output) for r in rows],
            truncated=[r.finish_reason == "length" for r in rows],
            seconds=seconds,
            prompt_tokens_computed=engine.prompt_tokens_computed - computed,
            prompt_tokens_cached=engine.prompt_tokens_cached - cached,
            logprobs=[logprobs[id(r)] for r in rows] if rows[0].params.logprobs is not None else [],
        )

    def _shapes(self) -> Any:
        """The training pass's shapes for the decoding (`invariant`), when they are asked."""
        if self.trainer_shapes is None:
            return contextlib.nullcontext()
        return trainer_shapes(self.module, self.trainer_shapes)

    def _engine(self, prompts: Sequence[list[int]], group: int, max_new: int) -> Any:
        """An engine big enough for every completion of `prompts` at once (kept while it is)."""
        from pipeline.serve.engine.core import Engine

        rows = len(prompts) * group
        block = ROLLOUT_BLOCK
        blocks = rows * -(-(max(len(p) for p in prompts) + max_new) // block)
        e = self.engine
        if e is None or e.scheduler.max_batch < rows or e.cache.num_blocks < blocks:
            self.engine = Engine(
                self.module,
                max_batch=rows,
                cache_blocks=blocks,
                block_size=block,
                prefill_chunk=4096,
                max_waiting=rows,
                cuda_graphs=self.cuda_graphs,
                # On the trainer's shapes each row's keys in order, and no step mixing prompt
                # chunks into the decode rows' pass (the padding is per call: `invariant`).
                pack_decode=self.trainer_shapes is None,
                mix_prompts=self.trainer_shapes is None,
            )
        return self.engine


def rollout_rows(
    rollouts: Rollouts, seq_length: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The rollouts as training rows `[rows, seq_length]`: prompt and completion, the labels
    (the next token), the loss mask on the positions that predict a completion token (its
    end-of-sequence token included; not a tool message's tokens, `tool_masks`), and positions;
    with the engine's log-probabilities, those at the same positions as `engine_logps`."""
    n = len(rollouts.completions)
    tokens = torch.zeros(n, seq_length + 1, dtype=torch.long)
    mask = torch.zeros(n, seq_length, dtype=torch.float32)
    engine = torch.zeros(n, seq_length, dtype=torch.float32)
    for row, (prompt, completion) in enumerate(zip(rollouts.prompts, rollouts.completions)):
        whole = prompt + completion
        tokens[row, : len(whole)] = torch.tensor(whole)
        mask[row, len(prompt) - 1 : len(whole) - 1] = 1.0
        if rollouts.tool_masks:
            own = torch.tensor(rollouts.tool_masks[row], dtype=torch.float32)
            mask[row, len(prompt) - 1 : len(whole) - 1] *= own
        if rollouts.logprobs:
            engine[row, len(prompt) - 1 : len(whole) - 1] = torch.tensor(rollouts.logprobs[row])
    positions = torch.arange(seq_length).expand(n, -1)
    rows = {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].to(device),
        "loss_mask": mask.to(device),
        "position_ids": positions.to(device),
    }
    if rollouts.logprobs:
        rows["engine_logps"] = engine.to(device)
    return rows


def _one_cpu_thread(device: torch.device) -> bool:
    """A CPU run on one thread: the only setting where torch's products give a row the same bits
    from four rows up (with more threads the rows are split among them by the shape)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def _is_plain(model: torch.nn.Module) -> bool:
    """Whether `model` is one ordinary module on this rank (no DTensor weight, not compiled)."""
    from torch.distributed.tensor import DTensor

    compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
    return not compiled and not any(isinstance(p, DTensor) for p in model.parameters())


def named_full_tensors(model: torch.nn.Module):
    """(name, whole tensor) of each parameter and buffer of `model`: a sharded (DTensor) one
    gathered, which every rank of its mesh must ask for at the same point."""
    from torch.distributed.tensor import DTensor

    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _plain_copy(
    policy: torch.nn.Module, cfg: Any, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """A plain model of the policy's shape (its adapters included) on `device` in `dtype` (its
    rotary frequencies kept in fp32, as `pipe serve` keeps them), for the engine; `refresh`
    fills it."""
    from pipeline.core.model.transformer import Transformer

    with torch.device(device):
        model = Transformer(policy.config)
        if cfg.lora.enabled:
            from pipeline.core.model.lora import apply_lora
            from pipeline.train.state.lora_run import lora_spec

            apply_lora(model, lora_spec(cfg))
    for p in model.parameters():
        p.requires_grad_(False)
    if dtype != torch.float32:
        model.to(dtype)
        model.rope.init_weights(device)
    return model
