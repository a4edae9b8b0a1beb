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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from pipeline.train.optimizers.adamw import param_groups
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
    return param.ndim in (2, 3) and not name.endswith(".bias") and module not in ADAMW_MODULES


def state_bytes_per_param(cfg: TrainConfig, model: ModelConfig) -> float:
    """Mean optimizer bytes per trainable parameter of `model` (built on `meta`, LoRA's
    adapters if `cfg` trains them): 4 (fp32 momentum) on Muon's, 8 (AdamW) on the others."""
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
    Newton-Schulz settings are per group (`ns_coefficients`, `ns_steps`, `ns_dtype`)."""

    def __init__(self, groups: list[dict[str, Any]], *, tp_mode: str = "duplicated", **defaults):
        super().__init__(groups, defaults)
        self.tp_mode = tp_mode

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        """One step of every group; the Muon groups' matrices orthogonalised together."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        mu, updates = group["momentum"], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - mu)
            updates.append(grad.lerp(buf, mu) if group["nesterov"] else buf)
        ns = NewtonSchulz(
            tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"],
            _DTYPES[group["ns_dtype"]],
        )  # fmt: skip
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
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=True,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["adam_eps"], maximize=False,
        )  # fmt: skip


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
        groups, tp_mode=o.muon_tp_mode, lr=o.lr, weight_decay=o.weight_decay,
        momentum=o.muon_momentum, nesterov=o.muon_use_nesterov,
        ns_coefficients=tuple(o.muon_ns_coefficients), ns_steps=o.muon_num_ns_steps,
        ns_dtype=o.muon_ns_dtype, eps=1e-7, adjust_lr_fn=o.muon_adjust_lr_fn,
        betas=(o.beta1, o.beta2), adam_eps=o.eps,
    )  # fmt: skip
