"""Tool calling on /v1/chat/completions, as vLLM serves it.

The request's `tools` go to the chat template as the client sent them (transformers'
`apply_chat_template(tools=...)`), its `tool_choice` picks how the reply is read:

- `"none"`: the reply is text, never parsed (accepted without any server option);
- `"auto"` (the default when `tools` are given): the reply is read by the `--tool-call-parser`
  format (`pipeline.serve.http.tool_parsers`), which needs `--enable-auto-tool-choice`, as in vLLM;
- `"required"` and a named function: as vLLM, the model writes JSON that fits
  `tool_choice_json_schema` by structured output (`ChatBody.structured_output`), and the reply
  is read as that JSON (a list of `{"name", "parameters"}`, or the named function's
  arguments).

`parallel_tool_calls: false` keeps the first call only. An assistant message a client sends back
with `tool_calls` reaches the template with each call's `arguments` as an object, as vLLM hands
them (templates such as Llama 3.1's iterate over them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeline.serve.http.openai_api import APIError
from pipeline.serve.http.tool_fields import ToolFields, tool_choice_json_schema  # noqa: F401 - re-exported
from pipeline.serve.http.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    ToolCallStream,
    tool_call_id,
    tool_call_object,
)

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The function names of `tools`; a 400 naming `tools` for an entry that is not a function."""
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(
                f'tools[{index}]: expected {{"type": "function", "function": {{"name": ...}}}}',
                param="tools",
            )
        names.append(function["name"])
    return names


def named_function(tool_choice: dict[str, Any], names: list[str]) -> str:
    """The function a named `tool_choice` asks for (a 400 with vLLM's message otherwise)."""
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise APIError(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}",
            param="tool_choice",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}",
            param="tool_choice",
        )
    if name not in names:
        raise APIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return name


@dataclass(frozen=True)
class ToolServing:
    """The server's tool options: `--tool-call-parser` and `--enable-auto-tool-choice`."""

    parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.parser!r}: choose from {', '.join(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def reply(self, body: ToolFields) -> ToolReply | None:
        """How to read the reply to `body` (None: as plain text); a 400 with vLLM's message for
        a tool choice the request or the server cannot serve."""
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if body.tools else "none"
        if choice == "none":
            return None
        if body.tools is None:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        names = tool_names(body.tools)
        limit = None if body.parallel_tool_calls is not False else 1
        if isinstance(choice, dict):
            return ToolReply("named", name=named_function(choice, names))
        if choice == "required":
            return ToolReply("required", max_calls=limit) if names else None
        if not (self.enable_auto_tool_choice and self.parser):
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolReply("auto", parser=self.parser, max_calls=limit)


@dataclass(frozen=True)
class ToolReply:
    """How one request's reply becomes a message: `mode` auto (a parser's format), required (a
    JSON list of calls) or named (the arguments of function `name`)."""

    mode: str
    parser: str | None = None
    name: str | None = None
    max_calls: int | None = None

    def calls(self, text: str) -> tuple[list[FunctionCall], str | None]:
        """The calls in a whole reply and the message's content."""
        if self.mode == "auto":
            extracted = TOOL_PARSERS[self.parser]().extract(text)
            return list(extracted.calls)[: self.max_calls], extracted.content
        if self.mode == "named":
            return [FunctionCall(self.name, text)], ""
        calls = required_calls(text)
        return (calls[: self.max_calls], "") if calls else ([], text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole reply and its finish reason ("tool_calls" when an
        auto or required choice called, as vLLM reports)."""
        calls, content = self.calls(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call_object(c) for c in calls]
            if self.mode != "named":
                finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self) -> ChoiceToolStream:
        """A reader of one streamed choice's text."""
        return ChoiceToolStream(self)


def required_calls(text: str) -> list[FunctionCall]:
    """The calls of a `required` reply, a JSON list of `{"name", "parameters"}` (none if not)."""
    try:
        items = json.loads(text)
        return [
            FunctionCall(str(i["name"]), json.dumps(i["parameters"], ensure_ascii=False))
            for i in items
        ]
    except (ValueError, KeyError, TypeError):
        return []


class ChoiceToolStream:
    """One streamed choice through its `ToolReply`: each piece of text the engine releases
    becomes the chunk's `delta` (content and/or tool_calls)."""

    def __init__(self, reply: ToolReply) -> None:
        self.reply, self.text, self.sent_header = reply, "", False
        parser = TOOL_PARSERS[reply.parser]() if reply.mode == "auto" else None
        self._auto = ToolCallStream(parser, reply.max_calls) if parser else None

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta for `text` (new since the last call) and the choice's finish reason."""
        if self._auto is not None:
            content, calls = self._auto.push(text)
            if finish_reason is not None:
                more_content, more_calls = self._auto.finish()
                content, calls = content + more_content, calls + more_calls
                finish_reason = "tool_calls" if self._auto.called else finish_reason
            return _delta(content, calls), finish_reason
        if self.reply.mode == "named":
            return self._named(text), finish_reason
        self.text += text
        if finish_reason is None:
            return {}, None
        calls, content = self.reply.calls(self.text)
        entries = [{"index": i, **tool_call_object(c)} for i, c in enumerate(calls)]
        return _delta(content or "", entries), "tool_calls" if calls else finish_reason

    def _named(self, text: str) -> dict:
        """vLLM's named-function stream: the call's header first, then its arguments as they
        come."""
        if not text:
            return {}
        function: dict[str, str] = {"arguments": text}
        entry: dict[str, Any] = {"index": 0, "function": function}
        if not self.sent_header:
            self.sent_header = True
            function["name"] = self.reply.name
            entry.update(id=tool_call_id(), type="function")
        return {"tool_calls": [entry]}


def _delta(content: str, calls: list[dict]) -> dict:
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta
