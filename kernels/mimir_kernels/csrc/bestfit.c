/* Best-fit-decreasing of packing windows: the loop of mimir_megatron/data/packing.py's _best_fit
   in C, statement for statement (the same sorted list of free spaces, the same bisect_left, the
   same insert and pop), so the contexts are identical.

   Built at install time by setuptools (pyproject.toml, [[tool.setuptools.ext-modules]], optional)
   into mimir_kernels/_bestfit<EXT_SUFFIX>: a plain shared library with no Python API, which
   mimir_megatron/data/bestfit.py loads with ctypes (so building it needs a C compiler only, no
   Python headers). */

#include <stdint.h>
#include <string.h>

/* Best-fit-decreasing of the consecutive windows of lengths[0, n), as packing._best_fit does it
   window by window: the window's items longest first (ties in position order: a stable counting
   sort), each into the open context whose free space fits it most tightly (caps: free spaces
   ascending, a new one inserted before its equals, so the latest is taken first among equals),
   a new context when none fits; a context whose free space is below the window's smallest item
   is closed. Out: items, each context's positions in the order placed, context after context;
   sizes, the items per context. Returns the number of contexts. Scratch: count (seq_len + 2),
   order, bin_of, caps, owners, pos (window + 1 each). Exported by name for ctypes, whatever
   visibility the interpreter's CFLAGS set. */
__attribute__((visibility("default")))
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
