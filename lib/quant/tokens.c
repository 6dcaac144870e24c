/* tokens.c — token precision (docs/quantizers.md#tokens): `tokens(SELECT; HI; LO)`
 * keeps each KV head's most important tokens at HI and the others at LO,
 * exact (`none`) or not at all (`drop`).  Eviction (StreamingLLM, H2O,
 * SnapKV, TOVA, key-norm), importance-based mixed precision (MiKV,
 * ZipCache) and "more tokens, lower precision" are all this one form.
 *
 * SELECT scores every token of a KV head (its query heads pooled by their
 * mean), in double from the float values, with the layer's own attention
 * (scale, soft-cap, window), and keeps K = max(1, round(keep·T)) tokens,
 * the forced ones (sinks, recent, snapkv's window, tova's last token)
 * first, then the highest scores, ties to the later token.  Every head
 * keeps the same number of tokens, so HI runs once on the H heads' kept
 * tokens as a layer of K tokens (each head's own, in position order) and
 * LO on the others: per-head seeds and layer-wide groups keep their
 * meaning, and a spec re-applying RoPE finds each token's position in
 * ctx->pos.  Dropped tokens come back as zero rows and a 0 in out->keep. */
#include "../internal.h"
#include "quant.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ selectors */

#define SEL_KEEP                                                                                            \
    {.key = "keep", .type = KVQ_PARAM_REAL, .min = 0, .max = 1,                                           \
     .help = "share of each KV head's tokens kept: K = max(1, round(keep*T))", KVQ_OPT(kvq_token_sel_opts, keep)}
#define SEL_SINKS                                                                                           \
    {.key = "sinks", .type = KVQ_PARAM_INT, .def = "0", .min = 0, .max = 1e9,                             \
     .help = "the first tokens, always kept", KVQ_OPT(kvq_token_sel_opts, sinks)}
#define SEL_RECENT                                                                                          \
    {.key = "recent", .type = KVQ_PARAM_INT, .def = "0", .min = 0, .max = 1e9,                            \
     .help = "the last tokens, always kept", KVQ_OPT(kvq_token_sel_opts, recent)}

/* AdaKV and decode-time compression (SPEC §3.11, round 2): every selector has them */
#define SEL_ROUND2                                                                                          \
    {.key = "adaptive", .type = KVQ_PARAM_REAL, .min = 0, .max = 1,                                       \
     .help = "AdaKV: each head keeps its top floor(a*K), the layer's other places go to the best of all heads", \
     KVQ_OPT(kvq_token_sel_opts, adaptive)},                                                              \
    {.key = "target", .type = KVQ_PARAM_INT, .min = 1, .max = 1e9,                                        \
     .help = "while decoding (--policy decode): the tokens each head keeps at HI after a compression",   \
     KVQ_OPT(kvq_token_sel_opts, target)},                                                                \
    {.key = "interval", .type = KVQ_PARAM_INT, .min = 1, .max = 1e9,                                      \
     .help = "while decoding: compress every `interval` decoded tokens", KVQ_OPT(kvq_token_sel_opts, interval)}, \
    {.key = "buffer", .type = KVQ_PARAM_INT, .min = 0, .max = 1e9,                                        \
     .help = "while decoding: the last queries that score (default interval)", KVQ_OPT(kvq_token_sel_opts, buffer)}

static const kvq_param sel_params[] = {SEL_KEEP, SEL_SINKS, SEL_RECENT, SEL_ROUND2};
static const kvq_param snapkv_params[] = {
    SEL_KEEP, SEL_SINKS, SEL_RECENT, SEL_ROUND2,
    {.key = "obs", .type = KVQ_PARAM_INT, .def = "64", .min = 1, .max = 1e9,
     .help = "observation window: the last queries, whose tokens are always kept", KVQ_OPT(kvq_token_sel_opts, obs)},
    {.key = "pool", .type = KVQ_PARAM_INT, .def = "5", .min = 1, .max = 1001,
     .help = "width of the average pool along the tokens (odd)", KVQ_OPT(kvq_token_sel_opts, pool)},
};

/* target, interval and buffer go together: target=S,interval=I[,buffer=B]. */
static kvq_status decode_keys_check(const kvq_spec *sp, kvq_error *err)
{
    const kvq_token_sel_opts *o = kvq_spec_opts(sp);
    int target = o->target != KVQ_UNSET, interval = o->interval != KVQ_UNSET;
    if (target != interval)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s: expected target=S and interval=I together (compress to S tokens "
                        "every I decoded tokens)", sp->text, target ? "target without interval" : "interval without target");
    if (!target && o->buffer != KVQ_UNSET)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: buffer=%d: expected it with target=S,interval=I", sp->text, o->buffer);
    return KVQ_OK;
}

static kvq_status sel_check(const kvq_spec *sp, kvq_error *err)
{
    const kvq_token_sel_opts *o = kvq_spec_opts(sp);
    if (isnan(o->keep) && o->target == KVQ_UNSET)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s needs keep=SHARE (of each head's tokens, 0..1) or "
                        "target=S,interval=I (while decoding)", sp->text, sp->q->name);
    return decode_keys_check(sp, err);
}

static kvq_status snapkv_check(const kvq_spec *sp, kvq_error *err)
{
    const kvq_token_sel_opts *o = kvq_spec_opts(sp);
    if (o->pool % 2 == 0)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: pool=%d: expected an odd width (the pool is centred)", sp->text,
                        o->pool);
    return sel_check(sp, err);
}

static kvq_status window_check(const kvq_spec *sp, kvq_error *err)
{
    const kvq_token_sel_opts *o = kvq_spec_opts(sp);
    if (o->sinks == 0 && o->recent == 0 && o->target == KVQ_UNSET)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: window keeps the sinks and the recent tokens: give sinks=N or recent=N",
                        sp->text);
    return decode_keys_check(sp, err);
}

#define SELECTOR(ident, nm, desc, tab, chk)                                                               \
    static const kvq_quantizer ident = {.name = nm, .description = desc, .params = tab,                   \
                                        .nparams = sizeof tab / sizeof tab[0], .check = chk}
SELECTOR(sel_window, "window", "the first `sinks` and last `recent` tokens (StreamingLLM); keep is ignored",
         sel_params, window_check);
SELECTOR(sel_h2o, "h2o", "accumulated attention: the sum of A[t][u] over every query t >= u (H2O)", sel_params,
         sel_check);
SELECTOR(sel_zipcache, "zipcache", "the h2o sum over the T - u queries that see u (ZipCache, ObservedAttention)",
         sel_params, sel_check);
SELECTOR(sel_snapkv, "snapkv", "mean attention of the last `obs` queries, average-pooled (SnapKV)", snapkv_params,
         snapkv_check);
SELECTOR(sel_tova, "tova", "attention of the last query, averaged over all query heads (TOVA)", sel_params,
         sel_check);
SELECTOR(sel_knorm, "knorm", "lowest key norm first (KnormPress)", sel_params, sel_check);
static const kvq_quantizer sel_random = {.name = "random", .description = "the seeded generator",
                                         .params = sel_params, .nparams = sizeof sel_params / sizeof sel_params[0],
                                         .check = sel_check, .nstreams = 1, .stream_tag_kept = 0x7fffffff};
SELECTOR(sel_keydiff, "keydiff", "least like the head's mean normalised key first: -cos(k_u, anchor) (KeyDiff)",
         sel_params, sel_check);

/* In kvq_selector's order. */
static const kvq_quantizer *const selectors[] = {&sel_window, &sel_h2o,   &sel_zipcache, &sel_snapkv,
                                                 &sel_tova,   &sel_knorm, &sel_random,   &sel_keydiff};
enum { NSEL = sizeof selectors / sizeof selectors[0] };

size_t kvq_selector_count(void) { return NSEL; }
const kvq_quantizer *kvq_selector_at(size_t i) { return i < NSEL ? selectors[i] : NULL; }
int kvq_selector_needs_queries(size_t i) { return i < NSEL && kvq_token_selector_needs_queries((kvq_selector)i); }

const kvq_quantizer *kvq_token_selector_find(const char *name)
{
    for (int i = 0; i < NSEL; i++)
        if (!strcmp(selectors[i]->name, name)) return selectors[i];
    return NULL;
}

kvq_selector kvq_token_selector_kind(const kvq_quantizer *q)
{
    for (int i = 0; i < NSEL; i++)
        if (selectors[i] == q) return (kvq_selector)i;
    return KVQ_SEL_WINDOW;
}

int kvq_token_selector_needs_queries(kvq_selector s)
{
    return s == KVQ_SEL_H2O || s == KVQ_SEL_ZIPCACHE || s == KVQ_SEL_SNAPKV || s == KVQ_SEL_TOVA;
}

/* ------------------------------------------------------------- scoring */

/* The softmax of one query row in double, as the layer computes attention
 * (docs/metrics.md: divided by sqrt(D) unless prescaled; or scale, soft-cap
 * and window): a[lo..t] from the dot products s[0..t]; returns lo. */
static int softmax_row_double(double *s, int t, int D, const kvq_attn_mode *m)
{
    int lo = 0;
    int plain = kvq_attn_mode_plain(m, D);
    if (plain) {
        double div = sqrt((double)D);
        if (!m->prescaled)
            for (int u = 0; u <= t; u++) s[u] /= div;
    } else {
        if (m->window > 0 && t - m->window + 1 > 0) lo = t - m->window + 1;
        double scale = m->scale > 0 ? m->scale : 1.0 / sqrt((double)D);
        for (int u = lo; u <= t; u++) {
            double x = m->prescaled ? s[u] : scale * s[u];
            s[u] = m->softcap > 0 ? m->softcap * tanh(x / m->softcap) : x;
        }
    }
    double mx = s[lo], sum = 0;
    for (int u = lo + 1; u <= t; u++) mx = s[u] > mx ? s[u] : mx;
    for (int u = lo; u <= t; u++) sum += (s[u] = exp(s[u] - mx));
    for (int u = lo; u <= t; u++) s[u] /= sum;
    return lo;
}

enum { SCORE_ROWS = 64 };

/* col[u] += Σ_t A[t][u] over query rows t in [r0, T) and keys u < ncol of
 * one query head Q [T][D] against Kd [T][D] (double).  S by dgemm in
 * blocks of SCORE_ROWS rows (shapes fixed by T alone: the same sums for
 * any thread count).  work: SCORE_ROWS × (D + T) doubles. */
static void attention_columns(const float *Q, const double *Kd, int T, int D, int r0, int ncol,
                              const kvq_attn_mode *m, double *col, double *work)
{
    double *Qd = work, *S = work + (size_t)SCORE_ROWS * D;
    for (int a = r0; a < T; a += SCORE_ROWS) {
        int b = a + SCORE_ROWS < T ? a + SCORE_ROWS : T, nr = b - a;
        for (size_t i = 0; i < (size_t)nr * D; i++) Qd[i] = Q[(size_t)a * D + i];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, b, D, 1.0, Qd, D, Kd, D, 0.0, S, b);
        for (int t = a; t < b; t++) {
            double *s = S + (size_t)(t - a) * b;
            int lo = softmax_row_double(s, t, D, m);
            int hi = t < ncol - 1 ? t : ncol - 1;
            for (int u = lo; u <= hi; u++) col[u] += s[u];
        }
    }
}

/* Σ over u of pool-wide windows centred on u, zero-padded, divided by pool
 * (torch's avg_pool1d with padding pool/2, count_include_pad). */
static void avg_pool(const double *x, double *y, int n, int pool)
{
    int r = pool / 2;
    for (int u = 0; u < n; u++) {
        double s = 0;
        for (int v = u - r; v <= u + r; v++)
            if (v >= 0 && v < n) s += x[v];
        y[u] = s / pool;
    }
}

/* Ranking order: higher score first, ties to the later token. */
typedef struct {
    double s;
    int u;
} ranked;
static int rank_cmp(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->u > y->u ? -1 : x->u < y->u;
}

/* The tokens every head keeps whatever the scores: forced[u] = 1. */
static int forced_tokens(kvq_selector sel, const kvq_token_sel_opts *o, int T, unsigned char *forced)
{
    memset(forced, 0, (size_t)T);
    for (int u = 0; u < T && u < o->sinks; u++) forced[u] = 1;
    int last = o->recent;
    if (sel == KVQ_SEL_SNAPKV && o->obs > last) last = o->obs;
    if (sel == KVQ_SEL_TOVA && last < 1) last = 1;
    for (int u = T - last > 0 ? T - last : 0; u < T; u++) forced[u] = 1;
    int n = 0;
    for (int u = 0; u < T; u++) n += forced[u];
    return n;
}

/* K of SPEC §3.11: the number of tokens every head keeps (on average with
 * adaptive=α); `target` when compressing while decoding. */
static int kept_count(kvq_selector sel, const kvq_token_sel_opts *o, const kvq_select_at *at, int T, int nforced)
{
    if (sel == KVQ_SEL_WINDOW) return nforced;
    double k = at ? at->target : floor(o->keep * T + 0.5); /* round half away from zero */
    int K = k < 1 ? 1 : (int)k;
    return K > nforced ? K : nforced;
}

/* One token of a head among all heads' (adaptive budgets): higher score
 * first, ties to the lower head, then the lower token (SPEC §3.11). */
typedef struct {
    double s;
    int h, u;
} ranked_head;
static int rank_head_cmp(const void *a, const void *b)
{
    const ranked_head *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    if (x->h != y->h) return x->h < y->h ? -1 : 1;
    return x->u < y->u ? -1 : x->u > y->u;
}

/* keep [H][T] from the scores sc [H][T] (NaN: -inf): per head the forced
 * tokens then the best others up to `own` per head; with adaptive budgets
 * (own < K) the layer's remaining H·K − Σ kept places then go to the best
 * scores of all heads together.  rk: T + 1 entries. */
static kvq_status keep_best(const double *sc, const unsigned char *forced, int nforced, int H, int T, int K, int own,
                            ranked *rk, unsigned char *keep, kvq_error *err)
{
    long left = 0; /* places the heads leave for the layer-wide stage */
    for (int h = 0; h < H; h++) {
        unsigned char *k = keep + (size_t)h * T;
        const double *s = sc + (size_t)h * T;
        memcpy(k, forced, (size_t)T);
        int n = 0;
        for (int u = 0; u < T; u++)
            if (!forced[u]) rk[n++] = (ranked){isnan(s[u]) ? -INFINITY : s[u], u};
        qsort(rk, (size_t)n, sizeof *rk, rank_cmp);
        int take = own > nforced ? own - nforced : 0;
        for (int i = 0; i < take && i < n; i++) k[rk[i].u] = 1;
        left += K - (nforced > own ? nforced : own);
    }
    if (left <= 0) return KVQ_OK;
    ranked_head *all = kvq_alloc_array((size_t)H * T + 1, sizeof *all);
    if (!all) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the scores of %d heads", H);
    size_t n = 0;
    for (int h = 0; h < H; h++)
        for (int u = 0; u < T; u++)
            if (!keep[(size_t)h * T + u]) {
                double s = sc[(size_t)h * T + u];
                all[n++] = (ranked_head){isnan(s) ? -INFINITY : s, h, u};
            }
    qsort(all, n, sizeof *all, rank_head_cmp);
    for (size_t i = 0; i < n && (long)i < left; i++) keep[(size_t)all[i].h * T + all[i].u] = 1;
    free(all);
    return KVQ_OK;
}

kvq_status kvq_tokens_select(const kvq_tokens_parts *tp, const kvq_layer *in, const kvq_attn_mode *mode,
                             uint64_t seed, int layer, int nthreads, unsigned char *keep, double *score,
                             kvq_error *err)
{
    return kvq_tokens_select_at(tp, in, mode, seed, layer, nthreads, NULL, keep, score, err);
}

/* The scores of the selectors that read attention (h2o, zipcache, snapkv,
 * tova) into sc [H][T], from query rows [q0, T) (SPEC §3.11; 0: every row). */
static kvq_status attention_scores(kvq_selector sel, const kvq_token_sel_opts *o, const kvq_layer *in,
                                   const kvq_attn_mode *mode, int q0, int nthreads, double *sc, kvq_error *err)
{
    int H = in->H, Hq = in->Hq, T = in->T, D = in->D, G = H > 0 ? Hq / H : 1;
    /* the attention columns of every query head: col [Hq][T] */
    int r0 = sel == KVQ_SEL_SNAPKV ? (T - o->obs > 0 ? T - o->obs : 0) : sel == KVQ_SEL_TOVA ? T - 1 : q0;
    int ncol = sel == KVQ_SEL_SNAPKV ? T - o->obs : sel == KVQ_SEL_TOVA ? T - 1 : T;
    double *col = kvq_alloc_array((size_t)Hq * T + 1, sizeof *col);
    double *Kd = kvq_alloc_array((size_t)H * T * D + 1, sizeof *Kd);
    int nt = kvq_threads(nthreads), fail = !col || !Kd;
    for (size_t i = 0; !fail && i < (size_t)H * T * D; i++) Kd[i] = in->key[i];
    if (!fail) memset(col, 0, (size_t)Hq * T * sizeof *col);
    if (!fail && ncol > 0) {
#pragma omp parallel num_threads(nt)
        {
            double *work = kvq_alloc_array((size_t)SCORE_ROWS * (D + T), sizeof *work);
            if (!work) {
#pragma omp atomic write
                fail = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int j = 0; j < Hq; j++)
                if (work)
                    attention_columns(in->query + (size_t)j * T * D, Kd + (size_t)(j / G) * T * D, T, D, r0, ncol,
                                      mode, col + (size_t)j * T, work);
            free(work);
        }
    }
    if (fail) {
        free(col), free(Kd);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the attention of %d query heads", Hq);
    }
    double *pooled = Kd; /* reused: [T] per head */
    for (int h = 0; h < H; h++) {
        double *s = sc + (size_t)h * T;
        if (sel == KVQ_SEL_TOVA) { /* every query head of the layer, one ranking */
            for (int u = 0; u < ncol; u++) {
                double a = 0;
                for (int j = 0; j < Hq; j++) a += col[(size_t)j * T + u];
                s[u] = a / Hq;
            }
            continue;
        }
        for (int u = 0; u < ncol; u++) { /* the group's mean */
            double a = 0;
            for (int j = h * G; j < (h + 1) * G; j++) a += col[(size_t)j * T + u];
            s[u] = a / G;
        }
        if (sel == KVQ_SEL_ZIPCACHE) /* the queries of rows [q0, T) that see u */
            for (int u = 0; u < T; u++) s[u] /= (double)(T - (u > q0 ? u : q0));
        if (sel == KVQ_SEL_SNAPKV && ncol > 0) {
            int nobs = T - r0;
            for (int u = 0; u < ncol; u++) s[u] /= nobs;
            avg_pool(s, pooled, ncol, o->pool);
            memcpy(s, pooled, (size_t)ncol * sizeof *s);
        }
    }
    free(col), free(Kd);
    return KVQ_OK;
}

/* KeyDiff (kvpress's KeyDiffPress) into sc [H][T]: the anchor a = the mean of
 * the head's L2-normalised keys; score -cos(k_u, a), each norm at least 1e-12
 * (F.normalize) and 1e-8 (F.cosine_similarity) as torch has them; in double. */
static kvq_status keydiff_scores(const kvq_layer *in, double *sc, kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D;
    double *anchor = kvq_alloc_array((size_t)D + 1, sizeof *anchor);
    if (!anchor) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int h = 0; h < H; h++) {
        const float *kh = in->key + (size_t)h * T * D; /* [T][D] */
        for (int c = 0; c < D; c++) anchor[c] = 0;
        for (int u = 0; u < T; u++) {
            double n2 = 0;
            for (int c = 0; c < D; c++) n2 += (double)kh[(size_t)u * D + c] * kh[(size_t)u * D + c];
            double n = fmax(sqrt(n2), 1e-12);
            for (int c = 0; c < D; c++) anchor[c] += kh[(size_t)u * D + c] / n;
        }
        double an2 = 0;
        for (int c = 0; c < D; c++) anchor[c] /= T, an2 += anchor[c] * anchor[c];
        double an = fmax(sqrt(an2), 1e-8);
        for (int u = 0; u < T; u++) {
            double dot = 0, n2 = 0;
            for (int c = 0; c < D; c++) {
                double x = kh[(size_t)u * D + c];
                dot += x * anchor[c], n2 += x * x;
            }
            sc[(size_t)h * T + u] = -dot / (fmax(sqrt(n2), 1e-8) * an);
        }
    }
    free(anchor);
    return KVQ_OK;
}

/* The key-only selectors' scores into sc [H][T]: knorm, keydiff, random. */
static kvq_status key_scores(kvq_selector sel, const kvq_layer *in, uint64_t seed, int layer, double *sc,
                             kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D;
    if (sel == KVQ_SEL_KEYDIFF) return keydiff_scores(in, sc, err);
    if (sel == KVQ_SEL_KNORM) /* the lowest key norm first */
        for (int h = 0; h < H; h++)
            for (int u = 0; u < T; u++) {
                const float *k = in->key + ((size_t)h * T + u) * D;
                double n2 = 0;
                for (int c = 0; c < D; c++) n2 += (double)k[c] * k[c];
                sc[(size_t)h * T + u] = -sqrt(n2);
            }
    if (sel == KVQ_SEL_RANDOM)
        for (int h = 0; h < H; h++) {
            kvq_rng r;
            kvq_rng_init(&r, seed, (uint64_t)layer, (uint64_t)h, kvq_family_stream(&sel_random, 0));
            for (int u = 0; u < T; u++) sc[(size_t)h * T + u] = kvq_rng_uniform(&r);
        }
    return KVQ_OK;
}

kvq_status kvq_tokens_select_at(const kvq_tokens_parts *tp, const kvq_layer *in, const kvq_attn_mode *mode,
                                uint64_t seed, int layer, int nthreads, const kvq_select_at *at, unsigned char *keep,
                                double *score, kvq_error *err)
{
    int H = in->H, T = in->T;
    kvq_selector sel = tp->selector;
    kvq_token_sel_opts eff = *(const kvq_token_sel_opts *)kvq_spec_opts(&tp->sel), *o = &eff;
    int q0 = 0; /* the first query row that scores */
    if (at) { /* while decoding: the held tokens, scored by the last rows [qrow0, T) (SPEC §3.11) */
        q0 = at->qrow0 > 0 ? at->qrow0 : 0;
        if (sel == KVQ_SEL_SNAPKV) o->obs = T - q0; /* its observation window is those rows */
        if (sel == KVQ_SEL_WINDOW) o->recent = at->target - o->sinks > 0 ? at->target - o->sinks : 0;
    }
    kvq_attn_mode plain = {0};
    if (!mode) mode = &plain;
    int queries = kvq_token_selector_needs_queries(sel);
    if (queries && !in->query)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: the %s selector scores tokens by attention: expected the queries "
                        "(query datasets in the dump)", tp->sel.text, tp->sel.q->name);
    unsigned char *forced = malloc((size_t)T + 1);
    double *sc = kvq_alloc_array((size_t)H * T + 1, sizeof *sc);
    ranked *rk = kvq_alloc_array((size_t)T + 1, sizeof *rk);
    kvq_status st = KVQ_OK;
    if (!forced || !sc || !rk) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto done;
    }
    int nforced = forced_tokens(sel, o, T, forced), K = kept_count(sel, o, at, T, nforced);
    for (size_t i = 0; i < (size_t)H * T; i++) sc[i] = NAN;
    if (queries && K < T) st = attention_scores(sel, o, in, mode, q0, nthreads, sc, err);
    else if (sel == KVQ_SEL_KNORM || sel == KVQ_SEL_KEYDIFF || sel == KVQ_SEL_RANDOM)
        st = key_scores(sel, in, seed, layer, sc, err);
    /* per head: the forced tokens, then the best of the rest; with adaptive=α
     * each head first its top floor(α·K), then the best of all heads */
    int own = isnan(o->adaptive) ? K : (int)floor(o->adaptive * K);
    if (st || (st = keep_best(sc, forced, nforced, H, T, K, own, rk, keep, err))) goto done;
    if (score)
        for (int h = 0; h < H; h++)
            for (int u = 0; u < T; u++) score[(size_t)h * T + u] = forced[u] ? NAN : sc[(size_t)h * T + u];
done:
    free(forced), free(sc), free(rk);
    return st;
}

/* ------------------------------------------------------- HI and LO */

static const kvq_spec *part_spec(const kvq_tokens_parts *tp, int lo)
{
    return (lo ? tp->lo_kind : tp->hi_kind) == KVQ_PART_SPEC ? (lo ? &tp->lo : &tp->hi) : NULL;
}

/* Runs part `lo` (0: HI, 1: LO) on the tokens of every head where
 * keep[h][u] == !lo, as a layer of n tokens each; writes them back into
 * out at their positions and adds the part's bits and static bytes. */
static kvq_status run_part(const kvq_spec *spec, const kvq_tokens_parts *tp, int lo, const kvq_quant_ctx *ctx,
                           const kvq_layer *in, const unsigned char *keep, int n, kvq_quant_out *out,
                           kvq_error *err, kvq_layer_runner run)
{
    int H = in->H, T = in->T, D = in->D;
    kvq_token_part kind = lo ? tp->lo_kind : tp->hi_kind;
    if (n == 0) return KVQ_OK;
    if (kind == KVQ_PART_DROP) { /* zero rows, no bits */
        for (int h = 0; h < H; h++)
            for (int u = 0; u < T; u++)
                if (keep[(size_t)h * T + u] == !lo) {
                    memset(out->key + ((size_t)h * T + u) * D, 0, (size_t)D * sizeof(float));
                    memset(out->value + ((size_t)h * T + u) * D, 0, (size_t)D * sizeof(float));
                }
        return KVQ_OK;
    }
    if (kind == KVQ_PART_NONE) { /* exact: 16 bits */
        for (int h = 0; h < H; h++) {
            for (int u = 0; u < T; u++)
                if (keep[(size_t)h * T + u] == !lo) {
                    size_t off = ((size_t)h * T + u) * D;
                    memcpy(out->key + off, in->key + off, (size_t)D * sizeof(float));
                    memcpy(out->value + off, in->value + off, (size_t)D * sizeof(float));
                }
            out->k_bits[h] += 16.0 * n * D, out->v_bits[h] += 16.0 * n * D;
        }
        return KVQ_OK;
    }
    size_t per = (size_t)H * n * D;
    int pre = in->key_pre_rope != NULL;
    float *buf = kvq_alloc_array(per * (pre ? 5 : 4), sizeof *buf);
    int *pos = kvq_alloc_array((size_t)H * n, sizeof *pos);
    double *bits = calloc(3 * (size_t)H, sizeof *bits);
    if (!buf || !pos || !bits) {
        free(buf), free(pos), free(bits);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    float *kc = buf, *vc = buf + per, *ko = buf + 2 * per, *vo = buf + 3 * per, *pc = pre ? buf + 4 * per : NULL;
    for (int h = 0; h < H; h++) {
        int i = 0;
        for (int u = 0; u < T; u++) {
            if (keep[(size_t)h * T + u] != !lo) continue;
            size_t from = ((size_t)h * T + u) * D, to = ((size_t)h * n + i) * D;
            memcpy(kc + to, in->key + from, (size_t)D * sizeof(float));
            memcpy(vc + to, in->value + from, (size_t)D * sizeof(float));
            if (pc) memcpy(pc + to, in->key_pre_rope + from, (size_t)D * sizeof(float));
            pos[(size_t)h * n + i++] = u;
        }
    }
    kvq_layer L = {.H = H, .Hq = in->Hq, .T = n, .D = D, .key = kc, .value = vc, .key_pre_rope = pc};
    kvq_dump_info info = *ctx->info;
    info.seq_len = n;
    const kvq_tokens_calib *tc = ctx->calib;
    kvq_quant_ctx c = *ctx;
    c.info = &info, c.pos = pos, c.calib = tc ? tc->state[lo] : NULL;
    kvq_quant_out po = {.key = ko, .value = vo, .k_bits = bits, .v_bits = bits + H, .static_bytes = bits + 2 * H};
    kvq_error e = {0};
    kvq_status st = run(part_spec(tp, lo), &c, &L, &po, &e);
    if (st) {
        st = kvq_fail(err, st, "%s: %s", spec->text, e.msg);
    } else {
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < n; i++) {
                size_t from = ((size_t)h * n + i) * D, to = ((size_t)h * T + pos[(size_t)h * n + i]) * D;
                memcpy(out->key + to, ko + from, (size_t)D * sizeof(float));
                memcpy(out->value + to, vo + from, (size_t)D * sizeof(float));
            }
            out->k_bits[h] += bits[h], out->v_bits[h] += bits[H + h], out->static_bytes[h] += bits[2 * H + h];
        }
    }
    free(buf), free(pos), free(bits);
    return st;
}

/* HI on the whole layer, as HI itself runs (its fused error sums too). */
static kvq_status whole_layer(const kvq_spec *spec, const kvq_tokens_parts *tp, const kvq_quant_ctx *ctx,
                              const kvq_layer *in, kvq_quant_out *out, kvq_error *err, kvq_layer_runner run)
{
    int H = in->H;
    size_t per = (size_t)in->T * in->D;
    if (tp->hi_kind == KVQ_PART_NONE) {
        memcpy(out->key, in->key, (size_t)H * per * sizeof(float));
        memcpy(out->value, in->value, (size_t)H * per * sizeof(float));
        for (int h = 0; h < H; h++) out->k_bits[h] = out->v_bits[h] = 16.0 * per;
        return KVQ_OK;
    }
    const kvq_tokens_calib *tc = ctx->calib;
    kvq_quant_ctx c = *ctx;
    c.calib = tc ? tc->state[0] : NULL;
    kvq_error e = {0};
    kvq_status st = run(&tp->hi, &c, in, out, &e);
    return st ? kvq_fail(err, st, "%s: %s", spec->text, e.msg) : KVQ_OK;
}

/* Adaptive budgets give the heads different counts: each head's parts then
 * run as a one-head layer holding its tokens (SPEC §3.11's words), the
 * head's rows of out as that layer's output.  A calibrated part is refused
 * (its state covers the layer's heads together); a family drawing numbers
 * per head draws the one-head layer's (head 0's) stream. */
static kvq_status run_parts_per_head(const kvq_spec *spec, const kvq_tokens_parts *tp, const kvq_quant_ctx *ctx,
                                     const kvq_layer *in, const unsigned char *keep, const int *nkept,
                                     kvq_quant_out *out, kvq_error *err, kvq_layer_runner run)
{
    int H = in->H, T = in->T, D = in->D, G = H > 0 ? in->Hq / H : 1;
    const kvq_tokens_calib *tc = ctx->calib;
    if (tc && (tc->state[0] || tc->state[1]))
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: adaptive budgets run each head's tokens as a layer of their own: "
                        "a calibrated HI or LO is not supported with adaptive=", spec->text);
    kvq_dump_info info = *ctx->info;
    info.num_kv_heads = 1, info.num_heads = G;
    kvq_quant_ctx c = *ctx;
    c.info = &info;
    for (int h = 0; h < H; h++) {
        size_t at = (size_t)h * T * D;
        kvq_layer Lh = {.H = 1, .Hq = G, .T = T, .D = D, .key = in->key + at, .value = in->value + at,
                        .key_pre_rope = in->key_pre_rope ? in->key_pre_rope + at : NULL};
        kvq_quant_out oh = {.key = out->key + at, .value = out->value + at, .k_bits = out->k_bits + h,
                            .v_bits = out->v_bits + h, .static_bytes = out->static_bytes + h};
        kvq_status st;
        if ((st = run_part(spec, tp, 0, &c, &Lh, keep + (size_t)h * T, nkept[h], &oh, err, run)) ||
            (st = run_part(spec, tp, 1, &c, &Lh, keep + (size_t)h * T, T - nkept[h], &oh, err, run)))
            return st;
    }
    return KVQ_OK;
}

kvq_status kvq_tokens_quantize(const kvq_spec *spec, const kvq_tokens_parts *tp, const kvq_quant_ctx *ctx,
                               const kvq_layer *in, kvq_quant_out *out, kvq_error *err, kvq_layer_runner run)
{
    int H = in->H, T = in->T;
    const kvq_token_sel_opts *o = kvq_spec_opts(&tp->sel);
    if (o->target != KVQ_UNSET && (!ctx->decoding || isnan(o->keep)))
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: target=%d compresses while decoding: expected kvq-eval --policy decode "
                        "or kvq.DecodeCache (keep=SHARE compresses a whole cache)", spec->text, o->target);
    unsigned char *keep = kvq_alloc_array((size_t)H * T + 1, 1);
    int *nkept = kvq_alloc_array((size_t)H + 1, sizeof *nkept);
    kvq_status st = KVQ_OK;
    if (!keep || !nkept) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((st = kvq_tokens_select(tp, in, ctx->attn, ctx->seed, ctx->layer, ctx->nthreads, keep, NULL, err))) {
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        st = kvq_fail(err, st, "%s: %s", spec->text, msg);
        goto done;
    }
    int ragged = 0, all = 1, drops = 0; /* heads keep different counts; every token kept; some dropped */
    for (int h = 0; h < H; h++) {
        nkept[h] = 0;
        for (int u = 0; u < T; u++) nkept[h] += keep[(size_t)h * T + u];
        ragged |= nkept[h] != nkept[0], all &= nkept[h] == T;
        drops |= tp->lo_kind == KVQ_PART_DROP && nkept[h] < T;
    }
    if (drops && !out->keep) {
        st = kvq_fail(err, KVQ_ERR_USAGE, "%s: drops tokens, which this caller cannot represent (no keep mask)",
                      spec->text);
        goto done;
    }
    for (int h = 0; h < H; h++) out->k_bits[h] = out->v_bits[h] = 0;
    if (all) { /* everything kept: HI is the spec of the whole layer, no mask */
        if ((st = whole_layer(spec, tp, ctx, in, out, err, run))) goto done;
        if (out->keep) memset(out->keep, 1, (size_t)H * T);
        out->dropped = 0;
        goto done;
    }
    if (ragged) {
        if ((st = run_parts_per_head(spec, tp, ctx, in, keep, nkept, out, err, run))) goto done;
    } else if ((st = run_part(spec, tp, 0, ctx, in, keep, nkept[0], out, err, run)) ||
               (st = run_part(spec, tp, 1, ctx, in, keep, T - nkept[0], out, err, run))) {
        goto done;
    }
    /* where the tokens are: a mask bit per token when both parts are stored,
     * a 32-bit position per kept token when LO is dropped (each head its
     * own count); shared by K and V */
    for (int h = 0; h < H; h++) {
        double where = tp->lo_kind == KVQ_PART_DROP ? 32.0 * nkept[h] : (double)T;
        out->k_bits[h] += where / 2, out->v_bits[h] += where / 2;
    }
    if (out->keep) memcpy(out->keep, keep, (size_t)H * T);
    out->dropped = drops;
done:
    free(keep), free(nkept);
    return st;
}
