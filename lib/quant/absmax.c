/* absmax.c — symmetric absmax quantization per token (docs/building-blocks.md (A)), the INT8
 * KV-cache baseline: one scale per group of `group` channels of a head
 * (group 0 = the whole head vector). */
#include "../internal.h"
#include "quant.h"

enum { AM_BITS, AM_GROUP, AM_SCALE };
static const kvq_param absmax_params[] = {
    [AM_BITS] =
        {.key = "bits", .type = KVQ_PARAM_INT, .def = "8", .min = 2, .max = 16, .help = "bits per code (signed)"},
    [AM_GROUP] = {.key = "group",
                  .type = KVQ_PARAM_INT,
                  .def = "0",
                  .min = 0,
                  .max = 1e9,
                  .help = "channels per group (0 = whole head vector)"},
    [AM_SCALE] = {.key = "scale",
                  .type = KVQ_PARAM_CHOICE,
                  .def = "fp16",
                  .choices = "fp16|fp32",
                  .help = "precision of scales"},
    KVQ_PARAM_PREROTATE,
};

static void absmax_plan(const kvq_spec *sp, int T, int D, kvq_plan *p)
{
    (void)D;
    kvq_step st = {KVQ_STEP_ABSMAX, 0, T, (int)sp->val[AM_BITS], (int)sp->val[AM_GROUP],
                   (kvq_scale_prec)sp->val[AM_SCALE]};
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
