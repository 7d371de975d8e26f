/* PagedAttention on the CPU: every query reads its keys and values where they lie in the
 * paged pool, through its sequence's block table (Kwon et al. 2023, section 4.1; vLLM's
 * CPU backend has a kernel of the same kind). Nothing is gathered or padded.
 *
 * Batch invariance. The arithmetic for one query token depends only on that token: its
 * query, its context length (position + 1) and the numbers in its context's blocks. Every
 * sum runs in a fixed order that no batch, chunking or thread count changes:
 *   - a score is a dot product over head_dim in 8 fixed lanes, the lanes then added in
 *     order (dot below);
 *   - the softmax's max is exact; its denominator adds exp(score - max) over the context in
 *     8 fixed lanes, then the lanes in order;
 *   - the output adds p_j * v_j over the context in key order, one lane per element of
 *     head_dim.
 * So a token computes the same bits alone, in a batch of 64, in a prefill chunk or as a
 * decode; int8 mode relies on this (see nanovllm_core.model.quantization).
 * Compiled with -ffp-contract=off: no multiply and add are fused into one rounding, so a
 * loop's vectorised body and its scalar remainder round alike.
 *
 * Layouts (float32, contiguous):
 *   q, out        [num_tokens, num_heads, head_dim]
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

static float dot(const float *a, const float *b, int n) {
    float lane[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += a[d + i] * b[d + i];
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += lane[i];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
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

/* Returns 0, or -1 when a thread's scratch memory could not be allocated. */
int paged_attention(const float *q, const float *k_pool, const float *v_pool, float *out,
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
        if (!scores || !acc || !denom) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scores || !acc || !denom) continue;
            const int t = (int)(item / num_kv_heads), g = (int)(item % num_kv_heads);
            const int ctx = token_ctx[t];
            const int32_t *table = block_tables + (int64_t)token_row[t] * max_blocks;
            const float *kh = k_pool + g * head_stride, *vh = v_pool + g * head_stride;
            const float *qg = q + ((int64_t)t * num_heads + (int64_t)g * group) * head_dim;
            /* scores = q . k / sqrt(head_dim), key by key through the block table */
            for (int j = 0; j < ctx; j++) {
                const float *kj = kh + ((int64_t)table[j / block_size] * block_size + j % block_size) * head_dim;
                for (int h = 0; h < group; h++)
                    scores[(int64_t)h * ctx + j] = dot(qg + (int64_t)h * head_dim, kj, head_dim) * scale;
            }
            /* softmax numerators and denominators */
            for (int h = 0; h < group; h++) {
                float *s = scores + (int64_t)h * ctx;
                float m = -INFINITY;
                for (int j = 0; j < ctx; j++) m = s[j] > m ? s[j] : m;
                for (int j = 0; j < ctx; j++) s[j] = expf(s[j] - m);
                denom[h] = sum(s, ctx);
            }
            /* out = sum_j p_j v_j / denominator */
            memset(acc, 0, sizeof(float) * (size_t)group * head_dim);
            for (int j = 0; j < ctx; j++) {
                const float *vj = vh + ((int64_t)table[j / block_size] * block_size + j % block_size) * head_dim;
                for (int h = 0; h < group; h++) {
                    const float p = scores[(int64_t)h * ctx + j];
                    float *a = acc + (int64_t)h * head_dim;
                    for (int d = 0; d < head_dim; d++) a[d] += p * vj[d];
                }
            }
            float *o = out + ((int64_t)t * num_heads + (int64_t)g * group) * head_dim;
            for (int h = 0; h < group; h++)
                for (int d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] / denom[h];
        }
        free(scores);
        free(acc);
        free(denom);
    }
    return failed ? -1 : 0;
}
