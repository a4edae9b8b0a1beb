#!/usr/bin/env bash
# Set up a fresh machine and run the main job on the embedded default: a corpus built from the
# Python standard library's docstrings and a BPE tokenizer trained on it (no network needed).
# Everything is written under runs/quickstart/ in this checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh"
RUN="$ROOT/runs/quickstart"
mkdir -p "$RUN"
echo "[quickstart] writing everything under $RUN"

echo "[quickstart] 1/3 corpus + tokenizer"
python -m pipeline.examples.stdlib_corpus --output "$RUN/data"

echo "[quickstart] 2/3 pipe preprocess"
pipe preprocess --input "$RUN/data/stdlib_docs.jsonl" --tokenizer "$RUN/data/tokenizer" \
    --output-prefix "$RUN/data/stdlib" --append-eod --workers 2 --overwrite

echo "[quickstart] 3/3 pipe inspect"
pipe inspect "$RUN/data/stdlib_text_document" --show 1 | head -n 40

echo "[quickstart] done: token shards in $RUN/data/stdlib_text_document.{bin,idx}"
