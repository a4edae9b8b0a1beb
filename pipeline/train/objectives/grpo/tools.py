"""GRPO's tools and environments, with TRL's contract (`GRPOTrainer(tools=...,
environment_factory=...)`).

- A tool is a typed Python function with a Google-style docstring (`--tool module:function`,
  `grpo.tools`); the model sees its JSON schema, made from its signature and docstring as
  transformers' `get_json_schema` makes one (`tool_schema`).
- An environment is a class (`--environment module:Class`, `grpo.environment`) built with no
  arguments, one instance per rollout (kept and reused, as TRL pools them): `reset(**row)` (the
  prompt's line: `prompt` and its other fields) starts a rollout and returns None or text
  appended to the last user turn; its other public methods are tools bound to that instance;
  an optional `get_reward()` scores the rollout (a reward named after the class).
- A call runs in a worker thread with a time limit (`grpo.tool_timeout`); what it returns
  becomes the tool message's text (`str(result)`), and an exception, or running past the
  limit, `str({"error": message})`, as TRL writes a failed call.

Importing the user's module is `rewards`' (the one place pipe imports user code).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import types
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pipeline.train.config.schema import ConfigError

__all__ = [
    "ToolBox",
    "ToolError",
    "environment_class",
    "environment_methods",
    "load_tools",
    "offered_schemas",
    "offered_tools",
    "run_call",
    "tool_schema",
]

RESERVED_METHODS = ("reset", "get_reward")


class ToolError(ValueError):
    """A function that cannot be offered as a tool (its schema cannot be made); one line."""


# ------------------------------------------------------------------------------ schemas

_JSON_SCALARS = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    type(None): "null",
}
_PLAIN_TYPES = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}
_SECTION = r"(Args:|Returns:|Raises:|\Z)"
_SUMMARY = re.compile(rf"^(.*?)[\n\s]*{_SECTION}", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
# one argument: its indent and name, an optional "(type)", its text up to the next argument
# at the same or a shallower indent
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
    r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def tool_schema(func: Callable) -> dict:
    """The OpenAI tool entry of `func`: `{"type": "function", "function": {name, description,
    parameters}}`, its parameters' JSON types from the type hints (int, float, str, bool,
    None, Any, list[...], tuple[...], dict[str, ...], unions and Optional, Literal, Enum) and
    their descriptions from the docstring's `Args:` (a trailing `(choices: [...])` becomes an
    enum), the return's from `Returns:` when its type converts; `self` is left out. A
    ToolError names what is missing."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ToolError(f"tool {name}: no docstring (a tool's description comes from it)")
    summary, described, returns = _docstring(doc.strip())
    parameters = _parameters(func, name)
    returned = parameters["properties"].pop("return", None)
    if returned is not None and returns is not None:
        returned["description"] = returns
    for argument, schema in parameters["properties"].items():
        if argument not in described:
            raise ToolError(f"tool {name}: the docstring's Args: does not describe {argument!r}")
        text = described[argument]
        choices = _CHOICES.search(text)
        if choices:
            values = json.loads(choices.group(1))
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            text = text[: choices.start()].strip()
        schema["description"] = text
    function = {"name": name, "description": summary, "parameters": parameters}
    if returned is not None:
        function["return"] = returned
    return {"type": "function", "function": function}


def _docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    summary, args, returns = _SUMMARY.search(doc), _ARGS.search(doc), _RETURNS.search(doc)
    described = {}
    if args:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        described = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(block)}
    return (
        summary.group(1).strip() if summary else None,
        described,
        returns.group(1).strip() if returns else None,
    )


def _parameters(func: Callable, name: str) -> dict:
    hints = get_type_hints(func)
    signature = inspect.signature(func)
    params = list(signature.parameters.values())
    receiver = None
    if params and params[0].name in ("self", "cls") and params[0].annotation is params[0].empty:
        receiver = params[0].name
    required = []
    for param in params:
        if param.name == receiver:
            continue
        if param.annotation is param.empty:
            raise ToolError(f"tool {name}: argument {param.name!r} has no type hint")
        if param.default is param.empty:
            required.append(param.name)
    properties = {}
    for argument, hint in hints.items():
        if argument == receiver:
            continue
        try:
            properties[argument] = _json_type(hint)
        except ToolError as error:
            if argument != "return":  # a return type the model never writes may stay out
                raise ToolError(f"tool {name}: argument {argument!r}: {error}") from None
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _json_type(hint: Any) -> dict:
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        return _enum([member.value for member in hint], hint.__name__)
    if origin is None:
        if hint in _PLAIN_TYPES:
            return dict(_PLAIN_TYPES[hint])
        raise ToolError(f"type {hint!r} has no JSON schema (use basic types, Literal, Enum)")
    if origin is Union or origin is types.UnionType:
        subtypes = [_json_type(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum(list(args), "Literal")
    if origin is list:
        return {"type": "array", "items": _json_type(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ToolError(f"{hint}: a tuple of one or of '...' has no schema (use a list)")
        return {"type": "array", "prefixItems": [_json_type(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _json_type(args[1])
        return out
    raise ToolError(f"type {hint!r} has no JSON schema")


def _enum(values: list, what: str) -> dict:
    if not values or any(type(v) not in _JSON_SCALARS for v in values):
        raise ToolError(f"{what}: values must be JSON scalars (int, float, str, bool, None)")
    kinds = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


# ------------------------------------------------------------------------------ loading


def load_tools(names: Sequence[str]) -> list[Callable]:
    """The functions `grpo.tools` names ("module:function" or "file.py:function"), each
    checked to have a schema; a ConfigError (one line naming the field) otherwise."""
    from pipeline.train.objectives.grpo.rewards import import_function

    tools = [import_function(name, "grpo.tools") for name in names]
    for name, tool in zip(names, tools):
        try:
            tool_schema(tool)
        except ToolError as error:
            raise ConfigError(f"grpo.tools {name!r}: {error}") from None
    repeated = _repeated([t.__name__ for t in tools])
    if repeated:
        raise ConfigError(f"grpo.tools: two tools are named {repeated!r}")
    return tools


def environment_class(name: str) -> type:
    """The class `grpo.environment` names, checked: a class with `reset` whose public methods
    have schemas; a ConfigError (one line) otherwise."""
    from pipeline.train.objectives.grpo.rewards import import_function

    cls = import_function(name, "grpo.environment")
    if not isinstance(cls, type):
        raise ConfigError(f"grpo.environment {name!r} is {type(cls).__name__}, not a class")
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    if "reset" not in members:
        raise ConfigError(f"grpo.environment {name!r}: the class has no reset method")
    for method in environment_methods(cls):
        try:
            tool_schema(getattr(cls, method))
        except ToolError as error:
            raise ConfigError(f"grpo.environment {name!r}: {error}") from None
    return cls


def environment_methods(cls: type) -> list[str]:
    """The names of the public methods of `cls` that are tools (all but reset and get_reward),
    in TRL's order (sorted by name, as `inspect.getmembers` lists them)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED_METHODS and not name.startswith("_")
    ]


def offered_tools(section: Any) -> tuple[list[Callable], type | None]:
    """(the standalone tools, the environment class or None) a `[grpo]` section names."""
    tools = load_tools(section.tools)
    environment = environment_class(section.environment) if section.environment else None
    return tools, environment


def offered_schemas(tools: Sequence[Callable], environment: type | None) -> list[dict]:
    """The schemas a rollout's prompt is rendered with: the standalone tools', then the
    environment's methods' (as `ToolBox` orders them)."""
    methods = (
        [getattr(environment, n) for n in environment_methods(environment)] if environment else []
    )
    return [tool_schema(f) for f in [*tools, *methods]]


def _repeated(names: list[str]) -> str | None:
    return next((n for i, n in enumerate(names) if n in names[:i]), None)


# ------------------------------------------------------------------------------ running


class ToolBox:
    """The tools of one rollout: the standalone functions and, with an environment, the methods
    of its instance, by name; their schemas in the same order (standalone first)."""

    def __init__(self, tools: Sequence[Callable], environment: Any = None) -> None:
        self.environment = environment
        methods = []
        if environment is not None:
            methods = [getattr(environment, n) for n in environment_methods(type(environment))]
        self.functions = {f.__name__: f for f in [*tools, *methods]}

    @property
    def schemas(self) -> list[dict]:
        return [tool_schema(f) for f in self.functions.values()]

    def call(self, name: str, arguments: Any, timeout: float) -> tuple[str, bool]:
        """(the tool message's text, whether the call failed) of calling tool `name` with
        `arguments` (a dict, or JSON text of one)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                return str({"error": f"arguments are not JSON: {error}"}), True
        if name not in self.functions:
            return str({"error": f"Tool {name} not found."}), True
        if not isinstance(arguments, dict):
            return str({"error": "arguments must be a JSON object"}), True
        return run_call(self.functions[name], arguments, timeout)


def run_call(func: Callable, arguments: dict, timeout: float) -> tuple[str, bool]:
    """`func(**arguments)` in a worker thread, at most `timeout` seconds: (`str(result)`,
    False), or (`str({"error": message})`, True) for an exception or running too long (the
    thread is left to finish on its own: Python cannot stop it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = func(**arguments)
        except Exception as error:  # noqa: BLE001 - a tool's failure is the model's to read
            box["error"] = str(error)

    worker = threading.Thread(target=target, daemon=True, name="pipe-grpo-tool")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return str({"error": f"the tool ran past its {timeout:g} s limit"}), True
    if "error" in box:
        return str({"error": box["error"]}), True
    return str(box.get("result")), False
