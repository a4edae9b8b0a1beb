"""gpt-oss generates what transformers' greedy `generate` does: the engine (paged KV cache,
chunked prefill, batching, rows of one prompt packed), `pipe generate` and `pipe serve`, on a
tiny gpt-oss with a sliding window of 5 tokens (every prompt but one is longer) and sinks.
CPU, fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.core.model.greedy import greedy_without_cache
from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import run_pipe, served_text
from tests.convert.test_gpt_oss import WINDOW, _case, _hf_model

transformers = pytest.importorskip("transformers")

NEW = 16
PROMPTS = [[5, 17, 3], [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77, 4, 19], [90, 3, 8, 1, 5, 44]]
TEXTS = ["line 3: value", "Hello, world! The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tiny_tokenizer_dir) -> tuple[Path, object]:
    """A perturbed tiny gpt-oss over the tiny tokenizer's vocabulary, with its tokenizer files,
    as a Hugging Face directory; and the transformers model."""
    vocab = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    hf_config, _ = _case(len(vocab) + 2)
    hf_config.eos_token_id = hf_config.bos_token_id = None
    hf = _hf_model(hf_config)
    directory = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, directory / name)
    return directory, hf


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


def test_engine_greedy_equals_transformers(gpt_oss_dir) -> None:
    directory, hf = gpt_oss_dir
    assert max(len(p) for p in PROMPTS) > WINDOW
    model = open_generator(directory).model
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    one = Engine(model, max_batch=1, block_size=4, prefill_chunk=4)
    batched = Engine(model, max_batch=4, block_size=4, prefill_chunk=8)
    expected = [_hf_greedy(hf, prompt) for prompt in PROMPTS]
    for prompt, tokens in zip(PROMPTS, expected):
        assert one.generate([prompt], params)[0].output == tokens, prompt
        assert greedy_without_cache(model, prompt, NEW) == tokens, prompt
    assert [r.output for r in batched.generate(PROMPTS, params)] == expected
    # The completions of one prompt share its blocks: decoded packed in one row, whose keys'
    # positions the window is measured from.
    groups = batched.generate_groups([PROMPTS[1]], [[params] * 3])
    assert [r.output for r in groups[0]] == [expected[1]] * 3


def _transformers_text(directory: Path, hf, prompt: str, new: int = NEW) -> str:
    tokenizer = load_tokenizer(directory)
    ids = tokenizer.encode_batch([prompt])[0]
    return tokenizer.decode(_hf_greedy(hf, ids, new))


def test_pipe_generate_prints_transformers_text(gpt_oss_dir, tmp_path) -> None:
    directory, hf = gpt_oss_dir
    for prompt in TEXTS:
        expected = prompt + _transformers_text(directory, hf, prompt) + "\n"
        args = ["--prompt", prompt, "--max-new-tokens", NEW, "--greedy"]
        assert run_pipe("generate", directory, *args).output == expected, prompt
    run_pipe("convert", directory, "--from", "hf", "--output", tmp_path / "ckpt", "-q")
    prompt = TEXTS[1]
    args = ["--prompt", prompt, "--max-new-tokens", NEW, "--greedy", "--tokenizer", directory]
    expected = prompt + _transformers_text(directory, hf, prompt) + "\n"
    assert run_pipe("generate", tmp_path / "ckpt", *args).output == expected


def test_pipe_serve_completes_with_transformers_text(gpt_oss_dir, tmp_path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.serve.test_server import Server

    directory, hf = gpt_oss_dir
    server = Server(directory, tmp_path / "stderr.txt", "--max-batch", "4", "--block-size", "4")
    try:
        for prompt in TEXTS:
            body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0}
            status, _, answer = server.post("/v1/completions", body)
            assert status == 200, answer
            ids = load_tokenizer(directory).encode_batch([prompt])[0]
            expected = served_text(directory, ids, _hf_greedy(hf, ids))
            assert answer["choices"][0]["text"] == expected, prompt
    finally:
        server.stop()


@pytest.mark.dist
def test_two_tensor_parallel_ranks_give_transformers_text(gpt_oss_dir) -> None:
    """`pipe generate --nproc-per-node 2`: each rank holds two of the four heads, their sinks and
    one of the two kv heads' cache; the text is transformers'."""
    from tests.serve.test_generate_tp import _generate

    directory, hf = gpt_oss_dir
    prompt = "line 3: value"  # test_generate_tp's ARGS: 10 greedy tokens
    expected = prompt + _transformers_text(directory, hf, prompt, 10) + "\n"
    assert _generate(directory, "--nproc-per-node", "2") == expected
