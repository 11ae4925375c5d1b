/* y = x W^T (+ add), fp32 on the CPU, on a weight packed once: the inference step's weight products
   from a few rows up (a prompt's tokens, a decoding step's 8-32 rows) on CPUs with AVX-512.

   The weight is packed into panels of 32 outputs, each panel its `in` columns one after another
   (32 consecutive floats per input), zero beyond the last output. A thread takes a contiguous
   range of panels; for each block of up to 8 rows of x it keeps the 8 x 32 results in 16 vector
   registers and, per input, loads the panel's 32 weights once and multiplies them by each row's
   value broadcast (one fused multiply-add per 16 results). Rows are taken in chunks of ~512 KiB of
   x, so that a chunk stays in the core's L2 while the thread's panels stream past it. (Fetching
   the next panel into L2 ahead of its use was tried: faster alone, 1.00x inside the step.)

   Why not oneDNN's GEMM on its own prepacked layout (torch.ops.mkldnn._linear_pointwise), which
   the step used before: on the AMD EPYC (Zen 4, 2 cores) its products of 64 rows by mid512's
   weights ran at 180-191 GFLOP/s inside a prefill, this loop at 198-205 (the FMA units' peak is
   ~234), and at 16 rows 113 against 158; torch's call also spends ~7-13 µs a call on ideep's
   bookkeeping (docs/performance.md#serving has the figures).

   Every result is one chain of fused multiply-adds over the inputs in order, from 0, then `add`
   added (rounded as `add + product`): the same whatever the rows beside it, the row count, the
   chunking or the thread count (batch-invariant), and equal to torch's products to float rounding.

   Part of the library mimir_kernels/_cpu_step (mimir_kernels/cpu_step.py). */

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 32      /* outputs per panel: two 16-float vectors */
#define BLOCK_ROWS 8  /* rows per register block: 16 accumulators */
#define CHUNK_BYTES (512 * 1024)

void mimir_pack_weight(const float *restrict w, int64_t out, int64_t in, float *restrict packed, int threads) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * in * PANEL;
        for (int64_t k = 0; k < in; k++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t o = p * PANEL + j;
                dst[k * PANEL + j] = o < out ? w[o * in + k] : 0.0f;
            }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

int mimir_packed_gemm_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* `rows` (1-8, a constant once inlined) rows of x against one panel: y's `cols` (1-32) columns. */
AVX512 static inline __attribute__((always_inline)) void
block(const int rows, const float *restrict x, int64_t x_stride, const float *restrict panel, int64_t in,
      const float *restrict add, float *restrict y, int64_t y_stride, int cols) {
    __m512 acc[BLOCK_ROWS][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * PANEL), w1 = _mm512_loadu_ps(panel + k * PANEL + 16);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    const __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int r = 0; r < rows; r++) {
        __m512 y0 = acc[r][0], y1 = acc[r][1];
        if (add) {
            y0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, add + r * y_stride), y0);
            y1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, add + r * y_stride + 16), y1);
        }
        _mm512_mask_storeu_ps(y + r * y_stride, m0, y0);
        _mm512_mask_storeu_ps(y + r * y_stride + 16, m1, y1);
    }
}

/* Each row count its own unrolled copy, so that the accumulators stay in registers. */
#define BLOCK_CASE(n) \
    case n: block(n, x, x_stride, panel, in, add, y, y_stride, cols); break;

AVX512 static void rows_block(int rows, const float *x, int64_t x_stride, const float *panel, int64_t in,
                              const float *add, float *y, int64_t y_stride, int cols) {
    switch (rows) {
        BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4)
        BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7) BLOCK_CASE(8)
    }
}

AVX512 static void gemm(const float *x, int64_t rows, int64_t in, int64_t x_stride, const float *packed,
                        int64_t out, const float *add, float *y, int threads) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
    int64_t chunk = in > 0 ? CHUNK_BYTES / (in * (int64_t)sizeof(float)) / BLOCK_ROWS * BLOCK_ROWS : rows;
    if (chunk < BLOCK_ROWS)
        chunk = BLOCK_ROWS;
#pragma omp parallel num_threads(threads)
    {
        int64_t team = 1, me = 0;
#ifdef _OPENMP
        team = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        const int64_t p0 = panels * me / team, p1 = panels * (me + 1) / team;
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
            const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
            for (int64_t p = p0; p < p1; p++) {
                const float *panel = packed + p * in * PANEL;
                const int cols = out - p * PANEL < PANEL ? (int)(out - p * PANEL) : PANEL;
                for (int64_t r = r0; r < r1; r += BLOCK_ROWS) {
                    const int n = r1 - r < BLOCK_ROWS ? (int)(r1 - r) : BLOCK_ROWS;
                    rows_block(n, x + r * x_stride, x_stride, panel, in, add ? add + r * out + p * PANEL : 0,
                               y + r * out + p * PANEL, out, cols);
                }
            }
        }
    }
}

/* x [rows, in] with rows `x_stride` floats apart; packed from mimir_pack_weight; y and add
   [rows, out], contiguous. Returns 1 where the CPU has no AVX-512 (nothing written). */
int mimir_packed_gemm(const float *x, int64_t rows, int64_t in, int64_t x_stride, const float *packed,
                      int64_t out, const float *add, float *y, int threads) {
    if (!mimir_packed_gemm_available())
        return 1;
    gemm(x, rows, in, x_stride, packed, out, add, y, threads);
    return 0;
}

#else

int mimir_packed_gemm_available(void) { return 0; }

int mimir_packed_gemm(const float *x, int64_t rows, int64_t in, int64_t x_stride, const float *packed,
                      int64_t out, const float *add, float *y, int threads) {
    (void)x, (void)rows, (void)in, (void)x_stride, (void)packed, (void)out, (void)add, (void)y, (void)threads;
    return 1;
}

#endif
