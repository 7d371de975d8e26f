/* Small per-token layer operations for float32 on the CPU, one call each.
 *
 * PyTorch's CPU rms_norm takes about 9 us for one 576-wide token (dispatch and a generic
 * reduction) and about 690 us for 512 tokens (2-core Xeon): the default model runs it 61
 * times a forward pass. This does the same arithmetic in one pass per token.
 *
 * Each token's sums run in an order fixed by the hidden size alone (LANES partial sums, then
 * a fixed tree), so a token's result does not depend on the other tokens in its batch nor on
 * the thread count: batching, chunked prefill and preemption keep their bit-identical
 * results. Compiled with -ffp-contract=off: no multiply and add are fused.
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

/* x [T, H] -> out [T, H]: out = (x * (1 / sqrt(mean(x^2) + eps))) * w, per token (row).
 * out may equal x. Zhang & Sennrich 2019, as LLaMA uses it. */
void rms_norm_f32(const float *x, const float *w, float eps, float *out, int64_t T, int64_t H, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float acc[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= H; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += xr[i + j] * xr[i + j];
        for (int j = 0; i < H; i++, j++) acc[j] += xr[i] * xr[i];
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int j = 0; j < width; j++) acc[j] += acc[j + width];
        const float r = 1.0f / sqrtf(acc[0] / (float)H + eps);
        float *o = out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = (xr[c] * r) * w[c];
    }
}

/* Rotary position embedding in place, "rotate half" pairing (dimension i with i + head_dim/2):
 * x [T, heads, head_dim] with rows row_stride floats apart (the q and k heads of a packed qkv
 * row), cos and sin [T, head_dim] as RotaryEmbedding.cos_sin builds them ((cos, cos) and
 * (-sin, sin)). Per element x * cos + rotate_half(x) * sin, the same two products and sum as
 * RotaryEmbedding.apply, so the bits are the same. Su et al. 2021 (RoFormer), section 3.4. */
void rope_f32(float *x, int64_t T, int64_t row_stride, int heads, int head_dim, const float *cos,
              const float *sin, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (T * heads * head_dim >= 65536) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < heads; h++) {
            float *xh = x + t * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                const float x1 = xh[i], x2 = xh[i + half];
                xh[i] = x1 * c[i] + x2 * s[i];
                xh[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}
