/* test_vq.c — the vq family (docs/quantizers.md#vq): cases worked by hand
 * (a codebook that holds every distinct point returns them at float16;
 * two clusters of two points; a second stage that codes the residual
 * exactly; ties to the lower index, the index order told by the
 * documented random stream; space=pre re-applying RoPE), the fast path
 * against the reference on data full of exact and near ties, bits and static
 * bytes, idempotence, error against bits and stages on the bundled dump,
 * and the refusals (dims, calibration, key_pre_rope); few distinct points are a note. */
#include "testutil.h"

/* spec on L (calibrated on `calib` where it asks) with seed 7 at layer 3;
 * KVQ_OK or the status, err filled. */
static kvq_status run_vq(const char *text, const kvq_layer *L, const kvq_layer *calib, const kvq_rope *rope,
                         int reference, int threads, float *kq, float *vq, double *kb, double *vb, double *sb,
                         kvq_error *err)
{
    kvq_spec sp;
    ck_assert_msg(kvq_spec_parse(text, &sp, err) == KVQ_OK, "%s", err->msg);
    kvq_quant_ctx ctx = {.layer = 3, .seed = 7, .nthreads = threads, .rope = rope};
    void *state = NULL;
    char key[256];
    if (sp.q->calib_key(&sp, key, sizeof key)) {
        if (!calib) return kvq_quantize_layer(&sp, &ctx, L, &(kvq_quant_out){0}, err); /* refused */
        kvq_status st = sp.q->calibrate(&sp, &ctx, calib, &state, err);
        if (st) return st;
        ctx.calib = state;
    }
    for (int h = 0; h < L->H; h++) sb[h] = 0;
    kvq_quant_out out = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    kvq_status st = reference ? kvq_quantize_layer_reference(&sp, &ctx, L, &out, err)
                              : kvq_quantize_layer(&sp, &ctx, L, &out, err);
    if (state) sp.q->calib_free(state);
    return st;
}

static void layer_kv(kvq_layer *L, int H, int T, int D, const float *k, const float *v, unsigned flags)
{
    kvq_error err;
    ck_assert_int_eq(kvq_layer_alloc(L, H, H, T, D, flags, &err), KVQ_OK);
    memcpy(L->key, k, (size_t)H * T * D * sizeof *k);
    memcpy(L->value, v, (size_t)H * T * D * sizeof *v);
}

START_TEST(vq_codebook_holds_every_point)
{
    /* each head's sub-vectors at each position are 8 distinct vectors,
     * repeated: 8 centres (bits=3) are exactly those, at float16 */
    enum { H = 2, T = 40, D = 8 };
    float k[H * T * D], v[H * T * D], pool[2][H][2][8][4];
    fill_normal(&pool[0][0][0][0][0], sizeof pool / sizeof(float), 5, 1.0);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < D; c++) {
                int g = c / 4, pick = (t * 5 + g) % 8;
                k[(h * T + t) * D + c] = pool[0][h][g][pick][c % 4];
                v[(h * T + t) * D + c] = pool[1][h][g][pick][c % 4];
            }
    kvq_layer L;
    layer_kv(&L, H, T, D, k, v, 0);
    float kq[H * T * D], vq[H * T * D];
    double kb[H], vb[H], sb[H];
    kvq_error err = {0};
    ck_assert_msg(run_vq("vq:dims=4,bits=3,codebook=data", &L, NULL, NULL, 0, 2, kq, vq, kb, vb, sb, &err) == KVQ_OK,
                  "%s", err.msg);
    for (int i = 0; i < H * T * D; i++)
        ck_assert_msg(kq[i] == kvq_round_f16(k[i]) && vq[i] == kvq_round_f16(v[i]), "[%d] %a %a", i, kq[i], vq[i]);
    for (int h = 0; h < H; h++) {
        ck_assert_double_eq(kb[h], T * D * 3.0 / 4); /* stages·bits/dims per element */
        ck_assert_double_eq(vb[h], T * D * 3.0 / 4);
        ck_assert_double_eq(sb[h], 2 * (D / 4) * (1 * 8 * 4 * 2)); /* K, V: 2 books of s·2^b·c·2 bytes */
    }
    /* share=layer: one book per position for both heads, its bytes split */
    ck_assert_int_eq(run_vq("vq:dims=4,bits=4,stages=2,codebook=data,share=layer", &L, NULL, NULL, 0, 2, kq, vq, kb,
                            vb, sb, &err), KVQ_OK);
    ck_assert_double_eq(kb[0], T * D * 2 * 4.0 / 4);
    ck_assert_double_eq(sb[0] + sb[1], 2 * (D / 4) * (2 * 16 * 4 * 2));
    kvq_layer_free(&L);
}
END_TEST

START_TEST(vq_two_clusters_and_a_second_stage)
{
    /* (0,0), (1,0), (10,0), (11,0): whatever two points k-means++ draws,
     * Lloyd ends at (0.5, 0) and (10.5, 0) */
    const float x[8] = {0, 0, 1, 0, 10, 0, 11, 0};
    kvq_layer L;
    layer_kv(&L, 1, 4, 2, x, x, 0);
    float kq[8], vq[8];
    double kb[1], vb[1], sb[1];
    kvq_error err = {0};
    for (uint64_t ref = 0; ref < 2; ref++) {
        ck_assert_int_eq(run_vq("vq:dims=2,bits=1,codebook=data", &L, NULL, NULL, (int)ref, 1, kq, vq, kb, vb, sb,
                                &err), KVQ_OK);
        const float want[8] = {0.5f, 0, 0.5f, 0, 10.5f, 0, 10.5f, 0};
        ck_assert(!memcmp(kq, want, sizeof want) && !memcmp(vq, want, sizeof want));
        ck_assert_double_eq(kb[0], 4.0); /* 4 tokens · 2 channels · 1/2 bit */
        /* stage 2 on the residuals ±0.5: two distinct points, two centres: exact */
        ck_assert_int_eq(run_vq("vq:dims=2,bits=1,stages=2,codebook=data", &L, NULL, NULL, (int)ref, 1, kq, vq, kb,
                                vb, sb, &err), KVQ_OK);
        ck_assert(!memcmp(kq, x, sizeof x) && !memcmp(vq, x, sizeof x));
        ck_assert_double_eq(kb[0], 8.0);
        ck_assert_double_eq(sb[0], 2 * 1 * (2 * 2 * 2 * 2));
    }
    kvq_layer_free(&L);
}
END_TEST

START_TEST(vq_ties_go_to_the_lower_index)
{
    /* calibration: (0,0) and (2,0), two centres for two distinct points:
     * each is a centre, in order of first appearance (SPEC 3.10), so
     * centre 0 is (0,0).  The data (1,0) is equally far from both: it takes
     * centre 0. */
    const float c[4] = {0, 0, 2, 0}, x[2] = {1, 0};
    kvq_layer C, L;
    layer_kv(&C, 1, 2, 2, c, c, 0);
    layer_kv(&L, 1, 1, 2, x, x, 0);
    for (int ref = 0; ref < 2; ref++) {
        float kq[2], vq[2];
        double kb[1], vb[1], sb[1];
        kvq_error err = {0};
        ck_assert_int_eq(run_vq("vq:dims=2,bits=1", &L, &C, NULL, ref, 1, kq, vq, kb, vb, sb, &err), KVQ_OK);
        for (int tensor = 0; tensor < 2; tensor++)
            ck_assert_msg((tensor ? vq : kq)[0] == c[0], "tensor %d: %g, centre 0 is %g", tensor,
                          (tensor ? vq : kq)[0], c[0]);
    }
    kvq_layer_free(&C), kvq_layer_free(&L);
}
END_TEST

START_TEST(vq_fast_equals_reference_on_ties)
{
    /* 16 centres on the grid {0..3}² (calibration points repeated); data on
     * half-integer points (2- and 4-way ties) and a hair beside them */
    enum { H = 2, TC = 64, T = 96, D = 4 };
    float c[H * TC * D], x[H * T * D];
    for (int i = 0; i < H * TC; i++)
        for (int g = 0; g < 2; g++) c[i * D + 2 * g] = (float)(i % 4), c[i * D + 2 * g + 1] = (float)(i / 4 % 4);
    kvq_rng rng;
    kvq_rng_init(&rng, 1, 2, 3, 4);
    for (int i = 0; i < H * T * D; i++) {
        float base = (float)kvq_rng_below(&rng, 7) * 0.5f - 0.5f;
        uint64_t r = kvq_rng_below(&rng, 4);
        x[i] = r == 0 ? nextafterf(base, INFINITY) : r == 1 ? nextafterf(base, -INFINITY) : base;
    }
    kvq_layer C, L;
    layer_kv(&C, H, TC, D, c, c, 0);
    layer_kv(&L, H, T, D, x, x, 0);
    const char *specs[] = {"vq:dims=2,bits=4", "vq:dims=2,bits=4,share=layer", "vq:dims=2,bits=2,stages=2,iters=5"};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        float kq[2][H * T * D], vq[2][H * T * D];
        double kb[2][H], vb[2][H], sb[2][H];
        kvq_error err = {0};
        for (int ref = 0; ref < 2; ref++)
            ck_assert_msg(run_vq(specs[s], &L, &C, NULL, ref, 2, kq[ref], vq[ref], kb[ref], vb[ref], sb[ref], &err) ==
                              KVQ_OK, "%s: %s", specs[s], err.msg);
        ck_assert_msg(!memcmp(kq[0], kq[1], sizeof kq[0]) && !memcmp(vq[0], vq[1], sizeof vq[0]), "%s", specs[s]);
        if (s < 2) /* one stage on the grid: every point went to a nearest grid point */
            for (int i = 0; i < H * T * D; i++) ck_assert(fabsf(kq[0][i] - x[i]) <= 0.5f + 1e-6f);
    }
    kvq_layer_free(&C), kvq_layer_free(&L);
}
END_TEST

START_TEST(vq_space_pre_reapplies_rope)
{
    enum { H = 1, T = 8, D = 4 };
    float pre[H * T * D], k[H * T * D], v[H * T * D];
    fill_normal(pre, H * T * D, 21, 1.0);
    fill_normal(v, H * T * D, 22, 1.0);
    kvq_rope rope;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_rope_from_theta(&rope, T, D, 10000.0, KVQ_ROPE_HALF, &err), KVQ_OK);
    memcpy(k, pre, sizeof k);
    for (int t = 0; t < T; t++) kvq_rope_rotate(&rope, k + t * D, t, 0);
    kvq_layer L;
    layer_kv(&L, H, T, D, k, v, KVQ_READ_KEY_PRE_ROPE);
    memcpy(L.key_pre_rope, pre, sizeof pre);
    float kq[H * T * D], vq[H * T * D];
    double kb[H], vb[H], sb[H];
    /* 8 distinct pre-RoPE sub-vectors, 8 centres: K' = RoPE_t(fp16(K_pre)) */
    ck_assert_int_eq(run_vq("vq:dims=2,bits=3,codebook=data,space=pre", &L, NULL, &rope, 0, 1, kq, vq, kb, vb, sb,
                            &err), KVQ_OK);
    for (int t = 0; t < T; t++) {
        float want[D];
        for (int c = 0; c < D; c++) want[c] = kvq_round_f16(pre[t * D + c]);
        kvq_rope_rotate(&rope, want, t, 0);
        for (int c = 0; c < D; c++) ck_assert(kq[t * D + c] == want[c] && vq[t * D + c] == kvq_round_f16(v[t * D + c]));
    }
    /* without RoPE, or without key_pre_rope: one line naming the key */
    ck_assert_int_eq(run_vq("vq:dims=2,bits=3,codebook=data,space=pre", &L, NULL, NULL, 0, 1, kq, vq, kb, vb, sb,
                            &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "space=pre") && strstr(err.msg, "rope_theta"), "%s", err.msg);
    kvq_layer_free(&L);
    layer_kv(&L, H, T, D, k, v, 0);
    ck_assert_int_eq(run_vq("vq:dims=2,bits=3,codebook=data,space=pre", &L, NULL, &rope, 0, 1, kq, vq, kb, vb, sb,
                            &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "space=pre") && strstr(err.msg, "key_pre_rope"), "%s", err.msg);
    kvq_layer_free(&L);
    kvq_rope_free(&rope);
}
END_TEST

START_TEST(vq_refusals)
{
    kvq_spec sp;
    kvq_error err = {0};
    /* dims must divide head_dim: a usage error naming both */
    ck_assert_int_eq(kvq_spec_parse("vq:dims=3", &sp, &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_check_shape(&sp, 8, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "dims=3") && strstr(err.msg, "head_dim 8"), "%s", err.msg);
    ck_assert_int_eq(kvq_spec_parse("vq:bits=13", &sp, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_spec_parse("vq:stages=5", &sp, &err), KVQ_ERR_USAGE);
    /* codebook=calib needs a calibration dump; data does not */
    ck_assert_int_eq(kvq_spec_parse("vq", &sp, &err), KVQ_OK);
    ck_assert(kvq_spec_needs_calib(&sp));
    ck_assert_int_eq(kvq_spec_check_calib(&sp, 0, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_spec_parse("vq:codebook=data", &sp, &err), KVQ_OK);
    ck_assert(!kvq_spec_needs_calib(&sp));
    float x[2 * 16 * 4];
    fill_normal(x, 2 * 16 * 4, 3, 1.0);
    for (int i = 0; i < 2 * 16 * 4; i++) x[i] = kvq_round_f16(x[i]); /* centres can hold them exactly */
    kvq_layer L;
    layer_kv(&L, 2, 16, 4, x, x, 0);
    float kq[128], vq[128];
    double kb[2], vb[2], sb[2];
    ck_assert_int_eq(run_vq("vq:dims=2", &L, NULL, NULL, 0, 1, kq, vq, kb, vb, sb, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "calibration"), "%s", err.msg);
    /* at most 2^bits distinct sub-vectors: each is a centre (k-means' optimum, SPEC 3.10), so the
     * float16 data come back exactly; a note names the first such codebook, not an error */
    char notes[2048];
    kvq_take_notes(NULL, 0);
    ck_assert_int_eq(run_vq("vq:dims=2,bits=5,codebook=data", &L, NULL, NULL, 0, 2, kq, vq, kb, vb, sb, &err),
                     KVQ_OK);
    ck_assert(!memcmp(kq, x, sizeof kq) && !memcmp(vq, x, sizeof vq));
    kvq_take_notes(notes, sizeof notes);
    ck_assert_msg(strstr(notes, "layer 3, key head 0, group 0 (channels 0-1), stage 1: 16 distinct") &&
                      strstr(notes, "2^bits = 32") && strstr(notes, "more like it"), "%s", notes);
    /* share=layer pools the heads: 32 points */
    ck_assert_int_eq(run_vq("vq:dims=2,bits=5,codebook=data,share=layer", &L, NULL, NULL, 0, 2, kq, vq, kb, vb, sb,
                            &err), KVQ_OK);
    /* a second stage with nothing left to code: its residuals are all 0, one centre holds them */
    kvq_take_notes(NULL, 0);
    ck_assert_int_eq(run_vq("vq:dims=2,bits=4,stages=2,codebook=data", &L, NULL, NULL, 0, 2, kq, vq, kb, vb, sb,
                            &err), KVQ_OK);
    ck_assert(!memcmp(kq, x, sizeof kq));
    kvq_take_notes(notes, sizeof notes);
    ck_assert_msg(strstr(notes, "16 distinct"), "%s", notes);
    kvq_layer_free(&L);
}
END_TEST

/* The bundled dump, calibrated on the bundled calibration dump: pooled
 * relative Frobenius errors of K and V over every layer and head. */
static void bundled_errors(const char *text, double *ek, double *ev)
{
    char dump[1024], cal[1024];
    snprintf(dump, sizeof dump, "%s/data/stories260K.h5", KVQ_SOURCE_ROOT);
    snprintf(cal, sizeof cal, "%s/data/stories260K-calib.h5", KVQ_SOURCE_ROOT);
    kvq_error err = {0};
    kvq_calib *c;
    kvq_dump *d;
    kvq_spec sp;
    ck_assert_int_eq(kvq_calib_open(cal, &c, &err), KVQ_OK);
    ck_assert_int_eq(kvq_dump_open(dump, &d, &err), KVQ_OK);
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis_opts o = {.specs = &sp, .nspecs = 1, .queries = {KVQ_Q_LAST, 16}, .seed = 0, .calib = c};
    kvq_analysis a;
    ck_assert_msg(kvq_analyze_dump(d, &o, &a, &err) == KVQ_OK, "%s: %s", text, err.msg);
    double e[2] = {0}, s[2] = {0};
    for (int i = 0; i < a.nlayers * a.nheads; i++) {
        e[0] += a.acc[i].k.sum_e2, s[0] += a.acc[i].k.sum_x2;
        e[1] += a.acc[i].v.sum_e2, s[1] += a.acc[i].v.sum_x2;
        ck_assert_double_eq(a.acc[i].k.bits, a.acc[i].k.n * sp.val[2] * sp.val[1] / sp.val[0]);
    }
    *ek = sqrt(e[0] / s[0]), *ev = sqrt(e[1] / s[1]);
    kvq_analysis_free(&a);
    kvq_dump_close(d);
    kvq_calib_close(c);
}

/* The spec fmt % i for i = from..to: K's and V's errors fall at every step. */
static void errors_fall(const char *fmt, int from, int to)
{
    double pk = INFINITY, pv = INFINITY;
    for (int i = from; i <= to; i++) {
        char text[64];
        double ek, ev;
        snprintf(text, sizeof text, fmt, i);
        bundled_errors(text, &ek, &ev);
        ck_assert_msg(ek < pk && ev < pv, "%s: K %g V %g after %g %g", text, ek, ev, pk, pv);
        pk = ek, pv = ev;
    }
}

START_TEST(vq_error_falls_with_bits_and_stages)
{
    /* share=head: bits 1..7 (layer 0's calibration values repeat with the
     * token, 150 distinct per head, so 7 bits is the most) */
    errors_fall("vq:dims=2,bits=%d", 1, 7);
    errors_fall("vq:dims=4,bits=4,stages=%d,share=layer", 1, 3);
}
END_TEST

START_TEST(vq_reconstruction_is_a_fixed_point)
{
    /* one stage: quantizing K', V' again with the same codebooks returns them */
    enum { H = 2, TC = 300, T = 64, D = 8 };
    static float c[H * TC * D], x[H * T * D];
    fill_normal(c, H * TC * D, 31, 1.0);
    fill_normal(x, H * T * D, 32, 1.0);
    kvq_layer C, L, L2;
    layer_kv(&C, H, TC, D, c, c, 0);
    layer_kv(&L, H, T, D, x, x, 0);
    const char *specs[] = {"vq", "vq:dims=8,bits=6,share=layer", "vq:dims=1,bits=3"};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        static float kq[H * T * D], vq[H * T * D], kq2[H * T * D], vq2[H * T * D];
        double kb[H], vb[H], sb[H];
        kvq_error err = {0};
        ck_assert_int_eq(run_vq(specs[s], &L, &C, NULL, 0, 2, kq, vq, kb, vb, sb, &err), KVQ_OK);
        layer_kv(&L2, H, T, D, kq, vq, 0);
        ck_assert_int_eq(run_vq(specs[s], &L2, &C, NULL, 0, 2, kq2, vq2, kb, vb, sb, &err), KVQ_OK);
        ck_assert_msg(!memcmp(kq, kq2, sizeof kq) && !memcmp(vq, vq2, sizeof vq), "%s", specs[s]);
        kvq_layer_free(&L2);
    }
    kvq_layer_free(&C), kvq_layer_free(&L);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("vq");
    TCase *tc = tcase_create("vq");
    tcase_add_test(tc, vq_codebook_holds_every_point);
    tcase_add_test(tc, vq_two_clusters_and_a_second_stage);
    tcase_add_test(tc, vq_ties_go_to_the_lower_index);
    tcase_add_test(tc, vq_fast_equals_reference_on_ties);
    tcase_add_test(tc, vq_space_pre_reapplies_rope);
    tcase_add_test(tc, vq_refusals);
    tcase_add_test(tc, vq_error_falls_with_bits_and_stages);
    tcase_add_test(tc, vq_reconstruction_is_a_fixed_point);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
