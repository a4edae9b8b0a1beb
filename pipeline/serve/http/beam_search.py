"""Beam search (`use_beam_search: true`) as vLLM's server runs it, over the engine's one-token
requests.

Each step asks the engine for one token of every live beam with the 2 x width most likely
next tokens and their log-probabilities (the model's own, before temperature); every
(beam, token) pair is a candidate scored by the beam's summed log-probability plus the token's.
A candidate ending in an end-of-sequence token (unless `ignore_eos`) is a finished beam; the
best `width` of the others go on. After `max_tokens` steps (or when no beam goes on) the
finished and live beams are ranked by summed log-probability over length ** `length_penalty`,
the length counting the prompt, as vLLM counts it, and the best `width` are the choices, best
first. The width is the request's `n`; its sampling fields other than `temperature` take no part,
as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.serve.engine.sampling import SamplingParams


@dataclass
class Beam:
    """A sequence being searched: prompt and generated ids, their summed log-probability."""

    tokens: list[int]
    logprob: float = 0.0
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)

    def score(self, eos_ids: frozenset[int], length_penalty: float) -> float:
        length = len(self.tokens) - (1 if self.tokens[-1] in eos_ids else 0)
        return self.logprob / (max(length, 1) ** length_penalty)


async def _next_tokens(submit: Callable, beam: Beam, params: SamplingParams) -> list:
    """(token, log-probability) candidates after `beam`: the engine's top 2 x width and the
    token it chose."""
    (stream,) = submit(beam.tokens, [params])
    ids, entries = [], []
    async for delta in stream:
        ids += delta.token_ids
        entries += delta.logprobs
    if not entries:
        return []
    entry = entries[0]
    candidates = dict(entry.top)
    candidates.setdefault(ids[0], entry.token_logprob)
    return list(candidates.items())


async def beam_search(
    submit: Callable,
    prompt: list[int],
    width: int,
    max_tokens: int,
    *,
    temperature: float,
    eos_ids: frozenset[int],
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
    include_eos: bool = False,
) -> list[Beam]:
    """The `width` best beams after `prompt` (module docstring). `submit(prompt, [params])` is
    the engine's, as the routes submit."""
    import asyncio

    params = SamplingParams(max_new_tokens=1, temperature=temperature, logprobs=2 * width)
    live, finished = [Beam(list(prompt))], []
    for _ in range(max_tokens):
        found = await asyncio.gather(*(_next_tokens(submit, beam, params) for beam in live))
        candidates = []
        for beam, options in zip(live, found):
            for token, logprob in options:
                total = beam.logprob + logprob
                if token in eos_ids and not ignore_eos:
                    tail = [token] if include_eos else []
                    ended = Beam(beam.tokens + tail, total, "stop", beam.generated + tail)
                    finished.append(ended)
                else:
                    candidates.append(
                        Beam(beam.tokens + [token], total, None, beam.generated + [token])
                    )
        candidates.sort(key=lambda b: b.logprob, reverse=True)
        live = candidates[:width]
        if not live:
            break
    ranked = sorted(finished + live, key=lambda b: b.score(eos_ids, length_penalty), reverse=True)
    for beam in ranked:
        beam.finish_reason = beam.finish_reason or "length"
    return ranked[:width]
