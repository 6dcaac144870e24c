/* test_metrics.c — every metric of docs/metrics.md on hand-computed cases (one-hot
 * attention included), the BLAS path against the plain reference, query
 * positions, pooling, grouped-query mapping, thread-count invariance of
 * the whole analysis and a first stage taken from another spec of the run. */
#include "testutil.h"
#include "simd.h"

#include <string.h>
#include <unistd.h>

START_TEST(recon_hand_case)
{
    const float x[4] = {1, 2, 3, 4}, xq[4] = {1, 2, 3, 5};
    kvq_acc acc = {0};
    kvq_recon_accumulate(&acc.k, x, xq, 4);
    kvq_recon_accumulate_ref(&acc.v, x, x, 4);
    acc.k.bits = 8, acc.v.bits = 12;
    kvq_metrics m;
    kvq_metrics_finalize(&acc, &m);
    ck_assert(fabs(m.k_rel_fro - sqrt(1.0 / 30)) < 1e-15);
    ck_assert(fabs(m.k_rmse - 0.5) < 1e-15);
    ck_assert(fabs(m.k_mae - 0.25) < 1e-15);
    ck_assert(m.k_max_abs == 1.0);
    ck_assert(fabs(m.k_sqnr_db - 10 * log10(30.0)) < 1e-12);
    ck_assert(m.k_bits == 2.0 && m.v_bits == 3.0);
    ck_assert(m.v_rel_fro == 0.0 && isinf(m.v_sqnr_db));
    ck_assert(!m.has_attn);
}
END_TEST

START_TEST(recon_fast_equals_reference)
{
    size_t n = 10007;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    fill_normal(x, n, 1, 3.0);
    fill_normal(y, n, 2, 0.1);
    for (size_t i = 0; i < n; i++) y[i] += x[i];
    kvq_recon_acc a = {0}, b = {0};
    kvq_recon_accumulate(&a, x, y, n);
    kvq_recon_accumulate_ref(&b, x, y, n);
    ck_assert(a.n == b.n && a.max_abs == b.max_abs);
    kvq_recon_acc c = {0}; /* the portable optimised path too */
    kvq_simd_force(0);
    kvq_recon_accumulate(&c, x, y, n);
    kvq_simd_force(1);
    ck_assert(close_rel(c.sum_e2, b.sum_e2, 1e-12, 0) && c.max_abs == b.max_abs);
    ck_assert(close_rel(a.sum_x2, b.sum_x2, 1e-12, 0));
    ck_assert(close_rel(a.sum_e2, b.sum_e2, 1e-12, 0));
    ck_assert(close_rel(a.sum_abs_e, b.sum_abs_e, 1e-12, 0));
    free(x), free(y);
}
END_TEST

/* The sums of many outputs of the same x at once (x read once for four)
 * equal one call each, to the bit, onto sums that already hold something,
 * for 1 to 9 outputs (groups of 4, 3 and 2 and a single), a length that
 * ends in a partial vector, at every SIMD level. */
START_TEST(recon_many_equals_one_by_one)
{
    enum { M = 9 };
    size_t n = 4103;
    float *x = malloc(n * sizeof *x), *y[M];
    fill_normal(x, n, 11, 3.0);
    for (int i = 0; i < M; i++) {
        y[i] = malloc(n * sizeof *y[i]);
        fill_normal(y[i], n, 12 + (uint64_t)i, 0.05 * (i + 1));
        for (size_t k = 0; k < n; k++) y[i][k] += x[k];
    }
    for (int level = KVQ_SIMD_NONE; level <= KVQ_SIMD_AVX512; level++)
        for (int m = 1; m <= M; m++) {
            kvq_simd_cap(level);
            kvq_recon_acc many[M], one[M], *pm[M];
            for (int i = 0; i < m; i++) {
                many[i] = one[i] = (kvq_recon_acc){.n = 7,
                                                   .sum_x2 = 1.25 * i,
                                                   .sum_e2 = 0.5,
                                                   .sum_abs_e = 0.1 * i,
                                                   .max_abs = i == 3 ? 100.0 : 0.0,
                                                   .bits = 3};
                pm[i] = &many[i];
                kvq_recon_accumulate(&one[i], x, y[i], n);
            }
            kvq_recon_accumulate_many(pm, x, (const float *const *)y, m, n);
            for (int i = 0; i < m; i++)
                ck_assert_msg(!memcmp(&many[i], &one[i], sizeof one[i]),
                              "level %d, %d outputs, output %d: e2 %.17g vs %.17g, x2 %.17g vs %.17g", level, m, i,
                              many[i].sum_e2, one[i].sum_e2, many[i].sum_x2, one[i].sum_x2);
        }
    kvq_simd_cap(-1);
    free(x);
    for (int i = 0; i < M; i++) free(y[i]);
}
END_TEST

START_TEST(pooling_sums_not_ratios)
{
    kvq_acc a = {0}, b = {0}, p = {0};
    a.k = (kvq_recon_acc){.n = 10, .sum_x2 = 100, .sum_e2 = 1, .sum_abs_e = 2, .max_abs = 0.5, .bits = 40};
    b.k = (kvq_recon_acc){.n = 30, .sum_x2 = 100, .sum_e2 = 9, .sum_abs_e = 6, .max_abs = 0.9, .bits = 60};
    a.v = a.k, b.v = b.k;
    a.has_attn = b.has_attn = 1;
    a.attn = (kvq_attn_acc){.rows = 2,
                            .s_ref2 = 4,
                            .s_diff2 = 1,
                            .a_ref2 = 1,
                            .a_diff2 = 0.25,
                            .kl_sum = 0.2,
                            .top1_same = 2,
                            .o_ref2 = 1,
                            .o_diff2 = 0.01,
                            .o_joint_diff2 = 0.04};
    b.attn = (kvq_attn_acc){.rows = 6,
                            .s_ref2 = 12,
                            .s_diff2 = 0,
                            .a_ref2 = 3,
                            .a_diff2 = 0,
                            .kl_sum = 0.6,
                            .top1_same = 3,
                            .o_ref2 = 3,
                            .o_diff2 = 0,
                            .o_joint_diff2 = 0};
    kvq_acc_merge(&p, &a);
    kvq_acc_merge(&p, &b);
    kvq_metrics m;
    kvq_metrics_finalize(&p, &m);
    ck_assert(fabs(m.k_rel_fro - sqrt(10.0 / 200)) < 1e-15);
    ck_assert(fabs(m.k_rmse - sqrt(10.0 / 40)) < 1e-15);
    ck_assert(fabs(m.k_mae - 8.0 / 40) < 1e-15);
    ck_assert(m.k_max_abs == 0.9 && m.k_bits == 100.0 / 40);
    ck_assert(fabs(m.score_rel - sqrt(1.0 / 16)) < 1e-15);
    ck_assert(fabs(m.attn_rel - sqrt(0.25 / 4)) < 1e-15);
    ck_assert(fabs(m.attn_kl - 0.8 / 8) < 1e-15);
    ck_assert(fabs(m.attn_top1 - 5.0 / 8) < 1e-15);
    ck_assert(fabs(m.out_rel - sqrt(0.01 / 4)) < 1e-15);
    ck_assert(fabs(m.out_rel_joint - sqrt(0.04 / 4)) < 1e-15);
}
END_TEST

/* One query at t = 2 that sees three keys; K' moves the peak from key 0 to
 * key 1.  Scores are 100 apart, so A and A' are one-hot to float precision. */
START_TEST(attention_one_hot)
{
    const float Q[3 * 2] = {0, 0, 0, 0, 100, 0};
    const float K[3 * 2] = {1, 0, 0, 0, 0, 1};
    const float Kq[3 * 2] = {0, 0, 1, 0, 0, 1};
    const float V[3 * 2] = {1, 2, 3, 4, 5, 6};
    const int pos[1] = {2};
    const float *kq[1] = {Kq}, *vq[1] = {V};
    for (int ref = 0; ref < 2; ref++) {
        kvq_attn_acc a = {0};
        kvq_error err = {0};
        /* query_prescaled = 1: no division by sqrt(D) */
        ck_assert_int_eq((ref ? kvq_attention_head_ref : kvq_attention_head)(
                             Q, 1, K, V, 3, 2, (kvq_attn_mode){.prescaled = 1}, pos, 1, 1, kq, vq, &a, &err),
                         KVQ_OK);
        kvq_acc acc = {.has_attn = 1, .attn = a, .k = {.n = 1, .sum_x2 = 1}, .v = {.n = 1, .sum_x2 = 1}};
        kvq_metrics m;
        kvq_metrics_finalize(&acc, &m);
        ck_assert(fabs(m.score_rel - sqrt(2.0)) < 1e-6);
        ck_assert(fabs(m.attn_rel - sqrt(2.0)) < 1e-6);
        ck_assert(fabs(m.attn_kl - 100.0) < 1e-4); /* KL = log A(0) − log A'(0) = 0 − (−100) */
        ck_assert(m.attn_top1 == 0.0);
        ck_assert(fabs(m.out_rel) < 1e-7);                          /* V' = V */
        ck_assert(fabs(m.out_rel_joint - sqrt(8.0 / 5.0)) < 1e-6); /* [3,4] vs [1,2] */
    }
    /* with division by sqrt(D) = sqrt(2): scores 100/√2 — still one-hot */
    kvq_attn_acc a = {0};
    kvq_attention_head(Q, 1, K, V, 3, 2, (kvq_attn_mode){0}, pos, 1, 1, kq, vq, &a, NULL);
    ck_assert(fabs(a.kl_sum - 100.0 / sqrtf(2.0f)) < 1e-3);
}
END_TEST

START_TEST(attention_identical_is_zero)
{
    int T = 40, D = 16, G = 2;
    float *Q = malloc((size_t)G * T * D * sizeof *Q), *K = malloc((size_t)T * D * 4), *V = malloc((size_t)T * D * 4);
    fill_normal(Q, (size_t)G * T * D, 1, 1);
    fill_normal(K, (size_t)T * D, 2, 1);
    fill_normal(V, (size_t)T * D, 3, 1);
    int pos[5] = {0, 1, 17, 38, 39};
    const float *kq[1] = {K}, *vq[1] = {V};
    kvq_attn_acc a = {0};
    kvq_attention_head(Q, G, K, V, T, D, (kvq_attn_mode){0}, pos, 5, 1, kq, vq, &a, NULL);
    ck_assert(a.rows == 10 && a.top1_same == 10);
    ck_assert(a.s_diff2 == 0 && a.a_diff2 == 0 && a.kl_sum == 0 && a.o_diff2 == 0 && a.o_joint_diff2 == 0);
    ck_assert(a.s_ref2 > 0 && a.a_ref2 > 0 && a.o_ref2 > 0);
    free(Q), free(K), free(V);
}
END_TEST

/* The chunked BLAS path equals the plain reference on random data, with
 * row chunks (T large enough that one chunk cannot hold all rows). */
START_TEST(attention_blas_equals_reference)
{
    const int cases[][3] = {{5, 3, 1}, {64, 8, 2}, {300, 24, 3}, {5000, 4, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int T = cases[c][0], D = cases[c][1], G = cases[c][2];
        size_t n = (size_t)T * D;
        float *Q = malloc(G * n * 4), *K = malloc(n * 4), *V = malloc(n * 4), *K2 = malloc(n * 4), *V2 = malloc(n * 4);
        fill_normal(Q, G * n, 10 + c, 1.5);
        fill_normal(K, n, 20 + c, 1);
        fill_normal(V, n, 30 + c, 1);
        fill_normal(K2, n, 40 + c, 0.2);
        fill_normal(V2, n, 50 + c, 0.2);
        for (size_t i = 0; i < n; i++) K2[i] += K[i], V2[i] += V[i];
        int *pos = malloc((size_t)T * sizeof *pos);
        for (int i = 0; i < T; i++) pos[i] = i;
        const float *kq[2] = {K2, K}, *vq[2] = {V2, V2};
        kvq_attn_acc b[2] = {0};
        kvq_attention_head_ref(Q, G, K, V, T, D, (kvq_attn_mode){0}, pos, (size_t)T, 2, kq, vq, b, NULL);
        /* the SIMD rows where the CPU has them (AVX-512 or AVX2), then the portable ones */
        for (int mode = 0; mode < 2; mode++) {
        kvq_attn_acc a[2] = {0};
        kvq_simd_force(mode == 0);
        kvq_attention_head(Q, G, K, V, T, D, (kvq_attn_mode){0}, pos, (size_t)T, 2, kq, vq, a, NULL);
        kvq_simd_force(1);
        for (int q = 0; q < 2; q++) {
            ck_assert(a[q].rows == b[q].rows);
            ck_assert(close_rel(a[q].s_ref2, b[q].s_ref2, 1e-5, 0));
            ck_assert(close_rel(a[q].s_diff2, b[q].s_diff2, 1e-4, 1e-12));
            ck_assert(close_rel(a[q].a_ref2, b[q].a_ref2, 1e-5, 0));
            ck_assert(close_rel(a[q].a_diff2, b[q].a_diff2, 1e-4, 1e-12));
            ck_assert(close_rel(a[q].kl_sum, b[q].kl_sum, 1e-3, 1e-9));
            ck_assert(fabs(a[q].top1_same - b[q].top1_same) <= 0.001 * a[q].rows + 1);
            ck_assert(close_rel(a[q].o_ref2, b[q].o_ref2, 1e-5, 0));
            ck_assert(close_rel(a[q].o_diff2, b[q].o_diff2, 1e-4, 1e-12));
            ck_assert(close_rel(a[q].o_joint_diff2, b[q].o_joint_diff2, 1e-4, 1e-12));
        }
        }
        free(Q), free(K), free(V), free(K2), free(V2), free(pos);
    }
}
END_TEST

/* A model's attention (docs/dump-format.md), worked by hand: with a window of 1 each
 * row attends to itself only, so A = A' = 1 on the diagonal whatever K'
 * does (attn_rel 0, KL 0, top-1 all kept) and the output is the row's own
 * value (out_rel = |V − V'| over the rows); the scores compared are the
 * diagonal ones, scale·q·k soft-capped: c·tanh(s/c). */
START_TEST(attention_window_one_by_hand)
{
    const float Q[3 * 2] = {1, 0, 0, 2, 1, 1};
    const float K[3 * 2] = {2, 0, 0, 1, 3, 0}, Kq[3 * 2] = {1, 0, 0, 3, 3, 3};
    const float V[3 * 2] = {1, 0, 0, 1, 1, 1}, Vq[3 * 2] = {1, 0, 0, 2, 1, 1};
    const int pos[3] = {0, 1, 2};
    const float *kq[1] = {Kq}, *vq[1] = {Vq};
    kvq_attn_mode mode = {.scale = 0.5f, .softcap = 2.0f, .window = 1};
    /* diagonal scores: q·k = 2, 2, 3 (exact) and 1, 6, 6 (quantized); x 0.5, then 2·tanh(x/2) */
    double se[3] = {2 * tanh(0.5), 2 * tanh(0.5), 2 * tanh(0.75)},
           sq[3] = {2 * tanh(0.25), 2 * tanh(1.5), 2 * tanh(1.5)};
    double s_ref2 = 0, s_diff2 = 0;
    for (int i = 0; i < 3; i++) s_ref2 += se[i] * se[i], s_diff2 += (se[i] - sq[i]) * (se[i] - sq[i]);
    for (int ref = 0; ref < 2; ref++) {
        kvq_attn_acc a = {0};
        kvq_error err = {0};
        ck_assert_int_eq(
            (ref ? kvq_attention_head_ref : kvq_attention_head)(Q, 1, K, V, 3, 2, mode, pos, 3, 1, kq, vq, &a, &err),
            KVQ_OK);
        ck_assert(a.rows == 3 && a.top1_same == 3 && a.a_diff2 == 0 && a.kl_sum == 0 && a.a_ref2 == 3);
        ck_assert_msg(fabs(a.s_ref2 - s_ref2) < 1e-5 && fabs(a.s_diff2 - s_diff2) < 1e-5, "scores %g %g, by hand %g %g",
                      a.s_ref2, a.s_diff2, s_ref2, s_diff2);
        ck_assert(fabs(a.o_ref2 - 4.0) < 1e-6 && fabs(a.o_diff2 - 1.0) < 1e-6); /* only V[1] moved, by 1 */
    }
    /* the same dump without the window: rows see earlier keys and the attention moves */
    kvq_attn_acc b = {0};
    kvq_attention_head(Q, 1, K, V, 3, 2, (kvq_attn_mode){.scale = 0.5f, .softcap = 2.0f}, pos, 3, 1, kq, vq, &b, NULL);
    ck_assert(b.a_diff2 > 1e-3 && b.kl_sum > 1e-4);
}
END_TEST

/* Windows, another scale, a soft-cap and prescaled queries: the chunked
 * BLAS path (at every SIMD level) and the cached exact side equal the
 * plain reference, and the plain mode (scale 1/sqrt(D), given or not) is
 * bit for bit the default. */
START_TEST(attention_modes_equal_reference)
{
    const kvq_attn_mode modes[] = {{.window = 7}, {.scale = 0.11f}, {.softcap = 3.0f, .scale = 0.3f},
                                   {.prescaled = 1, .softcap = 2.5f, .window = 33}, {.window = 1}, {.window = 5000}};
    int T = 300, D = 16, G = 2;
    size_t n = (size_t)T * D;
    float *Q = malloc(G * n * 4), *K = malloc(n * 4), *V = malloc(n * 4), *K2 = malloc(n * 4), *V2 = malloc(n * 4);
    fill_normal(Q, G * n, 61, 1.5);
    fill_normal(K, n, 62, 1);
    fill_normal(V, n, 63, 1);
    fill_normal(K2, n, 64, 0.2);
    fill_normal(V2, n, 65, 0.2);
    for (size_t i = 0; i < n; i++) K2[i] += K[i], V2[i] += V[i];
    int pos[40];
    for (int i = 0; i < 40; i++) pos[i] = i * 7 + 6;
    const float *kq[2] = {K2, K}, *vq[2] = {V2, V2};
    for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
        kvq_attn_acc b[2] = {0}, c[2] = {0};
        kvq_attention_head_ref(Q, G, K, V, T, D, modes[mi], pos, 40, 2, kq, vq, b, NULL);
        kvq_attn_ref *r;
        ck_assert(kvq_attn_ref_new(Q, G, K, V, T, D, modes[mi], pos, 40, &r, NULL) == KVQ_OK);
        ck_assert(kvq_attn_ref_compare(r, 2, kq, vq, c, NULL) == KVQ_OK);
        kvq_attn_ref_free(r);
        for (int simd = 0; simd < 2; simd++) {
            kvq_attn_acc a[2] = {0};
            kvq_simd_force(simd == 0);
            kvq_attention_head(Q, G, K, V, T, D, modes[mi], pos, 40, 2, kq, vq, a, NULL);
            kvq_simd_force(1);
            for (int q = 0; q < 2; q++) {
                ck_assert(a[q].rows == b[q].rows &&
                          (simd || !memcmp(&a[q], &c[q], sizeof a[q]))); /* cached == streamed */
                ck_assert_msg(
                    close_rel(a[q].s_ref2, b[q].s_ref2, 1e-5, 0) && close_rel(a[q].s_diff2, b[q].s_diff2, 1e-4, 1e-12),
                    "mode %zu: scores %g / %g vs %g / %g", mi, a[q].s_ref2, a[q].s_diff2, b[q].s_ref2, b[q].s_diff2);
                ck_assert(close_rel(a[q].a_ref2, b[q].a_ref2, 1e-5, 0) &&
                          close_rel(a[q].a_diff2, b[q].a_diff2, 1e-4, 1e-12));
                ck_assert_msg(close_rel(a[q].kl_sum, b[q].kl_sum, 1e-3, 1e-9), "mode %zu: kl %g vs %g", mi, a[q].kl_sum,
                              b[q].kl_sum);
                ck_assert(fabs(a[q].top1_same - b[q].top1_same) <= 1);
                ck_assert(close_rel(a[q].o_ref2, b[q].o_ref2, 1e-5, 0) &&
                          close_rel(a[q].o_diff2, b[q].o_diff2, 1e-4, 1e-12));
                ck_assert(close_rel(a[q].o_joint_diff2, b[q].o_joint_diff2, 1e-4, 1e-12));
            }
        }
    }
    /* a window past every position, or scale given as 1/sqrt(D): the default, bit for bit */
    kvq_attn_acc d[2] = {0}, e[2] = {0}, f[2] = {0};
    kvq_attention_head(Q, G, K, V, T, D, (kvq_attn_mode){0}, pos, 40, 2, kq, vq, d, NULL);
    kvq_attention_head(Q, G, K, V, T, D, (kvq_attn_mode){.scale = 0.25f}, pos, 40, 2, kq, vq, e, NULL);
    kvq_attention_head(Q, G, K, V, T, D, (kvq_attn_mode){.window = 5000}, pos, 40, 2, kq, vq, f, NULL);
    ck_assert(!memcmp(d, e, sizeof d));
    ck_assert(d[0].s_ref2 > 0 && close_rel(f[0].kl_sum, d[0].kl_sum, 1e-6, 1e-12) && f[0].top1_same == d[0].top1_same);
    free(Q), free(K), free(V), free(K2), free(V2);
}
END_TEST

/* One workspace kept from call to call, as the driver keeps a thread's:
 * each product of a quantizer's scores adds onto a block the previous
 * comparison left zero row by row.  Streamed and cached calls one after
 * the other, with a window, dropped keys, several row chunks whose columns
 * grow, fewer columns and a workspace that grows: every call's sums equal
 * those of the same call on a fresh workspace, to the bit, and so do those
 * of kvq_attention_rows_ws_more after it (the exact side kept or not). */
START_TEST(workspace_reuse_equals_fresh)
{
    enum { TMAX = 2100, D = 16, G = 2, NPMAX = 600 };
    const int Ts[] = {300, 2100, 900, 2100, 300, 900, 2100, 300};
    float *Qr = malloc((size_t)G * NPMAX * D * 4), *K = malloc(TMAX * D * 4), *V = malloc(TMAX * D * 4);
    float *K2 = malloc(TMAX * D * 4), *V2 = malloc(TMAX * D * 4);
    unsigned char keep[TMAX];
    fill_normal(Qr, (size_t)G * NPMAX * D, 71, 1.5);
    fill_normal(K, TMAX * D, 72, 1), fill_normal(V, TMAX * D, 73, 1);
    fill_normal(K2, TMAX * D, 74, 0.3), fill_normal(V2, TMAX * D, 75, 0.3);
    for (int i = 0; i < TMAX * D; i++) K2[i] += K[i], V2[i] += V[i];
    for (int t = 0; t < TMAX; t++) keep[t] = t % 5 != 2;
    const float *kq[2] = {K2, K2}, *vq[2] = {V2, V};
    const unsigned char *mq[2] = {keep, NULL};
    kvq_attn_ws *ws = kvq_attn_ws_new();
    int pos[NPMAX];
    for (size_t c = 0; c < sizeof Ts / sizeof Ts[0]; c++) {
        int T = Ts[c], npos = T == 2100 ? NPMAX : T / 8, cached = c % 3 == 1, masked = c % 4 == 3;
        for (int i = 0; i < npos; i++) pos[i] = T - 1 - (npos - 1 - i) * (T / npos); /* ascending, last row T-1 */
        kvq_attn_mode mode = c % 2 ? (kvq_attn_mode){.window = 9} : (kvq_attn_mode){0};
        kvq_attn_acc a[2] = {0}, b[2] = {0}, m[2] = {0};
        kvq_error err = {0};
        if (cached) {
            kvq_attn_ref *r;
            ck_assert(kvq_attn_ref_new_rows(Qr, G, K, V, T, D, mode, pos, npos, &r, &err) == KVQ_OK);
            ck_assert(kvq_attn_ref_compare_ws(r, 2, kq, vq, masked ? mq : NULL, a, ws, &err) == KVQ_OK);
            ck_assert(kvq_attn_ref_compare_masked(r, 2, kq, vq, masked ? mq : NULL, b, &err) == KVQ_OK);
            kvq_attn_ref_free(r);
        } else {
            ck_assert(kvq_attention_rows_ws(Qr, G, K, V, T, D, mode, pos, npos, 2, kq, vq, masked ? mq : NULL, a, ws,
                                            &err) == KVQ_OK);
            ck_assert(kvq_attention_rows_masked(Qr, G, K, V, T, D, mode, pos, npos, 2, kq, vq, masked ? mq : NULL, b,
                                                &err) == KVQ_OK);
        }
        /* more quantizers of the same head: the exact side kept where it fits one chunk,
         * computed again where it does not or a cached call overwrote it */
        ck_assert(kvq_attention_rows_ws_more(Qr, G, K, V, T, D, mode, pos, npos, 2, kq, vq, masked ? mq : NULL, m, ws,
                                             &err) == KVQ_OK);
        for (int q = 0; q < 2; q++) {
            ck_assert(a[q].rows == (double)G * npos && a[q].s_diff2 > 0);
            ck_assert_msg(!memcmp(&a[q], &b[q], sizeof a[q]) && !memcmp(&m[q], &b[q], sizeof m[q]),
                          "call %zu (T %d, %s%s), quantizer %d: %.17g vs %.17g (more: %.17g)", c, T,
                          cached ? "cached" : "streamed", masked ? ", dropped keys" : "", q, a[q].s_diff2, b[q].s_diff2,
                          m[q].s_diff2);
        }
    }
    /* a cached call between a streamed one and its more: its scores overwrote the kept exact side */
    int npos = 37, T = 300;
    for (int i = 0; i < npos; i++) pos[i] = T - 1 - (npos - 1 - i) * 8;
    kvq_attn_acc a[2] = {0}, b[2] = {0}, m[2] = {0};
    kvq_attn_ref *r;
    kvq_error err = {0};
    ck_assert(kvq_attention_rows_ws(Qr, G, K, V, T, D, (kvq_attn_mode){0}, pos, npos, 2, kq, vq, NULL, a, ws, &err) ==
              KVQ_OK);
    ck_assert(kvq_attn_ref_new_rows(Qr, G, K2, V2, T, D, (kvq_attn_mode){0}, pos, npos, &r, &err) == KVQ_OK);
    ck_assert(kvq_attn_ref_compare_ws(r, 2, kq, vq, NULL, b, ws, &err) == KVQ_OK);
    kvq_attn_ref_free(r);
    ck_assert(kvq_attention_rows_ws_more(Qr, G, K, V, T, D, (kvq_attn_mode){0}, pos, npos, 2, kq, vq, NULL, m, ws,
                                         &err) == KVQ_OK);
    for (int q = 0; q < 2; q++)
        ck_assert_msg(!memcmp(&a[q], &m[q], sizeof a[q]), "more after a cached call, quantizer %d", q);
    kvq_attn_ws_free(ws);
    free(Qr), free(K), free(V), free(K2), free(V2);
}
END_TEST

/* A quantizer whose K' equals the one before's (KIVI's keys are
 * per-channel's) reuses that one's scores and softmax: its sums equal those
 * of the same quantizer compared alone, to the bit, streamed and cached, at
 * every SIMD level, with two row chunks (head by head) or one (two query
 * heads a product), with and without a window; the same K' by another
 * buffer (compared) or the same buffer, a
 * K' equal to an earlier but not the previous one's, and one that differs
 * from the previous one only in the last key. */
START_TEST(same_keys_equal_alone)
{
    enum { T = 2100, D = 16, G = 2, NPOS = 600, NQ = 6 };
    size_t n = (size_t)T * D;
    float *Qr = malloc((size_t)G * NPOS * D * 4), *K = malloc(n * 4), *V = malloc(n * 4);
    float *K2 = malloc(n * 4), *K2c = malloc(n * 4), *K3 = malloc(n * 4), *K4 = malloc(n * 4), *V2 = malloc(n * 4);
    fill_normal(Qr, (size_t)G * NPOS * D, 81, 1.5);
    fill_normal(K, n, 82, 1), fill_normal(V, n, 83, 1);
    fill_normal(K2, n, 84, 0.3), fill_normal(K3, n, 85, 0.2), fill_normal(V2, n, 86, 0.3);
    for (size_t i = 0; i < n; i++) K2[i] += K[i], K3[i] += K[i], V2[i] += V[i];
    memcpy(K2c, K2, n * 4), memcpy(K4, K2, n * 4);
    K4[n - 1] += 1.0f; /* the last key: seen by the second row chunk only */
    /* 1 repeats 0's keys (another buffer), 3 repeats 2's (the same buffer), 4 repeats 1's past 3, 5 is 4's
     * but for the last key */
    const float *kq[NQ] = {K2, K2c, K3, K3, K2, K4}, *vq[NQ] = {V2, V, V, V2, V2, V};
    int pos[NPOS];
    const kvq_attn_mode modes[] = {{0}, {.window = 300}};
    for (int level = KVQ_SIMD_NONE; level <= KVQ_SIMD_AVX512; level++)
        for (int mc = 0; mc < 4; mc++)
            for (int cached = 0; cached < 2; cached++) {
                int mi = mc % 2, npos = mc < 2 ? NPOS : 64; /* 600 rows: two chunks; 64: one, both heads at once */
                for (int i = 0; i < npos; i++) pos[i] = T - 1 - (npos - 1 - i) * 3;
                kvq_simd_cap(level);
                kvq_attn_acc all[NQ] = {0};
                kvq_attn_ref *r = NULL;
                if (cached) {
                    ck_assert(kvq_attn_ref_new_rows(Qr, G, K, V, T, D, modes[mi], pos, npos, &r, NULL) == KVQ_OK);
                    ck_assert(kvq_attn_ref_compare(r, NQ, kq, vq, all, NULL) == KVQ_OK);
                } else {
                    ck_assert(kvq_attention_rows(Qr, G, K, V, T, D, modes[mi], pos, npos, NQ, kq, vq, all, NULL) ==
                              KVQ_OK);
                }
                for (int q = 0; q < NQ; q++) {
                    kvq_attn_acc alone = {0};
                    ck_assert((cached ? kvq_attn_ref_compare(r, 1, kq + q, vq + q, &alone, NULL)
                                      : kvq_attention_rows(Qr, G, K, V, T, D, modes[mi], pos, npos, 1, kq + q, vq + q,
                                                           &alone, NULL)) == KVQ_OK);
                    ck_assert(alone.rows == (double)G * npos && alone.s_diff2 > 0 && alone.kl_sum > 0);
                    ck_assert_msg(!memcmp(&all[q], &alone, sizeof alone),
                                  "level %d, mode %d, %d rows, %s, quantizer %d: s %.17g / %.17g, top1 %g / %g", level,
                                  mi, npos, cached ? "cached" : "streamed", q, all[q].s_diff2, alone.s_diff2,
                                  all[q].top1_same, alone.top1_same);
                }
                ck_assert(all[1].s_diff2 == all[0].s_diff2 && all[1].o_diff2 != all[0].o_diff2);
                kvq_attn_ref_free(r);
            }
    kvq_simd_cap(-1);
    free(Qr), free(K), free(V), free(K2), free(K2c), free(K3), free(K4), free(V2);
}
END_TEST

START_TEST(query_positions)
{
    kvq_query_sel s;
    kvq_error err = {0};
    int *p;
    size_t n;
    ck_assert_int_eq(kvq_query_sel_parse("last:3", &s, &err), KVQ_OK);
    kvq_query_positions(&s, 10, 0, &p, &n, &err);
    ck_assert(n == 3 && p[0] == 7 && p[2] == 9);
    free(p);
    kvq_query_sel_parse("last:64", &s, &err); /* clamped to T */
    kvq_query_positions(&s, 10, 0, &p, &n, &err);
    ck_assert(n == 10 && p[0] == 0);
    free(p);
    kvq_query_sel_parse("every:4", &s, &err);
    kvq_query_positions(&s, 10, 0, &p, &n, &err);
    ck_assert(n == 3 && p[0] == 0 && p[1] == 4 && p[2] == 8);
    free(p);
    kvq_query_sel_parse("all", &s, &err);
    kvq_query_positions(&s, 5, 0, &p, &n, &err);
    ck_assert(n == 5 && p[4] == 4);
    free(p);
    kvq_query_sel_parse("random:6", &s, &err);
    int *p2;
    size_t n2;
    kvq_query_positions(&s, 20, 7, &p, &n, &err);
    kvq_query_positions(&s, 20, 7, &p2, &n2, &err);
    ck_assert(n == 6 && n2 == 6 && !memcmp(p, p2, 6 * sizeof *p));
    for (size_t i = 1; i < n; i++) ck_assert(p[i] > p[i - 1] && p[i] < 20);
    free(p), free(p2);
    kvq_query_sel_parse("random:50", &s, &err);
    kvq_query_positions(&s, 20, 7, &p, &n, &err);
    ck_assert(n == 20 && p[19] == 19);
    free(p);
    const char *bad[] = {"last:0", "last:-1", "last:", "first:3", "every:x", "random:1.5", "last:+3"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_int_eq(kvq_query_sel_parse(bad[i], &s, &err), KVQ_ERR_USAGE);
}
END_TEST


static void analyze(const char *path, const char *const *texts, int ns, int threads, const char *q,
                    kvq_spec *specs, kvq_analysis *a)
{
    kvq_error err = {0};
    for (int i = 0; i < ns; i++) ck_assert_int_eq(kvq_spec_parse(texts[i], &specs[i], &err), KVQ_OK);
    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis_opts o = {.specs = specs, .nspecs = ns, .nthreads = threads};
    kvq_query_sel_parse(q, &o.queries, &err);
    ck_assert_msg(kvq_analyze_dump(d, &o, a, &err) == KVQ_OK, "%s", err.msg);
    kvq_dump_close(d);
}

/* Query head j reads KV head j / (Hq/H): the driver's per-head attention
 * sums equal the reference run query head by query head with that map. */
START_TEST(gqa_mapping)
{
    int L = 1, Hq = 6, H = 2, D = 8, T = 50, G = Hq / H;
    char *path = gen_dump(L, Hq, H, D, T, 3);
    const char *texts[1] = {"per-token:bits=2,group=4"};
    kvq_spec sp[1];
    kvq_analysis a;
    analyze(path, texts, 1, 2, "last:7", sp, &a);

    kvq_error err = {0};
    kvq_dump *d;
    kvq_dump_open(path, &d, &err);
    kvq_layer lay;
    ck_assert_int_eq(kvq_dump_read_layer(d, 0, KVQ_READ_QUERY, &lay, &err), KVQ_OK);
    size_t n = (size_t)H * T * D;
    float *kq = malloc(n * 4), *vq = malloc(n * 4);
    double kb[2], vb[2];
    kvq_quant_out qo = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb};
    kvq_quant_ctx ctx = {.nthreads = 1};
    kvq_quantize_layer(&sp[0], &ctx, &lay, &qo, &err);
    int pos[7];
    for (int i = 0; i < 7; i++) pos[i] = T - 7 + i;
    kvq_attn_acc ref[2] = {0};
    for (int j = 0; j < Hq; j++) {
        int h = j / G; /* GQA: h = j / (Hq / H) */
        size_t off = (size_t)h * T * D;
        const float *kqh[1] = {kq + off}, *vqh[1] = {vq + off};
        kvq_attention_head_ref(lay.query + (size_t)j * T * D, 1, lay.key + off, lay.value + off, T, D,
                               (kvq_attn_mode){0}, pos, 7, 1, kqh, vqh, &ref[h], &err);
    }
    for (int h = 0; h < H; h++) {
        const kvq_attn_acc *x = &a.acc[h].attn;
        ck_assert(a.acc[h].has_attn && x->rows == G * 7);
        ck_assert(close_rel(x->s_diff2, ref[h].s_diff2, 1e-4, 0));
        ck_assert(close_rel(x->o_joint_diff2, ref[h].o_joint_diff2, 1e-4, 0));
        ck_assert(close_rel(x->kl_sum, ref[h].kl_sum, 1e-3, 1e-9));
    }
    free(kq), free(vq);
    kvq_layer_free(&lay);
    kvq_dump_close(d);
    kvq_analysis_free(&a);
    unlink(path);
    free(path);
}
END_TEST

/* Same results, to the bit, for any thread count. */
START_TEST(threads_do_not_change_results)
{
    char *path = gen_dump(2, 8, 4, 16, 96, 9);
    const char *texts[4] = {"per-token:bits=2,span=layer", "kivi:bits=2,group=16,residual=32", "kcvt:bits=2,span=layer",
                            "absmax:bits=4,group=4"};
    kvq_spec sp[4];
    kvq_analysis a1, a3;
    analyze(path, texts, 4, 1, "random:20", sp, &a1);
    analyze(path, texts, 4, 3, "random:20", sp, &a3);
    ck_assert_int_eq(a1.nlayers * a1.nheads * a1.nspecs, 2 * 4 * 4);
    ck_assert_int_eq(memcmp(a1.acc, a3.acc, (size_t)32 * sizeof *a1.acc), 0);
    kvq_analysis_free(&a1);
    kvq_analysis_free(&a3);
    unlink(path);
    free(path);
}
END_TEST

/* A prepared dump (layers and exact attention cached, as kvq-sweep runs it)
 * gives accumulators identical to the bit to the streamed analysis, with
 * several row chunks per head (T = 2100: chunks of 499 rows) and a
 * selection of layers and heads; and its size estimate is not below what it
 * holds for the tensors. */
START_TEST(prepared_equals_streamed)
{
    char *path = gen_dump(3, 4, 2, 8, 2100, 5);
    const char *texts[3] = {"kivi:bits=2,group=32,residual=64", "per-token:bits=3,span=layer", "absmax:bits=4,group=8"};
    kvq_spec sp[3];
    kvq_error err = {0};
    for (int i = 0; i < 3; i++) ck_assert_int_eq(kvq_spec_parse(texts[i], &sp[i], &err), KVQ_OK);
    const char *sels[2] = {"all", "random:700"};
    int layers[2] = {2, 0}, heads[1] = {1};
    for (int k = 0; k < 2; k++) {
        kvq_dump *d;
        ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
        kvq_analysis_opts o = {.specs = sp, .nspecs = 3, .nthreads = 2, .seed = 7,
                               .layers = k ? layers : NULL, .nlayers = 2,
                               .heads = k ? heads : NULL, .nheads = 1};
        kvq_query_sel_parse(sels[k], &o.queries, &err);
        kvq_analysis a, b[3];
        ck_assert_msg(kvq_analyze_dump(d, &o, &a, &err) == KVQ_OK, "%s", err.msg);
        size_t bytes;
        kvq_prepared *p;
        ck_assert_int_eq(kvq_prepare_bytes(d, &o, 0, &bytes, &err), KVQ_OK);
        ck_assert(bytes >= (size_t)a.nlayers * 2 * 2 * 2100 * 8 * 4);
        ck_assert_msg(kvq_prepare_dump(d, &o, 0, &p, &err) == KVQ_OK, "%s", err.msg);
        /* one spec at a time, as the sweep does */
        for (int s = 0; s < 3; s++) {
            kvq_analysis_opts os = {.specs = &sp[s], .nspecs = 1, .nthreads = 1 + s % 2};
            ck_assert_msg(kvq_analyze_prepared(p, &os, &b[s], &err) == KVQ_OK, "%s", err.msg);
            ck_assert_int_eq(b[s].nlayers, a.nlayers);
            ck_assert_int_eq(b[s].nheads, a.nheads);
            for (int c = 0; c < a.nlayers * a.nheads; c++) {
                ck_assert(b[s].acc[c].has_attn);
                ck_assert_int_eq(memcmp(&b[s].acc[c], &a.acc[c * 3 + s], sizeof a.acc[0]), 0);
            }
            kvq_analysis_free(&b[s]);
        }
        if (k) ck_assert(a.layers[0] == 2 && a.heads[0] == 1 && a.acc[0].attn.rows == 2 * 700);
        else ck_assert(a.acc[0].attn.rows == 2 * 2100);
        kvq_prepared_free(p);
        kvq_analysis_free(&a);
        kvq_dump_close(d);
    }
    unlink(path);
    free(path);
}
END_TEST

/* fp8's and fp4's tensor scales come from the whole layer (layer_prepare):
 * run head by head in the metrics' loop, the driver computes them once a
 * layer and hands them to every head.  Each head's error sums equal those
 * of the same spec run over the layer at once (kvq_quantize_layer), to the
 * bit, with the specs side by side in one run. */
START_TEST(layer_state_by_head_equals_layer)
{
    enum { L = 2, Hq = 4, H = 2, D = 32, T = 96, NS = 3 };
    char *path = gen_dump(L, Hq, H, D, T, 17);
    const char *texts[NS] = {"fp8", "fp4:format=nvfp4,global=tensor", "fp8:format=e5m2,scale=channel"};
    kvq_spec sp[NS];
    kvq_analysis a;
    analyze(path, texts, NS, 2, "last:9", sp, &a);
    kvq_error err = {0};
    kvq_dump *d;
    ck_assert(kvq_dump_open(path, &d, &err) == KVQ_OK);
    float *kq = malloc((size_t)H * T * D * 4), *vq = malloc((size_t)H * T * D * 4);
    for (int li = 0; li < L; li++) {
        kvq_layer lay;
        ck_assert_int_eq(kvq_dump_read_layer(d, li, 0, &lay, &err), KVQ_OK);
        for (int s = 0; s < NS; s++) {
            ck_assert(kvq_spec_by_head(&sp[s], T, D));
            double kb[H], vb[H], sb[H] = {0};
            kvq_quant_out qo = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
            kvq_quant_ctx ctx = {.layer = li, .nthreads = 2};
            ck_assert_int_eq(kvq_quantize_layer(&sp[s], &ctx, &lay, &qo, &err), KVQ_OK);
            for (int h = 0; h < H; h++)
                for (int t = 0; t < 2; t++) {
                    kvq_recon_acc r = {0};
                    const kvq_recon_acc *got = t ? &a.acc[(li * H + h) * NS + s].v : &a.acc[(li * H + h) * NS + s].k;
                    size_t at = (size_t)h * T * D;
                    kvq_recon_accumulate(&r, (t ? lay.value : lay.key) + at, (t ? vq : kq) + at, (size_t)T * D);
                    ck_assert_msg(r.sum_e2 > 0 && r.sum_e2 == got->sum_e2 && r.sum_abs_e == got->sum_abs_e &&
                                      r.max_abs == got->max_abs && r.sum_x2 == got->sum_x2,
                                  "%s, layer %d head %d %s: head by head differs from the layer at once", texts[s], li,
                                  h, t ? "V" : "K");
                }
        }
        kvq_layer_free(&lay);
    }
    free(kq), free(vq);
    kvq_dump_close(d);
    kvq_analysis_free(&a);
    unlink(path);
    free(path);
}
END_TEST

/* turboquant's variant=prod starts with lloydmax at b − 1 bits: where the
 * run holds that spec too, before it, the driver hands its output over
 * (kvq_first_stages_taken counts each head's K and V) and turboquant's sums
 * are those of turboquant alone, to the bit (variant=mse: lloydmax at b
 * bits is all of it); another spec (other bits, another rotation or
 * codebook, after it) gives nothing. */
START_TEST(first_stage_from_the_run)
{
    int L = 2, Hq = 4, H = 2, D = 16, T = 120;
    char *path = gen_dump(L, Hq, H, D, T, 13);
    const struct {
        const char *with, *spec;
        int taken;
    } cases[] = {
        {"lloydmax:bits=2", "turboquant:bits=3", 1},
        {"lloydmax:bits=2,rotate=hadamard", "turboquant:bits=3,rotate=hadamard", 1},
        {"lloydmax:bits=1,rotate=none,codebook=sphere", "turboquant:bits=2,rotate=none", 1},
        {"lloydmax:bits=3", "turboquant:bits=3", 0},
        {"lloydmax:bits=2,rotate=hadamard", "turboquant:bits=3", 0},
        {"lloydmax:bits=2,codebook=gauss", "turboquant:bits=3", 0},
        {"lloydmax:bits=2", "turboquant:bits=2,variant=mse", 1},
        {"lloydmax:bits=2", "turboquant:bits=3,variant=mse", 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int after = 0; after < 2; after++) {
            const char *pair[2] = {after ? cases[c].spec : cases[c].with, after ? cases[c].with : cases[c].spec};
            kvq_spec sp[2], one[1];
            kvq_analysis a, b;
            unsigned long n0 = kvq_first_stages_taken();
            analyze(path, pair, 2, 2, "last:9", sp, &a);
            unsigned long taken = kvq_first_stages_taken() - n0;
            analyze(path, &cases[c].spec, 1, 1, "last:9", one, &b);
            ck_assert_msg(taken == (cases[c].taken && !after ? 2ul * L * H : 0ul), "%s then %s: %lu head tensors taken",
                          pair[0], pair[1], taken);
            for (int i = 0; i < L * H; i++)
                ck_assert_msg(!memcmp(&a.acc[i * 2 + !after], &b.acc[i], sizeof b.acc[i]),
                              "%s beside %s: head %d differs from it alone", cases[c].spec, cases[c].with, i);
            kvq_analysis_free(&a), kvq_analysis_free(&b);
        }
    unlink(path);
    free(path);
}
END_TEST

/* With at least twice as many threads as KV heads the driver splits each
 * head's specs into ranges, a task each (spec_groups): every spec's sums
 * equal those of one thread to the bit — head-by-head families, one with a
 * layer_prepare, a whole-layer family, a spec that drops tokens and one
 * that reads every query row.  Two threads on one head split the eight
 * specs 4 + 4, TurboQuant beside its stage-1 spec, which it takes; three
 * or four put them in different ranges, and TurboQuant quantizes stage 1
 * itself (no first stage taken) with the same sums. */
START_TEST(spec_ranges_equal_one_thread)
{
    int L = 2, Hq = 4, H = 1, D = 16, T = 130;
    char *path = gen_dump(L, Hq, H, D, T, 17);
    const char *texts[8] = {"lloydmax:bits=2",
                            "fp8",
                            "gear:rank=2,sparsity=0.1",
                            "turboquant:bits=3",
                            "tokens(knorm:keep=0.5; none; drop)",
                            "per-token:bits=3",
                            "tokens(snapkv:keep=0.25; per-token:bits=4; per-token:bits=2)",
                            "kivi:bits=2,group=16,residual=32"};
    kvq_spec sp[8];
    kvq_analysis a1, a;
    unsigned long n0 = kvq_first_stages_taken();
    analyze(path, texts, 8, 1, "last:11", sp, &a1);
    ck_assert_uint_eq(kvq_first_stages_taken() - n0, 2ul * L * H); /* one task per head: taken */
    for (int threads = 2; threads <= 4; threads++) {
        n0 = kvq_first_stages_taken();
        analyze(path, texts, 8, threads, "last:11", sp, &a);
        unsigned long taken = kvq_first_stages_taken() - n0;
        ck_assert_msg(threads == 2 ? taken == 2ul * L * H : taken == 0, "%d threads: %lu taken", threads, taken);
        ck_assert_int_eq(a.nlayers * a.nheads * a.nspecs, L * H * 8);
        for (int i = 0; i < L * H * 8; i++)
            ck_assert_msg(!memcmp(&a.acc[i], &a1.acc[i], sizeof a.acc[i]), "%d threads: %s on layer %d differs",
                          threads, texts[i % 8], i / 8);
        kvq_analysis_free(&a);
    }
    kvq_analysis_free(&a1);
    unlink(path);
    free(path);
}
END_TEST

/* A head's specs run head by head are quantized and compared in batches
 * (the driver's HEAD_BATCH of them, the exact attention kept from batch to
 * batch): each spec's sums equal its run alone, bit for bit.  Nine specs,
 * seven of them head by head, a first stage in the first batch taken by a
 * spec of the second; one thread and two. */
START_TEST(batches_equal_alone)
{
    int L = 2, Hq = 4, H = 2, D = 16, T = 130;
    char *path = gen_dump(L, Hq, H, D, T, 19);
    const char *texts[9] = {"lloydmax:bits=2",
                            "per-token:bits=3",
                            "fp8",
                            "gear:rank=2,sparsity=0.1",
                            "tokens(knorm:keep=0.5; none; drop)",
                            "kivi:bits=2,group=16,residual=32",
                            "per-channel:bits=2",
                            "tender",
                            "turboquant:bits=3"};
    kvq_spec sp[9];
    kvq_analysis all, one;
    for (int threads = 1; threads <= 2; threads++) {
        unsigned long n0 = kvq_first_stages_taken();
        analyze(path, texts, 9, threads, "last:11", sp, &all);
        ck_assert_uint_eq(kvq_first_stages_taken() - n0, 2ul * L * H); /* lloydmax's, batches apart */
        for (int s = 0; s < 9; s++) {
            analyze(path, texts + s, 1, threads, "last:11", sp, &one);
            for (int i = 0; i < L * H; i++)
                ck_assert_msg(!memcmp(&all.acc[(size_t)i * 9 + s], &one.acc[i], sizeof one.acc[i]),
                              "%d threads: %s on layer %d, head %d differs from its run alone", threads, texts[s],
                              i / H, i % H);
            kvq_analysis_free(&one);
        }
        kvq_analysis_free(&all);
    }
    unlink(path);
    free(path);
}
END_TEST

/* The vector exps of the AVX-512 and AVX2 softmaxes against expf: within 2
 * ulp over the whole range they are used on (x <= 0), denormal results
 * within 4 of the smallest denormal; and the two equal where both run. */
static void check_exp(void (*fn)(const float *, float *, size_t), const char *name, const float *x, float *y, int N)
{
    fn(x, y, (size_t)N);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        float e = expf(x[i]);
        if (e >= 1.17549435e-38f) {
            double ulps = fabs((double)y[i] - e) / (double)(nextafterf(e, INFINITY) - e);
            if (ulps > worst) worst = ulps;
            ck_assert_msg(ulps <= 2.0, "%s exp(%.9g): %.9g vs expf %.9g (%.1f ulp)", name, x[i], y[i], e, ulps);
        } else {
            ck_assert_msg(fabs((double)y[i] - e) <= 4 * 1.4e-45, "%s exp(%.9g): %g vs expf %g", name, x[i], y[i], e);
        }
    }
    printf("vector exp (%s): worst %.2f ulp against expf over [-110, 0]\n", name, worst);
}

START_TEST(vector_exp_accuracy)
{
    enum { N = (1 << 20) + 5 }; /* + a tail */
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y), *y2 = malloc(N * sizeof *y2);
    for (int i = 0; i < N; i++) x[i] = -110.0f * (float)i / (N - 1);
    x[1] = -0.0f, x[2] = -1e-30f, x[3] = -87.33655f, x[4] = -103.97208f, x[5] = -87.3365479f, x[6] = -100.5f;
    if (kvq_simd_active()) check_exp(kvq_exp_avx512, "AVX-512", x, y, N);
    else printf("vector exp: no AVX-512 here\n");
    if (kvq_simd_avx2_active()) {
        check_exp(kvq_exp_avx2, "AVX2", x, y2, N);
        if (kvq_simd_active()) ck_assert(!memcmp(y, y2, N * sizeof *y)); /* the same arithmetic */
    } else {
        printf("vector exp: no AVX2 + FMA here, the scalar expf path is the one in use\n");
    }
    free(x), free(y), free(y2);
}
END_TEST

/* One ISA's row functions, and whether this CPU runs them. */
typedef struct {
    const char *name;
    int (*active)(void);
    void (*softmax)(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled, float *m_out,
                    double *sum_out, int *argmax_out);
    void (*compare)(const float *s, const float *a, const float *sq, const float *aq, size_t n, double m,
                    double lse, double mq, double lseq, double *sd2, double *ad2, double *kl);
    kvq_softmax_compare_fn *fused;
} row_isa;

static const row_isa row_isas[] = {
    {"AVX2", kvq_simd_avx2_active, kvq_softmax_avx2, kvq_row_compare_avx2, kvq_softmax_compare_avx2},
    {"AVX-512", kvq_simd_active, kvq_softmax_avx512, kvq_row_compare_avx512, kvq_softmax_compare_avx512},
};

/* Vector rows, per ISA: the softmax's fused arg-max is the first index of
 * the max (ties planted across lanes and vectors), and the fused softmax +
 * comparison gives bit for bit what the softmax + row comparison give, for
 * row lengths with and without a tail, scaled and prescaled.  The two ISAs
 * also give each other's values (the same arithmetic). */
START_TEST(softmax_rows_vector)
{
    enum { NMAX = 8195 };
    float *s = malloc(NMAX * 4), *a = malloc(NMAX * 4), *sq = malloc(NMAX * 4), *aq = malloc(NMAX * 4);
    float *sq2 = malloc(NMAX * 4), *aq2 = malloc(NMAX * 4);
    const int lens[] = {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 8192, 8195};
    double sums[2][sizeof lens / sizeof lens[0]][4][3];
    int ran[2] = {0, 0};
    for (int isa = 0; isa < 2; isa++) {
        const row_isa *R = &row_isas[isa];
        if (!R->active()) {
            printf("softmax rows: no %s here\n", R->name);
            continue;
        }
        ran[isa] = 1;
        unsigned seed = 3;
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
            for (int trial = 0; trial < 4; trial++) {
                int n = lens[li], ncol = n + 3 > NMAX ? n : n + 3, prescaled = trial & 1;
                float scale = sqrtf(128.0f);
                fill_normal(s, (size_t)n, seed++, 3.0);
                fill_normal(sq, (size_t)n, seed++, 3.0);
                if (trial >= 2) { /* the max twice or more: in later lanes, vectors, and first */
                    for (int i = n - 1; i >= 0; i -= 5) sq[i] = 40.0f;
                    sq[n / 2] = 40.0f;
                }
                /* the exact row's softmax */
                float m;
                double sum;
                int am;
                R->softmax(s, a, (size_t)n, (size_t)ncol, scale, prescaled, &m, &sum, &am);
                double lse = log(sum);
                /* first arg-max by hand, of the row as the softmax scaled it */
                memcpy(sq2, sq, (size_t)n * 4);
                float mq2;
                double sumq2;
                int amq2;
                R->softmax(sq2, aq2, (size_t)n, (size_t)ncol, scale, prescaled, &mq2, &sumq2, &amq2);
                int first = 0;
                for (int i = 1; i < n; i++)
                    if (sq2[i] > sq2[first]) first = i;
                ck_assert_msg(amq2 == first && mq2 == sq2[first], "%s n %d trial %d: arg-max %d, first %d", R->name, n,
                              trial, amq2, first);
                double sd2 = 0.5, ad2 = 0.25, kl = 0.125, sd2b = 0.5, ad2b = 0.25, klb = 0.125;
                R->compare(s, a, sq2, aq2, (size_t)n, m, lse, mq2, log(sumq2), &sd2b, &ad2b, &klb);
                float mq;
                double sumq;
                int amq;
                aq[ncol - 1] = 7.0f; /* zeroed past the prefix */
                R->fused(s, a, sq, aq, (size_t)n, (size_t)ncol, scale, prescaled, m, lse, &mq, &sumq, &amq, &sd2, &ad2,
                         &kl);
                ck_assert(mq == mq2 && sumq == sumq2 && amq == amq2);
                ck_assert(!memcmp(sq, sq2, (size_t)n * 4) && !memcmp(aq, aq2, (size_t)ncol * 4));
                ck_assert_msg(sd2 == sd2b && ad2 == ad2b && kl == klb,
                              "%s n %d trial %d: %.17g %.17g %.17g vs %.17g %.17g %.17g", R->name, n, trial, sd2, ad2,
                              kl, sd2b, ad2b, klb);
                sums[isa][li][trial][0] = sd2, sums[isa][li][trial][1] = ad2, sums[isa][li][trial][2] = kl;
            }
    }
    if (ran[0] && ran[1]) /* the same elements summed in other lane groupings: equal to rounding */
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
            for (int trial = 0; trial < 4; trial++)
                for (int k = 0; k < 3; k++) {
                    double x = sums[0][li][trial][k], y = sums[1][li][trial][k];
                    ck_assert_msg(fabs(x - y) <= 1e-12 * (fabs(x) + 1.0),
                                  "n %d trial %d sum %d: AVX2 %.17g AVX-512 %.17g", lens[li], trial, k, x, y);
                }
    free(s), free(a), free(sq), free(aq), free(sq2), free(aq2);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("metrics");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, recon_hand_case);
    tcase_add_test(tc, recon_fast_equals_reference);
    tcase_add_test(tc, recon_many_equals_one_by_one);
    tcase_add_test(tc, pooling_sums_not_ratios);
    tcase_add_test(tc, attention_one_hot);
    tcase_add_test(tc, attention_identical_is_zero);
    tcase_add_test(tc, attention_blas_equals_reference);
    tcase_add_test(tc, attention_window_one_by_hand);
    tcase_add_test(tc, attention_modes_equal_reference);
    tcase_add_test(tc, workspace_reuse_equals_fresh);
    tcase_add_test(tc, same_keys_equal_alone);
    tcase_add_test(tc, query_positions);
    tcase_add_test(tc, gqa_mapping);
    tcase_add_test(tc, threads_do_not_change_results);
    tcase_add_test(tc, prepared_equals_streamed);
    tcase_add_test(tc, first_stage_from_the_run);
    tcase_add_test(tc, spec_ranges_equal_one_thread);
    tcase_add_test(tc, batches_equal_alone);
    tcase_add_test(tc, layer_state_by_head_equals_layer);
    tcase_add_test(tc, vector_exp_accuracy);
    tcase_add_test(tc, softmax_rows_vector);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
