"""Optimizer states and step in host memory: `optimizer.cpu_offload = true` (Megatron's
`--optimizer-cpu-offload`), for one-GPU fine-tuning.

torchao's `CPUOffloadOptimizer` does the work: a pinned fp32 copy of every trainable parameter
in host memory, one optimizer per parameter stepping there (torch's fused CPU AdamW, or
`AdamWBF16` under `optimizer.state_dtype = "bf16"`), the new weights copied back on a side
stream. `OffloadedOptimizer` adapts it to pipe's run in three ways:

* the gradients are copied to the host once, when `step()` is called: pipe clips them after
  the backward, so the copies torchao's backward hooks make (one per micro-batch) would be
  stale and wasted; those hooks are removed;
* `param_groups` are the run's groups (decay / no decay, over the GPU parameters), so the
  learning-rate scheduler and DCP's checkpoint helpers see an ordinary optimizer; their
  hyper-parameters reach the host optimizers at each step;
* `state`, `state_dict()` and `load_state_dict()` speak torch's format keyed by those groups'
  parameters, so checkpoints save and reload like AdamW's (the states keep their dtype); the
  host copies of the weights are taken again at the first step after building or loading, so
  weights loaded after the optimizer (a resume, an import) are the ones stepped.

Every parameter is offloaded (no small tensor stays on the GPU), so no optimizer state is
GPU-resident. torchao streams between a CUDA (or XPU) device and the host only: the config
checks refuse it on a CPU run and under any layout of more than one device
(`pipeline.train.optimizers.state_problems`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pipeline.common.quiet import quiet_library_logs
from pipeline.train.config.fields import ConfigError

quiet_library_logs()  # torchao logs its kernel libraries and pytree enums while importing
try:
    from torchao.optim import CPUOffloadOptimizer
except ImportError as e:
    raise ConfigError(
        "optimizer.cpu_offload needs torchao: pip install 'pipe-llm[fp8]' (torchao)"
    ) from e

__all__ = ["ACCELERATORS", "OffloadedOptimizer"]

ACCELERATORS = {"cuda", "xpu"}
"""The device types torchao streams states from and to."""


class OffloadedOptimizer(CPUOffloadOptimizer):
    """torchao's `CPUOffloadOptimizer` over `groups`, every parameter offloaded, adapted to
    pipe's clipping, scheduler and checkpoints (see the module docstring)."""

    def __init__(self, groups: list[dict[str, Any]], optimizer_class: type, **kwargs: Any) -> None:
        devices = {p.device.type for group in groups for p in group["params"]}
        if devices - ACCELERATORS:  # e.g. training.device = auto on a machine without one
            raise ConfigError(
                f"optimizer.cpu_offload needs the model on a GPU; its parameters are on "
                f"{', '.join(sorted(devices))}"
            )
        hyper = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
        for group in groups:
            for key, value in hyper.items():
                group.setdefault(key, value)
        hooks_before = {p: set(p._post_accumulate_grad_hooks or ()) for p in _params(groups)}
        # torchao pops "params" from the dicts it is given: hand it copies.
        super().__init__(
            [dict(group) for group in groups], optimizer_class, minimal_size=0, **kwargs
        )
        _remove_new_hooks(hooks_before)
        self._groups = groups
        self.defaults = {}  # no `found_inf` is read: a non-finite step is a host check
        self._host_stale = True  # see `_refresh_host_weights`
        for position, host_optimizer in enumerate(self.optim_dict.values()):
            if hasattr(host_optimizer, "first_position"):  # AdamWBF16: round as one optimizer
                host_optimizer.first_position = position

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Each GPU parameter's state, as its host optimizer keeps it (tensors on the host)."""
        return {p: s for p, _, s in self._each() if s}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        """Copy the final gradients to the host, step there, copy the weights back."""
        for group in self._groups:  # the scheduler's learning rate, decay per group
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.optim_dict[p].param_groups[0].update(hyper)
        self._refresh_host_weights()
        backend = getattr(torch, self.device)
        self.stream.wait_stream(backend.current_stream())
        with backend.stream(self.stream):
            for p, host in self.param_d2h_map.items():
                if p.grad is not None:
                    host.grad.copy_(p.grad, non_blocking=True)
                    self.queue[p] = self.stream.record_event()
        return super().step(closure)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict: parameters numbered in `param_groups` order."""
        state = {i: dict(s) for i, (_, _, s) in enumerate(self._each()) if s}
        groups, start = [], 0
        for group in self._groups:
            ids = list(range(start, start + len(group["params"])))
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
            start += len(ids)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a `state_dict()` (saved keys matched to parameters by position, as torch
        does); each state tensor moves to the host and keeps its dtype."""
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        for (p, host, _), key in zip(self._each(), saved, strict=True):
            if key in state_dict["state"]:
                values = state_dict["state"][key].items()
                self.optim_dict[p].state[host] = {k: _to_host(v) for k, v in values}
        for group, loaded in zip(self._groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        self._host_stale = True

    def _refresh_host_weights(self) -> None:
        """Copy the weights to their host masters once after building or loading: torchao
        copies them when it is built, but a checkpoint's weights arrive later (DCP's
        `set_state_dict` loads the optimizer, then the model), and so do imported ones; a host
        step from the stale copy would overwrite them."""
        if self._host_stale:
            for p, host in self.param_d2h_map.items():
                host.copy_(p.detach())
            self._host_stale = False

    def _each(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """(GPU parameter, its host copy, the host optimizer's state of it), in group order."""
        for group in self._groups:
            for p in group["params"]:
                host = self.param_d2h_map[p]
                yield p, host, self.optim_dict[p].state.get(host, {})


def _params(groups: list[dict[str, Any]]) -> Iterator[torch.Tensor]:
    """The trainable parameters of `groups`."""
    return (p for group in groups for p in group["params"] if p.requires_grad)


def _remove_new_hooks(hooks_before: dict[torch.Tensor, set[int]]) -> None:
    """Remove the post-accumulate-grad hooks registered since `hooks_before` was taken.

    torchao registers one per parameter (a device-to-host gradient copy after each backward)
    and keeps no handle, so the ids are found in the tensor's hook table, a private attribute
    of torch's `Tensor` (the one `RemovableHandle.remove()` deletes from)."""
    for p, before in hooks_before.items():
        hooks = p._post_accumulate_grad_hooks or {}
        for key in set(hooks) - before:
            del hooks[key]


def _to_host(value: Any) -> Any:
    """A loaded state value on the host (a step count of a CPU optimizer too)."""
    return value.to("cpu") if isinstance(value, torch.Tensor) else value
