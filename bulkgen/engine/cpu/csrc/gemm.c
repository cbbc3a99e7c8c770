/*
 * Linear layers, y = x W^T + b, for the CPU forward pass: float32, and bfloat16 where the CPU has
 * AVX512-BF16 (at the end of this file).
 *
 * Why our own: a decode step multiplies a few rows (the running sequences) by every weight of the
 * model, and those weights (540 MB for SmolLM2-135M) do not fit in any cache, so each step streams
 * them from memory. oneDNN's GEMM stalls on that stream for small batches: 26 ms a step for one row
 * (21 GB/s) and 35 ms for 18 rows, against 11-17 ms and 26 ms for this kernel, on 2 cores of an AMD
 * Zen 4. From about a hundred rows up both run near the CPU's float32 peak, and which is faster there
 * depends on the CPU: the engine races both on each machine (cpu_paths.py).
 *
 * Layout: W [N, K] is packed once into panels of NR output columns, [ceil(N/NR)][K][NR] (the last
 * panel zero-padded), so a panel streams from memory in one sequential run. A tile of up to MR_MAX
 * rows keeps MR x NR/VN vector accumulators in registers; for each k it loads the panel's NR weights
 * once and broadcasts each row's x[k] against them. A batch larger than MR_MAX is split into balanced
 * row groups that reuse the panel from L2. Threads split the panels.
 *
 * The tile is sized to the vector registers of the instruction set the library is built for (a tile
 * that does not fit spills its accumulators to the stack on every k: the 10 x 48 tile written for
 * AVX-512 ran 7x slower than oneDNN when built for AVX2):
 *   AVX-512    32 registers of 16 floats: 10 rows x 48 columns (30 accumulators, 3 weights, 1 broadcast)
 *   AVX, AVX2  16 registers of 8 floats:   6 rows x 16 columns (12 accumulators, 2 weights, 1 broadcast)
 *   NEON       32 registers of 4 floats:   6 rows x 16 columns (24 accumulators, 4 weights, 1 broadcast)
 *   otherwise  (SSE2: 16 registers of 4):  6 rows x 8 columns  (12 accumulators, 2 weights, 1 broadcast)
 *
 * Summation order: each output is one float32 FMA chain over k = 0..K-1, whatever the batch, so a
 * request's logits do not depend on which other requests share its step.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__)
#define NR 48
#define MR_MAX 10
#elif defined(__AVX__) || defined(__aarch64__)
#define NR 16
#define MR_MAX 6
#else
#define NR 8
#define MR_MAX 6
#endif

/* Rows of a panel ahead (k values; pairs of them in bfloat16) that a tile prefetches, so that the weights'
 * stream from memory overlaps the FMAs: 16 (3 KB) took a decode-sized product with the weights in DRAM
 * from 14 to 21 GB/s (Intel Xeon, AMX kind, 16 rows; 8 to 32 alike), and cost nothing in cache. 0: none
 * (-DPREFETCH_ROWS=0 in BULKGEN_KERNEL_CFLAGS, to measure a machine without them). */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif
static inline vf splat(float v) { return -(vf){} + v; } /* -0.0 + v == v: folds to one broadcast */

/* A tile: rows x[0..MR) against one panel w, into y (row stride ldy), the first ncols columns. */
typedef void (*tile_fn)(const void *x, int64_t K, const void *w, void *y, int64_t ldy, int ncols, const void *bias);

/* Threads over panels; within a panel, balanced groups of at most MR_MAX rows. elem: bytes per value. */
static void run_tiles(const tile_fn *tiles, size_t elem, const char *x, int64_t M, int64_t K, const char *packed,
                      int64_t N, const char *bias, char *y, int num_threads) {
    if (M <= 0 || N <= 0)
        return;
    int64_t panels = (N + NR - 1) / NR;
    int64_t groups = (M + MR_MAX - 1) / MR_MAX, rows = (M + groups - 1) / groups;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        int ncols = (int)(N - p * NR < NR ? N - p * NR : NR);
        for (int64_t r0 = 0; r0 < M; r0 += rows) {
            int64_t mr = M - r0 < rows ? M - r0 : rows;
            tiles[mr](x + r0 * K * elem, K, packed + p * K * NR * elem, y + (r0 * N + p * NR) * elem, N, ncols,
                      bias ? bias + p * NR * elem : 0);
        }
    }
}

/*
 * The MLP's input projection with its activation, silu(x Wg^T) * (x Wu^T), as one pass: the gate and
 * the up weights are packed one after the other (each [ceil(n/NR)][K][NR]), and a thread takes panel p
 * of both for each row group, so the two tiles of the same columns meet in L1 and leave as n outputs:
 * the [M, 2n] product is never written out and read back (in a prefill chunk of a thousand rows, 12 MB
 * a layer in float32). Each tile rounds as the plain linear layer does, then silu_mul_span as the
 * standalone silu_mul: the same bits as the two steps.
 */
static void run_tiles_silu_mul(const tile_fn *tiles, size_t elem, int dtype, const char *x, int64_t M, int64_t K,
                               const char *packed, int64_t n, char *y, int num_threads) {
    if (M <= 0 || n <= 0)
        return;
    int64_t panels = (n + NR - 1) / NR;
    int64_t groups = (M + MR_MAX - 1) / MR_MAX, rows = (M + groups - 1) / groups;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float gate[MR_MAX * NR], up[MR_MAX * NR]; /* float32 or bfloat16 values, rows NR apart */
        int ncols = (int)(n - p * NR < NR ? n - p * NR : NR);
        for (int64_t r0 = 0; r0 < M; r0 += rows) {
            int64_t mr = M - r0 < rows ? M - r0 : rows;
            tiles[mr](x + r0 * K * elem, K, packed + p * K * NR * elem, gate, NR, ncols, 0);
            tiles[mr](x + r0 * K * elem, K, packed + (panels + p) * K * NR * elem, up, NR, ncols, 0);
            for (int64_t r = 0; r < mr; r++)
                silu_mul_span((char *)gate + r * NR * elem, (char *)up + r * NR * elem,
                              y + ((r0 + r) * n + p * NR) * elem, ncols, dtype);
        }
    }
}

#define LINEAR_TILE(MR) \
    static void tile_##MR(const void *x_, int64_t K, const void *w_, void *y_, int64_t ldy, int ncols, \
                          const void *bias_) { \
        const float *restrict x = x_, *restrict w = w_, *restrict bias = bias_; \
        float *restrict y = y_; \
        vf acc[MR][NR / VN]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR / VN; j++) acc[r][j] = (vf){0}; \
        for (int64_t k = 0; k < K; k++) { \
            vf wk[NR / VN]; \
            _Pragma("GCC unroll 4") for (int j = 0; PREFETCH_ROWS > 0 && j < (NR * 4 + 63) / 64; j++) \
                __builtin_prefetch(w + (k + PREFETCH_ROWS) * NR + j * 16, 0, 3); \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR / VN; j++) wk[j] = vload_f32(w + k * NR + VN * j); \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) { \
                vf b = splat(x[r * K + k]); \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR / VN; j++) acc[r][j] += b * wk[j]; \
            } \
        } \
        for (int r = 0; r < MR; r++) { \
            float out[NR]; \
            memcpy(out, acc[r], sizeof out); \
            if (bias) \
                for (int j = 0; j < ncols; j++) out[j] += bias[j]; \
            memcpy(y + r * ldy, out, (size_t)ncols * sizeof(float)); \
        } \
    }

LINEAR_TILE(1) LINEAR_TILE(2) LINEAR_TILE(3) LINEAR_TILE(4) LINEAR_TILE(5) LINEAR_TILE(6)
#if MR_MAX == 10
LINEAR_TILE(7) LINEAR_TILE(8) LINEAR_TILE(9) LINEAR_TILE(10)
static const tile_fn TILES[MR_MAX + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5,
                                          tile_6, tile_7, tile_8, tile_9, tile_10};
#elif MR_MAX == 6
static const tile_fn TILES[MR_MAX + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
#else
#error "tiles of 6 or 10 rows"
#endif

/* Floats the packed form of an [N, K] weight takes. */
int64_t linear_packed_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

void pack_linear_f32(const float *w, int64_t N, int64_t K, float *out, int num_threads) {
    int64_t panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < NR; j++) {
                int64_t n = p * NR + j;
                out[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* y [M, N] = x [M, K] (contiguous rows) times the packed weight, plus bias [N] (or NULL). */
void linear_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias,
                float *y, int num_threads) {
    run_tiles(TILES, sizeof(float), (const char *)x, M, K, (const char *)packed, N, (const char *)bias, (char *)y,
              num_threads);
}

/* out [M, n] = silu(x Wg^T) * (x Wu^T), packed: pack_linear_f32 of Wg [n, K] then of Wu [n, K]. */
void linear_silu_mul_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t n, float *out,
                         int num_threads) {
    run_tiles_silu_mul(TILES, sizeof(float), 0, (const char *)x, M, K, (const char *)packed, n, (char *)out,
                       num_threads);
}

/*
 * bfloat16 weights and activations, float32 accumulation, the output rounded to bfloat16 once (as
 * oneDNN's bfloat16 linear does), where the CPU has AVX512-BF16: `vdpbf16ps` multiplies 16 columns
 * by a pair of k at once. Packed as [ceil(N/NR)][K/2][NR][2]: for each k pair, a column's two
 * weights side by side, which is the instruction's operand layout. Elsewhere (or for odd K)
 * linear_bf16_available() says no and the caller keeps oneDNN.
 */
#if defined(__AVX512BF16__)
#include <immintrin.h>

#define LINEAR_TILE_BF16(MR) \
    static void tile_bf16_##MR(const void *x_, int64_t K, const void *w_, void *y_, int64_t ldy, int ncols, \
                               const void *bias_) { \
        const uint16_t *restrict x = x_, *restrict w = w_, *restrict bias = bias_; \
        uint16_t *restrict y = y_; \
        __m512 acc[MR][NR / 16]; \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR / 16; j++) acc[r][j] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k += 2) { \
            __m512bh wk[NR / 16]; \
            _Pragma("GCC unroll 4") for (int j = 0; PREFETCH_ROWS > 0 && j < NR * 4 / 64; j++) \
                __builtin_prefetch(w + (k + 2 * PREFETCH_ROWS) * NR + j * 32, 0, 3); \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR / 16; j++) \
                wk[j] = (__m512bh)_mm512_loadu_si512(w + k * NR + 32 * j); \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) { \
                uint32_t pair; \
                memcpy(&pair, x + r * K + k, sizeof pair); \
                __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair); \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR / 16; j++) \
                    acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wk[j], b); \
            } \
        } \
        for (int r = 0; r < MR; r++) { \
            float out[NR]; \
            for (int j = 0; j < NR / 16; j++) _mm512_storeu_ps(out + 16 * j, acc[r][j]); \
            for (int j = 0; j < ncols; j++) { \
                y[r * ldy + j] = f32_to_bf16(bias ? out[j] + bf16_to_f32(bias[j]) : out[j]); \
            } \
        } \
    }

LINEAR_TILE_BF16(1) LINEAR_TILE_BF16(2) LINEAR_TILE_BF16(3) LINEAR_TILE_BF16(4) LINEAR_TILE_BF16(5)
LINEAR_TILE_BF16(6) LINEAR_TILE_BF16(7) LINEAR_TILE_BF16(8) LINEAR_TILE_BF16(9) LINEAR_TILE_BF16(10)

static const tile_fn TILES_BF16[MR_MAX + 1] = {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4,
                                                    tile_bf16_5, tile_bf16_6, tile_bf16_7, tile_bf16_8,
                                                    tile_bf16_9, tile_bf16_10};

int linear_bf16_available(int64_t K) { return K % 2 == 0; }

void pack_linear_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int num_threads) {
    int64_t panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k += 2)
            for (int j = 0; j < NR; j++)
                for (int t = 0; t < 2; t++) {
                    int64_t n = p * NR + j;
                    out[((p * K + k) * NR) + 2 * j + t] = n < N ? w[n * K + k + t] : 0;
                }
}

void linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                 const uint16_t *bias, uint16_t *y, int num_threads) {
    run_tiles(TILES_BF16, sizeof(uint16_t), (const char *)x, M, K, (const char *)packed, N, (const char *)bias,
              (char *)y, num_threads);
}

void linear_silu_mul_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t n, uint16_t *out,
                          int num_threads) {
    run_tiles_silu_mul(TILES_BF16, sizeof(uint16_t), 1, (const char *)x, M, K, (const char *)packed, n, (char *)out,
                       num_threads);
}
#else
int linear_bf16_available(int64_t K) { (void)K; return 0; }
void pack_linear_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int num_threads) {
    (void)w; (void)N; (void)K; (void)out; (void)num_threads;
}
void linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                 const uint16_t *bias, uint16_t *y, int num_threads) {
    (void)x; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)y; (void)num_threads;
}
void linear_silu_mul_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t n, uint16_t *out,
                          int num_threads) {
    (void)x; (void)M; (void)K; (void)packed; (void)n; (void)out; (void)num_threads;
}
#endif
