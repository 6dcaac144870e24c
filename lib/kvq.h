/* kvq.h — public API of libkvq, the KV-cache quantization analysis library.
 *
 * The library reads kvq-dump/1 HDF5 files (SPEC.md §1), runs quantizers from
 * one registry (§3) over one layer at a time, and accumulates reconstruction
 * and attention metrics (§4).  It never prints and never exits: every function
 * that can fail returns a kvq_status and fills a kvq_error with one line that
 * names the file, the object and what was expected.
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

/* Seeded generator (SPEC §2.5): xoshiro256** whose state is filled by
 * splitmix64 from (seed, a, b, c), so every (layer, head, tensor) stream is
 * reproducible and independent of the thread that draws it. */
typedef struct kvq_rng {
    uint64_t s[4];
} kvq_rng;

void kvq_rng_init(kvq_rng *r, uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
uint64_t kvq_rng_u64(kvq_rng *r);
double kvq_rng_uniform(kvq_rng *r);          /* [0, 1), 53 bits */
float kvq_rng_uniform_f(kvq_rng *r);         /* [0, 1), 24 bits */
double kvq_rng_normal(kvq_rng *r);           /* N(0, 1), Box–Muller */
uint64_t kvq_rng_below(kvq_rng *r, uint64_t n); /* uniform in [0, n), unbiased */

/* Stream tags for kvq_rng_init's third index.  Streams that exist for K and
 * for V use tag + tensor (0 = K, 1 = V). */
enum {
    KVQ_STREAM_KEY = 0, KVQ_STREAM_VALUE = 1, KVQ_STREAM_QUERIES = 2, KVQ_STREAM_GEN = 3,
    KVQ_STREAM_ROTATE = 4,  /* rotation of (layer, head, K/V): 4, 5 */
    KVQ_STREAM_LOWRANK = 6, /* GEAR power-iteration start of (layer, head, K/V): 6, 7 */
    KVQ_STREAM_KMEANS = 8,  /* k-means++ seeding of (layer, head, K/V): 8, 9 */
    KVQ_STREAM_QJL = 10     /* TurboQuant's QJL matrix S of (layer, head, K/V): 10, 11 */
};

/* ------------------------------------------------------------- dumps (§1) */

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
/* The root `tokens` attribute (kvq-dump's token ids; *tokens malloc'ed). */
kvq_status kvq_dump_read_tokens(kvq_dump *d, int **tokens, size_t *n, kvq_error *err);
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
const char *kvq_dump_writer_temp(const kvq_dump_writer *w);
/* A tool's hooks told of every dump writer's temporary as it is created and
 * when it is renamed or removed (so that a signal handler can remove it);
 * NULL: none.  Process-wide; set before writing. */
void kvq_set_temp_hooks(void (*created)(const char *tmp), void (*gone)(const char *tmp));
void kvq_dump_writer_abort(kvq_dump_writer *w); /* closes and removes the temporary */

/* ---------------------------------------------- group quantization (§2.1) */

typedef enum kvq_scale_prec { KVQ_SCALE_FP16 = 0, KVQ_SCALE_FP32 = 1 } kvq_scale_prec;

/* U(g; b) on one group of n values x[i*stride], written to y[i*stride]
 * (y may equal x).  Reference definition: plain C, in SPEC order.
 * Returns KVQ_ERR_NUMERIC if the rounded scale is not finite. */
kvq_status kvq_group_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                  kvq_scale_prec prec);
/* A(g; b), symmetric absmax (§2.2), same conventions. */
kvq_status kvq_absmax_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                   kvq_scale_prec prec);
/* Optimised per-channel U: rows x[t*D + c] for t < n, every channel c < D is
 * one group of n tokens.  Equal to the reference applied per channel. */
kvq_status kvq_group_quantize_channels(const float *x, float *y, size_t n, size_t D, int bits,
                                       kvq_scale_prec prec);

/* FP8 (§3.4): the OCP formats.  kvq_fp8_cast_ref(y) is y rounded to the
 * nearest finite value of the format (ties to the even code, |y| beyond
 * the largest finite value saturating to it, subnormals kept, NaN kept);
 * the definition, by integer bit manipulation. */
typedef enum kvq_fp8_format { KVQ_FP8_E4M3 = 0, KVQ_FP8_E5M2 = 1 } kvq_fp8_format;
float kvq_fp8_cast_ref(float y, kvq_fp8_format format);
/* The largest finite value: 448 (e4m3) or 57344 (e5m2). */
float kvq_fp8_max(kvq_fp8_format format);
/* y[i] = fp8(x[i] / s) · s (float32 divide), the vectorised hot loop (s
 * finite and > 0, x finite); equal to the reference. */
void kvq_fp8_quantize_array(const float *x, float *y, size_t n, float s, kvq_fp8_format format);
/* Rows x, y [rows][D]; column c scaled by s[c]: y = fp8(x / s[c]) · s[c]. */
void kvq_fp8_quantize_columns(const float *x, float *y, size_t rows, size_t D, const float *s,
                              kvq_fp8_format format);

/* A quantizer of the uniform families written as steps over token ranges
 * (a "plan"): the definition both the CPU (kvq_plan_quantize_head) and the
 * CUDA kernels execute, so the two paths cannot drift apart.  Each tensor's
 * steps cover tokens [0, T) in order, without overlap. */
typedef enum kvq_step_kind {
    KVQ_STEP_EXACT,       /* kept at the dump's values, 16 bits per element */
    KVQ_STEP_TOKEN,       /* U per token: groups of `group` channels of one head (clamped to D) */
    KVQ_STEP_TOKEN_LAYER, /* U per token along all heads, head-major (group clamped to H·D) */
    KVQ_STEP_CHANNEL,     /* U per channel: groups of `group` tokens from t0 */
    KVQ_STEP_ABSMAX       /* A per token: groups of `group` channels (clamped to D) */
} kvq_step_kind;

typedef struct kvq_step {
    kvq_step_kind kind;
    int t0, t1; /* tokens [t0, t1) */
    int bits, group;
    kvq_scale_prec prec;
} kvq_step;

#define KVQ_PLAN_MAX_STEPS 2
typedef struct kvq_plan {
    int nsteps[2];                          /* [tensor]: 0 = K, 1 = V */
    kvq_step step[2][KVQ_PLAN_MAX_STEPS];
} kvq_plan;

/* Stored bits of one step for head h of an [H][T][D] tensor: codes, scales
 * and zeros (a TOKEN_LAYER group's scale/zero shared in proportion to the
 * elements each head holds in it), 16 per exact element. */
double kvq_step_bits(const kvq_step *s, int H, int D, int h);
/* Σ of kvq_step_bits over the steps of one tensor (0 = K, 1 = V). */
double kvq_plan_bits(const kvq_plan *p, int tensor, int H, int D, int h);

/* ------------------------------------------------------ rotations (§2.3) */

typedef enum kvq_rotate_kind { KVQ_ROT_NONE = 0, KVQ_ROT_QR, KVQ_ROT_HADAMARD } kvq_rotate_kind;

/* A D×D orthogonal Π fixed by (seed, layer, head, tensor). */
typedef struct kvq_rotation {
    kvq_rotate_kind kind;
    int D;
    float *m;    /* qr: Π [D][D], row-major */
    float *sign; /* hadamard: the ±1 diagonal [D]; Π = H·diag(sign), H normalised */
} kvq_rotation;

/* qr: Gaussian [D][D] drawn row by row from stream (seed, layer, head,
 * KVQ_STREAM_ROTATE + tensor), QR in double (LAPACKE), columns times
 * sign(diag R).  hadamard: D must be a power of two (else KVQ_ERR_USAGE). */
kvq_status kvq_rotation_init(kvq_rotation *r, kvq_rotate_kind kind, int D, uint64_t seed,
                             int layer, int head, int tensor, kvq_error *err);
void kvq_rotation_free(kvq_rotation *r);
/* Bytes to store Π: qr 4·D² (fp32), hadamard ceil(D/8) (sign bits), none 0. */
double kvq_rotation_bytes(const kvq_rotation *r);
/* Rows of x [n][D] to y [n][D] (y != x): y_t = Π·x_t, or Πᵀ·x_t (inverse). */
kvq_status kvq_rotation_apply(const kvq_rotation *r, const float *x, float *y, size_t n,
                              int inverse, kvq_error *err);
/* Unnormalised fast Walsh–Hadamard transform of x [D] in place (Sylvester
 * order, D a power of two): x ← H_D·x with entries ±1. */
void kvq_fwht(float *x, int D);

/* ------------------------------------------- Lloyd–Max codebooks (§2.4) */

typedef enum kvq_codebook_kind { KVQ_CB_SPHERE = 0, KVQ_CB_GAUSS, KVQ_CB_DATA } kvq_codebook_kind;

#define KVQ_CODEBOOK_MAX_BITS 8
typedef struct kvq_codebook {
    int bits, n;                             /* n = 2^bits levels */
    double level[1 << KVQ_CODEBOOK_MAX_BITS]; /* ascending */
    double mse;        /* sphere: E‖u − û‖² of a unit vector; gauss, data: E(x − Q(x))² */
    int iterations;    /* Lloyd iterations run */
    float levelf[1 << KVQ_CODEBOOK_MAX_BITS]; /* levels as float */
    float bound[(1 << KVQ_CODEBOOK_MAX_BITS) - 1]; /* midpoints, float */
} kvq_codebook;

/* sphere (D >= 2) or gauss (D ignored) codebook, computed once per
 * (kind, D, bits) and cached for the process (thread-safe); *out stays valid. */
kvq_status kvq_codebook_get(kvq_codebook_kind kind, int D, int bits, const kvq_codebook **out,
                            kvq_error *err);
/* 1-D k-means (the same Lloyd iteration) over n samples. */
kvq_status kvq_codebook_fit_data(const float *x, size_t n, int bits, kvq_codebook *out,
                                 kvq_error *err);
/* Index of the level nearest to v (a value exactly on a midpoint takes the lower level). */
static inline int kvq_codebook_index(const kvq_codebook *cb, float v)
{
    int lo = 0, hi = cb->n - 1; /* answer in [lo, hi]: count of bounds < v */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (v > cb->bound[mid]) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* ---------------------------------------------------------- k-means (§3.2) */

/* k-means of n points x [n][D]: k-means++ seeding from `rng`, then Lloyd
 * iterations until no assignment changes or max_iter.  Ties go to the lower
 * centre index; an empty cluster keeps its centre.  centres [k][D] out;
 * assign [n] (may be NULL); objective [max_iter + 1] (may be NULL) receives
 * Σ‖x − c‖² after seeding and after each iteration; *iters the count. */
kvq_status kvq_kmeans(const float *x, size_t n, int D, int k, int max_iter, kvq_rng *rng,
                      float *centres, int *assign, double *objective, int *iters,
                      kvq_error *err);
/* Nearest centre of each point (ties: lower index). */
kvq_status kvq_kmeans_assign(const float *x, size_t n, int D, const float *centres, int k,
                             int *assign, kvq_error *err);

/* ------------------------------------------------------- low rank (§3.1) */

/* L [T][D] = best rank-r approximation of E [T][D] (truncated SVD, LAPACKE, double). */
kvq_status kvq_lowrank_svd(const float *E, int T, int D, int r, float *L, kvq_error *err);
/* GEAR's power iteration (in double): P [D][r] uniform [0,1) from rng (row by row);
 * `loop` passes of Qm = E·P, P = Eᵀ·Qm with P and Qm orthonormalised (QR) on
 * the last pass; L = Qm·Pᵀ. */
kvq_status kvq_lowrank_power(const float *E, int T, int D, int r, int loop, kvq_rng *rng,
                             float *L, kvq_error *err);

/* ------------------------------------------------- quantizer registry (§3) */

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
#define KVQ_SPEC_MAX 256

struct kvq_quantizer;

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

typedef struct kvq_quantizer {
    const char *name;
    const char *description;
    const kvq_param *params;
    int nparams;
    int needs_calib;    /* always needs --calib (see calib_key for spec-dependent needs) */
    int in_default_set; /* part of kvq-analyze's default set */
    const char *default_spec; /* the spec the default set uses ("" = defaults) */
    /* Cross-key constraints; NULL if none.  Returns KVQ_ERR_USAGE naming the key. */
    kvq_status (*check)(const kvq_spec *spec, kvq_error *err);
    /* Whether the spec can run on heads of D channels (e.g. llama.cpp's rule:
     * D a multiple of the block); NULL if any D.  KVQ_ERR_USAGE says why. */
    kvq_status (*check_shape)(const kvq_spec *spec, int D, kvq_error *err);
    /* Exactly one of the two: the whole layer (may use ctx->nthreads), or one
     * tensor (0 = K, 1 = V) of one head, which kvq_quantize_layer runs over all
     * heads in parallel and must write only that head's output and bits.
     * quantize_head may leave err untouched for KVQ_ERR_NUMERIC (the runner
     * then names the fp16 overflow) and KVQ_ERR_NOMEM. */
    kvq_status (*quantize)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                           kvq_quant_out *out, kvq_error *err);
    kvq_status (*quantize_head)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                kvq_quant_out *out, int tensor, int head, kvq_error *err);
    /* The uniform families also describe themselves as a plan of steps
     * (T tokens, D channels), which the CUDA path executes; NULL if the
     * quantizer is not a plan.  Their quantize_head is kvq_plan_quantize_head. */
    void (*plan)(const kvq_spec *spec, int T, int D, kvq_plan *out);
    /* Optional tensors the quantizer reads (KVQ_READ_KEY_PRE_ROPE); with that
     * flag the driver also passes the dump's RoPE when it has one. */
    unsigned read_flags;
    /* Calibration (optional).  calib_key returns 0 if this spec needs none,
     * else 1 with a key in buf: specs of one quantizer with equal keys share
     * one state per layer, computed once per run from the --calib dump's layer. */
    int (*calib_key)(const kvq_spec *spec, char *buf, size_t len);
    kvq_status (*calibrate)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *calib,
                            void **state, kvq_error *err);
    void (*calib_free)(void *state);
} kvq_quantizer;

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
/* Does this spec need a --calib dump? */
int kvq_spec_needs_calib(const kvq_spec *spec);

/* A calibration dump and the states computed from it, kept for the whole
 * run so that every dump, spec and sweep point sharing a state reuses it. */
typedef struct kvq_calib kvq_calib;
kvq_status kvq_calib_open(const char *path, kvq_calib **out, kvq_error *err);
const kvq_dump_info *kvq_calib_info(const kvq_calib *c);
/* Fails unless the calibration dump has the model shape of `info`
 * (layers, KV heads, head_dim). */
kvq_status kvq_calib_check(const kvq_calib *c, const char *dump_path, const kvq_dump_info *info,
                           kvq_error *err);
/* The state of `spec` for `layer` (computed on first use); *state may be NULL. */
kvq_status kvq_calib_state(kvq_calib *c, const kvq_spec *spec, int layer, uint64_t seed,
                           int nthreads, const void **state, kvq_error *err);
/* Number of calibration states computed so far (each (layer, quantizer, key) once). */
size_t kvq_calib_count(const kvq_calib *c);
void kvq_calib_close(kvq_calib *c);

/* ---------------------------------------------------------- metrics (§4) */

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

/* Query positions (§4). */
typedef enum kvq_query_kind { KVQ_Q_LAST, KVQ_Q_ALL, KVQ_Q_EVERY, KVQ_Q_RANDOM } kvq_query_kind;
typedef struct kvq_query_sel {
    kvq_query_kind kind;
    long n;
} kvq_query_sel;

kvq_status kvq_query_sel_parse(const char *text, kvq_query_sel *out, kvq_error *err);
/* Sorted positions for a sequence of T tokens; *pos is malloc'ed. */
kvq_status kvq_query_positions(const kvq_query_sel *sel, int T, uint64_t seed, int **pos,
                               size_t *npos, kvq_error *err);

/* How the model turns q·k into attention (SPEC §1): softmax(scale · q·k)
 * (prescaled: the queries already carry the scale), each score soft-capped
 * c·tanh(s/c) when softcap > 0, over the causal keys p − window < k <= p
 * (window 0: all of 0..p).  scale 0 (or 1/sqrt(D) within 1e-6) is the plain
 * attention, computed as a division by sqrt(D) (SPEC §4's order). */
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

/* Attention metrics of one KV head for several quantizers at once (§4).
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
/* layer/head < 0 print as `all`; extra: nextra cells (may be NULL). */
kvq_status kvq_report_row(kvq_report *r, const char *dump, int layer, int head,
                          const kvq_spec *spec, const kvq_metrics *m, const char *const *extra);
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


/* -------------------------------------------------- models in the loop (§8) */

/* ggml weight types kvq dequantizes (the GGUF tensor type ids). */
typedef enum kvq_ggml_type {
    KVQ_GGML_F32 = 0, KVQ_GGML_F16 = 1, KVQ_GGML_Q4_0 = 2, KVQ_GGML_Q4_1 = 3, KVQ_GGML_Q5_0 = 6,
    KVQ_GGML_Q5_1 = 7, KVQ_GGML_Q8_0 = 8, KVQ_GGML_Q2_K = 10, KVQ_GGML_Q3_K = 11, KVQ_GGML_Q4_K = 12,
    KVQ_GGML_Q5_K = 13, KVQ_GGML_Q6_K = 14, KVQ_GGML_IQ4_NL = 20, KVQ_GGML_IQ4_XS = 23,
    KVQ_GGML_BF16 = 30, KVQ_GGML_MXFP4 = 39, KVQ_GGML_NVFP4 = 40
} kvq_ggml_type;

/* Values and bytes per block of `type`; 0 if kvq does not read the type. */
int kvq_ggml_type_size(int type, int *block_values, size_t *block_bytes);
const char *kvq_ggml_type_name(int type); /* "q4_K", ...; NULL if unknown */
/* n values (a multiple of the block) of `type` at src, as ggml's
 * dequantize_row_<type> computes them, bit for bit. */
void kvq_ggml_dequantize(int type, const void *src, float *dst, size_t n);
/* n values (a multiple of the block for block types) of x to `type` at dst,
 * as ggml's quantize_row_<type>_ref (f16, bf16: round to nearest even), bit
 * for bit: the KV-cache types q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, f16,
 * bf16, and mxfp4, nvfp4.  Returns 0 for any other type. */
int kvq_ggml_quantize_ref(int type, const float *x, void *dst, size_t n);

/* FP4 micro-scaled formats (§3.9, formats/fp4.c), ggml's bit for bit.
 * Element values are doubled (kvq_e2m1_doubled[code]) and scales halved,
 * as in ggml: value = doubled · half-scale. */
#define KVQ_MXFP4_BLOCK 32 /* values per E8M0 scale */
#define KVQ_NVFP4_BLOCK 16 /* values per UE4M3 scale (ggml's nvfp4 blocks hold four) */
extern const int8_t kvq_e2m1_doubled[16];
uint8_t kvq_e8m0_mxfp4(float amax);    /* floor(log2 amax) − 2 + 127, 0 for 0 (and below 2^-125) */
float kvq_e8m0_half(uint8_t e);        /* 2^(e − 128) */
uint8_t kvq_ue4m3_encode(float x);     /* ggml_fp32_to_ue4m3: [256, 448] all give 448 (0x7E) */
uint8_t kvq_ue4m3_encode_rne(float x); /* E4M3 nearest even, saturating at 448: the code */
float kvq_ue4m3_half(uint8_t u);       /* half the unsigned E4M3 value */
int kvq_e2m1_index(float x, float d);  /* the code minimising |doubled·d − x|, first of equals */
/* One MXFP4 block: 32 values → 17 bytes (ggml's block_mxfp4) and back. */
void kvq_mxfp4_block_ref(const float *x, uint8_t *blk);
void kvq_mxfp4_block_dequantize(const uint8_t *blk, float *y);
/* One NVFP4 block of 16 values with second-level scale g: its UE4M3 scale
 * of amax/6/g (rne = 0: ggml's encoder, with g = 1 ggml's nvfp4; rne = 1:
 * E4M3 nearest even, the two-level scheme) and 8 bytes of codes; returns
 * the half-scale (decoded scale · g) the codes were chosen with. */
float kvq_nvfp4_block_ref(const float *x, float g, int rne, uint8_t *scale, uint8_t *qs);
void kvq_nvfp4_block_dequantize(uint8_t scale, const uint8_t *qs, float g, float *y);
/* The fast path the fp4 family runs, equal to the above bit for bit: a
 * block's half-scale, then y = the E2M1 value nearest each x at half-scale d
 * (kvq_e2m1_doubled[kvq_e2m1_index(x, d)] · d), n values, vectorised. */
float kvq_mxfp4_block_scale(const float *x);
float kvq_nvfp4_block_scale(const float *x, float g, int rne);
void kvq_fp4_round(const float *x, float *y, int n, float d);

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

typedef struct kvq_eval_opts {
    int stride;        /* decode: the cache is re-quantized every `stride` positions (1: exact decode) */
    uint64_t seed;
    int nthreads;      /* <= 0: all cores */
    kvq_calib *calib;  /* for specs that need one */
    size_t max_bytes;  /* bound on the hidden states kept at once (0: 4 GiB) */
    /* progress (may be NULL): called after each layer of each pass */
    void (*progress)(void *ud, int pass, int npasses, int layer, int nlayers);
    void *ud;
    /* corpus evaluation (SPEC §8, llama.cpp perplexity's protocol): chunk > 0
     * cuts the tokens into consecutive windows of `chunk` (the last partial
     * one dropped; the first token of each replaced by BOS when the model's
     * tokenizer adds one), evaluates each from an empty cache and scores
     * positions t >= chunk/2; `chunks` > 0 keeps only the first ones.
     * window_progress (may be NULL) is called after each window. */
    int chunk, chunks;
    void (*window_progress)(void *ud, int done, int total);
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

/* Teacher-forced evaluation (SPEC §8): the exact model and every item's
 * quantized cache run together, a layer's weights dequantized once for
 * all; *nll_ref receives the exact model's mean NLL over the scored
 * positions (pooled over the windows with o->chunk). */
kvq_status kvq_model_eval(kvq_model *m, const int *tokens, int T, kvq_eval_item *items, int nitems,
                          const kvq_eval_opts *o, double *nll_ref, kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif /* KVQ_H */
