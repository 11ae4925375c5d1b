/* The joining prompts' attention half of a layer in the inference step, for fp32 on the CPU: RoPE
   on each token's query and key, its key and value written into the KV cache, every token of a
   prompt attending all of that prompt's positions (PrefixLM's prefix is bidirectional), the context
   times the sigmoid of its output gate. One call, one OpenMP region, where the step ran RoPE and
   the writes in C, torch's SDPA over each run of equal-length prompts and the gate in C again
   (mimir_kernels/cpu_step.py says what it measured).

   The products are blocked: a work item is up to QUERY_BLOCK queries of one head against all of
   its prompt's keys, transposed KEY_TILE at a time so that scores are summed over the head width
   for sixteen keys at once; the weighted values likewise for sixteen widths at once. Every score,
   softmax sum and context element is summed in one fixed order, each product and sum rounded on
   its own (no FMA contraction: -ffp-contract=off), so the result does not depend on the vector
   width the CPU runs, the thread count, or the prompts sharing the step. The exponentials are
   csrc/exp.c's (libm's expf bit for bit).

   Part of the library mimir_kernels/_cpu_step, loaded with ctypes (mimir_kernels/cpu_step.py). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "head_ops.h"

#define QUERY_BLOCK 64 /* queries a work item takes */
#define KEY_TILE 64    /* keys transposed at a time (16 KiB at a head width of 64: L1) */

/* The work items of one head of a prompt of `length` tokens: its blocks of QUERY_BLOCK queries. */
static inline int64_t query_blocks(int64_t length) { return (length + QUERY_BLOCK - 1) / QUERY_BLOCK; }

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias)); /* unaligned access */

#define load8(p) (*(const v8u *)(p))
#define store8(p, v) (*(v8u *)(p) = (v))

/* scores[r][j] = (sum over d of q[r][d] * kt[d][j]) * scale for r < rows, j < n, score rows
   `stride` floats apart: kt is n keys transposed, [hd][n]. Four query rows and sixteen keys a pass;
   the sum over d in order. */
CLONES static void block_scores(const float *restrict q, const float *restrict kt, int64_t rows, int64_t n,
                                int64_t hd, float scale, float *restrict scores, int64_t stride) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *q0 = q + r * hd, *q1 = q0 + hd, *q2 = q1 + hd, *q3 = q2 + hd;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
            for (int64_t d = 0; d < hd; d++) {
                v8 k0 = load8(kt + d * n + j), k1 = load8(kt + d * n + j + 8);
                a0 += q0[d] * k0; b0 += q0[d] * k1;
                a1 += q1[d] * k0; b1 += q1[d] * k1;
                a2 += q2[d] * k0; b2 += q2[d] * k1;
                a3 += q3[d] * k0; b3 += q3[d] * k1;
            }
            float *s = scores + r * stride + j;
            store8(s, a0 * scale); store8(s + 8, b0 * scale);
            store8(s + stride, a1 * scale); store8(s + stride + 8, b1 * scale);
            store8(s + 2 * stride, a2 * scale); store8(s + 2 * stride + 8, b2 * scale);
            store8(s + 3 * stride, a3 * scale); store8(s + 3 * stride + 8, b3 * scale);
        }
        for (; j + 8 <= n; j += 8) {
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t d = 0; d < hd; d++) {
                v8 k0 = load8(kt + d * n + j);
                a0 += q0[d] * k0; a1 += q1[d] * k0; a2 += q2[d] * k0; a3 += q3[d] * k0;
            }
            float *s = scores + r * stride + j;
            store8(s, a0 * scale); store8(s + stride, a1 * scale);
            store8(s + 2 * stride, a2 * scale); store8(s + 3 * stride, a3 * scale);
        }
        for (; j < n; j++)
            for (int64_t rr = r; rr < r + 4; rr++) {
                float s = 0.f;
                for (int64_t d = 0; d < hd; d++) s += q[rr * hd + d] * kt[d * n + j];
                scores[rr * stride + j] = s * scale;
            }
    }
    for (; r < rows; r++)
        for (int64_t j = 0; j < n; j++) {
            float s = 0.f;
            for (int64_t d = 0; d < hd; d++) s += q[r * hd + d] * kt[d * n + j];
            scores[r * stride + j] = s * scale;
        }
}

/* out[r] = (sum over j of weights[r][j] * values[j]) / sums[r] for r < rows: four rows and sixteen
   widths a pass, the sum over j in order. out rows are `stride` floats apart. */
CLONES static void block_context(const float *restrict weights, const float *restrict values, const float *sums,
                                 int64_t rows, int64_t n, int64_t hd, float *out, int64_t stride) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = weights + r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        int64_t c = 0;
        for (; c + 16 <= hd; c += 16) {
            v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
            for (int64_t j = 0; j < n; j++) {
                v8 x0 = load8(values + j * hd + c), x1 = load8(values + j * hd + c + 8);
                a0 += w0[j] * x0; b0 += w0[j] * x1;
                a1 += w1[j] * x0; b1 += w1[j] * x1;
                a2 += w2[j] * x0; b2 += w2[j] * x1;
                a3 += w3[j] * x0; b3 += w3[j] * x1;
            }
            store8(out + r * stride + c, a0 / sums[r]); store8(out + r * stride + c + 8, b0 / sums[r]);
            store8(out + (r + 1) * stride + c, a1 / sums[r + 1]);
            store8(out + (r + 1) * stride + c + 8, b1 / sums[r + 1]);
            store8(out + (r + 2) * stride + c, a2 / sums[r + 2]);
            store8(out + (r + 2) * stride + c + 8, b2 / sums[r + 2]);
            store8(out + (r + 3) * stride + c, a3 / sums[r + 3]);
            store8(out + (r + 3) * stride + c + 8, b3 / sums[r + 3]);
        }
        for (; c + 8 <= hd; c += 8) {
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t j = 0; j < n; j++) {
                v8 x0 = load8(values + j * hd + c);
                a0 += w0[j] * x0; a1 += w1[j] * x0; a2 += w2[j] * x0; a3 += w3[j] * x0;
            }
            store8(out + r * stride + c, a0 / sums[r]);
            store8(out + (r + 1) * stride + c, a1 / sums[r + 1]);
            store8(out + (r + 2) * stride + c, a2 / sums[r + 2]);
            store8(out + (r + 3) * stride + c, a3 / sums[r + 3]);
        }
        for (; c < hd; c++)
            for (int64_t rr = r; rr < r + 4; rr++) {
                float a = 0.f;
                for (int64_t j = 0; j < n; j++) a += weights[rr * n + j] * values[j * hd + c];
                out[rr * stride + c] = a / sums[rr];
            }
    }
    for (; r < rows; r++)
        for (int64_t c = 0; c < hd; c++) {
            float a = 0.f;
            for (int64_t j = 0; j < n; j++) a += weights[r * n + j] * values[j * hd + c];
            out[r * stride + c] = a / sums[r];
        }
}

/* x[j] - max(x), in place (the maximum is exact in any order). */
CLONES static void shift_by_max(float *restrict x, int64_t n) {
    float top = -INFINITY;
    int64_t j = 0;
    if (n >= 8) {
        v8 m = load8(x);
        for (j = 8; j + 8 <= n; j += 8) {
            v8 v = load8(x + j);
            v8i bigger = v > m;
            m = (v8)(((v8i)v & bigger) | ((v8i)m & ~bigger));
        }
        for (int i = 0; i < 8; i++) top = m[i] > top ? m[i] : top;
    }
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    for (j = 0; j < n; j++) x[j] -= top;
}

/* The sum of x[0, n): eight running sums (x[j] into lane j % 8 in order), then the lanes in order
   and the tail; a fixed order whatever the CPU's vector width. */
CLONES static float sum_of(const float *restrict x, int64_t n) {
    v8 lanes = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) lanes += load8(x + j);
    float sum = 0.f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (; j < n; j++) sum += x[j];
    return sum;
}

/* Per-thread scratch of a work item: its queries, the keys transposed, the scores, the sums. */
typedef struct {
    float *q, *kt, *scores, *sums;
} Scratch;

/* One work item: queries [first, first + rows) of one prompt's head h. The prompt's tokens are the
   step's tokens [offset, offset + length), its keys and values the cache's row `row`; out holds
   each query (after RoPE) on entry and its gated context on return. */
static void attend_block(const float *mixed, const float *keys, const float *values, float *out, int64_t row,
                         int64_t offset, int64_t length, int64_t h, int64_t first, int64_t rows, int64_t heads,
                         int64_t hd, int64_t positions_room, float scale, Scratch s) {
    const float *k = keys + (row * heads + h) * positions_room * hd;
    const float *v = values + (row * heads + h) * positions_room * hd;
    for (int64_t r = 0; r < rows; r++)
        memcpy(s.q + r * hd, out + ((offset + first + r) * heads + h) * hd, sizeof(float) * (size_t)hd);
    for (int64_t j0 = 0; j0 < length; j0 += KEY_TILE) {  /* the keys transposed a tile at a time */
        int64_t n = length - j0 < KEY_TILE ? length - j0 : KEY_TILE;
        for (int64_t j = 0; j < n; j++)
            for (int64_t d = 0; d < hd; d++) s.kt[d * n + j] = k[(j0 + j) * hd + d];
        block_scores(s.q, s.kt, rows, n, hd, scale, s.scores + j0, length);
    }
    for (int64_t r = 0; r < rows; r++) {  /* softmax's weights, unnormalised: exp(score - max) */
        float *row_scores = s.scores + r * length;
        shift_by_max(row_scores, length);
        mimir_exp(row_scores, length);
        s.sums[r] = sum_of(row_scores, length);
    }
    float *first_out = out + ((offset + first) * heads + h) * hd;
    block_context(s.scores, v, s.sums, rows, length, hd, first_out, heads * hd);
    for (int64_t r = 0; r < rows; r++) {
        int64_t w = (offset + first + r) * heads + h;
        gate_head(out + w * hd, mixed + (w * 4 + 1) * hd, hd);
    }
}

/* The step's `tokens` prompt tokens: mixed [tokens, heads, 4, hd] (q, gate, k, v per head), cos_,
   sin_ [tokens, hd] (sin with rotate-half's signs); token t is written into the cache (keys,
   values: [rows_room, heads, positions_room, hd]) at (row[t], position[t]). prompts: [count, 3]
   int64, each prompt's (cache row, first token, length); every token of a prompt attends its
   prompt's positions [0, length). out: [tokens, heads * hd]. Returns 0, or 1 for a head width over
   MAX_HEAD_DIM or odd, 2 for a row, position or prompt outside the buffers or the step, 3 for
   scratch memory not allocated. Exported by name for ctypes. */
__attribute__((visibility("default")))
int mimir_prompt_attention(const float *mixed, const float *cos_, const float *sin_, float *keys, float *values,
                           const int64_t *row, const int64_t *position, int64_t tokens, int64_t heads,
                           int64_t hd, int64_t rows_room, int64_t positions_room, const int64_t *prompts,
                           int64_t count, float scale, int threads, float *out) {
    if (hd > MAX_HEAD_DIM || hd % 2 != 0) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (!in_cache(row[t], position[t], rows_room, positions_room)) return 2;
    int64_t longest = 1;
    for (int64_t p = 0; p < count; p++) {
        int64_t prow = prompts[3 * p], offset = prompts[3 * p + 1], length = prompts[3 * p + 2];
        if (prow < 0 || prow >= rows_room || offset < 0 || length < 1 || length > positions_room ||
            offset + length > tokens)
            return 2;
        longest = length > longest ? length : longest;
    }
    /* item_start[p]: the first work item of prompt p (its heads' query blocks, head-major) */
    int64_t *item_start = malloc(sizeof(int64_t) * (size_t)(count + 1));
    if (item_start == NULL) return 3;
    item_start[0] = 0;
    for (int64_t p = 0; p < count; p++)
        item_start[p + 1] = item_start[p] + heads * query_blocks(prompts[3 * p + 2]);
    int64_t items = item_start[count];
    int failed = 0;
    int64_t work = tokens * heads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++)
            store_item(w, mixed, cos_, sin_, keys, values, row, position, heads, hd, positions_room, out);
        /* the loop's barrier: every key is stored before any query attends */
        size_t floats = (size_t)(QUERY_BLOCK * hd + hd * KEY_TILE + QUERY_BLOCK * longest + QUERY_BLOCK);
        float *mem = malloc(sizeof(float) * floats);
        if (mem == NULL) {
#pragma omp atomic write
            failed = 3;
        }
        Scratch s = {0};
        if (mem != NULL)
            s = (Scratch){mem, mem + QUERY_BLOCK * hd, mem + QUERY_BLOCK * hd + hd * KEY_TILE,
                          mem + QUERY_BLOCK * hd + hd * KEY_TILE + QUERY_BLOCK * longest};
        int64_t p = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (mem == NULL) continue;
            while (item >= item_start[p + 1]) p++;  /* items arrive in increasing order per thread */
            int64_t blocks = query_blocks(prompts[3 * p + 2]);
            int64_t local = item - item_start[p], h = local / blocks, first = (local % blocks) * QUERY_BLOCK;
            int64_t length = prompts[3 * p + 2], rows = length - first < QUERY_BLOCK ? length - first : QUERY_BLOCK;
            attend_block(mixed, keys, values, out, prompts[3 * p], prompts[3 * p + 1], length, h, first, rows,
                         heads, hd, positions_room, scale, s);
        }
        free(mem);
    }
    free(item_start);
    return failed;
}
