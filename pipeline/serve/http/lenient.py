"""Request bodies that accept fields they do not know, as vLLM's do: an unknown field is
ignored and logged once per name (vLLM warns on every request), so a client written for another
server (or a newer OpenAI) keeps working. A misspelt parameter is therefore ignored too: the log
says which.

Fields that change what the answer must be are the exception: asking for a structured output
this server cannot give (`response_format` other than text, vLLM's `guided_*` and
`structured_outputs`) is a 400 naming the field, never a silent unconstrained answer. A body
that declares such a field (structured output serving it) takes it as any other field.

A chat or completion body (`vllm_body` set) also consults the inventory of vLLM's fields
(`pipeline.serve.http.vllm_fields`): a field it lists as refused is a 400 naming it unless sent
at vLLM's default, one listed as ignored is dropped without a log line (its reason is there).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.serve.http import vllm_fields

log = logging.getLogger(__name__)

UNSERVED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)
_logged: set[str] = set()  # the field names already logged, for the process
_lock = threading.Lock()


class LenientModel(BaseModel):
    """A request body (or part of one) that ignores unknown fields (module docstring)."""

    model_config = ConfigDict(extra="ignore")
    vllm_body: ClassVar[str | None] = None  # "chat" or "completion": vllm_fields' table

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields)
        unknown = [key for key in data if key not in known]
        for key in unknown:
            if key in UNSERVED and not _plain_text(key, data[key]):
                _refuse(key, "")
        if cls.vllm_body is not None:
            unknown = [key for key in unknown if not _listed(cls.vllm_body, key, data[key])]
        ignored_fields(unknown)
        return data


def _listed(body: str, key: str, value: Any) -> bool:
    """Whether vLLM's field `key` is settled by the inventory: refused (a 400 unless `value` is
    vLLM's default) or ignored on purpose. A served field is one the body declares."""
    rule = vllm_fields.rule(body, key)
    if rule is None or rule.status == "served":  # served but undeclared: logged, as unknown
        return False
    if rule.status != "ignored" and not rule.is_default(value):
        _refuse(key, rule.reason)
    return True


def _refuse(key: str, reason: str) -> None:
    from pipeline.serve.http.openai_api import APIError  # openai_api imports this module

    why = f": {reason}" if reason else ""
    raise APIError(f"{key} is not supported by this server{why}", param=key)


def _plain_text(key: str, value: Any) -> bool:
    """`response_format: {"type": "text"}` (or null), which asks for nothing."""
    if value is None:
        return True
    return key == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def ignored_fields(names: list[str]) -> None:
    """Log each of `names` the first time a request carries it."""
    with _lock:
        new = [name for name in names if name not in _logged]
        _logged.update(new)
    for name in new:
        log.warning(
            "The following fields were present in the request but ignored: %s "
            "(logged once per field name)",
            name,
        )
