/* kvquant.c — KVQuant-style quantization (Hooper et al. 2024; docs/quantizers.md#kvquant).
 * Rows are the channels of one head over its tokens for K (per-channel),
 * the tokens of one head for V (per-token).  The first `sink` tokens are
 * exact (attention sinks, the dump's values).  In each row of the rest, the
 * k = floor(outliers·n/2) largest and k smallest values are exact outliers
 * (GEAR's rule, docs/quantizers.md#gear step 1, without replacement; values at fp16); the other
 * values are normalised, u = (x − o)/r with o = fp16((mx + mn)/2) and
 * r = fp16((mx − mn)/2) over them, and snapped to the nearest of 2^b
 * levels: `uniform` (−1 + 2i/(2^b − 1)) or `nuq` (1-D k-means, docs/building-blocks.md `data`,
 * fitted per layer and K/V on the calibration dump's u values, computed the
 * same way).  x' = û·r + o (o when r = 0).  With prerope=1 and key_pre_rope
 * in the dump, K is quantized before RoPE and the dump's RoPE is applied to
 * the reconstruction.  Bits: b per element, 32 per row (o, r), 48 per
 * outlier (value + index), 16 per sink element; codebooks are static. */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <string.h>

enum { CB_NUQ, CB_UNIFORM }; /* codebook's choices */
typedef struct kvquant_opts {
    int bits;
    double outliers;
    int sink, codebook, prerope;
} kvquant_opts;
static const kvq_param kvquant_params[] = {
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "3", .min = 1, .max = KVQ_CODEBOOK_MAX_BITS,
     .help = "bits per code (2^bits levels)", KVQ_OPT(kvquant_opts, bits)},
    {.key = "outliers", .type = KVQ_PARAM_REAL, .def = "0.01", .min = 0, .max = 1,
     .help = "fraction of each row kept exact (both tails)", KVQ_OPT(kvquant_opts, outliers)},
    {.key = "sink", .type = KVQ_PARAM_INT, .def = "1", .min = 0, .max = 1e9,
     .help = "first tokens kept exact (attention sinks)", KVQ_OPT(kvquant_opts, sink)},
    {.key = "codebook", .type = KVQ_PARAM_CHOICE, .def = "nuq", .choices = "nuq|uniform",
     .help = "levels: k-means fitted on --calib (nuq) or uniform on [-1, 1]", KVQ_OPT(kvquant_opts, codebook)},
    {.key = "prerope", .type = KVQ_PARAM_INT, .def = "1", .min = 0, .max = 1,
     .help = "quantize keys before RoPE (needs key_pre_rope and the dump's RoPE)", KVQ_OPT(kvquant_opts, prerope)},
};

typedef struct kq_cfg {
    int bits, sink, prerope;
    double outliers;
} kq_cfg;

static kq_cfg cfg_of(const kvq_spec *sp, int T)
{
    const kvquant_opts *o = kvq_spec_opts(sp);
    kq_cfg c = {o->bits, o->sink, o->prerope, o->outliers};
    if (c.sink > T) c.sink = T;
    return c;
}

/* The uniform levels −1 + 2i/(2^b − 1) as a codebook (midpoints as bounds). */
static void uniform_codebook(int bits, kvq_codebook *cb)
{
    memset(cb, 0, sizeof *cb);
    cb->bits = bits, cb->n = 1 << bits;
    for (int i = 0; i < cb->n; i++) {
        cb->level[i] = -1.0 + 2.0 * i / (cb->n - 1);
        cb->levelf[i] = (float)cb->level[i];
    }
    for (int i = 0; i + 1 < cb->n; i++) cb->bound[i] = (float)(0.5 * (cb->level[i] + cb->level[i + 1]));
}

/* One row of n values: marks the outliers in sel, returns o and r over the
 * rest (r = −1 when every value is an outlier). */
static void row_stats(const float *row, int n, int k, unsigned char *sel, float *scratch, float *o, float *r)
{
    kvq_gear_row_outliers(row, NULL, sel, n, k, scratch);
    float mn = INFINITY, mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (!sel[i]) mn = row[i] < mn ? row[i] : mn, mx = row[i] > mx ? row[i] : mx;
    if (mn > mx) { /* no value left to normalise */
        *o = 0.0f, *r = -1.0f;
        return;
    }
    *o = kvq_round_f16((mx + mn) / 2.0f);
    *r = kvq_round_f16((mx - mn) / 2.0f);
}

/* Quantizes one row into out (codebook cb), or (out NULL) appends its u
 * values to u, *nu counting them.  scratch: 2n floats. */
static void row_quantize(const float *row, float *out, int n, int k, const kvq_codebook *cb, unsigned char *sel,
                         float *scratch, float *u, size_t *nu)
{
    float o, r;
    row_stats(row, n, k, sel, scratch, &o, &r);
    if (!out) {
        for (int i = 0; i < n && r > 0.0f; i++)
            if (!sel[i]) u[(*nu)++] = (row[i] - o) / r;
        return;
    }
    if (r > 0.0f) { /* x' = level(u)·r + o, u = (x − o)/r: the nearest level as Lloyd–Max snaps it */
        for (int i = 0; i < n; i++) scratch[i] = row[i] - o;
        kvq_lloydmax_snap(cb, scratch, r, n);
    }
    for (int i = 0; i < n; i++)
        out[i] = sel[i] ? kvq_round_f16(row[i]) /* an exact outlier, stored at fp16 */
                 : r > 0.0f ? scratch[i] * r + o
                            : o; /* r = 0: a constant rest, x' = o */
}

/* The rows of one head's tensor x [T][D] (K: channels over tokens ≥ sink;
 * V: tokens ≥ sink), quantized into y (NULL: only collect u).  Returns the
 * number of outliers per row through *k_out. */
static kvq_status head_rows(const float *x, float *y, int T, int D, int tensor, const kq_cfg *c,
                            const kvq_codebook *cb, float *u, size_t *nu, int *k_out)
{
    int rows = tensor ? T - c->sink : D, n = tensor ? D : T - c->sink;
    int k = (int)floor(c->outliers * n / 2.0);
    *k_out = k;
    if (rows <= 0 || n <= 0) return KVQ_OK;
    int B = tensor ? 1 : KVQ_CHANNEL_BLOCK; /* K: channels gathered a block at a time */
    float *buf = kvq_alloc_array((size_t)n, (2 * (size_t)B + 2) * sizeof *buf); /* rows, out, scratch of 2n */
    unsigned char *sel = malloc((size_t)n);
    if (!buf || !sel) {
        free(buf), free(sel);
        return KVQ_ERR_NOMEM;
    }
    float *row = buf, *out = buf + (size_t)B * n, *scratch = buf + 2 * (size_t)B * n;
    for (int rw0 = 0; rw0 < rows; rw0 += B) {
        if (tensor) { /* V: token sink + rw0, contiguous */
            const float *xr = x + (size_t)(c->sink + rw0) * D;
            row_quantize(xr, y ? y + (size_t)(c->sink + rw0) * D : NULL, n, k, cb, sel, scratch, u, nu);
            continue;
        }
        /* K: channels rw0.. over tokens sink..T−1 */
        int nb = rows - rw0 < B ? rows - rw0 : B;
        kvq_gather_channels(x + (size_t)c->sink * D + rw0, (size_t)D, nb, n, row);
        for (int b = 0; b < nb; b++)
            row_quantize(row + (size_t)b * n, y ? out + (size_t)b * n : NULL, n, k, cb, sel, scratch, u, nu);
        if (y) kvq_scatter_channels(out, nb, n, (size_t)D, y + (size_t)c->sink * D + rw0);
    }
    free(buf), free(sel);
    return KVQ_OK;
}

#define NEEDS_ROPE                                                                                          \
    "prerope=1: the keys are quantized before RoPE, which must then be re-applied: expected rope_style and " \
    "rope_theta (or /rope_cos, /rope_sin) in the dump (or use prerope=0)"

/* The stored bits of one head's tensor with k outliers per row: 16 per sink
 * element; per row of the rest o and r (32), 48 per outlier, b per code. */
static double head_bits(const kq_cfg *c, int T, int D, int tensor, int k)
{
    int rows = tensor ? T - c->sink : D, n = tensor ? D : T - c->sink;
    double bits = 16.0 * c->sink * D;
    if (rows > 0 && n > 0) bits += (double)rows * (32.0 + 48.0 * 2 * k + (double)c->bits * (n - 2 * k));
    return bits;
}

/* K's rows come from key_pre_rope with prerope=1 when the dump has it. */
static const float *key_source(const kq_cfg *c, const kvq_layer *in, int h)
{
    if (c->prerope && in->key_pre_rope) return in->key_pre_rope + (size_t)h * in->T * in->D;
    return kvq_head_in(in, 0, h);
}

static kvq_status kvquant_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                               kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    int T = in->T, D = in->D;
    kq_cfg c = cfg_of(sp, T);
    int pre = !tensor && c.prerope && in->key_pre_rope;
    if (pre && !ctx->rope) return kvq_fail(err, KVQ_ERR_FORMAT, "%s", NEEDS_ROPE);
    kvq_codebook uni;
    const kvq_codebook *cb = &uni;
    const kvquant_opts *o = kvq_spec_opts(sp);
    int codebook = o->codebook;
    if (codebook == CB_UNIFORM) uniform_codebook(c.bits, &uni);
    else cb = (const kvq_codebook *)ctx->calib + tensor; /* nuq: [K, V] of this layer */
    const float *x = tensor ? kvq_head_in(in, 1, h) : key_source(&c, in, h);
    float *y = kvq_head_out(out, in, tensor, h);
    int k = 0;
    kvq_status st = head_rows(x, y, T, D, tensor, &c, cb, NULL, NULL, &k);
    if (st) return st;
    if (pre) /* K' = RoPE_t(Q(K_pre)) */
        for (int t = c.sink; t < T; t++) kvq_rope_rotate(ctx->rope, y + (size_t)t * D, kvq_token_pos(ctx, in, h, t), 0);
    /* sink tokens: the dump's (post-RoPE) values */
    memcpy(y, kvq_head_in(in, tensor, h), (size_t)c.sink * D * sizeof *y);
    *kvq_head_bits(out, tensor, h) = head_bits(&c, T, D, tensor, k);
    if (tensor == 1 && codebook == CB_NUQ) /* the layer's two codebooks, shared by the heads */
        out->static_bytes[h] = 2.0 * 4.0 * cb->n / in->H;
    return KVQ_OK;
}

/* ------------------------------------------------------------ the reference */

/* The reference (.reference_head): kvquant_head's numbers from the
 * definition, one row at a time: the outliers by sorting
 * (kvq_gear_row_outliers_ref), o and r over the rest, u's level by the
 * codebook's search. */
static kvq_status kvquant_reference_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                         kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    int T = in->T, D = in->D;
    kq_cfg c = cfg_of(sp, T);
    const kvquant_opts *o = kvq_spec_opts(sp);
    int pre = !tensor && c.prerope && in->key_pre_rope;
    if (pre && !ctx->rope) return kvq_fail(err, KVQ_ERR_FORMAT, "%s", NEEDS_ROPE);
    kvq_codebook uni;
    const kvq_codebook *cb = &uni;
    if (o->codebook == CB_UNIFORM) uniform_codebook(c.bits, &uni);
    else cb = (const kvq_codebook *)ctx->calib + tensor; /* nuq: [K, V] of this layer */
    /* rows: K a channel over tokens sink..T−1, V a token from sink on */
    int rows = tensor ? T - c.sink : D, n = tensor ? D : T - c.sink;
    int k = (int)floor(c.outliers * n / 2.0);
    const float *x = tensor ? kvq_head_in(in, 1, h) : key_source(&c, in, h);
    float *y = kvq_head_out(out, in, tensor, h);
    float *row = kvq_alloc_array((size_t)(n > 0 ? n : 1), sizeof *row);
    unsigned char *sel = malloc((size_t)(n > 0 ? n : 1));
    kvq_status st = row && sel ? KVQ_OK : KVQ_ERR_NOMEM;
    for (int rw = 0; rw < rows && n > 0 && !st; rw++) {
#define ELEMENT(e) (tensor ? (size_t)(c.sink + rw) * D + (size_t)(e) : (size_t)(c.sink + (e)) * D + (size_t)rw)
        for (int e = 0; e < n; e++) row[e] = x[ELEMENT(e)];
        if ((st = kvq_gear_row_outliers_ref(row, sel, n, k))) break;
        float mn = INFINITY, mx = -INFINITY; /* over the values that are not outliers */
        for (int e = 0; e < n; e++)
            if (!sel[e]) mn = fminf(mn, row[e]), mx = fmaxf(mx, row[e]);
        float off = mn <= mx ? kvq_round_f16((mx + mn) / 2.0f) : 0.0f;
        float r = mn <= mx ? kvq_round_f16((mx - mn) / 2.0f) : 0.0f;
        for (int e = 0; e < n; e++) /* x' = û·r + o, û the level nearest u = (x − o)/r */
            y[ELEMENT(e)] = sel[e]     ? kvq_round_f16(row[e])
                            : r > 0.0f ? cb->levelf[kvq_codebook_index(cb, (row[e] - off) / r)] * r + off
                                       : off;
#undef ELEMENT
    }
    free(row), free(sel);
    if (st) return st;
    if (pre) /* K' = RoPE_t(Q(K_pre)) */
        for (int t = c.sink; t < T; t++) kvq_rope_rotate(ctx->rope, y + (size_t)t * D, kvq_token_pos(ctx, in, h, t), 0);
    for (size_t i = 0; i < (size_t)c.sink * D; i++) y[i] = kvq_head_in(in, tensor, h)[i]; /* the sinks, exact */
    *kvq_head_bits(out, tensor, h) = head_bits(&c, T, D, tensor, k);
    if (tensor == 1 && o->codebook == CB_NUQ) out->static_bytes[h] = 2.0 * 4.0 * cb->n / in->H;
    return KVQ_OK;
}

/* ------------------------------------------------- nuq: the calibration */

static int kvquant_calib_key(const kvq_spec *sp, char *buf, size_t len)
{
    const kvquant_opts *o = kvq_spec_opts(sp);
    if (o->codebook != CB_NUQ) return 0;
    snprintf(buf, len, "bits=%d,outliers=%.17g,sink=%d,prerope=%d", o->bits, o->outliers, o->sink, o->prerope);
    return 1;
}

/* Per layer, K and V: the u values of every head of the calibration layer
 * (the same sinks, outliers and normalisation), 1-D k-means at `bits`.
 * State: kvq_codebook [2]. */
static kvq_status kvquant_calibrate(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *cal,
                                    void **state, kvq_error *err)
{
    (void)ctx;
    int H = cal->H, T = cal->T, D = cal->D;
    kq_cfg c = cfg_of(sp, T);
    kvq_codebook *cbs = kvq_alloc_array(2, sizeof *cbs);
    float *u = kvq_alloc_array((size_t)H * T * D, sizeof *u);
    kvq_status st = cbs && u ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int tensor = 0; tensor < 2 && !st; tensor++) {
        size_t nu = 0;
        for (int h = 0; h < H && !st; h++) {
            int k;
            const float *x = tensor ? kvq_head_in(cal, 1, h) : key_source(&c, cal, h);
            if (head_rows(x, NULL, T, D, tensor, &c, NULL, u, &nu, &k))
                st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        }
        if (!st && nu == 0)
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: no value left to fit after the sinks and outliers",
                          tensor ? "value" : "key");
        if (!st) st = kvq_codebook_fit_data(u, nu, c.bits, &cbs[tensor], err);
    }
    free(u);
    if (st) {
        free(cbs);
        return st;
    }
    *state = cbs;
    return KVQ_OK;
}

const kvq_quantizer kvq_q_kvquant = {
    .name = "kvquant",
    .description = "KVQuant: pre-RoPE per-channel K / per-token V, NUQ levels, sparse outliers, sinks",
    .example_spec = "bits=2,prerope=1",
    .params = kvquant_params,
    .nparams = sizeof kvquant_params / sizeof kvquant_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = kvquant_head,
    .reference_head = kvquant_reference_head,
    .read_flags = KVQ_READ_KEY_PRE_ROPE,
    .calib_key = kvquant_calib_key,
    .calibrate = kvquant_calibrate,
    .calib_free = free,
};
