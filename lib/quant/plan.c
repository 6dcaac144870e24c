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
