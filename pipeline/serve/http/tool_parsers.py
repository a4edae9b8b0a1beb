"""Tool calls in a model's text, as vLLM's `--tool-call-parser` formats name them.

- `llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}` (or "arguments"),
  several joined by `;`, optionally after `<|python_tag|>`.
- `hermes`: Hermes' and Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
  after any plain text (that text is the message's content).
- `pythonic`: a Python list of keyword calls, `[get_weather(city="Paris"), now()]` (Llama 3.2's
  and 4's pythonic format).

A parser reads a whole reply (`extract`, the non-streamed answer) or the reply so far
(`split`, which `ToolCallStream` turns into deltas: plain text as it comes, each call once it is
complete). The rules for what counts as a call follow vLLM's parsers, so the same text gives the
same `tool_calls`; text that is not a well-formed call stays content. Where vLLM is narrower
than the format (its llama3_json regex reads two levels of braces, its pythonic parser refuses
negative numbers), pipe reads the whole JSON or Python literal instead.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from pipeline.serve.engine.text import held_prefix


@dataclass(frozen=True)
class FunctionCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's form)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Extracted:
    """What a whole reply holds: its calls (none: the reply is plain text) and its content."""

    calls: tuple[FunctionCall, ...]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


def tool_call_id() -> str:
    """A fresh call id, in vLLM's form (`chatcmpl-tool-` and 32 hex digits)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_object(call: FunctionCall) -> dict:
    """OpenAI's `tool_calls` entry of `call`, with a fresh id."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": tool_call_id(), "type": "function", "function": function}


def _arguments(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """A format of tool calls (module docstring). Subclasses define `extract` and `split`."""

    name = ""
    # the characters that can complete a call once the reply is in its calls: text without
    # them adds no call, so `ToolCallStream` need not parse the reply again
    CLOSERS = ""

    def extract(self, text: str) -> Extracted:
        """The calls and content of a whole reply."""
        raise NotImplementedError

    def split(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """A reply so far: the plain text that is safe to release, or None once the reply is
        in its calls (then no more content comes); and the calls already complete."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks; the text before the first is the content."""

    name = "hermes"
    START = "<tool_call>"
    CLOSERS = ">"  # a block ends with `</tool_call>`
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _COMPLETE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def extract(self, text: str) -> Extracted:
        at = text.find(self.START)
        if at < 0:
            return Extracted((), text)
        try:
            calls = [self._call(a or b) for a, b in self._BLOCK.findall(text)]
        except (ValueError, KeyError, TypeError):
            return Extracted((), text)
        return Extracted(tuple(calls), text[:at] or None)

    def split(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        at = text.find(self.START)
        if at < 0:
            return text[: len(text) - held_prefix(text, (self.START,))], []
        calls = []
        for block in self._COMPLETE.findall(text):
            try:
                calls.append(self._call(block))
            except (ValueError, KeyError, TypeError):
                break  # not a call: the whole reply ends up as content (`extract`)
        return None, calls

    @staticmethod
    def _call(block: str) -> FunctionCall:
        obj = json.loads(block)
        return FunctionCall(str(obj["name"]), _arguments(obj["arguments"]))


class Llama3JsonParser(ToolParser):
    """JSON objects `{"name", "parameters" | "arguments"}` joined by `;`."""

    name = "llama3_json"
    BOT = "<|python_tag|>"
    CLOSERS = "}"  # a call is a JSON object
    _SEPARATOR = re.compile(r"\s*;\s*")

    def extract(self, text: str) -> Extracted:
        start = text.find("{", text.find(self.BOT) + 1 if self.BOT in text else 0)
        if start < 0:
            return Extracted((), text)
        calls, _ = self._objects(text, start)
        return Extracted(tuple(calls), None) if calls else Extracted((), text)

    def split(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        # as vLLM streams: calls only when the reply starts with one
        if text.startswith(self.BOT):
            return None, self._objects(text, len(self.BOT))[0]
        if text.startswith("{"):
            return None, self._objects(text, 0)[0]
        if self.BOT.startswith(text):
            return "", []
        return text, []

    def _objects(self, text: str, at: int) -> tuple[list[FunctionCall], int]:
        """The complete calls from `at` on, and where they end; none if the first is not one."""
        decoder, calls = json.JSONDecoder(), []
        at = len(text) - len(text[at:].lstrip())
        while at < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(FunctionCall(str(obj["name"]), _arguments(args)))
            except (ValueError, KeyError, TypeError):
                break
            separator = self._SEPARATOR.match(text, at)
            if separator is None or separator.end() == at:
                break
            at = separator.end()
        return calls, at


class PythonicParser(ToolParser):
    """A reply that is a Python list of calls with literal keyword arguments."""

    name = "pythonic"
    # an item ends at a top-level `,` or where the list closes, which any closing bracket does
    # at depth 0 (`_complete_items`), so `)` and `}` too
    CLOSERS = ",)]}"

    def extract(self, text: str) -> Extracted:
        if not text.startswith("["):
            return Extracted((), text)
        try:
            body = ast.parse(text).body
            node = body[0].value if body and isinstance(body[0], ast.Expr) else None
            if not isinstance(node, ast.List) or not node.elts:
                return Extracted((), text)
            return Extracted(tuple(map(_python_call, node.elts)), None)
        except (SyntaxError, ValueError, TypeError):
            return Extracted((), text)

    def split(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        if not text.startswith("["):
            return text, []
        calls = []
        for item in _complete_items(text):
            try:
                calls.append(_python_call(ast.parse(item.strip(), mode="eval").body))
            except (SyntaxError, ValueError, TypeError):
                break
        return None, calls


def _python_call(node: ast.expr) -> FunctionCall:
    """A call node with literal keyword arguments as a FunctionCall (ValueError otherwise)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call with keyword arguments")
    arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return FunctionCall(node.func.id, _arguments(arguments))  # a set: TypeError


def _complete_items(text: str) -> list[str]:
    """The complete top-level items of the Python list that `text` begins (quotes and nested
    brackets skipped)."""
    items, depth, quote, start, escaped = [], 0, "", 1, False
    for at, char in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:  # the list closed
                items.append(text[start:at])
                break
        elif char == "," and depth == 1:
            items.append(text[start:at])
            start = at + 1
    return [item for item in items if item.strip()]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Llama3JsonParser, HermesParser, PythonicParser)
}


class ToolCallStream:
    """One streamed reply through a parser: each `push` of new text gives the content to send and
    the new calls' deltas (OpenAI's `delta.tool_calls` entries, one per complete call, with its
    index, id, name and whole arguments). Joined, they are `extract`'s answer on the whole text,
    except that content sent before the reply turned into calls stays sent (as in vLLM)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser, self.max_calls = parser, max_calls
        self.text, self.sent_content, self.calls = "", 0, 0
        self.in_calls = False

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """Content and call deltas released by `delta`."""
        self.text += delta
        if self.in_calls and not any(c in delta for c in self.parser.CLOSERS):
            return "", []  # no call completed: parsing the whole reply again would say so
        content, calls = self.parser.split(self.text)
        if content is None:
            self.in_calls = True
            return "", self._new_calls(calls)
        return self._content(content), []

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end of the reply: held text, the last calls."""
        whole = self.parser.extract(self.text)
        if whole.tools_called:
            return "", self._new_calls(list(whole.calls))
        if self.calls:
            return "", []
        return self._content(self.text), []

    @property
    def called(self) -> bool:
        """Whether a call has been sent (the choice ends with finish_reason "tool_calls")."""
        return self.calls > 0

    def _content(self, upto: str) -> str:
        delta = upto[self.sent_content :]
        self.sent_content = max(self.sent_content, len(upto))
        return delta

    def _new_calls(self, calls: list[FunctionCall]) -> list[dict]:
        limit = len(calls) if self.max_calls is None else min(len(calls), self.max_calls)
        deltas = []
        for index in range(self.calls, limit):
            deltas.append({"index": index, **tool_call_object(calls[index])})
        self.calls = max(self.calls, limit)
        return deltas
