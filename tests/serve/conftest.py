"""A tiny Hugging Face Llama with a real (small, trained) tokenizer beside it, shared by the
`pipe generate` and `pipe serve` tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.builders import perturbed, save_hf

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A perturbed 2-layer Llama over the tiny tokenizer's vocabulary, its tokenizer files (with a
    chat template) copied in, as a Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("tiny_hf")
    vocab = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.LlamaConfig(
        vocab_size=len(vocab) + 2,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = perturbed(transformers.LlamaForCausalLM(config).eval())
    model.save_pretrained(directory)
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    tokenizer_config = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """pipe's model of a small random Llama written as a Hugging Face directory (the engine
    tests' model)."""
    from pipeline.serve.engine.loading import open_generator

    directory = tmp_path_factory.mktemp("llama")
    save_hf("llama", directory)
    return open_generator(directory).model
