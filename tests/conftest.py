"""Shared fixtures: paths to ../shared/data, a tiny tokenizer trained in-process, and a
megatron-core oracle that writes what Megatron's preprocess_data.py would write."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA (torch is imported only when such a test exists)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def shared_file(relative: str) -> Path:
    """A file under ../shared/data, or skip the test when the folder is absent (a user's clone)."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not found (../shared/data sits beside the checkout in CI only)")
    return path


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


SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "日本語のテキストと中文文本，还有한국어.",
    "emoji 👩‍👩‍👧‍👦 and 🎉🎉 plus café naïve",
    "   leading and trailing spaces   \t\t\n\r\n",
    "numbers 1234567890 3.14159 1e-10",
    "",
    "DON'T stop; we're here, they'll go",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A small Llama-3-style byte-level BPE tokenizer (uint16 vocab) trained on generated text."""
    from pipeline.examples.stdlib_corpus import train_tokenizer

    texts = SAMPLE_TEXTS * 20 + [f"line {i}: value={i * 7} {'abc' * (i % 5)}" for i in range(500)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tiny_tok"), vocab_size=600)


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


@contextmanager
def quiet_megatron() -> Iterator[None]:
    """Import megatron-core modules inside this block without its warnings (no TE or Apex on a
    CPU), or skip the test when megatron-core is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        except ImportError:
            pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core)")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def megatron_builder():
    """megatron-core's IndexedDatasetBuilder/IndexedDataset, or skip when not installed."""
    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    return IndexedDatasetBuilder, IndexedDataset


def megatron_preprocess(documents: list, encode, eod: int | None, dtype, prefix: Path) -> str:
    """What Megatron's preprocess_data.py writes (document level) for `documents`, each a string
    or a list of sentences: empty sentences dropped, EOD appended to the last sentence of a
    non-empty document when `eod` is given, one `add_document` per document."""
    builder_cls, _ = megatron_builder()
    builder = builder_cls(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        sentences = [doc] if isinstance(doc, str) else doc
        ids = [encode(s) for s in sentences]
        ids = [x for x in ids if x]
        if ids and eod is not None:
            ids[-1] = ids[-1] + [eod]
        flat = [t for x in ids for t in x]
        builder.add_document(flat, [len(x) for x in ids])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def file_bytes(prefix: str | os.PathLike) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def micro_model_config(**overrides):
    """The micro dense model the parallel tests compare against one device: 2 layers, hidden 32,
    4 heads over 2 kv heads, ffn 64, vocab 128 (fp32-sized for gloo on 2 cores)."""
    from pipeline.core.model.config import ModelConfig

    fields = dict(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
    )
    return ModelConfig(**(fields | overrides))
