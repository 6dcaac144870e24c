/* metrics.c — reconstruction sums (docs/metrics.md), their pooling and the final
 * columns, and the query-position selection used by the attention metrics.
 * Sums of squares are accumulated in double. */
#include "../internal.h"
#include "../simd.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

/* Reference: one element at a time, in index order. */
void kvq_recon_accumulate_ref(kvq_recon_acc *acc, const float *x, const float *xq, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float e = x[i] - xq[i]; /* E = X − X', in float32 */
        acc->sum_x2 += (double)x[i] * x[i];
        acc->sum_e2 += (double)e * e;
        acc->sum_abs_e += fabs((double)e);
        if (fabs((double)e) > acc->max_abs) acc->max_abs = fabs((double)e);
    }
    acc->n += (double)n;
}

/* Optimised: the same sums with the additions reassociated into SIMD lanes
 * (a fixed order for a given build and CPU, so results do not depend on
 * threads).  Compiled plain and again for AVX2 (4 doubles a lane group),
 * picked at run time. */
KVQ_BODY void recon_body(kvq_recon_acc *acc, const float *restrict x, const float *restrict xq, size_t n)
{
    double sx2 = 0, se2 = 0, sae = 0;
    float mx = 0.0f;
#pragma omp simd reduction(+ : sx2, se2, sae) reduction(max : mx)
    for (size_t i = 0; i < n; i++) {
        float e = x[i] - xq[i];
        float ae = fabsf(e);
        sx2 += (double)x[i] * (double)x[i];
        se2 += (double)e * (double)e;
        sae += (double)ae;
        mx = ae > mx ? ae : mx;
    }
    acc->sum_x2 += sx2;
    acc->sum_e2 += se2;
    acc->sum_abs_e += sae;
    if ((double)mx > acc->max_abs) acc->max_abs = mx;
    acc->n += (double)n;
}

static void recon_plain(kvq_recon_acc *acc, const float *restrict x, const float *restrict xq, size_t n)
{
    recon_body(acc, x, xq, n);
}

#ifdef KVQ_AVX2_CLONES
KVQ_TARGET_AVX2 static void recon_avx2(kvq_recon_acc *acc, const float *restrict x, const float *restrict xq,
                                       size_t n)
{
    recon_body(acc, x, xq, n);
}
#endif

void kvq_recon_accumulate(kvq_recon_acc *acc, const float *restrict x, const float *restrict xq,
                          size_t n)
{
    if (kvq_simd_active()) {
        kvq_recon_avx512(acc, x, xq, n);
        return;
    }
#ifdef KVQ_AVX2_CLONES
    if (kvq_simd_avx2_active()) {
        recon_avx2(acc, x, xq, n);
        return;
    }
#endif
    recon_plain(acc, x, xq, n);
}

void kvq_recon_accumulate_many(kvq_recon_acc *const *acc, const float *x, const float *const *xq, int m, size_t n)
{
    if (kvq_simd_active()) {
        kvq_recon_many_avx512(acc, x, xq, m, n);
        return;
    }
    for (int i = 0; i < m; i++) kvq_recon_accumulate(acc[i], x, xq[i], n);
}

static void recon_merge(kvq_recon_acc *d, const kvq_recon_acc *s)
{
    d->n += s->n;
    d->sum_x2 += s->sum_x2;
    d->sum_e2 += s->sum_e2;
    d->sum_abs_e += s->sum_abs_e;
    if (s->max_abs > d->max_abs) d->max_abs = s->max_abs;
    d->bits += s->bits;
}

void kvq_acc_merge(kvq_acc *dst, const kvq_acc *src)
{
    recon_merge(&dst->k, &src->k);
    recon_merge(&dst->v, &src->v);
    dst->static_bytes += src->static_bytes;
    if (src->has_attn) {
        kvq_attn_acc *d = &dst->attn;
        const kvq_attn_acc *s = &src->attn;
        dst->has_attn = 1;
        d->rows += s->rows;
        d->s_ref2 += s->s_ref2, d->s_diff2 += s->s_diff2;
        d->a_ref2 += s->a_ref2, d->a_diff2 += s->a_diff2;
        d->kl_sum += s->kl_sum;
        d->top1_same += s->top1_same;
        d->o_ref2 += s->o_ref2, d->o_diff2 += s->o_diff2, d->o_joint_diff2 += s->o_joint_diff2;
        d->mass_sum += s->mass_sum;
    }
}

/* Each column of kvq_metric_cols.def from its sums: K and V columns from the
 * tensor's kvq_recon_acc r, attention ones from a (when rows had queries),
 * the others from acc. */
void kvq_metrics_finalize(const kvq_acc *acc, kvq_metrics *m)
{
    memset(m, 0, sizeof *m);
    m->has_attn = acc->has_attn && acc->attn.rows > 0;
    const kvq_attn_acc *a = &acc->attn;
    const kvq_recon_acc *r;
#define KVQ_METRIC_SUMS_K (r = &acc->k, 1)
#define KVQ_METRIC_SUMS_V (r = &acc->v, 1)
#define KVQ_METRIC_SUMS_ATTN m->has_attn
#define KVQ_METRIC_SUMS_ACC 1
#define KVQ_METRIC(column, sums, table, value) \
    if (KVQ_METRIC_SUMS_##sums) m->column = (value);
#include "../kvq_metric_cols.def"
#undef KVQ_METRIC
#undef KVQ_METRIC_SUMS_K
#undef KVQ_METRIC_SUMS_V
#undef KVQ_METRIC_SUMS_ATTN
#undef KVQ_METRIC_SUMS_ACC
    (void)r;
}

static const struct {
    const char *name;
    unsigned flags;
    size_t offset; /* of its value in kvq_metrics */
} metric_columns[] = {
#define KVQ_METRIC_IS_ATTN_K 0
#define KVQ_METRIC_IS_ATTN_V 0
#define KVQ_METRIC_IS_ATTN_ACC 0
#define KVQ_METRIC_IS_ATTN_ATTN KVQ_METRIC_ATTN
#define KVQ_METRIC(column, sums, table, value)                                                              \
    {#column, KVQ_METRIC_IS_ATTN_##sums | ((table) ? KVQ_METRIC_TABLE : 0u), offsetof(kvq_metrics, column)},
#include "../kvq_metric_cols.def"
#undef KVQ_METRIC
};

int kvq_metric_column(int i, const char **name, unsigned *flags)
{
    if (i < 0 || (size_t)i >= sizeof metric_columns / sizeof metric_columns[0]) return 0;
    *name = metric_columns[i].name, *flags = metric_columns[i].flags;
    return 1;
}

double kvq_metric_value(const kvq_metrics *m, int i)
{
    double v;
    memcpy(&v, (const char *)m + metric_columns[i].offset, sizeof v);
    return v;
}

/* ------------------------------------------------------ query positions */

kvq_status kvq_query_sel_parse(const char *text, kvq_query_sel *out, kvq_error *err)
{
    if (!strcmp(text, "all")) {
        out->kind = KVQ_Q_ALL, out->n = 0;
        return KVQ_OK;
    }
    static const struct { const char *prefix; kvq_query_kind kind; } forms[] = {
        {"last:", KVQ_Q_LAST}, {"every:", KVQ_Q_EVERY}, {"random:", KVQ_Q_RANDOM}};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        size_t pl = strlen(forms[i].prefix);
        if (strncmp(text, forms[i].prefix, pl)) continue;
        const char *num = text + pl;
        char *end;
        errno = 0;
        long n = strtol(num, &end, 10);
        if (errno || end == num || *end || *num == '-' || *num == '+' || n < 1)
            return kvq_fail(err, KVQ_ERR_USAGE, "--queries %s: expected a positive integer after '%s'", text,
                            forms[i].prefix);
        out->kind = forms[i].kind, out->n = n;
        return KVQ_OK;
    }
    return kvq_fail(err, KVQ_ERR_USAGE, "--queries %s: expected all, last:N, every:N or random:N", text);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

kvq_status kvq_query_positions(const kvq_query_sel *sel, int T, uint64_t seed, int **pos,
                               size_t *npos, kvq_error *err)
{
    size_t n = (size_t)T;
    if (sel->kind == KVQ_Q_LAST || sel->kind == KVQ_Q_RANDOM) n = sel->n < T ? (size_t)sel->n : (size_t)T;
    else if (sel->kind == KVQ_Q_EVERY) n = (size_t)((T - 1) / (sel->n < T ? sel->n : T) + 1);
    int *p = kvq_alloc_array(sel->kind == KVQ_Q_RANDOM ? (size_t)T : n, sizeof *p);
    if (!p) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu query positions", n);
    switch (sel->kind) {
    case KVQ_Q_ALL:
        for (size_t i = 0; i < n; i++) p[i] = (int)i;
        break;
    case KVQ_Q_LAST:
        for (size_t i = 0; i < n; i++) p[i] = T - (int)n + (int)i;
        break;
    case KVQ_Q_EVERY:
        for (size_t i = 0; i < n; i++) p[i] = (int)(i * (size_t)sel->n);
        break;
    case KVQ_Q_RANDOM: {
        /* partial Fisher–Yates: the first n of a seeded shuffle, then sorted;
         * one draw per run, the same positions for every layer and head */
        kvq_rng r;
        kvq_rng_init(&r, seed, 0, 0, KVQ_STREAM_QUERIES);
        for (int i = 0; i < T; i++) p[i] = i;
        for (size_t i = 0; i < n; i++) {
            size_t j = i + (size_t)kvq_rng_below(&r, (uint64_t)T - i);
            int t = p[i];
            p[i] = p[j], p[j] = t;
        }
        qsort(p, n, sizeof *p, cmp_int);
        break;
    }
    }
    *pos = p;
    *npos = n;
    return KVQ_OK;
}
