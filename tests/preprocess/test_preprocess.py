"""`pipe preprocess` end to end: outputs byte-identical to what Megatron's preprocess_data.py
writes (megatron-core's IndexedDatasetBuilder fed independently tokenized documents), every input
and tokenizer kind, bad input, interruption, and refusing to overwrite."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.indexed import IndexedDataset
from tests.builders import (
    SAMPLE_TEXTS,
    file_bytes,
    megatron_builder,
    megatron_preprocess,
    run_pipe,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("private_proof_cache")


def preprocess(src, tokenizer, out, *extra, expect_ok: bool = True):
    """`pipe preprocess -i SRC --tokenizer TOK -o OUT [extra...]`."""
    args = ["preprocess", "-i", src, "--tokenizer", tokenizer, "-o", out, *extra]
    return run_pipe(*args, expect_ok=expect_ok)


def hf_encoder(tokenizer_dir: Path, add_special_tokens: bool = False):
    """Token ids straight from `tokenizers` (the oracle side; never our fast engine)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=add_special_tokens).ids


def varied_documents() -> list[str]:
    return SAMPLE_TEXTS + ["<|end_of_text|> literal special", " " * 300, "x" * 5000, ""]


@pytest.mark.parametrize("workers", [1, 2])
def test_tiny_tokenizer_matches_megatron(tmp_path, tiny_tokenizer_dir, workers):
    docs = varied_documents() * 3
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess(
        src, tiny_tokenizer_dir, tmp_path / "out", "--append-eod", "--workers", workers, "-q"
    )
    expected = megatron_preprocess(
        docs, hf_encoder(tiny_tokenizer_dir), 1, np.uint16, tmp_path / "meg"
    )
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.num_documents == len(docs)
    assert len(ds) == sum(1 for d in docs if d)  # empty documents have no sequence
    _, megatron_dataset = megatron_builder()
    theirs = megatron_dataset(str(tmp_path / "out_text_document"))
    encode = hf_encoder(tiny_tokenizer_dir)
    assert [theirs[i].tolist() for i in range(len(theirs))] == [encode(d) + [1] for d in docs if d]


@pytest.mark.parametrize(
    "name,engine,eod,dtype,count",
    [("llama3", "gigatoken", 128001, np.int32, 120), ("llama2", "gigatoken", 2, np.uint16, 30)],
)
def test_real_tokenizers_on_real_corpus_match_megatron(
    request, tmp_path, corpus_texts, name, engine, eod, dtype, count
):
    """Llama 3 (int32, byte-level BPE) and Llama 2 (uint16, SentencePiece-style BPE with byte
    fallback), both on the gigatoken engine, on real text with --append-eod and 2 workers."""
    tokenizer_dir = request.getfixturevalue(f"{name}_dir")
    docs = corpus_texts[:count] + varied_documents()
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    result = preprocess(src, tokenizer_dir, tmp_path / "out", "--append-eod", "--workers", "2")
    assert f"engine {engine}" in result.output
    expected = megatron_preprocess(docs, hf_encoder(tokenizer_dir), eod, dtype, tmp_path / "meg")
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)


def test_add_special_tokens_applies_post_processing(tmp_path, llama2_dir, tiny_tokenizer_dir):
    docs = ["hello world", "", "second"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess(src, llama2_dir, tmp_path / "l2", "--add-special-tokens", "-q")
    expected = megatron_preprocess(
        docs, hf_encoder(llama2_dir, True), None, np.uint16, tmp_path / "meg"
    )
    assert file_bytes(tmp_path / "l2_text_document") == file_bytes(expected)
    assert IndexedDataset(tmp_path / "l2_text_document")[0][0] == 1  # BOS


def test_fast_engine_with_template_post_processor(tmp_path, llama3_dir):
    """Llama 3 with a BOS template (as Meta's own files have): the gigatoken engine adds the same
    prefix as tokenizers' post-processing."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(llama3_dir / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)]
    )
    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    tok.save(str(tokdir / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in SAMPLE_TEXTS])
    for engine in ("gigatoken", "tokenizers"):
        preprocess(
            src,
            tokdir,
            tmp_path / engine,
            "--add-special-tokens",
            "--tokenizer-engine",
            engine,
            "-q",
        )
    assert file_bytes(tmp_path / "gigatoken_text_document") == file_bytes(
        tmp_path / "tokenizers_text_document"
    )
    assert IndexedDataset(tmp_path / "gigatoken_text_document")[0][0] == 128000


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    text = tmp_path / "train.txt"
    text.write_text("\n".join(SAMPLE_TEXTS[:6] * 50 + [f"sentence number {i}" for i in range(300)]))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=200,
        model_type="bpe",
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    docs = SAMPLE_TEXTS
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess(src, tmp_path / "sp.model", tmp_path / "out", "--append-eod", "-q")
    expected = megatron_preprocess(docs, sp.encode, sp.eos_id(), np.uint16, tmp_path / "meg")
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)
    preprocess(src, tmp_path / "sp.model", tmp_path / "bos", "--add-special-tokens", "-q")
    assert IndexedDataset(tmp_path / "bos_text_document")[0].tolist() == [
        sp.bos_id(),
        *sp.encode(docs[0]),
    ]


def test_gpt2_vocab_and_merges(tmp_path):
    """GPT-2 style vocab.json + merges.txt: <|endoftext|> is the EOD id, text is byte-level BPE."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        SAMPLE_TEXTS * 30, vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False
    )
    trainer.save_model(str(tmp_path))
    oracle = ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    docs = SAMPLE_TEXTS
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess(src, tmp_path / "vocab.json", tmp_path / "out", "--append-eod", "-q")
    eod = oracle.token_to_id("<|endoftext|>")
    expected = megatron_preprocess(
        docs, lambda t: oracle.encode(t).ids, eod, np.uint16, tmp_path / "meg"
    )
    assert file_bytes(tmp_path / "out_text_document") == file_bytes(expected)


def test_several_keys_and_sentence_lists(tmp_path, tiny_tokenizer_dir):
    records = [
        {"text": "body one", "title": "Title one"},
        {"text": ["first sentence.", "", "second sentence."], "title": ""},
        {"text": "", "title": ["a", "b"]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    preprocess(
        src,
        tiny_tokenizer_dir,
        tmp_path / "out",
        "--json-keys",
        "text",
        "title",
        "--append-eod",
        "-q",
    )
    encode = hf_encoder(tiny_tokenizer_dir)
    for key in ("text", "title"):
        expected = megatron_preprocess(
            [r[key] for r in records], encode, 1, np.uint16, tmp_path / f"meg_{key}"
        )
        assert file_bytes(tmp_path / f"out_{key}_document") == file_bytes(expected)
    text = IndexedDataset(tmp_path / "out_text_document")
    assert text.document_indices.tolist() == [0, 1, 3, 3]  # 2 sentences kept, then an empty doc


def test_every_input_kind_gives_the_same_tokens(tmp_path, tiny_tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from datasets import Dataset

    docs = varied_documents()
    records = [{"text": d, "id": i} for i, d in enumerate(docs)]
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "a.json").write_text(json.dumps(records))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "a.parquet")
    Dataset.from_list(records).save_to_disk(str(tmp_path / "hfds"))
    with (
        pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    reference = None
    for name in ("a.jsonl", "a.jsonl.zst", "a.jsonl.gz", "a.json", "a.parquet", "a.arrow", "hfds"):
        out = tmp_path / f"out_{name.replace('.', '_')}"
        preprocess(tmp_path / name, tiny_tokenizer_dir, out, "--append-eod", "-q")
        got = file_bytes(f"{out}_text_document")
        reference = reference or got
        assert got == reference, name


def test_several_inputs_and_globs_keep_order(tmp_path, tiny_tokenizer_dir):
    for i in range(3):
        write_jsonl(tmp_path / f"part{i}.jsonl", [{"text": f"file {i} doc {j}"} for j in range(4)])
    preprocess(tmp_path / "part*.jsonl", tiny_tokenizer_dir, tmp_path / "glob", "-q")
    run_pipe(
        "preprocess",
        "--input",
        tmp_path / "part0.jsonl",
        tmp_path / "part1.jsonl",
        tmp_path / "part2.jsonl",
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "list",
        "-q",
    )
    assert file_bytes(tmp_path / "glob_text_document") == file_bytes(
        tmp_path / "list_text_document"
    )
    manifest = json.loads((tmp_path / "glob.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == [
        f"part{i}.jsonl" for i in range(3)
    ]
    assert manifest["outputs"]["text"]["documents"] == 12


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "broken\n', "in.jsonl:2: malformed JSON"),
    (b'{"text": "ok"}\n{"other": "x"}\n', "in.jsonl:2: missing key 'text'"),
    (b'{"text": 5}\n', "in.jsonl:1: key 'text' is a number, expected a string"),
    (b'{"text": null}\n', "in.jsonl:1: key 'text' is null, expected a string"),
    (b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', "in.jsonl:3: invalid UTF-8"),
    (b'["text"]\n', "in.jsonl:1: expected a JSON object, got a list"),
    (b'{"text": "\\ud800 lone"}\n', "in.jsonl:1: key 'text' holds an unpaired surrogate"),
]


@pytest.mark.parametrize("content,message", BAD_LINES)
def test_bad_input_stops_with_file_and_line(tmp_path, tiny_tokenizer_dir, content, message):
    (tmp_path / "in.jsonl").write_bytes(content)
    result = preprocess(
        tmp_path / "in.jsonl", tiny_tokenizer_dir, tmp_path / "out", "-q", expect_ok=False
    )
    assert result.exit_code == 1
    assert message in result.output
    assert "--skip-bad-lines" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written


def test_skip_bad_lines_counts_and_reports(tmp_path, tiny_tokenizer_dir):
    content = b"".join(c for c, _ in BAD_LINES) + b'{"text": "last good line"}\n'
    (tmp_path / "in.jsonl").write_bytes(content)
    result = preprocess(
        tmp_path / "in.jsonl", tiny_tokenizer_dir, tmp_path / "out", "--skip-bad-lines", "-q"
    )
    assert "skipped 7 bad lines" in result.output
    assert "in.jsonl:2: malformed JSON" in result.output
    manifest = json.loads((tmp_path / "out.json").read_text())
    assert manifest["counts"]["bad_lines"] == 7
    assert manifest["counts"]["blank_lines"] == 1
    good = ["ok", "ok", "ok", "last good line"]
    assert IndexedDataset(tmp_path / "out_text_document").num_documents == len(good)


def test_existing_outputs_refused_unless_overwrite(tmp_path, tiny_tokenizer_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}])
    args = [
        "preprocess",
        "-i",
        src,
        "--tokenizer",
        tiny_tokenizer_dir,
        "-o",
        tmp_path / "out",
        "-q",
    ]
    run_pipe(*args)
    result = run_pipe(*args, expect_ok=False)
    assert "output exists" in result.output and "--overwrite" in result.output
    run_pipe(*args, "--overwrite")


def test_missing_inputs_and_tokenizer_are_named(tmp_path, tiny_tokenizer_dir):
    result = preprocess(
        tmp_path / "nope.jsonl", tiny_tokenizer_dir, tmp_path / "out", expect_ok=False
    )
    assert result.exit_code == 1 and "nope.jsonl" in result.output
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    result = preprocess(src, tmp_path / "missing_tok", tmp_path / "out", expect_ok=False)
    assert result.exit_code == 1 and "missing_tok" in result.output


def _default_sigint() -> None:
    """SIGINT at its default in a child, as from a terminal: a suite run as a background job
    passes SIGINT on ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _open_fifo_for_writing(path: Path, proc: subprocess.Popen) -> int:
    """The write end of FIFO `path`, once `proc` has opened it for reading (fails if it exits)."""
    deadline = time.time() + 60
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            assert proc.poll() is None, proc.communicate()[0]
            assert time.time() < deadline, "the run never opened its input"
            time.sleep(0.02)
            continue
        os.set_blocking(fd, True)
        return fd


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_leaves_no_final_named_file(tmp_path, tiny_tokenizer_dir, sig):
    """Kill a run mid-way: no .bin/.idx/manifest under final names, no temporaries left.

    The input is a FIFO held open after its first documents, so the run is surely mid-way
    (writing has begun, the input has not ended) however fast the engine is. Should the run,
    interrupted, wait on its input, the input is then ended, as the writer of a real pipe would
    be ended by the same Ctrl-C."""
    src = tmp_path / "big.jsonl"
    os.mkfifo(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "preprocess",
        "-i",
        str(src),
        "-q",
        "--workers",
        "2",
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "-o",
        str(out_dir / "c"),
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_default_sigint,
        start_new_session=True,
    )
    with os.fdopen(_open_fifo_for_writing(src, proc), "w") as feed:
        line = json.dumps({"text": " ".join(SAMPLE_TEXTS) * 40}) + "\n"
        feed.write(line * 200)
        feed.flush()
        deadline = time.time() + 60
        while time.time() < deadline and not any(
            p.name.startswith(".c_text_document.bin.tmp-") for p in out_dir.iterdir()
        ):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before its input did"
        if sys.platform.startswith("linux"):
            assert len(_group_members(proc.pid)) == 2  # the run and its forked worker
        proc.send_signal(sig)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(BrokenPipeError):
                feed.close()
            output, _ = proc.communicate(timeout=60)
        with contextlib.suppress(BrokenPipeError, ValueError):
            feed.close()
    assert proc.returncode != 0, output
    assert sorted(p.name for p in out_dir.iterdir()) == [], output
    if sys.platform.startswith("linux"):
        assert _group_members(proc.pid) == []  # no worker outlives the run


def _group_members(group: int) -> list[int]:
    """Processes in process group `group` (Linux /proc; field 5 of stat is the group)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def test_merge_matches_megatron_add_index(tmp_path, tiny_tokenizer_dir):
    encode = hf_encoder(tiny_tokenizer_dir)
    parts = []
    for i in range(3):
        docs = [f"part {i} document {j}" for j in range(5)] + [""]
        parts.append(megatron_preprocess(docs, encode, 1, np.uint16, tmp_path / f"p{i}"))
    run_pipe("merge", "--input", *parts, "--output-prefix", tmp_path / "merged")
    builder_cls, _ = megatron_builder()
    builder = builder_cls(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for prefix in parts:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "meg.idx"))
    assert file_bytes(tmp_path / "merged") == file_bytes(tmp_path / "meg")
    # A directory merges its pairs in sorted name order, as merge_datasets.py does.
    sub = tmp_path / "sub"
    sub.mkdir()
    for i, prefix in enumerate(parts):
        for ext in (".bin", ".idx"):
            os.link(f"{prefix}{ext}", sub / f"p{i}{ext}")
    run_pipe("merge", "--input", sub, "--output-prefix", tmp_path / "from_dir")
    assert file_bytes(tmp_path / "from_dir") == file_bytes(tmp_path / "meg")


def test_merge_refuses_mixed_dtypes(tmp_path, tiny_tokenizer_dir):
    encode = hf_encoder(tiny_tokenizer_dir)
    a = megatron_preprocess(["a"], encode, None, np.uint16, tmp_path / "a")
    b = megatron_preprocess(["b"], encode, None, np.int32, tmp_path / "b")
    result = run_pipe("merge", "-i", a, b, "-o", tmp_path / "m", expect_ok=False)
    assert result.exit_code == 1 and "different dtypes" in result.output
    assert "b.idx (int32)" in result.output
    assert not (tmp_path / "m.bin").exists()


def test_inspect_reports_counts_manifest_and_decodes(tmp_path, tiny_tokenizer_dir):
    docs = ["first document here", "", "second one"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    preprocess(src, tiny_tokenizer_dir, tmp_path / "c", "--append-eod", "-q")
    result = run_pipe("inspect", tmp_path / "c_text_document", "--show", "2")
    assert "documents  3 (1 empty)" in result.output
    assert "sequences  2" in result.output
    assert "tokenizer.json" in result.output and "histogram" in result.output
    assert "first document here<|end_of_text|>" in result.output
    info = json.loads(run_pipe("inspect", tmp_path / "c_text_document", "--json").output)
    assert info["documents"] == 3 and info["manifest"]["flags"]["append_eod"] is True
    expected_tokens = sum(len(hf_encoder(tiny_tokenizer_dir)(d)) + 1 for d in docs if d)
    assert info["tokens"] == expected_tokens


def test_manifest_found_from_relative_and_absolute_paths(tmp_path, tiny_tokenizer_dir, monkeypatch):
    from pipeline.data.manifest import find_for_dataset

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b"}])
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    preprocess(src, tiny_tokenizer_dir, "out/my_corpus", "-q")  # recorded as a relative prefix
    expected = tmp_path / "out" / "my_corpus.json"
    assert find_for_dataset("out/my_corpus_text_document") == Path("out/my_corpus.json")
    assert find_for_dataset(str(tmp_path / "out/my_corpus_text_document")) == expected
    assert find_for_dataset(str(tmp_path / "out/other_text_document")) is None


def test_inspect_blend_reports_what_a_run_reads(tmp_path, tiny_tokenizer_dir):
    for name, n in (("a", 40), ("b", 10)):
        docs = [{"text": f"{name} document {i} " * 20} for i in range(n)]
        preprocess(
            write_jsonl(tmp_path / f"{name}.jsonl", docs),
            tiny_tokenizer_dir,
            tmp_path / name,
            "--append-eod",
            "-q",
        )
    blend = f"0.75 {tmp_path / 'a_text_document'} 0.25 {tmp_path / 'b_text_document'}"
    args = [
        "inspect",
        "--data",
        blend,
        "--seq-length",
        "32",
        "--samples",
        "400",
        "--split",
        "1,0,0",
    ]
    rows = json.loads(run_pipe(*args, "--json").output)
    assert [r["samples"] for r in rows] == [300, 100]
    assert [r["weight"] for r in rows] == [0.75, 0.25]
    tokens_b = IndexedDataset(tmp_path / "b_text_document").num_tokens
    assert rows[1]["tokens_per_epoch"] == tokens_b and rows[1]["epochs"] > 1
    assert "total" in run_pipe(*args).output
    # An int32 dataset cannot join a uint16 blend: inspect warns before a run would refuse it.
    encode = hf_encoder(tiny_tokenizer_dir)
    wide = megatron_preprocess(["x y z " * 50] * 20, encode, 1, np.int32, tmp_path / "wide")
    result = run_pipe(
        "inspect",
        "--data",
        f"{tmp_path / 'a_text_document'} {wide}",
        "--seq-length",
        "32",
        "--samples",
        "10",
    )
    assert "training would refuse this blend: the blend mixes token dtypes" in result.output
    bad = run_pipe("inspect", "--data", "0.5 x -1 y", "--seq-length", "8", expect_ok=False)
    assert bad.exit_code == 1 and "weight '-1'" in bad.output
