#!/usr/bin/env bash
# Mimir v1 on Slurm: sbatch launchers/v1.sh   (from the repository root)
#
#SBATCH --job-name=mimir-v1
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
# The recipe: 8 GPUs (one B200 node), configs/train/mimir_v1.yaml, 24 h per job; the job
# requeues itself until training is done (~3 weeks). sbatch options on the command line
# override the lines above, e.g. two nodes: sbatch --nodes=2 launchers/v1.sh
#
# Environment (export before sbatch; the job inherits it):
#   CONFIG           train config                    [configs/train/mimir_v1.yaml]
#   RUN_DIR          run directory (run.dir)          [runs/<config file name without .yaml>]
#   EXTRA_ARGS       more key=value config overrides, space-separated, e.g. "train.steps=1000"
#   NPROC_PER_NODE   training tasks per node          [$SLURM_NTASKS_PER_NODE, else 1]
#   PYTHON           python with this project installed [$VENV/bin/python, else python3]
#   VENV             virtual environment              [<repo>/.venv when it exists]
#   MIMIR_REPO       repository root (configs, data)  [the directory sbatch was run from]
#   CONTAINER_IMAGE  run the tasks in this image through pyxis (docs/operations.md); unset: bare
#   CONTAINER_MOUNTS pyxis mounts, comma-separated    [<repo>:<repo>]
#   DOCKER_IMAGE     run each task in this image with `docker run` (no pyxis needed;
#                    launchers/container.sh, which reads DOCKER_MOUNTS, DOCKER_USER, ...)
#   MASTER_ADDR      rendezvous host                  [first node of the job]
#   MASTER_PORT      rendezvous port                  [20000 + job id % 20000]
#   OMP_NUM_THREADS                                   [$SLURM_CPUS_PER_TASK, else 1]
#   NCCL_DEBUG [WARN], TORCH_NCCL_ASYNC_ERROR_HANDLING [1], CUDA_DEVICE_MAX_CONNECTIONS [1]
#                    (megatron orders TP/SP communication behind compute with one connection);
#                    any other NCCL_* variable (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) passes
#                    through unchanged.
#   DRY_RUN=1        print the srun command instead of running it
#
# Without GPUs (the CPU demo, or the tests' single-node Slurm) override the GPU request:
#   CONFIG=configs/train/demo.yaml sbatch --gpus-per-node=0 --ntasks-per-node=2 \
#       --cpus-per-task=1 --time=30:00 launchers/v1.sh
# `--gpus-per-node=0` on the command line replaces the line above and is accepted by a Slurm
# without GPUs (seen on 22.05), so the script stays complete for the real recipe.
#
# Why one srun task per GPU, not one torchrun per node: Slurm then starts, counts and signals
# every rank itself. The trainer reads SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, a failed rank
# ends the step (--kill-on-bad-exit), pyxis wraps each task in the container the same way, and a
# signal reaches the ranks directly: torchrun's agent would stand in between, forward only
# SIGTERM and SIGKILL the workers 30 s later, which is shorter than a checkpoint of this model.
#
# Pre-emption and requeue: Slurm sends SIGUSR1 to this script 10 minutes before the time limit
# (--signal=B:USR1@600; `scancel --batch --signal=USR1 JOBID` does the same by hand). The trap
# forwards it to the ranks; every rank finishes its step, a checkpoint is saved, the ranks exit
# 0, and the script requeues the job. The requeued job starts again with checkpoint.resume=auto
# (the trainer's default) and continues from <run dir>/checkpoints/latest. On SIGTERM
# (scancel, or a time limit reached without the warning) the ranks are asked to save as well,
# but the job is not requeued: a cancelled job must stay cancelled. Logs of every restart are
# appended to the same output file.
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "v1.sh: not inside a Slurm job; submit it: sbatch launchers/v1.sh" \
        "(one node without Slurm: bash launchers/torchrun.sh)" >&2
    exit 2
fi

# sbatch runs a copy of this script from Slurm's spool: find the repository from where sbatch
# was run.
REPO="${MIMIR_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [ ! -f "$REPO/launchers/v1.sh" ]; then
    echo "v1.sh: $REPO is not the repository root: run sbatch from there or set MIMIR_REPO" >&2
    exit 2
fi
cd "$REPO"

CONFIG="${CONFIG:-configs/train/mimir_v1.yaml}"
RUN_DIR="${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)}"
case "$RUN_DIR" in /*) ;; *) RUN_DIR="$REPO/$RUN_DIR" ;; esac
read -r -a extra_args <<<"${EXTRA_ARGS:-}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
CONTAINER_IMAGE="${CONTAINER_IMAGE:-}"
CONTAINER_MOUNTS="${CONTAINER_MOUNTS:-$REPO:$REPO}"
if [ -z "${PYTHON:-}" ]; then
    VENV="${VENV:-$REPO/.venv}"
    if [ -n "$CONTAINER_IMAGE" ]; then
        PYTHON=python  # the image's interpreter (docker/Dockerfile installs the project there)
    elif [ -x "$VENV/bin/python" ]; then
        PYTHON="$VENV/bin/python"
    else
        PYTHON=python3
    fi
fi

if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"
fi
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export MASTER_ADDR MASTER_PORT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

srun_args=(
    --nodes="$NNODES"
    --ntasks-per-node="$NPROC_PER_NODE"
    --ntasks="$((NNODES * NPROC_PER_NODE))"
    --kill-on-bad-exit=1
)
if [ -n "$CONTAINER_IMAGE" ]; then
    # mimir in the image: `python -m` would import the package from the mounted working
    # directory instead of the image's installation.
    srun_args+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS"
        --container-workdir="$REPO")
    train=(mimir train)
elif [ -n "${DOCKER_IMAGE:-}" ]; then
    # Each task execs `docker run`; the signals srun forwards reach the trainer through it.
    train=(bash "$REPO/launchers/container.sh" train)
else
    train=("$PYTHON" -m mimir_megatron.cli train)
fi
train+=(--config "$CONFIG" "run.dir=$RUN_DIR" "${extra_args[@]}")

echo "v1.sh: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
    "$NNODES x $NPROC_PER_NODE tasks, master $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR" >&2
echo "v1.sh: srun ${srun_args[*]} ${train[*]}" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    exit 0
fi

mkdir -p "$RUN_DIR"
srun_pid=""
requeue=0
interrupted=0
# shellcheck disable=SC2317  # called from the traps below
forward() {  # $1: the signal this script received
    interrupted=1
    if [ "$1" = USR1 ]; then
        requeue=1
    fi
    echo "v1.sh: SIG$1 received: asking the training tasks to checkpoint and stop" >&2
    if [ -n "$srun_pid" ]; then
        kill -USR1 "$srun_pid" 2>/dev/null || true  # srun forwards it to every task
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

if [ "$interrupted" = 1 ]; then  # signalled before anything started: nothing to save
    if [ "$requeue" = 1 ]; then
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit 0
fi
srun "${srun_args[@]}" "${train[@]}" &
srun_pid=$!
if [ "$interrupted" = 1 ]; then  # signalled while srun was being started
    kill -USR1 "$srun_pid" 2>/dev/null || true
fi

# A trapped signal makes `wait` return early (status > 128): wait again for srun's own status.
rc=""
while :; do
    interrupted=0
    status=0
    wait "$srun_pid" || status=$?
    if [ "$status" = 127 ] && [ -n "$rc" ]; then
        break  # srun had already been reaped; keep the status seen before
    fi
    rc="$status"
    if [ "$interrupted" = 1 ] && [ "$status" -gt 128 ]; then
        continue
    fi
    break
done

if [ "$requeue" = 1 ]; then
    if [ "$rc" = 0 ]; then
        echo "v1.sh: tasks checkpointed and exited; requeueing job $SLURM_JOB_ID" >&2
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            echo "v1.sh: requeue refused (JobRequeue=0 on this cluster?): resubmit to resume" >&2
            exit 1
        fi
    else
        echo "v1.sh: tasks exited with status $rc after SIGUSR1; not requeueing" >&2
    fi
fi
exit "$rc"
