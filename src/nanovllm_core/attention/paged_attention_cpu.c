/* PagedAttention on the CPU: every query reads its keys and values where they lie in the
 * paged pool, through its sequence's block table (Kwon et al. 2023, section 4.1; vLLM's
 * CPU backend has a kernel of the same kind). Nothing is gathered or padded.
 *
 * Batch invariance. The arithmetic for one query token depends only on that token: its
 * query, its context length (position + 1) and the numbers in its context's blocks. Every
 * sum runs in a fixed order that no batch, chunking or thread count changes:
 *   - a score is a dot product over head_dim in 8 fixed lanes, the lanes then added in a
 *     fixed tree (dot below; dot8 computes 8 keys' scores at once with the same bits, and
 *     with AVX-512 dot8_heads does so for up to 4 query heads sharing a KV head);
 *   - the softmax's max is exact; exp is a fixed polynomial (exp_nonpositive), the same
 *     operations for every element whichever way the loop is vectorised; the denominator
 *     adds exp(score - max) over the context in 8 fixed lanes, then the lanes in order;
 *   - the output adds p_j * v_j over the context in key order, one running sum per element
 *     of head_dim (weighted_sum; weighted_sum_heads with AVX-512).
 * So a token computes the same bits alone, in a batch of 64, in a prefill chunk or as a
 * decode.
 * Compiled with -ffp-contract=off: no multiply and add are fused into one rounding, so a
 * loop's vectorised body and its scalar remainder round alike, and a build for any x86-64
 * instruction set (plain, AVX2, AVX-512) gives the same bits (tests/test_cpu_paged.py).
 *
 * Layouts (float32, contiguous):
 *   q             [num_tokens, num_heads, head_dim], token rows q_stride floats apart, heads dense
 *   out           [num_tokens, num_heads, head_dim]
 *   k_pool,v_pool [num_kv_heads, num_blocks, block_size, head_dim]   (one layer, head-major)
 *   block_tables  [num_rows, max_blocks] int32, rows padded with any valid block id
 *   token_row     [num_tokens] int32: the block-table row of each token's sequence
 *   token_ctx     [num_tokens] int32: keys the token attends, 1 .. (its position + 1)
 * Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8
#define PREFETCH_KEYS 32 /* how far ahead K and V rows are fetched into cache */

/* exp(x) for x <= 0 (a score minus its row's maximum), branch-free so loops over it vectorise:
 * Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for e^r
 * (the Cephes expf coefficients), times 2^n built in the exponent bits. Within 2 ulp of expf;
 * below -87.3 it returns about 1e-38 instead of underflowing, which no softmax notices. */
static inline float exp_nonpositive(float x) {
    x = x > -87.3f ? x : -87.3f;
    /* round to nearest: adding and removing 1.5 * 2^23 leaves the integer part (|x log2 e| < 2^22) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* q . k over n elements: 8 lanes, lane i adding q[d] k[d] for d = i, i + 8, ... in order, then the
 * lanes in a fixed tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then any tail
 * (n % 8) in order. dot8 below computes the same bits for 8 keys at once. */
static float dot(const float *a, const float *b, int n) {
    float l[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) l[i] += a[d + i] * b[d + i];
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

#if defined(__AVX2__)
#include <immintrin.h>
#define HAVE_DOT8 1
/* out[i] = dot(q, k[i], n) for 8 keys, n a multiple of 8, bit for bit: each key's 8 lanes in one
 * register, the 8 registers' lanes summed by a transpose of pairwise additions whose tree is
 * the one dot uses. Separate multiplies and adds (no FMA), as in dot. */
static inline void reduce8(const __m256 acc[8], float *out) {
    /* out[i] = the lanes of acc[i] summed in dot's tree.
     * hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7] */
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0 = [(l0+l1)+(l2+l3) of keys 0..3 | (l4+l5)+(l6+l7) of keys 0..3], u1 likewise for keys 4..7 */
    const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
}

static inline void dot8(const float *q, const float *const k[8], int n, float *out) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k[i]));
        for (int d = 8; d < n; d += 8)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k[i] + d)));
        acc[i] = a;
    }
    reduce8(acc, out);
}
#else
#define HAVE_DOT8 0
#endif

#if HAVE_DOT8 && defined(__AVX512F__)
#define HAVE_HEADS512 1
/* Where AVX-512 is available, the heads that share a KV head are done together, so each key
 * and value row is loaded once for all of them instead of once per head, and a 512-bit
 * register holds two keys' 8 lanes (or 16 output elements). Every lane does the same
 * multiplies and adds, in the same order, as dot8 and weighted_sum: the same bits. */
#define MAX_HEADS512 4

static inline __m512 load_pair(const float *a, const float *b) { /* [a0..a7 | b0..b7] */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

static inline __m512 load_twice(const float *a) { /* [a0..a7 | a0..a7] */
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(a))));
}

/* scores[h * ctx + j + i] = dot(q_h, k[i], n) * scale for 8 keys i and heads h < H (H <= 4), n a
 * multiple of 8; q_h = q + h * n. Bit for bit dot8's. */
static inline __attribute__((always_inline)) void dot8_heads(const float *q, const float *const k[8], int n, int H,
                                                           float scale, float *scores, int ctx, int j) {
    __m512 acc[MAX_HEADS512][4];
    for (int m = 0; m < 4; m++) {
        const __m512 kp = load_pair(k[2 * m], k[2 * m + 1]);
        for (int h = 0; h < H; h++) acc[h][m] = _mm512_mul_ps(load_twice(q + (int64_t)h * n), kp);
    }
    for (int d = 8; d < n; d += 8)
        for (int m = 0; m < 4; m++) {
            const __m512 kp = load_pair(k[2 * m] + d, k[2 * m + 1] + d);
            for (int h = 0; h < H; h++)
                acc[h][m] = _mm512_add_ps(acc[h][m], _mm512_mul_ps(load_twice(q + (int64_t)h * n + d), kp));
        }
    for (int h = 0; h < H; h++) {
        __m256 per_key[8];
        for (int m = 0; m < 4; m++) {
            per_key[2 * m] = _mm512_castps512_ps256(acc[h][m]);
            per_key[2 * m + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][m]), 1));
        }
        float *s = scores + (int64_t)h * ctx + j;
        reduce8(per_key, s);
        for (int i = 0; i < 8; i++) s[i] *= scale;
    }
}

/* acc[h * n + d] = sum over keys j in order of p[h * ctx + j] * v[row[j] + d], for heads h < H
 * (H <= 4) and d < n, n a multiple of 64. Bit for bit weighted_sum's. */
static inline __attribute__((always_inline)) void weighted_sum_heads(const float *p, const float *v, const int64_t *row,
                                                                   int ctx, int n, int H, float *acc) {
    for (int d0 = 0; d0 < n; d0 += 64) {
        __m512 a[MAX_HEADS512][4];
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_setzero_ps();
        for (int j = 0; j < ctx; j++) {
            const float *vj = v + row[j] + d0;
            if (j + PREFETCH_KEYS < ctx)
                for (int c = 0; c < 64; c += 16) __builtin_prefetch(v + row[j + PREFETCH_KEYS] + d0 + c);
            const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
            const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
            for (int h = 0; h < H; h++) {
                const __m512 pj = _mm512_set1_ps(p[(int64_t)h * ctx + j]);
                a[h][0] = _mm512_add_ps(a[h][0], _mm512_mul_ps(pj, v0));
                a[h][1] = _mm512_add_ps(a[h][1], _mm512_mul_ps(pj, v1));
                a[h][2] = _mm512_add_ps(a[h][2], _mm512_mul_ps(pj, v2));
                a[h][3] = _mm512_add_ps(a[h][3], _mm512_mul_ps(pj, v3));
            }
        }
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (int64_t)h * n + d0 + 16 * c, a[h][c]);
    }
}

/* The same two, with the head count a constant the compiler unrolls for (1 to 4). */
#define HEADS_CASES(call) \
    switch (H) {          \
    case 1: call(1); break; \
    case 2: call(2); break; \
    case 3: call(3); break; \
    default: call(4); break; \
    }
static void dot8_heads_n(const float *q, const float *const k[8], int n, int H, float scale, float *scores, int ctx,
                         int j) {
#define DOT8_HEADS(c) dot8_heads(q, k, n, c, scale, scores, ctx, j)
    HEADS_CASES(DOT8_HEADS)
#undef DOT8_HEADS
}
static void weighted_sum_heads_n(const float *p, const float *v, const int64_t *row, int ctx, int n, int H,
                                 float *acc) {
#define WSUM_HEADS(c) weighted_sum_heads(p, v, row, ctx, n, c, acc)
    HEADS_CASES(WSUM_HEADS)
#undef WSUM_HEADS
}
#else
#define HAVE_HEADS512 0
#endif

/* s[j] = exp(s[j] - m) for j < n, where m >= every s[j]. */
static void exp_shifted(float *restrict s, int n, float m) {
    for (int j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - m);
}

static float sum(const float *x, int n) {
    float lane[LANES] = {0};
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += x[j + i];
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += lane[i];
    for (; j < n; j++) s += x[j];
    return s;
}

/* acc[d] = sum over keys j in order of p[j] * v[row[j] + d], d < n: one running sum per element,
 * keys in order. The AVX2 path keeps 64 elements' sums in registers over all keys; the plain
 * loop does the same operations in the same order. */
static void weighted_sum(const float *p, const float *v, const int64_t *row, int ctx, int n, float *acc) {
    int d0 = 0;
#if HAVE_DOT8
    for (; d0 + 64 <= n; d0 += 64) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int j = 0; j < ctx; j++) {
            const float *vj = v + row[j] + d0;
            if (j + PREFETCH_KEYS < ctx)
                for (int c = 0; c < 64; c += 16) __builtin_prefetch(v + row[j + PREFETCH_KEYS] + d0 + c);
            const __m256 pj = _mm256_set1_ps(p[j]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(pj, _mm256_loadu_ps(vj)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 24)));
            a4 = _mm256_add_ps(a4, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 32)));
            a5 = _mm256_add_ps(a5, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 40)));
            a6 = _mm256_add_ps(a6, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 48)));
            a7 = _mm256_add_ps(a7, _mm256_mul_ps(pj, _mm256_loadu_ps(vj + 56)));
        }
        _mm256_storeu_ps(acc + d0, a0);
        _mm256_storeu_ps(acc + d0 + 8, a1);
        _mm256_storeu_ps(acc + d0 + 16, a2);
        _mm256_storeu_ps(acc + d0 + 24, a3);
        _mm256_storeu_ps(acc + d0 + 32, a4);
        _mm256_storeu_ps(acc + d0 + 40, a5);
        _mm256_storeu_ps(acc + d0 + 48, a6);
        _mm256_storeu_ps(acc + d0 + 56, a7);
    }
#endif
    if (d0 < n) {
        for (int d = d0; d < n; d++) acc[d] = 0.0f;
        for (int j = 0; j < ctx; j++) {
            const float *vj = v + row[j];
            const float pj = p[j];
            for (int d = d0; d < n; d++) acc[d] += pj * vj[d];
        }
    }
}

/* Returns 0, or -1 when a thread's scratch memory could not be allocated. */
int paged_attention(const float *q, int64_t q_stride, const float *k_pool, const float *v_pool, float *out,
                    const int32_t *block_tables, const int32_t *token_row, const int32_t *token_ctx,
                    int num_tokens, int num_heads, int num_kv_heads, int head_dim, int num_blocks,
                    int block_size, int max_blocks, int max_ctx, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t head_stride = (int64_t)num_blocks * block_size * head_dim;
    const int64_t items = (int64_t)num_tokens * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* per thread: the group's scores (then probabilities) over the context, and outputs */
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_ctx);
        float *acc = malloc(sizeof(float) * (size_t)group * (size_t)head_dim);
        float *denom = malloc(sizeof(float) * (size_t)group);
        int64_t *row = malloc(sizeof(int64_t) * (size_t)max_ctx); /* key j's offset in a head's pool */
        if (!scores || !acc || !denom || !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scores || !acc || !denom || !row) continue;
            const int t = (int)(item / num_kv_heads), g = (int)(item % num_kv_heads);
            const int ctx = token_ctx[t];
            const int32_t *table = block_tables + (int64_t)token_row[t] * max_blocks;
            const float *kh = k_pool + g * head_stride, *vh = v_pool + g * head_stride;
            const float *qg = q + (int64_t)t * q_stride + (int64_t)g * group * head_dim;
            /* each key's place in the pool, block by block through the block table */
            for (int b = 0, j0 = 0; j0 < ctx; b++, j0 += block_size) {
                const int64_t base = (int64_t)table[b] * block_size * head_dim;
                for (int i = 0; i < block_size && j0 + i < ctx; i++) row[j0 + i] = base + (int64_t)i * head_dim;
            }
            /* scores = q . k / sqrt(head_dim) */
            int j = 0;
#if HAVE_DOT8
            if (head_dim % 8 == 0) {
                for (; j + 8 <= ctx; j += 8) {
                    const float *k8[8];
                    for (int i = 0; i < 8; i++) k8[i] = kh + row[j + i];
                    if (j + PREFETCH_KEYS + 8 <= ctx) /* the keys a few tiles ahead: blocks lie anywhere in the pool */
                        for (int i = 0; i < 8; i++)
                            for (int c = 0; c < head_dim; c += 16) {
                                __builtin_prefetch(kh + row[j + PREFETCH_KEYS + i] + c);
                                __builtin_prefetch(vh + row[j + PREFETCH_KEYS + i] + c); /* for weighted_sum */
                            }
#if HAVE_HEADS512
                    for (int h0 = 0; h0 < group; h0 += MAX_HEADS512) {
                        const int H = group - h0 < MAX_HEADS512 ? group - h0 : MAX_HEADS512;
                        dot8_heads_n(qg + (int64_t)h0 * head_dim, k8, head_dim, H, scale,
                                     scores + (int64_t)h0 * ctx, ctx, j);
                    }
#else
                    for (int h = 0; h < group; h++) {
                        float *s = scores + (int64_t)h * ctx + j;
                        dot8(qg + (int64_t)h * head_dim, k8, head_dim, s);
                        for (int i = 0; i < 8; i++) s[i] *= scale;
                    }
#endif
                }
            }
#endif
            for (; j < ctx; j++) {
                const float *kj = kh + row[j];
                for (int h = 0; h < group; h++)
                    scores[(int64_t)h * ctx + j] = dot(qg + (int64_t)h * head_dim, kj, head_dim) * scale;
            }
            /* softmax numerators and denominators */
            for (int h = 0; h < group; h++) {
                float *s = scores + (int64_t)h * ctx;
                float m = -INFINITY;
                int j = 0;
#if HAVE_HEADS512 /* max is exact, so 16 lanes then the lanes give the same m as the loop below */
                if (ctx >= 16) {
                    __m512 mv = _mm512_set1_ps(-INFINITY);
                    for (; j + 16 <= ctx; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + j), mv);
                    m = _mm512_reduce_max_ps(mv);
                }
#endif
                for (; j < ctx; j++) m = s[j] > m ? s[j] : m;
                exp_shifted(s, ctx, m);
                denom[h] = sum(s, ctx);
            }
            /* out = sum_j p_j v_j / denominator */
#if HAVE_HEADS512
            if (head_dim % 64 == 0)
                for (int h0 = 0; h0 < group; h0 += MAX_HEADS512) {
                    const int H = group - h0 < MAX_HEADS512 ? group - h0 : MAX_HEADS512;
                    weighted_sum_heads_n(scores + (int64_t)h0 * ctx, vh, row, ctx, head_dim, H,
                                         acc + (int64_t)h0 * head_dim);
                }
            else
#endif
                for (int h = 0; h < group; h++)
                    weighted_sum(scores + (int64_t)h * ctx, vh, row, ctx, head_dim, acc + (int64_t)h * head_dim);
            float *o = out + ((int64_t)t * num_heads + (int64_t)g * group) * head_dim;
            for (int h = 0; h < group; h++)
                for (int d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] / denom[h];
        }
        free(scores);
        free(acc);
        free(denom);
        free(row);
    }
    return failed ? -1 : 0;
}

/* The step's new keys and values into their slots (the KV-cache write before attention):
 * k, v [num_tokens, num_kv_heads, head_dim], token rows k_stride / v_stride floats apart (views
 * into the packed qkv projection), heads dense -> k_pool, v_pool [num_kv_heads, num_slots, head_dim]
 * (one layer, head-major; slot = block * block_size + offset) at slot_mapping[t]. Returns 0, or -1
 * (nothing written) when a slot lies outside [0, num_slots). */
int write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slot_mapping,
             int64_t num_tokens, int num_kv_heads, int head_dim, int64_t num_slots, float *k_pool, float *v_pool) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return -1;
    const size_t row = sizeof(float) * (size_t)head_dim;
    for (int64_t t = 0; t < num_tokens; t++)
        for (int g = 0; g < num_kv_heads; g++) {
            const int64_t dst = (g * num_slots + slot_mapping[t]) * head_dim;
            memcpy(k_pool + dst, k + t * k_stride + (int64_t)g * head_dim, row);
            memcpy(v_pool + dst, v + t * v_stride + (int64_t)g * head_dim, row);
        }
    return 0;
}
