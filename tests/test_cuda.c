/* test_cuda.c — the GPU path against the CPU reference (docs/tools.md#gpu-path---device-cuda).
 *
 * On a machine with a CUDA GPU and a build with -Dcuda=enabled:
 *   - every plan quantizer's K', V' from the kernels equal the CPU's bit for
 *     bit (odd shapes: D not a multiple of 32, T = 1, groups straddling
 *     heads), with equal error sums and bits;
 *   - a non-finite fp16 scale is reported for the same (tensor, head);
 *   - whole analyses (plan quantizers on the GPU, others uploaded; attention
 *     on the GPU) agree with --device cpu: 1e-4 relative on every metric
 *     (the attention ratios at least 1e-6 absolute; attn_kl: 1e-3 or 1e-9
 *     absolute), bits exactly, attn_top1 within one row (a near-tie may
 *     resolve differently after a different summation order in sgemm), on
 *     odd shapes, several seeds and the bundled dump;
 *   - the prepared (sweep) path equals the streamed one on the GPU.
 * Elsewhere it checks that --device cuda is refused with a clear reason and
 * exits 77 (meson: skipped). */
#include "analysis/device.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static kvq_device *dev;

static const char *const plan_specs[] = {
    "per-token:bits=2,group=32",
    "per-token:bits=3,group=7,scale=fp32",
    "per-token:bits=4,group=48,span=layer",
    "per-channel:bits=2,group=32",
    "per-channel:bits=3,group=5",
    "kivi:bits=2,group=8,residual=16",
    "kivi:kbits=4,vbits=2,group=32,residual=0",
    "kcvt:bits=4",
    "kcvt:bits=2,span=layer",
    "absmax:bits=8",
    "absmax:bits=4,group=6,scale=fp32",
};
#define NPLAN ((int)(sizeof plan_specs / sizeof plan_specs[0]))

/* K or V of a layer: N(0,1) with a few outlier channels. */
static void fill_layer(float *x, int H, int T, int D, uint64_t seed)
{
    fill_normal(x, (size_t)H * T * D, seed, 1.0);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) x[((size_t)h * T + t) * D + (h + 1) % D] *= 20.0f;
}

START_TEST(plan_kernels_match_cpu_bitwise)
{
    static const int shapes[][3] = {{3, 77, 40}, {2, 1, 2}, {4, 300, 128}, {1, 1000, 33}};
    kvq_error err = {0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (uint64_t seed = 1; seed <= 2; seed++) {
            int H = shapes[k][0], T = shapes[k][1], D = shapes[k][2];
            size_t n = (size_t)H * T * D;
            kvq_layer L = {.H = H, .T = T, .D = D, .Hq = H};
            L.key = malloc(n * sizeof(float)), L.value = malloc(n * sizeof(float));
            float *kc = malloc(n * sizeof(float)), *vc = malloc(n * sizeof(float));
            float *kg = malloc(n * sizeof(float)), *vg = malloc(n * sizeof(float));
            fill_layer(L.key, H, T, D, seed * 100 + k);
            fill_layer(L.value, H, T, D, seed * 100 + k + 50);
            ck_assert_msg(kvq_device_set_layer(dev, &L, 1, &err) == KVQ_OK, "%s", err.msg);
            for (int s = 0; s < NPLAN; s++) {
                kvq_spec sp;
                ck_assert_int_eq(kvq_spec_parse(plan_specs[s], &sp, &err), KVQ_OK);
                double kb[4] = {0}, vb[4] = {0}, sb[4] = {0};
                kvq_recon_acc rc[8] = {{0}}, rg[8] = {{0}};
                unsigned char done[8] = {0};
                kvq_quant_ctx ctx = {.layer = 0, .nthreads = 2};
                kvq_quant_out qo = {.key = kc, .value = vc, .k_bits = kb, .v_bits = vb, .static_bytes = sb,
                                    .recon = rc, .recon_done = done};
                ck_assert_msg(kvq_quantize_layer(&sp, &ctx, &L, &qo, &err) == KVQ_OK, "%s", err.msg);
                kvq_plan plan;
                int bad = -1;
                sp.q->plan(&sp, T, D, &plan);
                ck_assert_msg(kvq_device_quantize_plan(dev, 0, &plan, rg, &bad, &err) == KVQ_OK, "%s: %s",
                              plan_specs[s], err.msg);
                ck_assert_msg(kvq_device_download_slot(dev, 0, kg, vg, &err) == KVQ_OK, "%s", err.msg);
                for (size_t i = 0; i < n; i++) {
                    ck_assert_msg(kg[i] == kc[i], "%s [%d,%d,%d] seed %d: K'[%zu] GPU %.9g CPU %.9g", plan_specs[s],
                                  H, T, D, (int)seed, i, kg[i], kc[i]);
                    ck_assert_msg(vg[i] == vc[i], "%s [%d,%d,%d] seed %d: V'[%zu] GPU %.9g CPU %.9g", plan_specs[s],
                                  H, T, D, (int)seed, i, vg[i], vc[i]);
                }
                for (int t = 0; t < 2; t++)
                    for (int h = 0; h < H; h++) {
                        ck_assert(kvq_plan_bits(&plan, t, H, D, h) == (t ? vb[h] : kb[h]));
                        /* the CPU fused or not: compare with the plain sums */
                        kvq_recon_acc ref = {0};
                        size_t off = (size_t)h * T * D;
                        kvq_recon_accumulate_ref(&ref, (t ? L.value : L.key) + off, (t ? vc : kc) + off, (size_t)T * D);
                        const kvq_recon_acc *g = &rg[t * H + h];
                        ck_assert(g->n == ref.n);
                        ck_assert(close_rel(g->sum_x2, ref.sum_x2, 1e-12, 1e-300));
                        ck_assert(close_rel(g->sum_e2, ref.sum_e2, 1e-12, 1e-300));
                        ck_assert(close_rel(g->sum_abs_e, ref.sum_abs_e, 1e-12, 1e-300));
                        ck_assert(g->max_abs == ref.max_abs);
                    }
            }
            free(L.key), free(L.value), free(kc), free(vc), free(kg), free(vg);
        }
}
END_TEST

START_TEST(numeric_error_names_the_same_head)
{
    int H = 3, T = 40, D = 16;
    size_t n = (size_t)H * T * D;
    kvq_layer L = {.H = H, .T = T, .D = D, .Hq = H};
    L.key = malloc(n * sizeof(float)), L.value = malloc(n * sizeof(float));
    float *ko = malloc(n * sizeof(float)), *vo = malloc(n * sizeof(float));
    fill_layer(L.key, H, T, D, 5);
    fill_layer(L.value, H, T, D, 6);
    L.value[((size_t)1 * T + 7) * D + 3] = 1e9f; /* V head 1: the fp16 scale overflows */
    kvq_error err = {0};
    kvq_spec sp;
    ck_assert_int_eq(kvq_spec_parse("per-token:bits=2,group=8", &sp, &err), KVQ_OK);
    double kb[3], vb[3], sb[3] = {0};
    kvq_quant_ctx ctx = {.layer = 0, .nthreads = 1};
    kvq_quant_out qo = {.key = ko, .value = vo, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, &L, &qo, &err), KVQ_ERR_NUMERIC);
    ck_assert_msg(strstr(err.msg, "value head 1"), "%s", err.msg);
    kvq_plan plan;
    sp.q->plan(&sp, T, D, &plan);
    kvq_recon_acc rg[6] = {{0}};
    int bad = -1;
    ck_assert_msg(kvq_device_set_layer(dev, &L, 1, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(kvq_device_quantize_plan(dev, 0, &plan, rg, &bad, &err), KVQ_ERR_NUMERIC);
    ck_assert_int_eq(bad, 1 * H + 1);
    free(L.key), free(L.value), free(ko), free(vo);
}
END_TEST


/* Every GPU metric agrees with the CPU's (docs/README.md tolerances, as the issue asks). */
static void compare_devices(const char *path, const char *what, const char *const *texts, int ns,
                            const char *queries, uint64_t seed)
{
    kvq_error err = {0};
    kvq_spec sp[16];
    for (int s = 0; s < ns; s++) ck_assert_int_eq(kvq_spec_parse(texts[s], &sp[s], &err), KVQ_OK);
    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis_opts o = {.specs = sp, .nspecs = ns, .nthreads = 2, .seed = seed};
    ck_assert_int_eq(kvq_query_sel_parse(queries, &o.queries, &err), KVQ_OK);
    kvq_analysis cpu, gpu;
    ck_assert_msg(kvq_analyze_dump(d, &o, &cpu, &err) == KVQ_OK, "%s", err.msg);
    o.device = dev;
    ck_assert_msg(kvq_analyze_dump(d, &o, &gpu, &err) == KVQ_OK, "%s: %s", what, err.msg);
    ck_assert_int_eq(cpu.has_attn, gpu.has_attn);
    for (int cell = 0; cell < cpu.nlayers * cpu.nheads; cell++)
        for (int s = 0; s < ns; s++) {
            const kvq_acc *ca = &cpu.acc[cell * ns + s], *ga = &gpu.acc[cell * ns + s];
            kvq_metrics c, g;
            kvq_metrics_finalize(ca, &c);
            kvq_metrics_finalize(ga, &g);
            ck_assert_int_eq(c.has_attn, g.has_attn);
            if (c.has_attn) ck_assert(ga->attn.rows == ca->attn.rows);
            /* every column of lib/kvq_metric_cols.def, so a new metric is compared too and a
             * sum the GPU leaves at 0 (where the CPU's is not) fails */
            const char *name;
            unsigned flags;
            for (int i = 0; kvq_metric_column(i, &name, &flags); i++) {
                if ((flags & KVQ_METRIC_ATTN) && !c.has_attn) continue;
                double cv = kvq_metric_value(&c, i), gv = kvq_metric_value(&g, i);
                int ok;
                if (gv == cv)
                    ok = 1; /* also both infinite: k_sqnr_db where K′ is exact */
                else if (!strcmp(name, "k_bits") || !strcmp(name, "v_bits"))
                    ok = 0;
                else if (!strcmp(name, "attn_kl")) ok = close_rel(gv, cv, 1e-3, 1e-6) || fabs(gv - cv) <= 1e-9;
                else if (!strcmp(name, "attn_top1")) ok = fabs(gv - cv) * ca->attn.rows <= 1.0; /* one row may flip */
                /* score_rel, attn_rel, out_rel…: a norm of S′ − S (A′ − A, O′ − O) over the exact one.
                 * Each device rounds its float32 products at about √D·2⁻²⁴ of the exact norm, in its own
                 * summation order, so where the ratio itself is small (a 3-bit per-channel K′ gives
                 * score_rel ≈ 1e-4 on the H100 run's 64-wide shape) the two may differ by that much:
                 * 1e-4 relative, but at least 1e-6 absolute (as 1e-4 of a floor of 1e-2) */
                else
                    ok = close_rel(gv, cv, 1e-4, (flags & KVQ_METRIC_ATTN) ? 1e-2 : 1e-12);
                ck_assert_msg(ok && !(cv != 0 && gv == 0), "%s %s cell %d: %s GPU %.9g CPU %.9g", what, texts[s], cell,
                              name, gv, cv);
            }
        }
    kvq_analysis_free(&cpu);
    kvq_analysis_free(&gpu);
    kvq_dump_close(d);
}

static const char *const mixed_specs[] = {
    "per-token:bits=2,group=32", "per-token:bits=4,group=16,span=layer", "per-channel:bits=3,group=16",
    "kivi:bits=2,group=8,residual=32", "kcvt:bits=4,span=layer", "absmax:bits=8",
    "lloydmax:bits=2", "gear:bits=2,group=8,rank=2", /* on the CPU, uploaded */
};
#define NMIXED ((int)(sizeof mixed_specs / sizeof mixed_specs[0]))

START_TEST(analysis_matches_cpu_odd_shapes)
{
    static const int shapes[][5] = {/* L, Hq, H, D, T */ {2, 6, 3, 40, 77}, {1, 4, 4, 64, 300}, {1, 8, 2, 16, 1}};
    static const char *const queries[] = {"last:64", "all", "random:50", "every:7"};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (uint64_t seed = 0; seed < 2; seed++) {
            char *path = gen_dump(shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3], shapes[k][4], 10 + seed);
            char what[64];
            snprintf(what, sizeof what, "shape %zu seed %d", k, (int)seed);
            compare_devices(path, what, mixed_specs, NMIXED, queries[(k + seed) % 4], seed);
            unlink(path);
            free(path);
        }
}
END_TEST

START_TEST(analysis_matches_cpu_real_dump)
{
    const char *path = KVQ_SOURCE_ROOT "/data/stories260K.h5";
    compare_devices(path, "stories260K last:64", plan_specs, NPLAN, "last:64", 0);
    compare_devices(path, "stories260K all", mixed_specs, NMIXED, "all", 3);
}
END_TEST

START_TEST(prepared_equals_streamed_on_device)
{
    char *path = gen_dump(2, 4, 2, 24, 500, 4);
    kvq_error err = {0};
    kvq_spec sp[2];
    ck_assert_int_eq(kvq_spec_parse("kivi:bits=2,group=16,residual=32", &sp[0], &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_parse("lloydmax:bits=3", &sp[1], &err), KVQ_OK);
    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis_opts o = {.specs = sp, .nspecs = 2, .nthreads = 2, .seed = 1, .device = dev};
    kvq_query_sel_parse("random:100", &o.queries, &err);
    kvq_analysis a, b;
    kvq_prepared *p;
    ck_assert_msg(kvq_analyze_dump(d, &o, &a, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_msg(kvq_prepare_dump(d, &o, 0, &p, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_msg(kvq_analyze_prepared(p, &o, &b, &err) == KVQ_OK, "%s", err.msg);
    for (int c = 0; c < a.nlayers * a.nheads * 2; c++)
        ck_assert_int_eq(memcmp(&a.acc[c], &b.acc[c], sizeof a.acc[0]), 0);
    /* a cache built for the GPU is not silently analysed on the CPU */
    o.device = NULL;
    kvq_analysis x;
    ck_assert_int_eq(kvq_analyze_prepared(p, &o, &x, &err), KVQ_ERR_USAGE);
    kvq_prepared_free(p);
    kvq_analysis_free(&a), kvq_analysis_free(&b);
    kvq_dump_close(d);
    unlink(path);
    free(path);
}
END_TEST

int main(void)
{
    kvq_error err = {0};
    kvq_status st = kvq_device_open_cuda(&dev, &err);
    if (st) {
        /* no GPU path here: the refusal must be clear, then skip */
        int ok = st == KVQ_ERR_UNSUPPORTED && strstr(err.msg, "--device cuda") &&
                 (kvq_device_cuda_built() ? strstr(err.msg, "GPU") != NULL : strstr(err.msg, "without CUDA") != NULL);
        printf("cuda: skipped: %s\n", err.msg);
        return ok ? 77 : EXIT_FAILURE;
    }
    printf("cuda: testing on %s\n", kvq_device_name(dev));
    Suite *s = suite_create("cuda");
    TCase *tc = tcase_create("gpu-vs-cpu");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, plan_kernels_match_cpu_bitwise);
    tcase_add_test(tc, numeric_error_names_the_same_head);
    tcase_add_test(tc, analysis_matches_cpu_odd_shapes);
    tcase_add_test(tc, analysis_matches_cpu_real_dump);
    tcase_add_test(tc, prepared_equals_streamed_on_device);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK); /* a CUDA context does not survive fork() */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    kvq_device_close(dev);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
