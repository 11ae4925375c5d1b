#!/usr/bin/env bash
# One node without Slurm: bash launchers/torchrun.sh   (from anywhere)
#
#   NPROC_PER_NODE=8 bash launchers/torchrun.sh                                 # Mimir v1, 8 GPUs
#   CONFIG=configs/train/demo.yaml NPROC_PER_NODE=2 bash launchers/torchrun.sh   # CPU demo
#
# Environment:
#   CONFIG           train config                     [configs/train/mimir_v1.yaml]
#   RUN_DIR          run directory (run.dir)          [runs/<config file name without .yaml>]
#   EXTRA_ARGS       more key=value config overrides, space-separated
#   NPROC_PER_NODE   processes                        [number of GPUs (nvidia-smi -L), else 1]
#   PYTHON / VENV    python with this project installed [$VENV/bin/python, else python3;
#                    VENV defaults to <repo>/.venv]
#   OMP_NUM_THREADS  [cores / NPROC_PER_NODE, at least 1]
#   NCCL_DEBUG [WARN], TORCH_NCCL_ASYNC_ERROR_HANDLING [1], CUDA_DEVICE_MAX_CONNECTIONS [1]
#
# Stopping with a checkpoint: `kill -USR1 <pid>` or `kill <pid>` (pid printed at the start)
# sends SIGUSR1 to every worker; each finishes its step, one checkpoint is saved, and the
# script exits 0. Running it again resumes from <run dir>/checkpoints/latest. (Signalling
# torchrun itself would not do: it does not forward SIGUSR1, and after SIGTERM it kills the
# workers 30 s later, possibly in the middle of the checkpoint.)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

CONFIG="${CONFIG:-configs/train/mimir_v1.yaml}"
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)}"
read -r -a extra_args <<<"${EXTRA_ARGS:-}"
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
    [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
fi
if [ -z "${PYTHON:-}" ]; then
    VENV="${VENV:-$REPO/.venv}"
    if [ -x "$VENV/bin/python" ]; then PYTHON="$VENV/bin/python"; else PYTHON=python3; fi
fi
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

cmd=("$PYTHON" -m torch.distributed.run --standalone --nnodes=1
    --nproc-per-node="$NPROC_PER_NODE"
    -m mimir_megatron.cli train --config "$CONFIG" "run.dir=$RUN_DIR" "${extra_args[@]}")
echo "torchrun.sh: pid $$: ${cmd[*]}" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    exit 0
fi

torchrun_pid=""
interrupted=0
# shellcheck disable=SC2317  # called from the traps below
forward() {
    interrupted=1
    echo "torchrun.sh: SIG$1 received: asking the workers to checkpoint and stop" >&2
    if [ -n "$torchrun_pid" ]; then
        # The workers are torchrun's children.
        pkill -USR1 -P "$torchrun_pid" || true
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

"${cmd[@]}" &
torchrun_pid=$!

rc=""
while :; do
    interrupted=0
    status=0
    wait "$torchrun_pid" || status=$?
    if [ "$status" = 127 ] && [ -n "$rc" ]; then
        break
    fi
    rc="$status"
    if [ "$interrupted" = 1 ] && [ "$status" -gt 128 ]; then
        continue
    fi
    break
done
exit "$rc"
