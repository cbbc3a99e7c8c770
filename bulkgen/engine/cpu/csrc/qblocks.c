/*
 * Linear layers on a GGUF file's own blocks (--quantization gguf, engine/gguf_linear.py): Q8_0, Q4_0, Q4_1,
 * Q4_K and Q6_K weights kept at (about) their file size, every product in integers.
 *
 * Each format is, per block of WB weights of one output row (WB = 32, 16 for Q6_K), unsigned integers u with
 * w = s * u + m: Q8_0 u = q + 128, s = d, m = -128 d; Q4_0 u = q, s = d, m = -8 d; Q4_1 s = d, m = m;
 * Q4_K s = d * sc[j], m = -(dmin * mn[j]); Q6_K u = q, s = d * sc[j], m = -32 s. The activations are
 * quantized per block of QB = 32 values (x ≈ dx p, p in [-127, 127], as qgemm.c and llama.cpp's Q8_0), so
 *     y[m, n] = sum_b dx[m, b] * (s[n, b] * sum_{k in b} u[n, k] p[m, k] + m[n, b] * sum_{k in b} p[m, k])
 * with each block's two sums in integers (exact) and the blocks summed in float32 in order of b. Where m is
 * -zero * s (Q8_0, Q4_0, Q6_K) the zero comes out in integers, f = fma((float)(dot - zero * psum), s * dx, f);
 * else (Q4_1, Q4_K: a real minimum) f = fma((float)dot, s * dx, f); f = fma(m, dx * (float)psum, f). Every
 * version below (AVX512-VNNI; AVX-VNNI or AVX2 on 256 bits, idot.h; plain C) does exactly this: they agree bit
 * for bit.
 *
 * Layout (packed once at load): panels of QNR = 32 outputs; a panel holds its blocks in order of b, each block
 * its quants (WB / 4 groups of 4 k x 32 outputs) then its scales; K-quants put their superblock's fp32 d (and
 * dmin) before its first block. A group of 4 k is 128 bytes for 8 bits, 64 for 4 bits (the low nibble outputs
 * 0-15, the high one 16-31), 96 for 6 bits (the low 4 bits as 4-bit groups, then 32 bytes holding 2 bits each
 * of byte i and i + 32 of both halves). Scales: fp16 as the file has them (Q8_0, Q4_0: s; Q4_1: s, m), or the
 * file's small integers sc (and mn) under the superblock's fp32 d (and dmin). Bytes a weight: Q8_0 34/32,
 * Q4_0 18/32, Q4_1 20/32, Q4_K 152/256, Q6_K 212/256 (the file's: 34, 18, 20, 144, 210).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define QNR 32
#define QB 32

typedef struct {
    int bits, wb;  /* bits a quant; weights a block */
    int super;     /* blocks a superblock with fp32 d (0: fp16 scales a block) */
    int asym;      /* m stored (Q4_1: fp16; Q4_K: dmin and mn), else m = -zero * s */
    int zero;
    int sc_signed; /* Q6_K's sc are int8 */
} qformat;

static const qformat FORMATS[] = {
    {8, 32, 0, 0, 128, 0},  /* 0 Q8_0 */
    {4, 32, 0, 0, 8, 0},    /* 1 Q4_0 */
    {4, 32, 0, 1, 0, 0},    /* 2 Q4_1 */
    {4, 32, 8, 1, 0, 0},    /* 3 Q4_K */
    {6, 16, 16, 0, 32, 1},  /* 4 Q6_K */
};
#define NFORMATS ((int)(sizeof FORMATS / sizeof FORMATS[0]))

static int64_t group_bytes(const qformat *f) { return f->bits == 8 ? 128 : f->bits == 4 ? 64 : 96; }
static int64_t scale_bytes(const qformat *f) { return f->super ? (f->asym ? 64 : 32) : (f->asym ? 128 : 64); }
static int64_t quant_bytes(const qformat *f) { return f->wb / 4 * group_bytes(f); }
static int64_t block_bytes(const qformat *f) { return quant_bytes(f) + scale_bytes(f); }
static int64_t header_bytes(const qformat *f) { return f->super ? (f->asym ? 256 : 128) : 0; }
static int64_t per_super(const qformat *f) { return f->super ? f->super : 1; }

/* Where block b of a panel starts, and its superblock's header. */
static int64_t block_offset(const qformat *f, int64_t b) {
    int64_t s = per_super(f);
    return b / s * (header_bytes(f) + s * block_bytes(f)) + header_bytes(f) + b % s * block_bytes(f);
}
static int64_t header_offset(const qformat *f, int64_t b) {
    int64_t s = per_super(f);
    return b / s * (header_bytes(f) + s * block_bytes(f));
}
static int64_t panel_bytes(const qformat *f, int64_t K) { return block_offset(f, K / f->wb); }

/* 0 where K fits the format (a whole number of superblocks), and the format is known. */
int qblocks_takes(int fmt, int64_t K) {
    if (fmt < 0 || fmt >= NFORMATS)
        return 0;
    const qformat *f = &FORMATS[fmt];
    return K > 0 && K % (f->wb * per_super(f)) == 0 && K % QB == 0;
}

int64_t qblocks_packed_size(int fmt, int64_t N, int64_t K) {
    return (N + QNR - 1) / QNR * panel_bytes(&FORMATS[fmt], K);
}

static __attribute__((unused)) float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else {  /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The weights' u [N, K] (one byte each) and scales into panels. s, m: fp16 [N, K / wb] (formats without
 * superblocks; m only where asym), or d, dmin: fp32 [N, K / 256] and sc, mn: bytes [N, K / wb] (K-quants). */
void pack_qblocks(int fmt, const uint8_t *u, int64_t N, int64_t K, const void *s, const void *m, const uint8_t *sc,
                  const uint8_t *mn, uint8_t *out, int num_threads) {
    const qformat *f = &FORMATS[fmt];
    int64_t nbw = K / f->wb, panels = (N + QNR - 1) / QNR, pb = panel_bytes(f, K);
    int64_t nsup = nbw / per_super(f);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *panel = out + p * pb;
        memset(panel, 0, (size_t)pb);
        for (int64_t b = 0; b < nbw; b++) {
            uint8_t *blk = panel + block_offset(f, b), *scales = blk + quant_bytes(f);
            if (f->super && b % f->super == 0) {
                float *head = (float *)(panel + header_offset(f, b));
                for (int j = 0; j < QNR; j++) {
                    int64_t n = p * QNR + j;
                    head[j] = n < N ? ((const float *)s)[n * nsup + b / f->super] : 0.0f;
                    if (f->asym)
                        head[QNR + j] = n < N ? ((const float *)m)[n * nsup + b / f->super] : 0.0f;
                }
            }
            for (int j = 0; j < QNR; j++) {
                int64_t n = p * QNR + j;
                if (n >= N)
                    continue;  /* zero rows: u = 0, s = m = 0 */
                if (f->super) {
                    scales[j] = sc[n * nbw + b];
                    if (f->asym)
                        scales[QNR + j] = mn[n * nbw + b];
                } else {
                    memcpy(scales + 2 * j, (const uint16_t *)s + n * nbw + b, 2);
                    if (f->asym)
                        memcpy(scales + 2 * QNR + 2 * j, (const uint16_t *)m + n * nbw + b, 2);
                }
                for (int64_t g = 0; g < f->wb / 4; g++) {
                    uint8_t *grp = blk + g * group_bytes(f);
                    for (int t = 0; t < 4; t++) {
                        uint8_t v = u[n * K + b * f->wb + g * 4 + t];
                        int i = (j % 16) * 4 + t, high = j >= 16;  /* byte i of w0 (outputs 0-15) or w1 */
                        if (f->bits == 8)
                            grp[high * 64 + i] = v;
                        else {
                            grp[i] |= (uint8_t)((v & 0x0f) << (4 * high));
                            if (f->bits == 6)  /* byte i % 32: w0[i] bits 0-1 (i < 32) or 2-3, w1 4-5 or 6-7 */
                                grp[64 + i % 32] |= (uint8_t)((v >> 4) << (4 * high + 2 * (i >= 32)));
                        }
                    }
                }
            }
        }
    }
}

/* The scales of block b (of a panel) for its 32 outputs, as float32: s, and m where the format stores one. */
static __attribute__((unused)) void block_scales(const qformat *f, const uint8_t *panel, int64_t b, float *s,
                                                 float *m) {
    const uint8_t *scales = panel + block_offset(f, b) + quant_bytes(f);
    const float *head = (const float *)(panel + header_offset(f, b));
    for (int j = 0; j < QNR; j++) {
        if (f->super) {
            s[j] = head[j] * (f->sc_signed ? (float)(int8_t)scales[j] : (float)scales[j]);
            m[j] = f->asym ? 0.0f - head[QNR + j] * (float)scales[QNR + j] : 0.0f;
        } else {
            uint16_t h;
            memcpy(&h, scales + 2 * j, 2);
            s[j] = f16_to_f32(h);
            memcpy(&h, scales + 2 * QNR + 2 * j, 2);
            m[j] = f->asym ? f16_to_f32(h) : 0.0f;
        }
    }
}

/* One row of x (float32 or bfloat16, K a multiple of 32) -> p int8 [K], and per block of wb: dx, and the
 * sum of p over the block. dx = max|x| / 127 over each block of 32 (1 for zeros), p = round-half-even(x / dx),
 * as qgemm.c. */
static void quantize_x(const void *x, int dtype, int64_t K, int wb, int8_t *p, float *dx, int32_t *psum) {
    for (int64_t b = 0; b < K / QB; b++) {
        int32_t sums[2];
        float d = quantize_block32(x, b * QB, dtype, p + b * QB, sums);
        if (wb == QB) {
            dx[b] = d;
            psum[b] = sums[0] + sums[1];
        } else {  /* blocks of 16 */
            dx[2 * b] = dx[2 * b + 1] = d;
            psum[2 * b] = sums[0];
            psum[2 * b + 1] = sums[1];
        }
    }
}

/* A tile: mr rows of quantized x (p [mr][K], dx and psum [mr][nbw]) against one panel, into out [mr][QNR]. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QMR_MAX 6

int qblocks_vnni(void) { return 1; }

static inline __m512 load_scale_vec(const qformat *f, const uint8_t *scales, const float *head, int half,
                                    __m512 *m) {
    if (f->super) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(scales + 16 * half));
        __m512 sc = _mm512_cvtepi32_ps(f->sc_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
        if (f->asym) {
            __m128i rawm = _mm_loadu_si128((const __m128i *)(scales + QNR + 16 * half));
            __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(rawm));
            *m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_loadu_ps(head + QNR + 16 * half), mn));
        }
        return _mm512_mul_ps(_mm512_loadu_ps(head + 16 * half), sc);
    }
    if (f->asym)
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 2 * QNR + 32 * half)));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32 * half)));
}

static inline void unpack_group(int bits, const uint8_t *g, __m512i *w0, __m512i *w1) {
    if (bits == 8) {
        *w0 = _mm512_loadu_si512(g);
        *w1 = _mm512_loadu_si512(g + 64);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i v = _mm512_loadu_si512(g);
    *w0 = _mm512_and_si512(v, low);
    *w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (bits == 6) {
        const __m512i three = _mm512_set1_epi8(3);
        __m256i h = _mm256_loadu_si256((const __m256i *)(g + 64));
        __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
        /* bytes 0-31 of w0 take bits 0-1, 32-63 bits 2-3; of w1, bits 4-5 and 6-7 */
        __m512i shift0 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
        __m512i shift1 = _mm512_add_epi16(shift0, _mm512_set1_epi16(4));
        __m512i h0 = _mm512_and_si512(_mm512_srlv_epi16(hh, shift0), three);
        __m512i h1 = _mm512_and_si512(_mm512_srlv_epi16(hh, shift1), three);
        *w0 = _mm512_or_si512(*w0, _mm512_slli_epi16(h0, 4));
        *w1 = _mm512_or_si512(*w1, _mm512_slli_epi16(h1, 4));
    }
}

/* The tile, from the packed panel, or (uq given) from the panel unpack_panel unpacked: sv, mv its scales. */
static inline __attribute__((always_inline)) void qtile_body(const qformat *f, int mr, const int8_t *x, const float *dx,
                                                             const int32_t *psum, int64_t K, const uint8_t *panel,
                                                             const uint8_t *uq, const float *sv, const float *mv,
                                                             float *out) {
    int64_t nbw = K / f->wb;
    __m512 acc_f[QMR_MAX][2];
    for (int r = 0; r < QMR_MAX; r++)
        acc_f[r][0] = acc_f[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbw; b++) {
        const uint8_t *blk = uq ? NULL : panel + block_offset(f, b);
        __m512i acc[QMR_MAX][2];
        for (int r = 0; r < QMR_MAX; r++)
            acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int g = 0; g < f->wb / 4; g++) {
            __m512i w0, w1;
            if (uq) {
                w0 = _mm512_loadu_si512(uq + (b * (f->wb / 4) + g) * 128);
                w1 = _mm512_loadu_si512(uq + (b * (f->wb / 4) + g) * 128 + 64);
            } else
                unpack_group(f->bits, blk + g * group_bytes(f), &w0, &w1);
            for (int r = 0; r < QMR_MAX; r++) {
                if (r >= mr)
                    break;
                int32_t four;
                memcpy(&four, x + r * K + b * f->wb + g * 4, 4);
                __m512i p = _mm512_set1_epi32(four);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, p);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, p);
            }
        }
        __m512 m0 = _mm512_setzero_ps(), m1 = m0, s0, s1;
        if (uq) {
            s0 = _mm512_loadu_ps(sv + b * QNR), s1 = _mm512_loadu_ps(sv + b * QNR + 16);
            m0 = _mm512_loadu_ps(mv + b * QNR), m1 = _mm512_loadu_ps(mv + b * QNR + 16);
        } else {
            const float *head = (const float *)(panel + header_offset(f, b));
            s0 = load_scale_vec(f, blk + quant_bytes(f), head, 0, &m0);
            s1 = load_scale_vec(f, blk + quant_bytes(f), head, 1, &m1);
        }
        for (int r = 0; r < QMR_MAX; r++) {
            if (r >= mr)
                break;
            __m512 d = _mm512_set1_ps(dx[r * nbw + b]);
            int32_t ps = psum[r * nbw + b];
            if (!f->asym) {  /* the zero point out in integers */
                acc[r][0] = _mm512_sub_epi32(acc[r][0], _mm512_set1_epi32(f->zero * ps));
                acc[r][1] = _mm512_sub_epi32(acc[r][1], _mm512_set1_epi32(f->zero * ps));
            }
            acc_f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s0, d), acc_f[r][0]);
            acc_f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(s1, d), acc_f[r][1]);
            if (f->asym) {
                __m512 dp = _mm512_set1_ps(dx[r * nbw + b] * (float)ps);
                acc_f[r][0] = _mm512_fmadd_ps(m0, dp, acc_f[r][0]);
                acc_f[r][1] = _mm512_fmadd_ps(m1, dp, acc_f[r][1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out + r * QNR, acc_f[r][0]);
        _mm512_storeu_ps(out + r * QNR + 16, acc_f[r][1]);
    }
}

/* A panel unpacked once, for the several row tiles of a step: its quants as 8-bit groups (128 bytes a group of
 * 4 k, as Q8_0's), its scales as float32 [nbw][32] (s; m where the format has one). The tiles then read it as
 * Q8_0's and do the same arithmetic, so either way gives the same bits. */
static void unpack_panel(const qformat *f, const uint8_t *panel, int64_t K, uint8_t *uq, float *s, float *m) {
    for (int64_t b = 0; b < K / f->wb; b++) {
        const uint8_t *blk = panel + block_offset(f, b);
        for (int g = 0; g < f->wb / 4; g++) {
            __m512i w0, w1;
            unpack_group(f->bits, blk + g * group_bytes(f), &w0, &w1);
            _mm512_storeu_si512(uq + (b * (f->wb / 4) + g) * 128, w0);
            _mm512_storeu_si512(uq + (b * (f->wb / 4) + g) * 128 + 64, w1);
        }
        const float *head = (const float *)(panel + header_offset(f, b));
        for (int half = 0; half < 2; half++) {
            __m512 mh = _mm512_setzero_ps();
            _mm512_storeu_ps(s + b * QNR + 16 * half, load_scale_vec(f, blk + quant_bytes(f), head, half, &mh));
            _mm512_storeu_ps(m + b * QNR + 16 * half, mh);
        }
    }
}

#define QB_UNPACK 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* 256 bits (idot.h): the panel's 32 outputs as four quarters of 8, one int32 accumulator a row per quarter (16
 * registers: 6 rows fit), the float32 ones in memory. Quarter q of a group is bytes 32 q to 32 q + 31 of an
 * 8-bit group; of a 4-bit one, the low (q < 2) or high nibbles of bytes 32 (q % 2) on; a 6-bit one adds bits
 * 2 q and 2 q + 1 of its 32 high-bit bytes. */
#include "idot.h"
#define QMR_MAX 6

int qblocks_vnni(void) { return 0; }

static inline __m256i unpack_quarter(int bits, const uint8_t *g, int q) {
    if (bits == 8)
        return _mm256_loadu_si256((const __m256i *)(g + 32 * q));
    __m256i v = _mm256_loadu_si256((const __m256i *)(g + 32 * (q & 1)));
    __m256i w = _mm256_and_si256(q >= 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    if (bits == 6) {
        __m256i h = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(g + 64)), _mm_cvtsi32_si128(2 * q));
        w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(3)), 4));
    }
    return w;
}

/* Quarter q's scales s (returned) and m, as load_scale_vec's. */
static inline __m256 quarter_scales(const qformat *f, const uint8_t *scales, const float *head, int q, __m256 *m) {
    if (f->super) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(scales + 8 * q));
        __m256 sc = _mm256_cvtepi32_ps(f->sc_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
        if (f->asym) {
            __m128i rawm = _mm_loadl_epi64((const __m128i *)(scales + QNR + 8 * q));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(rawm));
            *m = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_loadu_ps(head + QNR + 8 * q), mn));
        }
        return _mm256_mul_ps(_mm256_loadu_ps(head + 8 * q), sc);
    }
    if (f->asym)
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * QNR + 16 * q)));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * q)));
}

static inline __attribute__((always_inline)) void qtile_body(const qformat *f, int mr, const int8_t *x, const float *dx,
                                                             const int32_t *psum, int64_t K, const uint8_t *panel,
                                                             const uint8_t *uq, const float *sv, const float *mv,
                                                             float *out) {
    int64_t nbw = K / f->wb;
    /* 8-bit weights (never unpacked) through idot_u8; its sum is of u - 128 where IDOT_U8_OFFSET is 0 */
    int zero = f->bits == 8 && !IDOT_U8_OFFSET ? 0 : f->zero;
    __m256 acc_f[QMR_MAX][4];
    for (int r = 0; r < QMR_MAX; r++)
        for (int q = 0; q < 4; q++)
            acc_f[r][q] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbw; b++) {
        const uint8_t *blk = uq ? NULL : panel + block_offset(f, b);
        const float *head = uq ? NULL : (const float *)(panel + header_offset(f, b));
        for (int q = 0; q < 4; q++) {
            __m256i acc[QMR_MAX];
            for (int r = 0; r < QMR_MAX; r++)
                acc[r] = _mm256_setzero_si256();
            for (int g = 0; g < f->wb / 4; g++) {
                __m256i w = uq ? _mm256_loadu_si256((const __m256i *)(uq + (b * (f->wb / 4) + g) * 128 + 32 * q))
                               : unpack_quarter(f->bits, blk + g * group_bytes(f), q);
                for (int r = 0; r < mr; r++) {
                    int32_t four;
                    memcpy(&four, x + r * K + b * f->wb + g * 4, 4);
                    __m256i p = _mm256_set1_epi32(four);
                    acc[r] = f->bits == 8 ? idot_u8(acc[r], w, p) : idot_small(acc[r], w, p);
                }
            }
            __m256 s, m = _mm256_setzero_ps();
            if (uq) {
                s = _mm256_loadu_ps(sv + b * QNR + 8 * q);
                m = _mm256_loadu_ps(mv + b * QNR + 8 * q);
            } else
                s = quarter_scales(f, blk + quant_bytes(f), head, q, &m);
            for (int r = 0; r < mr; r++) {
                __m256 d = _mm256_set1_ps(dx[r * nbw + b]);
                int32_t ps = psum[r * nbw + b];
                if (!f->asym)
                    acc[r] = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(zero * ps));
                acc_f[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(s, d), acc_f[r][q]);
                if (f->asym)
                    acc_f[r][q] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx[r * nbw + b] * (float)ps), acc_f[r][q]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++)
            _mm256_storeu_ps(out + r * QNR + 8 * q, acc_f[r][q]);
}

static void unpack_panel(const qformat *f, const uint8_t *panel, int64_t K, uint8_t *uq, float *s, float *m) {
    for (int64_t b = 0; b < K / f->wb; b++) {
        const uint8_t *blk = panel + block_offset(f, b);
        const float *head = (const float *)(panel + header_offset(f, b));
        for (int q = 0; q < 4; q++) {
            for (int g = 0; g < f->wb / 4; g++)
                _mm256_storeu_si256((__m256i *)(uq + (b * (f->wb / 4) + g) * 128 + 32 * q),
                                    unpack_quarter(f->bits, blk + g * group_bytes(f), q));
            __m256 mq = _mm256_setzero_ps();
            _mm256_storeu_ps(s + b * QNR + 8 * q, quarter_scales(f, blk + quant_bytes(f), head, q, &mq));
            _mm256_storeu_ps(m + b * QNR + 8 * q, mq);
        }
    }
}
#define QB_UNPACK 1
#else
#define QMR_MAX 6

int qblocks_vnni(void) { return 0; }
#define QB_UNPACK 0

/* The same math in plain C: u of a group's byte i (outputs j = i / 4 % 16 + 16 * high, k = i % 4). */
static inline int quant_at(const qformat *f, const uint8_t *g, int high, int i) {
    if (f->bits == 8)
        return g[high * 64 + i];
    int v = (g[i] >> (4 * high)) & 0x0f;
    if (f->bits == 6)
        v |= ((g[64 + i % 32] >> (4 * high + 2 * (i >= 32))) & 3) << 4;
    return v;
}

static void qbtile(int fmt, int64_t mr, const int8_t *x, const float *dx, const int32_t *psum, int64_t K,
                   const uint8_t *panel, float *out) {
    const qformat *f = &FORMATS[fmt];
    int64_t nbw = K / f->wb;
    float acc_f[QMR_MAX][QNR] = {{0}};
    for (int64_t b = 0; b < nbw; b++) {
        const uint8_t *blk = panel + block_offset(f, b);
        uint8_t u[QNR][QB];  /* [output][k in block] */
        for (int g = 0; g < f->wb / 4; g++)
            for (int high = 0; high < 2; high++)
                for (int i = 0; i < 64; i++)
                    u[i / 4 + 16 * high][g * 4 + i % 4] = (uint8_t)quant_at(f, blk + g * group_bytes(f), high, i);
        float s[QNR], m[QNR];
        block_scales(f, panel, b, s, m);
        for (int64_t r = 0; r < mr; r++) {
            const int8_t *xr = x + r * K + b * f->wb;
            float d = dx[r * nbw + b];
            int32_t ps = psum[r * nbw + b];
            for (int j = 0; j < QNR; j++) {
                int32_t dot = 0;
                for (int t = 0; t < f->wb; t++)
                    dot += (int32_t)u[j][t] * xr[t];
                if (!f->asym)
                    dot -= f->zero * ps;
                float sd = s[j] * d;
                acc_f[r][j] = fmaf((float)dot, sd, acc_f[r][j]);
                if (f->asym)
                    acc_f[r][j] = fmaf(m[j], d * (float)ps, acc_f[r][j]);
            }
        }
    }
    for (int64_t r = 0; r < mr; r++)
        memcpy(out + r * QNR, acc_f[r], sizeof acc_f[r]);
}
#endif

#if QB_UNPACK
/* One function per format and row count, the format's constants folded in. */
#define QBT(F, MR) \
    static void qbt_##F##_##MR(const int8_t *x, const float *dx, const int32_t *psum, int64_t K, \
                               const uint8_t *panel, float *out) { \
        qtile_body(&FORMATS[F], MR, x, dx, psum, K, panel, NULL, NULL, NULL, out); }
#define QBT_ROWS(F) QBT(F, 1) QBT(F, 2) QBT(F, 3) QBT(F, 4) QBT(F, 5) QBT(F, 6)
QBT_ROWS(0) QBT_ROWS(1) QBT_ROWS(2) QBT_ROWS(3) QBT_ROWS(4)
typedef void (*qbt_fn)(const int8_t *, const float *, const int32_t *, int64_t, const uint8_t *, float *);
#define QBT_TABLE(F) {0, qbt_##F##_1, qbt_##F##_2, qbt_##F##_3, qbt_##F##_4, qbt_##F##_5, qbt_##F##_6}
static const qbt_fn QBTILES[][QMR_MAX + 1] = {QBT_TABLE(0), QBT_TABLE(1), QBT_TABLE(2), QBT_TABLE(3), QBT_TABLE(4)};

static void qbtile(int fmt, int64_t mr, const int8_t *x, const float *dx, const int32_t *psum, int64_t K,
                   const uint8_t *panel, float *out) {
    QBTILES[fmt][mr](x, dx, psum, K, panel, out);
}

#define QBU(F, MR) \
    static void qbu_##F##_##MR(const int8_t *x, const float *dx, const int32_t *psum, int64_t K, const uint8_t *uq, \
                               const float *sv, const float *mv, float *out) { \
        qtile_body(&FORMATS[F], MR, x, dx, psum, K, NULL, uq, sv, mv, out); }
#define QBU_ROWS(F) QBU(F, 1) QBU(F, 2) QBU(F, 3) QBU(F, 4) QBU(F, 5) QBU(F, 6)
QBU_ROWS(0) QBU_ROWS(1) QBU_ROWS(2) QBU_ROWS(3) QBU_ROWS(4)
typedef void (*qbu_fn)(const int8_t *, const float *, const int32_t *, int64_t, const uint8_t *, const float *,
                       const float *, float *);
#define QBU_TABLE(F) {0, qbu_##F##_1, qbu_##F##_2, qbu_##F##_3, qbu_##F##_4, qbu_##F##_5, qbu_##F##_6}
static const qbu_fn QBUTILES[][QMR_MAX + 1] = {QBU_TABLE(0), QBU_TABLE(1), QBU_TABLE(2), QBU_TABLE(3), QBU_TABLE(4)};
#endif

/* y [M, N] (dtype: 0 float32, 1 bfloat16; rows ldy apart, so a fused layer's parts write their own columns) =
 * x [M, K] (same dtype) times the packed weights' transpose, plus bias [N] float32 (or NULL), rounded to
 * bfloat16 to nearest even as torch does. */
void qblocks_linear(int fmt, const void *x, int64_t M, int64_t K, int dtype, const uint8_t *packed, int64_t N,
                    const float *bias, void *y, int64_t ldy, int num_threads) {
    if (M <= 0 || N <= 0)
        return;
    const qformat *f = &FORMATS[fmt];
    int64_t nbw = K / f->wb, panels = (N + QNR - 1) / QNR, pb = panel_bytes(f, K);
    size_t elem = dtype ? 2 : 4;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc((size_t)(M * nbw) * sizeof(float));
    int32_t *psum = malloc((size_t)(M * nbw) * sizeof(int32_t));
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t m = 0; m < M; m++)
        quantize_x((const char *)x + m * K * elem, dtype, K, f->wb, xq + m * K, dx + m * nbw, psum + m * nbw);
    int64_t groups = (M + QMR_MAX - 1) / QMR_MAX;  /* row tiles, balanced: 37 rows are 6 + 6 + 5 x 5, not 6 x 6 + 1 */
    /* Several row tiles: each panel unpacked once for all of them, where its unpacking costs more than the copy
     * (6 bits: from 2 tiles; 4 bits: from 16; never 8 bits: measured per layer of the 1B shape, BENCHMARKS.md) */
    int unpack = QB_UNPACK && (f->bits == 6 ? groups > 1 : f->bits == 4 ? groups >= 16 : 0);
    #pragma omp parallel num_threads(num_threads)
    {
        uint8_t *uq = unpack ? malloc((size_t)(K * QNR)) : NULL;
        float *sv = unpack ? malloc((size_t)(2 * nbw * QNR) * sizeof(float)) : NULL;
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            float acc[QMR_MAX * QNR];
            int ncols = (int)(N - p * QNR < QNR ? N - p * QNR : QNR);
#if QB_UNPACK
            if (unpack)
                unpack_panel(f, packed + p * pb, K, uq, sv, sv + nbw * QNR);
#endif
            for (int64_t t = 0, r0 = 0, mr; t < groups; t++, r0 += mr) {
                mr = M / groups + (t < M % groups);
#if QB_UNPACK
                if (unpack)
                    QBUTILES[fmt][mr](xq + r0 * K, dx + r0 * nbw, psum + r0 * nbw, K, uq, sv, sv + nbw * QNR, acc);
                else
#endif
                    qbtile(fmt, mr, xq + r0 * K, dx + r0 * nbw, psum + r0 * nbw, K, packed + p * pb, acc);
                for (int64_t r = 0; r < mr; r++)
                    store_panel_row(acc + r * QNR, ncols, NULL, bias ? bias + p * QNR : NULL,
                                    (char *)y + ((r0 + r) * ldy + p * QNR) * elem, dtype);
            }
        }
        free(uq);
        free(sv);
    }
    free(xq);
    free(dx);
    free(psum);
}
