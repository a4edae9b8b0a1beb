"""Generation from BLOOM and MPT (ALiBi) against transformers' greedy `generate`: the engine's
paged-cache decode, its static decode step, packed groups (keys out of position order), `pipe
generate` and `pipe serve`'s completions route. CPU, fp32."""

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
from tests.builders import perturbed, run_pipe
from tests.convert.test_bloom_mpt import hf_alibi_model

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 3], [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77], [90], [11, 22, 33, 44, 55, 66]]
NEW = 12
TEXT_PROMPT = "line 3: value"


def _hf_greedy(hf, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["bloom", "mpt"])
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = hf_alibi_model(request.param)
    hf.generation_config.eos_token_id = None  # run every prompt to NEW tokens
    hf.config.eos_token_id = None
    hf.save_pretrained(directory)
    return request.param, directory, hf


def test_greedy_equals_transformers(family) -> None:
    name, directory, hf = family
    gen = open_generator(directory)
    params = SamplingParams(max_new_tokens=NEW, greedy=True)
    for static in (False, True):
        engine = Engine(gen.model, max_batch=1, block_size=4, prefill_chunk=4, static_decode=static)
        for prompt in PROMPTS:
            expected = _hf_greedy(hf, prompt)
            assert engine.generate([prompt], params)[0].output == expected, (name, static, prompt)
    for prompt in PROMPTS:
        assert greedy_without_cache(gen.model, prompt, NEW) == _hf_greedy(hf, prompt)
    batched = Engine(gen.model, max_batch=4, block_size=4, prefill_chunk=5).generate(
        PROMPTS, params
    )
    assert [r.output for r in batched] == [_hf_greedy(hf, p) for p in PROMPTS]


def test_a_packed_group_equals_separate_requests(family) -> None:
    """A group's completions share their prompt's keys, packed in one row whose keys are not in
    position order: ALiBi reads each key's own position."""
    _, directory, _ = family
    model = open_generator(directory).model
    prompt = [(7 * i + 3) % 90 + 1 for i in range(13)]
    params = [SamplingParams(max_new_tokens=8, temperature=1.4, seed=seed) for seed in range(4)]
    engine = Engine(model, block_size=4, prefill_chunk=4)
    group = [r.output for r in engine.generate_groups([prompt], [params])[0]]
    alone = [
        Engine(model, max_batch=1, block_size=4, prefill_chunk=4).generate([prompt], p)[0].output
        for p in params
    ]
    assert group == alone and len({tuple(out) for out in group}) > 1


def _with_tokenizer(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """A perturbed tiny BLOOM or MPT over the tiny tokenizer's vocabulary, its tokenizer
    copied in."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(0)
    if name == "bloom":
        config = transformers.BloomConfig(
            vocab_size=len(vocab) + 2, hidden_size=48, n_layer=2, n_head=6, eos_token_id=None
        )
        model = transformers.BloomForCausalLM(config)
    else:
        config = transformers.MptConfig(
            vocab_size=len(vocab) + 2, d_model=48, n_layers=2, n_heads=6, max_seq_len=128
        )
        model = transformers.MptForCausalLM(config)
    perturbed(model.eval()).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, directory / file)
    return directory


def _transformers_text(directory: Path, new: int) -> str:
    tokenizer = load_tokenizer(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = tokenizer.encode_batch([TEXT_PROMPT])[0]
    return tokenizer.decode(_hf_greedy(model, ids, new))


def test_pipe_generate_prints_transformers_text(tiny_tokenizer_dir, tmp_path) -> None:
    directory = _with_tokenizer("bloom", tmp_path / "bloom", tiny_tokenizer_dir)
    expected = TEXT_PROMPT + _transformers_text(directory, 10) + "\n"
    args = ["--prompt", TEXT_PROMPT, "--max-new-tokens", 10, "--greedy"]
    assert run_pipe("generate", directory, *args).output == expected
    run_pipe("convert", directory, "--from", "hf", "--output", tmp_path / "ckpt")
    from_pipe = run_pipe("generate", tmp_path / "ckpt", *args, "--tokenizer", directory)
    assert from_pipe.output == expected


def test_pipe_serve_completes_as_transformers(tiny_tokenizer_dir, tmp_path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.serve.test_server import Server

    directory = _with_tokenizer("mpt", tmp_path / "mpt", tiny_tokenizer_dir)
    expected = _transformers_text(directory, 10)
    assert len(expected) >= 5  # ten tokens of text, not an early end
    server = Server(directory, tmp_path / "stderr.txt", "--block-size", "4")
    try:
        body = {"prompt": TEXT_PROMPT, "max_tokens": 10, "temperature": 0}
        status, _, answer = server.post("/v1/completions", body)
    finally:
        server.stop()
    assert status == 200, server.stderr()
    assert answer["choices"][0]["text"] == expected


@pytest.mark.dist
def test_two_ranks_generate_transformers_text(tiny_tokenizer_dir, tmp_path) -> None:
    """`pipe generate --nproc-per-node 2`: each rank holds 3 of BLOOM's 6 heads and their
    slopes, and the text is transformers'."""
    from tests.serve.test_generate_tp import ARGS
    from tests.serve.test_generate_tp import _generate as generate_on_ranks

    directory = _with_tokenizer("bloom", tmp_path / "bloom", tiny_tokenizer_dir)
    expected = ARGS[1] + _transformers_text(directory, 10) + "\n"
    assert generate_on_ranks(directory, "--nproc-per-node", "2") == expected
