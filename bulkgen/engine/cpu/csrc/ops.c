/*
 * Small fused operations of the CPU forward pass, each one pass over memory instead of the five or six
 * torch ops (and their allocations) that Hugging Face's modules spend on them. Each reproduces the
 * roundings of the torch code it replaces: intermediate results are rounded to the model's dtype
 * where torch rounds them, so bfloat16 outputs match torch's up to float32 summation order.
 *
 * dtype codes: 0 float32, 1 bfloat16. Rows are contiguous; row strides are in elements.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Llama's RMSNorm: y = w * to_dtype(x * rsqrt(mean(x^2) + eps)), statistics in float32.
 * With `residual` (may be NULL): first x += residual (rounded to the dtype, as torch's add), stored
 * back into x, so that one pass does the residual add and the norm of the next sub-layer. */
void rms_norm(void *x, const void *residual, const void *weight, void *out, int64_t rows, int64_t cols,
              float eps, int dtype, int num_threads) {
    const int64_t vec_end = cols / VN * VN;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * cols;
        if (residual != NULL) {
            for (int64_t i = 0; i < vec_end; i += VN)
                vstore(x, o + i, vload(x, o + i, dtype) + vload(residual, o + i, dtype), dtype);
            for (int64_t i = vec_end; i < cols; i++) store(x, o + i, load(x, o + i, dtype) + load(residual, o + i, dtype), dtype);
        }
        vf partial = {0};
        for (int64_t i = 0; i < vec_end; i += VN) {
            vf v = vload(x, o + i, dtype);
            partial += v * v;
        }
        float sum = 0.0f;
        for (int j = 0; j < VN; j++) sum += partial[j];
        for (int64_t i = vec_end; i < cols; i++) sum += load(x, o + i, dtype) * load(x, o + i, dtype);
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
        for (int64_t i = 0; i < vec_end; i += VN)
            vstore(out, o + i, vload(weight, i, dtype) * vround_to(vload(x, o + i, dtype) * inv, dtype), dtype);
        for (int64_t i = vec_end; i < cols; i++)
            store(out, o + i, load(weight, i, dtype) * round_to(load(x, o + i, dtype) * inv, dtype), dtype);
    }
}

/* SiLU-and-multiply of a fused gate|up projection: gate_up [rows, 2 * cols] -> out [rows, cols]
 * (see silu_mul_span; the C linear layers also apply it as their epilogue, see linear_silu_mul). */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t cols, int dtype, int num_threads) {
    const size_t elem = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols > 4096)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_span((const char *)gate_up + r * 2 * cols * elem, (const char *)gate_up + (r * 2 + 1) * cols * elem,
                      (char *)out + r * cols * elem, cols, dtype);
}

/* Rotary position embedding in place, as Hugging Face's apply_rotary_pos_emb: for the first num_heads
 * heads of each row (q's heads then k's, as they sit in the fused qkv projection),
 * x <- to_dtype(to_dtype(x * cos) + to_dtype(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1).
 * cos, sin: [rows, head_dim]. No fused multiply-adds, so that float32 results equal torch's. */
__attribute__((optimize("fp-contract=off")))
void rope(void *x, int64_t rows, int64_t row_stride, int num_heads, int head_dim, const void *cos,
          const void *sin, int dtype, int num_threads) {
    const int half = head_dim / 2, vec_end = half / VN * VN;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t c0 = r * head_dim;
        for (int h = 0; h < num_heads; h++) {
            const int64_t x0 = r * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < vec_end; i += VN) {
                const vf x1 = vload(x, x0 + i, dtype), x2 = vload(x, x0 + i + half, dtype);
                const vf a = vround_to(x1 * vload(cos, c0 + i, dtype), dtype)
                             + vround_to(-x2 * vload(sin, c0 + i, dtype), dtype);
                const vf b = vround_to(x2 * vload(cos, c0 + i + half, dtype), dtype)
                             + vround_to(x1 * vload(sin, c0 + i + half, dtype), dtype);
                vstore(x, x0 + i, a, dtype);
                vstore(x, x0 + i + half, b, dtype);
            }
            for (int i = vec_end; i < half; i++) {
                const float x1 = load(x, x0 + i, dtype), x2 = load(x, x0 + i + half, dtype);
                const float a = round_to(x1 * load(cos, c0 + i, dtype), dtype)
                              + round_to(-x2 * load(sin, c0 + i, dtype), dtype);
                const float b = round_to(x2 * load(cos, c0 + i + half, dtype), dtype)
                              + round_to(x1 * load(sin, c0 + i + half, dtype), dtype);
                store(x, x0 + i, a, dtype);
                store(x, x0 + i + half, b, dtype);
            }
        }
    }
}

/* Index of the largest value of each float32 row; the first one on ties, as torch.argmax; a NaN, where
 * one is present, counts as the largest (so that callers see broken rows). */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * row_stride;
        float best[16];
        int64_t i = 0;
        for (int j = 0; j < 16; j++) best[j] = -INFINITY;
        int has_nan = 0;
        for (; i + 16 <= cols; i += 16)
            for (int j = 0; j < 16; j++) {
                const float v = xr[i + j];
                has_nan |= v != v;
                best[j] = v > best[j] ? v : best[j];
            }
        float m = -INFINITY;
        for (int j = 0; j < 16; j++) m = best[j] > m ? best[j] : m;
        for (; i < cols; i++) {
            has_nan |= xr[i] != xr[i];
            m = xr[i] > m ? xr[i] : m;
        }
        int64_t index = 0;
        for (i = 0; i < cols; i++)
            if (has_nan ? xr[i] != xr[i] : xr[i] == m) { index = i; break; }
        out[r] = index;
    }
}

/* 1 where this CPU runs every instruction-set extension the library was compiled for, else 0. The
 * library is built with -march=native and cached under a key of the CPU's flags, so a mismatch means a
 * cache shared between machines or copied; the loader then builds its own instead of crashing on an
 * illegal instruction. Compiled for the x86-64 baseline itself, so that asking is always safe. */
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("arch=x86-64")))
int kernel_isa_ok(void) {
    __builtin_cpu_init();
#define NEED(name) if (!__builtin_cpu_supports(name)) return 0
#ifdef __AVX__
    NEED("avx");
#endif
#ifdef __AVX2__
    NEED("avx2");
#endif
#ifdef __FMA__
    NEED("fma");
#endif
#ifdef __AVX512F__
    NEED("avx512f");
#endif
#ifdef __AVX512BW__
    NEED("avx512bw");
#endif
#ifdef __AVX512VL__
    NEED("avx512vl");
#endif
#ifdef __AVX512BF16__
    NEED("avx512bf16");
#endif
#ifdef __AMX_TILE__
    NEED("amx-tile");
#endif
#ifdef __AMX_BF16__
    NEED("amx-bf16");
#endif
#undef NEED
    return 1;
}
#else
int kernel_isa_ok(void) { return 1; }
#endif
