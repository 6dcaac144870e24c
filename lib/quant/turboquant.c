/* turboquant.c — TurboQuant (docs/quantizers.md#turboquant).  variant=mse is lloydmax at `bits`
 * (the same rotation, sphere codebook and fp16 norm: bit for bit).
 * variant=prod makes attention scores unbiased: per token and head, stage 1
 * is lloydmax at b − 1 bits, giving x̂₁; the residual r = x − x̂₁ is coded by
 * QJL — S a D×D matrix of i.i.d. N(0,1) from the seeded generator (per
 * layer, head, K/V), z = sign(S·r) (sign 0 = +1), γ = fp16(‖r‖) — and
 *   x' = x̂₁ + (sqrt(π/2) / D) · γ · Sᵀ·z,
 * so that E_S⟨q, x'⟩ = ⟨q, x⟩.  Both products with S are sgemm calls.
 * Bits per token and head: (b−1)·D + 16 + D + 16 (prod), b·D + 16 (mse);
 * static: the rotations, codebooks and S (D·D·4 bytes per head and tensor).
 * Stage 1 is the spec `lloydmax:bits=b−1,rotate=R,codebook=sphere` (b for
 * mse), bit for bit (the same rotation stream, codebook and snap): a run
 * that holds that spec too hands its output over (first_stage) and x̂₁ is
 * copied from it. */
#include "../internal.h"
#include "quant.h"

#include <cblas.h>
#include <math.h>

enum { TQ_MSE, TQ_PROD }; /* variant's choices */
typedef struct turboquant_opts {
    int bits, variant;
    int rotate; /* kvq_rotate_kind, in the choices' order */
} turboquant_opts;
static const kvq_param turboquant_params[] = {
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "3", .min = 1, .max = KVQ_CODEBOOK_MAX_BITS,
     .help = "bits per coordinate (prod: b-1 for Lloyd-Max + 1 for the QJL signs)", KVQ_OPT(turboquant_opts, bits)},
    {.key = "variant", .type = KVQ_PARAM_CHOICE, .def = "prod", .choices = "mse|prod",
     .help = "mse: Lloyd-Max only (= lloydmax); prod: + 1-bit QJL residual, unbiased scores",
     KVQ_OPT(turboquant_opts, variant)},
    {.key = "rotate", .type = KVQ_PARAM_CHOICE, .def = "qr", .choices = "none|qr|hadamard",
     .help = "seeded rotation before Lloyd-Max", KVQ_OPT(turboquant_opts, rotate)},
};

static kvq_status turboquant_check(const kvq_spec *sp, kvq_error *err)
{
    const turboquant_opts *o = kvq_spec_opts(sp);
    if (o->variant == TQ_PROD && o->bits < 2)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: bits=%d: variant=prod needs bits >= 2 (b-1 for Lloyd-Max, 1 for QJL)",
                        sp->text, o->bits);
    return KVQ_OK;
}

enum { QJL_ROWS = 8 }; /* rows whose norms are summed side by side */

/* r = x − y for T rows of D, and each row's γ = fp16(‖r‖) times coef into
 * scale[t].  Each ‖r‖² is summed in double in channel order, as the
 * definition reads; QJL_ROWS rows at a time, so that their sums are
 * independent chains instead of one waiting on each addition. */
static void qjl_residuals(const float *x, const float *y, float *r, float *scale, int T, int D, float coef)
{
    for (int t0 = 0; t0 < T; t0 += QJL_ROWS) {
        int nb = T - t0 < QJL_ROWS ? T - t0 : QJL_ROWS;
        size_t base = (size_t)t0 * D;
        for (size_t i = base; i < base + (size_t)nb * D; i++) r[i] = x[i] - y[i];
        double ss[QJL_ROWS] = {0};
        for (int c = 0; c < D; c++)
            for (int k = 0; k < nb; k++) {
                double v = r[base + (size_t)k * D + c];
                ss[k] += v * v;
            }
        for (int k = 0; k < nb; k++) scale[t0 + k] = coef * kvq_round_f16((float)sqrt(ss[k]));
    }
}

/* The QJL stage on T residuals r [T][D] (scale[t] = (sqrt(π/2)/D)·γ_t
 * from qjl_residuals), added to y: y_t += scale_t·Sᵀ·z_t with
 * z_t = sign(S·r_t).  S [D][D]; z: [T][D] scratch; r is overwritten. */
static void qjl_add(float *y, float *r, float *z, const float *scale, const float *S, int T, int D)
{
    /* z = r·Sᵀ (z[t][i] = Σ_j S[i][j]·r[t][j]), then its signs */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, D, D, 1.0f, r, D, S, D, 0.0f, z, D);
    for (size_t i = 0; i < (size_t)T * D; i++) z[i] = z[i] >= 0.0f ? 1.0f : -1.0f; /* sign 0 = +1 */
    /* Sᵀ·z_t (the rows of z·S), scaled, then added: two roundings, as written */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, D, D, 1.0f, z, D, S, D, 0.0f, r, D);
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * D;
        const float *rt = r + (size_t)t * D, st = scale[t];
        for (int c = 0; c < D; c++) yt[c] = yt[c] + st * rt[c];
    }
}

/* One head's tensor with stage 1's nearest levels found by snap. */
static kvq_status turboquant_run(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, int tensor, int h, kvq_snap_fn snap, kvq_error *err)
{
    const turboquant_opts *o = kvq_spec_opts(sp);
    int T = in->T, D = in->D, b = o->bits, prod = o->variant == TQ_PROD;
    int stage_bits = prod ? b - 1 : b;
    const kvq_codebook *cb;
    double rot_bytes;
    const float *x = kvq_head_in(in, tensor, h);
    float *y = kvq_head_out(out, in, tensor, h); /* [T][D] */
    /* stage 1: Lloyd–Max, x̂₁ into y, or from the run's lloydmax spec */
    kvq_status st = kvq_codebook_get(KVQ_CB_SPHERE, D, stage_bits, &cb, err);
    if (!st && ctx->first_stage) {
        memcpy(y, kvq_head_out(ctx->first_stage, in, tensor, h), (size_t)T * D * sizeof *y);
        rot_bytes = kvq_rotation_bytes(&(kvq_rotation){.kind = (kvq_rotate_kind)o->rotate, .D = D});
        kvq_first_stage_taken();
    } else if (!st) {
        st = kvq_lloydmax_head(x, y, T, D, (kvq_rotate_kind)o->rotate, cb, snap, ctx, h, tensor, &rot_bytes, err);
    }
    if (st) return st;
    if (prod) { /* stage 2: QJL on r = x − x̂₁, added to y */
        size_t n = (size_t)T * D;
        float *S = kvq_alloc_array((size_t)D * D, sizeof *S), *r = kvq_alloc_array(n, sizeof *r);
        float *z = kvq_alloc_array(n, sizeof *z), *scale = kvq_alloc_array((size_t)T, sizeof *scale);
        if (S && r && z && scale) {
            kvq_rng rng; /* S row by row from the (layer, head, K/V) stream */
            kvq_rng_init(&rng, ctx->seed, (uint64_t)ctx->layer, (uint64_t)h,
                         kvq_family_stream(sp->q, (uint64_t)tensor));
            for (size_t i = 0; i < (size_t)D * D; i++) S[i] = (float)kvq_rng_normal(&rng);
            qjl_residuals(x, y, r, scale, T, D, (float)(sqrt(M_PI / 2.0) / D));
            qjl_add(y, r, z, scale, S, T, D);
        } else {
            st = KVQ_ERR_NOMEM;
        }
        free(S), free(r), free(z), free(scale);
        if (st) return st;
    }
    *kvq_head_bits(out, tensor, h) = (double)T * ((double)stage_bits * D + 16.0 + (prod ? D + 16.0 : 0.0));
    if (tensor == 1) /* K's and V's rotation, codebook and S (same sizes), by one task */
        out->static_bytes[h] = 2.0 * (rot_bytes + 4.0 * cb->n + (prod ? 4.0 * D * D : 0.0));
    return KVQ_OK;
}

/* Stage 1 as a spec of its own (.first_stage): lloydmax at b − 1 bits
 * (prod) or b (mse, where it is the whole output). */
static int turboquant_first_stage(const kvq_spec *sp, char *buf, size_t len)
{
    const turboquant_opts *o = kvq_spec_opts(sp);
    static const char *const rotate[] = {"none", "qr", "hadamard"}; /* the choices' order */
    int n = snprintf(buf, len, "lloydmax:bits=%d,rotate=%s,codebook=sphere",
                     o->variant == TQ_PROD ? o->bits - 1 : o->bits, rotate[o->rotate]);
    return n > 0 && (size_t)n < len;
}

static kvq_status turboquant_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return turboquant_run(sp, ctx, in, out, tensor, h, kvq_lloydmax_snap, err);
}

/* The reference (.reference_head): stage 1's nearest levels by the
 * codebook's search; the rotations and QJL's two products with S are the
 * same BLAS calls as turboquant_head's. */
static kvq_status turboquant_reference_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                            kvq_quant_out *out, int tensor, int h, kvq_error *err)
{
    return turboquant_run(sp, ctx, in, out, tensor, h, kvq_lloydmax_snap_ref, err);
}

const kvq_quantizer kvq_q_turboquant = {
    .name = "turboquant",
    .description = "TurboQuant: rotation + Lloyd-Max (b-1 bits) + 1-bit QJL residual, unbiased scores",
    .example_spec = "bits=2,variant=prod",
    .params = turboquant_params,
    .nparams = sizeof turboquant_params / sizeof turboquant_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .check = turboquant_check,
    .quantize_head = turboquant_head,
    .reference_head = turboquant_reference_head,
    .first_stage = turboquant_first_stage,
    .nstreams = 2, /* the QJL matrix S of K and of V */
    .stream_tag_kept = 10,
};
