"""The rollout/trainer mismatch and its importance-sampling correction against TRL 1.16 (the
test oracle), fp32, 1e-6: the ratios of each of TRL's four modes with and without each bound,
the figures TRL logs, and the loss of every loss type weighed by them (TRL's `_compute_loss`
with its vLLM correction on). TRL computes the ratios and figures inside
`_generate_and_score_completions`; the test runs its own lines for them, cut from that
method's source between marker lines, on a stub `self` (a changed TRL fails here).

Then two micro runs: fp32 with the engine in the trainer (auto: no correction) logs a mismatch
at the rounding of fp32 only; bf16 (auto: corrected) logs a mismatch far above it and the
ratios' figures."""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pipeline.train.objectives.grpo.correction import (
    CorrectionOptions,
    correction_on,
    importance_ratio,
    mismatch_figures,
)
from pipeline.train.objectives.grpo.loss import (
    LOSS_TYPES,
    GRPOLossOptions,
    per_token_loss,
    reduce_loss,
)
from pipeline.train.objectives.grpo.settings import GRPOSection
from tests.builders import records
from tests.train.test_grpo import _train, grpo_sets, task  # noqa: F401
from tests.train.test_grpo_loss import MAX_LENGTH, TOL, leaf, rollouts
from tests.train.test_grpo_loss_types import full_args  # noqa: F401

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
BOUNDS = [(None, 3.0), (0.8, 1.25), (0.9, None)]


def source_lines(first: str, stop: str) -> str:
    """TRL's lines of `_generate_and_score_completions` from the one holding `first` up to
    (not including) the first after it holding `stop`, dedented."""
    from trl import GRPOTrainer

    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    starts = [i for i, line in enumerate(lines) if first in line]
    assert len(starts) == 1, "TRL's correction code moved: update the markers"
    end = next(i for i in range(starts[0], len(lines)) if stop in lines[i])
    return textwrap.dedent("\n".join(lines[starts[0] : end]))


RATIO_CODE = (
    "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
    "# Compute the per-token log probabilities for the reference model",
)
FIGURES_CODE = ("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {")


def trl_correction(trainer, engine, mask, options: CorrectionOptions):
    """TRL's importance ratios and logged figures, its own lines on a stub `self`."""
    from trl.trainer.utils import nanmax, nanmin

    stub = SimpleNamespace(
        vllm_importance_sampling_mode=options.mode,
        vllm_importance_sampling_clip_min=options.clip_min,
        vllm_importance_sampling_clip_max=options.clip_max,
        accelerator=SimpleNamespace(gather=lambda t: t.reshape(-1)),
        _metrics={"train": defaultdict(list)},
    )
    scope = {
        "torch": torch,
        "math": math,
        "nanmin": nanmin,
        "nanmax": nanmax,
        "self": stub,
        "mode": "train",
        "device": trainer.device,
        "old_per_token_logps": trainer,
        "sampling_per_token_logps": engine,
        "completion_mask": mask,
        "tool_mask": None,
        "mask": mask,
    }
    exec(source_lines(*RATIO_CODE), scope)
    exec(source_lines(*FIGURES_CODE), scope)
    logged = {k: v[0] for k, v in stub._metrics["train"].items()}
    return scope["vllm_importance_sampling_ratio"], logged


def logps_pair(seed: int):
    """(trainer, engine, mask) log-probabilities: differences wide enough to pass each bound,
    one token the engine could not score (NaN), completions of 6, 4, 1 and 0 tokens."""
    logps, _, _, _, mask = rollouts(seed)
    g = torch.Generator().manual_seed(seed)
    engine = logps + 0.3 * torch.randn(logps.shape, generator=g)
    engine[1, 2] = float("nan")
    return logps, engine, mask


@pytest.mark.parametrize("bounds", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
def test_ratios_and_figures_equal_trl(mode, bounds):
    options = CorrectionOptions(mode, clip_min=bounds[0], clip_max=bounds[1])
    trainer, engine, mask = logps_pair(seed=len(mode))
    expected, logged = trl_correction(trainer, engine, mask, options)
    ratio = importance_ratio(trainer, engine, mask, options)
    torch.testing.assert_close(ratio, expected, **TOL)
    assert ratio.shape == ((4, 1) if mode.startswith("sequence") else (4, 6))
    means, extremes = mismatch_figures(trainer, engine, mask, ratio)
    figures = {name: float(total / count) for name, (total, count) in means.items()}
    figures |= {name: float(value) for name, value in extremes.items()}
    for name in (
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    ):
        assert figures[name] == pytest.approx(logged[name], rel=1e-6, abs=1e-6), name
    d = (trainer - engine)[mask.bool() & ~torch.isnan(engine)].double()
    assert figures["sampling/kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-9)
    assert figures["sampling/kl"] > 0
    if mode.endswith("mask") and bounds[1] == 1.25:  # the bounds bite: not vacuous
        assert (ratio == 0).any()


def trl_corrected_loss(options, logps, old, ref, advantages, mask, is_ratio):
    """TRL's loss of one micro-batch with its vLLM correction on and the ratios given."""
    from trl import GRPOTrainer

    import tests.train.test_grpo_loss as base

    stub = base.stub_trainer(options, logps, 1)
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    inputs = {
        "prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(mask.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum().float(),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": is_ratio,
    }
    return GRPOTrainer._compute_loss(stub, None, inputs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_corrected_loss_equals_trl(loss_type, mode):
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses vespo with a sequence-level correction")
    options = GRPOLossOptions(
        loss_type=loss_type, epsilon_high=0.28, beta=0.04, max_completion_length=MAX_LENGTH
    )
    logps, old, ref, advantages, mask = rollouts(seed=len(loss_type))
    _, engine, _ = logps_pair(seed=2)
    is_ratio = importance_ratio(old, engine, mask, CorrectionOptions(mode, 1.3, 0.7))
    theirs_in, ours_in = leaf(logps), leaf(logps)
    expected = trl_corrected_loss(options, theirs_in, old, ref, advantages, mask, is_ratio)
    losses, _ = per_token_loss(ours_in, old, ref, advantages, mask, options, is_ratio)
    total, count = reduce_loss(losses, mask, options)
    torch.testing.assert_close(total / count, expected, **TOL)
    (expected_grad,) = torch.autograd.grad(expected, theirs_in)
    (grad,) = torch.autograd.grad(total / count, ours_in)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    plain, _ = per_token_loss(logps, old, ref, advantages, mask, options)
    assert not torch.allclose(reduce_loss(plain, mask, options)[0], total)  # it weighs


def test_defaults_auto_and_bad_values():
    import dataclasses

    from trl import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    section = GRPOSection()
    assert section.importance_sampling_mode == trl["vllm_importance_sampling_mode"]
    assert section.importance_sampling_clip_max == trl["vllm_importance_sampling_clip_max"]
    assert section.importance_sampling_clip_min == trl["vllm_importance_sampling_clip_min"]
    assert CorrectionOptions.from_section(section) == CorrectionOptions()
    unbounded = GRPOSection(importance_sampling_clip_max=float("inf"))
    assert CorrectionOptions.from_section(unbounded).clip_max is None

    def cfg(dtype="fp32", server="", setting="auto"):
        grpo = GRPOSection(rollout_server=server, importance_sampling_correction=setting)
        return SimpleNamespace(grpo=grpo, training=SimpleNamespace(dtype=dtype))

    assert not correction_on(cfg())
    assert correction_on(cfg("bf16")) and correction_on(cfg(server="http://127.0.0.1:1"))
    assert correction_on(cfg(setting="on")) and not correction_on(cfg("bf16", setting="off"))
    with pytest.raises(ValueError, match="grpo.importance_sampling_mode"):
        CorrectionOptions("token")
    with pytest.raises(ValueError, match="grpo.importance_sampling_clip_min"):
        CorrectionOptions(clip_min=3.0, clip_max=2.0)


def test_fp32_in_the_trainer_agrees_to_rounding_and_bf16_is_corrected(
    tmp_path,
    task,  # noqa: F811
    grpo_default_run,
):
    _train(grpo_sets(tmp_path / "bf16", task, "training.dtype=bf16"))
    fp32, bf16 = records(grpo_default_run[1]), records(tmp_path / "bf16")
    for step in (1, 2, 3):
        # fp32, one device: the engine's decoding and the training pass differ only in the
        # order of fp32 sums (kernels of other shapes), never by more than a few ulps
        assert fp32[step]["sampling/sampling_logp_difference/max"] <= 2e-6
        assert fp32[step]["sampling/kl"] < 1e-11
        assert "sampling/importance_sampling_ratio/mean" not in fp32[step]  # auto: off
        assert bf16[step]["sampling/sampling_logp_difference/mean"] > 1e-5
        low = bf16[step]["sampling/importance_sampling_ratio/min"]
        assert 0 < low <= bf16[step]["sampling/importance_sampling_ratio/mean"]
        assert bf16[step]["sampling/importance_sampling_ratio/max"] < 3.0


def test_fp32_rollouts_on_the_trainers_shapes_agree_to_the_bit(tmp_path, task):  # noqa: F811
    # fp32, the engine on the policy itself on a CPU: with the rollouts decoded on the training
    # pass's shapes (the default there) the engine's log-probabilities, from its own cached
    # decoding, are the trainer's bit for bit; on the engine's own shapes they are not. One
    # thread, where the setting's default is on (more threads split a product by its shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(grpo_sets(tmp_path / "same", task))
        _train(grpo_sets(tmp_path / "own", task, "grpo.rollout_trainer_shapes=off"))
    finally:
        torch.set_num_threads(threads)
    same, own = records(tmp_path / "same"), records(tmp_path / "own")
    for step in (1, 2, 3):
        assert same[step]["sampling/sampling_logp_difference/max"] == 0.0
        assert same[step]["sampling/kl"] == 0.0
    assert max(own[step]["sampling/sampling_logp_difference/max"] for step in (1, 2, 3)) > 0


def test_trainer_shapes_setting_and_its_refusals(tmp_path, task):  # noqa: F811
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.config.schema import ConfigError

    sets = grpo_sets(tmp_path, task)
    assert resolve_config(None, sets).grpo.rollout_trainer_shapes == "auto"
    with pytest.raises(ConfigError, match="rollout_trainer_shapes"):
        resolve_config(None, [*sets, "grpo.rollout_trainer_shapes=yes"])
    remote = [*sets, "grpo.rollout_server=http://127.0.0.1:1"]
    with pytest.raises(ConfigError, match="rollout_trainer_shapes = on has no effect"):
        resolve_config(None, [*remote, "grpo.rollout_trainer_shapes=on"])
