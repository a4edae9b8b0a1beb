#!/usr/bin/env bash
# The GRPO walk-through (docs/rl.md) with its rollouts on a `pipe serve`, run twice from the same
# SFT start: synchronously (`grpo.max_staleness=0`: each batch generated, then trained on) and
# one batch ahead (`max_staleness=1`: the next batch generated while the current one trains).
# Prints each run's held-out accuracy after GRPO and its wall time, and the difference: rollouts
# ahead should learn as the synchronous run does.
#
#   bash scripts/grpo_async_walkthrough.sh [SEED]        (default 0; runs under runs/grpo-async)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIPE=("$PYTHON" -m pipeline)
seed="${1:-0}"
dir="${OUT:-$ROOT/runs/grpo-async}/seed$seed"
cd "$ROOT"
rm -rf "$dir"
"$PYTHON" -m pipeline.examples.largest_number --output "$dir/data" --seed "$seed" > /dev/null
"${PIPE[@]}" preprocess --chat --input "$dir/data/sft.jsonl" --tokenizer "$dir/data/tokenizer" \
    --output-prefix "$dir/data/sft" --workers 2 > "$dir/preprocess.log" 2>&1
"${PIPE[@]}" train --recipe tiny_grpo_sft --sft --data "$dir/data/sft_messages_document" \
    --device cpu --run-dir "$dir/sft" --set "training.seed=$seed" > "$dir/sft.log" 2>&1
"${PIPE[@]}" convert "$dir/sft/checkpoints" --to hf --dtype fp32 --output "$dir/sft_hf" \
    --tokenizer "$dir/data/tokenizer" > "$dir/convert.log" 2>&1
port=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
for staleness in 0 1; do
    "${PIPE[@]}" serve "$dir/sft_hf" --dtype fp32 --port "$port" > /dev/null 2> "$dir/serve$staleness.log" &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
    start=$(date +%s)
    "${PIPE[@]}" train --recipe tiny_grpo --grpo --load "$dir/sft/checkpoints" --finetune \
        --device cpu --run-dir "$dir/rl$staleness" --set "training.seed=$seed" \
        --set "data.train_blend=$dir/data/train_prompts.jsonl" \
        --set "data.valid_blend=$dir/data/heldout_prompts.jsonl" \
        --set "data.tokenizer=$dir/data/tokenizer" \
        --set "grpo.rollout_server=http://127.0.0.1:$port" \
        --set "grpo.max_staleness=$staleness" > "$dir/rl$staleness.log" 2>&1
    echo $(( $(date +%s) - start )) > "$dir/rl$staleness/seconds"
    kill "$server"
    wait "$server" || true
done
"$PYTHON" - "$dir" "$seed" <<'PY'
import json
import sys

directory, seed = sys.argv[1:]


def final(run):
    lines = open(f"{directory}/{run}/metrics.jsonl").read().splitlines()
    valid = [json.loads(line) for line in lines if '"split": "valid"' in line]
    seconds = int(open(f"{directory}/{run}/seconds").read())
    return valid[-1]["accuracy"], seconds


(sync, sync_s), (ahead, ahead_s) = final("rl0"), final("rl1")
print(f"seed {seed}: held-out accuracy after GRPO: synchronous {sync:.3f} ({sync_s} s), "
      f"one batch ahead {ahead:.3f} ({ahead_s} s); difference {ahead - sync:+.3f}")
PY
