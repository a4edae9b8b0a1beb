"""GRPO's rollouts split over a tensor-parallel group.

The ranks of a tensor-parallel group hold the same prompts. Rather than each drawing every
completion of them (the same work tp times), tp rank `r` generates the groups `r, r + tp, ...`
(each prompt's completions stay together, sharing its prefill) and the ranks then exchange
what they drew, so each ends with the whole batch's `Rollouts` in the order one rank alone
would have produced. Each completion samples with its own seed (`completion_seed`), so which
rank draws it does not change it.

Both rollout sources split so: the engine in the trainer (`rollout.RolloutModel`) and a
rollout server (`remote.RemoteRollouts`), which then gets each request once per
data-parallel replica instead of once per tp rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from pipeline.train.objectives.grpo.rollout import Rollouts

__all__ = ["gather_rollouts", "generate_split"]


def generate_split(
    rollout: Any, prompts: Sequence[list[int]], params: Sequence[Sequence[Any]], group: Any
) -> Rollouts:
    """The completions of `prompts` (one group per prompt, one completion per entry of its
    `params` list, as `rollout.generate` draws them), this rank drawing only its share of the
    groups and the ranks of `group` (the tensor-parallel group; None: this rank alone) then
    gathering the rest. Every rank of `group` must call it at the same point.

    The prefill counters are summed over `group` (the whole batch's, as one rank alone would
    count them). `seconds` is this rank's wall time from its first request until the gather
    returns: the gather waits for the slowest rank, so it is the slowest rank's generation
    plus the exchange, the time the step spent getting its rollouts (what `rollout_share` and
    `rollout_tokens_per_s`, the whole batch's tokens over it, mean).
    """
    if group is None:
        return rollout.generate(prompts, params)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    start = time.perf_counter()
    mine = prompts[rank::size]
    own = rollout.generate(mine, params[rank::size]) if mine else Rollouts([], [], [])
    whole = gather_rollouts(own, group, [len(p) for p in params])
    whole.seconds = time.perf_counter() - start
    return whole


def gather_rollouts(own: Rollouts, group: Any, rows_per_prompt: Sequence[int]) -> Rollouts:
    """Every rank's `own` rollouts of `group` put together in the order of the whole batch: rank
    `r` of `size` holds the groups `r, r + size, ...`, prompt `i`'s `rows_per_prompt[i]`
    rows in turn. The counters are summed; `seconds` is this rank's own."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, own, group=group)
    whole = Rollouts([], [], [], seconds=own.seconds)
    taken = [0] * len(parts)
    for i, rows in enumerate(rows_per_prompt):
        part, at = parts[i % len(parts)], taken[i % len(parts)]
        whole.prompts += part.prompts[at : at + rows]
        whole.completions += part.completions[at : at + rows]
        whole.truncated += part.truncated[at : at + rows]
        whole.logprobs += part.logprobs[at : at + rows]
        whole.tool_masks += part.tool_masks[at : at + rows]
        taken[i % len(parts)] += rows
    whole.prompt_tokens_computed = sum(p.prompt_tokens_computed for p in parts)
    whole.prompt_tokens_cached = sum(p.prompt_tokens_cached for p in parts)
    return whole
