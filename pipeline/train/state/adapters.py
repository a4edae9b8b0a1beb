"""The model converters a run may apply to a built model, as the run state sees them.

A converter that trains adapters on a frozen base (LoRA today) changes what a checkpoint holds
and where the base comes from; the run state (`run_state.py`) reaches that through one hook, a
`StateAdapter`, and this module chooses it from the config, so neither the trainer nor the run
state names a converter.
"""

from __future__ import annotations

from typing import Any

__all__ = ["state_adapter"]


def state_adapter(cfg: Any, model: Any, parts: Any, group: Any) -> Any:
    """The run state's adapter hook for the model's converter (`lora_run.LoRAState` with
    `[lora] enabled`), or None for a model trained whole."""
    if cfg.lora.enabled:
        from pipeline.train.state.lora_run import LoRAState

        return LoRAState(cfg, model, parts, group)
    return None
