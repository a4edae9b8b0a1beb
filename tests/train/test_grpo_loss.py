"""The GRPO arithmetic against TRL 1.16's (the test oracle), fp32, 1e-6: on the same token
log-probabilities, old and reference log-probabilities, advantages and masks, pipe's loss
(loss sum / count), its gradient by the log-probabilities and its logged clip and KL figures
equal what `GRPOTrainer._compute_loss` computes and logs, for every loss type, importance
sampling level, beta (with and without the KL bias correction), old log-probabilities given or
not, and two-sided clipping; with gradient accumulation over two micro-batches, the sums over
them divide to TRL's accumulated loss and gradient.

TRL's `_compute_loss` runs on a stub trainer: a `SimpleNamespace` with the attributes it reads,
whose `_get_per_token_logps_and_entropies` hands back the fixed log-probabilities, and a
one-process accelerator. TRL's advantages sit in the middle of `_generate_and_score_completions`
(rollouts, rewards, logging), too much to stub; the test runs TRL's own lines for them, cut from
that method's source between two marker lines, on a stub `self` (a changed TRL fails here)."""

from __future__ import annotations

import inspect
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pipeline.train.objectives.grpo.loss import (
    CLIP_STATS,
    GRPOLossOptions,
    group_advantages,
    per_token_loss,
    reduce_loss,
    weighted_rewards,
)
from pipeline.train.objectives.grpo.settings import GRPOSection

trl = pytest.importorskip("trl")
ROWS, LENGTH, MAX_LENGTH = 4, 6, 8
TOL = dict(rtol=1e-6, atol=1e-6)
BETAS = [(0.0, True), (0.04, True), (0.04, False)]
COPIED = (  # the options TRL's trainer holds as its own attributes
    "loss_type",
    "beta",
    "epsilon_low",
    "epsilon_high",
    "importance_sampling_level",
    "max_completion_length",
)


def rollouts(seed: int):
    """(logps, old, ref, advantages, mask) of ROWS completions: ratios spread past both clip
    bounds, advantages of both signs, completions of 6, 4 and 1 tokens and an empty one."""
    g = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(ROWS, LENGTH, generator=g)
    old = logps + 0.4 * torch.randn(ROWS, LENGTH, generator=g)
    old[0, 0], old[1, 1] = logps[0, 0] - 0.5, logps[1, 1] + 0.5  # past the high and low bounds
    ref = logps + 0.3 * torch.randn(ROWS, LENGTH, generator=g)
    advantages = torch.tensor([1.2, -0.7, 0.5, -1.1]) * (1 + seed % 3)
    mask = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    for row, length in enumerate((6, 4, 1, 0)):
        mask[row, :length] = 1
    return logps, old, ref, advantages, mask


def stub_trainer(options: GRPOLossOptions, logps: torch.Tensor, accumulation: int):
    """What `GRPOTrainer._compute_loss` reads of its trainer, on one process."""
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        **{name: getattr(options, name) for name in COPIED},
        args=SimpleNamespace(
            delta=options.delta,
            use_bias_correction_kl=options.use_bias_correction_kl,
            steps_per_generation=accumulation,
        ),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        accelerator=SimpleNamespace(
            num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )


def trl_loss(options, logps, old, ref, advantages, mask, accumulation=1, num_items=None):
    """TRL's loss of one micro-batch and the figures it logged."""
    from trl import GRPOTrainer

    stub = stub_trainer(options, logps, accumulation)
    inputs = {
        "prompt_ids": torch.zeros(ROWS, 1, dtype=torch.long),
        "prompt_mask": torch.ones(ROWS, 1, dtype=torch.long),
        "completion_ids": torch.zeros(ROWS, LENGTH, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if options.beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[0] for k, v in stub._metrics["train"].items()}


def ours(options, logps, old, ref, advantages, mask):
    """(loss sum, count, stats) of one micro-batch."""
    losses, stats = per_token_loss(logps, old, ref, advantages, mask, options)
    total, count = reduce_loss(losses, mask, options)
    return total, count, stats


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_(True)


@pytest.mark.parametrize("delta", [None, 1.25])
@pytest.mark.parametrize("old_given", [True, False])
@pytest.mark.parametrize("beta,bias_correction", BETAS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_gradient_and_stats_equal_trl(
    loss_type, level, beta, bias_correction, old_given, delta
):
    options = GRPOLossOptions(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=0.2,
        epsilon_high=0.28,
        delta=delta,
        beta=beta,
        use_bias_correction_kl=bias_correction,
        max_completion_length=MAX_LENGTH,
    )
    logps, old, ref, advantages, mask = rollouts(seed=len(loss_type) + 7 * (delta is None))
    old = old if old_given else None
    theirs_in, ours_in = leaf(logps), leaf(logps)
    expected, logged = trl_loss(options, theirs_in, old, ref, advantages, mask)
    total, count, stats = ours(options, ours_in, old, ref, advantages, mask)
    torch.testing.assert_close(total / count, expected, **TOL)
    (expected_grad,) = torch.autograd.grad(expected, theirs_in)
    (grad,) = torch.autograd.grad(total / count, ours_in)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    assert grad.abs().sum() > 0
    names = list(CLIP_STATS) + (["kl"] if beta else [])
    assert sorted(stats) == sorted(names)
    for name in names:
        value = stats[name][0] / stats[name][1].clamp(min=1.0)
        torch.testing.assert_close(value, torch.tensor(logged[name]), **TOL)
    if old_given and level == "token":  # the data clips: the figures are not vacuous
        assert stats["clip_ratio/low_mean"][0] > 0 and stats["clip_ratio/region_mean"][0] > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_two_micro_batches_equal_trl_accumulation(loss_type, level):
    options = GRPOLossOptions(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=0.28,
        beta=0.04,
        max_completion_length=MAX_LENGTH,
    )
    batches = [rollouts(seed=1), rollouts(seed=2)]
    batches[1][4][3, :5] = 1  # the micro-batches' token counts differ
    num_items = sum(int(b[4].sum()) for b in batches)
    theirs_in = [leaf(b[0]) for b in batches]
    ours_in = [leaf(b[0]) for b in batches]
    expected = sum(
        trl_loss(options, x, *b[1:], accumulation=2, num_items=num_items)[0]
        for x, b in zip(theirs_in, batches)
    )
    parts = [ours(options, x, *b[1:])[:2] for x, b in zip(ours_in, batches)]
    loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    torch.testing.assert_close(loss, expected, **TOL)
    grads = torch.autograd.grad(loss, ours_in)
    for mine, theirs in zip(grads, torch.autograd.grad(expected, theirs_in)):
        torch.testing.assert_close(mine, theirs, **TOL)


START_MARK = "unscorable_mask = torch.isnan(rewards_per_func)"
END_MARK = "advantages = torch.nan_to_num(advantages, nan=0.0)"


def trl_advantages(per_func, weights, num_generations, scale_rewards):
    """TRL's advantages and zero-std flags: its own lines of `_generate_and_score_completions`,
    from the unscorable mask to the NaN-to-0, run on a stub `self`."""
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    first, last = START_MARK, END_MARK
    starts = [i for i, line in enumerate(lines) if first in line]
    ends = [i for i, line in enumerate(lines) if last in line]
    assert len(starts) == 1 and len(ends) == 1, "TRL's advantage code moved: update the markers"
    stub = SimpleNamespace(
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards=scale_rewards,
        reward_weights=weights,
        reward_funcs=[None] * len(weights),
    )
    scope = {
        "torch": torch,
        "nanstd": nanstd,
        "self": stub,
        "rewards_per_func": per_func,
        "num_generations": num_generations,
        "device": per_func.device,
    }
    exec(textwrap.dedent("\n".join(lines[starts[0] : ends[0] + 1])), scope)
    return scope["advantages"], scope["is_std_zero"]


def reward_table() -> torch.Tensor:
    """`[16, 2]` rewards of two functions for 4 groups of 4: varied; all equal (zero std); one
    unscorable row and one with a function missing; three unscorable rows of four."""
    g = torch.Generator().manual_seed(5)
    table = torch.rand(16, 2, generator=g)
    table[4:8] = torch.tensor([1.0, 0.5])
    table[8, :] = float("nan")
    table[9, 1] = float("nan")
    table[12:15, :] = float("nan")
    return table


@pytest.mark.parametrize("num_generations", [4, 2, 1])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(scale_rewards, num_generations):
    table, weights = reward_table(), torch.tensor([1.0, 0.5])
    expected, expected_zero = trl_advantages(table, weights, num_generations, scale_rewards)
    rewards = weighted_rewards(table, weights)
    advantages, zero = group_advantages(rewards, num_generations, scale_rewards)
    torch.testing.assert_close(advantages, expected, **TOL)
    assert torch.equal(zero, expected_zero)
    assert advantages[8] == 0 and advantages[12:15].eq(0).all()  # unscorable: no signal
    assert torch.isnan(rewards[8]) and not torch.isnan(rewards[9])
    if num_generations == 4 and scale_rewards != "batch":
        assert zero[4:8].all() and not zero[:4].any() and advantages[4:8].eq(0).all()
        assert advantages[15] == 0  # a group with one scorable row has no deviation


def test_options_from_section_and_bad_values():
    options = GRPOLossOptions.from_section(GRPOSection(epsilon=0.1, loss_type="bnpo"))
    assert (options.epsilon_low, options.epsilon_high, options.loss_type) == (0.1, 0.1, "bnpo")
    assert GRPOLossOptions.from_section(GRPOSection(epsilon_high=0.28)).epsilon_high == 0.28
    for bad, field in [
        (dict(loss_type="ppo"), "grpo.loss_type"),
        (dict(importance_sampling_level="tokens"), "grpo.importance_sampling_level"),
        (dict(epsilon_low=1.0), "grpo.epsilon"),
        (dict(delta=0.0), "grpo.delta"),
        (dict(beta=-0.1), "grpo.beta"),
        (dict(max_completion_length=0), "grpo.max_completion_length"),
    ]:
        with pytest.raises(ValueError, match=field):
            GRPOLossOptions(**bad)
    logps, old, _, advantages, mask = rollouts(seed=0)
    with pytest.raises(ValueError, match="ref_logps"):
        per_token_loss(logps, old, None, advantages, mask, GRPOLossOptions(beta=0.04))
    with pytest.raises(ValueError, match="grpo.scale_rewards"):
        group_advantages(torch.zeros(4), 2, "std")
    with pytest.raises(ValueError, match="grpo.num_generations"):
        group_advantages(torch.zeros(5), 2, "group")
