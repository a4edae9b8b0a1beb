"""The 2026 families' parallel layouts equal one device (gloo, fp32, CPU), as
`tests/train/test_layouts.py` checks the older ones: `tiny_glm4_moe` (q/k/v biases, per-head q/k
norms, RoPE over half of each head, a dense first layer, DeepSeek's MoE with its balancing bias)
and `tiny_minimax_m2` (q/k norms over the whole projection, whose mean of squares tensor
parallelism sums over the ranks' slices; partial RoPE; sigmoid routing with the bias in every
layer) and `tiny_mistral4` (latent attention with Llama 4's query scale at global positions,
softmax grouped routing) train under tp2 (with sequence parallelism), pp2, cp2 and ep2, each
layout's losses, validation loss and every gradient of one more global batch against the single
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import layout_sets, train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-5
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-4
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"],
    "cp2": ["parallel.cp=2"],
    "ep2": ["parallel.ep=2"],
}
RECIPES = ("tiny_glm4_moe", "tiny_minimax_m2", "tiny_mistral4")


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {}
    for recipe in RECIPES:
        for name, extra in LAYOUTS.items():
            result = train_and_probe(
                recipe, layout_sets(recipe, tmp / f"{recipe}_{name}", *extra, save=False)
            )
            if not result.pop("first_of_stage"):
                result.pop("grads")
            out[(recipe, name)] = result
    return out


@pytest.mark.dist
def test_family_layouts_equal_one_device(tmp_path: Path) -> None:
    reference = {}
    for recipe in RECIPES:
        reference[recipe] = train_and_probe(
            recipe, layout_sets(recipe, tmp_path / recipe, save=False)
        )
    per_rank = run_distributed(_worker, 2, tmp_path)
    for key in per_rank[0]:
        recipe, _ = key
        ref = reference[recipe]
        grads: dict[str, torch.Tensor] = {}
        for result in (r[key] for r in per_rank):
            assert result["losses"].keys() == ref["losses"].keys(), key
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (key, step)
            assert result["probe"] == pytest.approx(ref["probe"], rel=REL), key
            if result["valid"] is not None:
                assert result["valid"] == pytest.approx(ref["valid"], rel=REL), key
            for param, grad in result.get("grads", {}).items():
                assert param not in grads, f"{key}: {param} reported by two stages"
                grads[param] = grad
        assert grads.keys() == ref["grads"].keys(), key
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{key} {param}"
            )
    assert len(per_rank[0]) == len(LAYOUTS) * len(RECIPES)
