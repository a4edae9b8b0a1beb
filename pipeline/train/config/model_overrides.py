"""The run's `ModelConfig`: a named flavor (or the checkpoint's recorded model) with the
`[model]` section's overrides applied. Pure: the checkpoint's model, when the run takes it, was
read once by the config loader and comes in as an argument.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from pipeline.core.model.config import ModelConfig, MoEConfig
from pipeline.train.config.fields import ConfigError

if TYPE_CHECKING:
    from pipeline.train.config.schema import ModelSection

__all__ = ["apply_model_overrides", "lookup_flavor"]

_MOE_OVERRIDES = {
    "moe_top_k": "top_k",
    "moe_ffn_hidden_size": "ffn_hidden_size",
    "moe_aux_loss_coeff": "aux_loss_coeff",
    "moe_aux_loss_type": "aux_loss_type",
    "moe_z_loss_coeff": "z_loss_coeff",
    "moe_capacity_factor": "capacity_factor",
    "moe_norm_topk_prob": "norm_topk_prob",
    "moe_layer_step": "layer_step",
    "moe_dense_layers": "dense_layers",
}


def lookup_flavor(name: str) -> ModelConfig:
    """A fresh `ModelConfig` of the named flavor from `pipeline.core.model.flavors`."""
    from pipeline.core.model.flavors import FLAVORS

    if name not in FLAVORS:
        raise ConfigError(
            f"unknown model.flavor {name!r}; known flavors: {', '.join(FLAVORS)}, "
            "or checkpoint (the loaded checkpoint's model)"
        )
    return FLAVORS[name]()


def _per_layer_lists(base: ModelConfig, layers: int) -> dict[str, Any]:
    """The flavor's per-layer lists for `layers` layers: its attention kinds repeated in their
    order (gpt-oss's sliding and full layers keep alternating), its layers without RoPE kept
    where they still exist."""
    out: dict[str, Any] = {"no_rope_layers": [i for i in base.no_rope_layers if i < layers]}
    if base.layer_types is not None:
        kinds = base.layer_types
        out["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return out


def apply_model_overrides(base: ModelConfig, section: ModelSection) -> ModelConfig:
    """`base` with the non-`None` overrides of `section` applied (a new object).

    `head_dim` and `num_kv_heads` are filled in by `ModelConfig.__post_init__`, so they are
    re-derived when the fields they came from change and they were not overridden themselves;
    a new `num_layers` reshapes the per-layer lists (`_per_layer_lists`).
    """
    changes: dict[str, Any] = {}
    moe_changes: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name == "flavor" or value is None:
            continue
        if f.name in _MOE_OVERRIDES:
            moe_changes[_MOE_OVERRIDES[f.name]] = value
        elif f.name != "num_experts":
            changes[f.name] = value
    reshaped = "hidden_size" in changes or "num_attention_heads" in changes
    if reshaped and "head_dim" not in changes:
        derived = base.hidden_size // base.num_attention_heads
        if base.head_dim == derived:
            changes["head_dim"] = None
    if "num_layers" in changes:
        changes |= _per_layer_lists(base, changes["num_layers"])
    heads_changed = "num_attention_heads" in changes and "num_kv_heads" not in changes
    if heads_changed and base.num_kv_heads == base.num_attention_heads:
        changes["num_kv_heads"] = None
    moe = copy.deepcopy(base.moe)
    if section.num_experts is not None:
        if section.num_experts == 0:
            moe = None
        else:
            moe = moe or MoEConfig()
            moe.num_experts = section.num_experts
    if moe_changes:
        if moe is None:
            raise ConfigError(
                f"model overrides {', '.join('moe_' + k for k in moe_changes)} need a MoE model; "
                "set model.num_experts too"
            )
        moe = dataclasses.replace(moe, **moe_changes)
    changes["moe"] = moe
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:
        raise ConfigError(f"model overrides give an invalid model: {e}") from e
