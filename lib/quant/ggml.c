/* ggml.c — llama.cpp's KV-cache types (docs/quantizers.md#ggml, `-ctk`/`-ctv`): each
 * token's K (and V) row of all heads, head-major (H·D values), goes through
 * ggml's quantize_row_<type>_ref and dequantize_row_<type>, bit for bit
 * (formats/ggml_types.c).  Block types need head_dim to be a multiple of
 * 32, as llama.cpp does (it refuses a block that does not divide
 * n_embd_head), so that a block never spans two heads: each head's blocks
 * go through on their own (quantize_head), the same blocks as the rows'.
 * Bits: block bytes · 8 / 32 per element (8.5, 4.5, 5, 5.5, 6, 4.5; 16 for
 * f16 and bf16). */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <string.h>

typedef struct ggml_opts {
    int type[2]; /* K's and V's: indices into GGML_CACHE_TYPES and cache_type */
} ggml_opts;
#define GGML_CACHE_TYPES "q8_0|q4_0|q4_1|q5_0|q5_1|iq4_nl|f16|bf16"
static const int cache_type[] = {KVQ_GGML_Q8_0, KVQ_GGML_Q4_0, KVQ_GGML_Q4_1, KVQ_GGML_Q5_0,
                                 KVQ_GGML_Q5_1, KVQ_GGML_IQ4_NL, KVQ_GGML_F16, KVQ_GGML_BF16};

static const kvq_param ggml_params[] = {
    {.key = "ktype", .type = KVQ_PARAM_CHOICE, .def = "q8_0", .choices = GGML_CACHE_TYPES,
     .help = "llama.cpp cache type of K (-ctk)", KVQ_OPT(ggml_opts, type[0])},
    {.key = "vtype", .type = KVQ_PARAM_CHOICE, .def = "q8_0", .choices = GGML_CACHE_TYPES,
     .help = "llama.cpp cache type of V (-ctv)", KVQ_OPT(ggml_opts, type[1])},
    KVQ_PARAM_PREROTATE,
};

static kvq_status ggml_check_shape(const kvq_spec *sp, int D, kvq_error *err)
{
    const ggml_opts *o = kvq_spec_opts(sp);
    for (int tensor = 0; tensor < 2; tensor++) {
        int type = cache_type[o->type[tensor]], vals;
        kvq_ggml_type_size(type, &vals, NULL);
        if (D % vals)
            return kvq_fail(err, KVQ_ERR_USAGE,
                            "%s: %s=%s: head_dim %d is not a multiple of the %d-value blocks (llama.cpp refuses "
                            "it: \"block size %d does not divide n_embd_head\"; a block would span heads)",
                            sp->text, tensor ? "vtype" : "ktype", kvq_ggml_type_name(type), D, vals, vals);
    }
    return KVQ_OK;
}

/* One tensor of one head (quantize_head): its [T][D] values are whole
 * blocks one after the other (D is a multiple of the block, so a block
 * never spans heads: the blocks of llama.cpp's head-major token rows),
 * quantized and dequantized CHUNK values at a time through a buffer on the
 * stack.  KVQ_ERR_NUMERIC if a block's fp16 scale overflowed (a
 * non-finite x'). */
static kvq_status ggml_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                            int tensor, int h, kvq_error *err)
{
    enum { CHUNK = 4096 }; /* values a pass: whole blocks of every type */
    const ggml_opts *o = kvq_spec_opts(sp);
    int type = cache_type[o->type[tensor]], vals;
    size_t bytes, n = (size_t)in->T * in->D;
    kvq_ggml_type_size(type, &vals, &bytes); /* D % vals == 0: checked by check_shape */
    uint8_t blk[2 * CHUNK];                  /* at most 2 bytes a value (f16, bf16) */
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h);
    (void)ctx;
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t m = n - i < CHUNK ? n - i : CHUNK;
        kvq_ggml_quantize(type, x + i, blk, m);
        kvq_ggml_dequantize(type, blk, y + i, m);
        if (kvq_first_nonfinite(y + i, m) < m)
            return kvq_fail(err, KVQ_ERR_NUMERIC, "a block's fp16 scale overflows (values too large for %s)",
                            kvq_ggml_type_name(type));
    }
    *kvq_head_bits(out, tensor, h) = (double)bytes * 8.0 / vals * (double)n;
    return KVQ_OK;
}

/* The reference (.reference_head): each block of a head's token in place,
 * through quantize_row_<type>_ref and back, one block at a time. */
static kvq_status ggml_reference_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                      kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    const ggml_opts *o = kvq_spec_opts(sp);
    int type = cache_type[o->type[tensor]], vals, T = in->T, D = in->D;
    size_t bytes;
    kvq_ggml_type_size(type, &vals, &bytes);
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h);
    uint8_t *blk = malloc(bytes);
    if (!blk) return KVQ_ERR_NOMEM;
    for (size_t i = 0; i < (size_t)T * D; i += (size_t)vals) { /* block by block along [T][D] */
        kvq_ggml_quantize_ref(type, x + i, blk, (size_t)vals);
        kvq_ggml_dequantize(type, blk, y + i, (size_t)vals);
        for (int j = 0; j < vals; j++)
            if (!isfinite(y[i + (size_t)j])) {
                free(blk);
                return kvq_fail(err, KVQ_ERR_NUMERIC, "a block's fp16 scale overflows (values too large for %s)",
                                kvq_ggml_type_name(type));
            }
    }
    free(blk);
    (void)ctx;
    *kvq_head_bits(out, tensor, h) = (double)bytes * 8.0 / vals * (double)T * D;
    return KVQ_OK;
}

const kvq_quantizer kvq_q_ggml = {
    .name = "ggml",
    .description = "llama.cpp KV-cache types (-ctk/-ctv), bit-exact ggml quantize_row_*_ref + dequantize",
    .example_spec = "ktype=q4_0,vtype=iq4_nl",
    .params = ggml_params,
    .nparams = sizeof ggml_params / sizeof ggml_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .check_shape = ggml_check_shape,
    .quantize_head = ggml_head,
    .reference_head = ggml_reference_head,
};
