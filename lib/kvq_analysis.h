/* kvq_analysis.h — part of libkvq's public API (kvq.h includes every part):
 * analyses of dumps: the driver, the GPU, reports, sweeps, bit allocation. */
#ifndef KVQ_API_ANALYSIS_H
#define KVQ_API_ANALYSIS_H

#include "kvq_metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------- compute device */

/* An open GPU (opaque).  With one, the analysis runs the plan quantizers
 * (kvq_quantizer.plan) and every attention metric on it; the other
 * quantizers run on the CPU and their K', V' are copied over. */
typedef struct kvq_device kvq_device;
/* 1 if this build has the CUDA path (meson -Dcuda=enabled). */
int kvq_device_cuda_built(void);
/* Opens the first CUDA GPU; KVQ_ERR_UNSUPPORTED with one line saying why
 * (built without CUDA, no GPU or driver). */
kvq_status kvq_device_open_cuda(kvq_device **out, kvq_error *err);
const char *kvq_device_name(const kvq_device *dev);
void kvq_device_close(kvq_device *dev);

/* --------------------------------------------------------- analysis driver */

typedef enum kvq_per { KVQ_PER_HEAD, KVQ_PER_LAYER, KVQ_PER_MODEL } kvq_per;

typedef struct kvq_analysis_opts {
    const kvq_spec *specs;
    int nspecs;
    const int *layers; /* NULL: all */
    int nlayers;
    const int *heads;  /* KV heads; NULL: all */
    int nheads;
    kvq_query_sel queries;
    uint64_t seed;
    int nthreads;      /* <= 0: all cores */
    kvq_calib *calib;  /* needed by specs for which kvq_spec_needs_calib() */
    kvq_device *device; /* NULL: everything on the CPU */
    /* progress (may be NULL): called as each stage of a layer starts, with
     * the index of the selected layer, their count and what runs ("read",
     * a spec's text, "metrics") */
    void (*progress)(void *ud, int layer_index, int nlayers, const char *stage);
    void *ud;
} kvq_analysis_opts;

/* Result accumulators of one dump: acc[(li * nheads + hi) * nspecs + s] for
 * the li-th selected layer and hi-th selected head. */
typedef struct kvq_analysis {
    int nlayers, nheads, nspecs;
    int *layers, *heads;
    int has_attn;
    kvq_acc *acc;
} kvq_analysis;

kvq_status kvq_analyze_dump(kvq_dump *d, const kvq_analysis_opts *opts, kvq_analysis *out,
                            kvq_error *err);
void kvq_analysis_free(kvq_analysis *a);

/* A dump prepared for many analyses (kvq-sweep): the selected layers' K, V
 * (and pre-RoPE keys if `read_flags` asks), the query positions, RoPE and each
 * selected head's exact attention, read and computed once and kept in memory
 * (kvq_prepare_bytes says how much).  The selection (layers, heads, queries)
 * and seed come from `o`; later analyses use those, whatever their own opts
 * say, and give results identical to kvq_analyze_dump's. */
typedef struct kvq_prepared kvq_prepared;
kvq_status kvq_prepare_bytes(kvq_dump *d, const kvq_analysis_opts *o, unsigned read_flags,
                             size_t *bytes, kvq_error *err);
kvq_status kvq_prepare_dump(kvq_dump *d, const kvq_analysis_opts *o, unsigned read_flags,
                            kvq_prepared **out, kvq_error *err);
/* Uses o->specs, nspecs, nthreads and calib. */
kvq_status kvq_analyze_prepared(kvq_prepared *p, const kvq_analysis_opts *o, kvq_analysis *out,
                                kvq_error *err);
void kvq_prepared_free(kvq_prepared *p);

/* ------------------------------------------------------------- reports */

typedef enum kvq_format { KVQ_FMT_TABLE, KVQ_FMT_CSV, KVQ_FMT_JSONL } kvq_format;

typedef struct kvq_report kvq_report;
/* Rows go to `f`; the table format buffers rows to align columns. */
kvq_report *kvq_report_new(FILE *f, kvq_format fmt, const char *const *extra_cols, int nextra);
/* Emits the analysis of one dump, pooled per head, layer or model; extra:
 * the extra cells of every row (may be NULL). */
kvq_status kvq_report_analysis(kvq_report *r, const char *dump, const kvq_analysis *a,
                               const kvq_spec *specs, kvq_per per, const char *const *extra);
/* The rows of an analysis as kvq_report_analysis pools and orders them:
 * fn(ud, layer, head, spec, text, m) per row, layer and head -1 for "all",
 * text the row's spec (a mix's row of one layer: that layer's).  The first
 * status other than KVQ_OK ends it and is returned. */
typedef kvq_status (*kvq_row_fn)(void *ud, int layer, int head, const kvq_spec *spec, const char *text,
                                 const kvq_metrics *m);
kvq_status kvq_analysis_each_row(const kvq_analysis *a, const kvq_spec *specs, kvq_per per, kvq_row_fn fn, void *ud);
/* Writes the CSV header now (nothing for JSONL/table) / never: for files
 * written in pieces (kvq-sweep appends one unit of rows per point). */
kvq_status kvq_report_header(kvq_report *r);
void kvq_report_omit_header(kvq_report *r);
/* Rows with caller-named columns (kvq-eval), in the same three formats:
 * the first `ntext` columns are text (left-aligned in a table), a number
 * that is NaN is an empty cell (JSON null).  Finished by kvq_report_finish. */
typedef struct kvq_cell {
    const char *text; /* when !is_num */
    double num;
    int is_num;
} kvq_cell;
kvq_report *kvq_rows_new(FILE *f, kvq_format fmt, const char *const *cols, int ncols, int ntext);
kvq_status kvq_rows_add(kvq_report *r, const kvq_cell *cells);
kvq_status kvq_report_finish(kvq_report *r); /* flushes (table: prints) and frees */
void kvq_report_discard(kvq_report *r);      /* frees without printing buffered rows */

/* ------------------------------------------------------------- sweeps */

/* A parameter grid of one quantizer (kvq-sweep), or of the selector of a
 * tokens(SELECT; HI; LO) template (quant "tokens(snapkv; none; drop)":
 * points tokens(snapkv:keep=...; none; drop); keys written in SELECT are
 * fixed).  grids: "key=v1,v2,..."; fixed: "key=value[,key=value...]".  Usage errors: unknown quantizer or key,
 * a key given twice, a value its key does not accept, a value repeated.
 * Points: the cartesian product in the order the grid keys were given, the
 * last key varying fastest (nested loops). */
typedef struct kvq_grid kvq_grid;
kvq_status kvq_grid_new(const char *quant, const char *const *grids, int ngrids,
                        const char *const *fixed, int nfixed, kvq_grid **out, kvq_error *err);
void kvq_grid_free(kvq_grid *g);
size_t kvq_grid_size(const kvq_grid *g); /* points, invalid ones included */
int kvq_grid_nkeys(const kvq_grid *g);
const char *kvq_grid_key(const kvq_grid *g, int k);
const char *kvq_grid_value(const kvq_grid *g, size_t point, int k); /* text as given */
const kvq_quantizer *kvq_grid_quantizer(const kvq_grid *g); /* the family, or the template's selector */
unsigned kvq_grid_read_flags(const kvq_grid *g); /* KVQ_READ_* tensors its points read */
/* The spec of a point, "name:key=value,..." with the fixed and grid keys in
 * the quantizer's parameter order; KVQ_ERR_USAGE (with the reason) when the
 * point is invalid, e.g. KIVI's residual not a multiple of group. */
kvq_status kvq_grid_spec(const kvq_grid *g, size_t point, kvq_spec *out, kvq_error *err);

/* A kvq-sweep output read back (--resume, --merge): rows grouped into units,
 * one per run of consecutive rows with the same `point`. */
typedef struct kvq_sweep_unit {
    long point;
    char *spec;
    size_t nrows;
    size_t begin, end; /* byte range of its rows in the file */
} kvq_sweep_unit;

typedef struct kvq_sweep_file {
    kvq_format fmt;    /* KVQ_FMT_CSV or KVQ_FMT_JSONL (first byte '{') */
    char *columns;     /* CSV: the header line; JSONL: the keys of a row joined
                          by ','; NULL if the file has no complete line */
    size_t body;       /* offset of the first row */
    kvq_sweep_unit *units;
    size_t nunits;
    size_t end;        /* end of the last complete line */
    int partial;       /* bytes after `end` without a newline (an interrupted write) */
    char *data;        /* the whole file */
    size_t size;
} kvq_sweep_file;

/* KVQ_ERR_FORMAT naming the line for anything but kvq-sweep rows. */
kvq_status kvq_sweep_file_read(const char *path, kvq_sweep_file *out, kvq_error *err);
void kvq_sweep_file_free(kvq_sweep_file *f);

/* kvq-sweep --merge (analysis/sweep_merge.c): the shard outputs read whole
 * and checked (a sweep's rows each, the first's columns, no partial row),
 * their points in index order (none twice, each with as many rows as the
 * first); KVQ_ERR_FORMAT naming the file and the point otherwise. */
typedef struct kvq_sweep_merge kvq_sweep_merge;
kvq_status kvq_sweep_merge_open(const char *const *paths, int nfiles, kvq_sweep_merge **out, kvq_error *err);
/* --expect-grid: the merged points are every valid point of g exactly once,
 * with its spec, and nothing else; *ninvalid: g's invalid points. */
kvq_status kvq_sweep_merge_check_grid(const kvq_sweep_merge *m, const kvq_grid *g, size_t *ninvalid,
                                      kvq_error *err);
size_t kvq_sweep_merge_points(const kvq_sweep_merge *m);
size_t kvq_sweep_merge_rows(const kvq_sweep_merge *m);
kvq_format kvq_sweep_merge_format(const kvq_sweep_merge *m);
/* The merged output to f: the CSV header (of a CSV sweep), then every
 * point's rows as the shards hold them.  KVQ_ERR_IO (errno set) on a short write. */
kvq_status kvq_sweep_merge_write(const kvq_sweep_merge *m, FILE *f, kvq_error *err);
void kvq_sweep_merge_free(kvq_sweep_merge *m);

/* A shard's "I/N" (--shard of kvq-sweep, kvq-eval, kvq-alloc): 0 <= I < N <= 10^6, whole decimals; 0, or -1. */
int kvq_shard_parse(const char *s, long *i, long *n);

/* The points of a sweep (or shard) and what its OUT already holds (docs/tools.md#sweeps):
 * state[p] for each of the grid's points, 0 another shard's, 1 to run,
 * 2 invalid (no spec), 3 complete. */
enum { KVQ_POINT_OTHER = 0, KVQ_POINT_RUN, KVQ_POINT_INVALID, KVQ_POINT_DONE };
/* This shard's points (p mod shard_n == shard_i): valid ones to run,
 * invalid ones marked; *nrun, *ninvalid count them. */
void kvq_sweep_select(const kvq_grid *g, long shard_i, long shard_n, unsigned char *state, size_t *nrun,
                      size_t *ninvalid);
/* --resume: the points `old` (read from `path`) already holds.  Each unit
 * must be a point to run whose spec is the grid's, with rows_per_point rows
 * (the last may be short: an interrupted point, run again); those become
 * KVQ_POINT_DONE (*ncomplete of them) and *keep is the bytes of the file to
 * keep (its complete points).  KVQ_ERR_FORMAT naming the file and the point
 * for anything else (another grid, shard, dumps or --per). */
kvq_status kvq_sweep_reconcile(const char *path, const kvq_sweep_file *old, const kvq_grid *g, unsigned char *state,
                               size_t rows_per_point, size_t *keep, size_t *ncomplete, kvq_error *err);

/* The CSV header of a sweep's rows (kvq-analyze's columns, one per grid
 * key, then `point`), without its newline, into *text (malloc'ed).
 * KVQ_ERR_NOMEM or KVQ_OK. */
kvq_status kvq_sweep_header(const kvq_grid *g, char **text, size_t *len);
/* A dump a sweep reads: open, with its prepared data (or NULL: read per
 * point) and the name its rows carry. */
typedef struct kvq_sweep_dump {
    kvq_dump *dump;
    kvq_prepared *prep;
    const char *name;
} kvq_sweep_dump;
/* Point p's rows over the dumps in fmt (CSV without the header, or JSON
 * lines) as one unit of text in *text (malloc'ed): o's analysis with the
 * point's spec, each row followed by the grid's values and the point. */
kvq_status kvq_sweep_point_rows(const kvq_grid *g, size_t p, const kvq_sweep_dump *dumps, int ndumps,
                                const kvq_analysis_opts *o, kvq_per per, kvq_format fmt, char **text, size_t *len,
                                kvq_error *err);
/* Points pts[0..n) (each valid) as kvq_sweep_point_rows gives each, into
 * texts[i], lens[i] (malloc'ed), from one analysis of their n specs per
 * dump: with more threads than KV heads the specs share the threads (each
 * spec's sums do not depend on the others, so the bytes are the same).  On
 * a failure nothing is returned: run the points one at a time to learn
 * which failed. */
kvq_status kvq_sweep_points_rows(const kvq_grid *g, const size_t *pts, int n, const kvq_sweep_dump *dumps, int ndumps,
                                 const kvq_analysis_opts *o, kvq_per per, kvq_format fmt, char **texts, size_t *lens,
                                 kvq_error *err);
/* How many points to run at once (kvq_sweep_points_rows): threads over the
 * KV heads analysed, so that each thread has a spec when a model has few KV
 * heads, within 1 GiB of whole-layer outputs; 1 on a device. */
int kvq_sweep_batch(const kvq_sweep_dump *dumps, int ndumps, const kvq_analysis_opts *o);

/* kvq's CSV results read back (--resume, --merge): RFC 4180 as kvq writes
 * it.  Records (the header first) of ncols fields each; a last record
 * without its newline (an interrupted write) is left out and `torn` set;
 * `complete` is the byte length of the complete records.  A record with
 * another number of fields, a quote inside an unquoted field or text after
 * a quoted one: KVQ_ERR_FORMAT naming the file and line. */
typedef struct kvq_csv {
    char **cell; /* [nrec][ncols] */
    size_t *end; /* [nrec]: the byte after each record's newline */
    size_t ncells, nrec, complete;
    int ncols, torn;
} kvq_csv;
kvq_status kvq_csv_read(const char *path, kvq_csv *t, kvq_error *err);
kvq_status kvq_csv_parse(const char *path, const char *data, size_t size, kvq_csv *t, kvq_error *err);
void kvq_csv_free(kvq_csv *t);
const char *kvq_csv_at(const kvq_csv *t, size_t rec, int col); /* NULL outside the table */
int kvq_csv_column(const kvq_csv *t, const char *name);         /* its index in the header, or -1 */
/* A whole finite decimal number: 0, else -1. */
int kvq_csv_number(const char *s, double *v);
/* Whether data[0..size) is one JSON value with blanks around it (no line
 * break; nested at most 64 deep): 0, else -1 with why (at most whylen bytes,
 * NUL-terminated) saying what was expected and at which byte.  A line of a
 * JSON-lines file, or a run of a kvq meta file, checked before it is copied. */
int kvq_json_check(const char *data, size_t size, char *why, size_t whylen);

/* ------------------------------------------------------ bit allocation */

/* The exact optimum of the multiple-choice knapsack of kvq-alloc
 * (docs/models.md#kvq-alloc): for L layers with G choices each, of cost
 * cost[l][g] (predicted loss) and weight weight[l][g] (stored bits), the
 * choice[l] minimising the summed cost with the summed weight (added in
 * layer order) <= capacity; ties: the lower summed weight, then the
 * lexicographically first choices (the lower index per layer, in layer
 * order).  *min_weight (may be NULL): the lightest assignment's weight;
 * KVQ_ERR_USAGE when that exceeds capacity. */
kvq_status kvq_alloc_solve(int L, int G, const double *cost, const double *weight, double capacity, int *choice,
                           double *min_weight, kvq_error *err);
/* The mix(...) spec of an allocation: layer l gets specs[choice[l]]
 * (0 <= l < L), each chosen spec once in the order of its first layer,
 * its layers as ranges ("mix(0-1,3=A;2,4-=B)", the last range open when
 * it reaches layer L-1).  KVQ_OK, or KVQ_ERR_USAGE when the text needs
 * more than len - 1 characters (buf then holds a cut prefix). */
kvq_status kvq_alloc_mix_text(const char *const *specs, const int *choice, int L, char *buf, size_t len,
                              kvq_error *err);


struct kvq_model_info; /* kvq_model.h */

/* kvq-alloc's pipeline (docs/models.md#kvq-alloc) as calls: the tool keeps
 * the options, the files' locking and writing, and the messages around them.
 *
 * One valid grid point and its sensitivity row per layer: k_bits, v_bits,
 * dnll, dnll_se [L] (kvq_alloc_point_init), want_k/want_v the bits the
 * spec stores on the model's layers (kvq_alloc_stored_bits), done once its
 * pass is measured or read; a merge's points also record the shard (from)
 * and their rows' bytes there. */
typedef struct kvq_alloc_point {
    kvq_spec spec;
    double *k_bits, *v_bits, *dnll, *dnll_se;
    double want_k, want_v;
    int done;
    const char *from;
    const char *rows;
    size_t rows_len;
} kvq_alloc_point;
kvq_status kvq_alloc_point_init(kvq_alloc_point *pt, int L, kvq_error *err);
void kvq_alloc_point_free(kvq_alloc_point *pt); /* its arrays (the struct is the caller's) */
/* The bits per element spec stores on one of this model's layers of T
 * tokens, K and V: the quantizer run on a synthetic layer (the bits depend
 * on the shapes alone; a tokens(...) selector keeps as many tokens
 * whichever it picks). */
kvq_status kvq_alloc_stored_bits(const kvq_spec *spec, const struct kvq_model_info *in, int T, kvq_calib *calib,
                                 uint64_t seed, int nthreads, double *k_bits, double *v_bits, kvq_error *err);
/* The sensitivity table's columns (their number; *cols the names). */
int kvq_alloc_table_columns(const char *const **cols);
/* One pass's rows (every layer of pt, in order) as the table holds them,
 * header omitted: malloc'ed *buf of *len bytes. */
kvq_status kvq_alloc_table_rows(const kvq_alloc_point *pt, int L, const char *run, char **buf, size_t *len,
                                kvq_error *err);
/* What mends a refused table, for the caller to word. */
typedef enum {
    KVQ_ALLOC_FIX_NONE,
    KVQ_ALLOC_FIX_REMOVE,  /* removing the file (or not reading it) */
    KVQ_ALLOC_FIX_OPTIONS, /* ... or the options of the run that wrote it */
    KVQ_ALLOC_FIX_RESUME   /* finishing the run that writes it */
} kvq_alloc_fix;
/* Reads a table's complete passes (all L layers of a point, in layer order,
 * as a run writes them; data of size bytes, read from path) into their
 * points, each row checked: a layer of the model, a spec of the points,
 * finite numbers, bits as the spec stores them (want_k, want_v), the run's
 * fingerprint `run`; a point twice is an error.  A torn last row or an
 * unfinished last pass is not read: *keep is the byte length of what was
 * (the header included).  whole (a merge's shard): nothing may be
 * unfinished or empty, and the points record path and their rows' bytes.
 * Refusals name the file and line: KVQ_ERR_USAGE when the table is of
 * another grid, model or run, else KVQ_ERR_FORMAT; *fix says what mends it. */
kvq_status kvq_alloc_table_read(const char *path, const char *data, size_t size, int whole, const char *run,
                                kvq_alloc_point *pts, int np, int L, size_t *keep, kvq_alloc_fix *fix,
                                kvq_error *err);

/* The allocations of measured points per budget (steps 2 and 3 of
 * docs/models.md#kvq-alloc): a layer's weight is its stored bits (the
 * mean of K and V per element times layer_elems, its K and V elements per
 * token), its cost the point's dnll; each budget B (bits per element) has
 * the capacity B·layer_elems·L. */
typedef struct kvq_allocation {
    int L, np, nbudgets;
    double elems;          /* layer_elems · L */
    double *cost, *weight; /* [L][np] */
    int *choice;           /* [nbudgets][L]: the knapsack's optimum (kvq_alloc_solve) */
    kvq_spec *mix;         /* [nbudgets]: the allocation as a mix(...) spec */
    double *pred;          /* [nbudgets]: its predicted dnll, the summed costs */
    double *ubits, *upred; /* [np]: the uniform point's bits per element and predicted dnll */
    unsigned char *fits;   /* [np]: the uniform point is within the largest budget */
    int bad_budget;        /* after a refusal: the budget refused (−1: none) */
    double min_bits;       /* ... below the cheapest allocation, which stores this (NaN otherwise) */
} kvq_allocation;
/* KVQ_ERR_USAGE for a budget below the cheapest allocation, KVQ_ERR_UNSUPPORTED
 * for an allocation whose mix(...) exceeds KVQ_SPEC_MAX (bad_budget says
 * which; the message starts "budget B: "). */
kvq_status kvq_alloc_plan(const kvq_alloc_point *pts, int np, int L, double layer_elems, const double *budgets,
                          int nbudgets, kvq_allocation *out, kvq_error *err);
/* The best uniform point within budget once evaluated (nll[i] for each
 * point that fits): the least nll, then fewer bits; −1 if none fits. */
int kvq_alloc_best_uniform(const kvq_allocation *a, double budget, const double *nll);
void kvq_allocation_free(kvq_allocation *a);

#ifdef __cplusplus
}
#endif
#endif
