#!/usr/bin/env bash
# Mimir v1.5 on Slurm, continued from a v1 checkpoint: sbatch launchers/v1_5.sh
#
#SBATCH --job-name=mimir-v1.5
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# Same launcher as v1.sh (read its header: every variable there applies here too, and the
# same pre-emption/requeue behaviour), with configs/train/mimir_v1_5.yaml and the starting
# weights taken from a v1 checkpoint:
#   INIT_FROM    v1 checkpoint directory to start from
#                [the newest checkpoint of V1_RUN_DIR: <V1_RUN_DIR>/checkpoints/$(cat latest)]
#   V1_RUN_DIR   the v1 run directory              [runs/mimir_v1]
#   CONFIG       [configs/train/mimir_v1_5.yaml]    RUN_DIR [runs/mimir_v1_5]
#
# checkpoint.init_from is passed only while the v1.5 run has no checkpoint of its own: once
# it has, a requeued job resumes from <RUN_DIR>/checkpoints/latest (checkpoint.resume=auto),
# not from the v1 weights again.
#   INIT_FROM=runs/mimir_v1/checkpoints/step_1650000 sbatch launchers/v1_5.sh
set -euo pipefail

REPO="${MIMIR_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [ ! -f "$REPO/launchers/v1.sh" ]; then
    echo "v1_5.sh: $REPO is not the repository root: run sbatch from there or set MIMIR_REPO" >&2
    exit 2
fi
cd "$REPO"

export MIMIR_REPO="$REPO"
export CONFIG="${CONFIG:-configs/train/mimir_v1_5.yaml}"
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)}"
case "$RUN_DIR" in /*) ;; *) RUN_DIR="$REPO/$RUN_DIR" ;; esac
export RUN_DIR

if [ -f "$RUN_DIR/checkpoints/latest" ]; then
    echo "v1_5.sh: $RUN_DIR has checkpoints: resuming, INIT_FROM not used" >&2
else
    if [ -z "${INIT_FROM:-}" ]; then
        V1_RUN_DIR="${V1_RUN_DIR:-runs/mimir_v1}"
        if [ ! -f "$V1_RUN_DIR/checkpoints/latest" ]; then
            echo "v1_5.sh: set INIT_FROM to a v1 checkpoint directory" \
                "(no $V1_RUN_DIR/checkpoints/latest to default to)" >&2
            exit 2
        fi
        INIT_FROM="$V1_RUN_DIR/checkpoints/$(cat "$V1_RUN_DIR/checkpoints/latest")"
    fi
    case "$INIT_FROM" in /*) ;; *) INIT_FROM="$REPO/$INIT_FROM" ;; esac
    if [ ! -d "$INIT_FROM" ]; then
        echo "v1_5.sh: INIT_FROM=$INIT_FROM is not a directory" >&2
        exit 2
    fi
    echo "v1_5.sh: starting from the v1 checkpoint $INIT_FROM" >&2
    export EXTRA_ARGS="checkpoint.init_from=$INIT_FROM ${EXTRA_ARGS:-}"
fi

# exec keeps this process (the batch shell Slurm signals) and its output.
exec bash "$REPO/launchers/v1.sh"
