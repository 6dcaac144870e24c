/* absmax.c — symmetric absmax quantization per token (docs/building-blocks.md (A)), the INT8
 * KV-cache baseline: one scale per group of `group` channels of a head
 * (group 0 = the whole head vector). */
#include "../internal.h"
#include "quant.h"

typedef struct absmax_opts {
    int bits, group, scale; /* scale: kvq_scale_prec */
} absmax_opts;
static const kvq_param absmax_params[] = {
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "8", .min = 2, .max = 16, .help = "bits per code (signed)",
     KVQ_OPT(absmax_opts, bits)},
    {.key = "group",
     .type = KVQ_PARAM_INT,
     .def = "0",
     .min = 0,
     .max = 1e9,
     .help = "channels per group (0 = whole head vector)",
     KVQ_OPT(absmax_opts, group)},
    {.key = "scale",
     .type = KVQ_PARAM_CHOICE,
     .def = "fp16",
     .choices = "fp16|fp32",
     .help = "precision of scales",
     KVQ_OPT(absmax_opts, scale)},
    KVQ_PARAM_PREROTATE,
};

static void absmax_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    const absmax_opts *o = kvq_spec_opts(sp);
    kvq_step st = {KVQ_STEP_ABSMAX, 0, T, o->bits, o->group, (kvq_scale_prec)o->scale};
    *p = (kvq_plan){.nsteps = {1, 1}, .step = {{st}, {st}}};
}

const kvq_quantizer kvq_q_absmax = {
    .name = "absmax",
    .description = "symmetric absmax per token (INT8-style), one scale per group",
    .example_spec = "bits=4,group=4",
    .params = absmax_params,
    .nparams = sizeof absmax_params / sizeof absmax_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .plan = absmax_plan,
    .quantize_head = kvq_plan_quantize_head,
    .reference = kvq_plan_reference,
};
