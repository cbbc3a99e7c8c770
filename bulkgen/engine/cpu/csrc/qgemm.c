/*
 * int8 linear layers (--quantization int8, engine/quant.py): W quantized per output channel at load
 * (w ≈ scale[n] q[n, k]), x per block of QB = 32 values here (x ≈ d[m, b] p[m, k], as llama.cpp's Q8_0: per
 * token, SmolLM2's outlier channels cost 4 % of perplexity; per block, 0.6 %), and
 *     y[m, n] = scale[n] * sum_b d[m, b] * (sum_{k in b} p[m, k] q[n, k]) + bias[n],
 * each block's dot product in integers (exact), the blocks summed in float32 in order of b.
 *
 * AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, four to an int32 lane, 64 multiply-adds an
 * instruction (twice vdpbf16ps's) on weights half the bytes of bfloat16. The weights are stored unsigned,
 * u = q + 128, so sum u p = sum q p + 128 sum p, and each block's sum of p takes the 128 back out, in integers.
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

/* Row of x (float32 or bfloat16) -> q [padded_k(K)] int8 (zero-padded), and per block its scale d and
 * 128 * sum of q: d = max|x| / 127 over the block (1 for zeros), q = round-half-even(x / d), as
 * engine/quant.py's quantize_rows. */
static void quantize_row(const void *x, int dtype, int64_t K, int8_t *q, float *d, int32_t *offset) {
    const float *xf = x;
    const uint16_t *xh = x;
    for (int64_t b = 0; b * QB < K; b++) {
        int64_t k0 = b * QB, k1 = k0 + QB < K ? k0 + QB : K;
        float v[QB] = {0}, amax = 0.0f;
        for (int64_t k = k0; k < k1; k++) {
            v[k - k0] = dtype ? bf16_to_f32(xh[k]) : xf[k];
            amax = fabsf(v[k - k0]) > amax ? fabsf(v[k - k0]) : amax;
        }
        float s = amax / 127.0f;
        if (!(s > 0.0f))
            s = 1.0f;
        int32_t total = 0;
        for (int t = 0; t < QB; t++) {
            float r = nearbyintf(v[t] / s);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[k0 + t] = (int8_t)r;
            total += q[k0 + t];
        }
        d[b] = s;
        offset[b] = 128 * total;
    }
}

/* A tile: rows x [mr][kpad] (int8, their block scales d and offsets, nb blocks a row) against one panel w,
 * into out [mr][QNR]: sum_b d[b] * (dot_b - offset[b]) in float32. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QMR_MAX 6

int qlinear_available(void) { return 1; }


#define QTILE(MR) \
    static void qtile_##MR(const int8_t *x, const float *d, const int32_t *offset, int64_t nb, const uint8_t *w, \
                           float *out) { \
        __m512 f[MR][2]; \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) f[r][0] = f[r][1] = _mm512_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) { \
            __m512i acc[MR][2]; \
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512(); \
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
                __m512i off = _mm512_set1_epi32(offset[r * nb + b]); \
                __m512 db = _mm512_set1_ps(d[r * nb + b]); \
                f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], off)), db, f[r][0]); \
                f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], off)), db, f[r][1]); \
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
                                                             const int32_t *offset, int64_t nb, const uint8_t *w,
                                                             float *out) {
    __m256 f[QMR_MAX][4];
    for (int r = 0; r < QMR_MAX; r++)
        for (int q = 0; q < 4; q++)
            f[r][q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int q = 0; q < 4; q++) {
            __m256i acc[QMR_MAX];
            for (int r = 0; r < QMR_MAX; r++)
                acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < QB / 4; g++) {
                __m256i wq = _mm256_loadu_si256((const __m256i *)(w + (b * (QB / 4) + g) * 128 + 32 * q));
                for (int r = 0; r < mr; r++) {
                    int32_t four;
                    memcpy(&four, x + (r * nb + b) * QB + g * 4, 4);
                    acc[r] = idot_u8(acc[r], wq, _mm256_set1_epi32(four));
                }
            }
            for (int r = 0; r < mr; r++) {
                __m256i a = IDOT_U8_OFFSET ? _mm256_sub_epi32(acc[r], _mm256_set1_epi32(offset[r * nb + b])) : acc[r];
                f[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d[r * nb + b]), f[r][q]);
            }
        }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++)
            _mm256_storeu_ps(out + r * QNR + 8 * q, f[r][q]);
}

#define QTILE(MR) \
    static void qtile_##MR(const int8_t *x, const float *d, const int32_t *offset, int64_t nb, const uint8_t *w, \
                           float *out) { qtile_body(MR, x, d, offset, nb, w, out); }
#else
#define QMR_MAX 6

int qlinear_available(void) { return 0; }

static void qtile(int64_t mr, const int8_t *x, const float *d, const int32_t *offset, int64_t nb, const uint8_t *w,
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
                f[j] = fmaf((float)(acc[j] - offset[r * nb + b]), d[r * nb + b], f[j]);
        }
        memcpy(out + r * QNR, f, sizeof f);
    }
}
#endif

#ifdef QTILE  /* one function per row count, either SIMD version's */
QTILE(1) QTILE(2) QTILE(3) QTILE(4) QTILE(5) QTILE(6)
typedef void (*qtile_fn)(const int8_t *x, const float *d, const int32_t *offset, int64_t nb, const uint8_t *w,
                         float *out);
static const qtile_fn QTILES[QMR_MAX + 1] = {0, qtile_1, qtile_2, qtile_3, qtile_4, qtile_5, qtile_6};

static void qtile(int64_t mr, const int8_t *x, const float *d, const int32_t *offset, int64_t nb, const uint8_t *w,
                  float *out) {
    QTILES[mr](x, d, offset, nb, w, out);
}
#endif

/* y [M, N] (dtype: 0 float32, 1 bfloat16) = the int8 product of x [M, K] (same dtype) and the packed weight,
 * scale [N] float32 per output, bias [N] float32 or NULL: y = scale[n] * tile + bias[n], rounded to bfloat16
 * to nearest even as torch does. */
void qlinear(const void *x, int64_t M, int64_t K, int dtype, const uint8_t *packed, int64_t N, const float *scale,
             const float *bias, void *y, int num_threads) {
    if (M <= 0 || N <= 0)
        return;
    int64_t kpad = padded_k(K), nb = kpad / QB, panels = (N + QNR - 1) / QNR;
    size_t elem = dtype ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * kpad));
    float *d = malloc((size_t)(M * nb) * sizeof(float));
    int32_t *offset = malloc((size_t)(M * nb) * sizeof(int32_t));
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + m * K * elem, dtype, K, xq + m * kpad, d + m * nb, offset + m * nb);
    int64_t groups = (M + QMR_MAX - 1) / QMR_MAX, rows = (M + groups - 1) / groups;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float acc[QMR_MAX * QNR];
        int ncols = (int)(N - p * QNR < QNR ? N - p * QNR : QNR);
        for (int64_t r0 = 0; r0 < M; r0 += rows) {
            int64_t mr = M - r0 < rows ? M - r0 : rows;
            qtile(mr, xq + r0 * kpad, d + r0 * nb, offset + r0 * nb, nb, packed + p * kpad * QNR, acc);
            for (int64_t r = 0; r < mr; r++) {
                float v[QNR];
                for (int j = 0; j < QNR; j++)
                    v[j] = acc[r * QNR + j] * scale[p * QNR + (j < ncols ? j : 0)]
                           + (bias ? bias[p * QNR + (j < ncols ? j : 0)] : 0.0f);
                if (dtype)
                    for (int j = 0; j < ncols; j++)
                        ((uint16_t *)y)[(r0 + r) * N + p * QNR + j] = f32_to_bf16(v[j]);
                else
                    memcpy((float *)y + (r0 + r) * N + p * QNR, v, (size_t)ncols * sizeof(float));
            }
        }
    }
    free(xq);
    free(d);
    free(offset);
}
