/* group.c — the uniform group quantizer families of SPEC §3: per-token,
 * per-channel, kivi and kcvt.  Each is a parameter table plus a per-head
 * function; the registry (registry.c) lists them. */
#include "../internal.h"
#include "quant.h"

#include <math.h>

/* Parameter rows shared by the families (designated initialisers). */
#define P_BITS(d) {.key = "bits", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 16, .help = "bits per code"}
#define P_GROUP(d, h) {.key = "group", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 1e9, .help = h}
#define P_SCALE {.key = "scale", .type = KVQ_PARAM_CHOICE, .def = "fp16", .choices = "fp16|fp32", .help = "precision of scales and zeros"}
#define P_SPAN(h) {.key = "span", .type = KVQ_PARAM_CHOICE, .def = "head", .choices = "head|layer", .help = h}

/* ------------------------------------------------------------- per-token */

enum { PT_BITS, PT_GROUP, PT_SPAN, PT_SCALE };
static const kvq_param per_token_params[] = {
    [PT_BITS] = P_BITS("2"),
    [PT_GROUP] = P_GROUP("32", "channels per group (clamped to the axis)"),
    [PT_SPAN] = P_SPAN("group within one head, or along all heads of the token"),
    [PT_SCALE] = P_SCALE,
};

/* span=layer couples the heads of a token: one task per tensor. */
static kvq_status per_token_layer_task(const kvq_spec *sp, const kvq_layer *in, kvq_quant_out *out,
                                       int tensor, int h)
{
    if (h != 0) return KVQ_OK;
    return kvq_quant_layer_per_token_span(tensor ? in->value : in->key,
                                          tensor ? out->value : out->key, in->H, in->T, in->D, 0,
                                          in->T, (int)sp->val[PT_BITS], (int)sp->val[PT_GROUP],
                                          (kvq_scale_prec)sp->val[PT_SCALE],
                                          tensor ? out->v_bits : out->k_bits);
}

static kvq_status per_token_head(const kvq_spec *sp, const kvq_quant_ctx *ctx,
                                 const kvq_layer *in, kvq_quant_out *out, int tensor, int h,
                                 kvq_error *err)
{
    (void)ctx, (void)err;
    if ((int)sp->val[PT_SPAN] == 1) return per_token_layer_task(sp, in, out, tensor, h);
    return kvq_quant_head_per_token(kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h), in->T, in->D,
                                    0, in->T, (int)sp->val[PT_BITS], (int)sp->val[PT_GROUP],
                                    (kvq_scale_prec)sp->val[PT_SCALE], kvq_head_bits(out, tensor, h),
                                    kvq_head_recon(out, in, tensor, h));
}

const kvq_quantizer kvq_q_per_token = {
    .name = "per-token",
    .description = "U per token for K and V: groups of `group` channels (SPEC 2.1)",
    .params = per_token_params,
    .nparams = sizeof per_token_params / sizeof per_token_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = per_token_head,
};

/* ----------------------------------------------------------- per-channel */

enum { PC_BITS, PC_GROUP, PC_SCALE };
static const kvq_param per_channel_params[] = {
    [PC_BITS] = P_BITS("2"),
    [PC_GROUP] = P_GROUP("32", "tokens per group, aligned at t = 0"),
    [PC_SCALE] = P_SCALE,
};

static kvq_status per_channel_head(const kvq_spec *sp, const kvq_quant_ctx *ctx,
                                   const kvq_layer *in, kvq_quant_out *out, int tensor, int h,
                                 kvq_error *err)
{
    (void)ctx, (void)err;
    return kvq_quant_head_per_channel(kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h), in->T,
                                      in->D, 0, in->T, (int)sp->val[PC_BITS],
                                      (int)sp->val[PC_GROUP], (kvq_scale_prec)sp->val[PC_SCALE],
                                      kvq_head_bits(out, tensor, h), kvq_head_recon(out, in, tensor, h));
}

const kvq_quantizer kvq_q_per_channel = {
    .name = "per-channel",
    .description = "U per channel for K and V: groups of `group` tokens (SPEC 2.1)",
    .params = per_channel_params,
    .nparams = sizeof per_channel_params / sizeof per_channel_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = per_channel_head,
};

/* ------------------------------------------------------------------ kivi */

enum { KV_BITS, KV_GROUP, KV_RESIDUAL, KV_KBITS, KV_VBITS };
static const kvq_param kivi_params[] = {
    [KV_BITS] = P_BITS("2"),
    [KV_GROUP] = P_GROUP("32", "group size: tokens for K, channels for V"),
    [KV_RESIDUAL] = {.key = "residual", .type = KVQ_PARAM_INT, .def = "128", .min = 0, .max = 1e9,
                     .help = "full-precision window R (multiple of group; 0 = none)"},
    [KV_KBITS] = {.key = "kbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "key bits (default: bits)"},
    [KV_VBITS] = {.key = "vbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "value bits (default: bits)"},
};

static kvq_status kivi_check(const kvq_spec *sp, kvq_error *err)
{
    long R = (long)sp->val[KV_RESIDUAL], G = (long)sp->val[KV_GROUP];
    if (R % G != 0)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: residual=%ld must be a multiple of group=%ld", sp->text, R, G);
    return KVQ_OK;
}

static int kivi_bits(const kvq_spec *sp, int tensor)
{
    int k = tensor ? KV_VBITS : KV_KBITS;
    return (int)(isnan(sp->val[k]) ? sp->val[KV_BITS] : sp->val[k]);
}

/* KIVI at the moment the cache holds T tokens: keys per-channel on the
 * flushed T − (T mod R) tokens, values per-token on all but the last R. */
static kvq_status kivi_head(const kvq_spec *sp, const kvq_quant_ctx *ctx,
                            const kvq_layer *in, kvq_quant_out *out, int tensor, int h,
                                 kvq_error *err)
{
    (void)ctx, (void)err;
    int T = in->T, D = in->D, R = (int)sp->val[KV_RESIDUAL], G = (int)sp->val[KV_GROUP];
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h);
    kvq_recon_acc *recon = kvq_head_recon(out, in, tensor, h);
    double qbits = 0;
    kvq_status st;
    int tq;
    if (tensor == 0) {
        tq = R > 0 ? T - T % R : T;
        st = kvq_quant_head_per_channel(x, y, T, D, 0, tq, kivi_bits(sp, 0), G, KVQ_SCALE_FP16, &qbits, recon);
    } else {
        tq = T - R > 0 ? T - R : 0;
        st = kvq_quant_head_per_token(x, y, T, D, 0, tq, kivi_bits(sp, 1), G, KVQ_SCALE_FP16, &qbits, recon);
    }
    if (st) return st;
    *kvq_head_bits(out, tensor, h) = qbits + kvq_keep_exact(x, y, T, D, tq, T, recon);
    return KVQ_OK;
}

const kvq_quantizer kvq_q_kivi = {
    .name = "kivi",
    .description = "KIVI: K per-channel, V per-token, last tokens kept exact (SPEC 3)",
    .params = kivi_params,
    .nparams = sizeof kivi_params / sizeof kivi_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .check = kivi_check,
    .quantize_head = kivi_head,
};

/* ------------------------------------------------------------------ kcvt */

enum { KC_BITS, KC_SPAN };
static const kvq_param kcvt_params[] = {
    [KC_BITS] = P_BITS("4"),
    [KC_SPAN] = P_SPAN("V groups: one head's D channels, or all H*D of the token"),
};

static kvq_status kcvt_head(const kvq_spec *sp, const kvq_quant_ctx *ctx,
                            const kvq_layer *in, kvq_quant_out *out, int tensor, int h,
                                 kvq_error *err)
{
    (void)ctx, (void)err;
    int T = in->T, D = in->D, bits = (int)sp->val[KC_BITS];
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h);
    if (tensor == 0) /* K: one group per channel, G = T */
        return kvq_quant_head_per_channel(x, y, T, D, 0, T, bits, T, KVQ_SCALE_FP16, kvq_head_bits(out, 0, h),
                                          kvq_head_recon(out, in, 0, h));
    if ((int)sp->val[KC_SPAN] == 0) /* V: one group per token and head, G = D */
        return kvq_quant_head_per_token(x, y, T, D, 0, T, bits, D, KVQ_SCALE_FP16, kvq_head_bits(out, 1, h),
                                        kvq_head_recon(out, in, 1, h));
    if (h != 0) return KVQ_OK; /* span=layer: one group of H*D per token, done by head 0's task */
    return kvq_quant_layer_per_token_span(in->value, out->value, in->H, T, D, 0, T, bits,
                                          in->H * D, KVQ_SCALE_FP16, out->v_bits);
}

const kvq_quantizer kvq_q_kcvt = {
    .name = "kcvt",
    .description = "GEAR's KCVT: K per-channel over all tokens, V per-token over all channels",
    .params = kcvt_params,
    .nparams = sizeof kcvt_params / sizeof kcvt_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = kcvt_head,
};
