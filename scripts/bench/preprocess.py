"""Preprocessing throughput against the `tokenizers` library limit, measured in one run.

The library limit is what a user gets from Hugging Face `tokenizers` alone: `encode_batch` of texts
already in memory, on all cores (no reading, no writing). `pipe preprocess` is timed end to end as
a user runs it: process start, tokenizer load, reading and decompressing `.jsonl.zst`, JSON
parsing, encoding with `--append-eod`, writing `.bin/.idx` and the manifest.

Input: ../shared/data/corpus/python_docs.jsonl.zst concatenated --repeat times (zstd frames
concatenated; throughput does not depend on the text being unique).

    python scripts/bench/preprocess.py [--repeat 10] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
TARGETS = {"llama3": 2.0, "llama2": 0.85}  # required end-to-end / library-limit ratios
EOD = {"llama3": 128001, "llama2": 2}


def read_texts(corpus: Path, repeat: int) -> list[str]:
    import zstandard

    with open(corpus, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read()
    texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    return texts * repeat


def library_limit(tokenizer_json: Path, texts: list[str]) -> tuple[float, int]:
    """Seconds for tokenizers' encode_batch over all texts on all cores, and the token count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.encode_batch(texts[:50], add_special_tokens=False)  # warm the thread pool
    start = time.perf_counter()
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(e.ids) for e in encodings)


# Runs a command and prints the largest peak RSS (KiB) among it and the processes it waited for.
_RSS_WRAPPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)


def run_pipe(src: Path, tokenizer_dir: Path, out: Path, workers: int) -> tuple[float, int, str]:
    """Wall seconds of `pipe preprocess` end to end, its peak RSS (KiB, largest process), engine."""
    cmd = [
        sys.executable,
        "-m",
        "pipeline",
        "preprocess",
        "--input",
        str(src),
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(out),
        "--append-eod",
        "--workers",
        str(workers),
        "--overwrite",
        "--quiet",
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_WRAPPER, *cmd], capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"pipe preprocess failed:\n{proc.stdout}\n{proc.stderr}")
    rss_kib = int(proc.stdout.strip().splitlines()[-1])
    engine = json.loads(Path(f"{out}.json").read_text())["tokenizer"]["engine"]
    return elapsed, rss_kib, engine


def bench(name: str, src: Path, texts: list[str], text_mb: float, workers: int, tmp: Path) -> bool:
    tokenizer_dir = SHARED / "tokenizers" / name
    lib_s, lib_tokens = library_limit(tokenizer_dir / "tokenizer.json", texts)
    out = tmp / name
    pipe_s, rss_kib, engine = run_pipe(src, tokenizer_dir, out, workers)
    from pipeline.data.indexed import IndexedDataset

    ds = IndexedDataset(f"{out}_text_document")
    nonempty = int(np.count_nonzero(np.diff(ds.document_indices)))
    # Same tokens as the library plus one EOD per non-empty document: nothing dropped or added.
    assert ds.num_tokens == lib_tokens + nonempty, (ds.num_tokens, lib_tokens, nonempty)
    ratio = lib_s / pipe_s
    ok = ratio >= TARGETS[name]
    print(
        f"{name}: library limit (tokenizers encode_batch, all cores, in memory) "
        f"{text_mb / lib_s:7.2f} MB/s {lib_tokens / lib_s:12,.0f} tok/s"
    )
    print(
        f"{name}: pipe preprocess end to end ({engine}, {workers} workers)      "
        f"{text_mb / pipe_s:7.2f} MB/s {ds.num_tokens / pipe_s:12,.0f} tok/s "
        f"peak RSS {rss_kib / 1024:,.0f} MiB"
    )
    print(
        f"{name}: ratio pipe / library limit = {ratio:.2f}x "
        f"(target >= {TARGETS[name]}x: {'met' if ok else 'NOT met'})"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="copies of the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--tokenizers", nargs="+", default=["llama3", "llama2"], choices=sorted(TARGETS)
    )
    args = parser.parse_args()
    corpus = SHARED / "corpus" / "python_docs.jsonl.zst"
    if not corpus.exists():
        sys.exit(f"{corpus} not found: the benchmark needs ../shared/data beside the checkout")
    texts = read_texts(corpus, args.repeat)
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(
        f"input: {corpus.name} x{args.repeat} = {len(texts):,} documents, {text_mb:,.1f} MB "
        f"of text (the corpus repeated; throughput does not depend on uniqueness); "
        f"{os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory(prefix="pipe-bench-") as tmp:
        src = Path(tmp) / "input.jsonl.zst"
        src.write_bytes(corpus.read_bytes() * args.repeat)
        results = [
            bench(name, src, texts, text_mb, args.workers, Path(tmp)) for name in args.tokenizers
        ]
    print("all targets met" if all(results) else "some targets NOT met")


if __name__ == "__main__":
    main()
