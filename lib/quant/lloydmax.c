/* lloydmax.c — TurboQuant-style Lloyd–Max quantizer, MSE variant (docs/quantizers.md#lloydmax):
 * per token and head, the norm is stored at fp16 (n = fp16(‖x‖), used both
 * to normalise and to reconstruct), u = Π·x/n, every coordinate snaps to
 * the nearest level of a scalar codebook, x' = n·Πᵀ·û.  Bits: b·D + 16 per
 * token and head.  The helper kvq_lloydmax_rows is shared with `cluster`,
 * which codes its value residuals the same way. */
#include "../internal.h"
#include "quant.h"
#include "../simd.h"

#include <math.h>
#include <string.h>

typedef struct lloydmax_opts {
    int bits;
    int rotate;   /* kvq_rotate_kind, in the choices' order */
    int codebook; /* kvq_codebook_kind, in the choices' order */
} lloydmax_opts;
static const kvq_param lloydmax_params[] = {
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "2", .min = 1, .max = KVQ_CODEBOOK_MAX_BITS,
     .help = "bits per coordinate", KVQ_OPT(lloydmax_opts, bits)},
    {.key = "rotate", .type = KVQ_PARAM_CHOICE, .def = "qr", .choices = "none|qr|hadamard",
     .help = "seeded rotation before coding", KVQ_OPT(lloydmax_opts, rotate)},
    {.key = "codebook", .type = KVQ_PARAM_CHOICE, .def = "sphere", .choices = "sphere|gauss|data",
     .help = "levels for a unit-sphere coordinate, N(0,1/D), or fitted on --calib", KVQ_OPT(lloydmax_opts, codebook)},
};

/* The stored norm of one vector: fp16(‖x‖), sum of squares in double. */
static float stored_norm(const float *x, int D)
{
    double ss = 0.0;
    for (int c = 0; c < D; c++) ss += (double)x[c] * x[c];
    return kvq_round_f16((float)sqrt(ss));
}

/* stored_norm of each of T vectors [T][D] into norm[T]: NORM_LANES tokens at
 * once, each its own sum in the same order (c = 0, 1, ...), so the sums no
 * longer wait on one another's additions (4 cycles each) and vectorise
 * across tokens; the values are stored_norm's bit for bit. */
enum { NORM_LANES = 8 };
static void stored_norms(const float *x, int T, int D, float *norm)
{
    int t = 0;
    for (; t + NORM_LANES <= T; t += NORM_LANES) {
        const float *xt = x + (size_t)t * D;
        double ss[NORM_LANES] = {0};
        for (int c = 0; c < D; c++)
            for (int i = 0; i < NORM_LANES; i++) ss[i] += (double)xt[(size_t)i * D + c] * xt[(size_t)i * D + c];
        for (int i = 0; i < NORM_LANES; i++) norm[t + i] = kvq_round_f16((float)sqrt(ss[i]));
    }
    for (; t < T; t++) norm[t] = stored_norm(x + (size_t)t * D, D);
}

/* û_c = levelf[kvq_codebook_index(cb, u_c / n)] for one row, in place.  Up
 * to 16 levels, a select chain over the ascending midpoints: v > bound[j]
 * holds for j below the index and fails from it on, so the last level
 * selected is levelf[index] (a NaN selects none: level 0, as the search).
 * No branch on the data, so the loop vectorises; compiled plain and for
 * AVX2, picked at run time.  More levels: the binary search. */
#define LM_SNAP_BLOCK 64
KVQ_BODY void snap_chain_body(const kvq_codebook *cb, float *restrict u, float n, int D)
{
    const float *bound = cb->bound, *level = cb->levelf;
    for (int c0 = 0; c0 < D; c0 += LM_SNAP_BLOCK) {
        int w = D - c0 < LM_SNAP_BLOCK ? D - c0 : LM_SNAP_BLOCK;
        float v[LM_SNAP_BLOCK], q[LM_SNAP_BLOCK];
        for (int c = 0; c < w; c++) v[c] = u[c0 + c] / n, q[c] = level[0];
        for (int j = 0; j + 1 < cb->n; j++) {
            const float b = bound[j], l = level[j + 1];
            for (int c = 0; c < w; c++) q[c] = v[c] > b ? l : q[c];
        }
        memcpy(u + c0, q, (size_t)w * sizeof *q);
    }
}

static void snap_chain_plain(const kvq_codebook *cb, float *restrict u, float n, int D)
{
    snap_chain_body(cb, u, n, D);
}

#ifdef KVQ_AVX2_CLONES
KVQ_TARGET_AVX2 static void snap_chain_avx2(const kvq_codebook *cb, float *restrict u, float n, int D)
{
    snap_chain_body(cb, u, n, D);
}
KVQ_TARGET_AVX512 static void snap_chain_avx512(const kvq_codebook *cb, float *restrict u, float n, int D)
{
    snap_chain_body(cb, u, n, D);
}
#endif

void kvq_lloydmax_snap_ref(const kvq_codebook *cb, float *u, float n, int D)
{
    for (int c = 0; c < D; c++) u[c] = cb->levelf[kvq_codebook_index(cb, u[c] / n)];
}

void kvq_lloydmax_snap(const kvq_codebook *cb, float *u, float n, int D)
{
    if (cb->n > 16) {
        kvq_lloydmax_snap_ref(cb, u, n, D);
        return;
    }
    KVQ_PICK_CLONE(snap_chain)(cb, u, n, D);
}

kvq_status kvq_lloydmax_rows(const float *x, float *y, int T, int D, const kvq_rotation *rot,
                             const kvq_codebook *cb, kvq_snap_fn snap, float *work, float *norm, kvq_error *err)
{
    /* work_t = Π·x_t for every token (a plain copy without rotation) */
    kvq_status st = kvq_rotation_apply(rot, x, work, (size_t)T, 0, err);
    if (st) return st;
    if (snap == kvq_lloydmax_snap_ref) /* the reference: each norm on its own */
        for (int t = 0; t < T; t++) norm[t] = stored_norm(x + (size_t)t * D, D);
    else
        stored_norms(x, T, D, norm);
    for (int t = 0; t < T; t++) {
        float *ut = work + (size_t)t * D;
        float n = norm[t];
        if (!isfinite(n)) return KVQ_ERR_NUMERIC;
        if (n == 0.0f) { /* x' = 0 */
            memset(ut, 0, (size_t)D * sizeof *ut);
            continue;
        }
        snap(cb, ut, n, D); /* û */
    }
    /* x'_t = n·(Πᵀ·û_t) */
    if ((st = kvq_rotation_apply(rot, work, y, (size_t)T, 1, err))) return st;
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) y[(size_t)t * D + c] = norm[t] * y[(size_t)t * D + c];
    return KVQ_OK;
}

/* The codebook `gauss` scaled by 1/sqrt(D): levels and midpoints in double,
 * then rounded once. */
static void scale_codebook(const kvq_codebook *src, int D, kvq_codebook *dst)
{
    *dst = *src;
    double f = 1.0 / sqrt((double)D);
    for (int i = 0; i < src->n; i++) dst->level[i] = src->level[i] * f, dst->levelf[i] = (float)dst->level[i];
    for (int i = 0; i + 1 < src->n; i++) dst->bound[i] = (float)(0.5 * (dst->level[i] + dst->level[i + 1]));
}

/* Codebook of (spec, head, tensor): cached analytic, or fitted (calibration state). */
static kvq_status pick_codebook(const kvq_spec *sp, const kvq_quant_ctx *ctx, int D, int h, int tensor,
                                kvq_codebook *scaled, const kvq_codebook **cb, kvq_error *err)
{
    const lloydmax_opts *o = kvq_spec_opts(sp);
    int bits = o->bits, kind = o->codebook;
    if (kind == KVQ_CB_DATA) {
        *cb = (const kvq_codebook *)ctx->calib + 2 * h + tensor;
        return KVQ_OK;
    }
    kvq_status st = kvq_codebook_get((kvq_codebook_kind)kind, D, bits, cb, err);
    if (st || kind == KVQ_CB_SPHERE) return st;
    scale_codebook(*cb, D, scaled);
    *cb = scaled;
    return KVQ_OK;
}

kvq_status kvq_lloydmax_head(const float *x, float *y, int T, int D, kvq_rotate_kind rotate, const kvq_codebook *cb,
                             kvq_snap_fn snap, const kvq_quant_ctx *ctx, int h, int tensor, double *rot_bytes,
                             kvq_error *err)
{
    kvq_rotation rot;
    kvq_status st = kvq_rotation_init(&rot, rotate, D, ctx->seed, ctx->layer, h, tensor, err);
    if (st) return st;
    float *work = kvq_alloc_array((size_t)T * D, sizeof *work), *norm = kvq_alloc_array((size_t)T, sizeof *norm);
    if (!work || !norm) st = KVQ_ERR_NOMEM;
    else st = kvq_lloydmax_rows(x, y, T, D, &rot, cb, snap, work, norm, err);
    *rot_bytes = kvq_rotation_bytes(&rot);
    free(work), free(norm);
    kvq_rotation_free(&rot);
    return st;
}

/* One head's tensor with the nearest levels found by snap. */
static kvq_status lloydmax_run(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                               int tensor, int h, kvq_snap_fn snap, kvq_error *err)
{
    const lloydmax_opts *o = kvq_spec_opts(sp);
    int T = in->T, D = in->D, bits = o->bits;
    kvq_codebook scaled;
    const kvq_codebook *cb;
    double rot_bytes;
    kvq_status st = pick_codebook(sp, ctx, D, h, tensor, &scaled, &cb, err);
    if (!st)
        st = kvq_lloydmax_head(kvq_head_in(in, tensor, h), kvq_head_out(out, in, tensor, h), T, D,
                               (kvq_rotate_kind)o->rotate, cb, snap, ctx, h, tensor, &rot_bytes, err);
    if (st) return st;
    *kvq_head_bits(out, tensor, h) = (double)T * ((double)bits * D + 16.0);
    if (tensor == 1) /* K's and V's rotation and codebook (same sizes), by one task */
        out->static_bytes[h] = 2.0 * (rot_bytes + 4.0 * cb->n);
    return KVQ_OK;
}

static kvq_status lloydmax_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return lloydmax_run(sp, ctx, in, out, tensor, h, kvq_lloydmax_snap, err);
}

/* The reference (.reference_head): the nearest levels by the codebook's
 * search; the rotations are kvq_rotation_apply's products (BLAS for qr),
 * as lloydmax_head forms them. */
static kvq_status lloydmax_reference_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                          kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return lloydmax_run(sp, ctx, in, out, tensor, h, kvq_lloydmax_snap_ref, err);
}

/* ------------------------------------------------ codebook=data calibration */

static int lloydmax_calib_key(const kvq_spec *sp, char *buf, size_t len)
{
    const lloydmax_opts *o = kvq_spec_opts(sp);
    if (o->codebook != KVQ_CB_DATA) return 0;
    snprintf(buf, len, "bits=%d,rotate=%d", o->bits, o->rotate);
    return 1;
}

/* Per (head, K/V): the coordinates of u = Π·x/n over the calibration tokens
 * (tokens with n = 0 skipped), 1-D k-means.  State: kvq_codebook [H][2]. */
static kvq_status lloydmax_calibrate(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *cal,
                                     void **state, kvq_error *err)
{
    const lloydmax_opts *o = kvq_spec_opts(sp);
    int H = cal->H, T = cal->T, D = cal->D;
    kvq_codebook *cbs = kvq_alloc_array((size_t)H * 2, sizeof *cbs);
    float *u = kvq_alloc_array((size_t)T * D, sizeof *u);
    kvq_status st = cbs && u ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int task = 0; task < 2 * H && !st; task++) {
        int h = task / 2, tensor = task % 2;
        const float *x = kvq_head_in(cal, tensor, h);
        kvq_rotation rot;
        if ((st = kvq_rotation_init(&rot, (kvq_rotate_kind)o->rotate, D, ctx->seed, ctx->layer, h, tensor,
                                    err)))
            break;
        st = kvq_rotation_apply(&rot, x, u, (size_t)T, 0, err);
        kvq_rotation_free(&rot);
        size_t m = 0;
        for (int t = 0; t < T && !st; t++) {
            float n = stored_norm(x + (size_t)t * D, D);
            if (n == 0.0f || !isfinite(n)) continue;
            for (int c = 0; c < D; c++) u[m++] = u[(size_t)t * D + c] / n; /* m <= t·D + c: in place */
        }
        if (!st && m == 0)
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s head %d: every calibration token is zero", tensor ? "value" : "key",
                          h);
        if (!st) st = kvq_codebook_fit_data(u, m, o->bits, &cbs[task], err);
    }
    free(u);
    if (st) {
        free(cbs);
        return st;
    }
    *state = cbs;
    return KVQ_OK;
}

const kvq_quantizer kvq_q_lloydmax = {
    .name = "lloydmax",
    .description = "per-token fp16 norm + rotation + Lloyd-Max levels; codebook=data needs --calib",
    .example_spec = "bits=3,rotate=hadamard,codebook=data",
    .params = lloydmax_params,
    .nparams = sizeof lloydmax_params / sizeof lloydmax_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize_head = lloydmax_head,
    .reference_head = lloydmax_reference_head,
    .calib_key = lloydmax_calib_key,
    .calibrate = lloydmax_calibrate,
    .calib_free = free,
};
