/*
 * The sampler's one pass over the vocabulary (engine/draws.py): for each float32 row of logits, its
 * `cut` best tokens, its largest logit and, where asked, the log of its normaliser at the row's
 * temperature. torch spends a topk, an amax and three passes of exp-and-sum on the same (about 13 + 21 ms
 * for 256 rows of SmolLM2's 49,152 logits on 2 Zen 5 cores); here each row is read twice from cache.
 *
 * The candidates come in one canonical order, by value (descending) then by token id (ascending), so
 * that a row's candidates are the same bits whatever else is in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* A candidate as one integer whose order is the canonical one: the value's bits made monotone (ascending
 * floats to ascending integers) and inverted in the high half, the token id in the low half, so that a
 * smaller key is a better candidate. */
static inline uint64_t key_of(float value, int64_t id) {
    uint32_t u = 0;  // -0 is +0, as torch compares them
    if (value != 0.0f) memcpy(&u, &value, sizeof u);
    const uint32_t ascending = (u & 0x80000000u) ? ~u : u | 0x80000000u;
    return ((uint64_t)~ascending << 32) | (uint32_t)id;
}

static inline float value_of(uint64_t key) {
    const uint32_t ascending = ~(uint32_t)(key >> 32);
    const uint32_t u = (ascending & 0x80000000u) ? ascending & 0x7fffffffu : ~ascending;
    float value;
    memcpy(&value, &u, sizeof value);
    return value;
}

static inline void swap_keys(uint64_t *a, uint64_t *b) {
    const uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Partition c[lo..hi] around a median of three; returns the pivot's final place. */
static int64_t partition(uint64_t *c, int64_t lo, int64_t hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (c[mid] < c[lo]) swap_keys(&c[mid], &c[lo]);
    if (c[hi] < c[lo]) swap_keys(&c[hi], &c[lo]);
    if (c[hi] < c[mid]) swap_keys(&c[hi], &c[mid]);
    swap_keys(&c[mid], &c[hi]);
    const uint64_t pivot = c[hi];
    int64_t store = lo;
    for (int64_t i = lo; i < hi; i++)
        if (c[i] < pivot) swap_keys(&c[i], &c[store++]);
    swap_keys(&c[store], &c[hi]);
    return store;
}

/* Reorder c[0..n) so that its k smallest keys come first, in any order (quickselect; keys are distinct). */
static void keep_smallest(uint64_t *c, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t p = partition(c, lo, hi);
        if (p == k - 1 || p == k) return;
        if (p < k) lo = p + 1;
        else hi = p - 1;
    }
}

static void sort_keys(uint64_t *c, int64_t lo, int64_t hi) {
    while (hi - lo > 16) {
        const int64_t p = partition(c, lo, hi);
        if (p - lo < hi - p) {
            sort_keys(c, lo, p - 1);
            lo = p + 1;
        } else {
            sort_keys(c, p + 1, hi);
            hi = p - 1;
        }
    }
    for (int64_t i = lo + 1; i <= hi; i++) {
        const uint64_t t = c[i];
        int64_t j = i - 1;
        for (; j >= lo && c[j] > t; j--) c[j + 1] = c[j];
        c[j + 1] = t;
    }
}

/* The k-th largest of v[0..n) (reordering v), or -inf where n < k. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    if (n < k) return -INFINITY;
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return v[want];
}

/* The lanes of a comparison that hold, as bits. */
static inline uint32_t lane_bits(vi mask) {
#if defined(__AVX512F__)
    return (uint32_t)_mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
#elif defined(__AVX__)
    return (uint32_t)_mm256_movemask_ps((__m256)mask);
#else
    uint32_t bits = 0;
    for (int j = 0; j < VN; j++) bits |= (uint32_t)(mask[j] != 0) << j;
    return bits;
#endif
}

#define GROUP_VECTORS 64  /* vectors in a block of pass 1: each of its lanes is one group of 64 logits */

/* For rows rows_index[0..rows) of x (NULL: rows 0..rows-1), each `row_stride` floats apart with `cols`
 * logits: values/ids [rows, cut] the row's cut best logits and their ids (canonical order above), by_id
 * [rows, cut] the places of those candidates in ascending order of their ids, best
 * [rows] its largest logit (NaN if it holds one), and where want_z is NULL or want_z[r] is nonzero,
 * log_z[r] = log(sum over the row of exp((x - best) * inv_t[r])) (masked -inf logits add nothing). A row
 * holding NaN or +inf, or only -inf, is broken for the caller: it gets ids 0..cut-1 and log_z NaN.
 *
 * Pass 1 takes the row's max and the max of each group of 64 logits (a lane of a block of vectors); the
 * cut-th largest group max is a floor that at least cut logits reach, so pass 2 (the normaliser's sum)
 * hands only the few logits at or above it to the selection. */
void row_candidates(const float *x, int64_t rows, int64_t cols, int64_t row_stride, const int64_t *rows_index,
                    const float *inv_t, const int32_t *want_z, int cut, float *values, int64_t *ids, int64_t *by_id,
                    float *best, float *log_z, int num_threads) {
    const int64_t vec_end = cols / VN * VN;
    const int64_t num_groups = (vec_end / VN + GROUP_VECTORS - 1) / GROUP_VECTORS * VN;
    #pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        uint64_t *buffer = malloc(sizeof(uint64_t) * 2 * (size_t)cut);
        float *group_max = malloc(sizeof(float) * (size_t)(num_groups + 1));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + (rows_index ? rows_index[r] : r) * row_stride;
            vf vmax = (vf){0} - INFINITY;
            vi nan = (vi){0};
            for (int64_t i = 0, g = 0; i < vec_end; g += VN) {
                vf block = (vf){0} - INFINITY;
                for (int v = 0; v < GROUP_VECTORS && i < vec_end; v++, i += VN) {
                    const vf x_i = vload_f32(xr + i);
                    nan |= x_i != x_i;
                    block = float_of((bits_of(x_i) & (vu)(x_i > block)) | (bits_of(block) & (vu)(x_i <= block)));
                }
                memcpy(group_max + g, &block, sizeof block);
                vmax = float_of((bits_of(block) & (vu)(block > vmax)) | (bits_of(vmax) & (vu)(block <= vmax)));
            }
            float m = -INFINITY;
            int has_nan = lane_bits(nan) != 0;
            for (int j = 0; j < VN; j++) m = vmax[j] > m ? vmax[j] : m;
            for (int64_t i = vec_end; i < cols; i++) {
                has_nan |= xr[i] != xr[i];
                m = xr[i] > m ? xr[i] : m;
            }
            float *row_values = values + r * cut;
            int64_t *row_ids = ids + r * cut, *row_by_id = by_id + r * cut;
            if (has_nan || isinf(m)) {
                best[r] = has_nan ? NAN : m;
                for (int j = 0; j < cut; j++) {
                    row_ids[j] = row_by_id[j] = j;
                    row_values[j] = xr[j];
                }
                log_z[r] = NAN;
                continue;
            }
            best[r] = m;
            const int with_z = want_z == NULL || want_z[r];
            const float t = inv_t[r];
            // a logit enters the selection if it reaches the floor; once cut have entered, only if it beats
            // the worst of them (an equal one has a larger id, so it ranks after it)
            float bar = kth_largest(group_max, num_groups, cut);
            int strict = 0;
            int64_t n = 0;
            vf sum = (vf){0};
            const vf m_v = (vf){0} + m, t_v = (vf){0} + t;
            for (int64_t i = 0; i < cols; i += VN) {
                uint32_t enter;
                if (i + VN <= cols) {
                    const vf v = vload_f32(xr + i);
                    if (with_z) {
                        const vf arg = (v - m_v) * t_v;
                        sum += float_of(bits_of(vexp(arg)) & (vu)(arg >= -87.0f));
                    }
                    const vf bar_v = (vf){0} + bar;
                    enter = lane_bits(strict ? (vi)(v > bar_v) : (vi)(v >= bar_v));
                } else {  // the row's last logits, one by one
                    enter = 0;
                    for (int64_t k = i; k < cols; k++) {
                        if (with_z) {
                            const float arg = (xr[k] - m) * t;
                            sum[0] += arg >= -87.0f ? expf(arg) : 0.0f;
                        }
                        enter |= (uint32_t)(strict ? xr[k] > bar : xr[k] >= bar) << (k - i);
                    }
                }
                while (enter) {
                    const int64_t k = i + __builtin_ctz(enter);
                    enter &= enter - 1;
                    if (strict && !(xr[k] > bar)) continue;  // the bar rose within this vector
                    buffer[n++] = key_of(xr[k], k);
                    if (n == 2 * cut) {
                        keep_smallest(buffer, n, cut);
                        n = cut;
                    }
                    if (n == cut) {
                        uint64_t worst = buffer[0];
                        for (int64_t j = 1; j < n; j++) worst = buffer[j] > worst ? buffer[j] : worst;
                        bar = value_of(worst);
                        strict = 1;
                    }
                }
            }
            if (n > cut) keep_smallest(buffer, n, cut);
            sort_keys(buffer, 0, cut - 1);
            for (int j = 0; j < cut; j++) {
                row_values[j] = value_of(buffer[j]);
                row_ids[j] = (int64_t)(uint32_t)buffer[j];
                buffer[j] = (uint64_t)row_ids[j] << 32 | (uint32_t)j;  // to sort by id, keeping each place
            }
            sort_keys(buffer, 0, cut - 1);
            for (int j = 0; j < cut; j++) row_by_id[j] = (int64_t)(uint32_t)buffer[j];
            float z = 0.0f;
            for (int j = 0; j < VN; j++) z += sum[j];
            log_z[r] = with_z ? logf(z) : 0.0f;
        }
        free(group_max);
        free(buffer);
    }
}

/* A grammar's masks applied in place: row rows_index[i] (NULL: i) of x, `cols` logits `row_stride` floats
 * apart, keeps the tokens that bitmask row i allows (`words` int32 words a row, bit j of word w allows
 * token 32 w + j, as llguidance writes them) and gets -inf for the others; tokens past the mask's words
 * are refused. One pass over the allowed bits, instead of unpacking them to a boolean tensor. */
void mask_tokens(float *x, int64_t rows, int64_t cols, int64_t row_stride, const int64_t *rows_index,
                 const int32_t *mask, int64_t words, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + (rows_index ? rows_index[r] : r) * row_stride;
        const uint32_t *bits = (const uint32_t *)mask + r * words;
        for (int64_t w = 0; w * 32 < cols; w++) {
            const uint32_t allowed = w < words ? bits[w] : 0u;
            if (allowed == 0xffffffffu) continue;
            const int64_t base = w * 32, n = cols - base < 32 ? cols - base : 32;
            for (int64_t j = 0; j < n; j++)
                if (!((allowed >> j) & 1u)) xr[base + j] = -INFINITY;
        }
    }
}
