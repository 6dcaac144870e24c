/* uniform.c — the building blocks U (asymmetric min–max, docs/building-blocks.md (U)) and A
 * (symmetric absmax, docs/building-blocks.md).
 *
 * kvq_group_quantize_ref / kvq_absmax_quantize_ref are the definitions: plain
 * C in the order docs/building-blocks.md writes the arithmetic.  kvq_group_quantize_channels
 * is the optimised per-channel path (all D channels of a block of tokens at
 * once, walking rows so the loops are contiguous and vectorise); the tests
 * check it is bit-identical to the reference. */
#include "../internal.h"
#include "quant.h"
#include "../simd.h"

#include <math.h>
#include <omp.h>
#include <string.h>

float kvq_round_scale(float s, kvq_scale_prec prec)
{
    return prec == KVQ_SCALE_FP16 ? kvq_round_f16(s) : s;
}

kvq_status kvq_group_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                  kvq_scale_prec prec)
{
    if (n == 0) return KVQ_OK;
    const float L = (float)((1u << bits) - 1u);
    /* mn = min(g), mx = max(g) */
    float mn = x[0], mx = x[0];
    for (size_t i = 1; i < n; i++) {
        float v = x[i * stride];
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    /* s = (mx − mn) / L and z = mn, each rounded to the scale precision */
    float s = kvq_round_scale((mx - mn) / L, prec);
    float z = kvq_round_scale(mn, prec);
    if (!isfinite(s) || !isfinite(z))
        return KVQ_ERR_NUMERIC;
    if (s == 0.0f) { /* constant group (or range below fp16 resolution): x' = z */
        for (size_t i = 0; i < n; i++) y[i * stride] = z;
        return KVQ_OK;
    }
    for (size_t i = 0; i < n; i++) {
        /* q = clamp(rne((x − z) / s), 0, L); clamping before rounding gives the
         * same integer because 0 and L are integers and rne is monotone */
        float v = (x[i * stride] - z) / s;
        v = v < 0.0f ? 0.0f : (v > L ? L : v);
        float q = kvq_rne(v);
        y[i * stride] = q * s + z; /* x' = q·s + z */
    }
    return KVQ_OK;
}

kvq_status kvq_absmax_quantize_ref(const float *x, float *y, size_t n, size_t stride, int bits,
                                   kvq_scale_prec prec)
{
    if (n == 0) return KVQ_OK;
    const float qmax = (float)((1u << (bits - 1)) - 1u); /* 2^(b−1) − 1 */
    const float qmin = -(float)(1u << (bits - 1));       /* −2^(b−1) */
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i * stride]);
        if (a > amax) amax = a;
    }
    float s = kvq_round_scale(amax / qmax, prec);
    if (!isfinite(s)) return KVQ_ERR_NUMERIC;
    if (s == 0.0f) {
        for (size_t i = 0; i < n; i++) y[i * stride] = 0.0f;
        return KVQ_OK;
    }
    for (size_t i = 0; i < n; i++) {
        float v = x[i * stride] / s;
        v = v < qmin ? qmin : (v > qmax ? qmax : v);
        y[i * stride] = kvq_rne(v) * s; /* x' = q·s */
    }
    return KVQ_OK;
}

/* Optimised per-channel U over a block of n token rows of D channels.
 * Pass 1 keeps running min/max per channel row by row (contiguous, vector
 * min/max); pass 2 quantizes row by row with per-channel s, z.  Compiled
 * plain and again for AVX2 (no FMA: the reference's multiply and add),
 * picked at run time. */
KVQ_BODY kvq_status channels_body(const float *restrict x, float *restrict y, size_t n, size_t D, int bits,
                                 kvq_scale_prec prec)
{
    enum { CHUNK = 256 };
    const float L = (float)((1u << bits) - 1u);
    float mn[CHUNK], mx[CHUNK], s[CHUNK], z[CHUNK], lo[CHUNK], hi[CHUNK];
    for (size_t c0 = 0; c0 < D; c0 += CHUNK) {
        size_t w = D - c0 < CHUNK ? D - c0 : CHUNK;
        const float *xb = x + c0;
        float *yb = y + c0;
        memcpy(mn, xb, w * sizeof(float));
        memcpy(mx, xb, w * sizeof(float));
        for (size_t t = 1; t < n; t++) {
            const float *row = xb + t * D;
            for (size_t c = 0; c < w; c++) {
                mn[c] = row[c] < mn[c] ? row[c] : mn[c];
                mx[c] = row[c] > mx[c] ? row[c] : mx[c];
            }
        }
        int constant = 0;
        for (size_t c = 0; c < w; c++) {
            s[c] = kvq_round_scale((mx[c] - mn[c]) / L, prec);
            z[c] = kvq_round_scale(mn[c], prec);
            if (!isfinite(s[c]) || !isfinite(z[c])) return KVQ_ERR_NUMERIC;
            if (s[c] == 0.0f) constant = 1;
            lo[c] = 0.0f;
            hi[c] = L;
        }
        if (constant) {
            /* x' = z on constant channels: s = 1 and the clamp to [0,0] give
             * q = 0, so q·s + z = z without a branch in the loop */
            for (size_t c = 0; c < w; c++)
                if (s[c] == 0.0f) s[c] = 1.0f, hi[c] = 0.0f;
        }
        for (size_t t = 0; t < n; t++) {
            const float *row = xb + t * D;
            float *out = yb + t * D;
            for (size_t c = 0; c < w; c++) {
                float v = (row[c] - z[c]) / s[c];
                v = v < lo[c] ? lo[c] : v;
                v = v > hi[c] ? hi[c] : v;
                out[c] = kvq_rne(v) * s[c] + z[c];
            }
        }
    }
    return KVQ_OK;
}

static kvq_status channels_plain(const float *restrict x, float *restrict y, size_t n, size_t D, int bits,
                                 kvq_scale_prec prec)
{
    return channels_body(x, y, n, D, bits, prec);
}

#ifdef KVQ_AVX2_CLONES
KVQ_TARGET_AVX2 static kvq_status channels_avx2(const float *restrict x, float *restrict y, size_t n, size_t D,
                                                int bits, kvq_scale_prec prec)
{
    return channels_body(x, y, n, D, bits, prec);
}
#endif

/* U per channel on a block, plus its error sums into recon (unless NULL):
 * from registers in the AVX-512 kernel, else a pass while the block is in
 * cache after the AVX2 or plain loop. */
static kvq_status channels_block(const float *x, float *y, size_t n, size_t D, int bits, kvq_scale_prec prec,
                                 kvq_recon_acc *recon)
{
    if (n == 0) return KVQ_OK;
    if (kvq_simd_active()) return kvq_u_channels_avx512(x, y, n, D, bits, prec == KVQ_SCALE_FP16, recon);
#ifdef KVQ_AVX2_CLONES
    kvq_status st =
        kvq_simd_avx2_active() ? channels_avx2(x, y, n, D, bits, prec) : channels_plain(x, y, n, D, bits, prec);
#else
    kvq_status st = channels_plain(x, y, n, D, bits, prec);
#endif
    if (!st && recon) kvq_recon_accumulate(recon, x, y, n * D);
    return st;
}

kvq_status kvq_group_quantize_channels(const float *restrict x, float *restrict y, size_t n,
                                       size_t D, int bits, kvq_scale_prec prec)
{
    return channels_block(x, y, n, D, bits, prec, NULL);
}

/* ------------------------------------------------ U and A along the axes */

/* U on one contiguous group: the reference body with stride 1, inlined so
 * the compiler sees unit stride and vectorises. */
static inline kvq_status group_contig(const float *x, float *y, size_t n, int bits,
                                      kvq_scale_prec prec)
{
    return kvq_group_quantize_ref(x, y, n, 1, bits, prec);
}

/* U on nrows rows of W values, groups of G consecutive values per row: the
 * AVX-512 kernel where active, else the AVX2 one (groups of whole vectors),
 * else the reference group by group; the error sums into recon (unless
 * NULL) as in channels_block. */
static kvq_status group_rows(const float *x, float *y, size_t nrows, size_t W, size_t G, int bits,
                             kvq_scale_prec prec, kvq_recon_acc *recon)
{
    if (kvq_simd_active()) return kvq_u_rows_avx512(x, y, nrows, W, G, bits, prec == KVQ_SCALE_FP16, recon);
    kvq_status st = kvq_simd_avx2_active() ? kvq_u_rows_avx2(x, y, nrows, W, G, bits, prec == KVQ_SCALE_FP16)
                                           : KVQ_ERR_UNSUPPORTED;
    if (st == KVQ_ERR_UNSUPPORTED) { /* the reference, group by group */
        st = KVQ_OK;
        for (size_t r = 0; r < nrows && !st; r++)
            for (size_t c0 = 0; c0 < W && !st; c0 += G)
                st = group_contig(x + r * W + c0, y + r * W + c0, W - c0 < G ? W - c0 : G, bits, prec);
    }
    if (!st && recon) kvq_recon_accumulate(recon, x, y, nrows * W);
    return st;
}

/* Rows per block of the fused error: 32 rows of up to 128 channels, x and
 * y together within L1 (16 + 16 KB) for the portable pass (the AVX-512
 * kernel adds the error from registers). */
static size_t fuse_rows(int D)
{
    size_t r = (size_t)(4096 / (D > 0 ? D : 1));
    return r ? r : 1;
}

kvq_status kvq_quant_head_per_token(const float *x, float *y, int T, int D, int t0, int t1,
                                    int bits, int group, kvq_scale_prec prec, double *stored_bits,
                                    kvq_recon_acc *recon)
{
    int G = group > D ? D : group; /* clamped to the axis */
    /* rows are independent: quantize a block, add its error while it is in L1 */
    size_t block = recon ? fuse_rows(D) : (size_t)(t1 > t0 ? t1 - t0 : 1);
    for (size_t r0 = (size_t)t0; (int)r0 < t1; r0 += block) {
        size_t n = (size_t)t1 - r0 < block ? (size_t)t1 - r0 : block;
        kvq_status st = group_rows(x + r0 * D, y + r0 * D, n, (size_t)D, (size_t)G, bits, prec, recon);
        if (st) return st;
    }
    *stored_bits = kvq_step_bits(&(kvq_step){KVQ_STEP_TOKEN, t0, t1, bits, group, prec}, 1, D, 0);
    return KVQ_OK;
}

kvq_status kvq_quant_head_per_channel(const float *x, float *y, int T, int D, int t0, int t1,
                                      int bits, int group, kvq_scale_prec prec,
                                      double *stored_bits, kvq_recon_acc *recon)
{
    (void)T;
    for (int g0 = t0; g0 < t1; g0 += group) {
        int n = t1 - g0 < group ? t1 - g0 : group;
        const float *xg = x + (size_t)g0 * D;
        float *yg = y + (size_t)g0 * D;
        kvq_status st = channels_block(xg, yg, (size_t)n, (size_t)D, bits, prec, recon);
        if (st) return st;
    }
    *stored_bits = kvq_step_bits(&(kvq_step){KVQ_STEP_CHANNEL, t0, t1, bits, group, prec}, 1, D, 0);
    return KVQ_OK;
}

/* kvq_absmax_quantize_ref on n contiguous values, the same values: the
 * largest |x| through kvq_absmax (a max is exact in any order, and both skip
 * a NaN), and the loops without a stride, so that they vectorise (the
 * reference's strided max waited 4 cycles a value). */
static kvq_status absmax_quantize_contiguous(const float *x, float *y, size_t n, int bits, kvq_scale_prec prec)
{
    if (n == 0) return KVQ_OK;
    const float qmax = (float)((1u << (bits - 1)) - 1u), qmin = -(float)(1u << (bits - 1));
    float s = kvq_round_scale(kvq_absmax(x, n) / qmax, prec);
    if (!isfinite(s)) return KVQ_ERR_NUMERIC;
    if (s == 0.0f) {
        memset(y, 0, n * sizeof *y);
        return KVQ_OK;
    }
    for (size_t i = 0; i < n; i++) {
        float v = x[i] / s;
        v = v < qmin ? qmin : (v > qmax ? qmax : v);
        y[i] = kvq_rne(v) * s;
    }
    return KVQ_OK;
}

kvq_status kvq_quant_head_absmax(const float *x, float *y, int T, int D, int t0, int t1, int bits,
                                 int group, kvq_scale_prec prec, double *stored_bits,
                                 kvq_recon_acc *recon)
{
    (void)T;
    int G = group == 0 || group > D ? D : group; /* 0: the whole head vector */
    for (int t = t0; t < t1; t++)
        for (int c0 = 0; c0 < D; c0 += G) {
            size_t o = (size_t)t * D + c0;
            kvq_status st = absmax_quantize_contiguous(x + o, y + o, (size_t)(D - c0 < G ? D - c0 : G), bits, prec);
            if (st) return st;
        }
    if (recon && t1 > t0)
        kvq_recon_accumulate(recon, x + (size_t)t0 * D, y + (size_t)t0 * D, (size_t)(t1 - t0) * D);
    *stored_bits = kvq_step_bits(&(kvq_step){KVQ_STEP_ABSMAX, t0, t1, bits, group, prec}, 1, D, 0);
    return KVQ_OK;
}

kvq_status kvq_quant_layer_per_token_span(const float *x, float *y, int H, int T, int D, int t0,
                                          int t1, int bits, int group, kvq_scale_prec prec,
                                          double *bits_per_head)
{
    size_t W = (size_t)H * D; /* the concatenated axis */
    size_t G = (size_t)group > W ? W : (size_t)group;
    float *buf = kvq_alloc_array(W, sizeof(float));
    if (!buf) return KVQ_ERR_NOMEM;
    kvq_status st = KVQ_OK;
    for (int t = t0; t < t1 && !st; t++) {
        for (int h = 0; h < H; h++) /* gather token t of every head, head-major */
            memcpy(buf + (size_t)h * D, x + ((size_t)h * T + t) * D, (size_t)D * sizeof(float));
        st = group_rows(buf, buf, 1, W, G, bits, prec, NULL);
        for (int h = 0; h < H; h++)
            memcpy(y + ((size_t)h * T + t) * D, buf + (size_t)h * D, (size_t)D * sizeof(float));
    }
    free(buf);
    if (st) return st;
    kvq_step step = {KVQ_STEP_TOKEN_LAYER, t0, t1, bits, group, prec};
    for (int h = 0; h < H && bits_per_head; h++) bits_per_head[h] = kvq_step_bits(&step, H, D, h);
    return KVQ_OK;
}

double kvq_keep_exact(const float *x, float *y, int T, int D, int t0, int t1, kvq_recon_acc *recon)
{
    (void)T;
    if (t1 <= t0) return 0.0;
    memcpy(y + (size_t)t0 * D, x + (size_t)t0 * D, (size_t)(t1 - t0) * D * sizeof(float));
    if (recon) kvq_recon_accumulate(recon, x + (size_t)t0 * D, y + (size_t)t0 * D, (size_t)(t1 - t0) * D);
    return kvq_step_bits(&(kvq_step){KVQ_STEP_EXACT, t0, t1, 16, 1, KVQ_SCALE_FP16}, 1, D, 0);
}

/* The largest |x| of K (amax[0]) and V (amax[1]) over every head of a layer
 * (fp8 and fp4 scales per tensor), heads in parallel. */
int kvq_layer_absmax(const kvq_layer *in, int nthreads, float amax[2])
{
    int H = in->H;
    size_t n = (size_t)in->T * in->D;
    float *head_max = malloc((size_t)2 * H * sizeof *head_max);
    if (!head_max) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int i = 0; i < 2 * H; i++) head_max[i] = kvq_absmax(kvq_head_in(in, i / H, i % H), n);
    amax[0] = amax[1] = 0.0f;
    for (int i = 0; i < 2 * H; i++) amax[i / H] = head_max[i] > amax[i / H] ? head_max[i] : amax[i / H];
    free(head_max);
    return 0;
}
