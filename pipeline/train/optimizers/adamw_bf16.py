"""AdamW with bf16 moments: `optimizer.state_dtype = "bf16"` (Megatron's
`--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`).

The state is 2 + 2 bytes per parameter instead of 4 + 4. What is kept in fp32 and why:

* the weights: pipe's parameters are the fp32 master copy (bf16 runs compute on bf16 casts),
  so an update far below a bf16 ulp of the weight still lands;
* the step's arithmetic: each step widens the moments to fp32, updates them, applies the
  update from those fp32 values, and only then stores them back in bf16;
* the rounding of that store is stochastic (rounded up with the probability of the dropped
  bits' share of an ulp), so it is unbiased: an EMA whose step, (1 - beta2) * (g^2 - v), is
  below half a bf16 ulp of v (2^-9 of it, about 0.002, near beta2 = 0.999's 0.001) would
  never move under round-to-nearest; stochastically rounded it moves by the right amount on
  average.

Why not torchao: its `_AdamW(bf16_stochastic_round=True)` rounds bf16 *weights* and keeps the
state in the weight's dtype (fp32 for pipe's weights), and its `AdamW8bit`/`AdamW4bit`/
`AdamWFp8` quantize blockwise; none stores bf16 moments beside fp32 weights, and each step is
a `torch.compile`d kernel per parameter. This module is that one update in plain tensor ops.

DTensor parameters (FSDP2, tensor parallel) work on their local shards, the update being
elementwise; the moments are DTensors placed as their parameter, so checkpoints reshard them.
The random bits of the rounding come from a generator seeded by (seed, step, the parameter's
position, the shard's offset in the whole tensor), not from the global RNG
(`rounding_generator`): a run's other random draws do not depend on this choice, a resumed run
rounds as the uninterrupted one did, replicas of a shard round alike (they stay equal), and
each shard of a sharded parameter draws its own bits. A sharded run is therefore not bitwise
one process's (its shards draw other bits than the whole tensor does); each stored moment is
one of the same two bf16 neighbours, and their expectation is the same.

`adamw_step_bf16` is the update of one parameter, `adamw_group_step_bf16` of a group; `Muon`
steps its AdamW groups with it under `optimizer.state_dtype = "bf16"`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "AdamWBF16",
    "adamw_group_step_bf16",
    "adamw_step_bf16",
    "rounding_generator",
    "states_to_bf16",
    "stochastic_round_bf16",
]


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` (fp32) in bf16, rounded away from zero with the probability of its low 16 bits'
    share of a bf16 ulp, so that the expected result is `x`."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator
    )
    # Adding the noise to the dropped bits carries into the kept ones with that probability.
    return ((bits + noise) & -65536).view(torch.float32).bfloat16()


class AdamWBF16(torch.optim.Optimizer):
    """`torch.optim.AdamW`'s update (decoupled weight decay, bias correction) with both moments
    stored in bf16, stochastically rounded; see the module docstring.

    `seed` seeds the rounding (`training.seed`). No `found_inf` is read: a non-finite step is
    skipped after a host check (`pipeline.train.optimizers.nonfinite`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int = 0,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.seed = seed
        # Positions (which seed the rounding) count from here: an offloaded parameter's own
        # optimizer starts at its place in the run's groups, to round as one optimizer does.
        self.first_position = 0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        """One AdamW step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        position = self.first_position
        for group in self.param_groups:
            position = adamw_group_step_bf16(group, self.state, self.seed, position)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts floating state to the parameter's dtype (fp32), then the
        moments back to bf16 (exactly: they were bf16 when saved)."""
        super().load_state_dict(state_dict)
        states_to_bf16(self.state.values(), ("exp_avg", "exp_avg_sq"))


def adamw_group_step_bf16(
    group: dict[str, Any], state: dict[torch.Tensor, Any], seed: int, position: int
) -> int:
    """`adamw_step_bf16` of each parameter of `group` that has a gradient, the parameters
    numbered from `position` + 1 in the group's order (their rounding's positions); returns
    the last one's number, where the next group counts on from."""
    for i, param in enumerate(group["params"], position + 1):
        if param.grad is not None:
            adamw_step_bf16(param, state[param], group, seed, i)
    return position + len(group["params"])


def states_to_bf16(states: Iterable[dict[str, Any]], keys: Iterable[str]) -> None:
    """Cast the `keys` present in each optimizer state back to bf16 after torch's load (which
    casts floating state to the parameter's dtype); exact, as they were bf16 when saved."""
    keys = tuple(keys)
    for state in states:
        for key in keys:
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


def rounding_generator(seed: int, step: int, position: int, param: torch.Tensor) -> torch.Generator:
    """The generator of the rounding bits of `param`'s local shard at `step`: seeded by
    (seed, step, position, the shard's offset), on the shard's device (module docstring)."""
    generator = torch.Generator(device=_local(param).device)
    generator.manual_seed(hash((seed, step, position, _offset(param))) & (2**63 - 1))
    return generator


def adamw_step_bf16(
    param: torch.Tensor, state: dict[str, Any], group: dict[str, Any], seed: int, position: int
) -> None:
    """One AdamW step of `param` (its gradient set) with bf16 moments in `state` (created at
    the first step): the moments widened to fp32 for the step, stored stochastically rounded.
    `group` holds lr, betas, weight_decay and eps (or adam_eps, as Muon's groups name it)."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
    state["step"] += 1
    step = int(state["step"].item())  # a CPU tensor: no device sync
    generator = rounding_generator(seed, step, position, param)
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    eps = group["adam_eps"] if "adam_eps" in group else group["eps"]
    p, grad = _local(param), _local(param.grad).float()
    exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
    m = exp_avg.float().lerp_(grad, 1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.copy_(stochastic_round_bf16(m, generator))
    exp_avg_sq.copy_(stochastic_round_bf16(v, generator))
    p.mul_(1 - lr * weight_decay)
    denom = v.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


_OFFSETS = WeakIdKeyDictionary()
"""Each DTensor parameter's `_offset`, computed at its first step (its placement is fixed)."""


def _offset(param: torch.Tensor) -> tuple[int, ...]:
    """Where `param`'s local shard starts in the whole tensor (zeros for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (0,) * param.ndim
    if param not in _OFFSETS:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        _OFFSETS[param] = tuple(offset)
    return _OFFSETS[param]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
