/* y = x W^T (+ add) for a few rows of x, fp32 on the CPU: the inference step's weight products at
   a decoding step's 1-8 rows. There the product reads every weight once and does little with it,
   so it is bound by reading the weights; oneDNN's and MKL's GEMMs, made for many rows, read them
   at 15-17 GB/s inside a step where this loop reads them at ~25 GB/s (mimir_kernels/cpu_step.py
   has the figures). Each thread takes a contiguous range of W's rows (outputs) and streams it once
   for all of x's rows, which stay in L1.

   Every (row, output) is summed in one fixed order, whatever the number of rows and threads: four
   8-wide partial sums over 32-float strides, an 8-wide tail into the first, the four combined
   pairwise, the lanes pairwise, then the scalar tail; `add` last, as `add + product` rounds.
   So a row's result does not depend on the rows beside it in the step (batch-invariant), and
   differs from torch's GEMMs by float rounding only. Products and sums rounded one at a time
   (-ffp-contract=off, the library's flag): bound by memory up to ~4-8 rows, FMA would save
   nothing there, and from 9 rows the step uses oneDNN's GEMM.

   Part of the library mimir_kernels/_cpu_step (mimir_kernels/cpu_step.py). */

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define CLONES
#endif

/* GCC's and clang's generic vectors: 8 floats, one AVX register, two SSE or NEON ones. Unaligned
   loads (aligned(4)): torch's rows start anywhere. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8 *)(p))

/* The fixed order's end: the four partial sums, then the lanes. */
static inline float total(const v8 *part) {
    v8 s = (part[0] + part[1]) + (part[2] + part[3]);
    float b0 = s[0] + s[4], b1 = s[1] + s[5], b2 = s[2] + s[6], b3 = s[3] + s[7];
    return (b0 + b2) + (b1 + b3);
}

static inline void store(float *restrict y, const float *restrict add, int64_t at, float s) {
    y[at] = add ? add[at] + s : s;
}

/* Outputs [o0, o1) of every row: x [rows, in], w [out, in], y and add [rows, out]. Two rows at a
   time share each weight load. */
CLONES static void outputs(const float *restrict x, int64_t rows, int64_t in, const float *restrict w,
                           int64_t o0, int64_t o1, int64_t out, const float *restrict add, float *restrict y) {
    const int64_t n32 = in & ~(int64_t)31, n8 = in & ~(int64_t)7;
    for (int64_t o = o0; o < o1; o++) {
        const float *wo = w + o * in;
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            const float *p = x + r * in, *q = p + in;
            v8 a[4] = {{0}}, b[4] = {{0}};
            for (int64_t i = 0; i < n32; i += 32) {
                v8 w0 = LOAD(wo + i), w1 = LOAD(wo + i + 8), w2 = LOAD(wo + i + 16), w3 = LOAD(wo + i + 24);
                a[0] += w0 * LOAD(p + i);
                a[1] += w1 * LOAD(p + i + 8);
                a[2] += w2 * LOAD(p + i + 16);
                a[3] += w3 * LOAD(p + i + 24);
                b[0] += w0 * LOAD(q + i);
                b[1] += w1 * LOAD(q + i + 8);
                b[2] += w2 * LOAD(q + i + 16);
                b[3] += w3 * LOAD(q + i + 24);
            }
            for (int64_t i = n32; i < n8; i += 8) {
                v8 w0 = LOAD(wo + i);
                a[0] += w0 * LOAD(p + i);
                b[0] += w0 * LOAD(q + i);
            }
            float s = total(a), t = total(b);
            for (int64_t i = n8; i < in; i++) {
                s += wo[i] * p[i];
                t += wo[i] * q[i];
            }
            store(y, add, r * out + o, s);
            store(y, add, (r + 1) * out + o, t);
        }
        if (r < rows) {
            const float *p = x + r * in;
            v8 a[4] = {{0}};
            for (int64_t i = 0; i < n32; i += 32) {
                a[0] += LOAD(wo + i) * LOAD(p + i);
                a[1] += LOAD(wo + i + 8) * LOAD(p + i + 8);
                a[2] += LOAD(wo + i + 16) * LOAD(p + i + 16);
                a[3] += LOAD(wo + i + 24) * LOAD(p + i + 24);
            }
            for (int64_t i = n32; i < n8; i += 8) a[0] += LOAD(wo + i) * LOAD(p + i);
            float s = total(a);
            for (int64_t i = n8; i < in; i++) s += wo[i] * p[i];
            store(y, add, r * out + o, s);
        }
    }
}

/* x: [rows, in]; w: [out, in]; add (or NULL) and y: [rows, out]; all contiguous, y apart from the
   others. W's rows split over `threads` OpenMP threads when there are enough of them to pay for
   waking the threads. Exported by name for ctypes. */
__attribute__((visibility("default")))
void mimir_small_gemm(const float *x, int64_t rows, int64_t in, const float *w, int64_t out, const float *add,
                      float *y, int threads) {
#ifdef _OPENMP
    if (threads > 1 && out * in >= 32768) {
#pragma omp parallel num_threads(threads)
        {
            int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
            outputs(x, rows, in, w, out * t / n, out * (t + 1) / n, out, add, y);
        }
        return;
    }
#endif
    (void)threads;
    outputs(x, rows, in, w, 0, out, out, add, y);
}
