"""The experts' grouped products (`pipeline.core.model.moe`, `torch._grouped_mm`) where no
gradient flows: the values of the loop over experts they replace (`looped_swiglu`, the
reference) to the dtype's rounding (a group of one row may take another kernel in the loop),
for float32, bf16 and bf16 autocast, biases and gpt-oss's clamped activation, experts given no
token and no token at all; whole models of the MoE flavors (LoRA adapters on the expert stacks
included) give the loop's logits; the rule for where they run; training keeps the loop; expert
counts of a fixed size (no value read back to the host in a decode step:
`tests/serve/test_static_decode.py` checks whole steps)."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeline.core.model import moe as moe_module
from pipeline.core.model.flavors import get_flavor
from pipeline.core.model.lora import LoRASpec, apply_lora
from pipeline.core.model.moe import (
    clamped_swiglu,
    expert_counts,
    grouped_mm_serves,
    grouped_swiglu,
    looped_swiglu,
    swiglu,
)
from pipeline.core.model.transformer import Transformer

EXPERTS, HIDDEN, FFN = 4, 16, 24
COUNTS = [[3, 0, 6, 4], [13, 0, 0, 0], [1, 2, 3, 7], [0, 0, 0, 0]]


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stacks(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(w1, w3, w2) in `dtype`."""
    return tuple(
        _seeded(seed, EXPERTS, *shape).to(dtype)
        for seed, shape in ((1, (FFN, HIDDEN)), (2, (FFN, HIDDEN)), (3, (HIDDEN, FFN)))
    )


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize(
    ("dtype", "autocast"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
)
def test_grouped_products_give_the_loops_values(counts, biases, dtype, autocast) -> None:
    x = _seeded(0, sum(counts), HIDDEN)
    stacks = _stacks(torch.float32 if autocast else dtype)
    if not autocast:
        x = x.to(dtype)
    bias = tuple(_seeded(4 + i, EXPERTS, n) for i, n in enumerate((FFN, FFN, HIDDEN)))
    activation = functools.partial(clamped_swiglu, limit=7.0, alpha=1.702) if biases else swiglu
    tokens = torch.tensor(counts)
    outputs = []
    for run in (grouped_swiglu, looped_swiglu):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
            assert grouped_mm_serves(x, *stacks)
            outputs.append(run(x, tokens, *stacks, None, bias if biases else None, activation))
    grouped, looped = outputs
    assert grouped.shape == (sum(counts), HIDDEN) and grouped.dtype == looped.dtype == dtype
    torch.testing.assert_close(grouped, looped)  # the dtype's own tolerances


def _models(flavor: str, lora: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(get_flavor(flavor))
    model.init_weights()
    if lora:
        apply_lora(model, LoRASpec(rank=4, targets=("expert_gate", "expert_up", "expert_down")))
        for name, param in model.named_parameters():
            if "lora" in name:  # B starts at zero; give the update a value
                param.data.normal_(0.0, 0.05)
    return model.eval()


@pytest.mark.parametrize(
    ("flavor", "lora"),
    [
        ("tiny_moe", False),
        ("tiny_moe", True),
        ("tiny_qwen3_moe", False),
        ("tiny_deepseek_v3", False),
        ("tiny_gpt_oss", False),
    ],
)
def test_models_give_the_loops_logits(flavor, lora, monkeypatch) -> None:
    """A whole model's logits, with the grouped products and with the loop forced."""
    model = _models(flavor, lora)
    tokens = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator())
    calls = []
    grouped = moe_module._grouped_swiglu
    monkeypatch.setattr(moe_module, "_grouped_swiglu", lambda *a: calls.append(1) or grouped(*a))
    with torch.no_grad():
        mine = model(tokens)
    assert calls, "the grouped products did not run"
    monkeypatch.setattr(moe_module, "grouped_mm_serves", lambda *a: False)
    with torch.no_grad():
        theirs = model(tokens)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_where_the_grouped_products_run() -> None:
    x, stacks = torch.zeros(3, HIDDEN), _stacks(torch.float32)
    with torch.no_grad():
        assert grouped_mm_serves(x, *stacks)
        assert grouped_mm_serves(x.bfloat16(), *stacks)
        assert not grouped_mm_serves(x.half(), *stacks)  # the loop keeps other dtypes
        assert not grouped_mm_serves(x.to("meta"), *(s.to("meta") for s in stacks))
    # a gradient: training keeps the loop; without one (frozen weights) the grouped products
    assert grouped_mm_serves(x, *stacks)
    trained = stacks[0].clone().requires_grad_()
    assert not grouped_mm_serves(x, trained, *stacks[1:])
    with torch.no_grad():
        assert grouped_mm_serves(x, trained, *stacks[1:])


def test_training_runs_the_loop(monkeypatch) -> None:
    model = _models("tiny_moe", False).train()
    monkeypatch.setattr(moe_module, "_grouped_swiglu", None)  # fails if it is called
    model(torch.randint(0, model.config.vocab_size, (2, 9))).sum().backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if "experts" in name)


def test_expert_counts_have_a_fixed_size() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    assert expert_counts(ids, 6).tolist() == torch.bincount(ids.reshape(-1), minlength=6).tolist()
    assert expert_counts(ids[:0], 4).tolist() == [0, 0, 0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("biases", [False, True])
def test_grouped_products_on_a_gpu_give_the_loops_values(biases) -> None:
    """bf16 on a GPU of compute capability 9.0 or newer: one CUTLASS grouped kernel per
    projection, against the loop of cuBLAS products."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's bf16 kernel needs compute capability 9.0 or newer")
    stacks = [s.cuda() for s in _stacks(torch.bfloat16)]
    bias = tuple(_seeded(4 + i, EXPERTS, n).cuda() for i, n in enumerate((FFN, FFN, HIDDEN)))
    for counts in COUNTS[:3]:  # a step always has tokens; experts may have none
        x = _seeded(0, sum(counts), HIDDEN).cuda().bfloat16()
        tokens = torch.tensor(counts, device="cuda")
        with torch.no_grad():
            assert grouped_mm_serves(x, *stacks)
            grouped, looped = (
                run(x, tokens, *stacks, None, bias if biases else None, swiglu)
                for run in (grouped_swiglu, looped_swiglu)
            )
        # two kernels' bf16 roundings, carried through the activation: a few of bf16's steps
        # of the output's size (a row given another expert's weights is off by its whole size)
        scale = looped.float().abs().amax().item() if looped.numel() else 1.0
        torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2 * scale)
