"""Markers for tests of the C kernels (mimir_kernels): they skip where MIMIR_CPU_KERNELS=torch
turns the kernels off, as backend.native_cpu_step_ops does for the engine."""

from __future__ import annotations

import os

import pytest

needs_kernel = pytest.mark.skipif(os.environ.get("MIMIR_CPU_KERNELS", "").lower() == "torch",
                                  reason="MIMIR_CPU_KERNELS=torch")
