"""Beam search (`pipeline.serve.http.beam_search`) on a scripted model whose next-token
log-probabilities depend on the last token: the beams and their ranking worked out by hand from
vLLM's rule. The whole route against vLLM's server is in scripts/bench/vllm_battery.py."""

from __future__ import annotations

import asyncio
import math

import pytest

from pipeline.serve.engine.messages import Delta
from pipeline.serve.engine.sampling import TokenLogprobs
from pipeline.serve.http.beam_search import beam_search

EOS = 2
# last token -> the most likely next tokens, best first (token, logprob)
TABLE = {
    9: ((0, -0.1), (1, -2.0), (EOS, -3.0)),
    0: ((EOS, -0.05), (1, -1.0), (0, -4.0)),
    1: ((0, -0.2), (EOS, -0.3), (1, -5.0)),
}


class Stream:
    def __init__(self, delta: Delta) -> None:
        self.deltas = [delta]

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if not self.deltas:
            raise StopAsyncIteration
        return self.deltas.pop()


def submit(tokens: list[int], params: list) -> list[Stream]:
    (one,) = params
    top = TABLE[tokens[-1]][: one.logprobs]
    chosen, logprob = TABLE[tokens[-1]][0]
    entry = TokenLogprobs(logprob, top)
    return [Stream(Delta([chosen], "", logprobs=[entry], finish_reason="length"))]


def run(width: int, max_tokens: int, **options):
    return asyncio.run(
        beam_search(
            submit,
            [9],
            width,
            max_tokens,
            temperature=0,
            eos_ids=frozenset({EOS}),
            **options,
        )
    )


def test_one_beam_ends_at_the_end_of_sequence() -> None:
    # step 1 keeps 0 (-0.1); step 2: EOS ends [9, 0] at -0.15, [9, 0, 1] goes on at -1.1;
    # ranked by logprob / length (prompt included): -0.15 / 2 beats -1.1 / 3
    (best,) = run(1, 2)
    assert best.generated == [0] and best.finish_reason == "stop"
    assert math.isclose(best.logprob, -0.15)


def test_two_beams_ranked_with_the_length_penalty() -> None:
    beams = run(2, 2)
    # finished: [9,0] -0.15; [9,1,EOS] -2.3; live after step 2: [9,0,1] -1.1, [9,1,0] -2.2
    assert [b.generated for b in beams] == [[0], [0, 1]]
    assert [b.finish_reason for b in beams] == ["stop", "length"]
    # a strong length penalty prefers the longer beam: -1.1 / 3**6 > -0.15 / 2**6
    longer = run(2, 2, length_penalty=6.0)
    assert longer[0].generated == [0, 1]


@pytest.mark.parametrize("include_eos", [False, True])
def test_ignore_eos_and_include_eos(include_eos) -> None:
    (kept,) = run(1, 2, include_eos=include_eos)
    assert kept.generated == ([0, EOS] if include_eos else [0])
    (best,) = run(1, 2, ignore_eos=True)
    assert best.generated == [0, EOS] and best.finish_reason == "length"
