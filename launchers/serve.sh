#!/usr/bin/env bash
# Serve a model on a cluster node behind an API key (from the repository root):
#   sbatch launchers/serve.sh --checkpoint runs/mimir_v1 --ema
#   bash launchers/serve.sh --checkpoint runs/mimir_v1 --ema       # on a node you are logged in to
#
#SBATCH --job-name=mimir-serve
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#
# The arguments are those of `mimir serve` (the model, --port, --max-batch-size, ...). A node is
# shared: 127.0.0.1 is every user's, so the server always asks for an API key, which it reads
# from a file (never from its command line, which `ps` shows to every user of the node). A key
# file that does not exist is made (mode 600) with a fresh key; give its key to the clients:
#   export MIMIR_API_KEY="$(cat ~/.config/mimir/api-key)"    # mimir eval --base-url, lm-eval, ...
#   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=os.environ["MIMIR_API_KEY"])
# From a laptop: ssh -L 8000:127.0.0.1:8000 NODE (the server binds 127.0.0.1 unless HOST says).
#
# Environment (export before sbatch; the job inherits it):
#   MIMIR_API_KEY_FILE  the key file, one key a line (several: every one is accepted)
#                                                    [~/.config/mimir/api-key, made when missing]
#   HOST                address to bind              [127.0.0.1]
#   PYTHON              python with this project installed [$VENV/bin/python, else python3]
#   VENV                virtual environment          [<repo>/.venv when it exists]
#   MIMIR_REPO          repository root              [the directory sbatch (or bash) was run from]
#   DOCKER_IMAGE        serve in this image (launchers/container.sh, which reads DOCKER_MOUNTS, ...);
#                       the key file is mounted read-only at its own path
#   DRY_RUN=1           print the command instead of running it
set -euo pipefail

REPO="${MIMIR_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [ ! -f "$REPO/launchers/serve.sh" ]; then
    echo "serve.sh: $REPO is not the repository root: run it from there or set MIMIR_REPO" >&2
    exit 2
fi
cd "$REPO"
if [ -z "${PYTHON:-}" ]; then
    VENV="${VENV:-$REPO/.venv}"
    if [ -x "$VENV/bin/python" ]; then PYTHON="$VENV/bin/python"; else PYTHON=python3; fi
fi
HOST="${HOST:-127.0.0.1}"
KEY_FILE="${MIMIR_API_KEY_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/mimir/api-key}"

if [ ! -e "$KEY_FILE" ]; then
    # umask 077 in a subshell: the file is private from its creation, not chmod-ed afterwards
    (
        umask 077
        mkdir -p "$(dirname "$KEY_FILE")"
        "$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$KEY_FILE"
    )
    echo "serve.sh: made a new API key in $KEY_FILE (mode 600); clients: export MIMIR_API_KEY=\"\$(cat $KEY_FILE)\"" >&2
fi
if [ ! -r "$KEY_FILE" ]; then
    echo "serve.sh: cannot read the API key file $KEY_FILE" >&2
    exit 2
fi

if [ -n "${DOCKER_IMAGE:-}" ]; then
    export DOCKER_MOUNTS="${DOCKER_MOUNTS:-$REPO},$KEY_FILE:$KEY_FILE:ro"
    command=(bash "$REPO/launchers/container.sh" serve)
else
    command=("$PYTHON" -m mimir_megatron.cli serve)
fi
command+=(--host "$HOST" --api-key-file "$KEY_FILE" "$@")

echo "serve.sh: ${command[*]}" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
    exit 0
fi
# exec: Slurm's SIGTERM (scancel, the time limit) reaches the server, which finishes the requests
# in flight and exits 0.
exec "${command[@]}"
