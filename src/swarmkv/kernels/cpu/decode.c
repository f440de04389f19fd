/* One decode step of a decoder (Llama, Mistral, Qwen2, Qwen3, and Qwen3.5's hybrid) on the CPU, in one call:
 * embedding, every layer (norms, QKV, q/k norm, rotary, the KV store, paged attention, an output gate, output
 * projection, SwiGLU; a hybrid's Gated DeltaNet layers over their state slots, in delta.c) and the LM head, for
 * M rows that each decode one token. Weights are the grouped layout of grouped.c (or float32 row
 * blocks); K and V are the engine's slabs (float32, or float16 converted a tile at a time), addressed through its
 * page table.
 *
 * Why C: at 135M parameters a decode step reads ~100 MB of weights, about 6 ms at this CPU's bandwidth, while
 * the same step through PyTorch's eager modules pays ~1,200 operator calls (~15 ms). One parallel region spans
 * the step; each op splits its rows among the threads and ends at a barrier.
 *
 * Attention splits each row's keys into chunks of CHUNK positions from 0 (the threads share them, as
 * flash-decoding does), walks a chunk in tiles of TILE with an online softmax, and merges the chunks' partial
 * results in order. Rows that share their first pages (a cascade group) read the chunks wholly inside the shared
 * pages once for the whole group. Boundaries depend on positions only, so a row's result is the same grouped or
 * alone, and at any batch size.
 */
#include <math.h>
#include <string.h>

#include "grouped.c" /* one translation unit: the matmul's inline kernels are shared, not exported */

#define TILE 32       /* keys per attention tile */
#define CHUNK 256     /* keys per attention partial: every row splits its context at multiples of CHUNK */
#define MAX_MEMBERS 8 /* rows of a group one attention work item serves (each shared key read once for them) */
#define MAX_HEAD_DIM 256 /* a multiple of 16 */
#define HEAD_BLOCK 4 /* query heads one pass over a tile's keys serves */
#define MAX_GROUP_HEADS 16 /* query heads per KV head */

#include "delta.c"

typedef struct {
    int64_t start, rows;
    layout_t w; /* bits == 0: float32 rows [rows, K] at w.low */
} block_t;

typedef struct {
    int64_t N, K;
    int64_t num_blocks;
    const block_t *blocks;
    const float *bias; /* [N] or NULL */
} linear_t;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* [head_dim] or NULL */
    /* attention: q (each head's query then its gate, with attn_gate), k, v | a Gated DeltaNet layer: in_proj's
     * q, k, v | z (the output gate); o: the output projection (out_proj) */
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's slabs [slots, kv_heads, head_dim]: float32, or float16 (kv_half) */
    /* a Gated DeltaNet layer (linear != 0) */
    int linear;                      /* qkv: in_proj (q, k, v | z) then in_proj_ba (beta's logits | the decay's) */
    const float *conv_w;             /* [channels, kernel] */
    const float *neg_a, *dt_bias;    /* [value_heads]: -e^A_log, the decay's bias */
    const float *delta_norm;         /* [value_dim] */
    float *conv_state, *ssm_state;   /* [slots, channels, kernel - 1], [slots, value_heads, key_dim, value_dim] */
    int64_t state_layer;             /* its index among the linear layers (of the states, and of kept_t's) */
} layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, vocab, num_layers;
    float eps, scale;
    const layer_t *layers;
    linear_t embed; /* [vocab, hidden]: rows are looked up, not multiplied */
    const float *final_norm;
    linear_t lm_head;
    const float *cos_sin; /* [2, max_positions, head_dim] */
    int64_t max_positions;
    const int64_t *page_table; /* [rows, table_stride] page ids */
    int64_t table_stride, page_size;
    int int8_activations; /* projections read x quantised to int8 per group of 32 where the layout allows */
    int residual_groups;  /* the layers' int8 x carries quantize_x's residual pass over this many groups a row */
    int kv_half;          /* K and V pages hold float16 (needs F16C): converted a tile at a time to read */
    int64_t rotary_dim;   /* the first rotary_dim of a head rotate (cos_sin's rows are this wide) */
    int attn_gate;        /* attention output times sigmoid(the head's gate) */
    delta_shape_t delta;  /* a hybrid's Gated DeltaNet layers (value_heads 0: none) */
} model_t;

/* One attention work item: every head over the keys of chunk `chunk` (positions [chunk * CHUNK, ...)), for
 * rows [first, first + count): several rows only where that chunk lies wholly in the pages they share. */
typedef struct {
    int64_t first, count, chunk;
} item_t;

/* Scratch for one step, allocated once per call. */
typedef struct {
    float *resid, *x, *qkv, *attn, *gu, *act, *out;
    float *raw;  /* the QKV projection's rows before the gate is split off, or in_proj ++ in_proj_ba's */
    float *gate; /* [M, heads * head_dim]: the attention output gate */
    float *conv; /* [M, conv channels]: a Gated DeltaNet layer's conv outputs */
    float *xd, *xsum16, *xsum32;
    int8_t *codes;    /* QX_CODE_BYTES(M, widest): int8 x in the orders this build's kernel reads (quantize_x) */
    float *qconsts;   /* QX_CONST_FLOATS(M, widest): their scales, scaled sums and the kernel's spread forms */
    qx_t qx;
    item_t *items; /* attention work items */
    float *part;   /* [M, heads, chunks, 2 + head_dim]: each chunk's partial softmax state */
} scratch_t;

static inline float dot_f32(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float t = _mm512_reduce_add_ps(acc);
#else
    float lanes[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += a[i + j] * b[i + j];
    for (int w = 8; w > 0; w /= 2) /* a tree, not a chain of 16 dependent adds */
        for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
    float t = lanes[0];
#endif
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* e^x for x <= 0 (softmax weights), to a few float32 ulps, in plain arithmetic the compiler vectorises (libm's
 * expf is a call per element): 2^n e^f with n = round(x / ln 2), |f| <= ln 2 / 2, e^f by a degree-6 polynomial. */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f; /* e^-87 is at the bottom of float32's normal range: 0 to a sum beside 1; NaN
                                  * takes that value too (as MAXPS and fmaxf give it, without fmaxf's call) */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#if defined(__AVX2__)
/* exp_nonpositive on 8 lanes, the same operations in the same order (so the same values). */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    const __m256 f = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723e-6f)));
    const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(c[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* y[M, N] = x W^T (+ bias) for this thread's rows of every block; x's forms are prepared first by one thread.
 * `residual`: groups a row of int8 x carries quantize_x's residual pass for (the layers'; the LM head's likely
 * tokens are rescored in float32 instead). Ends at a barrier. */
static void linear(const linear_t *l, int64_t M, const float *x, float *y, scratch_t *s, int int8, int residual) {
    const int64_t K = l->K;
#pragma omp single
    {
        int need_d = 0, need16 = 0, need32 = 0, need_q = 0, need_quads = 0, need_residual = 0;
        for (int64_t b = 0; b < l->num_blocks; b++) {
            const layout_t *w = &l->blocks[b].w;
            if (w->bits == 0) continue;
            if (int8 && int8_dot_reads(w)) {
                need_q = 1;
                need_quads |= int8_reads_quads(w);
                need_residual |= int8_reads_residual(w);
                continue;
            }
            need_d |= w->bits != 8;
            need16 |= w->group == 16;
            need32 |= w->group == 32;
        }
        if (need16) prepare_x(M, K, 16, x, need_d ? s->xd : NULL, s->xsum16);
        if (need32) prepare_x(M, K, 32, x, need16 || !need_d ? NULL : s->xd, s->xsum32);
        if (need_q) quantize_x(M, K, x, s->codes, s->qconsts, &s->qx, need_quads, need_residual ? residual : 0);
    }
    for (int64_t b = 0; b < l->num_blocks; b++) {
        const block_t *blk = &l->blocks[b];
        const layout_t *w = &blk->w;
        float *yb = y + blk->start;
        if (w->bits == 0) {
            const float *W = (const float *)w->low;
#pragma omp for schedule(static) nowait
            for (int64_t n = 0; n < blk->rows; n++)
                for (int64_t m = 0; m < M; m++) yb[m * l->N + n] = dot_f32(x + m * K, W + n * K, K);
            continue;
        }
        if (int8 && int8_dot_reads(w)) {
            matmul_share_int8(w, M, blk->rows, K, &s->qx, yb, l->N);
            continue;
        }
        const float *xs = w->bits == 8 ? x : s->xd;
        matmul_share(w, M, blk->rows, K, xs, w->group == 16 ? s->xsum16 : s->xsum32, yb, l->N);
    }
#pragma omp barrier
    if (l->bias != NULL) {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < l->N; n++) y[m * l->N + n] += l->bias[n];
    }
}

/* With int8 activations, half the top-token changes against float32 come from the LM head (measured over
 * 1,024 tokens of the README on the embedded model: 95.4% agreement, 97.2% with a float32 head), at ties
 * a few hundredths of a logit apart. So each row's RESCORE highest logits are computed again from float32 x
 * against the dequantised rows: the likely tokens get the float32 head's values, for about RESCORE dot
 * products a row beside the head's 49,152. Runs inside the parallel region; ends at omp for's barrier. */
#define RESCORE 8
/* Keep v (logit n) among the RESCORE highest so far, in descending order, later equals after earlier ones. */
static inline void insert_top(float *top_value, int64_t *top, int *count, float v, int64_t n) {
    if (!(v == v) || (*count == RESCORE && v <= top_value[RESCORE - 1])) return;
    int i = *count < RESCORE ? (*count)++ : RESCORE - 1;
    for (; i > 0 && top_value[i - 1] < v; i--) top_value[i] = top_value[i - 1], top[i] = top[i - 1];
    top_value[i] = v, top[i] = n;
}

static void rescore_top(const linear_t *l, int64_t M, const float *x, float *y) {
    const int64_t K = l->K, N = l->N;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *row = y + m * N, top_value[RESCORE], w[K];
        int64_t top[RESCORE];
        int count = 0;
        int64_t n0 = 0;
#if defined(__AVX512F__)
        /* 16 logits a compare against the lowest kept: only the few that pass take the insertion below, in
         * order, so the result is the scalar loop's (NaN compares false and never enters) */
        for (; n0 + 16 <= N; n0 += 16) {
            const __m512 v = _mm512_loadu_ps(row + n0);
            __mmask16 pass = count == RESCORE ? _mm512_cmp_ps_mask(v, _mm512_set1_ps(top_value[RESCORE - 1]), _CMP_GT_OQ)
                                              : _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
            for (; pass; pass &= pass - 1) {
                const int64_t n = n0 + __builtin_ctz(pass);
                insert_top(top_value, top, &count, row[n], n);
            }
        }
#endif
        for (int64_t n = n0; n < N; n++) insert_top(top_value, top, &count, row[n], n); /* descending; no NaN */
        for (int i = 0; i < count; i++) {
            const int64_t n = top[i];
            const block_t *blk = l->blocks;
            while (n >= blk->start + blk->rows) blk++;
            if (blk->w.bits == 0 || !int8_dot_reads(&blk->w)) continue; /* already float32 */
            dequantize_row(&blk->w, K, n - blk->start, w);
            row[n] = dot_f32(x + m * K, w, K) + (l->bias != NULL ? l->bias[n] : 0.0f);
        }
    }
}

/* out = w * x / sqrt(mean(x^2) + eps), as the reference's float32 order: x * rsqrt(...), then times w. */
static inline void rms_norm_row(const float *x, const float *w, float eps, int64_t n, float *out) {
    float lanes[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += x[i + j] * x[i + j];
    float t = 0.0f;
    for (; i < n; i++) t += x[i] * x[i];
    for (int j = 0; j < 16; j++) t += lanes[j];
    const float r = 1.0f / sqrtf(t / (float)n + eps);
    for (int64_t k = 0; k < n; k++) out[k] = w[k] * (x[k] * r);
}

/* Rotate a head's first R dims in place by its position's cos/sin (rotate-half form: pairs (d, d + R/2)); the
 * rest pass through (partial rotary). */
static inline void rotate(float *h, const float *cos, const float *sin, int64_t R) {
    const int64_t half = R / 2;
    float tmp[MAX_HEAD_DIM];
    for (int64_t d = 0; d < half; d++) {
        tmp[d] = h[d] * cos[d] + (-h[d + half]) * sin[d];
        tmp[d + half] = h[d + half] * cos[d + half] + h[d] * sin[d + half];
    }
    memcpy(h, tmp, sizeof(float) * (size_t)R);
}

static inline int64_t slot_of(const model_t *m, int64_t row, int64_t position) {
    return m->page_table[row * m->table_stride + position / m->page_size] * m->page_size + position % m->page_size;
}

/* Attention need not round like gguf's dequantisation (the reason for -ffp-contract=off): fused multiply-adds,
 * and 512-bit vectors where the CPU has them. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

/* Online-softmax state of one query head. */
typedef struct {
    float max, sum;
    float acc[MAX_HEAD_DIM];
} softmax_t;

/* The float32 K and V rows of KV head `kvh` at `n` slots. */
static inline void tile_rows(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n, int64_t kvh,
                             const float **keys, const float **values) {
    const int64_t D = m->head_dim, stride = m->kv_heads * D;
    for (int64_t j = 0; j < n; j++) {
        keys[j] = (const float *)L->k_cache + slots[j] * stride + kvh * D;
        values[j] = (const float *)L->v_cache + slots[j] * stride + kvh * D;
    }
}

/* A tile's scores p[n] into softmax weights against the state's running maximum, folded into its sum and
 * maximum; returns the factor its accumulator takes first. */
static inline float fold_weights(softmax_t *sm, float *p, int64_t n) {
    float tile_max = -INFINITY, total = 0.0f;
    int64_t k = 0;
#if defined(__AVX2__)
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (; k + 8 <= n; k += 8) top = _mm256_max_ps(_mm256_loadu_ps(p + k), top); /* a NaN score never enters */
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) tile_max = lanes[i] > tile_max ? lanes[i] : tile_max;
#endif
    for (; k < n; k++) tile_max = p[k] > tile_max ? p[k] : tile_max;
    const float new_max = tile_max > sm->max ? tile_max : sm->max;
    const float alpha = sm->max == -INFINITY ? 0.0f : exp_nonpositive(sm->max - new_max);
    k = 0;
#if defined(__AVX2__)
    /* eight lanes at a time: a scalar exp a key was most of the attention's time at long contexts */
    const __m256 shift = _mm256_set1_ps(new_max);
    __m256 sums = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(p + k), shift));
        _mm256_storeu_ps(p + k, e);
        sums = _mm256_add_ps(sums, e);
    }
    _mm256_storeu_ps(lanes, sums);
    for (int i = 0; i < 8; i++) total += lanes[i];
#endif
    for (; k < n; k++) {
        p[k] = exp_nonpositive(p[k] - new_max);
        total += p[k];
    }
    sm->sum = sm->sum * alpha + total;
    sm->max = new_max;
    return alpha;
}

/* Fold keys [t0, t1) of `row` (one tile) into the states of `count` query heads q (of KV head `kvh`). */
#if defined(__AVX512F__)
/* The lane sums of sixteen vectors, as one vector in their order: pairs, then quads, then 128-bit halves. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lane block L of a[i]: [x0+x2, y0+y2, x1+x3, y1+y3] for x, y = v[2i], v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* lane block L of b[i]: the block sums of v[4i .. 4i + 3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp_nonpositive on 16 lanes (the same polynomial; fused multiply-adds here, as the attention may round). */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
    const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    for (int i = 0; i < 6; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* Up to 16 keys' scores q . K[j] times `scale` (keys [j, j + count)), in lane order; lanes past count, and NaN
 * scores (a corrupt key), are -inf, so they never enter a maximum and weigh nothing. */
#define TILE_SCORES(DIM, qv, keys, j, count, scale, out)                                                         \
    do {                                                                                                         \
        __m512 acc_[16];                                                                                         \
        for (int k_ = 0; k_ < 16; k_++) {                                                                        \
            if (k_ >= (count)) {                                                                                 \
                acc_[k_] = _mm512_setzero_ps();                                                                  \
                continue;                                                                                        \
            }                                                                                                    \
            acc_[k_] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[(j) + k_]));                                    \
            for (int v_ = 1; v_ < (DIM) / 16; v_++)                                                              \
                acc_[k_] = _mm512_fmadd_ps(qv[v_], _mm512_loadu_ps(keys[(j) + k_] + 16 * v_), acc_[k_]);         \
        }                                                                                                        \
        const __m512 scores_ = _mm512_mul_ps(sum16(acc_), (scale));                                              \
        const __mmask16 valid_ = ((count) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count)) - 1u)) &          \
                                 _mm512_cmp_ps_mask(scores_, scores_, _CMP_ORD_Q);                               \
        out = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid_, scores_);                                    \
    } while (0)

/* attend_tile for a head size known when compiled (64, 128): a query's and an accumulator's vectors stay in
 * registers; a tile's (at most 32) scores, their maximum, weights and sum stay in two vectors, so the online
 * softmax costs a few vector operations a tile. */
#define ATTEND_TILE_FIXED(NAME, DIM)                                                                             \
    static void NAME(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n, int64_t kvh,          \
                     const float *const *q, softmax_t *const *st, int count) {                                  \
        enum { V = DIM / 16 };                                                                                  \
        _Static_assert(TILE == 32, "a tile's scores are two vectors");                                          \
        const float *keys[TILE], *values[TILE];                                                                 \
        tile_rows(m, L, slots, n, kvh, keys, values);                                                           \
        const __m512 scale = _mm512_set1_ps(m->scale);                                                          \
        const int low = n < 16 ? (int)n : 16, high = n > 16 ? (int)n - 16 : 0;                                  \
        for (int c = 0; c < count; c++) {                                                                       \
            softmax_t *sm = st[c];                                                                              \
            __m512 qv[V];                                                                                       \
            for (int v = 0; v < V; v++) qv[v] = _mm512_loadu_ps(q[c] + 16 * v);                                 \
            __m512 s0, s1 = _mm512_set1_ps(-INFINITY);                                                          \
            TILE_SCORES(DIM, qv, keys, 0, low, scale, s0);                                                      \
            if (high > 0) TILE_SCORES(DIM, qv, keys, 16, high, scale, s1);                                      \
            const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s1, s0));                                 \
            const float new_max = tile_max > sm->max ? tile_max : sm->max;                                      \
            const float alpha = sm->max == -INFINITY ? 0.0f : exp_nonpositive(sm->max - new_max);              \
            const __m512 shift = _mm512_set1_ps(new_max);                                                       \
            const __m512 none = _mm512_set1_ps(-INFINITY); /* lanes past the tile, and NaN scores: weight 0 */   \
            const __mmask16 m0 = _mm512_cmp_ps_mask(s0, none, _CMP_NEQ_OQ);                                    \
            const __mmask16 m1 = _mm512_cmp_ps_mask(s1, none, _CMP_NEQ_OQ);                                    \
            const __m512 e0 = _mm512_maskz_mov_ps(m0, exp_nonpositive16(_mm512_sub_ps(s0, shift)));              \
            const __m512 e1 = _mm512_maskz_mov_ps(m1, exp_nonpositive16(_mm512_sub_ps(s1, shift)));              \
            sm->sum = sm->sum * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));                            \
            sm->max = new_max;                                                                                  \
            float p[TILE];                                                                                      \
            _mm512_storeu_ps(p, e0);                                                                            \
            _mm512_storeu_ps(p + 16, e1);                                                                       \
            __m512 a[V];                                                                                        \
            const __m512 keep = _mm512_set1_ps(alpha);                                                          \
            for (int v = 0; v < V; v++) a[v] = _mm512_mul_ps(_mm512_loadu_ps(sm->acc + 16 * v), keep);         \
            for (int64_t j = 0; j < n; j++) {                                                                   \
                const __m512 w = _mm512_set1_ps(p[j]);                                                          \
                for (int v = 0; v < V; v++) a[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(values[j] + 16 * v), a[v]); \
            }                                                                                                   \
            for (int v = 0; v < V; v++) _mm512_storeu_ps(sm->acc + 16 * v, a[v]);                               \
        }                                                                                                       \
    }
ATTEND_TILE_FIXED(attend_tile_64, 64)
ATTEND_TILE_FIXED(attend_tile_128, 128)
#undef TILE_SCORES
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The lane sums of eight vectors, as one vector in their order. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* per 128-bit half: v0..v3, v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* attend_tile in 256-bit vectors for a head size known when compiled (64, 128): eight keys' scores at a time in
 * eight accumulators, reduced together; the weighted values 64 dims at a time in registers. */
#define ATTEND_TILE_FIXED8(NAME, DIM)                                                                            \
    static void NAME(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n, int64_t kvh,          \
                     const float *const *q, softmax_t *const *st, int count) {                                  \
        enum { V = DIM / 8 };                                                                                   \
        const float *keys[TILE], *values[TILE];                                                                 \
        tile_rows(m, L, slots, n, kvh, keys, values);                                                           \
        for (int c = 0; c < count; c++) {                                                                       \
            softmax_t *sm = st[c];                                                                              \
            const float *qc = q[c];                                                                             \
            float p[TILE];                                                                                      \
            int64_t j = 0;                                                                                      \
            for (; j + 8 <= n; j += 8) {                                                                        \
                __m256 acc[8];                                                                                  \
                for (int k = 0; k < 8; k++) acc[k] = _mm256_mul_ps(_mm256_loadu_ps(qc), _mm256_loadu_ps(keys[j + k])); \
                for (int v = 1; v < V; v++) {                                                                   \
                    const __m256 qv = _mm256_loadu_ps(qc + 8 * v);                                              \
                    for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j + k] + 8 * v), acc[k]); \
                }                                                                                               \
                _mm256_storeu_ps(p + j, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(m->scale)));                    \
            }                                                                                                   \
            for (; j < n; j++) {                                                                                \
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qc), _mm256_loadu_ps(keys[j]));                      \
                for (int v = 1; v < V; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 8 * v), _mm256_loadu_ps(keys[j] + 8 * v), acc); \
                p[j] = hsum256(acc) * m->scale;                                                                 \
            }                                                                                                   \
            const float alpha = fold_weights(sm, p, n);                                                             \
            const __m256 scale = _mm256_set1_ps(alpha);                                                         \
            for (int v0 = 0; v0 < V; v0 += 8) { /* 64 dims: eight accumulators */                               \
                __m256 a[8];                                                                                    \
                for (int v = 0; v < 8; v++) a[v] = _mm256_mul_ps(_mm256_loadu_ps(sm->acc + 8 * (v0 + v)), scale); \
                for (int64_t k = 0; k < n; k++) {                                                               \
                    const __m256 w = _mm256_set1_ps(p[k]);                                                      \
                    for (int v = 0; v < 8; v++) a[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values[k] + 8 * (v0 + v)), a[v]); \
                }                                                                                               \
                for (int v = 0; v < 8; v++) _mm256_storeu_ps(sm->acc + 8 * (v0 + v), a[v]);                     \
            }                                                                                                   \
        }                                                                                                       \
    }
ATTEND_TILE_FIXED8(attend_tile_64, 64)
ATTEND_TILE_FIXED8(attend_tile_128, 128)
#define HAVE_ATTEND_FIXED 1
#elif defined(__AVX512F__)
#define HAVE_ATTEND_FIXED 1
#else
#define HAVE_ATTEND_FIXED 0
#endif

static void attend_tile_any(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n, int64_t kvh,
                        const float *const *q, softmax_t *const *st, int count) {
    const int64_t D = m->head_dim;
    const float *keys[TILE], *values[TILE];
    tile_rows(m, L, slots, n, kvh, keys, values);
    for (int c0 = 0; c0 < count; c0 += HEAD_BLOCK) { /* a few query heads at a time, each key read once */
        const int cb = count - c0 < HEAD_BLOCK ? count - c0 : HEAD_BLOCK;
        float p[HEAD_BLOCK][TILE];
        for (int64_t j = 0; j < n; j++)
            for (int c = 0; c < cb; c++) p[c][j] = dot_f32(q[c0 + c], keys[j], D) * m->scale;
        for (int c = 0; c < cb; c++) {
            softmax_t *sm = st[c0 + c];
            const float alpha = fold_weights(sm, p[c], n);
            for (int64_t d = 0; d < D; d++) sm->acc[d] *= alpha;
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) { /* the weighted values, 16 dims at a time in registers */
            float a[HEAD_BLOCK][16];
            for (int c = 0; c < cb; c++) memcpy(a[c], st[c0 + c]->acc + d0, sizeof a[c]);
            for (int64_t j = 0; j < n; j++) {
                const float *v = values[j] + d0;
                for (int c = 0; c < cb; c++)
                    for (int e = 0; e < 16; e++) a[c][e] += p[c][j] * v[e];
            }
            for (int c = 0; c < cb; c++) memcpy(st[c0 + c]->acc + d0, a[c], sizeof a[c]);
        }
    }
}

/* The partial state of row r, query head h, chunk c: [max, sum, acc[D]]. */
static inline float *partial(float *part, int64_t heads, int64_t chunks, int64_t D, int64_t r, int64_t h,
                             int64_t c) {
    return part + ((r * heads + h) * chunks + c) * (D + 2);
}

/* One work item's attention: the partial states of its rows' query heads of its KV head, over its chunk. */
/* A tile's attention, at the head size's specialised kernel where there is one. */
static inline void attend_tile(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n, int64_t kvh,
                               const float *const *q, softmax_t *const *st, int count) {
#if HAVE_ATTEND_FIXED
    if (m->head_dim == 64) return attend_tile_64(m, L, slots, n, kvh, q, st, count);
    if (m->head_dim == 128) return attend_tile_128(m, L, slots, n, kvh, q, st, count);
#endif
    attend_tile_any(m, L, slots, n, kvh, q, st, count);
}

/* The slots of positions [t0, t1) of `row` (at most TILE), one page-table read per page: no division per key. */
static inline int64_t tile_slots(const model_t *m, int64_t row, int64_t t0, int64_t t1, int64_t *slots) {
    const int64_t *pages = m->page_table + row * m->table_stride, size = m->page_size;
    int64_t page = t0 / size, offset = t0 % size;
    for (int64_t t = t0; t < t1; t++) {
        slots[t - t0] = pages[page] * size + offset;
        if (++offset == size) offset = 0, page++;
    }
    return t1 > t0 ? t1 - t0 : 0;
}

/* Ask for the K and V (every head) of `n` slots ahead of use: they are found through the page table, which the
 * hardware's prefetchers cannot follow. */
static inline void prefetch_slots(const model_t *m, const layer_t *L, const int64_t *slots, int64_t n) {
    const int64_t bytes = m->kv_heads * m->head_dim * (m->kv_half ? 2 : 4);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        const char *k = (const char *)L->k_cache + slot * bytes;
        const char *v = (const char *)L->v_cache + slot * bytes;
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(k + b);
            __builtin_prefetch(v + b);
        }
    }
}

#if defined(__F16C__)
#define HAVE_KV_HALF 1
/* n float16 values as float32. */
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

/* n float32 values as float16, rounded to nearest even (as torch's .to(float16)). */
static inline void floats_to_halves(const float *f, uint16_t *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT);
}
#else
#define HAVE_KV_HALF 0
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) { (void)h, (void)f, (void)n; }
static inline void floats_to_halves(const float *f, uint16_t *h, int64_t n) { (void)f, (void)h, (void)n; }
#endif

/* Whether this build reads float16 KV pages. */
int swarmkv_has_kv_half(void) { return HAVE_KV_HALF; }

static void attend_item(const model_t *m, const layer_t *L, const int64_t *rows, const int64_t *positions,
                        const item_t *item, const float *qkv, float *part, int64_t chunks) {
    const int64_t first = item->first, H = m->kv_heads;
    const int count = (int)item->count;
    const int64_t D = m->head_dim, G = m->heads / H, qkv_width = (m->heads + 2 * H) * D;
    const int64_t total = count * m->heads; /* states ordered (KV head, member, query head of the group) */
    softmax_t *states = malloc(sizeof(softmax_t) * (size_t)total);
    const float **q = malloc(sizeof(float *) * (size_t)total);
    softmax_t **st = malloc(sizeof(softmax_t *) * (size_t)total);
    if (states == NULL || q == NULL || st == NULL) abort(); /* a few KB: out of memory is not recoverable here */
    for (int64_t h = 0; h < H; h++)
        for (int c = 0; c < count; c++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t i = (h * count + c) * G + g;
                states[i].max = -INFINITY;
                states[i].sum = 0.0f;
                memset(states[i].acc, 0, sizeof(float) * (size_t)D);
                q[i] = qkv + (first + c) * qkv_width + (h * G + g) * D;
                st[i] = &states[i];
            }
    const int64_t t0 = item->chunk * CHUNK, ctx = positions[first] + 1;
    const int64_t t1 = t0 + CHUNK < ctx ? t0 + CHUNK : ctx; /* a shared chunk ends before every member's token */
    int64_t slots[2][TILE], staged_slots[TILE];
    /* float16 pages: a tile's K and V (every head) converted once into float32 rows, read in their place */
    const int64_t row_width = H * D;
    float *staged = m->kv_half ? malloc(sizeof(float) * (size_t)(2 * TILE * row_width)) : NULL;
    if (m->kv_half && staged == NULL) abort();
    layer_t staged_layer = *L;
    staged_layer.k_cache = staged, staged_layer.v_cache = staged ? staged + TILE * row_width : NULL;
    for (int64_t j = 0; j < TILE; j++) staged_slots[j] = j;
    int64_t n = tile_slots(m, rows[first], t0, t0 + TILE < t1 ? t0 + TILE : t1, slots[0]);
    for (int64_t t = t0, k = 0; t < t1; t += TILE, k ^= 1) { /* a tile's positions hold every KV head */
        const int64_t after = t + TILE, next = tile_slots(m, rows[first], after, after + TILE < t1 ? after + TILE : t1, slots[k ^ 1]);
        prefetch_slots(m, L, slots[k ^ 1], next);
        const layer_t *tile_layer = L;
        const int64_t *tile_slots_now = slots[k];
        if (staged != NULL) {
            for (int64_t j = 0; j < n; j++) {
                halves_to_floats((const uint16_t *)L->k_cache + slots[k][j] * row_width, staged + j * row_width, row_width);
                halves_to_floats((const uint16_t *)L->v_cache + slots[k][j] * row_width,
                                 staged + (TILE + j) * row_width, row_width);
            }
            tile_layer = &staged_layer, tile_slots_now = staged_slots;
        }
        for (int64_t h = 0; h < H; h++)
            attend_tile(m, tile_layer, tile_slots_now, n, h, q + h * count * G, st + h * count * G, count * (int)G);
        n = next;
    }
    free(staged);
    for (int64_t h = 0; h < H; h++)
        for (int c = 0; c < count; c++)
            for (int64_t g = 0; g < G; g++) {
                const softmax_t *sm = st[(h * count + c) * G + g];
                float *out = partial(part, m->heads, chunks, D, first + c, h * G + g, item->chunk);
                out[0] = sm->max, out[1] = sm->sum;
                memcpy(out + 2, sm->acc, sizeof(float) * (size_t)D);
            }
    free(st);
    free(q);
    free(states);
}

#pragma GCC pop_options

/* Row r's query head h: its chunks' partial states merged in order, into out[D]. */
static void merge_chunks(const float *part, int64_t heads, int64_t chunks, int64_t D, int64_t r, int64_t h,
                         int64_t used, float *out) {
    float top = -INFINITY, sum = 0.0f, acc[MAX_HEAD_DIM] = {0.0f};
    for (int64_t c = 0; c < used; c++) {
        const float *p = partial((float *)part, heads, chunks, D, r, h, c);
        const float new_top = p[0] > top ? p[0] : top;
        const float mine = exp_nonpositive(p[0] - new_top);
        const float theirs = top == -INFINITY ? 0.0f : exp_nonpositive(top - new_top);
        sum = sum * theirs + p[1] * mine;
        for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * theirs + p[2 + d] * mine;
        top = new_top;
    }
    for (int64_t d = 0; d < D; d++) out[d] = acc[d] / sum;
}

/* out = silu(g) * u = g / (1 + e^-g) * u, with e^-|g| from exp_nonpositive (libm's expf is a call an element):
 * for g < 0 the numerator is g e^g, the same value. Eight lanes at a time where the CPU has AVX2 (GCC does not
 * vectorise this loop itself), the same arithmetic in the rest. */
static void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    int64_t k = 0;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (; k + 8 <= n; k += 8) {
        const __m256 v = _mm256_loadu_ps(g + k), e = exp_nonpositive8(_mm256_or_ps(v, sign)); /* e^-|v| */
        const __m256 numerator = _mm256_mul_ps(v, _mm256_blendv_ps(one, e, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ)));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_div_ps(numerator, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + k)));
    }
#endif
    for (; k < n; k++) {
        const float v = g[k], e = exp_nonpositive(-fabsf(v));
        out[k] = v * (v < 0.0f ? e : 1.0f) / (1.0f + e) * u[k];
    }
}

static void embed_row(const linear_t *e, int64_t id, float *out) {
    for (int64_t b = 0; b < e->num_blocks; b++) {
        const block_t *blk = &e->blocks[b];
        if (id < blk->start || id >= blk->start + blk->rows) continue;
        if (blk->w.bits == 0)
            memcpy(out, (const float *)blk->w.low + (id - blk->start) * e->K, sizeof(float) * (size_t)e->K);
        else
            dequantize_row(&blk->w, e->K, id - blk->start, out);
        return;
    }
}

/* Logits [M, vocab] for M rows decoding token ids[m] at positions[m] in page-table rows rows[m]. Rows come in
 * groups (group_sizes, summing to M): a group's members share their first group_shared[g] positions. A hybrid's
 * rows continue the recurrent states of slots state_slots[m] (NULL for a dense model), updated in place; rows
 * of one slot (a speculative chunk) in position order, and where `kept` is not NULL the states after the rows it
 * names are kept there (delta.c). */
int swarmkv_decode_step(const model_t *m, int64_t M, const int64_t *ids, const int64_t *rows,
                        const int64_t *positions, int64_t num_groups, const int64_t *group_sizes,
                        const int64_t *group_shared, const int64_t *state_slots, const kept_t *kept, float *hidden,
                        float *logits, int threads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate, R = m->rotary_dim;
    const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * D;
    const int64_t raw_qkv_width = qkv_width + (m->attn_gate ? m->heads * D : 0);
    const delta_shape_t *dl = &m->delta;
    const int hybrid = dl->value_heads > 0;
    const int64_t delta_width = hybrid ? delta_conv_channels(dl) + dl->value_heads * dl->value_dim : 0;
    const int64_t proj_width = hybrid ? delta_width + 2 * dl->value_heads : 0; /* in_proj ++ in_proj_ba */
    if (m->kv_half && !HAVE_KV_HALF) return 4;
    if (D > MAX_HEAD_DIM || D % 16 || m->heads / m->kv_heads > MAX_GROUP_HEADS || m->heads % m->kv_heads) return 1;
    if (R > D || R % 2) return 1;
    if (hybrid && (state_slots == NULL || dl->key_dim > MAX_HEAD_DIM || dl->value_dim > MAX_HEAD_DIM ||
                   dl->value_heads % dl->key_heads || dl->conv_kernel < 1))
        return 1;
    for (int64_t r = 0; r < M; r++)
        if (positions[r] >= m->max_positions) return 3;
    const int64_t raw_width = raw_qkv_width > proj_width ? raw_qkv_width : proj_width;
    const int64_t mixed_width = hybrid && dl->value_heads * dl->value_dim > m->heads * D ? dl->value_heads * dl->value_dim
                                                                                         : m->heads * D;
    const int64_t conv_width = hybrid ? delta_conv_channels(dl) : 0;
    int64_t widest = H > I ? H : I;
    widest = widest > mixed_width ? widest : mixed_width;
    scratch_t s;
    float *arena = malloc(sizeof(float) * (size_t)(M * (3 * H + qkv_width + raw_width + m->heads * D + mixed_width +
                                                        conv_width + 3 * I + widest) +
                                                   M * widest / 16 * 2 + QX_CONST_FLOATS(M, widest)));
    int8_t *codes = aligned_alloc(64, (size_t)(QX_CODE_BYTES(M, widest) + 63) / 64 * 64); /* whole 512-bit loads */
    int64_t *run_order = hybrid ? malloc(sizeof(int64_t) * (size_t)(2 * M + 1)) : NULL;
    if (arena == NULL || codes == NULL || (hybrid && run_order == NULL)) {
        free(arena);
        free(codes);
        free(run_order);
        return 2;
    }
    const int64_t num_runs = hybrid ? delta_runs(M, state_slots, positions, run_order, run_order + M) : 0;
    s.resid = arena, s.x = s.resid + M * H, s.out = s.x + M * H, s.qkv = s.out + M * H;
    s.raw = s.qkv + M * qkv_width, s.gate = s.raw + M * raw_width, s.attn = s.gate + M * m->heads * D;
    s.conv = s.attn + M * mixed_width, s.gu = s.conv + M * conv_width, s.act = s.gu + M * 2 * I;
    s.xd = s.act + M * I, s.xsum16 = s.xd + M * widest, s.xsum32 = s.xsum16 + M * widest / 16;
    s.qconsts = s.xsum32 + M * widest / 16, s.codes = codes;

    /* attention work items: a group's wholly shared chunks (members MAX_MEMBERS at a time), then each row's own */
    int64_t chunks = 1;
    for (int64_t r = 0; r < M; r++) chunks = positions[r] / CHUNK + 1 > chunks ? positions[r] / CHUNK + 1 : chunks;
    int64_t num_items = 0;
    for (int pass = 0; pass < 2; pass++) {
        item_t *items_out = pass ? s.items : NULL;
        int64_t i = 0, first = 0;
        for (int64_t g = 0; g < num_groups; g++) {
            const int64_t size = group_sizes[g], together = size > 1 ? group_shared[g] / CHUNK : 0;
            for (int64_t c = 0; c < together; c++)
                for (int64_t mc = 0; mc < size; mc += MAX_MEMBERS, i++)
                    if (items_out)
                        items_out[i] = (item_t){first + mc, size - mc < MAX_MEMBERS ? size - mc : MAX_MEMBERS, c};
            for (int64_t r = first; r < first + size; r++)
                for (int64_t c = together; c <= positions[r] / CHUNK; c++, i++)
                    if (items_out) items_out[i] = (item_t){r, 1, c};
            first += size;
        }
        num_items = i;
        if (!pass) {
            s.items = malloc(sizeof(item_t) * (size_t)(num_items + 1));
            s.part = malloc(sizeof(float) * (size_t)(M * m->heads * chunks * (D + 2)));
            if (s.items == NULL || s.part == NULL) {
                free(s.items);
                free(s.part);
                free(arena);
                free(codes);
                free(run_order);
                return 2;
            }
        }
    }
    const item_t *items = s.items;

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) embed_row(&m->embed, ids[r], s.resid + r * H);
        for (int64_t l = 0; l < m->num_layers; l++) {
            const layer_t *L = &m->layers[l];
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) {
                if (l > 0)
                    for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
                rms_norm_row(s.resid + r * H, L->input_norm, m->eps, H, s.x + r * H);
            }
            if (L->linear) {
                linear(&L->qkv, M, s.x, s.raw, &s, m->int8_activations, m->residual_groups);
                delta_mix(dl, M, s.raw, proj_width, s.conv, s.attn, L->conv_w, L->conv_state, L->ssm_state,
                          state_slots, run_order, run_order + M, num_runs, kept, L->state_layer, L->neg_a,
                          L->dt_bias, L->delta_norm, m->eps);
                linear(&L->o, M, s.attn, s.out, &s, m->int8_activations, m->residual_groups);
            } else {
                linear(&L->qkv, M, s.x, m->attn_gate ? s.raw : s.qkv, &s, m->int8_activations, m->residual_groups);
                /* (the gate split off,) q/k norm, rotary, and the new K and V into their slots */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++) {
                    float *q = s.qkv + r * qkv_width, *k = q + m->heads * D, *v = k + m->kv_heads * D;
                    if (m->attn_gate) {
                        const float *raw = s.raw + r * raw_qkv_width;
                        for (int64_t h = 0; h < m->heads; h++) {
                            memcpy(q + h * D, raw + 2 * h * D, sizeof(float) * (size_t)D);
                            memcpy(s.gate + (r * m->heads + h) * D, raw + (2 * h + 1) * D, sizeof(float) * (size_t)D);
                        }
                        memcpy(k, raw + 2 * m->heads * D, sizeof(float) * (size_t)(2 * m->kv_heads * D));
                    }
                    const float *cos = m->cos_sin + positions[r] * R;
                    const float *sin = m->cos_sin + (m->max_positions + positions[r]) * R;
                    for (int64_t h = 0; h < m->heads + m->kv_heads; h++) {
                        float *head = q + h * D;
                        const float *norm = h < m->heads ? L->q_norm : L->k_norm;
                        if (norm != NULL) rms_norm_row(head, norm, m->eps, D, head);
                        rotate(head, cos, sin, R);
                    }
                    const int64_t slot = slot_of(m, rows[r], positions[r]);
                    const int64_t width = m->kv_heads * D;
                    if (m->kv_half) {
                        floats_to_halves(k, (uint16_t *)L->k_cache + slot * width, width);
                        floats_to_halves(v, (uint16_t *)L->v_cache + slot * width, width);
                    } else {
                        memcpy((float *)L->k_cache + slot * width, k, sizeof(float) * (size_t)width);
                        memcpy((float *)L->v_cache + slot * width, v, sizeof(float) * (size_t)width);
                    }
                }
#pragma omp for schedule(dynamic, 1)
                for (int64_t i = 0; i < num_items; i++)
                    attend_item(m, L, rows, positions, &items[i], s.qkv, s.part, chunks);
#pragma omp for schedule(static)
                for (int64_t rh = 0; rh < M * m->heads; rh++) {
                    const int64_t r = rh / m->heads, h = rh % m->heads;
                    float *head = s.attn + rh * D;
                    merge_chunks(s.part, m->heads, chunks, D, r, h, positions[r] / CHUNK + 1, head);
                    if (m->attn_gate)
                        for (int64_t d = 0; d < D; d++) head[d] *= 1.0f / (1.0f + expf(-s.gate[rh * D + d]));
                }
                linear(&L->o, M, s.attn, s.out, &s, m->int8_activations, m->residual_groups);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) {
                for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
                rms_norm_row(s.resid + r * H, L->post_norm, m->eps, H, s.x + r * H);
            }
            linear(&L->gate_up, M, s.x, s.gu, &s, m->int8_activations, m->residual_groups);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) silu_mul(s.gu + r * 2 * I, s.gu + r * 2 * I + I, I, s.act + r * I);
            linear(&L->down, M, s.act, s.out, &s, m->int8_activations, m->residual_groups);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
            rms_norm_row(s.resid + r * H, m->final_norm, m->eps, H, s.x + r * H);
            if (hidden != NULL) memcpy(hidden + r * H, s.x + r * H, sizeof(float) * (size_t)H); /* an MTP drafter's */
        }
        linear(&m->lm_head, M, s.x, logits, &s, m->int8_activations, 0);
        if (m->int8_activations) rescore_top(&m->lm_head, M, s.x, logits);
    }
    free(s.items);
    free(s.part);
    free(arena);
    free(codes);
    free(run_order);
    return 0;
}
