/* The float work around oneDNN's int8 matmul in an int8 linear layer, one pass per token.
 *
 * In PyTorch ops the per-token quantization before the matmul and the scaling after it take
 * about twenty small calls per layer (index, multiply, abs, amax, clamp, divide, round,
 * cast, outlier product, scale, add), each a few microseconds of dispatch: at batch 1 that
 * costs more than the int8 matmul itself. These two functions do the same arithmetic, in
 * the same order, with the same IEEE float32 operations (compiled with -ffp-contract=off,
 * so no multiply and add are fused): their results are bit-identical to the PyTorch path in
 * nanovllm_core/model/int8_linear.py, which stays as the fallback. Every value depends on
 * its own token (row) alone, so a token's result ignores its batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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
        float m = 0.0f;
        if (in_scale) {
            for (int64_t i = 0; i < K; i++) {
                const float a = fabsf(xr[i] * in_scale[i]);
                m = a > m ? a : m;
            }
        } else {
            for (int64_t i = 0; i < K; i++) {
                const float a = fabsf(xr[i]);
                m = a > m ? a : m;
            }
        }
        const float s = fmaxf(m, 1e-30f) / levels;
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

/* y [T, N] (the int8 matmul's output, already times the weight scales) in place:
 * y = y * sx + (xo @ wo_t) * so + bias, per row; xo [T, k] and wo_t [k, N] hold integers
 * whose products sum exactly in float32 (int8_linear.outlier_weight_levels), so their order
 * does not matter. wo_t, so and xo are unused when k == 0; bias may be NULL. */
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
                for (int64_t n = 0; n < N; n++) acc[n] = 0.0f;
                for (int64_t c = 0; c < k; c++) {
                    const float v = xo[t * k + c];
                    const float *w = wo_t + c * N;
                    for (int64_t n = 0; n < N; n++) acc[n] += v * w[n];
                }
                const float o = so[t];
                for (int64_t n = 0; n < N; n++) yr[n] = yr[n] * s + acc[n] * o;
            } else {
                for (int64_t n = 0; n < N; n++) yr[n] = yr[n] * s;
            }
            if (bias)
                for (int64_t n = 0; n < N; n++) yr[n] = yr[n] + bias[n];
        }
        free(acc);
    }
    return failed ? -1 : 0;
}
