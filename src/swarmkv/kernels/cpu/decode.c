/* One decode step of a dense decoder (Llama, Mistral, Qwen2, Qwen3) on the CPU, in one call: embedding,
 * every layer (norms, QKV, q/k norm, rotary, the KV store, paged attention, output projection, SwiGLU) and the
 * LM head, for M rows that each decode one token. Weights are the grouped layout of grouped.c (or float32 row
 * blocks); K and V are the engine's float32 slabs, addressed through its page table.
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

#include "grouped.c" /* one translation unit: the matmul's inline kernels are shared, not exported */

#define TILE 32       /* keys per attention tile */
#define CHUNK 256     /* keys per attention partial: every row splits its context at multiples of CHUNK */
#define MAX_MEMBERS 4 /* rows of a group one attention work item serves */
#define MAX_HEAD_DIM 256
#define MAX_GROUP_HEADS 16 /* query heads per KV head */

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
    linear_t qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's slabs [slots, kv_heads, head_dim] */
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
} model_t;

/* One attention work item: KV head `kv_head` over the keys of chunk `chunk` (positions [chunk * CHUNK, ...)),
 * for rows [first, first + count): several rows only where that chunk lies wholly in the pages they share. */
typedef struct {
    int64_t first, count, kv_head, chunk;
} item_t;

/* Scratch for one step, allocated once per call. */
typedef struct {
    float *resid, *x, *qkv, *attn, *gu, *act, *out;
    float *xd, *xsum16, *xsum32;
    int8_t *codes;    /* [2, M, widest]: int8 x, natural and paired orders */
    float *qconsts;   /* [10, M, widest / 32]: their scales, scaled sums and the scales spread eight wide */
    qx_t qx;
    item_t *items; /* attention work items */
    float *part;   /* [M, heads, chunks, 2 + head_dim]: each chunk's partial softmax state */
} scratch_t;

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float lanes[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += a[i + j] * b[i + j];
    float t = 0.0f;
    for (; i < n; i++) t += a[i] * b[i];
    for (int j = 0; j < 16; j++) t += lanes[j];
    return t;
}

/* y[M, N] = x W^T (+ bias) for this thread's rows of every block; x's forms are prepared first by one thread.
 * Ends at a barrier. */
static void linear(const linear_t *l, int64_t M, const float *x, float *y, scratch_t *s, int int8) {
    const int64_t K = l->K;
#pragma omp single
    {
        int need_d = 0, need16 = 0, need32 = 0, need_q = 0;
        for (int64_t b = 0; b < l->num_blocks; b++) {
            const layout_t *w = &l->blocks[b].w;
            if (w->bits == 0) continue;
            if (int8 && int8_dot_reads(w)) {
                need_q = 1;
                continue;
            }
            need_d |= w->bits != 8;
            need16 |= w->group == 16;
            need32 |= w->group == 32;
        }
        if (need16) prepare_x(M, K, 16, x, need_d ? s->xd : NULL, s->xsum16);
        if (need32) prepare_x(M, K, 32, x, need16 || !need_d ? NULL : s->xd, s->xsum32);
        if (need_q) {
            const int64_t groups = K / 32;
            float *spread = s->qconsts + 2 * M * groups;
            s->qx = (qx_t){s->codes, s->codes + M * K, s->qconsts, s->qconsts + M * groups, spread};
            quantize_x(M, K, x, s->codes, s->codes + M * K, s->qconsts, s->qconsts + M * groups, spread);
        }
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

/* Rotate one head in place by its position's cos/sin (rotate-half form: pairs (d, d + D/2)). */
static inline void rotate(float *h, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    float tmp[MAX_HEAD_DIM];
    for (int64_t d = 0; d < half; d++) {
        tmp[d] = h[d] * cos[d] + (-h[d + half]) * sin[d];
        tmp[d + half] = h[d + half] * cos[d + half] + h[d] * sin[d + half];
    }
    memcpy(h, tmp, sizeof(float) * (size_t)D);
}

static inline int64_t slot_of(const model_t *m, int64_t row, int64_t position) {
    return m->page_table[row * m->table_stride + position / m->page_size] * m->page_size + position % m->page_size;
}

/* Online-softmax state of one query head. */
typedef struct {
    float max, sum;
    float acc[MAX_HEAD_DIM];
} softmax_t;

/* Fold keys [t0, t1) of `row` (one tile) into the states of `count` query heads q (of KV head `kvh`). */
static void attend_tile(const model_t *m, const layer_t *L, int64_t row, int64_t kvh, int64_t t0, int64_t t1,
                        const float *const *q, softmax_t *const *st, int count) {
    const int64_t D = m->head_dim, stride = m->kv_heads * D;
    float scores[TILE];
    const float *keys[TILE], *values[TILE];
    for (int64_t t = t0; t < t1; t++) {
        const int64_t slot = slot_of(m, row, t);
        keys[t - t0] = L->k_cache + slot * stride + kvh * D;
        values[t - t0] = L->v_cache + slot * stride + kvh * D;
    }
    const int64_t n = t1 - t0;
    for (int c = 0; c < count; c++) {
        softmax_t *s = st[c];
        float tile_max = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            scores[j] = dot_f32(q[c], keys[j], D) * m->scale;
            tile_max = scores[j] > tile_max ? scores[j] : tile_max;
        }
        const float new_max = tile_max > s->max ? tile_max : s->max;
        const float alpha = expf(s->max - new_max); /* 0 on the first tile: max starts at -inf */
        s->sum *= alpha;
        for (int64_t d = 0; d < D; d++) s->acc[d] *= alpha;
        for (int64_t j = 0; j < n; j++) {
            const float p = expf(scores[j] - new_max);
            s->sum += p;
            const float *v = values[j];
            for (int64_t d = 0; d < D; d++) s->acc[d] += p * v[d];
        }
        s->max = new_max;
    }
}

/* The partial state of row r, query head h, chunk c: [max, sum, acc[D]]. */
static inline float *partial(float *part, int64_t heads, int64_t chunks, int64_t D, int64_t r, int64_t h,
                             int64_t c) {
    return part + ((r * heads + h) * chunks + c) * (D + 2);
}

/* One work item's attention: the partial states of its rows' query heads of its KV head, over its chunk. */
static void attend_item(const model_t *m, const layer_t *L, const int64_t *rows, const int64_t *positions,
                        const item_t *item, const float *qkv, float *part, int64_t chunks) {
    const int64_t first = item->first, kvh = item->kv_head;
    const int count = (int)item->count;
    const int64_t D = m->head_dim, G = m->heads / m->kv_heads, qkv_width = (m->heads + 2 * m->kv_heads) * D;
    softmax_t states[MAX_MEMBERS * MAX_GROUP_HEADS];
    const float *q[MAX_MEMBERS * MAX_GROUP_HEADS];
    softmax_t *st[MAX_MEMBERS * MAX_GROUP_HEADS];
    for (int c = 0; c < count; c++)
        for (int64_t g = 0; g < G; g++) {
            const int i = c * (int)G + (int)g;
            states[i].max = -INFINITY;
            states[i].sum = 0.0f;
            memset(states[i].acc, 0, sizeof(float) * (size_t)D);
            q[i] = qkv + (first + c) * qkv_width + (kvh * G + g) * D;
            st[i] = &states[i];
        }
    const int64_t t0 = item->chunk * CHUNK, ctx = positions[first] + 1;
    const int64_t t1 = t0 + CHUNK < ctx ? t0 + CHUNK : ctx; /* a shared chunk ends before every member's token */
    for (int64_t t = t0; t < t1; t += TILE)
        attend_tile(m, L, rows[first], kvh, t, t + TILE < t1 ? t + TILE : t1, q, st, count * (int)G);
    for (int c = 0; c < count; c++)
        for (int64_t g = 0; g < G; g++) {
            const softmax_t *sm = st[c * G + g];
            float *out = partial(part, m->heads, chunks, D, first + c, kvh * G + g, item->chunk);
            out[0] = sm->max, out[1] = sm->sum;
            memcpy(out + 2, sm->acc, sizeof(float) * (size_t)D);
        }
}

/* Row r's query head h: its chunks' partial states merged in order, into out[D]. */
static void merge_chunks(const float *part, int64_t heads, int64_t chunks, int64_t D, int64_t r, int64_t h,
                         int64_t used, float *out) {
    float top = -INFINITY, sum = 0.0f, acc[MAX_HEAD_DIM] = {0.0f};
    for (int64_t c = 0; c < used; c++) {
        const float *p = partial((float *)part, heads, chunks, D, r, h, c);
        const float new_top = p[0] > top ? p[0] : top;
        const float mine = expf(p[0] - new_top), theirs = expf(top - new_top);
        sum = sum * theirs + p[1] * mine;
        for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * theirs + p[2 + d] * mine;
        top = new_top;
    }
    for (int64_t d = 0; d < D; d++) out[d] = acc[d] / sum;
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
 * groups (group_sizes, summing to M): a group's members share their first group_shared[g] positions. */
int swarmkv_decode_step(const model_t *m, int64_t M, const int64_t *ids, const int64_t *rows,
                        const int64_t *positions, int64_t num_groups, const int64_t *group_sizes,
                        const int64_t *group_shared, float *logits, int threads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t qkv_width = (m->heads + 2 * m->kv_heads) * D;
    if (D > MAX_HEAD_DIM || D % 2 || m->heads / m->kv_heads > MAX_GROUP_HEADS || m->heads % m->kv_heads) return 1;
    for (int64_t r = 0; r < M; r++)
        if (positions[r] >= m->max_positions) return 3;
    int64_t widest = H > I ? H : I;
    widest = widest > m->heads * D ? widest : m->heads * D;
    scratch_t s;
    float *arena = malloc(sizeof(float) * (size_t)(M * (3 * H + qkv_width + m->heads * D + 3 * I + widest) +
                                                   M * widest / 16 * 2 + M * widest / 32 * 10));
    int8_t *codes = malloc((size_t)(2 * M * widest));
    if (arena == NULL || codes == NULL) {
        free(arena);
        free(codes);
        return 2;
    }
    s.resid = arena, s.x = s.resid + M * H, s.out = s.x + M * H, s.qkv = s.out + M * H;
    s.attn = s.qkv + M * qkv_width, s.gu = s.attn + M * m->heads * D, s.act = s.gu + M * 2 * I;
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
                for (int64_t mc = 0; mc < size; mc += MAX_MEMBERS)
                    for (int64_t h = 0; h < m->kv_heads; h++, i++)
                        if (items_out)
                            items_out[i] = (item_t){first + mc, size - mc < MAX_MEMBERS ? size - mc : MAX_MEMBERS, h, c};
            for (int64_t r = first; r < first + size; r++)
                for (int64_t c = together; c <= positions[r] / CHUNK; c++)
                    for (int64_t h = 0; h < m->kv_heads; h++, i++)
                        if (items_out) items_out[i] = (item_t){r, 1, h, c};
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
            if (l > 0) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++)
                    for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) rms_norm_row(s.resid + r * H, L->input_norm, m->eps, H, s.x + r * H);
            linear(&L->qkv, M, s.x, s.qkv, &s, m->int8_activations);
            /* q/k norm, rotary, and the new K and V into their slots */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) {
                float *q = s.qkv + r * qkv_width, *k = q + m->heads * D, *v = k + m->kv_heads * D;
                const float *cos = m->cos_sin + positions[r] * D;
                const float *sin = m->cos_sin + (m->max_positions + positions[r]) * D;
                for (int64_t h = 0; h < m->heads + m->kv_heads; h++) {
                    float *head = q + h * D;
                    const float *norm = h < m->heads ? L->q_norm : L->k_norm;
                    if (norm != NULL) rms_norm_row(head, norm, m->eps, D, head);
                    rotate(head, cos, sin, D);
                }
                const int64_t slot = slot_of(m, rows[r], positions[r]);
                memcpy(L->k_cache + slot * m->kv_heads * D, k, sizeof(float) * (size_t)(m->kv_heads * D));
                memcpy(L->v_cache + slot * m->kv_heads * D, v, sizeof(float) * (size_t)(m->kv_heads * D));
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_items; i++) attend_item(m, L, rows, positions, &items[i], s.qkv, s.part, chunks);
#pragma omp for schedule(static)
            for (int64_t rh = 0; rh < M * m->heads; rh++) {
                const int64_t r = rh / m->heads, h = rh % m->heads;
                merge_chunks(s.part, m->heads, chunks, D, r, h, positions[r] / CHUNK + 1, s.attn + rh * D);
            }
            linear(&L->o, M, s.attn, s.out, &s, m->int8_activations);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++) {
                for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
                rms_norm_row(s.resid + r * H, L->post_norm, m->eps, H, s.x + r * H);
            }
            linear(&L->gate_up, M, s.x, s.gu, &s, m->int8_activations);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                for (int64_t k = 0; k < I; k++) {
                    const float g = s.gu[r * 2 * I + k];
                    s.act[r * I + k] = g / (1.0f + expf(-g)) * s.gu[r * 2 * I + I + k];
                }
            linear(&L->down, M, s.act, s.out, &s, m->int8_activations);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) {
            for (int64_t k = 0; k < H; k++) s.resid[r * H + k] += s.out[r * H + k];
            rms_norm_row(s.resid + r * H, m->final_norm, m->eps, H, s.x + r * H);
        }
        linear(&m->lm_head, M, s.x, logits, &s, m->int8_activations);
    }
    free(s.items);
    free(s.part);
    free(arena);
    free(codes);
    return 0;
}
