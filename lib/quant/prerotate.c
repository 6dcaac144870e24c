/* prerotate.c — QuaRot-style pre-rotation for any quantizer that declares
 * the `prerotate` key (docs/building-blocks.md#rotations): each token's head vector is rotated,
 * y = Π·x, the quantizer runs on the rotated layer, and x' = Πᵀ·y'.
 * Queries rotated by the same Π give the same scores, so this is what an
 * inference engine with rotated heads stores.  Π is fixed per (layer, head,
 * K/V) by the seed (the same streams as lloydmax's rotation); the bits are
 * the quantizer's, and Π is static: D·D·4 bytes (qr) or D sign bits
 * (hadamard) per head and tensor.  One wrapper, run by kvq_quantize_layer,
 * so a family gets the option from one line in its parameter table. */
#include "../internal.h"
#include "quant.h"

#include <string.h>

int kvq_spec_prerotate(const kvq_spec *spec)
{
    int k = kvq_spec_param_index(spec->q, "prerotate");
    return k < 0 ? KVQ_ROT_NONE : (int)spec->val[k]; /* choices none|hadamard|qr */
}

static kvq_rotate_kind rotation_kind(int choice)
{
    return choice == 1 ? KVQ_ROT_HADAMARD : choice == 2 ? KVQ_ROT_QR : KVQ_ROT_NONE;
}

/* Rotates (inverse = 0) or rotates back (1) every head of K and V from
 * src to dst, [H][T][D] each; adds the rotations' bytes to static_bytes. */
static kvq_status rotate_layer(const kvq_spec *sp, const kvq_quant_ctx *ctx, int H, int T, int D,
                               const float *const src[2], float *const dst[2], int inverse,
                               double *static_bytes, kvq_error *err)
{
    kvq_rotate_kind kind = rotation_kind(kvq_spec_prerotate(sp));
    int nt = kvq_threads(ctx->nthreads), ntask = 2 * H;
    kvq_status *sts = calloc((size_t)ntask, sizeof *sts);
    kvq_error *errs = calloc((size_t)ntask, sizeof *errs);
    double *bytes = calloc((size_t)ntask, sizeof *bytes);
    if (!sts || !errs || !bytes) {
        free(sts), free(errs), free(bytes);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < ntask; i++) {
        int tensor = i / H, h = i % H;
        size_t off = (size_t)h * T * D;
        kvq_rotation r;
        sts[i] = kvq_rotation_init(&r, kind, D, ctx->seed, ctx->layer, h, tensor, &errs[i]);
        if (sts[i]) continue;
        sts[i] = kvq_rotation_apply(&r, src[tensor] + off, dst[tensor] + off, (size_t)T, inverse, &errs[i]);
        bytes[i] = kvq_rotation_bytes(&r);
        kvq_rotation_free(&r);
    }
    kvq_status st = KVQ_OK;
    for (int i = 0; i < ntask && !st; i++)
        if ((st = sts[i])) kvq_fail(err, st, "%s: %s", sp->text, errs[i].msg);
    if (!st && static_bytes)
        for (int i = 0; i < ntask; i++) static_bytes[i % H] += bytes[i];
    free(sts), free(errs), free(bytes);
    return st;
}

kvq_status kvq_prerotate_quantize(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, kvq_error *err,
                                  kvq_status (*run)(const kvq_spec *, const kvq_quant_ctx *, const kvq_layer *,
                                                    kvq_quant_out *, kvq_error *))
{
    int H = in->H, T = in->T, D = in->D;
    size_t n = (size_t)H * T * D;
    kvq_layer rot = *in; /* the rotated K and V; the rest shared */
    rot.key = kvq_alloc_array(n, sizeof(float));
    rot.value = kvq_alloc_array(n, sizeof(float));
    kvq_status st = rot.key && rot.value ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    const float *x[2] = {in->key, in->value};
    float *y[2] = {rot.key, rot.value}, *xq[2] = {out->key, out->value};
    if (!st) st = rotate_layer(sp, ctx, H, T, D, x, y, 0, NULL, err);
    if (!st) {
        /* the quantizer's fused error sums would be in the rotated space:
         * the driver computes them from x' instead */
        kvq_quant_out o = *out;
        o.recon = NULL, o.recon_done = NULL;
        st = run(sp, ctx, &rot, &o, err);
    }
    if (!st) { /* x' = Πᵀ·y': y' moves to the (no longer needed) rotated inputs, then back */
        memcpy(rot.key, out->key, n * sizeof(float));
        memcpy(rot.value, out->value, n * sizeof(float));
        const float *yq[2] = {rot.key, rot.value};
        st = rotate_layer(sp, ctx, H, T, D, yq, xq, 1, out->static_bytes, err); /* Π's bytes after the family's own */
    }
    free(rot.key), free(rot.value);
    return st;
}
