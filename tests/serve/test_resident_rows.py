"""Decode steps over resident rows (`pipeline.serve.engine.resident_rows`, the CPU default) give
the tokens of steps that gather each row's history from the blocks, for every family, and the
rows hold exactly the blocks' entries while requests come and go."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch

from pipeline.core.kernels import cpu_decode_attention
from pipeline.serve.engine import resident_rows
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from tests.core.test_cpu_decode_attention import torch_threads
from tests.serve.test_generation import FAMILIES, PROMPTS, _hf_family
from tests.serve.test_static_decode import SETTINGS, _outputs, _same

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    _hf_family(request.param, directory)
    return open_generator(directory).model


def _churn(engine: Engine) -> list:
    """Four requests with their own settings, and a fifth queued behind them, on a batch of 3:
    rows leave, later ones fill their places, and lengths differ row to row."""
    requests = [engine.add(p, s) for p, s in zip(PROMPTS, SETTINGS)]
    return requests + [engine.add(PROMPTS[1][:5], SamplingParams(max_new_tokens=7, greedy=True))]


def _resident_and_gathered(model, run, **kwargs) -> tuple[Engine, int]:
    """`run` on an engine over resident rows and on one that gathers; the two agree (tokens,
    and log-probabilities to float32 rounding: rows sit at other places in the batch)."""
    results = []
    for resident in (True, False):
        engine = Engine(model, resident_decode=resident, **kwargs)
        assert (engine.resident is not None) == resident
        results.append((engine, _outputs(engine, run(engine))))
    (engine, mine), (_, theirs) = results
    return engine, _same(mine, theirs)


def test_every_family_decodes_as_the_gathering_step(family_model) -> None:
    engine, compared = _resident_and_gathered(
        family_model, _churn, max_batch=3, block_size=4, prefill_chunk=5
    )
    assert compared >= 12 + 11  # every token of the two rows that ask
    assert engine.resident.steps > 10 and engine.resident.fills >= 5


def test_every_family_decodes_with_pipes_kernel_as_with_torchs_attention(family_model) -> None:
    """The decode rows' attention in pipe's C kernel (the CPU default for float32 models on one
    thread) and in torch's SDPA give the same tokens, and log-probabilities to float32
    rounding; the kernel ran in the first engine only."""
    kernel = cpu_decode_attention.decode_attention
    outputs, calls, steps = [], [], []
    for torch_attention in (False, True):
        switch = mock.patch.object(cpu_decode_attention, "serves", return_value=False)
        with (
            switch if torch_attention else nullcontext(),
            mock.patch.object(cpu_decode_attention, "decode_attention", wraps=kernel) as called,
            torch_threads(1),
        ):
            engine = Engine(family_model, max_batch=3, block_size=4, prefill_chunk=5)
            outputs.append(_outputs(engine, _churn(engine)))
        calls.append(called.call_count)
        steps.append(engine.resident.steps)
    assert _same(*outputs) >= 12 + 11
    assert calls[0] >= steps[0] > 10 and calls[1] == 0, (calls, steps)


def test_rows_hold_the_blocks_entries_as_requests_come_and_go(tiny_hf_dir) -> None:
    """After every step, each row's entries equal the block cache's at the request's slots:
    the moves into holes, the fills from the blocks and the reallocation when a row outgrows
    the first capacity keep rows exact."""
    model = open_generator(tiny_hf_dir).model
    engine = Engine(model, max_batch=3, block_size=4, cache_blocks=512)
    _churn(engine)
    engine.add(PROMPTS[0], SamplingParams(max_new_tokens=300, greedy=True))
    checked = 0
    while engine.busy:
        engine.step()
        resident = engine.resident
        for row, (request, length) in enumerate(zip(resident.requests, resident.lengths)):
            slots = request.slots[:length]
            for kinds, pools in zip(resident.buffers, engine.cache.pools):
                for buffer, pool in zip(kinds, pools):
                    assert torch.equal(resident.by_position(buffer)[row, :length], pool[slots])
            checked += 1
    assert checked > 280 and resident.moves > 0 and resident.capacity > 256 and resident.by_head


def test_groups_prefix_cache_and_a_row_longer_than_the_first_capacity(tiny_hf_dir) -> None:
    """Groups (packed steps between resident ones leave rows out of date: they are filled
    again), the prefix cache's blocks, and a request that outgrows the rows' first capacity
    (the rows are reallocated, head by head from then on, keeping what they hold)."""
    model = open_generator(tiny_hf_dir).model
    prompt = list(range(3, 22))
    seeded = [SamplingParams(max_new_tokens=8, temperature=1.1, seed=s) for s in range(3)]
    long = SamplingParams(max_new_tokens=300, temperature=0.9, seed=5, logprobs=1)

    def run(engine):
        first = engine.add_group(prompt, seeded)
        first += [engine.add(prompt[:9], long), engine.add(PROMPTS[1], SETTINGS[1])]
        return first + engine.add_group(prompt[:9], SETTINGS[2:])

    engine, compared = _resident_and_gathered(
        model, run, max_batch=8, block_size=4, cache_blocks=512
    )
    assert compared > 300 and engine.resident.capacity > 256 and engine.prompt_tokens_cached
    assert engine.resident.by_head


def test_rows_kept_head_by_head_give_the_same_bits(tiny_hf_dir, monkeypatch) -> None:
    """Past `BY_HEAD_CAPACITY` positions the rows keep keys and values head by head; attention
    reads the same numbers laid out otherwise, so tokens and log-probabilities are bit for bit
    those of rows kept position by position."""
    model = open_generator(tiny_hf_dir).model

    def run(engine):
        long = SamplingParams(max_new_tokens=300, temperature=0.8, seed=3, logprobs=2)
        greedy = SamplingParams(max_new_tokens=280, greedy=True, logprobs=1)
        return [engine.add(PROMPTS[0], long), engine.add(PROMPTS[1], greedy)]

    by_head = Engine(model, max_batch=3, block_size=4, cache_blocks=512)
    kept_by_head = _outputs(by_head, run(by_head))
    monkeypatch.setattr(resident_rows, "BY_HEAD_CAPACITY", 1 << 62)
    by_position = Engine(model, max_batch=3, block_size=4, cache_blocks=512)
    kept_by_position = _outputs(by_position, run(by_position))
    assert by_head.resident.by_head and by_head.resident.capacity > 256
    assert not by_position.resident.by_head and by_position.resident.capacity > 256
    assert kept_by_head == kept_by_position
    assert sum(len(tokens) for tokens, _, _ in kept_by_head) == 580


def test_every_family_gives_the_same_bits_head_by_head(family_model, monkeypatch) -> None:
    """Rows kept head by head from the start (the threshold lowered to 0) against rows kept
    position by position: the same tokens and log-probabilities, bit for bit, for every family
    (latent attention's entries have no heads and keep the one layout)."""
    outputs = []
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(resident_rows, "BY_HEAD_CAPACITY", threshold)
        engine = Engine(family_model, max_batch=3, block_size=4, prefill_chunk=5)
        outputs.append(_outputs(engine, _churn(engine)))
        assert engine.resident.by_head == (threshold == 0) and engine.resident.moves > 0
    assert outputs[0] == outputs[1]


def test_rows_over_the_budget_gather_instead(tiny_hf_dir) -> None:
    """A budget too small for the rows: the steps gather (none runs over resident rows) and
    give the same tokens."""
    model = open_generator(tiny_hf_dir).model
    small = Engine(model, max_batch=3, block_size=4)
    small.resident.budget_bytes = small.cache.slot_bytes * 255  # under one row's step
    requests = _churn(small)
    list(small.run())
    assert small.resident.steps == 0 and small.resident.buffers[0] == []
    plain = Engine(model, max_batch=3, block_size=4, resident_decode=False)
    expected = _churn(plain)
    list(plain.run())
    assert [r.output for r in requests] == [r.output for r in expected]
