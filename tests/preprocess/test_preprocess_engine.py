"""The encoding engine of `pipe preprocess`: gigatoken proven against the reference library at
load (fallback with a one-line note, refusal when forced, proofs remembered per file contents),
the vectorized document packing against Megatron's rule, `--record-sources`, and a merge of
hundreds of shards in bounded memory."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.indexed import IndexedDatasetWriter
from pipeline.data.sources import read_sources
from pipeline.preprocess.encode import pack_documents
from pipeline.tokenizer.tokenizer import TokenizerError, load_tokenizer
from tests.builders import (
    SAMPLE_TEXTS,
    file_bytes,
    megatron_builder,
    megatron_preprocess,
    run_pipe,
    write_jsonl,
)


@pytest.fixture(autouse=True)
def private_proof_cache(monkeypatch, tmp_path):
    """Each test starts with no remembered engine proof."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def modified_tokenizer(source: Path, target: Path, change) -> Path:
    """A copy of a tokenizer directory with `change(tokenizers.Tokenizer)` applied."""
    from tokenizers import Tokenizer

    shutil.copytree(source, target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    change(tok)
    tok.save(str(target / "tokenizer.json"))
    return target


def add_digit_splitting(tok) -> None:
    """A pre-tokenizer gigatoken loads but does not apply: only the self-test can tell."""
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer]
    )


def test_engine_that_disagrees_is_refused_and_the_reference_runs(tmp_path, tiny_tokenizer_dir):
    tokdir = modified_tokenizer(tiny_tokenizer_dir, tmp_path / "tok", add_digit_splitting)
    loaded = load_tokenizer(tokdir)
    assert loaded.engine == "tokenizers"
    assert "gigatoken not used: it differs from tokenizers on self-test text" in loaded.engine_note
    with pytest.raises(TokenizerError, match="the gigatoken engine cannot be used"):
        load_tokenizer(tokdir, engine="gigatoken")
    docs = SAMPLE_TEXTS + ["version 12345 of 678"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    result = run_pipe(
        "preprocess", "-i", src, "--tokenizer", tokdir, "-o", tmp_path / "out", "--append-eod"
    )
    notice = [line for line in result.output.splitlines() if "engine tokenizers" in line]
    assert len(notice) == 1 and "gigatoken not used" in notice[0]
    from tokenizers import Tokenizer

    oracle = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    encode = lambda t: oracle.encode(t, add_special_tokens=False).ids  # noqa: E731
    expected = megatron_preprocess(docs, encode, loaded.eod, np.uint16, tmp_path / "meg")
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)


def test_tokenizer_gigatoken_cannot_load_falls_back_with_one_line_note(
    tmp_path, tiny_tokenizer_dir
):
    from tokenizers import normalizers

    def lowercase(tok) -> None:
        tok.normalizer = normalizers.Lowercase()

    tokdir = modified_tokenizer(tiny_tokenizer_dir, tmp_path / "tok", lowercase)
    loaded = load_tokenizer(tokdir)
    assert loaded.engine == "tokenizers"
    assert loaded.engine_note.startswith("gigatoken not used: gigatoken cannot load it")
    assert "\n" not in loaded.engine_note
    assert loaded.encode_batch(["ABC abc"]) == [
        loaded._reference().tokenizer.encode("ABC abc", add_special_tokens=False).ids
    ]


def test_proof_is_remembered_for_the_same_file_contents_only(
    tmp_path, tiny_tokenizer_dir, monkeypatch
):
    import tokenizers

    tokdir = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, tokdir)
    assert load_tokenizer(tokdir).engine == "gigatoken"
    assert len(list((tmp_path / "cache" / "pipe" / "engine-proofs").iterdir())) == 1

    def no_reference(*_args, **_kwargs):
        raise AssertionError("the reference library was loaded")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", no_reference)
    assert load_tokenizer(tokdir).engine == "gigatoken"  # proven before: no reference needed
    # One flag of an added token changed: another file, so a new proof (the reference loads).
    spec = json.loads((tokdir / "tokenizer.json").read_text())
    spec["added_tokens"][0]["normalized"] = not spec["added_tokens"][0]["normalized"]
    (tokdir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match="reference library was loaded"):
        load_tokenizer(tokdir)


def test_sentencepiece_byte_fallback_model_runs_on_gigatoken(tmp_path):
    import sentencepiece as spm

    text = tmp_path / "train.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:6] * 50 + [f"sentence number {i}" for i in range(300)]))
    spm.SentencePieceTrainer.train(  # Llama 2's settings
        input=str(text),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    docs = SAMPLE_TEXTS + ["unseen: ÆØÅ ж 漢字 🚀 \x07", "  two  spaces  ", "<s> and </s> as text"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    run_pipe(
        "preprocess",
        "-i",
        src,
        "--tokenizer",
        tmp_path / "sp.model",
        "-o",
        tmp_path / "out",
        "--append-eod",
        "-q",
    )
    assert json.loads((tmp_path / "out.json").read_text())["tokenizer"]["engine"] == "gigatoken"
    expected = megatron_preprocess(docs, sp.encode, sp.eos_id(), np.uint16, tmp_path / "meg")
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)


def test_gpt2_files_run_on_gigatoken(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        SAMPLE_TEXTS * 30, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False
    )
    trainer.save_model(str(tmp_path))
    assert load_tokenizer(tmp_path / "vocab.json").engine == "gigatoken"


def test_gigatoken_threads_each_encode_a_batch_of_their_own(
    tmp_path, tiny_tokenizer_dir, monkeypatch
):
    """Where no process can be forked (macOS, Windows), `workers` threads encode different
    batches at the same time with gigatoken, each on its own thread (never gigatoken's pool,
    whose per-batch barrier idles cores), and the output is byte for byte that of one worker."""
    import threading

    from pipeline.preprocess import forked
    from pipeline.preprocess.runner import PreprocessConfig, preprocess
    from pipeline.tokenizer import engines

    monkeypatch.setattr(forked, "can_fork", lambda: False)

    records = [{"text": f"document {i}: value={i * 7} " + "abc " * (i % 40)} for i in range(600)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert tok.engine == "gigatoken"

    def run(name: str, workers: int) -> tuple[bytes, bytes]:
        prefix = tmp_path / name
        config = PreprocessConfig(
            [str(src)], str(prefix), workers=workers, batch_bytes=16384, show_progress=False
        )
        preprocess(config, tok)
        return file_bytes(f"{prefix}_text_document")

    one_worker = run("one", 1)
    both_encoding = threading.Barrier(2, timeout=20)
    pool_used = []
    real_encode_batch = engines.GigatokenEngine._encode_batch

    def encode_batch(self, texts, parallel=True):
        pool_used.append(parallel)
        if len(pool_used) <= 2:
            both_encoding.wait()  # passes only while two batches are being encoded at once
        return real_encode_batch(self, texts, parallel)

    monkeypatch.setattr(engines.GigatokenEngine, "_encode_batch", encode_batch)
    assert run("two", 2) == one_worker
    assert len(pool_used) >= 3 and not any(pool_used)


@pytest.mark.parametrize("eod", [None, 7])
@pytest.mark.parametrize("one_sentence_each", [True, False])
def test_pack_documents_follows_megatron(eod, one_sentence_each):
    """Vectorized packing against the per-document rule: empty sentences dropped, EOD after the
    last kept sentence of a document with tokens, empty documents kept with no sequence."""
    rng = np.random.default_rng(0)
    counts = [1] * 40 if one_sentence_each else rng.integers(0, 4, 40).tolist()
    lengths = rng.integers(0, 3, sum(counts)) * rng.integers(0, 5, sum(counts))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = rng.integers(10, 99, int(offsets[-1])).astype(np.uint32)
    got = pack_documents(flat, offsets, None if one_sentence_each else counts, eod, np.uint16)
    tokens, seq_lengths, per_doc, s = [], [], [], 0
    for count in counts:
        kept = [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(s, s + count)]
        kept = [x for x in kept if x]
        s += count
        if kept and eod is not None:
            kept[-1].append(eod)
        tokens += [t for x in kept for t in x]
        seq_lengths += [len(x) for x in kept]
        per_doc.append(len(kept))
    assert got.tokens.dtype == np.uint16 and got.tokens.tolist() == tokens
    assert got.sequence_lengths.tolist() == seq_lengths
    assert got.sequences_per_document.tolist() == per_doc


def test_record_sources_traces_documents_to_their_lines(tmp_path, tiny_tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_bytes(
        b'{"text": "first"}\n\n{"text": 5}\n{"text": "fourth"}\n   \n{"text": "sixth"}\n'
    )
    pq.write_table(
        pa.Table.from_pylist([{"text": "row one"}, {"text": "row two"}]), tmp_path / "b.parquet"
    )
    run_pipe(
        "preprocess",
        "-i",
        tmp_path / "a.jsonl",
        tmp_path / "b.parquet",
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "c",
        "--record-sources",
        "--skip-bad-lines",
        "-q",
    )
    rows = read_sources(tmp_path / "c_text_document")
    assert rows.tolist() == [(0, 1), (0, 4), (0, 6), (1, 1), (1, 2)]
    shown = run_pipe("inspect", tmp_path / "c_text_document", "--show", "5").output
    assert f"--- document 1 (from {tmp_path / 'a.jsonl'}:4) ---\nfourth" in shown
    assert f"--- document 4 (from {tmp_path / 'b.parquet'} row 2) ---\nrow two" in shown
    assert not (tmp_path / "c_text_document.sources").with_suffix(".sources.tmp").exists()


def test_record_sources_of_merged_shards_equal_the_unsharded_run(tmp_path, tiny_tokenizer_dir):
    lines = [json.dumps({"text": f"document {i} " * (i % 7)}) for i in range(400)]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines[:200]) + "\n\n" + "\n".join(lines[200:]) + "\n")
    common = ["--tokenizer", tiny_tokenizer_dir, "--record-sources", "--workers", "1", "-q"]
    run_pipe("preprocess", "-i", big, "-o", tmp_path / "one", *common)
    for index in range(3):
        run_pipe(
            "preprocess",
            "-i",
            big,
            "-o",
            tmp_path / "sh",
            *common,
            "--num-shards",
            "3",
            "--shard-index",
            index,
        )
    run_pipe("merge", "--shards", tmp_path / "sh")
    one = read_sources(tmp_path / "one_text_document")
    assert one["line"][-1] == 401  # the blank line 201 is not a document
    assert read_sources(tmp_path / "sh_text_document").tolist() == one.tolist()


def write_parts(directory: Path, count: int, documents: int) -> list[str]:
    """`count` uint16 datasets of `documents` one-sequence documents each."""
    rng = np.random.default_rng(count)
    prefixes = [str(directory / f"p{i:03d}") for i in range(count)]
    for prefix in prefixes:
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            lengths = rng.integers(1, 4, documents).astype(np.int32)
            tokens = rng.integers(0, 500, int(lengths.sum()))
            writer.add_documents(tokens, lengths, np.ones(documents, np.int32))
            writer.finalize()
    return prefixes


def test_merge_of_hundreds_of_shards_matches_megatron(tmp_path, monkeypatch):
    import gc

    prefixes = write_parts(tmp_path / "parts", 300, 20)
    run_pipe("merge", "--input", tmp_path / "parts", "--output-prefix", tmp_path / "merged")
    # Megatron's add_index runs a full garbage collection per input: seconds each in a test
    # process. Skipping it changes nothing it writes.
    monkeypatch.setattr(gc, "collect", lambda *_: 0)
    builder_cls, _ = megatron_builder()
    builder = builder_cls(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "meg.idx"))
    assert file_bytes(tmp_path / "merged") == file_bytes(tmp_path / "meg")


def test_merge_of_hundreds_of_shards_streams_in_bounded_memory(tmp_path, monkeypatch):
    """300 datasets with 600,000 sequences in all (7 MB of index): the merge never holds more
    than a chunk of the index (Megatron's keeps every input's index in Python lists, and took
    minutes here for what pipe merges in a second)."""
    import pipeline.data.indexed as indexed
    from pipeline.preprocess.merge import merge

    prefixes = write_parts(tmp_path / "parts", 300, 2000)
    monkeypatch.setattr(indexed, "_CHUNK", 1 << 14)

    def peak_bytes(specs: list[str], output: str) -> int:
        tracemalloc.start()
        merge(specs, str(tmp_path / output))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    few = peak_bytes(prefixes[:30], "few")
    peak = peak_bytes([str(tmp_path / "parts")], "all")
    # Ten times the index (0.7 MB -> 7 MB) adds almost nothing to the peak (constant buffers).
    assert peak < few + 500_000, f"merge peak grew from {few:,} to {peak:,} bytes"


def test_manifest_hashes_jsonl_files_as_they_are_read(tmp_path, tiny_tokenizer_dir, monkeypatch):
    """Whole JSONL files (plain, .zst, .gz) are hashed from the bytes read for encoding, not in a
    second pass; other inputs are hashed beside the run. All hashes are the files' SHA-256."""
    import gzip
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from pipeline.preprocess import manifest as manifest_io

    lines = "".join(json.dumps({"text": d}) + "\n" for d in SAMPLE_TEXTS).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    pq.write_table(pa.Table.from_pylist([{"text": "row"}]), tmp_path / "d.parquet")
    hashed_apart = []
    real_hash_inputs = manifest_io.hash_inputs

    def spy(parts):
        hashed_apart.extend(Path(p.file.path).name for p in parts)
        return real_hash_inputs(parts)

    monkeypatch.setattr(manifest_io, "hash_inputs", spy)
    names = ["a.jsonl", "b.jsonl.zst", "c.jsonl.gz", "d.parquet"]
    run_pipe(
        "preprocess",
        "-i",
        *[tmp_path / n for n in names],
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "out",
        "-q",
    )
    assert hashed_apart == ["d.parquet"]
    recorded = [i["sha256"] for i in json.loads((tmp_path / "out.json").read_text())["inputs"]]
    assert recorded == [hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in names]


def test_deeply_nested_line_is_a_bad_line_not_a_traceback(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "ok"}\n{"a": ' + b"[" * 100_000 + b"\n")
    args = ["-i", tmp_path / "in.jsonl", "--tokenizer", tiny_tokenizer_dir, "-o", tmp_path / "o"]
    result = run_pipe("preprocess", *args, "-q", expect_ok=False)
    assert result.exit_code == 1
    assert "in.jsonl:2: malformed JSON: nested too deeply" in result.output
