#!/usr/bin/env bash
# Inside the build: the wheelhouse docker/build.sh filled must be for this base's Python, or pip
# would only say that no wheel matches. Usage: bash docker/check-wheelhouse.sh DIR
set -euo pipefail
dir="$1"
want="$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
if [ ! -f "$dir/PYTHON" ]; then
    echo "docker/Dockerfile: no wheelhouse in docker/wheelhouse/: build with docker/build.sh, which fills it" >&2
    exit 1
fi
have="$(cat "$dir/PYTHON")"
if [ "$have" != "$want" ]; then
    echo "docker/Dockerfile: the wheelhouse holds wheels for $have but the base's Python is $want: fill it for this base (docker/build.sh)" >&2
    exit 1
fi
