"""Prefix caching (`Engine(prefix_caching=True)`, the default): full blocks named by a chain hash
of their tokens, shared between requests, kept after their last user leaves and evicted least
recently used. Greedy tokens equal those of an engine without the cache; the counts say what
was read and what was run; no block leaks or is evicted while in use. CPU, fp32."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.core.model.config import ModelConfig
from pipeline.core.model.greedy import greedy_without_cache
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.kv_cache import BlockKVCache, block_hashes
from pipeline.serve.engine.sampling import SamplingParams

pytest.importorskip("transformers")

BLOCK = 4
SYSTEMS = [[(5 * i + s) % 90 + 1 for i in range(11)] for s in range(3)]  # shared system prompts


def _engine(model, **kwargs) -> Engine:
    return Engine(model, **{"block_size": BLOCK, "prefill_chunk": 64, **kwargs})


def _cache(num_blocks: int = 4) -> BlockKVCache:
    config = ModelConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        ffn_hidden_size=32,
        max_position_embeddings=64,
    )
    return BlockKVCache(config, num_blocks=num_blocks, block_size=2)


def test_a_block_hash_names_its_tokens_and_everything_before_them() -> None:
    first, second = block_hashes([1, 2, 3, 4, 5], 2), block_hashes([9, 2, 3, 4], 2)
    assert len(first) == 2  # the fifth token fills no block
    assert first[0] != second[0] and first[1] != second[1]  # same tokens [3, 4], other prefix
    assert block_hashes([1, 2, 3, 4, 7, 7], 2)[:2] == first
    assert block_hashes([3, 4], 2, parent=first[0]) == first[1:]


def test_eviction_is_least_recently_released_and_never_of_a_held_block() -> None:
    cache = _cache(num_blocks=4)
    names = block_hashes(list(range(8)), 2)
    held = [cache.allocate(2)[0] for _ in range(4)]
    for block, name in zip(held, names):
        cache.register(block, name)
    a, b, c, d = ([block] for block in held)
    cache.release(b)
    cache.release(a)
    assert cache.free_blocks == 2 and cache.cached_blocks == 4
    hits = cache.lookup(names)
    assert hits == held and cache.unheld(hits) == 2
    cache.take(hits[:1])  # a is in use again; b is now the only unheld block
    assert cache.allocate(2) == [held[1]]  # b evicted: its name is gone
    assert cache.lookup(names) == held[:1] and cache.free_blocks == 0
    cache.release(c)
    cache.release(d)
    cache.release([held[0]])  # a's second user leaves: released after c and d
    assert cache.allocate(4) == [held[2], held[3]]  # c and d went first, a stays
    assert cache.lookup(names[:1]) == held[:1]
    cache.reset_prefix_cache()
    assert cache.lookup(names) == [] and cache.free_blocks == 1


def _workload(seed: int = 0, prompts: int = 50) -> list[list[int]]:
    """Prompts sharing a few system prompts, each with its own question."""
    rng = random.Random(seed)
    return [
        rng.choice(SYSTEMS) + [rng.randrange(1, 90) for _ in range(rng.randrange(1, 7))]
        for _ in range(prompts)
    ]


def _run(engine: Engine, prompts: list[list[int]], completions: int, new: int = 3) -> list:
    """Half the prompts' completions as one group each, the other half as separate requests."""
    params = SamplingParams(max_new_tokens=new, greedy=True)
    requests = []
    for index, prompt in enumerate(prompts):
        if index % 2:
            requests += engine.add_group(prompt, [params] * completions)
        else:
            requests += [engine.add(prompt, params) for _ in range(completions)]
    for _ in engine.run():
        pass
    return requests


def test_greedy_tokens_are_the_same_with_the_cache_on_and_off(llama) -> None:
    """50 prompts on 3 system prompts, 8 completions each, on a cache too small to keep every
    prompt's blocks (so it evicts)."""
    prompts = _workload()
    limits = {"max_batch": 32, "cache_blocks": 96, "max_waiting": 1000, "prefill_chunk": 512}
    cached, plain = _engine(llama, **limits), _engine(llama, **limits, prefix_caching=False)
    on, off = _run(cached, prompts, 8), _run(plain, prompts, 8)
    assert [r.output for r in on] == [r.output for r in off]
    assert cached.cache.evictions > 0
    for prompt in prompts[:3]:
        assert on[8 * prompts.index(prompt)].output == greedy_without_cache(llama, prompt, 3)
    total = 8 * sum(map(len, prompts))
    for engine in (cached, plain):
        assert engine.prompt_tokens_computed + engine.prompt_tokens_cached == total
        assert engine.cache.free_blocks == 96
    assert sum(r.cached_tokens for r in on) == cached.prompt_tokens_cached
    # the cache reads the system prompts' full blocks (8 of their 11 tokens) after the first
    assert cached.prompt_tokens_cached > plain.prompt_tokens_cached + 8 * 25 * 8
    assert cached.prompt_tokens_computed < plain.prompt_tokens_computed


def test_a_request_takes_the_longest_cached_prefix_but_never_its_last_token(llama) -> None:
    engine = _engine(llama, cache_blocks=16)
    params = SamplingParams(max_new_tokens=2, greedy=True)
    prompt = SYSTEMS[0] + [7]  # 12 tokens: 3 full blocks
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    longer = engine.generate([prompt + first.output[:1] + [3, 4]], params)[0]
    assert (first.cached_tokens, again.cached_tokens) == (0, 8)  # the 3rd block has the last
    assert longer.cached_tokens == 12
    assert again.output == first.output
    assert longer.output == greedy_without_cache(llama, prompt + first.output[:1] + [3, 4], 2)
    assert engine.prompt_tokens_computed == 12 + 4 + 3


def test_a_request_asking_prompt_logprobs_computes_a_prompt_cached_without_them(llama) -> None:
    asks = SamplingParams(max_new_tokens=1, greedy=True, prompt_logprobs=2)
    engine = _engine(llama, cache_blocks=16)
    engine.generate([SYSTEMS[1]], SamplingParams(max_new_tokens=1, greedy=True))
    request = engine.generate([SYSTEMS[1]], asks)[0]
    alone = _engine(llama, cache_blocks=16, prefix_caching=False).generate([SYSTEMS[1]], asks)[0]
    assert request.cached_tokens == 0
    assert [None if p is None else p.top for p in request.prompt_logprobs] == [
        None if p is None else p.top for p in alone.prompt_logprobs
    ]
    # and what it computed is cached for the next one
    assert engine.generate([SYSTEMS[1]], SamplingParams(max_new_tokens=1))[0].cached_tokens == 8


def test_scoring_requests_read_the_prompt_logprobs_their_cached_blocks_kept(llama) -> None:
    """lm-eval's loglikelihood requests: a few-shot prefix scored once, then only each
    request's own tokens; the log-probabilities equal an engine's without the cache."""
    asks = SamplingParams(max_new_tokens=1, greedy=True, prompt_logprobs=2)
    engine = _engine(llama, cache_blocks=16)
    alone = _engine(llama, cache_blocks=16, prefix_caching=False)
    engine.generate([SYSTEMS[1] + [7]], asks)  # keeps its first 2 blocks' entries
    # the same 2 blocks; then a prompt whose token after the 2nd block differs: only the 1st
    cases = [(SYSTEMS[1] + [9, 9], 8), (SYSTEMS[1][:8] + [50, 51, 52], 4)]
    for prompt, cached in cases:
        request = engine.generate([prompt], asks)[0]
        reference = alone.generate([prompt], asks)[0]
        assert request.cached_tokens == cached
        assert len(request.prompt_logprobs) == len(prompt)
        for got, want in zip(request.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
            assert got.token_logprob == pytest.approx(want.token_logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    more = SamplingParams(max_new_tokens=1, greedy=True, prompt_logprobs=3)
    assert engine.generate([SYSTEMS[1] + [9, 9]], more)[0].cached_tokens == 0  # 2 tops kept
    fewer = SamplingParams(max_new_tokens=1, greedy=True, prompt_logprobs=1)
    request = engine.generate([SYSTEMS[1] + [9, 9]], fewer)[0]
    assert request.cached_tokens == 12  # the 3 tops kept serve 1
    assert all(len(p.top) == 1 for p in request.prompt_logprobs[1:])


def test_reset_prefix_cache_forgets_every_block(llama) -> None:
    engine = _engine(llama, cache_blocks=16)
    params = SamplingParams(max_new_tokens=1, greedy=True)
    engine.generate([SYSTEMS[2]], params)
    engine.reset_prefix_cache()
    assert engine.generate([SYSTEMS[2]], params)[0].cached_tokens == 0
    assert engine.cache.free_blocks == 16


def _check_blocks(engine: Engine) -> None:
    """Every block is held, free or cached-and-unheld, once; a running request's blocks are
    held by it (so never on a list that eviction takes from)."""
    cache = engine.cache
    free, unheld = set(cache._free), set(cache._evictable)
    assert len(free) == len(cache._free) and not free & unheld
    held = {b for b in range(cache.num_blocks) if cache._references[b] > 0}
    assert held | free | unheld == set(range(cache.num_blocks)) and not held & (free | unheld)
    for request in engine.scheduler.running:
        assert set(request.blocks) <= held


def test_ten_thousand_requests_on_random_prefixes_leak_no_block(llama) -> None:
    """More distinct prefixes than the cache holds, so blocks are evicted all along."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, 90) for _ in range(rng.randrange(4, 13))] for _ in range(400)]
    engine = _engine(llama, max_batch=128, cache_blocks=320, max_waiting=20_000, prefill_chunk=2048)
    start = engine.cache.free_blocks
    params = SamplingParams(max_new_tokens=1, greedy=True)
    prompts = [rng.choice(prefixes) + [rng.randrange(1, 90)] for _ in range(10_000)]
    for prompt in prompts:
        engine.add(prompt, params)
    steps = 0
    with torch.inference_mode():
        while engine.busy:
            engine.step()
            steps += 1
            if steps % 10 == 0:
                _check_blocks(engine)
    _check_blocks(engine)
    assert engine.finish_counts["length"] == 10_000
    assert engine.cache.free_blocks == start and engine.cache.cached_blocks > 0
    assert engine.prompt_tokens_cached > 0
    assert engine.prompt_tokens_cached + engine.prompt_tokens_computed == sum(map(len, prompts))
