/* kvq.h — public API of libkvq, the KV-cache quantization analysis library.
 *
 * The library reads kvq-dump/1 HDF5 files (docs/dump-format.md), runs
 * quantizers from one registry (docs/quantizers.md) over one layer at a time,
 * and accumulates reconstruction and attention metrics (docs/metrics.md).
 * It never prints and never exits: every function that can fail returns a
 * kvq_status and fills a kvq_error with one line that names the file, the
 * object and what was expected.
 *
 * Tensor layout everywhere: one layer's keys/values are float32 [H][T][D]
 * (KV head, token, channel), queries [Hq][T][D], row-major.
 */
#ifndef KVQ_H
#define KVQ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ errors */

typedef enum kvq_status {
    KVQ_OK = 0,
    KVQ_ERR_USAGE,       /* bad spec string or option value (tools exit 2) */
    KVQ_ERR_IO,          /* cannot open, read or write a file */
    KVQ_ERR_FORMAT,      /* input is not a valid kvq-dump/1 file */
    KVQ_ERR_NOMEM,       /* allocation failed or size overflows */
    KVQ_ERR_NUMERIC,     /* a value cannot be represented (e.g. fp16 scale) */
    KVQ_ERR_UNSUPPORTED, /* a feature this build or input does not offer */
    KVQ_ERR_INTERNAL     /* a LAPACK or other library call failed */
} kvq_status;

/* Detail for the last failure: one line, no trailing newline. */
typedef struct kvq_error {
    kvq_status status;
    char msg[1024];
} kvq_error;

const char *kvq_strerror(kvq_status st);
const char *kvq_version(void);
/* What this libkvq is, as provenance records it (docs/tools.md#provenance):
 * its version; the git commit it was built from (40 hex digits, "-dirty"
 * appended when the work tree had changes; "" when not built from a git
 * checkout); the SIMD level its paths use now ("none", "avx2", "avx512":
 * the CPU's, capped by KVQ_SIMD); the BLAS (OpenBLAS's configuration
 * string); and whether the CUDA module was built with it. */
typedef struct kvq_build_info {
    const char *version, *commit, *simd, *blas, *blas_core;
    int cuda_built;
} kvq_build_info;
void kvq_get_build_info(kvq_build_info *info);
/* OpenBLAS's kernels (docs/performance.md#blas-kernels): the core in use
 * (openblas_get_corename); the one OpenBLAS chose itself (the same unless
 * KVQ_TEST_BLAS_DETECTED=NAME in the environment, for tests, says it chose
 * NAME); the best core this CPU can run (NULL: not x86-64); that core when
 * it is above OpenBLAS's choice and OpenBLAS can switch (a DYNAMIC_ARCH
 * build), else NULL — what the tools restart with. */
const char *kvq_blas_core(void);
const char *kvq_blas_core_detected(void);
const char *kvq_blas_core_for_cpu(void);
const char *kvq_blas_core_wanted(void);
/* Why that core: "detected by OpenBLAS", "OPENBLAS_CORETYPE=X" (the user's)
 * or "chosen by kvq (OPENBLAS_CORETYPE=X; OpenBLAS detected Y)". */
void kvq_blas_core_source(char *buf, size_t len);
/* The threads a call given nthreads = requested uses: requested when > 0,
 * else the processors this process may run on. */
int kvq_threads(int requested);
/* The most threads a call may ask for (the tools' --threads, the bindings' threads=). */
#define KVQ_MAX_THREADS 4096

/* ------------------------------------------------------- numeric helpers */

/* float32 -> IEEE binary16 with round-half-to-even (overflow -> inf). */
uint16_t kvq_f32_to_f16(float x);
float kvq_f16_to_f32(uint16_t h);
/* x rounded to the nearest fp16 value, returned as float32. */
float kvq_round_f16(float x);
/* Bulk conversions; use F16C when the CPU has it (checked at run time). */
void kvq_f16_to_f32_array(const uint16_t *src, float *dst, size_t n);
void kvq_f16_to_f32_array_ref(const uint16_t *src, float *dst, size_t n);
void kvq_f32_to_f16_array(const float *src, uint16_t *dst, size_t n);

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

/* Result files (every writer of kvq): *target (malloc'ed) is path with its
 * symlinks followed, so that a temporary + rename replaces the link's target;
 * *special = 1 when the target exists and is a FIFO or a device (written in
 * place, never replaced).  A directory or a symlink loop is KVQ_ERR_IO. */
kvq_status kvq_output_target(const char *path, char **target, int *special, kvq_error *err);
/* Creates "target.tmp.XXXXXX" (*tmp malloc'ed, *fd open) with the mode the
 * file keeps after the rename: an existing target's, else 0666 & ~umask.
 * Messages name path, the name the user gave. */
kvq_status kvq_output_temp(const char *path, const char *target, char **tmp, int *fd, kvq_error *err);

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

/* ---------------------------------- quantizer registry (docs/quantizers.md) */

typedef enum kvq_param_type { KVQ_PARAM_INT, KVQ_PARAM_REAL, KVQ_PARAM_CHOICE } kvq_param_type;

typedef struct kvq_param {
    const char *key;
    kvq_param_type type;
    const char *def;     /* default as text; NULL: unset unless given (e.g. kivi kbits) */
    double min, max;     /* inclusive range of INT/REAL values */
    const char *choices; /* CHOICE: "head|layer" */
    const char *help;
    int quiet_default;   /* left out of kvq_spec_format_full at its default (an option, e.g. prerotate) */
} kvq_param;

#define KVQ_MAX_PARAMS 16
#define KVQ_SPEC_MAX 1024 /* a mix(...) holds a spec per range */

/* A parsed spec string `name:key=value,...`. */
typedef struct kvq_spec {
    const struct kvq_quantizer *q;
    double val[KVQ_MAX_PARAMS];         /* number, or index into `choices`; NaN if unset */
    unsigned char given[KVQ_MAX_PARAMS]; /* set explicitly in the string */
    char text[KVQ_SPEC_MAX];            /* the string as given */
} kvq_spec;

/* What a quantizer sees besides the layer. */
typedef struct kvq_quant_ctx {
    const kvq_dump_info *info;
    int layer;
    uint64_t seed;
    int nthreads;
    const void *calib;    /* the spec's calibration state for this layer (or NULL) */
    const kvq_rope *rope; /* the dump's RoPE when the quantizer asked for it (or NULL) */
} kvq_quant_ctx;

/* What a quantizer produces: K', V' [H][T][D] and the stored bits per head. */
typedef struct kvq_quant_out {
    float *key, *value;
    double *k_bits, *v_bits; /* [H], filled by the quantizer */
    double *static_bytes;    /* [H], zeroed by the caller: bytes held once per model
                                whatever the sequence length (centres, codebooks, rotations) */
    /* Optional fused error sums, [2][H] (K heads, then V heads), zeroed by the
     * caller; NULL when not asked.  A quantizer may add each head's
     * reconstruction error here while the data is in cache (kvq_head_recon)
     * and set recon_done[tensor * H + h]; the driver computes the rest. */
    struct kvq_recon_acc *recon;
    unsigned char *recon_done;
} kvq_quant_out;

/* A quantizer of the registry (its definition, for the authors of a family,
 * is in quant/quant.h): read through these. */
typedef struct kvq_quantizer kvq_quantizer;
const char *kvq_quantizer_name(const kvq_quantizer *q);
const char *kvq_quantizer_description(const kvq_quantizer *q);
int kvq_quantizer_nparams(const kvq_quantizer *q);
const kvq_param *kvq_quantizer_param(const kvq_quantizer *q, int i);
int kvq_quantizer_in_default_set(const kvq_quantizer *q); /* part of kvq-analyze's default set */
unsigned kvq_quantizer_read_flags(const kvq_quantizer *q); /* KVQ_READ_* tensors it reads */
/* The keys of a non-default spec the tests run beside the default one ("bits=3,group=4"): NAME:KEYS */
const char *kvq_quantizer_example_spec(const kvq_quantizer *q);

size_t kvq_quantizer_count(void);
const kvq_quantizer *kvq_quantizer_at(size_t i);
const kvq_quantizer *kvq_quantizer_find(const char *name);

kvq_status kvq_spec_parse(const char *text, kvq_spec *out, kvq_error *err);
/* The quantizer's check_shape for heads of head_dim channels (KVQ_OK if it
 * has none); kvq_quantize_layer checks it too. */
kvq_status kvq_spec_check_shape(const kvq_spec *spec, int head_dim, kvq_error *err);
/* The spec q contributes to kvq-analyze's default set: "name", or
 * "name:default_spec" when it has one. */
kvq_status kvq_spec_default(const kvq_quantizer *q, kvq_spec *out, kvq_error *err);
/* Runs spec's quantizer on one layer: out->key/value [H][T][D], out->k_bits/v_bits [H]. */
kvq_status kvq_quantize_layer(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err);
/* Index of `key` in the quantizer's parameter table, or -1. */
int kvq_spec_param_index(const kvq_quantizer *q, const char *key);
/* Parses one value of parameter `key` of q (type and range; no cross-key
 * check).  KVQ_ERR_USAGE naming the quantizer's keys for an unknown key. */
kvq_status kvq_param_parse(const kvq_quantizer *q, const char *key, const char *text, double *val,
                           kvq_error *err);
/* Writes "name:key=value,..." with every parameter (defaults filled in). */
void kvq_spec_format_full(const kvq_spec *spec, char *buf, size_t len);
/* Writes the quantizer table for --list-quantizers. */
void kvq_registry_describe(FILE *f);
/* Does this spec need a --calib dump? (a mix: does any of its specs) */
int kvq_spec_needs_calib(const kvq_spec *spec);
/* The one calibration rule: KVQ_ERR_USAGE, "SPEC: " KVQ_NEEDS_CALIB, when
 * the spec needs a calibration dump and the caller has none (the tools add
 * how to give one). */
#define KVQ_NEEDS_CALIB "needs a calibration dump of the same model (a dump of another text)"
kvq_status kvq_spec_check_calib(const kvq_spec *spec, int have_calib, kvq_error *err);
/* The tensors the spec reads besides K and V (KVQ_READ_*; a mix: all of its specs'). */
unsigned kvq_spec_read_flags(const kvq_spec *spec);

/* Mixed precision (docs/quantizers.md#mix): `mix(RANGE=SPEC;RANGE=SPEC;...)`
 * runs each layer with the spec of the range that holds it; RANGE is a
 * layer list as --layers takes it (a-b, a- to the last layer, a,b).  A
 * plain spec is its own spec for every layer. */
int kvq_spec_is_mix(const kvq_spec *spec);
/* The spec that quantizes `layer` (KVQ_ERR_USAGE if no range holds it). */
kvq_status kvq_spec_for_layer(const kvq_spec *spec, int layer, kvq_spec *out, kvq_error *err);
/* Every layer 0..nlayers-1 in exactly one range and no range past the last
 * (else KVQ_ERR_USAGE naming the layer or the range); KVQ_OK for a plain spec. */
kvq_status kvq_spec_check_layers(const kvq_spec *spec, int nlayers, kvq_error *err);

/* A calibration dump and the states computed from it, kept for the whole
 * run so that every dump, spec and sweep point sharing a state reuses it. */
typedef struct kvq_calib kvq_calib;
kvq_status kvq_calib_open(const char *path, kvq_calib **out, kvq_error *err);
/* Fails unless the calibration dump has the model shape of `info`
 * (layers, KV heads, head_dim). */
kvq_status kvq_calib_check(const kvq_calib *c, const char *dump_path, const kvq_dump_info *info,
                           kvq_error *err);
/* Fails unless the calibration dump has layer `layer`, H KV heads and
 * head_dim D (arrays given by a caller rather than a dump). */
kvq_status kvq_calib_check_layer(const kvq_calib *c, int layer, int H, int D, kvq_error *err);
/* The state of `spec` for `layer` (computed on first use); *state may be NULL. */
kvq_status kvq_calib_state(kvq_calib *c, const kvq_spec *spec, int layer, uint64_t seed,
                           int nthreads, const void **state, kvq_error *err);
/* Number of calibration states computed so far (each (layer, quantizer, key) once). */
size_t kvq_calib_count(const kvq_calib *c);
void kvq_calib_close(kvq_calib *c);

/* ------------------------------------------------ metrics (docs/metrics.md) */

/* Sums for one tensor's reconstruction error; merged by adding. */
typedef struct kvq_recon_acc {
    double n;         /* elements */
    double sum_x2;    /* Σ x² */
    double sum_e2;    /* Σ e², e = x − x' */
    double sum_abs_e; /* Σ |e| */
    double max_abs;   /* max |e| */
    double bits;      /* stored bits */
} kvq_recon_acc;

typedef struct kvq_attn_acc {
    double rows;          /* query rows (query heads × positions) */
    double s_ref2, s_diff2;
    double a_ref2, a_diff2;
    double kl_sum;
    double top1_same;
    double o_ref2, o_diff2, o_joint_diff2;
} kvq_attn_acc;

typedef struct kvq_acc {
    kvq_recon_acc k, v;
    double static_bytes; /* summed over pooled (layer, head) cells */
    int has_attn;
    kvq_attn_acc attn;
} kvq_acc;

typedef struct kvq_metrics {
    double k_bits, v_bits;
    double k_rel_fro, k_rmse, k_mae, k_max_abs, k_sqnr_db;
    double v_rel_fro, v_rmse, v_mae, v_max_abs, v_sqnr_db;
    int has_attn; /* the attention columns below are meaningful */
    double score_rel, attn_rel, attn_kl, attn_top1, out_rel, out_rel_joint;
    double static_bytes;
} kvq_metrics;

/* Adds the error of xq against x (n elements) to `acc` (bits untouched). */
void kvq_recon_accumulate(kvq_recon_acc *acc, const float *x, const float *xq, size_t n);
void kvq_recon_accumulate_ref(kvq_recon_acc *acc, const float *x, const float *xq, size_t n);
void kvq_acc_merge(kvq_acc *dst, const kvq_acc *src);
void kvq_metrics_finalize(const kvq_acc *acc, kvq_metrics *m);

/* Query positions (docs/metrics.md). */
typedef enum kvq_query_kind { KVQ_Q_LAST, KVQ_Q_ALL, KVQ_Q_EVERY, KVQ_Q_RANDOM } kvq_query_kind;
typedef struct kvq_query_sel {
    kvq_query_kind kind;
    long n;
} kvq_query_sel;

kvq_status kvq_query_sel_parse(const char *text, kvq_query_sel *out, kvq_error *err);
/* Sorted positions for a sequence of T tokens; *pos is malloc'ed. */
kvq_status kvq_query_positions(const kvq_query_sel *sel, int T, uint64_t seed, int **pos,
                               size_t *npos, kvq_error *err);

/* How the model turns q·k into attention (docs/dump-format.md): softmax(scale · q·k)
 * (prescaled: the queries already carry the scale), each score soft-capped
 * c·tanh(s/c) when softcap > 0, over the causal keys p − window < k <= p
 * (window 0: all of 0..p).  scale 0 (or 1/sqrt(D) within 1e-6) is the plain
 * attention, computed as a division by sqrt(D) (docs/metrics.md's order). */
typedef struct kvq_attn_mode {
    int prescaled;
    float scale, softcap;
    int window;
} kvq_attn_mode;
/* The mode of a dump's layer (root attn_scale, attn_softcap, query_prescaled,
 * the layer's sliding_window). */
kvq_attn_mode kvq_dump_attn_mode(const kvq_dump *d, int layer);
/* 1 when the mode is plain causal softmax(q·k/sqrt(D)) (what the GPU path computes). */
int kvq_attn_mode_plain(const kvq_attn_mode *m, int D);

/* Attention metrics of one KV head for several quantizers at once (docs/metrics.md).
 * Q: the G query heads reading this KV head, [G][T][D].  K, V: [T][D].
 * Kq[i], Vq[i]: quantizer i's reconstruction, [T][D].  acc[i] receives the
 * sums.  Score matrices go through cblas_sgemm in row chunks of bounded size. */
kvq_status kvq_attention_head(const float *Q, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err);
/* The same with only the query rows at pos: Qrows [G][npos][D] (what
 * kvq_dump_read_query_rows reads, one KV head's G query heads). */
kvq_status kvq_attention_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err);
/* The exact side of one KV head's attention (query rows, S, A, O in the
 * chunks kvq_attention_head uses), computed once and kept, so that any number
 * of later quantizers are compared against it with bit-identical sums. */
typedef struct kvq_attn_ref kvq_attn_ref;
kvq_status kvq_attn_ref_new(const float *Q, int G, const float *K, const float *V, int T, int D,
                            kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                            kvq_error *err);
/* The same from the query rows at pos, Qrows [G][npos][D]. */
kvq_status kvq_attn_ref_new_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                                 kvq_error *err);
/* Same sums as kvq_attention_head with the K, V, Q the reference was built from. */
kvq_status kvq_attn_ref_compare(const kvq_attn_ref *ref, int nquant, const float *const *Kq,
                                const float *const *Vq, kvq_attn_acc *acc, kvq_error *err);
/* Memory kvq_attn_ref_new will hold for these shapes, in bytes. */
size_t kvq_attn_ref_bytes(int G, int T, int D, const int *pos, size_t npos);
void kvq_attn_ref_free(kvq_attn_ref *ref);
/* Plain reference of the same (no BLAS, no chunking), for tests. */
kvq_status kvq_attention_head_ref(const float *Q, int G, const float *K, const float *V, int T,
                                  int D, kvq_attn_mode mode, const int *pos, size_t npos,
                                  int nquant, const float *const *Kq, const float *const *Vq,
                                  kvq_attn_acc *acc, kvq_error *err);

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

/* A parameter grid of one quantizer (kvq-sweep).  grids: "key=v1,v2,...";
 * fixed: "key=value[,key=value...]".  Usage errors: unknown quantizer or key,
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
const kvq_quantizer *kvq_grid_quantizer(const kvq_grid *g);
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

/* -------------------------------------- models in the loop (docs/models.md) */

typedef enum kvq_arch { KVQ_ARCH_LLAMA = 0, KVQ_ARCH_QWEN2, KVQ_ARCH_QWEN3, KVQ_ARCH_GEMMA3, KVQ_ARCH_PHI3 } kvq_arch;
/* The feed-forward's gate activation: silu (SwiGLU) or GELU, tanh form (GeGLU). */
typedef enum kvq_ffn_act { KVQ_ACT_SILU = 0, KVQ_ACT_GELU_TANH } kvq_ffn_act;

typedef struct kvq_model_info {
    char path[1024];
    char name[256];      /* general.name, or the llama2.c file's base name */
    char format[32];     /* "GGUF v3", "llama2.c v0" */
    char arch_name[64];  /* "llama", "qwen2", "qwen3", "gemma3", "phi3" */
    kvq_arch arch;
    int n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, vocab_size, context_length;
    float norm_eps;
    double rope_theta;
    kvq_rope_style rope_style; /* llama: interleaved (GGUF's permuted Q/K); qwen2: half */
    int has_rope_freqs;  /* a rope_freqs tensor divides each pair's frequency */
    double rope_scale;   /* linear RoPE scaling: angles × rope_scale (1: none; 0 read as 1) */
    int tied_output;     /* the output matrix is the token embedding */
    int has_qkv_bias;
    int has_qk_norm;     /* qwen3, gemma3: RMSNorm of each head's q and k before RoPE */
    int has_post_norms;  /* gemma3: RMSNorm of the attention and FFN outputs before the residual add */
    kvq_ffn_act ffn_act;
    float embed_scale;   /* the token embedding is multiplied by it (gemma3: sqrt(dim)); 0: 1 */
    float attn_scale;    /* softmax(attn_scale · q·k); 0: 1/sqrt(head_dim) */
    float logit_softcap; /* final logits c·tanh(z/c); 0: none */
    int sliding_window;  /* W of the sliding-window layers (0: none): p attends to p−W < k <= p */
    int n_swa_layers;    /* how many layers use it (kvq_model_layer_window says which) */
    double rope_theta_swa; /* RoPE base of the sliding-window layers */
    int has_tokenizer;   /* --text works */
    char tokenizer[64];  /* tokenizer.ggml.model, or "llama2.c" */
} kvq_model_info;

typedef struct kvq_model kvq_model;

/* Opens a GGUF v2/v3 file or a llama2.c v0 checkpoint (told by the magic;
 * tokenizer_path: llama2.c's tokenizer.bin, NULL for none).  The file is
 * mapped and checked; weights are dequantized later, a layer at a time. */
kvq_status kvq_model_open(const char *path, const char *tokenizer_path, kvq_model **out, kvq_error *err);
const kvq_model_info *kvq_model_get_info(const kvq_model *m);
/* The sliding window of `layer` (0: the layer attends to every earlier position). */
int kvq_model_layer_window(const kvq_model *m, int layer);
void kvq_model_close(kvq_model *m);
/* The model's SentencePiece tokenizer: BOS, then the text's tokens (*ids
 * malloc'ed).  KVQ_ERR_UNSUPPORTED naming --tokens if the model has none. */
kvq_status kvq_model_tokenize(const kvq_model *m, const char *text, size_t len, int **ids, size_t *n,
                              kvq_error *err);
/* The text file at `path`, tokenized as kvq_model_tokenize does, read and
 * tokenized in segments so that with max_tokens > 0 only as much of the file
 * is read as that many tokens need (cut after a newline followed by
 * printable ASCII, where no token can span); a NUL byte is KVQ_ERR_FORMAT. */
kvq_status kvq_model_tokenize_file(const kvq_model *m, const char *path, size_t max_tokens, int **ids, size_t *n,
                                   kvq_error *err);
/* Whitespace-separated token ids, each below vocab; `what` names the source. */
kvq_status kvq_tokens_parse(const char *what, const char *text, size_t len, int vocab, int **ids,
                            size_t *n, kvq_error *err);
/* The same, read from a file in blocks: at most max_tokens ids (0: all)
 * are read, so /dev/urandom or a huge file cost no more than they; a NUL
 * byte (/dev/zero, a binary file) is KVQ_ERR_FORMAT at the first block. */
kvq_status kvq_tokens_parse_file(const char *path, int vocab, size_t max_tokens, int **ids, size_t *n,
                                 kvq_error *err);

/* Writes kvq-dump/1 (atomically) of a forward pass over tokens[0..T): key,
 * value, query (post-RoPE, not prescaled) and key_pre_rope of the selected
 * layers (NULL: all; the dump's layers are renumbered 0..nlayers−1 and its
 * `source_layers` attribute lists the model's), RoPE attributes (and tables
 * when rope_freqs apply), `tokens` and `mean_nll`.  *mean_nll may be NULL. */
kvq_status kvq_model_dump(kvq_model *m, const int *tokens, int T, const int *layers, int nlayers,
                          const char *out_path, int nthreads, double *mean_nll, kvq_error *err);

typedef enum kvq_policy { KVQ_POLICY_PREFILL = 0, KVQ_POLICY_DECODE } kvq_policy;

/* One evaluated configuration: a quantizer (spec NULL: the exact cache,
 * `-q none`) applied in every layer (layer −1) or one layer only. */
typedef struct kvq_eval_item {
    const kvq_spec *spec;
    int layer;
    kvq_policy policy;
    /* results */
    double k_bits, v_bits;   /* stored bits per element, pooled over the quantized layers */
    double nll, kl, top1;    /* means over the scored positions (0..T−2, or each window's second half) */
    int positions;           /* how many positions were scored */
    double dnll_se;          /* standard error of dnll: sample std of the per-position differences / sqrt(positions) */
} kvq_eval_item;

/* What a corpus evaluation pools over its windows for one configuration
 * (the exact model: nll and positions alone): sums over the scored
 * positions, the stored bits and elements of the quantized layers' caches,
 * and the Welford state (count, mean, squared deviations) of the
 * per-position dnll.  A window's sums are added in window order
 * (kvq_eval_sums_add, Chan's combination for the Welford state), so sums of
 * windows evaluated apart (kvq-eval --shard) merged in window order give the
 * numbers of one run bit for bit. */
typedef struct kvq_eval_sums {
    double nll, kl, top1, positions;
    double k_bits, v_bits, elements;
    double d_n, d_mean, d_m2;
} kvq_eval_sums;
void kvq_eval_sums_add(kvq_eval_sums *acc, const kvq_eval_sums *w);
/* The item's results (nll, kl, top1 as means; bits per element; positions;
 * dnll_se) from its pooled sums. */
void kvq_eval_item_finish(kvq_eval_item *it, const kvq_eval_sums *s);

typedef struct kvq_eval_opts {
    int stride;        /* decode: the cache is re-quantized every `stride` positions (1: exact decode) */
    uint64_t seed;
    int nthreads;      /* <= 0: all cores */
    kvq_calib *calib;  /* for specs that need one */
    size_t max_bytes;  /* bound on the hidden states kept at once (0: 4 GiB) */
    /* progress (may be NULL): called after each layer of each pass */
    void (*progress)(void *ud, int pass, int npasses, int layer, int nlayers);
    void *ud;
    /* corpus evaluation (docs/models.md, llama.cpp perplexity's protocol): chunk > 0
     * cuts the tokens into consecutive windows of `chunk` (the last partial
     * one dropped; the first token of each replaced by BOS when the model's
     * tokenizer adds one), evaluates each from an empty cache and scores
     * positions t >= chunk/2; `chunks` > 0 keeps only the first ones.
     * window_progress (may be NULL) is called after each window. */
    int chunk, chunks;
    void (*window_progress)(void *ud, int done, int total);
    /* a share of a corpus run (kvq-eval --shard): only windows [window_begin,
     * window_end) of the chunk's windows (both 0: all) */
    int window_begin, window_end;
    /* optional: after each window, its sums — the exact model's (ref) and
     * each item's (items[nitems]) — before they are pooled; a failure stops
     * the run with that status */
    kvq_status (*window_done)(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *items,
                              kvq_error *err);
    void *window_ud; /* window_done's ud */
    /* optional: the NLL of every scored position, [nitems + 1][positions]
     * (row 0 the exact model, row 1 + i item i; windows one after another) */
    double *position_nll;
    /* optional: the exact model's logits at positions logit_pos[0..n_logit_pos)
     * (each below T) into logits [n_logit_pos][vocab_size], for checks
     * against another implementation */
    const int *logit_pos;
    int n_logit_pos;
    float *logits;
} kvq_eval_opts;

/* What an evaluation's numbers depend on, as 64 bits (FNV-1a): the model
 * file (its size, first and last MiB), the tokens, the policy and its
 * stride, the chunking, the seed and the calibration file (size, first and
 * last MiB; NULL: none).  Not the threads: results do not depend on them.
 * kvq-alloc writes it beside every sensitivity row and refuses to resume or
 * merge rows of another. */
uint64_t kvq_eval_fingerprint(const kvq_model *m, const int *tokens, int T, kvq_policy policy,
                              const kvq_eval_opts *o, const char *calib_path);

/* Teacher-forced evaluation (docs/models.md): the exact model and every item's
 * quantized cache run together in lockstep (an item whose cache is still
 * exact computes nothing of its own); *nll_ref receives the exact model's mean NLL over the scored
 * positions (pooled over the windows with o->chunk). */
kvq_status kvq_model_eval(kvq_model *m, const int *tokens, int T, kvq_eval_item *items, int nitems,
                          const kvq_eval_opts *o, double *nll_ref, kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif /* KVQ_H */
