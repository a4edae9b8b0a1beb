"""The data-parallel trainer (FSDP2, gloo, world 2) against the single-process trainer.

A micro model on mock data, fp32 on CPU. dp=2 gives the same per-step losses (1e-5 relative)
and final weights (1e-5 absolute, gathered full tensors) as one process, and a checkpoint the
dp=2 run saved at iteration 2 resumes in one process to the uninterrupted run's losses (1e-5
relative). Only the summation order differs (gradients are summed over the ranks).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import verify
from pipeline.checkpoint.layout import read_tracker
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import micro_sets
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ITERS = 4
REL = 1e-5
ATOL = 1e-5


def _sets(run_dir: Path, *extra: str) -> list[str]:
    """The micro run: 4 iterations, checkpoints every 2, mbs 2 (so dp=2 accumulates 2)."""
    return micro_sets(run_dir, "checkpoint.save_interval=2", *extra, iters=ITERS, mbs=2)


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a plain full tensor (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().clone()
    return out


def _dp_worker(rank: int, world_size: int, tmp: Path) -> dict[int, float]:
    """Train the dp=2 run in this rank; rank 0 saves its gathered weights beside the run."""
    cfg = resolve_config(None, _sets(tmp / "dp", f"parallel.dp={world_size}"))
    trainer = Trainer(cfg, console=False)
    assert trainer.layout.dp == world_size and trainer.num_micro_batches == 2
    result = trainer.train()
    weights = _full_weights(trainer.model)
    if rank == 0:
        torch.save(weights, tmp / "dp_weights.pt")
    return result.losses


def _single(run_dir: Path, *extra: str) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """A single-process run: its per-step losses and final weights."""
    trainer = Trainer(resolve_config(None, _sets(run_dir, *extra)), console=False)
    result = trainer.train()
    return result.losses, _full_weights(trainer.model)


def _assert_losses_close(actual: dict[int, float], expected: dict[int, float]) -> None:
    assert actual.keys() == expected.keys()
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=REL), step


@pytest.mark.dist
def test_dp2_equals_single_process_and_resumes_in_one(tmp_path: Path) -> None:
    losses = run_distributed(_dp_worker, 2, tmp_path)
    assert losses[0] == losses[1], "ranks reported different losses"
    single_losses, single_weights = _single(tmp_path / "single")
    _assert_losses_close(losses[0], single_losses)
    dp_weights = torch.load(tmp_path / "dp_weights.pt")
    assert dp_weights.keys() == single_weights.keys()
    for name, value in single_weights.items():
        torch.testing.assert_close(dp_weights[name], value, rtol=0, atol=ATOL, msg=name)
    metrics = (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()
    assert sum('"split": "train"' in line for line in metrics) == ITERS  # rank 0 only

    checkpoint = tmp_path / "dp" / "checkpoints" / "iter_0000002"
    resumed_losses, _ = _single(tmp_path / "resumed", f"checkpoint.load={checkpoint}")
    _assert_losses_close(resumed_losses, {s: single_losses[s] for s in (3, 4)})


def _dp_async_worker(rank: int, world_size: int, tmp: Path) -> dict[int, float]:
    """The dp=2 run saving at every iteration in the background; each commit is held back, so
    the background thread's collectives run while the next step's collectives do."""
    from pipeline.checkpoint import saver

    commit = saver._SaveJob.commit

    def slowly(job):
        time.sleep(0.3)
        return commit(job)

    saver._SaveJob.commit = slowly
    sets = _sets(tmp / "dp", f"parallel.dp={world_size}", "checkpoint.async_save=true")
    trainer = Trainer(resolve_config(None, [*sets, "checkpoint.save_interval=1"]), console=False)
    result = trainer.train()
    weights = _full_weights(trainer.model)
    if rank == 0:
        torch.save(weights, tmp / "dp_weights.pt")
    return result.losses


@pytest.mark.dist
def test_dp2_async_saves_commit_and_load_in_one_process(tmp_path: Path) -> None:
    losses = run_distributed(_dp_async_worker, 2, tmp_path)
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(1, ITERS + 1))
    save_dir = tmp_path / "dp" / "checkpoints"
    for iteration in range(1, ITERS + 1):
        assert verify(save_dir / f"iter_{iteration:07d}").ok, iteration
    assert read_tracker(save_dir) == save_dir / f"iter_{ITERS:07d}"
    resumed = Trainer(resolve_config(None, _sets(tmp_path / "one", f"checkpoint.load={save_dir}")))
    assert resumed.iteration == ITERS
    dp_weights = torch.load(tmp_path / "dp_weights.pt")
    for name, value in _full_weights(resumed.model).items():
        assert torch.equal(value, dp_weights[name]), name


def test_torchrun_command_drops_nproc() -> None:
    from pipeline.core.parallel.process_group import torchrun_command

    argv = ["train", "--nproc-per-node", "2", "--dp", "2", "--nproc-per-node=2", "--iters", "3"]
    command = torchrun_command(2, "train", argv)
    assert command[1:6] == ["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    assert command[6:] == ["pipeline", "train", "--dp", "2", "--iters", "3"]


def test_torchrun_runs_with_one_thread_a_process_unless_told_otherwise() -> None:
    """OMP_NUM_THREADS=1 is what torchrun sets itself (with a banner); pipe sets it first and
    says so in its own line. A value the user set is kept."""
    from pipeline.core.parallel.process_group import torchrun_environment

    environment, added = torchrun_environment({"PATH": "/bin"})
    assert environment == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert added == {"OMP_NUM_THREADS": "1"}
    environment, added = torchrun_environment({"PATH": "/bin", "OMP_NUM_THREADS": "4"})
    assert environment == {"PATH": "/bin", "OMP_NUM_THREADS": "4"} and added == {}
