"""What the fields of a chat record must be, checked one at a time: a message's role and text,
text without unpaired surrogates. Shared by `pipe preprocess`'s chat and preference readers and
the prompt files GRPO reads (`prompt_files.py`), so a message is refused the same way
wherever it comes from; each problem is a `BadRecord`, which the reader reports with the
record's file and line."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ROLES", "SURROGATE", "BadRecord", "check_message", "check_text", "type_name"]

ROLES = ("system", "user", "assistant", "tool")
SURROGATE = re.compile("[\ud800-\udfff]")


class BadRecord(ValueError):
    """A record-level problem, reported with the record's file and line."""


def type_name(value: object) -> str:
    """How an error names a JSON value's type: "an object", "a list", "null"..."""
    names = {dict: "an object", list: "a list", int: "a number", float: "a number", str: "a string"}
    names[bool] = "a boolean"
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_text(value: Any, where: str) -> None:
    """`value` must be a string of valid Unicode (BadRecord naming `where` otherwise)."""
    if not isinstance(value, str):
        raise BadRecord(f"{where} is {type_name(value)}, expected a string")
    if not value.isascii() and SURROGATE.search(value):
        raise BadRecord(f"{where} holds an unpaired surrogate (not valid Unicode)")


def check_message(message: Any, where: str) -> dict[str, Any]:
    """`message` as an OpenAI-style message (`role` of ROLES, text `content`), else BadRecord."""
    if not isinstance(message, dict):
        raise BadRecord(f"{where} is {type_name(message)}, expected an object")
    role = message.get("role")
    if role not in ROLES:
        raise BadRecord(f"{where}: unknown role {role!r} (expected {', '.join(ROLES)})")
    check_text(message.get("content"), f"{where}.content")
    return message
