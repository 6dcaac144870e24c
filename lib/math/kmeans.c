/* kmeans.c — k-means for the clustered-residual quantizer's calibration
 * (docs/quantizers.md#cluster): k-means++ seeding from kvq's generator, then Lloyd
 * iterations until no assignment changes (or max_iter).
 *
 * Assignment: argmin_j ‖c_j‖² − 2·x·c_j, the cross terms for a block of
 * points through one cblas_sgemm; ties go to the lower index.  Centre
 * update: the mean of its points, summed in double in point order, so the
 * result does not depend on threads.  The objective is evaluated exactly
 * (double) for the caller's records. */
#include "../internal.h"
#include "maths.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

enum { BLOCK = 1024 }; /* points per gemm block */

static double dist2(const float *a, const float *b, int D)
{
    double s = 0.0;
    for (int c = 0; c < D; c++) {
        double d = (double)a[c] - (double)b[c];
        s += d * d;
    }
    return s;
}

kvq_status kvq_kmeans_assign(const float *x, size_t n, int D, const float *centres, int k,
                             int *assign, kvq_error *err)
{
    float *dot = kvq_alloc_array((size_t)BLOCK * k, sizeof *dot), *cn = kvq_alloc_array((size_t)k, sizeof *cn);
    if (!dot || !cn) {
        free(dot), free(cn);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for k-means");
    }
    for (int j = 0; j < k; j++) {
        float s = 0.0f;
        for (int c = 0; c < D; c++) s += centres[(size_t)j * D + c] * centres[(size_t)j * D + c];
        cn[j] = s;
    }
    for (size_t i0 = 0; i0 < n; i0 += BLOCK) {
        int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        /* dot [m][k] = X_block · Cᵀ */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, k, D, 1.0f, x + i0 * D, D, centres,
                    D, 0.0f, dot, k);
        for (int i = 0; i < m; i++) {
            const float *row = dot + (size_t)i * k;
            int best = 0;
            float bd = cn[0] - 2.0f * row[0];
            for (int j = 1; j < k; j++) {
                float dj = cn[j] - 2.0f * row[j];
                if (dj < bd) bd = dj, best = j;
            }
            assign[i0 + i] = best;
        }
    }
    free(dot), free(cn);
    return KVQ_OK;
}

static double objective_of(const float *x, size_t n, int D, const float *centres, const int *assign)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += dist2(x + i * D, centres + (size_t)assign[i] * D, D);
    return s;
}

/* d2[i] ← min(d2[i], dist2(x_i, c)) over n points (init: d2[i] ← dist2):
 * four points at a time, each sum in channel order as dist2 takes it, so
 * the four chains overlap where one would wait on its own additions. */
static void d2_update(const float *x, size_t n, int D, const float *c, double *d2, int init)
{
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *x0 = x + i * D, *x1 = x0 + D, *x2 = x1 + D, *x3 = x2 + D;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        for (int k = 0; k < D; k++) {
            double a = (double)x0[k] - (double)c[k], b = (double)x1[k] - (double)c[k];
            double e = (double)x2[k] - (double)c[k], f = (double)x3[k] - (double)c[k];
            s0 += a * a, s1 += b * b, s2 += e * e, s3 += f * f;
        }
        double s[4] = {s0, s1, s2, s3};
        for (int j = 0; j < 4; j++)
            if (init || s[j] < d2[i + j]) d2[i + j] = s[j];
    }
    for (; i < n; i++) {
        double d = dist2(x + i * D, c, D);
        if (init || d < d2[i]) d2[i] = d;
    }
}

/* k-means++: the first centre uniform, each next one drawn with probability
 * proportional to the squared distance to the nearest centre so far (uniform
 * again if every point already sits on a centre). */
void kvq_kmeans_seed(const float *x, size_t n, int D, int k, kvq_rng *rng, float *centres, double *d2)
{
    size_t first = (size_t)kvq_rng_below(rng, n);
    memcpy(centres, x + first * D, (size_t)D * sizeof *centres);
    d2_update(x, n, D, centres, d2, 1);
    for (int j = 1; j < k; j++) {
        double total = 0.0;
        for (size_t i = 0; i < n; i++) total += d2[i];
        size_t pick = n - 1;
        if (total > 0.0) {
            double u = kvq_rng_uniform(rng) * total, acc = 0.0;
            for (size_t i = 0; i < n; i++) {
                acc += d2[i];
                if (u < acc && d2[i] > 0.0) {
                    pick = i;
                    break;
                }
            }
            while (d2[pick] == 0.0 && pick > 0) pick--; /* rounding at the very end */
        } else {
            pick = (size_t)kvq_rng_below(rng, n);
        }
        float *cj = centres + (size_t)j * D;
        memcpy(cj, x + pick * D, (size_t)D * sizeof *cj);
        d2_update(x, n, D, cj, d2, 0);
    }
}

kvq_status kvq_kmeans(const float *x, size_t n, int D, int k, int max_iter, kvq_rng *rng,
                      float *centres, int *assign, double *objective, int *iters,
                      kvq_error *err)
{
    if (n == 0 || k < 1 || D < 1)
        return kvq_fail(err, KVQ_ERR_USAGE, "k-means: %zu points, k = %d: nothing to cluster", n, k);
    int *as = kvq_alloc_array(n, sizeof *as), *prev = kvq_alloc_array(n, sizeof *prev);
    double *d2 = kvq_alloc_array(n, sizeof *d2), *sum = kvq_alloc_array((size_t)k * D, sizeof *sum);
    size_t *cnt = kvq_alloc_array((size_t)k, sizeof *cnt);
    kvq_status st = KVQ_OK;
    int it = 0;
    if (!as || !prev || !d2 || !sum || !cnt) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for k-means of %zu points", n);
        goto out;
    }
    kvq_kmeans_seed(x, n, D, k, rng, centres, d2);
    if ((st = kvq_kmeans_assign(x, n, D, centres, k, as, err))) goto out;
    if (objective) objective[0] = objective_of(x, n, D, centres, as);
    for (it = 0; it < max_iter;) {
        /* update: each centre to the mean of its points (empty: unchanged) */
        memset(sum, 0, (size_t)k * D * sizeof *sum);
        memset(cnt, 0, (size_t)k * sizeof *cnt);
        for (size_t i = 0; i < n; i++) {
            double *s = sum + (size_t)as[i] * D;
            const float *xi = x + i * D;
            for (int c = 0; c < D; c++) s[c] += xi[c];
            cnt[as[i]]++;
        }
        for (int j = 0; j < k; j++)
            if (cnt[j])
                for (int c = 0; c < D; c++)
                    centres[(size_t)j * D + c] = (float)(sum[(size_t)j * D + c] / (double)cnt[j]);
        memcpy(prev, as, n * sizeof *as);
        if ((st = kvq_kmeans_assign(x, n, D, centres, k, as, err))) goto out;
        it++;
        if (objective) objective[it] = objective_of(x, n, D, centres, as);
        if (!memcmp(prev, as, n * sizeof *as)) break;
    }
    if (assign) memcpy(assign, as, n * sizeof *as);
out:
    if (iters) *iters = it;
    free(as), free(prev), free(d2), free(sum), free(cnt);
    return st;
}
