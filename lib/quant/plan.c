/* plan.c — the uniform families as plans (kvq.h, kvq_plan): the CPU
 * executor.  A plan quantizer (per-token, per-channel, kivi, kcvt, absmax)
 * only says which U/A step covers which tokens; this file runs the steps
 * with uniform.c's helpers, kernels/ runs the same steps on a GPU, and both
 * take their bits from kvq_step_bits (step_bits.c). */
#include "../internal.h"
#include "quant.h"

/* One per-head step on x, y [T][D]; adds its bits. */
static kvq_status run_step(const kvq_step *s, const float *x, float *y, int T, int D,
                           double *bits, kvq_recon_acc *recon)
{
    double b = 0;
    kvq_status st = KVQ_OK;
    switch (s->kind) {
    case KVQ_STEP_EXACT:
        b = kvq_keep_exact(x, y, T, D, s->t0, s->t1, recon);
        break;
    case KVQ_STEP_TOKEN:
        st = kvq_quant_head_per_token(x, y, T, D, s->t0, s->t1, s->bits, s->group, s->prec, &b, recon);
        break;
    case KVQ_STEP_CHANNEL:
        st = kvq_quant_head_per_channel(x, y, T, D, s->t0, s->t1, s->bits, s->group, s->prec, &b, recon);
        break;
    case KVQ_STEP_ABSMAX:
        st = kvq_quant_head_absmax(x, y, T, D, s->t0, s->t1, s->bits, s->group, s->prec, &b, recon);
        break;
    case KVQ_STEP_TOKEN_LAYER:
        st = KVQ_ERR_INTERNAL; /* not a per-head step */
        break;
    }
    *bits += b;
    return st;
}

kvq_status kvq_plan_quantize_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    (void)ctx, (void)err;
    kvq_plan p;
    sp->q->plan(sp, in->T, in->D, &p);
    const kvq_step *steps = p.step[tensor];
    int n = p.nsteps[tensor], layer_wide = 0;
    for (int i = 0; i < n; i++) layer_wide |= steps[i].kind == KVQ_STEP_TOKEN_LAYER;
    if (!layer_wide) {
        double *bits = kvq_head_bits(out, tensor, h);
        kvq_recon_acc *recon = kvq_head_recon(out, in, tensor, h);
        *bits = 0;
        for (int i = 0; i < n; i++) {
            kvq_status st = run_step(&steps[i], kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h),
                                     in->T, in->D, bits, recon);
            if (st) return st;
        }
        return KVQ_OK;
    }
    /* a step couples the heads of a token: head 0's task runs the tensor */
    if (h != 0) return KVQ_OK;
    int H = in->H, T = in->T, D = in->D;
    const float *x = tensor ? in->value : in->key;
    float *y = tensor ? out->value : out->key;
    double *bits = tensor ? out->v_bits : out->k_bits;
    for (int hh = 0; hh < H; hh++) bits[hh] = 0;
    for (int i = 0; i < n; i++) {
        const kvq_step *s = &steps[i];
        kvq_status st = KVQ_OK;
        if (s->kind == KVQ_STEP_TOKEN_LAYER) {
            st = kvq_quant_layer_per_token_span(x, y, H, T, D, s->t0, s->t1, s->bits, s->group, s->prec, NULL);
            for (int hh = 0; hh < H && !st; hh++) bits[hh] += kvq_step_bits(s, H, D, hh);
        } else {
            for (int hh = 0; hh < H && !st; hh++) {
                size_t off = (size_t)hh * T * D;
                st = run_step(s, x + off, y + off, T, D, &bits[hh], NULL);
            }
        }
        if (st) return st;
    }
    return KVQ_OK;
}

/* ------------------------------------------------------------ the reference */

/* One group of a step through the reference definition (uniform.c): U, or
 * A for absmax steps; n values x[i·stride] into y[i·stride]. */
static kvq_status ref_group(const kvq_step *s, const float *x, float *y, size_t n, size_t stride)
{
    return s->kind == KVQ_STEP_ABSMAX ? kvq_absmax_quantize_ref(x, y, n, stride, s->bits, s->prec)
                                      : kvq_group_quantize_ref(x, y, n, stride, s->bits, s->prec);
}

kvq_status kvq_step_reference(const kvq_step *s, const float *x, float *y, int H, int T, int D, float *row, int *bad)
{
    size_t W = (size_t)H * D;
    for (int h = 0; h < H; h++) {
        *bad = h;
        const float *xh = x + (size_t)h * T * D;
        float *yh = y + (size_t)h * T * D;
        kvq_status st = KVQ_OK;
        switch (s->kind) {
        case KVQ_STEP_EXACT: /* the dump's values */
            for (size_t i = (size_t)s->t0 * D; i < (size_t)s->t1 * D; i++) yh[i] = xh[i];
            break;
        case KVQ_STEP_TOKEN:
        case KVQ_STEP_ABSMAX: { /* each token: groups of G consecutive channels, the last one shorter */
            int G = s->group == 0 || s->group > D ? D : s->group; /* per-token groups are >= 1 */
            for (int t = s->t0; t < s->t1 && !st; t++)
                for (int c0 = 0; c0 < D && !st; c0 += G)
                    st = ref_group(s, xh + (size_t)t * D + c0, yh + (size_t)t * D + c0,
                                   (size_t)(D - c0 < G ? D - c0 : G), 1);
            break;
        }
        case KVQ_STEP_CHANNEL: /* each channel: groups of `group` tokens from t0, the last one shorter */
            for (int c = 0; c < D && !st; c++)
                for (int g0 = s->t0; g0 < s->t1 && !st; g0 += s->group)
                    st = ref_group(s, xh + (size_t)g0 * D + c, yh + (size_t)g0 * D + c,
                                   (size_t)(s->t1 - g0 < s->group ? s->t1 - g0 : s->group), (size_t)D);
            break;
        case KVQ_STEP_TOKEN_LAYER: /* each token: its H head vectors one after another */
            if (h) break;          /* all heads at once */
            for (int t = s->t0; t < s->t1 && !st; t++) {
                size_t G = (size_t)s->group > W ? W : (size_t)s->group;
                for (int hh = 0; hh < H; hh++)
                    for (int c = 0; c < D; c++) row[(size_t)hh * D + c] = x[((size_t)hh * T + t) * D + c];
                for (size_t c0 = 0; c0 < W && !st; c0 += G)
                    st = ref_group(s, row + c0, row + c0, W - c0 < G ? W - c0 : G, 1);
                for (int hh = 0; hh < H; hh++)
                    for (int c = 0; c < D; c++) y[((size_t)hh * T + t) * D + c] = row[(size_t)hh * D + c];
            }
            break;
        }
        if (st) return st;
    }
    return KVQ_OK;
}

kvq_status kvq_plan_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D;
    kvq_plan p;
    sp->q->plan(sp, T, D, &p);
    float *row = malloc((size_t)H * D * sizeof *row);
    if (!row) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    kvq_status st = KVQ_OK;
    int bad = 0, tensor = 0;
    for (tensor = 0; tensor < 2 && !st; tensor++) {
        const float *x = tensor ? in->value : in->key;
        float *y = tensor ? out->value : out->key;
        for (int i = 0; i < p.nsteps[tensor] && !st; i++) st = kvq_step_reference(&p.step[tensor][i], x, y, H, T, D, row, &bad);
        for (int h = 0; h < H; h++) *kvq_head_bits(out, tensor, h) = kvq_plan_bits(&p, tensor, H, D, h);
    }
    free(row);
    if (st == KVQ_ERR_NUMERIC) return kvq_quant_numeric_error(err, sp, ctx, tensor - 1 ? "value" : "key", bad);
    return st ? kvq_fail(err, st, "%s: %s", sp->text, kvq_strerror(st)) : KVQ_OK;
}
