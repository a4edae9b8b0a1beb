"""Muon for the hidden matrices, AdamW for the rest: the registry's `muon`.

`Muon` is one optimizer over every trainable parameter (the scheduler, clipping and checkpoints
see one object). Its groups marked `use_muon` hold the hidden matrices: attention and MLP
projections, and expert stacks (`[experts, m, n]`, orthogonalised per expert). Every other
parameter (embeddings, the output layer, norms, biases, the router) is in AdamW groups with
Megatron's decay rule (`adamw.param_groups`). A Muon step, per matrix, is torch.optim.Muon's:

    B <- mu B + (1 - mu) g;   U = (1 - mu) g + mu B (nesterov) or B
    O = NewtonSchulz(U);      W <- W (1 - lr wd) - lr * scale(m, n) * O

with `scale` Moonlight's `0.2 sqrt(max(m, n))` (`adjust_lr_fn = "match_rms_adamw"`: the update's
RMS is AdamW's, so AdamW's learning rate and weight decay carry over) or Keller Jordan's
`sqrt(max(1, m / n))` ("original"). The AdamW groups step as torch's fused AdamW does. How a
sharded matrix is orthogonalised under each parallel layout: `newton_schulz.orthogonalize`.

State, keyed by parameter like any torch optimizer's (so checkpoints reshard): a momentum
buffer per Muon parameter, `step`/`exp_avg`/`exp_avg_sq` per AdamW one.

`optimizer.state_dtype = "bf16"` stores all of it in bf16 (half the bytes), as `AdamWBF16`
does and for the same reasons: each step widens the momentum to fp32, updates it, makes the
update from that fp32 value and stores it back stochastically rounded (an EMA of momentum
0.95 would stall under round-to-nearest where (1 - mu) g is below half an ulp of the buffer);
the AdamW parameters step with `adamw_group_step_bf16`. The Muon parameters then keep a CPU `step`
too, which seeds their rounding (`rounding_generator`), so a resumed run rounds alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from pipeline.core.model.moe import is_bias
from pipeline.train.optimizers.adamw import param_groups
from pipeline.train.optimizers.adamw_bf16 import (
    adamw_group_step_bf16,
    rounding_generator,
    states_to_bf16,
    stochastic_round_bf16,
)
from pipeline.train.optimizers.newton_schulz import NewtonSchulz, orthogonalize, shard_layout

if TYPE_CHECKING:
    from pipeline.core.model.config import ModelConfig
    from pipeline.train.config.schema import TrainConfig

__all__ = ["ADAMW_MODULES", "Muon", "build_muon", "is_hidden_matrix", "state_bytes_per_param"]

ADAMW_MODULES = ("tok_embeddings", "output", "router")
"""Modules whose >=2-D weights AdamW keeps: the embedding, the output layer and the router."""
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def is_hidden_matrix(name: str, param: Tensor) -> bool:
    """Whether Muon trains the parameter `name`: a 2-D weight or a 3-D expert stack, outside
    the embedding, output layer and router."""
    module = name.rsplit(".", 2)[-2] if "." in name else ""
    return param.ndim in (2, 3) and not is_bias(name) and module not in ADAMW_MODULES


def state_bytes_per_param(cfg: TrainConfig, model: ModelConfig) -> float:
    """Mean fp32 optimizer bytes per trainable parameter of `model` (built on `meta`, LoRA's
    adapters if `cfg` trains them): 4 (fp32 momentum) on Muon's, 8 (AdamW) on the others
    (the registry halves it under `optimizer.state_dtype = "bf16"`)."""
    from pipeline.core.model.transformer import Transformer

    with torch.device("meta"):
        built = Transformer(model)
        if cfg.lora.enabled:
            from pipeline.core.model.lora import apply_lora
            from pipeline.train.state.lora_run import lora_spec

            built = apply_lora(built, lora_spec(cfg))
    trained = [(n, p) for n, p in built.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in trained)
    hidden = sum(p.numel() for n, p in trained if is_hidden_matrix(n, p))
    return (4 * hidden + 8 * (total - hidden)) / max(total, 1)


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: torch.Size) -> float:
    """The learning rate of a matrix of `shape` (`[..., m, n]`), as torch.optim.Muon scales it."""
    rows, cols = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _local(t: Tensor) -> Tensor:
    """The tensor this rank holds of `t` (a DTensor's shard, or `t`), sharing its memory."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon over the `use_muon` groups, fused AdamW over the others (module docstring).

    `tp_mode` chooses how a tensor-parallel matrix is orthogonalised (`newton_schulz`); the
    Newton-Schulz settings are per group (`ns_coefficients`, `ns_steps`, `ns_dtype`).
    `state_dtype` "bf16" stores the states in bf16, rounded with bits seeded by `seed`."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        tp_mode: str = "duplicated",
        state_dtype: str = "fp32",
        seed: int = 0,
        **defaults,
    ):
        super().__init__(groups, defaults)
        self.tp_mode, self.state_dtype, self.seed = tp_mode, state_dtype, seed

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        """One step of every group; the Muon groups' matrices orthogonalised together."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        position = 0  # each parameter's place in the groups, which seeds its rounding
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, position)
            elif self.state_dtype == "bf16":
                adamw_group_step_bf16(group, self.state, self.seed, position)
            else:
                self._adamw_step(group)
            position += len(group["params"])
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which casts floating state to the parameter's dtype (fp32); under
        bf16 states, back to bf16 (exactly: they were bf16 when saved)."""
        super().load_state_dict(state_dict)
        if self.state_dtype == "bf16":
            states_to_bf16(self.state.values(), ("momentum_buffer", "exp_avg", "exp_avg_sq"))

    def _momentum(self, p: Tensor, mu: float, position: int) -> Tensor:
        """The momentum buffer of `p` after this step's gradient, in fp32 (stored in the
        state's dtype: bf16 stochastically rounded)."""
        state, grad = self.state[p], _local(p.grad)
        bf16 = self.state_dtype == "bf16"
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=_DTYPES[self.state_dtype])
            if bf16:
                state["step"] = torch.tensor(0.0)
        buf = _local(state["momentum_buffer"])
        if not bf16:
            return buf.lerp_(grad, 1 - mu)
        state["step"] += 1
        generator = rounding_generator(self.seed, int(state["step"].item()), position, p)
        widened = buf.float().lerp_(grad.float(), 1 - mu)
        buf.copy_(stochastic_round_bf16(widened, generator))
        return widened

    def _muon_step(self, group: dict[str, Any], position: int) -> None:
        mu, params, updates = group["momentum"], [], []
        for i, p in enumerate(group["params"], position + 1):
            if p.grad is None:
                continue
            buf = self._momentum(p, mu, i)
            params.append(p)
            updates.append(_local(p.grad).lerp(buf, mu) if group["nesterov"] else buf)
        ns = NewtonSchulz(
            tuple(group["ns_coefficients"]),
            group["ns_steps"],
            group["eps"],
            _DTYPES[group["ns_dtype"]],
        )
        for p, update in zip(params, orthogonalize(list(zip(params, updates)), ns, self.tp_mode)):
            # A block orthogonalised alone is scaled by its own shape (RMS as AdamW's again).
            blockwise = shard_layout(p, self.tp_mode) == "blockwise"
            shape = _local(p).shape if blockwise else p.shape
            weight = _local(p)
            weight.mul_(1 - group["lr"] * group["weight_decay"])
            weight.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW(fused=True) starts
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adam_eps"],
            maximize=False,
        )


def build_muon(model: torch.nn.Module, cfg: TrainConfig) -> Muon:
    """`Muon` over `model`'s trainable parameters with `cfg.optimizer`'s settings: each of
    Megatron's AdamW groups split into its hidden matrices (group `muon...`) and the rest."""
    o = cfg.optimizer
    hidden = {id(p) for name, p in model.named_parameters() if is_hidden_matrix(name, p)}
    groups = []
    for group in param_groups(model, o.weight_decay):
        mine = [p for p in group["params"] if id(p) in hidden]
        rest = [p for p in group["params"] if id(p) not in hidden]
        if mine:
            name = group["name"].replace("decay", "muon", 1)
            groups.append({**group, "params": mine, "name": name, "use_muon": True})
        if rest or not mine:
            groups.append({**group, "params": rest, "use_muon": False})
    return Muon(
        groups,
        tp_mode=o.muon_tp_mode,
        state_dtype=o.state_dtype,
        seed=cfg.training.seed,
        lr=o.lr,
        weight_decay=o.weight_decay,
        momentum=o.muon_momentum,
        nesterov=o.muon_use_nesterov,
        ns_coefficients=tuple(o.muon_ns_coefficients),
        ns_steps=o.muon_num_ns_steps,
        ns_dtype=o.muon_ns_dtype,
        eps=1e-7,
        adjust_lr_fn=o.muon_adjust_lr_fn,
        betas=(o.beta1, o.beta2),
        adam_eps=o.eps,
    )
