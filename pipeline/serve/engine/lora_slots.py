"""Many LoRA adapters in one served model, each batch row with its own (or none): vLLM's
`--lora-modules`, `--max-loras` and `--max-lora-rank` in pipe's engine.

`LoRASlots.install(model, ...)` turns every linear an adapter may target (`pipeline.core.model.
lora.LINEAR_TARGETS`) into a `SlotLoRA` one: the same module re-classed, so its weights keep
their names (new weights still find them) and a packed CPU linear stays packed. Beside each such
linear the slots keep stacked adapters, `A` `[slots + 1, max_rank, in]` and `B` `[slots + 1, out,
max_rank]` (B already times alpha / rank; an adapter of a lower rank is zero-padded), the last
slot all zeros: the rows that ask for no adapter. Before each forward pass the engine says which
slot each row uses (`select`), and every adapted linear adds

    out[row] += x[row] @ A[slot[row]]^T @ B[slot[row]]^T

as one product per adapter over the rows that use it (`grouped_lora`, the default: faster on a
CPU), or one batched product over every row's gathered A and B (`gathered_lora`).
A linear that no selected adapter targets costs nothing.

At most `max_loras` adapters are resident at once. Adapters are registered by name and path
(`register`; read once to check they fit) and brought into a slot when a request that uses one is
admitted to the batch (`acquire`); a slot whose adapter no running request uses is reused, least
recently used first. No disk read happens at admission: a request's adapter is read from disk
when the request arrives (`hold`) unless it is resident, and an evicted adapter that waiting
requests still need is kept in memory until they are admitted. Unregistering (`unregister`) only
forgets the name: requests already holding the adapter finish with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.core.model.lora import LINEAR_TARGETS, adapted_class, find_linear

NO_ADAPTER = -1  # a row's slot when it asks for the base model


class LoRASlotError(ValueError):
    """An adapter that cannot be served: unknown name, wrong files, rank or shapes (one line)."""


Tensors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A [r, in], B*s [out, r])


class SlotLoRA:
    """The mix-in of an adapted linear (module docstring): its own forward plus its rows'
    adapters' updates, from `slots`."""

    slots: LoRASlots
    slot_path: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # type: ignore[misc]
        return self.slots.add_delta(self.slot_path, x, out)


@dataclass
class _Slot:
    name: str | None = None
    rank: int = 0
    users: int = 0  # running requests using it
    used: float = 0.0  # when last acquired, for LRU
    paths: frozenset[str] = frozenset()  # the linears its adapter targets


@dataclass
class _Held:
    """An adapter that waiting requests need: their count, its path and, when not resident, its
    tensors in memory."""

    path: str
    count: int = 0
    tensors: Tensors | None = None
    rank: int = 0


@dataclass
class LoRASlots:
    """The resident adapters of a served model and their stacked weights (module docstring)."""

    max_loras: int
    max_rank: int
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    registered: dict[str, str] = field(default_factory=dict)  # name -> path
    method: str = "grouped"  # or "gather" (`grouped_lora`, `gathered_lora`)
    _slots: list[_Slot] = field(default_factory=list)
    _held: dict[str, _Held] = field(default_factory=dict)
    _rows: torch.Tensor | None = None  # slot of each row of the next forward pass ("gather")
    _row_count: int = 0  # rows of the next forward pass
    _active_paths: frozenset[str] = frozenset()  # the linears its adapters target
    _groups: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> its rows
    model_config: Any = None  # the served model's, for peft files of linear attention

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def install(cls, model: nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
        """Slots for `model` (served, on its device and in its dtype), its linears re-classed."""
        param = next(model.parameters())
        stacks = {}
        slots = cls(max_loras, max_rank, stacks, _slots=[_Slot() for _ in range(max_loras)])
        for index, block in model.layers.items():
            for paths in LINEAR_TARGETS.values():
                for path in paths:
                    linear = find_linear(block, path)
                    if linear is None or linear.weight.dim() != 2:
                        continue
                    full = f"layers.{index}.{path}"
                    out_features, in_features = linear.weight.shape
                    shape_a, shape_b = (max_rank, in_features), (out_features, max_rank)
                    stacks[full] = tuple(
                        torch.zeros(max_loras + 1, *shape, dtype=param.dtype, device=param.device)
                        for shape in (shape_a, shape_b)
                    )
                    linear.__class__ = adapted_class(type(linear), SlotLoRA, "SlotLoRA")
                    linear.slots, linear.slot_path = slots, full
        slots.model_config = getattr(model, "config", None)
        return slots

    # ---- names ------------------------------------------------------------------------------

    def register(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` after reading it once to check that it fits;
        `LoRASlotError` naming the path when it does not."""
        if name in self.registered:
            raise LoRASlotError(f"The lora adapter '{name}' has already been loaded.")
        self.read(path)
        self.registered[name] = path

    def unregister(self, name: str) -> None:
        """Forget `name`: new requests cannot use it; those holding it finish with it."""
        if self.registered.pop(name, None) is None:
            raise LoRASlotError(f"The lora adapter '{name}' cannot be found.")

    def read(self, path: str) -> tuple[int, Tensors]:
        """(rank, {linear: (A, B x alpha / rank)}) of the adapter files at `path` (a pipe
        adapter checkpoint or a peft directory), checked against the served model."""
        from pipeline.common.quiet import quiet_dcp
        from pipeline.weights.lora_files import read_adapters

        try:
            with quiet_dcp():
                record, tensors = read_adapters(path, self.model_config)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise LoRASlotError(f"{path}: {error}") from None
        rank, scaling = int(record["rank"]), float(record["alpha"]) / int(record["rank"])
        if rank > self.max_rank:
            raise LoRASlotError(
                f"{path}: LoRA rank {rank} is greater than max_lora_rank {self.max_rank}"
            )
        return rank, self._pairs(Path(path), tensors, scaling)

    def _pairs(self, path: Path, tensors: dict[str, torch.Tensor], scaling: float) -> Tensors:
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, _, ab = key.rpartition(".lora_")
            if ".experts.lora." in key:
                raise LoRASlotError(
                    f"{path}: expert adapters ({key}) are served merged only "
                    "(pipe export merges them)"
                )
            if module not in self.stacks:
                raise LoRASlotError(f"{path}: {key} adapts no linear of the served model")
            pairs.setdefault(module, {})[ab] = tensor
        out = {}
        for module, pair in pairs.items():
            a, b = pair.get("A"), pair.get("B")
            stack_a, stack_b = self.stacks[module]
            fits = a is not None and b is not None and a.shape[1] == stack_a.shape[2]
            if not fits or b.shape[0] != stack_b.shape[1]:
                raise LoRASlotError(f"{path}: {module}'s adapter does not fit the served model")
            out[module] = (a, b * scaling)
        return out

    # ---- requests ---------------------------------------------------------------------------

    def hold(self, name: str) -> None:
        """A request for `name` arrived: keep the adapter at hand until it is admitted (read
        from disk now unless resident); `LoRASlotError` for an unknown name or bad files."""
        if name not in self.registered:
            raise LoRASlotError(f"The lora adapter '{name}' cannot be found.")
        held = self._held.get(name)
        if held is None:
            held = _Held(self.registered[name])
            if self._slot_of(name) is None:
                held.rank, held.tensors = self.read(held.path)
            self._held[name] = held
        held.count += 1

    def acquire(self, name: str) -> int | None:
        """A slot holding `name` for a request being admitted (loading it into a free or least
        recently used idle slot), or None when every slot is in use: the request waits."""
        index = self._slot_of(name)
        if index is None:
            idle = [i for i, s in enumerate(self._slots) if s.users == 0]
            if not idle:
                return None
            index = min(idle, key=lambda i: (self._slots[i].name is not None, self._slots[i].used))
            self._load(index, name)
        slot = self._slots[index]
        slot.users += 1
        slot.used = time.monotonic()
        self._unhold(name)
        return index

    def release(self, name: str, slot: int | None) -> None:
        """A request for `name` left: admitted (`slot`) or still waiting (None)."""
        if slot is None:
            self._unhold(name)
        else:
            self._slots[slot].users -= 1

    def _unhold(self, name: str) -> None:
        held = self._held[name]
        held.count -= 1
        if held.count == 0:
            del self._held[name]

    def _slot_of(self, name: str) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s.name == name), None)

    def _load(self, index: int, name: str) -> None:
        """Bring `name` (held, so in memory unless resident) into slot `index`, first keeping
        the adapter it evicts in memory if waiting requests still need it."""
        old = self._slots[index]
        if old.name is not None and old.name in self._held:
            self._held[old.name].rank, self._held[old.name].tensors = old.rank, self._extract(index)
        held = self._held[name]
        for path in old.paths:  # zero what the old adapter set
            for stack in self.stacks[path]:
                stack[index].zero_()
        for path, (a, b) in held.tensors.items():
            stack_a, stack_b = self.stacks[path]
            stack_a[index, : a.shape[0]].copy_(a)
            stack_b[index, :, : b.shape[1]].copy_(b)
        self._slots[index] = _Slot(name, held.rank, paths=frozenset(held.tensors))
        held.tensors = None

    def _extract(self, index: int) -> Tensors:
        slot = self._slots[index]
        return {
            path: (
                self.stacks[path][0][index, : slot.rank].clone(),
                self.stacks[path][1][index, :, : slot.rank].clone(),
            )
            for path in slot.paths
        }

    @property
    def resident(self) -> list[str]:
        """The adapters in slots now."""
        return [s.name for s in self._slots if s.name is not None]

    # ---- the forward pass -------------------------------------------------------------------

    def select(self, slots: list[int | None]) -> None:
        """The slot of each row of the next forward pass (None or `NO_ADAPTER`: the base): each
        adapter's rows found here once, so no linear waits on the device to find them."""
        zero = self.max_loras
        rows = [zero if s is None or s == NO_ADAPTER else s for s in slots]
        active = frozenset(rows) - {zero}
        self._active_paths = frozenset().union(*(self._slots[s].paths for s in active))
        self._row_count, device = len(rows), self._device
        gather = active and self.method == "gather"
        self._rows = torch.tensor(rows, device=device) if gather else None
        self._groups = {
            slot: torch.tensor([i for i, r in enumerate(rows) if r == slot], device=device)
            for slot in sorted(active)
        }

    def select_rows(self, rows: torch.Tensor) -> None:
        """Each row's slot read from `rows` `[batch]` (`max_loras`, the zero slot: the base) on
        the stacks' device, a tensor the caller keeps and fills in place: every adapted linear
        adds its gathered update, found on the device, so a captured decode step
        (`pipeline.serve.engine.static_decode`) replays on the rows' new slots."""
        self._rows, self._row_count, self._groups = rows, rows.shape[0], {}
        self._active_paths = frozenset(self.stacks)

    @cached_property
    def _device(self) -> torch.device | str:
        return self.stacks[next(iter(self.stacks))][0].device if self.stacks else "cpu"

    def add_delta(self, path: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's adapter update of linear `path` on input `x`."""
        if path not in self._active_paths:
            return out
        a, b = self.stacks[path]
        x3 = x.reshape(self._row_count, -1, x.shape[-1])  # [rows, tokens, in]
        if self._rows is not None:
            delta = gathered_lora(x3, a, b, self._rows)
        else:
            delta = grouped_lora(x3, a, b, self._groups)
        return out + delta.reshape(out.shape).to(out.dtype)


def gathered_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Each row's `x[row] @ a[rows[row]]^T @ b[rows[row]]^T` (`[rows, tokens, out]`) as one
    batched product over every row's gathered A and B (the base's rows: the zero slot)."""
    h = torch.bmm(x, a[rows].transpose(1, 2))
    return torch.bmm(h, b[rows].transpose(1, 2))


def grouped_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: dict[int, torch.Tensor]
) -> torch.Tensor:
    """What `gathered_lora` computes, as one product per adapter over its rows (`groups`: slot
    -> row indices; rows in no group get zeros). The engine's choice, measured on a CPU
    (`scripts/bench/lora_slots.py`, one thread, rank 16, one decode token per row, a quarter of
    the rows on the base): gathering copies every row's A and B, so its time grows with the
    rows; grouped took 0.01-0.84x its time in every case from 1 to 16 rows and 1 to 4
    adapters (at 512 -> 512, 8 rows, 2 adapters: 37 against 101 us; at 4096 -> 14336, 8 rows,
    2 adapters: 0.21 against 5.9 ms)."""
    out = x.new_zeros(*x.shape[:-1], b.shape[1])
    for slot, where in groups.items():
        out.index_copy_(0, where, (x.index_select(0, where) @ a[slot].T) @ b[slot].T)
    return out


def install_named_adapters(model: nn.Module, spec) -> LoRASlots:
    """The engine process's slots for `spec` (an `EngineSpec` with `max_loras` > 0), its
    `lora_modules` registered; `LoRASlotError` naming the first that does not fit."""
    if spec.lora_adapter is not None:
        raise LoRASlotError("--lora-adapter and --lora-modules: serve it by name instead")
    slots = LoRASlots.install(model, spec.max_loras, spec.max_lora_rank)
    for name, path in spec.lora_modules:
        slots.register(name, path)
    return slots


def adapter_control(slots: LoRASlots | None, message):
    """The engine process's answer (`ControlDone`) to `LoadLoRA` / `UnloadLoRA`."""
    from pipeline.serve.engine.messages import ControlDone, LoadLoRA

    if slots is None:
        return ControlDone("this server serves no adapters by name: start it with --enable-lora")
    try:
        if isinstance(message, LoadLoRA):
            slots.register(message.name, message.path)
        else:
            slots.unregister(message.name)
    except LoRASlotError as error:
        return ControlDone(str(error))
    return ControlDone()
