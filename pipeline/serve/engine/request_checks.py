"""Why a request can never run on an engine, found before it is queued.

`fit_problem` is the size rule (the engine client applies it too, before a request reaches the
engine process); `check_request` adds what only the engine knows: its model's vocabulary and
whether it has a structured-output backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.sampling import BadSamplingValue, SamplingParams

if TYPE_CHECKING:
    from pipeline.serve.engine.structured_output import GrammarBackend


class PromptTooLong(ValueError):
    """A request that can never fit the model's context or the cache (the message says why)."""


def fit_problem(
    prompt_tokens: int, max_new_tokens: int, max_context: int, block_size: int, num_blocks: int
) -> str | None:
    """Why a request can never run on an engine of these limits, or None if it can."""
    if prompt_tokens == 0:
        return "the prompt is empty (no tokens)"
    total = prompt_tokens + max_new_tokens
    if total > max_context:
        return (
            f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} "
            f"exceeds the model's context of {max_context} tokens"
        )
    if -(-total // block_size) > num_blocks:
        return f"{total} tokens do not fit the KV cache's {num_blocks * block_size} slots"
    return None


def check_request(
    prompt: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_context: int,
    cache: BlockKVCache,
    grammars: GrammarBackend | None,
) -> None:
    """Raise why `params` on `prompt` can never run: `BadSamplingValue` for a token id outside
    the vocabulary (a logit bias, allowed ids, bad words, the stop tokens `min_tokens` masks) or
    a structured output the engine cannot serve, `PromptTooLong` for a request that fits
    neither the context nor the cache."""
    named = {
        "logit_bias": [token for token, _ in params.logit_bias],
        "allowed_token_ids": params.allowed_token_ids or (),
        "bad_words": [token for word in params.bad_words for token in word],
        "stop_token_ids": params.stop_token_ids if params.min_tokens else (),
    }
    for field, tokens in named.items():
        outside = [token for token in tokens if token >= vocab_size]
        if outside:
            raise BadSamplingValue(
                f"{field} names token {outside[0]}, outside the vocabulary of {vocab_size} tokens"
            )
    if params.structured_output is not None:
        if grammars is None:
            raise BadSamplingValue("structured output needs a tokenizer.json beside the model")
        grammars.check(params.structured_output)
    problem = fit_problem(
        len(prompt), params.max_new_tokens, max_context, cache.block_size, cache.num_blocks
    )
    if problem is not None:
        raise PromptTooLong(problem)
