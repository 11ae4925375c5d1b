#!/usr/bin/env bash
# Create (or update) the project's virtual environment: bash launchers/setup_env.sh [extras]
#
# Finds a Python 3.12 (PYTHON, python3.12 on PATH, or a pyenv 3.12.x), makes $VENV (default
# .venv), and installs this package editable with the given extras (default: test), at the versions
# the Docker image pins (docker/requirements*.txt, as pip constraints): a run directory moves between
# the host and the image, and what it holds is read by the version that wrote it or a later one
# (MLflow's store schema, a checkpoint's torch). The tests run the versions the image ships.
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
stamp="$venv/.mimir-pyproject.sha256"
pins=("$repo/docker/requirements.txt" "$repo/docker/requirements-torch.txt")
digest="$(cat "$repo/pyproject.toml" "${pins[@]}" | sha256sum | cut -d' ' -f1)"
# Installed already (this pyproject.toml and pins, every requirement of the extra met): nothing to do. Re-running
# pip would reinstall the editable package under the feet of anything running from this venv.
if [ "$(cat "$stamp" 2>/dev/null)" = "$digest" ] && "$venv/bin/python" - "$extras" <<'PY' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement

def met(name: str, extras: set[str], seen: set) -> bool:
    """Every requirement of ``name[extras]`` is installed at a matching version."""
    if (name, frozenset(extras)) in seen:
        return True
    seen.add((name, frozenset(extras)))
    for line in distribution(name).requires or []:
        req = Requirement(line)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            continue
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                return False
        except PackageNotFoundError:
            return False
        if req.extras and not met(req.name, set(req.extras), seen):
            return False
    return True

sys.exit(0 if met("mimir-megatron", set(sys.argv[1].split(",")), set()) else 1)
PY
then
    echo "setup_env: mimir-megatron[$extras] is installed in $venv (pyproject.toml unchanged)"
    exit 0
fi
echo "setup_env: installing mimir-megatron[$extras] into $venv (torch is large on first install; log: $log)"
# pip and setuptools are chatty about editable installs: keep their output in the log, show it on failure.
if ! { "$venv/bin/python" -m pip install --upgrade pip \
        && "$venv/bin/python" -m pip install -e "${repo}[${extras}]" --constraint "${pins[0]}" \
            --constraint "${pins[1]}"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup_env: installation failed; full log: $log" >&2
    exit 1
fi
echo "$digest" >"$stamp"
echo "setup_env: ready: source $venv/bin/activate"
