/* rotate.c — the seeded rotations (docs/building-blocks.md#rotations): `qr`
 * (Gaussian matrix, QR in double through LAPACKE, column signs fixed by
 * diag R) and randomized
 * `hadamard` (±1 diagonal, then the normalised Sylvester–Hadamard matrix,
 * applied with the O(D log D) fast Walsh–Hadamard transform). */
#include "../internal.h"
#include "maths.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <string.h>

void kvq_fwht(float *x, int D)
{
    /* butterflies of the Sylvester order: H_2n = [[H_n, H_n], [H_n, −H_n]] */
    for (int len = 1; len < D; len <<= 1)
        for (int i = 0; i < D; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
}

void kvq_rotation_free(kvq_rotation *r)
{
    if (!r) return;
    free(r->m), free(r->sign);
    memset(r, 0, sizeof *r);
}

double kvq_rotation_bytes(const kvq_rotation *r)
{
    if (r->kind == KVQ_ROT_QR) return 4.0 * r->D * r->D;
    if (r->kind == KVQ_ROT_HADAMARD) return (double)((r->D + 7) / 8);
    return 0.0;
}

static kvq_status rotation_qr(kvq_rotation *r, int D, kvq_rng *rng, kvq_error *err)
{
    size_t n = (size_t)D * D;
    double *a = kvq_alloc_array(n, sizeof *a), *tau = kvq_alloc_array((size_t)D, sizeof *tau);
    double *sgn = kvq_alloc_array((size_t)D, sizeof *sgn);
    r->m = kvq_alloc_array(n, sizeof *r->m);
    kvq_status st = KVQ_OK;
    if (!a || !tau || !sgn || !r->m) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a %d x %d rotation", D, D);
        goto out;
    }
    for (size_t i = 0; i < n; i++) a[i] = kvq_rng_normal(rng); /* G [D][D], row by row */
    lapack_int info = LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, D, D, a, D, tau);
    if (info != 0) {
        st = kvq_fail(err, KVQ_ERR_INTERNAL, "LAPACKE_dgeqrf on a %d x %d rotation returned %d", D, D, (int)info);
        goto out;
    }
    for (int j = 0; j < D; j++) sgn[j] = a[(size_t)j * D + j] < 0 ? -1.0 : 1.0; /* sign(diag R) */
    info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, D, D, D, a, D, tau);
    if (info != 0) {
        st = kvq_fail(err, KVQ_ERR_INTERNAL, "LAPACKE_dorgqr on a %d x %d rotation returned %d", D, D, (int)info);
        goto out;
    }
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) r->m[(size_t)i * D + j] = (float)(a[(size_t)i * D + j] * sgn[j]);
out:
    free(a), free(tau), free(sgn);
    return st;
}

kvq_status kvq_rotation_init(kvq_rotation *r, kvq_rotate_kind kind, int D, uint64_t seed,
                             int layer, int head, int tensor, kvq_error *err)
{
    memset(r, 0, sizeof *r);
    r->kind = kind, r->D = D;
    if (kind == KVQ_ROT_NONE) return KVQ_OK;
    kvq_rng rng;
    kvq_rng_init(&rng, seed, (uint64_t)layer, (uint64_t)head, (uint64_t)(KVQ_STREAM_ROTATE + tensor));
    kvq_status st;
    if (kind == KVQ_ROT_QR) {
        st = rotation_qr(r, D, &rng, err);
    } else {
        if (D < 1 || (D & (D - 1)))
            return kvq_fail(err, KVQ_ERR_USAGE, "rotate=hadamard: head_dim %d is not a power of two (use rotate=qr)",
                            D);
        st = KVQ_OK;
        if (!(r->sign = kvq_alloc_array((size_t)D, sizeof *r->sign)))
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        for (int i = 0; i < D && !st; i++) r->sign[i] = (kvq_rng_u64(&rng) >> 63) ? -1.0f : 1.0f;
    }
    if (st) kvq_rotation_free(r);
    return st;
}

kvq_status kvq_rotation_apply(const kvq_rotation *r, const float *x, float *y, size_t n,
                              int inverse, kvq_error *err)
{
    int D = r->D;
    if (r->kind == KVQ_ROT_NONE) {
        memcpy(y, x, n * (size_t)D * sizeof *y);
    } else if (r->kind == KVQ_ROT_QR) {
        /* rows: y_t = Π x_t  →  Y = X Πᵀ;  y_t = Πᵀ x_t  →  Y = X Π */
        if (n > (size_t)0x7fffffff) return kvq_fail(err, KVQ_ERR_NOMEM, "too many rows for BLAS");
        cblas_sgemm(CblasRowMajor, CblasNoTrans, inverse ? CblasNoTrans : CblasTrans, (int)n, D, D,
                    1.0f, x, D, r->m, D, 0.0f, y, D);
    } else {
        const float norm = 1.0f / sqrtf((float)D);
        for (size_t t = 0; t < n; t++) {
            const float *xi = x + t * D;
            float *yi = y + t * D;
            if (!inverse) { /* Π x = H (s ⊙ x) / sqrt(D) */
                for (int c = 0; c < D; c++) yi[c] = xi[c] * r->sign[c];
                kvq_fwht(yi, D);
                for (int c = 0; c < D; c++) yi[c] *= norm;
            } else { /* Πᵀ x = s ⊙ (H x) / sqrt(D) */
                memcpy(yi, xi, (size_t)D * sizeof *yi);
                kvq_fwht(yi, D);
                for (int c = 0; c < D; c++) yi[c] = yi[c] * norm * r->sign[c];
            }
        }
    }
    return KVQ_OK;
}
