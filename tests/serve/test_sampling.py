"""Per-request logit adjustments and log-probabilities: the penalty formulas against independent
computations (transformers' `RepetitionPenaltyLogitsProcessor`, counts by hand), logit bias and
penalties steering greedy decoding, log-probabilities against transformers' full forward pass
(prompt ones over a chunked prefill), a request that uses them leaving its batch-mates' tokens
alone, and the validation messages. CPU, fp32, the tiny Llama of `tests.builders`."""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from pipeline.core.model.greedy import first_argmax
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import (
    BadSamplingValue,
    SamplingParams,
    TokenLogprobs,
    adjust_logits,
    choose,
)
from tests.builders import VOCAB, save_hf

transformers = pytest.importorskip("transformers")

PROMPT = [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77]
OTHERS = [[5, 17, 3], [90], [11, 22, 33, 44, 55, 66]]


@dataclass
class Row:
    """A stand-in for a request: what `choose` and `adjust_logits` read."""

    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(pipe model, transformers model) of the same tiny Llama."""
    directory = tmp_path_factory.mktemp("llama")
    _, hf = save_hf("llama", directory)
    return open_generator(directory).model, hf


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `tokens` `[len, vocab]`."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def _events(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    request = engine.add(prompt, params)
    return [event for event in engine.run() if event.request is request]


# ---- the formulas -------------------------------------------------------------------------------


def test_repetition_penalty_equals_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    rows = [
        Row(SamplingParams(repetition_penalty=1.3), [4, 9, 9], [17, 4]),
        Row(SamplingParams(), [1, 2, 3], [5]),  # no penalty: untouched
        Row(SamplingParams(repetition_penalty=0.7), [50], [60, 61, 50]),
    ]
    ours = adjust_logits(logits.clone(), rows)
    for i, row in enumerate(rows):
        oracle = transformers.RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)
        ids = torch.tensor([row.prompt + row.output])
        torch.testing.assert_close(ours[i : i + 1], oracle(ids, logits[i : i + 1].clone()))
    assert torch.equal(ours[1], logits[1])


def test_presence_and_frequency_penalties_from_output_counts() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    rows = [
        Row(SamplingParams(frequency_penalty=0.5, presence_penalty=1.5), [7, 8], [3, 3, 5, 3]),
        Row(SamplingParams(frequency_penalty=-0.25), [3], [9, 9]),
    ]
    ours = adjust_logits(logits.clone(), rows)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token, count in Counter(row.output).items():  # the prompt's tokens do not count
            params = row.params
            expected[i, token] -= params.frequency_penalty * count + params.presence_penalty
    torch.testing.assert_close(ours, expected)


def test_bias_comes_before_the_penalties_and_plain_rows_are_untouched() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [2.0, -1.0, 0.5, 0.0]])
    rows = [
        Row(SamplingParams(greedy=True, logit_bias={0: -4.0}, repetition_penalty=2.0), [0, 1]),
        Row(SamplingParams(greedy=True), [0, 1]),
    ]
    plain = logits[1].clone()
    assert [token for token, _ in choose(logits, rows)] == [2, 0]
    assert logits[0].tolist() == [-4.0, -2.0, 0.5, 0.0]  # (2 - 4) x 2, -1 x 2
    assert torch.equal(logits[1], plain)


# ---- steering greedy decoding -------------------------------------------------------------------


def test_a_large_frequency_penalty_stops_greedy_repeats(llama) -> None:
    model, _ = llama
    plain = SamplingParams(max_new_tokens=16, greedy=True)
    penalized = SamplingParams(max_new_tokens=16, greedy=True, frequency_penalty=2.0)
    before = Engine(model).generate([PROMPT], plain)[0].output
    after = Engine(model).generate([PROMPT], penalized)[0].output
    assert any(a == b for a, b in zip(before, before[1:]))  # the tiny model does repeat itself
    assert not any(a == b for a, b in zip(after, after[1:]))
    assert after[0] == before[0]  # nothing generated yet: nothing penalised


def test_logit_bias_forces_or_forbids_a_token(llama) -> None:
    model, _ = llama
    plain = Engine(model).generate([PROMPT], SamplingParams(max_new_tokens=8, greedy=True))
    favourite = plain[0].output[0]
    forced = SamplingParams(max_new_tokens=8, greedy=True, logit_bias={13: 100})
    assert Engine(model).generate([PROMPT], forced)[0].output == [13] * 8
    banned = SamplingParams(max_new_tokens=8, greedy=True, logit_bias={favourite: -100})
    assert favourite not in Engine(model).generate([PROMPT], banned)[0].output


# ---- log-probabilities --------------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_the_models_raw_log_softmax(llama, greedy) -> None:
    """The chosen token's and the top alternatives' log-probabilities are transformers' own,
    before temperature and penalties (vLLM's default)."""
    model, hf = llama
    params = SamplingParams(
        max_new_tokens=6,
        greedy=greedy,
        temperature=1.7,
        seed=3,
        logprobs=5,
        presence_penalty=0.5,
    )
    events = _events(Engine(model), PROMPT, params)
    output = [event.token for event in events]
    oracle = _hf_logprobs(hf, PROMPT + output)[len(PROMPT) - 1 : -1]
    for event, expected in zip(events, oracle):
        assert isinstance(event.logprobs, TokenLogprobs)
        assert event.logprobs.token_logprob == pytest.approx(float(expected[event.token]), abs=1e-4)
        top_ids = [token for token, _ in event.logprobs.top]
        top_values = [value for _, value in event.logprobs.top]
        assert top_values == sorted(top_values, reverse=True) and len(top_ids) == 5
        assert top_ids == expected.topk(5).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(top_values), expected.topk(5).values, atol=1e-4, rtol=0
        )
        assert event.prompt_logprobs is None
    if greedy:  # the penalty moved no greedy choice away from the top of the raw distribution
        assert all(event.token in [t for t, _ in event.logprobs.top] for event in events)


def test_zero_logprobs_gives_the_chosen_token_only(llama) -> None:
    model, _ = llama
    params = SamplingParams(max_new_tokens=2, greedy=True, logprobs=0)
    events = _events(Engine(model), PROMPT, params)
    assert all(event.logprobs.top == () for event in events)
    assert all(event.logprobs.token_logprob <= 0 for event in events)


@pytest.mark.parametrize("chunk", [4, 5])  # 11 prompt tokens: 4 + 4 + 3, or 5 + 5 + 1
def test_prompt_logprobs_over_a_chunked_prefill(llama, chunk) -> None:
    model, hf = llama
    engine = Engine(model, block_size=4, prefill_chunk=chunk)
    params = SamplingParams(max_new_tokens=3, greedy=True, prompt_logprobs=3)
    events = _events(engine, PROMPT, params)
    first = events[0].prompt_logprobs
    assert all(event.prompt_logprobs is None for event in events[1:])
    assert first == tuple(events[0].request.prompt_logprobs)
    assert len(first) == len(PROMPT) and first[0] is None
    oracle = _hf_logprobs(hf, PROMPT)
    for position in range(1, len(PROMPT)):
        found, expected = first[position], oracle[position - 1]
        assert found.token_logprob == pytest.approx(float(expected[PROMPT[position]]), abs=1e-4)
        assert [token for token, _ in found.top] == expected.topk(3).indices.tolist()


# ---- batch independence -------------------------------------------------------------------------


def test_a_request_with_extras_and_plain_requests_do_not_affect_each_other(llama) -> None:
    model, _ = llama
    special = SamplingParams(
        max_new_tokens=10,
        temperature=0.9,
        seed=5,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={7: 3.0, 50: -5.0},
        logprobs=4,
        prompt_logprobs=2,
    )
    plain = [
        SamplingParams(max_new_tokens=12, greedy=True),
        SamplingParams(max_new_tokens=8, temperature=1.1, top_p=0.8, seed=9),
        SamplingParams(max_new_tokens=12, greedy=True),
    ]

    def batched(with_special: bool) -> list[list]:
        engine = Engine(model, max_batch=4, block_size=4, prefill_chunk=5)
        requests = [engine.add(p, s) for p, s in zip(OTHERS, plain)]
        if with_special:
            requests.append(engine.add(PROMPT, special))
        events = list(engine.run())
        return [[e for e in events if e.request is r] for r in requests]

    alone = _events(Engine(model, max_batch=1), PROMPT, special)
    plain_alone = [Engine(model).generate([p], s)[0].output for p, s in zip(OTHERS, plain)]
    together = batched(with_special=True)
    assert [[e.token for e in events] for events in together[:3]] == plain_alone
    assert [[e.token for e in events] for events in batched(with_special=False)] == plain_alone
    mixed = together[3]
    assert [e.token for e in mixed] == [e.token for e in alone]
    for ours, theirs in zip(mixed, alone):
        assert ours.logprobs.token_logprob == pytest.approx(theirs.logprobs.token_logprob, abs=1e-5)
        assert [t for t, _ in ours.logprobs.top] == [t for t, _ in theirs.logprobs.top]
    assert all(e.logprobs is None for events in together[:3] for e in events)
    assert len(mixed[0].prompt_logprobs) == len(PROMPT)


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\], not 2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in \\[-2, 2\\], not -3.0"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, not 0.0"),
        ({"logit_bias": {5: 101}}, "logit_bias of token 5 must be in \\[-100, 100\\], not 101"),
        ({"logit_bias": {-1: 1}}, "logit_bias token ids must be distinct and >= 0, not -1"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "must be distinct and >= 0, not 3"),
        (
            {"logit_bias": {"5": 1}},
            "logit_bias maps integer token ids to numbers, not \\('5', 1\\)",
        ),
        ({"logit_bias": {5: "much"}}, "logit_bias maps integer token ids to numbers"),
        ({"logit_bias": (5,)}, "logit_bias maps integer token ids to numbers, not 5"),
        ({"logprobs": 21}, "logprobs must be None or an integer in \\[0, 20\\], not 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be None or an integer in \\[0, 20\\]"),
        ({"logprobs": True}, "logprobs must be None or an integer"),
    ],
)
def test_out_of_range_values_are_named(values, message) -> None:
    with pytest.raises(BadSamplingValue, match=message):
        SamplingParams(**values)


def test_logit_bias_outside_the_vocabulary_is_refused_at_add(llama) -> None:
    model, _ = llama
    engine = Engine(model)
    with pytest.raises(BadSamplingValue, match=f"token {VOCAB}, outside the vocabulary of {VOCAB}"):
        engine.add(PROMPT, SamplingParams(logit_bias={VOCAB: 1.0}))
    assert not engine.busy


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("allowed_token_ids", {"allowed_token_ids": (3, VOCAB)}),
        ("bad_words", {"bad_words": ((3, VOCAB),)}),
        ("stop_token_ids", {"min_tokens": 2, "stop_token_ids": (VOCAB,)}),
    ],
)
def test_token_constraints_outside_the_vocabulary_are_refused_at_add(llama, field, values) -> None:
    """A direct caller of the engine (rollouts, generate) gets the refusal at `add`, not a
    failed step: the stop tokens only when `min_tokens` masks them."""
    model, _ = llama
    engine = Engine(model)
    with pytest.raises(BadSamplingValue, match=f"{field} names token {VOCAB}"):
        engine.add(PROMPT, SamplingParams(**values))
    assert not engine.busy
    engine.add(PROMPT, SamplingParams(max_new_tokens=1, stop_token_ids=(VOCAB,)))


def test_params_and_logprobs_are_plain_picklable_data() -> None:
    params = SamplingParams(logit_bias={3: 1, 1: -2.5}, logprobs=2, prompt_logprobs=0)
    assert params.logit_bias == ((3, 1.0), (1, -2.5))
    assert pickle.loads(pickle.dumps(params)) == params
    logprobs = TokenLogprobs(-0.5, ((3, -0.5), (1, -1.5)))
    assert pickle.loads(pickle.dumps(logprobs)) == logprobs


@pytest.mark.parametrize("vocab", [32000, 96, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_is_argmax(vocab, dtype) -> None:
    """The blocked argmax (vocabularies of whole blocks: 32,000 and 96; 100 falls back) picks
    argmax's entry: the first on ties, within and across blocks, the first NaN, entry 0 of a
    row of -inf (a structured-output mask), one row or many."""
    torch.manual_seed(0)
    logits = torch.randn(9, vocab).to(dtype)
    logits[1, [3, vocab - 1]] = 50.0  # a tie across blocks
    logits[2, [vocab // 2, vocab // 2 + 1]] = 50.0  # a tie within a block
    logits[3, [7, vocab - 5]] = float("nan")
    logits[4] = float("-inf")
    logits[5, vocab - 1] = 50.0  # the last entry
    logits[6] = 1.0  # all equal
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    for row in logits:
        assert torch.equal(first_argmax(row), row.argmax(-1))
    assert torch.equal(first_argmax(logits[::2]), logits[::2].argmax(-1))  # strided rows
