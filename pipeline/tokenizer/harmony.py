"""gpt-oss's harmony replies split into reasoning and content: `--reasoning-parser openai_gptoss`
(vLLM's name; `gpt_oss` is accepted as an alias).

gpt-oss writes its reply as harmony messages, each a header and a body:

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>
    the answer<|return|>

The markers are special tokens, left out of the reply's text, so the reply is read from its
token ids (as vLLM's harmony parser reads it), and each body is decoded by the tokenizer. A
message on the `analysis` channel is reasoning; on `final`, or `commentary` with no recipient
(a preamble), content; a call to a function (`to=functions.NAME`) or to a built-in tool
(`to=browser...`) is neither (pipe has no harmony tool parser). Whole replies join their
messages' texts with a newline; streamed deltas carry each body as it is decoded, with no
separator. A reply cut inside a body keeps what was written; one cut inside a header (or with
no header at all) becomes content as its raw text, markers included, as vLLM recovers it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

HARMONY_NAMES = ("openai_gptoss", "gpt_oss")  # vLLM's name, then pipe's alias
HARMONY_MARKERS = ("start", "channel", "message", "end", "return", "call", "constrain")
_BUILT_IN_TOOLS = ("python", "browser", "container")  # vLLM's: not function calls
_HEADER, _BODY, _BETWEEN = "header", "body", "between"


class HarmonyServing:
    """The harmony format in the served tokenizer: its marker tokens' ids (a startup error when
    one is missing or not a single token) and the tokenizer's `decode` of message bodies."""

    def __init__(self, name: str, encode: Callable[[str], list[int]], decode) -> None:
        ids = {}
        for marker in HARMONY_MARKERS:
            tokens = encode(f"<|{marker}|>")
            if len(tokens) != 1:
                raise ValueError(
                    f"--reasoning-parser {name}: the tokenizer has no <|{marker}|> token"
                )
            ids[marker] = tokens[0]
        if decode is None:
            raise ValueError(f"--reasoning-parser {name}: needs the tokenizer's decode")
        self.name, self.ids, self.decode = name, ids, decode
        self.marker_of = {token: marker for marker, token in ids.items()}

    def reader(self, template_kwargs=None) -> HarmonyReader:
        """A reader of one reply (harmony has no switch: every reply is read)."""
        return HarmonyReader(self)


class _Message:
    """One harmony message being read: its header and body token ids."""

    def __init__(self) -> None:
        self.header: list[int] = []
        self.body: list[int] = []
        self.role = "assistant"  # the reply's own role unless a header names another
        self.channel: str | None = None
        self.recipient: str | None = None
        self.shown = ""  # the body's text sent so far


class HarmonyReader:
    """One reply read token by token: `push` a delta (its text is not needed, the ids are read),
    `whole` for an unstreamed reply; `reasoning_tokens` counts the body tokens of analysis
    messages and of tool calls, as vLLM counts them."""

    def __init__(self, serving: HarmonyServing) -> None:
        self.serving, self.ids = serving, serving.ids
        self.state = _HEADER  # the reply opens inside the first header (the role is given)
        self.message = _Message()
        self.raw: list[int] = []  # the current message's tokens, for a cut header's recovery
        self.done: list[_Message] = []
        self.reasoning_tokens = 0

    def push(self, text: str, ids: list[int]) -> tuple[str, str]:
        """The reasoning and content texts of one delta."""
        reasoning, content = [], []
        for token in ids:
            piece = self._read(token)
            kind = self._kind(self.message)
            if piece and kind == "reasoning":
                reasoning.append(piece)
            elif piece and kind == "content":
                content.append(piece)
        return "".join(reasoning), "".join(content)

    def finish(self) -> str:
        """The content a reply cut inside a header recovers (its raw text, markers included)."""
        if self.state == _BODY:
            self._complete()
        elif self.state == _HEADER and self.raw:
            recovered = _Message()
            recovered.channel = "final"
            recovered.shown = text = self._raw_text(self.raw)
            self.done.append(recovered)
            self.raw, self.state = [], _BETWEEN
            return text
        return ""

    def whole(self, text: str, ids: list[int]) -> tuple[str | None, str]:
        """(reasoning, content) of an unstreamed reply: null reasoning when there is none."""
        self.push(text, ids)
        self.finish()
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        for message in self.done:
            kind = self._kind(message)  # another role's message is streamed, not kept
            if kind in parts and message.shown and message.role == "assistant":
                parts[kind].append(message.shown)
        return "\n".join(parts["reasoning"]) or None, "\n".join(parts["content"])

    def _read(self, token: int) -> str:
        """Take one token; the body text it adds (held back while a character is incomplete)."""
        marker = self.serving.marker_of.get(token)
        if self.state == _BETWEEN:
            if marker == "start":  # anything else between messages is dropped, as in vLLM
                self.state, self.message, self.raw = _HEADER, _Message(), [token]
            return ""
        self.raw.append(token)
        if self.state == _HEADER:
            if marker == "message":
                self._open_body()
            else:
                self.message.header.append(token)
            return ""
        if marker in ("end", "return", "call"):
            self._complete()
            return ""
        self.message.body.append(token)
        if marker is None and self._counted(self.message):
            self.reasoning_tokens += 1
        now = self.serving.decode(self.message.body)
        if now.endswith("\ufffd") or not now.startswith(self.message.shown):
            return ""
        piece, self.message.shown = now[len(self.message.shown) :], now
        return piece

    def _open_body(self) -> None:
        """Read the header: `ROLE to=RECIPIENT<|channel|>CHANNEL to=RECIPIENT <|constrain|>TYPE`,
        the recipient in one place or the other, the type left out."""
        header = self._raw_text(self.message.header).split("<|constrain|>")[0]
        role, _, channel = header.partition("<|channel|>")
        channel = channel.split("<|")[0]  # harmony's: up to the next marker
        recipient = re.search(r"to=(\S+)", channel) or re.search(r"to=(\S+)", role)
        self.message.channel = channel.split(" to=")[0].split()[0] if channel.split() else None
        self.message.recipient = recipient.group(1) if recipient else None
        self.message.role = role.replace("<|start|>", "").split(" to=")[0].strip() or "assistant"
        self.state = _BODY

    def _complete(self) -> None:
        self.message.shown = self.serving.decode(self.message.body)
        self.done.append(self.message)
        self.message, self.raw, self.state = _Message(), [], _BETWEEN

    def _raw_text(self, ids: list[int]) -> str:
        """Token ids as text with the harmony markers written out."""
        out, run = [], []
        for token in ids:
            marker = self.serving.marker_of.get(token)
            if marker is None:
                run.append(token)
                continue
            out += [self.serving.decode(run), f"<|{marker}|>"]
            run = []
        return "".join(out) + self.serving.decode(run)

    @staticmethod
    def _kind(message: _Message) -> str:
        """vLLM's reading of a message: a function call, reasoning, content or ignored."""
        recipient = message.recipient
        if recipient and _is_function(recipient):
            return "tool"
        if message.channel == "analysis":
            return "reasoning"
        if message.channel == "final" or (message.channel == "commentary" and not recipient):
            return "content"
        return "ignored"

    @staticmethod
    def _counted(message: _Message) -> bool:
        return message.channel == "analysis" or (
            message.channel == "commentary" and message.recipient is not None
        )


def _is_function(recipient: str) -> bool:
    """Whether a recipient is a function (vLLM's: `functions.NAME` or any name not a built-in
    tool's)."""
    if recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in _BUILT_IN_TOOLS
