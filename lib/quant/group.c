/* group.c — the uniform group quantizer families of docs/quantizers.md: per-token,
 * per-channel, kivi and kcvt.  Each is a parameter table plus a plan (which
 * U step covers which tokens, kvq.h); plan.c runs plans on the CPU and
 * kernels/ on a GPU; the registry (table.c) lists them. */
#include "../internal.h"
#include "quant.h"

#include <math.h>

/* Parameter rows shared by the families (designated initialisers). */
#define P_BITS(d) {.key = "bits", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 16, .help = "bits per code"}
#define P_GROUP(d, h) {.key = "group", .type = KVQ_PARAM_INT, .def = d, .min = 1, .max = 1e9, .help = h}
#define P_SCALE                                                                                                        \
    {                                                                                                                  \
        .key = "scale", .type = KVQ_PARAM_CHOICE, .def = "fp16", .choices = "fp16|fp32",                               \
        .help = "precision of scales and zeros"                                                                        \
    }
#define P_SPAN(h) {.key = "span", .type = KVQ_PARAM_CHOICE, .def = "head", .choices = "head|layer", .help = h}

/* ------------------------------------------------------------- per-token */

enum { PT_BITS, PT_GROUP, PT_SPAN, PT_SCALE };
static const kvq_param per_token_params[] = {
    [PT_BITS] = P_BITS("2"),
    [PT_GROUP] = P_GROUP("32", "channels per group (clamped to the axis)"),
    [PT_SPAN] = P_SPAN("group within one head, or along all heads of the token"),
    [PT_SCALE] = P_SCALE,
    KVQ_PARAM_PREROTATE,
};

/* One step per tensor: U per token over all T tokens. */
static void per_token_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    kvq_step st = {(int)sp->val[PT_SPAN] == 1 ? KVQ_STEP_TOKEN_LAYER : KVQ_STEP_TOKEN, 0, T,
                   (int)sp->val[PT_BITS], (int)sp->val[PT_GROUP], (kvq_scale_prec)sp->val[PT_SCALE]};
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

enum { PC_BITS, PC_GROUP, PC_SCALE };
static const kvq_param per_channel_params[] = {
    [PC_BITS] = P_BITS("2"),
    [PC_GROUP] = P_GROUP("32", "tokens per group, aligned at t = 0"),
    [PC_SCALE] = P_SCALE,
    KVQ_PARAM_PREROTATE,
};

static void per_channel_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    kvq_step st = {KVQ_STEP_CHANNEL, 0, T, (int)sp->val[PC_BITS], (int)sp->val[PC_GROUP],
                   (kvq_scale_prec)sp->val[PC_SCALE]};
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

enum { KV_BITS, KV_GROUP, KV_RESIDUAL, KV_KBITS, KV_VBITS };
static const kvq_param kivi_params[] = {
    [KV_BITS] = P_BITS("2"),
    [KV_GROUP] = P_GROUP("32", "group size: tokens for K, channels for V"),
    [KV_RESIDUAL] = {.key = "residual",
                     .type = KVQ_PARAM_INT,
                     .def = "128",
                     .min = 0,
                     .max = 1e9,
                     .help = "full-precision window R (multiple of group; 0 = none)"},
    [KV_KBITS] =
        {.key = "kbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "key bits (default: bits)"},
    [KV_VBITS] =
        {.key = "vbits", .type = KVQ_PARAM_INT, .def = NULL, .min = 1, .max = 16, .help = "value bits (default: bits)"},
    KVQ_PARAM_PREROTATE,
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
 * flushed T − (T mod R) tokens, values per-token on all but the last R; the
 * rest exact.  Scales and zeros in fp16, as KIVI stores them. */
static void kivi_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    int R = (int)sp->val[KV_RESIDUAL], G = (int)sp->val[KV_GROUP];
    int tk = R > 0 ? T - T % R : T, tv = T - R > 0 ? T - R : 0;
    *p = (kvq_plan){
        .nsteps = {2, 2},
        .step = {{{KVQ_STEP_CHANNEL, 0, tk, kivi_bits(sp, 0), G, KVQ_SCALE_FP16},
                  {KVQ_STEP_EXACT, tk, T, 16, 1, KVQ_SCALE_FP16}},
                 {{KVQ_STEP_TOKEN, 0, tv, kivi_bits(sp, 1), G, KVQ_SCALE_FP16},
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

enum { KC_BITS, KC_SPAN };
static const kvq_param kcvt_params[] = {
    [KC_BITS] = P_BITS("4"),
    [KC_SPAN] = P_SPAN("V groups: one head's D channels, or all H*D of the token"),
    KVQ_PARAM_PREROTATE,
};

/* K: one group per channel (G = T); V: one group per token and head
 * (G = D), or per token across all heads with span=layer (G = H·D, clamped). */
static void kcvt_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    int bits = (int)sp->val[KC_BITS], layer = (int)sp->val[KC_SPAN] == 1;
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
