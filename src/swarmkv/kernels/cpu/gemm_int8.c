/* The int8 GEMM of prefill chunks: y = x W^T for many rows of x, over the K-quants (Q4_K, Q5_K, Q6_K). Included
 * at the end of grouped.c (one translation unit).
 *
 * x is quantised per super-group of 256 to int8 with one float scale dx (as llama.cpp's Q8_K), so a K-quant's
 * integer sub-scales multiply in integers: a super-group's sum over its groups of sc * (codes . x's codes) is one
 * exact int32 sum, scaled once by the super-group's d times dx. Minimums (Q4_K, Q5_K) meet x's group sums in
 * float; Q6_K's offset of 32 is taken off in the integer sum.
 *
 * A thread takes GEMM_BLOCK weight rows at a time and decodes them once into a tile: unsigned int8 codes, each
 * group of 32 as its even elements then its odd ones (x's codes are laid out the same), and int16 scale vectors
 * for the u8 x s8 pair sums. It then sweeps every row of x against the tile, GEMM_R weight rows by GEMM_C rows of
 * x at a time, the GEMM_R * GEMM_C integer sums of a super-group in registers.
 *
 * Every (weight row, x row) pair meets the same operations in the same order in whatever tile it falls: a row's
 * result depends neither on its neighbours nor on the batch size.
 */

#include <omp.h>

#ifndef GEMM_BLOCK /* (the tile sizes may be set by the compiler's flags, for a benchmark's variants) */
#define GEMM_BLOCK 32 /* weight rows a thread decodes at a time */
#endif
#ifndef GEMM_R
#define GEMM_R 1 /* weight rows a micro-tile holds */
#endif
#ifndef GEMM_C
#define GEMM_C 4 /* rows of x a micro-tile holds (at most 6) */
#endif

/* Whether the GEMM reads this layout: Q4_K and Q5_K (4 or 5 bits in groups of 32, unsigned 6-bit sub-scales and
 * minimums per super-group of 8 groups) and Q6_K (6 bits in groups of 16 less 32, signed sub-scales). */
static inline int gemm_int8_reads(const layout_t *w) {
    if (w->s_sub == NULL) return 0;
    if (w->group == 32 && (w->bits == 4 || w->bits == 5))
        return w->s_per == 8 && !w->s_sub_signed && w->offset == 0 && w->m_half != NULL && w->m_sub != NULL &&
               w->m_per == 8;
    return w->group == 16 && w->bits == 6 && w->s_per == 16 && w->s_sub_signed && w->offset == 32 && w->m_half == NULL;
}

/* x quantised per super-group of 256, for M rows of K. */
typedef struct {
    int8_t *codes;  /* [M, K]: x / dx rounded, at gemm_position */
    float *dx;      /* [M, K/256]: the super-group's max |x| / 127 */
    float *sum32;   /* [M, K/32]: dx * the group of 32's sum of codes (against minimums) */
    int16_t *sum16; /* [M, K/16]: the group of 16's sum of codes (against Q6_K's offset) */
} gemm_x_t;

/* A block of decoded weight rows (tile rows r of block rows [n0, n0 + rows)). */
typedef struct {
    uint8_t *codes;  /* [GEMM_BLOCK, K]: unsigned codes (Q6_K's offset is in `offset`), placed as x's */
    int16_t *scales; /* [GEMM_BLOCK, K/128, 2, 16]: each quad's sub-scales (gemm_decode_row) */
    int16_t *offset; /* [GEMM_BLOCK, K/256, 16]: Q6_K: -32 times group of 16 j's sub-scale in lane j */
    float *d;        /* [GEMM_BLOCK, K/256]: the super-group's float16 scale */
    float *mins;     /* [GEMM_BLOCK, K/32]: Q4_K, Q5_K: each group's minimum, -dmin * m, as gguf rounds it */
} gemm_tile_t;

/* Where element i of group of 32 g sits in a row's codes (x's and the tile's alike): four groups make a quad of
 * 128 bytes, four vectors of 32; each group is first put in pair order (its even elements, then its odd ones),
 * and vector v holds bytes [8v, 8v + 8) of each of the quad's four groups. So every int16 pair sum of a vector
 * is within one group, and with groups of 16 (Q6_K) vectors 0 and 2 hold the first group of 16 of each group of
 * 32, vectors 1 and 3 the second. */
static inline int64_t gemm_position(int64_t g, int i) {
    const int p = (i & 1) * 16 + i / 2;
    return g / 4 * 128 + p / 8 * 32 + g % 4 * 8 + p % 8;
}

#if defined(__AVX2__) && defined(__FMA__)
/* Four groups' codes, each in pair order, into a quad's four vectors (gemm_position): a 4 x 4 transpose of their
 * 8-byte pieces. */
static inline void gemm_store_quad(__m256i p0, __m256i p1, __m256i p2, __m256i p3, void *out) {
    const __m256i t0 = _mm256_unpacklo_epi64(p0, p1), t1 = _mm256_unpackhi_epi64(p0, p1);
    const __m256i t2 = _mm256_unpacklo_epi64(p2, p3), t3 = _mm256_unpackhi_epi64(p2, p3);
    __m256i *v = (__m256i *)out;
    _mm256_storeu_si256(v, _mm256_permute2x128_si256(t0, t2, 0x20));
    _mm256_storeu_si256(v + 1, _mm256_permute2x128_si256(t1, t3, 0x20));
    _mm256_storeu_si256(v + 2, _mm256_permute2x128_si256(t0, t2, 0x31));
    _mm256_storeu_si256(v + 3, _mm256_permute2x128_si256(t1, t3, 0x31));
}

/* Row n's unsigned codes at gemm_position: 4- and 5-bit codes a group at a time (nibble_codes gives pair order),
 * 6-bit ones two groups at a time (the nibbles' low halves are both groups' even elements, as in
 * rows_dot_int8_q6k, with the two high bits of each element moved to bits 4 and 5). */
static void gemm_decode_codes(const layout_t *w, int64_t K, int64_t n, uint8_t *codes) {
    const uint8_t *lo = w->low + n * (K / 2);
    for (int64_t u = 0; u < K / 128; u++) {
        __m256i p[4];
        if (w->bits == 6) {
            const uint8_t *high = w->high + n * (K / 4);
            for (int j = 0; j < 4; j += 2) {
                __m256i ce, co;
                q6k_pair_codes(lo, high, 4 * u + j, &ce, &co);
                p[j] = _mm256_permute2x128_si256(ce, co, 0x20), p[j + 1] = _mm256_permute2x128_si256(ce, co, 0x31);
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const int64_t g = 4 * u + j;
                p[j] = nibble_codes(lo + g * 16, w->bits == 5 ? w->high + n * (K / 8) + g * 4 : NULL);
            }
        }
        gemm_store_quad(p[0], p[1], p[2], p[3], codes + u * 128);
    }
}
#else
/* Row n's unsigned codes at gemm_position. */
static void gemm_decode_codes(const layout_t *w, int64_t K, int64_t n, uint8_t *codes) {
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *lo = w->low + n * (K / 2) + g * 16;
        for (int i = 0; i < 32; i++) { /* element k is byte k / 2's low nibble when k is even, else its high one */
            const int64_t k = g * 32 + i;
            uint8_t c = i & 1 ? lo[i / 2] >> 4 : lo[i / 2] & 0xF;
            if (w->bits == 5) c |= ((w->high[n * (K / 8) + (k >> 3)] >> (k & 7)) & 1) << 4;
            if (w->bits == 6) c |= ((w->high[n * (K / 4) + (k >> 2)] >> (2 * (k & 3))) & 3) << 4;
            codes[gemm_position(g, i)] = c;
        }
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* Row m of x into its codes, dx and sums: the plain loop's operations (|x|'s maximum, amax / 127, 1 / d, x * inv
 * rounded to nearest even as nearbyintf does), 8 lanes at a time, so the same codes and constants. */
static void gemm_quantize_row(int64_t K, const float *x, gemm_x_t *q, int64_t m) {
    const int64_t supers = K / 256;
    const float *v = x + m * K;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t s = 0; s < supers; s++) {
        __m256 top = _mm256_setzero_ps();
        for (int i = 0; i < 256; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + s * 256 + i), magnitude));
        __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        q->dx[m * supers + s] = d;
        for (int64_t u = 2 * s; u < 2 * s + 2; u++) {
            __m256i p[4];
            for (int j = 0; j < 4; j++) {
                const int64_t g = 4 * u + j;
                __m256i q32[4];
                for (int i = 0; i < 4; i++)
                    q32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + g * 32 + 8 * i), _mm256_set1_ps(inv)));
                /* int32 -> int8 in element order: the packs interleave 128-bit lanes, the permute restores them */
                const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
                const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                /* the sums of elements 0-15 and 16-31: the int32 lanes of each 128-bit half */
                const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
                __m128i lo = _mm256_castsi256_si128(s32), hi = _mm256_extracti128_si256(s32, 1);
                lo = _mm_hadd_epi32(_mm_hadd_epi32(lo, hi), _mm_setzero_si128());
                const int first = _mm_cvtsi128_si32(lo), second = _mm_extract_epi32(lo, 1);
                q->sum16[m * (K / 16) + 2 * g] = (int16_t)first, q->sum16[m * (K / 16) + 2 * g + 1] = (int16_t)second;
                q->sum32[m * (K / 32) + g] = d * (float)(first + second);
                p[j] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q8, split), 0xD8); /* evens, then odds */
            }
            gemm_store_quad(p[0], p[1], p[2], p[3], q->codes + m * K + u * 128);
        }
    }
}
#else
/* Row m of x into its codes, dx and sums. */
static void gemm_quantize_row(int64_t K, const float *x, gemm_x_t *q, int64_t m) {
    const int64_t supers = K / 256;
    const float *v = x + m * K;
    int8_t *codes = q->codes + m * K;
    for (int64_t s = 0; s < supers; s++) {
        float amax = 0.0f;
        for (int i = 0; i < 256; i++) amax = fabsf(v[s * 256 + i]) > amax ? fabsf(v[s * 256 + i]) : amax;
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        q->dx[m * supers + s] = d;
        for (int64_t g = s * 8; g < s * 8 + 8; g++) {
            int8_t c[32];
            for (int i = 0; i < 32; i++) c[i] = (int8_t)(int)nearbyintf(v[g * 32 + i] * inv);
            int sums[2] = {0, 0};
            for (int i = 0; i < 32; i++) sums[i / 16] += c[i];
            for (int i = 0; i < 32; i++) codes[gemm_position(g, i)] = c[i];
            q->sum16[m * (K / 16) + 2 * g] = (int16_t)sums[0];
            q->sum16[m * (K / 16) + 2 * g + 1] = (int16_t)sums[1];
            q->sum32[m * (K / 32) + g] = d * (float)(sums[0] + sums[1]);
        }
    }
}
#endif

/* Weight row n into tile row r: codes placed as x's, each quad's two vectors of sub-scales (int16 lane l: its
 * pair sums' group, the first group of 16 in the first vector, the second in the other; 4- and 5-bit codes have
 * one sub-scale a group of 32, in both), and the super-groups' constants. */
static void gemm_decode_row(const layout_t *w, int64_t K, int64_t n, gemm_tile_t *t, int64_t r) {
    const int64_t groups = K / 32, supers = K / 256, quads = K / 128, sub_groups = K / w->group;
    gemm_decode_codes(w, K, n, t->codes + r * K);
    if (w->m_half != NULL)
        for (int64_t g = 0; g < groups; g++)
            t->mins[r * groups + g] = half_to_float(w->m_half[n * supers + g / 8]) * (float)w->m_sub[n * groups + g];
    for (int64_t u = 0; u < quads; u++)
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 16; l++) {
                const int64_t g = 4 * u + l / 4, sub = w->group == 32 ? g : 2 * g + half;
                t->scales[(r * quads + u) * 32 + half * 16 + l] =
                    w->s_sub_signed ? (int16_t)((const int8_t *)w->s_sub)[n * sub_groups + sub]
                                    : (int16_t)((const uint8_t *)w->s_sub)[n * sub_groups + sub];
            }
    for (int64_t s = 0; s < supers; s++) {
        t->d[r * supers + s] = half_to_float(w->s_half[n * supers + s]);
        if (w->bits == 6)
            for (int j = 0; j < 16; j++)
                t->offset[(r * supers + s) * 16 + j] =
                    (int16_t)(-w->offset * ((const int8_t *)w->s_sub)[n * sub_groups + s * 16 + j]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_GEMM_INT8 1
/* acc + the pair sums p (int16) times the scales s (int16), pairwise added into int32 lanes. */
static inline __m256i madd_add(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* Tile rows [r0, r0 + R) against rows [m0, m0 + C) of x (R <= GEMM_R, C <= GEMM_C, constants where inlined):
 * y[m, n0 + r]. A quad of groups is four vectors whose int16 pair sums (|p| <= 2 * 63 * 127) add up in int16
 * before one multiply by their sub-scales: all four for 4- and 5-bit codes (|sum| <= 4 * 2 * 31 * 127), the two
 * of each group of 16 for Q6_K. A super-group's int32 sum stays below 2^29. */
static inline __attribute__((always_inline)) void gemm_micro(const gemm_tile_t *t, int64_t K, int64_t r0, int R,
                                                             const gemm_x_t *q, int64_t m0, int C, int six,
                                                             float *y, int64_t ldy, int64_t n0) {
    const int64_t groups = K / 32, supers = K / 256, quads = K / 128;
    __m256 accf[GEMM_R][GEMM_C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) accf[r][c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        __m256i acc[GEMM_R][GEMM_C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_si256();
        for (int64_t u = 2 * s; u < 2 * s + 2; u++) {
            __m256i p[GEMM_R][GEMM_C], p2[GEMM_R][GEMM_C];
            for (int v = 0; v < 4; v++) {
                __m256i w[GEMM_R];
                for (int r = 0; r < R; r++) w[r] = _mm256_loadu_si256((const __m256i *)(t->codes + (r0 + r) * K + u * 128 + v * 32));
                for (int c = 0; c < C; c++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(q->codes + (m0 + c) * K + u * 128 + v * 32));
                    for (int r = 0; r < R; r++) {
                        const __m256i d = _mm256_maddubs_epi16(w[r], xv);
                        if (six) {
                            if (v == 0) p[r][c] = d;
                            else if (v == 1) p2[r][c] = d;
                            else if (v == 2) p[r][c] = _mm256_add_epi16(p[r][c], d);
                            else p2[r][c] = _mm256_add_epi16(p2[r][c], d);
                        } else {
                            p[r][c] = v == 0 ? d : _mm256_add_epi16(p[r][c], d);
                        }
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i sa = _mm256_loadu_si256((const __m256i *)(t->scales + ((r0 + r) * quads + u) * 32));
                for (int c = 0; c < C; c++) acc[r][c] = madd_add(acc[r][c], p[r][c], sa);
                if (six) {
                    const __m256i sb = _mm256_loadu_si256((const __m256i *)(t->scales + ((r0 + r) * quads + u) * 32 + 16));
                    for (int c = 0; c < C; c++) acc[r][c] = madd_add(acc[r][c], p2[r][c], sb);
                }
            }
        }
        if (six)
            for (int c = 0; c < C; c++) {
                const __m256i xs = _mm256_loadu_si256((const __m256i *)(q->sum16 + (m0 + c) * (K / 16) + s * 16));
                for (int r = 0; r < R; r++) {
                    const __m256i off = _mm256_loadu_si256((const __m256i *)(t->offset + ((r0 + r) * supers + s) * 16));
                    acc[r][c] = madd_add(acc[r][c], xs, off);
                }
            }
        for (int c = 0; c < C; c++) {
            const float dx = q->dx[(m0 + c) * supers + s];
            for (int r = 0; r < R; r++)
                accf[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), _mm256_set1_ps(t->d[(r0 + r) * supers + s] * dx), accf[r][c]);
        }
        if (!six)
            for (int c = 0; c < C; c++) {
                const __m256 xs = _mm256_loadu_ps(q->sum32 + (m0 + c) * groups + s * 8);
                for (int r = 0; r < R; r++)
                    accf[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(t->mins + (r0 + r) * groups + s * 8), xs, accf[r][c]);
            }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) y[(m0 + c) * ldy + n0 + r0 + r] = hsum256(accf[r][c]);
}

/* The micro-tile of R weight rows (a constant) against C rows of x (1 to GEMM_C), C made a constant. */
#define GEMM_MICRO(R)                                                                                          \
    switch (C) {                                                                                               \
    case 1: gemm_micro(t, K, r0, R, q, m0, 1, six, y, ldy, n0); break;                                         \
    case 2: gemm_micro(t, K, r0, R, q, m0, 2 < GEMM_C ? 2 : GEMM_C, six, y, ldy, n0); break;                   \
    case 3: gemm_micro(t, K, r0, R, q, m0, 3 < GEMM_C ? 3 : GEMM_C, six, y, ldy, n0); break;                   \
    case 4: gemm_micro(t, K, r0, R, q, m0, 4 < GEMM_C ? 4 : GEMM_C, six, y, ldy, n0); break;                   \
    case 5: gemm_micro(t, K, r0, R, q, m0, 5 < GEMM_C ? 5 : GEMM_C, six, y, ldy, n0); break;                   \
    default: gemm_micro(t, K, r0, R, q, m0, GEMM_C, six, y, ldy, n0);                                          \
    }

/* Tile rows [0, rows) against every row of x. */
static void gemm_block(const gemm_tile_t *t, int64_t rows, int64_t K, const gemm_x_t *q, int64_t M, int six, float *y,
                       int64_t ldy, int64_t n0) {
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_C) {
        const int64_t C = M - m0 < GEMM_C ? M - m0 : GEMM_C;
        int64_t r0 = 0;
        for (; r0 + GEMM_R <= rows; r0 += GEMM_R) GEMM_MICRO(GEMM_R)
        for (; r0 < rows; r0++) GEMM_MICRO(1)
    }
}
#else
#define HAVE_GEMM_INT8 0
/* The same sums in plain C: each (weight row, x row) pair's integer super-group sums, then the same scaling. */
static void gemm_block(const gemm_tile_t *t, int64_t rows, int64_t K, const gemm_x_t *q, int64_t M, int six, float *y,
                       int64_t ldy, int64_t n0) {
    const int64_t groups = K / 32, supers = K / 256;
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t s = 0; s < supers; s++) {
                int32_t sum = 0;
                for (int64_t b = s * 256; b < s * 256 + 256; b++) { /* byte b: quad b / 128, vector (b / 32) % 4 */
                    const int64_t u = b / 128, v = b / 32 % 4, l = b % 32 / 2;
                    sum += (int32_t)t->codes[r * K + b] * q->codes[m * K + b] *
                           t->scales[(r * (K / 128) + u) * 32 + (six && v % 2) * 16 + l];
                }
                if (six)
                    for (int j = 0; j < 16; j++)
                        sum += (int32_t)q->sum16[m * (K / 16) + s * 16 + j] * t->offset[(r * supers + s) * 16 + j];
                acc += (float)sum * (t->d[r * supers + s] * q->dx[m * supers + s]);
                if (!six)
                    for (int64_t g = s * 8; g < s * 8 + 8; g++) acc += t->mins[r * groups + g] * q->sum32[m * groups + g];
            }
            y[m * ldy + n0 + r] = acc;
        }
}
#endif

/* Whether this build and layout run swarmkv_grouped_gemm_int8. */
int swarmkv_gemm_int8_reads(int bits, int group, int offset, const uint8_t *low, const uint8_t *high,
                            const uint16_t *s_half, const void *s_sub, int s_sub_signed, int s_per,
                            const uint16_t *m_half, const uint8_t *m_sub, int m_per) {
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
    return gemm_int8_reads(&w);
}

/* Whether the GEMM has this build's vector kernel (AVX2 or later; else the plain-C sums). */
int swarmkv_gemm_int8_vector(void) { return HAVE_GEMM_INT8; }

/* y[M, N] (row stride ldy) = x[M, K] W^T with x quantised per super-group of 256 to int8 (status 1: a layout
 * gemm_int8_reads refuses, or K not a multiple of 256; 2: out of memory). */
int swarmkv_grouped_gemm_int8(int64_t M, int64_t N, int64_t K, const float *x, float *y, int64_t ldy, int bits,
                              int group, int offset, const uint8_t *low, const uint8_t *high, const uint16_t *s_half,
                              const void *s_sub, int s_sub_signed, int s_per, const uint16_t *m_half,
                              const uint8_t *m_sub, int m_per, int threads) {
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
    if (!gemm_int8_reads(&w) || K % 256) return 1;
    const int64_t groups = K / 32, supers = K / 256;
    gemm_x_t q;
    q.codes = aligned_alloc(64, (size_t)(M * K + 63) / 64 * 64);
    q.dx = malloc(sizeof(float) * (size_t)(M * supers));
    q.sum32 = malloc(sizeof(float) * (size_t)(M * groups));
    q.sum16 = malloc(sizeof(int16_t) * (size_t)(M * (K / 16)));
    const int64_t tile_bytes = (GEMM_BLOCK * (K + K / 2 + supers * 32 + supers * 4 + groups * 4) + 63) / 64 * 64;
    uint8_t *scratch = aligned_alloc(64, (size_t)(threads * tile_bytes));
    int failed = q.codes == NULL || q.dx == NULL || q.sum32 == NULL || q.sum16 == NULL || scratch == NULL;
    if (!failed) {
        const int six = w.bits == 6;
        const int64_t blocks = (N + GEMM_BLOCK - 1) / GEMM_BLOCK;
#pragma omp parallel num_threads(threads)
        {
            /* dynamic: on a shared machine one thread may run slower than another; which thread takes a row or a
             * block changes nothing in its result */
#pragma omp for schedule(dynamic, 16)
            for (int64_t m = 0; m < M; m++) gemm_quantize_row(K, x, &q, m);
            /* each thread's tile in the one scratch allocation made before the region: workers allocate nothing */
            const int64_t bytes = GEMM_BLOCK * (K + K / 2 + supers * 32 + supers * 4 + groups * 4);
            uint8_t *mine = scratch + (int64_t)omp_get_thread_num() * ((bytes + 63) / 64 * 64);
            gemm_tile_t t;
            t.codes = mine;
            t.scales = (int16_t *)(mine + GEMM_BLOCK * K);
            t.offset = (int16_t *)(mine + GEMM_BLOCK * (K + K / 2));
            t.d = (float *)(mine + GEMM_BLOCK * (K + K / 2 + supers * 32));
            t.mins = (float *)(mine + GEMM_BLOCK * (K + K / 2 + supers * 32 + supers * 4));
#pragma omp for schedule(dynamic)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * GEMM_BLOCK, rows = N - n0 < GEMM_BLOCK ? N - n0 : GEMM_BLOCK;
                for (int64_t r = 0; r < rows; r++) gemm_decode_row(&w, K, n0 + r, &t, r);
                gemm_block(&t, rows, K, &q, M, six, y, ldy, n0);
            }
        }
    }
    free(q.codes), free(q.dx), free(q.sum32), free(q.sum16), free(scratch);
    return failed ? 2 : 0;
}
