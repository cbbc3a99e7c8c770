/*
 * Paged attention for decode steps on the CPU: one query token per sequence, keys and values read in
 * place from the sequence's KV blocks (no gather into a new tensor, no repeat of KV heads).
 *
 * Layouts (row-major):
 *   q, out           [num_seqs, num_heads, head_dim]                   float32
 *   k_cache          [num_blocks, num_kv_heads, head_dim, block_size]  float32
 *                    [num_blocks, num_kv_heads, head_dim / 2, block_size, 2]  bfloat16 (dims in pairs)
 *   v_cache          [num_blocks, num_kv_heads, block_size, head_dim]  float32 or bfloat16
 *                    (head-major blocks: one head's part of a block is contiguous; K transposed)
 *   block_tables     [num_seqs, block_table_stride]                    int32
 *   context_lens     [num_seqs]                                        int32 (tokens to attend to, >= 1)
 *   sinks            [num_heads] float32, or NULL                      (a logit of no token per head)
 *
 * A layer's own attention: window > 0 attends to the last `window` tokens only (a sliding window, as
 * Hugging Face's masks define it: key k is seen from query q where q - window < k <= q), the blocks
 * before it unread; softcap > 0 bounds each score with softcap * tanh(score / softcap); sinks join the
 * softmax as a logit with no value.
 *
 * Work item: one sequence, all of its heads. Each KV head serves its whole group of query heads, so
 * each key and value row is read from memory once per step; and a block's K part (all KV heads) is
 * one contiguous run, read in order (about a quarter faster than one work item per KV head, whose
 * runs are a third as long). Two passes: scores over K, then the weighted sum over V. Decoding sequences
 * that share their first blocks (a prefix through the prefix cache: a document's questions, a prompt's
 * samples) go in work items of several (paged_decode_shared): each shared block is read from memory once for
 * the item, with the same arithmetic per query, so the same bits.
 * K is transposed within its block so that the scores of VN tokens are one vector (q[d] broadcast
 * over row d of the block): no horizontal sum per token, which halved the work of the first pass.
 * bfloat16 K keeps dims in pairs so that AVX512-BF16's vdpbf16ps takes 16 tokens × 2 dims per
 * instruction straight from the block (no conversion; half the instructions of the float32 pass);
 * bfloat16 V rows are paired in registers for vdpbf16ps too, with the probabilities rounded to
 * bfloat16 (as torch's flash kernel rounds them for P·V); without AVX512-BF16, V is converted as loaded.
 * Head dims 64 and 128 with block sizes a multiple of 16 get vectorised versions (GCC vector
 * extensions in vectors of the build's width, VN lanes: AVX-512, AVX2, SSE or NEON); others take a
 * plain loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAX_GROUP 64
#define MAX_HEADS 256
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1  /* how far ahead the next block is prefetched (1: best with the KV cache in DRAM) */
#endif
/* Whether blocks that directly follow the one before in memory are prefetched too: on an AMD Zen 4 the hardware
 * prefetcher streams them faster alone (software prefetches there cost a third); on an Intel Xeon of the AMX kind
 * decode attention ran 10 % faster with them (BENCHMARKS.md, issue 38), so a build for AMX takes them. */
#ifndef PREFETCH_RUNS
#if defined(__AMX_TILE__)
#define PREFETCH_RUNS 1
#else
#define PREFETCH_RUNS 0
#endif
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 1
#endif
/* Prefetch one KV head's part (bytes long) of a block still to come, into L2: a head at a time, so that
 * the requests spread over the work on the current block instead of arriving as one burst. */
static inline void prefetch_head(const char *block, int kv_head, int64_t bytes) {
    if (block == NULL) return;
    const char *part = block + kv_head * bytes;
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(part + c, 0, PREFETCH_LOCALITY);
}

/* The block to prefetch while the pass over a sequence's blocks works on block i: the one PREFETCH_BLOCKS
 * ahead, running on from the last K blocks into the first V blocks (`then`: the V cache during the K
 * pass, NULL during the V pass), so that neither pass starts on a cold block. NULL where there is none,
 * or where it directly follows the block before it in memory (a contiguous run the hardware prefetcher
 * streams by itself, and faster: software prefetches there cost a third). */
static inline const char *ahead(int i, int ctx, int block_size, const int32_t *table, const void *cache,
                                const void *then, int64_t block_bytes) {
    const int j = i + PREFETCH_BLOCKS, nblocks = (ctx + block_size - 1) / block_size;
    if (PREFETCH_BLOCKS == 0)
        return NULL;
    if (j < nblocks)
        return table[j] == table[j - 1] + 1 && !PREFETCH_RUNS ? NULL : (const char *)cache + table[j] * block_bytes;
    if (then != NULL && j - nblocks < nblocks)
        return (const char *)then + table[j - nblocks] * block_bytes;
    return NULL;
}

static inline float sload_f32(const float *p, int64_t i) { return p[i]; }

static inline float sload_bf16(const uint16_t *p, int64_t i) {
    uint32_t bits = ((uint32_t)p[i]) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Sum of the lanes as a tree (a lane-by-lane loop is a chain of VN dependent adds). */
static inline float hsum(vf v) {
    float s[VN];
    memcpy(s, &v, sizeof s);
    for (int width = VN / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) s[i] += s[i + width];
    return s[0];
}

static inline vf vmax(vf a, vf b) {
    vi a_wins = a > b, ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & a_wins) | (bi & ~a_wins);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* s[t] <- exp(s[t] - m) for t < n, m the row's max; returns 1 / the sum. The caller scales by it. `sink`:
 * a logit of no token that takes its share of the softmax (gpt-oss's attention sinks; -INFINITY: none). */
static float softmax_row(float *s, int n, float sink) {
    float m = sink;
    int t = 0;
    if (n >= VN) {
        vf vm = vload_f32(s);
        for (t = VN; t + VN <= n; t += VN) vm = vmax(vm, vload_f32(s + t));
        for (int i = 0; i < VN; i++) m = vm[i] > m ? vm[i] : m;
    }
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    vf vsum = {0};
    for (t = 0; t + VN <= n; t += VN) {
        vf e = vexp(vload_f32(s + t) - m);
        memcpy(s + t, &e, sizeof e);
        vsum += e;
    }
    float sum = hsum(vsum) + expf(sink - m);
    for (; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return 1.0f / sum;
}

/* One row of scores (tokens 0 .. ctx - 1 of its span) to probabilities: tokens before lo (past a sliding
 * window) and from c on (later rows of a prefill tile) weigh 0; softcap > 0 first bounds each score to
 * (-softcap, softcap) with tanh (Gemma 2's attention logit softcapping). */
static float probabilities(float *s, int lo, int c, int ctx, float softcap, float sink) {
    if (softcap > 0.0f)
        for (int t = lo; t < c; t++) s[t] = softcap * tanhf(s[t] / softcap);
    const float inv_sum = softmax_row(s + lo, c - lo, sink);
    memset(s, 0, sizeof(float) * (size_t)lo);
    memset(s + c, 0, sizeof(float) * (size_t)(ctx - c));
    return inv_sum;
}

/* Scores of KT tokens (tokens v0..v0+KT-1 of a K block) for G query heads of one KV head: K_ROWS(d, v,
 * k0, k1) gives dims d and d + 1 of the VN tokens from v as float32 vectors k0, k1, each loaded once for
 * the G heads and multiplied by q[d], q[d + 1] broadcast. With AVX-512 a tile is one vector of tokens
 * with two accumulators per head (dims even and odd) to hide FMA latency; narrower builds take two
 * vectors of tokens per tile (one accumulator each), so that each broadcast feeds two FMAs. */
#if VN == 16
#define KT VN
#define K_TILE_VEC(G, K_ROWS)                                                                           \
    do {                                                                                                \
        vf acc[G][2];                                                                                   \
        for (int g = 0; g < (G); g++) acc[g][0] = acc[g][1] = (vf){0};                                 \
        for (int d = 0; d < HDIM; d += 2) {                                                             \
            K_ROWS(d, v0, k0, k1);                                                                      \
            IN_REGISTER(k0);                                                                            \
            IN_REGISTER(k1);                                                                            \
            for (int g = 0; g < (G); g++) {                                                             \
                acc[g][0] += qt[g * HDIM + d] * k0;                                                     \
                acc[g][1] += qt[g * HDIM + d + 1] * k1;                                                 \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < (G); g++) {                                                                 \
            vf sc = (acc[g][0] + acc[g][1]) * scale;                                                    \
            memcpy(st + (int64_t)g * ctx_pad + v0, &sc, sizeof sc);                                     \
        }                                                                                               \
    } while (0)
#else
#define KT (2 * VN)
#define K_TILE_VEC(G, K_ROWS)                                                                           \
    do {                                                                                                \
        vf acc[G][2]; /* [head][tokens v0.., v0 + VN..] */                                              \
        for (int g = 0; g < (G); g++) acc[g][0] = acc[g][1] = (vf){0};                                 \
        for (int d = 0; d < HDIM; d += 2) {                                                             \
            K_ROWS(d, v0, k00, k10);                                                                    \
            K_ROWS(d, v0 + VN, k01, k11);                                                               \
            IN_REGISTER(k00);                                                                           \
            IN_REGISTER(k10);                                                                           \
            IN_REGISTER(k01);                                                                           \
            IN_REGISTER(k11);                                                                           \
            for (int g = 0; g < (G); g++) {                                                             \
                const float qa = qt[g * HDIM + d], qb = qt[g * HDIM + d + 1];                           \
                acc[g][0] += qa * k00;                                                                  \
                acc[g][1] += qa * k01;                                                                  \
                acc[g][0] += qb * k10;                                                                  \
                acc[g][1] += qb * k11;                                                                  \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < (G); g++)                                                                   \
            for (int h = 0; h < 2; h++) {                                                               \
                vf sc = acc[g][h] * scale;                                                              \
                memcpy(st + (int64_t)g * ctx_pad + v0 + h * VN, &sc, sizeof sc);                        \
            }                                                                                           \
    } while (0)
#endif
/* k0, k1: dims d and d + 1 of the VN tokens from v, from a float32 block ([HD][block_size]) */
#define K_ROWS_F32(d, v, k0, k1)                                                                        \
    vf k0 = vload_f32(kt + (int64_t)(d) * block_size + (v));                                            \
    vf k1 = vload_f32(kt + (int64_t)((d) + 1) * block_size + (v))
#define K_TILE_F32(G) K_TILE_VEC(G, K_ROWS_F32)

/* bfloat16 K block: dims in pairs, [HD/2][block_size][2], so 64 bytes hold dims 2p and 2p+1 of 16
 * tokens. With AVX512-BF16 one vdpbf16ps multiplies them by the query's pair (q is bfloat16-exact: the
 * model computed it in bfloat16) and adds both products; otherwise the pair splits into two float32
 * vectors with a shift and a mask. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define K_TILE_BF16(G)                                                                                  \
    do {                                                                                                \
        __m512 acc[G][2];                                                                               \
        for (int g = 0; g < (G); g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();                     \
        for (int p = 0; p < HDIM / 2; p += 2) {                                                         \
            __m512i k0 = _mm512_loadu_si512(kt + ((int64_t)p * block_size + v0) * 2);                  \
            __m512i k1 = _mm512_loadu_si512(kt + ((int64_t)(p + 1) * block_size + v0) * 2);            \
            IN_REGISTER(k0);                                                                            \
            IN_REGISTER(k1);                                                                            \
            for (int g = 0; g < (G); g++) {                                                             \
                acc[g][0] = _mm512_dpbf16_ps(acc[g][0], (__m512bh)k0,                                   \
                                             (__m512bh)_mm512_set1_epi32((int)qp[g * HDIM / 2 + p]));   \
                acc[g][1] = _mm512_dpbf16_ps(acc[g][1], (__m512bh)k1,                                   \
                                             (__m512bh)_mm512_set1_epi32((int)qp[g * HDIM / 2 + p + 1])); \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < (G); g++) {                                                                 \
            vf sc;                                                                                      \
            __m512 sum = _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_set1_ps(scale));      \
            memcpy(&sc, &sum, sizeof sc);                                                               \
            memcpy(st + (int64_t)g * ctx_pad + v0, &sc, sizeof sc);                                     \
        }                                                                                               \
    } while (0)
#else
/* the same from a bfloat16 pair block ([HD/2][block_size][2]): a shift and a mask split each pair */
#define K_ROWS_BF16_PAIRS(d, v, k0, k1)                                                                 \
    vu k0##_pair;                                                                                       \
    memcpy(&k0##_pair, kt + ((int64_t)((d) / 2) * block_size + (v)) * 2, sizeof k0##_pair);             \
    vf k0 = float_of(k0##_pair << 16), k1 = float_of(k0##_pair & 0xffff0000u)
#define K_TILE_BF16(G) K_TILE_VEC(G, K_ROWS_BF16_PAIRS)
#endif

/* The weighted sum over a V block ([n][HD], converted as loaded) for G query heads of one KV head:
 * each V vector is loaded once for the G heads; VCHUNK dims at a time, so that the accumulators stay in
 * registers. */
#define V_TILE(G, VLOAD)                                                                                     \
    do {                                                                                                \
        for (int c0 = 0; c0 < HDIM; c0 += VCHUNK) {                                                     \
            vf acc[G][VCHUNK / VN];                                                                     \
            for (int g = 0; g < (G); g++)                                                               \
                for (int c = 0; c < VCHUNK / VN; c++) acc[g][c] = vload_f32(ot + g * HDIM + c0 + VN * c); \
            for (int j = 0; j < n; j++) {                                                               \
                float p[G];                                                                             \
                for (int g = 0; g < (G); g++) p[g] = pt[(int64_t)g * ctx_pad + j];                      \
                for (int c = 0; c < VCHUNK / VN; c++) {                                                 \
                    vf v = VLOAD(vb + j * HDIM + c0 + VN * c);                                          \
                    IN_REGISTER(v);                                                                     \
                    for (int g = 0; g < (G); g++) acc[g][c] += p[g] * v;                                \
                }                                                                                       \
            }                                                                                           \
            for (int g = 0; g < (G); g++)                                                               \
                for (int c = 0; c < VCHUNK / VN; c++)                                                   \
                    memcpy(ot + g * HDIM + c0 + VN * c, &acc[g][c], sizeof(vf));                        \
        }                                                                                               \
    } while (0)

#if defined(__AVX512BF16__)
/* The weighted sum over a bfloat16 V block with vdpbf16ps: rows j and j+1 interleaved in registers
 * (unpack lo/hi within 128-bit lanes) pair with the probabilities of tokens j and j+1, rounded to
 * bfloat16 as torch's flash kernel rounds them for its P·V product. The interleave leaves the dims of
 * each accumulator permuted (see unpermute_pairs); `ot` holds them so until the sequence is done. An odd
 * last row pairs with zeros. pp: probabilities as bfloat16 pairs, rows ctx_pad apart. */
#define V_TILE_PAIRS(G)                                                                                 \
    do {                                                                                                \
        __m512 acc[G][HDIM / 16];                                                                       \
        for (int g = 0; g < (G); g++)                                                                   \
            for (int c = 0; c < HDIM / 16; c++) acc[g][c] = _mm512_loadu_ps(ot + g * HDIM + 16 * c);   \
        for (int jp = 0; jp < (n + 1) / 2; jp++) {                                                      \
            const uint16_t *r0 = vb + (int64_t)2 * jp * HDIM;                                           \
            __m512bh pg[G];                                                                             \
            for (int g = 0; g < (G); g++) pg[g] = (__m512bh)_mm512_set1_epi32((int)pp[(int64_t)g * ctx_pad + jp]); \
            for (int c2 = 0; c2 < HDIM / 32; c2++) {                                                    \
                const __m512i a = _mm512_loadu_si512(r0 + 32 * c2);                                     \
                const __m512i b = 2 * jp + 1 < n ? _mm512_loadu_si512(r0 + HDIM + 32 * c2)              \
                                                 : _mm512_setzero_si512();                              \
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);                              \
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);                              \
                for (int g = 0; g < (G); g++) {                                                         \
                    acc[g][2 * c2] = _mm512_dpbf16_ps(acc[g][2 * c2], lo, pg[g]);                       \
                    acc[g][2 * c2 + 1] = _mm512_dpbf16_ps(acc[g][2 * c2 + 1], hi, pg[g]);               \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < (G); g++)                                                                   \
            for (int c = 0; c < HDIM / 16; c++) _mm512_storeu_ps(ot + g * HDIM + 16 * c, acc[g][c]);   \
    } while (0)
#define PAIRED_V 1
#else
#define V_TILE_PAIRS(G) V_TILE(G, vload_bf16)
#define PAIRED_V 0
#endif
#define V_TILE_F32(G) V_TILE(G, vload_f32)

/* Scores rows (float, ctx_pad apart) -> bfloat16 pairs in place: pair i of a row (tokens 2i, 2i+1)
 * at its uint32 index i. Tokens from ctx on count as 0. */
static inline void pair_rows(float *scores, int num_rows, int ctx, int ctx_pad) {
#if defined(__AVX512BF16__)
    for (int h = 0; h < num_rows; h++) {
        float *sg = scores + (int64_t)h * ctx_pad;
        const int end = (ctx + 15) / 16 * 16;
        for (int t = ctx; t < end; t++) sg[t] = 0.0f;
        for (int t = 0; t < end; t += 16) {
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(sg + t));
            memcpy((uint16_t *)sg + t, &b, sizeof b);
        }
    }
#else
    (void)scores; (void)num_rows; (void)ctx; (void)ctx_pad;
#endif
}

/* The dims of a paired V accumulator back in order: chunk c of 16 lanes holds, for half h = c / 2 of
 * the 32-dim run and lane k, dim 32h + 8(k / 4) + 4(c % 2) + k % 4 (unpack lo/hi per 128-bit lane). */
static inline void unpermute_pairs(float *o, int hdim) {
    float tmp[128];
    for (int c = 0; c < hdim / 16; c++)
        for (int k = 0; k < 16; k++) tmp[32 * (c / 2) + 8 * (k / 4) + 4 * (c % 2) + k % 4] = o[16 * c + k];
    memcpy(o, tmp, sizeof(float) * (size_t)hdim);
}

/* Query heads per tile (TILE) and V dims per pass (VCHUNK), sized so that a tile's accumulators stay in
 * the build's vector registers: 2 x TILE in the K pass, TILE x VCHUNK/VN in the V pass (AVX-512, 32
 * registers: 8 and 16; AVX2 and narrower, 16 registers: 8 and 8). */
#if VN == 16
#define TILE_FOR(HD) ((HD) == 64 ? 4 : 2)
#define VCHUNK_FOR(HD) (HD)
#else
#define TILE_FOR(HD) 4
#define VCHUNK_FOR(HD) (2 * VN)
#endif

/* TILE_MACRO for the query heads g0.. of a KV group: a full tile, or the 1-3 left at the group's end
 * (each size its own unrolled copy). */
#define BY_TILE(TILE_MACRO)                                                                             \
    switch (group - g0 < TILE ? group - g0 : TILE) {                                                    \
        case 1: TILE_MACRO(1); break;                                                                   \
        case 2: TILE_MACRO(2); break;                                                                   \
        case 3: TILE_MACRO(3); break;                                                                   \
        default: TILE_MACRO(TILE); break;                                                               \
    }

/* One sequence, all heads; block_size a multiple of 16, head_dim HD a multiple of 16.
 * Scores: K is stored transposed in each block, so VN tokens' scores are one vector: no horizontal
 * sums. Query heads sharing a KV head go in tiles of up to TILE heads, so each K and V vector feeds
 * several FMAs. scores: [num_heads, ctx_pad]; qpairs: the query as bfloat16 pairs (bfloat16 path). */
#define DEFINE_SEQ_VEC(NAME, T, K_TILE, V_TILE_M, PV, HD)                                                      \
static void NAME(const float *qs, const uint32_t *qpairs, const T *k_cache, const T *v_cache,          \
                 const int32_t *table, int ctx, float *os, float *scores, int group, int num_kv_heads,  \
                 int64_t head_stride, int64_t block_stride, int block_size, float scale, int row_heads,  \
                 int window, float softcap, const float *sinks) {                                       \
    enum { HDIM = (HD), TILE = TILE_FOR(HD), VCHUNK = VCHUNK_FOR(HD) };                                                    \
    (void)qpairs;                                                                                       \
    const int num_heads = group * num_kv_heads;                                                         \
    const int rows = row_heads ? group / row_heads : 1;                                                 \
    /* A sliding window: skip the blocks before the first row's window; positions below are local */   \
    const int base = window > 0 && ctx - (rows - 1) > window                                            \
                     ? (ctx - (rows - 1) - window) / block_size * block_size : 0;                        \
    table += base / block_size;                                                                         \
    ctx -= base;                                                                                        \
    const int ctx_pad = (ctx + block_size - 1) / block_size * block_size;                              \
    for (int t0 = 0; t0 < ctx; t0 += block_size) {                                                      \
        const T *kb0 = k_cache + (int64_t)table[t0 / block_size] * block_stride;                        \
        const char *next = ahead(t0 / block_size, ctx, block_size, table, k_cache, v_cache,          \
                                 sizeof(T) * block_stride);                                             \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                                     \
            const T *kt = kb0 + (int64_t)kh * head_stride;                                              \
            prefetch_head(next, kh, sizeof(T) * head_stride);                                           \
            for (int g0 = 0; g0 < group; g0 += TILE) {                                                  \
                const int h = kh * group + g0;                                                          \
                const float *qt = qs + (int64_t)h * HDIM;                                               \
                const uint32_t *qp = qpairs + (int64_t)h * HDIM / 2;                                    \
                (void)qt; (void)qp;                                                                     \
                float *st = scores + (int64_t)h * ctx_pad + t0;                                         \
                for (int v0 = 0; v0 < block_size; v0 += KT) {                                           \
                    BY_TILE(K_TILE);                                                                    \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    float inv_sums[MAX_HEADS];                                                                          \
    /* a prefill tile's heads of a KV group are [row][row_heads]; row r sees ctx - (rows - 1 - r) */      \
    for (int h = 0; h < num_heads; h++) {                                                               \
        const int c = row_heads ? ctx - (rows - 1 - (h % group) / row_heads) : ctx;                     \
        const int lo = window > 0 && c + base > window ? c + base - window - base : 0;                  \
        const int head = row_heads ? h / group * row_heads + h % group % row_heads : h; /* the model's */ \
        inv_sums[h] = probabilities(scores + (int64_t)h * ctx_pad, lo, c, ctx, softcap,                 \
                                    sinks != NULL ? sinks[head] : -INFINITY);                           \
    }                                                                                                   \
    if (PV) pair_rows(scores, num_heads, ctx, ctx_pad);                                                 \
    memset(os, 0, sizeof(float) * (size_t)num_heads * HDIM);                                           \
    for (int t0 = 0; t0 < ctx; t0 += block_size) {                                                      \
        const T *vb0 = v_cache + (int64_t)table[t0 / block_size] * block_stride;                        \
        const int n = ctx - t0 < block_size ? ctx - t0 : block_size;                                    \
        const char *next = ahead(t0 / block_size, ctx, block_size, table, v_cache, NULL,             \
                                 sizeof(T) * block_stride);                                             \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                                     \
            const T *vb = vb0 + (int64_t)kh * head_stride;                                              \
            prefetch_head(next, kh, sizeof(T) * head_stride);                                           \
            for (int g0 = 0; g0 < group; g0 += TILE) {                                                  \
                const int h = kh * group + g0;                                                          \
                const float *pt = scores + (int64_t)h * ctx_pad + t0;                                   \
                const uint32_t *pp = (const uint32_t *)(scores + (int64_t)h * ctx_pad) + t0 / 2;        \
                float *ot = os + (int64_t)h * HDIM;                                                     \
                (void)pt; (void)pp;                                                                     \
                BY_TILE(V_TILE_M);                                                                      \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    for (int h = 0; h < num_heads; h++) {                                                               \
        if (PV) unpermute_pairs(os + (int64_t)h * HDIM, HDIM);                                          \
        for (int i = 0; i < HDIM; i++) os[(int64_t)h * HDIM + i] *= inv_sums[h];                        \
    }                                                                                                   \
}

/* Up to SHARED_MAX decoding sequences whose first `shared` tokens are the same blocks (a prefix they share
 * through the prefix cache), all heads: each shared K and V block is read from memory once for all of them
 * (then from L1 for the others), where one sequence at a time reads it once each; the rest of each
 * sequence's blocks as DEFINE_SEQ_VEC reads them. Every query head's scores, softmax and weighted sum are the
 * same operations in the same order as DEFINE_SEQ_VEC's (a score per token from the same tile; V summed
 * block by block, token by token, in order), only interleaved across the sequences: the same bits, so a
 * sequence's attention does not depend on which others share its step. Full attention (no window) only.
 * scores: [m][num_heads][ctx_pad], ctx_pad covering every one's context. */
#define SHARED_MAX 16
#define DEFINE_SEQS_VEC(NAME, T, K_TILE, V_TILE_M, PV, HD)                                             \
static void NAME(int m, const float *const *qss, const uint32_t *const *qps, const T *k_cache,         \
                 const T *v_cache, const int32_t *const *tables, const int *ctxs, float *const *oss,    \
                 float *scores, int64_t ctx_pad, int shared, int group, int num_kv_heads,               \
                 int64_t head_stride, int64_t block_stride, int block_size, float scale, float softcap,  \
                 const float *sinks) {                                                                  \
    enum { HDIM = (HD), TILE = TILE_FOR(HD), VCHUNK = VCHUNK_FOR(HD) };                                 \
    const int num_heads = group * num_kv_heads;                                                         \
    const int64_t per_seq = (int64_t)num_heads * ctx_pad;                                               \
    for (int i = 0; i < m; i++)                                                                         \
        for (int t0 = 0; t0 < ctxs[i]; t0 += block_size) {                                             \
            if (t0 < shared && i > 0) continue; /* the shared blocks: all m sequences at the first's turn */ \
            const int32_t *table = tables[i];                                                           \
            const T *kb0 = k_cache + (int64_t)table[t0 / block_size] * block_stride;                    \
            const char *next = ahead(t0 / block_size, ctxs[i], block_size, table, k_cache, NULL,        \
                                     sizeof(T) * block_stride);                                         \
            const int first = t0 < shared ? 0 : i, last = t0 < shared ? m : i + 1;                      \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                                 \
                const T *kt = kb0 + (int64_t)kh * head_stride;                                          \
                prefetch_head(next, kh, sizeof(T) * head_stride);                                       \
                for (int j = first; j < last; j++)                                                      \
                    for (int g0 = 0; g0 < group; g0 += TILE) {                                          \
                        const int h = kh * group + g0;                                                  \
                        const float *qt = qss[j] + (int64_t)h * HDIM;                                   \
                        const uint32_t *qp = qps[j] + (int64_t)h * HDIM / 2;                            \
                        (void)qt; (void)qp;                                                             \
                        float *st = scores + j * per_seq + (int64_t)h * ctx_pad + t0;                   \
                        for (int v0 = 0; v0 < block_size; v0 += KT) {                                   \
                            BY_TILE(K_TILE);                                                            \
                        }                                                                               \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
    float inv_sums[SHARED_MAX * MAX_HEADS];                                                             \
    for (int i = 0; i < m; i++) {                                                                       \
        for (int h = 0; h < num_heads; h++)                                                             \
            inv_sums[i * num_heads + h] = probabilities(scores + i * per_seq + (int64_t)h * ctx_pad, 0,  \
                                                        ctxs[i], ctxs[i], softcap,                      \
                                                        sinks != NULL ? sinks[h] : -INFINITY);          \
        if (PV) pair_rows(scores + i * per_seq, num_heads, ctxs[i], (int)ctx_pad);                      \
        memset(oss[i], 0, sizeof(float) * (size_t)num_heads * HDIM);                                   \
    }                                                                                                   \
    for (int i = 0; i < m; i++)                                                                         \
        for (int t0 = 0; t0 < ctxs[i]; t0 += block_size) {                                             \
            if (t0 < shared && i > 0) continue;                                                         \
            const int32_t *table = tables[i];                                                           \
            const T *vb0 = v_cache + (int64_t)table[t0 / block_size] * block_stride;                    \
            const int n = ctxs[i] - t0 < block_size ? ctxs[i] - t0 : block_size;                        \
            const char *next = ahead(t0 / block_size, ctxs[i], block_size, table, v_cache, NULL,        \
                                     sizeof(T) * block_stride);                                         \
            const int first = t0 < shared ? 0 : i, last = t0 < shared ? m : i + 1;                      \
            for (int kh = 0; kh < num_kv_heads; kh++) {                                                 \
                const T *vb = vb0 + (int64_t)kh * head_stride;                                          \
                prefetch_head(next, kh, sizeof(T) * head_stride);                                       \
                for (int j = first; j < last; j++)                                                      \
                    for (int g0 = 0; g0 < group; g0 += TILE) {                                          \
                        const int h = kh * group + g0;                                                  \
                        float *row = scores + j * per_seq + (int64_t)h * ctx_pad;                       \
                        const float *pt = row + t0;                                                     \
                        const uint32_t *pp = (const uint32_t *)row + t0 / 2;                            \
                        float *ot = oss[j] + (int64_t)h * HDIM;                                         \
                        (void)pt; (void)pp;                                                             \
                        BY_TILE(V_TILE_M);                                                              \
                    }                                                                                   \
            }                                                                                           \
        }                                                                                               \
    for (int i = 0; i < m; i++)                                                                         \
        for (int h = 0; h < num_heads; h++) {                                                           \
            if (PV) unpermute_pairs(oss[i] + (int64_t)h * HDIM, HDIM);                                  \
            for (int d = 0; d < HDIM; d++) oss[i][(int64_t)h * HDIM + d] *= inv_sums[i * num_heads + h]; \
        }                                                                                               \
}

/* Any head_dim or block size: plain loops, one sequence, all heads. K rows in groups of P dims
 * (P = 1: float32, [HD][block_size]; P = 2: bfloat16, [HD/2][block_size][2]). */
#define DEFINE_SEQ_SCALAR(NAME, T, SLOAD, P)                                                            \
static void NAME(const float *qs, const T *k_cache, const T *v_cache, const int32_t *table, int ctx,   \
                 float *os, float *scores, int group, int num_kv_heads, int64_t head_stride,            \
                 int64_t block_stride, int block_size, float scale, int head_dim, int window,           \
                 float softcap, const float *sinks) {                                                   \
    const int num_heads = group * num_kv_heads;                                                         \
    const int lo = window > 0 && ctx > window ? ctx - window : 0; /* a sliding window's first token */  \
    for (int h = 0; h < num_heads; h++) {                                                               \
        for (int t = lo; t < ctx; t++) {                                                                \
            const T *kt = k_cache + (int64_t)table[t / block_size] * block_stride                       \
                          + (int64_t)(h / group) * head_stride + (t % block_size) * (P);                \
            float acc = 0.0f;                                                                           \
            for (int i = 0; i < head_dim; i++)                                                          \
                acc += qs[(int64_t)h * head_dim + i]                                                    \
                       * SLOAD(kt, (int64_t)(i / (P)) * block_size * (P) + i % (P));                    \
            scores[(int64_t)h * ctx + t] = acc * scale;                                                 \
        }                                                                                               \
    }                                                                                                   \
    float inv_sums[MAX_HEADS];                                                                          \
    for (int h = 0; h < num_heads; h++)                                                                 \
        inv_sums[h] = probabilities(scores + (int64_t)h * ctx, lo, ctx, ctx, softcap,                   \
                                    sinks != NULL ? sinks[h] : -INFINITY);                              \
    memset(os, 0, sizeof(float) * (size_t)num_heads * head_dim);                                       \
    for (int h = 0; h < num_heads; h++) {                                                               \
        for (int t = lo; t < ctx; t++) {                                                                \
            const T *vr = v_cache + (int64_t)table[t / block_size] * block_stride                       \
                          + (int64_t)(h / group) * head_stride + (t % block_size) * head_dim;           \
            const float p = scores[(int64_t)h * ctx + t] * inv_sums[h];                                 \
            for (int i = 0; i < head_dim; i++) os[(int64_t)h * head_dim + i] += p * SLOAD(vr, i);       \
        }                                                                                               \
    }                                                                                                   \
}

/* float32 -> bfloat16 bits, rounded to nearest even (exact for the bfloat16 model's queries). */
static inline uint32_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

#define DEFINE_PAGED_DECODE(NAME, T, SEQ64, SEQ128, SEQ_ANY)                                            \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,              \
         int64_t block_table_stride, const int32_t *context_lens, float *out, int num_seqs,             \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_context_len,            \
         float scale, int window, float softcap, const float *sinks, int num_threads) {                 \
    const int group = num_heads / num_kv_heads;                                                         \
    if (group > MAX_GROUP || num_heads > MAX_HEADS || group * num_kv_heads != num_heads) return 2;      \
    const int64_t head_stride = (int64_t)block_size * head_dim;                                         \
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;                                   \
    const int vectorised = block_size % 16 == 0 && (head_dim == 64 || head_dim == 128);                \
    const int64_t ctx_pad = (int64_t)(max_context_len + block_size - 1) / block_size * block_size;     \
    const int pairs = sizeof(T) == 2;                                                                   \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        float *scores = malloc(sizeof(float) * ((size_t)num_heads * (size_t)ctx_pad                     \
                                                + (size_t)num_heads * (size_t)head_dim / 2 + 1));       \
        uint32_t *qpairs = (uint32_t *)(scores + (size_t)num_heads * (size_t)ctx_pad);                  \
        if (scores == NULL) failed = 1;                                                                 \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (int s = 0; s < num_seqs; s++) {                                                            \
            if (scores == NULL) continue;                                                               \
            const int32_t *table = block_tables + (int64_t)s * block_table_stride;                      \
            const float *qs = q + (int64_t)s * num_heads * head_dim;                                    \
            float *os = out + (int64_t)s * num_heads * head_dim;                                        \
            if (pairs && vectorised)                                                                    \
                for (int i = 0; i < num_heads * head_dim / 2; i++)                                      \
                    qpairs[i] = bf16_bits(qs[2 * i]) | bf16_bits(qs[2 * i + 1]) << 16;                  \
            if (vectorised && head_dim == 64)                                                           \
                SEQ64(qs, qpairs, k_cache, v_cache, table, context_lens[s], os, scores, group,          \
                      num_kv_heads, head_stride, block_stride, block_size, scale, 0, window, softcap,   \
                      sinks);                                                                           \
            else if (vectorised)                                                                        \
                SEQ128(qs, qpairs, k_cache, v_cache, table, context_lens[s], os, scores, group,         \
                       num_kv_heads, head_stride, block_stride, block_size, scale, 0, window, softcap,  \
                       sinks);                                                                          \
            else                                                                                        \
                SEQ_ANY(qs, k_cache, v_cache, table, context_lens[s], os, scores, group, num_kv_heads,  \
                        head_stride, block_stride, block_size, scale, head_dim, window, softcap, sinks); \
        }                                                                                               \
        free(scores);                                                                                   \
    }                                                                                                   \
    return failed;                                                                                      \
}

/* Decode as paged_decode, the sequences taken in work items of up to SHARED_MAX that share blocks: item c
 * holds the sequences order[starts[c]] .. order[starts[c + 1] - 1], whose first shared[c] tokens (whole
 * blocks, within every one's context) are the same blocks of the cache (DEFINE_SEQS_VEC; shared[c] = 0: none).
 * The same bits as paged_decode. Returns 2 where it does not apply (a window; head dims other than 64 and 128;
 * block sizes not a multiple of 16): the caller runs paged_decode. */
#define DEFINE_PAGED_DECODE_SHARED(NAME, T, SEQS64, SEQS128)                                            \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,              \
         int64_t block_table_stride, const int32_t *context_lens, float *out, int num_seqs,             \
         int num_heads, int num_kv_heads, int head_dim, int block_size, int max_context_len,            \
         float scale, int window, float softcap, const float *sinks, int num_threads,                   \
         const int32_t *order, const int32_t *starts, const int32_t *shared, int num_items) {           \
    const int group = num_heads / num_kv_heads;                                                         \
    (void)num_seqs;                                                                                     \
    if (group > MAX_GROUP || num_heads > MAX_HEADS || group * num_kv_heads != num_heads || window > 0   \
        || block_size % 16 != 0 || (head_dim != 64 && head_dim != 128)) return 2;                       \
    for (int c = 0; c < num_items; c++)                                                                 \
        if (starts[c + 1] - starts[c] > SHARED_MAX || shared[c] % block_size != 0) return 2;            \
    const int64_t head_stride = (int64_t)block_size * head_dim;                                         \
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;                                   \
    const int64_t ctx_pad = (int64_t)(max_context_len + block_size - 1) / block_size * block_size;     \
    const int pairs = sizeof(T) == 2;                                                                   \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        float *scores = malloc(sizeof(float) * ((size_t)SHARED_MAX * num_heads * (size_t)ctx_pad        \
                                                + (size_t)SHARED_MAX * num_heads * head_dim / 2 + 1));  \
        uint32_t *qpairs = (uint32_t *)(scores + (size_t)SHARED_MAX * num_heads * (size_t)ctx_pad);     \
        if (scores == NULL) failed = 1;                                                                 \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (int c = 0; c < num_items; c++) {                                                           \
            if (scores == NULL) continue;                                                               \
            const float *qss[SHARED_MAX];                                                               \
            const uint32_t *qps[SHARED_MAX];                                                            \
            const int32_t *tables[SHARED_MAX];                                                          \
            int ctxs[SHARED_MAX];                                                                       \
            float *oss[SHARED_MAX];                                                                     \
            const int m = starts[c + 1] - starts[c];                                                    \
            for (int i = 0; i < m; i++) {                                                               \
                const int s = order[starts[c] + i];                                                     \
                qss[i] = q + (int64_t)s * num_heads * head_dim;                                         \
                qps[i] = qpairs + (int64_t)i * num_heads * head_dim / 2;                                \
                tables[i] = block_tables + (int64_t)s * block_table_stride;                             \
                ctxs[i] = context_lens[s];                                                              \
                oss[i] = out + (int64_t)s * num_heads * head_dim;                                       \
                if (pairs)                                                                              \
                    for (int k = 0; k < num_heads * head_dim / 2; k++)                                  \
                        qpairs[(int64_t)i * num_heads * head_dim / 2 + k] =                             \
                            bf16_bits(qss[i][2 * k]) | bf16_bits(qss[i][2 * k + 1]) << 16;              \
            }                                                                                           \
            if (head_dim == 64)                                                                         \
                SEQS64(m, qss, qps, k_cache, v_cache, tables, ctxs, oss, scores, ctx_pad, shared[c],    \
                       group, num_kv_heads, head_stride, block_stride, block_size, scale, softcap, sinks); \
            else                                                                                        \
                SEQS128(m, qss, qps, k_cache, v_cache, tables, ctxs, oss, scores, ctx_pad, shared[c],   \
                        group, num_kv_heads, head_stride, block_stride, block_size, scale, softcap, sinks); \
        }                                                                                               \
        free(scores);                                                                                   \
    }                                                                                                   \
    return failed;                                                                                      \
}

/* Prefill: query rows start .. start + n - 1 of one sequence (q, out: [n, num_heads, head_dim]), each
 * attending causally to the sequence's blocks in `table` (the chunk's own K/V already written). Rows
 * go in tiles of PREFILL_ROWS, handled as one decode whose KV groups hold PREFILL_ROWS × group query
 * heads: each K/V block is read from L2/L3 once per tile instead of once per row, and each vector feeds
 * more heads. Returns 2 where the vectorised kernel does not apply (the caller runs row by row). */
#define PREFILL_ROWS 4
#define DEFINE_PAGED_PREFILL(NAME, T, SEQ64, SEQ128)                                                    \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *table, int start, int n,   \
         float *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,        \
         int window, float softcap, const float *sinks, int num_threads) {                              \
    const int group = num_heads / num_kv_heads;                                                         \
    if (block_size % 16 != 0 || (head_dim != 64 && head_dim != 128) || group * num_kv_heads != num_heads \
        || group * PREFILL_ROWS > MAX_GROUP || num_heads * PREFILL_ROWS > MAX_HEADS) return 2;            \
    const int64_t head_stride = (int64_t)block_size * head_dim;                                         \
    const int64_t block_stride = (int64_t)num_kv_heads * head_stride;                                   \
    const int64_t ctx_pad = (int64_t)(start + n + block_size - 1) / block_size * block_size;           \
    const size_t tile_heads = (size_t)num_heads * PREFILL_ROWS;                                         \
    const int tiles = (n + PREFILL_ROWS - 1) / PREFILL_ROWS;                                            \
    int failed = 0;                                                                                     \
    _Pragma("omp parallel num_threads(num_threads)")                                                    \
    {                                                                                                   \
        float *scores = malloc(sizeof(float) * (tile_heads * (size_t)ctx_pad                            \
                                                + tile_heads * (size_t)head_dim * 5 / 2 + 16));         \
        float *qt = scores + tile_heads * (size_t)ctx_pad;                                              \
        float *ot = qt + tile_heads * (size_t)head_dim;                                                 \
        uint32_t *qpairs = (uint32_t *)(ot + tile_heads * (size_t)head_dim);                            \
        if (scores == NULL) failed = 1;                                                                 \
        _Pragma("omp for schedule(dynamic, 1)")                                                         \
        for (int i = 0; i < tiles; i++) {                                                               \
            if (scores == NULL) continue;                                                               \
            const int r0 = (tiles - 1 - i) * PREFILL_ROWS; /* the longest contexts first */             \
            const int rows = n - r0 < PREFILL_ROWS ? n - r0 : PREFILL_ROWS;                             \
            for (int kh = 0; kh < num_kv_heads; kh++)                                                   \
                for (int r = 0; r < rows; r++)                                                          \
                    memcpy(qt + ((int64_t)(kh * rows + r) * group) * head_dim,                          \
                           q + ((int64_t)(r0 + r) * num_heads + kh * group) * head_dim,                 \
                           sizeof(float) * (size_t)(group * head_dim));                                 \
            if (sizeof(T) == 2)                                                                         \
                for (int j = 0; j < num_heads * rows * head_dim / 2; j++)                               \
                    qpairs[j] = bf16_bits(qt[2 * j]) | bf16_bits(qt[2 * j + 1]) << 16;                  \
            if (head_dim == 64)                                                                         \
                SEQ64(qt, qpairs, k_cache, v_cache, table, start + r0 + rows, ot, scores, rows * group, \
                      num_kv_heads, head_stride, block_stride, block_size, scale, group, window,        \
                      softcap, sinks);                                                                  \
            else                                                                                        \
                SEQ128(qt, qpairs, k_cache, v_cache, table, start + r0 + rows, ot, scores, rows * group, \
                       num_kv_heads, head_stride, block_stride, block_size, scale, group, window,       \
                       softcap, sinks);                                                                 \
            for (int kh = 0; kh < num_kv_heads; kh++)                                                   \
                for (int r = 0; r < rows; r++)                                                          \
                    memcpy(out + ((int64_t)(r0 + r) * num_heads + kh * group) * head_dim,               \
                           ot + ((int64_t)(kh * rows + r) * group) * head_dim,                          \
                           sizeof(float) * (size_t)(group * head_dim));                                 \
        }                                                                                               \
        free(scores);                                                                                   \
    }                                                                                                   \
    return failed;                                                                                      \
}

DEFINE_SEQ_VEC(seq64_f32, float, K_TILE_F32, V_TILE_F32, 0, 64)
DEFINE_SEQ_VEC(seq128_f32, float, K_TILE_F32, V_TILE_F32, 0, 128)
DEFINE_SEQ_SCALAR(seq_any_f32, float, sload_f32, 1)
DEFINE_SEQ_VEC(seq64_bf16, uint16_t, K_TILE_BF16, V_TILE_PAIRS, PAIRED_V, 64)
DEFINE_SEQ_VEC(seq128_bf16, uint16_t, K_TILE_BF16, V_TILE_PAIRS, PAIRED_V, 128)
DEFINE_SEQ_SCALAR(seq_any_bf16, uint16_t, sload_bf16, 2)

DEFINE_SEQS_VEC(seqs64_f32, float, K_TILE_F32, V_TILE_F32, 0, 64)
DEFINE_SEQS_VEC(seqs128_f32, float, K_TILE_F32, V_TILE_F32, 0, 128)
DEFINE_SEQS_VEC(seqs64_bf16, uint16_t, K_TILE_BF16, V_TILE_PAIRS, PAIRED_V, 64)
DEFINE_SEQS_VEC(seqs128_bf16, uint16_t, K_TILE_BF16, V_TILE_PAIRS, PAIRED_V, 128)

DEFINE_PAGED_DECODE(paged_decode_f32, float, seq64_f32, seq128_f32, seq_any_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, seq64_bf16, seq128_bf16, seq_any_bf16)
DEFINE_PAGED_DECODE_SHARED(paged_decode_shared_f32, float, seqs64_f32, seqs128_f32)
DEFINE_PAGED_DECODE_SHARED(paged_decode_shared_bf16, uint16_t, seqs64_bf16, seqs128_bf16)
DEFINE_PAGED_PREFILL(paged_prefill_f32, float, seq64_f32, seq128_f32)
DEFINE_PAGED_PREFILL(paged_prefill_bf16, uint16_t, seq64_bf16, seq128_bf16)

/* Write the new tokens' keys and values into their cache slots (slot = block * block_size + row), K
 * transposed within its block in groups of P dims ([HD/P][block_size][P]). key, value: [num_tokens,
 * num_kv_heads, head_dim] with the given token and head strides in elements, head_dim contiguous.
 * write_kv_4: float32 (P = 1); write_kv_2: bfloat16 (P = 2, head_dim even). */
#define DEFINE_WRITE_KV(NAME, T, P)                                                                     \
void NAME(const T *key, const T *value, int64_t k_token_stride, int64_t k_head_stride,                 \
          int64_t v_token_stride, int64_t v_head_stride, const int64_t *slots, int num_tokens,          \
          T *k_cache, T *v_cache, int num_kv_heads, int head_dim, int block_size, int num_threads) {    \
    /* K's scattered stores mostly miss the cache (latency-bound): two threads overlap twice as many */ \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= 8)")          \
    for (int t = 0; t < num_tokens; t++) {                                                              \
        const int64_t block = slots[t] / block_size, row = slots[t] % block_size;                       \
        for (int kh = 0; kh < num_kv_heads; kh++) {                                                     \
            const int64_t base = (block * num_kv_heads + kh) * head_dim * block_size;                   \
            const T *ks = key + t * k_token_stride + kh * k_head_stride;                                \
            T *kt = k_cache + base + row * (P);                                                         \
            for (int d = 0; d < head_dim; d += (P))                                                     \
                memcpy(kt + (int64_t)d * block_size, ks + d, sizeof(T) * (P));                          \
            memcpy(v_cache + base + row * head_dim, value + t * v_token_stride + kh * v_head_stride,    \
                   sizeof(T) * (size_t)head_dim);                                                       \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_WRITE_KV(write_kv_4, uint32_t, 1)
DEFINE_WRITE_KV(write_kv_2, uint16_t, 2)
