/* expf over an array, four lanes at a time, bit for bit what libm's expf returns.

   The attention kernels call expf for every softmax weight and every output gate; one call at a
   time it cost ~4 ns a value, the largest part of the output gate of a 64-token prompt (a sixth
   of the tiny model's prefill outside its weight products). glibc (2.28 on) picks its expf by the
   CPU: where AVX2 and FMA are usable, a table-driven evaluation in double precision with fused
   multiply-adds, rounded once to float. mimir_exp evaluates those same operations on four lanes
   of AVX2 doubles: the same constants, the same fused steps in the same order, the same final
   rounding, so every result equals expf's. Inputs outside that evaluation's range (|x| >= 88, inf,
   nan) still go to expf itself.

   Whether the vector path is used is settled once when the library loads: the CPU has AVX2 and
   FMA, and the lanes agree with this process's expf on 65,536 inputs spread over every exponent
   and sign. Anything else (another libm, another CPU) keeps expf, one value at a time.
   tests/unit/test_step_ops.py compares every 64th float bit pattern. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MIMIR_EXP_X86 1
#endif

/* The reduction x / ln2 * 32 = k + r, |r| <= 1/2, and exp(x) = 2^(k/32) * 2^(r/32): the scale,
   the shift that rounds to an integer, 2^(i/32) for i in [0, 32) with the exponent's share of i
   taken out (added back from k), and the cubic for 2^(r/32) - glibc's exp2f data, as its FMA
   expf reads them. */
static const double INV_LN2_32 = 0x1.71547652b82fep+5;
static const double ROUND_SHIFT = 0x1.8p+52;
static const double POLY[3] = {0x1.c6af84b912394p-20, 0x1.ebfce50fac4f3p-13, 0x1.62e42ff0c52d6p-6};
static const uint64_t TWO_TO_I_32[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
/* The top 12 bits (sign dropped) from which expf takes its special path: |x| >= 88. */
#define SPECIAL_TOP 0x42b

static int use_lanes = 0;

static void exp_libm(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = expf(x[i]);
}

#ifdef MIMIR_EXP_X86
/* Four values: expf's evaluation in double lanes; 1 in a lane whose input is special. */
__attribute__((target("avx2,fma"))) static inline __m128 exp4(__m128 x, int *special) {
    __m128i bits = _mm_castps_si128(x);
    __m128i top = _mm_and_si128(_mm_srli_epi32(bits, 20), _mm_set1_epi32(0x7ff));
    *special = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(top, _mm_set1_epi32(SPECIAL_TOP - 1))));
    __m256d xd = _mm256_cvtps_pd(x);
    __m256d scale = _mm256_set1_pd(INV_LN2_32), shift = _mm256_set1_pd(ROUND_SHIFT);
    __m256d kd = _mm256_fmadd_pd(scale, xd, shift);
    __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    __m256d r = _mm256_fmsub_pd(scale, xd, kd);
    __m256i index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    __m256i t = _mm256_i64gather_epi64((const long long *)TWO_TO_I_32, index, 8);
    __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(POLY[0]), r, _mm256_set1_pd(POLY[1]));
    __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(POLY[2]), _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, r2, y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, s));
}

__attribute__((target("avx2,fma"))) static void exp_lanes(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        int special;
        __m128 in = _mm_loadu_ps(x + i);
        __m128 out = exp4(in, &special);
        if (special) {
            float kept[4];
            _mm_storeu_ps(kept, in);
            _mm_storeu_ps(x + i, out);
            for (int j = 0; j < 4; j++)
                if (special >> j & 1) x[i + j] = expf(kept[j]);
        } else {
            _mm_storeu_ps(x + i, out);
        }
    }
    exp_libm(x + i, n - i);
}

/* Settled at load (file comment): lanes only where they agree with this process's expf. */
__attribute__((constructor)) static void choose_exp(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return;
    enum { SAMPLES = 65536, BLOCK = 256 };
    for (uint64_t start = 0; start < SAMPLES; start += BLOCK) {
        float lanes[BLOCK], libm[BLOCK];
        for (int j = 0; j < BLOCK; j++) {
            uint32_t pattern = (uint32_t)((start + (uint64_t)j) * (0x100000000ull / SAMPLES) + 0x9e37);
            memcpy(&lanes[j], &pattern, sizeof pattern);
            libm[j] = lanes[j];
        }
        exp_lanes(lanes, BLOCK);
        exp_libm(libm, BLOCK);
        if (memcmp(lanes, libm, sizeof lanes) != 0) return;  /* nan payloads included */
    }
    use_lanes = 1;
}
#endif

/* x[i] = expf(x[i]) for i in [0, n), in place (file comment). */
__attribute__((visibility("default")))
void mimir_exp(float *x, int64_t n) {
#ifdef MIMIR_EXP_X86
    if (use_lanes) {
        exp_lanes(x, n);
        return;
    }
#endif
    exp_libm(x, n);
}

/* libm's expf one value at a time: what mimir_exp must equal (the tests' reference). */
__attribute__((visibility("default")))
void mimir_exp_libm(float *x, int64_t n) { exp_libm(x, n); }

/* Whether mimir_exp runs on vector lanes here (1) or calls expf per value (0). */
__attribute__((visibility("default")))
int mimir_exp_uses_lanes(void) { return use_lanes; }
