"""LR schedules against hand-computed values and against Megatron's `get_lr` as transcribed below;
the optimizer's param groups; the scheduler's state dict."""

from __future__ import annotations

import io
import math

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.optimizers import build_optimizer
from pipeline.train.optimizers.adamw import param_groups
from pipeline.train.optimizers.lr_scheduler import build_scheduler
from pipeline.train.optimizers.schedules import LRSchedule, lr_at


def megatron_get_lr(
    n: int,
    max_lr: float,
    min_lr: float,
    warmup: int,
    decay: int,
    style: str,
    init_lr: float = 0.0,
    wsd_iters: int | None = None,
    wsd_style: str = "linear",
) -> float:
    """Megatron's OptimizerParamScheduler.get_lr, branch for branch, as a reference oracle."""
    if warmup > 0 and n <= warmup:
        return init_lr + (max_lr - init_lr) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1)
    else:
        start = decay - wsd_iters
        if n <= start:
            coeff = 1.0
        else:
            q = (n - start) / wsd_iters
            coeff = {
                "linear": 1 - q,
                "cosine": 0.5 * (math.cos(math.pi * q) + 1),
                "exponential": 2 * math.pow(0.5, q) - 1,
                "minus_sqrt": 1 - math.sqrt(q),
            }[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


def schedule(style: str, **kw) -> LRSchedule:
    """max 1.0, min 0.1, warmup 10, decay ends at 110 (100 decay steps)."""
    args = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style=style)
    args.update(kw)
    return LRSchedule(**args)


# ---- hand-computed values ------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "wsd"])
def test_warmup(style):
    s = schedule(style, wsd_decay_iters=20)
    assert s.lr(0) == 0.0  # Megatron's first update uses the warmup's initial lr
    assert s.lr(5) == pytest.approx(0.5)
    assert s.lr(10) == 1.0  # end of warmup: the peak


def test_cosine():
    s = schedule("cosine")
    assert s.lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # 0.868198
    assert s.lr(35) == pytest.approx(0.8681980515)
    assert s.lr(60) == pytest.approx(0.55)  # mid-decay
    assert s.lr(110) == pytest.approx(0.1)  # end of decay
    assert s.lr(111) == 0.1 and s.lr(10_000) == 0.1  # after it: min_lr


def test_linear():
    s = schedule("linear")
    assert s.lr(35) == pytest.approx(0.775)
    assert s.lr(60) == pytest.approx(0.55)
    assert s.lr(110) == pytest.approx(0.1)
    assert s.lr(500) == 0.1


def test_constant_ignores_decay_iters():
    s = schedule("constant")
    assert s.lr(11) == 1.0 and s.lr(110) == 1.0 and s.lr(10_000) == 1.0


def test_warmup_init_lr_and_no_warmup():
    s = schedule("cosine", warmup_init_lr=0.2)
    assert s.lr(0) == pytest.approx(0.2)
    assert s.lr(5) == pytest.approx(0.6)
    s = schedule("cosine", warmup_iters=0)
    assert s.lr(0) == 1.0  # no warmup: decay starts from the peak at step 0
    assert s.lr(55) == pytest.approx(0.55)


@pytest.mark.parametrize(
    ("style", "mid"),
    [
        ("linear", 0.1 + 0.9 * 0.5),
        ("cosine", 0.1 + 0.9 * 0.5),
        ("exponential", 0.1 + 0.9 * (2 * 0.5**0.5 - 1)),  # 0.472792
        ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5**0.5)),  # 0.363604
    ],
)
def test_wsd_phases(style, mid):
    s = schedule("wsd", wsd_decay_iters=20, wsd_decay_style=style)
    assert s.lr(11) == 1.0  # stable phase right after warmup
    assert s.lr(90) == 1.0  # last stable step: decay_iters - wsd_decay_iters
    assert s.lr(91) < 1.0  # decay has begun
    assert s.lr(100) == pytest.approx(mid)  # halfway through the final decay
    assert s.lr(110) == pytest.approx(0.1)
    assert s.lr(111) == 0.1 and s.lr(5000) == 0.1


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize("wsd_style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_matches_megatron_transcription(style, wsd_style):
    kw = dict(wsd_decay_iters=30, wsd_decay_style=wsd_style, warmup_init_lr=1e-5)
    s = LRSchedule(
        max_lr=3e-4, min_lr=3e-5, warmup_iters=20, decay_iters=200, decay_style=style, **kw
    )
    for step in range(0, 260):
        expected = megatron_get_lr(step, 3e-4, 3e-5, 20, 200, style, 1e-5, 30, wsd_style)
        assert s.lr(step) == pytest.approx(expected, rel=1e-12, abs=0), step


def test_lr_at_reads_the_config():
    cfg = resolve_config("tiny")  # lr 1e-3 -> 1e-4, warmup 30, cosine over 300 iters
    assert lr_at(0, cfg) == 0.0
    assert lr_at(15, cfg) == pytest.approx(5e-4)
    assert lr_at(30, cfg) == pytest.approx(1e-3)
    assert lr_at(165, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(300, cfg) == pytest.approx(1e-4)
    assert lr_at(400, cfg) == 1e-4


def test_factor():
    assert schedule("cosine").factor(60) == pytest.approx(0.55)
    assert LRSchedule(max_lr=0.0, min_lr=0.0, warmup_iters=0, decay_iters=5).factor(3) == 0.0


# ---- optimizer -----------------------------------------------------------------------------------


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(16, 8)
        self.wq = torch.nn.Linear(8, 8, bias=True)
        self.norm = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.frozen = torch.nn.Parameter(torch.ones(8, 8), requires_grad=False)


def test_param_groups_follow_megatron_rule():
    model = Toy()
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = sorted(names[id(p)] for p in groups[0]["params"])
    no_decay = sorted(names[id(p)] for p in groups[1]["params"])
    assert decay == ["tok_embeddings.weight", "wq.weight"]
    assert no_decay == ["norm.bias", "norm.weight", "scale", "wq.bias"]
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.1, 0.0)


def test_param_groups_of_the_transformer():
    from pipeline.core.model.flavors import get_flavor
    from pipeline.core.model.transformer import Transformer

    model = Transformer(get_flavor("tiny"))
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert no_decay and all("norm" in n for n in no_decay)
    for p in groups[0]["params"]:
        assert p.ndim == 2


def test_build_optimizer_on_cpu():
    cfg = resolve_config("tiny")
    opt = build_optimizer(Toy(), cfg)
    assert isinstance(opt, torch.optim.AdamW)
    # fused on every device: it honours `found_inf`, so a skipped step needs no host sync
    assert opt.defaults["fused"] is True
    assert opt.defaults["betas"] == (0.9, 0.95)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def _train(opt, sched, model, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        model.wq.weight.grad = torch.ones_like(model.wq.weight)
        opt.step()
        sched.step()
    return lrs


def test_scheduler_follows_the_schedule():
    cfg = resolve_config("tiny")
    model = Toy()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    lrs = _train(opt, sched, model, 60)
    assert lrs == pytest.approx([lr_at(i, cfg) for i in range(60)], rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr_at(60, cfg)] * 2)


def test_scheduler_state_dict_round_trip():
    cfg = resolve_config("tiny")
    model = Toy()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg)
    _train(opt, sched, model, 37)
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain values only

    model2 = Toy()
    model2.load_state_dict(model.state_dict())
    opt2 = build_optimizer(model2, cfg)
    sched2 = build_scheduler(opt2, cfg)
    sched2.load_state_dict(saved["sched"])  # before the optimizer: lr is re-applied anyway
    assert sched2.last_epoch == 37
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    opt2.load_state_dict(saved["opt"])
    assert _train(opt2, sched2, model2, 10) == _train(opt, sched, model, 10)
    assert torch.equal(model.wq.weight, model2.wq.weight)
