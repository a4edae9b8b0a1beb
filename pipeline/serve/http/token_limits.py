"""A request whose prompt plus the tokens it asks for cannot fit, refused before it reaches the
engine with the API's own field names (`max_tokens`, `max_completion_tokens`, `messages`,
`prompt`), as vLLM words it; the engine's own check speaks of `max_new_tokens`."""

from __future__ import annotations

from pipeline.serve.http.openai_api import APIError


def check_token_limit(body, prompt_tokens: int, token_budget: int) -> None:
    """An `APIError` naming the field at fault when `prompt_tokens` plus the body's max tokens
    exceed `token_budget` (the context, or the KV cache when that is smaller)."""
    prompt_param = "messages" if hasattr(body, "messages") else "prompt"
    if prompt_tokens >= token_budget:
        raise APIError(
            f"This model's maximum context length is {token_budget} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
            f"{prompt_param}.",
            param=prompt_param,
        )
    wanted = body.requested_tokens()
    if wanted is None or getattr(body, "echo_only", False):
        return
    if prompt_tokens + wanted > token_budget:
        field = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else ("max_tokens")
        )
        raise APIError(
            f"'{field}' is too large: {wanted}. This model's maximum context length is "
            f"{token_budget} tokens and your request has {prompt_tokens} input tokens "
            f"({wanted} > {token_budget} - {prompt_tokens}).",
            param=field,
        )
