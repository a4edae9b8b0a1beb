"""Every request field of vLLM's chat and completion bodies, and what `pipe serve` does with it.

Read from vLLM's `ChatCompletionRequest` (vllm/entrypoints/openai/chat_completion/protocol.py)
and `CompletionRequest` (vllm/entrypoints/openai/completion/protocol.py) at commit
`VLLM_COMMIT`, plus the fields pipe's bodies take that vLLM's no longer list (OpenAI's
`best_of`, vLLM's older `guided_*`).

Each field is one of:
- `served`: a field of pipe's body, honoured as vLLM honours it;
- `refused`: a value other than vLLM's default is a 400 naming the field (a client sending the
  default, as many do, is served as it would be without it);
- `ignored`: accepted and dropped, only where the field cannot change the answer's tokens or
  text (`user`, a routing hint); each says why.

The lenient body (`pipeline.serve.http.lenient`) consults this table for every field a body does
not declare: nothing of vLLM's is dropped without a line here saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

VLLM_COMMIT = "002032ee2b18e1f7bd924ec47b62504ba3866063"
Status = Literal["served", "refused", "ignored"]
CHAT, COMPLETION = "chat", "completion"
_UNSET = object()


@dataclass(frozen=True)
class FieldRule:
    """What pipe does with one field: its `status`, a one-line `reason`, vLLM's `default` (a
    refused field sent with it, or null, is accepted) and, for a refused or ignored one, an
    `example` value other than the default (the tests send it: refused, or no change)."""

    status: Status
    reason: str
    default: Any = None
    example: Any = _UNSET

    def is_default(self, value: Any) -> bool:
        """Whether `value` asks for nothing beyond vLLM's default: null always; for a field
        whose default is null, also false and an empty list, map or text (but not 0, which may
        be a count)."""
        if value is None or value == self.default:
            return True
        return self.default is None and (value is False or value in ([], {}, ""))


def _served(reason: str) -> FieldRule:
    return FieldRule("served", reason)


def _ignored(reason: str, default: Any, example: Any) -> FieldRule:
    return FieldRule("ignored", reason, default, example)


def _refused(reason: str, default: Any, example: Any) -> FieldRule:
    return FieldRule("refused", reason, default, example)


_BOTH: dict[str, FieldRule] = {
    "model": _served("the served model or a loaded LoRA adapter; 404 otherwise"),
    "frequency_penalty": _served("OpenAI's count penalty"),
    "presence_penalty": _served("OpenAI's presence penalty"),
    "logit_bias": _served("added to the logits before the choice"),
    "logprobs": _served("the chosen tokens' log-probabilities"),
    "max_tokens": _served("the generated tokens' bound"),
    "n": _served("choices per prompt, each with its own seed"),
    "seed": _served("the request's own generator"),
    "stop": _served("stop strings, found in the text"),
    "stream": _served("server-sent events"),
    "stream_options": _served("include_usage and continuous_usage_stats"),
    "temperature": _served("sampling temperature"),
    "top_p": _served("nucleus sampling"),
    "top_k": _served("top-k sampling (0 or -1: off)"),
    "min_p": _served("tokens below min_p x the best token's probability are dropped"),
    "repetition_penalty": _served("transformers' repetition penalty over prompt and output"),
    "stop_token_ids": _served("token ids that end the request"),
    "ignore_eos": _served("generate past the end-of-sequence token"),
    "min_tokens": _served("the stop tokens are masked until this many tokens are generated"),
    "include_stop_str_in_output": _served("the stop string (or stop token's text) kept in text"),
    "skip_special_tokens": _served("special tokens left out of the text (default true)"),
    "spaces_between_special_tokens": _served(
        "pipe's detokeniser adds no spaces between special tokens; false is refused unless "
        "skip_special_tokens leaves them out (then it changes nothing, as in vLLM)"
    ),
    "truncate_prompt_tokens": _served("the prompt cut to its last k tokens (-1: the context)"),
    "truncation_side": _served("left (default) keeps the last tokens, right the first"),
    "allowed_token_ids": _served("every other token is masked"),
    "bad_words": _served("the last token of a bad word is masked after the rest of it"),
    "response_format": _served("structured output (text, json_object, json_schema)"),
    "structured_outputs": _served("vLLM's structured-output parameters"),
    "add_special_tokens": _served("the tokenizer's own special tokens (e.g. BOS) added"),
    "request_id": _served("the response's id carries it, as vLLM's does"),
    "user": _ignored("OpenAI's end-user id, for abuse monitoring: no effect", None, "u"),
    "session_id": _ignored("a routing hint for related requests: no effect", None, "s"),
    "priority": _ignored(
        "pipe's scheduler is first come first served, as vLLM's default one, which accepts and "
        "ignores it too",
        0,
        5,
    ),
    "use_beam_search": _served("n beams searched as vLLM's server does (not streamed)"),
    "length_penalty": _served("beam search's ranking: summed logprob / length ** penalty"),
    "watermarking": _refused("no watermarking logits processor", None, True),
    "prompt_logprobs": _served("each prompt token's logprob, rank and alternatives (unstreamed)"),
    "logprob_token_ids": _refused("logprobs of chosen ids are not served", None, [1]),
    "return_tokens_as_token_ids": _served("logprobs name each token `token_id:N`"),
    "routed_experts_prompt_start": _ignored(
        "only trims routed-expert data, which pipe never returns", 0, 3
    ),
    "return_token_offsets": _ignored(
        "read only by vLLM's render endpoints; ignored by generation in vLLM too", False, True
    ),
    "return_mm_kwargs": _ignored(
        "read only by vLLM's render endpoints; ignored by generation in vLLM too", True, False
    ),
    "cache_salt": _served("prefix-cache blocks shared only among requests of the same salt"),
    "kv_transfer_params": _refused("no disaggregated prefill", None, {"a": 1}),
    "ec_transfer_params": _refused("no encoder-cache transfer", None, {"a": 1}),
    "vllm_xargs": _refused("no custom extensions read them", None, {"a": 1}),
    "repetition_detection": _refused(
        "no n-gram repetition detector to end generation early", None, {"max_pattern_size": 4}
    ),
    "thinking_token_budget": _refused(
        "no limit on thinking tokens (the reasoning parser splits the reply only)", None, 16
    ),
    "stream_interval": _ignored(
        "how many tokens a streamed chunk groups: the text and tokens are the same", None, 4
    ),
    # pipe's, no longer in vLLM's body: OpenAI's best_of, vLLM's older structured fields
    "guided_json": _served("vLLM's older structured-output field"),
    "guided_regex": _served("vLLM's older structured-output field"),
    "guided_choice": _served("vLLM's older structured-output field"),
    "guided_grammar": _served("vLLM's older structured-output field"),
}

_CHAT_ONLY: dict[str, FieldRule] = {
    "messages": _served("rendered by the model's chat template"),
    "top_logprobs": _served("alternatives per token with logprobs"),
    "max_completion_tokens": _served("OpenAI's name for max_tokens"),
    "tools": _served("given to the chat template; calls parsed from the reply"),
    "tool_choice": _served("none, auto, required or a named function"),
    "parallel_tool_calls": _served("OpenAI's field, read by the tool-call parser"),
    "add_generation_prompt": _served("given to the chat template"),
    "continue_final_message": _served("the prompt ends inside the last message"),
    "documents": _served("given to the chat template"),
    "chat_template_kwargs": _served("given to the chat template (e.g. enable_thinking)"),
    "chat_template": _refused(
        "a template from the request is code from the client; vLLM refuses it unless started "
        "with --trust-request-chat-template",
        None,
        "{{ messages }}",
    ),
    "reasoning_effort": _served(
        "given to the chat template, with enable_thinking (false for none) unless the kwargs say"
    ),
    "include_reasoning": _served(
        "false leaves out the reasoning (and its logprobs and token ids) with --reasoning-parser"
    ),
    "echo": _served("the last message's text before the reply's, when their roles match"),
    "return_token_ids": _served("the prompt's and each choice's token ids"),
    "return_prompt_text": _served("the prompt as the chat template rendered it"),
    "media_io_kwargs": _refused("pipe serves text only", None, {"image": {"a": 1}}),
    "mm_processor_kwargs": _refused("pipe serves text only", None, {"a": 1}),
}

_COMPLETION_ONLY: dict[str, FieldRule] = {
    "prompt": _served("text, texts, token ids or lists of them"),
    "echo": _served("the prompt written before the completion"),
    "best_of": _served("OpenAI's: best_of generations, the n most likely kept"),
    "return_token_ids": _served("each choice's prompt and generated token ids"),
    "suffix": _refused("no fill-in-the-middle (vLLM refuses it too)", None, "end"),
    "prompt_embeds": _refused("prompts are text or token ids only", None, "AAAA"),
}

FIELDS: dict[str, dict[str, FieldRule]] = {
    CHAT: {**_BOTH, **_CHAT_ONLY},
    COMPLETION: {**_BOTH, **_COMPLETION_ONLY},
}


def rule(body: str, name: str) -> FieldRule | None:
    """What `body` ("chat" or "completion") does with field `name` (None: not vLLM's)."""
    return FIELDS[body].get(name)


def fields_with(body: str, status: Status) -> list[str]:
    """The names of `body`'s fields with `status`, sorted."""
    return sorted(name for name, each in FIELDS[body].items() if each.status == status)


def markdown_table() -> str:
    """The inventory as the table docs/serve.md shows (its "Request fields" section is checked
    against this by a test): one row per field, the bodies that take it, status and reason."""
    names = sorted(set(FIELDS[CHAT]) | set(FIELDS[COMPLETION]))
    rows = ["| field | chat | completions | why |", "| --- | --- | --- | --- |"]
    for name in names:
        chat, completion = rule(CHAT, name), rule(COMPLETION, name)
        reasons = [r.reason for r in (chat, completion) if r is not None]
        why = reasons[0] if len(set(reasons)) == 1 else " / ".join(reasons)
        cells = [each.status if each is not None else "-" for each in (chat, completion)]
        rows.append(f"| `{name}` | {cells[0]} | {cells[1]} | {why} |")
    return "\n".join(rows)
