/*
 * bfloat16 linear layers on AMX tiles (Intel Sapphire Rapids and later): y = x W^T (+ b), and the MLP's
 * silu(x Wg^T) * (x Wu^T), float32 sums rounded to bfloat16 once, as gemm.c's bfloat16 layers and
 * oneDNN's do.
 *
 * One TDPBF16PS multiplies a 16 x 32 tile of x by a 32 x 16 tile of W (16 x 16 x 32 products) into a
 * 16 x 16 float32 tile: 16 times the work of an AVX512-BF16 instruction. The kernel holds a 32 x 32 block
 * of outputs in four tiles (two tiles of 16 rows of x against two blocks of 16 columns of W), and for
 * each 32 values of k loads the two x tiles and the two W tiles once (8 tiles: all the machine has).
 *
 * Layout: W [N, K] is packed once into blocks of 16 output columns, [ceil(N/16)][Kp/2][16][2] with Kp =
 * K rounded up to 32 (zeros past K and past N): for each pair of k, a column's two weights side by side,
 * so that a tile of 16 pairs of k is 16 rows of 64 bytes, contiguous. A block streams from memory in one
 * run. x is copied, per group of rows that fits L2 with its sums, into tiles of 16 rows x 32 values,
 * zero-padded past K and past the last row (read in place, rows K values apart alias in L1).
 *
 * Threads split units of two column blocks, or, past one L2 group of rows, the rows (each thread then walks
 * every unit in the same order, and a unit's weights come from memory about once for both). For each group
 * of rows a thread takes its units four at a time: each unit walks k in chunks whose weights stay in L1
 * while the group's rows pass; the four units' outputs (rounding, bias, SiLU) are written a row at a time
 * between the tile products of the next four, where the vector ports are otherwise idle. Linux gives a process the tiles' state
 * only when asked (arch_prctl ARCH_REQ_XCOMP_PERM); amx_available() asks once and says whether it was
 * granted, and is 0 where the library was built without AMX: the callers keep the other bfloat16 paths.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_available(void) {
    static int state = -1; /* asked once; a race between two first callers asks twice, harmlessly */
    if (state < 0) {
        unsigned long mask = 0;
        __builtin_cpu_init();
        state = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")
                && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
                && syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) == 0
                && (mask & (1UL << XFEATURE_XTILEDATA));
    }
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles: 0, 1 sums of rows 0-15 against blocks b0, b1; 2, 3 the same for rows 16-31; 4, 5 x's two
 * row tiles; 6, 7 the weight tiles. Always 16 rows: x's tiles are copied, zero-padded to 32 rows. */
static void configure(int m0, int m1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline int64_t padded_k(int64_t K) { return (K + 31) / 32 * 32; }

/* Elements of the packed form of an [N, K] weight. */
int64_t amx_packed_size(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * padded_k(K); }

void pack_linear_amx(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int num_threads) {
    int64_t Kp = padded_k(K), blocks = (N + 15) / 16;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t kp = 0; kp < Kp / 2; kp++)
            for (int j = 0; j < 16; j++)
                for (int t = 0; t < 2; t++) {
                    int64_t n = b * 16 + j, k = 2 * kp + t;
                    out[(b * (Kp / 2) + kp) * 32 + 2 * j + t] = n < N && k < K ? w[n * K + k] : 0;
                }
}

/*
 * Rows x[0 .. rows) (row stride K) copied into tiles: [rows / 32 groups][Kp / 32][2][16][32], zeros past K
 * and past `rows` (a tile's rows are then 64 bytes apart: read in place, rows K values apart alias in L1
 * once K is a multiple of 2,048 and ran at 0.6x). Into a buffer of this thread's, grown as needed.
 */
static const uint16_t *tiles_of(const uint16_t *x, int64_t K, int64_t rows) {
    static __thread uint16_t *buffer;
    static __thread size_t capacity;
    int64_t Kp = padded_k(K), groups = (rows + 31) / 32;
    size_t need = (size_t)(groups * 32 * Kp);
    if (need > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, need * sizeof *buffer);
        capacity = buffer ? need : 0;
        if (!buffer)
            return 0;
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kb = 0; kb < Kp / 32; kb++)
            for (int h = 0; h < 2; h++) {
                uint16_t *tile = buffer + ((g * (Kp / 32) + kb) * 2 + h) * 512;
                for (int r = 0; r < 16; r++) {
                    int64_t row = g * 32 + h * 16 + r, k0 = kb * 32, n = K - k0 < 32 ? K - k0 : 32;
                    if (row < rows) {
                        memcpy(tile + r * 32, x + row * K + k0, (size_t)n * sizeof *tile);
                        if (n < 32)
                            memset(tile + r * 32 + n, 0, (size_t)(32 - n) * sizeof *tile);
                    } else {
                        memset(tile + r * 32, 0, 32 * sizeof *tile);
                    }
                }
            }
    return buffer;
}

/* Rounds n (<= 16) float32 sums (+ bias, bfloat16) to bfloat16 at out. */
static inline void round_out(const float *sums, const uint16_t *bias, uint16_t *out, int n) {
    if (n == 16 && !bias) {
        vstore(out, 0, vload_f32(sums), 1);
        return;
    }
    for (int j = 0; j < n; j++)
        out[j] = f32_to_bf16(bias ? sums[j] + bf16_to_f32(bias[j]) : sums[j]);
}

/* n (<= 16) outputs of the gated layer from a unit's float32 sums (gate's 16, then up's 16): each rounded to
 * bfloat16 as the plain layer rounds it, then silu_mul_span's math on the rounded values, in registers (the
 * same bits as rounding both to memory and calling silu_mul_span: its loads only widen what was rounded). */
static inline void silu_out(const float *sums, uint16_t *out, int n, uint16_t *spare) {
    const vf y = vsilu_mul(vround_to(vload_f32(sums), 1), vround_to(vload_f32(sums + 16), 1), 1);
    vstore(n == 16 ? out : spare, 0, y, 1);
    if (n < 16)
        memcpy(out, spare, (size_t)n * sizeof *out);
}

/*
 * The outputs of the last group of units, written while the next units' tile products run: a TDPBF16PS
 * takes 16 cycles of the tile unit and none of the vector ports, so a k step's four leave the vector ports
 * idle for ~64 cycles, and the epilogue (rounding, bias, the gated layer's SiLU: 30-35 cycles a vector) fits
 * in that shadow when issued a row at a time between them. Written in one piece after the products, it was
 * half of a gated call at K = 576. The units' sums are kept in two buffers, the pending one and the one
 * being summed.
 */
typedef struct {
    const float *sums; /* [units][group][32] */
    const uint16_t *bias;
    uint16_t *y;       /* row 0 of the group */
    int64_t rows, next, u0, u1, group, N, blocks, every, count;
    int silu;
} pending;

static inline void write_row(const pending *p, int64_t r) {
    uint16_t *out = p->y + r * p->N, spare[16];
    for (int64_t u = p->u0; u < p->u1; u++) {
        const float *c = p->sums + ((u - p->u0) * p->group + r) * 32;
        if (p->silu) {
            int n = p->N - u * 16 < 16 ? (int)(p->N - u * 16) : 16;
            silu_out(c, out + u * 16, n, spare);
        } else {
            for (int h = 0; h < 2 && 2 * u + h < p->blocks; h++) {
                int64_t col = (2 * u + h) * 16;
                int n = p->N - col < 16 ? (int)(p->N - col) : 16;
                round_out(c + 16 * h, p->bias ? p->bias + col : 0, out + col, n);
            }
        }
    }
}

/* One k step's share of the pending rows: a row every `every` steps. */
static inline void pending_step(pending *p) {
    if (p->next < p->rows && ++p->count >= p->every) {
        p->count = 0;
        write_row(p, p->next++);
    }
}

static void pending_finish(pending *p) {
    while (p->next < p->rows)
        write_row(p, p->next++);
}

/* c [32][32] float32 (+)= 32 rows in tiles (tiles_of: [Kp / 32][2][16][32]) times blocks b0 and b1 (each
 * [Kp/2][16][2]) over the k blocks [k0, k1); from zero where `first`, else on the sums in c. two: the
 * second 16 rows hold any rows (else only the first 16 are computed). Each k step also writes its share of
 * the pending outputs. */
static void block_product(const uint16_t *a, int64_t k0, int64_t k1, int two, const uint16_t *b0,
                          const uint16_t *b1, float *c, int first, pending *p) {
    if (first) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, c, 128);
        _tile_loadd(1, c + 16, 128);
        _tile_loadd(2, c + 16 * 32, 128);
        _tile_loadd(3, c + 16 * 32 + 16, 128);
    }
    if (two) {
        for (int64_t kb = k0; kb < k1; kb++) {
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(4, a + kb * 1024, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + kb * 1024 + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            pending_step(p);
        }
    } else {
        for (int64_t kb = k0; kb < k1; kb++) {
            _tile_loadd(4, a + kb * 1024, 64);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            pending_step(p);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
}

/*
 * The driver of both layers. Threads split units of two column blocks (the next block of the same weight
 * for a plain layer; the same block of the gate and of the up weight for the gated one). A thread takes
 * its rows in groups whose tiles stay in L2 (~1 MB), and for each unit walks k in chunks of KCHUNK blocks
 * (the unit's weights of a chunk, 32 KB, stay in L1 while every 32 rows of the group pass), the sums of
 * the group kept in c between chunks. silu: the gated layer's epilogue.
 */
#define KCHUNK 16
#ifndef UNITS
#define UNITS 4 /* units whose sums a group keeps before writing its rows out */
#endif

static void run_blocks(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                       const uint16_t *bias, uint16_t *y, int num_threads, int silu) {
    if (M <= 0 || N <= 0)
        return;
    int64_t Kp = padded_k(K), kblocks = Kp / 32, block = Kp * 16, blocks = (N + 15) / 16;
    int64_t units = silu ? blocks : (blocks + 1) / 2;
    int64_t chunks = (kblocks + KCHUNK - 1) / KCHUNK, chunk = (kblocks + chunks - 1) / chunks;
    /* rows of a group: their tiles and two sets of sums of UNITS units within ~1.25 MB of L2 */
    int64_t group = (5 << 18) / (Kp * 2 + 2 * UNITS * 32 * 4) / 32 * 32;
    group = group < 32 ? 32 : group;
    /* More rows than a group: the threads split the rows (each walks every unit, in the same order, so that
     * a unit's weights come from memory about once for all of them and the other thread finds them in L3);
     * else the columns. Groups balanced: as few as the rows need, of equal size. */
    const int row_split = M > group && M >= 128 * num_threads && num_threads > 1;
    const int64_t parts = row_split ? num_threads : 1, per_part = (M + parts - 1) / parts;
    const int64_t ngroups = (per_part + group - 1) / group;
    group = ((per_part + ngroups - 1) / ngroups + 31) / 32 * 32;
    #pragma omp parallel num_threads(num_threads)
    {
        static __thread float *sums;
        static __thread int64_t sums_size;
        int nt = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = row_split ? 0 : units * me / nt, last = row_split ? units : units * (me + 1) / nt;
        int64_t row0 = row_split ? per_part * me : 0, row1 = row_split ? per_part * (me + 1) : M;
        int64_t size = 2 * UNITS * group * 32, quad = 0;
        pending p = {0};
        row1 = row1 < M ? row1 : M;
        if (sums_size < size) {
            free(sums);
            sums = aligned_alloc(64, (size_t)size * sizeof *sums);
            sums_size = sums ? size : 0;
        }
        if (first < last && sums)
            configure(16, 16);
        for (int64_t g0 = row0; g0 < row1 && first < last && sums; g0 += group) {
            int64_t rows = row1 - g0 < group ? row1 - g0 : group;
            const uint16_t *a = tiles_of(x + g0 * K, K, rows);
            if (!a)
                break;
            for (int64_t u0 = first; u0 < last; u0 += UNITS, quad++) {
                int64_t u1 = u0 + UNITS < last ? u0 + UNITS : last;
                float *q = sums + (quad & 1) * UNITS * group * 32;
                for (int64_t u = u0; u < u1; u++) {
                    int64_t b0 = silu ? u : 2 * u;
                    int64_t b1 = silu ? blocks + u : (2 * u + 1 < blocks ? 2 * u + 1 : 2 * u);
                    float *s = q + (u - u0) * group * 32;
                    for (int64_t k0 = 0; k0 < kblocks; k0 += chunk) {
                        int64_t k1 = k0 + chunk < kblocks ? k0 + chunk : kblocks;
                        for (int64_t r = 0; r < rows; r += 32)
                            block_product(a + r * Kp, k0, k1, rows - r > 16, packed + b0 * block,
                                          packed + b1 * block, s + r * 32, k0 == 0, &p);
                    }
                }
                /* these units' outputs become the pending ones, a row every `every` k steps of the next
                 * units (each row's units written in one run: row by row and unit by unit, the stores
                 * missed the cache one line at a time, 40 % of a 1,024-row call at N = 3,072) */
                pending_finish(&p);
                int64_t steps = (u1 - u0) * kblocks * ((rows + 31) / 32);
                p = (pending){q, bias, y + g0 * N, rows, 0, u0, u1, group, N, blocks,
                              steps / rows > 1 ? steps / rows : 1, 0, silu};
            }
        }
        pending_finish(&p);
        if (first < last)
            _tile_release();
    }
}

/* y [M, N] = x [M, K] (contiguous rows) times the packed weight (pack_linear_amx), plus bias [N] or NULL. */
void linear_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const uint16_t *bias,
                uint16_t *y, int num_threads) {
    run_blocks(x, M, K, packed, N, bias, y, num_threads, 0);
}

/* out [M, n] = silu(x Wg^T) * (x Wu^T); packed: pack_linear_amx of Wg [n, K], then of Wu [n, K]. */
void linear_silu_mul_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t n, uint16_t *out,
                         int num_threads) {
    run_blocks(x, M, K, packed, n, 0, out, num_threads, 1);
}

/*
 * Prefill attention on AMX tiles, bfloat16: query rows start .. start + n - 1 of one sequence (q, out:
 * [n, num_heads, head_dim], bfloat16), each attending causally to the sequence's blocks in `table` (the
 * chunk's own K/V already written). Plain attention only (no window, softcap or sinks), head_dim 64 or
 * 128, blocks of a multiple of 32 tokens; returns 2 otherwise (the caller keeps the other kernels), 1
 * where a buffer could not be had.
 *
 * Work item: 16 query rows of one head. Pass 1: scores of all visible keys, 16 rows x 32 keys a step
 * (the query tiles stay in tiles; K's tiles load straight from its blocks, whose dims are already in
 * pairs: [head_dim / 2][block_size][2]). Softmax per row in float32: exp(score - max), rounded to
 * bfloat16 for P.V, the sum of the unrounded ones divides the output (as torch's flash kernel does). Pass 2: P.V into 4 tiles of 16 dims (two
 * sweeps at head_dim 128), V of the context first copied once per call into the tiles' pairs of keys
 * ([key pairs][16 dims][2]), zeros past the context (a cache slot never written may hold a NaN).
 */
static inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }

int paged_prefill_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                      int start, int n, uint16_t *out, int num_heads, int num_kv_heads, int head_dim,
                      int block_size, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (!amx_available() || (head_dim != 64 && head_dim != 128) || block_size % 32 != 0
        || group * num_kv_heads != num_heads || n <= 0)
        return 2;
    const int ctx = start + n, steps = (ctx + 31) / 32, ctx_pad = steps * 32, dims = head_dim / 32;
    const int64_t head_stride = (int64_t)block_size * head_dim, block_stride = num_kv_heads * head_stride;
    /* V of every KV head in pairs of keys: [kv_head][step][head_dim / 16][16 pairs][16 dims][2] */
    const int64_t v_step = 32 * (int64_t)head_dim;
    uint16_t *vp = aligned_alloc(64, (size_t)(num_kv_heads * steps * v_step) * sizeof *vp);
    if (!vp)
        return 1;
    int failed = 0;
    const int tiles = (n + 15) / 16;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static) collapse(2)
        for (int kh = 0; kh < num_kv_heads; kh++)
            for (int st = 0; st < steps; st++) {
                uint16_t *dst = vp + (kh * (int64_t)steps + st) * v_step;
                const int key0 = st * 32;
                const uint16_t *src = v_cache + table[key0 / block_size] * block_stride + kh * head_stride
                                      + (int64_t)(key0 % block_size) * head_dim;
                for (int pair = 0; pair < 16; pair++)
                    for (int t = 0; t < 2; t++) {
                        int key = key0 + 2 * pair + t;
                        for (int d = 0; d < head_dim; d++)
                            dst[((d / 16) * 16 + pair) * 32 + (d % 16) * 2 + t] =
                                key < ctx ? src[(int64_t)(2 * pair + t) * head_dim + d] : 0;
                    }
            }
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(16 * ctx_pad + 16 * 128));
        uint16_t *probs = aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * ctx_pad + 16 * 128));
        float *o = scores + 16 * ctx_pad;
        uint16_t *qt = probs + 16 * ctx_pad;
        if (!scores || !probs) {
            #pragma omp atomic write
            failed = 1;
        } else {
            configure(16, 16);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_heads * tiles; item++) {
            if (!scores || !probs)
                continue;
            const int h = item % num_heads, r0 = (tiles - 1 - item / num_heads) * 16; /* longest first */
            const int rows = n - r0 < 16 ? n - r0 : 16, kh = h / group;
            const int visible = start + r0 + rows, last_step = (visible + 31) / 32;
            float inv_sum[16];
            /* the query tile: [dims][16 rows][32], zero rows past n */
            for (int c = 0; c < dims; c++)
                for (int r = 0; r < 16; r++) {
                    uint16_t *row = qt + (c * 16 + r) * 32;
                    if (r < rows)
                        memcpy(row, q + ((int64_t)(r0 + r) * num_heads + h) * head_dim + c * 32, 64);
                    else
                        memset(row, 0, 64);
                }
            for (int st = 0; st < last_step; st++) {
                const int key0 = st * 32;
                const uint16_t *kb = k_cache + table[key0 / block_size] * block_stride + kh * head_stride
                                     + (int64_t)(key0 % block_size) * 2;
                _tile_zero(0);
                _tile_zero(1);
                for (int c = 0; c < dims; c++) {
                    /* 16 pairs of dims (rows block_size * 2 values apart) x 16 keys x 2 */
                    _tile_loadd(4, qt + c * 16 * 32, 64);
                    _tile_loadd(2, kb + (int64_t)c * 16 * block_size * 2, block_size * 4);
                    _tile_loadd(3, kb + (int64_t)c * 16 * block_size * 2 + 32, block_size * 4);
                    _tile_dpbf16ps(0, 4, 2);
                    _tile_dpbf16ps(1, 4, 3);
                }
                _tile_stored(0, scores + key0, ctx_pad * 4);
                _tile_stored(1, scores + key0 + 16, ctx_pad * 4);
            }
            for (int r = 0; r < 16; r++) {
                float *sr = scores + (int64_t)r * ctx_pad;
                uint16_t *pr = probs + (int64_t)r * ctx_pad;
                const int seen = r < rows ? start + r0 + r + 1 : 0; /* keys this row sees */
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int t = 0; t < seen; t += 16) {
                    __mmask16 m = seen - t >= 16 ? 0xffff : (__mmask16)((1u << (seen - t)) - 1);
                    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, sr + t));
                }
                const float top = seen ? hmax(mx) * scale : 0.0f;
                __m512 sum = _mm512_setzero_ps();
                int t = 0;
                for (; t < seen; t += 16) {
                    __mmask16 m = seen - t >= 16 ? 0xffff : (__mmask16)((1u << (seen - t)) - 1);
                    vf x = (vf)_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(sr + t), _mm512_set1_ps(scale)),
                                            _mm512_set1_ps(top));
                    __m512 e = _mm512_maskz_mov_ps(m, (__m512)vexp(x));
                    sum = _mm512_add_ps(sum, e);
                    vstore(pr, t, (vf)e, 1);
                }
                for (; t < last_step * 32; t += 16)
                    memset(pr + t, 0, 32);
                inv_sum[r] = seen ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
            }
            for (int half = 0; half < head_dim / 64; half++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *vh = vp + (int64_t)kh * steps * v_step + half * 4 * 512;
                for (int st = 0; st < last_step; st++) {
                    _tile_loadd(4, probs + st * 32, ctx_pad * 2);
                    const uint16_t *vs = vh + st * v_step;
                    _tile_loadd(5, vs, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, vs + 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, vs + 1024, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, vs + 1536, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, o, 64 * 4);
                _tile_stored(1, o + 16, 64 * 4);
                _tile_stored(2, o + 32, 64 * 4);
                _tile_stored(3, o + 48, 64 * 4);
                for (int r = 0; r < rows; r++)
                    for (int g = 0; g < 4; g++)
                        vstore(out + ((int64_t)(r0 + r) * num_heads + h) * head_dim + half * 64 + g * 16, 0,
                               vload_f32(o + r * 64 + g * 16) * inv_sum[r], 1);
            }
        }
        if (scores && probs)
            _tile_release();
        free(scores);
        free(probs);
    }
    free(vp);
    return failed;
}

#else
int amx_available(void) { return 0; }
int paged_prefill_amx(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                      int start, int n, uint16_t *out, int num_heads, int num_kv_heads, int head_dim,
                      int block_size, float scale, int num_threads) {
    (void)q; (void)k_cache; (void)v_cache; (void)table; (void)start; (void)n; (void)out; (void)num_heads;
    (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)num_threads;
    return 2;
}
int64_t amx_packed_size(int64_t N, int64_t K) { (void)N; (void)K; return 0; }
void pack_linear_amx(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int num_threads) {
    (void)w; (void)N; (void)K; (void)out; (void)num_threads;
}
void linear_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const uint16_t *bias,
                uint16_t *y, int num_threads) {
    (void)x; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)y; (void)num_threads;
}
void linear_silu_mul_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t n, uint16_t *out,
                         int num_threads) {
    (void)x; (void)M; (void)K; (void)packed; (void)n; (void)out; (void)num_threads;
}
#endif
