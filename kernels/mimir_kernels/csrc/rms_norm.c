/* RMSNorm without a weight for fp32 on the CPU, the inference step's norms (the model's are
   parameterless): out = x / sqrt(mean(x^2) + eps), per row, as torch.rms_norm computes it
   (x * rsqrt(mean + eps)). One call where torch's CPU rms_norm ran ~10 operations (pow, mean,
   add, rsqrt, mul and their copies): at a decoding step's 1-32 rows their dispatch, not the
   arithmetic, was the cost. The sum of squares is in another order than torch's: equal to float
   rounding. Part of the library mimir_kernels/_cpu_step (mimir_kernels/cpu_step.py). */

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define CLONES
#endif

CLONES static void norm_row(const float *restrict x, float *restrict out, int64_t width, float eps) {
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; i++) squares += x[i] * x[i];
    float scale = 1.f / sqrtf(squares / (float)width + eps);
#pragma omp simd
    for (int64_t i = 0; i < width; i++) out[i] = x[i] * scale;
}

/* x, out: [rows, width], contiguous (out may be x). Rows split over `threads` OpenMP threads once
   a call has enough of them to pay for waking the threads. Exported by name for ctypes. */
__attribute__((visibility("default")))
void mimir_rms_norm(const float *x, float *out, int64_t rows, int64_t width, float eps, int threads) {
    if (threads > 1 && rows * width >= 32768) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, out + r * width, width, eps);
    } else {  /* no OpenMP region at all: even an if(0) one was measured to cost more than the norm */
        for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, out + r * width, width, eps);
    }
}
