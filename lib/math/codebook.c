/* codebook.c — Lloyd–Max scalar codebooks (docs/building-blocks.md#lloydmax-codebooks).
 *
 * One Lloyd iteration: boundaries are the midpoints of neighbouring levels;
 * each level moves to the conditional mean of the density between its
 * boundaries.  Start: levels at the centres of 2^b equal cells of the
 * support ([−1, 1] sphere, [−4, 4] gauss, sample range data); stop when the
 * largest move is below 1e-12 × that width, or after 10,000 iterations.
 *
 * sphere: one coordinate x of a uniform unit vector in D dimensions has
 * density ∝ (1 − x²)^((D−3)/2).  With x = sin θ it becomes cos^(D−2) θ on
 * (−π/2, π/2): smooth for every D >= 2 (the arcsine density of D = 2 turns
 * into a constant), so adaptive Gauss–Kronrod quadrature reaches 1e-13
 * relative accuracy per cell.  Each cell's integrand is scaled by its value
 * at the cell point nearest 0, so cells far in the tail of a large-D density
 * do not underflow and their levels still move.
 * gauss: closed forms through erfc and the normal density.
 * data: sorted samples with prefix sums (exact cell means in double). */
#include "../internal.h"
#include "maths.h"

#include <math.h>
#include <string.h>

enum { MAX_ITER = 10000 };
#define REL_STOP 1e-12

/* ------------------------------------------------ sphere: quadrature */

/* Gauss–Kronrod 7/15 nodes (positive half, last is 0) and weights. */
static const double gk_x[8] = {
    0.991455371120812639206854697526329, 0.949107912342758524526189684047851,
    0.864864423359769072789712788640926, 0.741531185599394439863864773280788,
    0.586087235467691130294144845693013, 0.405845151377397166906606412076961,
    0.207784955007898467600689403773245, 0.000000000000000000000000000000000};
static const double gk_wk[8] = {
    0.022935322010529224963732008058970, 0.063092092629978553290700663189204,
    0.104790010322250183839876322541518, 0.140653259715525918745189590510238,
    0.169004726639267902826583426598550, 0.190350578064785409913256402421014,
    0.204432940075298892414161999234649, 0.209482141084727828012999174891714};
static const double gk_wg[4] = { /* Gauss 7 weights at gk_x[1], [3], [5], [7] */
    0.129484966168869693270611432679082, 0.279705391489276667901467771423780,
    0.381830050505118944950369775488975, 0.417959183673469387755102040816327};

typedef struct {
    double m;     /* exponent D − 2 */
    double logc0; /* log cos of the scaling point */
} sphere_fn;

/* cos^m θ / cos^m θ0, and its products with sin θ and sin² θ. */
static inline void sphere_eval(const sphere_fn *f, double th, double out[3])
{
    double c = cos(th), s = sin(th);
    double w = f->m == 0.0 ? 1.0 : (c <= 0.0 ? 0.0 : exp(f->m * (log(c) - f->logc0)));
    out[0] = w, out[1] = w * s, out[2] = w * s * s;
}

/* GK15 of the three moments over [a, b]; returns the error estimate |K15 − G7|. */
static double sphere_gk15(const sphere_fn *f, double a, double b, double res[3])
{
    double hl = 0.5 * (b - a), mid = 0.5 * (a + b);
    double k[3], g[3], v[3];
    sphere_eval(f, mid, v);
    for (int j = 0; j < 3; j++) k[j] = gk_wk[7] * v[j], g[j] = gk_wg[3] * v[j];
    for (int i = 0; i < 7; i++) {
        double l[3], r[3];
        sphere_eval(f, mid - hl * gk_x[i], l);
        sphere_eval(f, mid + hl * gk_x[i], r);
        for (int j = 0; j < 3; j++) {
            k[j] += gk_wk[i] * (l[j] + r[j]);
            if (i % 2 == 1) g[j] += gk_wg[i / 2] * (l[j] + r[j]);
        }
    }
    double errest = 0;
    for (int j = 0; j < 3; j++) {
        res[j] = k[j] * hl;
        double e = fabs((k[j] - g[j]) * hl);
        if (e > errest) errest = e;
    }
    return errest;
}

/* Adaptive: split until the estimate is below the absolute tolerance `tol`
 * (halved with each split, so the sum meets it). */
static void sphere_adapt(const sphere_fn *f, double a, double b, const double est[3], double errest,
                         double tol, int depth, double res[3])
{
    if (errest <= tol || depth >= 40) {
        for (int j = 0; j < 3; j++) res[j] = est[j];
        return;
    }
    double mid = 0.5 * (a + b), l[3], r[3], el, er, rl[3], rr[3];
    el = sphere_gk15(f, a, mid, l);
    er = sphere_gk15(f, mid, b, r);
    sphere_adapt(f, a, mid, l, el, 0.5 * tol, depth + 1, rl);
    sphere_adapt(f, mid, b, r, er, 0.5 * tol, depth + 1, rr);
    for (int j = 0; j < 3; j++) res[j] = rl[j] + rr[j];
}

static void sphere_integrate(const sphere_fn *f, double a, double b, double res[3])
{
    double est[3], errest = sphere_gk15(f, a, b, est);
    /* |K15 − G7| overstates K15's own error by orders of magnitude on
     * smooth integrands: 1e-11 of the cell's mass leaves K15 far inside the
     * 1e-10 accuracy docs/building-blocks.md asks for */
    sphere_adapt(f, a, b, est, errest, 1e-11 * fabs(est[0]) + 1e-300, 0, res);
}

/* Moments of the cell [xa, xb] (x-space): res = scaled ∫ {1, x, x²} and the
 * log of the scale factor. */
static void sphere_cell(int D, double xa, double xb, double res[3], double *logscale)
{
    double ta = asin(xa < -1 ? -1 : xa > 1 ? 1 : xa), tb = asin(xb < -1 ? -1 : xb > 1 ? 1 : xb);
    double t0 = ta > 0 ? ta : (tb < 0 ? tb : 0.0); /* the point nearest 0 */
    sphere_fn f = {.m = D - 2.0, .logc0 = log(cos(t0))};
    *logscale = f.m * f.logc0;
    if (tb <= ta) {
        res[0] = res[1] = res[2] = 0.0;
        return;
    }
    sphere_integrate(&f, ta, tb, res);
}

/* ------------------------------------------------------ gauss: closed form */

static double phi(double x) { return isinf(x) ? 0.0 : exp(-0.5 * x * x) / sqrt(2.0 * M_PI); }

/* Φ(b) − Φ(a) without cancellation in the tails. */
static double gauss_mass(double a, double b)
{
    if (a >= 0) return 0.5 * (erfc(a / M_SQRT2) - erfc(b / M_SQRT2));
    if (b <= 0) return 0.5 * (erfc(-b / M_SQRT2) - erfc(-a / M_SQRT2));
    return 1.0 - 0.5 * erfc(-a / M_SQRT2) - 0.5 * erfc(b / M_SQRT2);
}

static void gauss_cell(double a, double b, double res[3])
{
    double m0 = gauss_mass(a, b), pa = phi(a), pb = phi(b);
    res[0] = m0;
    res[1] = pa - pb;                                               /* ∫ x φ */
    res[2] = (isinf(a) ? 0 : a * pa) - (isinf(b) ? 0 : b * pb) + m0; /* ∫ x² φ */
}

/* ------------------------------------------------------ Lloyd iteration */

typedef struct {
    kvq_codebook_kind kind;
    int D;
    const double *xs, *s1, *s2; /* data: sorted samples, prefix sums (n + 1) */
    size_t n;
} density;

/* First index i with xs[i] > v. */
static size_t upper_bound(const double *xs, size_t n, double v)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (xs[mid] > v) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* Moments ∫ {1, x, x²} over (a, b] (absolute: scaled back for sphere). */
static void cell_moments(const density *d, double a, double b, double res[3], double *logscale)
{
    *logscale = 0.0;
    if (d->kind == KVQ_CB_SPHERE) {
        sphere_cell(d->D, a, b, res, logscale);
    } else if (d->kind == KVQ_CB_GAUSS) {
        gauss_cell(a, b, res);
    } else {
        size_t i0 = isinf(a) ? 0 : upper_bound(d->xs, d->n, a);
        size_t i1 = isinf(b) ? d->n : upper_bound(d->xs, d->n, b);
        res[0] = (double)(i1 - i0);
        res[1] = d->s1[i1] - d->s1[i0];
        res[2] = d->s2[i1] - d->s2[i0];
    }
}

static void lloyd(const density *d, double lo, double hi, double edge_lo, double edge_hi,
                  int bits, kvq_codebook *cb)
{
    int n = 1 << bits;
    double width = hi - lo, *lv = cb->level;
    memset(cb, 0, sizeof *cb);
    cb->bits = bits, cb->n = n;
    for (int i = 0; i < n; i++) lv[i] = lo + (i + 0.5) * width / n;
    int it;
    for (it = 0; it < MAX_ITER; it++) {
        double move = 0.0, a = edge_lo;
        double nl[1 << KVQ_CODEBOOK_MAX_BITS];
        for (int i = 0; i < n; i++) {
            double b = i + 1 < n ? 0.5 * (lv[i] + lv[i + 1]) : edge_hi, m[3], ls;
            cell_moments(d, a, b, m, &ls);
            nl[i] = m[0] > 0 ? m[1] / m[0] : lv[i]; /* conditional mean; empty cell stays */
            a = b;
        }
        for (int i = 0; i < n; i++) {
            double mv = fabs(nl[i] - lv[i]);
            if (mv > move) move = mv;
            lv[i] = nl[i];
        }
        if (move < REL_STOP * width) {
            it++;
            break;
        }
    }
    cb->iterations = it;
    /* MSE at the final levels: Σ over cells ∫ (x − c)² f */
    double total[3], tls, a = edge_lo, mse = 0.0;
    cell_moments(d, edge_lo, edge_hi, total, &tls);
    for (int i = 0; i < n; i++) {
        double b = i + 1 < n ? 0.5 * (lv[i] + lv[i + 1]) : edge_hi, m[3], ls;
        cell_moments(d, a, b, m, &ls);
        double c = lv[i], part = m[2] - 2.0 * c * m[1] + c * c * m[0];
        mse += part * exp(ls - tls) / total[0];
        a = b;
    }
    if (d->kind == KVQ_CB_SPHERE) mse *= d->D; /* per unit vector: D coordinates */
    cb->mse = mse;
    for (int i = 0; i < n; i++) cb->levelf[i] = (float)lv[i];
    for (int i = 0; i + 1 < n; i++) cb->bound[i] = (float)(0.5 * (lv[i] + lv[i + 1]));
}

/* ------------------------------------------------------------ the cache */

typedef struct cache_entry {
    kvq_codebook_kind kind;
    int D, bits;
    kvq_codebook *cb;
    struct cache_entry *next;
} cache_entry;
static cache_entry *cache_head;

kvq_status kvq_codebook_get(kvq_codebook_kind kind, int D, int bits, const kvq_codebook **out,
                            kvq_error *err)
{
    *out = NULL;
    if (bits < 1 || bits > KVQ_CODEBOOK_MAX_BITS)
        return kvq_fail(err, KVQ_ERR_USAGE, "codebook bits %d: expected 1..%d", bits, KVQ_CODEBOOK_MAX_BITS);
    if (kind == KVQ_CB_DATA)
        return kvq_fail(err, KVQ_ERR_USAGE, "a data codebook is fitted on samples, not cached");
    if (kind == KVQ_CB_SPHERE && D < 2)
        return kvq_fail(err, KVQ_ERR_USAGE, "sphere codebook: head_dim %d: expected >= 2", D);
    if (kind == KVQ_CB_GAUSS) D = 0;
    kvq_status st = KVQ_OK;
#pragma omp critical(kvq_codebook_cache)
    {
        cache_entry *e;
        for (e = cache_head; e; e = e->next)
            if (e->kind == kind && e->D == D && e->bits == bits) break;
        if (!e) {
            e = calloc(1, sizeof *e);
            kvq_codebook *cb = malloc(sizeof *cb);
            if (!e || !cb) {
                free(e), free(cb);
                e = NULL;
                st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a codebook");
            } else {
                density d = {.kind = kind, .D = D};
                if (kind == KVQ_CB_SPHERE) lloyd(&d, -1.0, 1.0, -1.0, 1.0, bits, cb);
                else lloyd(&d, -4.0, 4.0, -INFINITY, INFINITY, bits, cb);
                e->kind = kind, e->D = D, e->bits = bits, e->cb = cb;
                e->next = cache_head;
                cache_head = e;
            }
        }
        if (e && !st) *out = e->cb;
    }
    return st;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

kvq_status kvq_codebook_fit_data(const float *x, size_t n, int bits, kvq_codebook *out,
                                 kvq_error *err)
{
    if (bits < 1 || bits > KVQ_CODEBOOK_MAX_BITS)
        return kvq_fail(err, KVQ_ERR_USAGE, "codebook bits %d: expected 1..%d", bits, KVQ_CODEBOOK_MAX_BITS);
    if (n == 0) return kvq_fail(err, KVQ_ERR_USAGE, "data codebook: no samples");
    double *xs = kvq_alloc_array(n, sizeof *xs), *s1 = kvq_alloc_array(n + 1, sizeof *s1);
    double *s2 = kvq_alloc_array(n + 1, sizeof *s2);
    if (!xs || !s1 || !s2) {
        free(xs), free(s1), free(s2);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu codebook samples", n);
    }
    for (size_t i = 0; i < n; i++) xs[i] = x[i];
    qsort(xs, n, sizeof *xs, cmp_double);
    s1[0] = s2[0] = 0.0;
    for (size_t i = 0; i < n; i++) s1[i + 1] = s1[i] + xs[i], s2[i + 1] = s2[i] + xs[i] * xs[i];
    density d = {.kind = KVQ_CB_DATA, .xs = xs, .s1 = s1, .s2 = s2, .n = n};
    double lo = xs[0], hi = xs[n - 1];
    if (hi == lo) hi = lo + 1.0; /* constant samples: any width; every level ends at the value */
    lloyd(&d, lo, hi, -INFINITY, INFINITY, bits, out);
    free(xs), free(s1), free(s2);
    return KVQ_OK;
}
