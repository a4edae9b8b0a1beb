#!/usr/bin/env bash
# Set up a fresh machine and run the main job on the embedded default: a corpus built from the
# Python standard library's docstrings and a BPE tokenizer trained on it (no network needed),
# preprocessed, then a tiny Llama-style model trained on it, its checkpoint verified and its
# curves plotted, the model converted to Hugging Face and exported to TensorRT-LLM twice (bf16 at
# tp 2 x pp 2, and FP8 at tp 2 calibrated on the corpus), each export checked by a reference
# forward against the trained model; at the end the trained model is asked for a few tokens
# through `pipe generate`. QUICKSTART_ITERS=50 makes it quicker.
# Everything is written under runs/quickstart/ in this checkout. The virtual environment gets the
# extras used below: plot (matplotlib, for pipe plot) and hf (transformers, to verify the Hugging
# Face conversion).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh" plot,hf
RUN="$ROOT/runs/quickstart"
mkdir -p "$RUN"
echo "[quickstart] writing everything under $RUN"

ITERS="${QUICKSTART_ITERS:-300}"

echo "[quickstart] 1/8 corpus + tokenizer"
python -m pipeline.examples.stdlib_corpus --output "$RUN/data"

echo "[quickstart] 2/8 pipe preprocess"
pipe preprocess --input "$RUN/data/stdlib_docs.jsonl" --tokenizer "$RUN/data/tokenizer" \
    --output-prefix "$RUN/data/stdlib" --append-eod --workers 2 --overwrite
pipe inspect "$RUN/data/stdlib_text_document"
pipe inspect "$RUN/data/stdlib_text_document" --show 3 > "$RUN/data/first_documents.txt"
echo "(the first 3 documents, decoded: $RUN/data/first_documents.txt)"

echo "[quickstart] 3/8 pipe train (recipe tiny, $ITERS iterations on $(nproc) CPU cores: a few minutes)"
rm -rf "$RUN/train"
pipe train --recipe tiny --data "$RUN/data/stdlib_text_document" --iters "$ITERS" \
    --device cpu --run-dir "$RUN/train" --set "scheduler.warmup_iters=$((ITERS / 10))"

echo "[quickstart] 4/8 pipe checkpoint verify"
pipe checkpoint verify "$RUN/train/checkpoints"

echo "[quickstart] 5/8 pipe plot"
pipe plot "$RUN/train"

echo "[quickstart] 6/8 pipe convert --to hf"
rm -rf "$RUN/hf"
pipe convert "$RUN/train/checkpoints" --to hf --output "$RUN/hf"

# The corpus holds about 420,000 tokens: calibration reads the first 256 x 256 (the tiny model's
# context), and the FP8 check runs on 8 x 128 held-out tokens after those.
echo "[quickstart] 7/8 pipe export --trtllm (bf16; FP8 in ModelOpt's format, calibrated)"
rm -rf "$RUN/export_bf16" "$RUN/export_fp8"
pipe export "$RUN/train/checkpoints" --trtllm --output "$RUN/export_bf16" --dtype bfloat16
pipe export "$RUN/train/checkpoints" --trtllm --output "$RUN/export_fp8" \
    --fp8 --fp8-kv-cache --calib-data "$RUN/data/stdlib_text_document" \
    --calib-size 256 --calib-seq-len 256

echo "[quickstart] 8/8 pipe generate (greedy, from the trained checkpoint)"
pipe generate "$RUN/train/checkpoints" --prompt "Return the" --max-new-tokens 20 --greedy

echo "[quickstart] done, all under $RUN:"
echo "  token shards  $RUN/data/stdlib_text_document.{bin,idx}"
echo "  run           $RUN/train (config.toml, metrics.jsonl, checkpoints/)"
echo "  curves        $RUN/train/metrics.png"
echo "  Hugging Face  $RUN/hf (config.json, model.safetensors, tokenizer.json)"
echo "  export        $RUN/export_bf16 (Hugging Face, bf16: trtllm-serve / vllm serve DIR)"
echo "  export        $RUN/export_fp8 (Hugging Face, ModelOpt FP8 + hf_quant_config.json)"
