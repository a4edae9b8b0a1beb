"""Auxiliary-loss-free load balancing (DeepSeek-V3): the one place the expert bias moves.

After each optimizer step, every MoE layer with an `expert_bias` (`MoEConfig.expert_bias`)
moves it by `expert_bias_update_rate` towards an even load: down for each expert that took
more than the mean number of assignments during the step, up for each that took fewer. The
bias only chooses experts (it never weighs them), so it needs no gradient.

Loads are summed over every rank that holds the layer, so every rank computes the same bias:
one all-reduce of a `[num_layers, num_experts]` table in which each rank fills in the layers it
holds (pipeline stages hold different layers; data, context and expert parallel ranks route
different tokens; tensor parallel ranks route the same ones, which scales a layer's loads
uniformly and so leaves the update unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.moe import MoE

__all__ = ["update_expert_biases"]


@torch.no_grad()
def update_expert_biases(
    config: ModelConfig,
    moe_layers: Mapping[str, MoE],
    group: Any = None,
    apply: torch.Tensor | None = None,
) -> None:
    """Move each layer's expert bias by rate * sign(mean load - load) and reset its load count.

    `moe_layers`: this rank's MoE modules by global layer index. `group`: the ranks whose loads
    are summed (every rank of the run: all must call this together). `apply`: a 0-dim tensor,
    1 to update and 0 to leave the biases (a skipped step), read on the device."""
    moe = config.moe
    if moe is None or not moe.expert_bias:
        return
    held = {int(i): layer for i, layer in moe_layers.items()}
    device = next((m.expert_bias.device for m in held.values()), None)
    if device is None:  # a pipeline stage without MoE layers still joins the reduction
        device = apply.device if apply is not None else torch.device("cpu")
    layers = config.num_layers + config.mtp_num_layers
    loads = torch.zeros(layers, moe.num_experts, device=device)
    for i, layer in held.items():
        if layer.expert_load is not None:
            loads[i] = layer.expert_load
    if group is not None:
        dist.all_reduce(loads, group=group)
    for i, layer in held.items():
        step = moe.expert_bias_update_rate * torch.sign(loads[i].mean() - loads[i])
        if apply is not None:
            step = step * apply.to(step)
        layer.expert_bias.add_(step)
        layer.expert_load = None
