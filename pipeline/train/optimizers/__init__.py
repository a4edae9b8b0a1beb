"""The optimizer registry: `optimizer.name` picks an entry, the entry builds the optimizer.

An entry (`OptimizerSpec`) names the function that builds its optimizer and declares what the
rest of the run needs to know without building it: the bytes of state it keeps per trainable
parameter (the memory estimate and `--dry-run` count them) and whether its step skips a
non-finite step on the device (`nonfinite.step_unless_nonfinite` holds that contract). The
builder is imported on first use, so the registry, read by the config checks and `--dry-run`,
never imports torch.

Adding an optimizer is one new module here with a `build_<name>(model, cfg)` function and one
`register(OptimizerSpec(...))` below (docs/architecture.md, "Adding an optimizer"). The
learning-rate scheduler (`lr_scheduler`) drives the param groups of any of them.

Two settings change where and how an entry keeps its state, for the entries that declare
them: `optimizer.state_dtype = "bf16"` halves the state (`bf16_state`), and
`optimizer.cpu_offload` keeps state and step in host memory (`cpu_offload`, one GPU only).
`state_bytes_per_param(cfg, model)` and `state_description(cfg)` say what a config's choice costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.train.config.fields import ConfigError
from pipeline.train.config.registry import Registry, call_target

if TYPE_CHECKING:
    import torch

    from pipeline.core.model.config import ModelConfig
    from pipeline.train.config.schema import TrainConfig

__all__ = [
    "OPTIMIZERS",
    "OptimizerSpec",
    "build_optimizer",
    "optimizer_problems",
    "optimizer_spec",
    "register",
    "skips_on_device",
    "state_bytes_per_param",
    "state_description",
    "state_problems",
]


@dataclass(frozen=True)
class OptimizerSpec:
    """One registry entry: how to build an optimizer and what it costs, known before building."""

    name: str
    """The `optimizer.name` that selects it."""
    builder: str
    """`module:function`, called as `function(model, cfg)` to build the optimizer over the
    model's trainable parameters; imported only when a run builds it."""
    state_bytes_per_param: float
    """Bytes of optimizer state per trainable parameter, beside its fp32 weight and gradient
    (AdamW: two fp32 moments, 8)."""
    state: str
    """What that state is, in a few words, for the dry-run report."""
    skips_on_device: bool
    """Its step reads `found_inf` on the device and leaves everything untouched when it is 1,
    so a non-finite step costs no host sync; False: the host is asked first, every step."""
    bf16_state: str | None = None
    """What its state is under `optimizer.state_dtype = "bf16"` (half the bytes, as Megatron's
    `--exp-avg-dtype/--exp-avg-sq-dtype bf16`); None: fp32 only."""
    cpu_offload: bool = False
    """Whether `optimizer.cpu_offload` may keep its state and step in host memory."""
    state_bytes_for: str | None = None
    """`module:function`, called as `function(cfg, model)`: the mean state bytes per trainable
    parameter of that model, for an optimizer whose state differs between parameters (Muon:
    4 on the hidden matrices, 8 on the rest); None: `state_bytes_per_param` for every one."""
    problems: Callable[[TrainConfig], list[str]] = field(default=lambda cfg: [])
    """What is wrong with a config for this optimizer, one line each, no torch (Muon: its
    momentum, Newton-Schulz steps and coefficients)."""

    def state_bytes(self, cfg: TrainConfig, model: ModelConfig) -> float:
        """Mean bytes of fp32 optimizer state per trainable parameter of `model` under `cfg`
        (`state_bytes_per_param` applies `state_dtype` and `cpu_offload`)."""
        if self.state_bytes_for is None:
            return self.state_bytes_per_param
        return call_target(self.state_bytes_for, cfg, model)

    def build(self, model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
        """The optimizer over `model`'s trainable parameters with `cfg.optimizer`'s settings."""
        return call_target(self.builder, model, cfg)


OPTIMIZERS: Registry[OptimizerSpec] = Registry(
    "optimizer.name", "{field}: unknown optimizer {name}; known: {known}"
)
"""Every optimizer `optimizer.name` may choose, by name."""


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add `spec` to `OPTIMIZERS`; a name taken already is a programming error (ValueError)."""
    return OPTIMIZERS.add(spec.name, spec)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The entry called `name`; an unknown name is a one-line `ConfigError` naming the known."""
    return OPTIMIZERS.spec(name)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer.name` chooses, over `model`'s trainable parameters."""
    return optimizer_spec(cfg.optimizer.name).build(model, cfg)


def state_bytes_per_param(
    cfg: TrainConfig, model: ModelConfig | None = None, resident: bool = True
) -> float:
    """Mean bytes of optimizer state per trainable parameter of `model` (unset: `cfg`'s)
    under `cfg`'s `state_dtype` (bf16: half); with `resident`, only those in device memory
    (none under `cpu_offload`)."""
    o = cfg.optimizer
    if resident and o.cpu_offload:
        return 0.0
    full = optimizer_spec(o.name).state_bytes(cfg, model or cfg.model_config())
    return full / (2 if o.state_dtype == "bf16" else 1)


def state_description(cfg: TrainConfig) -> str:
    """What `cfg`'s optimizer state is and where it lives, for the dry-run report."""
    o = cfg.optimizer
    spec = optimizer_spec(o.name)
    state = (spec.bf16_state or spec.state) if o.state_dtype == "bf16" else spec.state
    return state + (" in host memory, stepped on the CPU" if o.cpu_offload else "")


def skips_on_device(cfg: TrainConfig) -> bool:
    """Whether `cfg`'s optimizer skips a non-finite step on the device (fp32 states on the
    device only: the bf16 and offloaded steps are told on the host)."""
    o = cfg.optimizer
    fp32 = o.state_dtype == "fp32" and not o.cpu_offload
    return optimizer_spec(o.name).skips_on_device and fp32


def optimizer_problems(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """What is wrong with `cfg` for its optimizer: an unknown `optimizer.name` (the line names
    the known ones), the entry's own problems and the state settings it cannot take."""
    try:
        spec = optimizer_spec(cfg.optimizer.name)
    except ConfigError as e:
        return [str(e)]
    return spec.problems(cfg) + state_problems(cfg, world_size)


def state_problems(cfg: TrainConfig, world_size: int | None) -> list[str]:
    """One line for each state setting the chosen entry or the run's layout cannot take."""
    o, p = cfg.optimizer, cfg.parallel
    try:
        spec = optimizer_spec(o.name)
    except ConfigError:
        return []  # named by the optimizer checks
    problems = []
    if o.state_dtype == "bf16" and spec.bf16_state is None:
        problems.append(f"optimizer.state_dtype: {o.name} keeps fp32 states only")
    if not o.cpu_offload:
        return problems
    dp = cfg.data_parallel_size(world_size)
    if not spec.cpu_offload:
        problems.append(f"optimizer.cpu_offload: {o.name} cannot be offloaded")
    elif cfg.training.device == "cpu":
        problems.append(
            "optimizer.cpu_offload needs a GPU (torchao's CPUOffloadOptimizer moves states "
            "between a CUDA device and host memory); training.device is cpu"
        )
    elif p.tp * p.pp * p.cp * p.ep * dp > 1:
        problems.append(
            f"optimizer.cpu_offload is for one-GPU runs; this layout has tp {p.tp} pp {p.pp} "
            f"cp {p.cp} ep {p.ep} dp {dp}"
        )
    return problems


register(
    OptimizerSpec(
        name="adamw",
        builder="pipeline.train.optimizers.adamw:build_adamw",
        state_bytes_per_param=8,
        state="two fp32 moments",
        skips_on_device=True,
        bf16_state="two bf16 moments, stochastically rounded (fp32 weights and update)",
        cpu_offload=True,
    )
)


def _muon_problems(cfg: TrainConfig) -> list[str]:
    """Muon's settings in range: momentum, Newton-Schulz steps and its three coefficients."""
    o, problems = cfg.optimizer, []
    if not 0 <= o.muon_momentum < 1 or o.muon_num_ns_steps < 1:
        problems.append("optimizer.muon_momentum must be in [0, 1) and muon_num_ns_steps >= 1")
    if len(o.muon_ns_coefficients) != 3:
        problems.append(
            f"optimizer.muon_ns_coefficients: need three (a, b, c), got {o.muon_ns_coefficients}"
        )
    return problems


register(
    OptimizerSpec(
        name="muon",
        builder="pipeline.train.optimizers.muon:build_muon",
        state_bytes_per_param=4,
        state="an fp32 momentum on the hidden matrices (4 B), two fp32 moments (AdamW, 8 B) on "
        "the rest",
        skips_on_device=False,
        state_bytes_for="pipeline.train.optimizers.muon:state_bytes_per_param",
        problems=_muon_problems,
        bf16_state="a bf16 momentum on the hidden matrices (2 B), two bf16 moments (AdamW, 4 B) "
        "on the rest, stochastically rounded (fp32 weights and update)",
    )
)
"""Muon for the hidden matrices, AdamW for the rest (`pipeline.train.optimizers.muon`)."""
