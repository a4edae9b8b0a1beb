"""The newer GRPO loss types (cispo, sapo, luspo, vespo) against TRL 1.16's `_compute_loss` (the
test oracle), fp32, 1e-6: the loss, its gradient by the log-probabilities and the figures TRL
logs, at both importance sampling levels, with and without the KL term, with each option at
its default and changed; gradient accumulation over two micro-batches. TRL runs on the stub
trainer of `test_grpo_loss` (the attributes `_compute_loss` reads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.train.objectives.grpo.loss import (
    SHAPE_OPTIONS,
    GRPOLossOptions,
    gamma_weights,
    loss_count,
    per_token_loss,
    reduce_loss,
)
from pipeline.train.objectives.grpo.settings import GRPOSection
from tests.train.test_grpo_loss import MAX_LENGTH, TOL, leaf, rollouts, stub_trainer, trl_loss

pytest.importorskip("trl")
NEW_TYPES = ["cispo", "sapo", "luspo", "vespo"]
CHANGED = dict(  # every sapo and vespo option away from its default
    sapo_temperature_neg=0.7,
    sapo_temperature_pos=1.6,
    vespo_k_pos=1.5,
    vespo_lambda_pos=2.5,
    vespo_k_neg=2.0,
    vespo_lambda_neg=1.2,
)
LOGGED = {"cispo": ["cispo_clip_ratio"], "sapo": [], "vespo": ["vespo/phi_seq_mean"]}
CLIPS = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]


def trl_args(options: GRPOLossOptions, accumulation: int) -> SimpleNamespace:
    """The `args` TRL's `_compute_loss` reads, the new loss types' options included."""
    names = ("delta", "use_bias_correction_kl", *SHAPE_OPTIONS)
    args = {name: getattr(options, name) for name in names}
    return SimpleNamespace(steps_per_generation=accumulation, **args)


@pytest.fixture(autouse=True)
def full_args(monkeypatch):
    """`stub_trainer` with TRL's args for every option of the new loss types."""
    import tests.train.test_grpo_loss as base

    def stub(options, logps, accumulation):
        trainer = stub_trainer(options, logps, accumulation)
        from trl import GRPOTrainer

        trainer.args = trl_args(options, accumulation)
        trainer.get_gamma_weights = GRPOTrainer.get_gamma_weights
        return trainer

    monkeypatch.setattr(base, "stub_trainer", stub)


def ours(options, logps, old, ref, advantages, mask):
    losses, stats = per_token_loss(logps, old, ref, advantages, mask, options)
    total, count = reduce_loss(losses, mask, options)
    return total, count, stats


@pytest.mark.parametrize("changed", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_new_losses_equal_trl(loss_type, level, beta, changed):
    high = 5.0 if loss_type == "cispo" and changed else 0.28
    options = GRPOLossOptions(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=high,
        beta=beta,
        max_completion_length=MAX_LENGTH,
        **(CHANGED if changed else {}),
    )
    logps, old, ref, advantages, mask = rollouts(seed=len(loss_type) + 3 * changed)
    theirs_in, ours_in = leaf(logps), leaf(logps)
    expected, logged = trl_loss(options, theirs_in, old, ref, advantages, mask)
    total, count, stats = ours(options, ours_in, old, ref, advantages, mask)
    torch.testing.assert_close(total / count, expected, **TOL)
    (expected_grad,) = torch.autograd.grad(expected, theirs_in)
    (grad,) = torch.autograd.grad(total / count, ours_in)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    assert grad.abs().sum() > 0
    names = LOGGED.get(loss_type, CLIPS) + (["kl"] if beta else [])
    assert sorted(stats) == sorted(names)
    for name in names:
        value = stats[name][0] / stats[name][1].clamp(min=1.0)
        torch.testing.assert_close(value, torch.tensor(logged[name]), **TOL)
    assert count == loss_count(mask.float(), loss_type)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_new_losses_accumulate_as_trl(loss_type):
    options = GRPOLossOptions(loss_type=loss_type, max_completion_length=MAX_LENGTH)
    batches = [rollouts(seed=3), rollouts(seed=4)]
    batches[1][4][3, :5] = 1
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
    for mine, theirs in zip(
        torch.autograd.grad(loss, ours_in), torch.autograd.grad(expected, theirs_in)
    ):
        torch.testing.assert_close(mine, theirs, **TOL)


def test_gamma_weights_equal_trl_with_importance_ratios():
    from trl import GRPOTrainer

    logps, old, _, advantages, mask = rollouts(seed=9)
    advantages[2] = 0.0  # a zero advantage takes the positive side's k and lambda
    is_ratio = torch.exp(0.3 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1)))
    options = GRPOLossOptions(loss_type="vespo", **CHANGED)
    for ratio in (None, is_ratio):
        shape = [getattr(options, name) for name in list(CHANGED)[2:]]
        expected = GRPOTrainer.get_gamma_weights(
            advantages[:, None], logps - old, mask.float(), ratio, *shape
        )
        mine = gamma_weights(advantages[:, None], logps - old, mask.float(), ratio, options)
        torch.testing.assert_close(mine, expected, **TOL)
        assert not mine.requires_grad and (mine != 1).any()


def test_defaults_are_trls_and_bad_values_are_named():
    import dataclasses

    from trl import GRPOConfig

    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    section = GRPOSection()
    for name in CHANGED:
        assert getattr(section, name) == defaults[name], name
    options = GRPOLossOptions.from_section(GRPOSection(loss_type="sapo", **CHANGED))
    assert {name: getattr(options, name) for name in CHANGED} == CHANGED
    with pytest.raises(ValueError, match="grpo.sapo_temperature_neg"):
        GRPOLossOptions(sapo_temperature_neg=0.0)
    assert GRPOLossOptions(loss_type="luspo").warnings()  # TRL warns: sequence level is meant
    assert GRPOLossOptions(loss_type="vespo", importance_sampling_level="sequence").warnings()
    assert not GRPOLossOptions(loss_type="luspo", importance_sampling_level="sequence").warnings()
    assert not GRPOLossOptions().warnings()
