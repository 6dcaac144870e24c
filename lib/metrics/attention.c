/* attention.c — attention metrics of one KV head (docs/metrics.md): scores S = QKᵀ/√D
 * over causal rows (or as the model computes them, docs/dump-format.md: its attn_scale,
 * attn_softcap and sliding window), stable softmax A, outputs O = A·V,
 * compared between the exact K/V and each quantizer's K'/V'.
 *
 * kvq_attention_head: the score and output products go through cblas_sgemm
 * in chunks of query rows (memory bounded by chunk × T), and the exact side
 * is computed once per chunk for all quantizers.
 * kvq_attn_ref: the exact side of a head kept in memory (same chunks), so
 * that sweeps compare any number of later quantizers against it.
 * kvq_attention_head_ref: the definition, with plain loops, used by tests. */
#include "../internal.h"
#include "../simd.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

/* Per-row summary of a softmax over the causal prefix. */
typedef struct {
    float m;     /* max score */
    double lse;  /* log Σ exp(s − m) */
    int argmax;  /* first index of the max */
} row_stats;

/* Scales the causal prefix s[0..p] (division by `scale`, skipped when
 * prescaled), writes a[0..p] = softmax, a[p+1..ncol) = 0, and returns the
 * row stats.  The reference; softmax_row is the one the metrics use. */
static row_stats softmax_row_ref(float *s, float *a, int p, int ncol, float scale, int prescaled)
{
    row_stats r;
    if (!prescaled)
        for (int u = 0; u <= p; u++) s[u] = s[u] / scale;
    float m = s[0];
    int am = 0;
    for (int u = 1; u <= p; u++)
        if (s[u] > m) m = s[u], am = u;
    double sum = 0.0;
    for (int u = 0; u <= p; u++) {
        a[u] = expf(s[u] - m);
        sum += a[u];
    }
    float fsum = (float)sum;
    for (int u = 0; u <= p; u++) a[u] = a[u] / fsum;
    for (int u = p + 1; u < ncol; u++) a[u] = 0.0f;
    r.m = m;
    r.lse = log(sum);
    r.argmax = am;
    return r;
}

/* The same with AVX-512 or AVX2 + FMA where the CPU has it: vector exp
 * within 2 ulp of expf, the other operations as the reference (tests
 * compare them). */
static row_stats softmax_row(float *s, float *a, int p, int ncol, float scale, int prescaled)
{
    row_stats r;
    double sum;
    if (kvq_simd_active())
        kvq_softmax_avx512(s, a, (size_t)p + 1, (size_t)ncol, scale, prescaled, &r.m, &sum, &r.argmax);
    else if (kvq_simd_avx2_active())
        kvq_softmax_avx2(s, a, (size_t)p + 1, (size_t)ncol, scale, prescaled, &r.m, &sum, &r.argmax);
    else
        return softmax_row_ref(s, a, p, ncol, scale, prescaled);
    r.lse = log(sum);
    return r;
}

/* --------------------------------------------------------------- modes */

/* How a row's scores become attention (kvq_attn_mode, docs/dump-format.md): plain (the
 * reference order: divide by sqrt(D), skipped when prescaled; SIMD paths)
 * or general (multiply by scale unless prescaled, soft-cap, window). */
typedef struct att_mode {
    int plain, prescaled, window;
    float div;        /* plain: sqrt(D) */
    float scale, cap; /* general */
} att_mode;

int kvq_attn_mode_plain(const kvq_attn_mode *m, int D)
{
    double plain = 1.0 / sqrt((double)D);
    return m->window <= 0 && !(m->softcap > 0) && (!(m->scale > 0) || fabs(m->scale - plain) <= 1e-6 * plain);
}

static att_mode make_mode(kvq_attn_mode m, int D)
{
    att_mode a = {.plain = kvq_attn_mode_plain(&m, D), .prescaled = m.prescaled, .window = m.window > 0 ? m.window : 0,
                  .div = sqrtf((float)D), .cap = m.softcap > 0 ? m.softcap : 0.0f};
    a.scale = m.scale > 0 ? m.scale : 1.0f / sqrtf((float)D);
    return a;
}

/* The first key row p attends to (p − W < k <= p). */
static int row_lo(const att_mode *m, int p) { return m->window > 0 && p - m->window + 1 > 0 ? p - m->window + 1 : 0; }

/* General mode: the scores s[lo..p] scaled (unless prescaled) and soft-capped, in place. */
static void transform_row(float *s, int lo, int p, const att_mode *m)
{
    for (int u = lo; u <= p; u++) {
        float x = m->prescaled ? s[u] : m->scale * s[u];
        s[u] = m->cap > 0 ? m->cap * tanhf(x / m->cap) : x;
    }
}

/* A row's softmax in its mode: the attended keys [*lo, p] (a = 0 elsewhere),
 * argmax as a key index.  ref: the plain-loop reference softmax. */
static row_stats mode_row(float *s, float *a, int p, int ncol, const att_mode *m, int ref, int *lo)
{
    if (m->plain) {
        *lo = 0;
        return ref ? softmax_row_ref(s, a, p, ncol, m->div, m->prescaled)
                   : softmax_row(s, a, p, ncol, m->div, m->prescaled);
    }
    int l = *lo = row_lo(m, p);
    transform_row(s, l, p, m);
    row_stats r = ref ? softmax_row_ref(s + l, a + l, p - l, ncol - l, 1.0f, 1)
                      : softmax_row(s + l, a + l, p - l, ncol - l, 1.0f, 1);
    r.argmax += l;
    memset(a, 0, (size_t)l * sizeof *a);
    return r;
}

/* Σ (x − y)² over n elements, and Σ x² if sx2 != NULL. */
static double sq_diff(const float *x, const float *y, size_t n, double *sx2)
{
    double d = 0, s = 0;
#pragma omp simd reduction(+ : d, s)
    for (size_t i = 0; i < n; i++) {
        double e = (double)x[i] - (double)y[i];
        d += e * e;
        s += (double)x[i] * x[i];
    }
    if (sx2) *sx2 += s;
    return d;
}

/* KL(A‖A') of one row from the log-softmax of both score rows. */
static double kl_row(const float *a, const float *s, row_stats rs, const float *sq, row_stats rq,
                     int p)
{
    double kl = 0;
    for (int u = 0; u <= p; u++) {
        if (a[u] == 0.0f) continue;
        double la = ((double)s[u] - rs.m) - rs.lse;
        double lq = ((double)sq[u] - rq.m) - rq.lse;
        kl += (double)a[u] * (la - lq);
    }
    return kl;
}

/* One row of a quantizer whose cache dropped tokens (keep[u] = 0: the key is
 * absent, SPEC §3.11): sq[0..p] its raw scores (q·k', 0 where dropped),
 * turned in place into the row's scaled scores; aq[0..ncol) its softmax
 * over the kept keys alone (0 elsewhere; all 0 when the row keeps none).
 * Adds the score and attention differences over the attended keys, KL(Â‖A')
 * with Â the exact A restricted to the kept keys and renormalised, and the
 * kept share Σ_kept A to ac; returns A''s row stats (argmax −1: none kept).
 * s, a, rs: the exact row as mode_row left it.  Plain C, the reference and
 * the fast path alike. */
static row_stats masked_row(const float *s, const float *a, row_stats rs, float *sq, float *aq, int p, int ncol,
                            const att_mode *m, const unsigned char *keep, kvq_attn_acc *ac)
{
    int lo = m->plain ? 0 : row_lo(m, p);
    if (m->plain) {
        if (!m->prescaled)
            for (int u = 0; u <= p; u++) sq[u] = sq[u] / m->div;
    } else {
        transform_row(sq, lo, p, m);
    }
    row_stats rq = {.m = 0.0f, .lse = 0.0, .argmax = -1};
    for (int u = lo; u <= p; u++)
        if (keep[u] && (rq.argmax < 0 || sq[u] > rq.m)) rq.m = sq[u], rq.argmax = u;
    double sum = 0.0;
    for (int u = 0; u < ncol; u++) aq[u] = 0.0f;
    if (rq.argmax >= 0) {
        for (int u = lo; u <= p; u++)
            if (keep[u]) sum += aq[u] = expf(sq[u] - rq.m);
        float fsum = (float)sum;
        for (int u = lo; u <= p; u++) aq[u] = aq[u] / fsum;
        rq.lse = log(sum);
    }
    double mass = 0.0, hat = 0.0;
    float mk = 0.0f; /* the largest exact score among the kept keys: Â's offset, as A''s */
    for (int u = lo, first = 1; u <= p; u++)
        if (keep[u] && (first || s[u] > mk)) mk = s[u], first = 0;
    for (int u = lo; u <= p; u++) {
        ac->s_diff2 += ((double)s[u] - sq[u]) * ((double)s[u] - sq[u]);
        ac->a_diff2 += ((double)a[u] - aq[u]) * ((double)a[u] - aq[u]);
        if (keep[u]) mass += a[u], hat += expf(s[u] - mk);
    }
    if (rq.argmax >= 0) { /* KL(Â‖A') over the kept keys, from the log-softmax of both */
        double lse_hat = log(hat), kl = 0.0;
        for (int u = lo; u <= p; u++) {
            if (!keep[u]) continue;
            double la = ((double)s[u] - mk) - lse_hat, lq = ((double)sq[u] - rq.m) - rq.lse;
            kl += exp(la) * (la - lq);
        }
        ac->kl_sum += kl;
    }
    ac->mass_sum += mass;
    return rq;
}

/* Rows per chunk: keep each score matrix near 1 M floats.  The cached and
 * the streamed paths use the same chunks, so their sums are identical. */
static size_t chunk_rows(int T, size_t npos)
{
    size_t chunk = ((size_t)1 << 20) / (size_t)T;
    if (chunk < 1) chunk = 1;
    return chunk > npos ? npos : chunk;
}

/* The G query heads of a KV head share their K, V and each K′, V′: when
 * every head's rows fit one chunk (the default last:64 does), each product
 * runs once for all G heads (M = G × rows), so OpenBLAS packs K, V, K′ and
 * V′ once instead of G times; the heads' arrays lie one after the other.
 * Every row's product and every sum is taken in the same order as head by
 * head, so the results are the same bit for bit.  At most GROUP_FLOATS of
 * scores a matrix, else head by head. */
enum { GROUP_FLOATS = 1 << 22, KVQ_MAX_GROUP = 64 };
static int group_heads(int G, int T, size_t npos)
{
    size_t chunk = chunk_rows(T, npos);
    return G > 1 && G <= KVQ_MAX_GROUP && npos <= chunk && (size_t)G * npos * (size_t)T <= GROUP_FLOATS ? G : 1;
}

/* The exact side of one chunk of query rows of one query head. */
typedef struct {
    int nc, ncol;      /* rows, columns (keys 0..ncol-1 seen by the last row) */
    const int *p;      /* positions of the rows */
    float *Qc;         /* [nc][D] query rows */
    float *S, *A;      /* [nc][ncol] scores (scaled), softmax */
    float *O;          /* [nc][D] A·V */
    row_stats *rs;     /* [nc] */
    double s_ref2, a_ref2, o_ref2;
} ref_chunk;

/* Fills Qc, S, A, O, rs and the norms of g consecutive chunks c[0..g) (the
 * same rows of g query heads, their arrays one after the other) from the
 * heads' query rows Qrows[j] at stride qstride floats. */
static void ref_chunk_compute(ref_chunk *c, int g, const float *Qrows, size_t qstride, const float *K, const float *V,
                              int D, const att_mode *m)
{
    int nc = c->nc, ncol = c->ncol;
    for (int j = 0; j < g; j++) memcpy(c[j].Qc, Qrows + (size_t)j * qstride, (size_t)nc * D * sizeof(float));
    /* S = Qc·Kᵀ, A = softmax, O = A·V: one product for the g heads */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g * nc, ncol, D, 1.0f, c->Qc, D, K, D, 0.0f, c->S, ncol);
    for (int j = 0; j < g; j++) {
        double s2 = 0, a2 = 0;
        for (int i = 0; i < nc; i++) {
            float *srow = c[j].S + (size_t)i * ncol, *arow = c[j].A + (size_t)i * ncol;
            int lo;
            c[j].rs[i] = mode_row(srow, arow, c->p[i], ncol, m, 0, &lo);
#pragma omp simd reduction(+ : s2, a2)
            for (int u = lo; u <= c->p[i]; u++) {
                s2 += (double)srow[u] * srow[u];
                a2 += (double)arow[u] * arow[u];
            }
        }
        c[j].s_ref2 = s2, c[j].a_ref2 = a2;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g * nc, D, ncol, 1.0f, c->A, ncol, V, D, 0.0f, c->O, D);
    for (int j = 0; j < g; j++) {
        double o2 = 0;
        for (size_t i = 0; i < (size_t)nc * D; i++) o2 += (double)c[j].O[i] * c[j].O[i];
        c[j].o_ref2 = o2;
    }
}

/* What one row of a quantizer's comparison adds to its sums, kept so that
 * a next quantizer with the same K' adds the same (ref_chunk_compare). */
typedef struct {
    double s_diff2, a_diff2, kl, top1;
} row_incr;

/* Per-quantizer workspace: chunk rows × T scores and softmax, × D outputs. */
typedef struct {
    float *Sq, *Aq, *Ov, *Oj;
    row_stats *rq;
    row_incr *inc;
    struct kvq_attn_ws *own; /* the thread's workspace these lie in */
} quant_ws;

/* A thread's workspace, kept from head to head by a caller that has many
 * (kvq-analyze's driver: fresh pages each head cost a page fault apiece, 7 %
 * of its cycles on a 2-core VM): one block of floats and one of row stats,
 * grown to the largest need and never shrunk. */
struct kvq_attn_ws {
    float *f;
    row_stats *rs;
    row_incr *inc; /* [nrs] */
    size_t nf, nrs;
    float *zero; /* [zero, zero + nzero) of f holds zeros: a quantizer's scores, each row cleared after use */
    size_t nzero;
    /* 1 when the last kvq_attention_rows_ws took one chunk of rows for all
     * its query heads: its exact side is still at the start of f and rs,
     * with the chunks' norms here (kvq_attention_rows_ws_more) */
    int kept;
    double norm[KVQ_MAX_GROUP][3];
};

kvq_attn_ws *kvq_attn_ws_new(void) { return calloc(1, sizeof(kvq_attn_ws)); }

void kvq_attn_ws_free(kvq_attn_ws *w)
{
    if (!w) return;
    free(w->f), free(w->rs), free(w->inc), free(w);
}

/* At least nf floats and nrs row stats in w. */
static kvq_status ws_reserve(kvq_attn_ws *w, size_t nf, size_t nrs, kvq_error *err)
{
    if (nf > w->nf || nrs > w->nrs) w->kept = 0;
    if (nf > w->nf) {
        free(w->f), w->nf = 0, w->zero = NULL, w->nzero = 0;
        if (!(w->f = kvq_alloc_array(nf, sizeof(float)))) goto nomem;
        w->nf = nf;
    }
    if (nrs > w->nrs) {
        free(w->rs), free(w->inc), w->nrs = 0, w->inc = NULL;
        if (!(w->rs = kvq_alloc_array(nrs, sizeof *w->rs)) || !(w->inc = kvq_alloc_array(nrs, sizeof *w->inc)))
            goto nomem;
        w->nrs = nrs;
    }
    return KVQ_OK;
nomem:
    return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for attention workspace (%zu floats)", nf);
}

/* The quantizers' workspace for rows × T scores from w's floats at f and row stats at rs. */
static void quant_ws_at(quant_ws *q, kvq_attn_ws *own, float *f, row_stats *rs, size_t rows, int T, int D)
{
    q->Sq = f, q->Aq = f + rows * T, q->Ov = f + 2 * rows * T, q->Oj = f + 2 * rows * T + rows * D, q->rq = rs;
    q->inc = own->inc + (rs - own->rs), q->own = own;
}

/* n zeros at w->Sq for a product that adds onto them (beta 1): OpenBLAS
 * clears C in a pass of its own before a product with beta 0, over
 * scores that have long left the cache; the rows the comparison clears
 * while they are still in it (compare_row) leave the block zero instead,
 * and only what was never cleared is cleared here. */
static void scores_zeroed(quant_ws *w, size_t n)
{
    kvq_attn_ws *o = w->own;
    if (o->zero != w->Sq) o->zero = w->Sq, o->nzero = 0;
    if (o->nzero < n) memset(w->Sq + o->nzero, 0, (n - o->nzero) * sizeof *w->Sq), o->nzero = n;
}

/* One row of a quantizer's attention against the exact row (c's row i; its
 * scores in sqrow, softmax into aqrow): the score, softmax and KL sums and
 * the top-1 count into ac, and, unless keys were dropped, what the row added
 * into *inc.  Each sum takes one addition a row (0 + x = x: the same bits as
 * adding into ac directly), except a dropped-keys row's. */
static void compare_row(const ref_chunk *c, int i, const att_mode *m, const unsigned char *keep, float *sqrow,
                        float *aqrow, row_stats *rq, kvq_softmax_compare_fn *fused, kvq_attn_acc *ac, row_incr *inc)
{
    int ncol = c->ncol, p = c->p[i], lo = m->plain ? 0 : row_lo(m, p);
    const float *srow = c->S + (size_t)i * ncol, *arow = c->A + (size_t)i * ncol;
    row_incr r = {0};
    if (keep) { /* dropped keys: plain C */
        *rq = masked_row(srow, arow, c->rs[i], sqrow, aqrow, p, ncol, m, keep, ac);
    } else if (fused) { /* softmax and sums, its last pass fused; a general row is transformed first */
        double sum;
        if (!m->plain) transform_row(sqrow, lo, p, m), memset(aqrow, 0, (size_t)lo * sizeof *aqrow);
        fused(srow + lo, arow + lo, sqrow + lo, aqrow + lo, (size_t)(p - lo) + 1, (size_t)(ncol - lo),
              m->plain ? m->div : 1.0f, m->plain ? m->prescaled : 1, c->rs[i].m, c->rs[i].lse, &rq->m, &sum,
              &rq->argmax, &r.s_diff2, &r.a_diff2, &r.kl);
        rq->lse = log(sum);
        rq->argmax += lo;
    } else {
        *rq = mode_row(sqrow, aqrow, p, ncol, m, 0, &lo);
        r.s_diff2 = sq_diff(srow + lo, sqrow + lo, (size_t)(p - lo) + 1, NULL);
        r.a_diff2 = sq_diff(arow + lo, aqrow + lo, (size_t)(p - lo) + 1, NULL);
        r.kl = kl_row(arow, srow, c->rs[i], sqrow, *rq, p);
    }
    r.top1 = c->rs[i].argmax == rq->argmax;
    if (!keep) ac->s_diff2 += r.s_diff2, ac->a_diff2 += r.a_diff2, ac->kl_sum += r.kl, *inc = r;
    ac->top1_same += r.top1;
    memset(sqrow, 0, (size_t)ncol * sizeof *sqrow); /* zeros for the next product (scores_zeroed) */
}

/* Whether quantizer q's scores are those of q − 1: the same keys K' over the
 * chunk's columns and neither drops any (KIVI's keys are per-channel's). */
static int same_scores(int q, int ncol, int D, const float *const *Kq, const unsigned char *const *Mq)
{
    return q > 0 && !(Mq && (Mq[q] || Mq[q - 1])) &&
           (Kq[q] == Kq[q - 1] || !memcmp(Kq[q], Kq[q - 1], (size_t)ncol * D * sizeof(float)));
}

/* Compares g consecutive exact chunks (the same rows of g query heads, their
 * arrays one after the other) with each quantizer's K'/V' [T][D]: each
 * product once for the g heads, the sums head by head as for one head.  A
 * quantizer whose K' is the one before's keeps that one's A' (still in w)
 * and adds its rows' sums again, in the same order: the same bits without
 * the score product and the softmax. */
static void ref_chunk_compare(const ref_chunk *c, int g, int D, const att_mode *m, int nquant,
                              const float *const *Kq, const float *const *Vq, const unsigned char *const *Mq,
                              kvq_attn_acc *acc, quant_ws *w)
{
    int nc = c->nc, ncol = c->ncol;
    size_t hs = (size_t)nc * ncol, ho = (size_t)nc * D; /* one head's scores, outputs */
    kvq_softmax_compare_fn *fused = kvq_simd_active()        ? kvq_softmax_compare_avx512
                                    : kvq_simd_avx2_active() ? kvq_softmax_compare_avx2
                                                             : NULL; /* the reference */
    for (int q = 0; q < nquant; q++) {
        kvq_attn_acc *ac = &acc[q];
        const unsigned char *keep = Mq ? Mq[q] : NULL;
        size_t nrows = (size_t)g * nc;
        if (same_scores(q, ncol, D, Kq, Mq)) {
            for (size_t r = 0; r < nrows; r++) {
                const row_incr *in = &w->inc[r];
                ac->s_diff2 += in->s_diff2, ac->a_diff2 += in->a_diff2, ac->kl_sum += in->kl;
                ac->top1_same += in->top1;
            }
        } else {
            scores_zeroed(w, nrows * ncol);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g * nc, ncol, D, 1.0f, c->Qc, D, Kq[q], D, 1.0f, w->Sq,
                        ncol);
            for (int j = 0; j < g; j++)
                for (int i = 0; i < nc; i++) {
                    size_t r = (size_t)j * nc + i;
                    compare_row(&c[j], i, m, keep, w->Sq + j * hs + (size_t)i * ncol, w->Aq + j * hs + (size_t)i * ncol,
                                &w->rq[r], fused, ac, &w->inc[r]);
                }
        }
        /* A·V' (exact attention, quantized values) and A'·V' (both) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g * nc, D, ncol, 1.0f, c->A, ncol, Vq[q], D, 0.0f, w->Ov,
                    D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g * nc, D, ncol, 1.0f, w->Aq, ncol, Vq[q], D, 0.0f,
                    w->Oj, D);
        for (int j = 0; j < g; j++) {
            if (!keep) ac->mass_sum += nc; /* every key kept: the whole attention */
            ac->o_diff2 += sq_diff(c[j].O, w->Ov + j * ho, ho, NULL);
            ac->o_joint_diff2 += sq_diff(c[j].O, w->Oj + j * ho, ho, NULL);
            ac->s_ref2 += c[j].s_ref2;
            ac->a_ref2 += c[j].a_ref2;
            ac->o_ref2 += c[j].o_ref2;
            ac->rows += nc;
        }
    }
}

/* The query rows at pos of G query heads [G][T][D], as [G][npos][D] (NULL: out of memory). */
static float *gather_rows(const float *Q, int G, int T, int D, const int *pos, size_t npos)
{
    float *r = kvq_alloc_array((size_t)G * (npos ? npos : 1) * D, sizeof *r);
    if (!r) return NULL;
    for (int j = 0; j < G; j++)
        for (size_t i = 0; i < npos; i++)
            memcpy(r + ((size_t)j * npos + i) * D, Q + ((size_t)j * T + pos[i]) * D, (size_t)D * sizeof *r);
    return r;
}

kvq_status kvq_attention_head(const float *Q, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err)
{
    float *rows = gather_rows(Q, G, T, D, pos, npos);
    if (!rows) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu query rows", npos);
    kvq_status st = kvq_attention_rows(rows, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, acc, err);
    free(rows);
    return st;
}

kvq_status kvq_attention_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err)
{
    return kvq_attention_rows_masked(Qrows, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, NULL, acc, err);
}

kvq_status kvq_attention_rows_masked(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                     kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                     const float *const *Kq, const float *const *Vq,
                                     const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_error *err)
{
    kvq_attn_ws *ws = kvq_attn_ws_new();
    if (!ws) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = kvq_attention_rows_ws(Qrows, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, Mq, acc, ws, err);
    kvq_attn_ws_free(ws);
    return st;
}

/* kvq_attention_rows_ws, the exact side taken from ws (more: where the last
 * call kept it) or computed. */
static kvq_status attention_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, int nquant, const float *const *Kq,
                                 const float *const *Vq, const unsigned char *const *Mq, kvq_attn_acc *acc,
                                 kvq_attn_ws *ws, int more, kvq_error *err)
{
    if (npos == 0) return KVQ_OK;
    const att_mode m = make_mode(mode, D);
    size_t chunk = chunk_rows(T, npos);
    int g = group_heads(G, T, npos); /* heads per product */
    size_t rows = (size_t)g * chunk, half = rows * (2 * (size_t)T + 2 * (size_t)D);
    ref_chunk c[KVQ_MAX_GROUP];
    quant_ws w;
    kvq_status st = g <= KVQ_MAX_GROUP ? ws_reserve(ws, 2 * half, 2 * rows, err)
                                       : kvq_fail(err, KVQ_ERR_USAGE, "%d query heads a KV head: at most %d", g,
                                                  KVQ_MAX_GROUP);
    if (st) return st;
    int one = g == G && npos <= chunk; /* one chunk for all the heads: the exact side can stay in ws */
    more = more && one && ws->kept;
    ws->kept = 0;
    float *Qc = ws->f, *S = Qc + rows * D, *A = S + rows * T, *O = A + rows * T; /* the exact side, then w */
    row_stats *rs = ws->rs;
    quant_ws_at(&w, ws, ws->f + half, ws->rs + rows, rows, T, D);
    for (int j0 = 0; j0 < G; j0 += g)
        for (size_t r0 = 0; r0 < npos; r0 += chunk) {
            int nc = (int)(npos - r0 < chunk ? npos - r0 : chunk), ncol = pos[r0 + nc - 1] + 1; /* positions ascend */
            for (int j = 0; j < g; j++)
                c[j] = (ref_chunk){.nc = nc, .ncol = ncol, .p = pos + r0, .Qc = Qc + (size_t)j * nc * D,
                                   .S = S + (size_t)j * nc * ncol, .A = A + (size_t)j * nc * ncol,
                                   .O = O + (size_t)j * nc * D, .rs = rs + (size_t)j * nc};
            if (more) {
                for (int j = 0; j < g; j++)
                    c[j].s_ref2 = ws->norm[j][0], c[j].a_ref2 = ws->norm[j][1], c[j].o_ref2 = ws->norm[j][2];
            } else {
                ref_chunk_compute(c, g, Qrows + ((size_t)j0 * npos + r0) * D, npos * D, K, V, D, &m);
                for (int j = 0; j < g; j++)
                    ws->norm[j][0] = c[j].s_ref2, ws->norm[j][1] = c[j].a_ref2, ws->norm[j][2] = c[j].o_ref2;
            }
            ref_chunk_compare(c, g, D, &m, nquant, Kq, Vq, Mq, acc, &w);
        }
    ws->kept = one;
    return KVQ_OK;
}

kvq_status kvq_attention_rows_ws(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, int nquant, const float *const *Kq,
                                 const float *const *Vq, const unsigned char *const *Mq, kvq_attn_acc *acc,
                                 kvq_attn_ws *ws, kvq_error *err)
{
    return attention_rows(Qrows, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, Mq, acc, ws, 0, err);
}

kvq_status kvq_attention_rows_ws_more(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                      kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                      const float *const *Kq, const float *const *Vq, const unsigned char *const *Mq,
                                      kvq_attn_acc *acc, kvq_attn_ws *ws, kvq_error *err)
{
    return attention_rows(Qrows, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, Mq, acc, ws, 1, err);
}

/* ------------------------------------------------- cached exact attention */

struct kvq_attn_ref {
    int G, T, D, g; /* g: heads per product (group_heads) */
    att_mode mode;
    size_t npos, chunk, nchunk; /* chunks per query head */
    int *pos;                   /* [npos] */
    ref_chunk *c;               /* [G][nchunk] */
    float *mem;                 /* one block holding every chunk's arrays */
    row_stats *rs;              /* [G][npos] */
};

/* Floats of one head's cache: per query head, Qc and O (npos × D) and S, A
 * (Σ rows × columns over chunks). */
static size_t ref_floats(int G, int T, int D, const int *pos, size_t npos)
{
    size_t chunk = chunk_rows(T, npos), per = 2 * npos * (size_t)D;
    for (size_t r0 = 0; r0 < npos; r0 += chunk) {
        size_t nc = npos - r0 < chunk ? npos - r0 : chunk;
        per += 2 * nc * (size_t)(pos[r0 + nc - 1] + 1);
    }
    return per * (size_t)G;
}

size_t kvq_attn_ref_bytes(int G, int T, int D, const int *pos, size_t npos)
{
    if (npos == 0) return sizeof(kvq_attn_ref);
    return sizeof(kvq_attn_ref) + ref_floats(G, T, D, pos, npos) * sizeof(float) +
           (size_t)G * npos * (sizeof(row_stats) + sizeof(int)) +
           (size_t)G * (npos / chunk_rows(T, npos) + 1) * sizeof(ref_chunk);
}

void kvq_attn_ref_free(kvq_attn_ref *r)
{
    if (!r) return;
    free(r->pos), free(r->c), free(r->mem), free(r->rs);
    free(r);
}

kvq_status kvq_attn_ref_new(const float *Q, int G, const float *K, const float *V, int T, int D,
                            kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                            kvq_error *err)
{
    float *rows = gather_rows(Q, G, T, D, pos, npos);
    *out = NULL;
    if (!rows) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu query rows", npos);
    kvq_status st = kvq_attn_ref_new_rows(rows, G, K, V, T, D, mode, pos, npos, out, err);
    free(rows);
    return st;
}

kvq_status kvq_attn_ref_new_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                                 kvq_error *err)
{
    kvq_attn_ref *r = calloc(1, sizeof *r);
    *out = NULL;
    if (!r) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    r->G = G, r->T = T, r->D = D, r->mode = make_mode(mode, D), r->npos = npos;
    if (npos == 0) {
        *out = r;
        return KVQ_OK;
    }
    r->chunk = chunk_rows(T, npos);
    r->nchunk = (npos + r->chunk - 1) / r->chunk;
    r->pos = kvq_alloc_array(npos, sizeof *r->pos);
    r->c = kvq_alloc_array((size_t)G * r->nchunk, sizeof *r->c);
    r->mem = kvq_alloc_array(ref_floats(G, T, D, pos, npos), sizeof(float));
    r->rs = kvq_alloc_array((size_t)G * npos, sizeof *r->rs);
    if (!r->pos || !r->c || !r->mem || !r->rs) {
        kvq_attn_ref_free(r);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the exact attention of %d query heads x %zu rows",
                        G, npos);
    }
    memcpy(r->pos, pos, npos * sizeof *pos);
    r->g = group_heads(G, T, npos);
    float *m = r->mem;
    for (int j0 = 0; j0 < G; j0 += r->g)
        for (size_t k = 0; k < r->nchunk; k++) {
            size_t r0 = k * r->chunk;
            int nc = (int)(npos - r0 < r->chunk ? npos - r0 : r->chunk), ncol = r->pos[r0 + nc - 1] + 1;
            ref_chunk *c = &r->c[(size_t)j0 * r->nchunk + k]; /* g > 1: one chunk per head, consecutive */
            for (int j = 0; j < r->g; j++) /* each array of the g heads one after the other */
                c[j] = (ref_chunk){.nc = nc, .ncol = ncol, .p = r->pos + r0, .rs = r->rs + (size_t)(j0 + j) * npos + r0,
                                   .Qc = m + (size_t)j * nc * D,
                                   .O = m + (size_t)r->g * nc * D + (size_t)j * nc * D,
                                   .S = m + 2 * (size_t)r->g * nc * D + (size_t)j * nc * ncol,
                                   .A = m + 2 * (size_t)r->g * nc * D + (size_t)r->g * nc * ncol +
                                        (size_t)j * nc * ncol};
            m += (size_t)r->g * nc * (2 * (size_t)D + 2 * (size_t)ncol);
            ref_chunk_compute(c, r->g, Qrows + ((size_t)j0 * npos + r0) * D, npos * D, K, V, D, &r->mode);
        }
    *out = r;
    return KVQ_OK;
}

kvq_status kvq_attn_ref_compare(const kvq_attn_ref *r, int nquant, const float *const *Kq,
                                const float *const *Vq, kvq_attn_acc *acc, kvq_error *err)
{
    return kvq_attn_ref_compare_masked(r, nquant, Kq, Vq, NULL, acc, err);
}

kvq_status kvq_attn_ref_compare_masked(const kvq_attn_ref *r, int nquant, const float *const *Kq,
                                       const float *const *Vq, const unsigned char *const *Mq, kvq_attn_acc *acc,
                                       kvq_error *err)
{
    kvq_attn_ws *ws = kvq_attn_ws_new();
    if (!ws) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = kvq_attn_ref_compare_ws(r, nquant, Kq, Vq, Mq, acc, ws, err);
    kvq_attn_ws_free(ws);
    return st;
}

kvq_status kvq_attn_ref_compare_ws(const kvq_attn_ref *r, int nquant, const float *const *Kq, const float *const *Vq,
                                   const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_attn_ws *ws, kvq_error *err)
{
    if (r->npos == 0) return KVQ_OK;
    size_t rows = (size_t)r->g * r->chunk;
    quant_ws w;
    kvq_status st = ws_reserve(ws, rows * (2 * (size_t)r->T + 2 * (size_t)r->D), rows, err);
    if (st) return st;
    ws->kept = 0; /* its scores go where a streamed call's exact side was */
    quant_ws_at(&w, ws, ws->f, ws->rs, rows, r->T, r->D);
    for (size_t i = 0; i < (size_t)r->G * r->nchunk; i += r->g == 1 ? 1 : (size_t)r->g)
        ref_chunk_compare(&r->c[i], r->g, r->D, &r->mode, nquant, Kq, Vq, Mq, acc, &w);
    return KVQ_OK;
}

/* ----------------------------------------------------------- reference */

/* Dot products of one row: s[u] = q·k_u for u ≤ p (softmax_row divides by √D). */
static void scores_ref(const float *q, const float *K, int D, int p, float *s)
{
    for (int u = 0; u <= p; u++) {
        float dot = 0.0f;
        for (int c = 0; c < D; c++) dot += q[c] * K[(size_t)u * D + c];
        s[u] = dot;
    }
}

kvq_status kvq_attention_head_ref(const float *Q, int G, const float *K, const float *V, int T,
                                  int D, kvq_attn_mode mode, const int *pos, size_t npos,
                                  int nquant, const float *const *Kq, const float *const *Vq,
                                  kvq_attn_acc *acc, kvq_error *err)
{
    return kvq_attention_head_ref_masked(Q, G, K, V, T, D, mode, pos, npos, nquant, Kq, Vq, NULL, acc, err);
}

kvq_status kvq_attention_head_ref_masked(const float *Q, int G, const float *K, const float *V, int T, int D,
                                         kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                         const float *const *Kq, const float *const *Vq,
                                         const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_error *err)
{
    float *s = kvq_alloc_array((size_t)T * 4, sizeof(float));
    float *o = kvq_alloc_array((size_t)D * 3, sizeof(float));
    if (!s || !o) {
        free(s), free(o);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    float *a = s + T, *sq = s + 2 * (size_t)T, *aq = s + 3 * (size_t)T;
    float *ov = o + D, *oj = o + 2 * D;
    const att_mode m = make_mode(mode, D);
    for (int q = 0; q < nquant; q++) {
        kvq_attn_acc *ac = &acc[q];
        for (int j = 0; j < G; j++) {
            const float *Qj = Q + (size_t)j * T * D;
            for (size_t i = 0; i < npos; i++) {
                int p = pos[i];
                const float *qv = Qj + (size_t)p * D;
                scores_ref(qv, K, D, p, s);
                scores_ref(qv, Kq[q], D, p, sq);
                int lo;
                row_stats rs = mode_row(s, a, p, p + 1, &m, 1, &lo), rq;
                if (Mq && Mq[q]) {
                    rq = masked_row(s, a, rs, sq, aq, p, p + 1, &m, Mq[q], ac);
                } else {
                    rq = mode_row(sq, aq, p, p + 1, &m, 1, &lo);
                    for (int u = lo; u <= p; u++) { /* the keys the row attends to */
                        ac->s_diff2 += ((double)s[u] - sq[u]) * ((double)s[u] - sq[u]);
                        ac->a_diff2 += ((double)a[u] - aq[u]) * ((double)a[u] - aq[u]);
                    }
                    ac->kl_sum += kl_row(a, s, rs, sq, rq, p);
                    ac->mass_sum += 1.0;
                }
                for (int u = lo; u <= p; u++) {
                    ac->s_ref2 += (double)s[u] * s[u];
                    ac->a_ref2 += (double)a[u] * a[u];
                }
                ac->top1_same += rs.argmax == rq.argmax;
                /* O = A·V, A·V', A'·V' */
                for (int c = 0; c < D; c++) {
                    float x = 0, y = 0, z = 0;
                    for (int u = 0; u <= p; u++) {
                        x += a[u] * V[(size_t)u * D + c];
                        y += a[u] * Vq[q][(size_t)u * D + c];
                        z += aq[u] * Vq[q][(size_t)u * D + c];
                    }
                    o[c] = x, ov[c] = y, oj[c] = z;
                }
                for (int c = 0; c < D; c++) {
                    ac->o_ref2 += (double)o[c] * o[c];
                    ac->o_diff2 += ((double)o[c] - ov[c]) * ((double)o[c] - ov[c]);
                    ac->o_joint_diff2 += ((double)o[c] - oj[c]) * ((double)o[c] - oj[c]);
                }
                ac->rows += 1;
            }
        }
    }
    free(s), free(o);
    return KVQ_OK;
}
