"""The optimizer registry: `optimizer.name` builds its entry's optimizer (AdamW as before), an
unknown name is refused in one line."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.config import ConfigError
from pipeline.train.config_loader import resolve_config
from pipeline.train.optimizers import OPTIMIZERS, build_optimizer, optimizer_spec
from pipeline.train.optimizers.adamw import param_groups


class Toy(torch.nn.Module):
    """Decayed and not-decayed parameters, and a frozen one the optimizer leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(8, 8, bias=True)
        self.norm = torch.nn.LayerNorm(8)
        self.frozen = torch.nn.Parameter(torch.ones(8, 8), requires_grad=False)


def _two_steps(optimizer: torch.optim.Optimizer, model: Toy) -> None:
    for _ in range(2):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, 0.5)
        optimizer.step()


def test_adamw_chosen_by_name_is_the_adamw_of_before() -> None:
    """`optimizer.name = "adamw"` builds torch's fused AdamW over Megatron's decay groups with
    the section's hyper-parameters, and it steps bit for bit as one built by hand."""
    cfg = resolve_config("tiny", ["optimizer.name=adamw"])
    torch.manual_seed(0)
    model = Toy()
    built = build_optimizer(model, cfg)
    torch.manual_seed(0)
    twin = Toy()
    o = cfg.optimizer
    by_hand = torch.optim.AdamW(
        param_groups(twin, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
        weight_decay=o.weight_decay, fused=True,
    )  # fmt: skip
    assert type(built) is torch.optim.AdamW
    assert built.defaults == by_hand.defaults
    assert built.state_dict()["param_groups"] == by_hand.state_dict()["param_groups"]
    _two_steps(built, model)
    _two_steps(by_hand, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_an_unknown_name_is_one_line_naming_the_known() -> None:
    expected = "optimizer.name: unknown optimizer 'sgd'; known: " + ", ".join(OPTIMIZERS)
    with pytest.raises(ConfigError) as error:
        resolve_config("tiny", ["optimizer.name=sgd"])
    assert error.value.args[0].splitlines()[1:] == [f"  {expected}"]
    with pytest.raises(ConfigError) as error:
        optimizer_spec("sgd")
    assert str(error.value) == expected
