"""The tool fields of a chat request as they arrive: the body's `tools`, `tool_choice` and
`parallel_tool_calls` (OpenAI's), and the `tool_calls` of an assistant message a client sends
back, made ready for a chat template. `pipeline.serve.http.tool_calls` decides what they mean."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel


class ToolFields(BaseModel):
    """The chat body's tool fields, mixed into `ChatBody`; `tools` stay the dicts the client
    sent, so the template renders them as transformers would."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True


def tool_choice_json_schema(tools: list[dict[str, Any]] | None, tool_choice: Any) -> dict | None:
    """The JSON schema the reply must follow for a `required` or named `tool_choice` (None for
    `none` and `auto`): the hook structured output constrains generation with, as vLLM's
    `_get_json_schema_from_tool`. Named: that function's parameters; required: a non-empty list
    of `{"name": one of the tools, "parameters": its parameters}`."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    try:
        functions = {t["function"]["name"]: t["function"] for t in tools}
    except (KeyError, TypeError):  # malformed tools: refused where the reply is planned
        return None
    if isinstance(tool_choice, dict):
        named = functions.get((tool_choice.get("function") or {}).get("name"))
        if named is None:  # refused with vLLM's message where the reply is planned
            return None
        return named.get("parameters") or {"type": "object", "properties": {}}
    choices = [
        {
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": f.get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        }
        for name, f in functions.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as a chat template reads them: each function's
    `arguments` JSON text parsed to an object, as vLLM hands them to Hugging Face templates
    (left as it is when it is not JSON)."""
    out = []
    for call in tool_calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                function = {**function, "arguments": json.loads(function["arguments"])}
            call = {**call, "function": function}
        out.append(call)
    return out
