/*
 * Paged attention for decode steps on the CPU: one query token per sequence, keys and values read in
 * place from the sequence's KV blocks (no gather into a new tensor, no repeat of KV heads).
 *
 * Layouts (row-major):
 *   q, out           [num_seqs, num_heads, head_dim]                   float32
 *   k_cache, v_cache [num_blocks, num_kv_heads, block_size, head_dim]  float32 or bfloat16
 *                    (head-major blocks: one head's rows of a block are contiguous)
 *   block_tables     [num_seqs, block_table_stride]                    int32
 *   context_lens     [num_seqs]                                        int32 (tokens to attend to, >= 1)
 *
 * Work item: one (sequence, KV head) pair, which serves its whole group of query heads, so each key
 * and value row is read from memory once per step. Two passes: scores over K, then the weighted sum
 * over V, block by block so a block's rows are still in L1 when the group's heads reuse them.
 * Head dims 64 and 128 get vectorised versions (GCC vector extensions: AVX-512, AVX2 or whatever
 * -march=native offers); other head dims take a plain loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2  /* how far ahead the next blocks are prefetched */
#endif
typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

static inline vf16 vload_f32(const float *p) { vf16 v; memcpy(&v, p, sizeof v); return v; }

static inline vf16 vload_bf16(const uint16_t *p) {
    vh16 h;
    memcpy(&h, p, sizeof h);
    vu16 bits = __builtin_convertvector(h, vu16) << 16;
    vf16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float sload_f32(const float *p, int i) { return p[i]; }

static inline float sload_bf16(const uint16_t *p, int i) {
    uint32_t bits = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* Sum of 16 lanes as a tree (a lane-by-lane loop is a chain of 16 dependent adds). */
static inline float hsum(vf16 v) {
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
          + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 on 16 lanes: x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n in the exponent
 * bits. Relative error about 2e-7; inputs below -87 give 0. */
static inline vf16 vexp(vf16 x) {
    vi16 keep = x >= -87.0f;  /* all ones where exp(x) is representable */
    vf16 floor_x = (vf16){0} - 87.0f;
    vi16 low = x < floor_x;
    vi16 xi, fi;
    memcpy(&xi, &x, sizeof xi);
    memcpy(&fi, &floor_x, sizeof fi);
    xi = (xi & ~low) | (fi & low);
    memcpy(&x, &xi, sizeof x);
    vf16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi16), vf16);
    vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf16 p = (vf16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    vf16 scale;
    memcpy(&scale, &bits, sizeof scale);
    vi16 out;
    vf16 product = p * scale;
    memcpy(&out, &product, sizeof out);
    out &= keep;
    memcpy(&product, &out, sizeof out);
    return product;
}

static inline vf16 vmax(vf16 a, vf16 b) {
    vi16 a_wins = a > b, ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & a_wins) | (bi & ~a_wins);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* scores[g][t] <- exp(scores[g][t] - max_t); inv_sums[g] <- 1 / sum_t. The caller scales by inv_sums. */
static void softmax_rows(float *scores, float *inv_sums, int group, int ctx) {
    for (int g = 0; g < group; g++) {
        float *sg = scores + (int64_t)g * ctx;
        float m = sg[0];
        int t = 0;
        if (ctx >= 16) {
            vf16 vm = vload_f32(sg);
            for (t = 16; t + 16 <= ctx; t += 16) vm = vmax(vm, vload_f32(sg + t));
            for (int i = 0; i < 16; i++) m = vm[i] > m ? vm[i] : m;
        }
        for (; t < ctx; t++) m = sg[t] > m ? sg[t] : m;
        vf16 vsum = {0};
        for (t = 0; t + 16 <= ctx; t += 16) {
            vf16 e = vexp(vload_f32(sg + t) - m);
            memcpy(sg + t, &e, sizeof e);
            vsum += e;
        }
        float sum = hsum(vsum);
        for (; t < ctx; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }
        inv_sums[g] = 1.0f / sum;
    }
}

/* One (sequence, KV head) work item with head_dim HD a multiple of 16. */
#define DEFINE_ITEM_VEC(NAME, T, VLOAD, HD)                                                             \
static void NAME(const float *qs, const T *k_cache, const T *v_cache, const int32_t *table, int ctx,   \
                 float *os, float *scores, int group, int kh, int64_t head_stride, int64_t block_stride,  \
                 int block_size, float scale) {                                                         \
    enum { C = (HD) / 16 };                                                                             \
    vf16 q[MAX_GROUP][C];                                                                               \
    for (int g = 0; g < group; g++)                                                                     \
        for (int c = 0; c < C; c++) q[g][c] = vload_f32(qs + (int64_t)g * (HD) + 16 * c) * scale;       \
    for (int t0 = 0; t0 < ctx; t0 += block_size) {                                                      \
        const T *kb = k_cache + (int64_t)table[t0 / block_size] * block_stride + (int64_t)kh * head_stride;\
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;                                    \
        const T *next = t0 + PREFETCH_BLOCKS * block_size < ctx                                         \
            ? k_cache + (int64_t)table[t0 / block_size + PREFETCH_BLOCKS] * block_stride                \
              + (int64_t)kh * head_stride                                                               \
            : NULL;                                                                                     \
        for (int j = 0; j < n; j++) {                                                                   \
            if (next != NULL)                                                                           \
                for (int c = 0; c < (int)(sizeof(T) * (HD)); c += 64)                                   \
                    __builtin_prefetch((const char *)(next + j * (HD)) + c);                            \
            vf16 k[C];                                                                                  \
            for (int c = 0; c < C; c++) k[c] = VLOAD(kb + j * (HD) + 16 * c);                     \
            for (int g = 0; g < group; g++) {                                                           \
                vf16 acc = q[g][0] * k[0];                                                              \
                for (int c = 1; c < C; c++) acc += q[g][c] * k[c];                                      \
                scores[(int64_t)g * ctx + t0 + j] = hsum(acc);                                          \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    float inv_sums[MAX_GROUP];                                                                          \
    softmax_rows(scores, inv_sums, group, ctx);                                                         \
    vf16 zero = {0};                                                                                    \
    for (int g = 0; g < group; g++)                                                                     \
        for (int c = 0; c < C; c++) memcpy(os + (int64_t)g * (HD) + 16 * c, &zero, sizeof zero);        \
    for (int t0 = 0; t0 < ctx; t0 += block_size) {                                                      \
        const T *vb = v_cache + (int64_t)table[t0 / block_size] * block_stride + (int64_t)kh * head_stride;\
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;                                    \
        if (t0 + PREFETCH_BLOCKS * block_size < ctx) {                                                  \
            const char *next = (const char *)(v_cache + (int64_t)table[t0 / block_size + PREFETCH_BLOCKS] * block_stride \
                                              + (int64_t)kh * head_stride);                             \
            for (int c = 0; c < (int)(sizeof(T) * (HD)) * block_size; c += 64) __builtin_prefetch(next + c); \
        }                                                                                               \
        for (int g = 0; g < group; g++) {                                                               \
            const float *p = scores + (int64_t)g * ctx + t0;                                            \
            float *og = os + (int64_t)g * (HD);                                                         \
            vf16 acc[C];                                                                                \
            for (int c = 0; c < C; c++) acc[c] = vload_f32(og + 16 * c);                                \
            for (int j = 0; j < n; j++)                                                                 \
                for (int c = 0; c < C; c++) acc[c] += p[j] * VLOAD(vb + j * (HD) + 16 * c);       \
            for (int c = 0; c < C; c++) memcpy(og + 16 * c, &acc[c], sizeof acc[c]);                    \
        }                                                                                               \
    }                                                                                                   \
    for (int g = 0; g < group; g++)                                                                     \
        for (int i = 0; i < (HD); i++) os[(int64_t)g * (HD) + i] *= inv_sums[g];                        \
}

/* Any head_dim: plain loops. */
#define DEFINE_ITEM_SCALAR(NAME, T, SLOAD)                                                              \
static void NAME(const float *qs, const T *k_cache, const T *v_cache, const int32_t *table, int ctx,   \
                 float *os, float *scores, int group, int kh, int64_t head_stride, int64_t block_stride,  \
                 int block_size, float scale, int head_dim) {                                           \
    for (int t = 0; t < ctx; t++) {                                                                     \
        const T *kr = k_cache + (int64_t)table[t / block_size] * block_stride                           \
                      + (int64_t)kh * head_stride + (t % block_size) * head_dim;                        \
        for (int g = 0; g < group; g++) {                                                               \
            float acc = 0.0f;                                                                           \
            for (int i = 0; i < head_dim; i++) acc += qs[(int64_t)g * head_dim + i] * SLOAD(kr, i);     \
            scores[(int64_t)g * ctx + t] = acc * scale;                                                 \
        }                                                                                               \
    }                                                                                                   \
    float inv_sums[MAX_GROUP];                                                                          \
    softmax_rows(scores, inv_sums, group, ctx);                                                         \
    memset(os, 0, sizeof(float) * (size_t)group * head_dim);                                            \
    for (int t = 0; t < ctx; t++) {                                                                     \
        const T *vr = v_cache + (int64_t)table[t / block_size] * block_stride                           \
                      + (int64_t)kh * head_stride + (t % block_size) * head_dim;                        \
        for (int g = 0; g < group; g++)                                                                 \
            for (int i = 0; i < head_dim; i++)                                                          \
                os[(int64_t)g * head_dim + i] += scores[(int64_t)g * ctx + t] * SLOAD(vr, i);           \
    }                                                                                                   \
    for (int g = 0; g < group; g++)                                                                     \
        for (int i = 0; i < head_dim; i++) os[(int64_t)g * head_dim + i] *= inv_sums[g];                \
}

#define DEFINE_PAGED_DECODE(NAME, T, ITEM64, ITEM128, ITEM_ANY)                                         \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,              \
         int64_t block_table_stride, const int32_t *context_lens, float *out, int num_seqs,             \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_context_len,            \
         float scale, int num_threads) {                                                                \
    const int group = num_heads / num_kv_heads;                                                         \
    if (group > MAX_GROUP || group * num_kv_heads != num_heads) return 2;                               \
    const int64_t head_stride = (int64_t)block_size * head_dim;                                         \
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;                                   \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_context_len);                \
        if (scores == NULL) failed = 1;                                                                 \
        _Pragma("omp for collapse(2) schedule(dynamic, 1)")                                             \
        for (int s = 0; s < num_seqs; s++) {                                                            \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                                 \
                if (scores == NULL) continue;                                                           \
                const int32_t *table = block_tables + (int64_t)s * block_table_stride;                  \
                const int64_t first = (int64_t)s * num_heads + (int64_t)kh * group;                     \
                const float *qs = q + first * head_dim;                                                 \
                float *os = out + first * head_dim;                                                     \
                if (head_dim == 64)                                                                     \
                    ITEM64(qs, k_cache, v_cache, table, context_lens[s], os, scores, group, kh,         \
                           head_stride, block_stride, block_size, scale);                                \
                else if (head_dim == 128)                                                               \
                    ITEM128(qs, k_cache, v_cache, table, context_lens[s], os, scores, group, kh,        \
                            head_stride, block_stride, block_size, scale);                               \
                else                                                                                    \
                    ITEM_ANY(qs, k_cache, v_cache, table, context_lens[s], os, scores, group, kh,       \
                             head_stride, block_stride, block_size, scale, head_dim);                    \
            }                                                                                           \
        }                                                                                               \
        free(scores);                                                                                   \
    }                                                                                                   \
    return failed;                                                                                      \
}

DEFINE_ITEM_VEC(item64_f32, float, vload_f32, 64)
DEFINE_ITEM_VEC(item128_f32, float, vload_f32, 128)
DEFINE_ITEM_SCALAR(item_any_f32, float, sload_f32)
DEFINE_ITEM_VEC(item64_bf16, uint16_t, vload_bf16, 64)
DEFINE_ITEM_VEC(item128_bf16, uint16_t, vload_bf16, 128)
DEFINE_ITEM_SCALAR(item_any_bf16, uint16_t, sload_bf16)

DEFINE_PAGED_DECODE(paged_decode_f32, float, item64_f32, item128_f32, item_any_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, item64_bf16, item128_bf16, item_any_bf16)
