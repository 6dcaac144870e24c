/* threads.c — kvq's threading layers: how many OpenMP threads a call uses,
 * and BLAS kept out of their way.  Shared by the analysis driver, the
 * quantizers and the forward pass (so none of them imports another for it). */
#include "../internal.h"

#include <cblas.h>
#include <omp.h>

int kvq_threads(int requested)
{
    if (requested > 0) return requested;
    int n = omp_get_num_procs();
    return n > 0 ? n : 1;
}

/* OpenBLAS's pthread build exports blas_thread_shutdown_ (its fork handler):
 * it joins the worker threads, and the next threaded call re-creates them.
 * Weak, so another OpenBLAS build simply skips it. */
extern int blas_thread_shutdown_(void) __attribute__((weak));

void kvq_blas_serial(void)
{
    openblas_set_num_threads(1);
    if (blas_thread_shutdown_) blas_thread_shutdown_();
}
