/* Matmul and dequantisation over swarmkv's grouped quantized layout (models/gguf_quants.py), on the CPU.
 *
 * A weight [N, K] holds codes q (4, 5, 6 or 8 bits) in groups of `group` along K, a scale S and optionally a
 * minimum M per group: W[n, k] = S[n, g] * (q[n, k] - offset) + M[n, g]. S and M are either float16 per group,
 * or a small integer per group times a float16 per super-group (the K-quants). Every size is a parameter.
 *
 * Portable C: the compiler vectorises the per-group loops (built with -O3 -march=native by cpu_grouped.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 256
#define FAST_ROWS 8 /* rows of x one pass over a weight row serves (every build: the int8 forms' sizes use it) */

typedef struct {
    int bits, group, offset;
    const uint8_t *low;   /* [N, K/2] nibbles, or [N, K] int8 codes when bits == 8 */
    const uint8_t *high;  /* [N, K*(bits-4)/8] or NULL */
    const uint16_t *s_half; /* float16 per group [N, G], or per super-group [N, G/s_per] when s_sub is set */
    const void *s_sub;    /* uint8 or int8 [N, G], or NULL */
    int s_sub_signed, s_per;
    const uint16_t *m_half; /* as s_half; NULL when the type has no minimums */
    const uint8_t *m_sub;
    int m_per;
} layout_t;

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#elif defined(__aarch64__)
static inline float half_to_float(uint16_t h) {
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* The group constant (scale or minimum) of row n, group g. */
static inline float constant(const uint16_t *half, const void *sub, int sub_signed, int per, int64_t n,
                             int64_t groups, int64_t g) {
    if (sub == NULL) return half_to_float(half[n * groups + g]);
    int64_t outer = groups / per;
    float s = sub_signed ? (float)((const int8_t *)sub)[n * groups + g] : (float)((const uint8_t *)sub)[n * groups + g];
    return half_to_float(half[n * outer + g / per]) * s;
}

/* The codes of row n, group g, minus the offset, as floats. */
static inline void decode_group(const layout_t *w, int64_t K, int64_t n, int64_t g, float *out) {
    const int gs = w->group;
    const int64_t k0 = g * gs;
    if (w->bits == 8) {
        const int8_t *q = (const int8_t *)w->low + n * K + k0;
        for (int j = 0; j < gs; j++) out[j] = (float)(q[j] - w->offset);
        return;
    }
    uint8_t q[MAX_GROUP];
    const uint8_t *lo = w->low + n * (K / 2) + k0 / 2;
    for (int j = 0; j < gs / 2; j++) {
        q[2 * j] = lo[j] & 0xF;
        q[2 * j + 1] = lo[j] >> 4;
    }
    if (w->bits == 5) {
        const uint8_t *hi = w->high + n * (K / 8) + k0 / 8;
        for (int j = 0; j < gs; j++) q[j] |= ((hi[j >> 3] >> (j & 7)) & 1) << 4;
    } else if (w->bits == 6) {
        const uint8_t *hi = w->high + n * (K / 4) + k0 / 4;
        for (int j = 0; j < gs; j++) q[j] |= ((hi[j >> 2] >> (2 * (j & 3))) & 3) << 4;
    }
    for (int j = 0; j < gs; j++) out[j] = (float)((int)q[j] - w->offset);
}

/* One row's constant (scale or minimum) reader: float16 per group, or an integer per group times a float16 per
 * super-group of 2^shift groups. */
typedef struct {
    const uint16_t *half;
    const uint8_t *sub;
    int sub_signed, shift;
} row_constants_t;

static inline row_constants_t row_constants(const uint16_t *half, const void *sub, int sub_signed, int per,
                                            int64_t n, int64_t groups) {
    row_constants_t c;
    c.sub = sub ? (const uint8_t *)sub + n * groups : NULL;
    c.half = half + n * (sub ? groups / per : groups);
    c.sub_signed = sub_signed;
    c.shift = 0;
    while ((1 << c.shift) < per) c.shift++;
    return c;
}

static inline float row_constant(const row_constants_t *c, int64_t g) {
    if (c->sub == NULL) return half_to_float(c->half[g]);
    float s = c->sub_signed ? (float)(int8_t)c->sub[g] : (float)c->sub[g];
    return half_to_float(c->half[g >> c->shift]) * s;
}

/* One output of y = x W^T: row n of W against x (8-bit codes: x itself; else x's even then odd elements, xe and
 * xo), with xsum each group's sum of x. Per-lane accumulators across groups, one horizontal sum per row. GS is a
 * compile-time group size so the lane loops vectorise. */
#define ROW_DOT(NAME, GS)                                                                                      \
    static float NAME(const layout_t *w, int64_t K, int64_t n, const float *xm, const float *xsum) {           \
        const int64_t groups = K / GS;                                                                         \
        const int bits = w->bits;                                                                              \
        row_constants_t sc = row_constants(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups);         \
        row_constants_t mc;                                                                                    \
        if (w->m_half) mc = row_constants(w->m_half, w->m_sub, 0, w->m_per, n, groups);                        \
        float lanes[GS] = {0.0f};                                                                              \
        float rest = 0.0f;                                                                                     \
        const float *xe = xm, *xo = xm + K / 2;                                                                \
        for (int64_t g = 0; g < groups; g++) {                                                                 \
            const float s = row_constant(&sc, g);                                                              \
            /* S (q - offset) + M against x: S q.x + (M - S offset) sum(x) */                                  \
            float shift = -s * (float)w->offset;                                                               \
            if (w->m_half) shift += row_constant(&mc, g);                                                      \
            rest += shift * xsum[g];                                                                           \
            if (bits == 8) {                                                                                   \
                const int8_t *q = (const int8_t *)w->low + n * K + g * GS;                                     \
                const float *x = xm + g * GS;                                                                  \
                for (int j = 0; j < GS; j++) lanes[j] += s * ((float)q[j] * x[j]);                             \
                continue;                                                                                      \
            }                                                                                                  \
            const uint8_t *lo = w->low + n * (K / 2) + g * (GS / 2);                                           \
            const float *e = xe + g * (GS / 2), *o = xo + g * (GS / 2);                                        \
            if (bits == 4) {                                                                                   \
                for (int j = 0; j < GS / 2; j++) {                                                             \
                    lanes[j] += s * ((float)(lo[j] & 0xF) * e[j]);                                             \
                    lanes[GS / 2 + j] += s * ((float)(lo[j] >> 4) * o[j]);                                     \
                }                                                                                              \
            } else if (bits == 5) { /* element k's fifth bit: bit k % 8 of byte k / 8 */                       \
                const uint8_t *hi = w->high + n * (K / 8) + g * (GS / 8);                                      \
                for (int j = 0; j < GS / 2; j++) {                                                             \
                    int h = hi[j >> 2] >> (2 * (j & 3));                                                       \
                    lanes[j] += s * ((float)((lo[j] & 0xF) | ((h & 1) << 4)) * e[j]);                          \
                    lanes[GS / 2 + j] += s * ((float)((lo[j] >> 4) | ((h & 2) << 3)) * o[j]);                  \
                }                                                                                              \
            } else { /* bits 4 and 5 of element k: bits 2 (k % 4) of byte k / 4 */                             \
                const uint8_t *hi = w->high + n * (K / 4) + g * (GS / 4);                                      \
                for (int j = 0; j < GS / 2; j++) {                                                             \
                    int h = hi[j >> 1] >> (4 * (j & 1));                                                       \
                    lanes[j] += s * ((float)((lo[j] & 0xF) | ((h & 3) << 4)) * e[j]);                          \
                    lanes[GS / 2 + j] += s * ((float)((lo[j] >> 4) | ((h & 0xC) << 2)) * o[j]);                \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        float total = rest;                                                                                    \
        for (int j = 0; j < GS; j++) total += lanes[j];                                                        \
        return total;                                                                                          \
    }

ROW_DOT(row_dot_16, 16)
ROW_DOT(row_dot_32, 32)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_FAST_32 1
static inline __m256 cvt_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 cvt_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

/* The sum of v's 8 lanes: halves, then pairs, then the last two. */
static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}


/* 8 codes as int32 lanes: nibbles from 8 bytes (low or high halves), plus the bits above them from `hi`
 * (a group's high plane as one 32-bit word) shifted right by `shifts` lane by lane. */
static inline __m256i code_lanes(__m128i nibbles8, int bits, __m256i hi, __m256i shifts) {
    __m256i c = _mm256_cvtepu8_epi32(nibbles8);
    if (bits == 5) c = _mm256_or_si256(c, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(hi, shifts), _mm256_set1_epi32(1)), 4));
    if (bits == 6) c = _mm256_or_si256(c, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(hi, shifts), _mm256_set1_epi32(3)), 4));
    return c;
}

/* Groups of GS (32: 4-, 5- and 8-bit codes; 16: 4-, 5- and 6-bit) with AVX2: each group's codes are decoded and
 * scaled once, then multiplied into up to FAST_ROWS rows of x, the accumulators in registers. */
#define ROWS_DOT_FAST(NAME, GS)                                                                                \
    static inline __attribute__((always_inline)) void NAME(const layout_t *w, int64_t K, int64_t n, int64_t M,  \
                                                           const float *xd, const float *xsum, float *out) {    \
        const int64_t groups = K / GS;                                                                         \
        const int bits = w->bits;                                                                              \
        enum { V = GS / 8 }; /* 8-lane vectors per group */                                                    \
        row_constants_t sc = row_constants(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups);         \
        row_constants_t mc;                                                                                    \
        if (w->m_half) mc = row_constants(w->m_half, w->m_sub, 0, w->m_per, n, groups);                        \
        __m256 acc[FAST_ROWS];                                                                                 \
        float rest[FAST_ROWS];                                                                                 \
        for (int64_t m = 0; m < M; m++) {                                                                      \
            acc[m] = _mm256_setzero_ps();                                                                      \
            rest[m] = 0.0f;                                                                                    \
        }                                                                                                      \
        const __m128i nib = _mm_set1_epi8(0xF);                                                                \
        /* 5 bits: element k's bit k of the group's word; 6 bits: bits 2k, 2k + 1 (groups of 16). Lanes of the  \
         * even vector hold elements 0, 2, 4, ...; of the odd one 1, 3, 5, ... */                              \
        const int step = bits == 6 ? 4 : 2;                                                                    \
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                        \
        const __m256i even = _mm256_mullo_epi32(lane, _mm256_set1_epi32(step));                                \
        const __m256i odd = _mm256_add_epi32(even, _mm256_set1_epi32(step / 2));                               \
        const __m256i later = _mm256_set1_epi32(8 * step); /* the second 8 even (odd) elements of a 32 group */ \
        for (int64_t g = 0; g < groups; g++) {                                                                 \
            const float s = row_constant(&sc, g);                                                              \
            float shift = -s * (float)w->offset;                                                               \
            if (w->m_half) shift += row_constant(&mc, g);                                                      \
            const __m256 sv = _mm256_set1_ps(s);                                                               \
            __m256 q[V];                                                                                       \
            int64_t off[V];                                                                                    \
            if (bits == 8) {                                                                                   \
                const int8_t *c = (const int8_t *)w->low + n * K + g * GS;                                     \
                for (int v = 0; v < V; v++) {                                                                  \
                    q[v] = _mm256_mul_ps(sv, cvt_i8(c + 8 * v));                                               \
                    off[v] = g * GS + 8 * v;                                                                   \
                }                                                                                              \
            } else {                                                                                           \
                const uint8_t *lo = w->low + n * (K / 2) + g * (GS / 2);                                       \
                __m128i b = GS == 32 ? _mm_loadu_si128((const __m128i *)lo) : _mm_loadl_epi64((const __m128i *)lo); \
                const __m128i low = _mm_and_si128(b, nib), high = _mm_and_si128(_mm_srli_epi16(b, 4), nib);    \
                uint32_t word = 0;                                                                             \
                if (bits == 5) memcpy(&word, w->high + n * (K / 8) + g * (GS / 8), GS / 8);                  \
                if (bits == 6 && GS == 16) memcpy(&word, w->high + n * (K / 4) + g * 4, 4);                  \
                const __m256i hi = _mm256_set1_epi32((int)word);                                               \
                /* even elements: x's first half; odd: its second half */                                      \
                q[0] = _mm256_cvtepi32_ps(code_lanes(low, bits, hi, even));                                    \
                off[0] = g * (GS / 2);                                                                         \
                if (GS == 32) {                                                                                \
                    q[1] = _mm256_cvtepi32_ps(code_lanes(_mm_srli_si128(low, 8), bits, hi, _mm256_add_epi32(even, later))); \
                    off[1] = g * 16 + 8;                                                                       \
                }                                                                                              \
                q[V / 2] = _mm256_cvtepi32_ps(code_lanes(high, bits, hi, odd));                                \
                off[V / 2] = K / 2 + g * (GS / 2);                                                             \
                if (GS == 32) {                                                                                \
                    q[3] = _mm256_cvtepi32_ps(code_lanes(_mm_srli_si128(high, 8), bits, hi, _mm256_add_epi32(odd, later))); \
                    off[3] = K / 2 + g * 16 + 8;                                                               \
                }                                                                                              \
                for (int v = 0; v < V; v++) q[v] = _mm256_mul_ps(sv, q[v]);                                    \
            }                                                                                                  \
            for (int64_t m = 0; m < M; m++) {                                                                  \
                const float *x = xd + m * K;                                                                   \
                __m256 a = acc[m];                                                                             \
                for (int v = 0; v < V; v++) a = _mm256_fmadd_ps(q[v], _mm256_loadu_ps(x + off[v]), a);        \
                acc[m] = a;                                                                                    \
                rest[m] += shift * xsum[m * groups + g];                                                       \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t m = 0; m < M; m++) out[m] = rest[m] + hsum256(acc[m]);                                    \
    }

ROWS_DOT_FAST(rows_dot_fast_32, 32)
ROWS_DOT_FAST(rows_dot_fast_16, 16)

#if defined(__AVX512F__)
#define HAVE_512 1
/* Groups of 32 with 4-, 5- or 8-bit codes on AVX-512: 16 lanes, two vectors a group. */
static inline __attribute__((always_inline)) void rows_dot_512(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                               const float *xd, const float *xsum, float *out) {
    const int64_t groups = K / 32;
    const int bits = w->bits;
    row_constants_t sc = row_constants(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups);
    row_constants_t mc;
    if (w->m_half) mc = row_constants(w->m_half, w->m_sub, 0, w->m_per, n, groups);
    __m512 acc[FAST_ROWS];
    float rest[FAST_ROWS];
    for (int64_t m = 0; m < M; m++) {
        acc[m] = _mm512_setzero_ps();
        rest[m] = 0.0f;
    }
    const __m128i nib = _mm_set1_epi8(0xF);
    const __m512i lane2 = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1);
    const __m512i lane2_odd = _mm512_add_epi32(lane2, _mm512_set1_epi32(1));
    const __m512i one = _mm512_set1_epi32(1);
    for (int64_t g = 0; g < groups; g++) {
        const float s = row_constant(&sc, g);
        float shift = -s * (float)w->offset;
        if (w->m_half) shift += row_constant(&mc, g);
        const __m512 sv = _mm512_set1_ps(s);
        __m512 q0, q1;
        int64_t o0, o1;
        if (bits == 8) {
            const int8_t *c = (const int8_t *)w->low + n * K + g * 32;
            q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
            q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
            o0 = g * 32, o1 = o0 + 16;
        } else {
            const __m128i b = _mm_loadu_si128((const __m128i *)(w->low + n * (K / 2) + g * 16));
            __m512i c0 = _mm512_cvtepu8_epi32(_mm_and_si128(b, nib));
            __m512i c1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), nib));
            if (bits == 5) { /* element k's fifth bit: bit k of the group's word */
                uint32_t word;
                memcpy(&word, w->high + n * (K / 8) + g * 4, 4);
                const __m512i hi = _mm512_set1_epi32((int)word);
                c0 = _mm512_or_si512(c0, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(hi, lane2), one), 4));
                c1 = _mm512_or_si512(c1, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(hi, lane2_odd), one), 4));
            }
            q0 = _mm512_cvtepi32_ps(c0), q1 = _mm512_cvtepi32_ps(c1);
            o0 = g * 16, o1 = K / 2 + g * 16; /* even elements: x's first half; odd: its second */
        }
        q0 = _mm512_mul_ps(sv, q0), q1 = _mm512_mul_ps(sv, q1);
        for (int64_t m = 0; m < M; m++) {
            const float *x = xd + m * K;
            acc[m] = _mm512_fmadd_ps(q1, _mm512_loadu_ps(x + o1), _mm512_fmadd_ps(q0, _mm512_loadu_ps(x + o0), acc[m]));
            rest[m] += shift * xsum[m * groups + g];
        }
    }
    for (int64_t m = 0; m < M; m++) out[m] = rest[m] + _mm512_reduce_add_ps(acc[m]);
}
#else
#define HAVE_512 0
#endif
#else
#define HAVE_FAST_32 0
#endif

/* Rows [n0, n1) of y = x W^T for the M rows of x. */
static void rows_matmul(const layout_t *w, int64_t M, int64_t K, const float *xd, const float *xsum, float *y,
                        int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t groups = K / w->group;
    for (int64_t n = n0; n < n1; n++) {
#if HAVE_FAST_32
        if ((w->group == 32 && w->bits != 6) || (w->group == 16 && w->bits != 8)) {
            float out[FAST_ROWS];
            for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {
                const int64_t rows = M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS;
                const float *x = xd + m0 * K, *xs = xsum + m0 * groups;
                /* a constant row count of 1 keeps the accumulator in a register */
#if HAVE_512
                if (w->group == 32)
                    rows == 1 ? rows_dot_512(w, K, n, 1, x, xs, out) : rows_dot_512(w, K, n, rows, x, xs, out);
                else
#endif
                if (w->group == 32)
                    rows == 1 ? rows_dot_fast_32(w, K, n, 1, x, xs, out) : rows_dot_fast_32(w, K, n, rows, x, xs, out);
                else
                    rows == 1 ? rows_dot_fast_16(w, K, n, 1, x, xs, out) : rows_dot_fast_16(w, K, n, rows, x, xs, out);
                for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < M; m++) {
            const float *xm = xd + m * K, *xs = xsum + m * groups;
            y[m * ldy + n] = w->group == 16 ? row_dot_16(w, K, n, xm, xs) : row_dot_32(w, K, n, xm, xs);
        }
    }
}

/* ---- int8 activations (decode): x quantised per group of 32 to int8 with one float scale, as llama.cpp's
 * Q8 activations; each group's dot product runs in integers on the CPU's u8 x s8 dot-product instructions
 * (AVX-512 VNNI or AVX-VNNI; AVX2's maddubs otherwise) and is scaled once. 4- and 5-bit codes are unsigned and
 * meet x directly; 8-bit codes are signed: the 256-bit kernel moves their sign onto x, the 512-bit one-row
 * kernel meets them with x + 128 (unsigned) and takes 128 times the codes' sum back off, and the 512-bit 16-row
 * kernel (tile16) flips them to codes + 128 against x and takes 128 times x's sum back off (bias8). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__BMI2__)
#define HAVE_INT8_512 1
#else
#define HAVE_INT8_512 0
#endif

typedef struct {
    /* the 256-bit kernel's forms */
    const float *scale;    /* [M, K/32]: dx, the group's max |x| / 127 */
    const float *sum;      /* [M, K/32]: dx * the group's sum of codes (for offsets and minimums) */
    const int8_t *natural; /* [M, K]: x / dx rounded, in element order (against 8-bit codes) */
    const int8_t *paired;  /* [M, K]: the same, each group's even elements then its odd ones (against nibbles) */
    const int8_t *pairs;   /* [M, K]: groups two at a time (2p, 2p + 1): 2p's even elements, 2p + 1's, 2p's odd
                            * ones, 2p + 1's (one load each against two groups' nibbles); a last odd group as paired */
    const float *scale4;   /* [M, K/32 * 4]: dx four times a group (a pair's 8 lanes as its dot's int32 lanes) */
    /* the 512-bit build's 16-row kernel (tile16) reads scale, sum, natural and paired, and: */
    const int32_t *bias8;  /* [M, K/32]: -128 times the group's sum of codes (8-bit codes are flipped to unsigned) */
    /* the 512-bit kernel's: K in blocks of four groups (the last of t <= 4), each block's rows side by side so
     * that a block of every row is one run (64-byte aligned where the buffers are), each row's part of it
     * two runs of t * 16 codes */
    int64_t rows;         /* M */
    const int8_t *quad4;  /* a block's groups' even elements, then their odd ones (against nibbles) */
    const uint8_t *quad8; /* codes + 128, a block's groups' first 16, then their last 16 (8-bit codes) */
    const float *consts4; /* t * 4 lanes of dx (four a group, as the int32 lanes of its sums), then t * 4 of
                           * its sum in a group's first lane, 0 in the other three */
    /* the residual pass (quantize_residuals), read by tile16: a row's R groups of largest dx again, as what
     * their int8 rounding left (x - q dx), itself rounded to int8 against its own max / 127 */
    int residual;                /* R: groups a row carries it for, 0 to MAX_RESIDUAL_GROUPS */
    const float *res_scale;      /* [M, R]: the residual's dx */
    const float *res_sum;        /* [M, R]: dx * its codes' sum */
    const int32_t *res_bias8;    /* [M, R]: -128 times its codes' sum */
    const int8_t *res_natural;   /* [M, R, 32]: its codes in element order */
    const int8_t *res_paired;    /* [M, R, 32]: even elements, then odd */
    const int32_t *res_pairs;    /* per FAST_ROWS rows (PAIR_INTS): their slots' groups in order, then K / 32; the
                                  * slots (m * R + j) in that order; their rows m within the block (kept,
                                  * so that tile16 divides by nothing) */
} qx_t;

/* An int8 group of 32 rounds each value to a multiple of its largest / 127, so one large value (the residual
 * stream's few outlier channels) makes the step coarse for the other 31, and that group carries most of a
 * row's rounding error. So the layers' input takes a second int8 pass over what the first left in each row's
 * few groups of largest step (EngineConfig.cpu_int8_residual_groups, whose help has the agreement it buys):
 * tile16 reads it while those groups' codes are in registers, 8 more dot products per (group, row) pair. */
#define MAX_RESIDUAL_GROUPS 4

/* A block of FAST_ROWS rows' (group, slot, row) triples of the residual pass, and the end mark. */
#define PAIR_INTS (3 * FAST_ROWS * MAX_RESIDUAL_GROUPS + 1)
/* Bytes of codes and floats of constants quantize_x writes for M rows of K. */
#define QX_CODE_BYTES(M, K) (4 * (M) * (K) + 64 * (M) * MAX_RESIDUAL_GROUPS)
#define QX_CONST_FLOATS(M, K) \
    (12 * (M) * ((K) / 32) + 4 * (M) * MAX_RESIDUAL_GROUPS + ((M) / FAST_ROWS + 1) * PAIR_INTS)

/* The residual pass of M rows over R groups each into codes [2, M, R, 32] and consts (4 M R, then PAIR_INTS a block
 * of FAST_ROWS rows), after quantize_x's first pass set qx->scale: each row's groups of largest dx (the lower
 * index first among equals; none whose dx is 0), and the int8 codes of what the first pass left of them. A slot
 * left without a group is written nowhere but the group list: no pair reads it. */
static void quantize_residuals(int64_t M, int64_t K, int R, const float *x, int8_t *codes, float *consts, qx_t *qx) {
    const int64_t groups = K / 32;
    int32_t *group = (int32_t *)consts, *bias8 = group + M * R;
    float *scale = consts + 2 * M * R, *sum = consts + 3 * M * R;
    int8_t *natural = codes, *paired = codes + M * R * 32;
    qx->residual = R, qx->res_bias8 = bias8, qx->res_scale = scale, qx->res_sum = sum;
    qx->res_natural = natural, qx->res_paired = paired;
    for (int64_t m = 0; m < M; m++) {
        const float *dx = qx->scale + m * groups;
        float top[MAX_RESIDUAL_GROUPS];
        for (int64_t j = 0; j < R; j++) top[j] = 0.0f, group[m * R + j] = (int32_t)groups;
        for (int64_t g = 0; g < groups; g++) {
            int64_t j = R;
            while (j > 0 && dx[g] > top[j - 1]) j--; /* strictly larger: among equals the earlier stays ahead */
            for (int64_t k = R - 1; k > j; k--) top[k] = top[k - 1], group[m * R + k] = group[m * R + k - 1];
            if (j < R) top[j] = dx[g], group[m * R + j] = (int32_t)g;
        }
        for (int64_t j = 0; j < R; j++) {
            const int64_t at = m * R + j;
            if (group[at] == groups) continue; /* an unused slot: no pair reads it */
            const float *v = x + m * K + group[at] * 32;
            const float d = top[j], inv = 1.0f / d; /* as the first pass: x * (1 / dx), rounded to nearest even */
            float r[32], rmax = 0.0f;
            for (int i = 0; i < 32; i++) {
                r[i] = v[i] - nearbyintf(v[i] * inv) * d;
                rmax = fabsf(r[i]) > rmax ? fabsf(r[i]) : rmax;
            }
            const float d2 = rmax / 127.0f, inv2 = d2 > 0.0f ? 1.0f / d2 : 0.0f;
            int total = 0;
            for (int i = 0; i < 32; i++) { /* clamped: 1 / d2 overflows where rmax is below about 4e-37 */
                const int8_t q = (int8_t)(int)fminf(fmaxf(nearbyintf(r[i] * inv2), -127.0f), 127.0f);
                natural[at * 32 + i] = q, paired[at * 32 + (i & 1) * 16 + i / 2] = q;
                total += q;
            }
            scale[at] = d2, sum[at] = d2 * (float)total, bias8[at] = -128 * total;
        }
    }
    int32_t *pairs = (int32_t *)consts + 4 * M * R; /* each block's (group, slot) pairs in group order */
    for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {
        int32_t *order = pairs + m0 / FAST_ROWS * PAIR_INTS, *slot = order + FAST_ROWS * MAX_RESIDUAL_GROUPS + 1;
        int32_t *row = slot + FAST_ROWS * MAX_RESIDUAL_GROUPS;
        int count = 0;
        for (int64_t at = m0 * R; at < (m0 + FAST_ROWS < M ? m0 + FAST_ROWS : M) * R; at++) {
            if (group[at] == groups) continue;
            int i = count++;
            for (; i > 0 && order[i - 1] > group[at]; i--) order[i] = order[i - 1], slot[i] = slot[i - 1], row[i] = row[i - 1];
            order[i] = group[at], slot[i] = (int32_t)at, row[i] = (int32_t)(at / R - m0);
        }
        order[count] = (int32_t)groups;
    }
    qx->res_pairs = pairs;
}

/* Quantise M rows of x [M, K] (K a multiple of 32) into codes [4, M, K] and consts [12, M, K / 32]: the forms
 * this build's kernels read, which qx then points at (the 512-bit build's quad forms only if `quads`: for the
 * layouts tile16 does not read). */
static void quantize_groups(int64_t M, int64_t K, const float *x, int8_t *codes, float *consts, qx_t *qx, int quads) {
    const int64_t groups = K / 32;
    int8_t *first = codes, *second = codes + M * K, *third = codes + 2 * M * K, *fourth = codes + 3 * M * K;
    memset(qx, 0, sizeof *qx);
#if HAVE_INT8_512
    /* tile16's scale, sum and bias8 first (3 M groups), then consts4 in 8 M groups of the 9 left: 64-byte
     * aligned where 15 floats are to spare */
    float *scale = consts, *sum = consts + M * groups, *after = consts + 3 * M * groups;
    int32_t *bias8 = (int32_t *)(consts + 2 * M * groups);
    float *consts4 = M * groups >= 15 ? (float *)(((uintptr_t)after + 63) & ~(uintptr_t)63) : after;
    qx->rows = M, qx->quad4 = first, qx->quad8 = (const uint8_t *)second, qx->consts4 = consts4;
    qx->scale = scale, qx->sum = sum, qx->bias8 = bias8, qx->paired = third, qx->natural = fourth;
#else
    (void)fourth;
    float *scale = consts, *sum = consts + M * groups, *scale4 = consts + 2 * M * groups;
    qx->scale = scale, qx->sum = sum, qx->natural = first, qx->paired = second, qx->pairs = third;
    qx->scale4 = scale4;
#endif
#if !HAVE_INT8_512 && defined(__AVX2__)
    /* the loop below, 8 lanes at a time: the same operations (|x|'s maximum, amax / 127, 1 / d, x * inv rounded
     * to nearest even as nearbyintf does), so the same codes and constants */
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + m * K + g * 32;
            const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            __m256 top = _mm256_setzero_ps();
            for (int j = 0; j < 32; j += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(v + j), magnitude));
            __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            __m256i q32[4];
            for (int j = 0; j < 4; j++) q32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), _mm256_set1_ps(inv)));
            /* int32 -> int8 in element order: the packs interleave 128-bit lanes, the permute restores them */
            const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
            const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(q16a, q16b), _mm256_set1_epi16(1));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            const int total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
            scale[m * groups + g] = d;
            sum[m * groups + g] = d * (float)total;
            _mm256_storeu_si256((__m256i *)(first + m * K + g * 32), q8);
            /* even elements, then odd: bytes 0, 2, .., 30 then 1, 3, .., 31 (shuffles within 128-bit lanes) */
            const __m256i split = _mm256_shuffle_epi8(q8, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
            const __m256i paired = _mm256_permute4x64_epi64(split, 0xD8);
            _mm256_storeu_si256((__m256i *)(second + m * K + g * 32), paired);
            int8_t *pair = third + m * K + g / 2 * 64;
            if (g + 1 == groups && groups % 2) {
                _mm256_storeu_si256((__m256i *)pair, paired);
            } else {
                _mm_storeu_si128((__m128i *)(pair + g % 2 * 16), _mm256_castsi256_si128(paired));
                _mm_storeu_si128((__m128i *)(pair + 32 + g % 2 * 16), _mm256_extracti128_si256(paired, 1));
            }
            _mm_storeu_ps(scale4 + (m * groups + g) * 4, _mm_set1_ps(d));
        }
    return;
#endif
#if HAVE_INT8_512
    /* the loop below, 16 lanes at a time (the same |x| maximum, amax / 127, 1 / d, x * inv rounded to nearest
     * even as nearbyintf does: the same codes and constants), into the forms tile16 reads */
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + m * K + g * 32;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            /* max(|v|, top) keeps top where |v| is NaN, as the scalar comparison does */
            const __m512 top = _mm512_max_ps(_mm512_and_ps(v1, magnitude), _mm512_max_ps(_mm512_and_ps(v0, magnitude), _mm512_setzero_ps()));
            const float amax = _mm512_reduce_max_ps(top);
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            const int total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            int8_t *natural = fourth + m * K + g * 32, *paired = third + m * K + g * 32;
            _mm_storeu_si128((__m128i *)natural, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(natural + 16), _mm512_cvtepi32_epi8(q1));
            _mm_storeu_si128((__m128i *)paired, _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, evens, q1)));
            _mm_storeu_si128((__m128i *)(paired + 16), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(q0, odds, q1)));
            scale[m * groups + g] = d;
            sum[m * groups + g] = d * (float)total;
            bias8[m * groups + g] = -128 * total;
            if (!quads) continue;
            const int8_t *q = natural;
            const int64_t b = g / 4, t = groups - 4 * b < 4 ? groups - 4 * b : 4, j = g - 4 * b;
            const int64_t at = b * M * 128 + m * 32 * t + 16 * j, c = b * M * 32 + m * 8 * t + 4 * j;
            for (int i = 0; i < 16; i++) {
                first[at + i] = q[2 * i], first[at + 16 * t + i] = q[2 * i + 1];
                second[at + i] = (int8_t)(uint8_t)(q[i] + 128), second[at + 16 * t + i] = (int8_t)(uint8_t)(q[16 + i] + 128);
            }
            for (int i = 0; i < 4; i++) consts4[c + i] = d, consts4[c + 4 * t + i] = i == 0 ? d * (float)total : 0.0f;
        }
#else
    (void)quads;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + m * K + g * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int total = 0;
            int8_t q[32];
            for (int j = 0; j < 32; j++) {
                q[j] = (int8_t)(int)nearbyintf(v[j] * inv);
                total += q[j];
            }
            scale[m * groups + g] = d;
            sum[m * groups + g] = d * (float)total;
            const int lone = g + 1 == groups && groups % 2;
            for (int j = 0; j < 32; j++) {
                first[m * K + g * 32 + j] = q[j];
                second[m * K + g * 32 + (j & 1) * 16 + j / 2] = q[j];
                third[m * K + g / 2 * 64 + (j & 1) * (lone ? 16 : 32) + (lone ? 0 : g % 2 * 16) + j / 2] = q[j];
            }
            for (int i = 0; i < 4; i++) scale4[(m * groups + g) * 4 + i] = d;
        }
#endif
}

/* quantize_groups, then quantize_residuals over `residual` groups a row (none if 0) after its codes and
 * constants: QX_CODE_BYTES and QX_CONST_FLOATS in all. */
static void quantize_x(int64_t M, int64_t K, const float *x, int8_t *codes, float *consts, qx_t *qx, int quads,
                       int residual) {
    quantize_groups(M, K, x, codes, consts, qx, quads);
    residual = residual < MAX_RESIDUAL_GROUPS ? residual : MAX_RESIDUAL_GROUPS;
    if (residual > 0) quantize_residuals(M, K, residual, x, codes + 4 * M * K, consts + 12 * M * (K / 32), qx);
}

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_INT8_DOT 1
/* Eight int32 sums of four u8 x s8 products each. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); /* |sums| < 2^15: no saturation */
#endif
}

/* A group's 32 unsigned codes, even elements then odd (4 bits; with `high`, 5 bits: element k's fifth bit is bit
 * k of the group's 32-bit word). */
static inline __m256i nibble_codes(const uint8_t *lo, const uint8_t *high) {
    const __m128i b = _mm_loadu_si128((const __m128i *)lo);
    __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0xF));
    if (high != NULL) {
        uint32_t word;
        memcpy(&word, high, 4);
        /* byte j of the even half is element 2j: bit 2(j % 4) of the word's byte j / 4; of the odd half, 2j + 1 */
        const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 0, 0, 0, 1, 1, 1, 1,
                                              2, 2, 2, 2, 3, 3, 3, 3);
        const __m256i bit = _mm256_setr_epi8(1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64, 2, 8, 32,
                                             -128, 2, 8, 32, -128, 2, 8, 32, -128, 2, 8, 32, -128);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)word), pick), bit), bit);
        c = _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return c;
}

/* Row n of W (groups of 32; 4, 5 or 8 bits) against up to FAST_ROWS rows of int8 x. */
static inline __attribute__((always_inline)) void rows_dot_int8(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                                const qx_t *qx, int64_t m0, float *out) {
    const int64_t groups = K / 32;
    const int bits = w->bits;
    row_constants_t sc = row_constants(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups);
    row_constants_t mc;
    if (w->m_half) mc = row_constants(w->m_half, w->m_sub, 0, w->m_per, n, groups);
    const int shifted = w->m_half != NULL || w->offset != 0;
    __m256 acc[FAST_ROWS];
    float rest[FAST_ROWS];
    for (int64_t m = 0; m < M; m++) {
        acc[m] = _mm256_setzero_ps();
        rest[m] = 0.0f;
    }
    const int8_t *x = (bits == 8 ? qx->natural : qx->paired) + m0 * K;
    const float *dx = qx->scale + m0 * groups, *xs = qx->sum + m0 * groups;
    for (int64_t g = 0; g < groups; g++) {
        const float s = row_constant(&sc, g);
        __m256i codes, sign = _mm256_setzero_si256();
        if (bits == 8) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)((const int8_t *)w->low + n * K + g * 32));
            codes = _mm256_sign_epi8(c, c);
            sign = c;
        } else {
            codes = nibble_codes(w->low + n * (K / 2) + g * 16, bits == 5 ? w->high + n * (K / 8) + g * 4 : NULL);
        }
        for (int64_t m = 0; m < M; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + m * K + g * 32));
            if (bits == 8) xv = _mm256_sign_epi8(xv, sign);
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(codes, xv));
            acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(s * dx[m * groups + g]), acc[m]);
        }
        if (shifted) {
            float shift = -s * (float)w->offset;
            if (w->m_half) shift += row_constant(&mc, g);
            for (int64_t m = 0; m < M; m++) rest[m] += shift * xs[m * groups + g];
        }
    }
    for (int64_t m = 0; m < M; m++) out[m] = rest[m] + hsum256(acc[m]);
}

/* Whether rows_dot_int8_k reads this layout: the K-quants, whose constants are an integer a group times a float16 a
 * super-group of 256 (Q4_K, Q5_K: 4 or 5 bits in groups of 32, unsigned sub-scales and minimums; Q6_K: 6 bits in
 * groups of 16 less 32, signed sub-scales, no minimums). */
static inline int kquant_int8_reads(const layout_t *w) {
    if (w->s_sub == NULL) return 0;
    if (w->group == 32 && (w->bits == 4 || w->bits == 5))
        return w->s_per == 8 && !w->s_sub_signed && w->offset == 0 && (w->m_half == NULL || (w->m_sub != NULL && w->m_per == 8));
#if defined(__F16C__) /* rows_dot_int8_q6k is built with the F16C paths (HAVE_INT8_PLAIN) */
    return w->group == 16 && w->bits == 6 && w->s_per == 16 && w->s_sub_signed && w->offset == 32 && w->m_half == NULL;
#else
    return 0;
#endif
}

/* Row n of a 4- or 5-bit K-quant W (Q4_K, Q5_K) against up to FAST_ROWS rows of int8 x, a super-group of 256 at a
 * time: each x group of 32's constant (dx times the group's sub-scale times the super-group's float16) is formed
 * for the eight groups at once in a vector, and the minimums meet x's group sums eight groups a vector. Q4_K takes
 * rows_dot_int8_plain where it is built and Q6_K rows_dot_int8_q6k: this reads Q5_K, and Q4_K elsewhere. */
static inline __attribute__((always_inline)) void rows_dot_int8_k(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                                  const qx_t *qx, int64_t m0, float *out) {
    const int64_t groups = K / 32, supers = K / 256;
    __m256 acc[FAST_ROWS], rest[FAST_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = rest[m] = _mm256_setzero_ps();
    const int8_t *x = qx->paired + m0 * K;
    const float *dx = qx->scale + m0 * groups, *xs = qx->sum + m0 * groups;
    const uint8_t *lo = w->low + n * (K / 2);
    for (int64_t sb = 0; sb < supers; sb++) {
        float scale[FAST_ROWS][8];
        const __m128i sub = _mm_loadl_epi64((const __m128i *)((const uint8_t *)w->s_sub + n * groups + sb * 8));
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(half_to_float(w->s_half[n * supers + sb])),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sub)));
        for (int64_t m = 0; m < M; m++) _mm256_storeu_ps(scale[m], _mm256_mul_ps(s, _mm256_loadu_ps(dx + m * groups + sb * 8)));
        if (w->m_half != NULL) {
            const __m128i msub = _mm_loadl_epi64((const __m128i *)(w->m_sub + n * groups + sb * 8));
            const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(half_to_float(w->m_half[n * supers + sb])),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(msub)));
            for (int64_t m = 0; m < M; m++) rest[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs + m * groups + sb * 8), rest[m]);
        }
        for (int64_t j = 0; j < 8; j++) {
            const int64_t g = sb * 8 + j;
            const __m256i codes = nibble_codes(lo + g * 16, w->bits == 5 ? w->high + n * (K / 8) + g * 4 : NULL);
            for (int64_t m = 0; m < M; m++) {
                const __m256i dot = dot_u8s8(codes, _mm256_loadu_si256((const __m256i *)(x + m * K + g * 32)));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&scale[m][j]), acc[m]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) out[m] = hsum256(rest[m]) + hsum256(acc[m]);
}

/* rows_dot_int8 for the common layouts, 4- or 8-bit codes with a float16 constant per group (Q4_0, Q4_1, Q8_0),
 * for R weight rows [n, n + R) against M rows of x (R * M <= FAST_ROWS; out[r * M + m]). The offsets and
 * minimums against the groups' sums are one 8-wide FMA per 8 groups, first. The group loop is then loads, integer
 * dots and one FMA:
 * - 4-bit codes, two groups at a time: one 32-byte load holds both groups' nibbles, whose low halves are their
 *   even elements and high halves their odd ones; both groups' int16 dot sums are added before the one madd, so
 *   the lanes of one vector hold two groups (four each), scaled by s * dx from each weight row's spread scales
 *   (formed first) and x's (quantize_x's pairs and scale4 forms: no permutes in the loop);
 * - 8-bit codes, a group at a time into two accumulators over even and odd groups, s * dx formed first for every
 *   pair of rows.
 * Each (weight row, x row) pair sees the same arithmetic in the same order at every R and M: a row gives the same
 * result at every row count and position in the batch. */
#if defined(__F16C__)
#define HAVE_INT8_PLAIN 1
static inline int int8_plain_reads(const layout_t *w, int64_t K) {
    /* Q4_K too: its constants are an unsigned integer a group times a float16 a super-group of 8 groups */
    const int q4_k = w->bits == 4 && w->s_sub != NULL && !w->s_sub_signed && w->s_per == 8 && K % 256 == 0 &&
                     (w->m_half == NULL || (w->m_sub != NULL && w->m_per == 8));
    if (q4_k) return 1;
    return (w->bits == 8 || (w->bits == 4 && K % 64 == 0)) && w->s_sub == NULL && (w->m_half == NULL || w->m_sub == NULL);
}

/* Eight groups' constants from g (a multiple of 8) of row n: float16 each, or (a K-quant's) eight unsigned
 * integers times their super-group's float16, rounded as gguf's float32 product. */
static inline __m256 octet_constants(const uint16_t *half, const uint8_t *sub, int64_t n, int64_t groups, int64_t g) {
    if (sub == NULL) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + n * groups + g)));
    const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sub + n * groups + g))));
    return _mm256_mul_ps(_mm256_set1_ps(half_to_float(half[n * (groups / 8) + g / 8])), codes);
}

static inline __attribute__((always_inline)) void rows_dot_int8_plain(const layout_t *w, int64_t K, int64_t n,
                                                                      int64_t M, const qx_t *qx, int64_t m0,
                                                                      float *out, int64_t R) {
    const int64_t groups = K / 32, octets = groups / 8 * 8, padded = (groups + 7) / 8 * 8;
    const int eight = w->bits == 8;
    const float *dx = qx->scale + m0 * groups, *xs = qx->sum + m0 * groups;
    const __m256 offset = _mm256_set1_ps(-(float)w->offset);
    /* 8-bit codes: [R * M, padded], pair i's s * dx of each group; 4-bit: [R, groups * 4], row r's s four times a
     * group (times x's scale4 in the loop: the same product) */
    float sdx[FAST_ROWS * padded * (eight ? 1 : 4)];
    __m256 acc[FAST_ROWS], odd[FAST_ROWS], shift[FAST_ROWS];
    float rest[FAST_ROWS];
    for (int64_t i = 0; i < R * M; i++) {
        acc[i] = odd[i] = shift[i] = _mm256_setzero_ps();
        rest[i] = 0.0f;
    }
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *sh = w->s_half + (n + r) * groups;
        const uint16_t *mh = w->m_half != NULL ? w->m_half + (n + r) * groups : NULL;
        int64_t g = 0;
        for (; g < octets; g += 8) {
            const __m256 sv = octet_constants(w->s_half, (const uint8_t *)w->s_sub, n + r, groups, g);
            __m256 hv = _mm256_mul_ps(sv, offset);
            if (mh != NULL) hv = _mm256_add_ps(hv, octet_constants(w->m_half, w->m_sub, n + r, groups, g));
            for (int64_t m = 0; m < M; m++) {
                const int64_t i = r * M + m;
                if (eight) _mm256_storeu_ps(sdx + i * padded + g, _mm256_mul_ps(sv, _mm256_loadu_ps(dx + m * groups + g)));
                shift[i] = _mm256_fmadd_ps(hv, _mm256_loadu_ps(xs + m * groups + g), shift[i]);
            }
            if (!eight)
                for (int j = 0; j < 4; j++) /* groups g + 2j, g + 2j + 1: four lanes each */
                    _mm256_storeu_ps(sdx + (r * groups + g + 2 * j) * 4,
                                     _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1,
                                                                                    2 * j + 1, 2 * j + 1, 2 * j + 1)));
        }
        for (; g < groups; g++) {
            const float sg = half_to_float(sh[g]);
            const float hg = -sg * (float)w->offset + (mh != NULL ? half_to_float(mh[g]) : 0.0f);
            for (int64_t m = 0; m < M; m++) {
                if (eight) sdx[(r * M + m) * padded + g] = sg * dx[m * groups + g];
                rest[r * M + m] += hg * xs[m * groups + g];
            }
            if (!eight) _mm_storeu_ps(sdx + (r * groups + g) * 4, _mm_set1_ps(sg));
        }
    }
    if (eight) {
        const int8_t *x = qx->natural + m0 * K;
        for (int64_t g = 0; g < groups; g += 2) {
            const int pair = g + 1 < groups;
            for (int64_t r = 0; r < R; r++) {
                const int8_t *row = (const int8_t *)w->low + (n + r) * K + g * 32;
                const __m256i s0 = _mm256_loadu_si256((const __m256i *)row), c0 = _mm256_sign_epi8(s0, s0);
                __m256i s1 = _mm256_setzero_si256(), c1 = s1; /* the codes' signs, and their magnitudes */
                if (pair) s1 = _mm256_loadu_si256((const __m256i *)(row + 32)), c1 = _mm256_sign_epi8(s1, s1);
                for (int64_t m = 0; m < M; m++) {
                    const int64_t i = r * M + m;
                    const int8_t *xm = x + m * K + g * 32;
                    const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xm), s0);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c0, x0)), _mm256_broadcast_ss(sdx + i * padded + g), acc[i]);
                    if (pair) {
                        const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xm + 32)), s1);
                        odd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(c1, x1)), _mm256_broadcast_ss(sdx + i * padded + g + 1), odd[i]);
                    }
                }
            }
        }
    } else {
        /* x in pairs of groups: one load of each row's even elements of both groups, one of its odd ones, and
         * one of its scales, shared by the R weight rows */
        const int8_t *x = qx->pairs + m0 * K;
        const float *dx4 = qx->scale4 + m0 * groups * 4;
        const __m256i low4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
        for (int64_t g = 0; g < groups; g += 2) {
            __m256i lo[FAST_ROWS], hi[FAST_ROWS];
            for (int64_t r = 0; r < R; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w->low + (n + r) * (K / 2) + g * 16));
                lo[r] = _mm256_and_si256(v, low4), hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            for (int64_t m = 0; m < M; m++) {
                const int8_t *xm = x + m * K + g * 32;
                const __m256i evens = _mm256_loadu_si256((const __m256i *)xm);
                const __m256i odds = _mm256_loadu_si256((const __m256i *)(xm + 32));
                const __m256 d = _mm256_loadu_ps(dx4 + m * groups * 4 + g * 4);
                for (int64_t r = 0; r < R; r++) {
                    const int64_t i = r * M + m;
                    /* |sums| <= 4 * 15 * 127: the int16 adds cannot saturate */
                    const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], evens), _mm256_maddubs_epi16(hi[r], odds));
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones));
                    const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(sdx + (r * groups + g) * 4), d);
                    acc[i] = _mm256_fmadd_ps(dot, scale, acc[i]);
                }
            }
        }
    }
    for (int64_t i = 0; i < R * M; i++) out[i] = (rest[i] + hsum256(shift[i])) + hsum256(_mm256_add_ps(acc[i], odd[i]));
}
#else
#define HAVE_INT8_PLAIN 0
#endif

#if HAVE_INT8_512
#define CHUNK_GROUPS 64 /* groups of a row whose constants are spread at once (a multiple of 16) */

/* Row n's constants of groups [g0, g0 + count) (count <= CHUNK_GROUPS), four lanes each as a block's sums
 * take them: scale4[4j + i] = the scale of group g0 + j, shift4 = minimum - scale * offset; 0 past count, to
 * the next multiple of 16 groups. */
static inline void spread_constants(const layout_t *w, int64_t n, int64_t groups, int64_t g0, int64_t count,
                                    const row_constants_t *sc, const row_constants_t *mc, float *scale4,
                                    float *shift4) {
    if (w->s_sub == NULL && (w->m_half == NULL || w->m_sub == NULL)) { /* float16 per group */
        const uint16_t *sh = w->s_half + n * groups + g0, *mh = w->m_half ? w->m_half + n * groups + g0 : NULL;
        const __m512 off = _mm512_set1_ps((float)-w->offset);
        for (int64_t j = 0; j < count; j += 16) {
            const __mmask16 k = count - j >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j)) - 1);
            const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sh + j));
            __m512 hv = _mm512_mul_ps(sv, off);
            if (mh) hv = _mm512_add_ps(hv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mh + j)));
            for (int q = 0; q < 4; q++) {
                const __m512i spread = _mm512_add_epi32(_mm512_set1_epi32(4 * q), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
                _mm512_storeu_ps(scale4 + 4 * (j + 4 * q), _mm512_permutexvar_ps(spread, sv));
                _mm512_storeu_ps(shift4 + 4 * (j + 4 * q), _mm512_permutexvar_ps(spread, hv));
            }
        }
        return;
    }
    for (int64_t j = 0; j < (count + 15) / 16 * 16; j++) {
        const float s = j < count ? row_constant(sc, g0 + j) : 0.0f;
        const float h = j < count ? -s * (float)w->offset + (w->m_half ? row_constant(mc, g0 + j) : 0.0f) : 0.0f;
        for (int i = 0; i < 4; i++) scale4[4 * j + i] = s, shift4[4 * j + i] = h;
    }
}

/* out[0..4) = the sums of the lanes of a, b, c and d: one transposing tree for four rows. */
static inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    /* 128-bit lanes: a's, b's, c's and d's four partial sums */
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, v)));
}

/* Rows [m0, m0 + M) of x against row n's block of groups [g, g + t) (t <= 4), added into acc. BITS, SHIFTED and,
 * outside the last block, t are constants where it is inlined, so the row loop has no branches. */
static inline __attribute__((always_inline)) void block_512(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                            const qx_t *qx, int64_t m0, int64_t g, int t,
                                                            const int BITS, const int SHIFTED,
                                                            const float *scale4, const float *shift4,
                                                            __m512 *acc) {
    const __m512i zero = _mm512_setzero_si512();
    const __mmask64 run = t == 4 ? ~0ULL : (1ULL << (16 * t)) - 1; /* t groups' 16 bytes */
    const __m512 sv = _mm512_loadu_ps(scale4), hv = _mm512_loadu_ps(shift4);
    __m512i a, b, start = zero;
    if (BITS == 8) {
        const int8_t *c = (const int8_t *)w->low + n * K + g * 32;
        __m512i r1, r2;
        if (t == 4) {
            r1 = _mm512_loadu_si512((const void *)c), r2 = _mm512_loadu_si512((const void *)(c + 64));
        } else {
            r1 = _mm512_maskz_loadu_epi8(t >= 2 ? ~0ULL : 0xFFFFFFFFULL, c);
            r2 = _mm512_maskz_loadu_epi8(t == 3 ? 0xFFFFFFFFULL : 0, c + 64);
        }
        a = _mm512_shuffle_i64x2(r1, r2, _MM_SHUFFLE(2, 0, 2, 0)); /* each group's first 16 */
        b = _mm512_shuffle_i64x2(r1, r2, _MM_SHUFFLE(3, 1, 3, 1)); /* and last 16 */
        const __m512i bias = _mm512_set1_epi8((char)0x80);
        start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, bias, a), bias, b));
    } else {
        const uint8_t *lo = w->low + n * (K / 2) + g * 16;
        const __m512i r = t == 4 ? _mm512_loadu_si512((const void *)lo) : _mm512_maskz_loadu_epi8(run, lo);
        const __m512i m4 = _mm512_set1_epi8(0xF);
        a = _mm512_and_si512(r, m4);
        b = _mm512_and_si512(_mm512_srli_epi16(r, 4), m4);
        if (BITS == 5) { /* element k's fifth bit is bit k of its group's word: even bits to a, odd to b */
            uint64_t words[2] = {0, 0};
            memcpy(words, w->high + n * (K / 8) + g * 4, (size_t)(4 * t));
            const uint64_t even = 0x5555555555555555ULL;
            const __mmask64 ke = _pext_u64(words[0], even) | (_pext_u64(words[1], even) << 32);
            const __mmask64 ko = _pext_u64(words[0], ~even) | (_pext_u64(words[1], ~even) << 32);
            const __m512i sixteen = _mm512_set1_epi8(0x10); /* + 16 sets bit 4 of a nibble */
            a = _mm512_mask_add_epi8(a, ke, a, sixteen);
            b = _mm512_mask_add_epi8(b, ko, b, sixteen);
        }
    }
    /* this block of row m0: its codes and constants; rows follow at 32 t bytes and 8 t floats */
    const int64_t at = g / 4 * qx->rows * 128 + m0 * 32 * t, second = 16 * t;
    const float *c = qx->consts4 + g / 4 * qx->rows * 32 + m0 * 8 * t;
    const int8_t *x4 = qx->quad4 + at;
    const uint8_t *x8 = qx->quad8 + at;
    const __mmask16 lanes = (__mmask16)((1u << (4 * t)) - 1);
#pragma GCC unroll 8
    for (int64_t m = 0; m < M; m++) {
        __m512i s;
        __m512 d, xs = _mm512_setzero_ps();
        if (t == 4) {
            if (BITS == 8) {
                s = _mm512_dpbusd_epi32(start, _mm512_loadu_si512((const void *)(x8 + 128 * m)), a);
                s = _mm512_dpbusd_epi32(s, _mm512_loadu_si512((const void *)(x8 + 128 * m + 64)), b);
            } else {
                s = _mm512_dpbusd_epi32(start, a, _mm512_loadu_si512((const void *)(x4 + 128 * m)));
                s = _mm512_dpbusd_epi32(s, b, _mm512_loadu_si512((const void *)(x4 + 128 * m + 64)));
            }
            d = _mm512_loadu_ps(c + 32 * m);
            if (SHIFTED) xs = _mm512_loadu_ps(c + 32 * m + 16);
        } else {
            const int64_t r = 32 * t * m;
            if (BITS == 8) {
                s = _mm512_dpbusd_epi32(start, _mm512_maskz_loadu_epi8(run, x8 + r), a);
                s = _mm512_dpbusd_epi32(s, _mm512_maskz_loadu_epi8(run, x8 + r + second), b);
            } else {
                s = _mm512_dpbusd_epi32(start, a, _mm512_maskz_loadu_epi8(run, x4 + r));
                s = _mm512_dpbusd_epi32(s, b, _mm512_maskz_loadu_epi8(run, x4 + r + second));
            }
            d = _mm512_maskz_loadu_ps(lanes, c + 8 * t * m);
            if (SHIFTED) xs = _mm512_maskz_loadu_ps(lanes, c + 8 * t * m + 4 * t);
        }
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), d), sv, acc[m]);
        if (SHIFTED) acc[m] = _mm512_fmadd_ps(hv, xs, acc[m]);
    }
}

/* The sum of a's lanes in reduce4's order: a row's result does not depend on how many rows it came with. */
static inline float reduce1(__m512 a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_permute_ps(q, _MM_SHUFFLE(2, 3, 0, 1)));
    q = _mm_add_ps(q, _mm_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(q);
}

/* Row n of W (groups of 32; 4, 5 or 8 bits) against up to FAST_ROWS rows of int8 x, four groups a 512-bit
 * step: the weight's codes are unpacked and its constants spread once a block, then each row costs two
 * dot-product instructions (each int32 lane sums 8 products of one group), one conversion, a multiply and two
 * FMAs (its scales; the shift against its group sums). The lanes of group j are [4j, 4j + 4) in both
 * operands: nibble bytes and quad4 hold even elements in one vector and odd in the other; 8-bit codes are
 * regrouped by 128-bit lane into first and last halves, as quad8. */
static inline __attribute__((always_inline)) void rows_dot_int8_512(const layout_t *w, int64_t K, int64_t n,
                                                                    int64_t M, const qx_t *qx, int64_t m0,
                                                                    float *out, const int BITS,
                                                                    const int SHIFTED) {
    const int64_t groups = K / 32;
    row_constants_t sc = row_constants(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups);
    row_constants_t mc = sc;
    if (w->m_half) mc = row_constants(w->m_half, w->m_sub, 0, w->m_per, n, groups);
    __m512 acc[FAST_ROWS];
#pragma GCC unroll 8
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    float scale4[4 * CHUNK_GROUPS], shift4[4 * CHUNK_GROUPS];
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
        const int64_t end = groups - g0 < CHUNK_GROUPS ? groups : g0 + CHUNK_GROUPS;
        spread_constants(w, n, groups, g0, end - g0, &sc, &mc, scale4, shift4);
        int64_t g = g0;
        for (; g + 4 <= end; g += 4)
            block_512(w, K, n, M, qx, m0, g, 4, BITS, SHIFTED, scale4 + 4 * (g - g0), shift4 + 4 * (g - g0), acc);
        if (g < end)
            block_512(w, K, n, M, qx, m0, g, (int)(end - g), BITS, SHIFTED, scale4 + 4 * (g - g0),
                      shift4 + 4 * (g - g0), acc);
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) reduce4(acc[m], acc[m + 1], acc[m + 2], acc[m + 3], out + m);
    for (; m < M; m++) out[m] = reduce1(acc[m]);
}

/* Rows [n0, n1) of y = x W^T from int8 x with the 512-bit kernel, for one kind of code. */
#define ROWS_MATMUL_512(NAME, BITS, SHIFTED)                                                                   \
    static void NAME(const layout_t *w, int64_t M, int64_t K, const qx_t *qx, float *y, int64_t ldy,          \
                     int64_t n0, int64_t n1) {                                                                 \
        float out[FAST_ROWS];                                                                                  \
        for (int64_t n = n0; n < n1; n++)                                                                      \
            for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {                                                    \
                const int64_t rows = M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS;                                  \
                BY_ROW_COUNT(rows_dot_int8_512, rows, BITS, SHIFTED)                                           \
                for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];                             \
            }                                                                                                  \
    }

/* ---- The 16-row kernel (tile16): Q4_0, Q4_1 and Q8_0 (4- or 8-bit codes, a float16 constant a group) on
 * AVX-512 VNNI. 16 weight rows at a time, one int32 lane a weight row: each row's 64 bytes of codes (four
 * groups of nibbles, or two of 8-bit codes) are transposed in registers so that a vector holds the same four
 * codes of all 16 rows, and x's four matching int8 values are broadcast against it. Eight dot-product
 * instructions give one group's whole integer sum for the 16 rows; its float work (convert, s * dx, FMA, and
 * the shift against the group's sum) is then one vector op each for 16 rows, where the one-row kernel pays it
 * per row and four lanes a group. Each (weight row, x row) result is its groups' sum in order, whatever the
 * row count and the row's place among the 16: a row's result does not depend on the rows it came with. */
static inline int tile16_reads(const layout_t *w) {
    return (w->bits == 4 || w->bits == 8) && w->s_sub == NULL && (w->m_half == NULL || w->m_sub == NULL);
}

/* r[j]'s lane i becomes r[i]'s lane j, for 16 vectors of 16 int32 lanes: pairs, quads, then 128-bit lanes. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* 128-bit lane L of b[4i + e]: element 4L + e of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88), d0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xDD);
        const __m512i c1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88), d1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xDD);
        r[e] = _mm512_shuffle_i32x4(c0, c1, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(d0, d1, 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(c0, c1, 0xDD);
        r[12 + e] = _mm512_shuffle_i32x4(d0, d1, 0xDD);
    }
}

/* The scales (st) and shifts (ht: minimum - scale * offset) of groups [g0, g0 + count) of the 16 rows, one vector
 * a group, lane r the row's. */
static inline __attribute__((always_inline)) void tile16_constants(const layout_t *w, int64_t groups, const int64_t *row,
                                                                   int64_t g0, int count, const int SHIFTED,
                                                                   __m512 *st, __m512 *ht) {
    const __mmask16 k = count >= 16 ? 0xFFFF : (__mmask16)((1u << count) - 1);
    const __m512 off = _mm512_set1_ps((float)-w->offset);
    __m512i s[16], h[16];
    for (int r = 0; r < 16; r++) {
        const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, w->s_half + row[r] * groups + g0));
        s[r] = _mm512_castps_si512(sv);
        if (SHIFTED) {
            __m512 hv = _mm512_mul_ps(sv, off);
            if (w->m_half) hv = _mm512_add_ps(hv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, w->m_half + row[r] * groups + g0)));
            h[r] = _mm512_castps_si512(hv);
        }
    }
    transpose16(s);
    for (int j = 0; j < 16; j++) st[j] = _mm512_castsi512_ps(s[j]);
    if (SHIFTED) {
        transpose16(h);
        for (int j = 0; j < 16; j++) ht[j] = _mm512_castsi512_ps(h[j]);
    }
}

/* Rows [n0, n0 + rows) of W (rows <= 16) against rows [m0, m0 + M) of int8 x (M <= FAST_ROWS), into y. */
static inline __attribute__((always_inline)) void tile16_int8(const layout_t *w, int64_t K, int64_t n0, int64_t rows,
                                                              int64_t M, const qx_t *qx, int64_t m0, float *y,
                                                              int64_t ldy, const int BITS, const int SHIFTED) {
    const int64_t groups = K / 32, row_bytes = BITS == 8 ? K : K / 2, group_bytes = BITS == 8 ? 32 : 16;
    const int per = BITS == 8 ? 2 : 4; /* groups in a row's 64 bytes */
    int64_t row[16];                   /* past the last row: the last again (its lanes are not stored) */
    for (int r = 0; r < 16; r++) row[r] = n0 + (r < rows ? r : rows - 1);
    __m512 acc[FAST_ROWS], sh[FAST_ROWS];
#pragma GCC unroll 8
    for (int64_t m = 0; m < M; m++) acc[m] = sh[m] = _mm512_setzero_ps();
    const int8_t *xq = (BITS == 8 ? qx->natural : qx->paired) + m0 * K;
    const float *dx = qx->scale + m0 * groups, *xs = qx->sum + m0 * groups;
    const int32_t *bias = qx->bias8 + m0 * groups;
    /* the residual pass: this block's (group, slot) pairs in group order (quantize_residuals; no group without
     * it); each row's sum of them apart from acc (indexed by a row known only at run time, it stays in memory) */
    const int R = qx->residual;
    const int32_t no_pairs = (int32_t)groups;
    const int32_t *pair_group = R ? qx->res_pairs + m0 / FAST_ROWS * PAIR_INTS : &no_pairs;
    const int32_t *pair_at = R ? pair_group + FAST_ROWS * MAX_RESIDUAL_GROUPS + 1 : NULL;
    const int32_t *pair_row = R ? pair_at + FAST_ROWS * MAX_RESIDUAL_GROUPS : NULL;
    const int8_t *res_codes = BITS == 8 ? qx->res_natural : qx->res_paired;
    int next = 0;
    __m512 res_acc[FAST_ROWS];
    for (int64_t m = 0; m < M; m++) res_acc[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0xF), flip = _mm512_set1_epi8((char)0x80);
    __m512 st[16], ht[16];
    if (m0 == 0) { /* the next 16 rows' constants: two more streams the hardware prefetchers are slow to follow */
        const char *s_next = (const char *)(w->s_half + (n0 + 16) * groups);
        const char *m_next = w->m_half != NULL ? (const char *)(w->m_half + (n0 + 16) * groups) : NULL;
        for (int64_t b = 0; b < 16 * groups * 2; b += 64) {
            _mm_prefetch(s_next + b, _MM_HINT_T0);
            if (m_next != NULL) _mm_prefetch(m_next + b, _MM_HINT_T0);
        }
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int count = groups - g0 < 16 ? (int)(groups - g0) : 16;
        tile16_constants(w, groups, row, g0, count, SHIFTED, st, ht);
        for (int gb = 0; gb < count; gb += per) {
            const int t = count - gb < per ? count - gb : per;
            const __mmask64 k = t == per ? ~0ULL : (1ULL << (t * group_bytes)) - 1;
            __m512i T[16]; /* T[j] lane r: dword j of row r's 64 bytes */
            for (int r = 0; r < 16; r++) {
                const uint8_t *at = w->low + row[r] * row_bytes + (g0 + gb) * group_bytes;
                T[r] = _mm512_maskz_loadu_epi8(k, at);
                if (m0 == 0) _mm_prefetch((const char *)(at + 16 * row_bytes), _MM_HINT_T0); /* the next 16 rows */
            }
            transpose16(T);
            for (int gi = 0; gi < t; gi++) {
                const int64_t g = g0 + gb + gi;
                __m512i B[8]; /* B[d] lane r: row r's codes against x's dword d of the group (paired or natural) */
                if (BITS == 8) {
                    for (int d = 0; d < 8; d++) B[d] = _mm512_xor_si512(T[8 * gi + d], flip);
                } else {
                    for (int d = 0; d < 4; d++) {
                        B[d] = _mm512_and_si512(T[4 * gi + d], low4);
                        B[4 + d] = _mm512_and_si512(_mm512_srli_epi16(T[4 * gi + d], 4), low4);
                    }
                }
                const __m512 sv = st[gb + gi], hv = ht[gb + gi];
#pragma GCC unroll 8
                for (int64_t m = 0; m < M; m++) {
                    const int8_t *xg = xq + m * K + g * 32;
                    __m512i s = BITS == 8 ? _mm512_set1_epi32(bias[m * groups + g]) : _mm512_setzero_si512();
                    for (int d = 0; d < 8; d++) {
                        int32_t v;
                        memcpy(&v, xg + 4 * d, 4);
                        s = _mm512_dpbusd_epi32(s, B[d], _mm512_set1_epi32(v));
                    }
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_set1_ps(dx[m * groups + g])), acc[m]);
                    if (SHIFTED) sh[m] = _mm512_fmadd_ps(hv, _mm512_set1_ps(xs[m * groups + g]), sh[m]);
                }
                for (; pair_group[next] == g; next++) { /* the residual pass, while the group's codes are in registers */
                    const int64_t at = pair_at[next];
                    const int8_t *rq = res_codes + at * 32;
                    __m512i u = BITS == 8 ? _mm512_set1_epi32(qx->res_bias8[at]) : _mm512_setzero_si512();
                    for (int d = 0; d < 8; d++) {
                        int32_t v;
                        memcpy(&v, rq + 4 * d, 4);
                        u = _mm512_dpbusd_epi32(u, B[d], _mm512_set1_epi32(v));
                    }
                    __m512 r = _mm512_mul_ps(_mm512_cvtepi32_ps(u), _mm512_mul_ps(sv, _mm512_set1_ps(qx->res_scale[at])));
                    if (SHIFTED) r = _mm512_fmadd_ps(hv, _mm512_set1_ps(qx->res_sum[at]), r);
                    res_acc[pair_row[next]] = _mm512_add_ps(res_acc[pair_row[next]], r);
                }
            }
        }
    }
    const __mmask16 out = rows >= 16 ? 0xFFFF : (__mmask16)((1u << rows) - 1);
#pragma GCC unroll 8
    for (int64_t m = 0; m < M; m++)
        _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, out,
                              SHIFTED ? _mm512_add_ps(_mm512_add_ps(acc[m], sh[m]), res_acc[m]) : _mm512_add_ps(acc[m], res_acc[m]));
}

/* Rows [n0, n1) of y = x W^T from int8 x with tile16, 16 weight rows and up to FAST_ROWS rows of x at a time. */
#define TILE16_MATMUL(NAME, BITS, SHIFTED)                                                                     \
    static void NAME(const layout_t *w, int64_t M, int64_t K, const qx_t *qx, float *y, int64_t ldy,          \
                     int64_t n0, int64_t n1) {                                                                 \
        for (int64_t n = n0; n < n1; n += 16) {                                                                \
            const int64_t rows = n1 - n < 16 ? n1 - n : 16;                                                    \
            for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {                                                    \
                switch (M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS) {                                             \
                case 1: tile16_int8(w, K, n, rows, 1, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 2: tile16_int8(w, K, n, rows, 2, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 3: tile16_int8(w, K, n, rows, 3, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 4: tile16_int8(w, K, n, rows, 4, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 5: tile16_int8(w, K, n, rows, 5, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 6: tile16_int8(w, K, n, rows, 6, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                case 7: tile16_int8(w, K, n, rows, 7, qx, m0, y, ldy, BITS, SHIFTED); break;                   \
                default: tile16_int8(w, K, n, rows, 8, qx, m0, y, ldy, BITS, SHIFTED);                         \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
TILE16_MATMUL(tile16_matmul_q4, 4, 1)
TILE16_MATMUL(tile16_matmul_q8, 8, 0)
TILE16_MATMUL(tile16_matmul_q8_shifted, 8, 1)
#endif

/* Whether rows_matmul_int8 reads this layout. */
static inline int int8_dot_reads(const layout_t *w) {
    return (w->group == 32 && (w->bits == 4 || w->bits == 5 || w->bits == 8)) || kquant_int8_reads(w);
}


/* Whether rows_matmul_int8 reads this layout with x's quad forms (quantize_x's `quads`). */
static inline int int8_reads_quads(const layout_t *w) {
#if HAVE_INT8_512
    return !tile16_reads(w);
#else
    (void)w;
    return 0;
#endif
}

/* KERNEL(w, K, n, rows, qx, m0, out, ...) with a constant row count (1 to FAST_ROWS): the accumulators stay in
 * registers. */
#define BY_ROW_COUNT(KERNEL, ROWS, ...)                                                                       \
    switch (ROWS) {                                                                                           \
    case 1: KERNEL(w, K, n, 1, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 2: KERNEL(w, K, n, 2, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 3: KERNEL(w, K, n, 3, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 4: KERNEL(w, K, n, 4, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 5: KERNEL(w, K, n, 5, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 6: KERNEL(w, K, n, 6, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    case 7: KERNEL(w, K, n, 7, qx, m0, out __VA_OPT__(,) __VA_ARGS__); break;                                 \
    default: KERNEL(w, K, n, 8, qx, m0, out __VA_OPT__(,) __VA_ARGS__);                                       \
    }

#if HAVE_INT8_512
ROWS_MATMUL_512(rows_matmul_512_q4, 4, 1) /* 4- and 5-bit codes always have an offset or a minimum */
ROWS_MATMUL_512(rows_matmul_512_q5, 5, 1)
ROWS_MATMUL_512(rows_matmul_512_q8, 8, 0)
ROWS_MATMUL_512(rows_matmul_512_q8_shifted, 8, 1)
#endif

#if defined(__AVX2__)
/* Two groups of 32 of a Q6_K row, g and g + 1, as unsigned codes (0 to 63) in quantize_x's pair order: `ce` their
 * even elements (g's 16, then g + 1's), `co` their odd ones, from one 32-byte load of nibbles and one 16-byte load
 * of high pairs (each element's two high bits moved to bits 4 and 5). */
static inline __attribute__((always_inline)) void q6k_pair_codes(const uint8_t *lo, const uint8_t *high, int64_t g,
                                                                 __m256i *ce, __m256i *co) {
    const __m256i low4 = _mm256_set1_epi8(0xF), mask = _mm256_set1_epi8(0x30);
    /* high byte of element 2q (evens) or 2q + 1 (odds) of the pair's first group: byte q / 2; second: 8 + q / 2 */
    const __m256i spread = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12,
                                            12, 13, 13, 14, 14, 15, 15);
    const __m256i odd_q = _mm256_set1_epi16((short)0xFF00);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(lo + g * 16));
    const __m256i h = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(high + g * 8))), spread);
    /* evens: bits 0-1 (q even) or 4-5 (q odd); odds: bits 2-3 or 6-7; each moved to bits 4-5 */
    const __m256i he = _mm256_and_si256(_mm256_blendv_epi8(_mm256_slli_epi16(h, 4), h, odd_q), mask);
    const __m256i ho = _mm256_and_si256(_mm256_blendv_epi8(_mm256_slli_epi16(h, 2), _mm256_srli_epi16(h, 2), odd_q), mask);
    *ce = _mm256_or_si256(_mm256_and_si256(v, low4), he);
    *co = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), ho);
}

/* Sub-scales 2p and 2p + 1 of a Q6_K super-group (subs16: its 16 as int16) on the int16 lanes of a pair's madd:
 * each group of 32's two pair sums take its two groups of 16's. */
static inline __attribute__((always_inline)) __m256i q6k_pair_subs(__m256i subs16, int64_t p) {
    const __m256i pair_scales = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 0, 1, 0, 1, 0, 1, 0, 1,
                                                 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(
        _mm256_permutevar8x32_epi32(subs16, _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1)),
        pair_scales);
}
#endif

#if HAVE_INT8_PLAIN
/* x's part of Q6_K's bias for rows [0, M) of x: per pair of groups, the int16 lanes of maddubs(32, evens) +
 * maddubs(32, odds) over quantize_x's pairs, i.e. 32 times each lane's four elements of x (|sum| <= 4 * 32 * 127).
 * rows_dot_int8_q6k takes them off its unsigned codes' sums, which puts the codes' -32 back. */
static void q6k_x_bias(int64_t M, int64_t K, const qx_t *qx, int16_t *xb) {
    const __m256i c32 = _mm256_set1_epi8(32);
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < K / 64; p++) {
            const int8_t *xm = qx->pairs + m * K + p * 64;
            const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(c32, _mm256_loadu_si256((const __m256i *)xm)),
                                               _mm256_maddubs_epi16(c32, _mm256_loadu_si256((const __m256i *)(xm + 32))));
            _mm256_storeu_si256((__m256i *)(xb + (m * (K / 64) + p) * 16), b);
        }
}

/* Row n of a Q6_K weight against up to FAST_ROWS rows of int8 x, x's groups two at a time as quantize_x's pairs
 * lay them out (both groups' even elements, then both groups' odd ones): one 32-byte load of the row's nibbles and
 * one 16-byte load of its high pairs serve the two groups of 32, four groups of 16. The unsigned codes (0 to 63)
 * meet x directly in maddubs (|pair| <= 2 * 63 * 127, two of them below 2^15), and x's bias (q6k_x_bias: 32 times
 * x) comes off in int16, whose wrapping subtraction lands on the true sum of (code - 32) x, itself below 2^15. The
 * two int16 pair sums of each group of 32 take their groups of 16's sub-scales in the madd; a super-group's four
 * pairs, each times x's dx (its scale4 form), are summed before one multiply by its float16. A row's arithmetic is
 * the same at every M, so its result is the same alone or in a batch. */
static inline __attribute__((always_inline)) void rows_dot_int8_q6k(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                                    const qx_t *qx, int64_t m0, float *out,
                                                                    const int16_t *xb) {
    const int64_t groups = K / 32, supers = K / 256;
    const int8_t *x = qx->pairs + m0 * K;
    const float *dx4 = qx->scale4 + m0 * groups * 4;
    const int16_t *bias = xb + m0 * (K / 64) * 16;
    const uint8_t *lo = w->low + n * (K / 2), *high = w->high + n * (K / 4);
    const int8_t *subs = (const int8_t *)w->s_sub + n * (K / 16);
    __m256 acc[FAST_ROWS]; /* per row: the super-groups' sums times their float16 */
    for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; sb++) {
        const __m256 d = _mm256_set1_ps(half_to_float(w->s_half[n * supers + sb]));
        const __m256i subs16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(subs + sb * 16)));
        __m256 part[FAST_ROWS]; /* per row: the super-group's four pairs, times x's dx */
        for (int64_t p = 0; p < 4; p++) {
            const int64_t g = sb * 8 + 2 * p;
            __m256i ce, co;
            q6k_pair_codes(lo, high, g, &ce, &co);
            const __m256i sub = q6k_pair_subs(subs16, p);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *xm = x + m * K + g * 32;
                const __m256i raw = _mm256_add_epi16(_mm256_maddubs_epi16(ce, _mm256_loadu_si256((const __m256i *)xm)),
                                                     _mm256_maddubs_epi16(co, _mm256_loadu_si256((const __m256i *)(xm + 32))));
                const __m256i sum16 = _mm256_sub_epi16(raw, _mm256_loadu_si256((const __m256i *)(bias + (m * (K / 64) + g / 2) * 16)));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, sub));
                const __m256 dx = _mm256_loadu_ps(dx4 + m * groups * 4 + g * 4);
                part[m] = p == 0 ? _mm256_mul_ps(dot, dx) : _mm256_fmadd_ps(dot, dx, part[m]);
            }
        }
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(part[m], d, acc[m]);
    }
    for (int64_t m = 0; m < M; m++) out[m] = hsum256(acc[m]);
}
#endif

#if HAVE_INT8_PLAIN
/* Sub-scales 2p and 2p + 1 of a Q4_K super-group (sub16: its eight as int16, in both halves) on a pair's madd
 * lanes: int16 lanes 0-7 take 2p, lanes 8-15 take 2p + 1. */
static inline __attribute__((always_inline)) __m256i q4k_pair_subs(__m256i sub16, int64_t p) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                          2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(sub16, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(4 * p))));
}
#endif

#if HAVE_INT8_PLAIN
/* Row n of a Q4_K weight against up to FAST_ROWS rows of int8 x, two groups of 32 a step as quantize_x's pairs lay
 * x out, a super-group's constants read where it starts (no pass over the row's constants first): one 32-byte load
 * holds both groups' nibbles (low halves their even elements, high halves their odd ones); the two int16 pair sums
 * of each group take its integer sub-scale in the madd (|sum| <= 4 * 15 * 127, times 63, twice: int32 holds it);
 * a super-group's four pairs, each times x's dx (its scale4 form), are summed before one multiply by its float16
 * (one multiply a pair fewer than scaling each pair). The minimums meet x's group sums eight groups a vector. Two
 * vectors a row of x: the caller passes at most four rows, which keeps them in registers. A row's arithmetic is
 * the same at every M, so its result is the same alone or in a batch. */
static inline __attribute__((always_inline)) void rows_dot_int8_q4k(const layout_t *w, int64_t K, int64_t n, int64_t M,
                                                                    const qx_t *qx, int64_t m0, float *out) {
    const int64_t groups = K / 32, supers = K / 256;
    const int8_t *x = qx->pairs + m0 * K;
    const float *dx4 = qx->scale4 + m0 * groups * 4, *xs = qx->sum + m0 * groups;
    const uint8_t *lo = w->low + n * (K / 2), *subs = (const uint8_t *)w->s_sub + n * groups;
    const __m256i low4 = _mm256_set1_epi8(0xF);
    __m256 acc[FAST_ROWS]; /* per row: the super-groups' sums times their float16, and the minimums' terms */
    for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; sb++) {
        const __m256 d = _mm256_set1_ps(half_to_float(w->s_half[n * supers + sb]));
        const __m128i sub8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(subs + sb * 8)));
        const __m256i sub16 = _mm256_set_m128i(sub8, sub8);
        __m256 part[FAST_ROWS]; /* per row: the super-group's four pairs, times x's dx */
        for (int64_t p = 0; p < 4; p++) {
            const int64_t g = sb * 8 + 2 * p;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(lo + g * 16));
            const __m256i ce = _mm256_and_si256(v, low4), co = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const __m256i sub = q4k_pair_subs(sub16, p);
            for (int64_t m = 0; m < M; m++) {
                const int8_t *xm = x + m * K + g * 32;
                const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(ce, _mm256_loadu_si256((const __m256i *)xm)),
                                                       _mm256_maddubs_epi16(co, _mm256_loadu_si256((const __m256i *)(xm + 32))));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, sub));
                const __m256 dx = _mm256_loadu_ps(dx4 + m * groups * 4 + g * 4);
                part[m] = p == 0 ? _mm256_mul_ps(dot, dx) : _mm256_fmadd_ps(dot, dx, part[m]);
            }
        }
        for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(part[m], d, acc[m]);
        if (w->m_half != NULL) {
            const __m128i msub = _mm_loadl_epi64((const __m128i *)(w->m_sub + n * groups + sb * 8));
            const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(half_to_float(w->m_half[n * supers + sb])),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(msub)));
            for (int64_t m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs + m * groups + sb * 8), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) out[m] = hsum256(acc[m]);
}
#endif

#if HAVE_INT8_PLAIN
/* Four rows' horizontal sums, each added as hsum256 adds its lanes ((0 + 2) + (1 + 3) of its halves' sum), so a
 * row's result is the same as hsum256's. */
static inline void hsum256_x4(const __m256 acc[4], float *out) {
    __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
    __m128 t1 = _mm_add_ps(_mm256_castps256_ps128(acc[1]), _mm256_extractf128_ps(acc[1], 1));
    __m128 t2 = _mm_add_ps(_mm256_castps256_ps128(acc[2]), _mm256_extractf128_ps(acc[2], 1));
    __m128 t3 = _mm_add_ps(_mm256_castps256_ps128(acc[3]), _mm256_extractf128_ps(acc[3], 1));
    _MM_TRANSPOSE4_PS(t0, t1, t2, t3); /* t_j: lane j of the four rows */
    _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(t0, t2), _mm_add_ps(t1, t3)));
}

/* Rows n to n + 3 of a Q4_K weight against one row of int8 x: rows_dot_int8_q4k's arithmetic for each (so each
 * result is the one it gives alone), one row after the other, their sums reduced together. A row of the 0.8B
 * class's weights is four super-groups, so a row's own costs (its sum, the call) weigh. */
static inline __attribute__((always_inline)) void rows4_dot_int8_q4k(const layout_t *w, int64_t K, int64_t n,
                                                                     const qx_t *qx, int64_t m0, float *out) {
    const int64_t groups = K / 32, supers = K / 256;
    const int8_t *x = qx->pairs + m0 * K;
    const float *dx4 = qx->scale4 + m0 * groups * 4, *xs = qx->sum + m0 * groups;
    const __m256i low4 = _mm256_set1_epi8(0xF);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) /* a row at a time: four rows side by side would be four streams to prefetch */
        for (int64_t sb = 0; sb < supers; sb++) {
            const int64_t nr = n + r;
            const uint8_t *lo = w->low + nr * (K / 2), *subs = (const uint8_t *)w->s_sub + nr * groups;
            const __m256 d = _mm256_set1_ps(half_to_float(w->s_half[nr * supers + sb]));
            const __m128i sub8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(subs + sb * 8)));
            const __m256i sub16 = _mm256_set_m128i(sub8, sub8);
            __m256 part = _mm256_setzero_ps();
            for (int64_t p = 0; p < 4; p++) {
                const int64_t g = sb * 8 + 2 * p;
                const __m256i v = _mm256_loadu_si256((const __m256i *)(lo + g * 16));
                const __m256i ce = _mm256_and_si256(v, low4), co = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                const __m256i sub = q4k_pair_subs(sub16, p);
                const int8_t *xm = x + g * 32;
                const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(ce, _mm256_loadu_si256((const __m256i *)xm)),
                                                       _mm256_maddubs_epi16(co, _mm256_loadu_si256((const __m256i *)(xm + 32))));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, sub));
                const __m256 dx = _mm256_loadu_ps(dx4 + g * 4);
                part = p == 0 ? _mm256_mul_ps(dot, dx) : _mm256_fmadd_ps(dot, dx, part);
            }
            acc[r] = _mm256_fmadd_ps(part, d, acc[r]);
            if (w->m_half != NULL) {
                const __m128i msub = _mm_loadl_epi64((const __m128i *)(w->m_sub + nr * groups + sb * 8));
                const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(half_to_float(w->m_half[nr * supers + sb])),
                                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(msub)));
                acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs + sb * 8), acc[r]);
            }
        }
    hsum256_x4(acc, out);
}

/* Rows n to n + 3 of a Q6_K weight against one row of int8 x: rows_dot_int8_q6k's arithmetic for each, the four
 * rows one after the other, their sums reduced together (as rows4_dot_int8_q4k). */
static inline __attribute__((always_inline)) void rows4_dot_int8_q6k(const layout_t *w, int64_t K, int64_t n,
                                                                     const qx_t *qx, int64_t m0, float *out,
                                                                     const int16_t *xb) {
    const int64_t groups = K / 32, supers = K / 256;
    const int8_t *x = qx->pairs + m0 * K;
    const float *dx4 = qx->scale4 + m0 * groups * 4;
    const int16_t *bias = xb + m0 * (K / 64) * 16;
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) /* a row at a time: four rows side by side would be four streams to prefetch */
        for (int64_t sb = 0; sb < supers; sb++) {
            const int64_t nr = n + r;
            const uint8_t *lo = w->low + nr * (K / 2), *high = w->high + nr * (K / 4);
            const int8_t *subs = (const int8_t *)w->s_sub + nr * (K / 16);
            const __m256 d = _mm256_set1_ps(half_to_float(w->s_half[nr * supers + sb]));
            const __m256i subs16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(subs + sb * 16)));
            __m256 part = _mm256_setzero_ps();
            for (int64_t p = 0; p < 4; p++) {
                const int64_t g = sb * 8 + 2 * p;
                __m256i ce, co;
                q6k_pair_codes(lo, high, g, &ce, &co);
                const __m256i sub = q6k_pair_subs(subs16, p);
                const int8_t *xm = x + g * 32;
                const __m256i raw = _mm256_add_epi16(_mm256_maddubs_epi16(ce, _mm256_loadu_si256((const __m256i *)xm)),
                                                     _mm256_maddubs_epi16(co, _mm256_loadu_si256((const __m256i *)(xm + 32))));
                const __m256i sum16 = _mm256_sub_epi16(raw, _mm256_loadu_si256((const __m256i *)(bias + (g / 2) * 16)));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, sub));
                const __m256 dx = _mm256_loadu_ps(dx4 + g * 4);
                part = p == 0 ? _mm256_mul_ps(dot, dx) : _mm256_fmadd_ps(dot, dx, part);
            }
            acc[r] = _mm256_fmadd_ps(part, d, acc[r]);
        }
    hsum256_x4(acc, out);
}
#endif

/* KERNEL(w, K, n, rows, qx, first, out) with a constant row count of 1 to 4, from x's row `first`. */
#define QUAD_ROW_COUNT(KERNEL, ROWS, FIRST, ...)                                                              \
    switch (ROWS) {                                                                                           \
    case 1: KERNEL(w, K, n, 1, qx, FIRST, out __VA_OPT__(,) __VA_ARGS__); break;                              \
    case 2: KERNEL(w, K, n, 2, qx, FIRST, out __VA_OPT__(,) __VA_ARGS__); break;                              \
    case 3: KERNEL(w, K, n, 3, qx, FIRST, out __VA_OPT__(,) __VA_ARGS__); break;                              \
    default: KERNEL(w, K, n, 4, qx, FIRST, out __VA_OPT__(,) __VA_ARGS__);                                    \
    }

/* Rows [n0, n1) of y = x W^T from int8 x for a K-quant layout (kquant_int8_reads). */
static void rows_matmul_int8_k(const layout_t *w, int64_t M, int64_t K, const qx_t *qx, float *y, int64_t ldy,
                               int64_t n0, int64_t n1) {
    float out[FAST_ROWS];
#if HAVE_INT8_PLAIN
    int16_t local[8192], *xb = NULL; /* Q6_K: q6k_x_bias's M * K / 4 lanes, on the stack for a decode's few rows */
    if (w->bits == 6) {
        const size_t lanes = (size_t)M * (size_t)(K / 4);
        xb = lanes <= sizeof local / sizeof *local ? local : malloc(lanes * sizeof *xb);
        if (xb == NULL) abort();
        q6k_x_bias(M, K, qx, xb);
    }
    if (M == 1 && (w->bits == 4 || w->bits == 6)) /* one row of x: four weight rows a pass */
        for (; n0 + 4 <= n1; n0 += 4) {
            if (w->bits == 6)
                rows4_dot_int8_q6k(w, K, n0, qx, 0, y + n0, xb);
            else
                rows4_dot_int8_q4k(w, K, n0, qx, 0, y + n0);
        }
#endif
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {
            const int64_t rows = M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS;
#if HAVE_INT8_PLAIN
            if (w->bits == 6) {
                BY_ROW_COUNT(rows_dot_int8_q6k, rows, xb)
                for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];
                continue;
            }
            if (w->bits == 4) { /* four rows of x a pass: a row's two vectors stay in registers */
                for (int64_t q = 0; q < rows; q += 4) {
                    const int64_t count = rows - q < 4 ? rows - q : 4;
                    QUAD_ROW_COUNT(rows_dot_int8_q4k, count, m0 + q)
                    for (int64_t m = 0; m < count; m++) y[(m0 + q + m) * ldy + n] = out[m];
                }
                continue;
            }
#endif
            BY_ROW_COUNT(rows_dot_int8_k, rows)
            for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];
        }
#if HAVE_INT8_PLAIN
    if (xb != local) free(xb);
#endif
}

/* Rows [n0, n1) of y = x W^T from int8 x. */
static void rows_matmul_int8(const layout_t *w, int64_t M, int64_t K, const qx_t *qx, float *y, int64_t ldy,
                             int64_t n0, int64_t n1) {
#if HAVE_INT8_512
    if (w->bits == 6) /* Q6_K: the 256-bit kernel (the 512-bit ones read groups of 32) */
        rows_matmul_int8_k(w, M, K, qx, y, ldy, n0, n1);
    else if (tile16_reads(w))
        (w->bits == 4 ? tile16_matmul_q4 : w->m_half != NULL || w->offset != 0 ? tile16_matmul_q8_shifted : tile16_matmul_q8)(w, M, K, qx, y, ldy, n0, n1);
    else if (w->bits == 8)
        (w->m_half != NULL || w->offset != 0 ? rows_matmul_512_q8_shifted : rows_matmul_512_q8)(w, M, K, qx, y, ldy, n0, n1);
    else
        (w->bits == 5 ? rows_matmul_512_q5 : rows_matmul_512_q4)(w, M, K, qx, y, ldy, n0, n1);
#else
    float out[FAST_ROWS];
#if HAVE_INT8_PLAIN
    if (w->bits == 4 && kquant_int8_reads(w)) { /* Q4_K: rows_dot_int8_q4k */
        rows_matmul_int8_k(w, M, K, qx, y, ldy, n0, n1);
        return;
    }
    if (int8_plain_reads(w, K)) {
        /* 4-bit codes: several weight rows a pass where x has few rows, sharing x's loads and each row's fixed
         * costs (8-bit codes gain nothing from it: their sign trick is per row, and the accumulators spill) */
        const int64_t R = w->bits == 8 ? 1 : M <= 2 ? 4 : M <= 4 ? 2 : 1;
        for (int64_t n = n0; n < n1;) {
            if (R > 1 && n + R <= n1) {
                switch (M) { /* R follows from M */
                case 1: rows_dot_int8_plain(w, K, n, 1, qx, 0, out, 4); break;
                case 2: rows_dot_int8_plain(w, K, n, 2, qx, 0, out, 4); break;
                case 3: rows_dot_int8_plain(w, K, n, 3, qx, 0, out, 2); break;
                default: rows_dot_int8_plain(w, K, n, 4, qx, 0, out, 2);
                }
                for (int64_t r = 0; r < R; r++)
                    for (int64_t m = 0; m < M; m++) y[m * ldy + n + r] = out[r * M + m];
                n += R;
                continue;
            }
            for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {
                const int64_t rows = M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS;
                BY_ROW_COUNT(rows_dot_int8_plain, rows, 1)
                for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];
            }
            n++;
        }
        return;
    }
#endif
    if (kquant_int8_reads(w)) {
        rows_matmul_int8_k(w, M, K, qx, y, ldy, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += FAST_ROWS) {
            const int64_t rows = M - m0 < FAST_ROWS ? M - m0 : FAST_ROWS;
            BY_ROW_COUNT(rows_dot_int8, rows)
            for (int64_t m = 0; m < rows; m++) y[(m0 + m) * ldy + n] = out[m];
        }
#endif
}
#else
#define HAVE_INT8_DOT 0
static inline int int8_dot_reads(const layout_t *w) {
    (void)w;
    return 0;
}
static inline int int8_reads_quads(const layout_t *w) {
    (void)w;
    return 0;
}
static void rows_matmul_int8(const layout_t *w, int64_t M, int64_t K, const qx_t *qx, float *y, int64_t ldy,
                             int64_t n0, int64_t n1) {
    (void)w, (void)M, (void)K, (void)qx, (void)y, (void)ldy, (void)n0, (void)n1;
}
#endif

static void fill_layout(layout_t *w, int bits, int group, int offset, const uint8_t *low, const uint8_t *high,
                        const uint16_t *s_half, const void *s_sub, int s_sub_signed, int s_per,
                        const uint16_t *m_half, const uint8_t *m_sub, int m_per) {
    w->bits = bits; w->group = group; w->offset = offset; w->low = low; w->high = high;
    w->s_half = s_half; w->s_sub = s_sub; w->s_sub_signed = s_sub_signed; w->s_per = s_per;
    w->m_half = m_half; w->m_sub = m_sub; w->m_per = m_per;
}

/* x's forms the matmul reads, for M rows of K: each group's sum (for offsets and minimums) and, for nibble
 * codes (xd != NULL), its even then odd elements. */
static void prepare_x(int64_t M, int64_t K, int group, const float *x, float *xd, float *xsum) {
    const int64_t groups = K / group;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int j = 0; j < group; j++) t += xm[g * group + j];
            xsum[m * groups + g] = t;
        }
        if (xd != NULL)
            for (int64_t j = 0; j < K / 2; j++) {
                xd[m * K + j] = xm[2 * j];
                xd[m * K + K / 2 + j] = xm[2 * j + 1];
            }
    }
}

#define ROW_BLOCK 16 /* weight rows a thread takes at a time */

/* This thread's share of y = x W^T from prepared x (xs: x itself for 8-bit codes, else its even/odd form).
 * Called inside a parallel region, its rows are split among the team (no barrier at the end); outside one,
 * it computes every row. */
static void matmul_share(const layout_t *w, int64_t M, int64_t N, int64_t K, const float *xs, const float *xsum,
                         float *y, int64_t ldy) {
    const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * ROW_BLOCK, n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        rows_matmul(w, M, K, xs, xsum, y, ldy, n0, n1);
    }
}

/* y[M, N] (row stride ldy) = x[M, K] W^T, float32. */
int swarmkv_grouped_matmul(int64_t M, int64_t N, int64_t K, const float *x, float *y, int64_t ldy, int bits,
                           int group, int offset, const uint8_t *low, const uint8_t *high, const uint16_t *s_half,
                           const void *s_sub, int s_sub_signed, int s_per, const uint16_t *m_half,
                           const uint8_t *m_sub, int m_per, int threads) {
    if ((group != 16 && group != 32) || K % group) return 1;
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
    const int64_t groups = K / group;
    float *xsum = malloc(sizeof(float) * (size_t)(M * groups));
    float *xd = bits == 8 ? NULL : malloc(sizeof(float) * (size_t)(M * K));
    if (xsum == NULL || (bits != 8 && xd == NULL)) {
        free(xsum);
        free(xd);
        return 2;
    }
    prepare_x(M, K, group, x, xd, xsum);
    const float *xs = xd != NULL ? xd : x;
#pragma omp parallel num_threads(threads)
    matmul_share(&w, M, N, K, xs, xsum, y, ldy);
    free(xsum);
    free(xd);
    return 0;
}

/* This thread's share of y = x W^T from int8 x (layouts int8_dot_reads accepts), as matmul_share. */
static void matmul_share_int8(const layout_t *w, int64_t M, int64_t N, int64_t K, const qx_t *qx, float *y,
                              int64_t ldy) {
    const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp for schedule(static) nowait
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * ROW_BLOCK, n1 = n0 + ROW_BLOCK < N ? n0 + ROW_BLOCK : N;
        rows_matmul_int8(w, M, K, qx, y, ldy, n0, n1);
    }
}

/* Whether this build has the integer dot product of the int8-activation path (AVX2 or later). */
int swarmkv_has_int8_dot(void) { return HAVE_INT8_DOT; }

/* Whether the int8 kernel of this build and layout reads the residual pass (tile16's layouts, AVX-512 VNNI). */
static inline int int8_reads_residual(const layout_t *w) {
#if HAVE_INT8_512
    return int8_dot_reads(w) && tile16_reads(w);
#else
    (void)w;
    return 0;
#endif
}

int swarmkv_int8_reads_residual(int bits, int group, int offset, const uint8_t *low, const uint8_t *high,
                                const uint16_t *s_half, const void *s_sub, int s_sub_signed, int s_per,
                                const uint16_t *m_half, const uint8_t *m_sub, int m_per) {
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
    return int8_reads_residual(&w);
}

/* y[M, N] = x W^T with x quantised to int8 per group of 32 first, with the residual pass over `residual` groups
 * a row where the kernel reads it (status 1: a layout it does not read). */
int swarmkv_grouped_matmul_int8(int64_t M, int64_t N, int64_t K, const float *x, float *y, int64_t ldy, int bits,
                                int group, int offset, const uint8_t *low, const uint8_t *high,
                                const uint16_t *s_half, const void *s_sub, int s_sub_signed, int s_per,
                                const uint16_t *m_half, const uint8_t *m_sub, int m_per, int residual, int threads) {
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
    if (!int8_dot_reads(&w) || K % 32) return 1;
    int8_t *codes = aligned_alloc(64, (size_t)(QX_CODE_BYTES(M, K) + 63) / 64 * 64);
    float *consts = aligned_alloc(64, (sizeof(float) * (size_t)QX_CONST_FLOATS(M, K) + 63) / 64 * 64);
    if (codes == NULL || consts == NULL) {
        free(codes);
        free(consts);
        return 2;
    }
    qx_t qx;
    quantize_x(M, K, x, codes, consts, &qx, int8_reads_quads(&w), int8_reads_residual(&w) ? residual : 0);
#pragma omp parallel num_threads(threads)
    matmul_share_int8(&w, M, N, K, &qx, y, ldy);
    free(codes);
    free(consts);
    return 0;
}

/* Row n of W dequantised into out[K], exactly as gguf does. */
static void dequantize_row(const layout_t *w, int64_t K, int64_t n, float *out) {
    const int group = w->group;
    const int64_t groups = K / group;
    float qf[MAX_GROUP];
    for (int64_t g = 0; g < groups; g++) {
        decode_group(w, K, n, g, qf);
        float s = constant(w->s_half, w->s_sub, w->s_sub_signed, w->s_per, n, groups, g);
        float *o = out + g * group;
        if (w->m_half) {
            float mn = constant(w->m_half, w->m_sub, 0, w->m_per, n, groups, g);
            for (int j = 0; j < group; j++) o[j] = s * qf[j] + mn;
        } else {
            for (int j = 0; j < group; j++) o[j] = s * qf[j];
        }
    }
}

/* out[R, K] float32 = the dequantised rows rows[0..R) of W (rows == NULL: rows 0..R). */
int swarmkv_grouped_dequantize(int64_t R, int64_t K, const int64_t *rows, float *out, int bits, int group,
                               int offset, const uint8_t *low, const uint8_t *high, const uint16_t *s_half,
                               const void *s_sub, int s_sub_signed, int s_per, const uint16_t *m_half,
                               const uint8_t *m_sub, int m_per, int threads) {
    if (group > MAX_GROUP || K % group) return 1;
    layout_t w;
    fill_layout(&w, bits, group, offset, low, high, s_half, s_sub, s_sub_signed, s_per, m_half, m_sub, m_per);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < R; r++) dequantize_row(&w, K, rows ? rows[r] : r, out + r * K);
    return 0;
}

#include "gemm_int8.c" /* prefill's int8 GEMM over the K-quants */
