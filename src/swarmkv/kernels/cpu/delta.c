/* A Gated DeltaNet layer's token mixing for one decode token a row (Qwen3.5's linear attention), the part between
 * its input projections and its output projection, over the engine's state slots in place. Included by decode.c
 * (one translation unit). The torch reference is models/gated_delta.py: causal_conv_step, gated_delta_step and
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

/* One value head's recurrent step on its state S [Dk, Dv] in place; writes o [Dv]. q, k normalised already. */
static void delta_head(const float *q, const float *k, const float *v, float g, float beta, float *S, int64_t Dk,
                       int64_t Dv, float *o) {
    float pred[MAX_HEAD_DIM], delta[MAX_HEAD_DIM];
    const float decay = expf(g);
    for (int64_t j = 0; j < Dv; j++) pred[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        float *row = S + i * Dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < Dv; j++) {
            row[j] *= decay;
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

/* The mixing of M rows inside the parallel region. proj [M, stride] holds in_proj's output (q, k, v | the output
 * gate z) then in_proj_ba's (beta's logits | the decay's, a value head each). conv [M, C] is scratch; out
 * [M, value_heads * value_dim] receives the gated-normed heads, out_proj's input. conv_state [slots, C, K-1] and
 * ssm_state [slots, value_heads, key_dim, value_dim] are this layer's, row m's at slot state_slots[m]. neg_a:
 * -e^A_log a value head; norm_w [value_dim]. */
static void delta_mix(const delta_shape_t *d, int64_t M, const float *proj, int64_t stride, float *conv, float *out,
                      const float *conv_w, float *conv_state, float *ssm_state, const int64_t *state_slots,
                      const float *neg_a, const float *dt_bias, const float *norm_w, float eps) {
    const int64_t C = delta_conv_channels(d), Hv = d->value_heads, Dk = d->key_dim, Dv = d->value_dim;
    const int64_t K = d->conv_kernel, key_width = d->key_heads * Dk, group = Hv / d->key_heads;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; r++)
        conv_row(proj + r * stride, conv_w, conv_state + state_slots[r] * C * (K - 1), C, K, conv + r * C);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < M * Hv; rh++) {
        const int64_t r = rh / Hv, h = rh % Hv, kh = d->tiled ? h % d->key_heads : h / group;
        const float *row = conv + r * C, *z = proj + r * stride + C, *ba = z + Hv * Dv;
        float q[MAX_HEAD_DIM], k[MAX_HEAD_DIM];
        l2_normalise(row + kh * Dk, Dk, 1.0f / sqrtf((float)Dk), q);
        l2_normalise(row + key_width + kh * Dk, Dk, 1.0f, k);
        const float g = neg_a[h] * softplus(ba[Hv + h] + dt_bias[h]);
        const float beta = 1.0f / (1.0f + expf(-ba[h]));
        float *o = out + r * Hv * Dv + h * Dv;
        delta_head(q, k, row + 2 * key_width + h * Dv, g, beta, ssm_state + (state_slots[r] * Hv + h) * Dk * Dv, Dk,
                   Dv, o);
        /* the gated RMSNorm: o / rms(o) * w * silu(z) */
        float t = 0.0f;
        for (int64_t j = 0; j < Dv; j++) t += o[j] * o[j];
        const float inv = 1.0f / sqrtf(t / (float)Dv + eps);
        for (int64_t j = 0; j < Dv; j++) o[j] = o[j] * inv * norm_w[j] * silu(z[h * Dv + j]);
    }
}
