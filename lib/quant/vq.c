/* vq.c — vector quantization: coupled channels against learned codebooks,
 * with residual stages (docs/quantizers.md#vq, after Coupled Quantization,
 * Zhang et al. 2024, "KV Cache is 1 Bit Per Channel").
 *
 * Each token's head vector (D values, K and V apart) is cut into D/c
 * sub-vectors of c = `dims` contiguous channels; sub-vector position g has a
 * codebook of K = 2^bits centres per stage, per KV head (share=head) or for
 * all heads of the layer (share=layer).  Codebooks are trained by k-means
 * (k-means++ from the seeded generator, Lloyd iterations until no assignment
 * changes or `iters`, distances and means in double, an empty cluster takes
 * the point farthest from its centre) on the --calib dump (codebook=calib) or
 * on the tensor itself (codebook=data), then rounded to float16.  Encoding:
 * the nearest rounded centre (squared distance in double, lowest index on
 * ties), stage by stage on the float32 residual; the reconstruction is the
 * float32 sum of the chosen centres in stage order.  space=pre codes
 * key_pre_rope and applies RoPE to the reconstruction.
 * Bits: stages·bits/dims per element; codebooks are static bytes,
 * stages · 2^bits · dims · 2 per codebook.
 *
 * The plain reference (vq_reference) assigns every point by computing its K
 * distances in double.  The fast path (vq_quantize) computes them for a
 * block of points as one sgemm, ‖c‖² − 2·x·c in float, and goes back to
 * double only where the float values cannot tell the nearest centre apart
 * (vq_assign_fast's bound), so both pick the same centres bit for bit; it
 * runs the codebooks on ctx->nthreads threads. */
#include "../internal.h"
#include "quant.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

enum { CB_CALIB, CB_DATA };      /* codebook's choices */
enum { SHARE_HEAD, SHARE_LAYER }; /* share's */
enum { SPACE_POST, SPACE_PRE };   /* space's */

typedef struct vq_opts {
    int dims, bits, stages, codebook, share, space, iters;
} vq_opts;
static const kvq_param vq_params[] = {
    {.key = "dims", .type = KVQ_PARAM_INT, .def = "4", .min = 1, .max = 16,
     .help = "channels coupled in one code (must divide head_dim)", KVQ_OPT(vq_opts, dims)},
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "8", .min = 1, .max = 12,
     .help = "bits per code (2^bits centres per codebook and stage)", KVQ_OPT(vq_opts, bits)},
    {.key = "stages", .type = KVQ_PARAM_INT, .def = "1", .min = 1, .max = 4,
     .help = "residual codebooks, each coding what the ones before left", KVQ_OPT(vq_opts, stages)},
    {.key = "codebook", .type = KVQ_PARAM_CHOICE, .def = "calib", .choices = "calib|data",
     .help = "centres trained on --calib, or on the tensor itself (an upper bound)", KVQ_OPT(vq_opts, codebook)},
    {.key = "share", .type = KVQ_PARAM_CHOICE, .def = "head", .choices = "head|layer",
     .help = "a codebook per KV head, or one for all heads of the layer", KVQ_OPT(vq_opts, share)},
    {.key = "space", .type = KVQ_PARAM_CHOICE, .def = "post", .choices = "post|pre",
     .help = "code keys after RoPE, or before it (needs key_pre_rope; RoPE re-applied)", KVQ_OPT(vq_opts, space)},
    {.key = "iters", .type = KVQ_PARAM_INT, .def = "100", .min = 0, .max = 100000,
     .help = "most Lloyd iterations of the k-means", KVQ_OPT(vq_opts, iters)},
};

/* The shape of one layer's codebooks: NH codebook sets (H with share=head,
 * 1 with share=layer) of G = D/c sub-vector positions, each S stages of K
 * centres of c floats.  Book b = (tensor·NH + hs)·G + g holds [S][K][c]. */
typedef struct vq_shape {
    int H, D, c, G, K, S, NH, iters;
} vq_shape;

static vq_shape shape_of(const kvq_spec *sp, int H, int D)
{
    const vq_opts *o = kvq_spec_opts(sp);
    vq_shape s = {.H = H, .D = D, .c = o->dims, .G = D / o->dims, .K = 1 << o->bits, .S = o->stages,
                  .NH = o->share == SHARE_LAYER ? 1 : H, .iters = o->iters};
    return s;
}
static size_t book_floats(const vq_shape *s) { return (size_t)s->S * s->K * s->c; }
static size_t nbooks(const vq_shape *s) { return (size_t)2 * s->NH * s->G; }

static kvq_status vq_check_shape(const kvq_spec *sp, int D, kvq_error *err)
{
    const vq_opts *o = kvq_spec_opts(sp);
    if (D % o->dims)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: dims=%d does not divide head_dim %d (a head vector is cut into "
                        "sub-vectors of dims channels)", sp->text, o->dims, D);
    return KVQ_OK;
}

/* ------------------------------------------------------------ distances */

/* The squared distance of a point to a centre, in double, in channel order:
 * the definition every assignment (reference and fast) decides ties by. */
static double dist2(const float *x, const double *c, int n)
{
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        double d = (double)x[i] - c[i];
        s += d * d;
    }
    return s;
}

/* A set of K centres: cd in double (what distances are measured to) and
 * its float copy cf with ‖cf_j‖² (what the fast path's sgemm uses). */
typedef struct vq_centres {
    int K, c;
    double *cd; /* [K][c] */
    float *cf;  /* [K][c] */
    float *cn;  /* [K] ‖cf_j‖² in float */
    double cnmax; /* max_j ‖cd_j‖² */
} vq_centres;

static void centres_sync(vq_centres *C)
{
    C->cnmax = 0.0;
    for (int j = 0; j < C->K; j++) {
        float s = 0.0f;
        double sd = 0.0;
        for (int i = 0; i < C->c; i++) {
            size_t k = (size_t)j * C->c + i;
            C->cf[k] = (float)C->cd[k];
            s += C->cf[k] * C->cf[k];
            sd += C->cd[k] * C->cd[k];
        }
        C->cn[j] = s;
        C->cnmax = sd > C->cnmax ? sd : C->cnmax;
    }
}

/* Scratch of one assignment: the sgemm's block of dot products. */
typedef struct vq_work {
    float *dot; /* [block][K] */
    int block;
} vq_work;

typedef void (*vq_assign_fn)(const float *x, size_t n, const vq_centres *C, int *a, vq_work *w);

/* Reference assignment: each point to the centre at the smallest dist2,
 * the lowest index on ties. */
static void vq_assign_ref(const float *x, size_t n, const vq_centres *C, int *a, vq_work *w)
{
    (void)w;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * C->c;
        int best = 0;
        double bd = dist2(xi, C->cd, C->c);
        for (int j = 1; j < C->K; j++) {
            double d = dist2(xi, C->cd + (size_t)j * C->c, C->c);
            if (d < bd) bd = d, best = j;
        }
        a[i] = best;
    }
}

/* Fast assignment: e_j = ‖cf_j‖² − 2·x·cf_j for a block of points through
 * one cblas_sgemm (alpha −2 onto rows of ‖cf‖²; ‖x‖² is the same for
 * every j).  Each e_j differs from the exact ‖c_j‖² − 2·x·c_j (c_j in
 * double) by less than slack = (4c + 16)·2⁻²⁴·(‖x‖² + max‖c‖²) — the float
 * copy of c (3u), ‖cf‖² (c·u), the c + 1 terms summed in any order and
 * with FMA (2·(c + 1)·u), each bounded by u·(‖x‖² + ‖c‖²) times the factor
 * named, then doubled — so the nearest centre is among the j with
 * e_j ≤ min e + 2·slack.  One such j is the answer; where there are more,
 * dist2 in double decides among them as the reference does. */
static void vq_assign_fast(const float *x, size_t n, const vq_centres *C, int *a, vq_work *w)
{
    const int K = C->K, c = C->c;
    const float *cn = C->cn; /* in locals: the stores to row must not reload them */
    const double *cd = C->cd, cnmax = C->cnmax;
    const double kappa = (4.0 * c + 16.0) * 0x1p-24;
    for (size_t i0 = 0; i0 < n; i0 += (size_t)w->block) {
        int m = (int)(n - i0 < (size_t)w->block ? n - i0 : (size_t)w->block);
        for (int i = 0; i < m; i++) memcpy(w->dot + (size_t)i * K, cn, (size_t)K * sizeof *cn);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, K, c, -2.0f, x + i0 * c, c, C->cf, c, 1.0f, w->dot,
                    K); /* e [m][K] = ‖cf‖² − 2·X_block · Cfᵀ */
        for (int i = 0; i < m; i++) {
            const float *row = w->dot + (size_t)i * K;
            const float *xi = x + (i0 + i) * c;
            float e1 = INFINITY;
#pragma omp simd reduction(min : e1)
            for (int j = 0; j < K; j++) e1 = row[j] < e1 ? row[j] : e1;
            double xn = 0.0;
            for (int k = 0; k < c; k++) xn += (double)xi[k] * xi[k];
            /* the candidates e_j <= e1 + 2·slack, through the smallest float at or above it */
            double lim = (double)e1 + 2.0 * kappa * (xn + cnmax);
            float thr = (float)lim;
            if ((double)thr < lim) thr = nextafterf(thr, INFINITY);
            int count = 0, at = 0;
            for (int j = 0; j < K; j++) {
                count += row[j] <= thr;
                at = row[j] <= thr ? j : at;
            }
            if (count > 1) { /* near a tie: the candidates in double, lowest index first */
                double bd = INFINITY;
                for (int j = 0; j < K; j++) {
                    if (row[j] > thr) continue;
                    double d = dist2(xi, cd + (size_t)j * c, c);
                    if (d < bd) bd = d, at = j;
                }
            }
            a[i0 + i] = at;
        }
    }
}

/* ------------------------------------------------------------- k-means */

/* Lexicographic order of sub-vectors, for counting distinct ones. */
typedef struct vq_point {
    const float *p;
    int c;
} vq_point;
static int point_cmp(const void *a, const void *b)
{
    const vq_point *x = a, *y = b;
    for (int i = 0; i < x->c; i++)
        if (x->p[i] != y->p[i]) return x->p[i] < y->p[i] ? -1 : 1;
    return 0;
}

/* The number of distinct points among n, counted up to K + 1 (more than
 * the K centres hold); when they are at most K, also the centres [K][c]
 * they make: each distinct point once in order of first appearance, the
 * last one repeated in the unused centres (SPEC 3.10: k-means' optimum).
 * One sort serves both.  -1 out of memory. */
static long distinct_centres(const float *x, size_t n, int c, int K, float *centres)
{
    vq_point *v = kvq_alloc_array(n, sizeof *v);
    size_t *first = kvq_alloc_array((size_t)K + 1, sizeof *first); /* each distinct point's first index */
    if (!v || !first) { free(v), free(first); return -1; }
    for (size_t i = 0; i < n; i++) v[i].p = x + i * c, v[i].c = c;
    qsort(v, n, sizeof *v, point_cmp);
    size_t d = 0;
    for (size_t i = 0; i < n && d <= (size_t)K; i++) {
        size_t at = (size_t)(v[i].p - x) / (size_t)c;
        if (i == 0 || point_cmp(&v[i - 1], &v[i])) first[d++] = at; /* a new point: its index so far */
        else if (at < first[d - 1]) first[d - 1] = at;              /* the same point seen earlier */
    }
    if (d <= (size_t)K) {
        /* the distinct points by their first index (at most K: insertion sort) */
        for (size_t i = 1; i < d; i++)
            for (size_t j = i; j > 0 && first[j - 1] > first[j]; j--) {
                size_t t = first[j];
                first[j] = first[j - 1], first[j - 1] = t;
            }
        for (int k = 0; k < K; k++)
            memcpy(centres + (size_t)k * c, x + first[(size_t)k < d ? (size_t)k : d - 1] * c,
                   (size_t)c * sizeof *centres);
    }
    free(v), free(first);
    return (long)d;
}

/* Lloyd iterations from the seeded centres: update (each centre the mean
 * of its points, summed in point order in double; an empty cluster, in
 * index order, takes the point farthest by dist2 from its own updated
 * centre, the lowest index on ties, which then counts as sitting on a
 * centre), then assign; until no assignment changes or `iters` updates.
 * a, prev [n]; sum [K][c]; cnt [K]; d2 [n]: scratch. */
static void lloyd(const float *x, size_t n, vq_centres *C, int iters, vq_assign_fn assign, vq_work *w, int *a,
                  int *prev, double *sum, size_t *cnt, double *d2)
{
    const int K = C->K, c = C->c;
    centres_sync(C);
    assign(x, n, C, a, w);
    for (int it = 0; it < iters; it++) {
        memset(sum, 0, (size_t)K * c * sizeof *sum);
        memset(cnt, 0, (size_t)K * sizeof *cnt);
        for (size_t i = 0; i < n; i++) {
            double *s = sum + (size_t)a[i] * c;
            for (int k = 0; k < c; k++) s[k] += x[i * c + k];
            cnt[a[i]]++;
        }
        int empty = 0;
        for (int j = 0; j < K; j++) {
            if (!cnt[j]) {
                empty = 1;
                continue;
            }
            for (int k = 0; k < c; k++) C->cd[(size_t)j * c + k] = sum[(size_t)j * c + k] / (double)cnt[j];
        }
        if (empty) {
            for (size_t i = 0; i < n; i++) d2[i] = dist2(x + i * c, C->cd + (size_t)a[i] * c, c);
            for (int j = 0; j < K; j++) {
                if (cnt[j]) continue;
                size_t far = 0;
                for (size_t i = 1; i < n; i++)
                    if (d2[i] > d2[far]) far = i;
                for (int k = 0; k < c; k++) C->cd[(size_t)j * c + k] = x[far * c + k];
                d2[far] = 0.0;
            }
        }
        centres_sync(C);
        memcpy(prev, a, n * sizeof *a);
        assign(x, n, C, a, w);
        if (!memcmp(prev, a, n * sizeof *a)) break;
    }
}

/* A double rounded to the nearest float16 (ties to even), as a float:
 * through float32, except where that float lands exactly halfway between
 * two float16 values while the double does not (double rounding), where
 * the double's side of the midpoint decides. */
static float round_f16_of(double d)
{
    float f = (float)d, h = kvq_round_f16(f);
    if ((double)f == d) return h;
    float lo = kvq_round_f16(nextafterf(f, -INFINITY)), hi = kvq_round_f16(nextafterf(f, INFINITY));
    if (lo != hi && (double)f == 0.5 * ((double)lo + (double)hi)) h = d > (double)f ? hi : lo;
    return h;
}

/* --------------------------------------------------- one codebook's stages */

/* Where a codebook sits, for messages. */
typedef struct vq_where {
    int layer, tensor, head; /* head -1: all heads (share=layer) */
    int g, c;
} vq_where;

/* Working memory of one codebook task (n points of c, K centres). */
typedef struct vq_task_mem {
    float *res, *y;  /* [n][c]: the residual, the reconstruction */
    int *a, *prev;   /* [n] */
    double *d2, *sum; /* [n], [K][c] */
    size_t *cnt;     /* [K] */
    vq_centres C;
    vq_work w;
} vq_task_mem;

static void task_mem_free(vq_task_mem *m)
{
    free(m->res), free(m->y), free(m->a), free(m->prev), free(m->d2), free(m->sum), free(m->cnt);
    free(m->C.cd), free(m->C.cf), free(m->C.cn), free(m->w.dot);
    memset(m, 0, sizeof *m);
}

static int task_mem_alloc(vq_task_mem *m, size_t n, int c, int K)
{
    memset(m, 0, sizeof *m);
    m->w.block = 16384 / K; /* the block's e values in 64 KB (K <= 4096: at least 4 points) */
    m->res = kvq_alloc_array(n, (size_t)c * sizeof(float)), m->y = kvq_alloc_array(n, (size_t)c * sizeof(float));
    m->a = kvq_alloc_array(n, sizeof(int)), m->prev = kvq_alloc_array(n, sizeof(int));
    m->d2 = kvq_alloc_array(n, sizeof(double)), m->sum = kvq_alloc_array((size_t)K * c, sizeof(double));
    m->cnt = kvq_alloc_array((size_t)K, sizeof(size_t));
    m->C.K = K, m->C.c = c;
    m->C.cd = kvq_alloc_array((size_t)K * c, sizeof(double));
    m->C.cf = kvq_alloc_array((size_t)K * c, sizeof(float)), m->C.cn = kvq_alloc_array((size_t)K, sizeof(float));
    m->w.dot = kvq_alloc_array((size_t)m->w.block * K, sizeof(float));
    if (m->res && m->y && m->a && m->prev && m->d2 && m->sum && m->cnt && m->C.cd && m->C.cf && m->C.cn && m->w.dot)
        return 0;
    task_mem_free(m);
    return -1;
}

/* The stages of one codebook on the n points in m->res (overwritten by the
 * residual): with `train`, stage s is first fitted to the residual left by
 * stages < s (k-means, then float16) into book [S][K][c]; then every point's
 * residual goes to its nearest centre of stage s, which is added to the
 * reconstruction m->y and taken from the residual.  rng: the codebook's
 * stream (train only). */
static kvq_status run_stages(vq_task_mem *m, size_t n, const vq_shape *s, float *book, int train, kvq_rng *rng,
                             vq_assign_fn assign, const vq_where *at, kvq_error *err)
{
    const int c = s->c, K = s->K;
    vq_centres *C = &m->C;
    memset(m->y, 0, n * c * sizeof *m->y);
    for (int st = 0; st < s->S; st++) {
        float *bs = book + (size_t)st * K * c;
        if (train) {
            long d = distinct_centres(m->res, n, c, K, C->cf);
            if (d < 0) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu sub-vectors", n);
            if (d <= K) { /* k-means' optimum: each distinct point a centre (SPEC 3.10), said once */
                char head[32];
                snprintf(head, sizeof head, at->head < 0 ? "all heads" : "head %d", at->head);
                for (size_t i = 0; i < (size_t)K * c; i++) C->cd[i] = C->cf[i];
                uint64_t order = ((((uint64_t)at->layer << 1 | (uint64_t)at->tensor) << 20 | (uint64_t)(at->head + 1))
                                      << 20 | (uint64_t)at->g) << 8 | (uint64_t)st; /* layer, tensor, head, group, stage */
                kvq_note(KVQ_NOTE_VQ_FEW_DISTINCT, order,
                         "vq: layer %d, %s %s, group %d (channels %d-%d), stage %d: %ld distinct training "
                         "sub-vectors for the 2^bits = %d centres: each is a centre (k-means' optimum)", at->layer,
                         at->tensor ? "value" : "key", head, at->g, at->g * at->c, at->g * at->c + at->c - 1, st + 1,
                         d, K);
            } else {
                /* k-means++ (lib/math/kmeans.c; its points are floats, so exact in double);
                 * more than K distinct points, so its total is never 0 */
                kvq_kmeans_seed(m->res, n, c, K, rng, C->cf, m->d2);
                for (size_t i = 0; i < (size_t)K * c; i++) C->cd[i] = C->cf[i];
                lloyd(m->res, n, C, s->iters, assign, &m->w, m->a, m->prev, m->sum, m->cnt, m->d2);
            }
            for (size_t i = 0; i < (size_t)K * c; i++) {
                bs[i] = round_f16_of(C->cd[i]);
                if (!isfinite(bs[i])) return KVQ_ERR_NUMERIC; /* the runner names the float16 overflow */
            }
        }
        for (size_t i = 0; i < (size_t)K * c; i++) C->cd[i] = bs[i];
        centres_sync(C);
        assign(m->res, n, C, m->a, &m->w);
        for (size_t i = 0; i < n; i++) {
            const float *ci = bs + (size_t)m->a[i] * c;
            for (int k = 0; k < c; k++) m->y[i * c + k] += ci[k], m->res[i * c + k] -= ci[k];
        }
    }
    return KVQ_OK;
}

/* --------------------------------------------------------- the layer */

/* The points of book (tensor, hs, g): channels g·c.. of every token of head
 * hs (share=head) or of every head in order (share=layer), from x [H][T][D],
 * into pts [n][c]; scatter puts a reconstruction back the same way. */
static size_t gather(const float *x, const vq_shape *s, int T, int hs, int g, float *pts)
{
    int h0 = s->NH == 1 ? 0 : hs, h1 = s->NH == 1 ? s->H : hs + 1;
    size_t n = 0;
    for (int h = h0; h < h1; h++)
        for (int t = 0; t < T; t++, n++)
            memcpy(pts + n * s->c, x + ((size_t)h * T + t) * s->D + (size_t)g * s->c, (size_t)s->c * sizeof *pts);
    return n;
}
static void scatter(const float *pts, const vq_shape *s, int T, int hs, int g, float *y)
{
    int h0 = s->NH == 1 ? 0 : hs, h1 = s->NH == 1 ? s->H : hs + 1;
    size_t n = 0;
    for (int h = h0; h < h1; h++)
        for (int t = 0; t < T; t++, n++)
            memcpy(y + ((size_t)h * T + t) * s->D + (size_t)g * s->c, pts + n * s->c, (size_t)s->c * sizeof *pts);
}

/* The layer's keys as the spec codes them: key_pre_rope with space=pre. */
static kvq_status key_source(const kvq_spec *sp, const kvq_layer *L, const char *whose, const float **out,
                             kvq_error *err)
{
    const vq_opts *o = kvq_spec_opts(sp);
    *out = L->key;
    if (o->space != SPACE_PRE) return KVQ_OK;
    if (!L->key_pre_rope)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: space=pre codes the keys before RoPE: expected key_pre_rope in %s "
                        "(or use space=post)", sp->text, whose);
    *out = L->key_pre_rope;
    return KVQ_OK;
}

/* Every book of a layer [H][T][D]: trained (books NULL: into `trained`,
 * with the seeded streams) or given, and the reconstruction written to y
 * (yk, yv; NULL: training only).  Books run on nt threads; the first
 * failure in book order is the error. */
static kvq_status run_books(const kvq_spec *sp, const vq_shape *s, const kvq_quant_ctx *ctx, const float *xk,
                            const float *xv, int T, const float *books, float *trained, float *yk, float *yv,
                            vq_assign_fn assign, int nt, kvq_error *err)
{
    const int nb = (int)nbooks(s);
    size_t n = (size_t)(s->NH == 1 ? s->H : 1) * T;
    kvq_status *sts = calloc((size_t)nb, sizeof *sts);
    kvq_error *errs = calloc((size_t)nb, sizeof *errs);
    if (!sts || !errs) {
        free(sts), free(errs);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int b = 0; b < nb; b++) {
        int g = b % s->G, hs = b / s->G % s->NH, tensor = b / s->G / s->NH;
        vq_task_mem m;
        if (task_mem_alloc(&m, n, s->c, s->K)) {
            sts[b] = kvq_fail(&errs[b], KVQ_ERR_NOMEM, "out of memory for %zu sub-vectors", n);
            continue;
        }
        gather(tensor ? xv : xk, s, T, hs, g, m.res);
        kvq_rng rng;
        /* stream: (seed, layer, head or 2^64−1 for all heads, its stream tensor + 2·g) */
        kvq_rng_init(&rng, ctx->seed, (uint64_t)ctx->layer, s->NH == 1 ? UINT64_MAX : (uint64_t)hs,
                     kvq_family_stream(sp->q, (uint64_t)tensor + 2u * (uint64_t)g));
        vq_where at = {ctx->layer, tensor, s->NH == 1 ? -1 : hs, g, s->c};
        float *book = books ? (float *)books + (size_t)b * book_floats(s) : trained + (size_t)b * book_floats(s);
        sts[b] = run_stages(&m, n, s, book, books == NULL, &rng, assign, &at, &errs[b]);
        if (!sts[b] && (tensor ? yv : yk)) scatter(m.y, s, T, hs, g, tensor ? yv : yk);
        task_mem_free(&m);
    }
    kvq_status st = KVQ_OK;
    for (int b = 0; b < nb && !st; b++) {
        if (!(st = sts[b])) continue;
        if (st == KVQ_ERR_NUMERIC && !errs[b].msg[0])
            kvq_fail(err, st, "layer %d: a centre overflows float16", ctx->layer);
        else kvq_fail(err, st, "%s", errs[b].msg);
    }
    free(sts), free(errs);
    return st;
}

/* ------------------------------------------------------- calibration */

typedef struct vq_state {
    vq_shape s;
    float *books; /* nbooks × [S][K][c], float16 values */
} vq_state;

static void vq_state_free(void *p)
{
    vq_state *st = p;
    if (st) free(st->books), free(st);
}

static int vq_calib_key(const kvq_spec *sp, char *buf, size_t len)
{
    const vq_opts *o = kvq_spec_opts(sp);
    if (o->codebook != CB_CALIB) return 0;
    snprintf(buf, len, "dims=%d,bits=%d,stages=%d,share=%d,space=%d,iters=%d", o->dims, o->bits, o->stages, o->share,
             o->space, o->iters);
    return 1;
}

static kvq_status vq_calibrate(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *cal, void **state,
                               kvq_error *err)
{
    kvq_status st = vq_check_shape(sp, cal->D, err);
    if (st) return st;
    const float *keys;
    if ((st = key_source(sp, cal, "the calibration dump", &keys, err))) return st;
    vq_state *s = calloc(1, sizeof *s);
    if (s) s->s = shape_of(sp, cal->H, cal->D);
    if (!s || !(s->books = kvq_alloc_array(nbooks(&s->s), book_floats(&s->s) * sizeof(float)))) {
        vq_state_free(s);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the codebooks", sp->text);
    }
    if ((st = run_books(sp, &s->s, ctx, keys, cal->value, cal->T, NULL, s->books, NULL, NULL, vq_assign_fast,
                        kvq_threads(ctx->nthreads), err))) {
        vq_state_free(s);
        return st;
    }
    *state = s;
    return KVQ_OK;
}

/* ------------------------------------------------------- quantize */

static kvq_status vq_run(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                         vq_assign_fn assign, int nt, kvq_error *err)
{
    const vq_opts *o = kvq_spec_opts(sp);
    const int H = in->H, T = in->T, D = in->D;
    vq_shape s = shape_of(sp, H, D);
    const float *keys;
    kvq_status st = key_source(sp, in, "the dump", &keys, err);
    if (st) return st;
    if (o->space == SPACE_PRE && !ctx->rope)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: space=pre re-applies RoPE to the keys: expected rope_style and "
                        "rope_theta (or /rope_cos, /rope_sin) in the dump (or use space=post)", sp->text);
    const float *books = NULL;
    float *trained = NULL;
    if (o->codebook == CB_CALIB) {
        const vq_state *cs = ctx->calib;
        if (!cs) return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s", sp->text, KVQ_NEEDS_CALIB);
        if (cs->s.H != H || cs->s.D != D)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: the codebooks were trained on %d KV heads of head_dim %d, the "
                            "layer has %d of %d", sp->text, cs->s.H, cs->s.D, H, D);
        books = cs->books;
    } else if (!(trained = kvq_alloc_array(nbooks(&s), book_floats(&s) * sizeof(float)))) {
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the codebooks", sp->text);
    }
    st = run_books(sp, &s, ctx, keys, in->value, T, books, trained, out->key, out->value, assign, nt, err);
    free(trained);
    if (st) { /* named by the spec here; a calibration's error is named by its caller */
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        return kvq_fail(err, st, "%s: %s", sp->text, msg);
    }
    if (o->space == SPACE_PRE) /* K' = RoPE_t(Q(K_pre)) */
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++)
                kvq_rope_rotate(ctx->rope, out->key + ((size_t)h * T + t) * D, kvq_token_pos(ctx, in, h, t), 0);
    double bits = (double)T * s.G * s.S * o->bits; /* s·b/c per element */
    double bytes = 2.0 * s.G * (double)book_floats(&s) * 2.0 * s.NH / H; /* K and V books, float16 */
    for (int h = 0; h < H; h++) out->k_bits[h] = out->v_bits[h] = bits, out->static_bytes[h] += bytes;
    return KVQ_OK;
}

static kvq_status vq_quantize(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                              kvq_error *err)
{
    return vq_run(sp, ctx, in, out, vq_assign_fast, kvq_threads(ctx->nthreads), err);
}

/* The reference: the same stages with every distance in double, one thread. */
static kvq_status vq_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                               kvq_error *err)
{
    return vq_run(sp, ctx, in, out, vq_assign_ref, 1, err);
}

const kvq_quantizer kvq_q_vq = {
    .name = "vq",
    .description = "vector quantization: dims channels coupled per code, learned codebooks, residual stages",
    .example_spec = "dims=2,bits=4,stages=2,codebook=data,share=layer,space=pre",
    .params = vq_params,
    .nparams = sizeof vq_params / sizeof vq_params[0],
    .in_default_set = 0,
    .default_spec = "",
    .check_shape = vq_check_shape,
    .quantize = vq_quantize,
    .reference = vq_reference,
    .read_flags = KVQ_READ_KEY_PRE_ROPE,
    .calib_key = vq_calib_key,
    .calibrate = vq_calibrate,
    .calib_free = vq_state_free,
    .nstreams = 2u << 28, /* codebook seeding of (K/V, sub-vector g): tensor + 2·g, head_dim < 2^28 */
    .stream_tag_kept = 12,
};
