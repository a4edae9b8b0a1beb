"""The registry's `muon`: one process equals torch.optim.Muon (hidden matrices) plus
torch.optim.AdamW (the rest) applied by hand; every layout (tp2 duplicated and distributed,
FSDP dp2, ep2) equals one process with fp32 Newton-Schulz to fp32 order, and those and cp2 and
pp2 with the default bf16 one within bf16's rounding; FSDP's owners broadcast bf16 results bit
for bit over gloo; checkpoints hold Muon's momentum, resume after kill -9 and under another
layout (tp2 -> dp2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from pipeline.train.optimizers import OPTIMIZERS, OptimizerSpec
from pipeline.train.optimizers.muon import is_hidden_matrix
from pipeline.train.optimizers.newton_schulz import NewtonSchulz, _owners, orthogonalize
from tests.builders import kill_after_save, layout_sets
from tests.distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

REL = 1e-5
ITERS = 10
RESUMED = 12
# fp32 Newton-Schulz: layouts then differ from one device by fp32 summation order only.
FP32 = "optimizer.muon_ns_dtype=fp32"
MUON = ["optimizer.name=muon", FP32, "model.num_layers=2"]
LAYOUTS = [
    ("tiny", "tp2_duplicated", ["parallel.tp=2", "optimizer.muon_tp_mode=duplicated"]),
    ("tiny", "tp2_distributed", ["parallel.tp=2", "optimizer.muon_tp_mode=distributed"]),
    ("tiny", "dp2", ["parallel.dp=2"]),
    ("tiny_moe", "ep2", ["parallel.ep=2"]),
]
# The same layouts with Newton-Schulz in its default dtype (bf16) and tp2 in the default mode,
# and cp2 (FSDP2 over the context ranks: the owners' broadcast again) and pp2, over fewer steps
# and saving nothing (what they check shows from the first update on).
DEFAULT_ITERS = 4
DEFAULT_NS = [
    ("tiny", "tp2_default", ["parallel.tp=2"]),
    ("tiny", "tp2_distributed_default", ["parallel.tp=2", "optimizer.muon_tp_mode=distributed"]),
    ("tiny", "dp2_default", ["parallel.dp=2"]),
    ("tiny", "cp2_default", ["parallel.cp=2"]),
    ("tiny", "pp2_default", ["parallel.pp=2"]),
    ("tiny_moe", "ep2_default", ["parallel.ep=2"]),
]
# bf16 Newton-Schulz: a layout's update, equal to one device's to fp32 order before the cast,
# rounds to another bf16 neighbour only where it sat that close to a rounding boundary, so
# few elements move, by one bf16 ulp. Measured: 7.2e-7 at most over 10 steps (tp2
# distributed); the bound is 10x under the loss' motion of one step (1e-3 to 1e-2).
BF16_REL = 1e-4


def _sets(recipe: str, run_dir: Path, *extra: str, iters: int = ITERS) -> list[str]:
    return layout_sets(
        recipe,
        run_dir,
        *MUON,
        f"training.iters={iters}",
        f"scheduler.decay_iters={RESUMED}",
        "checkpoint.save_interval=5",
        f"training.eval_interval={RESUMED}",
        *extra,
    )


def _default_sets(recipe: str, run_dir: Path, *extra: str) -> list[str]:
    """`_sets` with Newton-Schulz in its default dtype, DEFAULT_ITERS steps, no checkpoint."""
    sets = _sets(recipe, run_dir, *extra, "checkpoint.save_interval=0", iters=DEFAULT_ITERS)
    return [s for s in sets if s != FP32]


def _losses(recipe: str, sets: list[str]) -> dict[int, float]:
    return Trainer(resolve_config(recipe, sets), console=False).train().losses


def _assert_losses(
    got: dict[int, float], expected: dict[int, float], steps, what, rel: float = REL
) -> None:
    assert sorted(got) == list(steps), what
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=rel), (what, step)


class _ByHand(torch.optim.Optimizer):
    """torch.optim.Muon over the 2-D weights but the embedding and output layer, torch's
    AdamW (Megatron's decay rule) over the rest; their groups shared, so the scheduler and
    `zero_grad` drive both."""

    def __init__(self, model: torch.nn.Module, cfg) -> None:
        o = cfg.optimizer
        hidden, decay, no_decay = [], [], []
        for name, p in model.named_parameters():
            if p.ndim == 2 and name not in ("tok_embeddings.weight", "output.weight"):
                hidden.append(p)
            else:
                (decay if p.ndim >= 2 else no_decay).append(p)
        self.muon = torch.optim.Muon(
            hidden,
            lr=o.lr,
            weight_decay=o.weight_decay,
            momentum=o.muon_momentum,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,
        )
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


def test_hidden_matrices_are_muons_and_the_rest_adamws() -> None:
    """Attention, MLP and expert weights go to Muon; embedding, output, router, norms to AdamW."""
    shapes = {
        "tok_embeddings.weight": (8, 4),
        "output.weight": (8, 4),
        "norm.weight": (4,),
        "layers.0.attention.wq.weight": (4, 4),
        "layers.0.moe.router.weight": (2, 4),
        "layers.0.moe.experts.w1": (2, 6, 4),
        "layers.0.feed_forward.w2.bias": (4,),
    }
    muon = {n for n, s in shapes.items() if is_hidden_matrix(n, torch.empty(s, device="meta"))}
    assert muon == {"layers.0.attention.wq.weight", "layers.0.moe.experts.w1"}


def test_owners_spread_the_work_evenly() -> None:
    assert _owners([10, 1, 9, 2, 8, 3], 2) == [0, 0, 1, 0, 1, 0]  # 10+3+2+1 against 9+8


def test_one_process_equals_torch_muon_plus_adamw(tmp_path: Path, monkeypatch) -> None:
    """10 fp32 steps of the trainer with `muon` (bf16 Newton-Schulz, as torch's) and with
    torch's optimizers applied by hand: the same losses and weights. (The AdamW by hand is
    fused, as ours: bf16 Newton-Schulz turns the unfused kernel's 1e-7 differences into 1e-5.)"""
    spec = OptimizerSpec("by_hand", f"{__name__}:_ByHand", 8, "by hand", skips_on_device=False)
    monkeypatch.setitem(OPTIMIZERS, "by_hand", spec)
    runs = {}
    for name in ("muon", "by_hand"):
        sets = _sets(
            "tiny", tmp_path / name, f"optimizer.name={name}", "checkpoint.save_interval=0"
        )
        sets.remove("optimizer.muon_ns_dtype=fp32")
        trainer = Trainer(resolve_config("tiny", sets), console=False)
        runs[name] = (trainer.train().losses, dict(trainer.model.named_parameters()))
    (losses, weights), (ref_losses, ref_weights) = runs["muon"], runs["by_hand"]
    _assert_losses(losses, ref_losses, range(1, ITERS + 1), "muon vs by hand")
    for name, weight in ref_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=REL, atol=0.0, msg=name)


def _sharded_newton_schulz(rank: int, world_size: int) -> list[str]:
    """Matrices wide, tall and square, split by rows and by columns: where `sharded` on this
    rank's shard differs from this rank's part of `whole` on the matrix (fp32)."""
    import torch.distributed as dist

    ns, wrong = NewtonSchulz(dtype=torch.float32), []
    for shape in ((8, 12), (12, 8), (8, 8), (3, 8, 12)):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        tall = shape[-2] > shape[-1]
        for dim in (-2, -1):
            mine = full.chunk(world_size, dim)[rank]
            got = ns.sharded(mine, dim, dist.group.WORLD, tall)
            expected = ns.whole(full).chunk(world_size, dim)[rank]
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
                wrong.append(f"{shape} split on {dim}")
    return wrong


def _owners_broadcast(rank: int, world_size: int) -> list[str]:
    """Matrices split by FSDP2 (rows, columns, an expert stack's rows), orthogonalised by their
    owners in the default dtype and broadcast: where this rank's part differs from its part of
    `whole` on the full matrix, bit for bit (one owner computes what one device would)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipeline.train.config.schema import OptimizerSection
    from pipeline.train.optimizers.muon import _DTYPES

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    ns = NewtonSchulz(dtype=_DTYPES[OptimizerSection().muon_ns_dtype])
    cases = [((8, 12), 0), ((12, 8), 1), ((6, 6), 0), ((3, 8, 12), 1)]
    items, expected = [], []
    for shape, dim in cases:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        param = distribute_tensor(full, mesh, [Shard(dim)])
        items.append((param, param.to_local()))
        expected.append(ns.whole(full).chunk(world_size, dim)[rank])
    got = orthogonalize(items, ns, "duplicated")
    return [
        f"{shape} split on {dim}"
        for (shape, dim), mine, want in zip(cases, got, expected)
        if mine.dtype != ns.dtype or not torch.equal(mine, want)
    ]


def _layout_worker(rank: int, world_size: int, tmp: Path) -> dict:
    """Each of LAYOUTS and DEFAULT_NS, then the tp2 checkpoint resumed under dp2: their
    losses."""
    out: dict = {
        "sharded_newton_schulz": _sharded_newton_schulz(rank, world_size),
        "owners_broadcast": _owners_broadcast(rank, world_size),
    }
    out |= {
        name: _losses(recipe, _sets(recipe, tmp / name, *extra)) for recipe, name, extra in LAYOUTS
    }
    out |= {
        name: _losses(recipe, _default_sets(recipe, tmp / name, *extra))
        for recipe, name, extra in DEFAULT_NS
    }
    checkpoint = tmp / "tp2_duplicated" / "checkpoints" / f"iter_{ITERS:07d}"
    load = [f"checkpoint.load={checkpoint}", "parallel.dp=2"]
    out["tp2 -> dp2"] = _losses("tiny", _sets("tiny", tmp / "resumed", *load, iters=RESUMED))
    return out


@pytest.mark.dist
def test_layouts_equal_one_process_and_resume_across_layouts(tmp_path: Path) -> None:
    """Distributed Newton-Schulz equals it on the whole matrix, and FSDP2's owners broadcast
    the default bf16 result bit for bit; tp2 (duplicated, distributed), dp2 (FSDP2 owners) and
    ep2 equal one process over 10 steps with fp32 Newton-Schulz, and those, cp2 and pp2 over 4
    with the default bf16; the tp2 checkpoint resumes under dp2 and continues as the
    uninterrupted run."""
    reference = {
        recipe: _losses(recipe, _sets(recipe, tmp_path / recipe, iters=RESUMED))
        for recipe in ("tiny", "tiny_moe")
    }
    default = {
        recipe: _losses(recipe, _default_sets(recipe, tmp_path / f"{recipe}_default"))
        for recipe in ("tiny", "tiny_moe")
    }
    per_rank = run_distributed(_layout_worker, 2, tmp_path / "dist")
    for result in per_rank:
        assert result["sharded_newton_schulz"] == []
        assert result["owners_broadcast"] == []
        for recipe, name, _ in LAYOUTS:
            _assert_losses(result[name], reference[recipe], range(1, ITERS + 1), name)
        for recipe, name, _ in DEFAULT_NS:
            steps = range(1, DEFAULT_ITERS + 1)
            _assert_losses(result[name], default[recipe], steps, name, BF16_REL)
        resumed = range(ITERS + 1, RESUMED + 1)
        _assert_losses(result["tp2 -> dp2"], reference["tiny"], resumed, "tp2 -> dp2")


def test_kill_minus_nine_resumes_exactly(tmp_path: Path) -> None:
    """A run killed right after saving iteration 5 resumes from it with Muon's momentum: its
    next losses equal the uninterrupted run's, bit for bit."""
    sets = _sets("tiny", tmp_path / "killed", iters=7)
    proc = kill_after_save(5, "tiny", sets)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -9, out
    resumed = _losses("tiny", [*sets, f"checkpoint.load={tmp_path / 'killed' / 'checkpoints'}"])
    uninterrupted = _losses("tiny", _sets("tiny", tmp_path / "whole", iters=7))
    assert resumed == {step: uninterrupted[step] for step in (6, 7)}


def test_dry_run_counts_momentum_on_the_matrices_and_adamw_on_the_rest() -> None:
    """Muon's state in the estimate: 4 B on the hidden matrices, 8 on the embedding, output
    layer and norms (the Llama flavor's counts), so the mean lies between."""
    from pipeline.train.report.estimates import dry_run_report, estimate_memory, parameter_counts

    cfg, adamw = resolve_config("tiny_muon"), resolve_config("tiny")
    model = cfg.model_config()
    counts = parameter_counts(model)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    hidden = counts.total - counts.embedding - norms
    state = (4 * hidden + 8 * (counts.total - hidden)) / counts.total
    muon, reference = estimate_memory(cfg, model), estimate_memory(adamw, model)
    assert muon.state == pytest.approx(reference.state - 4 * hidden)
    assert 4 < state < 8
    assert any(f"4 + 4 + {state:.3g} B/param" in line for line in dry_run_report(cfg))
