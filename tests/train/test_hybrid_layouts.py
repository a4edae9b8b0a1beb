"""The hybrid linear-attention models (Qwen3.5 dense and MoE, Qwen3-Next) under parallel layouts
equal one device (gloo, fp32, CPU), as `test_layouts.py` checks the other families: tensor
parallelism by key heads (with and without sequence parallelism), pipeline parallelism and
expert parallelism train the micro model ITERS steps and take one more batch's gradients, whose
losses and gradients match the single process. Context parallelism is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.model.flavors import get_flavor
from pipeline.core.parallel.layout_rules import model_problems
from tests.builders import layout_sets as _sets
from tests.builders import train_and_probe as _train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-4
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-4
RECIPE = "tiny_qwen3_5"
# (flavor, layout name, sets) run on two processes.
ROWS = [
    ("tiny_qwen3_5", "tp2", ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    ("tiny_qwen3_5", "tp2_sp", ["parallel.tp=2"]),
    ("tiny_qwen3_5", "pp2", ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"]),
    ("tiny_qwen3_5_moe", "ep2", ["parallel.ep=2"]),
    ("tiny_qwen3_next", "tp2_sp", ["parallel.tp=2"]),
    ("tiny_qwen3_next", "ep2", ["parallel.ep=2"]),
]
FLAVORS = sorted({flavor for flavor, _, _ in ROWS})


def _flavor_sets(flavor: str, run_dir: Path, *extra: str) -> list[str]:
    return _sets(RECIPE, run_dir, f"model.flavor={flavor}", *extra, save=False)


def _tp_placements() -> dict[str, tuple]:
    """(placement, local shape) of a tp2-sharded linear-attention layer's tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.core.model.transformer import Transformer
    from pipeline.core.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = Transformer(get_flavor("tiny_qwen3_5"))
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
    layer = model.layers["0"].attention
    names = ("wqkv.weight", "wz.weight", "conv_weight", "A_log", "norm.weight", "wo.weight")
    params = {n: layer.get_parameter(n) for n in names}
    return {n: (str(p.placements[0]), tuple(p.to_local().shape)) for n, p in params.items()}


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {"placements": _tp_placements()}
    for flavor, name, extra in ROWS:
        result = _train_and_probe(RECIPE, _flavor_sets(flavor, tmp / f"{flavor}_{name}", *extra))
        if not result.pop("first_of_stage"):
            result.pop("grads")
        out[(flavor, name)] = result
    return out


@pytest.mark.dist
def test_hybrid_layouts_equal_one_device(tmp_path: Path) -> None:
    reference = {}
    for flavor in FLAVORS:
        result = _train_and_probe(RECIPE, _flavor_sets(flavor, tmp_path / "single" / flavor))
        result.pop("first_of_stage")
        reference[flavor] = result
    per_rank = run_distributed(_worker, 2, tmp_path)
    # tiny_qwen3_5: 2 key heads of 32 serving 4 value heads of 32, hidden 256.
    assert per_rank[0].pop("placements") == {
        "wqkv.weight": ("S(0)", (128, 256)),  # one key head's q, k and two value heads
        "wz.weight": ("S(0)", (64, 256)),
        "conv_weight": ("S(0)", (128, 1, 4)),
        "A_log": ("S(0)", (2,)),
        "norm.weight": ("R", (32,)),
        "wo.weight": ("S(1)", (256, 64)),
    }
    per_rank[1].pop("placements")
    for flavor, name, _ in ROWS:
        ref, key = reference[flavor], (flavor, name)
        grads: dict[str, torch.Tensor] = {}
        for result in (r[key] for r in per_rank):
            assert result["losses"].keys() == ref["losses"].keys(), key
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (key, step)
            assert result["probe"] == pytest.approx(ref["probe"], rel=REL), key
            for param, grad in result.get("grads", {}).items():
                assert param not in grads, f"{key}: {param} reported by two stages"
                grads[param] = grad
        assert grads.keys() == ref["grads"].keys(), key
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{key} {param}"
            )


def test_context_parallelism_and_uneven_heads_are_refused() -> None:
    model = get_flavor("tiny_qwen3_5")
    problems = model_problems(tp=1, pp=1, cp=2, ep=1, model=model, seq_length=64)
    assert (
        len(problems) == 1
        and "parallel.cp > 1 is not supported with linear attention" in (problems[0])
    )
    problems = model_problems(tp=4, pp=1, cp=1, ep=1, model=model, seq_length=64)
    assert any("linear_attention.num_key_heads (2)" in p for p in problems)
