"""Greedy generation of the 2026 families against transformers' `generate` (the oracle): GLM-4.5
(q/k/v biases, per-head q/k norms, half of each head rotated, DeepSeek's MoE), GLM-4.5-Air (no
q/k norms), MiniMax-M2 (q/k norms over the whole projection, partial RoPE), Kimi K2.5's text
model (its INT4 experts dequantized on import; transformers holds the values compressed-tensors
decompresses), Mistral 4 (Llama 4's query scale, past its 8 original positions), SmolLM3 with
`use_sliding_window` on (a window of 5 on the layers without RoPE, q/k/v/o biases; prompts
longer than the window) and Seed-OSS (q/k/v biases, head_dim 24 over hidden 64). Each tiny
model shares the tiny tokenizer's vocabulary, so the same weights answer token prompts in the
engine, text prompts in `pipe generate` and `/v1/completions` of `pipe serve`: 16 new tokens,
several prompts, equal to transformers'. CPU, fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.serve.engine.core import Engine
from pipeline.serve.engine.loading import open_generator
from pipeline.serve.engine.sampling import SamplingParams
from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import run_pipe, served_text

transformers = pytest.importorskip("transformers")

FAMILIES = [
    "glm45",
    "glm45_air",
    "minimax_m2",
    "kimi_k25_int4",
    "mistral4",
    "smollm3_window_bias",
    "seed_oss",
]
TOKEN_PROMPTS = [[5, 17, 3], [40, 2, 71, 9, 9, 12, 60, 33, 1, 8, 77], [90], [11, 22, 33, 44]]
TEXT_PROMPTS = ["line 3: value", "def f(x):", "line 41: value=287 abc"]
NEW = 16


def _family(name: str, directory: Path, vocab_size: int):
    """transformers' model of `name` (perturbed) saved to `directory`, over `vocab_size`."""
    if name == "kimi_k25_int4":
        from tests.convert.test_kimi_int4 import kimi_checkpoint

        return kimi_checkpoint(directory, vocab_size)[1]
    if name in ("smollm3_window_bias", "seed_oss"):
        from tests.convert.test_smollm3_seed_oss import _hf_model as smollm3_or_seed_oss

        hf = smollm3_or_seed_oss(name, vocab_size)
        hf.save_pretrained(directory)
        return hf
    if name == "mistral4":
        from tests.convert.test_mistral4 import _case, _hf_model

        hf_config = _case()[0]
    elif name.startswith("glm45"):
        from tests.convert.test_glm4_moe import _case, _hf_model

        hf_config = _case("air" if name == "glm45_air" else "glm45")[0]
    else:
        from tests.convert.test_minimax_m2 import _case, _hf_model

        hf_config = _case()[0]
        hf_config.bos_token_id = hf_config.eos_token_id = None
    hf_config.vocab_size = vocab_size
    hf = _hf_model(hf_config)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, tiny_tokenizer_dir):
    """(name, directory with the tokenizer files beside the weights, transformers' model)."""
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    vocab = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    hf = _family(request.param, directory, len(vocab) + 2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, directory / name)
    return request.param, directory, hf


def _hf_greedy(hf, prompt: list[int], eos: frozenset[int]) -> list[int]:
    """transformers' greedy continuation, stopping on the end ids pipe stops on."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=sorted(eos) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


# transformers' continuations by (model directory, prompt): the `pipe generate` and the
# `pipe serve` checks of a family compare against the same ones, so each is generated once.
_HF_IDS: dict[tuple[Path, str], tuple[list[int], list[int]]] = {}


def _hf_ids(hf, directory: Path, prompt: str) -> tuple[list[int], list[int]]:
    """The text `prompt`'s ids and transformers' greedy continuation, without the end ids."""
    key = (directory, prompt)
    if key not in _HF_IDS:
        ids = load_tokenizer(directory).encode_batch([prompt])[0]
        eos = open_generator(directory).eos_ids
        _HF_IDS[key] = ids, [t for t in _hf_greedy(hf, ids, eos) if t not in eos]
    return _HF_IDS[key]


def _hf_text(hf, directory: Path, prompt: str) -> str:
    """transformers' greedy continuation of the text `prompt`, as `tokenizer.decode` writes it."""
    return load_tokenizer(directory).decode(_hf_ids(hf, directory, prompt)[1])


def test_engine_greedy_equals_transformers(family) -> None:
    """The serving engine (paged cache, chunked prefill, a batch of mixed lengths) continues
    every prompt as transformers does."""
    name, directory, hf = family
    gen = open_generator(directory)
    params = SamplingParams(max_new_tokens=NEW, greedy=True, stop_token_ids=gen.eos_ids)
    engine = Engine(gen.model, max_batch=4, block_size=4, prefill_chunk=5)
    outputs = [r.output for r in engine.generate(TOKEN_PROMPTS, params)]
    assert outputs == [_hf_greedy(hf, p, gen.eos_ids) for p in TOKEN_PROMPTS], name
    assert sum(len(out) for out in outputs) > 2 * NEW  # not a run of early ends


def test_pipe_generate_prints_transformers_text(family) -> None:
    name, directory, hf = family
    for prompt in TEXT_PROMPTS:
        args = ["--prompt", prompt, "--max-new-tokens", NEW, "--greedy"]
        continuation = _hf_text(hf, directory, prompt)
        assert len(continuation) >= NEW // 2, (name, prompt)  # text, not an early end
        expected = prompt + continuation + "\n"
        assert run_pipe("generate", directory, *args).output == expected, (name, prompt)


def test_pipe_serve_completes_as_transformers(family, tmp_path) -> None:
    from tests.serve.test_server import Server

    name, directory, hf = family
    server = Server(directory, tmp_path / "stderr.txt", "--max-batch", "4", "--block-size", "8")
    try:
        for prompt in TEXT_PROMPTS:
            body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0}
            status, _, answer = server.post("/v1/completions", body)
            assert status == 200, answer
            expected = served_text(directory, *_hf_ids(hf, directory, prompt))
            assert answer["choices"][0]["text"] == expected, (name, prompt)
    finally:
        server.stop()


def test_smollm3_prompts_outrun_its_sliding_window(tiny_tokenizer_dir) -> None:
    """The SmolLM3 case slides, and a token prompt and a text prompt are longer than its window,
    so the greedy checks above see keys fall out of it."""
    from tests.convert.test_smollm3_seed_oss import _case

    hf_config = _case("smollm3_window_bias")[1]
    assert hf_config.use_sliding_window and "sliding_attention" in hf_config.layer_types
    texts = load_tokenizer(tiny_tokenizer_dir).encode_batch(TEXT_PROMPTS)
    longest = min(max(len(ids) for ids in texts), max(len(p) for p in TOKEN_PROMPTS))
    assert longest > hf_config.sliding_window
