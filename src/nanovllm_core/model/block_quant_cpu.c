/* Linear layers whose weights stay in GGUF's block formats: y = x W^T with W read as shipped.
 *
 * A block holds 32 consecutive weights of one output row (one row of W [N, K]) and their scale:
 *   Q8_0  34 bytes: fp16 d, then 32 int8 q;               w = d * q
 *   Q4_0  18 bytes: fp16 d, then 16 bytes of 4-bit q;     w = d * (q - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, then 16 bytes of q;   w = d * q + m
 * In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high one
 * (ggml's layout, ggml-quants.c). A row of W is K / 32 blocks, rows one after another.
 *
 * Activations stay float32: the product is exact with respect to the dequantized weights up to
 * float32 rounding (no second quantization of x, as llama.cpp's Q8 activations would add).
 * Per output element n and block b, with q the block's integers as floats and sx[b] the sum of
 * the row's 32 activations in that block:
 *     sum_i w_i x_i = d * (sum_i q_i x_i) + m * sx[b]      (Q4_0: m = -8 d; Q8_0: m = 0)
 * so the inner loop multiplies small integers by floats and the scale is applied once a block.
 *
 * Batch invariance. One row's result depends only on that row of x and on W, never on how many
 * rows share the call or on the thread count: every sum runs in one fixed order,
 *   v[l]  = q[l] x[l];  v[l] = fma(q[8+l], x[8+l], v[l]);  ... (16+l), (24+l)   (8 lanes l)
 *   T[l]  = fma(d, v[l], T[l])                       over the blocks in order
 *   S     = S + m * sx[b]                            over the blocks in order
 *   y     = tree(T) + S,  tree(T) = ((T0+T4)+(T2+T6)) + ((T1+T5)+(T3+T7))
 * and sx[b] = tree of (x[l] + x[8+l]) + x[16+l]) + x[24+l]. The AVX2 path computes exactly these
 * operations with 8-float vectors and explicit FMA instructions; the portable path does them one
 * lane at a time with fmaf. Compiled with -ffp-contract=off so the compiler fuses nothing else:
 * a portable, an AVX2 and an AVX-512 build give the same bits (tests/test_block_quant.py). The
 * greedy-invariance promise of the engine (alone, batched, chunked, preempted) rests on this.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BQ_AVX2 1
#else
#define BQ_AVX2 0
#endif

#define QK 32
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2 };

static inline int block_bytes(int fmt) { return fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20; }

/* IEEE half -> float, exact (every half is a float). */
static inline float half_to_float(uint16_t h) {
#if BQ_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) bits = sign;
        else { /* subnormal half: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (mant << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The scale d and offset m of a block (see the header: Q4_0's -8 d is exact, a power of two). */
static inline void block_scales(int fmt, const uint8_t *blk, float *d, float *m) {
    *d = half_to_float(read_u16(blk));
    *m = fmt == FMT_Q4_1 ? half_to_float(read_u16(blk + 2)) : fmt == FMT_Q4_0 ? -8.0f * *d : 0.0f;
}

/* The block's 32 integers as floats, in element order. */
static inline void block_ints(int fmt, const uint8_t *blk, float q[QK]) {
    if (fmt == FMT_Q8_0) {
        const int8_t *qs = (const int8_t *)(blk + 2);
        for (int i = 0; i < QK; i++) q[i] = (float)qs[i];
    } else {
        const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
        for (int j = 0; j < 16; j++) { q[j] = (float)(qs[j] & 15); q[j + 16] = (float)(qs[j] >> 4); }
    }
}

static inline float tree8(const float t[8]) {
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* sx[b] for one row x [K]: each block's sum of activations, in the header's order. */
static void block_sums(const float *x, int nb, float *sx) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)b * QK;
        float s[8];
        for (int l = 0; l < 8; l++) s[l] = ((xb[l] + xb[8 + l]) + xb[16 + l]) + xb[24 + l];
        sx[b] = tree8(s);
    }
}

#if BQ_AVX2
static inline float hsum8(__m256 t) { /* tree8 on a vector: (j + j+4), then (j + j+2), then (0 + 1) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* The block's integers as four 8-float vectors (elements 0-7, 8-15, 16-23, 24-31). */
static inline void block_ints8(int fmt, const uint8_t *blk, __m256 q[4]) {
    if (fmt == FMT_Q8_0) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i b = _mm_loadu_si128((const __m128i *)(blk + 18));
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (fmt == FMT_Q4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}
#endif

#define TILE_M 4 /* activation rows that share one pass over a weight row */

/* out[r * ldo + n] (+= residual) for the R <= TILE_M rows x[r] and one weight row w (nb blocks). */
static inline void row_dots(int fmt, const uint8_t *w, int nb, const float *const *x, const float *const *sx, int R,
                            float *out) {
    const int bb = block_bytes(fmt);
#if BQ_AVX2
    __m256 T[TILE_M];
    float S[TILE_M];
    for (int r = 0; r < R; r++) { T[r] = _mm256_setzero_ps(); S[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (int64_t)b * bb;
        float d, m;
        block_scales(fmt, blk, &d, &m);
        __m256 q[4];
        block_ints8(fmt, blk, q);
        const __m256 dv = _mm256_set1_ps(d);
        for (int r = 0; r < R; r++) {
            const float *xb = x[r] + (int64_t)b * QK;
            __m256 v = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            v = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), v);
            v = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), v);
            v = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), v);
            T[r] = _mm256_fmadd_ps(dv, v, T[r]);
            S[r] = S[r] + m * sx[r][b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(T[r]) + S[r];
#else
    float T[TILE_M][8], S[TILE_M];
    for (int r = 0; r < R; r++) { for (int l = 0; l < 8; l++) T[r][l] = 0.0f; S[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (int64_t)b * bb;
        float d, m, q[QK];
        block_scales(fmt, blk, &d, &m);
        block_ints(fmt, blk, q);
        for (int r = 0; r < R; r++) {
            const float *xb = x[r] + (int64_t)b * QK;
            for (int l = 0; l < 8; l++) {
                float v = q[l] * xb[l];
                v = fmaf(q[8 + l], xb[8 + l], v);
                v = fmaf(q[16 + l], xb[16 + l], v);
                v = fmaf(q[24 + l], xb[24 + l], v);
                T[r][l] = fmaf(d, v, T[r][l]);
            }
            S[r] = S[r] + m * sx[r][b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = tree8(T[r]) + S[r];
#endif
}

#define CHUNK_N 16 /* output rows a thread takes at a time */

/* y [M, N] (rows ldy floats apart) = x [M, K] (rows ldx apart) @ W^T, W [N, K] in blocks of fmt;
 * y = residual + x W^T where residual [M, N] (rows ldr apart) is not NULL (it may equal y).
 * sx_buf: scratch of M * (K / 32) floats. Returns 0, or -1 for a K that is not a multiple of 32. */
int block_linear(int fmt, const uint8_t *W, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *residual, int64_t ldr, int64_t M, int64_t N, int64_t K, float *sx_buf,
                 int num_threads) {
    if (K % QK) return -1;
    const int nb = (int)(K / QK);
    const int64_t row_bytes = (int64_t)nb * block_bytes(fmt);
    const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
#pragma omp parallel num_threads(num_threads) if (M * N * K >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) block_sums(x + i * ldx, nb, sx_buf + i * nb);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * CHUNK_N, n1 = n0 + CHUNK_N < N ? n0 + CHUNK_N : N;
            for (int64_t i0 = 0; i0 < M; i0 += TILE_M) {
                const int R = M - i0 < TILE_M ? (int)(M - i0) : TILE_M;
                const float *xs[TILE_M], *ss[TILE_M];
                for (int r = 0; r < R; r++) { xs[r] = x + (i0 + r) * ldx; ss[r] = sx_buf + (i0 + r) * nb; }
                for (int64_t n = n0; n < n1; n++) {
                    float o[TILE_M];
                    row_dots(fmt, W + n * row_bytes, nb, xs, ss, R, o);
                    for (int r = 0; r < R; r++) {
                        const float add = residual ? residual[(i0 + r) * ldr + n] : 0.0f;
                        y[(i0 + r) * ldy + n] = residual ? add + o[r] : o[r];
                    }
                }
            }
        }
    }
    return 0;
}

/* Rows of a block matrix as float32: out [num_ids, K] = W[ids[i]] dequantized (w = d q + m, with
 * Q4_0's m = -8 d folded as d * (q - 8) to match ggml's reference dequantizer bit for bit).
 * The token-embedding lookup of a model whose embedding stays in blocks. Returns 0, or -1 for a
 * K that is not a multiple of 32 or an id outside [0, N). */
int block_rows(int fmt, const uint8_t *W, const int64_t *ids, int64_t num_ids, int64_t N, int64_t K, float *out) {
    if (K % QK) return -1;
    for (int64_t i = 0; i < num_ids; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int nb = (int)(K / QK);
    const int bb = block_bytes(fmt);
    for (int64_t i = 0; i < num_ids; i++) {
        const uint8_t *row = W + ids[i] * (int64_t)nb * bb;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (int64_t)b * bb;
            float q[QK], *o = out + i * K + (int64_t)b * QK;
            const float d = half_to_float(read_u16(blk));
            block_ints(fmt, blk, q);
            if (fmt == FMT_Q4_1) {
                const float m = half_to_float(read_u16(blk + 2));
                for (int j = 0; j < QK; j++) o[j] = d * q[j] + m;
            } else if (fmt == FMT_Q4_0) {
                for (int j = 0; j < QK; j++) o[j] = d * (q[j] - 8.0f);
            } else {
                for (int j = 0; j < QK; j++) o[j] = d * q[j];
            }
        }
    }
    return 0;
}
