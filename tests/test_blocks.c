/* test_blocks.c — the building blocks of the error-reduction quantizers
 * (docs/building-blocks.md): rotations, Lloyd–Max codebooks, k-means, low
 * rank, RoPE tables. */
#include "testutil.h"
#include "math/maths.h"

#include <string.h>

/* ---------------------------------------------------------- rotations */

/* max |Π·Πᵀ − I| by applying Π to the identity rows. */
static double orthogonality_error(const kvq_rotation *r)
{
    int D = r->D;
    float *I = calloc((size_t)D * D, sizeof *I), *P = malloc((size_t)D * D * sizeof *P);
    for (int i = 0; i < D; i++) I[(size_t)i * D + i] = 1.0f;
    kvq_error err;
    ck_assert_int_eq(kvq_rotation_apply(r, I, P, (size_t)D, 0, &err), KVQ_OK); /* row i = Π e_i = column i of Π */
    double worst = 0;
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
            double s = 0;
            for (int c = 0; c < D; c++) s += (double)P[(size_t)i * D + c] * P[(size_t)j * D + c];
            double e = fabs(s - (i == j));
            if (e > worst) worst = e;
        }
    free(I), free(P);
    return worst;
}

START_TEST(rotations_orthogonal_and_seeded)
{
    const int dims[] = {2, 8, 12, 64, 128};
    kvq_error err;
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++) {
        int D = dims[k];
        kvq_rotation a, b, c;
        ck_assert_int_eq(kvq_rotation_init(&a, KVQ_ROT_QR, D, 7, 1, 2, 0, &err), KVQ_OK);
        ck_assert_int_eq(kvq_rotation_init(&b, KVQ_ROT_QR, D, 7, 1, 2, 0, &err), KVQ_OK);
        ck_assert_int_eq(kvq_rotation_init(&c, KVQ_ROT_QR, D, 7, 1, 3, 0, &err), KVQ_OK);
        ck_assert_msg(orthogonality_error(&a) < 1e-5, "qr D=%d: %g", D, orthogonality_error(&a));
        ck_assert_int_eq(memcmp(a.m, b.m, (size_t)D * D * sizeof(float)), 0); /* reproducible */
        ck_assert_int_ne(memcmp(a.m, c.m, (size_t)D * D * sizeof(float)), 0); /* another head */
        kvq_rotation_free(&a), kvq_rotation_free(&b), kvq_rotation_free(&c);
        if (D & (D - 1)) {
            ck_assert_int_eq(kvq_rotation_init(&a, KVQ_ROT_HADAMARD, D, 7, 1, 2, 0, &err), KVQ_ERR_USAGE);
            ck_assert(strstr(err.msg, "power of two"));
            continue;
        }
        ck_assert_int_eq(kvq_rotation_init(&a, KVQ_ROT_HADAMARD, D, 7, 1, 2, 1, &err), KVQ_OK);
        ck_assert_msg(orthogonality_error(&a) < 1e-5, "hadamard D=%d", D);
        /* forward then inverse gives the vector back */
        float x[128], y[128], z[128];
        fill_normal(x, (size_t)D, 3, 1.0);
        kvq_rotation_apply(&a, x, y, 1, 0, &err);
        kvq_rotation_apply(&a, y, z, 1, 1, &err);
        for (int i = 0; i < D; i++) ck_assert(fabs(z[i] - x[i]) < 1e-5);
        kvq_rotation_free(&a);
    }
}
END_TEST

START_TEST(fast_hadamard_equals_matrix)
{
    enum { D = 16 };
    /* explicit Sylvester matrix: H[i][j] = (−1)^popcount(i & j) */
    float x[D], y[D];
    fill_normal(x, D, 9, 1.0);
    memcpy(y, x, sizeof x);
    kvq_fwht(y, D);
    for (int i = 0; i < D; i++) {
        double s = 0;
        for (int j = 0; j < D; j++) s += (__builtin_popcount((unsigned)(i & j)) % 2 ? -1.0 : 1.0) * x[j];
        ck_assert_msg(fabs(y[i] - s) < 1e-5, "row %d: %g vs %g", i, y[i], s);
    }
    /* the rotation is H·diag(sign)/sqrt(D) */
    kvq_rotation r;
    kvq_error err;
    ck_assert_int_eq(kvq_rotation_init(&r, KVQ_ROT_HADAMARD, D, 1, 0, 0, 0, &err), KVQ_OK);
    kvq_rotation_apply(&r, x, y, 1, 0, &err);
    for (int i = 0; i < D; i++) {
        double s = 0;
        for (int j = 0; j < D; j++)
            s += (__builtin_popcount((unsigned)(i & j)) % 2 ? -1.0 : 1.0) * r.sign[j] * x[j];
        ck_assert(fabs(y[i] - s / 4.0) < 1e-5);
    }
    kvq_rotation_free(&r);
}
END_TEST

/* ----------------------------------------------------------- codebooks */

static const kvq_codebook *codebook(kvq_codebook_kind kind, int D, int bits)
{
    const kvq_codebook *cb;
    kvq_error err;
    ck_assert_msg(kvq_codebook_get(kind, D, bits, &cb, &err) == KVQ_OK, "%s", err.msg);
    return cb;
}

START_TEST(gauss_matches_max_table)
{
    const kvq_codebook *b1 = codebook(KVQ_CB_GAUSS, 0, 1), *b2 = codebook(KVQ_CB_GAUSS, 0, 2);
    ck_assert(fabs(b1->level[1] - 0.7979) < 1e-4 && fabs(b1->level[0] + 0.7979) < 1e-4);
    ck_assert(fabs(b2->level[2] - 0.4528) < 1e-4 && fabs(b2->level[3] - 1.5104) < 1e-4);
    ck_assert_msg(fabs(b1->mse - 0.3634) < 1e-4, "%g", b1->mse);
    ck_assert_msg(fabs(b2->mse - 0.1175) < 1e-4, "%g", b2->mse);
    ck_assert_ptr_eq(codebook(KVQ_CB_GAUSS, 5, 2), b2); /* cached; D does not matter */
}
END_TEST

START_TEST(sphere_matches_check_values)
{
    const double s = sqrt(128.0);
    const double want[4][8] = {{0.7994}, {0.4525, 1.5052}, {0.2444, 0.7533, 1.3366, 2.1315}};
    const double mse[4] = {0.3609, 0.1160, 0.0340, 0.0093};
    for (int b = 1; b <= 4; b++) {
        const kvq_codebook *cb = codebook(KVQ_CB_SPHERE, 128, b);
        int n = 1 << b;
        for (int i = 0; b <= 3 && i < n / 2; i++)
            ck_assert_msg(fabs(cb->level[n / 2 + i] * s - want[b - 1][i]) < 1e-4, "b=%d level %d: %.6f", b, i,
                          cb->level[n / 2 + i] * s);
        ck_assert_msg(fabs(cb->mse - mse[b - 1]) < 1e-4, "b=%d mse %.6f", b, cb->mse);
    }
}
END_TEST

START_TEST(codebooks_symmetric_and_improving)
{
    const int dims[] = {2, 3, 8, 16};
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++) {
        double prev = INFINITY;
        for (int b = 1; b <= 5; b++) {
            const kvq_codebook *cb = codebook(KVQ_CB_SPHERE, dims[k], b);
            for (int i = 0; i < cb->n; i++) ck_assert(fabs(cb->level[i] + cb->level[cb->n - 1 - i]) < 1e-9);
            for (int i = 0; i + 1 < cb->n; i++) ck_assert(cb->level[i] < cb->level[i + 1]);
            ck_assert_msg(cb->mse < prev, "D=%d b=%d: mse %g not below %g", dims[k], b, cb->mse, prev);
            prev = cb->mse;
        }
    }
    /* D = 3: uniform on [−1, 1] — levels at the cell centres */
    const kvq_codebook *u = codebook(KVQ_CB_SPHERE, 3, 2);
    ck_assert(fabs(u->level[2] - 0.25) < 1e-9 && fabs(u->level[3] - 0.75) < 1e-9);
    /* D = 2: arcsine density; 1 bit → ±E[x | x > 0] = ±2/π */
    ck_assert(fabs(codebook(KVQ_CB_SPHERE, 2, 1)->level[1] - 2.0 / M_PI) < 1e-9);
    /* nearest level: a value on a midpoint takes the lower level */
    const kvq_codebook *g = codebook(KVQ_CB_GAUSS, 0, 2);
    ck_assert_int_eq(kvq_codebook_index(g, g->bound[1]), 1);
    ck_assert_int_eq(kvq_codebook_index(g, nextafterf(g->bound[1], 1.0f)), 2);
    ck_assert_int_eq(kvq_codebook_index(g, -100.0f), 0);
    ck_assert_int_eq(kvq_codebook_index(g, 100.0f), 3);
}
END_TEST

START_TEST(data_codebook_is_1d_kmeans)
{
    /* four tight clusters: 2 bits find their means */
    enum { N = 4000 };
    static float x[N];
    const float centre[4] = {-3.0f, -1.0f, 0.5f, 4.0f};
    kvq_rng r;
    kvq_rng_init(&r, 1, 2, 3, 4);
    for (int i = 0; i < N; i++) x[i] = centre[i % 4] + 0.01f * (float)kvq_rng_normal(&r);
    kvq_codebook cb;
    kvq_error err;
    ck_assert_int_eq(kvq_codebook_fit_data(x, N, 2, &cb, &err), KVQ_OK);
    for (int i = 0; i < 4; i++) ck_assert_msg(fabs(cb.level[i] - centre[i]) < 2e-3, "%d: %g", i, cb.level[i]);
    kvq_codebook cb3;
    ck_assert_int_eq(kvq_codebook_fit_data(x, N, 3, &cb3, &err), KVQ_OK);
    ck_assert(cb3.mse < cb.mse);
    ck_assert_int_eq(kvq_codebook_fit_data(x, 0, 2, &cb, &err), KVQ_ERR_USAGE);
}
END_TEST

/* ------------------------------------------------------------- k-means */

START_TEST(kmeans_monotone_and_reproducible)
{
    enum { N = 600, D = 8, K = 6, IT = 100 };
    static float x[N * D];
    fill_normal(x, N * D, 21, 1.0);
    for (int i = 0; i < N; i++) x[i * D] += (float)(3 * (i % 3)); /* some structure */
    float c1[K * D], c2[K * D];
    int a1[N], a2[N], it1, it2;
    double obj[IT + 1];
    kvq_rng r1, r2;
    kvq_error err;
    kvq_rng_init(&r1, 5, 0, 0, kvq_stream_of_name("kmeans test"));
    kvq_rng_init(&r2, 5, 0, 0, kvq_stream_of_name("kmeans test"));
    ck_assert_int_eq(kvq_kmeans(x, N, D, K, IT, &r1, c1, a1, obj, &it1, &err), KVQ_OK);
    ck_assert_int_eq(kvq_kmeans(x, N, D, K, IT, &r2, c2, a2, NULL, &it2, &err), KVQ_OK);
    ck_assert_int_eq(it1, it2);
    ck_assert_int_eq(memcmp(c1, c2, sizeof c1), 0);
    ck_assert_int_eq(memcmp(a1, a2, sizeof a1), 0);
    ck_assert(it1 >= 1 && it1 <= IT);
    /* the objective never increases (float distances choose the assignment:
     * allow float rounding, 1e-6 relative) */
    for (int i = 1; i <= it1; i++)
        ck_assert_msg(obj[i] <= obj[i - 1] * (1 + 1e-6), "iteration %d: %g > %g", i, obj[i], obj[i - 1]);
    ck_assert(obj[it1] < obj[0]);
    /* converged: every point sits at its nearest centre */
    for (int i = 0; i < N; i++) {
        double best = INFINITY;
        for (int j = 0; j < K; j++) {
            double s = 0;
            for (int c = 0; c < D; c++) s += pow(x[i * D + c] - c1[j * D + c], 2);
            if (s < best) best = s;
        }
        double mine = 0;
        for (int c = 0; c < D; c++) mine += pow(x[i * D + c] - c1[a1[i] * D + c], 2);
        ck_assert(mine <= best * (1 + 1e-5) + 1e-9);
    }
    /* more centres than points: still defined */
    float cc[10 * D];
    ck_assert_int_eq(kvq_kmeans(x, 3, D, 10, IT, &r1, cc, NULL, NULL, NULL, &err), KVQ_OK);
}
END_TEST

/* ------------------------------------------------------------ low rank */

static double fro_diff(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) s += pow((double)a[i] - b[i], 2);
    return sqrt(s);
}

START_TEST(lowrank_svd_and_power)
{
    enum { T = 64, D = 16 };
    static float E[T * D], L[T * D], u[T * 2], v[2 * D];
    kvq_error err;
    /* an exactly rank-2 matrix is reproduced by both methods */
    fill_normal(u, T * 2, 1, 1.0);
    fill_normal(v, 2 * D, 2, 1.0);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) E[t * D + c] = u[t * 2] * v[c] + u[t * 2 + 1] * v[D + c];
    ck_assert_int_eq(kvq_lowrank_svd(E, T, D, 2, L, &err), KVQ_OK);
    ck_assert(fro_diff(E, L, T * D) < 1e-4);
    kvq_rng r;
    kvq_rng_init(&r, 0, 0, 0, kvq_stream_of_name("power test"));
    ck_assert_int_eq(kvq_lowrank_power(E, T, D, 2, 1, &r, L, &err), KVQ_OK);
    ck_assert(fro_diff(E, L, T * D) < 1e-3);
    /* a generic matrix: the power iteration approaches the SVD as loop grows,
     * never beating it (SVD is the best rank-r approximation) */
    fill_normal(E, T * D, 3, 1.0);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) E[t * D + c] *= (float)(1.0 / (1 + c)); /* decaying spectrum */
    ck_assert_int_eq(kvq_lowrank_svd(E, T, D, 3, L, &err), KVQ_OK);
    double best = fro_diff(E, L, T * D), prev = INFINITY;
    const int loops[] = {1, 2, 3, 4, 6, 8};
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        kvq_rng_init(&r, 0, 0, 0, kvq_stream_of_name("power test"));
        ck_assert_int_eq(kvq_lowrank_power(E, T, D, 3, loops[i], &r, L, &err), KVQ_OK);
        double e = fro_diff(E, L, T * D);
        ck_assert_msg(e >= best * (1 - 1e-5), "loop %d: %g below the SVD's %g", loops[i], e, best);
        ck_assert_msg(e <= prev * (1 + 1e-5), "loop %d: %g above %g", loops[i], e, prev);
        prev = e;
    }
    ck_assert_msg(prev <= best * (1 + 1e-3), "loop 8: %g vs SVD %g", prev, best);
    /* rank 0: nothing */
    ck_assert_int_eq(kvq_lowrank_svd(E, T, D, 0, L, &err), KVQ_OK);
    for (int i = 0; i < T * D; i++) ck_assert(L[i] == 0.0f);
}
END_TEST

/* ---------------------------------------------------------------- RoPE */

START_TEST(rope_table_round_trip)
{
    enum { T = 5, D = 8 };
    kvq_rope r;
    kvq_error err;
    ck_assert_int_eq(kvq_rope_from_theta(&r, T, D, 10000.0, KVQ_ROPE_HALF, &err), KVQ_OK);
    float x[T * D], y[T * D];
    fill_normal(x, T * D, 4, 1.0);
    memcpy(y, x, sizeof x);
    kvq_rope_apply(y, T, D, 10000.0, KVQ_ROPE_HALF); /* kvq-gen's path */
    for (int t = 0; t < T; t++) {
        float z[D];
        memcpy(z, x + t * D, sizeof z);
        kvq_rope_rotate(&r, z, t, 0);
        for (int c = 0; c < D; c++) ck_assert(fabs(z[c] - y[t * D + c]) < 1e-6);
        kvq_rope_rotate(&r, z, t, 1); /* and back */
        for (int c = 0; c < D; c++) ck_assert(fabs(z[c] - x[t * D + c]) < 1e-5);
    }
    kvq_rope_free(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("blocks");
    TCase *tc = tcase_create("blocks");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, rotations_orthogonal_and_seeded);
    tcase_add_test(tc, fast_hadamard_equals_matrix);
    tcase_add_test(tc, gauss_matches_max_table);
    tcase_add_test(tc, sphere_matches_check_values);
    tcase_add_test(tc, codebooks_symmetric_and_improving);
    tcase_add_test(tc, data_codebook_is_1d_kmeans);
    tcase_add_test(tc, kmeans_monotone_and_reproducible);
    tcase_add_test(tc, lowrank_svd_and_power);
    tcase_add_test(tc, rope_table_round_trip);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
