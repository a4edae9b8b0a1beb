"""The typed setter's rules: which Python value fits a config field's annotation.

The schema (`pipeline.train.config.schema`) says what each field holds with plain annotations:
`int`, `float`, `bool`, `str`, `list[int]`, `X | None`, and `Literal["a", "b"]` for a field with a
fixed set of allowed values. `coerce` checks a value against one of them (ints widen to floats,
nothing else is converted) and raises `ConfigError` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

__all__ = ["ConfigError", "coerce", "field_types", "literal_values", "type_name"]


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent with another."""


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a section dataclass (ClassVars excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def literal_values(tp: Any) -> tuple[Any, ...]:
    """The allowed values of a `Literal[...]` annotation (empty for any other annotation)."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def type_name(tp: Any) -> str:
    """A readable name for an annotation: `int`, `str or None`, `list of int` (a `Literal` of
    strings reads `str`: its values are listed when one does not match)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is Literal:
        return type_name(type(typing.get_args(tp)[0]))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Return `value` if it fits annotation `tp` (int widens to float), else raise `ConfigError`.

    A `Literal` field takes a value of its values' type that is one of them; another value of
    that type is refused with the allowed values listed."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError:
                continue
    elif origin is Literal:
        allowed = typing.get_args(tp)
        coerce(value, type(allowed[0]), where)  # the values' type first: `expects str`
        if value not in allowed:
            raise ConfigError(
                f"{where} must be one of {', '.join(map(str, allowed))}; got {value!r}"
            )
        return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item_type,) = typing.get_args(tp)
            return [coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where} expects {type_name(tp)}, got {type(value).__name__} {value!r}")
