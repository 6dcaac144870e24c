/* kvq_dump.h — part of libkvq's public API (kvq.h includes every part):
 * dumps (docs/dump-format.md): reading, writing, synthetic dumps, statistics. */
#ifndef KVQ_API_DUMP_H
#define KVQ_API_DUMP_H

#include "kvq_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------- dumps (docs/dump-format.md) */

typedef enum kvq_dtype { KVQ_F16 = 0, KVQ_F32 = 1, KVQ_F64 = 2 } kvq_dtype;
typedef enum kvq_rope_style { KVQ_ROPE_UNSET = 0, KVQ_ROPE_INTERLEAVED, KVQ_ROPE_HALF } kvq_rope_style;

typedef struct kvq_dump_info {
    char model[256];
    int num_layers;    /* L */
    int num_heads;     /* Hq, query heads */
    int num_kv_heads;  /* H */
    int head_dim;      /* D */
    int seq_len;       /* T */
    int has_rope_theta;
    double rope_theta;
    kvq_rope_style rope_style;
    int query_prescaled;
    int has_query;        /* every layer has `query` */
    int has_key_pre_rope; /* every layer has `key_pre_rope` */
    int has_rope_table;   /* root `rope_cos`/`rope_sin` present */
    kvq_dtype key_dtype, value_dtype, query_dtype;
    double attn_scale;    /* root `attn_scale` (0: absent, 1/sqrt(D)) */
    double attn_softcap;  /* root `attn_softcap` (0: none) */
    int window_layers;    /* layers with a `sliding_window` > 0 (kvq_dump_attn_mode gives each) */
} kvq_dump_info;

/* One layer in memory.  Arrays are owned by the struct (kvq_layer_free). */
typedef struct kvq_layer {
    int H, Hq, T, D;
    float *key;          /* [H][T][D] */
    float *value;        /* [H][T][D] */
    float *query;        /* [Hq][T][D] or NULL */
    float *key_pre_rope; /* [H][T][D] or NULL */
} kvq_layer;

enum { KVQ_READ_QUERY = 1u, KVQ_READ_KEY_PRE_ROPE = 2u };

typedef struct kvq_dump kvq_dump; /* an open dump file (opaque) */

/* Opens and validates every attribute and the shape/type of every dataset;
 * tensor values are read (and checked finite) by kvq_dump_read_layer. */
kvq_status kvq_dump_open(const char *path, kvq_dump **out, kvq_error *err);
/* A dump held in memory, as a file would hold it (docs/dump-format.md): the
 * layers' tensors (borrowed: they must outlive the handle), every layer of
 * one shape with the same optional tensors, and the root attributes. */
typedef struct kvq_dump_mem {
    const char *name;  /* what messages name (and kvq_dump_path returns) */
    const char *model;
    const kvq_layer *layers; /* [nlayers] */
    int nlayers;
    const int *windows;      /* [nlayers] each layer's sliding_window (0: none), or NULL: none */
    double rope_theta;       /* 0: absent */
    kvq_rope_style rope_style;
    const double *rope_cos, *rope_sin; /* [T][D/2] tables (rounded to float32, as a file keeps them) or NULL */
    int query_prescaled;
    double attn_scale, attn_softcap; /* 0: absent / none */
} kvq_dump_mem;
/* The handle of kvq_dump_open over m, checked as a file is (shapes,
 * attributes; values finite when read), so that the driver reads it as it
 * reads a file.  KVQ_ERR_FORMAT naming m->name and the object. */
kvq_status kvq_dump_from_memory(const kvq_dump_mem *m, kvq_dump **out, kvq_error *err);
const kvq_dump_info *kvq_dump_get_info(const kvq_dump *d);
/* The dump's model attribute whole (kvq_dump_info.model holds its first 255 bytes). */
const char *kvq_dump_model(const kvq_dump *d);
const char *kvq_dump_path(const kvq_dump *d);
/* Reads one layer (memory stays bounded by one layer).  `flags` selects the
 * optional tensors; those the dump lacks are left NULL. */
kvq_status kvq_dump_read_layer(kvq_dump *d, int layer, unsigned flags, kvq_layer *out,
                               kvq_error *err);
/* The same into io's buffers when they have this dump's shape and the same
 * optional tensors (else they are freed and allocated anew): a loop over
 * layers touches its memory once.  io starts zeroed; kvq_layer_free at the end. */
kvq_status kvq_dump_read_layer_reuse(kvq_dump *d, int layer, unsigned flags, kvq_layer *io,
                                     kvq_error *err);
/* Only the query rows at positions pos (ascending, < seq_len) of one layer:
 * *out (malloc'ed) = [Hq][npos][D], read as a hyperslab and checked finite. */
kvq_status kvq_dump_read_query_rows(kvq_dump *d, int layer, const int *pos, size_t npos, float **out,
                                    kvq_error *err);
/* The root `tokens` attribute (kvq-dump's token ids; *tokens malloc'ed):
 * KVQ_ERR_FORMAT where it is missing (kvq_dump_has_tokens: 1 if it is there). */
kvq_status kvq_dump_read_tokens(kvq_dump *d, int **tokens, size_t *n, kvq_error *err);
int kvq_dump_has_tokens(kvq_dump *d);
/* The threads that read a float16 tensor of several slabs: 2 (the default,
 * where OpenMP has two: one reads a slab while the other converts the one
 * before) or 1, which leaves a core to other work (the tools' background
 * hash on a 2-core machine).  The values and errors read are the same. */
void kvq_dump_set_read_threads(kvq_dump *d, int nthreads);
void kvq_dump_close(kvq_dump *d);
void kvq_layer_free(kvq_layer *l);

/* RoPE of one dump: the angle of every position t < T and pair i < D/2,
 * from the root rope_cos/rope_sin tables when present, else from
 * rope_theta (angle = t·theta^(−2i/D), in double), paired by `style`. */
typedef struct kvq_rope {
    int T, D;
    kvq_rope_style style;
    double *cos, *sin; /* [T][D/2] */
} kvq_rope;
/* Fails (KVQ_ERR_FORMAT, naming the missing attribute) if the dump has no
 * rope_style or neither tables nor rope_theta. */
kvq_status kvq_dump_read_rope(kvq_dump *d, kvq_rope *out, kvq_error *err);
kvq_status kvq_rope_from_theta(kvq_rope *r, int T, int D, double theta, kvq_rope_style style,
                               kvq_error *err);
void kvq_rope_free(kvq_rope *r);
/* x [D] of position t: rotated forward (RoPE) or back (inverse = 1), in place. */
void kvq_rope_rotate(const kvq_rope *r, float *x, int t, int inverse);
/* Allocates a zeroed layer of the given shape (query/key_pre_rope optional). */
kvq_status kvq_layer_alloc(kvq_layer *l, int H, int Hq, int T, int D, unsigned flags,
                           kvq_error *err);

/* Writer: the file is built under a temporary name and renamed into place by
 * kvq_dump_writer_finish, so a crash never leaves a half-written dump. */
typedef struct kvq_dump_writer kvq_dump_writer;
kvq_status kvq_dump_writer_create(const char *path, const kvq_dump_info *info, kvq_dtype dtype,
                                  kvq_dump_writer **out, kvq_error *err);
/* Writes /layer_NNN from `l` (query and key_pre_rope when non-NULL). */
kvq_status kvq_dump_writer_layer(kvq_dump_writer *w, int layer, const kvq_layer *l,
                                 kvq_error *err);
/* Integer attribute `name` of /layer_NNN (written after that layer). */
kvq_status kvq_dump_writer_layer_attr_int(kvq_dump_writer *w, int layer, const char *name, long long v,
                                          kvq_error *err);
/* Writes the root rope_cos/rope_sin tables ([T][D/2] each). */
kvq_status kvq_dump_writer_rope_table(kvq_dump_writer *w, const float *cos, const float *sin,
                                      kvq_error *err);
/* Extra root attributes: an int32 array (n = 0: the scalar v[0]), a float64, a string. */
kvq_status kvq_dump_writer_attr_ints(kvq_dump_writer *w, const char *name, const int *v, size_t n,
                                     kvq_error *err);
kvq_status kvq_dump_writer_attr_real(kvq_dump_writer *w, const char *name, double v, kvq_error *err);
kvq_status kvq_dump_writer_attr_string(kvq_dump_writer *w, const char *name, const char *v,
                                       kvq_error *err);
kvq_status kvq_dump_writer_finish(kvq_dump_writer *w, kvq_error *err);
/* The temporary file's name (a tool removes it if a signal ends the run). */
/* A tool's hooks told of every dump writer's temporary as it is created and
 * when it is renamed or removed (so that a signal handler can remove it);
 * NULL: none.  Process-wide; set before writing. */
void kvq_set_temp_hooks(void (*created)(const char *tmp), void (*gone)(const char *tmp));
void kvq_dump_writer_abort(kvq_dump_writer *w); /* closes and removes the temporary */

/* ---------------------------------------------------- synthetic dumps */

typedef struct kvq_gen_opts {
    int num_layers, num_heads, num_kv_heads, head_dim, seq_len;
    kvq_rope_style rope_style;
    double rope_theta;
    int outlier_channels; /* per KV head, in pre-RoPE keys */
    double outlier_scale; /* magnitude factor of those channels */
    double peak;          /* query/key alignment: larger = more peaked attention */
    int with_query, with_key_pre_rope;
    kvq_dtype dtype;
    uint64_t seed;
    /* optional: called before each layer is generated and written */
    void (*progress)(void *ud, int layer_index, int nlayers, const char *stage);
    void *progress_ud;
} kvq_gen_opts;

void kvq_gen_defaults(kvq_gen_opts *o);
kvq_status kvq_gen_write(const char *path, const kvq_gen_opts *o, kvq_error *err);
/* Applies RoPE to x [T][D] in place for positions 0..T-1. */
void kvq_rope_apply(float *x, int T, int D, double theta, kvq_rope_style style);

/* ------------------------------------------------------- dump statistics */

typedef struct kvq_channel_stats {
    double abs_max, abs_mean, rms;
} kvq_channel_stats;

/* Per-(head, channel) statistics of x [H][T][D] into st[H*D]. */
void kvq_channel_stats_compute(const float *x, int H, int T, int D, kvq_channel_stats *st);
/* max/median of per-channel abs-max over H*D channels. */
double kvq_channel_absmax_ratio(const kvq_channel_stats *st, size_t n);
/* Pearson kurtosis (normal = 3) of n values. */
double kvq_kurtosis(const float *x, size_t n);

#ifdef __cplusplus
}
#endif
#endif
