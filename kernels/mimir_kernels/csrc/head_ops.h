/* What the attention kernels share per head of a token (csrc/cache_attention.c for decoding
   rows, csrc/prompt_attention.c for joining prompts): RoPE with the cache's writes, and the output
   gate. Static functions, compiled into each kernel's file. */

#ifndef MIMIR_HEAD_OPS_H
#define MIMIR_HEAD_OPS_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* One build for every x86 CPU: the hot loops compiled three times, the best the CPU runs picked
   when the library loads (an ifunc). */
#define CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define CLONES
#endif

#define MAX_HEAD_DIM 512 /* the widest head the kernels' stack arrays hold */

void mimir_exp(float *x, int64_t n); /* exp.c: expf over an array, bit for bit */

/* The output gate of one head, in place: x[i] times the sigmoid of gate[i], 1 / (1 + expf(-gate[i]))
   (decoding rows and prompts alike). */
CLONES static void gate_head(float *restrict x, const float *restrict gate, int64_t hd) {
    float e[MAX_HEAD_DIM];
    for (int64_t at = 0; at < hd; at += MAX_HEAD_DIM) {  /* any width (mimir_gate does not bound it) */
        int64_t n = hd - at < MAX_HEAD_DIM ? hd - at : MAX_HEAD_DIM;
        for (int64_t i = 0; i < n; i++) e[i] = -gate[at + i];
        mimir_exp(e, n);
        for (int64_t i = 0; i < n; i++) x[at + i] = (1.f / (1.f + e[i])) * x[at + i];
    }
}

/* RoPE one head's query (into q_out) and key (into the cache at k_out), copy its value (v_out). */
CLONES static void rope_and_store(const float *restrict m, const float *restrict cos_, const float *restrict sin_,
                                  int64_t hd, float *restrict q_out, float *restrict k_out,
                                  float *restrict v_out) {
    const float *mq = m, *mk = m + 2 * hd, *mv = m + 3 * hd;
    int64_t half = hd / 2;
    for (int64_t i = 0; i < hd; i++) {
        int64_t j = i < half ? i + half : i - half;
        float qa = mq[i] * cos_[i], qb = mq[j] * sin_[i];
        float ka = mk[i] * cos_[i], kb = mk[j] * sin_[i];
        q_out[i] = qa + qb;
        k_out[i] = ka + kb;
        v_out[i] = mv[i];
    }
}

/* Whether (row, position) lies inside the cache's buffers of rows_room x positions_room. */
static inline int in_cache(int64_t row, int64_t position, int64_t rows_room, int64_t positions_room) {
    return row >= 0 && row < rows_room && position >= 0 && position < positions_room;
}

/* Work item w = (token w / heads, head w % heads) of a step: RoPE its query into q_out + w * hd, its
   key and its value into the cache at (row[t], position[t]). */
static inline void store_item(int64_t w, const float *mixed, const float *cos_, const float *sin_,
                              float *keys, float *values, const int64_t *row, const int64_t *position,
                              int64_t heads, int64_t hd, int64_t positions_room, float *q_out) {
    int64_t t = w / heads, h = w % heads;
    int64_t at = ((row[t] * heads + h) * positions_room + position[t]) * hd;
    rope_and_store(mixed + w * 4 * hd, cos_ + t * hd, sin_ + t * hd, hd, q_out + w * hd, keys + at,
                   values + at);
}

#endif
