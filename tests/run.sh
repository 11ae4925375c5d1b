#!/usr/bin/env bash
# Set up the environment and run the whole test suite: bash tests/run.sh [pytest args]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/launchers/setup_env.sh" test
cd "$repo"
exec "${VENV:-$repo/.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
