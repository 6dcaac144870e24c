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

/* What kvq_quantize_arrays runs besides the arrays: the quantizer `spec`
 * as kvq-analyze runs it on a dump's layer `layer` with --seed `seed`, on
 * nthreads threads (0: as many as the work keeps busy); RoPE (for
 * quantizers that re-apply it to pre-RoPE keys) from the tables rope_cos,
 * rope_sin [T][D/2] when given, else from rope_theta > 0, paired by
 * rope_style; calib (may be NULL) feeds the calibrated quantizers. */
typedef struct kvq_arrays_opts {
    const char *spec;
    int layer;
    uint64_t seed;
    int nthreads;
    const double *rope_cos, *rope_sin;
    double rope_theta;
    kvq_rope_style rope_style;
    kvq_calib *calib;
    /* tokens(...)'s selectors that score by attention read query
     * [num_heads][T][D] (post-RoPE; num_heads a multiple of H, NULL: none);
     * keep (may be NULL) receives the [H][T] selection: 1 for a token the
     * selector kept (stored by HI), 0 for the others (stored by LO, or
     * evicted when LO is drop: their K', V' rows are 0); all 1 for a spec
     * that selects nothing */
    const float *query;
    int num_heads;
    unsigned char *keep;
} kvq_arrays_opts;

/* o's quantizer on one layer of the caller's arrays: key, value (and
 * key_pre_rope, may be NULL) [H][T][D] float32, checked finite.  Writes
 * K', V' [H][T][D] and, per head, the reconstruction sums, bits and static
 * bytes kvq-analyze pools into its rows (head_acc [H], attention left
 * empty): kvq_acc_merge + kvq_metrics_finalize give its columns. */
kvq_status kvq_quantize_arrays(const kvq_arrays_opts *o, int H, int T, int D, const float *key, const float *value,
                               const float *key_pre_rope, float *key_out, float *value_out, kvq_acc *head_acc,
                               kvq_error *err);

/* tokens(...)'s selection on arrays (kvq.DecodeCache compressing while
 * decoding, SPEC §3.11): which of the T tokens of each of the H heads the
 * selector of o->spec keeps, keep [H][T] = 1 or 0, from key [H][T][D] (as
 * cached) and o->query [num_heads][T][D] for selectors that score by
 * attention; target > 0: `target` tokens kept, scored by the query rows
 * [qrow0, T) (decode-time); target 0: the selector's keep= of the whole
 * cache.  Only o->spec, layer, seed, nthreads, query and num_heads are read. */
kvq_status kvq_select_arrays(const kvq_arrays_opts *o, int H, int T, int D, const float *key, int target, int qrow0,
                             unsigned char *keep, kvq_error *err);

/* The layout of the structs bindings mirror field for field (python/kvq's
 * ctypes classes), so that a binding can refuse a libkvq built from other
 * headers instead of reading garbage: the i-th field of those structs, in
 * declaration order, as its struct's name, its own, its offset and the
 * struct's size.  0 past the last (i counts from 0), else 1. */
int kvq_abi_field(int i, const char **type, const char **field, size_t *offset, size_t *size);

/* kvq-analyze's options for kvq_analyze_csv: `label` in the dump column
 * (NULL: the path), the specs, --per, --layers/--heads (NULL: all),
 * --queries (NULL: last:64), --calib, --seed, --threads (0: all cores). */
typedef struct kvq_analyze_csv_opts {
    const char *label;
    const char *const *specs;
    int nspecs;
    kvq_per per;
    const int *layers;
    int nlayers;
    const int *heads;
    int nheads;
    const char *queries;
    kvq_calib *calib;
    uint64_t seed;
    int nthreads;
} kvq_analyze_csv_opts;

/* kvq-analyze on one dump with these options, its rows as CSV text (header
 * included) in *csv, byte for byte what `kvq-analyze --format csv` writes. */
kvq_status kvq_analyze_csv(const char *path, const kvq_analyze_csv_opts *o, char **csv, kvq_error *err);
/* The same on a dump held in memory (kvq_dump_from_memory; `label` NULL:
 * m->name): the rows kvq_analyze_csv gives on that dump written to a file. */
kvq_status kvq_analyze_csv_memory(const kvq_dump_mem *m, const kvq_analyze_csv_opts *o, char **csv, kvq_error *err);

/* One row of kvq-analyze: layer and head (-1: "all", the row pools them),
 * the family's name, the row's spec (a mix's row of one layer: that
 * layer's) and the metrics, each column's value as kvq_metric_column names
 * them (an attention column is absent, its CSV cell empty, when !m.has_attn). */
typedef struct kvq_analysis_row {
    int layer, head;
    const char *quantizer;
    char spec[KVQ_SPEC_MAX];
    kvq_metrics m;
} kvq_analysis_row;
/* The rows kvq_analyze_csv writes (on the file at path, or on the dump in
 * memory m: exactly one given), as values instead of text: *rows (free with
 * kvq_free) holds *nrows of them, in the CSV's order; the dump column is the
 * caller's own. */
kvq_status kvq_analyze_rows(const char *path, const kvq_dump_mem *m, const kvq_analyze_csv_opts *o,
                            kvq_analysis_row **rows, size_t *nrows, kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif
