"""Chat templates: a tokenizer's Jinja template for turning messages into one prompt, rendered
as Hugging Face transformers renders it, so a served or fine-tuned model sees the very text it
was trained on.

Where the template lives: `chat_template` in tokenizer_config.json (one string, or a list of
`{"name", "template"}`), overridden by a `chat_template.jinja` file beside it (newer
transformers save it there), with further named templates in `additional_chat_templates/`.
What a template sees: `messages`, `add_generation_prompt`, `tools`, `documents`, any extra
keyword argument, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...).

A template is data from a file, not code: it runs in jinja2's immutable sandbox, with only the
helpers templates are written for (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, the `{% generation %}` block). Any failure while rendering is one
`ChatTemplateError` with a one-line message. `{% generation %}...{% endgeneration %}` marks
the assistant's own text: its character spans come back with the text, so supervised
fine-tuning can train on those tokens alone.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "SPECIAL_TOKEN_NAMES",
    "ChatTemplate",
    "ChatTemplateError",
    "RenderedChat",
    "chat_prompt",
    "eos_token_ids",
    "load_chat_template",
    "normalize_messages",
    "special_tokens",
]

# The named special tokens transformers hands every template (when the tokenizer has them).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
# Names a message's reasoning may come under; templates read `reasoning_content` (or
# `thinking`, gpt-oss), so transformers fills both from whichever is given.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template cannot be loaded or rendered; the message is one line saying why."""


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: the text, and the [start, end) character spans the template's
    `{% generation %}` blocks emitted (the assistant's own text), in order."""

    text: str
    generation_spans: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat templates (by name; "default" is the usual one) and the special
    tokens rendered into them."""

    templates: Mapping[str, str]
    special_tokens: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_string(cls, template: str, special_tokens: Mapping[str, Any] | None = None):
        """One template given as text (no tokenizer directory)."""
        return cls({"default": template}, dict(special_tokens or {}))

    def source(self, name: str | None = None, *, tools: bool = False) -> str:
        """The text of template `name`; without a name, "tool_use" when tools are given and
        the tokenizer has one, else "default", else the only template."""
        if name is not None:
            if name not in self.templates:
                known = ", ".join(sorted(self.templates))
                raise ChatTemplateError(f"no chat template named {name!r} (there are: {known})")
            return self.templates[name]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        known = ", ".join(sorted(self.templates))
        raise ChatTemplateError(f"several chat templates and none is 'default': {known}")

    def check(self, name: str | None = None) -> None:
        """Compile template `name` (see `source`): a syntax error is a ChatTemplateError now
        rather than at the first render."""
        _compiled(self.source(name))

    def render(
        self,
        messages: list[Any],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> RenderedChat:
        """`messages` (dicts, dataclasses or pydantic models) rendered as transformers'
        `apply_chat_template(..., tokenize=False)` renders them; keyword arguments override
        special tokens of the same name."""
        pieces, spans = self.render_pieces(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            template_name=template_name,
            **kwargs,
        )
        return RenderedChat("".join(pieces), spans)

    def render_pieces(
        self,
        messages: list[Any],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        template_name: str | None = None,
        normalized: bool = False,
        **kwargs: Any,
    ) -> tuple[list[str], tuple[tuple[int, int], ...]]:
        """`render`, with the text left as the pieces the template emitted in order (each
        literal run and each `{{ ... }}` is one): where two renderings part ways, piece by
        piece, tells which turn's output changed (see pipeline.tokenizer.chat_spans).
        `normalized`: the messages are already as `normalize_messages` returns them (a caller
        rendering one conversation many times normalizes it once)."""
        compiled, template_globals = _compiled(self.source(template_name, tools=tools is not None))
        variables = {
            **template_globals,
            **_plain_tokens(self),
            **(_plain(kwargs) if kwargs else {}),
            "messages": messages if normalized else normalize_messages(messages),
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
        }
        recorder = _SpanRecorder()
        token = _RECORDER.set(recorder)
        try:
            # extend() appends each piece as the template yields it, so a generation block
            # finds every piece before it already in the list. The variables already hold the
            # template's globals: a shared context skips merging them again on every render.
            context = compiled.new_context(variables, shared=True)
            recorder.pieces.extend(compiled.root_render_func(context))
        except ChatTemplateError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever a template's code raises is its error
            raise ChatTemplateError(_one_line(error)) from None
        finally:
            _RECORDER.reset(token)
        return recorder.pieces, tuple(recorder.spans)


def chat_prompt(
    messages: list[Any], template: ChatTemplate | str | None, add_generation_prompt: bool = True
) -> str:
    """The prompt text for `messages`, ending where the assistant's reply begins (or after the
    last message, without `add_generation_prompt`): what `pipe serve`'s chat endpoint and
    `pipe generate --chat` both encode (without adding special tokens, as transformers'
    `apply_chat_template` does). Without a template, `role: content` lines and `assistant:`.
    A template that fails raises `ChatTemplateError` (one line)."""
    if template is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")
    if isinstance(template, str):
        template = ChatTemplate.from_string(template)
    return template.render(messages, add_generation_prompt=add_generation_prompt).text


def eos_token_ids(template: ChatTemplate | None, tokenizer: Any) -> set[int]:
    """The id of the template's end-of-sequence token (the token a chat reply ends with),
    when `tokenizer` encodes it as one token; empty otherwise. Generation stops there."""
    eos = template.special_tokens.get("eos_token") if template is not None else None
    ids = tokenizer.encode_batch([eos])[0] if isinstance(eos, str) else []
    return set(ids) if len(ids) == 1 else set()


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat templates of the tokenizer at `path` (its directory, or a file in it) with its
    special tokens; None when it has no template. Reading never runs the template."""
    directory = Path(path)
    directory = directory if directory.is_dir() else directory.parent
    config = _tokenizer_config(directory)
    templates = _config_templates(config, directory / "tokenizer_config.json")
    template_file = directory / TEMPLATE_FILE
    if template_file.is_file():
        templates["default"] = _read_text(template_file)
    named_dir = directory / NAMED_TEMPLATES_DIR
    if named_dir.is_dir():
        for file in sorted(named_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    if not templates:
        return None
    return ChatTemplate(templates, special_tokens(directory, config))


def special_tokens(directory: str | Path, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The special tokens a template sees, as text: the named ones (tokenizer_config.json,
    then special_tokens_map.json for those it lacks), the model's own named ones
    (`extra_special_tokens` as a mapping) and `additional_special_tokens` (a list)."""
    directory = Path(directory)
    config = _tokenizer_config(directory) if config is None else config
    legacy = _json_file(directory / "special_tokens_map.json") or {}
    tokens: dict[str, Any] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = _token_text(config.get(name)) or _token_text(legacy.get(name))
        if value is not None:
            tokens[name] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens |= {k: v for k, v in ((k, _token_text(v)) for k, v in extra.items()) if v}
    additional = config.get("additional_special_tokens", legacy.get("additional_special_tokens"))
    if isinstance(additional, list):
        tokens["additional_special_tokens"] = [t for t in map(_token_text, additional) if t]
    return tokens


# -- loading ---------------------------------------------------------------------------------


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    return _json_file(directory / "tokenizer_config.json") or {}


def _json_file(path: Path) -> dict[str, Any] | None:
    """A JSON object file, None when absent; a damaged one is a ChatTemplateError naming it."""
    if not path.is_file():
        return None
    try:
        data = json.loads(_read_text(path))
    except ValueError as error:
        raise ChatTemplateError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: not a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"{path}: cannot read ({error})") from None


def _config_templates(config: dict[str, Any], path: Path) -> dict[str, str]:
    template = config.get("chat_template")
    if template is None:
        return {}
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list) and all(_is_named_template(t) for t in template):
        return {t["name"]: t["template"] for t in template}
    raise ChatTemplateError(
        f"{path}: chat_template must be a string or a list of {{name, template}} objects"
    )


def _is_named_template(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
    )


def _token_text(value: Any) -> str | None:
    """A special token's text: a plain string, or an AddedToken dict's `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# -- the inputs a template sees --------------------------------------------------------------


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (dataclasses and pydantic models become dicts,
    str/int/float subclasses their base type): the sandbox cannot vouch for the methods of
    other objects. Anything else becomes an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy and torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _plain_tokens(template: ChatTemplate) -> dict[str, Any]:
    """The template's special tokens as plain values, made once per ChatTemplate."""
    cached = template.__dict__.get("_plain_special_tokens")
    if cached is None:
        cached = _plain(dict(template.special_tokens))
        object.__setattr__(template, "_plain_special_tokens", cached)
    return cached


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: plain dicts, keys whose value is
    None dropped (templates test for a missing key, not for None), reasoning under every name
    templates read."""
    out = []
    for message in map(_plain_message, messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be an object, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain_message(message: Any) -> Any:
    """`_plain(message)`, at once for the common message of string keys and values."""
    if type(message) is dict and all(
        type(k) is str and (type(v) is str or v is None) for k, v in message.items()
    ):
        return message
    return _plain(message)


# -- the Jinja environment -------------------------------------------------------------------


@dataclasses.dataclass
class _SpanRecorder:
    """What one render has emitted so far, and the spans of its generation blocks."""

    pieces: list[str] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


_RECORDER: ContextVar[_SpanRecorder | None] = ContextVar("chat_template_spans", default=None)


def _one_line(error: BaseException) -> str:
    message = " ".join(str(error).split()) or type(error).__name__
    lineno = getattr(error, "lineno", None)
    return f"line {lineno}: {message}" if lineno else message


@lru_cache(maxsize=16)
def _compiled(source: str) -> tuple[Any, dict[str, Any]]:
    """`source` compiled once in the sandboxed environment (compiling runs nothing), with the
    globals a render of it sees (the environment's helpers) as one plain dict."""
    import jinja2

    try:
        template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(_one_line(error)) from None
    return template, dict(template.globals)


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.runtime
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: emits its body unchanged and records
        where in the rendered text that body went."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_emit", [])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _emit(self, caller) -> str:
            body = caller()
            recorder = _RECORDER.get()
            if recorder is not None:
                # The outer render has consumed every piece before this block: their length
                # is where the body starts.
                start = sum(map(len, recorder.pieces))
                recorder.spans.append((start, start + len(body)))
            return body

    class Sandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, answering at once for jinja's own loop object (`loop.index0`
        and the like, read once per message by most templates): its public attributes are
        safe, its underscore ones are refused as everywhere."""

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            if type(obj) is jinja2.runtime.LoopContext:
                return not attr.startswith("_")
            return super().is_safe_attribute(obj, attr, value)

    environment = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _DictMaker()
    environment.globals["namespace"] = _namespace_class(jinja2)
    return environment


def _raise_exception(message: Any) -> None:
    """What a template calls to refuse its input (e.g. roles that do not alternate)."""
    raise ChatTemplateError(" ".join(str(message).split()))


def _strftime_now(fmt: str) -> str:
    """The local time now, formatted (templates that print today's date)."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON text as templates expect it: non-ASCII kept, nothing HTML-escaped."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _DictMaker:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the `dict`
    type itself (whose attributes lead to Python's internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _namespace_class(jinja2):
    """jinja2's `namespace`, refusing attribute names that start with an underscore."""

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace (underscore name)"
            )

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return SafeNamespace
