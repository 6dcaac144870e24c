/* testutil.h — helpers shared by kvq's Check suites. */
#ifndef KVQ_TESTUTIL_H
#define KVQ_TESTUTIL_H

#include "kvq.h"
#include "internal.h"     /* the reference maths and formats the tests check */
#include "quant/quant.h" /* the quantizer-author API */

#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* |a − b| <= tol · max(|b|, floor) */
static inline int close_rel(double a, double b, double tol, double floor_)
{
    double m = fabs(b) > floor_ ? fabs(b) : floor_;
    return fabs(a - b) <= tol * m;
}

/* n values of N(0, sigma) from a seeded stream. */
static inline void fill_normal(float *x, size_t n, uint64_t seed, double sigma)
{
    kvq_rng r;
    kvq_rng_init(&r, seed, 11, 22, 33);
    for (size_t i = 0; i < n; i++) x[i] = (float)(sigma * kvq_rng_normal(&r));
}

/* A small synthetic dump (kvq-gen, one outlier channel) in a temporary
 * file; the caller unlinks and frees the path. */
static inline char *gen_dump(int L, int Hq, int H, int D, int T, uint64_t seed)
{
    char *path = strdup("/tmp/kvq-test-XXXXXX.h5");
    int fd = mkstemps(path, 3);
    ck_assert(fd >= 0);
    close(fd);
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    o.num_layers = L, o.num_heads = Hq, o.num_kv_heads = H, o.head_dim = D, o.seq_len = T, o.seed = seed;
    o.outlier_channels = 1;
    kvq_error err = {0};
    ck_assert_msg(kvq_gen_write(path, &o, &err) == KVQ_OK, "%s", err.msg);
    return path;
}

/* Runs a suite, returns the process exit status. */
static inline int run_suite(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif
