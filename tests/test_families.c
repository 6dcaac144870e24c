/* test_families.c — the families FP8 (docs/quantizers.md#fp8) and Tender (#tender).
 *
 * FP8: every float16 value and both sides of every rounding boundary of
 * both formats, cast by the reference and by the vectorised loop (AVX2 and
 * portable), against the format's values built here independently from
 * (exponent, mantissa) with ldexp; the scales of each `scale=` mode; bits.
 * Tender: hand-worked blocks (group boundaries hit exactly, alpha = 4,
 * TMax = 0, a short last chunk, chunk=0), span=head against span=layer,
 * bit counts, thread invariance.
 * ggml (docs/quantizers.md#ggml): hand-worked blocks of every cache type (all zero, one huge
 * value, negative only), the row layout across heads, bits, idempotence.
 * turboquant (docs/quantizers.md#turboquant): mse equals lloydmax bit for bit; prod's bits; prod's
 * scores unbiased where mse's shrink (a statistical check, fixed seeds).
 * kvquant (docs/quantizers.md#kvquant): bits by hand, sinks and outliers exact, r = 0, nuq needs
 * its calibration state, prerope refuses a dump without RoPE. */
#include "testutil.h"
#include "simd.h"
#include "math/maths.h"
#include "formats/formats.h"

#include <float.h>

/* ------------------------------------------------------------------ FP8 */

/* The non-negative finite values of a format, ascending, from its
 * definition: exponent field e, mantissa m; e = 0 is subnormal. */
typedef struct {
    double v[256];
    int code[256];
    int n;
} fp8_values;

static void build_values(kvq_fp8_format f, fp8_values *out)
{
    int ebits = f == KVQ_FP8_E4M3 ? 4 : 5, mbits = 7 - ebits, bias = f == KVQ_FP8_E4M3 ? 7 : 15;
    out->n = 0;
    for (int e = 0; e < (1 << ebits); e++)
        for (int m = 0; m < (1 << mbits); m++) {
            int code = e << mbits | m;
            if (f == KVQ_FP8_E4M3 && code == 0x7F) continue;    /* NaN */
            if (f == KVQ_FP8_E5M2 && e == (1 << ebits) - 1) continue; /* inf, NaN */
            double v = e == 0 ? ldexp((double)m, 1 - bias - mbits)
                              : ldexp(1.0 + (double)m / (1 << mbits), e - bias);
            out->v[out->n] = v, out->code[out->n] = code, out->n++;
        }
}

/* The expected cast of y: nearest value (ties to the even code), saturating. */
static float expected_cast(const fp8_values *fv, float y)
{
    if (isnan(y)) return y;
    double a = fabs((double)y), r;
    if (a >= fv->v[fv->n - 1]) {
        r = fv->v[fv->n - 1];
    } else {
        int i = 0;
        while (fv->v[i + 1] <= a) i++; /* v[i] <= a < v[i+1] */
        double lo = a - fv->v[i], hi = fv->v[i + 1] - a;
        r = lo < hi ? fv->v[i] : hi < lo ? fv->v[i + 1] : (fv->code[i] % 2 == 0 ? fv->v[i] : fv->v[i + 1]);
    }
    return signbit(y) ? -(float)r : (float)r;
}

static int same_float(float a, float b)
{
    return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b));
}

/* Checks n values by the reference and by both array paths. */
static void check_casts(kvq_fp8_format f, const fp8_values *fv, const float *y, size_t n, const char *what)
{
    float *arr = malloc(n * sizeof *arr), *arr_plain = malloc(n * sizeof *arr);
    kvq_fp8_quantize_array(y, arr, n, 1.0f, f);
    kvq_simd_force(0);
    kvq_fp8_quantize_array(y, arr_plain, n, 1.0f, f);
    kvq_simd_force(1);
    for (size_t i = 0; i < n; i++) {
        float e = expected_cast(fv, y[i]), r = kvq_fp8_cast_ref(y[i], f);
        ck_assert_msg(same_float(r, e), "%s %s: fp8(%a) = %a, expected %a", what, f ? "e5m2" : "e4m3", y[i], r, e);
        if (isnan(y[i])) continue; /* the array loop's contract: no NaN */
        ck_assert_msg(same_float(arr[i], e) && same_float(arr_plain[i], e),
                      "%s %s: array fp8(%a) = %a / %a (portable), expected %a", what, f ? "e5m2" : "e4m3", y[i],
                      arr[i], arr_plain[i], e);
    }
    free(arr), free(arr_plain);
}

START_TEST(fp8_every_float16)
{
    float *y = malloc(65536 * sizeof *y);
    for (int i = 0; i < 65536; i++) y[i] = kvq_f16_to_f32((uint16_t)i);
    for (int f = 0; f < 2; f++) {
        fp8_values fv;
        build_values((kvq_fp8_format)f, &fv);
        ck_assert_int_eq(fv.n, f ? 124 : 127);
        ck_assert(fv.v[fv.n - 1] == kvq_fp8_max((kvq_fp8_format)f));
        check_casts((kvq_fp8_format)f, &fv, y, 65536, "float16");
    }
    free(y);
}
END_TEST

START_TEST(fp8_rounding_boundaries)
{
    for (int f = 0; f < 2; f++) {
        fp8_values fv;
        build_values((kvq_fp8_format)f, &fv);
        float *y = malloc(4096 * sizeof *y);
        size_t n = 0;
        /* each value, each midpoint to the next, and their float32 neighbours */
        for (int i = 0; i < fv.n; i++) {
            float pts[2] = {(float)fv.v[i], i + 1 < fv.n ? (float)(0.5 * (fv.v[i] + fv.v[i + 1])) : (float)fv.v[i]};
            for (int p = 0; p < 2; p++) {
                ck_assert((double)pts[p] == (p ? 0.5 * (fv.v[i] + (i + 1 < fv.n ? fv.v[i + 1] : fv.v[i])) : fv.v[i]));
                float c[3] = {nextafterf(pts[p], 0.0f), pts[p], nextafterf(pts[p], INFINITY)};
                for (int k = 0; k < 3; k++) y[n++] = c[k], y[n++] = -c[k];
            }
        }
        /* beyond the largest finite value, float32 subnormals, the extremes */
        float fmax = kvq_fp8_max((kvq_fp8_format)f);
        float extra[] = {fmax * 1.0625f, fmax * 1.125f, fmax * 2.0f, 1e30f, FLT_MAX, INFINITY, FLT_MIN,
                         FLT_TRUE_MIN, 0x1p-140f, 0.0f, (float)(fv.v[1] / 2), (float)(fv.v[1] * 1.5)};
        for (size_t k = 0; k < sizeof extra / sizeof extra[0]; k++) y[n++] = extra[k], y[n++] = -extra[k];
        ck_assert(n <= 4096);
        check_casts((kvq_fp8_format)f, &fv, y, n, "boundary");
        free(y);
    }
    /* the facts of docs/quantizers.md#fp8 written out */
    ck_assert(kvq_fp8_cast_ref(464.0f, KVQ_FP8_E4M3) == 448.0f);      /* saturates, no 480 */
    ck_assert(kvq_fp8_cast_ref(-1e9f, KVQ_FP8_E4M3) == -448.0f);
    ck_assert(kvq_fp8_cast_ref(61440.0f, KVQ_FP8_E5M2) == 57344.0f);  /* IEEE would give inf */
    ck_assert(kvq_fp8_cast_ref(INFINITY, KVQ_FP8_E5M2) == 57344.0f);
    ck_assert(kvq_fp8_cast_ref(0x1p-9f, KVQ_FP8_E4M3) == 0x1p-9f);    /* smallest subnormal */
    ck_assert(kvq_fp8_cast_ref(0x1p-10f, KVQ_FP8_E4M3) == 0.0f);      /* tie: code 0 is even */
    ck_assert(kvq_fp8_cast_ref(0x3p-10f, KVQ_FP8_E4M3) == 0x1p-8f);   /* tie 1.5 units: code 2 */
    ck_assert(kvq_fp8_cast_ref(0x1p-16f, KVQ_FP8_E5M2) == 0x1p-16f);
    ck_assert(kvq_fp8_cast_ref(1.0625f, KVQ_FP8_E4M3) == 1.0f);       /* tie 1 | 1.125: even 1 */
    ck_assert(kvq_fp8_cast_ref(1.1875f, KVQ_FP8_E4M3) == 1.25f);      /* tie 1.125 | 1.25: even 1.25 */
    ck_assert(kvq_fp8_cast_ref(1.125f, KVQ_FP8_E5M2) == 1.0f);        /* tie 1 | 1.25 */
    ck_assert(isnan(kvq_fp8_cast_ref(NAN, KVQ_FP8_E4M3)));
}
END_TEST

/* Runs spec on layer L; returns the bits of each head in kb/vb [H]. */
static void run_spec(const char *text, const kvq_layer *L, float *kq, float *vq, double *kb, double *vb, int nthreads)
{
    kvq_spec sp;
    kvq_error err = {0};
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK, "%s", err.msg);
    double sb[16] = {0};
    kvq_quant_out out = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    kvq_quant_ctx ctx = {.nthreads = nthreads};
    ck_assert_msg(kvq_quantize_layer(&sp, &ctx, L, &out, &err) == KVQ_OK, "%s: %s", text, err.msg);
}

/* text parses, and running it on L is a usage error whose message contains
 * needle (e.g. a head_dim the family cannot take). */
static void expect_layer_refused(const char *text, const kvq_layer *L, const char *needle)
{
    kvq_spec sp;
    kvq_error err = {0};
    size_t n = (size_t)L->H * L->T * L->D;
    float *kq = malloc(n * sizeof *kq), *vq = malloc(n * sizeof *vq);
    double *kb = calloc((size_t)L->H, sizeof *kb), *vb = calloc((size_t)L->H, sizeof *vb);
    double *sb = calloc((size_t)L->H, sizeof *sb);
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK, "%s: %s", text, err.msg);
    kvq_quant_out out = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    kvq_quant_ctx ctx = {.nthreads = 1};
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, L, &out, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, needle), "%s: %s (expected \"%s\")", text, err.msg, needle);
    free(kq), free(vq), free(kb), free(vb), free(sb);
}

static float absmax_strided(const float *x, size_t n, size_t stride)
{
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fabsf(x[i * stride]) > m ? fabsf(x[i * stride]) : m;
    return m;
}

START_TEST(fp8_scales_and_bits)
{
    int H = 3, T = 7, D = 4;
    size_t n = (size_t)H * T * D;
    kvq_layer L;
    kvq_error err;
    ck_assert_int_eq(kvq_layer_alloc(&L, H, H, T, D, 0, &err), KVQ_OK);
    fill_normal(L.key, n, 7, 3.0);
    fill_normal(L.value, n, 8, 0.01); /* small values: scale=none lands in the subnormals */
    L.key[5] = 1000.0f;                /* beyond e4m3's range: saturates without a scale */
    float *kq = malloc(n * sizeof *kq), *vq = malloc(n * sizeof *vq);
    const char *scales[] = {"none", "tensor", "head", "token", "channel"};
    for (int f = 0; f < 2; f++)
        for (int sc = 0; sc < 5; sc++) {
            char spec[64];
            snprintf(spec, sizeof spec, "fp8:format=%s,scale=%s", f ? "e5m2" : "e4m3", scales[sc]);
            double kb[3], vb[3];
            run_spec(spec, &L, kq, vq, kb, vb, 2);
            float fmax = kvq_fp8_max((kvq_fp8_format)f);
            for (int tensor = 0; tensor < 2; tensor++) {
                const float *x = tensor ? L.value : L.key, *y = tensor ? vq : kq;
                float tmax = absmax_strided(x, n, 1);
                for (int h = 0; h < H; h++)
                    for (int t = 0; t < T; t++)
                        for (int c = 0; c < D; c++) {
                            const float *xh = x + (size_t)h * T * D;
                            float m = sc == 0 ? 0 : sc == 1 ? tmax : sc == 2 ? absmax_strided(xh, (size_t)T * D, 1)
                                    : sc == 3 ? absmax_strided(xh + (size_t)t * D, (size_t)D, 1)
                                              : absmax_strided(xh + c, (size_t)T, (size_t)D);
                            float s = m > 0 ? m / fmax : 1.0f;
                            size_t i = ((size_t)h * T + t) * D + c;
                            float e = kvq_fp8_cast_ref(x[i] / s, (kvq_fp8_format)f) * s;
                            ck_assert_msg(y[i] == e, "%s tensor %d [%d][%d][%d]: %a, expected %a", spec, tensor, h, t,
                                          c, y[i], e);
                        }
                /* bits per head: 8 per element + 32 per scale (the tensor's shared by the H heads) */
                double per_head = 8.0 * T * D + (sc == 0   ? 0
                                                 : sc == 1 ? 32.0 / H
                                                 : sc == 2 ? 32
                                                 : sc == 3 ? 32.0 * T
                                                           : 32.0 * D);
                for (int h = 0; h < H; h++) ck_assert_double_eq((tensor ? vb : kb)[h], per_head);
            }
        }
    /* without a scale the outlier saturates at 448 */
    double kb[3], vb[3];
    run_spec("fp8:scale=none", &L, kq, vq, kb, vb, 1);
    ck_assert(kq[5] == 448.0f);
    free(kq), free(vq);
    kvq_layer_free(&L);
}
END_TEST

/* ---------------------------------------------------------------- Tender */

/* A one-layer input with H heads of [T][D] given row-major per head. */
static void layer_from(kvq_layer *L, int H, int T, int D, const float *k)
{
    kvq_error err;
    ck_assert_int_eq(kvq_layer_alloc(L, H, H, T, D, 0, &err), KVQ_OK);
    size_t n = (size_t)H * T * D;
    memcpy(L->key, k, n * sizeof *k);
    memcpy(L->value, k, n * sizeof *k);
}

/* x' of one value given its group's scale and its bias, as docs/quantizers.md#tender writes it. */
static float tender_value(float x, float bias, float s, int Qm)
{
    float v = (x - bias) / s;
    v = v > Qm ? (float)Qm : v < -Qm ? (float)-Qm : v;
    return rintf(v) * s + bias;
}

START_TEST(tender_groups_on_boundaries)
{
    /* one head, 2 tokens, 4 channels; bits=4 (Qm = 7), groups=3, alpha=2.
     * c0 {-8, 8}: bias 0, CMax 8 = TMax          -> group 1, s = 8/7
     * c1 {1, 5}: bias 3, CMax 2 = TMax/4 exactly  -> group 3, s = 8/28
     * c2 {10, 18}: bias 14, CMax 4 = TMax/2       -> group 2, s = 8/14
     * c3 {0, 4.0039062}: bias 2.0019531, CMax just above TMax/4 -> group 2 */
    const float k[] = {-8, 1, 10, 0, 8, 5, 18, 4.00390625f};
    kvq_layer L;
    layer_from(&L, 1, 2, 4, k);
    float kq[8], vq[8];
    double kb[1], vb[1];
    run_spec("tender:bits=4,groups=3,alpha=2,chunk=0,span=head", &L, kq, vq, kb, vb, 1);
    const float bias[4] = {0, 3, 14, 2.001953125f};
    const int group[4] = {1, 3, 2, 2};
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 4; c++) {
            float s = 8.0f / (float)((1 << (group[c] - 1)) * 7);
            float e = tender_value(k[t * 4 + c], bias[c], s, 7);
            ck_assert_msg(kq[t * 4 + c] == e && vq[t * 4 + c] == e, "[%d][%d] %a, expected %a (group %d)", t, c,
                          kq[t * 4 + c], e, group[c]);
        }
    /* c1 comes back exact in group 3 (±2 = ±7 steps of 2/7), it would not in group 2 */
    ck_assert(fabsf(kq[1] - 1.0f) < 1e-6f && fabsf(kq[5] - 5.0f) < 1e-6f);
    kvq_layer_free(&L);

    /* alpha = 4, groups = 3: boundaries TMax/4 and TMax/16 (TMax = 16) */
    const float k4[] = {-16, 0, 0, 16, 8, 2};
    layer_from(&L, 1, 2, 3, k4); /* c0 CMax 16; c1 {0,8} CMax 4 = 16/4 -> 2; c2 {0,2} CMax 1 = 16/16 -> 3 */
    run_spec("tender:bits=3,groups=3,alpha=4,chunk=0,span=head", &L, kq, vq, kb, vb, 1);
    const float b4[3] = {0, 4, 1};
    const int g4[3] = {1, 2, 3};
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 3; c++) {
            float s = 16.0f / (float)((g4[c] == 1 ? 1 : g4[c] == 2 ? 4 : 16) * 3);
            ck_assert(kq[t * 3 + c] == tender_value(k4[t * 3 + c], b4[c], s, 3));
        }
    /* bits: 3·6 codes + 3 channels·(16 bias + 2 group bits) + 16 TMax */
    ck_assert_double_eq(kb[0], 3.0 * 6 + 3 * 18 + 16);
    kvq_layer_free(&L);
}
END_TEST

START_TEST(tender_tmax_zero_and_chunks)
{
    /* constant channels (fp16 values): TMax = 0, x' = bias = x */
    float k[12];
    for (int t = 0; t < 4; t++) k[t * 3] = 1.5f, k[t * 3 + 1] = -2.0f, k[t * 3 + 2] = 0.0f;
    kvq_layer L;
    layer_from(&L, 1, 4, 3, k);
    float kq[30], vq[30];
    double kb[2], vb[2];
    run_spec("tender", &L, kq, vq, kb, vb, 1);
    ck_assert(!memcmp(kq, k, sizeof k));
    kvq_layer_free(&L);

    /* T = 5, chunk = 2: chunks [0,2) [2,4) [4,5); the last, one token, comes
     * back as rnd(x) (bias = x rounded, CMax = |x − bias|); chunks are independent */
    float x[2][10];
    fill_normal(x[0], 10, 21, 1.0);
    memcpy(x[1], x[0], sizeof x[0]);
    x[1][0] = 50.0f; x[1][1] = -7.0f; /* chunk 0 changes */
    float out[2][10];
    for (int r = 0; r < 2; r++) {
        layer_from(&L, 1, 5, 2, x[r]);
        run_spec("tender:chunk=2,span=head,bits=8", &L, out[r], vq, kb, vb, 1);
        kvq_layer_free(&L);
    }
    ck_assert(memcmp(out[0], out[1], 4 * sizeof(float)) != 0);
    ck_assert(!memcmp(out[0] + 4, out[1] + 4, 6 * sizeof(float)));
    for (int c = 0; c < 2; c++) ck_assert(fabsf(out[0][8 + c] - x[0][8 + c]) <= fabsf(x[0][8 + c]) * 0x1p-9f);
    /* bits: 8·10 + 3 chunks · (2·(16 + 3) + 16) */
    ck_assert_double_eq(kb[0], 80.0 + 3 * (2 * 19 + 16));

    /* chunk = 0, chunk = T and chunk > T are one chunk */
    float y[3][40], in[40], yv[40];
    fill_normal(in, 40, 22, 2.0);
    const char *specs[3] = {"tender:chunk=0", "tender:chunk=10", "tender:chunk=999"};
    for (int r = 0; r < 3; r++) {
        layer_from(&L, 2, 10, 2, in);
        run_spec(specs[r], &L, y[r], yv, kb, vb, 1);
        kvq_layer_free(&L);
    }
    ck_assert(!memcmp(y[0], y[1], sizeof y[0]) && !memcmp(y[0], y[2], sizeof y[0]));
}
END_TEST

START_TEST(tender_span_head_and_layer)
{
    /* head 1 = head 0 / 8: with alpha = 2 everything scales by 2^-3 under
     * span=head; under span=layer head 1's channels sit 3 groups lower,
     * which is the same unless the groups run out (groups=2) */
    int H = 2, T = 16, D = 8;
    float k[256];
    fill_normal(k, 128, 31, 4.0);
    for (int c = 0; c < D; c++) k[c] = 6.0f, k[D + c] = -6.0f; /* every CMax within 2^2 of TMax */
    for (int i = 0; i < 128; i++) k[128 + i] = k[i] / 8.0f;
    kvq_layer L;
    layer_from(&L, H, T, D, k);
    float y[4][256], vq[256];
    double kb[4][2], vb[2];
    run_spec("tender:span=head,groups=8", &L, y[0], vq, kb[0], vb, 2);
    run_spec("tender:span=layer,groups=8", &L, y[1], vq, kb[1], vb, 2);
    run_spec("tender:span=head,groups=2", &L, y[2], vq, kb[2], vb, 2);
    run_spec("tender:span=layer,groups=2", &L, y[3], vq, kb[3], vb, 2);
    for (int i = 0; i < 128; i++) {
        ck_assert(y[0][128 + i] == y[0][i] / 8.0f);
        ck_assert(y[2][128 + i] == y[2][i] / 8.0f);
    }
    ck_assert(!memcmp(y[0], y[1], sizeof y[0]));
    /* groups=2 under span=layer: head 0 as span=head, head 1 coarser */
    ck_assert(!memcmp(y[3], y[2], 128 * sizeof(float)));
    double e_head = 0, e_layer = 0;
    for (int i = 128; i < 256; i++) e_head += fabs(y[2][i] - k[i]), e_layer += fabs(y[3][i] - k[i]);
    ck_assert_msg(e_layer > 2 * e_head, "span=layer %g, span=head %g", e_layer, e_head);
    /* bits: one TMax per chunk per head, or shared by the 2 heads */
    ck_assert_double_eq(kb[0][0], 4.0 * 128 + 8 * (16 + 3) + 16);
    ck_assert_double_eq(kb[1][0], 4.0 * 128 + 8 * (16 + 3) + 8);
    ck_assert_double_eq(kb[3][1], 4.0 * 128 + 8 * (16 + 1) + 8);
    kvq_layer_free(&L);
}
END_TEST

START_TEST(families_usage_errors)
{
    const char *bad[][2] = {{"fp8:format=e3m4", "format"}, {"fp8:scale=block", "scale"}, {"tender:alpha=1", "alpha"},
                            {"tender:groups=0", "groups"}, {"tender:groups=65", "groups"}, {"tender:bits=1", "bits"},
                            {"tender:chunk=-1", "chunk"}, {"tender:span=token", "span"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvq_spec sp;
        kvq_error err = {0};
        ck_assert_int_eq(kvq_spec_parse(bad[i][0], &sp, &err), KVQ_ERR_USAGE);
        ck_assert_msg(strstr(err.msg, bad[i][1]) != NULL, "%s: %s", bad[i][0], err.msg);
    }
}
END_TEST

/* ---------------------------------------------------------------- ggml */

/* the eight cache types, in the order of the `ktype` choices */
static const int types[] = {KVQ_GGML_Q8_0, KVQ_GGML_Q4_0, KVQ_GGML_Q4_1, KVQ_GGML_Q5_0,
                            KVQ_GGML_Q5_1, KVQ_GGML_IQ4_NL, KVQ_GGML_F16, KVQ_GGML_BF16};

static void ggml_round_trip(int type, const float *x, float *y, size_t n)
{
    uint8_t blk[4 * 64];
    ck_assert(n <= 64 && kvq_ggml_quantize_ref(type, x, blk, n));
    kvq_ggml_dequantize(type, blk, y, n);
}

START_TEST(ggml_hand_blocks)
{
    float x[32], y[32];
    /* an all-zero block comes back zero (d = 0, no division by it) */
    memset(x, 0, sizeof x);
    for (int i = 0; i < 8; i++) {
        ggml_round_trip(types[i], x, y, 32);
        for (int j = 0; j < 32; j++) ck_assert_msg(y[j] == 0.0f, "%s", kvq_ggml_type_name(types[i]));
    }
    /* q8_0, one huge value: d = fp16(1000/127) = 7.875; 1000 -> 127·7.875, 0.5 -> 0 */
    for (int j = 0; j < 32; j++) x[j] = j ? 0.5f : 1000.0f;
    ggml_round_trip(KVQ_GGML_Q8_0, x, y, 32);
    ck_assert(y[0] == 127 * 7.875f);
    for (int j = 1; j < 32; j++) ck_assert(y[j] == 0.0f);
    /* q8_0 rounds half away from zero (roundf), not to even: with 127 the
     * largest, d = 1 and the values are their own codes */
    {
        const float in[] = {127.0f, 0.5f, -0.5f, 1.5f, 2.5f, -2.5f, 0x1.fffffep-2f, -0x1.fffffep-2f, 126.5f, -126.5f};
        const float out[] = {127.0f, 1.0f, -1.0f, 2.0f, 3.0f, -3.0f, 0.0f, 0.0f, 127.0f, -127.0f};
        memset(x, 0, sizeof x);
        memcpy(x, in, sizeof in);
        ggml_round_trip(KVQ_GGML_Q8_0, x, y, 32);
        for (size_t j = 0; j < sizeof in / sizeof in[0]; j++)
            ck_assert_msg(y[j] == out[j], "q8_0 %a -> %g, expected %g", (double)in[j], (double)y[j], (double)out[j]);
    }
    /* q4_0, negative only: max = -32, d = -32/-8 = 4; trunc(x/4 + 8.5) - 8 steps of 4 */
    for (int j = 0; j < 32; j++) x[j] = -(float)(j + 1);
    ggml_round_trip(KVQ_GGML_Q4_0, x, y, 32);
    ck_assert(y[0] == 0.0f && y[1] == 0.0f && y[2] == -4.0f && y[5] == -4.0f && y[6] == -8.0f && y[31] == -32.0f);
    /* q4_1, negative only: min -2 stored exactly, d = fp16(1/15); -1 -> 15 steps */
    for (int j = 0; j < 32; j++) x[j] = -1.0f - (float)j / 31.0f;
    ggml_round_trip(KVQ_GGML_Q4_1, x, y, 32);
    ck_assert(y[31] == -2.0f);
    ck_assert(y[0] == 15.0f * kvq_round_f16(1.0f / 15.0f) + -2.0f);
    /* q5_0 and q5_1 on their own grids: exact */
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16);
    ggml_round_trip(KVQ_GGML_Q5_0, x, y, 32);
    ck_assert(!memcmp(x, y, sizeof x));
    for (int j = 0; j < 32; j++) x[j] = (float)j;
    ggml_round_trip(KVQ_GGML_Q5_1, x, y, 32);
    ck_assert(!memcmp(x, y, sizeof x));
    /* iq4_nl on its own levels times 1/64: d0 = max/-127 = 1/64 picks them,
     * the least-squares d is 1/64 again (exact in fp16): exact */
    static const int lv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    for (int j = 0; j < 32; j++) x[j] = (float)lv[(j * 7) % 16] / 64.0f;
    ggml_round_trip(KVQ_GGML_IQ4_NL, x, y, 32);
    for (int j = 0; j < 32; j++) ck_assert_msg(y[j] == x[j], "iq4_nl [%d] %a vs %a", j, y[j], x[j]);
    /* iq4_nl's level choice (ggml's best_index_int8) on each midpoint (a
     * tie: the upper level) and just below it (the lower), and on both end
     * levels: with x[0] = -127/64 the largest, d0 = 1/64 and the scaled
     * values are x·64 exactly */
    {
        float al[32];
        int want[32], m = 0;
        al[m] = -127.0f, want[m++] = 0;
        for (int k = 0; k + 1 < 16 && m + 2 <= 32; k++) {
            float mid = 0.5f * (float)(lv[k] + lv[k + 1]); /* a half-integer or an integer: exact */
            al[m] = mid, want[m++] = k + 1;
            al[m] = nextafterf(mid, -1e9f), want[m++] = k;
        }
        ck_assert(m == 31);
        al[31] = 113.0f, want[31] = 15;
        for (int j = 0; j < 32; j++) x[j] = al[j] / 64.0f;
        uint8_t blk[18];
        ck_assert(kvq_ggml_quantize_ref(KVQ_GGML_IQ4_NL, x, blk, 32));
        for (int j = 0; j < 32; j++) {
            int idx = j < 16 ? blk[2 + j] & 0x0F : blk[2 + j - 16] >> 4;
            ck_assert_msg(idx == want[j], "iq4_nl level of %g: %d, expected %d", (double)al[j], idx, want[j]);
        }
    }
    /* f16 and bf16: round to nearest even */
    x[0] = 1.0f + 0x1p-11f, x[1] = 1.0f + 0x3p-11f, x[2] = 1.0f + 0x1p-8f, x[3] = 1.0f + 0x3p-8f;
    ggml_round_trip(KVQ_GGML_F16, x, y, 2);
    ck_assert(y[0] == 1.0f && y[1] == 1.0f + 0x1p-9f);
    ggml_round_trip(KVQ_GGML_BF16, x + 2, y, 2);
    ck_assert(y[0] == 1.0f && y[1] == 1.0f + 0x1p-6f);
    /* idempotent: a second round trip changes nothing (as ggml's) */
    for (int i = 0; i < 8; i++)
        for (int rep = 0; rep < 50; rep++) {
            float z[32], w[32];
            fill_normal(x, 32, 100 + rep, rep % 5 ? 1.0 : 1e-3);
            ggml_round_trip(types[i], x, y, 32);
            ggml_round_trip(types[i], y, z, 32);
            ggml_round_trip(types[i], z, w, 32);
            ck_assert_msg(!memcmp(y, z, sizeof y) && !memcmp(z, w, sizeof z), "%s", kvq_ggml_type_name(types[i]));
        }
}
END_TEST

/* kvq_ggml_quantize (q8_0's blocks in lanes) writes the reference's bytes:
 * normal blocks at scales from the subnormals to near overflow, and blocks
 * with a NaN, an infinity, a zero, a tie at .5 of a step, or values whose
 * scaled copies reach 2^23 (an infinite or huge id), for every cache type. */
START_TEST(ggml_quantize_equals_reference)
{
    static const double scales[] = {1e-42, 1e-39, 1e-30, 1e-3, 1.0, 7.0, 1e4, 1e30, 1e36};
    static const float odd[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 0x1p-149f, FLT_MAX, -FLT_MAX, 127.5f, -0.5f};
    const int nt = sizeof types / sizeof types[0];
    for (int i = 0; i < nt; i++)
        for (int rep = 0; rep < 400; rep++) {
            float x[64];
            uint8_t a[4 * 64], b[4 * 64];
            fill_normal(x, 64, 900 + rep, scales[rep % 9]);
            if (rep % 3 == 1) x[rep % 64] = odd[rep / 3 % 10];
            if (rep % 7 == 2) x[0] = 127.0f, x[5] = 2.5f, x[9] = -3.5f; /* d = 1: ties away from zero */
            memset(a, 0xA5, sizeof a), memset(b, 0x5A, sizeof b);
            ck_assert(kvq_ggml_quantize_ref(types[i], x, a, 64) && kvq_ggml_quantize(types[i], x, b, 64));
            size_t bytes;
            int vals;
            kvq_ggml_type_size(types[i], &vals, &bytes);
            ck_assert_msg(!memcmp(a, b, 64 / vals * bytes), "%s, block set %d", kvq_ggml_type_name(types[i]), rep);
        }
}
END_TEST

START_TEST(ggml_rows_bits_and_errors)
{
    /* H = 2, D = 32: a token's row of 64 values is two blocks, one per head */
    int H = 2, T = 3, D = 32;
    size_t n = (size_t)H * T * D;
    float k[192], kq[192], vq[192];
    fill_normal(k, n, 41, 2.0);
    kvq_layer L;
    layer_from(&L, H, T, D, k);
    const char *names[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "f16", "bf16"};
    const double bpe[] = {8.5, 4.5, 5, 5.5, 6, 4.5, 16, 16};
    for (int i = 0; i < 8; i++) {
        char spec[64];
        snprintf(spec, sizeof spec, "ggml:ktype=%s,vtype=%s", names[i], names[(i + 3) % 8]);
        double kb[2], vb[2];
        run_spec(spec, &L, kq, vq, kb, vb, 2);
        ck_assert_double_eq(kb[0], bpe[i] * T * D);
        ck_assert_double_eq(vb[1], bpe[(i + 3) % 8] * T * D);
        for (int t = 0; t < T; t++) { /* x' = dequantize(quantize(row of both heads)) */
            float row[64], back[64];
            for (int h = 0; h < H; h++) memcpy(row + h * D, k + ((size_t)h * T + t) * D, D * sizeof(float));
            ggml_round_trip(types[i], row, back, 64);
            for (int h = 0; h < H; h++)
                ck_assert(!memcmp(back + h * D, kq + ((size_t)h * T + t) * D, D * sizeof(float)));
        }
    }
    kvq_layer_free(&L);
    /* head_dim 16 with H·D = 48: block types refuse it (llama.cpp's rule,
     * even where H·D would be a multiple of 32), f16 and bf16 take it */
    layer_from(&L, 3, 2, 16, k);
    expect_layer_refused("ggml:ktype=f16,vtype=q4_0", &L,
                         "vtype=q4_0: head_dim 16 is not a multiple of the 32-value blocks (llama.cpp refuses");
    kvq_spec sp;
    kvq_error err = {0};
    double kb[3], vb[3];
    ck_assert_int_eq(kvq_spec_parse("ggml:ktype=f16,vtype=q4_0", &sp, &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_check_shape(&sp, 16, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_spec_check_shape(&sp, 64, &err), KVQ_OK);
    run_spec("ggml:ktype=f16,vtype=bf16", &L, kq, vq, kb, vb, 1);
    kvq_layer_free(&L);
}
END_TEST

/* ------------------------------------------------------------------ fp4 */

/* One MXFP4 block of 32 through ggml's format and back. */
static void mxfp4_round_trip(const float *x, float *y, uint8_t *e)
{
    uint8_t blk[17];
    kvq_mxfp4_block_ref(x, blk);
    kvq_mxfp4_block_dequantize(blk, y);
    if (e) *e = blk[0];
}

/* One NVFP4 block of 16 with second-level scale g (rne as the family uses it). */
static void nvfp4_round_trip(const float *x, float *y, float g, int rne, uint8_t *scale)
{
    uint8_t sc, qs[8];
    kvq_nvfp4_block_ref(x, g, rne, &sc, qs);
    kvq_nvfp4_block_dequantize(sc, qs, g, y);
    if (scale) *scale = sc;
}

START_TEST(fp4_hand_blocks)
{
    float x[32], y[32];
    uint8_t e;
    /* all zero: E8M0 0 and UE4M3 0, every value back as 0 */
    memset(x, 0, sizeof x);
    mxfp4_round_trip(x, y, &e);
    ck_assert_int_eq(e, 0);
    for (int j = 0; j < 32; j++) ck_assert(y[j] == 0.0f);
    nvfp4_round_trip(x, y, 1.0f, 0, &e);
    ck_assert_int_eq(e, 0);
    for (int j = 0; j < 16; j++) ck_assert(y[j] == 0.0f);
    /* one huge value: amax 1000, floor(log2) = 9, e = 134, half-scale 2^6;
     * 1000/64 = 15.6 takes the largest doubled value 12 -> 768; 0.5 -> 0 */
    for (int j = 0; j < 32; j++) x[j] = j == 5 ? 1000.0f : 0.5f;
    mxfp4_round_trip(x, y, &e);
    ck_assert_int_eq(e, 134);
    for (int j = 0; j < 32; j++) ck_assert(y[j] == (j == 5 ? 768.0f : 0.0f));
    /* negative only, amax 10: e = 128, half-scale 1, so the doubled values
     * are the grid {0, 1, 2, 3, 4, 6, 8, 12}; midpoints go to the first of
     * equals in ggml's table order: the smaller magnitude */
    {
        const float in[] = {-0.5f, -1.5f, -2.5f, -3.5f, -5.0f, -7.0f, -10.0f, -0.0f, -0.75f, -5.5f, -11.0f, -1.0f};
        const float out[] = {0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, 0.0f, -1.0f, -6.0f, -12.0f, -1.0f};
        for (int j = 0; j < 32; j++) x[j] = -1.0f;
        memcpy(x, in, sizeof in);
        mxfp4_round_trip(x, y, &e);
        ck_assert_int_eq(e, 128);
        for (size_t j = 0; j < sizeof in / sizeof in[0]; j++)
            ck_assert_msg(y[j] == out[j], "mxfp4 %g -> %g, expected %g", (double)in[j], (double)y[j], (double)out[j]);
        /* the same midpoints positive: smaller magnitude too */
        for (size_t j = 0; j < sizeof in / sizeof in[0]; j++) x[j] = -in[j];
        for (int j = sizeof in / sizeof in[0]; j < 32; j++) x[j] = 1.0f;
        mxfp4_round_trip(x, y, &e);
        for (size_t j = 0; j < sizeof in / sizeof in[0]; j++) ck_assert(y[j] == -out[j] + 0.0f);
    }
    /* code choice: index 0 for +-0 and for every value nearer 0 than half the first step */
    ck_assert_int_eq(kvq_e2m1_index(-0.0f, 1.0f), 0);
    ck_assert_int_eq(kvq_e2m1_index(-0.5f, 1.0f), 0);
    ck_assert_int_eq(kvq_e2m1_index(-0.50001f, 1.0f), 9);
    ck_assert_int_eq(kvq_e2m1_index(14.0f, 1.0f), 7);
    ck_assert_int_eq(kvq_e2m1_index(-14.0f, 1.0f), 15);
    /* E8M0 at the exponent extremes */
    ck_assert_int_eq(kvq_e8m0_mxfp4(0x1.8p126f), 251);
    ck_assert_int_eq(kvq_e8m0_mxfp4(FLT_MAX), 253);          /* log2f rounds to 128 */
    ck_assert_int_eq(kvq_e8m0_mxfp4(0x1p-120f), 5);
    ck_assert_int_eq(kvq_e8m0_mxfp4(0x1p-125f), 0);
    ck_assert_int_eq(kvq_e8m0_mxfp4(0x1p-126f), 0);          /* ggml's cast is undefined below: kvq keeps 0 */
    ck_assert_int_eq(kvq_e8m0_mxfp4(0x1p-149f), 0);
    ck_assert(kvq_e8m0_half(0) == 0x1p-128f && kvq_e8m0_half(1) == 0x1p-127f && kvq_e8m0_half(2) == 0x1p-126f);
    ck_assert(kvq_e8m0_half(128) == 1.0f && kvq_e8m0_half(254) == 0x1p126f);
    for (int j = 0; j < 32; j++) x[j] = j ? -0x1p124f : 0x1.8p126f;
    mxfp4_round_trip(x, y, &e);
    ck_assert_int_eq(e, 251);
    ck_assert(y[0] == 0x1.8p126f && y[1] == -0x1p124f); /* 12 and 2 times the half-scale 2^123 */
    /* FLT_MAX: e = 253; FLT_MAX/2^125 is nearest 8, but 8·2^125 overflows
     * in float and so does its error: 6·2^125 is chosen, as in ggml (the
     * values stay finite for any finite input) */
    x[0] = FLT_MAX;
    mxfp4_round_trip(x, y, &e);
    ck_assert(e == 253 && y[0] == 0x1.8p127f);
    for (int j = 0; j < 32; j++) x[j] = j ? 0x1p-149f : 0x1p-126f; /* e = 0: half-scale 2^-128 */
    mxfp4_round_trip(x, y, &e);
    ck_assert_int_eq(e, 0);
    ck_assert(y[0] == 0x1p-126f && y[1] == 0.0f); /* 4 times the half-scale */
    /* UE4M3: rounding half up in the mantissa, subnormals, underflow and saturation */
    ck_assert_int_eq(kvq_ue4m3_encode(1.0f), 7 << 3);
    ck_assert_int_eq(kvq_ue4m3_encode(1.0625f), 7 << 3 | 1);       /* a tie: up */
    ck_assert_int_eq(kvq_ue4m3_encode_rne(1.0625f), 7 << 3);        /* a tie: to even */
    ck_assert_int_eq(kvq_ue4m3_encode(0x1p-9f), 1);                 /* smallest subnormal */
    ck_assert_int_eq(kvq_ue4m3_encode(0x1p-10f), 1);                /* half of it: up */
    ck_assert_int_eq(kvq_ue4m3_encode(0x1.fp-11f), 0);              /* below: underflow */
    ck_assert_int_eq(kvq_ue4m3_encode(448.0f), 0x7E);
    ck_assert_int_eq(kvq_ue4m3_encode(1e30f), 0x7E);                /* saturates */
    ck_assert_int_eq(kvq_ue4m3_encode(300.0f), 0x7E);               /* ggml: [256, 448) -> 448 */
    ck_assert_int_eq(kvq_ue4m3_encode_rne(300.0f), 15 << 3 | 1);    /* E4M3: 288 */
    ck_assert_int_eq(kvq_ue4m3_encode_rne(1e30f), 0x7E);
    ck_assert_int_eq(kvq_ue4m3_encode_rne(0x1p-10f), 0);            /* a tie with 0: to even */
    ck_assert(kvq_ue4m3_half(0x7E) == 224.0f && kvq_ue4m3_half(1) == 0x1p-10f && kvq_ue4m3_half(0x7F) == 0.0f);
    ck_assert(kvq_ue4m3_half(15 << 3 | 1) == 144.0f);
    /* every code the RNE encoder makes decodes to the E4M3 value it rounded to */
    for (int c = 1; c < 0x7F; c++) {
        float v = 2.0f * kvq_ue4m3_half((uint8_t)c);
        ck_assert_int_eq(kvq_ue4m3_encode_rne(v), c);
        ck_assert(v == kvq_fp8_cast_ref(v, KVQ_FP8_E4M3));
    }
    /* NVFP4 scale underflow: amax/6 below 2^-10 gives scale 0, the block comes back 0 */
    for (int j = 0; j < 16; j++) x[j] = j % 2 ? 1e-4f : -5e-4f;
    nvfp4_round_trip(x, y, 1.0f, 0, &e);
    ck_assert_int_eq(e, 0);
    for (int j = 0; j < 16; j++) ck_assert(y[j] == 0.0f);
    /* NVFP4 saturation: amax 6000, scale 448 (half 224), 6000 -> 12·224 =
     * 2688; 150 -> 1·224 (E2M1 0.5), 100 -> 0 */
    for (int j = 0; j < 16; j++) x[j] = j == 0 ? 6000.0f : j == 1 ? 150.0f : 100.0f;
    nvfp4_round_trip(x, y, 1.0f, 0, &e);
    ck_assert_int_eq(e, 0x7E);
    ck_assert(y[0] == 2688.0f && y[1] == 224.0f && y[2] == 0.0f);
}
END_TEST

/* The fast rounding the family runs equals ggml's 16-way search on every
 * float16 value (both signs, 0, subnormals) at half-scales that are powers
 * of two (mxfp4), E4M3 values (nvfp4) and arbitrary floats (E4M3 · g),
 * including 0 (an underflowed scale); run at every SIMD level by the simd suite. */
START_TEST(fp4_fast_round_equals_reference)
{
    const float ds[] = {1.0f, 0x1p-20f, 0x1p-128f, 0x1p100f, 0x1p125f, 0.0f, 224.0f, 0x1.4p-3f, 0x1.ep-10f,
                        0.3748f * 1.7e-3f, 3.14159f, 1e-30f};
    enum { N = 65536 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    for (int i = 0; i < N; i++) x[i] = kvq_f16_to_f32((uint16_t)i);
    for (int i = 0; i < N; i++)
        if (!isfinite(x[i])) x[i] = 0.5f;
    for (size_t k = 0; k < sizeof ds / sizeof ds[0]; k++)
        for (int m = 0; m < 3; m++) { /* the values as they are, scaled to the grid, and near its midpoints */
            float *xs = malloc(N * sizeof *xs);
            for (int i = 0; i < N; i++) xs[i] = m == 0 ? x[i] : m == 1 ? x[i] * ds[k] : nextafterf(x[i] * ds[k], 0.0f);
            kvq_fp4_round(xs, y, N, ds[k]);
            for (int i = 0; i < N; i++) {
                float want = (float)kvq_e2m1_doubled[kvq_e2m1_index(xs[i], ds[k])] * ds[k];
                if (memcmp(&want, &y[i], 4)) /* (ck_assert per value would write to check's pipe each time) */
                    ck_abort_msg("d %a x %a: %a, expected %a", (double)ds[k], (double)xs[i], (double)y[i],
                                 (double)want);
            }
            free(xs);
        }
    free(x), free(y);
}
END_TEST

/* nvfp4 with a second-level scale, by hand on two blocks (one head, one
 * token of 32): global=tensor/head g = amax/2688 = 2 for amax 5376 */
START_TEST(fp4_global_scales_by_hand)
{
    int H = 1, T = 1, D = 32;
    float k[32], kq[32], vq[32];
    for (int j = 0; j < 16; j++) k[j] = j ? 100.0f : 5376.0f; /* block A: s = 5376/6/2 = 448 */
    for (int j = 16; j < 32; j++) k[j] = j == 16 ? 96.0f : 20.0f; /* block B: s = 96/6/2 = 8 */
    kvq_layer L;
    layer_from(&L, H, T, D, k);
    const char *specs[] = {"fp4:format=nvfp4,global=tensor", "fp4:format=nvfp4,global=head",
                           "fp4:format=nvfp4,global=token"};
    for (int i = 0; i < 3; i++) {
        double kb[1], vb[1];
        run_spec(specs[i], &L, kq, vq, kb, vb, 1);
        /* A: half-scale 224·2 = 448, 5376 -> 12·448, 100/448 -> 0;
         * B: half-scale 4·2 = 8, 96 -> 12·8, 20/8 = 2.5, a tie -> 2·8 = 16 */
        ck_assert_msg(kq[0] == 5376.0f && kq[1] == 0.0f && kq[16] == 96.0f && kq[17] == 16.0f, "%s: %g %g %g %g",
                      specs[i], (double)kq[0], (double)kq[1], (double)kq[16], (double)kq[17]);
        ck_assert(!memcmp(kq, vq, sizeof kq));
        ck_assert_double_eq(kb[0], 4.5 * 32 + 32.0); /* one g: per tensor of 1 head, per head, per token */
    }
    /* global=none on the same blocks: ggml's nvfp4; A's scale 896 saturates to 448 (half 224) */
    double kb[1], vb[1];
    run_spec("fp4:format=nvfp4", &L, kq, vq, kb, vb, 1);
    ck_assert(kq[0] == 2688.0f && kq[16] == 96.0f);
    ck_assert_double_eq(kb[0], 4.5 * 32);
    kvq_layer_free(&L);
    /* bits of g: 32/H per head (tensor), 32 per head, 32 per token */
    H = 2, T = 3;
    float big[192], bq[192], bv[192];
    fill_normal(big, 192, 5, 1.0);
    layer_from(&L, H, T, D, big);
    double b2[2], v2[2];
    run_spec("fp4:format=nvfp4,global=tensor", &L, bq, bv, b2, v2, 1);
    ck_assert_double_eq(b2[1], 4.5 * T * D + 16.0);
    run_spec("fp4:format=nvfp4,global=token", &L, bq, bv, b2, v2, 1);
    ck_assert_double_eq(b2[0], 4.5 * T * D + 32.0 * T);
    run_spec("fp4", &L, bq, bv, b2, v2, 1);
    ck_assert_double_eq(b2[0], 4.25 * T * D);
    kvq_layer_free(&L);
}
END_TEST

/* The family equals ggml's row functions on each token's head-major row
 * (blocks never span heads), round trips are idempotent, head_dim must be a
 * multiple of the block. */
START_TEST(fp4_rows_idempotent_and_shape)
{
    int H = 2, T = 5, D = 64;
    size_t n = (size_t)H * T * D;
    float *k = malloc(n * sizeof *k), *kq = malloc(n * sizeof *kq), *vq = malloc(n * sizeof *vq);
    float *k2 = malloc(n * sizeof *k2), *v2 = malloc(n * sizeof *v2);
    fill_normal(k, n, 77, 3.0);
    for (size_t i = 0; i < n; i += 37) k[i] *= 40.0f; /* outliers */
    kvq_layer L, L2;
    layer_from(&L, H, T, D, k);
    const char *specs[] = {"fp4:format=mxfp4", "fp4:format=nvfp4"};
    const int fp4_types[] = {KVQ_GGML_MXFP4, KVQ_GGML_NVFP4};
    for (int i = 0; i < 2; i++) {
        double kb[2], vb[2];
        run_spec(specs[i], &L, kq, vq, kb, vb, 2);
        for (int t = 0; t < T; t++) {
            float row[128], back[128];
            uint8_t blk[4 * 36];
            for (int h = 0; h < H; h++) memcpy(row + h * D, k + ((size_t)h * T + t) * D, D * sizeof(float));
            ck_assert(kvq_ggml_quantize_ref(fp4_types[i], row, blk, 128));
            kvq_ggml_dequantize(fp4_types[i], blk, back, 128);
            for (int h = 0; h < H; h++)
                ck_assert_msg(!memcmp(back + h * D, kq + ((size_t)h * T + t) * D, D * sizeof(float)), "%s", specs[i]);
        }
        /* idempotent: quantizing x' again gives x' */
        layer_from(&L2, H, T, D, kq);
        run_spec(specs[i], &L2, k2, v2, kb, vb, 1);
        ck_assert_msg(!memcmp(k2, kq, n * sizeof *kq), "%s not idempotent", specs[i]);
        kvq_layer_free(&L2);
    }
    /* the two-level variants: idempotent up to g's float rounding */
    const char *gspecs[] = {"fp4:format=nvfp4,global=tensor", "fp4:format=nvfp4,global=head",
                            "fp4:format=nvfp4,global=token"};
    for (int i = 0; i < 3; i++) {
        double kb[2], vb[2];
        run_spec(gspecs[i], &L, kq, vq, kb, vb, 2);
        layer_from(&L2, H, T, D, kq);
        run_spec(gspecs[i], &L2, k2, v2, kb, vb, 1);
        for (size_t j = 0; j < n; j++)
            ck_assert_msg(fabsf(k2[j] - kq[j]) <= 1e-6f * fabsf(kq[j]), "%s [%zu] %g vs %g", gspecs[i], j,
                          (double)k2[j], (double)kq[j]);
        kvq_layer_free(&L2);
    }
    kvq_layer_free(&L);
    /* head_dim 48: a multiple of nvfp4's 16, not of mxfp4's 32 */
    layer_from(&L, 2, 2, 48, k);
    expect_layer_refused("fp4", &L, "fp4: head_dim 48 is not a multiple of the 32-value blocks");
    kvq_spec sp;
    kvq_error err = {0};
    double kb[2], vb[2];
    run_spec("fp4:format=nvfp4", &L, kq, vq, kb, vb, 1);
    kvq_layer_free(&L);
    /* mxfp4 takes no second-level scale */
    ck_assert_int_eq(kvq_spec_parse("fp4:global=tensor", &sp, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "global"), "%s", err.msg);
    free(k), free(kq), free(vq), free(k2), free(v2);
}
END_TEST

/* ----------------------------------------------------------- turboquant */

START_TEST(turboquant_mse_prod)
{
    int H = 4, T = 2000, D = 64;
    size_t n = (size_t)H * T * D;
    kvq_layer L;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_layer_alloc(&L, H, H, T, D, 0, &err), KVQ_OK);
    fill_normal(L.key, n, 5, 1.0);
    fill_normal(L.value, n, 6, 1.0);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float)), *va = malloc(n * sizeof(float));
    float *vb2 = malloc(n * sizeof(float));
    double ka[4], vka[4], kb[4], vkb[4];
    /* variant=mse is lloydmax at the same bits and rotation, to the last bit */
    const char *pairs[][2] = {{"turboquant:variant=mse,bits=3", "lloydmax:bits=3"},
                              {"turboquant:variant=mse,bits=2,rotate=hadamard", "lloydmax:bits=2,rotate=hadamard"}};
    for (int i = 0; i < 2; i++) {
        run_spec(pairs[i][0], &L, a, va, ka, vka, 2);
        run_spec(pairs[i][1], &L, b, vb2, kb, vkb, 2);
        ck_assert_msg(!memcmp(a, b, n * sizeof(float)) && !memcmp(va, vb2, n * sizeof(float)), "%s", pairs[i][0]);
        ck_assert(!memcmp(ka, kb, sizeof ka));
    }
    /* prod: ((b-1)·D + 16 + D + 16) bits per token and head */
    run_spec("turboquant:bits=3", &L, b, vb2, kb, vkb, 2);
    ck_assert_double_eq(kb[0] / ((double)T * D), ((3.0 - 1) * D + D + 32) / D);
    /* scores q·x' against q·x for queries correlated with the keys
     * (q = x + N(0, 1)): Lloyd-Max shrinks them (about -3.3% at 3 bits),
     * QJL makes them unbiased (observed |bias| < 0.1% over three seeds; the
     * check allows 0.5%) */
    float *q = malloc(n * sizeof(float));
    fill_normal(q, n, 7, 1.0);
    for (size_t i = 0; i < n; i++) q[i] += L.key[i];
    const char *specs[2] = {"turboquant:variant=mse,bits=3", "turboquant:bits=3"};
    for (int sidx = 0; sidx < 2; sidx++) {
        kvq_spec sp;
        ck_assert_int_eq(kvq_spec_parse(specs[sidx], &sp, &err), KVQ_OK);
        double sb[4] = {0};
        kvq_quant_out out = {.key = a, .value = va, .k_bits = ka, .v_bits = vka, .static_bytes = sb};
        kvq_quant_ctx ctx = {.nthreads = 2, .seed = 11};
        ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, &L, &out, &err), KVQ_OK);
        double err_sum = 0, score_sum = 0;
        for (size_t t = 0; t < (size_t)H * T; t++) {
            double s0 = 0, s1 = 0;
            for (int c = 0; c < D; c++)
                s0 += (double)q[t * D + c] * L.key[t * D + c], s1 += (double)q[t * D + c] * a[t * D + c];
            err_sum += s1 - s0, score_sum += s0;
        }
        double bias = err_sum / score_sum;
        if (sidx == 0) ck_assert_msg(bias < -0.02, "mse: relative score bias %g, expected about -0.033", bias);
        else ck_assert_msg(fabs(bias) < 0.005, "prod: relative score bias %g, expected about 0", bias);
        /* static: rotations, codebooks and (prod) the QJL matrices of K and V */
        ck_assert_double_eq(sb[0], 2.0 * (4.0 * D * D + 4.0 * (sidx ? 4 : 8) + (sidx ? 4.0 * D * D : 0)));
    }
    free(q), free(a), free(b), free(va), free(vb2);
    kvq_layer_free(&L);
    /* prod needs a bit for Lloyd-Max */
    kvq_spec sp;
    ck_assert_int_eq(kvq_spec_parse("turboquant:bits=1", &sp, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "bits=1: variant=prod needs bits >= 2"), "%s", err.msg);
    ck_assert_int_eq(kvq_spec_parse("turboquant:bits=1,variant=mse", &sp, &err), KVQ_OK);
}
END_TEST

/* -------------------------------------------------------------- kvquant */

START_TEST(kvquant_rows)
{
    int H = 2, T = 40, D = 8;
    size_t n = (size_t)H * T * D;
    float k[640], kq[640], vq[640];
    fill_normal(k, n, 12, 1.0);
    for (size_t i = 0; i < n; i++) k[i] = roundf(k[i] * 64.0f) / 64.0f; /* fp16 values: outliers exact */
    kvq_layer L;
    layer_from(&L, H, T, D, k);
    double kb[2], vb[2];
    /* no outliers, no sink, uniform, post-RoPE: b + 32/T for K, b + 32/D for V */
    run_spec("kvquant:bits=3,outliers=0,sink=0,codebook=uniform,prerope=0", &L, kq, vq, kb, vb, 2);
    ck_assert_double_eq(kb[0] / (T * D), 3.0 + 32.0 / T);
    ck_assert_double_eq(vb[1] / (T * D), 3.0 + 32.0 / D);
    /* sink=2, outliers=0.06: K rows of n = 38 keep k = 1 each way, V rows (n = 8) none */
    run_spec("kvquant:bits=2,outliers=0.06,sink=2,codebook=uniform", &L, kq, vq, kb, vb, 2);
    ck_assert_double_eq(kb[0], 16.0 * 2 * D + D * (32.0 + 48.0 * 2 + 2.0 * 36));
    ck_assert_double_eq(vb[0], 16.0 * 2 * D + 38 * (32.0 + 2.0 * D));
    for (int h = 0; h < H; h++) {
        const float *x = k + (size_t)h * T * D, *y = kq + (size_t)h * T * D, *yv = vq + (size_t)h * T * D;
        ck_assert(!memcmp(x, y, 2 * D * sizeof(float)) && !memcmp(x, yv, 2 * D * sizeof(float))); /* sinks */
        for (int c = 0; c < D; c++) { /* the largest and (of the rest) the smallest come back exact */
            int imax = 2, imin = -1;
            for (int t = 2; t < T; t++) if (x[t * D + c] > x[imax * D + c]) imax = t;
            for (int t = 2; t < T; t++)
                if (t != imax && (imin < 0 || x[t * D + c] < x[imin * D + c])) imin = t;
            ck_assert(y[imax * D + c] == x[imax * D + c] && y[imin * D + c] == x[imin * D + c]);
        }
    }
    /* a constant rest (r = 0) comes back as o, exactly */
    for (size_t i = 0; i < n; i++) k[i] = 0.75f;
    kvq_layer_free(&L);
    layer_from(&L, H, T, D, k);
    run_spec("kvquant:codebook=uniform,prerope=0", &L, kq, vq, kb, vb, 1);
    for (size_t i = 0; i < n; i++) ck_assert(kq[i] == 0.75f && vq[i] == 0.75f);
    kvq_layer_free(&L);
    /* the default (nuq) needs --calib; prerope=1 on pre-RoPE keys needs the dump's RoPE */
    kvq_spec sp;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_spec_parse("kvquant", &sp, &err), KVQ_OK);
    ck_assert(kvq_spec_needs_calib(&sp));
    ck_assert_int_eq(kvq_spec_parse("kvquant:codebook=uniform", &sp, &err), KVQ_OK);
    ck_assert(!kvq_spec_needs_calib(&sp));
    ck_assert_int_eq(kvq_layer_alloc(&L, H, H, T, D, KVQ_READ_KEY_PRE_ROPE, &err), KVQ_OK);
    fill_normal(L.key_pre_rope, n, 13, 1.0);
    double sb[2] = {0};
    kvq_quant_out out = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    kvq_quant_ctx ctx = {.nthreads = 1}; /* no ctx.rope: the dump has none */
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, &L, &out, &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "prerope=1") && strstr(err.msg, "rope_theta"), "%s", err.msg);
    kvq_layer_free(&L);
}
END_TEST

/* ------------------------------------------------------------ prerotate */

START_TEST(prerotate_wrapper)
{
    /* a kvq-gen layer with an outlier key channel */
    char *path = gen_dump(1, 4, 2, 16, 64, 9);
    kvq_dump *d;
    kvq_error err = {0};
    kvq_layer L;
    ck_assert_int_eq(kvq_dump_open(path, &d, &err), KVQ_OK);
    ck_assert_int_eq(kvq_dump_read_layer(d, 0, 0, &L, &err), KVQ_OK);
    size_t n = (size_t)L.H * L.T * L.D;
    float *kq[3], *vq[3];
    double kb[3][2], vb[3][2], sb[3][2];
    const char *specs[3] = {"per-token:bits=3,group=16", "per-token:bits=3,group=16,prerotate=none",
                            "per-token:bits=3,group=16,prerotate=hadamard"};
    double ke[3] = {0};
    for (int i = 0; i < 3; i++) {
        kq[i] = malloc(n * sizeof(float)), vq[i] = malloc(n * sizeof(float));
        kvq_spec sp;
        ck_assert_int_eq(kvq_spec_parse(specs[i], &sp, &err), KVQ_OK);
        memset(sb[i], 0, sizeof sb[i]);
        kvq_quant_out out = {.key = kq[i], .value = vq[i], .k_bits = kb[i], .v_bits = vb[i], .static_bytes = sb[i]};
        kvq_quant_ctx ctx = {.nthreads = 2, .seed = 4, .layer = 0};
        ck_assert_msg(kvq_quantize_layer(&sp, &ctx, &L, &out, &err) == KVQ_OK, "%s", err.msg);
        for (size_t e = 0; e < n; e++) ke[i] += ((double)kq[i][e] - L.key[e]) * ((double)kq[i][e] - L.key[e]);
    }
    /* none is the plain quantizer; the bits do not change; Hadamard lowers per-token key error */
    ck_assert(!memcmp(kq[0], kq[1], n * sizeof(float)) && !memcmp(vq[0], vq[1], n * sizeof(float)));
    ck_assert(!memcmp(kb[0], kb[2], sizeof kb[0]) && !memcmp(vb[0], vb[2], sizeof vb[0]));
    ck_assert_msg(ke[2] < 0.8 * ke[0], "hadamard %g, none %g", ke[2], ke[0]);
    /* static: D sign bits per head and tensor (16 channels: 2 bytes, K and V) */
    ck_assert(sb[0][0] == 0 && sb[2][0] == 4 && sb[2][1] == 4);
    /* x' = Πᵀ·Q(Π·x), by hand with the same rotations */
    kvq_layer R = L;
    R.key = malloc(n * sizeof(float)), R.value = malloc(n * sizeof(float));
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < L.H; h++) {
            kvq_rotation r;
            size_t off = (size_t)h * L.T * L.D;
            ck_assert_int_eq(kvq_rotation_init(&r, KVQ_ROT_HADAMARD, L.D, 4, 0, h, t, &err), KVQ_OK);
            ck_assert_int_eq(
                kvq_rotation_apply(&r, (t ? L.value : L.key) + off, (t ? R.value : R.key) + off, L.T, 0, &err), KVQ_OK);
            kvq_rotation_free(&r);
        }
    kvq_spec plain;
    ck_assert_int_eq(kvq_spec_parse(specs[0], &plain, &err), KVQ_OK);
    float *yk = malloc(n * sizeof(float)), *yv = malloc(n * sizeof(float));
    double b1[2], b2[2], s3[2] = {0};
    kvq_quant_out out = {.key = yk, .value = yv, .k_bits = b1, .v_bits = b2, .static_bytes = s3};
    kvq_quant_ctx ctx = {.nthreads = 1, .seed = 4, .layer = 0};
    ck_assert_int_eq(kvq_quantize_layer(&plain, &ctx, &R, &out, &err), KVQ_OK);
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < L.H; h++) {
            kvq_rotation r;
            size_t off = (size_t)h * L.T * L.D;
            ck_assert_int_eq(kvq_rotation_init(&r, KVQ_ROT_HADAMARD, L.D, 4, 0, h, t, &err), KVQ_OK);
            ck_assert_int_eq(kvq_rotation_apply(&r, (t ? yv : yk) + off, (t ? R.value : R.key) + off, L.T, 1, &err),
                             KVQ_OK);
            kvq_rotation_free(&r);
        }
    ck_assert(!memcmp(R.key, kq[2], n * sizeof(float)) && !memcmp(R.value, vq[2], n * sizeof(float)));
    free(R.key), free(R.value), free(yk), free(yv);
    for (int i = 0; i < 3; i++) free(kq[i]), free(vq[i]);
    kvq_layer_free(&L);
    kvq_dump_close(d);
    unlink(path);
    free(path);

    /* every family that declares the key takes it; hadamard needs a power-of-two head_dim */
    const char *fams[] = {"per-token", "per-channel", "kivi", "kcvt", "absmax", "fp8", "ggml"};
    for (size_t i = 0; i < sizeof fams / sizeof fams[0]; i++)
        ck_assert_msg(kvq_spec_param_index(kvq_quantizer_find(fams[i]), "prerotate") >= 0, "%s", fams[i]);
    float k[3 * 4 * 12];
    fill_normal(k, 3 * 4 * 12, 3, 1.0);
    layer_from(&L, 3, 4, 12, k);
    expect_layer_refused("absmax:prerotate=hadamard", &L, "not a power of two");
    float o1[144], o2[144];
    double kb1[3], vb1[3];
    run_spec("absmax:prerotate=qr", &L, o1, o2, kb1, vb1, 1);
    kvq_layer_free(&L);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("families");
    TCase *tc = tcase_create("fp8");
    tcase_add_test(tc, fp8_every_float16);
    tcase_add_test(tc, fp8_rounding_boundaries);
    tcase_add_test(tc, fp8_scales_and_bits);
    suite_add_tcase(s, tc);
    tc = tcase_create("tender");
    tcase_add_test(tc, tender_groups_on_boundaries);
    tcase_add_test(tc, tender_tmax_zero_and_chunks);
    tcase_add_test(tc, tender_span_head_and_layer);
    tcase_add_test(tc, families_usage_errors);
    suite_add_tcase(s, tc);
    tc = tcase_create("ggml");
    tcase_add_test(tc, ggml_hand_blocks);
    tcase_add_test(tc, ggml_quantize_equals_reference);
    tcase_add_test(tc, ggml_rows_bits_and_errors);
    tcase_add_test(tc, fp4_hand_blocks);
    tcase_add_test(tc, fp4_fast_round_equals_reference);
    tcase_add_test(tc, fp4_global_scales_by_hand);
    tcase_add_test(tc, fp4_rows_idempotent_and_shape);
    tcase_add_test(tc, prerotate_wrapper);
    tcase_add_test(tc, turboquant_mse_prod);
    tcase_add_test(tc, kvquant_rows);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
