/* kvq_arrays.h — part of libkvq's public API (kvq.h includes every part):
 * arrays in memory: the entry points of bindings (python/kvq). */
#ifndef KVQ_API_ARRAYS_H
#define KVQ_API_ARRAYS_H

#include "kvq_analysis.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------- arrays in memory (bindings: python/) */

/* For callers that hold arrays rather than dumps and cannot build kvq's
 * structs (Python's kvq package, over ctypes).  Strings they receive are
 * malloc'ed: kvq_free releases them. */
void kvq_free(void *p);

/* The quantizer `spec` on one layer of the caller's arrays, exactly as
 * kvq-analyze runs it on a dump's layer `layer` with --seed `seed`: key,
 * value (and key_pre_rope, may be NULL) [H][T][D] float32, checked finite;
 * RoPE (for quantizers that re-apply it to pre-RoPE keys) from the tables
 * rope_cos/rope_sin [T][D/2] when given, else from rope_theta > 0, paired
 * by rope_style; calib (may be NULL) feeds the calibrated quantizers.
 * Writes K', V' [H][T][D] and, per head, the reconstruction sums, bits and
 * static bytes kvq-analyze pools into its rows (head_acc [H], attention
 * left empty): kvq_acc_merge + kvq_metrics_finalize give its columns. */
kvq_status kvq_quantize_arrays(const char *spec, int layer, uint64_t seed, int nthreads, int H, int T, int D,
                               const float *key, const float *value, const float *key_pre_rope,
                               const double *rope_cos, const double *rope_sin, double rope_theta,
                               kvq_rope_style rope_style, kvq_calib *calib, float *key_out, float *value_out,
                               kvq_acc *head_acc, kvq_error *err);

/* The layout of the structs bindings mirror field for field (python/kvq's
 * ctypes classes), so that a binding can refuse a libkvq built from other
 * headers instead of reading garbage: the i-th field of those structs, in
 * declaration order, as its struct's name, its own, its offset and the
 * struct's size.  0 past the last (i counts from 0), else 1. */
int kvq_abi_field(int i, const char **type, const char **field, size_t *offset, size_t *size);

/* kvq-analyze on one dump with these options, its rows as CSV text (header
 * included) in *csv, byte for byte what `kvq-analyze --format csv` writes
 * with `label` in the dump column.  layers/heads NULL: all; queries NULL:
 * last:64; nthreads <= 0: all cores. */
kvq_status kvq_analyze_csv(const char *path, const char *label, const char *const *specs, int nspecs,
                           kvq_per per, const int *layers, int nlayers, const int *heads, int nheads,
                           const char *queries, kvq_calib *calib, uint64_t seed, int nthreads, char **csv,
                           kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif
