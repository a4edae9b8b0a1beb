#!/usr/bin/env bash
# The GRPO walk-through's task with the rollouts on a `pipe serve`
# (docs/rl.md, "Rollouts ahead of training"): for each seed, the example task and the SFT
# start, then the same GRPO run twice against a server started on the SFT weights, synchronous
# (`grpo.max_staleness=0`) and one batch ahead (`max_staleness=1`), and a line per seed with
# both runs' final held-out accuracy, their gap and their wall times.
#
#   bash scripts/grpo_staleness.sh [SEED ...]          (default: 0; runs under runs/grpo-staleness)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIPE=("$PYTHON" -m pipeline)
OUT="${OUT:-$ROOT/runs/grpo-staleness}"
cd "$ROOT"
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for s in ${@:-0}; do
    dir="$OUT/seed$s"
    rm -rf "$dir"
    "$PYTHON" -m pipeline.examples.largest_number --output "$dir/data" --seed "$s" > /dev/null
    "${PIPE[@]}" preprocess --chat --input "$dir/data/sft.jsonl" --tokenizer "$dir/data/tokenizer" \
        --output-prefix "$dir/data/sft" --workers 2 > "$dir/preprocess.log" 2>&1
    "${PIPE[@]}" train --recipe tiny_grpo_sft --sft --data "$dir/data/sft_messages_document" \
        --device cpu --run-dir "$dir/sft" --set "training.seed=$s" \
        --set checkpoint.save_hf=final > "$dir/sft.log" 2>&1
    hf=$(ls -d "$dir"/sft/checkpoints/hf/*/ | head -1)
    for staleness in 0 1; do
        port=$(free_port)
        "${PIPE[@]}" serve "$hf" --tokenizer "$dir/data/tokenizer" --port "$port" \
            --max-batch 128 --engine-threads 1 > "$dir/serve$staleness.log" 2>&1 &
        server=$!
        for _ in $(seq 240); do
            curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
            sleep 0.5
        done
        start=$(date +%s)
        "${PIPE[@]}" train --recipe tiny_grpo --grpo --load "$dir/sft/checkpoints" --finetune \
            --device cpu --set "training.seed=$s" \
            --set "data.train_blend=$dir/data/train_prompts.jsonl" \
            --set "data.valid_blend=$dir/data/heldout_prompts.jsonl" \
            --set "data.tokenizer=$dir/data/tokenizer" \
            --set "grpo.rollout_server=http://127.0.0.1:$port" \
            --set "grpo.max_staleness=$staleness" \
            --run-dir "$dir/rl$staleness" > "$dir/rl$staleness.log" 2>&1 || true
        echo $(( $(date +%s) - start )) > "$dir/rl$staleness.seconds"
        kill "$server"
        wait "$server" 2> /dev/null || true
    done
    "$PYTHON" - "$dir" "$s" <<'PY'
import json
import sys

directory, seed = sys.argv[1:]


def final(run):
    lines = open(f"{directory}/{run}/metrics.jsonl").read().splitlines()
    valid = [json.loads(line) for line in lines if '"split": "valid"' in line]
    return valid[-1]["accuracy"], int(open(f"{directory}/{run}.seconds").read())


(sync, sync_s), (ahead, ahead_s) = final("rl0"), final("rl1")
print(f"seed {seed}: held-out accuracy synchronous {sync:.3f} ({sync_s} s), "
      f"max_staleness=1 {ahead:.3f} ({ahead_s} s), gap {ahead - sync:+.3f}, "
      f"steps/hour {sync_s / ahead_s:.2f}x")
PY
done
