/* Linear layers whose weights stay in GGUF's block formats: y = x W^T with W read as shipped.
 *
 * A block holds 32 consecutive weights of one output row (one row of W [N, K]) and their scale:
 *   Q8_0  34 bytes: fp16 d, then 32 int8 q;               w = d * q
 *   Q4_0  18 bytes: fp16 d, then 16 bytes of 4-bit q;     w = d * (q - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, then 16 bytes of q;   w = d * q + m
 * In a 4-bit block, byte j holds weight j in its low nibble and weight j + 16 in its high one
 * (ggml's layout, ggml-quants.c). A row of W is K / 32 blocks, rows one after another.
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

/* Activation row i of M -> per 32-block b, at index b * M + i (block-major, so that a pass over
 * the rows of one block reads consecutive memory): the int8 values xq[(b M + i) 32 ..], their
 * scale xd = max|x| / 127, xq = round-half-even(x / xd) (ggml's quantize_row_q8_1 arithmetic, the
 * scale kept in float32), sx = xd * sum(xq) and xs8 = 8 * sum(xq) (an exact integer). The same
 * operations in every build. */
static void quantize_row(const float *x, int nb, int64_t M, int64_t i, int8_t *xq, float *xd, float *sx, int32_t *xs8) {
    for (int b = 0; b < nb; b++) {
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
}

/* The products. Output element (row i, weight row n), for each block b in order (one fixed order,
 * whatever M, the tile, the thread or the build):
 *     s    = sum of the block's 32 integer products q_j * xq_j     (exact; Q4_0: (q_j - 8) * xq_j)
 *     acc  = fma(d_w * xd, (float)s, acc)                            (float32, acc from 0)
 *     S    = S + m_w * sx                                            (Q4_1 only, S from 0)
 * and y = acc + S (Q4_1) or acc, then y = residual + y where a residual is given. |s| <= 32 * 128 * 127
 * < 2^24, so (float)s is exact. The AVX2 path holds NC = 8 weight rows in the 8 lanes of a vector:
 * per block it unpacks and transposes their integers once (lane k = row n0 + k), then runs every
 * activation row of a chunk of MC rows through them; each lane does the operations above for its
 * own output. The portable path does them one output at a time with fmaf. */
#define NC 8  /* weight rows (outputs) one pass holds, one per vector lane */
#define MC 64 /* activation rows per pass over a group's transposed blocks (their accumulators: 4 KB) */

/* The portable product: outputs (rows i0 .. i0 + R - 1) x (weight rows n0 .. n0 + C - 1). */
static __attribute__((unused)) void group_scalar(int fmt, const uint8_t *W, int64_t row_bytes, int64_t n0, int C, int nb, int64_t M,
                         const int8_t *xq, const float *xd, const float *sx, const int32_t *xs8, int64_t i0, int R,
                         float *acc, float *S) {
    const int bb = block_bytes(fmt), qoff = fmt == FMT_Q4_1 ? 4 : 2;
    for (int k = 0; k < C; k++)
        for (int r = 0; r < R; r++) { acc[r * NC + k] = 0.0f; S[r * NC + k] = 0.0f; }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < C; k++) {
            const uint8_t *blk = W + (n0 + k) * row_bytes + (int64_t)b * bb;
            float d, m;
            int q[QK];
            block_scales(fmt, blk, &d, &m);
            if (fmt == FMT_Q8_0) for (int j = 0; j < QK; j++) q[j] = ((const int8_t *)(blk + 2))[j];
            else for (int j = 0; j < 16; j++) { q[j] = blk[qoff + j] & 15; q[j + 16] = blk[qoff + j] >> 4; }
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
/* Four 128-bit rows per 128-bit lane, transposed as 32-bit words: in[k] = [row k | row k + 4];
 * out[g] = [word g of rows 0..3 | word g of rows 4..7]. */
static inline void transpose4(const __m256i in[4], __m256i out[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(in[0], in[1]), t1 = _mm256_unpackhi_epi32(in[0], in[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(in[2], in[3]), t3 = _mm256_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

static inline __m256i load2(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* The fp16 d (and Q4_1's m) of block `off` of 8 weight rows as floats, lane k = row k: words 0 (and 1)
 * of the 8 block headers. Both the batched and the batch-1 loop read them here. */
static inline __attribute__((always_inline)) void headers8(const uint8_t *const rows[NC], int64_t off, __m256 *dw,
                                                           __m256 *mw) {
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    uint32_t h[NC];
    for (int k = 0; k < NC; k++) memcpy(&h[k], rows[k] + off, 4);
    __m256i hw = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)h), split);
    hw = _mm256_permute4x64_epi64(hw, 0xD8); /* [d0..d3 d4..d7 | m0..m3 m4..m7] as fp16 */
    *dw = _mm256_cvtph_ps(_mm256_castsi256_si128(hw));
    *mw = _mm256_cvtph_ps(_mm256_extracti128_si256(hw, 1));
}

static inline __m256i bcast4(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }

/* The AVX2 product of NC weight rows (rows[k]: row n0 + k, or a repeat of the last row past N)
 * with activation rows i0 .. i0 + R - 1: acc, S [R][NC] as group_scalar leaves them. */
static inline __attribute__((always_inline)) void group_avx2(int fmt, const uint8_t *const rows[NC], int nb, int64_t M,
                                                             const int8_t *xq, const float *xd, const float *sx,
                                                             const int32_t *xs8, int64_t i0, int R, float *acc, float *S) {
    const int bb = block_bytes(fmt), qoff = fmt == FMT_Q4_1 ? 4 : 2;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
    for (int r = 0; r < R; r++) {
        _mm256_store_ps(acc + r * NC, _mm256_setzero_ps());
        _mm256_store_ps(S + r * NC, _mm256_setzero_ps());
    }
    for (int b = 0; b < nb; b++) {
        const int64_t off = (int64_t)b * bb;
        __m256 dw, mw;
        headers8(rows, off, &dw, &mw);
        __m256i T[8], A[8], in[4];
        if (fmt == FMT_Q8_0) {
            for (int k = 0; k < 4; k++) in[k] = load2(rows[k] + off + 2, rows[k + 4] + off + 2);
            transpose4(in, T);
            for (int k = 0; k < 4; k++) in[k] = load2(rows[k] + off + 18, rows[k + 4] + off + 18);
            transpose4(in, T + 4);
            for (int g = 0; g < 8; g++) A[g] = _mm256_abs_epi8(T[g]);
        } else {
            __m256i P[4];
            for (int k = 0; k < 4; k++) in[k] = load2(rows[k] + off + qoff, rows[k + 4] + off + qoff);
            transpose4(in, P);
            for (int g = 0; g < 4; g++) {
                T[g] = _mm256_and_si256(P[g], low4);                          /* elements 4g .. 4g + 3 */
                T[g + 4] = _mm256_and_si256(_mm256_srli_epi16(P[g], 4), low4); /* elements 16 + 4g .. */
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = (int64_t)b * M + i0 + r;
            const int8_t *xb = xq + at * QK;
            __m256i s;
            if (fmt == FMT_Q8_0) { /* |q| * (x * sign q) = q * x; a pair sum fits int16, two may not */
                s = _mm256_madd_epi16(_mm256_maddubs_epi16(A[0], _mm256_sign_epi8(bcast4(xb), T[0])), ones);
                for (int g = 1; g < 8; g++)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(A[g], _mm256_sign_epi8(bcast4(xb + 4 * g), T[g])), ones));
            } else { /* 16 products of 4-bit q and int8 x: |sum| <= 16 * 15 * 127 < 2^15 */
                __m256i p = _mm256_maddubs_epi16(T[0], bcast4(xb));
                for (int g = 1; g < 8; g++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(T[g], bcast4(xb + 4 * g)));
                s = _mm256_madd_epi16(p, ones);
                if (fmt == FMT_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(xs8[at]));
            }
            const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(xd[at]));
            _mm256_store_ps(acc + r * NC, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(s), _mm256_load_ps(acc + r * NC)));
            if (fmt == FMT_Q4_1)
                _mm256_store_ps(S + r * NC, _mm256_add_ps(_mm256_load_ps(S + r * NC), _mm256_mul_ps(mw, _mm256_set1_ps(sx[at]))));
        }
    }
}

/* Batch 1 (M = 1, a decode step): the same operations per output as group_avx2, but with no
 * transpose and no stack traffic. Per block b, each of the NC rows' integers meet the one x block
 * (a register) in maddubs/madd, giving 8 int32 partial sums per row; an hadd tree turns the 8
 * rows' vectors into one whose lane k is row k's exact s (integer adds: any order gives the same
 * s). Then the same per-lane float operations as group_avx2: acc = fma(d_w xd, (float)s, acc),
 * S = S + m_w sx. The group PF groups ahead is prefetched a block's share at a time, so the
 * weights stream in memory order (a group of NC rows is contiguous) ahead of their use. */
#define PF 2 /* groups ahead */
static inline __m256i hsum8(const __m256i v[NC]) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d); /* [0..3 lo | 0..3 hi], [4..7 ..] */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

static inline __attribute__((always_inline)) void group1_avx2(int fmt, const uint8_t *const rows[NC], int nb,
                                                              const int8_t *xq, const float *xd, const float *sx,
                                                              const int32_t *xs8, const uint8_t *pf, int64_t pf_step,
                                                              __m256 *acc_out, __m256 *S_out) {
    const int bb = block_bytes(fmt), qoff = fmt == FMT_Q4_1 ? 4 : 2;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps(), S = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (pf) {
            const uint8_t *p = pf + b * pf_step;
            for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
        }
        const int64_t off = (int64_t)b * bb;
        __m256 dw, mw;
        headers8(rows, off, &dw, &mw);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * QK));
        __m256i v[NC];
        if (fmt == FMT_Q8_0) {
            for (int k = 0; k < NC; k++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(rows[k] + off + 2));
                v[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q)), ones);
            }
        } else {
            for (int k = 0; k < NC; k++) {
                const __m128i p = _mm_loadu_si128((const __m128i *)(rows[k] + off + qoff));
                const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), low4);
                v[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
            }
        }
        __m256i s = hsum8(v);
        if (fmt == FMT_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(xs8[b]));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[b])), _mm256_cvtepi32_ps(s), acc);
        if (fmt == FMT_Q4_1) S = _mm256_add_ps(S, _mm256_mul_ps(mw, _mm256_set1_ps(sx[b])));
    }
    *acc_out = acc;
    *S_out = S;
}
#endif

/* Floats of scratch block_linear needs for M rows of K: their int8 values and, per 32-block, xd, sx and xs8. */
#define BLOCK_SCRATCH(M, K) ((M) * ((K) / QK) * 3 + (M) * (K) / 4)

/* y [M, N] (rows ldy floats apart) = x [M, K] (rows ldx apart) @ W^T, W [N, K] in blocks of fmt;
 * y = residual + x W^T where residual [M, N] (rows ldr apart) is not NULL (it may equal y).
 * Every row of x is quantized once per call (quantize_row), then the threads split N in groups
 * of NC weight rows, each thread taking every row of x for its groups, MC rows at a time.
 * scratch: BLOCK_SCRATCH(M, K) floats. Returns 0, or -1 for a K that is not a multiple of 32. */
int block_linear(int fmt, const uint8_t *W, const float *x, int64_t ldx, float *y, int64_t ldy,
                 const float *residual, int64_t ldr, int64_t M, int64_t N, int64_t K, float *scratch,
                 int num_threads) {
    if (K % QK) return -1;
    const int nb = (int)(K / QK);
    const int64_t row_bytes = (int64_t)nb * block_bytes(fmt);
    const int64_t groups = (N + NC - 1) / NC;
    float *xd = scratch, *sx = xd + M * nb;
    int32_t *xs8 = (int32_t *)(sx + M * nb);
    int8_t *xq = (int8_t *)(xs8 + M * nb);
#pragma omp parallel num_threads(num_threads) if (M * N * K >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize_row(x + i * ldx, nb, M, i, xq, xd, sx, xs8);
#if BQ_AVX2
        if (M == 1) { /* batch 1: group1_avx2, prefetching ahead within this thread's share of groups */
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
            for (int64_t g = g0; g < g1; g++) {
                const int64_t n0 = g * NC;
                const int C = N - n0 < NC ? (int)(N - n0) : NC;
                const uint8_t *rows[NC];
                for (int k = 0; k < NC; k++) rows[k] = W + (n0 + (k < C ? k : C - 1)) * row_bytes;
                const uint8_t *pf = g + PF < g1 ? W + (g + PF) * NC * row_bytes : NULL;
                const int64_t pf_step = NC * (int64_t)block_bytes(fmt);
                __m256 a, s;
                if (fmt == FMT_Q4_1) group1_avx2(FMT_Q4_1, rows, nb, xq, xd, sx, xs8, pf, pf_step, &a, &s);
                else if (fmt == FMT_Q4_0) group1_avx2(FMT_Q4_0, rows, nb, xq, xd, sx, xs8, pf, pf_step, &a, &s);
                else group1_avx2(FMT_Q8_0, rows, nb, xq, xd, sx, xs8, pf, pf_step, &a, &s);
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
            float acc[MC * NC] __attribute__((aligned(32))), S[MC * NC] __attribute__((aligned(32)));
#if BQ_AVX2
            const uint8_t *rows[NC];
            for (int k = 0; k < NC; k++) rows[k] = W + (n0 + (k < C ? k : C - 1)) * row_bytes; /* past N: repeat */
#endif
            for (int64_t i0 = 0; i0 < M; i0 += MC) {
                const int R = M - i0 < MC ? (int)(M - i0) : MC;
#if BQ_AVX2 /* a constant format per call: specialised loops */
                if (fmt == FMT_Q4_1) group_avx2(FMT_Q4_1, rows, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
                else if (fmt == FMT_Q4_0) group_avx2(FMT_Q4_0, rows, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
                else group_avx2(FMT_Q8_0, rows, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
#else
                group_scalar(fmt, W, row_bytes, n0, C, nb, M, xq, xd, sx, xs8, i0, R, acc, S);
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
