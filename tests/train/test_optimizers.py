"""The optimizer registry: `optimizer.name` builds its entry's optimizer (AdamW as before), an
unknown name is refused in one line, and each entry says how it skips a non-finite step."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.config.schema import ConfigError
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
        param_groups(twin, o.weight_decay),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True,
    )
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


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_entry_builds_what_it_declares(name: str) -> None:
    """An entry's optimizer takes every trainable parameter and no frozen one, and reads
    `found_inf` on the device exactly when the entry says it skips there."""
    from pipeline.train.optimizers.nonfinite import reads_found_inf

    spec = optimizer_spec(name)
    model = Toy()
    optimizer = spec.build(model, resolve_config("tiny", [f"optimizer.name={name}"]))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    assert reads_found_inf(optimizer) is spec.skips_on_device
    assert spec.state_bytes_per_param >= 0 and spec.state


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_step_leaves_weights_and_state_untouched(fused: bool, monkeypatch) -> None:
    """`step_unless_nonfinite`: a finite step steps; a non-finite one changes no weight, moment
    or step count. A fused AdamW is told on the device (no tensor is read on the host)."""
    from pipeline.train.optimizers.nonfinite import step_unless_nonfinite

    model = Toy()
    optimizer = torch.optim.AdamW(model.wq.parameters(), lr=0.1, fused=fused)
    if fused:
        monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("host sync"))
    initial = model.wq.weight.detach().clone()
    model.wq.weight.grad = torch.ones_like(model.wq.weight)
    step_unless_nonfinite(optimizer, torch.tensor(True))
    before = model.wq.weight.detach().clone()
    assert not torch.equal(before, initial)
    state = {k: v.clone() for k, v in optimizer.state[model.wq.weight].items()}
    model.wq.weight.grad = torch.full_like(model.wq.weight, float("nan"))
    step_unless_nonfinite(optimizer, torch.tensor(False))
    assert torch.equal(model.wq.weight, before)
    for key, value in optimizer.state[model.wq.weight].items():
        assert torch.equal(value, state[key]), key


def test_the_memory_estimate_takes_the_state_bytes_from_the_registry(monkeypatch) -> None:
    """Weights and gradients are 4 + 4 bytes a trainable parameter and the chosen entry adds its
    state (LoRA: to the adapters only); the dry run names the entry and its bytes."""
    from pipeline.train.optimizers import OptimizerSpec
    from pipeline.train.report.estimates import (
        dry_run_report,
        estimate_memory,
        lora_parameters,
        parameter_counts,
    )

    fake = OptimizerSpec(
        name="fake",
        builder="unused:unused",
        state_bytes_per_param=2,
        state="one bf16 moment",
        skips_on_device=False,
    )
    monkeypatch.setitem(OPTIMIZERS, "fake", fake)
    for recipe, world in (("llama3_8b", 8), ("tiny_lora", 1)):
        adamw = resolve_config(recipe, world_size=world)
        chosen = resolve_config(recipe, ["optimizer.name=fake"], world_size=world)
        model = adamw.model_config()
        before, after = (estimate_memory(c, model, world) for c in (adamw, chosen))
        trained = before.params_per_device  # what one device holds of the trained parameters
        if adamw.lora.enabled:
            trained *= lora_parameters(adamw, model) / parameter_counts(model).total
        assert before.state - after.state == pytest.approx(trained * (8 - 2))
        assert after.activations_none == before.activations_none
        report = dry_run_report(chosen, world_size=world)
        assert (
            "optimizer    fake: one bf16 moment, 2 B/param of state; a non-finite step is "
            "skipped after a host check (one sync a step)"
        ) in report
        assert any("fake state (4 + 4 + 2 B/param)" in line for line in report)
