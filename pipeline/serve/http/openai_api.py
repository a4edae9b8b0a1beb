"""The OpenAI-compatible request bodies and response objects of `pipe serve`.

Bodies follow OpenAI's documented fields, plus the extras vLLM accepts (sampling constraints,
detokenisation, prompt truncation, chat-template arguments) and the chat body's tool fields
(`pipeline.serve.http.tool_fields`). Every field of vLLM's bodies is served, refused or ignored
on purpose (`pipeline.serve.http.vllm_fields`); other unknown fields are ignored and logged once,
as vLLM does (`pipeline.serve.http.lenient`). `null`
for an optional field means its default. Errors are OpenAI's `{"error": {...}}` body with vLLM's
type names ("BadRequestError", "NotFoundError") and the field at fault as `param`.

Chat messages become a prompt through the tokenizer's chat template, run in jinja2's sandbox (a
template is data from a file: it must not run code), or through a plain "role: content" layout
when the tokenizer has none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from pipeline.serve.engine.sampling import MAX_LOGPROBS, SamplingParams
from pipeline.serve.engine.structured_output import StructuredOutput, StructuredOutputError
from pipeline.serve.http.lenient import LenientModel
from pipeline.serve.http.structured_request import structured_output_of
from pipeline.serve.http.tool_fields import ToolFields, template_tool_calls, tool_choice_json_schema
from pipeline.tokenizer.chat_template import ChatTemplate, chat_prompt  # noqa: F401 - re-exported

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# JSON has no -inf: a token the model rules out reports this, as vLLM does
LOWEST_LOGPROB = -9999.0
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
_GREEDY_TEMPERATURE = 1e-5


class APIError(Exception):
    """A request the server answers with `status` and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(message: str, status: int = 400, param: str | None = None) -> dict:
    """OpenAI's error object: message, type, the field at fault (or None) and the status code."""
    kind = ERROR_TYPES.get(status, "APIError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---- request bodies ---------------------------------------------------------------------------

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StreamOptions(LenientModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices;
    vLLM's `continuous_usage_stats` (with it) puts the usage so far on every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Body(LenientModel):
    """The fields completions and chat share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=128)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: off
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    ignore_eos: bool | None = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # structured output: OpenAI's field, vLLM's, and vLLM's older ones (structured_request)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's constraints, text and prompt fields (vllm_fields says what each does)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=0, ge=0)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None  # None: the body's default (special_tokens_wanted)
    request_id: str | None = None
    use_beam_search: bool | None = False  # pipeline.serve.http.beam_search, n beams
    length_penalty: float | None = 1.0  # beam search's ranking: logprob / length ** this
    return_token_ids: bool | None = False  # each choice's prompt and generated ids
    return_tokens_as_token_ids: bool | None = False  # logprobs name tokens `token_id:N`
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    @property
    def special_tokens_wanted(self) -> bool:
        """Whether the tokenizer's own special tokens (BOS) go into a text prompt."""
        raise NotImplementedError

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's `continuous_usage_stats`)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def check(self, vocab_size: int) -> None:
        """What one field's type cannot say: `APIError` naming the field at fault."""
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is allowed only with stream: true", param="stream_options"
            )
        for key in self.logit_bias or {}:
            _token_id(key, vocab_size, "logit_bias")
        for token in self.stop_token_ids or []:
            _token_id(token, vocab_size, "stop_token_ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise APIError("allowed_token_ids is empty", param="allowed_token_ids")
            for token in self.allowed_token_ids:
                _token_id(token, vocab_size, "allowed_token_ids")
        greedy = self.temperature is not None and self.temperature < _GREEDY_TEMPERATURE
        if greedy and self.choices_per_prompt > 1 and not self.use_beam_search:
            # vLLM refuses it too: n greedy choices would be n copies of one
            raise APIError(
                f"n must be 1 when using greedy sampling, got {self.choices_per_prompt}",
                param="n",
            )
        asked = self.requested_tokens()
        if self.min_tokens and asked is not None and self.min_tokens > asked:
            raise APIError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({asked})",
                param="min_tokens",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                "prompt_logprobs is not supported with stream: true", param="prompt_logprobs"
            )
        if self.spaces_between_special_tokens is False and self.skip_special_tokens is False:
            raise APIError(
                "spaces_between_special_tokens: false is not supported with special tokens in "
                "the text (pipe's detokeniser writes them as the tokenizer decodes them)",
                param="spaces_between_special_tokens",
            )
        self.structured_output()

    def structured_output(self) -> StructuredOutput | None:
        """The constraint the body asks for (`structured_request`); APIError naming the field."""
        try:
            return structured_output_of(self)
        except StructuredOutputError as error:
            raise APIError(str(error), param=error.param) from None

    def requested_tokens(self) -> int | None:
        """max_tokens as asked (None: up to the context)."""
        raise NotImplementedError

    def logprobs_wanted(self) -> int | None:
        """Alternatives per generated token to report (None: no logprobs)."""
        raise NotImplementedError

    def truncated(self, prompt: list[int], context: int) -> list[int]:
        """`prompt` cut to `truncate_prompt_tokens`, keeping its last tokens (`truncation_side`
        right: its first), as vLLM cuts it: -1 is what the context leaves beside max_tokens,
        more than that is a 400."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt
        room = context - (self.requested_tokens() or 0)
        if keep > room:
            raise APIError(
                f"truncate_prompt_tokens ({keep}) must be at most the context less "
                f"max_tokens ({room})",
                param="truncate_prompt_tokens",
            )
        keep = room if keep == -1 else keep
        if len(prompt) <= keep:
            return prompt
        return prompt[:keep] if self.truncation_side == "right" else prompt[len(prompt) - keep :]

    def sampling(
        self,
        prompt_tokens: int,
        token_budget: int,
        eos_ids: frozenset[int],
        index: int = 0,
        bad_words: tuple[tuple[int, ...], ...] = (),
    ) -> SamplingParams:
        """The engine parameters of choice `index` for a prompt of `prompt_tokens` tokens.

        `token_budget` bounds prompt + output (the context, or the cache if smaller); a choice
        beyond the first gets its own seed, so n seeded choices differ yet repeat. `bad_words`:
        the body's bad words as token ids (`bad_word_ids`)."""
        max_new = self.requested_tokens()
        if max_new is None:
            max_new = max(1, token_budget - prompt_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            stop_ids |= eos_ids
        seed = None if self.seed is None else (self.seed + index) % 2**63
        top_k = self.top_k if self.top_k and self.top_k > 0 else 0
        bias = tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=frozenset(stop_ids),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=bias,
            logprobs=self.logprobs_wanted(),
            prompt_logprobs=self.prompt_logprobs_wanted(),
            structured_output=self.structured_output(),
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            allowed_token_ids=(
                None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
            ),
            bad_words=bad_words,
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            cache_salt=self.cache_salt,
            logprob_ranks=self.prompt_logprobs_shown is not None,
        )

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token to compute (None: no prompt logprobs)."""
        return self.prompt_logprobs_shown

    @property
    def prompt_logprobs_shown(self) -> int | None:
        """Alternatives per prompt token in vLLM's `prompt_logprobs` object (None: none), when
        asked. (vLLM also writes it for a completion's echo with logprobs; pipe does not, so
        scoring, lm-eval's loglikelihood, does not pay for the ranks it never reads.)"""
        return self.prompt_logprobs


def logprob_token_text(body: _Body, token_text: Callable[[int], str]) -> Callable[[int], str]:
    """How logprobs name a token: its text, or `token_id:N` with vLLM's
    `return_tokens_as_token_ids`."""
    if body.return_tokens_as_token_ids:
        return lambda token: f"token_id:{token}"
    return token_text


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple:
    """Each bad word as the token sequences it may be written as, vLLM's way: the word alone
    (its leading spaces stripped), and after a space when that starts with another token of
    the same count (a word inside text, for tokenizers that mark a leading space)."""
    sequences = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            raise APIError(f"bad_words: {word!r} has no tokens", param="bad_words")
        sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return tuple(sequences)


def _token_id(value: Any, vocab_size: int, param: str) -> int:
    """`value` (an int or its decimal string) as a token id of the vocabulary, else APIError."""
    try:
        token = int(value)
    except (TypeError, ValueError):
        raise APIError(f"{param}: {value!r} is not a token id", param=param) from None
    if not 0 <= token < vocab_size:
        raise APIError(
            f"{param}: token id {token} is out of the vocabulary (0..{vocab_size - 1})",
            param=param,
        )
    return token


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionBody(_Body):
    """POST /v1/completions."""

    vllm_body: ClassVar[str] = "completion"

    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)  # 0 with echo: score the prompt alone
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=128)

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo (OpenAI's and vLLM's prompt scoring): the answer is the
        prompt with its logprobs; the one token the engine generates is dropped."""
        return bool(self.echo) and self.max_tokens == 0

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens 0 needs echo: true (prompt scoring)", param="max_tokens")
        if self.best_of is not None:
            if self.best_of < self.choices_per_prompt:
                raise APIError(
                    f"best_of ({self.best_of}) must be at least n ({self.choices_per_prompt})",
                    param="best_of",
                )
            if self.stream:
                raise APIError("best_of is not supported with stream: true", param="best_of")

    @property
    def generations_per_prompt(self) -> int:
        """Engine requests per prompt: best_of when given (the n best are kept), else n."""
        return self.best_of or self.choices_per_prompt

    def requested_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        # best_of ranks by cumulative logprob, so it needs the chosen tokens' logprobs
        if self.logprobs is None and self.generations_per_prompt > self.choices_per_prompt:
            return 0
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        # echo's logprobs are the prompt's too: as many alternatives as either asks
        asked = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return max(asked) if asked else None

    @property
    def special_tokens_wanted(self) -> bool:
        return self.add_special_tokens is not False  # vLLM's default for a prompt: added


class ChatMessage(LenientModel):
    """One message; `content` is text or a list of parts (only text parts are supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # what a client sends back with an earlier assistant message; not given to the template
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class ChatBody(_Body, ToolFields):
    """POST /v1/chat/completions."""

    vllm_body: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # what reaches the chat template (vLLM's)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool | None = True  # the reply's reasoning shown (with a parser)
    echo: bool | None = False  # the last message's text before the reply (same role)
    return_prompt_text: bool | None = False  # the rendered prompt in the answer

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if "chat_template" in (self.chat_template_kwargs or {}):
            raise APIError(
                "chat_template_kwargs: a chat template from the request is not accepted",
                param="chat_template_kwargs",
            )
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )

    @property
    def special_tokens_wanted(self) -> bool:
        return bool(self.add_special_tokens)  # vLLM's default for chat: the template's only

    def template_kwargs(self) -> dict[str, Any]:
        """The extra arguments the chat template sees: `documents`, `reasoning_effort` (and
        `enable_thinking` from it unless the kwargs say), then `chat_template_kwargs`, as vLLM
        gives them."""
        extra = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            extra["documents"] = self.documents
        if self.reasoning_effort is not None:
            extra["reasoning_effort"] = self.reasoning_effort
            extra.setdefault("enable_thinking", self.reasoning_effort != "none")
        return extra

    def structured_output(self) -> StructuredOutput | None:
        """A `required` or named `tool_choice` holds the reply to its calls' JSON, as vLLM does
        (`tool_choice_json_schema`); otherwise what the structured-output fields ask."""
        schema = tool_choice_json_schema(self.tools, self.tool_choice)
        if schema is None:
            return super().structured_output()
        return StructuredOutput.json_schema(schema)

    @property
    def generations_per_prompt(self) -> int:
        return self.choices_per_prompt

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_logprobs_shown(self) -> int | None:
        """vLLM's `prompt_logprobs`: as asked, else with `echo` top_logprobs' count (vLLM's);
        never for a streamed echo, whose chunks carry none (so none are computed)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.top_logprobs or 0) if self.echo and not self.stream else None


class TokenizeBody(LenientModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the template, with
    vLLM's fields. `add_special_tokens` (the tokenizer's own, e.g. BOS) defaults as in vLLM:
    on for a prompt, off for messages (the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    # the chat form's
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """What the fields' types cannot say: `APIError` naming the field at fault."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        if self.messages is None:
            for name in ("add_generation_prompt", "chat_template_kwargs", "tools"):
                if getattr(self, name) is not None:
                    raise APIError(f"{name} is for messages, not prompt", param=name)
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )

    @property
    def special_tokens_wanted(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None


class DetokenizeBody(LenientModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ---- prompts ----------------------------------------------------------------------------------


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion body: each a text or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def template_messages(messages: Sequence[ChatMessage], template: ChatTemplate | None) -> list[dict]:
    """Messages as the plain dicts a chat template reads: text content (text parts joined), and
    `name`, `tool_calls`, `tool_call_id` where given. A `developer` message is a `system` one
    unless the template names the developer role (OpenAI treats them alike for models that
    predate it)."""
    names_developer = template is not None and any(
        "developer" in source for source in template.templates.values()
    )
    developer = "developer" if names_developer else "system"
    plain = []
    for index, message in enumerate(messages):
        entry = {
            "role": developer if message.role == "developer" else message.role,
            "content": message_text(message.content, index),
        }
        for key in ("name", "tool_call_id"):
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        if message.tool_calls is not None:
            entry["tool_calls"] = template_tool_calls(message.tool_calls)
        plain.append(entry)
    return plain


def message_text(content: str | list[dict] | None, index: int) -> str:
    """Message `index`'s content as text: its text parts joined (other parts: APIError)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(
                f"messages[{index}]: content part of type {kind!r} is not supported "
                "(only text parts)",
                param="messages",
            )
        texts.append(part["text"])
    return "".join(texts)


# ---- responses --------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The usage object; `cached_tokens`: the prompt tokens read from the prefix cache
    (`prompt_tokens_details`, as OpenAI and vLLM report it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(ident: str, model: str, kind: str, choices: list[dict]) -> dict:
    """The object around choices: id, object type, creation time, model."""
    return {
        "id": ident,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Any],
    top: int,
    token_text: Callable[[int], str],
    offset: int = 0,
) -> dict:
    """The legacy completions `logprobs` object of `token_ids`: each token's text, logprob, its
    `top` best alternatives (with the chosen token, as vLLM reports) and where it starts in the
    choice's text. An entry None (the first prompt token) has no logprob."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_finite(entry.token_logprob))
        best = {token_text(t): _finite(lp) for t, lp in entry.top[:top]}
        best.setdefault(text, _finite(entry.token_logprob))
        tops.append(best)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs_list(
    prompt: Sequence[int], entries: Sequence[Any] | None, token_text: Callable[[int], str]
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) a map from token id to
    its logprob, rank and text: the prompt's own token first, then the best alternatives."""
    entries = list(entries or [])
    entries += [None] * (len(prompt) - len(entries))

    def one(token: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token)}

    out: list[dict | None] = []
    for token, entry in zip(prompt, entries):
        if entry is None:
            out.append(None)
            continue
        found = {str(token): one(token, entry.token_logprob, entry.rank)}
        for rank, (other, logprob) in enumerate(entry.top, 1):
            found[str(other)] = one(other, logprob, rank)
        out.append(found)
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Any], top: int, token_text: Callable[[int], str]
) -> dict:
    """The chat `logprobs` object: per token its text, logprob, UTF-8 bytes and `top` best
    alternatives."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = [
        {
            **one(token, entry.token_logprob),
            "top_logprobs": [one(t, lp) for t, lp in entry.top[:top]],
        }
        for token, entry in zip(token_ids, entries)
    ]
    return {"content": content}
