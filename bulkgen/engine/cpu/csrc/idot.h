/* Integer dot products of 4 bytes into int32 lanes on 256-bit vectors, for qgemm.c's and qblocks.c's AVX2
 * tiles (their AVX512-VNNI tiles use vpdpbusd on 512 bits directly). Each lane of acc gains
 * sum_{t<4} w[4i+t] * p[4i+t], w unsigned and p signed bytes, exactly:
 *   AVX-VNNI (recent AVX2 CPUs: Alder Lake, Zen 5): vpdpbusd, any w in [0, 255].
 *   AVX2: vpmaddubsw (pairs into saturating int16) then vpmaddwd by ones; exact for w in [0, 127] with p in
 *   [-127, 127] (2 * 127 * 127 < 32767). 8-bit weights (u = q + 128, up to 255) would saturate: idot_u8
 *   takes their signed value q = u - 128 instead, as llama.cpp does (|q| times p with q's sign), so its sum is
 *   that of q, not of u; IDOT_U8_OFFSET says which the caller gets (1: the sum of u, take 128 sum p out). */
#ifndef BULKGEN_IDOT_H
#define BULKGEN_IDOT_H
#include <immintrin.h>

#if defined(__AVXVNNI__)
#define IDOT_U8_OFFSET 1
static inline __m256i idot_small(__m256i acc, __m256i w, __m256i p) { return _mm256_dpbusd_avx_epi32(acc, w, p); }
static inline __m256i idot_u8(__m256i acc, __m256i u, __m256i p) { return _mm256_dpbusd_avx_epi32(acc, u, p); }
#else
#define IDOT_U8_OFFSET 0
static inline __m256i idot_small(__m256i acc, __m256i w, __m256i p) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, p), _mm256_set1_epi16(1)));
}
static inline __m256i idot_u8(__m256i acc, __m256i u, __m256i p) {
    __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));  /* u - 128 as signed bytes */
    return idot_small(acc, _mm256_abs_epi8(q), _mm256_sign_epi8(p, q));
}
#endif
#endif
