"""Pipeline parallelism: layer split rules, and gloo parity of torch's schedules with one device.

The parity tests follow PyTorch's `test_schedule_multiproc.py::test_grad_with_manual`: every rank
builds the full reference model from the same seed, runs it on the whole batch, then runs its own
stages under the schedule and checks the loss and every gradient it holds against the
reference (fp32, absolute tolerance 1e-5). Schedules run with `scale_grads=False`, because the
loss is already token-normalised over the whole batch.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pipeline.core.kernels.cross_entropy import chunked_linear_cross_entropy
from pipeline.core.model.config import ModelConfig
from pipeline.core.model.transformer import Transformer
from pipeline.core.parallel.pipeline import (
    build_schedule,
    build_stages,
    local_stage_indices,
    make_loss_fn,
    masked_labels,
    split_model,
    stage_layer_ranges,
    stages_per_rank,
)
from tests.builders import micro_model_config
from tests.distributed import run_distributed

ATOL = 1e-5
N_MICROBATCHES = 4
BATCH, SEQ = 8, 16


def tiny_config() -> ModelConfig:
    return micro_model_config(num_layers=4, rope_theta=10000.0)


# ---------------------------------------------------------------------------------------------
# stage_layer_ranges / split_model (single process)
# ---------------------------------------------------------------------------------------------


def test_ranges_balanced() -> None:
    assert stage_layer_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layer_ranges(3, 1) == [(0, 3)]


def test_ranges_uneven_puts_extra_layers_first() -> None:
    assert stage_layer_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_ranges_first_and_last_fewer() -> None:
    assert stage_layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=1) == [
        (0, 1),
        (1, 5),
        (5, 9),
        (9, 10),
    ]
    assert stage_layer_ranges(7, 3, first_stage_layers=0) == [(0, 0), (0, 4), (4, 7)]
    assert stage_layer_ranges(7, 3, last_stage_layers=1) == [(0, 3), (3, 6), (6, 7)]
    assert stage_layer_ranges(5, 2, first_stage_layers=2, last_stage_layers=3) == [(0, 2), (2, 5)]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((3, 4), {}, "cannot place"),
        ((4, 0), {}, "num_stages"),
        ((0, 2), {}, "num_layers"),
        ((4, 2), {"first_stage_layers": 5}, "first_stage_layers"),
        ((4, 3), {"first_stage_layers": 2, "last_stage_layers": 2}, "cannot place"),
        ((4, 2), {"first_stage_layers": 1, "last_stage_layers": 1}, "all layers"),
        ((4, 1), {"last_stage_layers": 2}, "one stage"),
    ],
)
def test_ranges_errors(args: tuple[int, int], kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stage_layer_ranges(*args, **kwargs)


def test_local_stage_indices() -> None:
    assert local_stage_indices(1, 2, "1F1B") == [1]
    assert local_stage_indices(1, 2, "Interleaved1F1B") == [1, 3]
    assert local_stage_indices(0, 2, "ZBVZeroBubble") == [0, 3]
    assert stages_per_rank("gpipe") == 1 and stages_per_rank("ZBVZeroBubble") == 2


def test_split_model_keeps_global_names() -> None:
    model = Transformer(tiny_config())
    ranges = stage_layer_ranges(4, 2)
    first = split_model(copy.deepcopy(model), 0, 2, ranges)
    last = split_model(copy.deepcopy(model), 1, 2, ranges)
    assert list(first.layers.keys()) == ["0", "1"] and list(last.layers.keys()) == ["2", "3"]
    assert first.norm is None and first.output is None and first.tok_embeddings is not None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    names = {n for m in (first, last) for n, _ in m.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_split_model_rejects_tied_embeddings() -> None:
    model = Transformer(ModelConfig(**{**tiny_config().__dict__, "tie_word_embeddings": True}))
    with pytest.raises(NotImplementedError, match="tied"):
        split_model(model, 0, 2, stage_layer_ranges(4, 2))


# ---------------------------------------------------------------------------------------------
# Schedules vs the single-device reference (gloo, world 2)
# ---------------------------------------------------------------------------------------------


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and a 0/1 loss mask with some masked positions (same on every rank)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
    loss_mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.2).float()
    return tokens, labels, loss_mask


def _reference(model: Transformer, batch: tuple) -> tuple[float, dict[str, torch.Tensor]]:
    """Whole-batch loss (token-normalised) and gradients of the unsplit model."""
    tokens, labels, loss_mask = batch
    loss_sum, num_tokens = chunked_linear_cross_entropy(
        model(tokens), model.output.weight, labels, loss_mask
    )
    loss = loss_sum / num_tokens
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _run_schedule(rank: int, world_size: int, tmp: Path, schedule: str) -> dict:
    """One rank: reference, then this rank's stages under `schedule`; compare loss and grads."""
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    model.init_weights()
    batch = _batch()
    ref_loss, ref_grads = _reference(copy.deepcopy(model), batch)

    num_stages = world_size * stages_per_rank(schedule)
    ranges = stage_layer_ranges(model.config.num_layers, num_stages)
    indices = local_stage_indices(rank, world_size, schedule)
    modules = [split_model(copy.deepcopy(model), i, num_stages, ranges) for i in indices]
    stages = build_stages(modules, indices, num_stages, torch.device("cpu"))
    loss_fn = make_loss_fn(modules)
    sched = build_schedule(stages, N_MICROBATCHES, loss_fn, schedule, scale_grads=False)

    tokens, labels, loss_mask = batch
    is_first = 0 in indices
    is_last = num_stages - 1 in indices
    args = (tokens,) if is_first else ()
    target = masked_labels(labels, loss_mask) if is_last else None
    losses: list[torch.Tensor] = []
    with loss_fn.normalised_by(loss_mask.sum().item()):
        sched.step(
            *args,
            target=target,
            losses=losses if is_last else None,
            position_ids=torch.arange(SEQ).expand(BATCH, -1),  # kwargs reach every stage
        )

    checked, max_diff = [], 0.0
    for module in modules:
        for name, param in module.named_parameters():
            torch.testing.assert_close(param.grad, ref_grads[name], atol=ATOL, rtol=0, msg=name)
            max_diff = max(max_diff, (param.grad - ref_grads[name]).abs().max().item())
            checked.append(name)
    if is_last:
        assert len(losses) == N_MICROBATCHES
        total = torch.stack(losses).sum().item()
        assert abs(total - ref_loss) < ATOL, (total, ref_loss)
    return {"checked": checked, "all": sorted(ref_grads), "last": is_last, "max_diff": max_diff}


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_schedule_matches_single_device(tmp_path: Path, schedule: str) -> None:
    results = run_distributed(_run_schedule, 2, tmp_path, schedule)
    checked = [name for r in results for name in r["checked"]]
    assert sorted(checked) == results[0]["all"]  # every parameter checked exactly once
    assert sum(r["last"] for r in results) == 1
