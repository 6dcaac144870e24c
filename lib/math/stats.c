/* stats.c — descriptive statistics of dumps for kvq-info: per-channel
 * magnitudes (the outlier-channel view), their max/median ratio, kurtosis. */
#include "../internal.h"

#include <math.h>
#include <string.h>

void kvq_channel_stats_compute(const float *x, int H, int T, int D, kvq_channel_stats *st)
{
    double *sa = calloc((size_t)D, sizeof *sa), *s2 = calloc((size_t)D, sizeof *s2);
    for (int h = 0; h < H; h++) {
        kvq_channel_stats *o = st + (size_t)h * D;
        if (!sa || !s2) { /* no memory: report NaN rather than fail silently */
            for (int c = 0; c < D; c++) o[c].abs_max = o[c].abs_mean = o[c].rms = NAN;
            continue;
        }
        memset(sa, 0, (size_t)D * sizeof *sa);
        memset(s2, 0, (size_t)D * sizeof *s2);
        for (int c = 0; c < D; c++) o[c].abs_max = 0;
        for (int t = 0; t < T; t++) {
            const float *r = x + ((size_t)h * T + t) * D;
            for (int c = 0; c < D; c++) {
                double a = fabs((double)r[c]);
                sa[c] += a;
                s2[c] += a * a;
                if (a > o[c].abs_max) o[c].abs_max = a;
            }
        }
        for (int c = 0; c < D; c++) o[c].abs_mean = sa[c] / T, o[c].rms = sqrt(s2[c] / T);
    }
    free(sa), free(s2);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvq_channel_absmax_ratio(const kvq_channel_stats *st, size_t n)
{
    double *v = kvq_alloc_array(n, sizeof *v);
    if (!v || n == 0) { free(v); return NAN; }
    for (size_t i = 0; i < n; i++) v[i] = st[i].abs_max;
    qsort(v, n, sizeof *v, cmp_double);
    double med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    double r = v[n - 1] / med;
    free(v);
    return r;
}

double kvq_kurtosis(const float *x, size_t n)
{
    double mean = 0, m2 = 0, m4 = 0;
    for (size_t i = 0; i < n; i++) mean += x[i];
    mean /= (double)n;
    for (size_t i = 0; i < n; i++) {
        double d = x[i] - mean, d2 = d * d;
        m2 += d2, m4 += d2 * d2;
    }
    m2 /= (double)n, m4 /= (double)n;
    return m4 / (m2 * m2);
}
