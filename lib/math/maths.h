/* maths.h — the math room's reference maths (public to the tests, not to the tools):
 * rotations, Lloyd–Max codebooks, k-means and low rank. */
#ifndef KVQ_ROOM_MATHS_H
#define KVQ_ROOM_MATHS_H

#include "../internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* -------------------------------------- rotations (docs/building-blocks.md) */

typedef enum kvq_rotate_kind { KVQ_ROT_NONE = 0, KVQ_ROT_QR, KVQ_ROT_HADAMARD } kvq_rotate_kind;

/* A D×D orthogonal Π fixed by (seed, layer, head, tensor). */
typedef struct kvq_rotation {
    kvq_rotate_kind kind;
    int D;
    float *m;    /* qr: Π [D][D], row-major */
    float *sign; /* hadamard: the ±1 diagonal [D]; Π = H·diag(sign), H normalised */
} kvq_rotation;

/* qr: Gaussian [D][D] drawn row by row from stream (seed, layer, head,
 * KVQ_STREAM_ROTATE + tensor), QR in double (LAPACKE), columns times
 * sign(diag R).  hadamard: D must be a power of two (else KVQ_ERR_USAGE). */
kvq_status kvq_rotation_init(kvq_rotation *r, kvq_rotate_kind kind, int D, uint64_t seed,
                             int layer, int head, int tensor, kvq_error *err);
void kvq_rotation_free(kvq_rotation *r);
/* Bytes to store Π: qr 4·D² (fp32), hadamard ceil(D/8) (sign bits), none 0. */
double kvq_rotation_bytes(const kvq_rotation *r);
/* Rows of x [n][D] to y [n][D] (y != x): y_t = Π·x_t, or Πᵀ·x_t (inverse). */
kvq_status kvq_rotation_apply(const kvq_rotation *r, const float *x, float *y, size_t n,
                              int inverse, kvq_error *err);
/* Unnormalised fast Walsh–Hadamard transform of x [D] in place (Sylvester
 * order, D a power of two): x ← H_D·x with entries ±1. */
void kvq_fwht(float *x, int D);

/* ---------------------------- Lloyd–Max codebooks (docs/building-blocks.md) */

typedef enum kvq_codebook_kind { KVQ_CB_SPHERE = 0, KVQ_CB_GAUSS, KVQ_CB_DATA } kvq_codebook_kind;

#define KVQ_CODEBOOK_MAX_BITS 8
typedef struct kvq_codebook {
    int bits, n;                             /* n = 2^bits levels */
    double level[1 << KVQ_CODEBOOK_MAX_BITS]; /* ascending */
    double mse;        /* sphere: E‖u − û‖² of a unit vector; gauss, data: E(x − Q(x))² */
    int iterations;    /* Lloyd iterations run */
    float levelf[1 << KVQ_CODEBOOK_MAX_BITS]; /* levels as float */
    float bound[(1 << KVQ_CODEBOOK_MAX_BITS) - 1]; /* midpoints, float */
} kvq_codebook;

/* sphere (D >= 2) or gauss (D ignored) codebook, computed once per
 * (kind, D, bits) and cached for the process (thread-safe); *out stays valid. */
kvq_status kvq_codebook_get(kvq_codebook_kind kind, int D, int bits, const kvq_codebook **out,
                            kvq_error *err);
/* 1-D k-means (the same Lloyd iteration) over n samples. */
kvq_status kvq_codebook_fit_data(const float *x, size_t n, int bits, kvq_codebook *out,
                                 kvq_error *err);
/* Index of the level nearest to v (a value exactly on a midpoint takes the lower level). */
static inline int kvq_codebook_index(const kvq_codebook *cb, float v)
{
    int lo = 0, hi = cb->n - 1; /* answer in [lo, hi]: count of bounds < v */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (v > cb->bound[mid]) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ------------------------------------- k-means (docs/quantizers.md#cluster) */

/* k-means of n points x [n][D]: k-means++ seeding from `rng`, then Lloyd
 * iterations until no assignment changes or max_iter.  Ties go to the lower
 * centre index; an empty cluster keeps its centre.  centres [k][D] out;
 * assign [n] (may be NULL); objective [max_iter + 1] (may be NULL) receives
 * Σ‖x − c‖² after seeding and after each iteration; *iters the count. */
kvq_status kvq_kmeans(const float *x, size_t n, int D, int k, int max_iter, kvq_rng *rng,
                      float *centres, int *assign, double *objective, int *iters,
                      kvq_error *err);
/* k-means++ seeding alone (cluster's and vq's): centres [k][D] are points of
 * x, the first a uniform draw, each next one drawn with probability
 * proportional to its squared distance (double, channel order) to the
 * nearest centre so far (uniform again if that total is 0).  d2 [n]: scratch. */
void kvq_kmeans_seed(const float *x, size_t n, int D, int k, kvq_rng *rng, float *centres, double *d2);
/* Nearest centre of each point (ties: lower index). */
kvq_status kvq_kmeans_assign(const float *x, size_t n, int D, const float *centres, int k,
                             int *assign, kvq_error *err);

/* --------------------------------------- low rank (docs/quantizers.md#gear) */

/* L [T][D] = best rank-r approximation of E [T][D] (truncated SVD, LAPACKE, double). */
kvq_status kvq_lowrank_svd(const float *E, int T, int D, int r, float *L, kvq_error *err);
/* GEAR's power iteration (in double): P [D][r] uniform [0,1) from rng (row by row);
 * `loop` passes of Qm = E·P, P = Eᵀ·Qm with P and Qm orthonormalised (QR) on
 * the last pass; L = Qm·Pᵀ. */
kvq_status kvq_lowrank_power(const float *E, int T, int D, int r, int loop, kvq_rng *rng,
                             float *L, kvq_error *err);
/* The same in place on E already in double: e [T][D] holds E on entry and
 * L on return (its last product is written over E, which it no longer
 * needs): a caller that forms E in double and adds L itself saves the float
 * copies and one T×D buffer of doubles. */
kvq_status kvq_lowrank_power_d(double *e, int T, int D, int r, int loop, kvq_rng *rng, kvq_error *err);

#ifdef __cplusplus
}
#endif

#endif
