#!/usr/bin/env bash
# One Slurm task in the Docker image: srun bash launchers/container.sh train --config ...
#
# For clusters that run Docker but not pyxis/enroot (with pyxis, set CONTAINER_IMAGE for
# launchers/v1.sh instead). launchers/v1.sh uses this script for each task when DOCKER_IMAGE is
# set: DOCKER_IMAGE=mimir-megatron:0.1.0 sbatch launchers/v1.sh
# The arguments are those of `mimir` (the image's entrypoint). The task replaces itself with
# `docker run` (exec), so the signals Slurm sends to the task (SIGUSR1 before the time limit,
# SIGTERM on scancel) reach the docker client, which forwards them to the container, where
# docker's init (--init) hands them to the trainer: it checkpoints and exits 0, and so does the task.
#
# Environment:
#   DOCKER_IMAGE   the image (docker/build.sh builds it; load it on every node)   [required]
#   DOCKER_MOUNTS  comma-separated host paths (mounted at the same path) or SRC:DST[:ro]
#                  [the repository; add the data and run directories when they live elsewhere]
#   DOCKER_USER    uid:gid in the container                    [the submitting user: $(id -u):$(id -g)]
#   DOCKER_GPUS    --gpus value (with it: memlock and stack ulimits) [all when nvidia-smi exists, else none]
#   DOCKER_NETWORK the container's network: host for the rendezvous and NCCL     [host]
#   DOCKER_ARGS    more `docker run` options, space-separated (e.g. "--shm-size=16g")
#   DOCKER         docker client                                [docker]
#   MIMIR_REPO     repository root, the working directory inside [the directory of this script's parent]
#   DRY_RUN=1      print the docker command instead of running it
# Slurm's task variables (SLURM_*), MASTER_ADDR/MASTER_PORT, OMP_NUM_THREADS, NCCL_*, TORCH_*,
# CUDA_DEVICE_MAX_CONNECTIONS, MLFLOW_*, HF_* and MIMIR_API_KEY (`mimir serve`'s key) pass through,
# by name: `docker run --env=NAME` takes the value from this environment, not from the command line. The container shares the node's
# network (rendezvous, NCCL) and IPC namespace (shared memory).
set -euo pipefail

REPO="${MIMIR_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
if [ -z "${DOCKER_IMAGE:-}" ]; then
    echo "container.sh: set DOCKER_IMAGE to the image to run (bash docker/build.sh builds one)" >&2
    exit 2
fi
docker="${DOCKER:-docker}"
if ! command -v "$docker" >/dev/null 2>&1; then
    echo "container.sh: no docker client on $(hostname -s) (install Docker, or use pyxis: CONTAINER_IMAGE with launchers/v1.sh)" >&2
    exit 2
fi

volumes=()
IFS=, read -r -a mounts <<<"${DOCKER_MOUNTS:-$REPO}"
for mount in "${mounts[@]}"; do
    [ -n "$mount" ] || continue
    case "$mount" in
        *:*) volumes+=("--volume=$mount") ;;
        *) volumes+=("--volume=$mount:$mount") ;;
    esac
done

environment=()
for name in $(compgen -e); do
    case "$name" in
        SLURM_* | MASTER_ADDR | MASTER_PORT | OMP_NUM_THREADS | NCCL_* | TORCH_* | CUDA_DEVICE_MAX_CONNECTIONS \
            | MLFLOW_* | HF_* | MIMIR_API_KEY) environment+=("--env=$name") ;;
    esac
done

gpus="${DOCKER_GPUS:-}"
if [ -z "$gpus" ] && command -v nvidia-smi >/dev/null 2>&1; then
    gpus=all
fi
gpu_args=()
if [ -n "$gpus" ] && [ "$gpus" != none ]; then
    # NCCL over InfiniBand pins memory; NVIDIA's containers ask for a large stack.
    gpu_args=("--gpus=$gpus" --ulimit memlock=-1 --ulimit stack=67108864)
fi
read -r -a extra <<<"${DOCKER_ARGS:-}"

name="mimir-${SLURM_JOB_ID:-local}-${SLURM_STEP_ID:-0}-${SLURM_PROCID:-0}"
command=("$docker" run --rm --init --name "$name" --network "${DOCKER_NETWORK:-host}" --ipc host
    "--user=${DOCKER_USER:-$(id -u):$(id -g)}" --workdir "$REPO"
    "${volumes[@]}" "${environment[@]}" "${gpu_args[@]}" "${extra[@]}" "$DOCKER_IMAGE" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "${command[*]}"
    exit 0
fi
exec "${command[@]}"
