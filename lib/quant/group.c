/* group.c — the uniform group quantizer families of docs/quantizers.md: per-token,
 * per-channel, kivi and kcvt.  Each is a parameter table plus a plan (which
 * U step covers which tokens, kvq.h); plan.c runs plans on the CPU and
 * kernels/ on a GPU; the registry (table.c) lists them. */
#include "../internal.h"
#include "quant.h"

#include <math.h>

/* Parameter rows shared by the families (designated initialisers); the
 * last argument places the value in the family's options struct. */
#define P_BITS(d, ...) \
    {.key = "bits", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 16, .help = "bits per code", __VA_ARGS__}
#define P_GROUP(d, h, ...) {.key = "group", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 1e9, .help = h, __VA_ARGS__}
#define P_SCALE(...)                                                                                                   \
    {                                                                                                                  \
        .key = "scale", .type = KVQ_PARAM_CHOICE, .def = "fp16", .choices = "fp16|fp32",                               \
        .help = "precision of scales and zeros", __VA_ARGS__                                                           \
    }
#define P_SPAN(h, ...) \
    {.key = "span", .type = KVQ_PARAM_CHOICE, .def = "head", .choices = "head|layer", .help = h, __VA_ARGS__}
enum { SPAN_HEAD, SPAN_LAYER }; /* span's choices */

/* ------------------------------------------------------------- per-token */

typedef struct per_token_opts {
    int bits, group, span, scale; /* span: SPAN_*; scale: kvq_scale_prec */
} per_token_opts;
static const kvq_param per_token_params[] = {
    P_BITS("2", KVQ_OPT(per_token_opts, bits)),
    P_GROUP("32", "channels per group (clamped to the axis)", KVQ_OPT(per_token_opts, group)),
    P_SPAN("group within one head, or along all heads of the token", KVQ_OPT(per_token_opts, span)),
    P_SCALE(KVQ_OPT(per_token_opts, scale)),
    KVQ_PARAM_PREROTATE,
};

/* One step per tensor: U per token over all T tokens. */
static void per_token_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    const per_token_opts *o = kvq_spec_opts(sp);
    kvq_step st = {o->span == SPAN_LAYER ? KVQ_STEP_TOKEN_LAYER : KVQ_STEP_TOKEN, 0, T, o->bits, o->group,
                   (kvq_scale_prec)o->scale};
    *p = (kvq_plan){.nsteps = {1, 1}, .step = {{st}, {st}}};
}

const kvq_quantizer kvq_q_per_token = {
    .name = "per-token",
    .description = "U per token for K and V: groups of `group` channels",
    .example_spec = "bits=3,group=4,span=layer",
    .params = per_token_params,
    .nparams = sizeof per_token_params / sizeof per_token_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .plan = per_token_plan,
    .quantize_head = kvq_plan_quantize_head,
    .reference = kvq_plan_reference,
};

/* ----------------------------------------------------------- per-channel */

typedef struct per_channel_opts {
    int bits, group, scale;
} per_channel_opts;
static const kvq_param per_channel_params[] = {
    P_BITS("2", KVQ_OPT(per_channel_opts, bits)),
    P_GROUP("32", "tokens per group, aligned at t = 0", KVQ_OPT(per_channel_opts, group)),
    P_SCALE(KVQ_OPT(per_channel_opts, scale)),
    KVQ_PARAM_PREROTATE,
};

static void per_channel_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    const per_channel_opts *o = kvq_spec_opts(sp);
    kvq_step st = {KVQ_STEP_CHANNEL, 0, T, o->bits, o->group, (kvq_scale_prec)o->scale};
    *p = (kvq_plan){.nsteps = {1, 1}, .step = {{st}, {st}}};
}

const kvq_quantizer kvq_q_per_channel = {
    .name = "per-channel",
    .description = "U per channel for K and V: groups of `group` tokens",
    .example_spec = "bits=3,group=64,scale=fp32",
    .params = per_channel_params,
    .nparams = sizeof per_channel_params / sizeof per_channel_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .plan = per_channel_plan,
    .quantize_head = kvq_plan_quantize_head,
    .reference = kvq_plan_reference,
};

/* ------------------------------------------------------------------ kivi */

typedef struct kivi_opts {
    int bits, group, residual;
    int kbits, vbits; /* KVQ_UNSET: bits */
} kivi_opts;
static const kvq_param kivi_params[] = {
    P_BITS("2", KVQ_OPT(kivi_opts, bits)),
    P_GROUP("32", "group size: tokens for K, channels for V", KVQ_OPT(kivi_opts, group)),
    {.key = "residual",
     .type = KVQ_PARAM_INT,
     .def = "128",
     .min = 0,
     .max = 1e9,
     .help = "full-precision window R (multiple of group; 0 = none)",
     KVQ_OPT(kivi_opts, residual)},
    {.key = "kbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "key bits (default: bits)",
     KVQ_OPT(kivi_opts, kbits)},
    {.key = "vbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "value bits (default: bits)",
     KVQ_OPT(kivi_opts, vbits)},
    KVQ_PARAM_PREROTATE,
};

static kvq_status kivi_check(const kvq_spec *sp, kvq_error *err)
{
    const kivi_opts *o = kvq_spec_opts(sp);
    if (o->residual % o->group != 0)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: residual=%d must be a multiple of group=%d", sp->text, o->residual,
                        o->group);
    return KVQ_OK;
}

static int kivi_bits(const kivi_opts *o, int tensor)
{
    int b = tensor ? o->vbits : o->kbits;
    return b == KVQ_UNSET ? o->bits : b;
}

/* KIVI at the moment the cache holds T tokens: keys per-channel on the
 * flushed T − (T mod R) tokens, values per-token on all but the last R; the
 * rest exact.  Scales and zeros in fp16, as KIVI stores them. */
static void kivi_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    const kivi_opts *o = kvq_spec_opts(sp);
    int R = o->residual, G = o->group;
    int tk = R > 0 ? T - T % R : T, tv = T - R > 0 ? T - R : 0;
    *p = (kvq_plan){
        .nsteps = {2, 2},
        .step = {{{KVQ_STEP_CHANNEL, 0, tk, kivi_bits(o, 0), G, KVQ_SCALE_FP16},
                  {KVQ_STEP_EXACT, tk, T, 16, 1, KVQ_SCALE_FP16}},
                 {{KVQ_STEP_TOKEN, 0, tv, kivi_bits(o, 1), G, KVQ_SCALE_FP16},
                  {KVQ_STEP_EXACT, tv, T, 16, 1, KVQ_SCALE_FP16}}},
    };
}

const kvq_quantizer kvq_q_kivi = {
    .name = "kivi",
    .description = "KIVI: K per-channel, V per-token, last tokens kept exact",
    .example_spec = "bits=2,group=8,residual=16",
    .params = kivi_params,
    .nparams = sizeof kivi_params / sizeof kivi_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .check = kivi_check,
    .plan = kivi_plan,
    .quantize_head = kvq_plan_quantize_head,
    .reference = kvq_plan_reference,
};

/* ------------------------------------------------------------------ kcvt */

typedef struct kcvt_opts {
    int bits, span;
} kcvt_opts;
static const kvq_param kcvt_params[] = {
    P_BITS("4", KVQ_OPT(kcvt_opts, bits)),
    P_SPAN("V groups: one head's D channels, or all H*D of the token", KVQ_OPT(kcvt_opts, span)),
    KVQ_PARAM_PREROTATE,
};

/* K: one group per channel (G = T); V: one group per token and head
 * (G = D), or per token across all heads with span=layer (G = H·D, clamped). */
static void kcvt_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    const kcvt_opts *o = kvq_spec_opts(sp);
    int bits = o->bits, layer = o->span == SPAN_LAYER;
    *p = (kvq_plan){
        .nsteps = {1, 1},
        .step = {{{KVQ_STEP_CHANNEL, 0, T, bits, T > 0 ? T : 1, KVQ_SCALE_FP16}},
                 {{layer ? KVQ_STEP_TOKEN_LAYER : KVQ_STEP_TOKEN, 0, T, bits, layer ? 1 << 30 : D,
                   KVQ_SCALE_FP16}}},
    };
}

const kvq_quantizer kvq_q_kcvt = {
    .name = "kcvt",
    .description = "GEAR's KCVT: K per-channel over all tokens, V per-token over all channels",
    .example_spec = "bits=2,span=layer",
    .params = kcvt_params,
    .nparams = sizeof kcvt_params / sizeof kcvt_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .plan = kcvt_plan,
    .quantize_head = kvq_plan_quantize_head,
    .reference = kvq_plan_reference,
};
