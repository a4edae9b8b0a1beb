"""Where the assistant's text lies in a rendered conversation, for a supervised fine-tuning loss
that trains on the assistant's tokens only.

Two rules, chosen by the template (`mask_rule`):

- "generation": the template marks the assistant's text with `{% generation %}` blocks; their
  character spans are the assistant's text, as transformers' `return_assistant_tokens_mask`
  takes them.
- "rendered-prefix": an unmarked template. For assistant message i the span runs from the end
  of rendering(messages[:i], add_generation_prompt=True) to the end of
  rendering(messages[:i + 1]): the message after its role header, through its end-of-turn
  marker. Both renderings must be prefixes of the full rendering. A template that appends its
  generation prompt even when not asked (some Llama 3 copies do) leaves that prompt after
  every rendering's last turn: where the next turn replaces it, the span ends where the two
  renderings part ways, piece by piece, and the text cut off must be that generation prompt.
  After the last turn, the same tail as after an earlier turn is left out; with no earlier
  turn, a probe turn appended shows what the template writes once the conversation goes on.
  A template that renders a turn differently once later turns follow (Qwen3 drops earlier
  reasoning) is refused with `TemplateRewritesTurns`: its spans cannot be read off the
  rendering, and a `{% generation %}`-marked copy of it can say where they are.

`token_mask` turns spans into a 0/1 value per token from the tokens' offsets in the text,
with transformers' overlap rule: a token is 1 when it overlaps a span.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.tokenizer.chat_template import ChatTemplate, ChatTemplateError, normalize_messages

__all__ = [
    "MASK_RULES",
    "AssistantSpans",
    "TemplateRewritesTurns",
    "assistant_spans",
    "mask_rule",
    "token_mask",
]

MASK_RULES = ("generation", "rendered-prefix")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The turn appended after a conversation's last message to see how the template continues it.
_PROBE = {"role": "user", "content": "Go on."}


class TemplateRewritesTurns(ChatTemplateError):
    """The template renders an earlier turn differently once later turns follow, so the
    assistant's spans cannot be derived from the rendering."""


@dataclass(frozen=True)
class AssistantSpans:
    """A conversation's full rendering and the [start, end) character spans of the assistant's
    text in it, in order."""

    text: str
    spans: tuple[tuple[int, int], ...]


def mask_rule(source: str) -> str:
    """ "generation" for a template with `{% generation %}` blocks, else "rendered-prefix"."""
    return "generation" if _GENERATION_TAG.search(source) else "rendered-prefix"


def assistant_spans(
    template: ChatTemplate,
    messages: Sequence[dict[str, Any]],
    rule: str,
    template_name: str | None = None,
) -> AssistantSpans:
    """The rendering of `messages` and the spans of its assistant messages by `rule`; raises
    ChatTemplateError when the template refuses the messages, TemplateRewritesTurns when the
    rendered-prefix rule cannot be applied."""
    if rule == "generation":
        rendered = template.render(list(messages), template_name=template_name)
        return AssistantSpans(rendered.text, rendered.generation_spans)
    if rule != "rendered-prefix":
        raise ValueError(f"unknown mask rule {rule!r}; choose from {MASK_RULES}")
    return _rendered_prefix_spans(template, normalize_messages(list(messages)), template_name)


def _rendered_prefix_spans(
    template: ChatTemplate, messages: list[dict[str, Any]], name: str | None
) -> AssistantSpans:
    def pieces(turns: list[dict[str, Any]], prompt: bool = False) -> list[str]:
        return template.render_pieces(
            turns, add_generation_prompt=prompt, template_name=name, normalized=True
        )[0]

    full_pieces = pieces(messages)
    full = "".join(full_pieces)
    spans: list[tuple[int, int]] = []
    last = len(messages) - 1
    tail = None  # what the template appended after an earlier turn rendered last
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = "".join(pieces(messages[:i], prompt=True))
        if not full.startswith(before):
            if i == 0:  # nothing before it: the conversation's start, not the template, is odd
                raise ChatTemplateError(
                    "the rendering of no messages is not where this conversation's rendering "
                    "starts, so its first (assistant) message cannot be located"
                )
            raise TemplateRewritesTurns(_rewrites(i, "the turns before it"))
        start = len(before)
        own = full_pieces if i == last else pieces(messages[: i + 1])
        if i < last:
            end = _turn_end(own, (full_pieces, full), before)
            if end is not None:
                tail = "".join(own)[end:]
        elif tail is not None and full.endswith(tail) and before.endswith(tail):  # as before
            end = len(full) - len(tail)
        else:  # a probe turn shows what the template writes once the conversation goes on
            end = _turn_end(own, _continued(pieces, messages), before)
        if end is None:
            if i < last:
                raise TemplateRewritesTurns(_rewrites(i, "it"))
            end = len(full)  # the last turn, rendered as it stands: nothing follows it here
        if end <= start or (spans and start < spans[-1][1]):
            raise TemplateRewritesTurns(_rewrites(i, "it"))
        spans.append((start, end))
    return AssistantSpans(full, tuple(spans))


def _continued(pieces, messages: list[dict[str, Any]]) -> tuple[list[str], str] | None:
    """The rendering with a probe turn after the last message, as pieces and text (None if
    the template refuses it): what the template writes once the conversation goes on."""
    try:
        rendered = pieces([*messages, dict(_PROBE)])
    except ChatTemplateError:
        return None
    return rendered, "".join(rendered)


def _turn_end(own: list[str], following: tuple[list[str], str] | None, before: str) -> int | None:
    """Where a turn ends in the rendering `following` (pieces, text) that continues it: the
    end of `own` (the rendering up to that turn) when `following` starts with it, else where
    the two part ways piece by piece, provided the part of `own` cut off is a generation
    prompt the template appends regardless (`before` ends with it). None when neither holds."""
    text = "".join(own)
    if following is None:
        return len(text)
    if following[1].startswith(text):
        return len(text)
    common = 0
    for mine, theirs in zip(own, following[0]):
        if mine != theirs:
            break
        common += len(mine)
    tail = text[common:]
    return common if tail and before.endswith(tail) else None


def _rewrites(index: int, what: str) -> str:
    return (
        f"the chat template renders {what} differently once later turns follow (assistant "
        f"message {index}), so the assistant's tokens cannot be read off the rendering; use a "
        "copy of the template that marks the assistant's text with {% generation %} ... "
        "{% endgeneration %} (--chat-template FILE)"
    )


def token_mask(
    starts: np.ndarray, ends: np.ndarray, spans: Sequence[tuple[int, int]]
) -> np.ndarray:
    """1 for each token [starts[t], ends[t]) that overlaps a span (starts before it ends and
    ends after it starts), else 0 (uint8): transformers' `return_assistant_tokens_mask` rule.
    Tokens and spans are in order; each span marks the run of tokens it overlaps."""
    mask = np.zeros(len(starts), dtype=np.uint8)
    if not spans or not len(starts):
        return mask
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    first = np.searchsorted(ends, bounds[:, 0], side="right")  # first token ending after
    stop = np.searchsorted(starts, bounds[:, 1], side="left")  # first token starting at/after
    runs = first < stop
    edges = np.zeros(len(starts) + 1, dtype=np.int32)
    np.add.at(edges, first[runs], 1)
    np.add.at(edges, stop[runs], -1)
    mask[np.cumsum(edges[:-1]) > 0] = 1
    return mask
