"""Sharding costs nothing: 2 shards run as 2 concurrent processes (1 worker each) plus
`pipe merge --shards`, against one unsharded 2-worker `pipe preprocess`, on the same cores.

Both are timed end to end as a user runs them (process start, tokenizer load, reading, encoding
with `--append-eod`, writing, manifests; the sharded side includes the merge). The merged
`.bin/.idx` must equal the unsharded run's byte for byte.

Input: $PIPE_BENCH_DATA/corpus/python_docs.jsonl.zst decompressed to plain JSONL and concatenated
--repeat times (plain, so that the two shards split the one file by byte ranges; throughput does
not depend on the text being unique). Tokenizer: Llama 3 from $PIPE_BENCH_DATA/tokenizers/llama3.

    python scripts/bench/preprocess_shards.py [--repeat 25] [--rounds 1]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The benchmark corpora and tokenizers: a folder with corpus/ and tokenizers/ (PIPE_BENCH_DATA).
SHARED = Path(os.environ.get("PIPE_BENCH_DATA", ROOT.parent / "shared" / "data"))
TARGET = 1.10  # sharded total / unsharded wall time


def pipe(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def preprocess_args(src: Path, tokenizer: Path, out: Path, workers: int) -> list[str]:
    return pipe(
        "preprocess",
        "--input",
        str(src),
        "--tokenizer",
        str(tokenizer),
        "--output-prefix",
        str(out),
        "--append-eod",
        "--workers",
        str(workers),
        "--quiet",
    )


def check(proc: subprocess.CompletedProcess | subprocess.Popen, output: str) -> None:
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.args}):\n{output}")


def unsharded(src: Path, tokenizer: Path, out: Path) -> float:
    """Wall seconds of one 2-worker run."""
    start = time.perf_counter()
    proc = subprocess.run(preprocess_args(src, tokenizer, out, 2), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    check(proc, proc.stdout + proc.stderr)
    return elapsed


def sharded(src: Path, tokenizer: Path, out: Path) -> tuple[float, float]:
    """Wall seconds of 2 concurrent 1-worker shards then the merge: (total, merge alone)."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            preprocess_args(src, tokenizer, out, 1)
            + ["--num-shards", "2", "--shard-index", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for proc in procs:
        output, _ = proc.communicate()
        check(proc, output)
    merge_start = time.perf_counter()
    proc = subprocess.run(pipe("merge", "--shards", str(out)), capture_output=True, text=True)
    end = time.perf_counter()
    check(proc, proc.stdout + proc.stderr)
    return end - start, end - merge_start


def make_input(corpus: Path, repeat: int, path: Path) -> int:
    """Write the corpus, decompressed, `repeat` times to `path`; returns its size."""
    import zstandard

    with open(corpus, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read()
    if not raw.endswith(b"\n"):
        raw += b"\n"
    with open(path, "wb") as f:
        for _ in range(repeat):
            f.write(raw)
    return len(raw) * repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=25, help="copies of the corpus")
    parser.add_argument("--rounds", type=int, default=1, help="best of this many of each")
    args = parser.parse_args()
    corpus = SHARED / "corpus" / "python_docs.jsonl.zst"
    tokenizer = SHARED / "tokenizers" / "llama3"
    if not corpus.exists() or not tokenizer.exists():
        sys.exit(f"{SHARED} not found: set PIPE_BENCH_DATA (corpus/, tokenizers/)")
    with tempfile.TemporaryDirectory(prefix="pipe-bench-shards-") as tmp:
        src = Path(tmp) / "input.jsonl"
        size = make_input(corpus, args.repeat, src)
        print(
            f"input: {corpus.name} decompressed x{args.repeat} = {size / 1e6:,.1f} MB of plain "
            f"JSONL (the corpus repeated); Llama 3 tokenizer; {os.cpu_count()} cores"
        )
        one, two, merge = [], [], []
        for _ in range(args.rounds):
            one.append(unsharded(src, tokenizer, Path(tmp) / "one"))
            total, merge_s = sharded(src, tokenizer, Path(tmp) / "sharded")
            two.append(total)
            merge.append(merge_s)
            for ext in (".bin", ".idx"):
                a, b = (Path(tmp) / f"{p}_text_document{ext}" for p in ("one", "sharded"))
                if not filecmp.cmp(a, b, shallow=False):
                    sys.exit(f"merged {b.name} differs from the unsharded run's")
            for p in Path(tmp).iterdir():
                if p.name.startswith(("one", "sharded")):
                    p.unlink()
        best_one, best_two = min(one), min(two)
        print(f"unsharded, 1 process x 2 workers:          {best_one:7.2f} s")
        print(
            f"sharded, 2 processes x 1 worker + merge:   {best_two:7.2f} s "
            f"(merge {merge[two.index(best_two)]:.2f} s)"
        )
        ratio = best_two / best_one
        verdict = "met" if ratio <= TARGET else "NOT met"
        print(f"ratio sharded / unsharded = {ratio:.3f} (target <= {TARGET}: {verdict})")
        print("merged .bin/.idx identical to the unsharded run's: yes")


if __name__ == "__main__":
    main()
