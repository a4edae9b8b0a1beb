"""fp16 training (`training.dtype = "fp16"`): it tracks fp32, a gradient overflow is skipped,
counted and logged with the loss scale, and a run killed with SIGKILL after one resumes exactly
(the scaler's state is in the checkpoint); under parallel layouts it equals one process's fp16.

The 200-step figure of the `tiny` recipe against fp32 is `scripts/fp16_vs_fp32.py`'s (too slow
for the suite on a CPU); here a micro model trains 40 steps."""

from __future__ import annotations

import logging
import signal
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import KILL_AFTER_SAVE, micro_sets, records, run_training_process

FP16 = ["training.dtype=fp16"]
# A scale the micro model's gradients never overflow at on their own, no hysteresis and a short
# window, so one forced overflow halves it and the scale then grows again every 2 steps.
SMALL_SCALE = ["training.initial_loss_scale=1024", "training.hysteresis=1"]
SHORT_WINDOW = ["training.loss_scale_window=2"]


class _Overflow(torch.autograd.Function):
    """The identity whose gradient is Inf: a loss whose backward overflows."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def force_overflow(iteration: int, setattr=setattr) -> None:
    """Make the gradients of training step `iteration` (1-based) overflow, its loss finite
    (`setattr`: pytest's monkeypatch.setattr to undo it after a test)."""
    import pipeline.train.objectives.language_model.objective as lm

    step = {"now": False}
    train_one_step, token_loss = Trainer.train_one_step, lm.token_loss

    def one_step(self, iterator):
        step["now"] = self.iteration + 1 == iteration
        try:
            return train_one_step(self, iterator)
        finally:
            step["now"] = False

    def loss(model, hidden, batch):
        loss_sum, tokens = token_loss(model, hidden, batch)
        if step["now"] and torch.is_grad_enabled():
            loss_sum = _Overflow.apply(loss_sum)
        return loss_sum, tokens

    setattr(Trainer, "train_one_step", one_step)
    setattr(lm, "token_loss", loss)


# tests.builders' run killed right after a save, with step 3's gradients overflowing.
OVERFLOW_THEN_KILL = (
    "from tests.train.test_fp16 import force_overflow\nforce_overflow(3)\n"
    + textwrap.dedent(KILL_AFTER_SAVE)
)


def test_fp16_tracks_fp32(tmp_path: Path) -> None:
    """40 steps of the micro model from Megatron's default scale (2**32: the first steps
    overflow until the scale fits): the last 10 losses' mean is within 2% of fp32's, and the
    numerics are fp16's (the losses are not fp32's)."""
    losses, skipped = {}, {}
    for dtype in ("fp32", "fp16"):
        sets = micro_sets(tmp_path / dtype, f"training.dtype={dtype}", iters=40)
        sets.append("checkpoint.enable=false")
        result = Trainer(resolve_config(None, sets), console=False).train()
        losses[dtype] = [result.losses[s] for s in range(31, 41)]
        skipped[dtype] = result.skipped
    assert skipped["fp32"] == 0 and skipped["fp16"] > 0  # the scale backed off from 2**32
    assert np.mean(losses["fp16"]) == pytest.approx(np.mean(losses["fp32"]), rel=0.02)
    assert losses["fp16"] != losses["fp32"]
    scales = [r["loss_scale"] for r in records(tmp_path / "fp16").values()]
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2.0**32  # window of 1000
    assert all(s == 2.0 ** round(np.log2(s)) for s in scales)


def test_forced_overflow_skipped_logged_and_resumed_after_kill(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    """An overflow at step 3 of 8 is skipped (counted, logged, the scale halved); a run killed
    with SIGKILL right after saving step 4 resumes to the same losses, gradient norms and loss
    scales, bit for bit, as the uninterrupted run."""
    sets_a = micro_sets(tmp_path / "a", *FP16, *SMALL_SCALE, *SHORT_WINDOW)
    with monkeypatch.context() as patch:  # the child process of run b forces its own
        force_overflow(3, patch.setattr)
        with caplog.at_level(logging.WARNING, logger="pipeline.train"):
            result = Trainer(resolve_config(None, sets_a), console=False).train()
    assert result.skipped == 1
    assert "iteration 3: fp16 gradients overflowed at loss scale 2048: step skipped" in caplog.text
    a = records(tmp_path / "a")
    assert [a[s]["skipped"] for s in range(1, 9)] == [0, 0, 1, 1, 1, 1, 1, 1]
    # 1024 grows to 2048 after two finite steps, halves at the overflow, then grows every 2.
    assert [a[s]["loss_scale"] for s in range(1, 9)] == [1024, 2048, 1024, 1024, 2048] + [
        2048,
        4096,
        4096,
    ]

    sets_b = micro_sets(tmp_path / "b", *FP16, *SMALL_SCALE, *SHORT_WINDOW)
    proc = run_training_process(OVERFLOW_THEN_KILL, "4", "", *sets_b)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, output
    assert max(records(tmp_path / "b")) == 4
    resumed = [*sets_b, f"checkpoint.load={tmp_path / 'b' / 'checkpoints'}"]
    Trainer(resolve_config(None, resumed), console=False).train()
    b = records(tmp_path / "b")
    for key in ("loss", "grad_norm", "loss_scale", "skipped"):
        assert [a[s][key] for s in range(5, 9)] == [b[s][key] for s in range(5, 9)], key


# fp16 under the parallel layouts (the layout tests' micro runs, 6 steps), against one process's
# fp16: a forced overflow at step 2 is skipped everywhere and halves the scale (hysteresis 1),
# which grows back after 2 finite steps; the losses agree to fp16's rounding (layouts round
# partial sums in other places: tensor parallelism adds fp16 partial products across ranks,
# expert parallelism gives an expert the tokens of two ranks in one fp16 GEMM, so where an
# unforced overflow starts may differ by a factor of 2 between layouts: the scale here stays
# below that).
LAYOUT_FP16 = [
    "training.dtype=fp16",
    "training.initial_loss_scale=4096",
    "training.hysteresis=1",
    "training.loss_scale_window=2",
    "training.iters=6",
    "training.eval_interval=0",
    "checkpoint.enable=false",
]
FP16_LAYOUTS = {
    2: [
        ("tiny", "dp2", ["parallel.dp=2"]),
        ("tiny", "dp2_zero1", ["parallel.dp=2", "parallel.dp_mode=zero1"]),
        ("tiny", "dp2_replicate", ["parallel.dp=2", "parallel.dp_mode=replicate"]),
        ("tiny", "tp2", ["parallel.tp=2"]),
        ("tiny", "pp2", ["parallel.pp=2"]),
        ("tiny", "cp2", ["parallel.cp=2"]),
        ("tiny_moe", "ep2", ["parallel.ep=2"]),
    ],
    4: [
        ("tiny", "tp2_pp2", ["parallel.tp=2", "parallel.pp=2"]),
        ("tiny", "dp2_tp2_zero1", ["parallel.dp=2", "parallel.tp=2", "parallel.dp_mode=zero1"]),
    ],
}
FP16_REL = 5e-3


def _fp16_run(recipe: str, run_dir: Path, *extra: str) -> dict:
    from tests.builders import layout_sets

    sets = layout_sets(recipe, run_dir, *LAYOUT_FP16, *extra)
    trainer = Trainer(resolve_config(recipe, sets), console=False)
    result = trainer.train()
    return {
        "losses": result.losses,
        "skipped": result.skipped,
        "scale": float(trainer.loss_scaler.scale),
    }


def _fp16_layout_worker(rank: int, world_size: int, tmp: Path, layouts: list) -> dict:
    force_overflow(2)  # in this rank's process only
    return {
        (recipe, name): _fp16_run(recipe, tmp / f"{recipe}_{name}", *extra)
        for recipe, name, extra in layouts
    }


@pytest.fixture(scope="module")
def fp16_reference(tmp_path_factory) -> dict:
    """Each recipe of FP16_LAYOUTS trained in one process (step 2 overflowing), once for both
    world sizes."""
    tmp = tmp_path_factory.mktemp("fp16_single")
    recipes = sorted({recipe for layouts in FP16_LAYOUTS.values() for recipe, _, _ in layouts})
    with pytest.MonkeyPatch.context() as patch:
        force_overflow(2, patch.setattr)
        return {r: _fp16_run(r, tmp / f"single_{r}") for r in recipes}


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_layouts_equal_one_process(
    tmp_path: Path, fp16_reference: dict, world_size: int
) -> None:
    from tests.distributed import run_distributed

    layouts = FP16_LAYOUTS[world_size]
    reference = {recipe: fp16_reference[recipe] for recipe, _, _ in layouts}
    for ref in reference.values():  # 4096, 2048 (the overflow), 2048, 4096, 4096, 8192
        assert (ref["skipped"], ref["scale"]) == (1, 8192.0)
    per_rank = run_distributed(_fp16_layout_worker, world_size, tmp_path / "runs", layouts)
    for result in per_rank:
        for (recipe, name), run in result.items():
            ref = reference[recipe]
            assert (run["skipped"], run["scale"]) == (ref["skipped"], ref["scale"]), name
            for step, loss in ref["losses"].items():
                assert run["losses"][step] == pytest.approx(loss, rel=FP16_REL), (name, step)
