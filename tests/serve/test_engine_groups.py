"""Completions of one prompt sharing its prefill (`Engine.add_group`, GRPO's `num_generations`):
a group gives what separate requests give (greedy against decoding without a cache, sampled
against separate requests with the same seeds), prefills its prompt once, and returns every
block whether it finishes or is aborted; the block cache's references underneath. CPU, fp32."""

from __future__ import annotations

import pytest

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.greedy import greedy_without_cache
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.kv_cache import BlockKVCache
from pipeline.serve.engine.request import Request
from pipeline.serve.engine.request_checks import PromptTooLong
from pipeline.serve.engine.sampling import SamplingParams

pytest.importorskip("transformers")

BLOCK = 4
LONG = [(7 * i + 3) % 90 + 1 for i in range(23)]  # prefilled over several chunks of 4
PROMPTS = [[90], [5, 17, 3], [40, 2, 71, 9], [11, 22, 33, 44, 55], LONG]


def _engine(model, **kwargs) -> Engine:
    return Engine(model, **{"block_size": BLOCK, "prefill_chunk": BLOCK, **kwargs})


def _separately(model, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    """The outputs of `params` as one request each, on an engine of their own."""
    return [_engine(model, max_batch=1).generate([prompt], each)[0].output for each in params]


def _finish(engine: Engine, steps: int = 200) -> None:
    for _ in range(steps):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError(f"the engine still has requests after {steps} steps")


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}_tokens")
def test_a_greedy_group_equals_decoding_without_a_cache(llama, prompt) -> None:
    """Different lengths in one group, the leader finishing first (1 token) while its siblings
    still read its blocks, and another request waiting to reuse whatever is freed."""
    lengths = [1, 9, 4, 7]
    params = [SamplingParams(max_new_tokens=n, greedy=True) for n in lengths]
    engine = _engine(llama, max_batch=3, cache_blocks=16)
    group = engine.add_group(prompt, params)
    after = engine.add(LONG[::-1], SamplingParams(max_new_tokens=5, greedy=True))
    _finish(engine)
    expected = greedy_without_cache(llama, prompt, max(lengths))
    assert [r.output for r in group] == [expected[:n] for n in lengths]
    assert after.output == greedy_without_cache(llama, LONG[::-1], 5)
    assert [r.output for r in engine.generate_groups([prompt], [params])[0]] == [
        expected[:n] for n in lengths
    ]
    assert engine.cache.free_blocks == 16


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[3], LONG], ids=len)
def test_a_sampled_group_equals_separate_requests_with_the_same_seeds(llama, prompt) -> None:
    params = [SamplingParams(max_new_tokens=10, temperature=1.4, seed=seed) for seed in range(4)]
    group = _engine(llama).generate_groups([prompt], [params])[0]
    outputs = [r.output for r in group]
    assert outputs == _separately(llama, prompt, params)
    assert len({tuple(out) for out in outputs}) > 1  # the seeds differ, so do the completions


def test_a_group_of_8_prefills_its_prompt_once(llama) -> None:
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed) for seed in range(8)]
    grouped, separate = _engine(llama), _engine(llama, prefix_caching=False)
    group = grouped.generate_groups([LONG], [params])[0]
    alone = [separate.generate([LONG], each)[0] for each in params]
    size = len(LONG)
    assert grouped.prompt_tokens_computed == size - 1 + 8
    assert grouped.prompt_tokens_cached == 7 * (size - 1)
    assert [r.cached_tokens for r in group] == [0] + [size - 1] * 7
    assert separate.prompt_tokens_computed == 8 * size and separate.prompt_tokens_cached == 0
    assert [r.output for r in group] == [r.output for r in alone]


def test_a_one_token_prompt_has_nothing_to_share(llama) -> None:
    engine = _engine(llama)
    engine.generate_groups([[90]], [[SamplingParams(max_new_tokens=2, greedy=True)] * 3])
    assert engine.prompt_tokens_computed == 3 and engine.prompt_tokens_cached == 0


def test_a_sibling_reserves_only_its_own_blocks(llama) -> None:
    """9 prompt tokens + 3 new take 3 blocks of 4; a sibling shares the leader's first 2 (8
    positions) and reserves 1 for the rest, so both run at once in 4 blocks."""
    prompt = LONG[:9]
    params = SamplingParams(max_new_tokens=3, greedy=True)
    engine = _engine(llama, cache_blocks=4, prefill_chunk=16)
    group = engine.add_group(prompt, [params, params])
    engine.step()  # the leader's whole prompt, and the sibling joins
    engine.step()
    assert engine.load == (2, 0) and engine.cache.free_blocks == 0
    _finish(engine)
    assert [r.output for r in group] == [greedy_without_cache(llama, prompt, 3)] * 2
    assert engine.cache.free_blocks == 4
    with pytest.raises(PromptTooLong, match="KV cache"):
        engine.add_group(prompt, [params, SamplingParams(max_new_tokens=8)])
    assert not engine.busy  # nothing of a refused group is queued


def test_a_prefix_ending_mid_block_that_cannot_fit_shared_runs_alone(llama) -> None:
    """4 prompt tokens + 4 new fill a 2-block cache; shared, the sibling would hold the leader's
    first block (3 positions) and 2 of its own: it prefills on its own instead of waiting
    forever."""
    params = SamplingParams(max_new_tokens=4, greedy=True)
    engine = _engine(llama, cache_blocks=2)
    group = engine.add_group(PROMPTS[2], [params, params])
    _finish(engine)
    assert [r.output for r in group] == [greedy_without_cache(llama, PROMPTS[2], 4)] * 2
    assert engine.prompt_tokens_cached == 0 and engine.cache.free_blocks == 2


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["alone", "prefix_cache"])
def test_aborting_the_leader_mid_prefill_leaves_its_siblings_to_prefill_alone(
    llama, prefix_caching
) -> None:
    """With prefix caching, the 2 blocks the leader computed before it left stay cached and
    each sibling starts on them."""
    params = [SamplingParams(max_new_tokens=6, temperature=1.2, seed=seed) for seed in range(3)]
    engine = _engine(llama, cache_blocks=24, prefix_caching=prefix_caching)
    leader, *siblings = engine.add_group(LONG, params)
    engine.step()
    engine.step()
    assert 0 < leader.computed < len(LONG) - 1
    engine.abort(leader)
    _finish(engine)
    assert leader.finish_reason == "abort"
    assert [r.output for r in siblings] == _separately(llama, LONG, params[1:])
    cached = 2 * BLOCK if prefix_caching else 0  # per sibling
    assert engine.prompt_tokens_cached == 2 * cached
    assert engine.prompt_tokens_computed == 2 * BLOCK + 2 * (len(LONG) - cached)
    assert engine.cache.free_blocks == 24


def test_a_leader_aborted_during_the_step_that_completes_its_prefix_shares_nothing(llama) -> None:
    """Aborted by a server thread while the model runs the chunk that reaches the shared
    positions: its blocks are already released, so the siblings prefill on their own."""

    class AbortingMidStep(Engine):
        def _advance(self, rows):
            if rows[0][0] is leader:
                self.abort(leader)
            return super()._advance(rows)

    params = [SamplingParams(max_new_tokens=3, greedy=True)] * 3
    engine = AbortingMidStep(llama, block_size=BLOCK, prefill_chunk=32, cache_blocks=24)
    leader, *siblings = engine.add_group(LONG, params)
    _finish(engine)
    assert leader.finish_reason == "abort" and engine.prompt_tokens_cached == 0
    assert [r.output for r in siblings] == [greedy_without_cache(llama, LONG, 3)] * 2
    assert engine.cache.free_blocks == 24


def test_aborting_siblings_waiting_or_running_returns_every_block(llama) -> None:
    params = [SamplingParams(max_new_tokens=8, greedy=True)] * 4
    engine = _engine(llama, max_batch=2, cache_blocks=24)
    leader, running, waiting, early = engine.add_group(LONG, params)
    engine.abort(early)  # before the leader shares its prompt
    for _ in range(7):  # 22 shared positions, 4 a step; the sibling joins at the 7th
        engine.step()
    assert running.admitted is not None and early.cached_tokens == 0
    assert waiting.cached_tokens == len(LONG) - 1 and waiting.admitted is None
    engine.abort(waiting)  # holding the leader's blocks from the queue
    engine.step()
    engine.abort(running)
    _finish(engine)
    assert leader.output == greedy_without_cache(llama, LONG, 8)
    assert engine.cache.free_blocks == 24


def test_a_sibling_keeps_the_leaders_blocks_until_it_finishes(llama) -> None:
    """The leader finishes in its first step (1 token); a request waiting for its batch slot
    then takes blocks from the free list and prefills into them while the sibling decodes."""
    params = [SamplingParams(max_new_tokens=n, greedy=True) for n in (1, 6)]
    engine = _engine(llama, max_batch=2, cache_blocks=24, prefill_chunk=32)
    leader, sibling = engine.add_group(LONG, params)
    after = engine.add(LONG[::-1], SamplingParams(max_new_tokens=4, greedy=True))
    engine.step()
    assert leader.finished and sibling.cached_tokens == len(LONG) - 1
    prefix = sibling.blocks[:6]  # 22 shared positions over blocks of 4
    engine.step()
    assert after.admitted is not None and not set(prefix) & set(after.blocks)
    _finish(engine)
    assert sibling.output == _separately(llama, LONG, params[1:])[0]
    assert after.output == greedy_without_cache(llama, LONG[::-1], 4)
    assert engine.cache.free_blocks == 24


def test_prompt_logprobs_of_a_sibling_are_its_leaders(llama) -> None:
    """A sibling asking the leader's prompt_logprobs copies them; one asking another number of
    alternatives prefills on its own, after the full blocks whose entries the leader kept
    (`pipeline.serve.engine.prompt_logprob_cache`; none without prefix caching)."""
    asks = SamplingParams(max_new_tokens=2, greedy=True, prompt_logprobs=2)
    other = SamplingParams(max_new_tokens=2, greedy=True, prompt_logprobs=1)
    group = _engine(llama).generate_groups([LONG], [[asks, asks, other]])[0]
    alone = _engine(llama).generate([LONG], asks)[0]
    kept = (len(LONG) - 1) // BLOCK * BLOCK
    assert [r.cached_tokens for r in group] == [0, len(LONG) - 1, kept]
    assert group[1].prompt_logprobs == group[0].prompt_logprobs
    assert _rounded(group[0]) == _rounded(alone)
    assert len(group[2].prompt_logprobs) == len(LONG)
    assert [p.top for p in group[2].prompt_logprobs[1:]] == [
        p.top[:1] for p in group[0].prompt_logprobs[1:]
    ]
    plain = _engine(llama, prefix_caching=False).generate_groups([LONG], [[asks, other]])[0]
    assert [r.cached_tokens for r in plain] == [0, 0]


def _rounded(request: Request) -> list:
    return [
        None if p is None else (round(p.token_logprob, 4), [token for token, _ in p.top])
        for p in request.prompt_logprobs
    ]


def test_block_references() -> None:
    """A shared block returns to the free list after its last release, not its first."""
    config = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        ffn_hidden_size=32,
        max_position_embeddings=64,
    )
    cache = BlockKVCache(config, num_blocks=4, block_size=2)
    first = cache.allocate(4)
    shared = first[:1]
    cache.share(shared)
    cache.release(first)
    assert cache.free_blocks == 3 and first == []
    assert shared[0] not in cache.allocate(6)  # still held: not handed out again
    assert cache.free_blocks == 0
    block = shared[0]
    cache.release(shared)
    assert cache.free_blocks == 1
    with pytest.raises(ValueError, match=f"block {block} is free"):
        cache.share([block])


def test_a_groups_decode_rows_are_packed_and_read_the_prompt_once(llama) -> None:
    """`pipeline.serve.engine.packing`: one batch row for the group, the shared prompt blocks in its
    keys once, each completion's own positions after them; the tokens as without a cache."""
    import torch

    from pipeline.serve.engine.packing import packed_decode_batch

    engine = _engine(llama, cache_blocks=64)
    group = engine.add_group(LONG, [SamplingParams(max_new_tokens=5, greedy=True)] * 4)
    alone = engine.add(PROMPTS[1], SamplingParams(max_new_tokens=5, greedy=True))
    while not all(len(r.output) >= 2 for r in [*group, alone]):
        engine.step()
    rows = list(engine.scheduler.running)
    batch, where_row, where_col = packed_decode_batch(
        rows, BLOCK, engine.cache.scratch_slot, torch.device("cpu")
    )
    shared = (len(LONG) - 1) // BLOCK * BLOCK
    own = [r.computed + 1 - shared for r in group]
    assert batch.read_slots.shape == (2, shared + sum(own))  # the group's row, the other's
    assert where_row.tolist() == [0, 0, 0, 0, 1] and where_col.tolist() == [0, 1, 2, 3, 0]
    assert batch.mask()[0, 0].sum(-1).tolist() == [shared + n for n in own]
    _finish(engine)
    assert [r.output for r in group] == [greedy_without_cache(llama, LONG, 5)] * 4
    assert alone.output == greedy_without_cache(llama, PROMPTS[1], 5)
