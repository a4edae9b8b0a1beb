"""Split a training state into what DCP stores (tensors) and what JSON stores (everything else).

DCP writes any non-tensor leaf as a pickled "bytes" item and reads it back with `torch.load`
without `weights_only`, so we never hand it one. Small JSON-representable leaves (optimizer
hyper-parameters such as `lr` or `betas`, step counters stored as numbers) travel in
`pipe_metadata.json` instead; anything else is refused with the path of the offending leaf.

Also home of the model + optimizer helpers around `torch.distributed.checkpoint.state_dict`,
which key optimizer state by parameter name, so checkpoints do not depend on the parallel layout.
"""

from __future__ import annotations

from typing import Any

from pipeline.checkpoint.layout import CheckpointError

_JSON_SCALARS = (str, int, float, bool, type(None))


def is_stateful(value: Any) -> bool:
    """True for objects DCP treats as `Stateful` (they have state_dict and load_state_dict)."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def resolve_stateful(state: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of `state` with each top-level Stateful replaced by its state_dict()."""
    return {
        key: value.state_dict() if is_stateful(value) else value for key, value in state.items()
    }


def _to_json(value: Any, where: str) -> Any:
    """Encode a non-tensor leaf as JSON (tuples marked so they come back as tuples)."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        items = [_to_json(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    raise CheckpointError(
        f"state leaf {where!r} is a {type(value).__name__}, which is neither a tensor nor a "
        "JSON value; put it in the checkpoint metadata instead"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__tuple__"}:
        return tuple(_from_json(item) for item in value["__tuple__"])
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[list[Any]]]:
    """Tensors as a nested dict for DCP, and `[path, json_value]` pairs for the other leaves.

    The tensor tree holds the same tensor objects as `state`, so a DCP load into it fills
    `state` in place. Keys must be strings (DCP joins them into dotted names).
    """
    import torch

    others: list[list[Any]] = []

    def walk(node: dict[str, Any], path: list[str]) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for key, value in node.items():
            where = ".".join([*path, str(key)])
            if not isinstance(key, str):
                raise CheckpointError(f"state key {where!r} is not a string")
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, dict):
                subtree = walk(value, [*path, key])
                if subtree:
                    tensors[key] = subtree
            elif isinstance(value, (list, tuple)) and any(
                isinstance(item, torch.Tensor) for item in value
            ):
                raise CheckpointError(f"state leaf {where!r} is a list of tensors; use a dict")
            else:
                others.append([[*path, key], _to_json(value, where)])
        return tensors

    return walk(state, []), others


def merge_json_leaves(state: dict[str, Any], leaves: list[list[Any]]) -> None:
    """Put saved `[path, json_value]` leaves back into `state` for the top-level keys it has."""
    for path, value in leaves:
        if not path or path[0] not in state:
            continue
        node = state
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _from_json(value)


def model_and_optimizer_state(model: Any, optimizer: Any | None = None) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}` from DCP's `get_state_dict`, keyed by parameter names.

    Works for plain modules and for DTensor/FSDP2-parallelised ones alike; the optimizer's state
    is flattened (`state.<param>.<key>`, `param_groups.<param>.<key>`) so every leaf is addressed
    by parameter name, independent of how parameters are grouped or sharded.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def load_model_and_optimizer_state(
    model: Any, optimizer: Any | None, state: dict[str, Any], strict: bool = True
) -> None:
    """Apply a loaded `model_and_optimizer_state` dict back onto the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
