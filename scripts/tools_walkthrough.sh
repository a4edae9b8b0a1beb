#!/usr/bin/env bash
# The tool-use GRPO walk-through (docs/rl.md, "Tools: the walk-through") for one or more seeds,
# timed: the example task (sums of two four-digit numbers, a calculator tool), SFT on the
# teacher's conversations, the SFT model's held-out accuracy, GRPO with the tool, and a line per
# seed with the held-out accuracy before and after, the share of held-out answers that called
# the tool, and the wall time.
#
#   bash scripts/tools_walkthrough.sh [SEED ...]          (default: 0 1 2; runs under runs/tools-seeds)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIPE=("$PYTHON" -m pipeline)
OUT="${OUT:-$ROOT/runs/tools-seeds}"
cd "$ROOT"
# the GRPO example's recipes, resized for the tool conversations (docs/rl.md)
SFT_SETS=(--set data.seq_length=96 --set training.iters=2000 --set training.eval_interval=1000
          --set checkpoint.save_interval=2000)
GRPO_SETS=(--tool pipeline.examples.tool_sums:calculator --set grpo.max_tool_calling_iterations=2
           --set data.seq_length=96 --set grpo.max_completion_length=64 --set training.iters=60
           --set training.micro_batch_size=8 --set training.global_batch_size=8
           --set training.eval_iters=25)
for seed in "${@:-0 1 2}"; do
    for s in $seed; do
        dir="$OUT/seed$s"
        rm -rf "$dir"
        start=$(date +%s)
        "$PYTHON" -m pipeline.examples.tool_sums --output "$dir/data" --seed "$s" > /dev/null
        "${PIPE[@]}" preprocess --chat --input "$dir/data/sft.jsonl" --tokenizer "$dir/data/tokenizer" \
            --output-prefix "$dir/data/sft" --workers 2 > "$dir/preprocess.log" 2>&1
        "${PIPE[@]}" train --recipe tiny_grpo_sft --sft --data "$dir/data/sft_messages_document" \
            --device cpu --run-dir "$dir/sft" --set "training.seed=$s" "${SFT_SETS[@]}" \
            > "$dir/sft.log" 2>&1
        grpo=(train --recipe tiny_grpo --grpo --load "$dir/sft/checkpoints" --finetune
              --device cpu --set "training.seed=$s" "${GRPO_SETS[@]}"
              --set "data.train_blend=$dir/data/train_prompts.jsonl"
              --set "data.valid_blend=$dir/data/heldout_prompts.jsonl"
              --set "data.tokenizer=$dir/data/tokenizer")
        "${PIPE[@]}" "${grpo[@]}" --run-dir "$dir/start" --set training.skip_train=true \
            > "$dir/start.log" 2>&1
        "${PIPE[@]}" "${grpo[@]}" --run-dir "$dir/rl" > "$dir/rl.log" 2>&1
        seconds=$(( $(date +%s) - start ))
        "$PYTHON" - "$dir" "$s" "$seconds" <<'PY'
import json
import sys

directory, seed, seconds = sys.argv[1:]


def valid(run):
    lines = open(f"{directory}/{run}/metrics.jsonl").read().splitlines()
    return [json.loads(line) for line in lines if '"split": "valid"' in line]


before, after = valid("start")[-1], valid("rl")[-1]
print(f"seed {seed}: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
      f"({after['accuracy'] - before['accuracy']:+.3f}), answers calling the tool "
      f"{before['tools/used']:.2f} -> {after['tools/used']:.2f}, in {seconds} s")
PY
    done
done
