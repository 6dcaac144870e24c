/* test_mix.c — mixed specs, mix(RANGE=SPEC;...) (docs/quantizers.md#mix):
 * parsing and its errors, the layer's own spec, coverage of the model's
 * layers, and the analysis: a one-range mix equals its spec bit for bit, a
 * two-range mix's layers equal each spec run on its layers alone (the
 * calibrated cluster included), and the pooled bits by hand. */
#include "testutil.h"

#define DUMP KVQ_SOURCE_ROOT "/data/stories260K.h5"
#define CALIB KVQ_SOURCE_ROOT "/data/stories260K-calib.h5"

static kvq_status parse(const char *text, kvq_spec *sp, kvq_error *err)
{
    memset(err, 0, sizeof *err);
    return kvq_spec_parse(text, sp, err);
}

/* err's message contains `want` */
static void expect_usage(kvq_status st, const kvq_error *err, const char *want)
{
    ck_assert_int_eq(st, KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err->msg, want), "message '%s' lacks '%s'", err->msg, want);
}

/* A spec parsed once for a run (kvq_spec_resolve) says what the per-call
 * functions say: each layer's own spec, the tensors read, the calibration
 * need, the shape rule, the continuation's spec, and the same refusals. */
START_TEST(resolved_once)
{
    const char *specs[] = {
        "kivi:bits=2",
        "mix(0,2=kivi;1,3-=fp8)",
        "mix(0=cluster;1-=kivi)",
        "mix(0-1=tokens(h2o:keep=0.5; kivi:bits=4; drop);2-=ggml)",
        "tokens(window:recent=8; none; kivi:bits=2)",
        "tokens(snapkv:keep=0.25; per-token:bits=8; drop)",
    };
    kvq_error err;
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kvq_spec sp, own;
        kvq_resolved_spec *r;
        ck_assert_msg(parse(specs[i], &sp, &err) == KVQ_OK, "%s: %s", specs[i], err.msg);
        ck_assert_msg(kvq_spec_resolve(&sp, 5, &r, &err) == KVQ_OK, "%s: %s", specs[i], err.msg);
        ck_assert_uint_eq(kvq_resolved_spec_flags(r), kvq_spec_read_flags(&sp));
        ck_assert_int_eq(kvq_resolved_spec_needs_calib(r), kvq_spec_needs_calib(&sp));
        for (int D = 8; D <= 64; D *= 8) {
            kvq_error e1 = {0}, e2 = {0};
            ck_assert_int_eq(kvq_resolved_spec_check_shape(r, D, &e1), kvq_spec_check_shape(&sp, D, &e2));
            ck_assert_str_eq(e1.msg, e2.msg);
        }
        for (int l = 0; l < 5; l++) {
            ck_assert_int_eq(kvq_spec_for_layer(&sp, l, &own, &err), KVQ_OK);
            ck_assert_str_eq(kvq_resolved_spec_at(r, l)->text, own.text);
            ck_assert(!kvq_spec_is_mix(kvq_resolved_spec_at(r, l)));
            const kvq_spec *hi = kvq_resolved_spec_continuation(r, l);
            if (strncmp(own.text, "tokens(", 7)) ck_assert_str_eq(hi->text, own.text);
            else if (strstr(own.text, "; none;")) ck_assert(hi == NULL);
            else ck_assert_msg(hi && strstr(own.text, hi->text) && !kvq_spec_is_tokens(hi) &&
                               (!strcmp(hi->text, "kivi:bits=4") || !strcmp(hi->text, "per-token:bits=8")),
                               "%s: HI %s", own.text, hi ? hi->text : "NULL");
        }
        kvq_resolved_spec_free(r);
    }
    /* the refusals of kvq_spec_check_layers */
    kvq_spec sp;
    kvq_resolved_spec *r = (kvq_resolved_spec *)&sp;
    ck_assert_int_eq(parse("mix(0-1=kivi;3-=kivi)", &sp, &err), KVQ_OK);
    expect_usage(kvq_spec_resolve(&sp, 5, &r, &err), &err, "layer 2 is in no range (every layer needs one)");
    ck_assert(r == NULL);
    ck_assert_int_eq(parse("mix(0,2=kivi;1,3-4=fp8)", &sp, &err), KVQ_OK);
    expect_usage(kvq_spec_resolve(&sp, 4, &r, &err), &err, "range 3-4: the model has 4 layers (0..3)");
}
END_TEST

START_TEST(parsing)
{
    kvq_spec sp, sub;
    kvq_error err;
    ck_assert_int_eq(parse("mix(0-1=kivi:kbits=4,vbits=2;2-=per-token:bits=2)", &sp, &err), KVQ_OK);
    ck_assert(kvq_spec_is_mix(&sp));
    ck_assert_str_eq(kvq_quantizer_name(sp.q), "mix");
    ck_assert_int_eq(kvq_spec_for_layer(&sp, 1, &sub, &err), KVQ_OK);
    ck_assert_str_eq(sub.text, "kivi:kbits=4,vbits=2");
    ck_assert_int_eq(kvq_spec_for_layer(&sp, 7, &sub, &err), KVQ_OK); /* "2-": to the last layer */
    ck_assert_str_eq(sub.text, "per-token:bits=2");
    ck_assert_int_eq(kvq_spec_check_layers(&sp, 5, &err), KVQ_OK);
    ck_assert_int_eq(parse("mix(0,2=kivi;1,3-4=fp8)", &sp, &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_for_layer(&sp, 2, &sub, &err), KVQ_OK);
    ck_assert_str_eq(sub.text, "kivi");
    ck_assert_int_eq(kvq_spec_for_layer(&sp, 3, &sub, &err), KVQ_OK);
    ck_assert_str_eq(sub.text, "fp8");
    ck_assert_int_eq(kvq_spec_check_layers(&sp, 5, &err), KVQ_OK);
    /* coverage against the model's layer count */
    expect_usage(kvq_spec_check_layers(&sp, 6, &err), &err, "layer 5 is in no range");
    expect_usage(kvq_spec_check_layers(&sp, 4, &err), &err, "range 3-4: the model has 4 layers");
    ck_assert_int_eq(parse("mix(0-1=kivi;3-=kivi)", &sp, &err), KVQ_OK);
    expect_usage(kvq_spec_check_layers(&sp, 5, &err), &err, "layer 2 is in no range");
    expect_usage(kvq_spec_for_layer(&sp, 2, &sub, &err), &err, "layer 2 is in no range");
    ck_assert_int_eq(parse("mix(9-=kivi)", &sp, &err), KVQ_OK);
    expect_usage(kvq_spec_check_layers(&sp, 5, &err), &err, "range 9-: the model has 5 layers");
    /* what a mix needs is what its specs need */
    ck_assert_int_eq(parse("mix(0=cluster;1-=kivi)", &sp, &err), KVQ_OK);
    ck_assert(kvq_spec_needs_calib(&sp));
    ck_assert(kvq_spec_read_flags(&sp) & KVQ_READ_KEY_PRE_ROPE);
    ck_assert_int_eq(parse("mix(0-=kivi;)", &sp, &err), KVQ_ERR_USAGE); /* an empty item */
    ck_assert_int_eq(parse("mix(0-=ggml)", &sp, &err), KVQ_OK);
    expect_usage(kvq_spec_check_shape(&sp, 8, &err), &err, "head_dim 8 is not a multiple");
    ck_assert_int_eq(kvq_spec_check_shape(&sp, 64, &err), KVQ_OK);
    /* parse errors name the range or the layer */
    expect_usage(parse("mix(0-2=kivi;2-=fp8)", &sp, &err), &err, "layer 2 is in two ranges (0-2 and 2-)");
    expect_usage(parse("mix(1-=kivi;4=fp8)", &sp, &err), &err, "layer 4 is in two ranges (1- and 4)");
    expect_usage(parse("mix(0,0=kivi)", &sp, &err), &err, "layer 0 is in two ranges");
    expect_usage(parse("mix(0-=kivi:bitz=3)", &sp, &err), &err, "range 0-: kivi:bitz=3: unknown key 'bitz'");
    expect_usage(parse("mix(0-=nope)", &sp, &err), &err, "range 0-: nope: unknown quantizer");
    expect_usage(parse("mix(0-=mix(0-=kivi))", &sp, &err), &err, "a mix inside a mix");
    expect_usage(parse("mix(3-1=kivi)", &sp, &err), &err, "range '3-1'");
    expect_usage(parse("mix(x=kivi)", &sp, &err), &err, "range 'x'");
    expect_usage(parse("mix(-1=kivi)", &sp, &err), &err, "range '-1'");
    expect_usage(parse("mix(0-=)", &sp, &err), &err, "expected RANGE=SPEC");
    expect_usage(parse("mix(kivi)", &sp, &err), &err, "expected RANGE=SPEC");
    expect_usage(parse("mix(0-=kivi", &sp, &err), &err, "expected mix(RANGE=SPEC");
    expect_usage(parse("mix()", &sp, &err), &err, "expected mix(RANGE=SPEC");
}
END_TEST

/* The analysis of `specs` on the bundled dump, per (layer, head, spec). */
static kvq_analysis analyse(const kvq_spec *specs, int n, const int *layers, int nlayers, kvq_calib *calib)
{
    kvq_dump *d;
    kvq_error err = {0};
    ck_assert_msg(kvq_dump_open(DUMP, &d, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis a;
    kvq_analysis_opts o = {.specs = specs, .nspecs = n, .layers = layers, .nlayers = nlayers,
                           .queries = {KVQ_Q_LAST, 64}, .nthreads = 2, .calib = calib};
    ck_assert_msg(kvq_analyze_dump(d, &o, &a, &err) == KVQ_OK, "%s", err.msg);
    kvq_dump_close(d);
    return a;
}

static const kvq_acc *cell(const kvq_analysis *a, int li, int hi, int s)
{
    return &a->acc[((size_t)li * a->nheads + hi) * a->nspecs + s];
}

/* A composite spec is taken apart once, when it is first parsed (spec.c's
 * composite_of): its copies, every layer of every dump, the checks, the
 * resolution and the calibration find the parts (kvq_spec_splits counts). */
START_TEST(split_once)
{
    const char *text = "mix(0-1=tokens(h2o:keep=0.5; kivi:bits=4; drop);2,4=cluster:centroids=4;3=kivi:bits=2)";
    unsigned long n0 = kvq_spec_splits();
    kvq_spec sp, again, own;
    kvq_error err;
    ck_assert_int_eq(parse(text, &sp, &err), KVQ_OK);
    ck_assert_uint_eq(kvq_spec_splits(), n0 + 2); /* the mix and its tokens(...) item */
    ck_assert_int_eq(parse(text, &again, &err), KVQ_OK);
    kvq_spec copy = sp;
    for (int l = 0; l < 5; l++) ck_assert_int_eq(kvq_spec_for_layer(&copy, l, &own, &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_check_layers(&copy, 5, &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_check_shape(&copy, 8, &err), KVQ_OK);
    ck_assert(kvq_spec_read_flags(&copy) & KVQ_READ_QUERY); /* h2o's queries, found in the parts */
    ck_assert(kvq_spec_needs_calib(&copy));
    kvq_resolved_spec *r;
    ck_assert_int_eq(kvq_spec_resolve(&copy, 5, &r, &err), KVQ_OK);
    kvq_resolved_spec_free(r);
    kvq_calib *calib;
    ck_assert_int_eq(kvq_calib_open(CALIB, &calib, &err), KVQ_OK);
    for (int dump = 0; dump < 2; dump++) { /* two dumps, every layer, with the calibration */
        kvq_analysis a = analyse(&copy, 1, NULL, 0, calib);
        ck_assert_int_eq(a.nlayers, 5);
        kvq_analysis_free(&a);
    }
    kvq_calib_close(calib);
    ck_assert_uint_eq(kvq_spec_splits(), n0 + 2);
    /* a text that does not parse is split once too, and refused the same way each time */
    kvq_error e1 = {0}, e2 = {0};
    ck_assert_int_eq(kvq_spec_parse("tokens(h2o:keep=0.5; kivi:bits=4)", &sp, &e1), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_spec_parse("tokens(h2o:keep=0.5; kivi:bits=4)", &sp, &e2), KVQ_ERR_USAGE);
    ck_assert_str_eq(e1.msg, e2.msg);
    ck_assert_uint_eq(kvq_spec_splits(), n0 + 3);
}
END_TEST

START_TEST(one_range_is_its_spec)
{
    const char *plain[] = {"kivi:bits=2", "gear:rank=2", "turboquant", "fp8:scale=token"};
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        char text[128];
        snprintf(text, sizeof text, "mix(0-=%s)", plain[i]);
        kvq_spec sp[2];
        kvq_error err;
        ck_assert_int_eq(parse(text, &sp[0], &err), KVQ_OK);
        ck_assert_int_eq(parse(plain[i], &sp[1], &err), KVQ_OK);
        kvq_analysis a = analyse(sp, 2, NULL, 0, NULL);
        for (int li = 0; li < a.nlayers; li++)
            for (int hi = 0; hi < a.nheads; hi++)
                if (memcmp(cell(&a, li, hi, 0), cell(&a, li, hi, 1), sizeof(kvq_acc)))
                    ck_abort_msg("%s: layer %d head %d differs from %s", text, li, hi, plain[i]);
        kvq_analysis_free(&a);
    }
}
END_TEST

/* Each layer of a two-range mix (the calibrated cluster in one range) is
 * what its own spec gives on that layer alone. */
START_TEST(two_ranges_are_their_specs)
{
    kvq_spec sp[3];
    kvq_error err;
    ck_assert_int_eq(parse("mix(0,3=cluster:centroids=4;1-2,4-=kivi:kbits=4,vbits=2)", &sp[0], &err), KVQ_OK);
    ck_assert_int_eq(parse("cluster:centroids=4", &sp[1], &err), KVQ_OK);
    ck_assert_int_eq(parse("kivi:kbits=4,vbits=2", &sp[2], &err), KVQ_OK);
    kvq_calib *calib;
    ck_assert_int_eq(kvq_calib_open(CALIB, &calib, &err), KVQ_OK);
    kvq_analysis a = analyse(sp, 3, NULL, 0, calib);
    for (int li = 0; li < a.nlayers; li++) {
        int own = a.layers[li] == 0 || a.layers[li] == 3 ? 1 : 2;
        for (int hi = 0; hi < a.nheads; hi++)
            if (memcmp(cell(&a, li, hi, 0), cell(&a, li, hi, own), sizeof(kvq_acc)))
                ck_abort_msg("layer %d head %d differs from %s", a.layers[li], hi, sp[own].text);
    }
    kvq_analysis_free(&a);
    kvq_calib_close(calib);
}
END_TEST

/* Pooled bits by hand.  stories260K: 5 layers of 4 KV heads x 512 tokens x
 * head_dim 8.  kivi:kbits=4,vbits=2 (group 32, residual 128): K 4 + 2·16/32
 * = 5 bits on every token (512 is a multiple of 128); V per-token groups
 * of 8 channels, 2 + 2·16/8 = 6 bits on 384 tokens and 16 on the last 128:
 * (384·6 + 128·16)/512 = 8.5.  per-token:bits=2: 2 + 32/8 = 6 for K and V.
 * Every layer (equal sizes) and layers 1,3,4 (a --layers subset, 1 of kivi
 * and 2 of per-token): the mean of the layers' bits. */
START_TEST(pooled_bits_by_hand)
{
    kvq_spec sp;
    kvq_error err;
    ck_assert_int_eq(parse("mix(0-1=kivi:kbits=4,vbits=2;2-=per-token:bits=2)", &sp, &err), KVQ_OK);
    struct { const int *layers; int n; double k, v; } cases[] = {
        {NULL, 0, (2 * 5.0 + 3 * 6.0) / 5, (2 * 8.5 + 3 * 6.0) / 5},
        {(const int[]){1, 3, 4}, 3, (5.0 + 2 * 6.0) / 3, (8.5 + 2 * 6.0) / 3},
    };
    for (size_t c = 0; c < 2; c++) {
        kvq_analysis a = analyse(&sp, 1, cases[c].layers, cases[c].n, NULL);
        kvq_acc pooled = {0};
        for (int li = 0; li < a.nlayers; li++)
            for (int hi = 0; hi < a.nheads; hi++) kvq_acc_merge(&pooled, cell(&a, li, hi, 0));
        kvq_metrics m;
        kvq_metrics_finalize(&pooled, &m);
        ck_assert_msg(fabs(m.k_bits - cases[c].k) < 1e-12 && fabs(m.v_bits - cases[c].v) < 1e-12,
                      "case %zu: bits %.15g %.15g, by hand %.15g %.15g", c, m.k_bits, m.v_bits, cases[c].k, cases[c].v);
        kvq_analysis_free(&a);
    }
}
END_TEST

/* A mix the dump cannot take is refused before any work, naming the layer. */
START_TEST(analysis_checks_coverage)
{
    kvq_spec sp;
    kvq_error err;
    ck_assert_int_eq(parse("mix(0-3=kivi)", &sp, &err), KVQ_OK);
    kvq_dump *d;
    ck_assert_int_eq(kvq_dump_open(DUMP, &d, &err), KVQ_OK);
    kvq_analysis a;
    kvq_analysis_opts o = {.specs = &sp, .nspecs = 1, .queries = {KVQ_Q_LAST, 64}, .nthreads = 1};
    expect_usage(kvq_analyze_dump(d, &o, &a, &err), &err, "layer 4 is in no range");
    kvq_dump_close(d);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("mix");
    TCase *tc = tcase_create("mix");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, resolved_once);
    tcase_add_test(tc, parsing);
    tcase_add_test(tc, split_once);
    tcase_add_test(tc, one_range_is_its_spec);
    tcase_add_test(tc, two_ranges_are_their_specs);
    tcase_add_test(tc, pooled_bits_by_hand);
    tcase_add_test(tc, analysis_checks_coverage);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
