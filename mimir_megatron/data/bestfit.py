"""Best-fit-decreasing of packing windows in C, compiled on first use; the pure-Python loop
(:func:`mimir_megatron.data.packing._best_fit`) where no C compiler is found.

The C loop is the Python one statement for statement (the same sorted list of free spaces, the
same ``bisect_left``, the same insert and pop), so the contexts are identical; numpy does the
sort before it and the grouping after it. A packing index at the paper's scale (174M samples an
epoch) is the reason: ~2.8 µs a sample in Python, ~500 CPU-s an epoch.

The library is built with the system's C compiler (``$CC``, else ``cc``/``gcc``) into
``$XDG_CACHE_HOME/mimir-megatron`` (``~/.cache``), named by the source's digest, written under a
temporary name and renamed, so ranks and packing processes that race build it harmlessly.
``MIMIR_PACKING=python`` uses the Python loop.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Best-fit-decreasing of the consecutive windows of lengths[0, n), as packing._best_fit does it
   window by window: the window's items longest first (ties in position order: a stable counting
   sort), each into the open context whose free space fits it most tightly (caps: free spaces
   ascending, a new one inserted before its equals, so the latest is taken first among equals),
   a new context when none fits; a context whose free space is below the window's smallest item
   is closed. Out: items, each context's positions in the order placed, context after context;
   sizes, the items per context. Returns the number of contexts. Scratch: count (seq_len + 2),
   order, bin_of, caps, owners, pos (window + 1 each). */
int64_t pack_windows(const int32_t *lengths, int64_t n, int64_t window, int32_t seq_len,
                     int64_t *items, int64_t *sizes, int64_t *count, int64_t *order, int64_t *bin_of,
                     int32_t *caps, int64_t *owners, int64_t *pos) {
    int64_t bins = 0;
    for (int64_t w0 = 0; w0 < n; w0 += window) {
        int64_t m = n - w0 < window ? n - w0 : window;
        const int32_t *len = lengths + w0;
        memset(count, 0, (size_t)(seq_len + 2) * sizeof *count);
        for (int64_t i = 0; i < m; i++) count[seq_len - len[i] + 1]++;
        for (int64_t k = 1; k <= seq_len + 1; k++) count[k] += count[k - 1];
        for (int64_t i = 0; i < m; i++) order[count[seq_len - len[i]]++] = i;
        int32_t smallest = len[order[m - 1]];
        int64_t first_bin = bins, ncaps = 0;
        for (int64_t k = 0; k < m; k++) {
            int32_t size = len[order[k]];
            int64_t lo = 0, hi = ncaps;
            while (lo < hi) {
                int64_t mid = (lo + hi) / 2;
                if (caps[mid] < size) lo = mid + 1; else hi = mid;
            }
            int64_t b;
            int32_t free;
            if (lo == ncaps) {
                b = bins++;
                free = seq_len - size;
            } else {
                free = caps[lo] - size;
                b = owners[lo];
                memmove(caps + lo, caps + lo + 1, (size_t)(ncaps - lo - 1) * sizeof *caps);
                memmove(owners + lo, owners + lo + 1, (size_t)(ncaps - lo - 1) * sizeof *owners);
                ncaps--;
            }
            bin_of[k] = b - first_bin;
            if (free >= smallest) {
                lo = 0;
                hi = ncaps;
                while (lo < hi) {
                    int64_t mid = (lo + hi) / 2;
                    if (caps[mid] < free) lo = mid + 1; else hi = mid;
                }
                memmove(caps + lo + 1, caps + lo, (size_t)(ncaps - lo) * sizeof *caps);
                memmove(owners + lo + 1, owners + lo, (size_t)(ncaps - lo) * sizeof *owners);
                caps[lo] = free;
                owners[lo] = b;
                ncaps++;
            }
        }
        int64_t nb = bins - first_bin;
        for (int64_t b = 0; b < nb; b++) sizes[first_bin + b] = 0;
        for (int64_t k = 0; k < m; k++) sizes[first_bin + bin_of[k]]++;
        pos[0] = 0;
        for (int64_t b = 0; b < nb; b++) pos[b + 1] = pos[b] + sizes[first_bin + b];
        for (int64_t k = 0; k < m; k++) items[w0 + pos[bin_of[k]]++] = w0 + order[k];
    }
    return bins;
}
"""

_BLOCK = 1 << 20  # samples per call: bounds the scratch arrays


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled best fit, or None (no compiler, or ``MIMIR_PACKING=python``)."""
    if os.environ.get("MIMIR_PACKING", "").lower() == "python":
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mimir-megatron"
    path = cache / f"bestfit-{digest}.so"
    if not path.is_file() and not _compile(path):
        return None
    lib = ctypes.CDLL(str(path))
    lib.pack_windows.restype = ctypes.c_int64
    lib.pack_windows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32] + \
        [ctypes.c_void_p] * 8
    return lib


def _compile(path: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("packing: no C compiler found, best fit runs in Python (~30x slower; set CC)")
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            source = Path(tmp) / "bestfit.c"
            source.write_text(SOURCE)
            built = Path(tmp) / path.name
            subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                           check=True, capture_output=True, timeout=120)
            os.replace(built, path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.info("packing: building the C best fit failed (%s %s), it runs in Python",
                 exc, detail.decode(errors="replace")[:200])
        return False
    return True


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
