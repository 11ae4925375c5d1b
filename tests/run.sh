#!/usr/bin/env bash
# Set up everything and run the whole test suite: bash tests/run.sh [pytest args]
#
# As root with apt-get available, installs the system packages the tests use (Slurm and munge
# for the real Slurm tests, iproute2 and util-linux for their two simulated nodes, shellcheck
# for the launcher lint); without them those
# tests skip with a reason (and fail under CI=true, see tests/expected_skips.txt). Then creates
# .venv with the test extras and runs pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(slurmctld slurmd slurm-client munge iproute2 util-linux shellcheck procps)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=()
    for pkg in "${packages[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "tests/run.sh: installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

bash "$repo/launchers/setup_env.sh" test
cd "$repo"
# -rs lists every skip with its reason; under CI=true a skip not in tests/expected_skips.txt
# fails the run (tests/skip_policy.py).
exec "${VENV:-$repo/.venv}/bin/python" -m pytest -q -rs -p no:cacheprovider "$@" tests
