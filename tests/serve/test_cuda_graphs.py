"""CUDA graphs of the engine's decode step (`pipeline.serve.engine.static_decode`), on a GPU: each
(bucket, width) captured once and replayed on new values gives the tokens and log-probabilities
of the same static step run eagerly; a capture fails on any host synchronisation, so these runs
also prove the step has none. A bf16 MoE model is captured (its experts in grouped products); in
float32 it is not, and says why. Only torch and pipe are imported: the GPU machine carries no
test oracles."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    [5, 17, 3],
    [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77],
    [90],
    [11, 22, 33, 44, 55, 66],
    list(range(1, 40)),
    [7] * 20,
]
SETTINGS = [
    SamplingParams(max_new_tokens=12, greedy=True),
    SamplingParams(max_new_tokens=20, temperature=1.3, top_k=20, seed=2, logprobs=3),
    SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.7, seed=3),
    SamplingParams(max_new_tokens=30, greedy=True, logprobs=1),
    SamplingParams(max_new_tokens=16, temperature=1.0, seed=4, repetition_penalty=1.2),
    SamplingParams(max_new_tokens=24, temperature=0.7, seed=5),
]


def _model(flavor: str, dtype: torch.dtype):
    from pipeline.core.model.flavors import get_flavor
    from pipeline.core.model.transformer import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(get_flavor(flavor))
    model.to_empty(device="cuda")
    model.init_weights()
    model.to(dtype)
    model.rope.init_weights(torch.device("cuda"))  # float32, as loading for serving keeps it
    return model.eval()


def _generate(engine: Engine) -> list:
    requests = [engine.add(p, s) for p, s in zip(PROMPTS, SETTINGS)]
    found = {id(r): [] for r in requests}
    for event in engine.run():
        found[id(event.request)].append((event.token, event.logprobs))
    return [found[id(r)] for r in requests]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_graphs_equal_the_static_step_run_eagerly(dtype) -> None:
    model = _model("tiny", dtype)
    settings = dict(max_batch=4, cache_blocks=64, block_size=4, prefill_chunk=16)
    graphs = Engine(model, **settings)  # CUDA: graphs by default
    assert graphs.decoder is not None and graphs.decoder.graphs
    eager = Engine(model, cuda_graphs=False, static_decode=True, **settings)
    assert not eager.decoder.graphs
    first = _generate(graphs)
    _same(first, _generate(eager), 1e-5 if dtype == torch.float32 else 5e-2)
    captured = graphs.decoder._graphs
    assert len(captured) >= 3 and {bucket for bucket, _, _ in captured} >= {1, 2, 4}
    again = Engine(model, **settings)  # a second engine captures its own graphs
    assert _generate(again) == first  # replays are deterministic


def _same(mine: list, theirs: list, tolerance: float) -> None:
    """The same tokens, log-probabilities within `tolerance` (cuBLAS may choose another
    algorithm under capture), the same alternatives."""
    for a, b in zip(mine, theirs):
        assert [token for token, _ in a] == [token for token, _ in b]
        for (_, x), (_, y) in zip(a, b):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.token_logprob == pytest.approx(y.token_logprob, abs=tolerance)


def test_a_bf16_moe_model_is_captured_and_equals_its_eager_step() -> None:
    """bf16 experts on this GPU run as grouped products, which never ask the host: captured."""
    model = _model("tiny_moe", torch.bfloat16)
    settings = dict(max_batch=4, cache_blocks=64, block_size=4, prefill_chunk=16)
    graphs = Engine(model, **settings)
    assert graphs.decoder is not None and graphs.decoder.graphs
    eager = Engine(model, cuda_graphs=False, static_decode=True, **settings)
    _same(_generate(graphs), _generate(eager), 5e-2)
    assert len(graphs.decoder._graphs) >= 3


def test_an_fp32_moe_model_decodes_eagerly_and_says_why(caplog) -> None:
    model = _model("tiny_moe", torch.float32)
    with caplog.at_level(logging.WARNING):
        engine = Engine(model, max_batch=4, cache_blocks=64, block_size=4)
    assert engine.decoder is None
    assert "CUDA graphs off: its MoE layers" in caplog.text
    assert all(len(out) == s.max_new_tokens for out, s in zip(_generate(engine), SETTINGS))
