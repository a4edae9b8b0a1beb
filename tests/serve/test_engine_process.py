"""The engine in its own process, seen through `EngineClient`: the same tokens as the engine run
in this process, several tokens in one delta for a consumer slower than the engine, admission
refused at once, and a model that cannot load named in one line. Also the CPU linears packed
for oneDNN, alone and stacked by input, against `nn.Linear`."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from pipeline.core.model.shared_input import project
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.cpu_linear import (
    PrepackedLinear,
    StackedLinears,
    can_prepack,
    prepack_linears,
)
from pipeline.serve.engine.loading import LoadError, open_generator
from pipeline.serve.engine.process import EngineSpec
from pipeline.serve.engine.request_checks import PromptTooLong
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.serve.engine.scheduler import QueueFull
from pipeline.serve.http.engine_client import EngineClient

PROMPT = [5, 17, 3, 40, 2, 71]
NEW = 24


def _spec(directory, **changes) -> EngineSpec:
    spec = EngineSpec(
        checkpoint=str(directory),
        tokenizer=None,
        device="cpu",
        dtype=None,
        kv_cache_bytes=2**20,
        block_size=8,
        max_batch=2,
        prefill_chunk=64,
        threads=1,
    )
    return dataclasses.replace(spec, **changes)


@pytest.fixture(scope="module")
def client(tiny_hf_dir):
    client = EngineClient(_spec(tiny_hf_dir), max_waiting=1)
    client.start()
    yield client
    client.stop()


def _in_process_tokens(directory, params: SamplingParams) -> list[int]:
    model = open_generator(directory).model
    engine = Engine(model, max_batch=1, cache_blocks=16, block_size=8)
    return engine.generate([PROMPT], params)[0].output


def test_a_slow_consumer_gets_what_arrived_in_one_delta(client, tiny_hf_dir) -> None:
    params = SamplingParams(max_new_tokens=NEW, greedy=True)

    async def consume():
        client.attach(asyncio.get_running_loop())
        stream = client.submit(PROMPT, params)
        await asyncio.sleep(1.0)  # the engine runs ahead (24 tokens of a tiny model: ~50 ms)
        return [delta async for delta in stream]

    deltas = asyncio.run(consume())
    tokens = [t for delta in deltas for t in delta.token_ids]
    assert len(deltas) < NEW and deltas[-1].finish_reason == "length"  # several per delta
    assert tokens == _in_process_tokens(tiny_hf_dir, params)
    assert "".join(delta.text for delta in deltas) == client.tokenizer.decode(tokens)
    assert deltas[-1].completion_tokens == NEW and deltas[-1].prompt_tokens == len(PROMPT)
    assert client.finish_counts["length"] >= 1


def test_admission_is_refused_at_once(client) -> None:
    async def submit_three():
        client.attach(asyncio.get_running_loop())
        with pytest.raises(PromptTooLong, match="context"):
            client.submit(PROMPT, SamplingParams(max_new_tokens=10**6))
        params = SamplingParams(max_new_tokens=200, greedy=True)
        streams = [client.submit(PROMPT, params) for _ in range(3)]  # batch 2 + 1 waiting
        with pytest.raises(QueueFull, match="waiting"):
            client.submit(PROMPT, params)
        for stream in streams:
            stream.abort()
        return streams

    streams = asyncio.run(submit_three())
    assert all(stream.finish_reason == "abort" for stream in streams)


def test_a_checkpoint_that_cannot_load_is_one_line(tmp_path) -> None:
    client = EngineClient(_spec(tmp_path / "missing"), max_waiting=1)
    with pytest.raises(LoadError, match="missing: no such checkpoint"):
        client.start()
    assert not client.process.is_alive()


def test_the_decode_attention_kernel_is_built_while_loading_where_it_serves(
    tiny_hf_dir, tmp_path, monkeypatch
) -> None:
    """A float32 engine on one thread has pipe's decode attention kernel built before it says
    it is ready (not in its first request); on two threads, where torch's attention serves,
    nothing is built."""
    built = {}
    for threads in (1, 2):
        cache = tmp_path / f"threads{threads}"
        monkeypatch.setenv("PIPE_CACHE_DIR", str(cache))
        client = EngineClient(_spec(tiny_hf_dir, threads=threads), max_waiting=1)
        client.start()
        try:
            built[threads] = sorted(p.name for p in cache.glob("native/*.so"))
        finally:
            client.stop()
    assert len(built[1]) == 1 and built[1][0].startswith("cpu_decode_attention-"), built
    assert built[2] == [], built


@pytest.mark.skipif(not can_prepack(nn.Linear(2, 2)), reason="no oneDNN in this torch")
@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (7, 48), (3, 5, 48)])
def test_a_prepacked_linear_equals_nn_linear(shape) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight  # what the rest of the model reads is unchanged


@pytest.mark.skipif(not can_prepack(nn.Linear(2, 2)), reason="no oneDNN in this torch")
@pytest.mark.skipif(not can_prepack(nn.Linear(2, 2)), reason="no oneDNN in this torch")
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_linears_give_each_linear_its_own_product(bias) -> None:
    """One product for linears of one input, each output bit for bit its linear's alone; a
    linear called alone, or hooked, still gets its own; new weights take effect on repack."""
    torch.manual_seed(0)
    plain = [nn.Linear(48, n, bias=bias) for n in (64, 32, 32)]
    linears = tuple(PrepackedLinear(linear) for linear in plain)
    inputs = [torch.randn(*shape) for shape in [(1, 48), (1, 1, 48), (7, 48), (3, 5, 48)]]
    apart = [[linear(x) for linear in linears] for x in inputs]
    stack = StackedLinears(linears)
    assert all(linear.packed is None for linear in linears)  # the stack holds the only copy
    for x, expected in zip(inputs, apart):
        for got, want in zip(project(x, *linears), expected):
            assert torch.equal(got, want)
        assert torch.equal(linears[1](x), expected[1])
    with torch.no_grad():
        plain[2].weight.mul_(2)
    stack.repack()
    torch.testing.assert_close(project(inputs[2], *linears)[2], plain[2](inputs[2]))
    hooked = []
    linears[0].register_forward_hook(lambda *_: hooked.append(True))
    project(inputs[0], *linears)
    assert hooked == [True] and not stack.serves(linears)


def test_a_prepacked_model_generates_the_same_tokens(tiny_hf_dir) -> None:
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    model = open_generator(tiny_hf_dir).model
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    stacks = {id(m.stacked) for m in model.modules() if getattr(m, "stacked", None)}
    assert len(stacks) == 2 * model.config.num_layers  # wq/wk/wv and w1/w3 of each layer
    engine = Engine(model, max_batch=2, cache_blocks=16, block_size=8)
    packed = engine.generate([PROMPT, PROMPT[:3]], params)
    assert packed[0].output == _in_process_tokens(tiny_hf_dir, params)
    assert prepack_linears(model.to(torch.bfloat16)) == 0  # fp32 only


def test_control_messages_from_two_routes_each_get_their_own_answer() -> None:
    """A weight push and an adapter load sent at once: the second waits for the first's answer,
    so neither takes the other's (the engine answers in order)."""
    import asyncio

    from pipeline.serve.engine.messages import ControlDone, LoadLoRA, ResetPrefixCache
    from pipeline.serve.http.engine_client import EngineClient

    client = EngineClient.__new__(EngineClient)  # the control channel alone, no engine process
    client._dead, client._control, client._control_lock = None, None, asyncio.Lock()
    sent = []

    class Engine:  # answers each message after a while, in order, naming it
        def send(self, message) -> None:
            sent.append(message)
            answer = ControlDone(error=type(message).__name__)
            asyncio.get_running_loop().call_later(0.05, client._dispatch, answer)

    client._pipe = Engine()

    async def both():
        reset, load = client.control(ResetPrefixCache()), client.control(LoadLoRA("a", "/x"))
        sends = asyncio.gather(reset, load)
        return await asyncio.wait_for(sends, 5)  # without the lock the first waits forever

    first, second = asyncio.run(both())
    assert (first.error, second.error) == ("ResetPrefixCache", "LoadLoRA")
    assert [type(m).__name__ for m in sent] == ["ResetPrefixCache", "LoadLoRA"]
