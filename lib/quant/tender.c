/* tender.c — Tender (docs/quantizers.md#tender): per chunk of tokens, a bias per
 * channel is subtracted, and the channels fall into `groups` groups whose
 * scales differ by powers of `alpha` (rescaling between groups is a shift
 * when alpha = 2).  Rows are tokens; columns are all H·D channels of the
 * layer (span=layer, one TMax per chunk shared by the heads) or the D of
 * one head (span=head).
 *
 * Per chunk of `chunk` tokens (chunk=0: all T), channel c, b bits, Qm = 2^(b−1) − 1:
 *   bias_c = rnd((max_c + min_c) / 2),  x̃ = x − bias_c
 *   CMax_c = max |x̃|,  TMax = rnd(max_c CMax_c)
 *   g_c    = 1 + #{k in 1..G−1 : CMax_c <= TMax / alpha^k}
 *   s_g    = TMax / (alpha^(g−1) · Qm),  x' = clamp(rne(x̃ / s_g), −Qm, Qm) · s_g + bias_c
 * (rnd: the scale precision; TMax = 0 gives x' = bias_c).
 *
 * The channel statistics need only min and max: x̃ rounds monotonically, so
 * CMax_c = max(max_c − bias_c, bias_c − min_c) exactly.  span=head runs each
 * (tensor, head, chunk) block in one task while it is in cache; span=layer
 * first finds each block's largest CMax (one pass), then quantizes. */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <stdlib.h>

typedef struct tender_opts {
    int bits, groups, alpha, chunk;
    int span;  /* 0 layer, 1 head */
    int scale; /* kvq_scale_prec */
} tender_opts;
static const kvq_param tender_params[] = {
    {.key = "bits", .type = KVQ_PARAM_INT, .def = "4", .min = 2, .max = 16,
     .help = "bits per code (signed, Qm = 2^(bits-1) - 1)", KVQ_OPT(tender_opts, bits)},
    {.key = "groups", .type = KVQ_PARAM_INT, .def = "8", .min = 1, .max = 64,
     .help = "channel groups; scales differ by powers of alpha", KVQ_OPT(tender_opts, groups)},
    {.key = "alpha", .type = KVQ_PARAM_INT, .def = "2", .min = 2, .max = 256,
     .help = "ratio of neighbouring groups' scales (2: a one-bit shift)", KVQ_OPT(tender_opts, alpha)},
    {.key = "chunk", .type = KVQ_PARAM_INT, .def = "256", .min = 0, .max = 1e9,
     .help = "tokens per chunk with their own biases and groups (0 = all)", KVQ_OPT(tender_opts, chunk)},
    {.key = "span", .type = KVQ_PARAM_CHOICE, .def = "layer", .choices = "layer|head",
     .help = "channels of the whole layer (head-major) or of one head", KVQ_OPT(tender_opts, span)},
    {.key = "scale", .type = KVQ_PARAM_CHOICE, .def = "fp16", .choices = "fp16|fp32",
     .help = "precision of biases and TMax", KVQ_OPT(tender_opts, scale)},
};

typedef struct tender_cfg {
    int Qm, G, alpha, chunk, nchunks, span_head;
    kvq_scale_prec prec;
} tender_cfg;

static tender_cfg tender_cfg_of(const kvq_spec *sp, int T)
{
    const tender_opts *o = kvq_spec_opts(sp);
    tender_cfg c = {.Qm = (1 << (o->bits - 1)) - 1, .G = o->groups, .alpha = o->alpha, .chunk = o->chunk,
                    .span_head = o->span == 1, .prec = (kvq_scale_prec)o->scale};
    if (c.chunk == 0 || c.chunk > T) c.chunk = T;
    c.nchunks = T > 0 ? (T + c.chunk - 1) / c.chunk : 0;
    return c;
}

/* Bits of head h: b per element; per chunk and channel the bias and
 * ceil(log2 G) group bits; per chunk one TMax (shared by the H heads with
 * span=layer, a 1/H share each). */
static double tender_bits(const kvq_spec *sp, const tender_cfg *c, int H, int T, int D)
{
    int gbits = 0;
    while ((1 << gbits) < c->G) gbits++;
    double sb = kvq_scale_bits(c->prec);
    double per_chunk = (double)D * (sb + gbits) + (c->span_head ? sb : sb / H);
    const tender_opts *o = kvq_spec_opts(sp);
    return (double)o->bits * T * D + c->nchunks * per_chunk;
}

/* Channel statistics of a block x [rows][D]: bias and CMax per channel;
 * returns max_c CMax_c, or NaN if a bias does not fit the precision. */
static float block_stats(const float *x, int rows, int D, kvq_scale_prec prec, float *mn, float *mx,
                         float *bias, float *cmax)
{
    for (int c = 0; c < D; c++) mn[c] = mx[c] = x[c];
    for (int t = 1; t < rows; t++) {
        const float *r = x + (size_t)t * D;
        for (int c = 0; c < D; c++) {
            mn[c] = r[c] < mn[c] ? r[c] : mn[c];
            mx[c] = r[c] > mx[c] ? r[c] : mx[c];
        }
    }
    float m = 0.0f;
    for (int c = 0; c < D; c++) {
        float b = kvq_round_scale((mx[c] + mn[c]) / 2.0f, prec);
        if (!isfinite(b)) return NAN;
        float hi = mx[c] - b, lo = b - mn[c]; /* the largest x − b and b − x */
        bias[c] = b;
        cmax[c] = hi > lo ? hi : lo;
        m = cmax[c] > m ? cmax[c] : m;
    }
    return m;
}

/* Quantizes a block x [rows][D] into y with its biases and CMax and the chunk's TMax. */
static void block_quantize(const float *x, float *y, int rows, int D, const tender_cfg *cfg, float tmax,
                           const float *bias, const float *cmax, float *sdiv, float *smul)
{
    /* thresholds TMax / alpha^k (k = 1..G−1) and the scales s_g, in double then float */
    double thr[64];
    float sg[64];
    double ak = 1.0;
    for (int g = 1; g <= cfg->G; g++) {
        if (g > 1) thr[g - 1] = (double)tmax / ak; /* ak = alpha^(g−1) */
        sg[g - 1] = tmax / (float)(ak * cfg->Qm);
        ak *= cfg->alpha;
    }
    for (int c = 0; c < D; c++) {
        int g = 1;
        while (g < cfg->G && (double)cmax[c] <= thr[g]) g++;
        float s = sg[g - 1];
        /* s = 0 (TMax = 0, or a scale below float range): x' = bias_c */
        sdiv[c] = s > 0.0f ? s : 1.0f;
        smul[c] = s;
    }
    const float Qm = (float)cfg->Qm;
    for (int t = 0; t < rows; t++) {
        const float *xr = x + (size_t)t * D;
        float *yr = y + (size_t)t * D;
        for (int c = 0; c < D; c++) {
            float v = (xr[c] - bias[c]) / sdiv[c];
            v = v > Qm ? Qm : v; /* clamping before rounding: the same integer */
            v = v < -Qm ? -Qm : v;
            yr[c] = kvq_rne(v) * smul[c] + bias[c];
        }
    }
}

static kvq_status tender_quantize(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                  kvq_quant_out *out, kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D;
    tender_cfg cfg = tender_cfg_of(sp, T);
    int nch = cfg.nchunks, ntask = 2 * H * nch; /* task i: tensor, head, chunk */
    double bits = tender_bits(sp, &cfg, H, T, D);
    for (int h = 0; h < H; h++) out->k_bits[h] = out->v_bits[h] = bits;

    float *tmax = malloc((size_t)(ntask > 0 ? ntask : 1) * sizeof *tmax); /* [2][H][nch] */
    int *bad = malloc((size_t)(ntask > 0 ? ntask : 1) * sizeof *bad);
    if (!tmax || !bad) {
        free(tmax), free(bad);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    }
    int nt = kvq_threads(ctx->nthreads), nomem = 0;
    for (int pass = cfg.span_head; pass < 2 && !nomem; pass++) {
        /* pass 0 (span=layer): every block's largest CMax; then TMax per
         * (tensor, chunk) over the heads.  pass 1: quantize. */
#pragma omp parallel num_threads(nt) reduction(| : nomem)
        {
            float *w = malloc((size_t)6 * D * sizeof *w);
            nomem |= !w;
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < ntask; i++) {
                int tensor = i / (H * nch), h = i / nch % H, ch = i % nch;
                int t0 = ch * cfg.chunk, rows = T - t0 < cfg.chunk ? T - t0 : cfg.chunk;
                size_t off = (size_t)t0 * D;
                const float *x = kvq_head_in(in, tensor, h) + off;
                bad[i] = 0;
                if (!w) continue;
                float *mn = w, *mx = w + D, *bias = w + 2 * D, *cmax = w + 3 * D;
                float m = block_stats(x, rows, D, cfg.prec, mn, mx, bias, cmax);
                if (isnan(m)) {
                    bad[i] = 1;
                    continue;
                }
                if (pass == 0) {
                    tmax[i] = m;
                    continue;
                }
                float tm = cfg.span_head ? kvq_round_scale(m, cfg.prec) : tmax[i];
                if (!isfinite(tm)) {
                    bad[i] = 1;
                    continue;
                }
                block_quantize(x, kvq_head_out(out, in, tensor, h) + off, rows, D, &cfg, tm, bias, cmax,
                               w + 4 * D, w + 5 * D);
            }
            free(w);
        }
        for (int i = 0; i < ntask && !nomem; i++)
            if (bad[i]) {
                int tensor = i / (H * nch), h = i / nch % H;
                free(tmax), free(bad);
                return kvq_quant_numeric_error(err, sp, ctx, tensor ? "value" : "key", h);
            }
        if (pass == 0) /* TMax of (tensor, chunk): rnd of the largest over the heads */
            for (int tensor = 0; tensor < 2; tensor++)
                for (int ch = 0; ch < nch; ch++) {
                    float m = 0.0f;
                    for (int h = 0; h < H; h++) {
                        float v = tmax[(tensor * H + h) * nch + ch];
                        m = v > m ? v : m;
                    }
                    m = kvq_round_scale(m, cfg.prec);
                    for (int h = 0; h < H; h++) tmax[(tensor * H + h) * nch + ch] = m;
                }
    }
    free(tmax), free(bad);
    if (nomem) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    return KVQ_OK;
}

/* ------------------------------------------------------------ the reference */

/* The reference (.reference): the four steps of docs/quantizers.md#tender per
 * chunk, over the layer's H·D channels (span=layer) or a head's D, on one
 * thread: CMax as max |x − bias| (tender_quantize takes it from min and
 * max), x̃/s rounded before it is clamped (tender_quantize clamps first). */
static kvq_status tender_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                   kvq_quant_out *out, kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D;
    tender_cfg cfg = tender_cfg_of(sp, T);
    double bits = tender_bits(sp, &cfg, H, T, D);
    for (int h = 0; h < H; h++) out->k_bits[h] = out->v_bits[h] = bits;
    /* the columns of one block: all H·D head-major, or the D of head h0 */
    int W = cfg.span_head ? D : H * D, nblocks = cfg.span_head ? H : 1;
    float *bias = malloc((size_t)W * sizeof *bias), *cmax = malloc((size_t)W * sizeof *cmax);
    kvq_status st = bias && cmax ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
    for (int tensor = 0; tensor < 2 && !st; tensor++)
        for (int h0 = 0; h0 < nblocks && !st; h0++)
            for (int t0 = 0; t0 < T && !st; t0 += cfg.chunk) {
                int t1 = T - t0 < cfg.chunk ? T : t0 + cfg.chunk;
#define X(t, j) kvq_head_in(in, tensor, h0 + (j) / D)[(size_t)(t) * D + (size_t)(j) % D]
#define Y(t, j) kvq_head_out(out, in, tensor, h0 + (j) / D)[(size_t)(t) * D + (size_t)(j) % D]
                /* 1. bias_c = rnd((max_c + min_c) / 2); 2. CMax_c = max |x − bias_c| */
                float tmax = 0.0f;
                int bad = -1;
                for (int j = 0; j < W; j++) {
                    float mn = X(t0, j), mx = X(t0, j);
                    for (int t = t0; t < t1; t++) mn = fminf(mn, X(t, j)), mx = fmaxf(mx, X(t, j));
                    bias[j] = kvq_round_scale((mx + mn) / 2.0f, cfg.prec);
                    if (!isfinite(bias[j]) && bad < 0) bad = h0 + j / D;
                    cmax[j] = 0.0f;
                    for (int t = t0; t < t1; t++) cmax[j] = fmaxf(cmax[j], fabsf(X(t, j) - bias[j]));
                    tmax = fmaxf(tmax, cmax[j]);
                }
                tmax = kvq_round_scale(tmax, cfg.prec); /* TMax = rnd(max_c CMax_c) */
                if (bad < 0 && !isfinite(tmax)) bad = h0;
                if (bad >= 0) {
                    st = kvq_quant_numeric_error(err, sp, ctx, tensor ? "value" : "key", bad);
                    break;
                }
                for (int j = 0; j < W; j++) {
                    /* 3. g_c = 1 + #{k in 1..G−1 : CMax_c <= TMax / alpha^k} (alpha^k in double) */
                    int g = 1;
                    double ak = 1.0;
                    for (int k = 1; k < cfg.G; k++) {
                        ak *= cfg.alpha;
                        g += (double)cmax[j] <= (double)tmax / ak;
                    }
                    /* 4. s_g = TMax / (alpha^(g−1)·Qm) (the divisor in double, then float) */
                    double ag = 1.0;
                    for (int k = 1; k < g; k++) ag *= cfg.alpha;
                    float s = tmax / (float)(ag * cfg.Qm);
                    for (int t = t0; t < t1; t++) {
                        if (s == 0.0f) { /* TMax = 0 (or s below float range): x' = bias_c */
                            Y(t, j) = bias[j];
                            continue;
                        }
                        float q = kvq_rne((X(t, j) - bias[j]) / s);
                        q = fminf(fmaxf(q, (float)-cfg.Qm), (float)cfg.Qm);
                        Y(t, j) = q * s + bias[j];
                    }
                }
#undef X
#undef Y
            }
    free(bias), free(cmax);
    return st;
}

const kvq_quantizer kvq_q_tender = {
    .name = "tender",
    .description = "Tender: per-chunk channel bias + channel groups whose scales differ by powers of alpha",
    .example_spec = "bits=3,chunk=100,span=head",
    .params = tender_params,
    .nparams = sizeof tender_params / sizeof tender_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize = tender_quantize,
    .reference = tender_reference,
};
