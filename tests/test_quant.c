/* test_quant.c — U and A on hand-computed groups, the optimised per-channel
 * path against the reference, spec parsing and its usage errors, the
 * registry, and the bit accounting of every family. */
#include "testutil.h"
#include "quant/quant.h"
#include "simd.h"

#include <string.h>

/* ---------------------------------------------------------------- U, A */

START_TEST(uniform_hand_cases)
{
    float y[8];
    /* s = (3 − 0)/3 = 1, z = 0: q = rne(x) with ties to even */
    const float g1[5] = {0.0f, 0.5f, 1.5f, 2.5f, 3.0f};
    ck_assert_int_eq(kvq_group_quantize_ref(g1, y, 5, 1, 2, KVQ_SCALE_FP16), KVQ_OK);
    const float e1[5] = {0, 0, 2, 2, 3};
    for (int i = 0; i < 5; i++) ck_assert_float_eq(y[i], e1[i]);

    const float g2[4] = {0.0f, 0.4f, 1.1f, 3.0f};
    kvq_group_quantize_ref(g2, y, 4, 1, 2, KVQ_SCALE_FP16);
    const float e2[4] = {0, 0, 1, 3};
    for (int i = 0; i < 4; i++) ck_assert_float_eq(y[i], e2[i]);

    /* fp16 scale: s = fp16(0.1) = 0.0999755859375; fp32 keeps 0.1f */
    const float g3[2] = {0.0f, 0.1f};
    kvq_group_quantize_ref(g3, y, 2, 1, 1, KVQ_SCALE_FP16);
    ck_assert_float_eq(y[0], 0.0f);
    ck_assert_float_eq(y[1], 0.0999755859375f);
    kvq_group_quantize_ref(g3, y, 2, 1, 1, KVQ_SCALE_FP32);
    ck_assert_float_eq(y[1], 0.1f);

    /* zero rounded too: z = fp16(0.1); x − z < 0 clamps to q = 0 */
    const float g4[2] = {0.1f, 1.1f};
    kvq_group_quantize_ref(g4, y, 2, 1, 1, KVQ_SCALE_FP16);
    ck_assert_float_eq(y[0], 0.0999755859375f);
    ck_assert_float_eq(y[1], 1.0f * 1.0f + 0.0999755859375f); /* s = fp16(1.0) = 1 */

    /* constant group: x' = z (no NaN) */
    const float g5[3] = {2.5f, 2.5f, 2.5f};
    kvq_group_quantize_ref(g5, y, 3, 1, 2, KVQ_SCALE_FP16);
    for (int i = 0; i < 3; i++) ck_assert_float_eq(y[i], 2.5f);

    /* strided group: every second element */
    float g6[6] = {0, 9, 1.5f, 9, 3, 9};
    kvq_group_quantize_ref(g6, g6, 3, 2, 2, KVQ_SCALE_FP16);
    ck_assert_float_eq(g6[0], 0);
    ck_assert_float_eq(g6[2], 2); /* 1.5 ties to even */
    ck_assert_float_eq(g6[4], 3);
    ck_assert_float_eq(g6[1], 9);

    /* a range beyond fp16 is reported, not turned into NaN */
    const float g7[2] = {-70000.0f, 70000.0f};
    ck_assert_int_eq(kvq_group_quantize_ref(g7, y, 2, 1, 1, KVQ_SCALE_FP16), KVQ_ERR_NUMERIC);
    ck_assert_int_eq(kvq_group_quantize_ref(g7, y, 2, 1, 1, KVQ_SCALE_FP32), KVQ_OK);
}
END_TEST

START_TEST(absmax_hand_cases)
{
    float y[3];
    const float g[3] = {-1.0f, 0.5f, 0.25f};
    /* b = 2: qmax 1, s = 1; rne(0.5) = 0 */
    kvq_absmax_quantize_ref(g, y, 3, 1, 2, KVQ_SCALE_FP16);
    ck_assert_float_eq(y[0], -1.0f);
    ck_assert_float_eq(y[1], 0.0f);
    ck_assert_float_eq(y[2], 0.0f);
    /* b = 3: qmax 3, s = fp16(1/3) = 0.333251953125 */
    kvq_absmax_quantize_ref(g, y, 3, 1, 3, KVQ_SCALE_FP16);
    ck_assert_float_eq(y[0], -3 * 0.333251953125f);
    ck_assert_float_eq(y[1], 2 * 0.333251953125f);
    ck_assert_float_eq(y[2], 0.333251953125f);
    const float z[3] = {0, 0, 0};
    kvq_absmax_quantize_ref(z, y, 3, 1, 8, KVQ_SCALE_FP16);
    ck_assert_float_eq(y[1], 0.0f);
}
END_TEST

START_TEST(channels_path_equals_reference)
{
    const int shapes[][2] = {{1, 1}, {7, 3}, {32, 128}, {33, 300}, {5, 257}, {100, 8}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int n = shapes[s][0], D = shapes[s][1];
        size_t N = (size_t)n * D;
        float *x = malloc(N * sizeof *x), *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
        for (int bits = 1; bits <= 8; bits += 3)
            for (int prec = 0; prec < 2; prec++)
                for (uint64_t seed = 0; seed < 3; seed++) {
                    fill_normal(x, N, seed * 100 + s, 2.0);
                    if (seed == 2) /* a constant channel */
                        for (int t = 0; t < n; t++) x[(size_t)t * D] = 1.25f;
                    ck_assert_int_eq(kvq_group_quantize_channels(x, a, (size_t)n, (size_t)D, bits, prec), KVQ_OK);
                    for (int c = 0; c < D; c++)
                        kvq_group_quantize_ref(x + c, b + c, (size_t)n, (size_t)D, bits, prec);
                    ck_assert_int_eq(memcmp(a, b, N * sizeof *a), 0);
                }
        free(x), free(a), free(b);
    }
}
END_TEST

/* The per-token head path at SIMD level `cap` equals U applied group by
 * group; and the forced portable path gives the same values. */
static void per_token_shapes(int cap)
{
    const int shapes[][3] = {{3, 8, 8}, {5, 128, 32}, {4, 40, 7}, {2, 100, 33}, {3, 17, 17}, {2, 300, 64},
                             {3, 48, 24}, {2, 64, 8}};
    kvq_simd_cap(cap);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int T = shapes[s][0], D = shapes[s][1], G = shapes[s][2];
        size_t N = (size_t)T * D;
        /* a and d on cache lines, as the driver's outputs: with D and G
         * multiples of 16 the kernels stream their stores where the output
         * is large enough, here half the time (a threshold of 0 bytes) */
        size_t lines = (N * 4 + 63) / 64 * 64;
        float *x = malloc(N * 4), *a = aligned_alloc(64, lines), *b = malloc(N * 4), *c = malloc(N * 4);
        for (int bits = 1; bits <= 8; bits += 3)
            for (int prec = 0; prec < 2; prec++) {
                kvq_simd_stream_min(prec ? 0 : KVQ_STREAM_MIN_BYTES);
                fill_normal(x, N, 7 * s + bits, 3.0);
                for (int i = 0; i < G && i < D; i++) x[i] = -0.5f; /* a constant group */
                double bits_a, bits_c;
                kvq_recon_acc fused = {0}, ref = {0};
                ck_assert_int_eq(kvq_quant_head_per_token(x, a, T, D, 0, T, bits, G, prec, &bits_a, &fused), KVQ_OK);
                kvq_recon_accumulate_ref(&ref, x, a, N); /* the fused error sums = the reference's */
                ck_assert(fused.n == ref.n && fused.max_abs == ref.max_abs);
                ck_assert(close_rel(fused.sum_e2, ref.sum_e2, 1e-12, 1e-300) &&
                          close_rel(fused.sum_x2, ref.sum_x2, 1e-12, 0));
                ck_assert(close_rel(fused.sum_abs_e, ref.sum_abs_e, 1e-12, 1e-300));
                for (int t = 0; t < T; t++)
                    for (int c0 = 0; c0 < D; c0 += G)
                        kvq_group_quantize_ref(x + (size_t)t * D + c0, b + (size_t)t * D + c0,
                                               (size_t)(D - c0 < G ? D - c0 : G), 1, bits, prec);
                kvq_simd_force(0);
                kvq_quant_head_per_token(x, c, T, D, 0, T, bits, G, prec, &bits_c, NULL);
                kvq_group_quantize_channels(x, c, (size_t)T, (size_t)D, bits, prec); /* portable channels */
                kvq_simd_cap(cap);
                float *d = aligned_alloc(64, lines);
                double bits_d;
                kvq_recon_acc fused_c = {0}, ref_c = {0};
                /* per channel, one group of all T tokens, error fused */
                ck_assert_int_eq(kvq_quant_head_per_channel(x, d, T, D, 0, T, bits, T, prec, &bits_d, &fused_c),
                                 KVQ_OK);
                kvq_recon_accumulate_ref(&ref_c, x, d, N);
                ck_assert(fused_c.n == ref_c.n && fused_c.max_abs == ref_c.max_abs);
                ck_assert(close_rel(fused_c.sum_e2, ref_c.sum_e2, 1e-12, 1e-300) &&
                          close_rel(fused_c.sum_x2, ref_c.sum_x2, 1e-12, 0));
                ck_assert(close_rel(fused_c.sum_abs_e, ref_c.sum_abs_e, 1e-12, 1e-300));
                for (size_t i = 0; i < N; i++) {
                    ck_assert_msg(a[i] == b[i], "shape %zu bits %d [%zu]: %g vs %g", s, bits, i, a[i], b[i]);
                    ck_assert(c[i] == d[i]);
                }
                ck_assert(bits_a == bits_c);
                free(d);
            }
        kvq_simd_stream_min(KVQ_STREAM_MIN_BYTES);
        free(x), free(a), free(b), free(c);
    }
}

/* ... at each SIMD level the CPU has (AVX-512, AVX2). */
START_TEST(per_token_path_equals_reference)
{
    int levels = 0;
    for (int cap = KVQ_SIMD_AVX512; cap >= KVQ_SIMD_AVX2; cap--) {
        kvq_simd_cap(cap);
        if (cap == KVQ_SIMD_AVX512 ? !kvq_simd_active() : !kvq_simd_avx2_active()) continue;
        levels |= 1 << cap;
        per_token_shapes(cap);
    }
    kvq_simd_cap(-1);
    printf("per-token/per-channel optimised paths checked:%s%s%s\n", levels & (1 << KVQ_SIMD_AVX512) ? " AVX-512" : "",
           levels & (1 << KVQ_SIMD_AVX2) ? " AVX2" : "", levels ? "" : " none here (portable only)");
}
END_TEST

/* ------------------------------------------------------------- specs */

static void expect_usage(const char *text, const char *needle)
{
    kvq_spec sp;
    kvq_error err = {0};
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_ERR_USAGE, "%s parsed", text);
    ck_assert_msg(strstr(err.msg, needle) != NULL, "'%s': message '%s' lacks '%s'", text, err.msg, needle);
}

START_TEST(spec_parsing)
{
    kvq_spec sp;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_spec_parse("kivi:bits=4,group=16,residual=64", &sp, &err), KVQ_OK);
    ck_assert_str_eq(sp.q->name, "kivi");
    ck_assert(sp.val[kvq_spec_param_index(sp.q, "bits")] == 4);
    ck_assert(sp.val[kvq_spec_param_index(sp.q, "group")] == 16);
    ck_assert(isnan(sp.val[kvq_spec_param_index(sp.q, "kbits")]));
    ck_assert_str_eq(sp.text, "kivi:bits=4,group=16,residual=64");
    char full[256];
    kvq_spec_format_full(&sp, full, sizeof full);
    ck_assert_str_eq(full, "kivi:bits=4,group=16,residual=64");
    ck_assert_int_eq(kvq_spec_parse("per-token:span=layer,scale=fp32", &sp, &err), KVQ_OK);
    kvq_spec_format_full(&sp, full, sizeof full);
    ck_assert_str_eq(full, "per-token:bits=2,group=32,span=layer,scale=fp32");
    ck_assert_int_eq(kvq_spec_parse("absmax", &sp, &err), KVQ_OK);

    expect_usage("nope:bits=2", "unknown quantizer 'nope'");
    expect_usage("kivi:foo=1", "unknown key 'foo'");
    expect_usage("kivi:bits=0", "bits=0: out of range");
    expect_usage("kivi:bits=2x", "bits=2x: expected an integer");
    expect_usage("kivi:bits=", "expected key=value");
    expect_usage("kivi:bits", "expected key=value");
    expect_usage("kivi:bits=2,bits=3", "given twice");
    expect_usage("kivi:residual=100,group=32", "residual=100 must be a multiple of group=32");
    expect_usage("per-token:span=tensor", "span=tensor: expected one of head|layer");
    expect_usage("kivi:", "expected key=value");
    expect_usage("", "empty quantizer spec");
    expect_usage("absmax:bits=1", "out of range");
}
END_TEST

START_TEST(registry_defaults_parse)
{
    ck_assert_int_ge(kvq_quantizer_count(), 5);
    for (size_t i = 0; i < kvq_quantizer_count(); i++) {
        const kvq_quantizer *q = kvq_quantizer_at(i);
        kvq_spec sp;
        kvq_error err = {0};
        ck_assert_msg(kvq_spec_parse(q->name, &sp, &err) == KVQ_OK, "%s: %s", q->name, err.msg);
        if (q->in_default_set) { /* the default set's spec parses and names q */
            ck_assert_msg(kvq_spec_default(q, &sp, &err) == KVQ_OK, "%s: %s", q->name, err.msg);
            ck_assert_ptr_eq(sp.q, q);
        }
        ck_assert_ptr_eq(kvq_quantizer_find(q->name), q);
        ck_assert(q->nparams <= KVQ_MAX_PARAMS);
        ck_assert(q->description && (q->quantize || q->quantize_head));
        ck_assert_msg(!q->couples_heads || (q->quantize && q->quantize_head), "%s: couples_heads picks between the two",
                      q->name);
        ck_assert_msg(!q->layer_prepare || q->quantize_head, "%s: layer_prepare serves quantize_head", q->name);
    }
    ck_assert_ptr_null(kvq_quantizer_at(kvq_quantizer_count()));
    FILE *f = tmpfile();
    kvq_registry_describe(f);
    ck_assert_int_gt(ftell(f), 200);
    fclose(f);
}
END_TEST

/* ------------------------------------------------------ bit accounting */

/* Runs spec on a random layer; returns bits per element of K and V. */
static void run_bits(const char *text, int H, int T, int D, double *kb, double *vb, kvq_layer *L,
                     float **kq, float **vq)
{
    kvq_spec sp;
    kvq_error err = {0};
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(kvq_layer_alloc(L, H, H, T, D, 0, &err), KVQ_OK);
    fill_normal(L->key, (size_t)H * T * D, 5, 1.0);
    fill_normal(L->value, (size_t)H * T * D, 6, 1.0);
    size_t n = (size_t)H * T * D;
    *kq = malloc(n * sizeof(float)), *vq = malloc(n * sizeof(float));
    double kbits[16] = {0}, vbits[16] = {0}, sbytes[16] = {0};
    kvq_quant_out out = {.key = *kq, .value = *vq, .k_bits = kbits, .v_bits = vbits, .static_bytes = sbytes};
    kvq_quant_ctx ctx = {.nthreads = 2};
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, L, &out, &err), KVQ_OK);
    double ks = 0, vs = 0;
    for (int h = 0; h < H; h++) ks += kbits[h], vs += vbits[h];
    *kb = ks / (double)n, *vb = vs / (double)n;
}

static void check_bits(const char *text, int H, int T, int D, double ek, double ev)
{
    kvq_layer L;
    float *kq, *vq;
    double kb, vb;
    run_bits(text, H, T, D, &kb, &vb, &L, &kq, &vq);
    ck_assert_msg(fabs(kb - ek) < 1e-12 && fabs(vb - ev) < 1e-12, "%s: bits %g %g, expected %g %g", text, kb, vb, ek,
                  ev);
    kvq_layer_free(&L);
    free(kq), free(vq);
}

START_TEST(bits_by_hand)
{
    /* per-token D=8 G=8, b=2: 2 + 32/8 */
    check_bits("per-token:bits=2,group=8", 2, 10, 8, 6.0, 6.0);
    /* group 32 clamps to D = 8 */
    check_bits("per-token:bits=2", 2, 10, 8, 6.0, 6.0);
    /* span=layer, H·D = 16, G = 32 clamps to 16: 2 + 32/16 */
    check_bits("per-token:bits=2,span=layer", 2, 10, 8, 4.0, 4.0);
    /* span=layer G = 12 over 3 heads of D=8 (24 per token): groups [0,12) [12,24) */
    /* two groups of 12 per token, 32 scale+zero bits each, over 24 elements */
    check_bits("per-token:bits=3,group=12,span=layer", 3, 4, 8, 3 + 64.0 / 24, 3 + 64.0 / 24);
    /* per-channel T=10 G=4: groups 4,4,2 -> 3 groups per channel: 2 + 3·32/10 */
    check_bits("per-channel:bits=2,group=4", 1, 10, 8, 2 + 96.0 / 10, 2 + 96.0 / 10);
    check_bits("per-channel:bits=3,group=4,scale=fp32", 1, 10, 8, 3 + 192.0 / 10, 3 + 192.0 / 10);
    /* kivi T=10, R=4, G=2: K quantizes 8 tokens (4 groups), 2 exact;
     * V quantizes 6 tokens per-token (G=2 -> 4 groups of 2 channels), 4 exact */
    check_bits("kivi:bits=2,group=2,residual=4", 1, 10, 8,
               (8 * 8 * 2 + 4 * 8 * 32 + 2 * 8 * 16) / 80.0,
               (6 * 8 * 2 + 6 * 4 * 32 + 4 * 8 * 16) / 80.0);
    /* kivi residual 0: all quantized; kbits/vbits override */
    check_bits("kivi:kbits=3,vbits=4,group=5,residual=0", 1, 10, 8, 3 + 2 * 32 / 10.0, 4 + 2 * 32 / 8.0);
    /* kcvt: K one group per channel (G = T), V one per token (G = D) */
    check_bits("kcvt:bits=4", 2, 16, 8, 4 + 32 / 16.0, 4 + 32 / 8.0);
    check_bits("kcvt:bits=2,span=layer", 2, 16, 8, 2 + 32 / 16.0, 2 + 32 / 16.0);
    /* absmax: one fp16 scale per group */
    check_bits("absmax:bits=8", 1, 4, 8, 8 + 16 / 8.0, 8 + 16 / 8.0);
    check_bits("absmax:bits=4,group=3", 1, 4, 8, 4 + 3 * 16 / 8.0, 4 + 3 * 16 / 8.0);
    /* gear, T=16 D=8 H=2, b=2, group 4, rank 1, sparsity 0.25:
     * K rows (channels, n=16): k=2, 4 outliers per channel at 48 bits;
     *   codes 2, scales 4 groups·32/16 tokens = 8, outliers 4·48/16 = 12,
     *   factors 1·(16+8)·16 / 128 = 3  → 25
     * V rows (tokens, n=8): k=1, 2 outliers per token: 2·48/8 = 12; scales
     *   2 groups·32/8 = 8; codes 2; factors 3 → 25 */
    check_bits("gear:bits=2,group=4,rank=1,sparsity=0.25,lowrank=svd", 2, 16, 8, 25.0, 25.0);
    check_bits("gear:bits=2,group=4,rank=1,sparsity=0.25", 2, 16, 8, 25.0, 25.0);
    /* span=layer: V rows of H·D = 16: k = 2, 4 outliers per token over the
     * 2 heads (4·48/16 = 12 per element), groups of 4 along the 16 */
    check_bits("gear:bits=2,group=4,rank=1,sparsity=0.25,span=layer", 2, 16, 8, 25.0, 25.0);
    /* kcvt backbone, no outliers, no low rank: kcvt's bits */
    check_bits("gear:bits=4,backbone=kcvt,rank=0,sparsity=0", 2, 16, 8, 4 + 32 / 16.0, 4 + 32 / 8.0);
    /* gear-l: rank 2 (T+D = 24 per factor pair): 2·24·16/128 = 6 */
    check_bits("gear-l:bits=2,group=8,rank=2", 1, 16, 8, 2 + 2 * 32 / 16.0 + 6, 2 + 32 / 8.0 + 6);
    /* rank clamps to min(T, D) */
    check_bits("gear-l:bits=2,group=8,rank=99", 1, 16, 8, 2 + 2 * 32 / 16.0 + 8 * 24 * 16 / 128.0,
               2 + 32 / 8.0 + 8 * 24 * 16 / 128.0);
    /* lloydmax: b·D + 16 per token */
    check_bits("lloydmax:bits=3", 2, 10, 8, 3 + 16 / 8.0, 3 + 16 / 8.0);
    check_bits("lloydmax:bits=1,rotate=hadamard,codebook=gauss", 1, 10, 16, 1 + 1.0, 1 + 1.0);
}
END_TEST

/* Quantizes with two specs on the same random layer; returns both outputs. */
static void run_pair(const char *a, const char *b, int H, int T, int D, float **ka, float **va, float **kb,
                     float **vb, double bits[4])
{
    kvq_layer L, L2;
    double k1, v1, k2, v2;
    run_bits(a, H, T, D, &k1, &v1, &L, ka, va);
    run_bits(b, H, T, D, &k2, &v2, &L2, kb, vb);
    bits[0] = k1, bits[1] = v1, bits[2] = k2, bits[3] = v2;
    kvq_layer_free(&L), kvq_layer_free(&L2);
}

static void expect_same(const char *a, const char *b, int H, int T, int D)
{
    float *ka, *va, *kb, *vb;
    double bits[4];
    size_t n = (size_t)H * T * D * sizeof(float);
    run_pair(a, b, H, T, D, &ka, &va, &kb, &vb, bits);
    ck_assert_msg(!memcmp(ka, kb, n) && !memcmp(va, vb, n), "%s and %s differ", a, b);
    free(ka), free(va), free(kb), free(vb);
}

/* The outlier rule by brute force: pick the best remaining k times. */
static void outliers_ref(const float *row, int n, int k, unsigned char *sel)
{
    memset(sel, 0, (size_t)n);
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int i = 0; i < n; i++) {
                if (sel[i]) continue;
                if (best < 0 || (pass == 0 ? row[i] > row[best] : row[i] < row[best])) best = i;
            }
            sel[best] = 1;
        }
}

/* Rows of n (7, 300; 8192 takes gear.c's sampled cut, whose cut may also
 * catch too few values and fall back) against outliers_ref. */
START_TEST(gear_outlier_rule)
{
    enum { NMAX = 8192 };
    float *row = malloc(NMAX * sizeof *row), *work = malloc(NMAX * sizeof *work), *r = malloc(2 * NMAX * sizeof *r);
    unsigned char *sel = malloc(NMAX), *ref = malloc(NMAX);
    kvq_rng g;
    kvq_rng_init(&g, 1, 2, 3, 4);
    const int ks[] = {1, 2, 5, 64, 65, 81, 100, 150, 2048};
    for (int len = 0; len < 2; len++)
        for (int trial = 0; trial < 7; trial++)
            for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
                int n = len ? NMAX : trial == 3 ? 7 : 300, k = ks[ki] > n / 2 ? n / 2 : ks[ki];
                /* trial 0: distinct values; 1: many ties; 2: constant; 3: short row;
                 * 4: sorted ascending (a quickselect's bad case); 5: ±0 and few values;
                 * 6: the largest and smallest values where a strided sample looks */
                for (int i = 0; i < n; i++)
                    row[i] = trial == 0 ? (float)kvq_rng_normal(&g) : trial == 1 ? (float)kvq_rng_below(&g, 3) - 1.0f
                             : trial == 2 ? 0.5f : trial == 3 ? (float)kvq_rng_below(&g, 2) : trial == 4 ? (float)i
                             : trial == 6 ? (i % 16 ? (float)kvq_rng_normal(&g) : (i % 32 ? 1e3f : -1e3f) + (float)i)
                             : (float)kvq_rng_below(&g, 3) == 0 ? -0.0f : (float)kvq_rng_below(&g, 2);
                memcpy(work, row, (size_t)n * sizeof *row);
                kvq_gear_row_outliers(row, work, sel, n, k, r);
                outliers_ref(row, n, k, ref);
                ck_assert_msg(!memcmp(sel, ref, (size_t)n), "n %d trial %d k %d", n, trial, k);
                int cnt = 0;
                double mean = 0;
                for (int i = 0; i < n; i++) cnt += sel[i], mean += row[i];
                ck_assert_int_eq(cnt, 2 * k);
                for (int i = 0; i < n; i++) ck_assert(work[i] == (sel[i] ? (float)(mean / n) : row[i]));
            }
    free(row), free(work), free(r), free(sel), free(ref);
}
END_TEST

/* kvq_lloydmax_snap (select chain, plain and AVX2; search above 16 levels)
 * against kvq_codebook_index on every midpoint, its float neighbours, the
 * levels, ±0, huge values and random ones, for two norms and a row length
 * that leaves a partial block. */
START_TEST(lloydmax_snap_equals_search)
{
    enum { D = 200 };
    kvq_error err = {0};
    kvq_rng g;
    kvq_rng_init(&g, 5, 6, 7, 8);
    for (int bits = 1; bits <= 6; bits++) {
        const kvq_codebook *cb;
        ck_assert_int_eq(kvq_codebook_get(KVQ_CB_SPHERE, 128, bits, &cb, &err), KVQ_OK);
        float v[4 * 64 + 8 + D];
        int m = 0;
        for (int j = 0; j + 1 < cb->n; j++) {
            v[m++] = cb->bound[j];
            v[m++] = nextafterf(cb->bound[j], INFINITY);
            v[m++] = nextafterf(cb->bound[j], -INFINITY);
        }
        for (int j = 0; j < cb->n && j < 64; j++) v[m++] = cb->levelf[j];
        const float special[] = {0.0f, -0.0f, 1e30f, -1e30f, 1.0f, -1.0f, 3e-39f, -3e-39f};
        for (int j = 0; j < 8; j++) v[m++] = special[j];
        while (m < (int)(sizeof v / sizeof v[0])) v[m++] = (float)(0.2 * kvq_rng_normal(&g));
        const float norms[] = {1.0f, 0.375f};
        for (int ni = 0; ni < 2; ni++)
            for (int simd = 0; simd < 2; simd++)
                for (int off = 0; off + D <= m; off += D / 2) {
                    float u[D], want[D];
                    /* u = v·n: what the snap divides by n is then v or its neighbour, as the search sees it */
                    for (int c = 0; c < D; c++) {
                        u[c] = v[off + c] * norms[ni];
                        want[c] = cb->levelf[kvq_codebook_index(cb, u[c] / norms[ni])];
                    }
                    kvq_simd_force(simd);
                    kvq_lloydmax_snap(cb, u, norms[ni], D - ni * 33);
                    kvq_simd_force(1);
                    for (int c = 0; c < D - ni * 33; c++)
                        ck_assert_msg(u[c] == want[c], "bits %d n %g simd %d: %g -> %g, search %g", bits, norms[ni],
                                      simd, v[off + c], u[c], want[c]);
                }
    }
}
END_TEST

START_TEST(gear_reductions)
{
    /* rank 0 and no outliers: the backbone alone */
    expect_same("gear:bits=2,group=4,rank=0,sparsity=0", "kivi:bits=2,group=4,residual=0", 2, 24, 8);
    expect_same("gear:bits=3,backbone=kcvt,rank=0,sparsity=0", "kcvt:bits=3", 2, 24, 8);
    expect_same("gear:bits=2,backbone=kcvt,rank=0,sparsity=0,span=layer", "kcvt:bits=2,span=layer", 2, 24, 8);
    /* sparsity 0 is gear-l */
    expect_same("gear:bits=2,group=4,rank=2,sparsity=0,lowrank=svd", "gear-l:bits=2,group=4,rank=2,lowrank=svd", 2, 24,
                8);
    expect_same("gear:bits=2,group=4,rank=2,sparsity=0", "gear-l:bits=2,group=4,rank=2", 2, 24, 8);
}
END_TEST

START_TEST(gear_outliers_exact_and_lowrank_helps)
{
    int H = 1, T = 32, D = 8;
    kvq_layer L;
    float *kq, *vq;
    double kb, vb;
    /* rank 0: the k = 2 largest and 2 smallest of each K channel (T = 32,
     * sparsity 0.125) come back at exactly fp16(x) */
    run_bits("gear:bits=2,group=8,rank=0,sparsity=0.125", H, T, D, &kb, &vb, &L, &kq, &vq);
    for (int c = 0; c < D; c++) {
        int hi1 = 0, lo1 = 0;
        for (int t = 1; t < T; t++) {
            if (L.key[t * D + c] > L.key[hi1 * D + c]) hi1 = t;
            if (L.key[t * D + c] < L.key[lo1 * D + c]) lo1 = t;
        }
        ck_assert(kq[hi1 * D + c] == kvq_round_f16(L.key[hi1 * D + c]));
        ck_assert(kq[lo1 * D + c] == kvq_round_f16(L.key[lo1 * D + c]));
    }
    kvq_layer_free(&L), free(kq), free(vq);
    /* the low-rank part lowers the error of the same backbone + outliers */
    float *ka, *va, *kb2, *vb2;
    double bits[4];
    run_pair("gear:bits=2,group=8,rank=0", "gear:bits=2,group=8,rank=4,lowrank=svd", 2, 64, 16, &ka, &va, &kb2, &vb2,
             bits);
    run_bits("per-token", 2, 64, 16, &kb, &vb, &L, &kq, &vq); /* the same random layer */
    double e0 = 0, e1 = 0;
    for (size_t i = 0; i < (size_t)2 * 64 * 16; i++)
        e0 += pow(L.key[i] - ka[i], 2) + pow(L.value[i] - va[i], 2),
        e1 += pow(L.key[i] - kb2[i], 2) + pow(L.value[i] - vb2[i], 2);
    ck_assert_msg(e1 < e0, "rank 4: %g, rank 0: %g", e1, e0);
    ck_assert(bits[2] > bits[0]);
    kvq_layer_free(&L), free(kq), free(vq), free(ka), free(va), free(kb2), free(vb2);
}
END_TEST

START_TEST(lloydmax_structure)
{
    /* rotate=none, 1 bit, sphere D=8: x'_c = ±n·level with the sign of x_c
     * and n = fp16(‖x‖) */
    int T = 6, D = 8;
    kvq_layer L;
    float *kq, *vq;
    double kb, vb;
    run_bits("lloydmax:bits=1,rotate=none", 1, T, D, &kb, &vb, &L, &kq, &vq);
    const kvq_codebook *cb;
    kvq_error err;
    ck_assert_int_eq(kvq_codebook_get(KVQ_CB_SPHERE, D, 1, &cb, &err), KVQ_OK);
    for (int t = 0; t < T; t++) {
        double ss = 0;
        for (int c = 0; c < D; c++) ss += (double)L.key[t * D + c] * L.key[t * D + c];
        float n = kvq_round_f16((float)sqrt(ss));
        for (int c = 0; c < D; c++) {
            float want = n * (L.key[t * D + c] > 0 ? cb->levelf[1] : cb->levelf[0]);
            ck_assert_msg(kq[t * D + c] == want, "t %d c %d: %g vs %g", t, c, kq[t * D + c], want);
        }
    }
    kvq_layer_free(&L), free(kq), free(vq);
    /* with a rotation the reconstruction keeps norm n·‖û‖ */
    run_bits("lloydmax:bits=2,rotate=qr", 1, T, D, &kb, &vb, &L, &kq, &vq);
    ck_assert_int_eq(kvq_codebook_get(KVQ_CB_SPHERE, D, 2, &cb, &err), KVQ_OK);
    for (int t = 0; t < T; t++) {
        double sx = 0, sy = 0;
        for (int c = 0; c < D; c++) sx += pow(L.value[t * D + c], 2), sy += pow(vq[t * D + c], 2);
        ck_assert(sy > 0 && sy <= sx * pow(cb->level[3], 2) * D * 1.01); /* |û_c| <= top level */
    }
    kvq_layer_free(&L), free(kq), free(vq);
}
END_TEST

START_TEST(hadamard_needs_power_of_two)
{
    kvq_spec sp;
    kvq_error err;
    kvq_layer L;
    ck_assert_int_eq(kvq_spec_parse("lloydmax:rotate=hadamard", &sp, &err), KVQ_OK);
    ck_assert_int_eq(kvq_layer_alloc(&L, 1, 1, 4, 12, 0, &err), KVQ_OK);
    float y[48], z[48];
    double kb[1], vb[1], sb[1] = {0};
    kvq_quant_out out = {.key = y, .value = z, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    kvq_quant_ctx ctx = {.nthreads = 1};
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, &L, &out, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "power of two") && strstr(err.msg, "key head 0"), "%s", err.msg);
    kvq_layer_free(&L);
}
END_TEST

START_TEST(kivi_structure)
{
    /* exact tokens stay at the dump's values; quantized ones are per-channel
     * (K) / per-token (V) exactly as the building blocks give */
    kvq_layer L;
    float *kq, *vq;
    double kb, vb;
    int T = 10, D = 8;
    run_bits("kivi:bits=2,group=2,residual=4", 1, T, D, &kb, &vb, &L, &kq, &vq);
    float *ref = malloc((size_t)T * D * sizeof *ref);
    double b;
    kvq_quant_head_per_channel(L.key, ref, T, D, 0, 8, 2, 2, KVQ_SCALE_FP16, &b, NULL);
    ck_assert_int_eq(memcmp(kq, ref, 8 * D * sizeof(float)), 0);
    ck_assert_int_eq(memcmp(kq + 8 * D, L.key + 8 * D, 2 * D * sizeof(float)), 0);
    kvq_quant_head_per_token(L.value, ref, T, D, 0, 6, 2, 2, KVQ_SCALE_FP16, &b, NULL);
    ck_assert_int_eq(memcmp(vq, ref, 6 * D * sizeof(float)), 0);
    ck_assert_int_eq(memcmp(vq + 6 * D, L.value + 6 * D, 4 * D * sizeof(float)), 0);
    free(ref), free(kq), free(vq);
    kvq_layer_free(&L);
}
END_TEST

START_TEST(span_layer_groups_cross_heads)
{
    /* span=layer with G = H·D equals U over each token's concatenated vector */
    int H = 3, T = 5, D = 4;
    kvq_layer L;
    float *kq, *vq;
    double kb, vb;
    run_bits("per-token:bits=2,group=12,span=layer", H, T, D, &kb, &vb, &L, &kq, &vq);
    for (int t = 0; t < T; t++) {
        float cat[12], q[12];
        for (int h = 0; h < H; h++) memcpy(cat + h * D, L.key + ((size_t)h * T + t) * D, D * sizeof(float));
        kvq_group_quantize_ref(cat, q, 12, 1, 2, KVQ_SCALE_FP16);
        for (int h = 0; h < H; h++)
            ck_assert_int_eq(memcmp(q + h * D, kq + ((size_t)h * T + t) * D, D * sizeof(float)), 0);
    }
    free(kq), free(vq);
    kvq_layer_free(&L);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, uniform_hand_cases);
    tcase_add_test(tc, absmax_hand_cases);
    tcase_add_test(tc, channels_path_equals_reference);
    tcase_add_test(tc, per_token_path_equals_reference);
    tcase_add_test(tc, spec_parsing);
    tcase_add_test(tc, registry_defaults_parse);
    tcase_add_test(tc, bits_by_hand);
    tcase_add_test(tc, kivi_structure);
    tcase_add_test(tc, gear_outlier_rule);
    tcase_add_test(tc, gear_reductions);
    tcase_add_test(tc, gear_outliers_exact_and_lowrank_helps);
    tcase_add_test(tc, lloydmax_structure);
    tcase_add_test(tc, lloydmax_snap_equals_search);
    tcase_add_test(tc, hadamard_needs_power_of_two);
    tcase_add_test(tc, span_layer_groups_cross_heads);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
