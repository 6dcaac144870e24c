/* run.c — running a spec on one layer: the shape check, the `prerotate`
 * wrapper, the per-head runner that spreads a family's quantize_head over
 * the heads (K and V) in parallel and names the head that failed, and the
 * same through the family's plain reference (for tests); one head of a
 * family that quantizes head by head, for the analysis; and whether one
 * spec's output is another's first stage (kvq_quantizer.first_stage). */
#include "../internal.h"
#include "plan.h"
#include "quant.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* The family's own path (quantize, or quantize_head over the heads). */
static kvq_status quantize_layer_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err);
/* The family's reference (reference, or reference_head over the heads in order). */
static kvq_status reference_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                   kvq_quant_out *out, kvq_error *err);

/* tokens(...): its parts, then kvq_tokens_quantize running each through `run`. */
static kvq_status run_tokens(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                             kvq_error *err, kvq_layer_runner run)
{
    const kvq_tokens_parts *tp;
    kvq_status st = kvq_tokens_parts_of(spec, &tp, err);
    return st ? st : kvq_tokens_quantize(spec, tp, ctx, in, out, err, run);
}

kvq_status kvq_quantize_layer(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err)
{
    if (kvq_spec_is_mix(spec)) { /* the spec of the range that holds this layer */
        kvq_spec sub;
        kvq_status st = kvq_spec_for_layer(spec, ctx->layer, &sub, err);
        return st ? st : kvq_quantize_layer(&sub, ctx, in, out, err);
    }
    kvq_status st = kvq_spec_check_shape(spec, in->D, err);
    if (st) return st;
    if (kvq_spec_is_tokens(spec)) return run_tokens(spec, ctx, in, out, err, kvq_quantize_layer);
    if (kvq_spec_prerotate(spec)) return kvq_prerotate_quantize(spec, ctx, in, out, err, quantize_layer_direct);
    return quantize_layer_direct(spec, ctx, in, out, err);
}

kvq_status kvq_quantize_layer_in(const kvq_resolved_spec *r, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, kvq_error *err)
{
    const kvq_spec *spec = kvq_resolved_spec_at(r, ctx->layer);
    const kvq_tokens_parts *tp = kvq_resolved_spec_parts(r, ctx->layer);
    /* tokens(...): HI and LO run through kvq_quantize_layer, which checks their shape rules */
    return tp ? kvq_tokens_quantize(spec, tp, ctx, in, out, err, kvq_quantize_layer)
              : kvq_quantize_layer(spec, ctx, in, out, err);
}

kvq_status kvq_quantize_layer_reference(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err)
{
    if (kvq_spec_is_mix(spec)) {
        kvq_spec sub;
        kvq_status st = kvq_spec_for_layer(spec, ctx->layer, &sub, err);
        return st ? st : kvq_quantize_layer_reference(&sub, ctx, in, out, err);
    }
    kvq_status st = kvq_spec_check_shape(spec, in->D, err);
    if (st) return st;
    if (kvq_spec_is_tokens(spec)) return run_tokens(spec, ctx, in, out, err, kvq_quantize_layer_reference);
    if (!spec->q->reference && !spec->q->reference_head) return KVQ_ERR_UNSUPPORTED;
    if (kvq_spec_prerotate(spec)) return kvq_prerotate_quantize(spec, ctx, in, out, err, reference_direct);
    return reference_direct(spec, ctx, in, out, err);
}

/* A per-head function over tensor 0 (K) and 1 (V) of every head on nt
 * threads; the first failure in task order (independent of scheduling)
 * becomes the error. */
static kvq_status run_heads(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                            kvq_error *err, int nt,
                            kvq_status (*fn)(const kvq_spec *, const kvq_quant_ctx *, const kvq_layer *,
                                             kvq_quant_out *, int, int, kvq_error *))
{
    int ntask = 2 * in->H;
    kvq_status *sts = calloc((size_t)ntask, sizeof *sts);
    kvq_error *errs = calloc((size_t)ntask, sizeof *errs);
    if (!sts || !errs) {
        free(sts), free(errs);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < ntask; i++) sts[i] = fn(spec, ctx, in, out, i / in->H, i % in->H, &errs[i]);
    kvq_status st = KVQ_OK;
    int bad = 0;
    for (int i = 0; i < ntask && !st; i++) st = sts[i], bad = i;
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "%s", errs[bad].msg);
    free(sts), free(errs);
    const char *tensor = bad / in->H ? "value" : "key";
    if (!st) return KVQ_OK;
    if (msg[0])
        return kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", spec->text, ctx->layer, tensor, bad % in->H, msg);
    if (st == KVQ_ERR_NUMERIC) return kvq_quant_numeric_error(err, spec, ctx, tensor, bad % in->H);
    if (st == KVQ_ERR_NOMEM) return kvq_fail(err, st, "%s: out of memory", spec->text);
    return kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", spec->text, ctx->layer, tensor,
                    bad % in->H, kvq_strerror(st));
}

kvq_status kvq_quant_with_layer_state(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in, void *state,
                                      kvq_quant_ctx *c, kvq_error *err)
{
    if (c != ctx) *c = *ctx;
    if (!spec->q->layer_prepare) return KVQ_OK;
    kvq_status st = spec->q->layer_prepare(spec, ctx, in, state, err);
    if (!st) c->layer_state = state;
    return st;
}

static kvq_status quantize_layer_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err)
{
    if (spec->q->quantize) return spec->q->quantize(spec, ctx, in, out, err);
    _Alignas(double) unsigned char state[KVQ_LAYER_STATE_MAX];
    kvq_quant_ctx c; /* the layer's shared state once for all its heads */
    kvq_status st = kvq_quant_with_layer_state(spec, ctx, in, state, &c, err);
    return st ? st : run_heads(spec, &c, in, out, err, kvq_threads(ctx->nthreads), spec->q->quantize_head);
}

static kvq_status reference_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                   kvq_quant_out *out, kvq_error *err)
{
    if (spec->q->reference) return spec->q->reference(spec, ctx, in, out, err);
    return run_heads(spec, ctx, in, out, err, 1, spec->q->reference_head);
}

int kvq_spec_by_head(const kvq_spec *spec, int T, int D)
{
    if (kvq_spec_is_mix(spec) || kvq_spec_is_tokens(spec) || !spec->q->quantize_head || kvq_spec_prerotate(spec) ||
        (spec->q->couples_heads && spec->q->couples_heads(spec)))
        return 0;
    if (!spec->q->plan) return 1;
    kvq_plan p;
    spec->q->plan(spec, T, D, &p);
    for (int tensor = 0; tensor < 2; tensor++)
        for (int i = 0; i < p.nsteps[tensor]; i++)
            if (p.step[tensor][i].kind == KVQ_STEP_TOKEN_LAYER) return 0;
    return 1;
}

kvq_status kvq_quantize_one_head(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    if (!spec->q->layer_prepare || ctx->layer_state) return spec->q->quantize_head(spec, ctx, in, out, tensor, h, err);
    _Alignas(double) unsigned char state[KVQ_LAYER_STATE_MAX]; /* the caller has none: for this head */
    kvq_quant_ctx c;
    kvq_status st = kvq_quant_with_layer_state(spec, ctx, in, state, &c, err);
    return st ? st : spec->q->quantize_head(spec, &c, in, out, tensor, h, err);
}

/* ------------------------------------------------------ first stages */

int kvq_spec_is_first_stage(const kvq_spec *spec, const kvq_spec *cand)
{
    char want[KVQ_SPEC_MAX], have[KVQ_SPEC_MAX];
    kvq_spec stage;
    kvq_error err = {0};
    if (!spec->q->first_stage || !spec->q->first_stage(spec, want, sizeof want) || kvq_spec_parse(want, &stage, &err) ||
        stage.q != cand->q)
        return 0;
    kvq_spec_format_full(&stage, want, sizeof want);
    kvq_spec_format_full(cand, have, sizeof have);
    return !strcmp(want, have);
}
