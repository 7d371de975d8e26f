/* The float work around oneDNN's int8 matmul in an int8 linear layer, one pass per token.
 *
 * In PyTorch ops the per-token quantization before the matmul and the scaling after it take
 * about twenty small calls per layer (index, multiply, abs, amax, clamp, divide, round,
 * cast, outlier product, scale, add), each a few microseconds of dispatch: at batch 1 that
 * costs more than the int8 matmul itself. These two functions do the same arithmetic, in
 * the same order, with the same IEEE float32 operations (compiled with -ffp-contract=off,
 * so no multiply and add are fused): their results are bit-identical to the PyTorch path in
 * nanovllm_core/model/int8_linear.py, which stays as the fallback. Every value depends on
 * its own token (row) alone, so a token's result ignores its batch. The vector paths (AVX2,
 * AVX-512) keep those bits: a max is exact in any order, and the outlier sums are integers
 * below 2^24 (tests/test_quantization.py builds each instruction set and compares).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* max over i < K of |x[i] * scale[i]| (|x[i]| when scale is NULL), starting from 0. A max is
 * exact whatever the order, and a NaN is skipped both by the loop (a > m is false) and by the
 * vector max (which returns its second operand, m): every build returns the same value. */
static float absmax(const float *x, const float *scale, int64_t K) {
    float m = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    if (K >= 16) {
        __m512 mv = _mm512_setzero_ps();
        for (; i + 16 <= K; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + i));
            mv = _mm512_max_ps(_mm512_abs_ps(v), mv);
        }
        m = _mm512_reduce_max_ps(mv);
    }
#elif defined(__AVX2__)
    if (K >= 8) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mv = _mm256_setzero_ps();
        for (; i + 8 <= K; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(scale + i));
            mv = _mm256_max_ps(_mm256_andnot_ps(sign, v), mv);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    }
#endif
    for (; i < K; i++) {
        const float a = fabsf(scale ? x[i] * scale[i] : x[i]);
        m = a > m ? a : m;
    }
    return m;
}

/* x [T, K] float32 -> qx [T, K] int8 and sx [T]: x (times in_scale [K] if given) ~ qx * sx, per row,
 * the row's largest magnitude becoming `levels` (127). With qxf non-NULL the integers are written
 * there as floats instead (fbgemm's single-token path takes them so), and qx is not touched.
 * With k outlier channels (idx [k]): xo [T, k] = round(x[:, idx] * col_scale / so) as floats, so [T] = max |x[:, idx] * col_scale| / olevels. */
void int8_quantize_rows(const float *x, int64_t T, int64_t K, const float *in_scale, float levels,
                        int8_t *qx, float *qxf, float *sx, const int64_t *idx, int64_t k, const float *col_scale,
                        float olevels, float *xo, float *so, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * K >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * K;
        if (k > 0) {
            float *o = xo + t * k;
            float m = 0.0f;
            for (int64_t c = 0; c < k; c++) {
                o[c] = xr[idx[c]] * col_scale[c];
                const float a = fabsf(o[c]);
                m = a > m ? a : m;
            }
            const float s = fmaxf(m, 1e-30f) / olevels;
            for (int64_t c = 0; c < k; c++) o[c] = nearbyintf(o[c] / s);
            so[t] = s;
        }
        const float s = fmaxf(absmax(xr, in_scale, K), 1e-30f) / levels;
        if (qxf) {
            float *q = qxf + t * K;
            if (in_scale)
                for (int64_t i = 0; i < K; i++) q[i] = nearbyintf((xr[i] * in_scale[i]) / s);
            else
                for (int64_t i = 0; i < K; i++) q[i] = nearbyintf(xr[i] / s);
            sx[t] = s;
            continue;
        }
        int8_t *q = qx + t * K;
        if (in_scale)
            for (int64_t i = 0; i < K; i++) q[i] = (int8_t)nearbyintf((xr[i] * in_scale[i]) / s);
        else
            for (int64_t i = 0; i < K; i++) q[i] = (int8_t)nearbyintf(xr[i] / s);
        sx[t] = s;
    }
}

/* One row of the epilogue below, 64 outputs at a time with their outlier sums held in
 * registers (wo_t is read once per row and no sum goes through memory), per element the same
 * operations in the same order as the plain loop in int8_epilogue, except that the outlier
 * products are added with fused multiply-adds where the CPU has them: every product and
 * partial sum is an integer below 2^24 (int8_linear.outlier_weight_levels), so a fused and an
 * unfused multiply-add both round nothing and give the same bits. Returns the first output it
 * did not do (N rounded down to 64). */
#if defined(__AVX512F__)
#define HAVE_VEC 1
typedef __m512 vec;
#define VEC_WIDTH 16
#define vec_set1 _mm512_set1_ps
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_add _mm512_add_ps
#define vec_mul _mm512_mul_ps
#define vec_mul_add(v, w, a) _mm512_fmadd_ps(v, w, a) /* AVX-512 CPUs all have FMA */
#elif defined(__AVX2__)
#define HAVE_VEC 1
typedef __m256 vec;
#define VEC_WIDTH 8
#define vec_set1 _mm256_set1_ps
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_add _mm256_add_ps
#define vec_mul _mm256_mul_ps
#if defined(__FMA__)
#define vec_mul_add(v, w, a) _mm256_fmadd_ps(v, w, a)
#else
#define vec_mul_add(v, w, a) _mm256_add_ps(a, _mm256_mul_ps(v, w))
#endif
#else
#define HAVE_VEC 0
#endif
static int64_t epilogue_row_vector(float *yr, int64_t N, float s, const float *xo, const float *wo_t, int64_t k,
                                   float o, const float *bias) {
    int64_t n0 = 0;
#if HAVE_VEC
    enum { R = 64 / VEC_WIDTH }; /* registers holding 64 outputs' sums */
    const vec vs = vec_set1(s), vo = vec_set1(o);
    for (; n0 + 64 <= N; n0 += 64) {
        vec a[R];
        for (int i = 0; i < R; i++) a[i] = vec_set1(0.0f);
        for (int64_t c = 0; c < k; c++) {
            const vec v = vec_set1(xo[c]);
            const float *w = wo_t + c * N + n0;
            for (int i = 0; i < R; i++) a[i] = vec_mul_add(v, vec_load(w + VEC_WIDTH * i), a[i]);
        }
        for (int i = 0; i < R; i++) {
            float *yp = yr + n0 + VEC_WIDTH * i;
            vec y = vec_add(vec_mul(vec_load(yp), vs), vec_mul(a[i], vo));
            if (bias) y = vec_add(y, vec_load(bias + n0 + VEC_WIDTH * i));
            vec_store(yp, y);
        }
    }
#else
    (void)yr, (void)s, (void)xo, (void)wo_t, (void)k, (void)o, (void)bias;
#endif
    return n0;
}

/* y [T, N] (the int8 matmul's output, already times the weight scales) in place:
 * y = y * sx + (xo @ wo_t) * so + bias, per row; xo [T, k] and wo_t [k, N] hold integers
 * whose products sum exactly in float32 (int8_linear.outlier_weight_levels), so their order
 * does not matter (each output's products are added in channel order all the same). wo_t, so
 * and xo are unused when k == 0; bias may be NULL. Returns 0, or -1 when a thread's scratch
 * row could not be allocated. */
int int8_epilogue(float *y, int64_t T, int64_t N, const float *sx, const float *xo, const float *wo_t, int64_t k,
                  const float *so, const float *bias, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (T * N * (k + 1) >= 65536)
    {
        float *acc = k > 0 ? malloc(sizeof(float) * (size_t)N) : NULL;
        if (k > 0 && !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *yr = y + t * N;
            const float s = sx[t];
            if (k > 0 && acc) {
                const int64_t n0 = epilogue_row_vector(yr, N, s, xo + t * k, wo_t, k, so[t], bias);
                for (int64_t n = n0; n < N; n++) acc[n] = 0.0f;
                for (int64_t c = 0; c < k; c++) {
                    const float v = xo[t * k + c];
                    const float *w = wo_t + c * N;
                    for (int64_t n = n0; n < N; n++) acc[n] += v * w[n];
                }
                const float o = so[t];
                for (int64_t n = n0; n < N; n++) yr[n] = yr[n] * s + acc[n] * o;
                if (bias)
                    for (int64_t n = n0; n < N; n++) yr[n] = yr[n] + bias[n];
            } else if (k == 0) {
                for (int64_t n = 0; n < N; n++) yr[n] = yr[n] * s;
                if (bias)
                    for (int64_t n = 0; n < N; n++) yr[n] = yr[n] + bias[n];
            }
        }
        free(acc);
    }
    return failed ? -1 : 0;
}
