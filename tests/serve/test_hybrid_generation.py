"""Generation from the hybrid linear-attention models (Qwen3.5 dense and MoE, Qwen3-Next) against
transformers' greedy `generate`: the engine one request at a time (chunked prefill carrying the
states across chunks), batched (rows of different lengths padded), in groups whose completions
start from their leader's prompt state, `pipe generate`, `pipe serve` with concurrent requests
of n > 1, and GRPO's rollout engine. CPU, fp32."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import run_pipe, served_text
from tests.convert.test_qwen3_5 import CASES, hf_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3], [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77], [90], [11, 22, 33, 44, 55, 66]]
NEW = 12
TEXTS = ["line 3: value", "line 12: value=84 abcabc", "x"]


@pytest.fixture(scope="module", params=CASES)
def family(request, tmp_path_factory, tiny_tokenizer_dir):
    """(name, directory, HF model): the model saved with the tiny tokenizer beside it."""
    directory = tmp_path_factory.mktemp(request.param)
    vocab = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    hf = hf_model(
        request.param, vocab_size=len(vocab) + 2, eos_token_id=None, bos_token_id=None
    ).eval()
    hf.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, directory / name)
    return request.param, directory, hf


def _hf_greedy(hf, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_engine_equals_transformers_alone_batched_and_in_groups(family) -> None:
    """One request at a time with 4-token prefill chunks; four at once with 8-token chunks (rows
    padded to the longest); a group of three completions per prompt, the siblings starting from
    their leader's state after the prompt but its last token: all transformers' greedy tokens."""
    name, directory, hf = family
    model = open_generator(directory).model
    expected = [_hf_greedy(hf, p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    one = Engine(model, max_batch=1, block_size=4, prefill_chunk=4)
    assert one.cache.states is not None and not one.prefix_cache.enabled
    assert [one.generate([p], params)[0].output for p in PROMPTS] == expected, name
    batched = Engine(model, max_batch=4, block_size=4, prefill_chunk=8)
    assert [r.output for r in batched.generate(PROMPTS, params)] == expected, name
    grouped = Engine(model, max_batch=12, block_size=4, prefill_chunk=64)
    groups = grouped.generate_groups(PROMPTS, [[params] * 3] * len(PROMPTS))
    assert [[r.output for r in g] for g in groups] == [[e] * 3 for e in expected], name
    # The siblings read their leader's prompt (all but its last token) instead of computing it.
    assert grouped.prompt_tokens_cached == 2 * sum(len(p) - 1 for p in PROMPTS)
    assert len(grouped.cache.states._free) == 12  # every state slot back


def test_sampled_group_equals_its_completions_run_alone(family) -> None:
    """Sampled completions of a group (each its own seed) equal the same seeds run one request
    at a time: a sibling's copied state is the state it would have computed."""
    _, directory, _ = family
    model = open_generator(directory).model
    seeds = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
    group = Engine(model, max_batch=3, block_size=4).generate_groups([PROMPTS[1]], [seeds])[0]
    alone = Engine(model, max_batch=1, block_size=4)
    assert [r.output for r in group] == [alone.generate([PROMPTS[1]], s)[0].output for s in seeds]


def test_grpo_rollouts_equal_transformers(family) -> None:
    """GRPO's rollout engine on the policy itself (one fp32 process) gives greedy completions
    equal to transformers', every completion of a prompt alike."""
    from pipeline.train.objectives.grpo.rollout import RolloutModel

    _, directory, hf = family
    model = open_generator(directory).model
    cfg = SimpleNamespace(
        training=SimpleNamespace(dtype="fp32"),
        data=SimpleNamespace(seq_length=64),
        grpo=SimpleNamespace(rollout_cuda_graphs="auto", rollout_trainer_shapes="auto"),
    )
    rollout = RolloutModel(model, cfg, torch.device("cpu"))
    params = [[SamplingParams(max_new_tokens=NEW, greedy=True)] * 2 for _ in PROMPTS]
    rollouts = rollout.generate(PROMPTS, params)
    expected = [e for p in PROMPTS for e in [_hf_greedy(hf, p)] * 2]
    assert rollouts.completions == expected


def _hf_text(directory: Path, hf, text: str, new: int) -> str:
    tokenizer = load_tokenizer(directory)
    ids = tokenizer.encode_batch([text])[0]
    return tokenizer.decode(_hf_greedy(hf, ids, new))


def test_pipe_generate_prints_transformers_text(family) -> None:
    name, directory, hf = family
    if name != "qwen3_next":
        pytest.skip("the command is the same for every family; one is enough")
    for text in TEXTS:
        expected = text + _hf_text(directory, hf, text, 10) + "\n"
        args = ["--prompt", text, "--max-new-tokens", 10, "--greedy"]
        assert run_pipe("generate", directory, *args).output == expected


def test_pipe_serve_concurrent_requests_of_several_completions(family, tmp_path) -> None:
    """`pipe serve` answers concurrent completions requests (n = 2, top_k 1: greedy n > 1 is
    refused, as vLLM refuses it) with transformers' greedy text in every choice."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.serve.test_server import Server

    name, directory, hf = family
    if name != "qwen3_5_moe":
        pytest.skip("the server is the same for every family; one is enough")
    tokenizer = load_tokenizer(directory)
    expected = {}
    for text in TEXTS:
        ids = tokenizer.encode_batch([text])[0]
        expected[text] = served_text(directory, ids, _hf_greedy(hf, ids, 8))
    server = Server(directory, tmp_path / "stderr.txt", "--max-batch", "8", "--block-size", "8")
    try:

        def ask(text: str) -> tuple[int, list[str]]:
            body = {"prompt": text, "max_tokens": 8, "top_k": 1, "n": 2}
            status, _, answer = server.post("/v1/completions", body)
            return status, [c["text"] for c in answer["choices"]]

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, TEXTS * 2))
    finally:
        server.stop()
    for text, (status, choices) in zip(TEXTS * 2, answers):
        assert status == 200 and choices == [expected[text]] * 2, (text, choices)


@pytest.mark.dist
def test_two_ranks_give_one_rank_text(family) -> None:
    """`pipe generate --nproc-per-node 2`: the key heads (and their states) split over two gloo
    processes give the text of one process."""
    from tests.serve.test_generate_tp import ARGS, _generate

    name, directory, _ = family
    if name != "qwen3_next":
        pytest.skip("one family is enough for the split")
    alone = run_pipe("generate", directory, *ARGS).output
    assert len(alone) > len(ARGS[1]) + 3
    assert _generate(directory, "--nproc-per-node", "2") == alone
