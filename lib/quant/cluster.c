/* cluster.c — clustered residual quantization (docs/quantizers.md#cluster, Watanabe
 * & Taura).  Calibration: per layer, KV head and K/V, k-means centres of the
 * --calib dump's keys (pre-RoPE when it has them) and values.  Keys: the
 * nearest centre to the pre-RoPE key, put back at position t by RoPE, is the
 * base; the residuals are quantized per channel (U, groups of `group`
 * tokens).  Values: nearest centre + a Lloyd–Max coded residual (fp16 norm,
 * rotation, sphere codebook).  The last `window` tokens stay exact.
 * Bits per token: ceil(log2 centroids) for each of K and V, residual codes,
 * K scales/zeros, 16 for the V norm; centres, codebook and rotation are
 * static bytes. */
#include "../internal.h"
#include "quant.h"

#include <string.h>

typedef struct cluster_opts {
    int centroids, kbits, vbits, group, window;
    int rotate; /* kvq_rotate_kind, in the choices' order */
} cluster_opts;
static const kvq_param cluster_params[] = {
    {.key = "centroids", .type = KVQ_PARAM_INT, .def = "16", .min = 1, .max = 65536,
     .help = "k-means centres per layer, KV head and K/V", KVQ_OPT(cluster_opts, centroids)},
    {.key = "kbits", .type = KVQ_PARAM_INT, .def = "2", .min = 1, .max = 16,
     .help = "key residual bits (U per channel)", KVQ_OPT(cluster_opts, kbits)},
    {.key = "vbits", .type = KVQ_PARAM_INT, .def = "2", .min = 1, .max = KVQ_CODEBOOK_MAX_BITS,
     .help = "value residual bits (Lloyd-Max, sphere codebook)", KVQ_OPT(cluster_opts, vbits)},
    {.key = "group", .type = KVQ_PARAM_INT, .def = "32", .min = 1, .max = 1e9,
     .help = "tokens per key residual group", KVQ_OPT(cluster_opts, group)},
    {.key = "window", .type = KVQ_PARAM_INT, .def = "32", .min = 0, .max = 1e9,
     .help = "last tokens kept exact", KVQ_OPT(cluster_opts, window)},
    {.key = "rotate", .type = KVQ_PARAM_CHOICE, .def = "qr", .choices = "none|qr|hadamard",
     .help = "rotation of the value residuals", KVQ_OPT(cluster_opts, rotate)},
};

typedef struct {
    int H, C, D;
    int pre_rope; /* key centres are pre-RoPE */
    float *kc;    /* [H][C][D] */
    float *vc;    /* [H][C][D] */
} cluster_state;

static void cluster_free(void *p)
{
    cluster_state *s = p;
    if (!s) return;
    free(s->kc), free(s->vc), free(s);
}

static int cluster_calib_key(const kvq_spec *sp, char *buf, size_t len)
{
    const cluster_opts *o = kvq_spec_opts(sp);
    snprintf(buf, len, "centroids=%d", o->centroids);
    return 1;
}

static kvq_status cluster_calibrate(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *cal,
                                    void **state, kvq_error *err)
{
    const cluster_opts *o = kvq_spec_opts(sp);
    int H = cal->H, T = cal->T, D = cal->D, C = o->centroids;
    cluster_state *s = calloc(1, sizeof *s);
    size_t per = (size_t)C * D;
    if (!s || !(s->kc = kvq_alloc_array((size_t)H, per * sizeof(float))) ||
        !(s->vc = kvq_alloc_array((size_t)H, per * sizeof(float)))) {
        cluster_free(s);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %d x %d centres", H, C);
    }
    s->H = H, s->C = C, s->D = D, s->pre_rope = cal->key_pre_rope != NULL;
    const float *keys = s->pre_rope ? cal->key_pre_rope : cal->key;
    kvq_status *sts = calloc((size_t)2 * H, sizeof *sts);
    kvq_error *errs = calloc((size_t)2 * H, sizeof *errs);
    kvq_status st = sts && errs ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    int nt = kvq_threads(ctx->nthreads);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int task = 0; task < 2 * H; task++) {
        if (st) continue;
        int h = task / 2, tensor = task % 2;
        kvq_rng rng;
        kvq_rng_init(&rng, ctx->seed, (uint64_t)ctx->layer, (uint64_t)h, kvq_family_stream(sp->q, (uint64_t)tensor));
        const float *x = (tensor ? cal->value : keys) + (size_t)h * T * D;
        float *centres = (tensor ? s->vc : s->kc) + (size_t)h * per;
        sts[task] = kvq_kmeans(x, (size_t)T, D, C, 100, &rng, centres, NULL, NULL, NULL, &errs[task]);
    }
    for (int task = 0; task < 2 * H && !st; task++)
        if (sts[task])
            st = kvq_fail(err, sts[task], "%s head %d: %s", task % 2 ? "value" : "key", task / 2, errs[task].msg);
    free(sts), free(errs);
    if (st) {
        cluster_free(s);
        return st;
    }
    *state = s;
    return KVQ_OK;
}

static int index_bits(int C)
{
    int b = 0;
    while ((1L << b) < C) b++;
    return b; /* ceil(log2 C) */
}

/* Keys of head h: base = RoPE_t(nearest centre of the pre-RoPE key),
 * residual quantized per channel over the tokens before the window (with
 * reference, group by group through kvq_step_reference). */
static kvq_status cluster_keys(const kvq_spec *sp, const kvq_quant_ctx *ctx, const cluster_state *s,
                               const kvq_layer *in, kvq_quant_out *out, int h, int reference, kvq_error *err)
{
    const cluster_opts *o = kvq_spec_opts(sp);
    int T = in->T, D = in->D, C = s->C, window = o->window;
    int Tq = T - window > 0 ? T - window : 0;
    const float *k = kvq_head_in(in, 0, h);
    float *y = kvq_head_out(out, in, 0, h);
    if (s->pre_rope && !ctx->rope)
        return kvq_fail(err, KVQ_ERR_FORMAT, "the calibration keys are pre-RoPE, so the key centres need RoPE: "
                        "expected rope_style and rope_theta (or /rope_cos, /rope_sin) in the dump");
    size_t n = (size_t)T * D;
    float *pre = kvq_alloc_array(n, sizeof *pre), *base = kvq_alloc_array(n, sizeof *base);
    float *r = kvq_alloc_array(n, sizeof *r), *rq = kvq_alloc_array(n, sizeof *rq);
    int *as = kvq_alloc_array((size_t)T, sizeof *as);
    kvq_status st = KVQ_OK;
    double qbits = 0.0;
    if (!pre || !base || !r || !rq || !as) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto out;
    }
    /* the pre-RoPE key: from the dump, or the post-RoPE key turned back */
    if (!s->pre_rope) {
        memcpy(pre, k, n * sizeof *pre);
    } else if (in->key_pre_rope) {
        memcpy(pre, in->key_pre_rope + (size_t)h * n, n * sizeof *pre);
    } else {
        memcpy(pre, k, n * sizeof *pre);
        for (int t = 0; t < T; t++) kvq_rope_rotate(ctx->rope, pre + (size_t)t * D, kvq_token_pos(ctx, in, h, t), 1);
    }
    if (Tq > 0 && (st = kvq_kmeans_assign(pre, (size_t)Tq, D, s->kc + (size_t)h * C * D, C, as, err))) goto out;
    for (int t = 0; t < Tq; t++) {
        float *bt = base + (size_t)t * D;
        memcpy(bt, s->kc + ((size_t)h * C + as[t]) * D, (size_t)D * sizeof *bt);
        if (s->pre_rope) kvq_rope_rotate(ctx->rope, bt, kvq_token_pos(ctx, in, h, t), 0); /* base = RoPE_t(c) */
        for (int c = 0; c < D; c++) r[(size_t)t * D + c] = k[(size_t)t * D + c] - bt[c];
    }
    if (reference) {
        kvq_step step = {KVQ_STEP_CHANNEL, 0, Tq, o->kbits, o->group, KVQ_SCALE_FP16};
        int bad;
        st = kvq_step_reference(&step, r, rq, 1, T, D, NULL, &bad);
        qbits = kvq_step_bits(&step, 1, D, 0);
    } else {
        st = kvq_quant_head_per_channel(r, rq, T, D, 0, Tq, o->kbits, o->group, KVQ_SCALE_FP16, &qbits, NULL);
    }
    if (st) goto out;
    for (size_t i = 0; i < (size_t)Tq * D; i++) y[i] = base[i] + rq[i]; /* k' = base + Q(r) */
    *kvq_head_bits(out, 0, h) = qbits + (double)Tq * index_bits(C) + kvq_keep_exact(k, y, T, D, Tq, T, NULL);
out:
    free(pre), free(base), free(r), free(rq), free(as);
    return st;
}

/* Values of head h: nearest centre + Lloyd–Max coded residual (with
 * reference, the nearest levels by the codebook's search). */
static kvq_status cluster_values(const kvq_spec *sp, const kvq_quant_ctx *ctx, const cluster_state *s,
                                 const kvq_layer *in, kvq_quant_out *out, int h, int reference, kvq_error *err)
{
    const cluster_opts *o = kvq_spec_opts(sp);
    int T = in->T, D = in->D, C = s->C, window = o->window, vbits = o->vbits;
    int Tq = T - window > 0 ? T - window : 0;
    const float *v = kvq_head_in(in, 1, h);
    float *y = kvq_head_out(out, in, 1, h);
    const float *vc = s->vc + (size_t)h * C * D;
    const kvq_codebook *cb;
    kvq_rotation rot;
    kvq_status st = kvq_codebook_get(KVQ_CB_SPHERE, D, vbits, &cb, err);
    if (st) return st;
    if ((st = kvq_rotation_init(&rot, (kvq_rotate_kind)o->rotate, D, ctx->seed, ctx->layer, h, 1, err)))
        return st;
    size_t n = (size_t)T * D;
    float *r = kvq_alloc_array(n, sizeof *r), *rq = kvq_alloc_array(n, sizeof *rq);
    float *work = kvq_alloc_array(n, sizeof *work), *norm = kvq_alloc_array((size_t)T, sizeof *norm);
    int *as = kvq_alloc_array((size_t)T, sizeof *as);
    if (!r || !rq || !work || !norm || !as) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto out;
    }
    if (Tq > 0) {
        if ((st = kvq_kmeans_assign(v, (size_t)Tq, D, vc, C, as, err))) goto out;
        for (int t = 0; t < Tq; t++)
            for (int c = 0; c < D; c++) r[(size_t)t * D + c] = v[(size_t)t * D + c] - vc[(size_t)as[t] * D + c];
        if ((st = kvq_lloydmax_rows(r, rq, Tq, D, &rot, cb, reference ? kvq_lloydmax_snap_ref : kvq_lloydmax_snap,
                                     work, norm, err)))
            goto out;
        for (int t = 0; t < Tq; t++) /* v' = c + n·Πᵀ·û */
            for (int c = 0; c < D; c++) y[(size_t)t * D + c] = vc[(size_t)as[t] * D + c] + rq[(size_t)t * D + c];
    }
    *kvq_head_bits(out, 1, h) = (double)Tq * (index_bits(C) + (double)vbits * D + 16.0) +
                                kvq_keep_exact(v, y, T, D, Tq, T, NULL);
    /* static: K and V centres (fp32), the value codebook and rotation */
    out->static_bytes[h] = 2.0 * C * D * 4.0 + 4.0 * cb->n + kvq_rotation_bytes(&rot);
out:
    kvq_rotation_free(&rot);
    free(r), free(rq), free(work), free(norm), free(as);
    return st;
}

static kvq_status cluster_run(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                              int tensor, int h, int reference, kvq_error *err)
{
    const cluster_state *s = ctx->calib;
    if (!s) return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s", sp->text, KVQ_NEEDS_CALIB);
    return tensor ? cluster_values(sp, ctx, s, in, out, h, reference, err)
                  : cluster_keys(sp, ctx, s, in, out, h, reference, err);
}

static kvq_status cluster_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                               kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return cluster_run(sp, ctx, in, out, tensor, h, 0, err);
}

/* The reference (.reference_head): the key residuals' groups through
 * kvq_step_reference, the value residuals' levels by the codebook's
 * search; the nearest centres (kvq_kmeans_assign) and the rotations are
 * the BLAS products cluster_head takes. */
static kvq_status cluster_reference_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                         kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return cluster_run(sp, ctx, in, out, tensor, h, 1, err);
}

const kvq_quantizer kvq_q_cluster = {
    .name = "cluster",
    .description = "k-means centre + residual: K per-channel U, V rotated Lloyd-Max",
    .example_spec = "centroids=4,window=8",
    .params = cluster_params,
    .nparams = sizeof cluster_params / sizeof cluster_params[0],
    .needs_calib = 1,
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = cluster_head,
    .reference_head = cluster_reference_head,
    .read_flags = KVQ_READ_KEY_PRE_ROPE,
    .calib_key = cluster_calib_key,
    .calibrate = cluster_calibrate,
    .calib_free = cluster_free,
    .nstreams = 2, /* k-means++ seeding of K and of V */
    .stream_tag_kept = 8,
};
