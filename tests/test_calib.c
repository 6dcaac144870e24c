/* test_calib.c — quantizers calibrated on a --calib dump: `cluster` and
 * `lloydmax:codebook=data`, run through the analysis driver on small
 * kvq-gen dumps (bits by hand, static bytes, shared calibration, thread
 * invariance, RoPE from tables or theta, pre-RoPE keys absent, errors). */
#include "testutil.h"

#include <string.h>
#include <unistd.h>

static char *tmp_path(void)
{
    char *p = strdup("/tmp/kvq-calib-XXXXXX.h5");
    int fd = mkstemps(p, 3);
    ck_assert_int_ge(fd, 0);
    close(fd);
    return p;
}

enum { L = 2, HQ = 4, H = 2, D = 8, T = 48 };

static char *gen(uint64_t seed, int pre_rope, int dim)
{
    char *p = tmp_path();
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    o.num_layers = L, o.num_heads = HQ, o.num_kv_heads = H, o.head_dim = dim, o.seq_len = T;
    o.outlier_channels = 1, o.seed = seed, o.with_key_pre_rope = pre_rope;
    o.rope_style = KVQ_ROPE_INTERLEAVED;
    kvq_error err;
    ck_assert_msg(kvq_gen_write(p, &o, &err) == KVQ_OK, "%s", err.msg);
    return p;
}

/* A copy of src without rope_theta (RoPE as explicit tables instead) or
 * without rope information at all. */
static char *copy_rope(const char *src, int tables)
{
    char *p = tmp_path();
    kvq_dump *d;
    kvq_dump_writer *w;
    kvq_error err;
    ck_assert_int_eq(kvq_dump_open(src, &d, &err), KVQ_OK);
    kvq_dump_info info = *kvq_dump_get_info(d);
    double theta = info.rope_theta;
    info.has_rope_theta = 0;
    ck_assert_int_eq(kvq_dump_writer_create(p, &info, KVQ_F32, &w, &err), KVQ_OK);
    for (int l = 0; l < L; l++) {
        kvq_layer ly;
        ck_assert_int_eq(kvq_dump_read_layer(d, l, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &ly, &err), KVQ_OK);
        ck_assert_int_eq(kvq_dump_writer_layer(w, l, &ly, &err), KVQ_OK);
        kvq_layer_free(&ly);
    }
    if (tables) {
        kvq_rope r;
        ck_assert_int_eq(kvq_rope_from_theta(&r, T, D, theta, info.rope_style, &err), KVQ_OK);
        float c[T * D / 2], s[T * D / 2];
        for (int i = 0; i < T * D / 2; i++) c[i] = (float)r.cos[i], s[i] = (float)r.sin[i];
        ck_assert_int_eq(kvq_dump_writer_rope_table(w, c, s, &err), KVQ_OK);
        kvq_rope_free(&r);
    }
    ck_assert_int_eq(kvq_dump_writer_finish(w, &err), KVQ_OK);
    kvq_dump_close(d);
    return p;
}

/* Runs specs on dump with calib; the analysis in *a. */
static kvq_status analyze(const char *dump, kvq_calib *calib, const char *const *texts, int n, int threads,
                          kvq_analysis *a, kvq_spec *specs, kvq_error *err)
{
    for (int i = 0; i < n; i++) ck_assert_msg(kvq_spec_parse(texts[i], &specs[i], err) == KVQ_OK, "%s", err->msg);
    kvq_dump *d;
    ck_assert_int_eq(kvq_dump_open(dump, &d, err), KVQ_OK);
    kvq_analysis_opts o = {.specs = specs, .nspecs = n, .queries = {KVQ_Q_LAST, 16}, .seed = 7,
                           .nthreads = threads, .calib = calib};
    kvq_status st = kvq_analyze_dump(d, &o, a, err);
    kvq_dump_close(d);
    return st;
}

START_TEST(cluster_bits_static_and_sharing)
{
    char *cal = gen(1, 1, D), *tgt = gen(2, 1, D);
    kvq_calib *c;
    kvq_error err;
    ck_assert_int_eq(kvq_calib_open(cal, &c, &err), KVQ_OK);
    const char *texts[] = {"cluster:centroids=4,group=8,window=8", "cluster:centroids=4,kbits=3,group=8,window=8",
                           "cluster:centroids=3,vbits=1,window=100,rotate=hadamard", "lloydmax:codebook=data"};
    kvq_spec specs[4];
    kvq_analysis a;
    ck_assert_msg(analyze(tgt, c, texts, 4, 2, &a, specs, &err) == KVQ_OK, "%s", err.msg);
    /* states: centroids=4 (shared by the first two), centroids=3, lloydmax data: 3 per layer */
    ck_assert_int_eq(kvq_calib_count(c), 3 * L);
    double n = (double)T * D;
    for (int cell = 0; cell < L * H; cell++) {
        const kvq_acc *x = &a.acc[cell * 4];
        /* K: 40 tokens · (2 index + 8·2 codes) + 5 groups · 8 channels · 32 + 8 exact tokens · 8 · 16 */
        ck_assert_msg(fabs(x[0].k.bits - (40 * (2 + 16) + 5 * 8 * 32 + 8 * 8 * 16)) < 1e-9, "%g", x[0].k.bits);
        /* V: 40 · (2 index + 8·2 codes + 16 norm) + exact window */
        ck_assert(fabs(x[0].v.bits - (40 * (2 + 16 + 16) + 8 * 8 * 16)) < 1e-9);
        ck_assert(fabs(x[1].k.bits - (40 * (2 + 24) + 5 * 8 * 32 + 8 * 8 * 16)) < 1e-9);
        /* window 100 > T: every token exact */
        ck_assert(fabs(x[2].k.bits - 16 * n) < 1e-9 && fabs(x[2].v.bits - 16 * n) < 1e-9);
        ck_assert(x[2].k.sum_e2 == 0 && x[2].v.sum_e2 == 0);
        /* static: K and V centres (fp32) + the 2-bit codebook + a qr rotation */
        ck_assert(x[0].static_bytes == 2 * 4 * 8 * 4 + 4 * 4 + 4 * 8 * 8);
        /* 3 centres, 1-bit codebook, hadamard signs (1 byte for D = 8) */
        ck_assert(x[2].static_bytes == 2 * 3 * 8 * 4 + 2 * 4 + 1);
        /* lloydmax data: b·D + 16 per token, K and V rotations + codebooks */
        ck_assert(fabs(x[3].k.bits - T * (2 * 8 + 16)) < 1e-9);
        ck_assert(x[3].static_bytes == 2 * (4 * 8 * 8 + 4 * 4));
        ck_assert(x[0].k.sum_e2 > 0 && x[0].k.sum_e2 < x[0].k.sum_x2);
        ck_assert(x[1].k.sum_e2 < x[0].k.sum_e2); /* 3-bit residuals beat 2-bit */
    }
    /* same run, one thread, a fresh calibration: identical sums */
    kvq_analysis b;
    kvq_calib *c2;
    ck_assert_int_eq(kvq_calib_open(cal, &c2, &err), KVQ_OK);
    ck_assert_int_eq(analyze(tgt, c2, texts, 4, 1, &b, specs, &err), KVQ_OK);
    ck_assert_int_eq(memcmp(a.acc, b.acc, (size_t)L * H * 4 * sizeof *a.acc), 0);
    /* a second run on the same calibration reuses every state */
    kvq_analysis_free(&b);
    ck_assert_int_eq(analyze(tgt, c, texts, 4, 2, &b, specs, &err), KVQ_OK);
    ck_assert_int_eq(kvq_calib_count(c), 3 * L);
    ck_assert_int_eq(memcmp(a.acc, b.acc, (size_t)L * H * 4 * sizeof *a.acc), 0);
    kvq_analysis_free(&a), kvq_analysis_free(&b);
    kvq_calib_close(c), kvq_calib_close(c2);
    unlink(cal), unlink(tgt);
    free(cal), free(tgt);
}
END_TEST

START_TEST(cluster_rope_sources)
{
    char *cal = gen(1, 1, D), *tgt = gen(2, 1, D), *nopre = gen(2, 0, D);
    char *tables = copy_rope(tgt, 1), *norope = copy_rope(tgt, 0);
    kvq_calib *c;
    kvq_error err;
    ck_assert_int_eq(kvq_calib_open(cal, &c, &err), KVQ_OK);
    const char *texts[] = {"cluster:centroids=4,group=8,window=8"};
    kvq_spec sp[1];
    kvq_analysis a, b, e;
    ck_assert_int_eq(analyze(tgt, c, texts, 1, 2, &a, sp, &err), KVQ_OK);
    /* RoPE from rope_cos/rope_sin tables (float) instead of theta: the same to float rounding */
    ck_assert_msg(analyze(tables, c, texts, 1, 2, &b, sp, &err) == KVQ_OK, "%s", err.msg);
    for (int i = 0; i < L * H; i++)
        ck_assert_msg(close_rel(b.acc[i].k.sum_e2, a.acc[i].k.sum_e2, 1e-4, 1e-12), "%g vs %g", b.acc[i].k.sum_e2,
                      a.acc[i].k.sum_e2);
    kvq_analysis_free(&b);
    /* no key_pre_rope in the dump: pre-RoPE keys by inverse RoPE, close to the stored ones */
    ck_assert_msg(analyze(nopre, c, texts, 1, 2, &b, sp, &err) == KVQ_OK, "%s", err.msg);
    double ea = 0, eb = 0;
    for (int i = 0; i < L * H; i++) ea += a.acc[i].k.sum_e2, eb += b.acc[i].k.sum_e2;
    ck_assert_msg(close_rel(eb, ea, 1e-3, 1e-12), "%g vs %g", eb, ea);
    kvq_analysis_free(&b);
    /* pre-RoPE centres but no RoPE information in the dump: a clear error */
    ck_assert_int_eq(analyze(norope, c, texts, 1, 2, &e, sp, &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "rope_theta") && strstr(err.msg, "key head 0"), "%s", err.msg);
    kvq_analysis_free(&a);
    kvq_calib_close(c);
    char *files[] = {cal, tgt, nopre, tables, norope};
    for (int i = 0; i < 5; i++) unlink(files[i]), free(files[i]);
}
END_TEST

START_TEST(calibration_errors)
{
    char *cal16 = gen(1, 1, 16), *tgt = gen(2, 1, D);
    kvq_error err;
    const char *texts[] = {"cluster"};
    kvq_spec sp[1];
    kvq_analysis a;
    /* no --calib */
    ck_assert_int_eq(analyze(tgt, NULL, texts, 1, 1, &a, sp, &err), KVQ_ERR_USAGE);
    ck_assert(strstr(err.msg, KVQ_NEEDS_CALIB));
    const char *lm[] = {"lloydmax:codebook=data"};
    ck_assert_int_eq(analyze(tgt, NULL, lm, 1, 1, &a, sp, &err), KVQ_ERR_USAGE);
    /* another model's calibration dump */
    kvq_calib *c;
    ck_assert_int_eq(kvq_calib_open(cal16, &c, &err), KVQ_OK);
    ck_assert_int_eq(analyze(tgt, c, texts, 1, 1, &a, sp, &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "/head_dim: expected 8") && strstr(err.msg, "got 16"), "%s", err.msg);
    kvq_calib_close(c);
    ck_assert_int_eq(kvq_calib_open("/nonexistent.h5", &c, &err), KVQ_ERR_IO);
    unlink(cal16), unlink(tgt);
    free(cal16), free(tgt);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("calib");
    TCase *tc = tcase_create("calib");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, cluster_bits_static_and_sharing);
    tcase_add_test(tc, cluster_rope_sources);
    tcase_add_test(tc, calibration_errors);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
