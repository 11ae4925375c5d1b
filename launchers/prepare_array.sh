#!/usr/bin/env bash
# One dataset prepared by a Slurm array, then merged (`mimir prepare --part I/N`, `--merge`).
#
#   PARTS=16 bash launchers/prepare_array.sh -i raw/*.jsonl -t TOKENIZER -o prepared/NAME [options]
#
# Run from the repository root, outside a job: it submits an array of PARTS jobs, each preparing
# one contiguous range of the dataset's shards (`--part $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`),
# and a merge job that starts when all of them succeeded (`--dependency=afterok`) and writes the
# manifest. The output directory must be on a file system every node sees. The arguments are
# `mimir prepare`'s, the same for every job (inputs, tokenizer, output, --seq-len, provenance
# flags, ...). A failed part can be resubmitted alone (finished shards are skipped), then the merge.
# The result equals a single `mimir prepare` run, byte for byte.
#
# Environment:
#   PARTS            array jobs                               [8]
#   SBATCH_ARGS      more sbatch options, space-separated, e.g. "--partition=cpu --time=4:00:00"
#   PYTHON           python with this project installed        [$VENV/bin/python, else python3]
#   VENV             virtual environment                       [<repo>/.venv when it exists]
#   MIMIR_REPO       repository root                           [the directory sbatch was run from]
#   DRY_RUN=1        print the sbatch commands instead of submitting them
#
#SBATCH --job-name=mimir-prepare
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --time=12:00:00
#SBATCH --output=%x-%A_%a.out
set -euo pipefail

if [ "$#" -eq 0 ]; then
    echo "prepare_array.sh: give mimir prepare's arguments (-i INPUT... -t TOKENIZER -o OUTPUT ...)" >&2
    exit 2
fi

if [ -z "${SLURM_JOB_ID:-}" ]; then
    PARTS="${PARTS:-8}"
    case "$PARTS" in ''|*[!0-9]*|0) echo "prepare_array.sh: PARTS must be a positive integer, got '$PARTS'" >&2; exit 2 ;; esac
    read -r -a sbatch_args <<<"${SBATCH_ARGS:-}"
    array=(sbatch --parsable --array="0-$((PARTS - 1))" "${sbatch_args[@]}" "$0" "$@")
    if [ "${DRY_RUN:-0}" = 1 ]; then
        echo "${array[*]}"
        echo "sbatch --parsable --dependency=afterok:ARRAY_JOB_ID --export=ALL,MIMIR_PREPARE_MERGE=1 ${sbatch_args[*]} $0 $*"
        exit 0
    fi
    array_id="$("${array[@]}")"
    merge_id="$(sbatch --parsable --dependency="afterok:${array_id%%;*}" --export=ALL,MIMIR_PREPARE_MERGE=1 \
        "${sbatch_args[@]}" "$0" "$@")"
    echo "submitted parts: job $array_id (array 0-$((PARTS - 1))), merge: job $merge_id"
    exit 0
fi

# Inside a job: sbatch runs a copy of this script from Slurm's spool; find the repository.
REPO="${MIMIR_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
    VENV="${VENV:-$REPO/.venv}"
    if [ -x "$VENV/bin/python" ]; then PYTHON="$VENV/bin/python"; else PYTHON=python3; fi
fi
workers="${SLURM_CPUS_PER_TASK:-1}"
if [ "${MIMIR_PREPARE_MERGE:-0}" = 1 ]; then
    exec "$PYTHON" -m mimir_megatron.cli prepare --merge --workers "$workers" --no-progress "$@"
fi
: "${SLURM_ARRAY_TASK_ID:?not an array job: submit from outside a job (bash launchers/prepare_array.sh ...)}"
exec "$PYTHON" -m mimir_megatron.cli prepare --part "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" \
    --workers "$workers" --no-progress "$@"
