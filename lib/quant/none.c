/* none.c — the exact cache as a spec (SPEC §10): every value kept as it is,
 * 16 bits per element, zero error.  Not a family of the registry (it has no
 * keys to sweep and is no quantizer of the default set): kvq_spec_parse
 * knows it by name, so it goes wherever a spec goes — kvq-analyze -q none,
 * a sweep, a range of mix(...): mix(0=none;1-=kivi:bits=2). */
#include "../internal.h"
#include "quant.h"

#include <string.h>

static kvq_status none_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                            int tensor, int head, kvq_error *err)
{
    (void)sp, (void)ctx, (void)err;
    size_t n = (size_t)in->T * in->D; /* one head's [T][D] */
    memcpy(kvq_head_out(out, in, tensor, head), kvq_head_in(in, tensor, head), n * sizeof(float));
    *kvq_head_bits(out, tensor, head) = 16.0 * (double)n;
    return KVQ_OK;
}

const kvq_quantizer kvq_q_none = {
    .name = "none",
    .description = "the exact cache: every value as it is, 16 bits per element",
    .example_spec = "",
    .nparams = 0,
    .default_spec = "",
    .quantize_head = none_head,
    .reference_head = none_head,
};
