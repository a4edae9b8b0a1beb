"""Shared fixtures: the tokenizers and corpus of the shared test data
(`tests.builders.SHARED_DATA`), a tiny tokenizer trained in-process, a private engine-proof
cache. Plain builders are in tests/builders.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import SAMPLE_TEXTS, shared_file


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA (torch is imported only when such a test exists)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def llama3_dir() -> Path:
    return shared_file("tokenizers/llama3/tokenizer.json").parent


@pytest.fixture(scope="session")
def llama2_dir() -> Path:
    return shared_file("tokenizers/llama2/tokenizer.json").parent


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """The 497 documents of the shared Python-docs corpus."""
    import zstandard

    path = shared_file("corpus/python_docs.jsonl.zst")
    with open(path, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read()
    return [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A small Llama-3-style byte-level BPE tokenizer (uint16 vocab) trained on generated text."""
    from pipeline.examples.stdlib_corpus import train_tokenizer

    texts = SAMPLE_TEXTS * 20 + [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(500)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tiny_tok"), vocab_size=600)


@pytest.fixture
def private_proof_cache(monkeypatch, tmp_path_factory):
    """Engine proofs are remembered in a test-private cache, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
