"""Every parallel layout of `pipe train` equals one device (gloo, fp32, CPU).

For the `tiny` and `tiny_moe` recipes, and a few rows of `tiny_qwen3` (per-head q/k norms,
head_dim != hidden / heads) and `tiny_qwen3_moe` (a dense first layer, then MoE), all shrunk
to a micro model on mock data so 8 gloo processes fit on 2 cores, each layout trains ITERS
steps through the real `Trainer` and then computes the gradients of one more global batch.
Against the single-process run of the same recipe:

* the loss of every step and the validation loss agree to REL (relative);
* every parameter's gradient (gathered to a full tensor, each from the rank of its stage)
  agrees to GRAD_ATOL absolute, GRAD_RTOL relative.

Only summation order differs between layouts (gradient sums over ranks, chunked attention,
vocabulary-parallel softmax), so the tolerances are those of fp32 rounding. No layout makes
torch's DTensor warn that it runs collectives one after another where one would do (the
gradient norm of parameters sharded over two mesh dimensions needs their flattened mesh).
Layouts sharing a world size run one after another in one spawn, since each spawn costs
seconds of start-up.

Checkpoints: the tp2 x pp2 x dp2 run of `tiny` saves at iteration ITERS; it is loaded under
dp4 (4 processes) and under one process, and the next losses equal those of an uninterrupted
run. The ep2 runs of `tiny_moe` and `tiny_qwen3_moe`, and the tp2 x pp2 run of `tiny_qwen3`,
resume in one process (experts and shards gathered) the same way.

Expert parallelism beside tensor parallelism (ep2 x tp2: experts whole on each rank, the ep
group made of the data-parallel ranks of one tp index) has rows for `tiny_moe` (with and
without sequence parallelism), `tiny_qwen3_moe` and `tiny_deepseek_v3`. DeepSeek-V3's rows
(latent attention, a dense first layer, shared experts, grouped sigmoid routing and the
balancing bias, which moves after every step) are tp2 with sequence parallelism, ep2, cp2, pp2
(the dense layer on stage 0) and ep2 x tp2; its ep2 and ep2 x tp2 checkpoints resume in one
process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pipeline.common.quiet import quiet_unmergeable_gather_hints
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from tests.builders import LAYOUT_ITERS as ITERS
from tests.builders import LAYOUT_MOE_RECIPES as MOE_RECIPES
from tests.builders import LAYOUT_RESUMED_ITERS as RESUMED_ITERS
from tests.builders import layout_sets as _sets
from tests.builders import train_and_probe as _train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-5
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-4

DENSE_AND_MOE = {
    2: {
        "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
        "tp2_sp": ["parallel.tp=2"],
        "dp2": ["parallel.dp=2"],
        "pp2_1f1b": ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"],
        "pp2_interleaved": ["parallel.pp=2", "parallel.pipeline_schedule=Interleaved1F1B"],
        "pp2_zero_bubble": ["parallel.pp=2", "parallel.pipeline_schedule=ZBVZeroBubble"],
        "cp2": ["parallel.cp=2"],
    },
    4: {
        "tp2_dp2": ["parallel.tp=2", "parallel.dp=2"],
        "tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
        "cp2_tp2": ["parallel.cp=2", "parallel.tp=2"],
    },
    8: {"dp2_pp2_tp2": ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2"]},
}
# Variants of the data-parallel and pipeline modes, checked on the dense recipe.
DENSE_ONLY = {
    2: {
        "dp2_zero2": ["parallel.dp=2", "parallel.reshard_after_forward=false"],
        "dp2_replicate": ["parallel.dp=2", "parallel.dp_mode=replicate"],
        "pp2_first_stage_1_layer": ["parallel.pp=2", "parallel.first_stage_layers=1"],
    },
}
MOE_ONLY = {
    2: {"ep2": ["parallel.ep=2"]},  # the two data-parallel ranks hold two experts each
    4: {
        "ep2_dp2": ["parallel.ep=2"],  # experts over 2 ranks, each half sharded over 2
        # ep over the two data-parallel ranks of each tp index; each tp rank routes its share
        # of the sequence (sequence parallelism) or all of it (without).
        "ep2_tp2": ["parallel.ep=2", "parallel.tp=2"],
        "ep2_tp2_no_sp": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=false"],
    },
}
QWEN3_ROWS = {
    2: [
        ("tiny_qwen3", "tp2", DENSE_AND_MOE[2]["tp2"]),
        ("tiny_qwen3_moe", "ep2", MOE_ONLY[2]["ep2"]),
        ("tiny_qwen3_moe", "cp2", DENSE_AND_MOE[2]["cp2"]),
    ],
    4: [
        ("tiny_qwen3", "tp2_pp2", DENSE_AND_MOE[4]["tp2_pp2"]),
        ("tiny_qwen3_moe", "ep2_dp2", MOE_ONLY[4]["ep2_dp2"]),
        ("tiny_qwen3_moe", "ep2_tp2", MOE_ONLY[4]["ep2_tp2"]),
    ],
}
DEEPSEEK_V3_ROWS = {
    2: [
        ("tiny_deepseek_v3", "tp2_sp", DENSE_AND_MOE[2]["tp2_sp"]),
        ("tiny_deepseek_v3", "ep2", MOE_ONLY[2]["ep2"]),
        ("tiny_deepseek_v3", "cp2", DENSE_AND_MOE[2]["cp2"]),
        # 4 layers over 2 stages: the dense layer 0 and MoE layer 1 on stage 0.
        ("tiny_deepseek_v3", "pp2_1f1b", DENSE_AND_MOE[2]["pp2_1f1b"]),
    ],
    4: [("tiny_deepseek_v3", "ep2_tp2", MOE_ONLY[4]["ep2_tp2"])],
}


# The layouts whose checkpoints the tests below load; the others save none (a save is a
# second or more of a micro run on 2 cores).
RESUMED = {
    ("tiny", "tp2_pp2"),
    ("tiny", "dp2_pp2_tp2"),
    ("tiny_qwen3", "tp2_pp2"),
    ("tiny_deepseek_v3", "ep2_tp2"),
    *((recipe, "ep2") for recipe in MOE_RECIPES),
}


# DTensor warns here of collectives run one after another where one would do.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _Recorder(logging.Handler):
    """Keeps the messages of the records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _layout_worker(
    rank: int, world_size: int, tmp: Path, layouts: list, resumed: set = RESUMED
) -> dict:
    """Run each (recipe, name, sets) layout in turn, saving checkpoints for the `resumed` ones
    only; return what the first rank of each pipeline stage saw, and on every rank what torch's
    DTensor logged while the layout ran (with the filter `pipe train` installs)."""
    quiet_unmergeable_gather_hints()
    logged = _Recorder()
    logging.getLogger(REDISTRIBUTE_LOGGER).addHandler(logged)
    out = {}
    for recipe, name, extra in layouts:
        if (recipe, name) not in resumed:
            extra = [*extra, "checkpoint.enable=false"]
        logged.messages = []
        result = _train_and_probe(recipe, _sets(recipe, tmp / f"{recipe}_{name}", *extra))
        result["dtensor_warnings"] = logged.messages
        if result.pop("first_of_stage"):
            out[(recipe, name)] = result
        else:
            out[(recipe, name)] = {k: v for k, v in result.items() if k != "grads"}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The single-process run of each recipe."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for recipe in ("tiny", "tiny_moe", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3"):
        result = _train_and_probe(recipe, _sets(recipe, tmp / recipe))
        result.pop("first_of_stage")
        result["checkpoints"] = tmp / recipe / "checkpoints"
        out[recipe] = result
    return out


def _layouts(world_size: int) -> list[tuple[str, str, list[str]]]:
    both = [(r, n, s) for r in ("tiny", "tiny_moe") for n, s in DENSE_AND_MOE[world_size].items()]
    dense = [("tiny", n, s) for n, s in DENSE_ONLY.get(world_size, {}).items()]
    moe = [("tiny_moe", n, s) for n, s in MOE_ONLY.get(world_size, {}).items()]
    families = QWEN3_ROWS.get(world_size, []) + DEEPSEEK_V3_ROWS.get(world_size, [])
    return both + dense + moe + families


def _assert_equal_to_reference(per_rank: list[dict], reference: dict[str, dict]) -> list[str]:
    """Compare every layout's losses and gradients with the single process; returns the names
    of the layouts checked."""
    checked = []
    for key in per_rank[0]:
        recipe, name = key
        ref = reference[recipe]
        grads: dict[str, torch.Tensor] = {}
        for result in (r[key] for r in per_rank):
            # e.g. a gradient norm reduced over two mesh dimensions in two all-reduces
            assert result["dtensor_warnings"] == [], key
            assert result["losses"].keys() == ref["losses"].keys(), key
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (key, step)
            assert result["probe"] == pytest.approx(ref["probe"], rel=REL), key
            if result["valid"] is not None:  # only rank 0 writes metrics
                assert result["valid"] == pytest.approx(ref["valid"], rel=REL), key
                # Router statistics are logged for MoE runs (the load of the last micro-batch).
                assert (result["moe_max_load"] is not None) == (recipe in MOE_RECIPES), key
                if recipe in MOE_RECIPES:
                    assert result["moe_max_load"] >= 1.0, key
            for param, grad in result.get("grads", {}).items():
                assert param not in grads, f"{key}: {param} reported by two stages"
                grads[param] = grad
        assert grads.keys() == ref["grads"].keys(), key
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{key} {param}"
            )
        checked.append(f"{recipe}:{name}")
    return checked


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_layouts_equal_one_device(tmp_path: Path, reference: dict, world_size: int) -> None:
    layouts = _layouts(world_size)
    per_rank = run_distributed(_layout_worker, world_size, tmp_path, layouts)
    checked = _assert_equal_to_reference(per_rank, reference)
    assert len(checked) == len(layouts)
    if world_size == 4:
        _assert_tp2_pp2_exports_the_single_device_model(tmp_path, reference)
        _assert_resumes_in_one_process(tmp_path, "tiny_qwen3", "tp2_pp2")
        _assert_resumes_in_one_process(tmp_path, "tiny_deepseek_v3", "ep2_tp2")
    if world_size == 2:
        # Experts move too: the ep2 checkpoint resumes in one process, where every expert is
        # local, and continues as the uninterrupted run does.
        for recipe in MOE_RECIPES:
            _assert_resumes_in_one_process(tmp_path, recipe, "ep2")


def _assert_resumes_in_one_process(tmp_path: Path, recipe: str, layout: str) -> None:
    """The `recipe` run under `layout` resumes in one process and continues as the
    uninterrupted single-process run does."""
    checkpoint = tmp_path / f"{recipe}_{layout}" / "checkpoints" / f"iter_{ITERS:07d}"
    resumed = _resumed_losses(tmp_path / f"{recipe}_resumed", checkpoint, recipe=recipe)
    uninterrupted = _resumed_losses(tmp_path / f"{recipe}_uninterrupted", None, recipe=recipe)
    _assert_continues(resumed, uninterrupted, f"{recipe}: {layout} -> one process")


def _assert_tp2_pp2_exports_the_single_device_model(tmp_path: Path, reference: dict) -> None:
    """The tp2 x pp2 run's checkpoint converts to Hugging Face; transformers' logits from it
    equal our single-device model's (from the single-process run's checkpoint)."""
    pytest.importorskip("transformers")
    from pipeline.convert.run import run_conversion
    from pipeline.weights.checks import compare_hf_logits
    from pipeline.weights.pipe_checkpoint import PipeCheckpointSource

    hf_dir = tmp_path / "tiny_tp2_pp2_hf"
    summary = run_conversion(
        tmp_path / "tiny_tp2_pp2" / "checkpoints",
        hf_dir,
        "pipe",
        "hf",
        dtype="fp32",
        verify="on",
        quiet=True,
    )
    assert "logits match transformers" in summary
    single = PipeCheckpointSource(reference["tiny"]["checkpoints"])
    assert compare_hf_logits(single, hf_dir) < 1e-4


def _resume_worker(rank: int, world_size: int, tmp: Path, checkpoint: Path) -> dict[int, float]:
    """Resume the `tiny` run from `checkpoint` under dp=world_size and train to RESUMED_ITERS."""
    return _resumed_losses(tmp / "resumed", checkpoint, f"parallel.dp={world_size}")


def _resumed_losses(
    run_dir: Path, checkpoint: Path | None, *extra: str, recipe: str = "tiny"
) -> dict[int, float]:
    """Losses of a run to RESUMED_ITERS, resumed from `checkpoint` (None: from scratch)."""
    load = [f"checkpoint.load={checkpoint}"] if checkpoint is not None else []
    sets = _sets(recipe, run_dir, f"training.iters={RESUMED_ITERS}", *load, *extra)
    return Trainer(resolve_config(recipe, sets), console=False).train().losses


def _assert_continues(resumed: dict, uninterrupted: dict, layout: str) -> None:
    """The resumed run's losses (steps after ITERS only) equal the uninterrupted run's."""
    expected = {step: uninterrupted[step] for step in range(ITERS + 1, RESUMED_ITERS + 1)}
    assert resumed.keys() == expected.keys(), layout
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, rel=REL), (layout, step)


@pytest.mark.dist
def test_eight_processes_and_checkpoints_across_layouts(tmp_path: Path, reference: dict) -> None:
    """dp2 x pp2 x tp2 equals one device; its checkpoint resumes under dp4 and one process."""
    per_rank = run_distributed(_layout_worker, 8, tmp_path, _layouts(8))
    assert len(_assert_equal_to_reference(per_rank, reference)) == len(_layouts(8))

    checkpoint = tmp_path / "tiny_dp2_pp2_tp2" / "checkpoints" / f"iter_{ITERS:07d}"
    uninterrupted = _resumed_losses(tmp_path / "uninterrupted", None)
    resumed = run_distributed(_resume_worker, 4, tmp_path / "dp4", checkpoint)
    _assert_continues(resumed[0], uninterrupted, "tp2.pp2.dp2 -> dp4")
    single = _resumed_losses(tmp_path / "single", checkpoint)
    _assert_continues(single, uninterrupted, "tp2.pp2.dp2 -> tp1.pp1")
