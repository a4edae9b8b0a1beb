"""Damaged inputs of every kind are refused through the CLI with one line naming the file.

Checkpoints: every command that reads a pipe checkpoint checks each file against the SHA-256
in `pipe_metadata.json` while reading it (`--no-verify-checksums` skips that), so a flipped
byte anywhere in a shard, even in optimizer state a conversion never uses, is refused before
anything is written under the final output name. Truncated shards, `.metadata`, safetensors,
`.bin/.idx` and tokenizer files are named too, and no traceback reaches the user.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.checkpoint.layout import CheckpointError
from pipeline.checkpoint.verified_files import VerifiedFiles, owner_of
from pipeline.cli import cli
from tests.builders import SAMPLE_TEXTS, micro_sets, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _invoke(*args: str) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_refused(result, path: Path, what: str = "") -> None:
    """Exit code != 0 through click (no stray exception), no traceback, and exactly one
    `Error:` line, naming `path` (and saying `what`)."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if "Error" in line]
    assert len(errors) == 1, result.output
    assert str(path) in errors[0] and what in errors[0], errors[0]


# --- pipe checkpoints -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A micro model's two-step training checkpoint (weights, optimizer; one shard file)."""
    from pipeline.train.assembly.run_config import resolve_config
    from pipeline.train.loop.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("trained")
    Trainer(resolve_config(None, micro_sets(run_dir, iters=2)), console=False).train()
    return run_dir / "checkpoints"


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint save dir and its shard file."""
    save_dir = shutil.copytree(trained, tmp_path / "ckpt")
    return save_dir, next(save_dir.glob("iter_*/__0_0.distcp"))


def _item_offset(shard: Path, prefix: str) -> int:
    """Byte offset of the first DCP item whose name starts with `prefix` in the shard."""
    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    metadata = load_dcp_metadata(shard.parent / ".metadata")
    return min(
        info.offset + info.length // 2
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith(prefix) and info.relative_path == shard.name
    )


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _train_args(run_dir: Path) -> list[str]:
    return [f"--set={s}" for s in micro_sets(run_dir, iters=2)]


def test_flipped_model_byte_refused_by_convert_export_and_train(trained, tmp_path) -> None:
    save_dir, shard = _copy(trained, tmp_path)
    _flip(shard, _item_offset(shard, "model.layers.1."))
    hf, trt, relaid = tmp_path / "hf", tmp_path / "trt", tmp_path / "tp2"
    assert_refused(_invoke("convert", save_dir, "--to", "hf", "-o", hf, "-q"), shard, "SHA-256")
    assert not hf.exists() and not list(tmp_path.glob(".hf.tmp-*"))
    assert_refused(_invoke("convert", save_dir, "--tp", "2", "-o", relaid, "-q"), shard, "SHA-256")
    assert not (relaid / "iter_0000000").exists() and not (relaid / "latest").exists()
    assert_refused(_invoke("export", save_dir, "--trtllm", "-o", trt, "-q"), shard, "SHA-256")
    assert not trt.exists() and not list(tmp_path.glob(".trt.tmp-*"))
    for mode in (["--finetune"], []):
        run_dir = tmp_path / f"run{len(mode)}"
        result = _invoke("train", *_train_args(run_dir), "--load", save_dir, *mode)
        assert_refused(result, shard, "SHA-256")
        assert not list(run_dir.glob("checkpoints/iter_*"))

    # --no-verify-checksums reads it anyway (the damage goes through, as asked).
    result = _invoke("convert", save_dir, "--to", "hf", "-o", hf, "-q", "--no-verify-checksums")
    assert result.exit_code == 0, result.output


def test_flipped_byte_in_optimizer_state_refused_by_convert(trained, tmp_path) -> None:
    """Convert reads only the weights, but every byte of each file it reads is hashed."""
    save_dir, shard = _copy(trained, tmp_path)
    _flip(shard, _item_offset(shard, "optimizer."))
    result = _invoke("convert", save_dir, "--to", "hf", "-o", tmp_path / "hf", "-q")
    assert_refused(result, shard, "SHA-256")
    assert not (tmp_path / "hf").exists()


def test_truncated_shard_named_with_and_without_checksums(trained, tmp_path) -> None:
    save_dir, shard = _copy(trained, tmp_path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])
    out = tmp_path / "hf"
    assert_refused(_invoke("convert", save_dir, "--to", "hf", "-o", out, "-q"), shard, "records")
    result = _invoke("convert", save_dir, "--to", "hf", "-o", out, "-q", "--no-verify-checksums")
    assert_refused(result, shard, "truncated")
    result = _invoke(
        "train", *_train_args(tmp_path / "run"), "--load", save_dir, "--no-verify-checksums"
    )
    assert_refused(result, shard, "truncated")
    assert not out.exists()


def test_damaged_item_without_checksums_names_the_file(trained, tmp_path) -> None:
    """Garbage inside an item (no checksum to catch it) is torch's zip error, with the file."""
    save_dir, shard = _copy(trained, tmp_path)
    data = bytearray(shard.read_bytes())
    data[:64] = b"\xff" * 64  # the first item's zip header
    shard.write_bytes(bytes(data))
    result = _invoke(
        "convert", save_dir, "--to", "hf", "-o", tmp_path / "hf", "-q", "--no-verify-checksums"
    )
    assert_refused(result, shard, "cannot read model.")


def test_truncated_dcp_metadata(trained, tmp_path) -> None:
    save_dir, shard = _copy(trained, tmp_path)
    metadata = shard.parent / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    out = tmp_path / "hf"
    assert_refused(_invoke("convert", save_dir, "--to", "hf", "-o", out, "-q"), metadata)
    result = _invoke("export", save_dir, "--trtllm", "-o", out, "-q", "--no-verify-checksums")
    assert_refused(result, metadata, "unreadable DCP metadata")
    assert not out.exists()


def test_verified_files_hash_each_byte_once_in_any_read_order(tmp_path) -> None:
    """Reads out of order, with gaps never read and a tail, verify against the file's SHA-256
    and serve the right bytes; skipped wanted ranges are kept, not read again."""
    payload = bytes(range(256)) * 40
    (tmp_path / "a.distcp").write_bytes(payload)
    record = {"a.distcp": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    files = VerifiedFiles(tmp_path, record)
    files.want({"a.distcp": [(100, 50), (1000, 300), (5000, 20)]})
    assert files.read("a.distcp", 1000, 300) == payload[1000:1300]
    with open(tmp_path / "a.distcp", "r+b") as handle:  # already hashed: only the kept copy
        handle.seek(100)  # of these bytes can be served now
        handle.write(b"\0" * 50)
    assert files.read("a.distcp", 100, 50) == payload[100:150]
    assert files.read("a.distcp", 5000, 20) == payload[5000:5020]  # completes the file: OK

    (tmp_path / "a.distcp").write_bytes(payload[:-1] + b"\1")
    files = VerifiedFiles(tmp_path, record)
    files.want({"a.distcp": [(0, 10)]})
    with pytest.raises(CheckpointError, match=r"a\.distcp: SHA-256 differs"):
        files.read("a.distcp", 0, 10)  # the damage is in the tail, hashed on completion


def test_each_data_file_has_one_owner_rank() -> None:
    names = [f"__{r}_0.distcp" for r in range(12)]
    owners = owner_of(names, 4)
    assert [owners[f"__{r}_0.distcp"] for r in range(12)] == [r % 4 for r in range(12)]
    converted = owner_of([f"__0_{i}.distcp" for i in range(5)], 2)
    assert sorted(converted.values()) == [0, 0, 0, 1, 1]


# --- Hugging Face imports -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from tests.builders import export_hf_model as hf_model

    directory = tmp_path_factory.mktemp("hf") / "model"
    hf_model("llama3").save_pretrained(directory, max_shard_size="50KB")
    return directory


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "shard"])
def test_damaged_hf_files_named(hf_dir, name, tmp_path) -> None:
    directory = shutil.copytree(hf_dir, tmp_path / "hf")
    target = (
        sorted(directory.glob("model-*.safetensors"))[1] if name == "shard" else (directory / name)
    )
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2] + b"\xff")
    out = tmp_path / "ckpt"
    result = _invoke("convert", directory, "--from", "hf", "-o", out, "-q")
    assert_refused(result, target)
    assert not list(out.glob("iter_*"))


# --- .bin/.idx datasets and tokenizers ------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A small preprocessed `.bin/.idx` prefix."""
    root = tmp_path_factory.mktemp("data")
    records = [{"text": text * 5} for text in SAMPLE_TEXTS * 10]
    write_jsonl(root / "in.jsonl", records)
    result = _invoke(
        "preprocess",
        "-i",
        root / "in.jsonl",
        "-o",
        root / "c",
        "--append-eod",
        "--tokenizer",
        tiny_tokenizer_dir,
        "--workers",
        "1",
    )
    assert result.exit_code == 0, result.output
    return root / "c_text_document"


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_truncated_bin_and_idx_named(dataset, suffix, tmp_path) -> None:
    prefix = tmp_path / dataset.name
    for ext in (".bin", ".idx"):
        shutil.copy(f"{dataset}{ext}", f"{prefix}{ext}")
    shutil.copy(dataset.parent / "c.json", tmp_path / "c.json")  # the preprocess manifest
    damaged = Path(f"{prefix}{suffix}")
    damaged.write_bytes(damaged.read_bytes()[:-3])
    assert_refused(_invoke("inspect", prefix), damaged, "bytes")
    merged = tmp_path / "merged"
    assert_refused(_invoke("merge", "-i", prefix, "-o", merged), damaged, "bytes")
    assert not list(tmp_path.glob("merged*"))
    args = [f"--set={s}" for s in micro_sets(tmp_path / "run", "model.vocab_size=600")]
    result = _invoke("train", *args, "--set", "data.mock=false", "--data", prefix)
    assert_refused(result, damaged, "bytes")


def _tokenizer_copy(tiny_tokenizer_dir: Path, tmp_path: Path, kind: str) -> Path:
    """The tiny tokenizer as tokenizer.json, as GPT-2 vocab.json + merges.txt, or an empty
    directory for a SentencePiece model."""
    directory = tmp_path / "tok"
    if kind == "hf":
        return shutil.copytree(tiny_tokenizer_dir, directory)
    directory.mkdir()
    if kind == "sp":  # the test writes its tokenizer.model
        return directory
    spec = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (directory / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    text = "#version: 0.2\n" + "\n".join(merges) + "\n"
    (directory / "merges.txt").write_text(text, encoding="utf-8")
    return directory


@pytest.mark.parametrize(
    "kind, name, damage",
    [
        ("hf", "tokenizer.json", "garbage"),
        ("hf", "tokenizer.json", "cut"),
        ("hf", "tokenizer_config.json", "garbage"),
        ("gpt2", "merges.txt", "cut"),
        ("gpt2", "merges.txt", "empty"),
        ("gpt2", "vocab.json", "cut"),
        ("sp", "tokenizer.model", "garbage"),
    ],
)
def test_damaged_tokenizer_files_named(tiny_tokenizer_dir, kind, name, damage, tmp_path) -> None:
    if kind == "sp":
        pytest.importorskip("sentencepiece")
    directory = _tokenizer_copy(tiny_tokenizer_dir, tmp_path, kind)
    target = directory / name
    original = target.read_bytes() if target.exists() else b""
    target.write_bytes(
        {"garbage": b"\xff\xfe\x00 not a tokenizer", "empty": b""}.get(damage)
        or original[: len(original) // 2 - 1].rstrip(b"\n")  # cut inside a line
    )
    write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}])
    result = _invoke(
        "preprocess",
        "-i",
        tmp_path / "in.jsonl",
        "-o",
        tmp_path / "c",
        "--tokenizer",
        directory,
        "--workers",
        "1",
    )
    assert_refused(result, target)
    assert not list(tmp_path.glob("c_*"))
