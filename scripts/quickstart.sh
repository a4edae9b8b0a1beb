#!/usr/bin/env bash
# Set up a fresh machine and run the main job on the embedded default: a corpus built from the
# Python standard library's docstrings and a BPE tokenizer trained on it (no network needed),
# preprocessed, then a tiny Llama-style model trained on it, its checkpoint verified and its
# curves plotted, the model converted to Hugging Face (a few tokens generated from it with
# transformers), and exported to TensorRT-LLM twice (bf16 at tp 2 x pp 2, and FP8
# at tp 2 calibrated on the corpus), each export checked by a reference forward against the
# trained model. QUICKSTART_ITERS=50 makes it quicker.
# Everything is written under runs/quickstart/ in this checkout. The virtual environment gets the
# extras used below: plot (matplotlib, for pipe plot) and hf (transformers, to verify the Hugging
# Face conversion and generate from it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$ROOT/scripts/setup_env.sh" plot,hf
RUN="$ROOT/runs/quickstart"
mkdir -p "$RUN"
echo "[quickstart] writing everything under $RUN"

ITERS="${QUICKSTART_ITERS:-300}"

echo "[quickstart] 1/7 corpus + tokenizer"
python -m pipeline.examples.stdlib_corpus --output "$RUN/data"

echo "[quickstart] 2/7 pipe preprocess"
pipe preprocess --input "$RUN/data/stdlib_docs.jsonl" --tokenizer "$RUN/data/tokenizer" \
    --output-prefix "$RUN/data/stdlib" --append-eod --workers 2 --overwrite
pipe inspect "$RUN/data/stdlib_text_document"
pipe inspect "$RUN/data/stdlib_text_document" --show 3 > "$RUN/data/first_documents.txt"
echo "(the first 3 documents, decoded: $RUN/data/first_documents.txt)"

echo "[quickstart] 3/7 pipe train (recipe tiny, $ITERS iterations on $(nproc) CPU cores: a few minutes)"
rm -rf "$RUN/train"
pipe train --recipe tiny --data "$RUN/data/stdlib_text_document" --iters "$ITERS" \
    --device cpu --run-dir "$RUN/train" --set "scheduler.warmup_iters=$((ITERS / 10))"

echo "[quickstart] 4/7 pipe checkpoint verify"
pipe checkpoint verify "$RUN/train/checkpoints"

echo "[quickstart] 5/7 pipe plot"
pipe plot "$RUN/train"

echo "[quickstart] 6/7 pipe convert --to hf"
rm -rf "$RUN/hf"
pipe convert "$RUN/train/checkpoints" --to hf --output "$RUN/hf"
python - "$RUN/hf" <<'PY'
import sys

from pipeline.common.quiet import import_transformers

transformers = import_transformers()
directory = sys.argv[1]
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{directory}/tokenizer.json")
model = transformers.AutoModelForCausalLM.from_pretrained(directory)
prompt = "Return the"
ids = tokenizer(prompt, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=20, do_sample=False)
print(f"transformers, greedy from {prompt!r}: {tokenizer.decode(out[0])!r}")
PY

# The corpus holds about 420,000 tokens: calibration reads the first 256 x 256 (the tiny model's
# context), and the FP8 check runs on 8 x 128 held-out tokens after those.
echo "[quickstart] 7/7 pipe export --trtllm (bf16; FP8 in ModelOpt's format, calibrated)"
rm -rf "$RUN/export_bf16" "$RUN/export_fp8"
pipe export "$RUN/train/checkpoints" --trtllm --output "$RUN/export_bf16" --dtype bfloat16
pipe export "$RUN/train/checkpoints" --trtllm --output "$RUN/export_fp8" \
    --fp8 --fp8-kv-cache --calib-data "$RUN/data/stdlib_text_document" \
    --calib-size 256 --calib-seq-len 256

echo "[quickstart] done, all under $RUN:"
echo "  token shards  $RUN/data/stdlib_text_document.{bin,idx}"
echo "  run           $RUN/train (config.toml, metrics.jsonl, checkpoints/)"
echo "  curves        $RUN/train/metrics.png"
echo "  Hugging Face  $RUN/hf (config.json, model.safetensors, tokenizer.json)"
echo "  export        $RUN/export_bf16 (Hugging Face, bf16: trtllm-serve / vllm serve DIR)"
echo "  export        $RUN/export_fp8 (Hugging Face, ModelOpt FP8 + hf_quant_config.json)"
