/* quant.h — the quantizer-author API: what a family's file defines (its
 * kvq_quantizer) and may use (plans, the helpers that apply U/A along the
 * axes of docs/building-blocks.md (U), rotations, codebooks...).  Tools see quantizers only
 * through kvq.h's accessors. */
#ifndef KVQ_QUANT_H
#define KVQ_QUANT_H

#include "../internal.h"
#include "../formats/formats.h"
#include "../math/maths.h"
#include "plan.h"

#include <math.h>
#include <string.h>

/* ----------------------------- group quantization (docs/building-blocks.md) */

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

typedef struct kvq_quantizer {
    const char *name;
    const char *description;
    const kvq_param *params;
    int nparams;
    int needs_calib;    /* always needs --calib (see calib_key for spec-dependent needs) */
    int in_default_set; /* part of kvq-analyze's default set */
    const char *default_spec; /* the spec the default set uses ("" = defaults) */
    /* Keys of a non-default spec that takes the family's own paths (e.g.
     * "bits=3,group=4,span=layer"): the registry and Python tests run it
     * beside the default on every family, so no test keeps a list. */
    const char *example_spec;
    /* Cross-key constraints; NULL if none.  Returns KVQ_ERR_USAGE naming the key. */
    kvq_status (*check)(const kvq_spec *spec, kvq_error *err);
    /* Whether the spec can run on heads of D channels (e.g. llama.cpp's rule:
     * D a multiple of the block); NULL if any D.  KVQ_ERR_USAGE says why. */
    kvq_status (*check_shape)(const kvq_spec *spec, int D, kvq_error *err);
    /* At least one of the two: the whole layer (may use ctx->nthreads), or one
     * tensor (0 = K, 1 = V) of one head, which kvq_quantize_layer runs over all
     * heads in parallel and must write only that head's output and bits.
     * quantize_head may leave err untouched for KVQ_ERR_NUMERIC (the runner
     * then names the fp16 overflow) and KVQ_ERR_NOMEM.  With both,
     * kvq_quantize_layer runs quantize, the analysis's head loop quantize_head
     * (for the specs couples_heads leaves to it), and the two write the same
     * bits (test_registry). */
    kvq_status (*quantize)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                           kvq_quant_out *out, kvq_error *err);
    kvq_status (*quantize_head)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                kvq_quant_out *out, int tensor, int head, kvq_error *err);
    /* Optional, for a family with both: 1 for a spec whose heads cannot be
     * quantized one at a time (GEAR's span=layer: V's rows are tokens across
     * the heads), which then runs on the whole layer only.  NULL: none. */
    int (*couples_heads)(const kvq_spec *spec);
    /* The plain reference (ggml's from_float_ref beside the fast function),
     * at most one of the two: the whole layer on one thread (quantize's
     * contract), or one tensor of one head (quantize_head's, run over the
     * heads in order on one thread).  Plain C written as docs/ defines the
     * family: no SIMD, no blocking, selections by sorting, searches for
     * nearest levels; the shared building blocks that are BLAS or LAPACKE
     * products (rotations, k-means assignment, low rank) are called as the
     * fast path calls them, their sums' order being BLAS's (test_blocks
     * checks them on their own).  tests/test_registry.c holds the fast path
     * to it bit for bit at every thread count and SIMD level. */
    kvq_status (*reference)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                            kvq_quant_out *out, kvq_error *err);
    kvq_status (*reference_head)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
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
    /* Optional: a spec whose output is, head by head and bit for bit, this
     * spec's first stage (turboquant's: lloydmax at b − 1 bits with its
     * rotation, at b for variant=mse).  1 and that spec's text in buf, or
     * 0.  Where a run holds that spec too, both head by head and it first,
     * the analysis hands its output to quantize_head as ctx->first_stage
     * (kvq_spec_is_first_stage); the family takes it and calls
     * kvq_first_stage_taken. */
    int (*first_stage)(const kvq_spec *spec, char *buf, size_t len);
    /* Optional, with quantize_head: what the heads of a layer share (fp8's
     * and fp4's tensor scales), computed from the whole layer before any of
     * its heads into at most KVQ_LAYER_STATE_MAX bytes at state, which
     * quantize_head reads as ctx->layer_state.  The per-head runner and the
     * analysis run it once a layer; kvq_quantize_one_head, given no
     * ctx->layer_state, runs it for the one head. */
    kvq_status (*layer_prepare)(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in, void *state,
                                kvq_error *err);
    /* The one `mix(...)` pseudo-family (quant/spec.c): its text is the spec. */
    int is_mix;
    /* `tokens(SELECT; HI; LO)` (parsed in spec.c, run by tokens.c): its text is the spec too. */
    int is_tokens;
    /* Seeded streams (docs/building-blocks.md#random-numbers): how many
     * consecutive tags the family draws from (0 = none, 2 = one for K and
     * one for V), the first being kvq_stream_of_name(name).  stream_tag_kept
     * is that first tag for the families that drew random numbers before tags
     * came from names, kept so that their seeded results stay as published;
     * a new family leaves it 0.  test_registry checks that no two families'
     * ranges, nor a shared stream of internal.h, overlap. */
    uint64_t nstreams;
    uint64_t stream_tag_kept;
} kvq_quantizer;

/* 1 if cand's output is spec's first stage (spec's family names it: the
 * same family and options, written out in full), else 0. */
int kvq_spec_is_first_stage(const kvq_spec *spec, const kvq_spec *cand);
/* A family took one head tensor's first stage from ctx->first_stage
 * (counted for kvq_first_stages_taken). */
void kvq_first_stage_taken(void);

/* Tag of the family's stream i (< nstreams) for kvq_rng_init. */
static inline uint64_t kvq_family_stream(const kvq_quantizer *q, uint64_t i)
{
    return (q->stream_tag_kept ? q->stream_tag_kept : kvq_stream_of_name(q->name)) + i;
}

/* Round half to even for |v| < 2^22 (callers clamp v to their code range
 * first).  Adding and subtracting 1.5·2^23 rounds in the FPU's default mode
 * (nearest, ties to even) — the same result as rintf/torch.round, but
 * vectorisable on every x86-64 without SSE4.1.  Needs -ffp-contract=off and
 * no -ffast-math. */
static inline float kvq_rne(float v) { return (v + 12582912.0f) - 12582912.0f; /* 1.5·2^23 */ }

/* max |x_i| over n values of a tensor (NaN never counts; 0 for none). */
static inline float kvq_absmax(const float *x, size_t n) { return kvq_absmax_lanes(x, n, KVQ_ABSMAX_LANES_MAX); }

/* A float32 scale amax / fmax that maps a tensor's largest value to a
 * format's largest (fp8, nvfp4's second level); 1 where amax is 0 or the
 * quotient underflows. */
static inline float kvq_max_scale(float amax, float fmax)
{
    float s = amax / fmax;
    return s > 0.0f ? s : 1.0f;
}

/* max |x| of K (amax[0]) and of V (amax[1]) over all heads of a layer, per
 * head on nthreads threads then reduced (the same for any thread count).
 * 0, or -1 out of memory. */
int kvq_layer_absmax(const kvq_layer *in, int nthreads, float amax[2]);

/* s rounded to the scale precision. */
float kvq_round_scale(float s, kvq_scale_prec prec);

/* Head h of K (tensor 0) or V (tensor 1) in a layer and in a quantizer's output. */
static inline const float *kvq_head_in(const kvq_layer *in, int tensor, int h)
{
    return (tensor ? in->value : in->key) + (size_t)h * in->T * in->D;
}
static inline float *kvq_head_out(const kvq_quant_out *out, const kvq_layer *in, int tensor, int h)
{
    return (tensor ? out->value : out->key) + (size_t)(h - out->head0) * in->T * in->D;
}
static inline double *kvq_head_bits(kvq_quant_out *out, int tensor, int h)
{
    return (tensor ? out->v_bits : out->k_bits) + h;
}

/* Where the quantizer adds the error of (tensor, head h) while quantizing,
 * or NULL if the caller did not ask (see kvq_quant_out.recon).  Taking it
 * promises to add every element of the head: the helpers below do, block by
 * block while the block is in cache. */
static inline kvq_recon_acc *kvq_head_recon(kvq_quant_out *out, const kvq_layer *in, int tensor, int h)
{
    if (!out->recon) return NULL;
    out->recon_done[tensor * in->H + h] = 1;
    return &out->recon[tensor * in->H + h];
}

/* Bits of one scale (or zero) at this precision. */
static inline double kvq_scale_bits(kvq_scale_prec prec) { return prec == KVQ_SCALE_FP16 ? 16.0 : 32.0; }

/* --- U along one head's axes; x, y: [T][D] of one head; returns the stored
 *     bits (codes + scales/zeros).  Tokens [t0, t1) only; y elsewhere untouched.
 *     recon: where to add the error of tokens [t0, t1) (or NULL). */
kvq_status kvq_quant_head_per_token(const float *x, float *y, int T, int D, int t0, int t1,
                                    int bits, int group, kvq_scale_prec prec, double *stored_bits,
                                    kvq_recon_acc *recon);
kvq_status kvq_quant_head_per_channel(const float *x, float *y, int T, int D, int t0, int t1,
                                      int bits, int group, kvq_scale_prec prec,
                                      double *stored_bits, kvq_recon_acc *recon);
/* A per token, groups of `group` channels (0 or > D: the whole head vector). */
kvq_status kvq_quant_head_absmax(const float *x, float *y, int T, int D, int t0, int t1, int bits,
                                 int group, kvq_scale_prec prec, double *stored_bits,
                                 kvq_recon_acc *recon);
/* Per-token U with span=layer: groups along the head-major concatenation of
 * the H heads of each token.  x, y: [H][T][D]; bits[h] (unless NULL)
 * receives each head's share (codes + its proportion of every group's scale/zero). */
kvq_status kvq_quant_layer_per_token_span(const float *x, float *y, int H, int T, int D, int t0,
                                          int t1, int bits, int group, kvq_scale_prec prec,
                                          double *bits_per_head);

/* Copies tokens [t0, t1) of a head exactly and returns their 16-bit cost;
 * adds their (zero) error and Σx² to recon if not NULL. */
double kvq_keep_exact(const float *x, float *y, int T, int D, int t0, int t1, kvq_recon_acc *recon);

/* u_c ← levelf[kvq_codebook_index(cb, u_c / n)] for a row of D: the
 * nearest level.  kvq_lloydmax_snap_ref is that line, a binary search per
 * coordinate; kvq_lloydmax_snap is branch-free up to 16 levels (plain or
 * AVX2; tests compare it with the search). */
typedef void (*kvq_snap_fn)(const kvq_codebook *cb, float *u, float n, int D);
void kvq_lloydmax_snap(const kvq_codebook *cb, float *u, float n, int D);
void kvq_lloydmax_snap_ref(const kvq_codebook *cb, float *u, float n, int D);
/* Lloyd–Max coding of T rows x [T][D] into y (docs/quantizers.md#lloydmax): fp16 norm,
 * rotation, nearest level by `snap` (one of the two above: the fast path
 * or the reference).  work [T][D], norm [T]: scratch. */
kvq_status kvq_lloydmax_rows(const float *x, float *y, int T, int D, const kvq_rotation *rot,
                             const kvq_codebook *cb, kvq_snap_fn snap, float *work, float *norm, kvq_error *err);

/* One head's T rows x [T][D] coded by Lloyd–Max into y (docs/quantizers.md#lloydmax): rotation
 * `rotate` of (ctx seed, layer, h, tensor), codebook cb; *rot_bytes gets
 * Π's size.  lloydmax's head, and turboquant's first stage. */
kvq_status kvq_lloydmax_head(const float *x, float *y, int T, int D, kvq_rotate_kind rotate, const kvq_codebook *cb,
                             kvq_snap_fn snap, const kvq_quant_ctx *ctx, int h, int tensor, double *rot_bytes,
                             kvq_error *err);

/* GEAR's outliers of one row (docs/quantizers.md#gear): sel[i] = 1 for the k largest
 * values, then the k smallest of the rest (ties: lower index first); those
 * positions of work (a copy of row; NULL: selection only) become the row
 * mean.  O(n): scans for small k, selections otherwise.  scratch: 2n floats. */
void kvq_gear_row_outliers(const float *row, float *work, unsigned char *sel, int n, int k, float *scratch);
/* The same selection by its definition (the references): the row sorted by
 * (value descending, index), then the rest by (value, index).  KVQ_ERR_NOMEM
 * or KVQ_OK. */
kvq_status kvq_gear_row_outliers_ref(const float *row, unsigned char *sel, int n, int k);

/* K's rows are channels over tokens: columns of [tokens][ld].  These copy
 * nb <= KVQ_CHANNEL_BLOCK channels at once (x and y start at the block's
 * first channel), so that each cache line of the tensor is touched once per
 * block instead of once per channel: rows[b·n + t] = x[t·ld + b].  Through a
 * tile of KVQ_CHANNEL_BLOCK tokens in L1, so that every row is written (or
 * read) 16 consecutive floats at a time, not one float per token: 2.3× on
 * one 8192-token head of 128 channels. */
#define KVQ_CHANNEL_BLOCK 16
static inline void kvq_gather_channels(const float *x, size_t ld, int nb, int n, float *rows)
{
    enum { TILE = KVQ_CHANNEL_BLOCK };
    size_t t0 = 0;
    for (; t0 + TILE <= (size_t)n; t0 += TILE) {
        float tile[TILE][KVQ_CHANNEL_BLOCK];
        if (nb == KVQ_CHANNEL_BLOCK) /* a constant size: vector moves, not a string copy */
            for (int i = 0; i < TILE; i++) memcpy(tile[i], x + (t0 + i) * ld, sizeof tile[i]);
        else
            for (int i = 0; i < TILE; i++) memcpy(tile[i], x + (t0 + i) * ld, (size_t)nb * sizeof(float));
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < TILE; i++) rows[(size_t)b * n + t0 + i] = tile[i][b];
    }
    for (size_t t = t0; t < (size_t)n; t++)
        for (int b = 0; b < nb; b++) rows[(size_t)b * n + t] = x[t * ld + b];
}
static inline void kvq_scatter_channels(const float *rows, int nb, int n, size_t ld, float *y)
{
    enum { TILE = KVQ_CHANNEL_BLOCK };
    size_t t0 = 0;
    for (; t0 + TILE <= (size_t)n; t0 += TILE) {
        float tile[TILE][KVQ_CHANNEL_BLOCK];
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < TILE; i++) tile[i][b] = rows[(size_t)b * n + t0 + i];
        if (nb == KVQ_CHANNEL_BLOCK)
            for (int i = 0; i < TILE; i++) memcpy(y + (t0 + i) * ld, tile[i], sizeof tile[i]);
        else
            for (int i = 0; i < TILE; i++) memcpy(y + (t0 + i) * ld, tile[i], (size_t)nb * sizeof(float));
    }
    for (size_t t = t0; t < (size_t)n; t++)
        for (int b = 0; b < nb; b++) y[t * ld + b] = rows[(size_t)b * n + t];
}

/* Runs spec's plan (kvq_quantizer.plan) for one tensor of one head with
 * the helpers above; a tensor with a TOKEN_LAYER step runs whole in head 0's
 * task.  The quantize_head of every plan quantizer. */
kvq_status kvq_plan_quantize_head(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, int tensor, int h, kvq_error *err);

/* One step of one tensor x, y [H][T][D] (kvq_step), spelled out group by
 * group as docs/building-blocks.md (U), (A) defines it; row: H·D floats of
 * scratch (for KVQ_STEP_TOKEN_LAYER); *bad gets the head of a
 * KVQ_ERR_NUMERIC.  The backbone of references built on U. */
kvq_status kvq_step_reference(const kvq_step *s, const float *x, float *y, int H, int T, int D, float *row, int *bad);
/* The plain reference of every plan quantizer (their .reference): each
 * step group by group with kvq_group_quantize_ref / kvq_absmax_quantize_ref. */
kvq_status kvq_plan_reference(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err);
/* spec on a layer through its family's reference (the prerotate wrapper
 * and the shape check as kvq_quantize_layer); KVQ_ERR_UNSUPPORTED, with
 * no message, for a family without one. */
kvq_status kvq_quantize_layer_reference(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err);
/* 1 when spec (one layer's: not a mix, not tokens(...)) quantizes every
 * head of K and V on its own on T tokens of D channels: its family has a
 * quantize_head, no prerotate, and no plan step (or couples_heads) that
 * couples the heads.
 * Then kvq_quantize_one_head(tensor, h) writes exactly what
 * kvq_quantize_layer writes for that head, and the analysis may run it
 * head by head into a buffer of one head (kvq_quant_out.head0). */
int kvq_spec_by_head(const kvq_spec *spec, int T, int D);
/* ctx into c (c may be ctx), with what the heads of layer `in` share (the
 * family's layer_prepare, into state: KVQ_LAYER_STATE_MAX bytes aligned
 * for double) where the family has one: the per-head runner's, and the
 * analysis's once a layer for a spec it runs head by head. */
kvq_status kvq_quant_with_layer_state(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in, void *state,
                                      kvq_quant_ctx *c, kvq_error *err);
kvq_status kvq_quantize_one_head(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, int tensor, int h, kvq_error *err);

/* Pre-rotation (docs/building-blocks.md#rotations): the `prerotate` key a family adds to its table
 * with one line; kvq_quantize_layer then runs the family on Π·x and returns
 * Πᵀ·y' (prerotate.c). */
#define KVQ_PARAM_PREROTATE                                                                          \
    {.key = "prerotate", .type = KVQ_PARAM_CHOICE, .def = "none", .choices = "none|hadamard|qr",     \
     .help = "rotate each head vector first (QuaRot): x' = P^T Q(P x)", .quiet_default = 1}
/* The spec's prerotate choice: 0 none (or no such key), 1 hadamard, 2 qr. */
int kvq_spec_prerotate(const kvq_spec *spec);
/* Runs `run` (the family's whole-layer quantizer) on the rotated layer and
 * rotates its output back; adds the rotations' bytes to out->static_bytes. */
kvq_status kvq_prerotate_quantize(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, kvq_error *err,
                                  kvq_status (*run)(const kvq_spec *, const kvq_quant_ctx *, const kvq_layer *,
                                                    kvq_quant_out *, kvq_error *));

/* The keys of text = "NAME[:key=value,...]" parsed against q's table (the
 * caller has matched NAME to q): kvq_spec_parse's work after the lookup, for
 * tables outside the registry too (tokens(...)'s selectors). */
kvq_status kvq_spec_parse_as(const kvq_quantizer *q, const char *text, kvq_spec *out, kvq_error *err);

/* --- tokens(SELECT; HI; LO) (tokens.c, docs/quantizers.md#tokens) */
/* The selectors, in the order SPEC §3.11 lists them. */
typedef enum kvq_selector {
    KVQ_SEL_WINDOW, KVQ_SEL_H2O, KVQ_SEL_ZIPCACHE, KVQ_SEL_SNAPKV, KVQ_SEL_TOVA, KVQ_SEL_KNORM, KVQ_SEL_RANDOM,
    KVQ_SEL_KEYDIFF
} kvq_selector;
typedef struct kvq_token_sel_opts {
    double keep;     /* NaN: not given (window; or target alone) */
    int sinks, recent, obs, pool;
    double adaptive; /* AdaKV's α (0..1); NaN: every head its own budget */
    /* decode-time compression (kvq-eval --policy decode): KVQ_UNSET when not given */
    int target, interval, buffer;
} kvq_token_sel_opts;
typedef enum kvq_token_part { KVQ_PART_SPEC, KVQ_PART_NONE, KVQ_PART_DROP } kvq_token_part;
/* A tokens(...) spec taken apart: the selector (sel.q is its table,
 * kvq_spec_opts(&sel) a kvq_token_sel_opts) and HI, LO. */
typedef struct kvq_tokens_parts {
    kvq_selector selector;
    kvq_spec sel;
    kvq_token_part hi_kind, lo_kind;
    kvq_spec hi, lo; /* when the kind is KVQ_PART_SPEC */
} kvq_tokens_parts;
/* A tokens(...) spec's parts, taken apart once in the process when it was
 * parsed (spec.c: composite specs are split by their parser alone); *out
 * stays valid for the process. */
kvq_status kvq_tokens_parts_of(const kvq_spec *spec, const kvq_tokens_parts **out, kvq_error *err);
/* Layer l's tokens(...) taken apart once (kvq_spec_resolve), or NULL for a plain spec. */
const kvq_tokens_parts *kvq_resolved_spec_parts(const kvq_resolved_spec *r, int layer);
/* The parts of "tokens(A; B; C)" (text starting "tokens(", its last
 * character the closing one): part k lies between cut[k] and cut[k + 1]
 * (exclusive; split at the ';' outside parentheses).  Returns how many
 * parts there are, 4 meaning more than 3 (then cut is incomplete). */
int kvq_tokens_cut(const char *text, int cut[4]);
/* Part k's bounds [*b, *e) without surrounding blanks. */
void kvq_tokens_part(const char *text, const int cut[4], int k, int *b, int *e);
/* The selector's table by name (window, h2o, ...), or NULL (tokens.c). */
const kvq_quantizer *kvq_token_selector_find(const char *name);
kvq_selector kvq_token_selector_kind(const kvq_quantizer *selector);
int kvq_token_selector_needs_queries(kvq_selector s);
/* The calibration state of a tokens(...) spec: HI's and LO's (NULL where
 * they have none), made and kept by the calibration (analysis/calib.c). */
typedef struct kvq_tokens_calib {
    const void *state[2];
} kvq_tokens_calib;
/* A spec run on a layer (kvq_quantize_layer or its reference), handed to
 * the composite runners so that they need not call back into run.c. */
typedef kvq_status (*kvq_layer_runner)(const kvq_spec *, const kvq_quant_ctx *, const kvq_layer *, kvq_quant_out *,
                                       kvq_error *);
/* tokens(...) on a layer (tokens.c): selection, HI and LO each through run
 * on its compacted tokens, the mask into out->keep (run.c calls it). */
kvq_status kvq_tokens_quantize(const kvq_spec *spec, const kvq_tokens_parts *tp, const kvq_quant_ctx *ctx,
                               const kvq_layer *in, kvq_quant_out *out, kvq_error *err, kvq_layer_runner run);
int kvq_spec_is_tokens(const kvq_spec *spec);
/* Which tokens of each KV head tp keeps (SPEC §3.11): keep [H][T] = 1 or 0;
 * score [H][T] (or NULL) receives each head's scores (NaN where the
 * selector scores nothing: window, the forced tokens).  mode: how the
 * layer's attention is computed (NULL: plain).  KVQ_ERR_FORMAT naming the
 * selector when it needs queries and in->query is NULL. */
kvq_status kvq_tokens_select(const kvq_tokens_parts *tp, const kvq_layer *in, const struct kvq_attn_mode *mode,
                             uint64_t seed, int layer, int nthreads, unsigned char *keep, double *score,
                             kvq_error *err);
/* Where a selection runs while decoding (SPEC §3.11, decode-time
 * compression): the layer holds the tokens at HI, each head keeps `target`
 * (forced ones win), and only query rows [qrow0, T) score (snapkv's window,
 * h2o's and zipcache's sums); window keeps its sinks and the last
 * target − sinks. */
typedef struct kvq_select_at {
    int target, qrow0;
} kvq_select_at;
kvq_status kvq_tokens_select_at(const kvq_tokens_parts *tp, const kvq_layer *in, const struct kvq_attn_mode *mode,
                                uint64_t seed, int layer, int nthreads, const kvq_select_at *at, unsigned char *keep,
                                double *score, kvq_error *err);

/* The position of token t of head h in the layer a quantizer sees: t,
 * unless tokens(...) compacted it (ctx->pos) — for RoPE re-applied to a
 * reconstruction. */
static inline int kvq_token_pos(const kvq_quant_ctx *ctx, const kvq_layer *in, int h, int t)
{
    return ctx->pos ? ctx->pos[(size_t)h * in->T + t] : t;
}

/* params.c: text of a parameter value checked against its type and range
 * (spec: the spec text messages name); the quantizer's keys, comma-separated. */
kvq_status kvq_param_value_parse(const char *spec, const kvq_param *p, const char *text, double *v,
                                 kvq_error *err);
void kvq_param_list_keys(const kvq_quantizer *q, char *buf, size_t len);

/* Helper to name the head in error messages. */
kvq_status kvq_quant_numeric_error(kvq_error *err, const kvq_spec *spec, const kvq_quant_ctx *ctx,
                                   const char *tensor, int head);

#endif
