#!/usr/bin/env bash
# Download the wheels that bench/gpu_check.sh needs on a GPU machine without internet (one with
# PyTorch preinstalled): megatron-core, omegaconf, a transformers that has `hrm_text`, and pytest
# with pytest-timeout (the GPU image may lack a test runner; the per-test limit needs the plugin).
# Run it where PyPI is reachable, carry the folder, then: WHEELS=<folder> bash bench/gpu_check.sh
#
#   bash bench/fetch_wheels.sh [DIR]      # default DIR: .whl (git-ignored)
set -euo pipefail

dir=${1:-.whl}
python=${PYTHON:-python3}
mkdir -p "$dir"
# Pure-Python wheels plus megatron-core's manylinux build for CPython 3.12 on x86-64.
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" \
    "megatron-core==0.19.2" "omegaconf==2.4.0" "transformers==5.24.0" \
    "pytest==9.2.0" "pluggy==1.7.0" "iniconfig==2.3.1" "pytest-timeout==2.4.0"
ls -l "$dir"
