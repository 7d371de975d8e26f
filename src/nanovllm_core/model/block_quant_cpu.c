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

/* One activation row x [K] -> per 32-block: the int8 values xq, their scale xd and sx = xd * sum(xq).
 * xd = max|x| / 127 and xq = round-half-even(x / xd) (ggml's quantize_row_q8_1 arithmetic, with the
 * scale kept in float32 instead of fp16): the same operations in every build. */
static void quantize_row(const float *x, int nb, int8_t *xq, float *xd, float *sx) {
    for (int b = 0; b < nb; b++) {
        const float *xb = x + (int64_t)b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) { const float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)nearbyintf(xb[i] * id);
            xq[(int64_t)b * QK + i] = (int8_t)q;
            sum += q;
        }
        xd[b] = d;
        sx[b] = d * (float)sum;
    }
}

#if BQ_AVX2
static inline float hsum8(__m256 t) { /* tree8 on a vector: (j + j+4), then (j + j+2), then (0 + 1) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* A 4-bit block's 32 integers as bytes in element order (low nibbles = elements 0-15, high = 16-31). */
static inline __m256i nibbles(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}
#endif

#define TILE_M 4 /* activation rows that share one pass over a weight row */

/* out[r] for the R <= TILE_M quantized rows (xq, xd, sx of each) and one weight row w (nb blocks):
 * per block, integer sums of 4 products in 8 lanes (lane l: elements 4l .. 4l+3, exact),
 * acc[l] = fma(d_w * d_x, lane sum, acc[l]); S += m_w * sx; out = tree8(acc) + S. */
static inline __attribute__((always_inline)) void row_dots(int fmt, const uint8_t *w, int nb, const int8_t *const *xq, const float *const *xd,
                            const float *const *sx, int R, float *out) {
    const int bb = block_bytes(fmt), qoff = fmt == FMT_Q4_1 ? 4 : 2;
#if BQ_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[TILE_M];
    float S[TILE_M];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); S[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (int64_t)b * bb;
        float d, m;
        block_scales(fmt, blk, &d, &m);
        __m256i qv = fmt == FMT_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2)) : nibbles(blk + qoff);
        const __m256i qa = fmt == FMT_Q8_0 ? _mm256_abs_epi8(qv) : qv;
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq[r] + (int64_t)b * QK));
            if (fmt == FMT_Q8_0) xv = _mm256_sign_epi8(xv, qv); /* |q| * (x * sign q) = q * x */
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r][b]), _mm256_cvtepi32_ps(p), acc[r]);
            S[r] = S[r] + m * sx[r][b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + S[r];
#else
    float acc[TILE_M][8], S[TILE_M];
    for (int r = 0; r < R; r++) { for (int l = 0; l < 8; l++) acc[r][l] = 0.0f; S[r] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (int64_t)b * bb;
        float d, m;
        int q[QK];
        block_scales(fmt, blk, &d, &m);
        if (fmt == FMT_Q8_0) for (int i = 0; i < QK; i++) q[i] = ((const int8_t *)(blk + 2))[i];
        else for (int j = 0; j < 16; j++) { q[j] = blk[qoff + j] & 15; q[j + 16] = blk[qoff + j] >> 4; }
        for (int r = 0; r < R; r++) {
            const int8_t *xb = xq[r] + (int64_t)b * QK;
            const float dd = d * xd[r][b];
            for (int l = 0; l < 8; l++) {
                const int p = q[4 * l] * xb[4 * l] + q[4 * l + 1] * xb[4 * l + 1] + q[4 * l + 2] * xb[4 * l + 2]
                              + q[4 * l + 3] * xb[4 * l + 3];
                acc[r][l] = fmaf(dd, (float)p, acc[r][l]);
            }
            S[r] = S[r] + m * sx[r][b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = tree8(acc[r]) + S[r];
#endif
}

#if BQ_AVX2
#define NR 4 /* weight rows one activation row meets at once: independent FMA chains hide their latency */
/* out[k] = row_dots of the single quantized row (xq, xd, sx) with weight rows w + k * row_bytes, k < NR:
 * for each weight row, the same operations in the same order as row_dots with R = 1. */
static inline __attribute__((always_inline)) void row_dots_nr(int fmt, const uint8_t *w, int64_t row_bytes, int nb, const int8_t *xq,
                               const float *xd, const float *sx, float *out) {
    const int bb = block_bytes(fmt), qoff = fmt == FMT_Q4_1 ? 4 : 2;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NR];
    float S[NR];
    for (int k = 0; k < NR; k++) { acc[k] = _mm256_setzero_ps(); S[k] = 0.0f; }
    for (int b = 0; b < nb; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * QK));
        const float dx = xd[b], s = sx[b];
        for (int k = 0; k < NR; k++) {
            const uint8_t *blk = w + k * row_bytes + (int64_t)b * bb;
            float d, m;
            block_scales(fmt, blk, &d, &m);
            __m256i p;
            if (fmt == FMT_Q8_0) {
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 2));
                p = _mm256_maddubs_epi16(_mm256_abs_epi8(qv), _mm256_sign_epi8(x, qv));
            } else {
                p = _mm256_maddubs_epi16(nibbles(blk + qoff), x);
            }
            p = _mm256_madd_epi16(p, ones);
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(p), acc[k]);
            S[k] = S[k] + m * s;
        }
    }
    for (int k = 0; k < NR; k++) out[k] = hsum8(acc[k]) + S[k];
}
#endif

#define CHUNK_N 16 /* output rows a thread takes at a time */

/* Floats of scratch block_linear needs for M rows of K: their int8 values, scales and block sums. */
#define BLOCK_SCRATCH(M, K) ((M) * ((K) / QK) * 2 + (M) * (K) / 4)

/* y [M, N] (rows ldy floats apart) = x [M, K] (rows ldx apart) @ W^T, W [N, K] in blocks of fmt;
 * y = residual + x W^T where residual [M, N] (rows ldr apart) is not NULL (it may equal y).
 * Each row of x is first quantized per 32-block (quantize_row), then multiplied with integer
 * dot products (row_dots). scratch: BLOCK_SCRATCH(M, K) floats. Returns 0, or -1 for a K that
 * is not a multiple of 32. */
int block_linear(int fmt, const uint8_t *W, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *residual, int64_t ldr, int64_t M, int64_t N, int64_t K, float *scratch,
                 int num_threads) {
    if (K % QK) return -1;
    const int nb = (int)(K / QK);
    const int64_t row_bytes = (int64_t)nb * block_bytes(fmt);
    const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
    float *xd = scratch, *sx = xd + M * nb;
    int8_t *xq = (int8_t *)(sx + M * nb);
#pragma omp parallel num_threads(num_threads) if (M * N * K >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, nb, xq + i * K, xd + i * nb, sx + i * nb);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * CHUNK_N, n1 = n0 + CHUNK_N < N ? n0 + CHUNK_N : N;
            for (int64_t i0 = 0; i0 < M; i0 += TILE_M) {
                const int R = M - i0 < TILE_M ? (int)(M - i0) : TILE_M;
                const int8_t *xs[TILE_M];
                const float *ds[TILE_M], *ss[TILE_M];
                for (int r = 0; r < R; r++) {
                    xs[r] = xq + (i0 + r) * K;
                    ds[r] = xd + (i0 + r) * nb;
                    ss[r] = sx + (i0 + r) * nb;
                }
                int64_t n = n0;
#if BQ_AVX2
                if (R == 1) /* one activation row (a batch-1 decode): NR weight rows at a time */
                    for (; n + NR <= n1; n += NR) {
                        float o[NR];
                        const uint8_t *wn = W + n * row_bytes; /* a constant format per call: specialised loops */
                        if (fmt == FMT_Q4_1) row_dots_nr(FMT_Q4_1, wn, row_bytes, nb, xs[0], ds[0], ss[0], o);
                        else if (fmt == FMT_Q4_0) row_dots_nr(FMT_Q4_0, wn, row_bytes, nb, xs[0], ds[0], ss[0], o);
                        else row_dots_nr(FMT_Q8_0, wn, row_bytes, nb, xs[0], ds[0], ss[0], o);
                        for (int k = 0; k < NR; k++)
                            y[i0 * ldy + n + k] = residual ? residual[i0 * ldr + n + k] + o[k] : o[k];
                    }
#endif
                for (; n < n1; n++) {
                    float o[TILE_M];
                    if (fmt == FMT_Q4_1) row_dots(FMT_Q4_1, W + n * row_bytes, nb, xs, ds, ss, R, o);
                    else if (fmt == FMT_Q4_0) row_dots(FMT_Q4_0, W + n * row_bytes, nb, xs, ds, ss, R, o);
                    else row_dots(FMT_Q8_0, W + n * row_bytes, nb, xs, ds, ss, R, o);
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

/* SwiGLU's gate: act [T, I] = silu(gate) * up, with gate = gu[:, :I], up = gu[:, I:] (gu [T, 2I]);
 * silu(g) = g / (1 + exp(-g)) with libm's expf, so every build gives the same bits. Both the
 * step-by-step model (llama.py, in block modes) and decoder_layers below use it: the two paths
 * compute the same numbers. Shazeer 2020, "GLU Variants Improve Transformer". */
void silu_mul_f32(const float *gu, float *act, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * I >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        for (int64_t i = 0; i < I; i++) a[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* ------------------------------------------------------------------------------------------
 * Decoder layers in one call: the LLaMA block of model/llama.py for a whole step's flat batch,
 * without Python between the operations. The other operations are the engine's own C
 * functions, passed in as pointers from the libraries the step-by-step path calls
 * (layer_ops_cpu.c's RMSNorm and RoPE, paged_attention_cpu.c's KV write and attention), so
 * both paths run the same machine code on the same numbers and give the same bits. */
typedef void (*rms_norm_fn)(const float *, const float *, float, float *, int64_t, int64_t, int);
typedef void (*rope_fn)(float *, int64_t, int64_t, int, int, const float *, const float *, int);
typedef int (*write_kv_fn)(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, int, int, int64_t,
                           float *, float *);
typedef int (*attention_fn)(const float *, int64_t, const float *, const float *, float *, const int32_t *,
                            const int32_t *, const int32_t *, int, int, int, int, int, int, int, int, float, int);

typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down; /* blocks of the four linear layers */
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    const float *input_norm, *post_norm;     /* RMSNorm weights [H] */
    float *k_pool, *v_pool;                  /* this layer's pools [num_kv_heads, num_blocks, block_size, head_dim] */
} layer_weights;

typedef struct {
    rms_norm_fn rms_norm;
    rope_fn rope;
    write_kv_fn write_kv;
    attention_fn attention;
} layer_ops;

/* x [T, H] in place through num_layers layers: for each,
 *   h = x + o(attention(rope(qkv(norm(x)))))        (the KV write before attention)
 *   x = h + down(silu(gate(norm(h))) * up(norm(h)))
 * cos, sin [T, head_dim] (RotaryEmbedding.cos_sin's tables); slot_mapping [T] int64; block_tables
 * [rows, max_blocks], token_row, token_ctx [T] int32 as paged_attention_cpu.c takes them.
 * scratch: T * (H + (nh + 2 nkv) hd + nh hd + 3 I) + BLOCK_SCRATCH(T, max(H, I)) floats.
 * Returns 0, -1 for a bad width or slot, -2 when attention could not allocate its scratch. */
int decoder_layers(const layer_weights *layers, int num_layers, const layer_ops *ops, float *x, int64_t T, int64_t H,
                   int64_t I, int nh, int nkv, int hd, float eps, const float *cos, const float *sin,
                   const int64_t *slot_mapping, int64_t num_slots, const int32_t *block_tables, const int32_t *token_row,
                   const int32_t *token_ctx, int num_blocks, int block_size, int max_blocks, int max_ctx, float scale,
                   float *scratch, int num_threads) {
    const int64_t qs = (int64_t)nh * hd, kvs = (int64_t)nkv * hd, qkv_w = qs + 2 * kvs;
    float *xn = scratch, *qkv = xn + T * H, *att = qkv + T * qkv_w, *gu = att + T * qs, *act = gu + T * 2 * I;
    float *sx = act + T * I;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = &layers[l];
        ops->rms_norm(x, w->input_norm, eps, xn, T, H, num_threads);
        if (block_linear(w->qkv_fmt, w->qkv, xn, H, qkv, qkv_w, NULL, 0, T, qkv_w, H, sx, num_threads)) return -1;
        ops->rope(qkv, T, qkv_w, nh + nkv, hd, cos, sin, num_threads);
        if (ops->write_kv(qkv + qs, qkv_w, qkv + qs + kvs, qkv_w, slot_mapping, T, nkv, hd, num_slots, w->k_pool,
                          w->v_pool)) return -1;
        if (ops->attention(qkv, qkv_w, w->k_pool, w->v_pool, att, block_tables, token_row, token_ctx, (int)T, nh, nkv,
                           hd, num_blocks, block_size, max_blocks, max_ctx, scale, num_threads)) return -2;
        if (block_linear(w->o_fmt, w->o, att, qs, x, H, x, H, T, H, qs, sx, num_threads)) return -1;
        ops->rms_norm(x, w->post_norm, eps, xn, T, H, num_threads);
        if (block_linear(w->gate_up_fmt, w->gate_up, xn, H, gu, 2 * I, NULL, 0, T, 2 * I, H, sx, num_threads)) return -1;
        silu_mul_f32(gu, act, T, I, num_threads);
        if (block_linear(w->down_fmt, w->down, act, I, x, H, x, H, T, H, I, sx, num_threads)) return -1;
    }
    return 0;
}
