/* Float vectors of the width the build's instruction set has (GCC vector extensions), and the few
 * helpers the kernel files share.
 *
 * VN, the lanes of a vector, is 16 with AVX-512, 8 with AVX/AVX2, 4 otherwise (SSE2, NEON). The kernels
 * are written in vectors of VN lanes, never wider: GCC lowers a vector wider than the machine's through
 * the stack, lane group by lane group, which made the AVX-512-shaped kernels 7-12x slower on AVX2. */
#ifndef BULKGEN_VEC_H
#define BULKGEN_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VN 16
#elif defined(__AVX__)
#define VN 8
#else
#define VN 4
#endif

typedef float vf __attribute__((vector_size(4 * VN)));
typedef uint32_t vu __attribute__((vector_size(4 * VN)));
typedef int32_t vi __attribute__((vector_size(4 * VN)));
typedef uint16_t vh __attribute__((vector_size(2 * VN)));

/* Keeps a loaded vector in a register: GCC otherwise folds the load into each FMA that uses it, so one K or V
 * vector serving G query heads is loaded G times (on an AMD Zen 4 the loads, not the FMAs, then bound decode
 * attention). An empty asm the vector passes through; no instruction. */
#if defined(BULKGEN_NO_IN_REGISTER)
#define IN_REGISTER(x) ((void)0)
#elif defined(__x86_64__) && defined(__AVX__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#elif defined(__aarch64__)
#define IN_REGISTER(x) __asm__("" : "+w"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

static inline vu bits_of(vf f) { vu u; memcpy(&u, &f, sizeof u); return u; }
static inline vf float_of(vu u) { vf f; memcpy(&f, &u, sizeof f); return f; }

static inline vf vload_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch (c10::BFloat16) does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
/* 16 bfloat16 values to float32 in one vpmovzxwd (GCC lowers the generic widening to four instructions) */
static inline vf widen_bf16(__m256i h) {
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline vf vload_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return widen_bf16(_mm256_loadu_si256((const void *)p));
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return float_of(__builtin_convertvector(h, vu) << 16);
#endif
}

/* exp on VN lanes for x in [-87, 88] (clamped outside): x = n ln2 + r, exp(r) by a degree-6
 * polynomial, 2^n in the exponent bits. Relative error about 2e-7. */
static inline vf vexp(vf x) {
#if defined(__AVX512F__)
    /* the same operations in fewer instructions (the same bits, tested): the clamps as max/min (a NaN
     * becomes 0 as the masks below make it), rounding to an integer in place, 2^n by vscalefps */
    __m512 v = (__m512)x;
    const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    v = _mm512_maskz_mov_ps(ordered, _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
    x = (vf)v;
#else
    x = float_of((bits_of(x) & (vu)(x >= -87.0f)) | (bits_of((vf){0} - 87.0f) & (vu)(x < -87.0f)));
    x = float_of((bits_of(x) & (vu)(x <= 88.0f)) | (bits_of((vf){0} + 88.0f) & (vu)(x > 88.0f)));
#endif
    /* n = x / ln 2 rounded half away from zero (truncating x / ln 2 + copysign(0.5, x)) */
    const vf t = x * 1.44269504088896341f + float_of((bits_of(x) & 0x80000000u) | bits_of((vf){0} + 0.5f));
#if defined(__AVX512F__)
    vf n = (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
#else
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
#endif
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
#if defined(__AVX512F__)
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    return p * float_of((vu)((__builtin_convertvector(n, vi) + 127) << 23));
#endif
}

/* Elements of a tensor in the model's dtype (0 float32, 1 bfloat16), as float32; stores round to it. */
static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float round_to(float f, int dtype) { return dtype == 0 ? f : bf16_to_f32(f32_to_bf16(f)); }

static inline void store(void *p, int64_t i, float f, int dtype) {
    if (dtype == 0) ((float *)p)[i] = f;
    else ((uint16_t *)p)[i] = f32_to_bf16(f);
}

static inline vf vload(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? vload_f32((const float *)p + i) : vload_bf16((const uint16_t *)p + i);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* The CPU's own float32 -> bfloat16 rounding (to nearest even, as torch's). */
static inline vh to_bf16_bits(vf f) {
    __m256bh h = _mm512_cvtneps_pbh((__m512)f);
    vh out;
    memcpy(&out, &h, sizeof out);
    return out;
}
#define HAVE_BF16_ROUNDING 1
#endif

static inline vf vround_to(vf f, int dtype) {
    if (dtype == 0) return f;
#ifdef HAVE_BF16_ROUNDING
    return widen_bf16((__m256i)_mm512_cvtneps_pbh((__m512)f));
#endif
    vu u = bits_of(f);
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return float_of((rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan));
}

static inline void vstore(void *p, int64_t i, vf f, int dtype) {
    if (dtype == 0) { memcpy((float *)p + i, &f, sizeof f); return; }
#ifdef HAVE_BF16_ROUNDING
    vh h = to_bf16_bits(f);
#else
    vh h = __builtin_convertvector(bits_of(vround_to(f, 1)) >> 16, vh);
#endif
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* silu(g) rounded to the dtype, times u: one vector of silu_mul_span (amx.c's gated epilogue uses it too). */
static inline vf vsilu_mul(vf g, vf u, int dtype) { return vround_to(g / (1.0f + vexp(-g)), dtype) * u; }

/* out[i] = to_dtype(to_dtype(silu(gate[i])) * up[i]) for i < n, silu(g) = g / (1 + exp(-g)): torch's
 * F.silu(gate) * up in the dtype. */

static inline void silu_mul_span(const void *gate, const void *up, void *out, int64_t n, int dtype) {
    const int64_t vec_end = n / VN * VN;
    for (int64_t i = 0; i < vec_end; i += VN)
        vstore(out, i, vsilu_mul(vload(gate, i, dtype), vload(up, i, dtype), dtype), dtype);
    for (int64_t i = vec_end; i < n; i++) {
        const float g = load(gate, i, dtype);
        store(out, i, round_to(g / (1.0f + expf(-g)), dtype) * load(up, i, dtype), dtype);
    }
}

/* One block of 32 values of x from element i (dtype as load's) quantized as engine/quant.py's quantize_rows:
 * d = max|x| / 127 (1 for a block of zeros), q = round-half-even(x / d) clamped to [-127, 127]; sums[h] gets the
 * sum of q over half h (16 values). Returns d. The same bits as the scalar math: the division is IEEE's and
 * (r + 1.5 * 2^23) - 1.5 * 2^23 rounds |r| < 2^22 to nearest even. */
typedef int8_t vb __attribute__((vector_size(VN)));
static inline float quantize_block32(const void *x, int64_t i, int dtype, int8_t *q, int32_t sums[2]) {
    vf v[32 / VN], top = {0};
    for (int j = 0; j < 32 / VN; j++) {
        v[j] = vload(x, i + j * VN, dtype);
        vf a = float_of(bits_of(v[j]) & 0x7fffffffu);
        vu more = (vu)(a > top);
        top = float_of((bits_of(a) & more) | (bits_of(top) & ~more));
    }
#if defined(__AVX512F__)
    float amax = _mm512_reduce_max_ps((__m512)top);  /* top holds no NaN: max is exact in any order */
#else
    float amax = 0.0f;
    for (int l = 0; l < VN; l++)
        amax = top[l] > amax ? top[l] : amax;
#endif
    float d = amax / 127.0f;
    if (!(d > 0.0f))
        d = 1.0f;
    vi half[2] = {{0}, {0}};
    for (int j = 0; j < 32 / VN; j++) {
        vf r = (v[j] / d + 12582912.0f) - 12582912.0f;
        vu high = (vu)(r > 127.0f), low = (vu)(r < -127.0f);
        r = float_of((bits_of(r) & ~high & ~low) | (bits_of((vf){0} + 127.0f) & high) | (bits_of((vf){0} - 127.0f) & low));
        vi qi = __builtin_convertvector(r, vi);
        vb qb = __builtin_convertvector(qi, vb);
        memcpy(q + j * VN, &qb, VN);
        half[j * VN / 16] += qi;
    }
    for (int h = 0; h < 2; h++) {
#if defined(__AVX512F__)
        sums[h] = _mm512_reduce_add_epi32((__m512i)half[h]);
#else
        int32_t total = 0;
        for (int l = 0; l < VN; l++)
            total += half[h][l];
        sums[h] = total;
#endif
    }
    return d;
}

/* A row of a panel's 32 outputs (float32 sums; the quantized layers' QNR) to y in its dtype: y = sum * scale +
 * bias (scale, bias: the panel's, each may be NULL), ncols of them (fewer in the last panel). */
static inline void store_panel_row(const float *sum, int ncols, const float *scale, const float *bias, void *y,
                                   int dtype) {
    if (ncols == 32) {
        for (int j = 0; j < 32; j += VN) {
            vf v = vload_f32(sum + j);
            if (scale) v = v * vload_f32(scale + j);
            if (bias) v = v + vload_f32(bias + j);
            vstore(y, j, v, dtype);
        }
        return;
    }
    for (int j = 0; j < ncols; j++)
        store(y, j, sum[j] * (scale ? scale[j] : 1.0f) + (bias ? bias[j] : 0.0f), dtype);
}

#endif
