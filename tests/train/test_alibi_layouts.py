"""ALiBi models (the `tiny_bloom` and `tiny_mpt` flavors, shrunk to the layout tests' micro
size with 6 heads) train under tensor parallelism (with and without sequence parallelism),
context parallelism, a pipeline and sharded data parallelism as in one process: the losses of
every step and the gradients of one more batch agree (gloo, fp32, CPU).

Under tp2 each rank holds 3 of the 6 heads and their slopes (rank 1's include two of the
non-power-of-two slopes); under cp2 the biases come from the global positions of each rank's
two chunks; the pipeline keeps BLOOM's embedding norm on the first stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import layout_sets, train_and_probe
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-4
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-4
# The micro model with 6 heads of 8 (hidden 48), MLP 4 x hidden, untied (pipeline stages).
SHAPE = [
    "model.hidden_size=48",
    "model.num_attention_heads=6",
    "model.num_kv_heads=6",
    "model.ffn_hidden_size=192",
    "model.tie_word_embeddings=false",
]
FLAVORS = ("tiny_bloom", "tiny_mpt")
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2"],
    "cp2": ["parallel.cp=2"],
    "pp2": ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"],
    "dp2": ["parallel.dp=2"],
}


def _sets(flavor: str, run_dir: Path, *extra: str) -> list[str]:
    return layout_sets("tiny", run_dir, f"model.flavor={flavor}", *SHAPE, *extra, save=False)


def _worker(rank: int, world_size: int, tmp: Path) -> dict:
    out = {}
    for flavor in FLAVORS:
        for name, extra in LAYOUTS.items():
            result = train_and_probe("tiny", _sets(flavor, tmp / f"{flavor}_{name}", *extra))
            if not result.pop("first_of_stage"):
                result.pop("grads")
            out[(flavor, name)] = result
    return out


@pytest.mark.dist
def test_alibi_layouts_equal_one_process(tmp_path: Path) -> None:
    reference = {}
    for flavor in FLAVORS:
        reference[flavor] = train_and_probe("tiny", _sets(flavor, tmp_path / f"{flavor}_single"))
    per_rank = run_distributed(_worker, 2, tmp_path)
    for (flavor, name), _ in per_rank[0].items():
        ref = reference[flavor]
        grads: dict[str, torch.Tensor] = {}
        for result in (r[(flavor, name)] for r in per_rank):
            for step, loss in ref["losses"].items():
                assert result["losses"][step] == pytest.approx(loss, rel=REL), (flavor, name)
            assert result["probe"] == pytest.approx(ref["probe"], rel=REL), (flavor, name)
            grads |= result.get("grads", {})
        assert grads.keys() == ref["grads"].keys(), (flavor, name)
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(
                grads[param], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=f"{flavor} {name} {param}"
            )
    assert len(per_rank[0]) == len(FLAVORS) * len(LAYOUTS)


def test_the_dry_run_names_the_block() -> None:
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.report.estimates import dry_run_report

    bloom = dry_run_report(resolve_config("tiny", ["model.flavor=tiny_bloom"]))[0]
    assert (
        "heads 6/6 kv, head_dim 16, q/k/v bias, ALiBi, LayerNorm, gelu_pytorch_tanh plain MLP"
        in bloom
    )
    llama = dry_run_report(resolve_config("tiny", []))[0]
    assert "ALiBi" not in llama and "LayerNorm" not in llama and "MLP" not in llama
