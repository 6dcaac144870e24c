/* fp8.c — the FP8 KV cache (docs/quantizers.md#fp8): x' = fp8(x / s) · s with
 * the OCP formats e4m3 and e5m2 (the cast: formats/fp8.c), one float32 scale
 * per tensor, head, token or channel (or none, vLLM's uncalibrated default). */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <string.h>

/* ----------------------------------------------------------- the quantizer */

enum { SC_NONE, SC_TENSOR, SC_HEAD, SC_TOKEN, SC_CHANNEL }; /* scale's choices */
typedef struct fp8_opts {
    int format; /* kvq_fp8_format */
    int scale;  /* SC_* */
} fp8_opts;
static const kvq_param fp8_params[] = {
    {.key = "format", .type = KVQ_PARAM_CHOICE, .def = "e4m3", .choices = "e4m3|e5m2",
     .help = "OCP FP8 format: e4m3 (max 448) or e5m2 (max 57344)", KVQ_OPT(fp8_opts, format)},
    {.key = "scale", .type = KVQ_PARAM_CHOICE, .def = "tensor", .choices = "none|tensor|head|token|channel",
     .help = "float32 scale max|x|/fmax per layer tensor, KV head, token or channel (none: 1)",
     KVQ_OPT(fp8_opts, scale)},
    KVQ_PARAM_PREROTATE,
};

/* One head [T][D] of one tensor with its scale(s); returns the stored bits.
 * tensor_amax: the layer tensor's max|x| (scale=tensor only). */
static kvq_status fp8_head(const float *x, float *y, int H, int T, int D, int scale, kvq_fp8_format fmt,
                           float tensor_amax, double *bits)
{
    const float fmax = kvq_fp8_max(fmt);
    size_t n = (size_t)T * D;
    double codes = 8.0 * (double)n;
    switch (scale) {
    case SC_NONE:
        kvq_fp8_quantize_array(x, y, n, 1.0f, fmt);
        *bits = codes;
        break;
    case SC_TENSOR: /* one scale for the H heads: a 1/H share of its 32 bits each */
        kvq_fp8_quantize_array(x, y, n, kvq_max_scale(tensor_amax, fmax), fmt);
        *bits = codes + 32.0 / H;
        break;
    case SC_HEAD:
        kvq_fp8_quantize_array(x, y, n, kvq_max_scale(kvq_absmax(x, n), fmax), fmt);
        *bits = codes + 32.0;
        break;
    case SC_TOKEN:
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * D;
            kvq_fp8_quantize_array(xt, y + (size_t)t * D, (size_t)D, kvq_max_scale(kvq_absmax(xt, (size_t)D), fmax),
                                   fmt);
        }
        *bits = codes + 32.0 * T;
        break;
    case SC_CHANNEL: {
        /* column maxima in one contiguous pass, then row by row with a scale per column */
        float *s = malloc((size_t)D * sizeof *s);
        if (!s) return KVQ_ERR_NOMEM;
        for (int c = 0; c < D; c++) s[c] = 0.0f;
        for (int t = 0; t < T; t++)
            for (int c = 0; c < D; c++) {
                float a = fabsf(x[(size_t)t * D + c]);
                s[c] = a > s[c] ? a : s[c];
            }
        for (int c = 0; c < D; c++) s[c] = kvq_max_scale(s[c], fmax);
        kvq_fp8_quantize_columns(x, y, (size_t)T, (size_t)D, s, fmt);
        free(s);
        *bits = codes + 32.0 * D;
        break;
    }
    }
    return KVQ_OK;
}

/* The layer's part (.layer_prepare): scale=tensor's max|x| of K and of V
 * over all heads (float[2]; 0 for the other scales). */
static kvq_status fp8_prepare(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, void *state,
                              kvq_error *err)
{
    const fp8_opts *o = kvq_spec_opts(sp);
    float *amax = state;
    amax[0] = amax[1] = 0.0f;
    if (o->scale == SC_TENSOR && kvq_layer_absmax(in, kvq_threads(ctx->nthreads), amax))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    return KVQ_OK;
}

static kvq_status fp8_quantize_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                    kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    (void)err; /* KVQ_ERR_NOMEM: the runner says it */
    const fp8_opts *o = kvq_spec_opts(sp);
    const float *amax = ctx->layer_state;
    return fp8_head(kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h), in->H, in->T, in->D, o->scale,
                    (kvq_fp8_format)o->format, amax[tensor], kvq_head_bits(out, tensor, h));
}

/* The reference (.reference): every element as docs/quantizers.md#fp8 writes
 * it, x' = fp8(x / s)·s with the branchy cast kvq_fp8_cast_ref, the scale of
 * the element's tensor, head, token or channel found by a plain scan. */
static kvq_status fp8_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                kvq_quant_out *out, kvq_error *err)
{
    (void)ctx, (void)err;
    const fp8_opts *o = kvq_spec_opts(sp);
    int H = in->H, T = in->T, D = in->D, scale = o->scale;
    kvq_fp8_format fmt = (kvq_fp8_format)o->format;
    const float fmax = kvq_fp8_max(fmt);
    for (int tensor = 0; tensor < 2; tensor++) {
        const float *x = tensor ? in->value : in->key; /* [H][T][D] */
        float *y = tensor ? out->value : out->key;
        float tensor_amax = kvq_absmax(x, (size_t)H * T * D);
        for (int h = 0; h < H; h++) {
            const float *xh = x + (size_t)h * T * D;
            float head_amax = kvq_absmax(xh, (size_t)T * D);
            for (int t = 0; t < T; t++)
                for (int c = 0; c < D; c++) {
                    float amax = 0.0f; /* the max |x| the element's scale is taken over */
                    if (scale == SC_TENSOR) amax = tensor_amax;
                    else if (scale == SC_HEAD) amax = head_amax;
                    else if (scale == SC_TOKEN) amax = kvq_absmax(xh + (size_t)t * D, (size_t)D);
                    else if (scale == SC_CHANNEL)
                        for (int u = 0; u < T; u++) amax = fmaxf(amax, fabsf(xh[(size_t)u * D + c]));
                    float s = scale == SC_NONE ? 1.0f : kvq_max_scale(amax, fmax);
                    size_t i = ((size_t)h * T + t) * D + c;
                    y[i] = kvq_fp8_cast_ref(x[i] / s, fmt) * s;
                }
            /* codes, plus 32 bits per scale (a tensor's shared by its H heads) */
            double scales[] = {[SC_NONE] = 0, [SC_TENSOR] = 1.0 / H, [SC_HEAD] = 1, [SC_TOKEN] = T, [SC_CHANNEL] = D};
            *kvq_head_bits(out, tensor, h) = 8.0 * T * D + 32.0 * scales[scale];
        }
    }
    return KVQ_OK;
}

const kvq_quantizer kvq_q_fp8 = {
    .name = "fp8",
    .description = "FP8 cast e4m3/e5m2 after a float32 scale, round to nearest even, saturating",
    .example_spec = "format=e5m2,scale=token",
    .params = fp8_params,
    .nparams = sizeof fp8_params / sizeof fp8_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = fp8_quantize_head,
    .layer_prepare = fp8_prepare,
    .reference = fp8_reference,
};
