/* The attention half of a layer in the inference step, for fp32 on the CPU: RoPE on each token's
   query and key, its key and value written into the KV cache, its query attending its row's first
   `attended` cached positions, the context times the sigmoid of its output gate. One call does a
   whole step's tokens (decoding rows and joining prompts alike), where torch took ten operations
   and one SDPA call over every row padded to the longest under a mask
   (mimir_kernels/cpu_step.py says what it replaces and what it measured).

   Built at install time by setuptools (pyproject.toml, [[tool.setuptools.ext-modules]], optional)
   into mimir_kernels/_cpu_step<EXT_SUFFIX> with rms_norm.c: a plain shared library with no Python
   API, loaded with ctypes. Threads: OpenMP, the caller's count (torch's); the library is loaded after
   torch, so its libgomp.so.1 is the one torch already loaded (one pool, not two).

   The arithmetic: RoPE as inference/step.py writes it, q * cos + rotate_half(q) * sin_signed,
   each product and the sum rounded on its own (no FMA contraction: -ffp-contract=off), so the
   cached keys are bit for bit torch's. The softmax and the weighted sum differ from SDPA's only
   in summation order (scores are exact dot products, the maximum subtracted before exp). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "head_ops.h"

/* One head of one token: softmax(q . keys[0, n) * scale) . values[0, n), times sigmoid(gate),
   into out (which holds q on entry). scores: n floats of scratch. */
CLONES static void attend(float *restrict out, const float *restrict gate, const float *restrict keys,
                          const float *restrict values, int64_t n, int64_t hd, float scale,
                          float *restrict scores) {
    float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    for (int64_t i = 0; i < hd; i++) {
        q[i] = out[i];
        acc[i] = 0.f;
    }
    float top = -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        const float *k = keys + p * hd;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < hd; i++) s += q[i] * k[i];
        s *= scale;
        scores[p] = s;
        top = s > top ? s : top;
    }
    for (int64_t p = 0; p < n; p++) scores[p] -= top;
    mimir_exp(scores, n);
    float sum = 0.f;
    for (int64_t p = 0; p < n; p++) sum += scores[p];
    for (int64_t p = 0; p < n; p++) {
        const float *v = values + p * hd;
        float w = scores[p];
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) acc[i] += w * v[i];
    }
    for (int64_t i = 0; i < hd; i++) out[i] = acc[i] / sum;
    gate_head(out, gate, hd);
}

/* The step's `tokens` tokens, token t of cache row row[t] at position position[t], attending that
   row's positions [0, attended[t]). mixed: [tokens, heads, 4, hd] (q, gate, k, v per head);
   cos_, sin_: [tokens, hd] (sin with rotate-half's signs); keys, values: [rows_room, heads,
   positions_room, hd]; out: [tokens, heads * hd]. Every token's key and value are written before
   any token attends, so a prompt's tokens see each other (PrefixLM's prefix) and a decoding
   token sees itself. Returns 0, or 1 for a head width over MAX_HEAD_DIM or odd, 2 for a row,
   position or attended length outside the buffers, 3 for scratch memory not allocated.
   Exported by name for ctypes, whatever visibility the interpreter's CFLAGS set. */
__attribute__((visibility("default")))
int mimir_cache_attention(const float *mixed, const float *cos_, const float *sin_, float *keys, float *values,
                          const int64_t *row, const int64_t *position, const int64_t *attended, int64_t tokens,
                          int64_t heads, int64_t hd, int64_t rows_room, int64_t positions_room, float scale,
                          int threads, float *out) {
    if (hd > MAX_HEAD_DIM || hd % 2 != 0) return 1;
    int64_t longest = 1;
    for (int64_t t = 0; t < tokens; t++) {
        if (!in_cache(row[t], position[t], rows_room, positions_room) || attended[t] < 1 ||
            attended[t] > positions_room)
            return 2;
        longest = attended[t] > longest ? attended[t] : longest;
    }
    int failed = 0;
    int64_t work = tokens * heads;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++)
            store_item(w, mixed, cos_, sin_, keys, values, row, position, heads, hd, positions_room, out);
        /* the loop's barrier: every key is stored before any token attends */
        float *scores = malloc(sizeof(float) * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++) {
            if (scores == NULL) continue;
            int64_t t = w / heads, h = w % heads;
            int64_t slot = (row[t] * heads + h) * positions_room * hd;
            attend(out + w * hd, mixed + (w * 4 + 1) * hd, keys + slot, values + slot, attended[t], hd, scale,
                   scores);
        }
        free(scores);
    }
    return failed;
}

/* The joining prompts' half of that work around torch's SDPA: RoPE on each token's query (into
   q_out, [tokens, heads, hd]) and key, its key and value written into the cache at (row[t],
   position[t]). The attention between a prompt's tokens is SDPA's, whose blocked products beat a
   token-by-token loop once a prompt is long; then mimir_gate. Returns 0, or 1 / 2 as
   mimir_cache_attention. */
__attribute__((visibility("default")))
int mimir_rope_store(const float *mixed, const float *cos_, const float *sin_, float *keys, float *values,
                     const int64_t *row, const int64_t *position, int64_t tokens, int64_t heads, int64_t hd,
                     int64_t rows_room, int64_t positions_room, int threads, float *q_out) {
    if (hd > MAX_HEAD_DIM || hd % 2 != 0) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (!in_cache(row[t], position[t], rows_room, positions_room)) return 2;
    int64_t work = tokens * heads;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (work * hd >= 32768)
    for (int64_t w = 0; w < work; w++)
        store_item(w, mixed, cos_, sin_, keys, values, row, position, heads, hd, positions_room, q_out);
    return 0;
}

/* context [tokens, heads * hd] times the sigmoid of each head's output gate (mixed[t, h, 1]), in
   place: the gate of mimir_cache_attention for contexts SDPA computed. */
__attribute__((visibility("default")))
void mimir_gate(float *context, const float *mixed, int64_t tokens, int64_t heads, int64_t hd, int threads) {
    int64_t work = tokens * heads;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1) if (work * hd >= 32768)
    for (int64_t w = 0; w < work; w++) gate_head(context + w * hd, mixed + (w * 4 + 1) * hd, hd);
}
