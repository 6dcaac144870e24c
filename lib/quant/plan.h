/* plan.h — the uniform families as plans of steps (docs/building-blocks.md (U)): the one
 * definition the CPU executor (plan.c) and the CUDA kernels (kernels/) run.
 * Part of the quantizer-author API (quant.h includes it). */
#ifndef KVQ_QUANT_PLAN_H
#define KVQ_QUANT_PLAN_H

#include "../internal.h"

/* How a group's scale (and zero) is stored: fp16 (rounded, as stored) or fp32. */
typedef enum kvq_scale_prec { KVQ_SCALE_FP16 = 0, KVQ_SCALE_FP32 = 1 } kvq_scale_prec;

#ifdef __cplusplus
extern "C" {
#endif

/* A quantizer of the uniform families written as steps over token ranges
 * (a "plan"): the definition both the CPU (kvq_plan_quantize_head) and the
 * CUDA kernels execute, so the two paths cannot drift apart.  Each tensor's
 * steps cover tokens [0, T) in order, without overlap. */
typedef enum kvq_step_kind {
    KVQ_STEP_EXACT,       /* kept at the dump's values, 16 bits per element */
    KVQ_STEP_TOKEN,       /* U per token: groups of `group` channels of one head (clamped to D) */
    KVQ_STEP_TOKEN_LAYER, /* U per token along all heads, head-major (group clamped to H·D) */
    KVQ_STEP_CHANNEL,     /* U per channel: groups of `group` tokens from t0 */
    KVQ_STEP_ABSMAX       /* A per token: groups of `group` channels (clamped to D) */
} kvq_step_kind;

typedef struct kvq_step {
    kvq_step_kind kind;
    int t0, t1; /* tokens [t0, t1) */
    int bits, group;
    kvq_scale_prec prec;
} kvq_step;

#define KVQ_PLAN_MAX_STEPS 2
typedef struct kvq_plan {
    int nsteps[2];                          /* [tensor]: 0 = K, 1 = V */
    kvq_step step[2][KVQ_PLAN_MAX_STEPS];
} kvq_plan;

/* Stored bits of one step for head h of an [H][T][D] tensor: codes, scales
 * and zeros (a TOKEN_LAYER group's scale/zero shared in proportion to the
 * elements each head holds in it), 16 per exact element. */
double kvq_step_bits(const kvq_step *s, int H, int D, int h);
/* Σ of kvq_step_bits over the steps of one tensor (0 = K, 1 = V). */
double kvq_plan_bits(const kvq_plan *p, int tensor, int H, int D, int h);

#ifdef __cplusplus
}
#endif

#endif
