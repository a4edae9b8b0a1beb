"""Fixtures the export tests share across modules: the tokenized corpus and the briefly trained
model of each family, each built once per session (training is most of these tests' time)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import export_family, tokenized_corpus, train_briefly


@pytest.fixture(scope="session")
def corpus_prefix(corpus_texts, tmp_path_factory) -> Path:
    """The shared corpus tokenized with a 512-token BPE trained on it (a .bin/.idx prefix)."""
    return tokenized_corpus(corpus_texts, tmp_path_factory.mktemp("export_corpus"))


@pytest.fixture(scope="session")
def trained_family(corpus_prefix, tmp_path_factory) -> Callable[[str], tuple[str, Path]]:
    """name -> (HF architecture, a Hugging Face directory of that family's tiny model trained
    briefly on the corpus), trained on first use only."""
    from pipeline.export.calibration import calibration_sequences
    from pipeline.weights.hf_writer import write_hf
    from pipeline.weights.source import InMemorySource

    trained: dict[str, tuple[str, Path]] = {}

    def get(name: str) -> tuple[str, Path]:
        if name not in trained:
            architecture, config = export_family(name)
            tokens = calibration_sequences(corpus_prefix, 10**9, 1).flatten()
            model = train_briefly(config, tokens)
            state = {n: t.detach() for n, t in model.state_dict().items()}
            source = InMemorySource(config, state, {"hf_architecture": architecture})
            directory = tmp_path_factory.mktemp(name) / "hf"
            trained[name] = architecture, write_hf(source, directory)
        return trained[name]

    return get
