/* forward.c — the decoder forward pass (docs/models.md): pre-norm blocks with
 * RMSNorm, GQA attention with RoPE, SwiGLU, final norm and output matrix,
 * float32 activations, every weight product one BLAS sgemm over all
 * positions (prefill).
 *
 * Several streams run in lockstep: the exact model and any number of
 * quantized caches.  Each layer's weights are dequantized once for all of
 * them (peak memory: the mapped file + one layer in float32 + activations),
 * and the output head walks the vocabulary in chunks, keeping an online
 * log-softmax per position, so neither the output matrix nor the logits are
 * ever whole in memory.
 *
 * A quantized stream replaces K, V [H][T][D] of a layer by the registry
 * quantizer's reconstruction, exactly as kvq-analyze calls it
 * (kvq_quantize_layer), either on all T tokens at once (prefill) or, for
 * decode, on the cache as it holds the first c tokens, c growing by
 * `stride` (1: every position). */
#include "model.h"
#include "../quant/quant.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------- fixed-tile products */

/* Every product of the forward pass is cut into tiles whose bounds depend
 * on the shapes alone, and each tile is one single-threaded sgemm call, so
 * every output element is computed by the same call with the same operands
 * whatever the thread count: results do not depend on --threads (docs/models.md
 * "Forward").  A multi-threaded BLAS call splits its work by the thread
 * count, and a last-bit change in a key can flip a 4-bit rounding. */
enum { TILE_ROWS = 512, TILE_COLS = 1024, ATT_ROWS = 64 };

static int imin(int a, int b) { return a < b ? a : b; }

/* y [M][N] = x [M][K] · W [N][K]ᵀ + beta · y */
static void gemm_tiled(float *y, const float *x, const float *W, int M, int K, int N, float beta, int nt)
{
    int mt = (M + TILE_ROWS - 1) / TILE_ROWS, ct = (N + TILE_COLS - 1) / TILE_COLS;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < mt * ct; i++) {
        int r = i / ct * TILE_ROWS, c = i % ct * TILE_COLS;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, imin(TILE_ROWS, M - r), imin(TILE_COLS, N - c), K, 1.0f,
                    x + (size_t)r * K, K, W + (size_t)c * K, K, beta, y + (size_t)r * N + c, N);
    }
}

/* ------------------------------------------------------------ weights */

typedef struct fw_weights {
    const float *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *q_norm, *k_norm, *wo, *post_attn_norm, *ffn_norm, *w_gate,
        *w_up, *w_down, *post_ffn_norm;
    float *buf; /* dequantized copies of the tensors not used in place */
    size_t cap;
} fw_weights;

static size_t wt_floats(const kvq_wtensor *t) { return t->data ? (size_t)t->cols * (size_t)t->rows : 0; }

/* float32 tensors aligned for float loads are used in place. */
static int in_place(const kvq_wtensor *t) { return t->type == KVQ_GGML_F32 && ((uintptr_t)t->data & 3) == 0; }

/* The error for the first non-finite weight, index bad of the rows from r0 at x. */
static kvq_status nonfinite_weight(const kvq_model *m, const kvq_wtensor *t, int64_t r0, const float *x, size_t bad,
                                   kvq_error *err)
{
    size_t cols = (size_t)t->cols;
    return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: row %lld, column %zu is %g: expected finite weights", m->path,
                    t->name ? t->name : "?", (long long)(r0 + (int64_t)(bad / cols)), bad % cols, (double)x[bad]);
}

/* Rows [r0, r1) of t dequantized into out, rows shared among nt threads
 * (each value is computed alone: the result is the same for any nt), and
 * checked finite: fails naming the tensor, row and column of the first
 * non-finite weight. */
static kvq_status weight_rows(const kvq_model *m, const kvq_wtensor *t, int64_t r0, int64_t r1, float *out, int nt,
                              kvq_error *err)
{
    size_t cols = (size_t)t->cols, bad = SIZE_MAX;
    int64_t chunk = (int64_t)((1u << 16) / cols) + 1; /* rows of at least 64k values per task */
#pragma omp parallel for num_threads(nt) schedule(static) reduction(min : bad)
    for (int64_t a = r0; a < r1; a += chunk) {
        int64_t b = a + chunk < r1 ? a + chunk : r1;
        float *y = out + (size_t)(a - r0) * cols;
        kvq_wtensor_rows(t, a, b, y);
        size_t n = (size_t)(b - a) * cols, i = kvq_first_nonfinite(y, n);
        if (i < n && (size_t)(a - r0) * cols + i < bad) bad = (size_t)(a - r0) * cols + i;
    }
    return bad == SIZE_MAX ? KVQ_OK : nonfinite_weight(m, t, r0, out, bad, err);
}

static kvq_status load_layer(const kvq_model *m, int l, fw_weights *w, int nt, kvq_error *err)
{
    const kvq_layer_weights *lw = &m->layer[l];
    const kvq_wtensor *src[KVQ_LAYER_TENSORS] = {&lw->attn_norm,
                                                 &lw->wq,
                                                 &lw->wk,
                                                 &lw->wv,
                                                 &lw->bq,
                                                 &lw->bk,
                                                 &lw->bv,
                                                 &lw->q_norm,
                                                 &lw->k_norm,
                                                 &lw->wo,
                                                 &lw->post_attn_norm,
                                                 &lw->ffn_norm,
                                                 &lw->w_gate,
                                                 &lw->w_up,
                                                 &lw->w_down,
                                                 &lw->post_ffn_norm};
    const float **dst[KVQ_LAYER_TENSORS] = {&w->attn_norm, &w->wq, &w->wk, &w->wv, &w->bq, &w->bk, &w->bv, &w->q_norm,
                                            &w->k_norm, &w->wo, &w->post_attn_norm, &w->ffn_norm, &w->w_gate, &w->w_up,
                                            &w->w_down, &w->post_ffn_norm};
    size_t need = 0;
    for (int i = 0; i < KVQ_LAYER_TENSORS; i++)
        if (src[i]->data && !in_place(src[i])) need += wt_floats(src[i]);
    if (need > w->cap) {
        free(w->buf);
        w->cap = 0;
        if (!(w->buf = kvq_alloc_array(need, sizeof(float))))
            return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for layer %d's weights (%zu floats)", m->path, l,
                            need);
        w->cap = need;
    }
    size_t off = 0;
    for (int i = 0; i < KVQ_LAYER_TENSORS; i++) {
        const kvq_wtensor *t = src[i];
        kvq_status st = KVQ_OK;
        if (!t->data) {
            *dst[i] = NULL;
        } else if (in_place(t)) {
            *dst[i] = (const float *)t->data;
            size_t n = wt_floats(t), bad = kvq_first_nonfinite(*dst[i], n);
            if (bad < n) st = nonfinite_weight(m, t, 0, *dst[i], bad, err);
        } else {
            st = weight_rows(m, t, 0, t->rows, w->buf + off, nt, err);
            *dst[i] = w->buf + off;
            off += wt_floats(t);
        }
        if (st) return st;
    }
    return KVQ_OK;
}

/* --------------------------------------------------------- small ops */

/* out[t] = x[t] / sqrt(mean(x[t]²) + eps) · w, rows of n. */
static void rmsnorm(float *out, const float *x, const float *w, int T, int n, float eps, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        float *o = out + (size_t)t * n;
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++) o[i] = w[i] * (scale * xr[i]);
    }
}

/* y [T][out] = x [T][in] · Wᵀ (+ bias) (+ y if accumulate); W [out][in]. */
static void linear(float *y, const float *x, const float *W, const float *bias, int T, int in, int out, int accumulate,
                   int nt)
{
    gemm_tiled(y, x, W, T, in, out, accumulate ? 1.0f : 0.0f, nt);
    if (bias)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < out; i++) y[(size_t)t * out + i] += bias[i];
}

/* [T][nh·D] (one row per position) <-> [nh][T][D] (one matrix per head). */
static void to_heads(const float *x, float *y, int T, int nh, int D)
{
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < T; t++)
            memcpy(y + ((size_t)h * T + t) * D, x + (size_t)t * nh * D + (size_t)h * D, (size_t)D * sizeof(float));
}

int kvq_model_rope_tabled(const kvq_model *m)
{
    return m->info.has_rope_freqs || (m->info.rope_scale > 0 && m->info.rope_scale != 1.0);
}

kvq_status kvq_model_rope(const kvq_model *m, int T, double theta, double scale, kvq_rope *r, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    int D = in->head_dim, half = D / 2;
    kvq_status st = kvq_rope_from_theta(r, T, D, theta, in->rope_style, err);
    if (!(scale > 0)) scale = 1.0;
    if (st || (!in->has_rope_freqs && scale == 1.0)) return st;
    float *f = kvq_alloc_array((size_t)half, sizeof *f);
    if (!f) {
        kvq_rope_free(r);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < half; i++) f[i] = 1.0f;
    if (in->has_rope_freqs) kvq_wtensor_rows(&m->rope_freqs, 0, 1, f);
    for (int i = 0; i < half; i++)
        if (!(f[i] > 0) || !isfinite(f[i])) {
            kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor rope_freqs.weight: factor %d is %g: expected a positive number",
                     m->path, i, (double)f[i]);
            kvq_rope_free(r);
            free(f);
            return KVQ_ERR_FORMAT;
        }
    /* llama.cpp multiplies the position by freq_scale and divides each pair's angle by its factor */
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double ang = t * scale * pow(theta, -2.0 * i / D) / f[i];
            r->cos[(size_t)t * half + i] = cos(ang);
            r->sin[(size_t)t * half + i] = sin(ang);
        }
    free(f);
    return KVQ_OK;
}

/* -------------------------------------------------------- attention */

/* Per-thread buffers of attend(): scores of one tile, the tile's output,
 * and (decode) the zero-padded keys and values the tile reads. */
typedef struct att_buf {
    float *S, *O, *Kp, *Vp;
} att_buf;

/* Causal attention, with a sliding window W > 0 (p − W < k <= p), of the
 * query rows [r0, r1) of every head over a cache of the first c keys
 * (c >= r1) of K, V [H][c][D] (head h at h·c·D); Q [Hq][T][D]; the rows
 * go to att [T][Hq·D].
 *
 * Rows are done in tiles of ATT_ROWS positions aligned to multiples of
 * ATT_ROWS; the tile [a, b) reads keys [k0, b) (k0 = max(0, a − W + 1) with
 * a window, else 0).  Its two products (S = scale · Q·Kᵀ, then O = A·V by
 * sgemm) have the same shapes and the same operands in every row that is
 * used whether the cache holds all of [k0, b) (prefill) or only its first
 * keys (decode: the rest are zero rows, masked), so a row's output depends
 * on its query and the keys it sees alone: prefill and decode agree bit for
 * bit for a quantizer whose reconstruction of a token depends on that token
 * alone, and no result depends on the thread count.  Softmax per row in
 * float with a double sum. */
static void attend(const float *Q, const float *K, const float *V, int c, int T, int Hq, int H, int D, int W,
                   float scale, int r0, int r1, float *att, const att_buf *buf, int nt)
{
    int G = Hq / H, t0 = r0 / ATT_ROWS, t1 = (r1 + ATT_ROWS - 1) / ATT_ROWS, ntile = t1 - t0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < Hq * ntile; i++) {
        const att_buf *B = &buf[omp_get_thread_num()];
        int j = i / ntile, a = (t0 + i % ntile) * ATT_ROWS, b = imin(a + ATT_ROWS, T);
        int k0 = W > 0 && a - W + 1 > 0 ? a - W + 1 : 0, n = b - k0, m = b - a;
        int ra = a > r0 ? a : r0, rb = b < r1 ? b : r1; /* the rows wanted */
        const float *Kh = K + (size_t)(j / G) * c * D + (size_t)k0 * D,
                    *Vh = V + (size_t)(j / G) * c * D + (size_t)k0 * D;
        if (c < b) { /* decode: keys [k0, c) and zero rows up to b */
            size_t have = (size_t)(c - k0) * D, pad = (size_t)(b - c) * D;
            memcpy(B->Kp, Kh, have * sizeof(float)), memset(B->Kp + have, 0, pad * sizeof(float));
            memcpy(B->Vp, Vh, have * sizeof(float)), memset(B->Vp + have, 0, pad * sizeof(float));
            Kh = B->Kp, Vh = B->Vp;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, D, scale, Q + ((size_t)j * T + a) * D, D, Kh, D,
                    0.0f, B->S, n);
        for (int t = a; t < b; t++) {
            float *s = B->S + (size_t)(t - a) * n;
            if (t < ra || t >= rb) { /* a row not wanted now: zero, so that A stays finite */
                memset(s, 0, (size_t)n * sizeof(float));
                continue;
            }
            int u0 = W > 0 && t - W + 1 > k0 ? t - W + 1 - k0 : 0, u1 = t - k0; /* keys k0 + [u0, u1] */
            float mx = s[u0];
            for (int u = u0 + 1; u <= u1; u++) mx = s[u] > mx ? s[u] : mx;
            double sum = 0;
            for (int u = u0; u <= u1; u++) {
                s[u] = expf(s[u] - mx);
                sum += s[u];
            }
            float inv = (float)(1.0 / sum);
            for (int u = 0; u < u0; u++) s[u] = 0.0f;
            for (int u = u0; u <= u1; u++) s[u] *= inv;
            for (int u = u1 + 1; u < n; u++) s[u] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, D, n, 1.0f, B->S, n, Vh, D, 0.0f, B->O, D);
        for (int t = ra; t < rb; t++)
            memcpy(att + (size_t)t * Hq * D + (size_t)j * D, B->O + (size_t)(t - a) * D, (size_t)D * sizeof(float));
    }
}

/* ------------------------------------------------------- the pass */

typedef struct fw_scratch {
    float *xn, *xo, *q, *k, *v, *att, *g, *u; /* row-major activations */
    float *Qh, *Kh, *Vh, *Kpre;               /* [.][T][D] */
    float *pk, *pv, *ppre;                    /* decode: the first c tokens, [H][c][D] */
    float *kq, *vq;                           /* quantizer outputs [H][T][D] */
    double *kb, *vb, *sb;                     /* [H] */
    att_buf *ab;                              /* [nt] */
    int nab;
} fw_scratch;

static void scratch_free(fw_scratch *s)
{
    float *f[] = {s->xn, s->xo, s->q,    s->k,  s->v,  s->att,  s->g,  s->u, s->Qh,
                  s->Kh, s->Vh, s->Kpre, s->pk, s->pv, s->ppre, s->kq, s->vq};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(f[i]);
    free(s->kb), free(s->vb), free(s->sb);
    for (int i = 0; s->ab && i < s->nab; i++) free(s->ab[i].S), free(s->ab[i].O), free(s->ab[i].Kp), free(s->ab[i].Vp);
    free(s->ab);
    memset(s, 0, sizeof *s);
}

/* quantized: some stream quantizes its cache (the prefix and output buffers
 * are needed); the exact model alone does without them. */
static kvq_status scratch_alloc(fw_scratch *s, const kvq_model_info *in, int T, int quantized, int nt, kvq_error *err)
{
    size_t t = (size_t)T, qd = (size_t)in->n_heads * in->head_dim, kd = (size_t)in->n_kv_heads * in->head_dim;
    size_t D = (size_t)in->head_dim;
    int ok = 1;
    memset(s, 0, sizeof *s);
    s->xn = kvq_alloc_array(t, in->dim * sizeof(float));
    s->xo = kvq_alloc_array(t, in->dim * sizeof(float));
    s->q = kvq_alloc_array(t, qd * sizeof(float)), s->att = kvq_alloc_array(t, qd * sizeof(float));
    s->Qh = kvq_alloc_array(t, qd * sizeof(float));
    s->k = kvq_alloc_array(t, kd * sizeof(float)), s->v = kvq_alloc_array(t, kd * sizeof(float));
    s->Kh = kvq_alloc_array(t, kd * sizeof(float)), s->Vh = kvq_alloc_array(t, kd * sizeof(float));
    s->Kpre = kvq_alloc_array(t, kd * sizeof(float));
    if (quantized) {
        s->pk = kvq_alloc_array(t, kd * sizeof(float)), s->pv = kvq_alloc_array(t, kd * sizeof(float));
        s->ppre = kvq_alloc_array(t, kd * sizeof(float));
        s->kq = kvq_alloc_lines(t * kd * sizeof(float)), s->vq = kvq_alloc_lines(t * kd * sizeof(float));
        ok = s->pk && s->pv && s->ppre && s->kq && s->vq;
    }
    s->g = kvq_alloc_array(t, (size_t)in->ffn_dim * sizeof(float));
    s->u = kvq_alloc_array(t, (size_t)in->ffn_dim * sizeof(float));
    s->kb = calloc((size_t)in->n_kv_heads, sizeof(double)), s->vb = calloc((size_t)in->n_kv_heads, sizeof(double));
    s->sb = calloc((size_t)in->n_kv_heads, sizeof(double));
    if ((s->ab = calloc((size_t)nt, sizeof *s->ab))) {
        s->nab = nt;
        for (int i = 0; i < nt && ok; i++) {
            att_buf *b = &s->ab[i];
            b->S = kvq_alloc_array(ATT_ROWS, t * sizeof(float)), b->O = kvq_alloc_array(ATT_ROWS, D * sizeof(float));
            if (quantized) b->Kp = kvq_alloc_array(t, D * sizeof(float)), b->Vp = kvq_alloc_array(t, D * sizeof(float));
            ok = b->S && b->O && (!quantized || (b->Kp && b->Vp));
        }
    }
    if (!ok || !s->ab || !s->xn || !s->xo || !s->q || !s->att || !s->Qh || !s->k || !s->v || !s->Kh || !s->Vh ||
        !s->Kpre || !s->g || !s->u || !s->kb || !s->vb || !s->sb) {
        scratch_free(s);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the activations of %d tokens", T);
    }
    return KVQ_OK;
}

/* Copies tokens [0, c) of x [H][T][D] into y [H][c][D]. */
static void prefix(const float *x, float *y, int H, int T, int D, int c)
{
    for (int h = 0; h < H; h++) memcpy(y + (size_t)h * c * D, x + (size_t)h * T * D, (size_t)c * D * sizeof(float));
}

typedef struct fw_ctx {
    kvq_model *m;
    const kvq_fw_opts *o;
    fw_weights w;
    fw_scratch s;
    kvq_rope rope, rope_swa; /* rope_swa: sliding-window layers with their own base (T = 0: none) */
    kvq_dump_info qinfo;     /* what the quantizers see of the "dump" */
    int nt;
} fw_ctx;

static const kvq_rope *layer_rope(const fw_ctx *c, int l)
{
    return c->rope_swa.T && kvq_model_layer_window(c->m, l) ? &c->rope_swa : &c->rope;
}

/* The quantizer of stream st on the first c tokens of the layer (pk/pv
 * hold them when c < T, else Kh/Vh); K', V' into kq/vq [H][c][D]. */
static kvq_status quantize_cache(fw_ctx *c, const kvq_spec *spec, int layer, int ntok, kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads, D = in->head_dim, T = c->o->T;
    kvq_layer L = {.H = H, .Hq = in->n_heads, .T = ntok, .D = D};
    if (ntok == T) {
        L.key = s->Kh, L.value = s->Vh, L.key_pre_rope = s->Kpre;
    } else {
        prefix(s->Kh, s->pk, H, T, D, ntok);
        prefix(s->Vh, s->pv, H, T, D, ntok);
        prefix(s->Kpre, s->ppre, H, T, D, ntok);
        L.key = s->pk, L.value = s->pv, L.key_pre_rope = s->ppre;
    }
    kvq_dump_info info = c->qinfo;
    info.seq_len = ntok;
    kvq_quant_ctx ctx = {
        .info = &info, .layer = layer, .seed = c->o->seed, .nthreads = c->nt, .rope = layer_rope(c, layer)};
    memset(s->kb, 0, (size_t)H * sizeof(double));
    memset(s->vb, 0, (size_t)H * sizeof(double));
    memset(s->sb, 0, (size_t)H * sizeof(double));
    kvq_quant_out qo = {.key = s->kq, .value = s->vq, .k_bits = s->kb, .v_bits = s->vb, .static_bytes = s->sb};
    kvq_status st;
    if (c->o->calib && (st = kvq_calib_state(c->o->calib, spec, layer, c->o->seed, c->nt, &ctx.calib, err))) return st;
    return kvq_quantize_layer(spec, &ctx, &L, &qo, err); /* BLAS runs one thread; the quantizers thread over heads */
}

/* x [T][dim] += a [T][in] · Wᵀ, RMS-normed first by post_norm when the
 * model has one (gemma3; tmp [T][dim] holds the product), else
 * accumulated by the product itself. */
static void residual_add(float *x, const float *a, const float *W, const float *post_norm, float *tmp, int T, int in,
                         int dim, float eps, int nt)
{
    if (!post_norm) {
        linear(x, a, W, NULL, T, in, dim, 1, nt);
        return;
    }
    linear(tmp, a, W, NULL, T, in, dim, 0, nt);
    rmsnorm(tmp, tmp, post_norm, T, dim, eps, nt);
    for (size_t i = 0, n = (size_t)T * dim; i < n; i++) x[i] += tmp[i];
}

/* GELU, tanh form, as ggml_gelu. */
static float gelu_tanh(float x)
{
    return 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * x * (1.0f + 0.044715f * x * x)));
}

/* One layer of one stream: x += attention(x), x += ffn(x) (gemma3: each
 * output RMS-normed before its residual add). */
static kvq_status layer_step(fw_ctx *c, kvq_fw_stream *st, int l, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    const fw_weights *w = &c->w;
    fw_scratch *s = &c->s;
    int T = c->o->T, dim = in->dim, Hq = in->n_heads, H = in->n_kv_heads, D = in->head_dim;
    int qd = Hq * D, kd = H * D, F = in->ffn_dim, nt = c->nt, W = kvq_model_layer_window(c->m, l);
    float scale = in->attn_scale > 0 ? in->attn_scale : 1.0f / sqrtf((float)D);
    const kvq_rope *rope = layer_rope(c, l);
    kvq_status rc = KVQ_OK;

    rmsnorm(s->xn, st->x, w->attn_norm, T, dim, in->norm_eps, nt);
    linear(s->q, s->xn, w->wq, w->bq, T, dim, qd, 0, nt);
    linear(s->k, s->xn, w->wk, w->bk, T, dim, kd, 0, nt);
    linear(s->v, s->xn, w->wv, w->bv, T, dim, kd, 0, nt);
    if (w->q_norm) rmsnorm(s->q, s->q, w->q_norm, T * Hq, D, in->norm_eps, nt); /* per head, before RoPE */
    if (w->k_norm) rmsnorm(s->k, s->k, w->k_norm, T * H, D, in->norm_eps, nt);
    to_heads(s->k, s->Kpre, T, H, D);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < Hq; j++) kvq_rope_rotate(rope, s->q + (size_t)t * qd + (size_t)j * D, t, 0);
        for (int h = 0; h < H; h++) kvq_rope_rotate(rope, s->k + (size_t)t * kd + (size_t)h * D, t, 0);
    }
    to_heads(s->q, s->Qh, T, Hq, D);
    to_heads(s->k, s->Kh, T, H, D);
    to_heads(s->v, s->Vh, T, H, D);
    if (!st->item && c->o->on_layer) {
        kvq_layer L = {
            .H = H, .Hq = Hq, .T = T, .D = D, .key = s->Kh, .value = s->Vh, .query = s->Qh, .key_pre_rope = s->Kpre};
        if ((rc = c->o->on_layer(c->o->ud, l, &L, err))) return rc;
    }
    const kvq_eval_item *it = st->item;
    int quantized = it && it->spec && (it->layer < 0 || it->layer == l);
    if (!quantized) {
        attend(s->Qh, s->Kh, s->Vh, T, T, Hq, H, D, W, scale, 0, T, s->att, s->ab, nt);
        if (it && (it->layer < 0 || it->layer == l)) /* -q none: the exact cache, 16 bits */
            st->k_bits += 16.0 * T * kd, st->v_bits += 16.0 * T * kd, st->n_elem += (double)T * kd;
    } else {
        int stride = it->policy == KVQ_POLICY_DECODE ? (c->o->stride > 0 ? c->o->stride : 1) : T;
        for (int p0 = 0; p0 < T && !rc; p0 += stride) {
            int p1 = p0 + stride < T ? p0 + stride : T;
            if ((rc = quantize_cache(c, it->spec, l, p1, err))) break;
            attend(s->Qh, s->kq, s->vq, p1, T, Hq, H, D, W, scale, p0, p1, s->att, s->ab, nt);
            if (p1 == T) /* the cache after the last token */
                for (int h = 0; h < H; h++) st->k_bits += s->kb[h], st->v_bits += s->vb[h];
        }
        st->n_elem += (double)T * kd;
    }
    if (rc) return rc;
    residual_add(st->x, s->att, w->wo, w->post_attn_norm, s->xo, T, qd, dim, in->norm_eps, nt);
    rmsnorm(s->xn, st->x, w->ffn_norm, T, dim, in->norm_eps, nt);
    linear(s->g, s->xn, w->w_gate, NULL, T, dim, F, 0, nt);
    linear(s->u, s->xn, w->w_up, NULL, T, dim, F, 0, nt);
    size_t n = (size_t)T * F;
    if (in->ffn_act == KVQ_ACT_GELU_TANH) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (size_t i = 0; i < n; i++) s->g[i] = gelu_tanh(s->g[i]) * s->u[i]; /* GeGLU */
    } else {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (size_t i = 0; i < n; i++) {
            float g = s->g[i];
            s->g[i] = g / (1.0f + expf(-g)) * s->u[i]; /* SwiGLU: silu(gate) · up */
        }
    }
    residual_add(st->x, s->g, w->w_down, w->post_ffn_norm, s->xo, T, F, dim, in->norm_eps, nt);
    return KVQ_OK;
}

/* ------------------------------------------------------ output head */

/* Folds logits chunk z [N][vc] (vocabulary [v0, v0+vc)) into the online
 * state of stream st; ref: the exact stream's chunk (NULL for itself). */
static void fold_chunk(kvq_fw_stream *st, const float *z, const float *ref, const kvq_fw_stream *r, int N, int vc,
                       int v0, const int *tokens, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < N; t++) {
        const float *zr = z + (size_t)t * vc;
        float cm = zr[0];
        int ca = 0;
        for (int v = 1; v < vc; v++)
            if (zr[v] > cm) cm = zr[v], ca = v;
        if (v0 == 0 || cm > st->amax[t]) st->amax[t] = cm, st->arg[t] = v0 + ca; /* first arg-max */
        double m_old = v0 ? st->lmax[t] : -INFINITY, m_new = m_old > cm ? m_old : cm;
        double sum = 0;
        for (int v = 0; v < vc; v++) sum += exp((double)zr[v] - m_new);
        st->lsum[t] = (v0 ? st->lsum[t] * exp(m_old - m_new) : 0.0) + sum;
        st->lmax[t] = m_new;
        int tgt = tokens[t + 1];
        if (tgt >= v0 && tgt < v0 + vc) st->ltgt[t] = zr[tgt - v0];
        if (ref) { /* Σ p_v (a_v − b_v) with p from the reference, scaled by its running max */
            const float *ar = ref + (size_t)t * vc;
            float am = ar[0];
            for (int v = 1; v < vc; v++) am = ar[v] > am ? ar[v] : am;
            double ra_old = v0 ? r->lmax[t] : -INFINITY, ra_new = ra_old > am ? ra_old : am;
            double wsum = 0;
            for (int v = 0; v < vc; v++) wsum += exp((double)ar[v] - ra_new) * ((double)ar[v] - (double)zr[v]);
            st->lw[t] = (v0 ? st->lw[t] * exp(ra_old - ra_new) : 0.0) + wsum;
        }
    }
}

/* Logits of a chunk: z [N][n] = xn [N][dim] · W [n][dim]ᵀ, soft-capped when the model says so. */
static void chunk_logits(float *z, const float *xn, const float *W, int N, int dim, int n, float cap, int nt)
{
    gemm_tiled(z, xn, W, N, dim, n, 0.0f, nt);
    if (cap > 0) {
        size_t e = (size_t)N * n;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (size_t i = 0; i < e; i++) z[i] = cap * tanhf(z[i] / cap);
    }
}

static kvq_status output_head(fw_ctx *c, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    const kvq_fw_opts *o = c->o;
    int N = o->T - 1, dim = in->dim, V = in->vocab_size, nt = c->nt, NA = N;
    for (int i = 0; i < o->n_logit_pos; i++) /* the last position's logits are wanted too: one more row */
        if (o->logit_pos[i] == N) NA = N + 1;
    /* vocabulary chunks: at most 64 MB of weights or of logits at a time */
    size_t lim = (16u << 20) / (size_t)(N > dim ? N : dim);
    int vc = lim < 256 ? 256 : lim > (size_t)V ? V : (int)lim;
    if (vc > V) vc = V;
    float *W = kvq_alloc_array((size_t)vc, (size_t)dim * sizeof(float));
    float *A = kvq_alloc_array((size_t)NA, (size_t)vc * sizeof(float)); /* row N: the last position (own call) */
    float *B = kvq_alloc_array((size_t)N, (size_t)vc * sizeof(float));
    float *xn = kvq_alloc_array((size_t)o->ns * N + (size_t)(NA - N), (size_t)dim * sizeof(float));
    float *onorm = kvq_alloc_array((size_t)dim, sizeof(float));
    kvq_status rc = KVQ_OK;
    if (!W || !A || !B || !xn || !onorm) {
        rc = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the output head (%d positions, chunks of %d tokens)", N,
                      vc);
        goto done;
    }
    if ((rc = weight_rows(c->m, &c->m->output_norm, 0, 1, onorm, 1, err))) goto done;
    /* stream i's normed rows at xn + (i ? NA + (i − 1)·N : 0) rows */
    for (int i = 0; i < o->ns; i++)
        rmsnorm(xn + (i ? (size_t)NA + (size_t)(i - 1) * N : 0) * dim, o->s[i].x, onorm, i ? N : NA, dim, in->norm_eps,
                nt);
    for (int v0 = 0; v0 < V; v0 += vc) {
        int n = v0 + vc < V ? vc : V - v0;
        if ((rc = weight_rows(c->m, &c->m->output, v0, v0 + n, W, nt, err))) goto done;
        chunk_logits(A, xn, W, N, dim, n, in->logit_softcap, nt);
        if (NA > N) chunk_logits(A + (size_t)N * n, xn + (size_t)N * dim, W, 1, dim, n, in->logit_softcap, nt);
        for (int i = 0; i < o->n_logit_pos; i++)
            memcpy(o->logits + (size_t)i * V + v0, A + (size_t)o->logit_pos[i] * n, (size_t)n * sizeof(float));
        for (int i = 1; i < o->ns; i++) {
            chunk_logits(B, xn + ((size_t)NA + (size_t)(i - 1) * N) * dim, W, N, dim, n, in->logit_softcap, nt);
            fold_chunk(&o->s[i], B, A, &o->s[0], N, n, v0, o->tokens, nt);
        }
        fold_chunk(&o->s[0], A, NULL, NULL, N, n, v0, o->tokens, nt);
    }
    const kvq_fw_stream *r = &o->s[0];
    for (int i = 0; i < o->ns; i++) {
        kvq_fw_stream *st = &o->s[i];
        st->nll = st->kl = st->top1 = st->d_n = st->d_mean = st->d_m2 = 0;
        for (int t = o->score_from > 0 ? o->score_from : 0; t < N; t++) {
            double lse = st->lmax[t] + log(st->lsum[t]), nll = lse - st->ltgt[t];
            st->nll += nll;
            if (st->pos_nll) st->pos_nll[t - (o->score_from > 0 ? o->score_from : 0)] = nll;
            if (i) {
                double lse_r = r->lmax[t] + log(r->lsum[t]), kl = st->lw[t] / r->lsum[t] - lse_r + lse;
                st->kl += kl > 0 ? kl : 0.0;
                st->top1 += st->arg[t] == r->arg[t];
                double d = nll - (lse_r - r->ltgt[t]), delta = d - st->d_mean; /* Welford */
                st->d_n += 1;
                st->d_mean += delta / st->d_n;
                st->d_m2 += delta * (d - st->d_mean);
            } else {
                st->top1 += 1;
            }
        }
    }
done:
    free(W), free(A), free(B), free(xn), free(onorm);
    return rc;
}

/* --------------------------------------------------------- driver */

int kvq_model_layer_window(const kvq_model *m, int layer)
{
    return m->layer_swa && layer >= 0 && layer < m->info.n_layers && m->layer_swa[layer] ? m->info.sliding_window : 0;
}

/* The token embeddings of stream 0, scaled as the model says, checked finite. */
static kvq_status embed(fw_ctx *c, kvq_error *err)
{
    kvq_model *m = c->m;
    const kvq_fw_opts *o = c->o;
    int T = o->T, dim = m->info.dim;
    float *x = o->s[0].x, sc = m->info.embed_scale;
    for (int t = 0; t < T; t++) { /* only the rows of the tokens are dequantized */
        kvq_status st = weight_rows(m, &m->tok_embd, o->tokens[t], o->tokens[t] + 1, x + (size_t)t * dim, 1, err);
        if (st) return st;
        if (sc > 0)
            for (int i = 0; i < dim; i++) x[(size_t)t * dim + i] *= sc;
    }
    return KVQ_OK;
}

kvq_status kvq_forward(kvq_model *m, const kvq_fw_opts *o, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    int T = o->T, dim = in->dim;
    fw_ctx c = {.m = m, .o = o, .nt = kvq_threads(o->nthreads)};
    kvq_status rc;
    int quantized = 0, blas_nt = openblas_get_num_threads();
    for (int i = 0; i < o->ns; i++) quantized |= o->s[i].item && o->s[i].item->spec;
    if ((rc = scratch_alloc(&c.s, in, T, quantized, c.nt, err))) return rc;
    openblas_set_num_threads(1); /* threads run fixed tiles, each one BLAS call */
    if ((rc = kvq_model_rope(m, T, in->rope_theta, in->rope_scale, &c.rope, err))) goto done;
    if (in->n_swa_layers && (in->rope_theta_swa != in->rope_theta || kvq_model_rope_tabled(m)) &&
        (rc = kvq_model_rope(m, T, in->rope_theta_swa, 1.0, &c.rope_swa, err)))
        goto done;
    c.qinfo = (kvq_dump_info){.num_layers = in->n_layers,
                              .num_heads = in->n_heads,
                              .num_kv_heads = in->n_kv_heads,
                              .head_dim = in->head_dim,
                              .seq_len = T,
                              .has_rope_theta = 1,
                              .rope_theta = in->rope_theta,
                              .rope_style = in->rope_style,
                              .has_key_pre_rope = 1,
                              .has_rope_table = kvq_model_rope_tabled(m),
                              .key_dtype = KVQ_F32,
                              .value_dtype = KVQ_F32,
                              .query_dtype = KVQ_F32};
    snprintf(c.qinfo.model, sizeof c.qinfo.model, "%s", in->name);
    for (int i = 0; i < o->ns; i++) o->s[i].active = !o->s[i].item || o->s[i].item->layer < 0;
    if ((rc = embed(&c, err))) goto done;
    for (int i = 1; i < o->ns; i++)
        if (o->s[i].active) memcpy(o->s[i].x, o->s[0].x, (size_t)T * dim * sizeof(float));
    for (int l = 0; l < in->n_layers; l++) {
        if ((rc = load_layer(m, l, &c.w, c.nt, err))) goto done;
        for (int i = 1; i < o->ns; i++) /* one-layer items start from the exact state at their layer */
            if (!o->s[i].active && o->s[i].item->layer == l) {
                memcpy(o->s[i].x, o->s[0].x, (size_t)T * dim * sizeof(float));
                o->s[i].active = 1;
            }
        for (int i = 0; i < o->ns; i++) {
            if (!o->s[i].active) continue;
            if ((rc = layer_step(&c, &o->s[i], l, err))) {
                if (o->s[i].item && o->s[i].item->spec) {
                    char msg[sizeof err->msg];
                    snprintf(msg, sizeof msg, "%s", err->msg);
                    rc = kvq_fail(err, rc, "%s: %s", m->path, msg);
                }
                goto done;
            }
            size_t nx = (size_t)T * dim, bad = kvq_first_nonfinite(o->s[i].x, nx);
            if (bad < nx) {
                const kvq_eval_item *it = o->s[i].item;
                rc = kvq_fail(err, KVQ_ERR_FORMAT,
                              "%s: layer %d, position %zu: the hidden state%s%s%s is %g: expected finite activations",
                              m->path, l, bad / (size_t)dim, it ? " with the cache of " : "",
                              it ? (it->spec ? it->spec->text : "none") : "", it ? "," : "", (double)o->s[i].x[bad]);
                goto done;
            }
        }
        if (o->progress) o->progress(o->progress_ud, l + 1, in->n_layers);
    }
    rc = output_head(&c, err);
done:
    openblas_set_num_threads(blas_nt);
    free(c.w.buf);
    scratch_free(&c.s);
    kvq_rope_free(&c.rope);
    kvq_rope_free(&c.rope_swa);
    return rc;
}
