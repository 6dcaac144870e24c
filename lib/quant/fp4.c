/* fp4.c — the `fp4` family (docs/quantizers.md#fp4): the FP4 micro-scaled KV-cache
 * formats MXFP4 (OCP, ggml `mxfp4`: blocks of 32, E8M0 scales) and NVFP4
 * (NVIDIA: blocks of 16, unsigned E4M3 scales, and optionally the
 * second-level float32 scale g of TensorRT-LLM and vLLM, per tensor, head
 * or token).  Blocks run along each token's head vector and never span
 * heads, so head_dim must be a multiple of the block (llama.cpp's rule for
 * its cache types).  With global=none the codes and values are ggml's
 * quantize_row_*_ref + dequantize_row_* bit for bit (formats/fp4.c); with
 * a second-level scale the block scales round as E4M3 does (nearest even;
 * ggml's encoder stores every scale in [256, 448) as 448, which is where
 * the two-level scheme puts the largest blocks).
 *
 * Bits per element: 4 + 8/32 = 4.25 (mxfp4), 4 + 8/16 = 4.5 (nvfp4), plus
 * 32 per g: 32/H per head for global=tensor, 32 per head, 32 per token. */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <string.h>

/* The options, as the table below fills them (kvq_spec_opts). */
enum { FMT_MXFP4, FMT_NVFP4 };             /* format's choices */
enum { G_NONE, G_TENSOR, G_HEAD, G_TOKEN }; /* global's choices */
typedef struct fp4_opts {
    int format, global;
} fp4_opts;

static const kvq_param fp4_params[] = {
    {.key = "format", .type = KVQ_PARAM_CHOICE, .def = "mxfp4", .choices = "mxfp4|nvfp4",
     .help = "mxfp4: 32-value blocks, E8M0 scales; nvfp4: 16-value blocks, E4M3 scales", KVQ_OPT(fp4_opts, format)},
    {.key = "global", .type = KVQ_PARAM_CHOICE, .def = "none", .choices = "none|tensor|head|token",
     .help = "nvfp4's second-level float32 scale amax/(6*448) per layer tensor, KV head or token "
             "(none: 1, ggml's nvfp4)",
     KVQ_OPT(fp4_opts, global)},
    KVQ_PARAM_PREROTATE,
};

static int fp4_block(const fp4_opts *o) { return o->format == FMT_MXFP4 ? KVQ_MXFP4_BLOCK : KVQ_NVFP4_BLOCK; }

static kvq_status fp4_check(const kvq_spec *sp, kvq_error *err)
{
    const fp4_opts *o = kvq_spec_opts(sp);
    if (o->format == FMT_MXFP4 && o->global != G_NONE)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: global: a second-level scale is nvfp4's (mxfp4's E8M0 scales need "
                        "none); use format=nvfp4 or global=none", sp->text);
    return KVQ_OK;
}

static kvq_status fp4_check_shape(const kvq_spec *sp, int D, kvq_error *err)
{
    int B = fp4_block(kvq_spec_opts(sp));
    if (D % B)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: head_dim %d is not a multiple of the %d-value blocks (blocks never "
                        "span heads; llama.cpp refuses such a cache)", sp->text, D, B);
    return KVQ_OK;
}

/* nvfp4's second-level scale: amax/(6·448) in float32, as fp8's scales. */
static float global_scale(float amax) { return kvq_max_scale(amax, 6.0f * 448.0f); }

/* One row of D values (D a multiple of the block) through the format and
 * back, with second-level scale g (nvfp4; rne: E4M3 rounding of the block
 * scales, see formats/fp4.c). */
static void fp4_row(const float *x, float *y, int D, int format, float g, int rne)
{
    if (format == FMT_MXFP4)
        for (int b = 0; b < D; b += KVQ_MXFP4_BLOCK)
            kvq_fp4_round(x + b, y + b, KVQ_MXFP4_BLOCK, kvq_mxfp4_block_scale(x + b));
    else
        for (int b = 0; b < D; b += KVQ_NVFP4_BLOCK)
            kvq_fp4_round(x + b, y + b, KVQ_NVFP4_BLOCK, kvq_nvfp4_block_scale(x + b, g, rne));
}

/* One head [T][D]; tensor_g: the layer tensor's g (global=tensor).  Values
 * stay finite: a code whose value would overflow has an infinite error and
 * is never the nearest. */
static void fp4_head(const float *x, float *y, int H, int T, int D, int format, int global, float tensor_g,
                     double *bits)
{
    size_t n = (size_t)T * D;
    double per_elem = format == FMT_MXFP4 ? 4.0 + 8.0 / KVQ_MXFP4_BLOCK : 4.0 + 8.0 / KVQ_NVFP4_BLOCK;
    float g = global == G_TENSOR ? tensor_g : global == G_HEAD ? global_scale(kvq_absmax(x, n)) : 1.0f;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * D;
        fp4_row(xt, y + (size_t)t * D, D, format, global == G_TOKEN ? global_scale(kvq_absmax(xt, (size_t)D)) : g,
                global != G_NONE);
    }
    double g_bits = global == G_TENSOR ? 32.0 / H : global == G_HEAD ? 32.0 : global == G_TOKEN ? 32.0 * T : 0.0;
    *bits = per_elem * (double)n + g_bits;
}

/* The layer's part (.layer_prepare): global=tensor's g of K and of V
 * (float[2]; 1 for the other choices), after the shape check. */
static kvq_status fp4_prepare(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, void *state,
                              kvq_error *err)
{
    const fp4_opts *o = kvq_spec_opts(sp);
    float *g = state, amax[2];
    g[0] = g[1] = 1.0f;
    kvq_status st = fp4_check_shape(sp, in->D, err);
    if (st) return st;
    if (o->global != G_TENSOR) return KVQ_OK;
    if (kvq_layer_absmax(in, kvq_threads(ctx->nthreads), amax))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    g[0] = global_scale(amax[0]), g[1] = global_scale(amax[1]);
    return KVQ_OK;
}

static kvq_status fp4_quantize_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                    kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    (void)err;
    const fp4_opts *o = kvq_spec_opts(sp);
    const float *g = ctx->layer_state;
    fp4_head(kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h), in->H, in->T, in->D, o->format, o->global,
             g[tensor], kvq_head_bits(out, tensor, h));
    return KVQ_OK;
}

/* The reference (.reference): every block through ggml's encoder and
 * decoder (kvq_mxfp4_block_ref / kvq_nvfp4_block_ref and their
 * _dequantize: the codes and scales a cache would hold), the second-level
 * scale of the block's tensor, head or token found by a plain scan. */
static kvq_status fp4_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                kvq_quant_out *out, kvq_error *err)
{
    (void)ctx;
    const fp4_opts *o = kvq_spec_opts(sp);
    int H = in->H, T = in->T, D = in->D;
    kvq_status st = fp4_check_shape(sp, D, err);
    if (st) return st;
    for (int tensor = 0; tensor < 2; tensor++) {
        const float *x = tensor ? in->value : in->key; /* [H][T][D] */
        float *y = tensor ? out->value : out->key;
        float tensor_amax = kvq_absmax(x, (size_t)H * T * D);
        for (int h = 0; h < H; h++) {
            const float *xh = x + (size_t)h * T * D;
            float *yh = y + (size_t)h * T * D;
            float head_amax = kvq_absmax(xh, (size_t)T * D);
            for (int t = 0; t < T; t++) {
                const float *xt = xh + (size_t)t * D;
                float *yt = yh + (size_t)t * D;
                float g = o->global == G_TENSOR ? global_scale(tensor_amax)
                          : o->global == G_HEAD ? global_scale(head_amax)
                          : o->global == G_TOKEN ? global_scale(kvq_absmax(xt, (size_t)D))
                                                 : 1.0f;
                for (int b = 0; b < D; b += fp4_block(o)) {
                    if (o->format == FMT_MXFP4) {
                        uint8_t blk[17];
                        kvq_mxfp4_block_ref(xt + b, blk);
                        kvq_mxfp4_block_dequantize(blk, yt + b);
                    } else {
                        uint8_t scale, qs[KVQ_NVFP4_BLOCK / 2];
                        kvq_nvfp4_block_ref(xt + b, g, o->global != G_NONE, &scale, qs);
                        kvq_nvfp4_block_dequantize(scale, qs, g, yt + b);
                    }
                }
            }
            /* 4 bits a value and an 8-bit scale a block, plus the float32 second-level scales */
            double per_elem = 4.0 + 8.0 / fp4_block(o);
            double g_bits = o->global == G_TENSOR ? 32.0 / H : o->global == G_HEAD ? 32.0
                            : o->global == G_TOKEN ? 32.0 * T : 0.0;
            *kvq_head_bits(out, tensor, h) = per_elem * ((double)T * D) + g_bits;
        }
    }
    return KVQ_OK;
}

const kvq_quantizer kvq_q_fp4 = {
    .name = "fp4",
    .description = "FP4 micro-scaled formats MXFP4 / NVFP4 (E2M1 + block scales), bit-exact ggml",
    .example_spec = "format=nvfp4,global=tensor",
    .params = fp4_params,
    .nparams = sizeof fp4_params / sizeof fp4_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .check = fp4_check,
    .check_shape = fp4_check_shape,
    .quantize_head = fp4_quantize_head,
    .layer_prepare = fp4_prepare,
    .reference = fp4_reference,
};
