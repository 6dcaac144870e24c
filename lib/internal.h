/* internal.h — helpers shared by libkvq's sources, not part of the API. */
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

/* Adds head h's reconstruction sums (fused by the quantizer or computed
 * here), bits and static bytes of quantizer output q over layer L to acc:
 * what kvq-analyze's driver and kvq_quantize_arrays both measure. */
void kvq_quant_head_acc(const kvq_layer *L, const kvq_quant_out *q, int h, kvq_acc *acc);

/* ---------------------------------------------------------------------
 * The reference maths and number formats the families are built from
 * (public to the tests, not to the tools). */

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

/* Stream tags for kvq_rng_init's third index.  Streams that exist for K and
 * for V use tag + tensor (0 = K, 1 = V). */
enum {
    KVQ_STREAM_KEY = 0, KVQ_STREAM_VALUE = 1, KVQ_STREAM_QUERIES = 2, KVQ_STREAM_GEN = 3,
    KVQ_STREAM_ROTATE = 4,  /* rotation of (layer, head, K/V): 4, 5 */
    KVQ_STREAM_LOWRANK = 6, /* GEAR power-iteration start of (layer, head, K/V): 6, 7 */
    KVQ_STREAM_KMEANS = 8,  /* k-means++ seeding of (layer, head, K/V): 8, 9 */
    KVQ_STREAM_QJL = 10,    /* TurboQuant's QJL matrix S of (layer, head, K/V): 10, 11 */
    KVQ_STREAM_VQ = 12,     /* vq's codebooks of (layer, head, K/V, group g): 12 + K/V + 2·g */
    KVQ_STREAM_TOKENS = 0x7fffffff, /* tokens(random...)'s scores of (layer, KV head): past vq's tags */
    KVQ_STREAM_TASKS = 0x7ffffffe   /* kvq-gen --task's words of (kind, task) */
};

/* ----------------------------- group quantization (docs/building-blocks.md) */

typedef enum kvq_scale_prec { KVQ_SCALE_FP16 = 0, KVQ_SCALE_FP32 = 1 } kvq_scale_prec;

/* U(g; b) on one group of n values x[i*stride], written to y[i*stride]
 * (y may equal x).  Reference definition: plain C, in the order docs/ writes it.
 * Returns KVQ_ERR_NUMERIC if the rounded scale is not finite. */
kvq_status kvq_group_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                  kvq_scale_prec prec);
/* A(g; b), symmetric absmax (docs/building-blocks.md), same conventions. */
kvq_status kvq_absmax_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                   kvq_scale_prec prec);
/* Optimised per-channel U: rows x[t*D + c] for t < n, every channel c < D is
 * one group of n tokens.  Equal to the reference applied per channel. */
kvq_status kvq_group_quantize_channels(const float *x, float *y, size_t n, size_t D, int bits,
                                       kvq_scale_prec prec);

/* FP8 (docs/quantizers.md#fp8): the OCP formats.  kvq_fp8_cast_ref(y) is y rounded to the
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

/* -------------------------------------- rotations (docs/building-blocks.md) */

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

/* ---------------------------- Lloyd–Max codebooks (docs/building-blocks.md) */

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

/* ------------------------------------- k-means (docs/quantizers.md#cluster) */

/* k-means of n points x [n][D]: k-means++ seeding from `rng`, then Lloyd
 * iterations until no assignment changes or max_iter.  Ties go to the lower
 * centre index; an empty cluster keeps its centre.  centres [k][D] out;
 * assign [n] (may be NULL); objective [max_iter + 1] (may be NULL) receives
 * Σ‖x − c‖² after seeding and after each iteration; *iters the count. */
kvq_status kvq_kmeans(const float *x, size_t n, int D, int k, int max_iter, kvq_rng *rng,
                      float *centres, int *assign, double *objective, int *iters,
                      kvq_error *err);
/* k-means++ seeding alone (cluster's and vq's): centres [k][D] are points of
 * x, the first a uniform draw, each next one drawn with probability
 * proportional to its squared distance (double, channel order) to the
 * nearest centre so far (uniform again if that total is 0).  d2 [n]: scratch. */
void kvq_kmeans_seed(const float *x, size_t n, int D, int k, kvq_rng *rng, float *centres, double *d2);
/* Nearest centre of each point (ties: lower index). */
kvq_status kvq_kmeans_assign(const float *x, size_t n, int D, const float *centres, int k,
                             int *assign, kvq_error *err);

/* --------------------------------------- low rank (docs/quantizers.md#gear) */

/* L [T][D] = best rank-r approximation of E [T][D] (truncated SVD, LAPACKE, double). */
kvq_status kvq_lowrank_svd(const float *E, int T, int D, int r, float *L, kvq_error *err);
/* GEAR's power iteration (in double): P [D][r] uniform [0,1) from rng (row by row);
 * `loop` passes of Qm = E·P, P = Eᵀ·Qm with P and Qm orthonormalised (QR) on
 * the last pass; L = Qm·Pᵀ. */
kvq_status kvq_lowrank_power(const float *E, int T, int D, int r, int loop, kvq_rng *rng,
                             float *L, kvq_error *err);

/* ------------------------------------------------- ggml and FP4 formats */

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

/* FP4 micro-scaled formats (docs/quantizers.md#fp4, formats/fp4.c), ggml's bit for bit.
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

#ifdef __cplusplus
}
#endif

#endif
