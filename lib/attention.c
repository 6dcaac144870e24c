/* attention.c — attention metrics of one KV head (SPEC §4): scores S = QKᵀ/√D
 * over causal rows, stable softmax A, outputs O = A·V, compared between the
 * exact K/V and each quantizer's K'/V'.
 *
 * kvq_attention_head: the score and output products go through cblas_sgemm
 * in chunks of query rows (memory bounded by chunk × T), and the exact side
 * is computed once per chunk for all quantizers.
 * kvq_attention_head_ref: the definition, with plain loops, used by tests. */
#include "internal.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

/* Per-row summary of a softmax over the causal prefix. */
typedef struct {
    float m;     /* max score */
    double lse;  /* log Σ exp(s − m) */
    int argmax;  /* first index of the max */
} row_stats;

/* Scales the causal prefix s[0..p] (division by `scale`, skipped when 1),
 * writes a[0..p] = softmax, a[p+1..ncol) = 0, and returns the row stats. */
static row_stats softmax_row(float *s, float *a, int p, int ncol, float scale, int prescaled)
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

enum { W_QC, W_S, W_A, W_O, W_SQ, W_AQ, W_OV, W_OJ, W_COUNT };

kvq_status kvq_attention_head(const float *Q, int G, const float *K, const float *V, int T, int D,
                              int query_prescaled, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err)
{
    if (npos == 0) return KVQ_OK;
    const float scale = sqrtf((float)D);
    /* rows per chunk: keep each score matrix near 1 M floats */
    size_t chunk = ((size_t)1 << 20) / (size_t)T;
    if (chunk < 1) chunk = 1;
    if (chunk > npos) chunk = npos;
    size_t sizes[W_COUNT] = {chunk * D, chunk * T, chunk * T, chunk * D,
                             chunk * T, chunk * T, chunk * D, chunk * D};
    float *w[W_COUNT] = {0};
    row_stats *rs = kvq_alloc_array(chunk, sizeof *rs), *rq = kvq_alloc_array(chunk, sizeof *rq);
    int ok = rs && rq;
    for (int i = 0; i < W_COUNT && ok; i++) ok = (w[i] = kvq_alloc_array(sizes[i], sizeof(float))) != NULL;
    if (!ok) {
        for (int i = 0; i < W_COUNT; i++) free(w[i]);
        free(rs), free(rq);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for attention workspace (%zu rows x %d)", chunk, T);
    }
    float *Qc = w[W_QC], *S = w[W_S], *A = w[W_A], *O = w[W_O];
    float *Sq = w[W_SQ], *Aq = w[W_AQ], *Ov = w[W_OV], *Oj = w[W_OJ];

    for (int j = 0; j < G; j++) {
        const float *Qj = Q + (size_t)j * T * D;
        for (size_t r0 = 0; r0 < npos; r0 += chunk) {
            int nc = (int)(npos - r0 < chunk ? npos - r0 : chunk);
            const int *p = pos + r0;
            int ncol = p[nc - 1] + 1; /* positions ascend: the last row sees the most keys */
            for (int i = 0; i < nc; i++) memcpy(Qc + (size_t)i * D, Qj + (size_t)p[i] * D, (size_t)D * sizeof(float));

            /* exact side: S = Qc·Kᵀ, A = softmax, O = A·V */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nc, ncol, D, 1.0f, Qc, D, K, D, 0.0f, S, ncol);
            double s_ref2 = 0, a_ref2 = 0, o_ref2 = 0;
            for (int i = 0; i < nc; i++) {
                float *srow = S + (size_t)i * ncol, *arow = A + (size_t)i * ncol;
                rs[i] = softmax_row(srow, arow, p[i], ncol, scale, query_prescaled);
                for (int u = 0; u <= p[i]; u++) {
                    s_ref2 += (double)srow[u] * srow[u];
                    a_ref2 += (double)arow[u] * arow[u];
                }
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nc, D, ncol, 1.0f, A, ncol, V, D, 0.0f, O, D);
            for (size_t i = 0; i < (size_t)nc * D; i++) o_ref2 += (double)O[i] * O[i];

            for (int q = 0; q < nquant; q++) {
                kvq_attn_acc *ac = &acc[q];
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nc, ncol, D, 1.0f, Qc, D, Kq[q], D, 0.0f, Sq, ncol);
                for (int i = 0; i < nc; i++) {
                    float *srow = S + (size_t)i * ncol, *sqrow = Sq + (size_t)i * ncol;
                    float *arow = A + (size_t)i * ncol, *aqrow = Aq + (size_t)i * ncol;
                    rq[i] = softmax_row(sqrow, aqrow, p[i], ncol, scale, query_prescaled);
                    ac->s_diff2 += sq_diff(srow, sqrow, (size_t)p[i] + 1, NULL);
                    ac->a_diff2 += sq_diff(arow, aqrow, (size_t)p[i] + 1, NULL);
                    ac->kl_sum += kl_row(arow, srow, rs[i], sqrow, rq[i], p[i]);
                    ac->top1_same += rs[i].argmax == rq[i].argmax;
                }
                /* A·V' (exact attention, quantized values) and A'·V' (both) */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nc, D, ncol, 1.0f, A, ncol, Vq[q], D, 0.0f, Ov, D);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nc, D, ncol, 1.0f, Aq, ncol, Vq[q], D, 0.0f, Oj, D);
                ac->o_diff2 += sq_diff(O, Ov, (size_t)nc * D, NULL);
                ac->o_joint_diff2 += sq_diff(O, Oj, (size_t)nc * D, NULL);
                ac->s_ref2 += s_ref2;
                ac->a_ref2 += a_ref2;
                ac->o_ref2 += o_ref2;
                ac->rows += nc;
            }
        }
    }
    for (int i = 0; i < W_COUNT; i++) free(w[i]);
    free(rs), free(rq);
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
                                  int D, int query_prescaled, const int *pos, size_t npos,
                                  int nquant, const float *const *Kq, const float *const *Vq,
                                  kvq_attn_acc *acc, kvq_error *err)
{
    float *s = kvq_alloc_array((size_t)T * 4, sizeof(float));
    float *o = kvq_alloc_array((size_t)D * 3, sizeof(float));
    if (!s || !o) {
        free(s), free(o);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    float *a = s + T, *sq = s + 2 * (size_t)T, *aq = s + 3 * (size_t)T;
    float *ov = o + D, *oj = o + 2 * D;
    for (int q = 0; q < nquant; q++) {
        kvq_attn_acc *ac = &acc[q];
        for (int j = 0; j < G; j++) {
            const float *Qj = Q + (size_t)j * T * D;
            for (size_t i = 0; i < npos; i++) {
                int p = pos[i];
                const float *qv = Qj + (size_t)p * D;
                scores_ref(qv, K, D, p, s);
                scores_ref(qv, Kq[q], D, p, sq);
                row_stats rs = softmax_row(s, a, p, p + 1, sqrtf((float)D), query_prescaled);
                row_stats rq = softmax_row(sq, aq, p, p + 1, sqrtf((float)D), query_prescaled);
                for (int u = 0; u <= p; u++) {
                    ac->s_ref2 += (double)s[u] * s[u];
                    ac->s_diff2 += ((double)s[u] - sq[u]) * ((double)s[u] - sq[u]);
                    ac->a_ref2 += (double)a[u] * a[u];
                    ac->a_diff2 += ((double)a[u] - aq[u]) * ((double)a[u] - aq[u]);
                }
                ac->kl_sum += kl_row(a, s, rs, sq, rq, p);
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
