"""`pipe train --load CKPT` and the model CKPT records: an imported Hugging Face model
fine-tunes with no sizes typed by hand, and a run whose model has other shapes is refused in
one line naming the fields, before any tensor is read.

The Hugging Face model is a tiny Llama made by transformers (random weights) whose sizes are
unlike the `tiny` recipe's: width 48, 2 layers, 640 tokens, tied embeddings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.train.assembly.run_config import check_config, resolve_config
from pipeline.train.config.schema import ConfigError
from pipeline.train.state.checkpoint_model import check_checkpoint_model
from pipeline.weights.pipe_checkpoint import PipeCheckpointSource
from tests.builders import ROOT, write_jsonl

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HF_SIZES = dict(
    vocab_size=640,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """`pipe convert --from hf` of a tiny random Llama saved by transformers."""
    directory = tmp_path_factory.mktemp("imported")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).save_pretrained(
        directory / "hf"
    )
    result = CliRunner().invoke(
        cli, ["convert", str(directory / "hf"), "--from", "hf", "-o", str(directory / "ckpt"), "-q"]
    )
    assert result.exit_code == 0, result.output
    return directory / "ckpt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_tokenizer_dir: Path) -> str:
    """A `.bin/.idx` prefix made by `pipe preprocess` with a 600-token tokenizer."""
    directory = tmp_path_factory.mktemp("corpus")
    docs = [{"text": f"line {i}: value={i * 7} {'abc' * (i % 5)} the end."} for i in range(3000)]
    src = write_jsonl(directory / "docs.jsonl", docs)
    result = CliRunner().invoke(
        cli,
        [
            "preprocess",
            "-i",
            str(src),
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "-o",
            str(directory / "corpus"),
            "--append-eod",
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    return str(directory / "corpus_text_document")


def _pipe_train(*args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline train ARGS` as a user runs it: its own process, output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_finetune_an_imported_model_with_no_sizes_given(imported, corpus, tmp_path) -> None:
    """convert --from hf, then train --load --finetune: the run builds the recorded model,
    starts from its weights, trains and saves a checkpoint of the same model."""
    run_dir = tmp_path / "run"
    flags = ["--finetune", "--iters", "2", "--device", "cpu", "--seq-length", "32"]
    done = _pipe_train("--load", str(imported), "--data", corpus, "--run-dir", str(run_dir), *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert 'flavor = "checkpoint"' in (run_dir / "config.toml").read_text()

    start, trained = PipeCheckpointSource(imported), PipeCheckpointSource(run_dir / "checkpoints")
    assert trained.metadata["iteration"] == 2
    assert dataclasses.asdict(trained.model_config) == dataclasses.asdict(start.model_config)
    assert trained.model_config.hidden_size == 48 and trained.model_config.tie_word_embeddings
    # Two AdamW steps at lr <= 3e-4 move each weight by about 1e-3 at most: the run started
    # from the imported weights (a fresh init would be ~0.02 away), and it did train.
    name = "layers.1.feed_forward.w2.weight"
    moved = (trained.read(name) - start.read(name).float()).abs().max()
    assert 0 < moved < 2e-3


def test_a_recipe_model_of_other_shapes_is_refused_in_one_line(imported, corpus) -> None:
    refused_dir = imported.parent / "refused"
    args = ["--recipe", "tiny", "--load", str(imported), "--data", corpus, "--device", "cpu"]
    done = _pipe_train(*args, "--run-dir", str(refused_dir))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "Size mismatch" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: checkpoint {imported / 'iter_0000000'} was saved with model.vocab_size=640, "
        "model.hidden_size=48, model.num_layers=2, model.head_dim=12, model.ffn_hidden_size=80, "
        "model.tie_word_embeddings=True; this run has 8192, 128, 4, 32, 352, False "
        "(--set model.flavor=checkpoint trains the checkpoint's model)"
    ], done.stderr
    assert not refused_dir.exists()  # refused before the run started


def test_which_runs_take_the_checkpoint_model(imported, tmp_path) -> None:
    """Nothing names a model -> the checkpoint's (other model.* settings adjust it); a recipe's
    [model] table or --set model.flavor names one; the checkpoint flavor needs a checkpoint."""
    load = {"load": str(imported)}
    recorded = PipeCheckpointSource(imported).model_config
    cfg = resolve_config(None, ["model.max_position_embeddings=128"], load, validate=False)
    assert cfg.model.flavor == "checkpoint"
    assert cfg.model_config() == dataclasses.replace(recorded, max_position_embeddings=128)
    assert resolve_config("tiny", [], load, validate=False).model.flavor == "tiny"
    named = resolve_config(None, ["model.flavor=tiny_moe"], load, validate=False)
    assert named.model.flavor == "tiny_moe"
    explicit = resolve_config("tiny", ["model.flavor=checkpoint"], load, validate=False)
    assert explicit.model_config() == recorded
    # A run that saves where it loads finds nothing the first time: the default model.
    empty = resolve_config(None, [], {"load": str(tmp_path)}, validate=False)
    assert empty.model.flavor == "tiny"
    with pytest.raises(ConfigError, match=f"{tmp_path} holds no checkpoint yet"):
        resolve_config(None, ["model.flavor=checkpoint"], {"load": str(tmp_path)}).model_config()


def test_shape_preserving_changes_are_logged_not_refused(imported, caplog) -> None:
    recorded = PipeCheckpointSource(imported).model_config.rope_theta
    cfg = resolve_config(None, ["model.rope_theta=1234.0"], {"load": str(imported)}, validate=False)
    with caplog.at_level(logging.WARNING, logger="pipeline.train.state.checkpoint_model"):
        check_checkpoint_model(cfg)
    assert f"was saved with model.rope_theta={recorded}; this run uses 1234.0" in caplog.text
    wider = resolve_config(None, ["model.num_layers=3"], {"load": str(imported)}, validate=False)
    with pytest.raises(ConfigError, match=r"model.num_layers=2; this run has 3 \("):
        check_checkpoint_model(wider)


def test_the_loaded_checkpoint_is_read_once(imported, monkeypatch) -> None:
    """`resolve_config` reads the checkpoint's `pipe_metadata.json` once; validating, the model,
    the shape check and the dry-run report read it no more."""
    import pipeline.checkpoint.loader as loader
    from pipeline.train.report.estimates import dry_run_report

    reads, original = [], loader.read_pipe_metadata
    monkeypatch.setattr(loader, "read_pipe_metadata", lambda d: reads.append(d) or original(d))
    cfg = resolve_config(None, ["data.mock=true"], {"load": str(imported)})
    check_config(cfg, world_size=1)
    check_checkpoint_model(cfg)
    assert cfg.model_config().hidden_size == HF_SIZES["hidden_size"]
    dry_run_report(cfg, world_size=1)
    assert reads == [imported / "iter_0000000"]
