#!/bin/bash
# Sharded `pipe preprocess` as a Slurm job array: N tasks each tokenize one shard of the inputs,
# then a dependent job merges the shards into the files one machine would have written.
#
#   sbatch --array=0-15 scripts/preprocess_slurm.sh 'data/*.jsonl.zst' ../llama3/ out/corpus \
#       --append-eod
#
# The array size is the shard count N (here 16): --array=0-(N-1), contiguous, no `:step`. Run it
# from the repository root. Arguments after the output prefix go to every `pipe preprocess`
# task unchanged (e.g. `--append-eod --json-keys text title`).
#
# Each task takes its shard from Slurm's environment: index SLURM_ARRAY_TASK_ID -
# SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT (`pipe preprocess` logs "shard I of N (from
# Slurm array ...)"). It writes {prefix}.shard-IIIII-of-NNNNN_{key}_document.bin/.idx and a
# manifest. The array's first task also submits the merge job, which starts only after every
# task exited 0 (afterok on the whole array) and runs `pipe merge --shards {prefix}`: it checks
# that all N shards are complete and agree, then writes {prefix}_{key}_document.bin/.idx and
# {prefix}.json, byte-identical to a single-machine run.
#
# Retrying failed tasks: if any task fails, the merge job's dependency can never be met and
# Slurm cancels it (--kill-on-invalid-dep). Resubmit only the failed indices, giving the shard
# count explicitly (a partial array's own COUNT/MIN are not the run's):
#
#   NUM_SHARDS=16 sbatch --array=3,11 scripts/preprocess_slurm.sh 'data/*.jsonl.zst' ../llama3/ \
#       out/corpus --append-eod
#
# The retry's first task submits a new merge job after the retried tasks. Re-running a shard
# that already finished is a no-op (its manifest says it is complete), so resubmitting the whole
# array is safe too. `pipe merge --shards out/corpus` run by hand names any shard still missing.
#
# Set VENV to the directory of the environment that has `pipeline` installed, if it is not active.

#SBATCH --job-name=pipe-preprocess
#SBATCH --array=0-15              # N shards: 0-(N-1); override with `sbatch --array=...`
#SBATCH --ntasks=1                # one process per array task; it forks its tokenizer workers
#SBATCH --cpus-per-task=16        # tokenizer workers per shard (one per core)
#SBATCH --mem=16G                 # memory stays flat whatever the input size
#SBATCH --time=24:00:00
#SBATCH --output=%x-%A_%a.out     # array job id and task id

set -euo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: sbatch --array=0-(N-1) $0 INPUT TOKENIZER OUTPUT_PREFIX [pipe preprocess args...]" >&2
    exit 2
fi
INPUT=$1
TOKENIZER=$2
PREFIX=$3
shift 3

if [[ -n "${VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi
export PYTHONUNBUFFERED=1

# The shard: from the environment for a full array; from NUM_SHARDS and the task id for a retry
# of some indices (explicit flags win over the environment).
SHARD_ARGS=()
if [[ -n "${NUM_SHARDS:-}" ]]; then
    SHARD_ARGS=(--num-shards "$NUM_SHARDS" --shard-index "$SLURM_ARRAY_TASK_ID")
fi

# The first task of the array submits the merge, to run after every task of this array exited 0.
if [[ "$SLURM_ARRAY_TASK_ID" == "$SLURM_ARRAY_TASK_MIN" ]]; then
    ACTIVATE=""
    if [[ -n "${VENV:-}" ]]; then
        ACTIVATE="source $(printf '%q' "$VENV/bin/activate") && "
    fi
    sbatch --job-name=pipe-merge \
        --dependency="afterok:$SLURM_ARRAY_JOB_ID" \
        --kill-on-invalid-dep=yes \
        --ntasks=1 --cpus-per-task=1 --time=4:00:00 \
        --output="%x-%j.out" \
        --wrap="${ACTIVATE}pipe merge --shards $(printf '%q' "$PREFIX")"
fi

mkdir -p "$(dirname "$PREFIX")"
pipe preprocess \
    --input "$INPUT" \
    --tokenizer "$TOKENIZER" \
    --output-prefix "$PREFIX" \
    --workers "${SLURM_CPUS_PER_TASK:-1}" \
    ${SHARD_ARGS[@]+"${SHARD_ARGS[@]}"} \
    "$@"
