"""`pipe convert` between our own checkpoints: offline re-layout, streaming writes, safety.

A micro model trained for two steps gives a real training checkpoint (weights, optimizer,
DTensor-free single-process save). Re-laying it out for tp4 x pp2 cuts every tensor-parallel
tensor into four chunks in the DCP metadata, and converting back to tp1 gives bit-identical
tensors; the converted checkpoints are loaded by `pipe train --finetune`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline.convert.commands import convert, parse_size, parse_verify
from pipeline.convert.verify import compare_tensors
from pipeline.train.assembly.run_config import resolve_config
from pipeline.train.loop.trainer import Trainer
from pipeline.weights.pipe_checkpoint import (
    PipeCheckpointSource,
    TargetLayout,
    tensor_chunks,
)
from tests.builders import micro_sets

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _train(run_dir: Path, *extra: str) -> Path:
    """Two steps of the micro model; returns its checkpoint save directory."""
    sets = micro_sets(run_dir, "model.num_layers=4", *extra, iters=2)
    Trainer(resolve_config(None, sets), console=False).train()
    return run_dir / "checkpoints"


def _chunks(directory: Path, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    item = load_dcp_metadata(directory / ".metadata").state_dict_metadata[f"model.{name}"]
    return [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]


def _run(*args: str) -> str:
    result = CliRunner().invoke(convert, [*args, "--quiet"])
    assert result.exit_code == 0, result.output
    return result.output


def test_relayout_round_trip_is_bit_exact_and_trains(tmp_path: Path) -> None:
    original = PipeCheckpointSource(_train(tmp_path / "run"))
    out = _run(
        str(tmp_path / "run" / "checkpoints"),
        "--tp",
        "4",
        "--pp",
        "2",
        "-o",
        str(tmp_path / "tp4pp2"),
    )
    assert "bit-identical" in out
    laid_out = PipeCheckpointSource(tmp_path / "tp4pp2")
    # Column-parallel rows, row-parallel columns, the vocabulary: four chunks; norms whole.
    wq = original.tensors()["layers.0.attention.wq.weight"].shape
    assert _chunks(laid_out.directory, "layers.0.attention.wq.weight") == [
        ((r, 0), (wq[0] // 4, wq[1])) for r in range(0, wq[0], wq[0] // 4)
    ]
    wo = original.tensors()["layers.1.attention.wo.weight"].shape
    columns = [
        offsets[1] for offsets, _ in _chunks(laid_out.directory, "layers.1.attention.wo.weight")
    ]
    assert columns == list(range(0, wo[1], wo[1] // 4))
    assert len(_chunks(laid_out.directory, "tok_embeddings.weight")) == 4
    assert len(_chunks(laid_out.directory, "layers.0.ffn_norm.weight")) == 1
    assert laid_out.metadata["layout"] == {"tp": 4, "pp": 2, "ep": 1, "cp": 1, "dp": 1}

    _run(str(tmp_path / "tp4pp2"), "-o", str(tmp_path / "tp1"))
    back = PipeCheckpointSource(tmp_path / "tp1")
    assert compare_tensors(original, back) == len(original.tensors())
    assert _chunks(back.directory, "layers.0.attention.wq.weight") == [((0, 0), wq)]

    # A converted (weights-only) checkpoint starts a run with --finetune.
    sets = micro_sets(tmp_path / "ft", "model.num_layers=4", iters=2)
    sets += [f"checkpoint.load={tmp_path / 'tp4pp2'}", "checkpoint.finetune=true"]
    trainer = Trainer(resolve_config(None, sets), console=False)
    expected = original.read("layers.2.feed_forward.w2.weight")
    assert torch.equal(trainer.model.layers["2"].feed_forward.w2.weight.detach(), expected)


def test_tied_embeddings_keep_one_tensor_and_finetune(tmp_path: Path) -> None:
    tied = ["model.tie_word_embeddings=true"]
    source = PipeCheckpointSource(_train(tmp_path / "run", *tied))
    assert "output.weight" not in source.tensors()
    _run(str(tmp_path / "run" / "checkpoints"), "-o", str(tmp_path / "out"), "--dtype", "bf16")
    converted = PipeCheckpointSource(tmp_path / "out")
    embedding = converted.read("tok_embeddings.weight")
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, source.read("tok_embeddings.weight").bfloat16())
    sets = micro_sets(tmp_path / "ft", "model.num_layers=4", *tied, iters=2)
    sets += [f"checkpoint.load={tmp_path / 'out'}", "checkpoint.finetune=true"]
    model = Trainer(resolve_config(None, sets), console=False).model
    assert model.output.weight is model.tok_embeddings.weight


def test_trained_checkpoint_goes_to_hf_in_bf16_by_default(tmp_path: Path) -> None:
    """A trained checkpoint (fp32 master weights) becomes a bf16 Hugging Face model unless
    --dtype says otherwise, and the summary says why."""
    pytest.importorskip("transformers")
    ckpt = _train(tmp_path / "run")
    out = _run(str(ckpt), "--to", "hf", "-o", str(tmp_path / "hf"), "--verify", "off")
    assert "in bfloat16, the default for a trained checkpoint (--dtype to change)" in out
    config = (tmp_path / "hf" / "config.json").read_text()
    assert '"torch_dtype": "bfloat16"' in config
    out = _run(
        str(ckpt), "--to", "hf", "-o", str(tmp_path / "hf32"), "--dtype", "fp32", "--verify", "off"
    )
    assert "in float32, as --dtype asked;" in out


def test_tensor_chunks_follow_torch_chunk_sizes() -> None:
    layout = TargetLayout(tp=4, ep=2)
    # Uneven vocabulary: ceil(10 / 4) = 3 rows per rank, the last rank 1.
    assert [s for _, s in tensor_chunks("output.weight", (10, 8), layout)] == [
        (3, 8),
        (3, 8),
        (3, 8),
        (1, 8),
    ]
    assert tensor_chunks("layers.0.moe.experts.w2", (4, 8, 16), layout) == [
        ((0, 0, 0), (2, 8, 16)),
        ((2, 0, 0), (2, 8, 16)),
    ]
    assert tensor_chunks("layers.0.moe.router.weight", (4, 8), layout) == [((0, 0), (4, 8))]


def test_cli_refuses_bad_requests(tmp_path: Path) -> None:
    ckpt = _train(tmp_path / "run")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    result = CliRunner().invoke(convert, [str(ckpt), "-o", str(tmp_path / "full")])
    assert result.exit_code == 2 and "--overwrite" in result.output
    result = CliRunner().invoke(
        convert, [str(ckpt), "-o", str(tmp_path / "h"), "--to", "hf", "--tp", "2"]
    )
    assert result.exit_code == 2 and "no layout" in result.output
    result = CliRunner().invoke(convert, [str(tmp_path / "full"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "full" in result.output  # not a checkpoint: named
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500 MB") == 5 * 10**8
    assert parse_verify("layers=2") == ("on", 2) and parse_verify("off") == ("off", None)
