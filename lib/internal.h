/* internal.h — the base room's helpers, shared by every libkvq source and
 * not part of the API: errors and notes, checked sizes and allocation, the
 * BLAS threading switch, the seeded generator and its stream tags.  Each
 * other room keeps its own internal header (docs/layout.md): math/maths.h,
 * formats/formats.h, quant/quant.h, analysis/analysis.h, model/model.h, io/h5.h. */
#ifndef KVQ_INTERNAL_H
#define KVQ_INTERNAL_H

#include "kvq.h"
#include "kvq_output.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

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
/* 1 when this BLAS core computes each row of a product to the same bits
 * whatever other rows share the call, single-threaded (SkylakeX's kernels
 * do, Haswell's do not; probed once per process): the forward pass then
 * multiplies all the rows it has by a weight tile in one call.
 * KVQ_BLAS_ROWS=tiles makes it 0 (the tests compare the two). */
int kvq_blas_rows_independent(void);

/* Records status + formatted detail in err (may be NULL); returns status. */
kvq_status kvq_fail(kvq_error *err, kvq_status st, const char *fmt, ...) KVQ_PRINTF(3, 4);
/* A note for the tools (kvq_take_notes): of each kind the one of lowest `order` kept (the
 * same whichever thread comes first), the others counted. */
void kvq_note(kvq_note_kind kind, uint64_t order, const char *fmt, ...) KVQ_PRINTF(3, 4);

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

/* max |x_i| over n values, NaN never counting (0 for none), in `lanes` (a
 * constant at the call, <= KVQ_ABSMAX_LANES_MAX) running maxima kept in
 * vectors (one running max waits 4 cycles a value); a max is exact, so any
 * `lanes` gives the same: 32 for a tensor (kvq_absmax), 8 for a block. */
enum { KVQ_ABSMAX_LANES_MAX = 32 };
static inline __attribute__((always_inline)) float kvq_absmax_lanes(const float *x, size_t n, int lanes)
{
    float lane[KVQ_ABSMAX_LANES_MAX] = {0}, m = 0.0f;
    size_t whole = n - n % (size_t)lanes; /* values in whole rounds of the lanes */
    for (size_t i = 0; i < whole; i += (size_t)lanes)
        for (int l = 0; l < lanes; l++) {
            float a = __builtin_fabsf(x[i + l]);
            lane[l] = a > lane[l] ? a : lane[l];
        }
    for (size_t i = whole; i < n; i++) {
        float a = __builtin_fabsf(x[i]);
        m = a > m ? a : m;
    }
    for (int l = 0; l < lanes; l++) m = lane[l] > m ? lane[l] : m;
    return m;
}

/* Seeded generator (docs/building-blocks.md#random-numbers): xoshiro256** whose state is filled by
 * splitmix64 from (seed, a, b, c), so every (layer, head, tensor) stream is
 * reproducible and independent of the thread that draws it. */
typedef struct kvq_rng {
    uint64_t s[4];
} kvq_rng;

void kvq_rng_init(kvq_rng *r, uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
uint64_t kvq_rng_u64(kvq_rng *r);
double kvq_rng_uniform(kvq_rng *r);          /* [0, 1), 53 bits */
double kvq_rng_normal(kvq_rng *r);           /* N(0, 1), Box–Muller */
uint64_t kvq_rng_below(kvq_rng *r, uint64_t n); /* uniform in [0, n), unbiased */

/* Stream tags for kvq_rng_init's third index.  The shared streams are named
 * here; a family's own streams come from its registry row (quant.h's
 * kvq_family_stream: its name's tag, or the tag it had before tags came
 * from names).  Streams that exist for K and for V use tag + tensor (0 = K, 1 = V). */
enum {
    KVQ_STREAM_KEY = 0, KVQ_STREAM_VALUE = 1, KVQ_STREAM_QUERIES = 2, KVQ_STREAM_GEN = 3,
    KVQ_STREAM_ROTATE = 4,        /* rotation of (layer, head, K/V): 4, 5 */
    KVQ_STREAM_TASKS = 0x7ffffffe /* kvq-gen --task's words of (kind, task) */
};
/* The first tag of a named family's streams: FNV-1a (64 bits) of the name
 * with the top bit set, so it is far from every tag above and from the
 * families' kept tags, all below 2^31. */
uint64_t kvq_stream_of_name(const char *name);

#ifdef __cplusplus
}
#endif

#endif
