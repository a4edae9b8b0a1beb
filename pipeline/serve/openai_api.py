"""The OpenAI-compatible request bodies and response objects of `pipe serve`.

Bodies are pydantic models that forbid unknown fields, so a misspelt parameter is a 400 rather
than silently ignored. Chat messages become a prompt through the tokenizer's chat template, run
in jinja2's sandbox (a template is data from a file: it must not run code), or through a plain
"role: content" layout when the tokenizer has none.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.serve.sampling import SamplingParams
from pipeline.tokenizer.chat_template import ChatTemplate


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False

    def sampling(self, eos_ids: frozenset[int]) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, seed=self.seed, stop=tuple(stop), stop_token_ids=eos_ids,
        )  # fmt: skip


class CompletionBody(_Body):
    """POST /v1/completions."""

    prompt: str = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Body):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)


def chat_prompt(messages: list[ChatMessage], template: ChatTemplate | str | None) -> str:
    """The prompt text for `messages`, ending where the assistant's reply begins; a template
    that fails raises `ChatTemplateError` (one line, the client's 400)."""
    plain = [m.model_dump() for m in messages]
    if template is None:
        return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
    if isinstance(template, str):
        template = ChatTemplate.from_string(template)
    return template.render(plain, add_generation_prompt=True).text


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


def completion_object(
    ident: str, model: str, text: str, finish: str | None, usage: dict | None, chat: bool
) -> dict:
    """A whole response (`usage` given) or one streamed chunk (`usage` None)."""
    if chat:
        piece = (
            {"message": {"role": "assistant", "content": text}}
            if usage
            else {"delta": {"content": text}}
        )
        kind = "chat.completion" if usage else "chat.completion.chunk"
    else:
        piece, kind = {"text": text}, "text_completion"
    body = {
        "id": ident, "object": kind, "created": int(time.time()), "model": model,
        "choices": [{"index": 0, **piece, "finish_reason": finish}],
    }  # fmt: skip
    if usage:
        body["usage"] = usage
    return body
