#!/usr/bin/env bash
# Set up everything and run the test suite: bash tests/run.sh [unit|integration|system] [pytest args]
#
# Without a tier, every tier runs (what CI does). Tiers (tests/TIERS.md): unit is in-process and
# quick, integration spawns processes and servers, system needs Slurm, the demo or docker tools.
#
# As root with apt-get available, installs the system packages the tests use (Slurm and munge
# for the real Slurm tests, iproute2 and util-linux for their two simulated nodes, shellcheck
# for the launcher lint, chromium for the MLflow UI in a browser, docker.io and debootstrap for the
# image's build and runs, a C compiler for the packer's best fit that the .venv's install builds,
# passwd and curl for the second Unix user who tries the services of the first);
# without them those
# tests skip with a reason (and fail under CI=true, see tests/expected_skips.txt). Then creates
# .venv with the test extras and runs pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

targets=(tests)
case "${1:-}" in
    unit | integration | system) targets=("tests/$1"); shift ;;
esac

packages=(slurmctld slurmd slurm-client munge iproute2 util-linux shellcheck procps chromium debootstrap gcc libc6-dev
    passwd curl)
# Docker for tests/system/test_docker.py (it starts dockerd itself when none runs); a machine
# with another Docker (docker-ce) keeps it.
command -v dockerd >/dev/null 2>&1 || packages+=(docker.io)
if [ "${targets[0]}" != tests/unit ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
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
# Workers (pytest-xdist): one per core, at most 4; MIMIR_TEST_WORKERS=1 runs in this process.
# Much of the suite waits on subprocesses, servers and Slurm, or runs single-threaded Python, so
# two workers on two cores finish in about half the time (a third worker on two cores was
# slower, 18 min 49 s against 17 min 11 s: the README check's demo training starved). A module
# runs on one worker (its trained fixtures are built once), the modules that take minutes first
# (tests/helpers/schedule.py).
cores="$(nproc)"
workers="${MIMIR_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
parallel=(-p no:xdist)
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
    # Workers and their subprocesses share the cores with more torch threads than there are
    # cores. An OpenMP thread that finds no work spins before it sleeps; under that contention
    # the spinning burned as much CPU as the work (the demo's training: 953 CPU-s where alone it
    # needs ~540). Sleeping at once changes no result (same threads, same reduction order).
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
fi
# Files the tests keep for people to look at (the MLflow UI's screenshots: tests/system/test_ui_browser.py)
# go to $MIMIR_TEST_ARTIFACTS, default build/test-artifacts: CI keeps that folder.
export MIMIR_TEST_ARTIFACTS="${MIMIR_TEST_ARTIFACTS:-$repo/build/test-artifacts}"
# -rs lists every skip with its reason; under CI=true a skip not in tests/expected_skips.txt
# fails the run (tests/helpers/skip_policy.py); --durations=30 lists the slowest tests of every run.
exec "${VENV:-$repo/.venv}/bin/python" -m pytest -q -rs --durations=30 -p no:cacheprovider "${parallel[@]}" \
    "$@" "${targets[@]}"
