/* Linear layers whose weights stay in GGUF's block formats: y = x W^T with W read as shipped.
 *
 * A block holds 32 consecutive weights of one output row (one row of W [N, K]) and their scale:
 *   Q8_0  34 bytes: fp16 d, then 32 int8 q;               w = d * q
 *   Q4_0  18 bytes: fp16 d, then 16 bytes of 4-bit q;     w = d * (q - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, then 16 bytes of q;   w = d * q + m
 * In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high one
 * (ggml's layout, ggml-quants.c). In the file a row of W is K / 32 blocks, rows one after
 * another; in memory the kernels read them packed 8 rows at a time (the same bytes interleaved
 * for the vector lanes: "Packed layout" below).
 *
 * Activations are quantized the way llama.cpp's CPU path does it: each row of x, per 32-block, to
 * int8 values xq with a float32 scale xd (quantize_row), once per call. Each output is then a sum
 * over blocks of exact integer dot products, scaled once a block:
 *     sum_i w_i x_i ~= d_w xd sum_i q_i xq_i + m_w xd sum_i xq_i   (Q4_0: m_w = -8 d_w; Q8_0: m_w = 0)
 * (float activations, exact with respect to the dequantized weights, were measured slower: see
 * block_quant.py).
 *
 * Batch invariance. One output element depends only on its row of x and on W, never on how many
 * rows share the call, on the tile it falls in, on the thread count or on the instruction set:
 * every output runs the same operations in the same order (spelled out above group_scalar
 * below), and the file is compiled with -ffp-contract=off so the compiler fuses nothing else. A
 * portable, an AVX2 and an AVX-512 build give the same bits (tests/test_block_quant.py). The
 * greedy-invariance promise of the engine (alone, batched, chunked, preempted) rests on this.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

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

/* Activation row i of M -> per 32-block b, at index b * M + i (block-major, so that a pass over
 * the rows of one block reads consecutive memory): the int8 values xq[(b M + i) 32 ..], their
 * scale xd = max|x| / 127, xq = round-half-even(x / xd) (ggml's quantize_row_q8_1 arithmetic, the
 * scale kept in float32), sx = xd * sum(xq) and xs8 = 8 * sum(xq) (an exact integer). The same
 * operations in every build. */
static inline void quantize_block(const float *x, int b, int64_t M, int64_t i, int8_t *xq, float *xd, float *sx,
                                  int32_t *xs8) {
    const float *xb = x + (int64_t)b * QK;
    const int64_t at = (int64_t)b * M + i;
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) { const float a = fabsf(xb[j]); amax = a > amax ? a : amax; }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        const int q = (int)nearbyintf(xb[j] * id);
        xq[at * QK + j] = (int8_t)q;
        sum += q;
    }
    xd[at] = d;
    sx[at] = d * (float)sum;
    xs8[at] = 8 * sum;
}

static void quantize_row(const float *x, int nb, int64_t M, int64_t i, int8_t *xq, float *xd, float *sx, int32_t *xs8) {
    for (int b = 0; b < nb; b++) quantize_block(x, b, M, i, xq, xd, sx, xs8);
}

/* Packed layout. The kernels read a matrix of NC = 8 weight rows at a time, one row per vector
 * lane, so at load the rows' blocks are interleaved in groups of 8 rows (block_quant.pack; the
 * same bytes, reordered, nothing requantized; llama.cpp's CPU repack does the same for Q4_0,
 * "block_q4_0x8"). Group g (rows 8g .. 8g + 7; past N the last row repeats) holds, for each
 * block b in order, NC * block_bytes bytes:
 *     d  of rows 0..7           8 fp16   (16 bytes)
 *     m  of rows 0..7           8 fp16   (16 bytes, Q4_1 only)
 *     the quant bytes, 4 at a time: word w (bytes 4w .. 4w + 3 of a row's 16 or 32 quant bytes)
 *     of row k at 32 w + 4 k    (Q4: 4 words = 128 bytes; Q8_0: 8 words = 256 bytes)
 * so one 32-byte load gives word w of all 8 rows, lane k = row k, with no shuffling, and the
 * groups follow each other: the whole matrix is read front to back, once. */
#define NC 8  /* weight rows (outputs) one group holds, one per vector lane */
#define MC 64 /* activation rows per pass over a group's blocks (their accumulators: 4 KB) */

static inline int header_bytes(int fmt) { return fmt == FMT_Q4_1 ? 4 * NC : 2 * NC; }
static inline int64_t group_block_bytes(int fmt) { return (int64_t)NC * block_bytes(fmt); }

/* Row k's scale d and offset m in the packed block at p (Q4_0's m = -8 d is exact: a power of two). */
static inline void packed_scales(int fmt, const uint8_t *p, int k, float *d, float *m) {
    *d = half_to_float(read_u16(p + 2 * k));
    *m = fmt == FMT_Q4_1 ? half_to_float(read_u16(p + 2 * NC + 2 * k)) : fmt == FMT_Q4_0 ? -8.0f * *d : 0.0f;
}

/* Row k's 32 integers in element order from the packed block at p (Q4: byte j holds weights j and j + 16). */
static inline void packed_ints(int fmt, const uint8_t *p, int k, int q[QK]) {
    const uint8_t *qs = p + header_bytes(fmt);
    if (fmt == FMT_Q8_0)
        for (int j = 0; j < QK; j++) q[j] = (int8_t)qs[32 * (j / 4) + 4 * k + j % 4];
    else
        for (int j = 0; j < 16; j++) {
            const uint8_t v = qs[32 * (j / 4) + 4 * k + j % 4];
            q[j] = v & 15;
            q[j + 16] = v >> 4;
        }
}

/* The products. Output element (row i, weight row n), for each block b in order (one fixed order,
 * whatever M, the tile, the thread or the build):
 *     s    = sum of the block's 32 integer products q_j * xq_j     (exact; Q4_0: (q_j - 8) * xq_j)
 *     acc  = fma(d_w * xd, (float)s, acc)                            (float32, acc from 0)
 *     S    = S + m_w * sx                                            (Q4_1 only, S from 0)
 * and y = acc + S (Q4_1) or acc, then y = residual + y where a residual is given. |s| <= 32 * 128 * 127
 * < 2^24, so (float)s is exact. The AVX2 paths hold a group's NC rows in the 8 lanes of a vector:
 * per block they load the 8 rows' words (lane k = row k) and run every activation row of a chunk
 * of MC rows through them; each lane does the operations above for its own output. The portable
 * path does them one output at a time with fmaf. */

/* The portable product: outputs (rows i0 .. i0 + R - 1) x (the C real rows of the group at G). */
static __attribute__((unused)) void group_scalar(int fmt, const uint8_t *G, int C, int nb, int64_t M,
                         const int8_t *xq, const float *xd, const float *sx, const int32_t *xs8, int64_t i0, int R,
                         float *acc, float *S) {
    const int64_t gbb = group_block_bytes(fmt);
    for (int k = 0; k < C; k++)
        for (int r = 0; r < R; r++) { acc[r * NC + k] = 0.0f; S[r * NC + k] = 0.0f; }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < C; k++) {
            const uint8_t *p = G + (int64_t)b * gbb;
            float d, m;
            int q[QK];
            packed_scales(fmt, p, k, &d, &m);
            packed_ints(fmt, p, k, q);
            for (int r = 0; r < R; r++) {
                const int64_t at = (int64_t)b * M + i0 + r;
                const int8_t *xb = xq + at * QK;
                int s = 0;
                for (int j = 0; j < QK; j++) s += q[j] * xb[j];
                if (fmt == FMT_Q4_0) s -= xs8[at];
                acc[r * NC + k] = fmaf(d * xd[at], (float)s, acc[r * NC + k]);
                if (fmt == FMT_Q4_1) S[r * NC + k] = S[r * NC + k] + m * sx[at];
            }
        }
}

#if BQ_AVX2
static inline __m256i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* One packed block of a group: d (and m) of its 8 rows as floats, lane k = row k, and its
 * integers as 8 vectors T[w] (word w of every row: elements 4w .. 4w + 3 in lane k; for Q4,
 * T[w + 4] holds elements 16 + 4w .. of the same bytes' high nibbles), A[w] = |T[w]| for Q8_0. */
static inline __attribute__((always_inline)) void load_block8(int fmt, const uint8_t *p, __m256 *dw, __m256 *mw,
                                                              __m256i T[8], __m256i A[8]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const uint8_t *qs = p + header_bytes(fmt);
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *mw = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * NC))) : _mm256_setzero_ps();
    if (fmt == FMT_Q8_0) {
        for (int w = 0; w < 8; w++) {
            T[w] = _mm256_loadu_si256((const __m256i *)(qs + 32 * w));
            A[w] = _mm256_abs_epi8(T[w]);
        }
    } else {
        for (int w = 0; w < 4; w++) {
            const __m256i P = _mm256_loadu_si256((const __m256i *)(qs + 32 * w));
            T[w] = _mm256_and_si256(P, low4);
            T[w + 4] = _mm256_and_si256(_mm256_srli_epi16(P, 4), low4);
        }
    }
}

/* The 8 rows' exact integer sums s (lane k = row k) of one block against the activation block xb (32 int8). */
static inline __attribute__((always_inline)) __m256i dot8(int fmt, const __m256i T[8], const __m256i A[8],
                                                          const int8_t *xb, int32_t xs8) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s;
    if (fmt == FMT_Q8_0) { /* |q| * (x * sign q) = q * x; a pair sum fits int16, two may not */
        s = _mm256_madd_epi16(_mm256_maddubs_epi16(A[0], _mm256_sign_epi8(bcast4(xb), T[0])), ones);
        for (int w = 1; w < 8; w++)
            s = _mm256_add_epi32(s, _mm256_madd_epi16(
                _mm256_maddubs_epi16(A[w], _mm256_sign_epi8(bcast4(xb + 4 * w), T[w])), ones));
    } else { /* 16 products of 4-bit q and int8 x: |sum| <= 16 * 15 * 127 < 2^15 */
        __m256i p = _mm256_maddubs_epi16(T[0], bcast4(xb));
        for (int w = 1; w < 8; w++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(T[w], bcast4(xb + 4 * w)));
        s = _mm256_madd_epi16(p, ones);
        if (fmt == FMT_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(xs8));
    }
    return s;
}

/* The AVX2 product of the group at G with activation rows i0 .. i0 + R - 1: acc, S [R][NC] as
 * group_scalar leaves them (all NC lanes; lanes past N are discarded by the caller). */
static inline __attribute__((always_inline)) void group_avx2(int fmt, const uint8_t *G, int nb, int64_t M,
                                                             const int8_t *xq, const float *xd, const float *sx,
                                                             const int32_t *xs8, int64_t i0, int R, float *acc, float *S) {
    const int64_t gbb = group_block_bytes(fmt);
    for (int r = 0; r < R; r++) {
        _mm256_store_ps(acc + r * NC, _mm256_setzero_ps());
        _mm256_store_ps(S + r * NC, _mm256_setzero_ps());
    }
    for (int b = 0; b < nb; b++) {
        __m256 dw, mw;
        __m256i T[8], A[8];
        load_block8(fmt, G + (int64_t)b * gbb, &dw, &mw, T, A);
        for (int r = 0; r < R; r++) {
            const int64_t at = (int64_t)b * M + i0 + r;
            const __m256i s = dot8(fmt, T, A, xq + at * QK, xs8[at]);
            const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(xd[at]));
            _mm256_store_ps(acc + r * NC, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(s), _mm256_load_ps(acc + r * NC)));
            if (fmt == FMT_Q4_1)
                _mm256_store_ps(S + r * NC, _mm256_add_ps(_mm256_load_ps(S + r * NC), _mm256_mul_ps(mw, _mm256_set1_ps(sx[at]))));
        }
    }
}

/* Batch 1 (M = 1, a decode step): group_avx2's operations for one activation row, the two
 * accumulators kept in registers. */
static inline __attribute__((always_inline)) void group1_avx2(int fmt, const uint8_t *G, int nb, const int8_t *xq,
                                                              const float *xd, const float *sx, const int32_t *xs8,
                                                              __m256 *acc_out, __m256 *S_out) {
    const int64_t gbb = group_block_bytes(fmt);
    __m256 acc = _mm256_setzero_ps(), S = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256 dw, mw;
        __m256i T[8], A[8];
        load_block8(fmt, G + (int64_t)b * gbb, &dw, &mw, T, A);
        const __m256i s = dot8(fmt, T, A, xq + (int64_t)b * QK, xs8[b]);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[b])), _mm256_cvtepi32_ps(s), acc);
        if (fmt == FMT_Q4_1) S = _mm256_add_ps(S, _mm256_mul_ps(mw, _mm256_set1_ps(sx[b])));
    }
    *acc_out = acc;
    *S_out = S;
}
#endif

/* Floats of scratch block_linear needs for M rows of K: their int8 values and, per 32-block, xd, sx and xs8. */
#define BLOCK_SCRATCH(M, K) ((M) * ((K) / QK) * 3 + (M) * (K) / 4)

/* y [M, N] (rows ldy floats apart) = x [M, K] (rows ldx apart) @ W^T, W [N, K] packed (see above:
 * ceil(N / 8) groups of K / 32 packed blocks); y = residual + x W^T where residual [M, N] (rows
 * ldr apart) is not NULL (it may equal y). Every row of x is quantized once per call
 * (quantize_row; at M = 1 the threads share its blocks), then the threads split the groups, each thread taking every row of x for its
 * groups, MC rows at a time (at M = 1: one contiguous run of groups per thread).
 * scratch: BLOCK_SCRATCH(M, K) floats. Returns 0, or -1 for a K that is not a multiple of 32. */
int block_linear(int fmt, const uint8_t *W, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *residual, int64_t ldr, int64_t M, int64_t N, int64_t K, float *scratch,
                 int num_threads) {
    if (K % QK) return -1;
    const int nb = (int)(K / QK);
    const int64_t group_bytes = (int64_t)nb * group_block_bytes(fmt);
    const int64_t groups = (N + NC - 1) / NC;
    float *xd = scratch, *sx = xd + M * nb;
    int32_t *xs8 = (int32_t *)(sx + M * nb);
    int8_t *xq = (int8_t *)(xs8 + M * nb);
#pragma omp parallel num_threads(num_threads) if (M * N * K >= 32768)
    {
        if (M == 1) { /* one row: its blocks are independent, so the threads share them */
#pragma omp for schedule(static)
            for (int b = 0; b < nb; b++) quantize_block(x, b, 1, 0, xq, xd, sx, xs8);
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, nb, M, i, xq, xd, sx, xs8);
        }
#if BQ_AVX2
        if (M == 1) { /* batch 1: group1_avx2 over this thread's contiguous run of groups */
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
            for (int64_t g = g0; g < g1; g++) {
                const int64_t n0 = g * NC;
                const int C = N - n0 < NC ? (int)(N - n0) : NC;
                const uint8_t *G = W + g * group_bytes;
                __m256 a, s;
                if (fmt == FMT_Q4_1) group1_avx2(FMT_Q4_1, G, nb, xq, xd, sx, xs8, &a, &s);
                else if (fmt == FMT_Q4_0) group1_avx2(FMT_Q4_0, G, nb, xq, xd, sx, xs8, &a, &s);
                else group1_avx2(FMT_Q8_0, G, nb, xq, xd, sx, xs8, &a, &s);
                float o[NC] __attribute__((aligned(32)));
                _mm256_store_ps(o, fmt == FMT_Q4_1 ? _mm256_add_ps(a, s) : a);
                for (int k = 0; k < C; k++) y[n0 + k] = residual ? residual[n0 + k] + o[k] : o[k];
            }
        } else
#endif
        {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NC;
            const int C = N - n0 < NC ? (int)(N - n0) : NC;
            const uint8_t *G = W + g * group_bytes;
            float acc[MC * NC] __attribute__((aligned(32))), S[MC * NC] __attribute__((aligned(32)));
            for (int64_t i0 = 0; i0 < M; i0 += MC) {
                const int R = M - i0 < MC ? (int)(M - i0) : MC;
#if BQ_AVX2 /* a constant format per call: specialised loops */
                if (fmt == FMT_Q4_1) group_avx2(FMT_Q4_1, G, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
                else if (fmt == FMT_Q4_0) group_avx2(FMT_Q4_0, G, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
                else group_avx2(FMT_Q8_0, G, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
#else
                group_scalar(fmt, G, C, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
#endif
                for (int r = 0; r < R; r++)
                    for (int k = 0; k < C; k++) {
                        const float o = fmt == FMT_Q4_1 ? acc[r * NC + k] + S[r * NC + k] : acc[r * NC + k];
                        y[(i0 + r) * ldy + n0 + k] = residual ? residual[(i0 + r) * ldr + n0 + k] + o : o;
                    }
            }
        }
        }
    }
    return 0;
}

/* Rows of a packed block matrix as float32: out [num_ids, K] = W[ids[i]] dequantized (w = d q + m,
 * with Q4_0's m = -8 d folded as d * (q - 8) to match ggml's reference dequantizer bit for bit).
 * The token-embedding lookup of a model whose embedding stays in blocks. Returns 0, or -1 for a
 * K that is not a multiple of 32 or an id outside [0, N). */
int block_rows(int fmt, const uint8_t *W, const int64_t *ids, int64_t num_ids, int64_t N, int64_t K, float *out) {
    if (K % QK) return -1;
    for (int64_t i = 0; i < num_ids; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int nb = (int)(K / QK);
    const int64_t gbb = group_block_bytes(fmt);
    for (int64_t i = 0; i < num_ids; i++) {
        const uint8_t *G = W + ids[i] / NC * (int64_t)nb * gbb;
        const int k = (int)(ids[i] % NC);
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = G + (int64_t)b * gbb;
            float *o = out + i * K + (int64_t)b * QK;
            float d, m;
            int q[QK];
            packed_scales(fmt, p, k, &d, &m);
            packed_ints(fmt, p, k, q);
            if (fmt == FMT_Q4_1) {
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j] + m;
            } else if (fmt == FMT_Q4_0) {
                for (int j = 0; j < QK; j++) o[j] = d * ((float)q[j] - 8.0f);
            } else {
                for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
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

/* yield_gate.py's gate: while until_ns (CLOCK_MONOTONIC, ns) lies ahead, the layers wait before
 * their next layer, polling every 0.5 ms; the wait is added to waited_ns at each poll. A front end holds it
 * for a moment so that a key's frame gets the CPU (see yield_gate.py). */
typedef struct {
    volatile int64_t until_ns, waited_ns;
} yield_gate;

static int64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void gate_wait(yield_gate *g) {
    if (!g || !g->until_ns) return;
    int64_t now = monotonic_ns(), until;
    while ((until = g->until_ns) != 0 && now < until) {
        const int64_t left = until - now;
        struct timespec nap = {0, left < 500000 ? left : 500000};
        nanosleep(&nap, NULL);
        const int64_t later = monotonic_ns();
        g->waited_ns += later - now;  /* as it goes: a gate closed for good sees its engine waiting */
        now = later;
    }
}

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
 * gate: NULL, or the front end's yield_gate, waited at before each layer.
 * Returns 0, -1 for a bad width or slot, -2 when attention could not allocate its scratch. */
int decoder_layers(const layer_weights *layers, int num_layers, const layer_ops *ops, float *x, int64_t T, int64_t H,
                   int64_t I, int nh, int nkv, int hd, float eps, const float *cos, const float *sin,
                   const int64_t *slot_mapping, int64_t num_slots, const int32_t *block_tables, const int32_t *token_row,
                   const int32_t *token_ctx, int num_blocks, int block_size, int max_blocks, int max_ctx, float scale,
                   float *scratch, int num_threads, yield_gate *gate) {
    const int64_t qs = (int64_t)nh * hd, kvs = (int64_t)nkv * hd, qkv_w = qs + 2 * kvs;
    float *xn = scratch, *qkv = xn + T * H, *att = qkv + T * qkv_w, *gu = att + T * qs, *act = gu + T * 2 * I;
    float *sx = act + T * I;
    for (int l = 0; l < num_layers; l++) {
        const layer_weights *w = &layers[l];
        gate_wait(gate);
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
