"""The best-fit-decreasing loop of packing windows in C, built when the package is installed; the
pure-Python loop (:func:`mimir_megatron.data.packing._best_fit`) where it was not built.

The C loop (``kernels/mimir_kernels/csrc/bestfit.c``) is the Python one statement for statement
(the same sorted list of free spaces, the same ``bisect_left``, the same insert and pop), so the
contexts are identical; numpy does the sort before it and the grouping after it. A packing index
at the paper's scale (174M samples an epoch) is the reason: the loop takes ~1.6 µs a sample in
Python, ~25x the C loop's (a whole index ~5x: bench/bench_data.py, docs/performance.md).

``pip install`` builds it (pyproject.toml's optional ``ext-modules``) into the installed
``mimir_kernels`` package as ``_bestfit<EXT_SUFFIX>``, a plain shared library loaded here with
ctypes: nothing is compiled or written at run time. An install without a C compiler still
succeeds; packing then runs in Python, said once in the log. ``MIMIR_PACKING=python`` uses the
Python loop.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_BLOCK = 1 << 20  # samples per call: bounds the scratch arrays


def library_path() -> Path | None:
    """Where the install put the built loop (``mimir_kernels/_bestfit<EXT_SUFFIX>``), if it did.
    Found without importing ``mimir_kernels`` (whose kernels import torch)."""
    spec = importlib.util.find_spec("mimir_kernels")
    name = "_bestfit" + sysconfig.get_config_var("EXT_SUFFIX")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built best fit, or None (``MIMIR_PACKING=python``, or not built at install time)."""
    if os.environ.get("MIMIR_PACKING", "").lower() == "python":
        return None
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path)) if path else None
        why = "was not built at install time (no C compiler?)"
    except OSError as exc:
        lib, why = None, f"does not load ({exc})"
    if lib is None:
        log.info("packing: the C best fit (mimir_kernels/_bestfit) %s, so it runs in Python: an "
                 "epoch's index ~5x slower (~1.4 µs a sample, ~4 CPU-min for 174M samples); reinstall "
                 "with a C compiler (apt-get install gcc) to build it", why)
        return None
    lib.pack_windows.restype = ctypes.c_int64
    lib.pack_windows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32] + \
        [ctypes.c_void_p] * 8
    return lib


def pack_windows_native(lib: ctypes.CDLL, lengths: np.ndarray, seq_len: int,
                        window: int) -> tuple[np.ndarray, np.ndarray]:
    """(window positions of every context's items, context after context; items per context),
    as ``packing._pack_windows`` returns them, through the C loop."""
    dtype = np.int32 if len(lengths) < 2**31 else np.int64
    items: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    block = max(window, _BLOCK // window * window)  # whole windows per call
    scratch = min(window, len(lengths))
    count = np.empty(seq_len + 2, np.int64)
    order, bin_of, owners = (np.empty(scratch, np.int64) for _ in range(3))
    caps, pos = np.empty(scratch, np.int32), np.empty(scratch + 1, np.int64)
    for b0 in range(0, len(lengths), block):
        chunk = np.ascontiguousarray(lengths[b0 : b0 + block], dtype=np.int32)
        out, per_context = np.empty(len(chunk), np.int64), np.empty(len(chunk), np.int64)
        contexts = lib.pack_windows(
            chunk.ctypes.data, len(chunk), window, seq_len, out.ctypes.data, per_context.ctypes.data,
            count.ctypes.data, order.ctypes.data, bin_of.ctypes.data, caps.ctypes.data, owners.ctypes.data,
            pos.ctypes.data)
        items.append((out + b0).astype(dtype))
        sizes.append(per_context[:contexts].copy())
    if not items:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return np.concatenate(items), np.concatenate(sizes)
