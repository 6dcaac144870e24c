/* lowrank.c — the low-rank part of GEAR (docs/quantizers.md#gear): the best rank-r
 * approximation by truncated SVD (LAPACKE dgesdd, double), and GEAR's power
 * iteration (in double: cblas_dgemm + QR through LAPACKE dgeqrf/dorgqr), as in
 * GEAR's fake_poweriteration_group. */
#include "../internal.h"
#include "maths.h"

#include <cblas.h>
#include <lapacke.h>
#include <string.h>

kvq_status kvq_lowrank_svd(const float *E, int T, int D, int r, float *L, kvq_error *err)
{
    int m = T < D ? T : D;
    if (r > m) r = m;
    if (r <= 0) {
        memset(L, 0, (size_t)T * D * sizeof *L);
        return KVQ_OK;
    }
    size_t n = (size_t)T * D;
    double *a = kvq_alloc_array(n, sizeof *a), *s = kvq_alloc_array((size_t)m, sizeof *s);
    double *u = kvq_alloc_array((size_t)T * m, sizeof *u), *vt = kvq_alloc_array((size_t)m * D, sizeof *vt);
    kvq_status st = KVQ_OK;
    if (!a || !s || !u || !vt) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the SVD of a %d x %d matrix", T, D);
        goto out;
    }
    for (size_t i = 0; i < n; i++) a[i] = E[i];
    /* E = U Σ Vᵀ, economy size: U [T][m], Vᵀ [m][D] */
    lapack_int info = LAPACKE_dgesdd(LAPACK_ROW_MAJOR, 'S', T, D, a, D, s, u, m, vt, D);
    if (info != 0) {
        st = kvq_fail(err, KVQ_ERR_INTERNAL, "LAPACKE_dgesdd on a %d x %d matrix returned %d", T, D, (int)info);
        goto out;
    }
    /* L = (U_r·diag(s_r))·Vᵀ_r in double (dgemm), rounded once to float */
    for (int t = 0; t < T; t++)
        for (int i = 0; i < r; i++) u[(size_t)t * m + i] *= s[i];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, D, r, 1.0, u, m, vt, D, 0.0, a, D);
    for (size_t i = 0; i < n; i++) L[i] = (float)a[i];
out:
    free(a), free(s), free(u), free(vt);
    return st;
}

/* Orthonormal basis of the columns of a (rows × cols, column-major, rows >= cols), in
 * place.  Column-major is what LAPACK computes in: LAPACKE's row-major entry transposes
 * into it and back, to the same values. */
static kvq_status orthonormalise(double *a, int rows, int cols, double *tau, kvq_error *err)
{
    lapack_int info = LAPACKE_dgeqrf(LAPACK_COL_MAJOR, rows, cols, a, rows, tau);
    if (info == 0) info = LAPACKE_dorgqr(LAPACK_COL_MAJOR, rows, cols, cols, a, rows, tau);
    if (info != 0)
        return kvq_fail(err, KVQ_ERR_INTERNAL, "LAPACKE QR of a %d x %d matrix returned %d", rows, cols, (int)info);
    return KVQ_OK;
}

/* In double: GEAR orthonormalises only on the last pass, so P's columns all
 * turn towards the top singular vector as `loop` grows; float32 would lose
 * the other directions after a few passes (measured: the error rose again
 * from loop 8 on), double keeps them for any practical loop.
 * P and Qm are column-major (a column of D, of T), so that in each product
 * with E it is E that OpenBLAS packs in cache-sized blocks as its first
 * operand, beside the r columns: as the second operand, E was packed whole
 * into a buffer of its size and read back from memory (E is 8 MB of doubles
 * on an 8k-token head), six times a head. */
kvq_status kvq_lowrank_power_d(double *e, int T, int D, int r, int loop, kvq_rng *rng, kvq_error *err)
{
    int m = T < D ? T : D;
    if (r > m) r = m;
    if (r <= 0 || loop <= 0) {
        memset(e, 0, (size_t)T * D * sizeof *e);
        return KVQ_OK;
    }
    double *P = kvq_alloc_array((size_t)D * r, sizeof *P), *Q = kvq_alloc_array((size_t)T * r, sizeof *Q);
    double *tau = kvq_alloc_array((size_t)r, sizeof *tau);
    kvq_status st = KVQ_OK;
    if (!P || !Q || !tau) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a rank-%d power iteration", r);
        goto out;
    }
    for (int d = 0; d < D; d++) /* P [D][r] drawn row by row, stored by column */
        for (int j = 0; j < r; j++) P[(size_t)j * D + d] = kvq_rng_uniform(rng);
    /* e [T][D] row-major is Eᵀ column-major (D × T, leading dimension D) */
    for (int i = 0; i < loop; i++) {
        int last = i == loop - 1;
        if (last && (st = orthonormalise(P, D, r, tau, err))) goto out;
        /* Qm = E·P  (T × r) */
        cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, T, r, D, 1.0, e, D, P, D, 0.0, Q, T);
        if (last && (st = orthonormalise(Q, T, r, tau, err))) goto out;
        /* P = Eᵀ·Qm  (D × r) */
        cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, D, r, T, 1.0, e, D, Q, T, 0.0, P, D);
    }
    /* L = Qm·Pᵀ [T][D] row-major, over E: Lᵀ = P·Qmᵀ column-major */
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, D, T, r, 1.0, P, D, Q, T, 0.0, e, D);
out:
    free(P), free(Q), free(tau);
    return st;
}

kvq_status kvq_lowrank_power(const float *E, int T, int D, int r, int loop, kvq_rng *rng,
                             float *L, kvq_error *err)
{
    size_t n = (size_t)T * D;
    double *e = kvq_alloc_array(n, sizeof *e);
    if (!e) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a rank-%d power iteration", r);
    for (size_t i = 0; i < n; i++) e[i] = E[i];
    kvq_status st = kvq_lowrank_power_d(e, T, D, r, loop, rng, err);
    if (!st)
        for (size_t i = 0; i < n; i++) L[i] = (float)e[i];
    free(e);
    return st;
}
