"""Forked encoding processes of `pipe preprocess` (Linux, gigatoken): the same bytes as one
worker, bad lines named from whichever process met them, and a worker that dies or fails
stops the run with one line, leaving no output under a final name and no process behind."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from pipeline.preprocess import forked
from pipeline.preprocess.encode import DocumentEncoder
from pipeline.preprocess.runner import PreprocessConfig, PreprocessError, preprocess
from pipeline.tokenizer.engines import POOL
from pipeline.tokenizer.tokenizer import load_tokenizer
from tests.builders import file_bytes, write_jsonl

pytestmark = pytest.mark.skipif(not forked.can_fork(), reason="forked workers run on Linux only")


@pytest.fixture
def tok(tiny_tokenizer_dir, private_proof_cache):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert tok.engine == "gigatoken" and tok.forks
    return tok


@pytest.fixture
def encoders_log(tmp_path, monkeypatch) -> Path:
    """A file where every batch encoded appends `pid index` (the forked copies inherit the
    patched encoder, so their batches are logged too)."""
    log = tmp_path / "encoded-by.txt"
    real_call = DocumentEncoder.__call__

    def logged(self, batch, threads=POOL):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {batch.index}\n")
        return real_call(self, batch, threads)

    monkeypatch.setattr(DocumentEncoder, "__call__", logged)
    return log


def encoded_by(log: Path) -> dict[int, int]:
    """Batch index -> pid of the process that encoded it."""
    pairs = [line.split() for line in log.read_text().splitlines()]
    return {int(index): int(pid) for pid, index in pairs}


def records(n: int = 400) -> list[dict]:
    return [
        {
            "text": f"document {i}: value={i * 7} " + "abc " * (i % 40),
            "title": [f"part {j} of {i}" for j in range(i % 3)],  # sentence lists, some empty
        }
        for i in range(n)
    ]


def run(tmp_path: Path, tok, src: Path, name: str, workers: int, **options) -> str:
    prefix = tmp_path / name
    config = PreprocessConfig(
        [str(src)],
        str(prefix),
        json_keys=("text", "title"),
        append_eod=True,
        workers=workers,
        batch_bytes=2048,
        show_progress=False,
        **options,
    )
    preprocess(config, tok)
    return str(prefix)


def outputs(prefix: str) -> list[bytes]:
    files = []
    for key in ("text", "title"):
        files += [*file_bytes(f"{prefix}_{key}_document")]
        files.append(Path(f"{prefix}_{key}_document.sources").read_bytes())
    return files


def outputs_without_sources(prefix: str) -> list[bytes]:
    return [*file_bytes(f"{prefix}_text_document"), *file_bytes(f"{prefix}_title_document")]


def test_forked_workers_write_the_bytes_of_one_worker(tmp_path, tok, encoders_log):
    src = write_jsonl(tmp_path / "in.jsonl", records())
    one = run(tmp_path, tok, src, "one", 1, record_sources=True)
    encoders_log.unlink(missing_ok=True)  # one worker parses and encodes in steps
    three = run(tmp_path, tok, src, "three", 3, record_sources=True)
    assert outputs(three) == outputs(one)
    by = encoded_by(encoders_log)
    assert len(by) > 10 and set(by) == set(range(len(by)))  # every batch encoded once
    helpers = set(by.values()) - {os.getpid()}
    assert len(helpers) == 2  # both forked copies encoded batches
    assert by[0] in helpers  # the first batch always goes to a copy


def test_bad_line_met_by_a_forked_worker_is_named(tmp_path, tok, encoders_log):
    rows = [json.dumps(r) for r in records()]
    rows[1] = '{"text": "unterminated'
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(rows) + "\n")
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:2: malformed JSON"):
        run(tmp_path, tok, src, "stop", 2)
    assert encoded_by(encoders_log)[0] != os.getpid()  # the copy met it
    assert not list(tmp_path.glob("stop*"))
    skipped = run(tmp_path, tok, src, "skip", 2, skip_bad_lines=True)
    assert Path(f"{skipped}_text_document.bin").exists()
    rows.pop(1)
    (tmp_path / "good.jsonl").write_text("\n".join(rows) + "\n")
    assert outputs_without_sources(skipped) == outputs_without_sources(
        run(tmp_path, tok, tmp_path / "good.jsonl", "good", 1)
    )


def test_killed_worker_stops_the_run_cleanly(tmp_path, tok, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", records())
    runner_pid = os.getpid()
    pids = tmp_path / "pids.txt"
    real_call = DocumentEncoder.__call__

    def dies_in_a_copy(self, batch, threads=POOL):
        if os.getpid() != runner_pid:
            pids.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_call(self, batch, threads)

    monkeypatch.setattr(DocumentEncoder, "__call__", dies_in_a_copy)
    with pytest.raises(PreprocessError, match=r"encoding process \(pid \d+, killed by SIGKILL\)"):
        run(tmp_path, tok, src, "out", 2)
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(ProcessLookupError):  # reaped, not left as a zombie
        os.kill(int(pids.read_text()), 0)


def test_error_inside_a_worker_is_reported_in_one_line(tmp_path, tok, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", records())
    runner_pid = os.getpid()
    real_call = DocumentEncoder.__call__

    def fails_in_a_copy(self, batch, threads=POOL):
        if os.getpid() != runner_pid:
            raise RuntimeError("no more memory for the cache")
        return real_call(self, batch, threads)

    monkeypatch.setattr(DocumentEncoder, "__call__", fails_in_a_copy)
    with pytest.raises(PreprocessError) as error:
        run(tmp_path, tok, src, "out", 2)
    assert str(error.value) == (
        "encoding failed in a worker process: RuntimeError: no more memory for the cache"
    )
    assert not list(tmp_path.glob("out*"))
