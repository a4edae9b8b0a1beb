"""Choosing the next token: greedy, or temperature / top-k / top-p sampling from a request's own
random generator, so a seed gives the same text whatever else shares the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pipeline.core.model.greedy import greedy_token


class BadSamplingValue(ValueError):
    """A sampling parameter out of range (the message names it)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. temperature 0 (or `greedy`) takes the most likely token;
    top_k 0 and top_p 1 keep every token; `seed` None draws a fresh seed; generation stops after
    `max_new_tokens`, at a token of `stop_token_ids` (EOS) or at any of the `stop` strings."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    greedy: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BadSamplingValue(f"max_new_tokens must be at least 1, not {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadSamplingValue(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise BadSamplingValue(f"top_k must be >= 0 (0: off), not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise BadSamplingValue(f"top_p must be in (0, 1], not {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise BadSamplingValue(f"seed must be in [0, 2**63), not {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's logprob and the best alternatives, (token id, logprob) best first."""

    token_logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s logprob under `logits` `[vocab]` and the `top` most likely tokens."""
    logprobs = logits.float().log_softmax(-1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprobs(float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist())))


def adjust(logits: torch.Tensor, params: SamplingParams, tokens: list[int], output: list[int]):
    """Logits after the penalties (repetition over all tokens, presence and frequency over the
    output) and the logit bias."""
    logits = logits.float().clone()
    if params.repetition_penalty != 1.0 and tokens:
        seen = torch.tensor(sorted(set(tokens)), device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)  # fmt: skip
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=logits.device),
                                minlength=logits.numel()).float()  # fmt: skip
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token, bias in params.logit_bias:
        logits[token] += bias
    return logits


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator (None for greedy): seeded by `params.seed` or freshly."""
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits `[vocab]`."""
    if params.is_greedy:
        return greedy_token(logits)
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        threshold = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, -math.inf)
    if params.top_p < 1:
        ordered, order = logits.sort(descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of better tokens
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = before >= params.top_p  # the best token always stays
        logits = logits.masked_fill(drop, -math.inf)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
