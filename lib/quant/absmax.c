/* absmax.c — symmetric absmax quantization per token (SPEC §2.2), the INT8
 * KV-cache baseline: one scale per group of `group` channels of a head
 * (group 0 = the whole head vector). */
#include "../internal.h"
#include "quant.h"

enum { AM_BITS, AM_GROUP, AM_SCALE };
static const kvq_param absmax_params[] = {
    [AM_BITS] = {.key = "bits", .type = KVQ_PARAM_INT, .def = "8", .min = 2, .max = 16, .help = "bits per code (signed)"},
    [AM_GROUP] = {.key = "group", .type = KVQ_PARAM_INT, .def = "0", .min = 0, .max = 1e9, .help = "channels per group (0 = whole head vector)"},
    [AM_SCALE] = {.key = "scale", .type = KVQ_PARAM_CHOICE, .def = "fp16", .choices = "fp16|fp32", .help = "precision of scales"},
};

static kvq_status absmax_head(const kvq_spec *sp, const kvq_quant_ctx *ctx,
                              const kvq_layer *in, kvq_quant_out *out, int tensor, int h,
                                 kvq_error *err)
{
    (void)ctx, (void)err;
    int T = in->T, D = in->D, bits = (int)sp->val[AM_BITS];
    int G = (int)sp->val[AM_GROUP];
    kvq_scale_prec prec = (kvq_scale_prec)sp->val[AM_SCALE];
    if (G == 0 || G > D) G = D;
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h);
    for (int t = 0; t < T; t++)
        for (int c0 = 0; c0 < D; c0 += G) {
            size_t o = (size_t)t * D + c0;
            kvq_status st = kvq_absmax_quantize_ref(x + o, y + o, (size_t)(D - c0 < G ? D - c0 : G), 1, bits, prec);
            if (st) return st;
        }
    int ngroups = (D + G - 1) / G;
    *kvq_head_bits(out, tensor, h) = (double)T * ((double)D * bits + ngroups * kvq_scale_bits(prec));
    return KVQ_OK;
}

const kvq_quantizer kvq_q_absmax = {
    .name = "absmax",
    .description = "symmetric absmax per token (INT8-style), one scale per group",
    .params = absmax_params,
    .nparams = sizeof absmax_params / sizeof absmax_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = absmax_head,
};
