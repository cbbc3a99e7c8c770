/*
 * int8 linear layers (--quantization int8, engine/quant.py): W quantized per output channel at load
 * (w ≈ scale[n] q[n, k]), x per block of QB = 32 values here (x ≈ d[m, b] p[m, k], as llama.cpp's Q8_0: per
 * token, SmolLM2's outlier channels cost 4 % of perplexity; per block, 0.6 %), and
 *     y[m, n] = scale[n] * sum_b d[m, b] * (sum_{k in b} p[m, k] q[n, k]) + bias[n],
 * each block's dot product in integers (exact), the blocks summed in float32 in order of b.
 *
 * AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, four to an int32 lane, 64 multiply-adds an
 * instruction (twice vdpbf16ps's) on weights half the bytes of bfloat16. The weights are stored unsigned,
 * u = q + 128, so sum u p = sum q p + 128 sum p: each block's int32 accumulators start at -128 sum p (the
 * row's, computed when x is quantized), so the 128 leaves in integers at no cost in the tile.
 * AVX2 (with or without AVX-VNNI): the same on 256 bits (idot.h). Elsewhere the same math in plain C.
 *
 * Layout: W [N, K] packed once into panels of QNR = 32 outputs, [ceil(N/32)][ceil(K/32) * 8][32][4] bytes (K
 * padded with q = 0, N with zero rows), so a panel streams in one sequential run. A tile of up to QMR_MAX rows
 * keeps 2 int32 and 2 float32 accumulators a row; for each group of 4 k it loads the panel's 128 bytes once and
 * broadcasts each row's 4 bytes of x against them. Threads split the panels.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define QNR 32
#define QB 32

static int64_t padded_k(int64_t K) { return (K + QB - 1) / QB * QB; }

int64_t qlinear_packed_size(int64_t N, int64_t K) { return (N + QNR - 1) / QNR * QNR * padded_k(K); }

/* W int8 [N, K] (values in [-127, 127]) into the panels above, as unsigned bytes q + 128. */
void pack_qlinear(const int8_t *w, int64_t N, int64_t K, uint8_t *out, int num_threads) {
    int64_t panels = (N + QNR - 1) / QNR, k4 = padded_k(K) / 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < k4; g++)
            for (int j = 0; j < QNR; j++)
                for (int t = 0; t < 4; t++) {
                    int64_t n = p * QNR + j, k = g * 4 + t;
                    int v = n < N && k < K ? w[n * K + k] : 0;
                    out[((p * k4 + g) * QNR + j) * 4 + t] = (uint8_t)(v + 128);
                }
}

/* Row of x (float32 or bfloat16) -> q [padded_k(K)] int8 (zero-padded), and per block its scale d and where
 * the tile's int32 sums of u q start, -128 * sum of q: d = max|x| / 127 over the block (1 for zeros),
 * q = round-half-even(x / d), as engine/quant.py's quantize_rows (vec.h's quantize_block32). */
static void quantize_row(const void *x, int dtype, int64_t K, int8_t *q, float *d, int32_t *start) {
    size_t elem = dtype ? 2 : 4;
    for (int64_t b = 0; b * QB < K; b++) {
        int32_t sums[2];
        if ((b + 1) * QB <= K)
            d[b] = quantize_block32(x, b * QB, dtype, q + b * QB, sums);
        else {  /* the last block, zero-padded */
            char tail[QB * 4] = {0};
            memcpy(tail, (const char *)x + b * QB * elem, (size_t)(K - b * QB) * elem);
            d[b] = quantize_block32(tail, 0, dtype, q + b * QB, sums);
        }
        start[b] = -128 * (sums[0] + sums[1]);
    }
}

/* A tile: rows x [mr][kpad] (int8, their block scales d and starts, nb blocks a row) against one panel w,
 * into out [mr][QNR]: sum_b d[b] * (start[b] + dot_b) in float32. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QMR_MAX 6

int qlinear_available(void) { return 1; }


#define QTILE(MR) \
    static void qtile_##MR(const int8_t *x, const float *d, const int32_t *start, int64_t nb, const uint8_t *w, \
                           float *out) { \
        __m512 f[MR][2]; \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) f[r][0] = f[r][1] = _mm512_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) { \
            __m512i acc[MR][2]; \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) \
                acc[r][0] = acc[r][1] = _mm512_set1_epi32(start[r * nb + b]); \
            _Pragma("GCC unroll 8") for (int g = 0; g < QB / 4; g++) { \
                const uint8_t *wg = w + (b * (QB / 4) + g) * 128; \
                __m512i w0 = _mm512_loadu_si512(wg), w1 = _mm512_loadu_si512(wg + 64); \
                __builtin_prefetch(wg + 16 * 128, 0, 3); \
                __builtin_prefetch(wg + 16 * 128 + 64, 0, 3); \
                _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) { \
                    int32_t four; \
                    memcpy(&four, x + (r * nb + b) * QB + g * 4, 4); \
                    __m512i p = _mm512_set1_epi32(four); \
                    acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, p); \
                    acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, p); \
                } \
            } \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) { \
                __m512 db = _mm512_set1_ps(d[r * nb + b]); \
                f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), db, f[r][0]); \
                f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), db, f[r][1]); \
            } \
        } \
        for (int r = 0; r < MR; r++) { \
            _mm512_storeu_ps(out + r * QNR, f[r][0]); \
            _mm512_storeu_ps(out + r * QNR + 16, f[r][1]); \
        } \
    }
#elif defined(__AVX2__) && defined(__FMA__)
/* 256 bits (idot.h): the panel's 32 outputs as four quarters of 8 (bytes 32 q to 32 q + 31 of each group of 4 k),
 * one int32 accumulator a row per quarter, the float32 ones in memory. */
#include "idot.h"
#define QMR_MAX 6

int qlinear_available(void) { return 1; }

static inline __attribute__((always_inline)) void qtile_body(int mr, const int8_t *x, const float *d,
                                                             const int32_t *start, int64_t nb, const uint8_t *w,
                                                             float *out) {
    __m256 f[QMR_MAX][4];
    for (int r = 0; r < QMR_MAX; r++)
        for (int q = 0; q < 4; q++)
            f[r][q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int q = 0; q < 4; q++) {
            __m256i acc[QMR_MAX];
            for (int r = 0; r < QMR_MAX; r++)  /* from -128 sum p where the products take u = q + 128 */
                acc[r] = IDOT_U8_OFFSET && r < mr ? _mm256_set1_epi32(start[r * nb + b]) : _mm256_setzero_si256();
            for (int g = 0; g < QB / 4; g++) {
                __m256i wq = _mm256_loadu_si256((const __m256i *)(w + (b * (QB / 4) + g) * 128 + 32 * q));
                for (int r = 0; r < mr; r++) {
                    int32_t four;
                    memcpy(&four, x + (r * nb + b) * QB + g * 4, 4);
                    acc[r] = idot_u8(acc[r], wq, _mm256_set1_epi32(four));
                }
            }
            for (int r = 0; r < mr; r++) {
                f[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(d[r * nb + b]), f[r][q]);
            }
        }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++)
            _mm256_storeu_ps(out + r * QNR + 8 * q, f[r][q]);
}

#define QTILE(MR) \
    static void qtile_##MR(const int8_t *x, const float *d, const int32_t *start, int64_t nb, const uint8_t *w, \
                           float *out) { qtile_body(MR, x, d, start, nb, w, out); }
#else
#define QMR_MAX 6

int qlinear_available(void) { return 0; }

static void qtile(int64_t mr, const int8_t *x, const float *d, const int32_t *start, int64_t nb, const uint8_t *w,
                  float *out) {
    for (int64_t r = 0; r < mr; r++) {
        float f[QNR] = {0};
        for (int64_t b = 0; b < nb; b++) {
            int32_t acc[QNR] = {0};
            for (int g = 0; g < QB / 4; g++)
                for (int j = 0; j < QNR; j++)
                    for (int t = 0; t < 4; t++)
                        acc[j] += (int32_t)w[((b * (QB / 4) + g) * QNR + j) * 4 + t] * x[(r * nb + b) * QB + g * 4 + t];
            for (int j = 0; j < QNR; j++)
                f[j] = fmaf((float)(acc[j] + start[r * nb + b]), d[r * nb + b], f[j]);
        }
        memcpy(out + r * QNR, f, sizeof f);
    }
}
#endif

#ifdef QTILE  /* one function per row count, either SIMD version's */
QTILE(1) QTILE(2) QTILE(3) QTILE(4) QTILE(5) QTILE(6)
typedef void (*qtile_fn)(const int8_t *x, const float *d, const int32_t *start, int64_t nb, const uint8_t *w,
                         float *out);
static const qtile_fn QTILES[QMR_MAX + 1] = {0, qtile_1, qtile_2, qtile_3, qtile_4, qtile_5, qtile_6};

static void qtile(int64_t mr, const int8_t *x, const float *d, const int32_t *start, int64_t nb, const uint8_t *w,
                  float *out) {
    QTILES[mr](x, d, start, nb, w, out);
}
#endif

/* y [M, N] (dtype: 0 float32, 1 bfloat16) = the int8 product of x [M, K] (same dtype) and the packed weight,
 * scale [N] float32 per output, bias [N] float32 or NULL: y = scale[n] * tile + bias[n], rounded to bfloat16
 * to nearest even as torch does. gated: the packed weight holds 2 N outputs, a gate's then an up projection's
 * (N a multiple of QNR), and y = silu(gate) * up, each rounded as the plain layer rounds it, then vec.h's
 * silu_mul_span as ops.c's silu_mul: the same bits as the two steps, without the [M, 2 N] product in memory. */
static void qlinear_run(const void *x, int64_t M, int64_t K, int dtype, const uint8_t *packed, int64_t N,
                        const float *scale, const float *bias, void *y, int num_threads, int gated) {
    if (M <= 0 || N <= 0)
        return;
    int64_t kpad = padded_k(K), nb = kpad / QB, panels = (N + QNR - 1) / QNR;
    size_t elem = dtype ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * kpad));
    float *d = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *start = malloc((size_t)(M * nb) * sizeof(int32_t));
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * elem, dtype, K, xq + m * kpad, d + m * nb, start + m * nb);
    int64_t groups = (M + QMR_MAX - 1) / QMR_MAX;  /* row tiles, balanced: 37 rows are 6 + 6 + 5 x 5, not 6 x 6 + 1 */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float acc[QMR_MAX * QNR], up[QMR_MAX * QNR];
        int ncols = (int)(N - p * QNR < QNR ? N - p * QNR : QNR);
        for (int64_t t = 0, r0 = 0, mr; t < groups; t++, r0 += mr) {
            mr = M / groups + (t < M % groups);
            qtile(mr, xq + r0 * kpad, d + r0 * nb, start + r0 * nb, nb, packed + p * kpad * QNR, acc);
            if (gated)
                qtile(mr, xq + r0 * kpad, d + r0 * nb, start + r0 * nb, nb, packed + (panels + p) * kpad * QNR, up);
            for (int64_t r = 0; r < mr; r++) {
                char *row = (char *)y + ((r0 + r) * N + p * QNR) * elem;
                if (!gated) {
                    store_panel_row(acc + r * QNR, ncols, scale + p * QNR, bias ? bias + p * QNR : NULL, row, dtype);
                    continue;
                }
                char g[QNR * 4], u[QNR * 4];
                store_panel_row(acc + r * QNR, QNR, scale + p * QNR, bias ? bias + p * QNR : NULL, g, dtype);
                store_panel_row(up + r * QNR, QNR, scale + N + p * QNR, bias ? bias + N + p * QNR : NULL, u, dtype);
                silu_mul_span(g, u, row, QNR, dtype);
            }
        }
    }
    free(xq);
    free(d);
    free(start);
}

void qlinear(const void *x, int64_t M, int64_t K, int dtype, const uint8_t *packed, int64_t N, const float *scale,
             const float *bias, void *y, int num_threads) {
    qlinear_run(x, M, K, dtype, packed, N, scale, bias, y, num_threads, 0);
}

/* y [M, N] = silu(x Wg^T) * (x Wu^T) where packed is pack_qlinear of [Wg; Wu] (2 N rows), scale [2 N], bias
 * [2 N] or NULL; N a multiple of 32 (qlinear_silu_mul_takes). */
void qlinear_silu_mul(const void *x, int64_t M, int64_t K, int dtype, const uint8_t *packed, int64_t N,
                      const float *scale, const float *bias, void *y, int num_threads) {
    qlinear_run(x, M, K, dtype, packed, N, scale, bias, y, num_threads, 1);
}

int qlinear_silu_mul_takes(int64_t N) { return N % QNR == 0; }
