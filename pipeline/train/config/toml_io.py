"""Read TOML (`tomllib`, or `tomli` on Python 3.10) and write the small subset our configs use.

The standard library reads TOML but cannot write it, and the resolved config holds only tables of
scalars (bool, int, float, str) and flat lists of them, so a writer for exactly that subset is a few
lines and saves a dependency. `None` has no TOML spelling: callers drop it before writing.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["dumps", "load", "loads"]


def loads(text: str) -> dict[str, Any]:
    """Parse TOML text."""
    return tomllib.loads(text)


def load(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def dumps(tables: dict[str, dict[str, Any]]) -> str:
    """Write `{section: {key: value}}` as TOML, one `[section]` table per entry, in order.

    Values may be bool, int, float, str or a list of those; anything else is a `TypeError`
    naming the key, so an unsupported value never turns into a file that reads back differently.
    """
    out: list[str] = []
    for section, values in tables.items():
        if out:
            out.append("")
        out.append(f"[{_key(section)}]")
        for key, value in values.items():
            out.append(f"{_key(key)} = {_value(value, f'{section}.{key}')}")
    return "\n".join(out) + "\n"


def _key(key: str) -> str:
    if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key):
        return key
    return _string(key)


def _value(value: Any, where: str) -> str:
    # bool before int: bool is a subclass of int.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form; TOML accepts `1e-05` and `0.0003`
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, where) for v in value) + "]"
    raise TypeError(f"{where}: cannot write {type(value).__name__} {value!r} as TOML")


_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _string(text: str) -> str:
    parts = []
    for ch in text:
        if ch in _ESCAPES:
            parts.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # control characters must be escaped in TOML
            parts.append(f"\\u{ord(ch):04x}")
        else:
            parts.append(ch)
    return '"' + "".join(parts) + '"'
