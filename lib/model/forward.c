/* forward.c — the decoder forward pass (docs/models.md): pre-norm blocks with
 * RMSNorm, GQA attention with RoPE, SwiGLU, final norm and output matrix,
 * float32 activations, every weight product one BLAS sgemm over all
 * positions (prefill).
 *
 * Several streams run in lockstep: the exact model and any number of
 * quantized caches.  Weights are dequantized a column tile at a time, by
 * the thread that multiplies it (peak memory: the mapped file + a tile per
 * thread + activations), and the output head walks the vocabulary in
 * chunks, keeping an online log-softmax per position, so neither the
 * output matrix nor the logits are ever whole in memory.  A configuration
 * computes nothing of its own while its caches are the exact ones, and
 * only the rows that are scored reach the last layer's queries and the
 * head.
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
 * count, and a last-bit change in a key can flip a 4-bit rounding.
 *
 * Row tiles sit at multiples of TILE_ROWS from position 0, and a product
 * over rows [r0, r1) starts at such a multiple, so the rows a pass computes
 * of the last layer and the output head (only those that are scored) come
 * out of the same calls as in a pass that computes them all: a corpus
 * window's scored half equals a plain run of the window bit for bit.
 * (OpenBLAS's result for a row depends on the call's other rows: its
 * kernels block M.)  Tiles of 256 × 512 run at the sgemm rate of larger
 * ones on these shapes. */
enum { TILE_ROWS = 256, TILE_COLS = 512, ATT_ROWS = 64 };

static int imin(int a, int b) { return a < b ? a : b; }

/* A weight matrix W [N][K] (a tensor's rows [w0, w0 + N)) is read by the
 * products in place when the file holds it as aligned float32, else one
 * column tile — TILE_COLS rows of W — at a time, dequantized into a
 * buffer of the thread that multiplies it and checked finite there: no
 * layer is ever whole in float32 (no page of it to fault in), and the
 * tile is read while it is warm. */
typedef struct fw_gemm {
    const float *x; /* [.][K], row 0 */
    float *y;       /* [.][ldy], row 0, the product's first column */
    int r0, r1;     /* the rows: tiles from r0 */
    int ldy;
} fw_gemm;

/* float32 tensors aligned for float loads are used in place. */
static int in_place(const kvq_wtensor *t) { return t->type == KVQ_GGML_F32 && ((uintptr_t)t->data & 3) == 0; }

/* The error for the first non-finite weight, at row r, column col of t. */
static kvq_status nonfinite_weight(const kvq_model *m, const kvq_wtensor *t, int64_t r, size_t col, double v,
                                   kvq_error *err)
{
    return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: row %lld, column %zu is %g: expected finite weights", m->path,
                    t->name ? t->name : "?", (long long)r, col, v);
}

/* Rows [r0, r1) of t dequantize to finite weights for certain: finite half
 * scales of a block format (kvq_ggml_finite_by_scales) tell it without
 * reading the values; 0: look at them. */
static int wtensor_finite_by_scales(const kvq_wtensor *t, int64_t r0, int64_t r1)
{
    return kvq_ggml_finite_by_scales(t->type, t->data + (size_t)r0 * t->row_bytes, (size_t)(r1 - r0) * t->cols);
}

/* Jobs whose rows follow one another in memory (job j's first row, in x
 * and in y, right after job j − 1's last: the lockstep slots, the output
 * head's streams) as one job *one, rows from g[0]'s on; 0 when they do not. */
static int stack_jobs(const fw_gemm *g, int ng, int K, fw_gemm *one)
{
    *one = g[0];
    for (int j = 1; j < ng; j++) {
        if (g[j].ldy != g[0].ldy || g[j].x + (size_t)g[j].r0 * K != g[j - 1].x + (size_t)g[j - 1].r1 * K ||
            g[j].y + (size_t)g[j].r0 * g[0].ldy != g[j - 1].y + (size_t)g[j - 1].r1 * g[0].ldy)
            return 0;
        one->r1 += g[j].r1 - g[j].r0;
    }
    return 1;
}

/* GELU, tanh form, as ggml_gelu. */
static float gelu_tanh(float x)
{
    return 0.5f * x * (1.0f + tanhf(0.79788456080286535588f * x * (1.0f + 0.044715f * x * x)));
}

/* Column tile [c, c + n) of tensor t's rows from w0 (K columns) for one
 * task: in place (Wf), or dequantized into buf and checked finite; NULL
 * when it holds a non-finite weight, the first of them (row · K + column)
 * kept in *bad and *badv. */
static const float *weight_tile(kvq_wtensor *t, const float *Wf, int64_t w0, int c, int n, int K, float *buf,
                                size_t *bad, float *badv)
{
    if (Wf) return Wf + (size_t)c * K;
    kvq_wtensor_rows(t, w0 + c, w0 + c + n, buf);
    size_t nv = (size_t)n * K,
           i = t->checked || wtensor_finite_by_scales(t, w0 + c, w0 + c + n) ? nv : kvq_first_nonfinite(buf, nv);
    if (i == nv) return buf;
#pragma omp critical(kvq_nonfinite_weight)
    if ((size_t)c * K + i < *bad) *bad = (size_t)c * K + i, *badv = buf[i];
    return NULL;
}

/* What a task does with its calls' rows (tile_calls). */
enum { CALLS_INTO_Y, CALLS_INTO_U, CALLS_GLU };

/* The calls of one task (column tile [c, c + n); with split, only the
 * ri-th call of the jobs g): CALLS_INTO_Y, rows of y = x·Wᵀ + beta·y;
 * CALLS_INTO_U, the same product into u [rows of the calls][n] instead,
 * the calls' rows one after the other (beta 0); CALLS_GLU, y = act(y)·u
 * over the same rows, act the model's: GeGLU, else SwiGLU. */
static void tile_calls(const fw_gemm *g, int ng, int rows_free, int split, int ri, int K, int c, int n, const float *W,
                       float beta, float *u, int what, kvq_ffn_act act)
{
    for (int j = 0, k = 0, ur = 0; j < ng; j++) {
        int step = rows_free && !split ? g[j].r1 - g[j].r0 : TILE_ROWS; /* rows a call */
        for (int r = g[j].r0; r < g[j].r1; r += step, k++) {
            if (split && k != ri) continue;
            int m = imin(step, g[j].r1 - r);
            float *y = g[j].y + (size_t)r * g[j].ldy + c, *ut = u ? u + (size_t)ur * n : NULL;
            if (what != CALLS_GLU) {
                int into_u = what == CALLS_INTO_U;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, K, 1.0f, g[j].x + (size_t)r * K, K, W, K,
                            into_u ? 0.0f : beta, into_u ? ut : y, into_u ? n : g[j].ldy);
            } else
                for (int i = 0; i < m; i++) {
                    float *yr = y + (size_t)i * g[j].ldy;
                    const float *urow = ut + (size_t)i * n;
                    if (act == KVQ_ACT_GELU_TANH)
                        for (int v = 0; v < n; v++) yr[v] = gelu_tanh(yr[v]) * urow[v]; /* GeGLU */
                    else
                        for (int v = 0; v < n; v++) {
                            float a = yr[v];
                            yr[v] = a / (1.0f + expf(-a)) * urow[v]; /* SwiGLU: silu(gate) · up */
                        }
                }
            ur += m;
        }
    }
}

#define SMALL_GEMM_MNK 1e6 /* OpenBLAS's small products: M·N·K at most this (gemm_w) */

/* A product's tasks: gemm_w's jobs g stacked where they can be (*one),
 * and the tasks over ct column tiles and their row tiles; 0 when there
 * are no rows. */
typedef struct fw_tasks {
    fw_gemm one;
    const fw_gemm *g;
    int ng, ct, rt, split, ntask;
    size_t rows; /* the jobs' rows, all of them */
} fw_tasks;

static int plan_tasks(fw_tasks *p, int rows_free, int nt, int K, int N, const fw_gemm *g, int ng)
{
    p->g = g, p->ng = ng, p->ct = (N + TILE_COLS - 1) / TILE_COLS, p->rt = 0, p->rows = 0;
    /* the smallest call of a job alone: its rows, or its last row tile; by the last column tile */
    int fewest = INT32_MAX, narrowest = N % TILE_COLS ? N % TILE_COLS : imin(N, TILE_COLS);
    for (int j = 0, r; j < ng; j++)
        r = g[j].r1 - g[j].r0, fewest = imin(fewest, r % TILE_ROWS ? r % TILE_ROWS : imin(r, TILE_ROWS));
    if (rows_free && ng > 1 && (double)fewest * narrowest * K > SMALL_GEMM_MNK && stack_jobs(g, ng, K, &p->one))
        p->g = &p->one, p->ng = 1;
    for (int j = 0; j < p->ng; j++)
        p->rt += (p->g[j].r1 - p->g[j].r0 + TILE_ROWS - 1) / TILE_ROWS, p->rows += (size_t)(p->g[j].r1 - p->g[j].r0);
    /* tasks: a column tile with all its row tiles, or, with fewer column
     * tiles than twice the threads, one row tile each (dequantizing the
     * column tile again): the same sgemm calls either way */
    p->split = p->ct < 2 * nt && p->rt > 1, p->ntask = p->split ? p->ct * p->rt : p->ct;
    return p->rt > 0;
}

/* For each job g, rows [g.r0, g.r1) of g.y = g.x · W[w0 .. w0 + N)ᵀ + beta · g.y,
 * where W is tensor t's rows.  Fails naming the first non-finite weight
 * read (a tensor read whole once is not checked again).  rows_free: this
 * BLAS core computes a row the same whatever rows share its call
 * (kvq_blas_rows_independent), so the jobs' rows, stacked where they
 * follow one another, go to a column tile in one call (a row tile each
 * when the tasks are row tiles): the weight tile is packed once instead of
 * once per 256 rows, and every element keeps its bits.  Only where every
 * call a job makes on its own is past OpenBLAS's small products, though:
 * those (M·N·K <= 100³, its kernels' gemm_small_kernel_permit) have their
 * own kernels, which round otherwise, so stacking a small call would not
 * give its rows the bits their stream alone gets (the jobs then keep
 * their own calls). */
static kvq_status gemm_w(const kvq_model *m, float *const *tile, int nt, int rows_free, kvq_wtensor *t, int64_t w0,
                         int N, const fw_gemm *g, int ng, float beta, kvq_error *err)
{
    int K = (int)t->cols;
    fw_tasks p;
    if (!plan_tasks(&p, rows_free, nt, K, N, g, ng)) return KVQ_OK;
    const float *Wf = in_place(t) ? (const float *)t->data + (size_t)w0 * K : NULL;
    size_t bad = SIZE_MAX; /* the first non-finite weight: row · K + column */
    float badv = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int task = 0; task < p.ntask; task++) {
        int ci = p.split ? task / p.rt : task, ri = p.split ? task % p.rt : -1;
        int c = ci * TILE_COLS, n = imin(TILE_COLS, N - c);
        const float *W = weight_tile(t, Wf, w0, c, n, K, tile[omp_get_thread_num()], &bad, &badv);
        if (W) tile_calls(p.g, p.ng, rows_free, p.split, ri, K, c, n, W, beta, NULL, CALLS_INTO_Y, 0);
    }
    if (bad == SIZE_MAX) {
        if (w0 == 0 && N == t->rows) t->checked = 1;
        return KVQ_OK;
    }
    return nonfinite_weight(m, t, w0 + (int64_t)(bad / (size_t)K), bad % (size_t)K, badv, err);
}

/* The feed-forward's gated activations: for each job g, rows [g.r0, g.r1)
 * of g.y = act(g.x · Gᵀ) · (g.x · Uᵀ), G and U the gate and up matrices
 * (N rows each).  Each task takes its column tile of G into g.y and of U
 * into the thread's ubuf[rows][TILE_COLS] (its calls as gemm_w's for U
 * would be, so the same bits), and applies act on those columns at once:
 * no up activations for all rows.  ubuf is grown to *ucap floats a
 * thread as needed. */
static kvq_status gemm_glu(const kvq_model *m, float *const *tile, float **ubuf, size_t *ucap, int nt, int rows_free,
                           kvq_wtensor *G, kvq_wtensor *U, int N, const fw_gemm *g, int ng, kvq_ffn_act act,
                           kvq_error *err)
{
    int K = (int)G->cols;
    fw_tasks p;
    if (!plan_tasks(&p, rows_free, nt, K, N, g, ng)) return KVQ_OK;
    size_t need = (p.split ? (size_t)TILE_ROWS : p.rows) * TILE_COLS;
    if (need > *ucap) { /* the caller frees them */
        for (int i = 0; i < nt; i++) free(ubuf[i]), ubuf[i] = NULL;
        *ucap = 0;
        for (int i = 0; i < nt; i++)
            if (!(ubuf[i] = kvq_alloc_array(need, sizeof(float))))
                return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the up activations (%zu floats a thread)", need);
        *ucap = need;
    }
    const float *Gf = in_place(G) ? (const float *)G->data : NULL, *Uf = in_place(U) ? (const float *)U->data : NULL;
    size_t bad[2] = {SIZE_MAX, SIZE_MAX}; /* the first non-finite weight of G, of U */
    float badv[2] = {0, 0};
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int task = 0; task < p.ntask; task++) {
        int ci = p.split ? task / p.rt : task, ri = p.split ? task % p.rt : -1, th = omp_get_thread_num();
        int c = ci * TILE_COLS, n = imin(TILE_COLS, N - c);
        const float *W = weight_tile(G, Gf, 0, c, n, K, tile[th], &bad[0], &badv[0]);
        if (!W) continue;
        tile_calls(p.g, p.ng, rows_free, p.split, ri, K, c, n, W, 0.0f, NULL, CALLS_INTO_Y, act);
        if (!(W = weight_tile(U, Uf, 0, c, n, K, tile[th], &bad[1], &badv[1]))) continue;
        tile_calls(p.g, p.ng, rows_free, p.split, ri, K, c, n, W, 0.0f, ubuf[th], CALLS_INTO_U, act);
        tile_calls(p.g, p.ng, rows_free, p.split, ri, K, c, n, NULL, 0.0f, ubuf[th], CALLS_GLU, act);
    }
    kvq_wtensor *t[2] = {G, U};
    for (int i = 0; i < 2; i++)
        if (bad[i] != SIZE_MAX)
            return nonfinite_weight(m, t[i], (int64_t)(bad[i] / (size_t)K), bad[i] % (size_t)K, badv[i], err);
    if (N == G->rows) G->checked = 1;
    if (N == U->rows) U->checked = 1;
    return KVQ_OK;
}

/* ------------------------------------------------------------ weights */

/* A layer's vectors (norms, biases) in float32, and its matrices as the products read them. */
typedef struct fw_weights {
    const float *attn_norm, *bq, *bk, *bv, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm;
    kvq_wtensor *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;
    float *buf; /* dequantized copies of the vectors not used in place */
    size_t cap;
} fw_weights;

static size_t wt_floats(const kvq_wtensor *t) { return t->data ? (size_t)t->cols * (size_t)t->rows : 0; }

/* Rows [r0, r1) of t dequantized into out (one thread) and checked finite:
 * fails naming the tensor, row and column of the first non-finite weight. */
static kvq_status weight_rows(const kvq_model *m, const kvq_wtensor *t, int64_t r0, int64_t r1, float *out,
                              kvq_error *err)
{
    size_t cols = (size_t)t->cols, n = (size_t)(r1 - r0) * cols;
    kvq_wtensor_rows(t, r0, r1, out);
    size_t bad = wtensor_finite_by_scales(t, r0, r1) ? n : kvq_first_nonfinite(out, n);
    return bad < n ? nonfinite_weight(m, t, r0 + (int64_t)(bad / cols), bad % cols, out[bad], err) : KVQ_OK;
}

static kvq_status load_layer(kvq_model *m, int l, fw_weights *w, kvq_error *err)
{
    kvq_layer_weights *lw = &m->layer[l];
    const kvq_wtensor *vec[] = {&lw->attn_norm,      &lw->bq,       &lw->bk,           &lw->bv,
                                &lw->q_norm,         &lw->k_norm,   &lw->post_attn_norm, &lw->ffn_norm,
                                &lw->post_ffn_norm};
    const float **dst[] = {&w->attn_norm, &w->bq,       &w->bk,       &w->bv,           &w->q_norm,
                           &w->k_norm,    &w->post_attn_norm, &w->ffn_norm, &w->post_ffn_norm};
    enum { NVEC = sizeof vec / sizeof vec[0] };
    w->wq = &lw->wq, w->wk = &lw->wk, w->wv = &lw->wv, w->wo = &lw->wo;
    w->w_gate = &lw->w_gate, w->w_up = &lw->w_up, w->w_down = &lw->w_down;
    size_t need = 0;
    for (int i = 0; i < NVEC; i++)
        if (vec[i]->data && !in_place(vec[i])) need += wt_floats(vec[i]);
    if (need > w->cap) {
        free(w->buf);
        w->cap = 0;
        if (!(w->buf = kvq_alloc_array(need, sizeof(float))))
            return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for layer %d's weights (%zu floats)", m->path, l,
                            need);
        w->cap = need;
    }
    size_t off = 0;
    for (int i = 0; i < NVEC; i++) {
        const kvq_wtensor *t = vec[i];
        kvq_status st = KVQ_OK;
        if (!t->data) {
            *dst[i] = NULL;
        } else if (in_place(t)) {
            *dst[i] = (const float *)t->data;
            size_t n = wt_floats(t), bad = kvq_first_nonfinite(*dst[i], n);
            if (bad < n) st = nonfinite_weight(m, t, (int64_t)(bad / (size_t)t->cols), bad % (size_t)t->cols,
                                               (*dst[i])[bad], err);
        } else {
            st = weight_rows(m, t, 0, t->rows, w->buf + off, err);
            *dst[i] = w->buf + off;
            off += wt_floats(t);
        }
        if (st) return st;
    }
    /* matrices in place are checked here once; the others as each tile is dequantized */
    const kvq_wtensor *mat[] = {w->wq, w->wk, w->wv, w->wo, w->w_gate, w->w_up, w->w_down};
    for (size_t i = 0; i < sizeof mat / sizeof mat[0]; i++) {
        const kvq_wtensor *t = mat[i];
        if (!t->data || !in_place(t)) continue;
        const float *f = (const float *)t->data;
        size_t n = wt_floats(t), bad = kvq_first_nonfinite(f, n);
        if (bad < n)
            return nonfinite_weight(m, t, (int64_t)(bad / (size_t)t->cols), bad % (size_t)t->cols, f[bad], err);
    }
    return KVQ_OK;
}

/* --------------------------------------------------------- small ops */

/* out[t] = x[t] / sqrt(mean(x[t]²) + eps) · w, rows [r0, r1) of n. */
static void rmsnorm(float *out, const float *x, const float *w, int r0, int r1, int n, float eps, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = r0; t < r1; t++) {
        const float *xr = x + (size_t)t * n;
        float *o = out + (size_t)t * n;
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++) o[i] = w[i] * (scale * xr[i]);
    }
}

/* Rows [r0, r1) of [T][nh·D] (one row per position) -> [nh][T][D] (one matrix per head). */
static void to_heads(const float *x, float *y, int r0, int r1, int T, int nh, int D)
{
    for (int h = 0; h < nh; h++)
        for (int t = r0; t < r1; t++)
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
 * (c >= r1) of K, V [H][lk][D] (head h at h·lk·D; lk >= c); keep [H][lk]
 * (NULL: every key) masks evicted keys; Q [Hq][T][D]; the rows go to att
 * [T][Hq·D].
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
/* A score row's softmax over the kept keys of [u0, u1] (kp[u] = 1), 0 at
 * every other of the n columns; all 0 when none is kept. */
static void masked_softmax(float *s, const unsigned char *kp, int u0, int u1, int n)
{
    int any = 0;
    float mx = 0.0f;
    for (int u = u0; u <= u1; u++)
        if (kp[u] && (!any || s[u] > mx)) mx = s[u], any = 1;
    double sum = 0;
    for (int u = u0; u <= u1; u++) {
        s[u] = kp[u] ? expf(s[u] - mx) : 0.0f;
        sum += s[u];
    }
    float inv = any ? (float)(1.0 / sum) : 0.0f;
    for (int u = 0; u < u0; u++) s[u] = 0.0f;
    for (int u = u0; u <= u1; u++) s[u] *= inv;
    for (int u = u1 + 1; u < n; u++) s[u] = 0.0f;
}

static void attend(const float *Q, const float *K, const float *V, const unsigned char *keep, int c, int lk, int T,
                   int Hq, int H, int D, int W, float scale, int r0, int r1, float *att, const att_buf *buf, int nt)
{
    int G = Hq / H, t0 = r0 / ATT_ROWS, t1 = (r1 + ATT_ROWS - 1) / ATT_ROWS, ntile = t1 - t0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < Hq * ntile; i++) {
        const att_buf *B = &buf[omp_get_thread_num()];
        int j = i / ntile, a = (t0 + i % ntile) * ATT_ROWS, b = imin(a + ATT_ROWS, T);
        int k0 = W > 0 && a - W + 1 > 0 ? a - W + 1 : 0, n = b - k0, m = b - a;
        int ra = a > r0 ? a : r0, rb = b < r1 ? b : r1; /* the rows wanted */
        const float *Kh = K + (size_t)(j / G) * lk * D + (size_t)k0 * D,
                    *Vh = V + (size_t)(j / G) * lk * D + (size_t)k0 * D;
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
            if (keep) { /* tokens(...; drop): the evicted keys are absent */
                const unsigned char *kp = keep + (size_t)(j / G) * lk + k0;
                masked_softmax(s, kp, u0, u1, n);
                continue;
            }
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
    float *xn, *xo, *q, *k, *v, *att, *g;     /* row-major activations, [slot][T][.] */
    float *Qh, *Kh, *Vh, *Kpre;               /* [.][T][D] */
    float *pk, *pv, *ppre;                    /* decode: the first c tokens, [H][c][D] */
    float *kq, *vq;                           /* quantizer outputs [H][T][D] */
    float *pq;                                /* decode with a selector: the first c queries, [Hq][c][D] (on first use) */
    unsigned char *keep;                      /* [H][T]: the tokens a quantizer kept (tokens(...; drop)) */
    int *pos;                                 /* [H][T]: the positions of a segment's tokens (--context) */
    float *ck, *cv;                           /* --context: the cache [H][T][D], the context compressed once */
    unsigned char *ckeep;                     /* [H][T]: its kept tokens (decode-time compression: those held) */
    unsigned char *dhi, *dsel;                /* decode-time compression: [H][T] held at HI; a selection [H][n] */
    double *kb, *vb, *sb;                     /* [H] */
    att_buf *ab;                              /* [nt] */
    int nab;
} fw_scratch;

static void scratch_free(fw_scratch *s)
{
    float *f[] = {s->xn, s->xo,   s->q,  s->k,  s->v,    s->att, s->g,  s->Qh, s->Kh,
                  s->Vh, s->Kpre, s->pk, s->pv, s->ppre, s->kq,  s->vq, s->pq};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(f[i]);
    free(s->kb), free(s->vb), free(s->sb), free(s->keep), free(s->pos), free(s->ck), free(s->cv), free(s->ckeep);
    free(s->dhi), free(s->dsel);
    for (int i = 0; s->ab && i < s->nab; i++) free(s->ab[i].S), free(s->ab[i].O), free(s->ab[i].Kp), free(s->ab[i].Vp);
    free(s->ab);
    memset(s, 0, sizeof *s);
}

/* quantized: some stream quantizes its cache (the prefix and output buffers
 * are needed); the exact model alone does without them.  context: the
 * buffers of --context's cache too (2: and of decode-time compression).
 * slots: xn, xo, att, g, q, k and v hold that many blocks of T rows,
 * one after the other (the lockstep's slots, fw_rest and qkv_products:
 * pages a slot never uses are never touched). */
static kvq_status scratch_alloc(fw_scratch *s, const kvq_model_info *in, int T, int slots, int quantized, int context,
                                int nt, kvq_error *err)
{
    size_t t = (size_t)T, qd = (size_t)in->n_heads * in->head_dim, kd = (size_t)in->n_kv_heads * in->head_dim;
    size_t D = (size_t)in->head_dim, ts = t * (size_t)slots;
    int ok = 1;
    memset(s, 0, sizeof *s);
    s->xn = kvq_alloc_array(ts, in->dim * sizeof(float));
    s->xo = kvq_alloc_array(ts, in->dim * sizeof(float));
    s->q = kvq_alloc_array(ts, qd * sizeof(float)), s->att = kvq_alloc_array(ts, qd * sizeof(float));
    s->Qh = kvq_alloc_array(t, qd * sizeof(float));
    s->k = kvq_alloc_array(ts, kd * sizeof(float)), s->v = kvq_alloc_array(ts, kd * sizeof(float));
    s->Kh = kvq_alloc_array(t, kd * sizeof(float)), s->Vh = kvq_alloc_array(t, kd * sizeof(float));
    s->Kpre = kvq_alloc_array(t, kd * sizeof(float));
    if (quantized) {
        s->pk = kvq_alloc_array(t, kd * sizeof(float)), s->pv = kvq_alloc_array(t, kd * sizeof(float));
        s->ppre = kvq_alloc_array(t, kd * sizeof(float));
        s->kq = kvq_alloc_lines(t * kd * sizeof(float)), s->vq = kvq_alloc_lines(t * kd * sizeof(float));
        s->keep = kvq_alloc_array(t, (size_t)in->n_kv_heads);
        s->pos = kvq_alloc_array(t, (size_t)in->n_kv_heads * sizeof(int));
        ok = s->pk && s->pv && s->ppre && s->kq && s->vq && s->keep && s->pos;
    }
    if (quantized && context) {
        s->ck = kvq_alloc_array(t, kd * sizeof(float)), s->cv = kvq_alloc_array(t, kd * sizeof(float));
        s->ckeep = kvq_alloc_array(t, (size_t)in->n_kv_heads);
        ok = ok && s->ck && s->cv && s->ckeep;
    }
    if (quantized && context > 1) {
        s->dhi = kvq_alloc_array(t, (size_t)in->n_kv_heads), s->dsel = kvq_alloc_array(t, (size_t)in->n_kv_heads);
        ok = ok && s->dhi && s->dsel;
    }
    s->g = kvq_alloc_array(ts, (size_t)in->ffn_dim * sizeof(float));
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
        !s->Kpre || !s->g || !s->kb || !s->vb || !s->sb) {
        scratch_free(s);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the activations of %d tokens", T);
    }
    return KVQ_OK;
}

/* Copies tokens [t0, t1) of x [H][T][D] into y [H][t1−t0][D]. */
static void segment(const float *x, float *y, int H, int T, int D, int t0, int t1)
{
    size_t n = (size_t)(t1 - t0) * D;
    for (int h = 0; h < H; h++) memcpy(y + (size_t)h * n, x + ((size_t)h * T + t0) * D, n * sizeof(float));
}

/* The rest of a layer (attention output and feed-forward) of several
 * streams in lockstep: each weight tile of the output, gate, up and down
 * matrices is dequantized once and multiplied by the rows of every stream
 * waiting here (gemm_w's and gemm_glu's jobs), instead of once per stream:
 * the same sgemm calls on the same operands, so the results are each
 * stream's alone, bit for bit.  Slot i holds stream i's attention output
 * (the scratch's att points to the slot of the stream attending), normed
 * input and gated activations (the up activations are a column tile's a
 * thread, gemm_glu; slot 0 is the scratch's own); at most cap streams
 * wait, as many as REST_GROUP_BYTES of slots hold. */
enum { REST_MAX_GROUP = 16 };
#define REST_GROUP_BYTES ((size_t)512 << 20)
typedef struct fw_rest {
    kvq_fw_stream *st[REST_MAX_GROUP]; /* the waiting streams, in the order they reached it */
    int n, cap, nslots;               /* waiting; the most that may; slots allocated (0: none yet) */
    int r0;                           /* the slots' first row: slot i's rows [r0, T) follow slot i − 1's */
    float *xn[REST_MAX_GROUP], *g[REST_MAX_GROUP], *xo[REST_MAX_GROUP], *att[REST_MAX_GROUP];
} fw_rest;

typedef struct fw_ctx {
    kvq_model *m;
    const kvq_fw_opts *o;
    fw_weights w;
    fw_scratch s;
    kvq_rope rope, rope_swa; /* rope_swa: sliding-window layers with their own base (T = 0: none) */
    kvq_dump_info qinfo;     /* what the quantizers see of the "dump" */
    int nt;
    int rows_free; /* kvq_blas_rows_independent(): gemm_w stacks the rows it can */
    int h0; /* the first row the output head computes: a multiple of TILE_ROWS (0 when every row is wanted) */
    unsigned char *was_following; /* [ns]: the streams that followed the exact one when the layer began */
    float **tile;                 /* [nt]: each thread's dequantized column tile, TILE_COLS × the widest K */
    float **ubuf;                 /* [nt]: each thread's up activations of a column tile (gemm_glu) */
    size_t ucap;                  /* the floats each ubuf holds */
    fw_rest rest;                 /* the streams whose rest of the layer waits for the others' (lockstep) */
} fw_ctx;

static const kvq_rope *layer_rope(const fw_ctx *c, int l)
{
    return c->rope_swa.T && kvq_model_layer_window(c->m, l) ? &c->rope_swa : &c->rope;
}

/* The spec (resolved for the run, or a plain one) on L, a layer of the
 * cache's tokens at positions pos [H][L->T] (NULL: token i at i): K', V'
 * into kq/vq, the bits into kb/vb/sb, the kept tokens into keep (may be
 * NULL) and *dropped (may be NULL); a message names the model. */
static kvq_status run_on_cache(fw_ctx *c, const kvq_resolved_spec *spec, const kvq_spec *plain, int layer,
                               const kvq_layer *L, const int *pos, unsigned char *keep, int *dropped, kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads;
    kvq_dump_info info = c->qinfo;
    info.seq_len = L->T;
    kvq_attn_mode mode = {.scale = in->attn_scale, .window = kvq_model_layer_window(c->m, layer)};
    kvq_quant_ctx ctx = {.info = &info, .layer = layer, .seed = c->o->seed, .nthreads = c->nt,
                         .rope = layer_rope(c, layer), .attn = &mode, .pos = pos, .decoding = 1};
    memset(s->kb, 0, (size_t)H * sizeof(double));
    memset(s->vb, 0, (size_t)H * sizeof(double));
    memset(s->sb, 0, (size_t)H * sizeof(double));
    kvq_quant_out qo = {.key = s->kq, .value = s->vq, .k_bits = s->kb, .v_bits = s->vb, .static_bytes = s->sb,
                        .keep = keep};
    kvq_status st;
    const kvq_spec *own = spec ? kvq_resolved_spec_at(spec, layer) : plain;
    if (c->o->calib && (st = kvq_calib_state(c->o->calib, own, layer, c->o->seed, c->nt, &ctx.calib, err))) return st;
    /* BLAS runs one thread; the quantizers thread over heads */
    st = spec ? kvq_quantize_layer_in(spec, &ctx, L, &qo, err) : kvq_quantize_layer(plain, &ctx, L, &qo, err);
    if (st) { /* the quantizer's message, with the model it ran in */
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        return kvq_fail(err, st, "%s: %s", c->m->path, msg);
    }
    if (dropped) *dropped = qo.dropped;
    return KVQ_OK;
}

/* The spec on tokens [t0, t1) of the layer (pk/pv hold them unless they
 * are all T, then Kh/Vh), as a layer of their own at their own positions:
 * K', V' into kq/vq [H][t1−t0][D], the kept tokens into keep [H][t1−t0]
 * (*dropped: some were evicted).  t0 > 0: the tokens after a context
 * (--context), so a spec that re-applies RoPE rotates token i at t0 + i.
 * The spec: the stream's, parsed once for the run, or (spec NULL) a plain
 * one (neither a mix nor a tokens(...): a continuation's HI). */
static kvq_status quantize_cache(fw_ctx *c, const kvq_resolved_spec *spec, const kvq_spec *plain, int layer, int t0,
                                 int t1, int *dropped, kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads, D = in->head_dim, T = c->o->T, ntok = t1 - t0;
    kvq_layer L = {.H = H, .Hq = in->n_heads, .T = ntok, .D = D};
    unsigned flags = spec ? kvq_resolved_spec_flags(spec) : plain->q->read_flags;
    int queries = (flags & KVQ_READ_QUERY) != 0; /* a selector scores with them */
    if (ntok == T) {
        L.key = s->Kh, L.value = s->Vh, L.key_pre_rope = s->Kpre, L.query = queries ? s->Qh : NULL;
    } else {
        segment(s->Kh, s->pk, H, T, D, t0, t1);
        segment(s->Vh, s->pv, H, T, D, t0, t1);
        segment(s->Kpre, s->ppre, H, T, D, t0, t1);
        if (queries && !s->pq && !(s->pq = kvq_alloc_array((size_t)T, (size_t)in->n_heads * D * sizeof(float))))
            return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the queries of %d tokens", T);
        if (queries) segment(s->Qh, s->pq, in->n_heads, T, D, t0, t1);
        L.key = s->pk, L.value = s->pv, L.key_pre_rope = s->ppre, L.query = queries ? s->pq : NULL;
    }
    if (t0 > 0) /* [H][ntok]: token i of every head is at t0 + i */
        for (int h = 0; h < H; h++)
            for (int i = 0; i < ntok; i++) s->pos[(size_t)h * ntok + i] = t0 + i;
    return run_on_cache(c, spec, plain, layer, &L, t0 > 0 ? s->pos : NULL, s->keep, dropped, err);
}

/* Whether the quantized cache of tokens [t0, t1) (kq, vq [H][t1−t0][D])
 * is bit for bit the exact one (rows [t0, t1) of Kh, Vh [H][T][D]). */
static int cache_is_exact(const fw_ctx *c, int t0, int t1)
{
    const fw_scratch *s = &c->s;
    int H = c->m->info.n_kv_heads, D = c->m->info.head_dim, T = c->o->T;
    size_t n = (size_t)(t1 - t0) * D;
    for (int h = 0; h < H; h++)
        if (memcmp(s->kq + (size_t)h * n, s->Kh + ((size_t)h * T + t0) * D, n * sizeof(float)) ||
            memcmp(s->vq + (size_t)h * n, s->Vh + ((size_t)h * T + t0) * D, n * sizeof(float)))
            return 0;
    return 1;
}

/* Layer l's queries (rows [r0, T)), keys and values (all T rows: the
 * cache) of the n streams st (n <= the lockstep's cap) from their hidden
 * states, each weight tile of the query, key and value matrices
 * dequantized once for all of them (gemm_w's jobs, as the rest of the
 * layer's: each stream's bits are its own alone): stream i's normed input
 * (all T rows) at i·T rows of the scratch's xn, its products in QKV slot i
 * (the scratch's q, k, v, slot i at i·T rows, so that the streams' rows
 * stack); the rest's slots (rest_slots) reuse xn after these products. */
static kvq_status lockstep_fits(const fw_ctx *c, int n, kvq_error *err);
static kvq_status qkv_products(fw_ctx *c, kvq_fw_stream *const *st, int n, int l, int r0, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    const fw_weights *w = &c->w;
    fw_scratch *s = &c->s;
    size_t T = (size_t)c->o->T, dim = (size_t)in->dim, qd = (size_t)in->n_heads * in->head_dim;
    size_t kd = (size_t)in->n_kv_heads * in->head_dim;
    kvq_status rc = lockstep_fits(c, n, err);
    fw_gemm gq[REST_MAX_GROUP], gk[REST_MAX_GROUP], gv[REST_MAX_GROUP];
    for (int i = 0; !rc && i < n; i++) { /* slot i's normed input: all T rows, at i·T rows of the scratch's xn */
        float *xn = s->xn + i * T * dim;
        rmsnorm(xn, st[i]->x, w->attn_norm, 0, (int)T, (int)dim, in->norm_eps, c->nt);
        gq[i] = (fw_gemm){.x = xn, .y = s->q + i * T * qd, .r0 = r0, .r1 = (int)T, .ldy = (int)qd};
        gk[i] = (fw_gemm){.x = xn, .y = s->k + i * T * kd, .r0 = 0, .r1 = (int)T, .ldy = (int)kd};
        gv[i] = (fw_gemm){.x = xn, .y = s->v + i * T * kd, .r0 = 0, .r1 = (int)T, .ldy = (int)kd};
    }
    if (rc || (rc = gemm_w(c->m, c->tile, c->nt, c->rows_free, w->wq, 0, (int)qd, gq, n, 0.0f, err)) ||
        (rc = gemm_w(c->m, c->tile, c->nt, c->rows_free, w->wk, 0, (int)kd, gk, n, 0.0f, err)) ||
        (rc = gemm_w(c->m, c->tile, c->nt, c->rows_free, w->wv, 0, (int)kd, gv, n, 0.0f, err)))
        return rc;
    const fw_gemm *job[] = {gq, gk, gv};
    const float *bias[] = {w->bq, w->bk, w->bv};
    size_t width[] = {qd, kd, kd};
    for (int b = 0; b < 3; b++)
        for (int i = 0; bias[b] && i < n; i++)
            for (size_t t = (size_t)job[b][i].r0; t < T; t++)
                for (size_t j = 0; j < width[b]; j++) job[b][i].y[t * width[b] + j] += bias[b][j];
    return KVQ_OK;
}

/* QKV slot i's products (qkv_products) as the scratch's queries (rows [r0,
 * T)), keys and values of layer l: Qh [Hq][T][D], Kh, Vh and the pre-RoPE
 * Kpre [H][T][D], each normed (qwen3, gemma3) and rotated first. */
static void qkv_heads(fw_ctx *c, int i, int l, int r0)
{
    const kvq_model_info *in = &c->m->info;
    const fw_weights *w = &c->w;
    fw_scratch *s = &c->s;
    int T = c->o->T, Hq = in->n_heads, H = in->n_kv_heads, D = in->head_dim;
    int qd = Hq * D, kd = H * D, nt = c->nt;
    float *q = s->q + (size_t)i * T * qd, *k = s->k + (size_t)i * T * kd, *v = s->v + (size_t)i * T * kd;
    const kvq_rope *rope = layer_rope(c, l);
    if (w->q_norm) rmsnorm(q, q, w->q_norm, r0 * Hq, T * Hq, D, in->norm_eps, nt); /* per head, before RoPE */
    if (w->k_norm) rmsnorm(k, k, w->k_norm, 0, T * H, D, in->norm_eps, nt);
    to_heads(k, s->Kpre, 0, T, T, H, D);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < T; t++) {
        for (int j = 0; t >= r0 && j < Hq; j++) kvq_rope_rotate(rope, q + (size_t)t * qd + (size_t)j * D, t, 0);
        for (int h = 0; h < H; h++) kvq_rope_rotate(rope, k + (size_t)t * kd + (size_t)h * D, t, 0);
    }
    to_heads(q, s->Qh, r0, T, T, Hq, D);
    to_heads(k, s->Kh, 0, T, T, H, D);
    to_heads(v, s->Vh, 0, T, T, H, D);
}

/* Attention rows [r0, r1) over the exact cache (Kh, Vh: all T keys). */
static void attend_exact(fw_ctx *c, int W, float scale, int r0, int r1)
{
    const kvq_model_info *in = &c->m->info;
    fw_scratch *s = &c->s;
    int T = c->o->T;
    attend(s->Qh, s->Kh, s->Vh, NULL, T, T, T, in->n_heads, in->n_kv_heads, in->head_dim, W, scale, r0, r1, s->att,
           s->ab, c->nt);
}

/* Rows [t0, t1) of the quantizer's output (kq, vq [H][t1−t0][D], keep
 * [H][t1−t0] or every token when none was dropped) into the --context cache
 * ck, cv [H][T][D], ckeep [H][T]. */
static void context_put(fw_scratch *s, int H, int T, int D, int t0, int t1, int dropped)
{
    size_t n = (size_t)(t1 - t0);
    for (int h = 0; h < H; h++) {
        size_t at = (size_t)h * T + t0;
        memcpy(s->ck + at * D, s->kq + (size_t)h * n * D, n * D * sizeof(float));
        memcpy(s->cv + at * D, s->vq + (size_t)h * n * D, n * D * sizeof(float));
        if (dropped) memcpy(s->ckeep + at, s->keep + (size_t)h * n, n);
        else memset(s->ckeep + at, 1, n);
    }
}

/* The cache_tokens column's count: over the scored rows t in [t0, t1) and
 * the KV heads, the tokens u <= t the cache holds (mask [H][ld]:
 * held[h][u]; NULL: all t + 1), added as a whole number (exact in a
 * double, whatever the blocks); per position it is divided by the heads
 * and the layers the item applies to (st->cache_div). */
static void count_held(const fw_ctx *c, kvq_fw_stream *st, const unsigned char *mask, int ld, int t0, int t1)
{
    int T = c->o->T, H = c->m->info.n_kv_heads, from = c->o->score_from > 0 ? c->o->score_from : 0;
    int a = t0 > from ? t0 : from, b = t1 < T - 1 ? t1 : T - 1;
    if (!st->item) return;
    st->cache_div = (double)H * (st->item->layer < 0 ? c->m->info.n_layers : 1);
    long sum = 0;
    for (int h = 0; h < H && a < b; h++) {
        const unsigned char *m = mask ? mask + (size_t)h * ld : NULL;
        long held = 0;
        for (int u = 0; m && u < a; u++) held += m[u] != 0;
        for (int t = a; t < b; t++) sum += m ? (held += m[t] != 0) : t + 1;
    }
    st->cache_held += (double)sum;
}

/* --context N (SPEC §3.11), rows [r0, T) of stream st at layer l: the
 * context [0, N) is prefilled exactly (its rows attend to the exact keys
 * and values) and compressed once by the item's spec on its N tokens (a
 * selector scoring with their own queries); rows [N, T) attend to that
 * cache with the continuation's own entries on top — exact (prefill
 * policy, or HI none), or stored by the continuation spec (the layer's
 * spec, a tokens(...)'s HI) as generation would: as it holds tokens
 * [N, p1) for the rows before p1, p1 growing by the stride.  Bits: the
 * cache after the last token.  *same as layer_attention's. */
static kvq_status context_attention(fw_ctx *c, kvq_fw_stream *st, int l, int r0, int *same, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    fw_scratch *s = &c->s;
    const kvq_eval_item *it = st->item;
    int T = c->o->T, N = c->o->context, Hq = in->n_heads, H = in->n_kv_heads, D = in->head_dim, nt = c->nt;
    int W = kvq_model_layer_window(c->m, l);
    float scale = in->attn_scale > 0 ? in->attn_scale : 1.0f / sqrtf((float)D);
    int dropped = 0;
    kvq_status rc;
    if ((rc = quantize_cache(c, st->spec, NULL, l, 0, N, &dropped, err))) return rc;
    for (int h = 0; h < H; h++) /* the cache's bits, and the context's own */
        st->k_bits += s->kb[h], st->v_bits += s->vb[h], st->ctx_k_bits += s->kb[h], st->ctx_v_bits += s->vb[h];
    int exact = !dropped && cache_is_exact(c, 0, N); /* the compressed context is the exact one */
    context_put(s, H, T, D, 0, N, dropped);
    const kvq_spec *hi = kvq_resolved_spec_continuation(st->spec, l); /* NULL: exact */
    if (it->policy == KVQ_POLICY_PREFILL || !hi) { /* the continuation's own entries exact, 16 bits */
        size_t n = (size_t)(T - N);
        st->k_bits += 16.0 * n * H * D, st->v_bits += 16.0 * n * H * D;
        if (!dropped) count_held(c, st, NULL, T, N, T);
        if (*same && exact) return KVQ_OK;
        for (int h = 0; h < H; h++) {
            size_t at = (size_t)h * T + N;
            memcpy(s->ck + at * D, s->Kh + at * D, n * D * sizeof(float));
            memcpy(s->cv + at * D, s->Vh + at * D, n * D * sizeof(float));
            memset(s->ckeep + at, 1, n);
        }
        if (dropped) count_held(c, st, s->ckeep, T, N, T);
        *same = 0;
        if (r0 < N) attend_exact(c, W, scale, r0, N);
        attend(s->Qh, s->ck, s->cv, dropped ? s->ckeep : NULL, T, T, T, Hq, H, D, W, scale, r0 > N ? r0 : N, T,
               s->att, s->ab, nt);
        return KVQ_OK;
    }
    int stride = c->o->stride > 0 ? c->o->stride : 1;
    if (!*same && r0 < N) attend_exact(c, W, scale, r0, N);
    for (int h = 0; h < H; h++) memset(s->ckeep + (size_t)h * T + N, 1, (size_t)(T - N)); /* the continuation's */
    for (int p0 = N; p0 < T; p0 += stride) {
        int p1 = p0 + stride < T ? p0 + stride : T, d = 0;
        if (p1 <= r0 && p1 < T) continue; /* rows not wanted (the last step counts the bits) */
        count_held(c, st, dropped ? s->ckeep : NULL, T, p0, p1);
        if ((rc = quantize_cache(c, NULL, hi, l, N, p1, &d, err))) return rc;
        if (p1 == T)
            for (int h = 0; h < H; h++) st->k_bits += s->kb[h], st->v_bits += s->vb[h];
        if (*same) {
            if (exact && cache_is_exact(c, N, p1)) continue;
            *same = 0;
            if (p0 > r0) attend_exact(c, W, scale, r0, p0);
        }
        context_put(s, H, T, D, N, p1, 0);
        if (p1 > r0)
            attend(s->Qh, s->ck, s->cv, dropped ? s->ckeep : NULL, p1, T, T, Hq, H, D, W, scale, p0 > r0 ? p0 : r0, p1,
                   s->att, s->ab, nt);
    }
    return KVQ_OK;
}

/* ------------------------------------------- decode-time compression */

/* Layer l's tokens(...) when it compresses while decoding (target=), else NULL. */
static const kvq_tokens_parts *decoding_parts(const kvq_fw_stream *st, int l)
{
    const kvq_tokens_parts *tp = st->spec ? kvq_resolved_spec_parts(st->spec, l) : NULL;
    return tp && ((const kvq_token_sel_opts *)kvq_spec_opts(&tp->sel))->target != KVQ_UNSET ? tp : NULL;
}

/* The plain spec sp on the tokens u < upto of each head where mask[h][u]
 * is set (n per head, in position order), from K, V [H][T][D] (the exact
 * entries, or the cache ck, cv; keys pre-RoPE: the exact ones), as a layer
 * of their own at their positions; K', V' into the cache ck, cv; the
 * stored bits added to bits[0] (K), bits[1] (V). */
static kvq_status press_run(fw_ctx *c, const kvq_spec *sp, int l, const unsigned char *mask, int upto, int n,
                            const float *K, const float *V, double *bits, kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads, D = in->head_dim, T = c->o->T;
    size_t row = (size_t)D * sizeof(float);
    for (int h = 0; h < H; h++)
        for (int u = 0, i = 0; u < upto; u++)
            if (mask[(size_t)h * T + u]) {
                size_t from = ((size_t)h * T + u) * D, to = ((size_t)h * n + i) * D;
                if (i == n) return kvq_fail(err, KVQ_ERR_INTERNAL, "decode-time compression: head %d holds more "
                                            "than %d tokens", h, n);
                memcpy(s->pk + to, K + from, row), memcpy(s->pv + to, V + from, row);
                memcpy(s->ppre + to, s->Kpre + from, row);
                s->pos[(size_t)h * n + i++] = u;
            }
    kvq_layer L = {.H = H, .Hq = in->n_heads, .T = n, .D = D, .key = s->pk, .value = s->pv, .key_pre_rope = s->ppre};
    kvq_status st = run_on_cache(c, NULL, sp, l, &L, s->pos, NULL, NULL, err);
    if (st) return st;
    for (int h = 0; h < H; h++) {
        for (int i = 0; i < n; i++) {
            size_t from = ((size_t)h * n + i) * D, to = ((size_t)h * T + s->pos[(size_t)h * n + i]) * D;
            memcpy(s->ck + to, s->kq + from, row), memcpy(s->cv + to, s->vq + from, row);
        }
        bits[0] += s->kb[h], bits[1] += s->vb[h];
    }
    return KVQ_OK;
}

/* Selection on the tokens held at HI (dhi, n per head, before position
 * p1): their keys as cached, the queries of the last `nq` rows (at = NULL:
 * every row, compress-once's own scores); dsel [H][n] = the kept. */
static kvq_status press_select(fw_ctx *c, const kvq_tokens_parts *tp, int l, int n, int p1, int nq,
                               const kvq_select_at *at, kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads, Hq = in->n_heads, D = in->head_dim, T = c->o->T, G = Hq / H;
    int queries = kvq_token_selector_needs_queries(tp->selector);
    size_t row = (size_t)D * sizeof(float);
    if (queries && !s->pq && !(s->pq = kvq_alloc_array((size_t)T, (size_t)Hq * D * sizeof(float))))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the queries of %d tokens", T);
    for (int h = 0; h < H; h++)
        for (int u = 0, i = 0; u < p1; u++)
            if (s->dhi[(size_t)h * T + u]) {
                size_t from = ((size_t)h * T + u) * D, to = ((size_t)h * n + i) * D;
                memcpy(s->pk + to, s->ck + from, row), memcpy(s->pv + to, s->cv + from, row);
                for (int j = h * G; queries && i >= n - nq && j < (h + 1) * G; j++)
                    memcpy(s->pq + ((size_t)j * n + i) * D, s->Qh + ((size_t)j * T + u) * D, row);
                i++;
            }
    kvq_layer L = {.H = H, .Hq = Hq, .T = n, .D = D, .key = s->pk, .value = s->pv, .query = queries ? s->pq : NULL};
    kvq_attn_mode mode = {.scale = in->attn_scale, .window = kvq_model_layer_window(c->m, l)};
    return kvq_tokens_select_at(tp, &L, &mode, c->o->seed, l, c->nt, at, s->dsel, NULL, err);
}

/* The held tokens that selection did not keep (dsel, n per head) leave HI
 * for good: evicted (drop), kept as they are (none, 16 bits), or stored by
 * LO from their HI values (once).  bits: LO's. */
static kvq_status press_move(fw_ctx *c, const kvq_tokens_parts *tp, int l, int n, int p1, double *bits,
                             kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    int H = in->n_kv_heads, D = in->head_dim, T = c->o->T, moved = 0;
    for (int h = 0; h < H; h++) { /* dhi 2: moving now; every head moves as many (one target) */
        int m = 0;
        for (int u = 0, i = 0; u < p1; u++)
            if (s->dhi[(size_t)h * T + u] && !s->dsel[(size_t)h * n + i++]) s->dhi[(size_t)h * T + u] = 2, m++;
        if (h && m != moved)
            return kvq_fail(err, KVQ_ERR_INTERNAL, "decode-time compression: heads 0 and %d keep different counts", h);
        moved = m;
    }
    if (!moved) return KVQ_OK;
    kvq_status st = KVQ_OK;
    if (tp->lo_kind == KVQ_PART_SPEC) { /* from the HI values the cache holds */
        for (size_t i = 0; i < (size_t)H * T; i++) s->dsel[i] = s->dhi[i] == 2; /* the mask press_run reads */
        st = press_run(c, &tp->lo, l, s->dsel, p1, moved, s->ck, s->cv, bits, err);
    } else if (tp->lo_kind == KVQ_PART_NONE) {
        bits[0] += 16.0 * moved * D * H, bits[1] += 16.0 * moved * D * H;
    }
    for (size_t i = 0; i < (size_t)H * T; i++)
        if (s->dhi[i] == 2) s->dhi[i] = 0, s->ckeep[i] = tp->lo_kind != KVQ_PART_DROP;
    return st;
}

/* Rows [r0, T) of stream st at layer l under decode-time compression (SPEC
 * §3.11, kvpress's DecodingPress): the cache grows a token per position at
 * HI; after every `interval`-th decoded token, when more than `target` are
 * at HI, the selector scores them (queries: the last min(buffer, interval)
 * rows) and keeps `target` at HI, the others leave HI for good (press_move).
 * With --context N the context is prefilled exactly and, with keep=, first
 * compressed once (PrefillDecodingPress).  Each row attends to the cache as
 * it stands; HI none keeps exact entries, a HI spec stores the tokens at HI
 * as a layer of their own every `stride` positions.  Bits: the cache after
 * the last token.  Every row is attended here (*same = 0). */
static kvq_status press_attention(fw_ctx *c, kvq_fw_stream *st, const kvq_tokens_parts *tp, int l, int r0, int *same,
                                  kvq_error *err)
{
    fw_scratch *s = &c->s;
    const kvq_model_info *in = &c->m->info;
    const kvq_token_sel_opts *o = kvq_spec_opts(&tp->sel);
    int T = c->o->T, N = c->o->context > 0 ? c->o->context : 0, Hq = in->n_heads, H = in->n_kv_heads;
    int D = in->head_dim, W = kvq_model_layer_window(c->m, l), S = o->target, every = o->interval;
    int nq = o->buffer == KVQ_UNSET || o->buffer > every ? every : o->buffer;
    int stride = c->o->stride > 0 ? c->o->stride : 1;
    float scale = in->attn_scale > 0 ? in->attn_scale : 1.0f / sqrtf((float)D);
    const kvq_spec *hi = tp->hi_kind == KVQ_PART_SPEC ? &tp->hi : NULL;
    double lo_bits[2] = {0, 0}, hi_bits[2] = {0, 0};
    size_t all = (size_t)H * T;
    kvq_status rc;
    /* PrefillDecodingPress: keep= (window: its recent=) compresses the context once first */
    int once = N > 0 && (!isnan(o->keep) || (tp->selector == KVQ_SEL_WINDOW && o->recent > 0));
    int n = N, quiet = !hi && !once; /* n: held at HI before the next position */
    for (int e = N + every - 1; quiet && e + 1 < T; e += every) quiet = e + 1 <= S;
    if (quiet) { /* no compression ever fires: the exact cache, 16 bits */
        st->k_bits += 16.0 * all * D, st->v_bits += 16.0 * all * D;
        if (N > 0) st->ctx_k_bits += 16.0 * N * H * D, st->ctx_v_bits += 16.0 * N * H * D;
        count_held(c, st, NULL, T, r0, T);
        if (!*same) attend_exact(c, W, scale, r0, T);
        return KVQ_OK;
    }
    memcpy(s->ck, s->Kh, all * D * sizeof(float)), memcpy(s->cv, s->Vh, all * D * sizeof(float));
    memset(s->dhi, 1, all), memset(s->ckeep, 1, all);
    *same = 0;
    if (r0 < N) attend_exact(c, W, scale, r0, N);
    if (N > 0) { /* the context: compressed once by keep= (its own queries), its bits */
        if (once &&
            ((rc = press_select(c, tp, l, N, N, N, NULL, err)) || (rc = press_move(c, tp, l, N, N, lo_bits, err))))
            return rc;
        n = 0;
        for (int u = 0; u < N; u++) n += s->dhi[u];
        double ctx[2] = {16.0 * n * D * H, 16.0 * n * D * H};
        if (hi && (ctx[0] = ctx[1] = 0, rc = press_run(c, hi, l, s->dhi, N, n, s->Kh, s->Vh, ctx, err))) return rc;
        double where = n == N ? 0 : tp->lo_kind == KVQ_PART_DROP ? 32.0 * n * H : (double)N * H;
        st->ctx_k_bits += ctx[0] + lo_bits[0] + where / 2, st->ctx_v_bits += ctx[1] + lo_bits[1] + where / 2;
    }
    for (int p0 = N; p0 < T;) {
        /* the next compression: after the token at e = N + k·interval − 1 */
        int e = N + ((p0 - N) / every + 1) * every - 1, p1 = e + 1 < T ? e + 1 : T;
        for (int a = p0; a < p1; a += stride) { /* rows [a, b): the tokens at HI stored by HI */
            int b = a + stride < p1 ? a + stride : p1, nb = n + (b - p0);
            if (hi) {
                hi_bits[0] = hi_bits[1] = 0;
                if ((rc = press_run(c, hi, l, s->dhi, b, nb, s->Kh, s->Vh, hi_bits, err))) return rc;
            } else {
                hi_bits[0] = hi_bits[1] = 16.0 * nb * D * H;
            }
            count_held(c, st, s->ckeep, T, a, b);
            if (b > r0)
                attend(s->Qh, s->ck, s->cv, s->ckeep, b, T, T, Hq, H, D, W, scale, a > r0 ? a : r0, b, s->att, s->ab,
                       c->nt);
        }
        n += p1 - p0;
        p0 = p1;
        if (p1 < T && n > S) { /* compress: S stay at HI */
            kvq_select_at at = {.target = S, .qrow0 = n - nq};
            if ((rc = press_select(c, tp, l, n, p1, nq, &at, err)) || (rc = press_move(c, tp, l, n, p1, lo_bits, err)))
                return rc;
            n = 0;
            for (int u = 0; u < p1; u++) n += s->dhi[u];
        }
    }
    /* where the tokens are, when some left HI: a position per held token (drop), else a mask bit per token */
    int left = 0, held = 0;
    for (int u = 0; u < T; u++) left += !s->dhi[u], held += s->ckeep[u];
    double where = !left ? 0 : tp->lo_kind == KVQ_PART_DROP ? 32.0 * held * H : (double)T * H;
    st->k_bits += hi_bits[0] + lo_bits[0] + where / 2, st->v_bits += hi_bits[1] + lo_bits[1] + where / 2;
    return KVQ_OK;
}

/* The attention rows [r0, T) of stream st at layer l into the scratch's
 * att, from the scratch's Q, K, V: over the exact cache, or over its item's
 * quantized cache where the item applies (prefill: quantized once over the
 * T tokens; decode: as it holds the first p1 tokens for the rows before p1,
 * p1 growing by the stride; --context: context_attention), the stored bits
 * counted.
 * *same (in): st still follows the exact stream — then nothing is attended
 * while each cache is bit-identical to the exact keys and values, and at
 * the first that is not, the rows before it are attended exactly; *same
 * (out): 1 if every cache was exact (st's attention is the exact one). */
static kvq_status layer_attention(fw_ctx *c, kvq_fw_stream *st, int l, int r0, int *same, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    fw_scratch *s = &c->s;
    int T = c->o->T, Hq = in->n_heads, H = in->n_kv_heads, D = in->head_dim, kd = H * D, nt = c->nt;
    int W = kvq_model_layer_window(c->m, l);
    float scale = in->attn_scale > 0 ? in->attn_scale : 1.0f / sqrtf((float)D);
    const kvq_eval_item *it = st->item;
    int applies = it && (it->layer < 0 || it->layer == l);
    int N = c->o->context > 0 ? c->o->context : 0;
    if (applies) st->n_elem += (double)T * kd, st->ctx_elem += (double)N * kd;
    if (!applies || !it->spec) {
        if (applies) count_held(c, st, NULL, T, 0, T);
        if (applies) /* -q none: the exact cache, 16 bits */
            st->k_bits += 16.0 * T * kd, st->v_bits += 16.0 * T * kd, st->ctx_k_bits += 16.0 * N * kd,
            st->ctx_v_bits += 16.0 * N * kd;
        if (!*same) attend_exact(c, W, scale, r0, T);
        return KVQ_OK;
    }
    const kvq_tokens_parts *press = it->policy == KVQ_POLICY_DECODE ? decoding_parts(st, l) : NULL;
    if (press) return press_attention(c, st, press, l, r0, same, err);
    if (c->o->context > 0) return context_attention(c, st, l, r0, same, err);
    int stride = it->policy == KVQ_POLICY_DECODE ? (c->o->stride > 0 ? c->o->stride : 1) : T;
    for (int p0 = 0; p0 < T; p0 += stride) {
        int p1 = p0 + stride < T ? p0 + stride : T;
        if (p1 <= r0 && p1 < T) continue; /* rows not wanted (the last step counts the bits) */
        int dropped = 0;
        kvq_status rc = quantize_cache(c, st->spec, NULL, l, 0, p1, &dropped, err);
        if (rc) return rc;
        count_held(c, st, dropped ? s->keep : NULL, p1, p0, p1);
        if (p1 == T) /* the cache after the last token */
            for (int h = 0; h < H; h++) st->k_bits += s->kb[h], st->v_bits += s->vb[h];
        if (*same) {
            if (!dropped && cache_is_exact(c, 0, p1)) continue;
            *same = 0;
            if (p0 > r0) attend_exact(c, W, scale, r0, p0);
        }
        if (p1 > r0)
            attend(s->Qh, s->kq, s->vq, dropped ? s->keep : NULL, p1, p1, T, Hq, H, D, W, scale, p0 > r0 ? p0 : r0, p1,
                   s->att, s->ab, nt);
    }
    return KVQ_OK;
}

/* Whether n streams fit the lockstep's cap slots (the groups' job arrays). */
static kvq_status lockstep_fits(const fw_ctx *c, int n, kvq_error *err)
{
    return n > c->rest.cap ? kvq_fail(err, KVQ_ERR_INTERNAL, "%d streams in lockstep, %d slots", n, c->rest.cap)
                           : KVQ_OK;
}

/* Slot i's buffers for a layer's rows [r0, T): in the scratch's, which
 * holds cap slots of T rows, slot i's row r0 right after slot i − 1's
 * last, at (r0 + i·(T − r0)) rows, so that the slots' rows stack in
 * gemm_w — also those of the last layer, which computes only the scored
 * rows (rows [0, r0) of slot i > 0 lie over slot i − 1's, and none of
 * the rest reads or writes them).  Slot 0 is the scratch's own buffers. */
static kvq_status rest_slots(fw_ctx *c, int n, int r0, kvq_error *err)
{
    fw_rest *f = &c->rest;
    const kvq_model_info *in = &c->m->info;
    size_t S = (size_t)(c->o->T - r0), qd = (size_t)in->n_heads * in->head_dim; /* S: rows a slot holds */
    kvq_status st = lockstep_fits(c, n, err);
    if (st) return st;
    if (!f->nslots) f->att[0] = c->s.att; /* the first time: the scratch's att is slot 0's */
    for (int i = 0; (!f->nslots || f->r0 != r0) && i < f->cap; i++) {
        f->xn[i] = c->s.xn + i * S * in->dim, f->xo[i] = c->s.xo + i * S * in->dim;
        f->g[i] = c->s.g + i * S * in->ffn_dim;
        f->att[i] = f->att[0] + i * S * qd;
    }
    f->nslots = f->cap, f->r0 = r0;
    return KVQ_OK;
}

/* The next waiting stream's slot (rows [r0, T)) as the scratch's attention output, before it attends. */
static kvq_status rest_next(fw_ctx *c, int r0, kvq_error *err)
{
    kvq_status st = c->rest.n && c->rest.r0 != r0 ? kvq_fail(err, KVQ_ERR_INTERNAL, "streams of two layers waiting")
                                                  : rest_slots(c, c->rest.n + 1, r0, err);
    if (!st) c->s.att = c->rest.att[c->rest.n];
    return st;
}

/* The slots, the scratch's own attention output back in place. */
static void rest_free(fw_ctx *c)
{
    fw_rest *f = &c->rest;
    if (f->nslots) c->s.att = f->att[0];
    memset(f, 0, sizeof *f);
}

/* How many streams' feed-forward may wait together: the slots of all of
 * them, or as many as REST_GROUP_BYTES hold (at least one). */
static int rest_group_cap(const kvq_model_info *in, int T, int ns)
{
    size_t qd = (size_t)in->n_heads * in->head_dim, kd = (size_t)in->n_kv_heads * in->head_dim;
    size_t slot = (size_t)T * (2 * (size_t)in->dim + (size_t)in->ffn_dim + 2 * qd + 2 * kd) * sizeof(float);
    size_t cap = slot ? REST_GROUP_BYTES / slot : 1;
    if (cap < 1) cap = 1;
    if (cap > REST_MAX_GROUP) cap = REST_MAX_GROUP;
    return (int)(cap < (size_t)ns ? cap : (size_t)ns);
}

/* x [T][dim] += a · Wᵀ on rows [r0, T) of each waiting stream (a: slot
 * i's activations in acts[i]), RMS-normed first by post_norm when the
 * model has one (gemma3; the product in slot i's xo). */
static kvq_status rest_residual(fw_ctx *c, float *const *acts, kvq_wtensor *W, const float *post_norm, int r0,
                               kvq_error *err)
{
    fw_rest *f = &c->rest;
    const kvq_model_info *in = &c->m->info;
    int T = c->o->T, dim = in->dim;
    size_t rows = (size_t)(T - r0) * dim;
    /* with rows free, the hidden states are added to in the xo slots, whose
     * rows stack: each copied there and back (the same sums on the same values) */
    int stage = c->rows_free && !post_norm && f->n > 1;
    fw_gemm g[REST_MAX_GROUP] = {{0}};
    for (int i = 0; i < f->n; i++) {
        g[i] = (fw_gemm){.x = acts[i], .y = post_norm || stage ? f->xo[i] : f->st[i]->x, .r0 = r0, .r1 = T, .ldy = dim};
        if (stage) memcpy(f->xo[i] + (size_t)r0 * dim, f->st[i]->x + (size_t)r0 * dim, rows * sizeof(float));
    }
    kvq_status st = gemm_w(c->m, c->tile, c->nt, c->rows_free, W, 0, dim, g, f->n, post_norm ? 0.0f : 1.0f, err);
    for (int i = 0; !st && stage && i < f->n; i++)
        memcpy(f->st[i]->x + (size_t)r0 * dim, f->xo[i] + (size_t)r0 * dim, rows * sizeof(float));
    for (int i = 0; !st && post_norm && i < f->n; i++) {
        float *x = f->st[i]->x, *tmp = f->xo[i];
        rmsnorm(tmp, tmp, post_norm, r0, T, dim, in->norm_eps, c->nt);
        for (size_t k = (size_t)r0 * dim, n = (size_t)T * dim; k < n; k++) x[k] += tmp[k];
    }
    return st;
}

/* The rest of layer l of every waiting stream, rows [r0, T): x +=
 * attention output · Woᵀ, then x += ffn(x) (gemma3: each RMS-normed before
 * its residual add), each weight tile once for all of them; then each
 * stream's hidden state checked finite. */
static kvq_status check_finite(const fw_ctx *c, const kvq_fw_stream *st, int l, int r0, kvq_error *err);
static kvq_status rest_flush(fw_ctx *c, int l, int r0, kvq_error *err)
{
    fw_rest *f = &c->rest;
    const kvq_model_info *in = &c->m->info;
    const fw_weights *w = &c->w;
    int T = c->o->T, dim = in->dim, F = in->ffn_dim, nt = c->nt, n = f->n;
    if (!n) return KVQ_OK;
    kvq_status rc = rest_residual(c, f->att, w->wo, w->post_attn_norm, r0, err);
    if (rc) return f->n = 0, rc;
    fw_gemm gg[REST_MAX_GROUP];
    for (int i = 0; i < n; i++) {
        rmsnorm(f->xn[i], f->st[i]->x, w->ffn_norm, r0, T, dim, in->norm_eps, nt);
        gg[i] = (fw_gemm){.x = f->xn[i], .y = f->g[i], .r0 = r0, .r1 = T, .ldy = F};
    }
    if ((rc = gemm_glu(c->m, c->tile, c->ubuf, &c->ucap, nt, c->rows_free, w->w_gate, w->w_up, F, gg, n, in->ffn_act,
                       err)))
        return f->n = 0, rc;
    rc = rest_residual(c, f->g, w->w_down, w->post_ffn_norm, r0, err);
    for (int i = 0; !rc && i < n; i++) rc = check_finite(c, f->st[i], l, r0, err);
    f->n = 0;
    return rc;
}

/* The rest of layer l for stream st, whose attention output is in the
 * next slot (rest_next): it waits for the other streams' (rest_flush), which
 * a full group runs at once. */
static kvq_status layer_rest(fw_ctx *c, kvq_fw_stream *st, int l, int r0, kvq_error *err)
{
    fw_rest *f = &c->rest;
    f->st[f->n++] = st;
    return f->n == f->cap ? rest_flush(c, l, r0, err) : KVQ_OK;
}

/* Fails naming the layer, position and stream if rows [r0, T) of st's hidden state hold a non-finite value. */
static kvq_status check_finite(const fw_ctx *c, const kvq_fw_stream *st, int l, int r0, kvq_error *err)
{
    int T = c->o->T, dim = c->m->info.dim;
    size_t nx = (size_t)(T - r0) * dim, bad = kvq_first_nonfinite(st->x + (size_t)r0 * dim, nx);
    if (bad == nx) return KVQ_OK;
    const kvq_eval_item *it = st->item;
    return kvq_fail(err, KVQ_ERR_FORMAT,
                    "%s: layer %d, position %zu: the hidden state%s%s%s is %g: expected finite activations",
                    c->m->path, l, (size_t)r0 + bad / (size_t)dim, it ? " with the cache of " : "",
                    it ? (it->spec ? it->spec->text : "none") : "", it ? "," : "",
                    (double)st->x[(size_t)r0 * dim + bad]);
}

/* Layer l of every stream, rows [r0, T).  The streams that compute their
 * own Q, K, V here — the exact one and those that left it before — do so
 * in lockstep, cap at a time (qkv_products), the exact stream in the
 * first group.  After the exact stream's, the streams that follow it check
 * their caches against its Q, K, V (and those whose cache differs leave
 * it here, from its hidden state before the layer); then the exact
 * stream attends; then the streams that had left it before, each on its
 * own Q, K, V. */
static kvq_status layer_all(fw_ctx *c, int l, int r0, kvq_error *err)
{
    const kvq_fw_opts *o = c->o;
    kvq_fw_stream *ex = &o->s[0], *grp[REST_MAX_GROUP];
    int T = o->T, dim = c->m->info.dim, cap = c->rest.cap;
    kvq_status rc;
    for (int i = 0; i < o->ns; i++) c->was_following[i] = i > 0 && o->s[i].follows;
    for (int next = 0; next < o->ns;) { /* next: the first stream not yet in a group */
        int n = 0;
        for (; next < o->ns && n < cap; next++)
            if (!next || !c->was_following[next]) grp[n++] = &o->s[next];
        if (n && (rc = qkv_products(c, grp, n, l, r0, err))) return rc;
        for (int k = 0; k < n; k++) {
            kvq_fw_stream *st = grp[k];
            int same;
            qkv_heads(c, k, l, r0);
            if (st == ex && o->on_layer) {
                const kvq_model_info *in = &c->m->info;
                kvq_layer L = {.H = in->n_kv_heads, .Hq = in->n_heads, .T = T, .D = in->head_dim, .key = c->s.Kh,
                               .value = c->s.Vh, .query = c->s.Qh, .key_pre_rope = c->s.Kpre};
                if ((rc = o->on_layer(o->ud, l, &L, err))) return rc;
            }
            for (int i = 1; st == ex && i < o->ns; i++) { /* the exact stream's followers, on its Q, K, V */
                kvq_fw_stream *fs = &o->s[i];
                if (!c->was_following[i]) continue;
                same = 1;
                if ((rc = rest_next(c, r0, err)) || (rc = layer_attention(c, fs, l, r0, &same, err))) return rc;
                if (same) continue;
                memcpy(fs->x, ex->x, (size_t)T * dim * sizeof(float)); /* it leaves the exact stream here */
                fs->follows = 0;
                if ((rc = layer_rest(c, fs, l, r0, err))) return rc;
            }
            same = 0;
            if ((rc = rest_next(c, r0, err)) || (rc = layer_attention(c, st, l, r0, &same, err)) ||
                (rc = layer_rest(c, st, l, r0, err)))
                return rc;
        }
    }
    return rest_flush(c, l, r0, err); /* the streams still waiting */
}

/* ------------------------------------------------------ output head */

/* Folds row zr (vocabulary [v0, v0+vc)) of position t into the online
 * state of stream st: its arg-max, max, Σ exp(z − max) and target logit.
 * esum: Σ exp(z − max) of this row already taken (the exact stream's,
 * fold_group's), or NULL to take it here. */
static void fold_row(kvq_fw_stream *st, const float *zr, int t, int vc, int v0, const int *tokens, const double *esum)
{
    float cm = zr[0];
    int ca = 0;
    for (int v = 1; v < vc; v++)
        if (zr[v] > cm) cm = zr[v], ca = v;
    if (v0 == 0 || cm > st->amax[t]) st->amax[t] = cm, st->arg[t] = v0 + ca; /* first arg-max */
    double m_old = v0 ? st->lmax[t] : -INFINITY, m_new = m_old > cm ? m_old : cm;
    double sum = 0;
    if (esum) sum = *esum;
    else
        for (int v = 0; v < vc; v++) sum += exp((double)zr[v] - m_new);
    st->lsum[t] = (v0 ? st->lsum[t] * exp(m_old - m_new) : 0.0) + sum;
    st->lmax[t] = m_new;
    int tgt = tokens[t + 1];
    if (tgt >= v0 && tgt < v0 + vc) st->ltgt[t] = zr[tgt - v0];
}

/* Folds the logits chunk Z [ng][N][vc] (vocabulary [v0, v0+vc)) of
 * positions t0 + [0, N) of streams st[0..ng) into their online states,
 * with their KL cross terms Σ p_v (a_v − b_v) against the exact stream r's
 * chunk A [.][vc] (p from A, scaled by r's running max, which r's own fold
 * updates only after every group's).  A row's exp(a_v − max) are taken
 * once, into the thread's row of e [nt][vc], for every stream's cross
 * term and, with esum (NULL: not this group), for r's own sum, esum[i]:
 * the same exponentials added in the same order as each sum took them
 * alone. */
static void fold_group(kvq_fw_stream *const *st, int ng, const float *Z, const float *A, const kvq_fw_stream *r, int t0,
                       int N, int vc, int v0, const int *tokens, double *e, double *esum, int nt)
{
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int i = 0; i < N; i++) {
        int t = t0 + i;
        const float *ar = A + (size_t)i * vc;
        double *ex = e + (size_t)omp_get_thread_num() * vc;
        float am = ar[0];
        for (int v = 1; v < vc; v++) am = ar[v] > am ? ar[v] : am;
        double ra_old = v0 ? r->lmax[t] : -INFINITY, ra_new = ra_old > am ? ra_old : am, sum = 0;
        for (int v = 0; v < vc; v++) sum += ex[v] = exp((double)ar[v] - ra_new);
        if (esum) esum[i] = sum;
        for (int k = 0; k < ng; k++) {
            const float *zr = Z + ((size_t)k * N + i) * vc;
            fold_row(st[k], zr, t, vc, v0, tokens, NULL);
            double wsum = 0;
            for (int v = 0; v < vc; v++) wsum += ex[v] * ((double)ar[v] - (double)zr[v]);
            st[k]->lw[t] = (v0 ? st[k]->lw[t] * exp(ra_old - ra_new) : 0.0) + wsum;
        }
    }
}

/* Soft-capping c·tanh(z/c) of n logits, when the model says so. */
static void softcap(float *z, size_t n, float cap, int nt)
{
    if (!(cap > 0)) return;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (size_t i = 0; i < n; i++) z[i] = cap * tanhf(z[i] / cap);
}

/* The output head for positions [h0, T − 1) (their rows start at a
 * multiple of TILE_ROWS, so they are computed as in a pass of every row)
 * of the exact stream and of each stream that left it — all of them from
 * each tile of the output matrix while it is warm; a stream that still
 * follows the exact one has its results. */
static kvq_status output_head(fw_ctx *c, kvq_error *err)
{
    const kvq_model_info *in = &c->m->info;
    const kvq_fw_opts *o = c->o;
    int N = o->T - 1, dim = in->dim, V = in->vocab_size, nt = c->nt, NA = N, h0 = c->h0;
    for (int i = 0; i < o->n_logit_pos; i++) /* the last position's logits are wanted too: one more row */
        if (o->logit_pos[i] == N) NA = N + 1;
    int NR = N - h0, NRA = NA - h0, nown = 0; /* rows of a stream; the exact stream's; streams with their own */
    for (int i = 1; i < o->ns; i++) nown += !o->s[i].follows;
    /* vocabulary chunks of whole column tiles, their size from the shapes
     * alone (the online log-softmax folds chunk by chunk: the same chunks in
     * every pass give the same sums): at most 64 MB of a stream's logits;
     * the streams' logits of a chunk in groups of at most 64 MB */
    size_t lim = (16u << 20) / (size_t)(NRA > dim ? NRA : dim);
    int vc = lim >= (size_t)V ? V : (int)(lim / TILE_COLS) * TILE_COLS;
    if (vc < TILE_COLS) vc = TILE_COLS < V ? TILE_COLS : V;
    int grp = (int)((16u << 20) / ((size_t)(NR > 0 ? NR : 1) * vc));
    grp = grp > nown ? nown : grp;
    grp = grp < 1 ? 1 : grp;
    /* the exact stream's logits A (row NR: the last position, its own call) and
     * then, rows following A's so that gemm_w can stack them, a group's Z */
    float *A = kvq_alloc_array((size_t)NRA + (size_t)(nown ? grp : 0) * NR, (size_t)vc * sizeof(float)), *Z = NULL;
    float *xn = kvq_alloc_array((size_t)nown * NR + (size_t)NRA, (size_t)dim * sizeof(float));
    float *onorm = kvq_alloc_array((size_t)dim, sizeof(float));
    kvq_fw_stream **own = kvq_alloc_array((size_t)o->ns, sizeof *own); /* the stream of each own block */
    fw_gemm *jobs = kvq_alloc_array((size_t)grp + 2, sizeof *jobs);
    double *esum = kvq_alloc_array((size_t)(NR > 0 ? NR : 1), sizeof *esum); /* the exact rows' Σ exp, fold_group */
    double *e = kvq_alloc_array((size_t)nt * vc, sizeof *e);                 /* [nt][vc]: each thread's row of exp */
    kvq_status rc = KVQ_OK;
    if (!A || !xn || !onorm || !own || !jobs || !esum || !e) {
        rc = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the output head (%d positions, chunks of %d tokens)", NR,
                      vc);
        goto done;
    }
    if ((rc = weight_rows(c->m, &c->m->output_norm, 0, 1, onorm, err))) goto done;
    /* the exact stream's normed rows at xn, stream own[k]'s at xn + (NRA + k·NR) rows */
    rmsnorm(xn, o->s[0].x + (size_t)h0 * dim, onorm, 0, NRA, dim, in->norm_eps, nt);
    for (int i = 1, k = 0; i < o->ns; i++)
        if (!o->s[i].follows) {
            own[k] = &o->s[i];
            rmsnorm(xn + ((size_t)NRA + (size_t)k * NR) * dim, o->s[i].x + (size_t)h0 * dim, onorm, 0, NR, dim,
                    in->norm_eps, nt);
            k++;
        }
    for (int v0 = 0; v0 < V; v0 += vc) {
        int n = v0 + vc < V ? vc : V - v0;
        Z = A + (size_t)NRA * n; /* [grp][NR][n] */
        /* the exact stream's logits with the first group of streams, then the other groups */
        for (int g0 = 0; g0 == 0 || g0 < nown; g0 += grp) {
            int nj = 0, ng = nown - g0 < grp ? nown - g0 : grp;
            if (!g0) {
                jobs[nj++] = (fw_gemm){.x = xn, .y = A, .r0 = 0, .r1 = NR, .ldy = n};
                if (NA > N) jobs[nj++] = (fw_gemm){.x = xn, .y = A, .r0 = NR, .r1 = NR + 1, .ldy = n};
            }
            for (int k = 0; k < ng; k++)
                jobs[nj++] = (fw_gemm){.x = xn + ((size_t)NRA + (size_t)(g0 + k) * NR) * dim,
                                       .y = Z + (size_t)k * NR * n, .r0 = 0, .r1 = NR, .ldy = n};
            if ((rc = gemm_w(c->m, c->tile, nt, c->rows_free, &c->m->output, v0, n, jobs, nj, 0.0f, err))) goto done;
            if (!g0) softcap(A, (size_t)NRA * n, in->logit_softcap, nt);
            softcap(Z, (size_t)ng * NR * n, in->logit_softcap, nt);
            /* before the exact stream's own fold: they read its running max */
            fold_group(own + g0, ng, Z, A, &o->s[0], h0, NR, n, v0, o->tokens, e, g0 ? NULL : esum, nt);
        }
        for (int i = 0; i < o->n_logit_pos; i++)
            memcpy(o->logits + (size_t)i * V + v0, A + (size_t)(o->logit_pos[i] - h0) * n, (size_t)n * sizeof(float));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int i = 0; i < NR; i++) fold_row(&o->s[0], A + (size_t)i * n, h0 + i, n, v0, o->tokens, &esum[i]);
    }
    c->m->output.checked = 1; /* every row read finite */
    const kvq_fw_stream *r = &o->s[0];
    int from = o->score_from > 0 ? o->score_from : 0;
    for (int i = 0; i < o->ns; i++) {
        kvq_fw_stream *st = &o->s[i];
        int exact = i == 0 || st->follows; /* its logits are the exact stream's */
        st->nll = st->kl = st->top1 = st->d_n = st->d_mean = st->d_m2 = 0;
        for (int t = from; t < N; t++) {
            const kvq_fw_stream *src = exact ? r : st;
            double lse = src->lmax[t] + log(src->lsum[t]), nll = lse - src->ltgt[t];
            st->nll += nll;
            if (st->pos_nll) st->pos_nll[t - from] = nll;
            if (st->pos_hit) st->pos_hit[t - from] = src->arg[t] == o->tokens[t + 1];
            st->top1 += 1;
            if (!i) continue;
            double d = 0;
            if (!exact) {
                double lse_r = r->lmax[t] + log(r->lsum[t]), kl = st->lw[t] / r->lsum[t] - lse_r + lse;
                st->kl += kl > 0 ? kl : 0.0;
                st->top1 -= st->arg[t] != r->arg[t];
                d = nll - (lse_r - r->ltgt[t]);
            }
            double delta = d - st->d_mean; /* Welford */
            st->d_n += 1;
            st->d_mean += delta / st->d_n;
            st->d_m2 += delta * (d - st->d_mean);
        }
    }
done:
    free(A), free(xn), free(onorm), free(own), free(jobs), free(esum), free(e);
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
        kvq_status st = weight_rows(m, &m->tok_embd, o->tokens[t], o->tokens[t] + 1, x + (size_t)t * dim, err);
        if (st) return st;
        if (sc > 0)
            for (int i = 0; i < dim; i++) x[(size_t)t * dim + i] *= sc;
    }
    return KVQ_OK;
}

kvq_status kvq_forward(kvq_model *m, const kvq_fw_opts *o, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    int T = o->T;
    fw_ctx c = {.m = m, .o = o, .nt = kvq_threads(o->nthreads)};
    kvq_status rc;
    int quantized = 0, blas_nt = openblas_get_num_threads();
    for (int i = 0; i < o->ns; i++) quantized |= o->s[i].item && o->s[i].item->spec;
    /* the rows the last layer and the head compute: from the first scored
     * position (or wanted logits) down to a multiple of TILE_ROWS; all of
     * them when a dump wants every layer's queries */
    int first = o->score_from > 0 ? o->score_from : 0;
    for (int i = 0; i < o->n_logit_pos; i++) first = o->logit_pos[i] < first ? o->logit_pos[i] : first;
    int all_queries = 0; /* a selector scores with every query of every layer */
    for (int i = 0; i < o->ns; i++)
        all_queries |= o->s[i].spec && (kvq_resolved_spec_flags(o->s[i].spec) & KVQ_READ_QUERY);
    c.h0 = o->on_layer || all_queries ? 0 : first / TILE_ROWS * TILE_ROWS;
    int kmax = in->dim > in->ffn_dim ? in->dim : in->ffn_dim;
    if (in->n_heads * in->head_dim > kmax) kmax = in->n_heads * in->head_dim;
    if (!(c.was_following = calloc((size_t)o->ns, 1)) || !(c.tile = calloc((size_t)c.nt, sizeof *c.tile)) ||
        !(c.ubuf = calloc((size_t)c.nt, sizeof *c.ubuf))) {
        free(c.was_following), free(c.tile);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < c.nt; i++)
        if (!(c.tile[i] = kvq_alloc_array((size_t)TILE_COLS * kmax, sizeof(float)))) {
            rc = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the weight tiles (%d × %d floats a thread)", TILE_COLS,
                          kmax);
            goto done;
        }
    int pressed = 0; /* a stream compresses while decoding */
    for (int i = 1; i < o->ns; i++)
        for (int l = 0; o->s[i].spec && l < in->n_layers; l++) pressed |= decoding_parts(&o->s[i], l) != NULL;
    c.rest.cap = rest_group_cap(in, T, o->ns);
    if ((rc = scratch_alloc(&c.s, in, T, c.rest.cap, quantized, pressed ? 2 : o->context > 0, c.nt, err))) goto done;
    openblas_set_num_threads(1); /* threads run fixed tiles, each one BLAS call */
    c.rows_free = kvq_blas_rows_independent();
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
    o->s[0].follows = 0;
    for (int i = 1; i < o->ns; i++) o->s[i].follows = 1; /* every configuration starts on the exact embeddings */
    if ((rc = embed(&c, err))) goto done;
    for (int l = 0; l < in->n_layers; l++) {
        if ((rc = load_layer(m, l, &c.w, err))) goto done;
        /* the last layer: only the rows the head reads (keys and values of all) */
        if ((rc = layer_all(&c, l, l == in->n_layers - 1 ? c.h0 : 0, err))) goto done;
        if (o->progress) o->progress(o->progress_ud, l + 1, in->n_layers);
    }
    rc = output_head(&c, err);
done:
    openblas_set_num_threads(blas_nt);
    free(c.w.buf);
    free(c.was_following);
    for (int i = 0; i < c.nt; i++) free(c.tile[i]), free(c.ubuf[i]);
    free(c.tile), free(c.ubuf);
    rest_free(&c);
    scratch_free(&c.s);
    kvq_rope_free(&c.rope);
    kvq_rope_free(&c.rope_swa);
    return rc;
}
