/* testutil.h — helpers shared by kvq's Check suites. */
#ifndef KVQ_TESTUTIL_H
#define KVQ_TESTUTIL_H

#include "kvq.h"

#include <check.h>
#include <math.h>
#include <stdlib.h>

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
