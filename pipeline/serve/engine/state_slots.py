"""State slots: what a hybrid model's linear-attention layers keep per sequence, beside the KV
cache of its attention layers.

A gated DeltaNet layer carries, per sequence, its conv's last `width - 1` inputs and its delta
rule's state (`pipeline.core.model.linear_attention`), fixed in size whatever the sequence's
length. The engine gives each running request one slot (`acquire` at admission, `release` when
it leaves); a slot holds those two tensors for every linear layer, in fp32. A group's siblings
start from their leader's state after its prompt but the last token (`snapshot`, then `restore`
into their own slot when admitted; `pipeline.serve.engine.groups`).

Unlike keys and values, a state is not per position, so it cannot be shared block by block:
prefix caching is off for hybrid models.
"""

from __future__ import annotations

import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.kv_sizes import state_shapes

Snapshot = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (window, state)


class StateSlots:
    """`num_slots` slots of every linear-attention layer's conv window and rule state (one of
    `tp` ranks' heads), fp32 on `device`."""

    def __init__(
        self, config: ModelConfig, num_slots: int, device: torch.device | str, tp: int = 1
    ) -> None:
        window_shape, state_shape = state_shapes(config, tp)
        self.layers = [
            i for i in range(config.num_layers) if config.layer_type(i) == "linear_attention"
        ]
        zeros = lambda shape: torch.zeros(num_slots, *shape, device=device)  # noqa: E731
        self.windows = {i: zeros(window_shape) for i in self.layers}
        self.states = {i: zeros(state_shape) for i in self.layers}
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def for_model(config: ModelConfig, num_slots: int, device, tp: int = 1) -> StateSlots | None:
        """Slots for `config`'s linear layers; None for a model without any."""
        if config.linear_attention is None:
            return None
        if not any(config.layer_type(i) == "linear_attention" for i in range(config.num_layers)):
            return None
        return StateSlots(config, num_slots, device, tp)

    def is_linear(self, layer: int) -> bool:
        return layer in self.windows

    def acquire(self) -> int:
        """A free slot, zeroed (a sequence's start); RuntimeError when none is free."""
        if not self._free:
            raise RuntimeError("no free state slot")  # the scheduler admits within max_batch
        slot = self._free.pop()
        for layer in self.layers:
            self.windows[layer][slot].zero_()
            self.states[layer][slot].zero_()
        return slot

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(windows, states) of `slots` `[batch]` for `layer`, new tensors."""
        return self.windows[layer].index_select(0, slots), self.states[layer].index_select(0, slots)

    def write(
        self, layer: int, slots: torch.Tensor, window: torch.Tensor, state: torch.Tensor
    ) -> None:
        self.windows[layer].index_copy_(0, slots, window.float())
        self.states[layer].index_copy_(0, slots, state.float())

    def snapshot(self, slot: int) -> Snapshot:
        """Copies of `slot`'s tensors, for a sibling to start from."""
        return {
            i: (self.windows[i][slot].clone(), self.states[i][slot].clone()) for i in self.layers
        }

    def restore(self, slot: int, snapshot: Snapshot) -> None:
        for layer, (window, state) in snapshot.items():
            self.windows[layer][slot].copy_(window)
            self.states[layer][slot].copy_(state)
