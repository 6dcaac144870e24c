/* internal.h — helpers shared by libkvq's sources, not part of the API. */
#ifndef KVQ_INTERNAL_H
#define KVQ_INTERNAL_H

#include "kvq.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>

#if defined(__GNUC__)
#define KVQ_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVQ_PRINTF(a, b)
#endif

/* One threading layer at a time: BLAS single-threaded inside kvq's own
 * OpenMP loops, with OpenBLAS's idle worker threads stopped (they would
 * otherwise spin in sched_yield beside kvq's threads); a later multi-threaded
 * BLAS call (the model's forward pass) starts them again. */
void kvq_blas_serial(void);

/* Records status + formatted detail in err (may be NULL); returns status. */
kvq_status kvq_fail(kvq_error *err, kvq_status st, const char *fmt, ...) KVQ_PRINTF(3, 4);

/* a*b*c... as size_t; false on overflow. */
static inline bool kvq_mul_size(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* Number of elements of one [A][B][C] tensor in bytes of float; false on overflow. */
static inline bool kvq_tensor_bytes(size_t a, size_t b, size_t c, size_t *bytes)
{
    size_t n;
    return kvq_mul_size(a, b, &n) && kvq_mul_size(n, c, &n) && kvq_mul_size(n, sizeof(float), bytes);
}

/* malloc of n*size bytes with overflow check; NULL on failure. */
void *kvq_alloc_array(size_t n, size_t size);
/* bytes on a 64-byte (cache line) boundary, for outputs the SIMD kernels
 * stream into; free() releases it.  NULL on failure. */
void *kvq_alloc_lines(size_t bytes);

/* Index of the first inf or NaN in x[0..n), or n (vectorised screen, then a search). */
size_t kvq_first_nonfinite(const float *x, size_t n);

/* Effective thread count (<= 0: all cores). */
int kvq_threads(int requested);

#endif
