/* A Gated DeltaNet layer's token mixing (Qwen3.5's linear attention), the part between its input projections and its
 * output projection, over the engine's state slots in place, for rows that each compute one position. Rows of one
 * slot (a speculative chunk: its request's last token and a draft) run in position order, each from the state the
 * one before it left, and where the step keeps their states (kept_t) each position's conv window and delta-rule
 * state also go to the step's kept buffers, for the engine's rewind. Included by decode.c (one translation unit). The torch reference is models/gated_delta.py: causal_conv_step, gated_delta_step and
 * gated_rms_norm, which this follows operation for operation in float32 (sums in another order).
 *
 * Per value head h, with the state S [Dk, Dv], decay a = e^g and write strength beta:
 *     S <- a S,  delta = beta (v - S^T k),  S <- S + k delta^T,  o = S^T q
 * q and k are L2-normalised (q also times Dk^-1/2). S is walked twice (decay with the prediction, then the write
 * with the output), a head at a time: 64 KB at Dk = Dv = 128, which stays in L2 between the two passes. */

#define L2_NORM_EPS 1e-6f /* added to the squared norm, as the reference and fla's kernels do */

typedef struct {
    int64_t key_heads, value_heads, key_dim, value_dim; /* heads, and each head's size */
    int64_t conv_kernel;
    int tiled; /* value head j reads key head j % key_heads (llama.cpp's order); else j / (value_heads / key_heads) */
} delta_shape_t;

/* A step's speculative chunks' states after each position, for the rewind. Row r's conv window after it is copied
 * to conv[layer][conv_index[r]] (none where negative); its delta-rule state after it is written to
 * ssm[layer][ssm_index[r]] instead of its slot (where negative, to its slot: a chunk's last position, whose state
 * the slot then holds). A state is written once either way: keeping costs the buffer's memory traffic, not a copy.
 * conv [linear layers, conv_count, channels, kernel - 1], ssm [linear layers, ssm_count, value_heads, key_dim,
 * value_dim], a layer's part at its state_layer. */
typedef struct {
    const int64_t *conv_index, *ssm_index;
    float *conv, *ssm;
    int64_t conv_count, ssm_count;
} kept_t;

static inline int64_t delta_conv_channels(const delta_shape_t *d) {
    return 2 * d->key_heads * d->key_dim + d->value_heads * d->value_dim;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

/* The causal conv's new output for one row: channels C, taps w [C, K] (oldest first), the window [C, K-1] of the
 * inputs before x, shifted to end with x. out = silu(taps . (window ++ x)). */
static void conv_row(const float *x, const float *w, float *window, int64_t C, int64_t K, float *out) {
    for (int64_t c = 0; c < C; c++) {
        float *win = window + c * (K - 1);
        const float *taps = w + c * K;
        float t = 0.0f;
        for (int64_t j = 0; j < K - 1; j++) t += win[j] * taps[j];
        t += x[c] * taps[K - 1];
        for (int64_t j = 0; j + 1 < K - 1; j++) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = x[c];
        out[c] = silu(t);
    }
}

/* v / sqrt(|v|^2 + eps) * scale into out. */
static inline void l2_normalise(const float *v, int64_t n, float scale, float *out) {
    float t = 0.0f;
    for (int64_t i = 0; i < n; i++) t += v[i] * v[i];
    const float r = 1.0f / sqrtf(t + L2_NORM_EPS) * scale;
    for (int64_t i = 0; i < n; i++) out[i] = v[i] * r;
}

/* One value head's recurrent step from the state S_in [Dk, Dv] into S (the same memory, or a kept copy's); writes
 * o [Dv]. q, k normalised already. Each element is read from S_in and written to S before S is read again, so the
 * values are the same in place or not. */
static void delta_head(const float *q, const float *k, const float *v, float g, float beta, const float *S_in,
                       float *S, int64_t Dk, int64_t Dv, float *o) {
    float pred[MAX_HEAD_DIM], delta[MAX_HEAD_DIM];
    const float decay = expf(g);
    for (int64_t j = 0; j < Dv; j++) pred[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        float *row = S + i * Dv;
        const float *row_in = S_in + i * Dv, ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) {
            row[j] = row_in[j] * decay;
            pred[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < Dv; j++) delta[j] = (v[j] - pred[j]) * beta;
    for (int64_t i = 0; i < Dk; i++) {
        float *row = S + i * Dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) {
            row[j] += ki * delta[j];
            o[j] += qi * row[j];
        }
    }
}

/* Rows by slot for delta_mix: order [M] lists the rows slot by slot, each slot's in position order; runs [count
 * + 1] are the offsets in order where a slot's rows start (and M). Before the parallel region. */
static int64_t delta_runs(int64_t M, const int64_t *state_slots, const int64_t *positions, int64_t *order,
                          int64_t *runs) {
    for (int64_t r = 0; r < M; r++) { /* insertion sort on (slot, position): a step's rows are few */
        int64_t i = r;
        for (; i > 0; i--) {
            const int64_t o = order[i - 1];
            if (state_slots[o] < state_slots[r] || (state_slots[o] == state_slots[r] && positions[o] < positions[r]))
                break;
            order[i] = o;
        }
        order[i] = r;
    }
    int64_t count = 0;
    for (int64_t i = 0; i < M; i++)
        if (i == 0 || state_slots[order[i]] != state_slots[order[i - 1]]) runs[count++] = i;
    runs[count] = M;
    return count;
}

/* The mixing of M rows inside the parallel region, a slot's rows (a run of order, delta_runs) in position order.
 * proj [M, stride] holds in_proj's output (q, k, v | the output gate z) then in_proj_ba's (beta's logits | the
 * decay's, a value head each). conv [M, C] is scratch; out [M, value_heads * value_dim] receives the gated-normed
 * heads, out_proj's input. conv_state [slots, C, K-1] and ssm_state [slots, value_heads, key_dim, value_dim] are
 * this layer's (state_layer among the linear ones), row m's at slot state_slots[m]; kept (or NULL) says which
 * rows' states after them are kept. neg_a: -e^A_log a value head; norm_w [value_dim]. */
static void delta_mix(const delta_shape_t *d, int64_t M, const float *proj, int64_t stride, float *conv, float *out,
                      const float *conv_w, float *conv_state, float *ssm_state, const int64_t *state_slots,
                      const int64_t *order, const int64_t *runs, int64_t num_runs, const kept_t *kept,
                      int64_t state_layer, const float *neg_a, const float *dt_bias, const float *norm_w, float eps) {
    const int64_t C = delta_conv_channels(d), Hv = d->value_heads, Dk = d->key_dim, Dv = d->value_dim;
    const int64_t K = d->conv_kernel, key_width = d->key_heads * Dk, group = Hv / d->key_heads;
    const int64_t window = C * (K - 1), head_state = Dk * Dv;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < num_runs; u++)
        for (int64_t i = runs[u]; i < runs[u + 1]; i++) {
            const int64_t r = order[i];
            float *win = conv_state + state_slots[r] * window;
            conv_row(proj + r * stride, conv_w, win, C, K, conv + r * C);
            if (kept != NULL && kept->conv_index[r] >= 0)
                memcpy(kept->conv + (state_layer * kept->conv_count + kept->conv_index[r]) * window, win,
                       sizeof(float) * (size_t)window);
        }
#pragma omp for schedule(static)
    for (int64_t uh = 0; uh < num_runs * Hv; uh++) {
        const int64_t u = uh / Hv, h = uh % Hv, kh = d->tiled ? h % d->key_heads : h / group;
        float *slot_state = ssm_state + (state_slots[order[runs[u]]] * Hv + h) * head_state;
        const float *before = slot_state; /* the state the run's next row continues */
        for (int64_t i = runs[u]; i < runs[u + 1]; i++) {
            const int64_t r = order[i];
            const float *row = conv + r * C, *z = proj + r * stride + C, *ba = z + Hv * Dv;
            float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM];
            l2_normalise(row + kh * Dk, Dk, 1.0f / sqrtf((float)Dk), q);
            l2_normalise(row + key_width + kh * Dk, Dk, 1.0f, k);
            const float g = neg_a[h] * softplus(ba[Hv + h] + dt_bias[h]);
            const float beta = 1.0f / (1.0f + expf(-ba[h]));
            float *after = slot_state;
            if (kept != NULL && kept->ssm_index[r] >= 0)
                after = kept->ssm + ((state_layer * kept->ssm_count + kept->ssm_index[r]) * Hv + h) * head_state;
            float *o = out + r * Hv * Dv + h * Dv;
            delta_head(q, k, row + 2 * key_width + h * Dv, g, beta, before, after, Dk, Dv, o);
            before = after;
            /* the gated RMSNorm: o / rms(o) * w * silu(z) */
            float t = 0.0f;
            for (int64_t j = 0; j < Dv; j++) t += o[j] * o[j];
            const float inv = 1.0f / sqrtf(t / (float)Dv + eps);
            for (int64_t j = 0; j < Dv; j++) o[j] = o[j] * inv * norm_w[j] * silu(z[h * Dv + j]);
        }
    }
}
