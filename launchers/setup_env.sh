#!/usr/bin/env bash
# Create (or update) the project's virtual environment: bash launchers/setup_env.sh [extras]
#
# Finds a Python 3.12 (PYTHON, python3.12 on PATH, or a pyenv 3.12.x), makes $VENV (default
# .venv), and installs this package editable with the given extras (default: test).
# Idempotent: a second run only installs what changed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
extras="${1:-test}"

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

if [ ! -x "$venv/bin/python" ]; then
    python="$(find_python)" || { echo "setup_env: no Python 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
    echo "setup_env: creating $venv with $python"
    "$python" -m venv "$venv"
fi
log="$venv/setup.log"
echo "setup_env: installing mimir-megatron[$extras] into $venv (torch is large on first install; log: $log)"
# pip and setuptools are chatty about editable installs: keep their output in the log, show it on failure.
if ! { "$venv/bin/python" -m pip install --upgrade pip \
        && "$venv/bin/python" -m pip install -e "${repo}[${extras}]"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup_env: installation failed; full log: $log" >&2
    exit 1
fi
echo "setup_env: ready: source $venv/bin/activate"
