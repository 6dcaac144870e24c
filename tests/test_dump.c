/* test_dump.c — the dump writer and reader: float16/32/64 round trips, the
 * float16 path equal to rounding and its finite check slab by slab,
 * attributes, kvq-gen reproducibility and the reader's refusal of
 * impossible sizes and layers. */
#include "testutil.h"

#include <string.h>
#include <unistd.h>

static char *tmp_path(void)
{
    char *p = strdup("/tmp/kvq-dump-XXXXXX.h5");
    int fd = mkstemps(p, 3);
    close(fd);
    return p;
}

static void write_read(kvq_dtype dt)
{
    int H = 2, Hq = 4, T = 9, D = 6, L = 2;
    kvq_dump_info info = {.num_layers = L, .num_heads = Hq, .num_kv_heads = H, .head_dim = D, .seq_len = T,
                          .has_rope_theta = 1, .rope_theta = 5e5, .rope_style = KVQ_ROPE_HALF, .query_prescaled = 1};
    snprintf(info.model, sizeof info.model, "unit test");
    kvq_layer lay;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_layer_alloc(&lay, H, Hq, T, D, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &err), KVQ_OK);
    size_t n = (size_t)H * T * D, nq = (size_t)Hq * T * D;
    char *path = tmp_path();
    kvq_dump_writer *w;
    ck_assert_int_eq(kvq_dump_writer_create(path, &info, dt, &w, &err), KVQ_OK);
    for (int l = 0; l < L; l++) {
        fill_normal(lay.key, n, 10 + l, 3);
        fill_normal(lay.value, n, 20 + l, 1);
        fill_normal(lay.query, nq, 30 + l, 2);
        fill_normal(lay.key_pre_rope, n, 40 + l, 3);
        ck_assert_int_eq(kvq_dump_writer_layer(w, l, &lay, &err), KVQ_OK);
    }
    ck_assert_int_eq(kvq_dump_writer_finish(w, &err), KVQ_OK);

    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
    const kvq_dump_info *in = kvq_dump_get_info(d);
    ck_assert_str_eq(in->model, "unit test");
    ck_assert(in->num_layers == L && in->num_heads == Hq && in->num_kv_heads == H && in->head_dim == D &&
              in->seq_len == T);
    ck_assert(in->has_rope_theta && in->rope_theta == 5e5 && in->rope_style == KVQ_ROPE_HALF &&
              in->query_prescaled == 1);
    ck_assert(in->has_query && in->has_key_pre_rope && !in->has_rope_table);
    ck_assert_int_eq(in->key_dtype, dt);
    kvq_layer r;
    ck_assert_int_eq(kvq_dump_read_layer(d, 1, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &r, &err), KVQ_OK);
    float *expect = malloc(nq * sizeof *expect);
    struct { float *got; size_t n; uint64_t seed; double sigma; } t[] = {
        {r.key, n, 11, 3}, {r.value, n, 21, 1}, {r.query, nq, 31, 2}, {r.key_pre_rope, n, 41, 3}};
    for (int i = 0; i < 4; i++) {
        fill_normal(expect, t[i].n, t[i].seed, t[i].sigma);
        for (size_t k = 0; k < t[i].n; k++) {
            float e = dt == KVQ_F16 ? kvq_round_f16(expect[k]) : expect[k];
            ck_assert_msg(t[i].got[k] == e, "tensor %d [%zu]: %g vs %g", i, k, t[i].got[k], e);
        }
    }
    /* query rows alone (a hyperslab of runs of positions) equal the full read's rows */
    const int pos[] = {0, 1, 2, 5, 8};
    float *rows;
    ck_assert_int_eq(kvq_dump_read_query_rows(d, 1, pos, 5, &rows, &err), KVQ_OK);
    for (int j = 0; j < Hq; j++)
        for (int i = 0; i < 5; i++)
            ck_assert(
                !memcmp(rows + ((size_t)j * 5 + i) * D, r.query + ((size_t)j * T + pos[i]) * D, D * sizeof(float)));
    free(rows);
    const int unsorted[] = {3, 2}, beyond[] = {9};
    ck_assert_int_eq(kvq_dump_read_query_rows(d, 1, unsorted, 2, &rows, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_dump_read_query_rows(d, 1, beyond, 1, &rows, &err), KVQ_ERR_USAGE);
    ck_assert_ptr_null(rows);
    /* reading into reused buffers: the same values as a fresh read, the same memory */
    kvq_layer io = {0}, fresh;
    ck_assert_int_eq(kvq_dump_read_layer_reuse(d, 0, KVQ_READ_KEY_PRE_ROPE, &io, &err), KVQ_OK);
    float *kept = io.key;
    ck_assert_int_eq(kvq_dump_read_layer_reuse(d, 1, KVQ_READ_KEY_PRE_ROPE, &io, &err), KVQ_OK);
    ck_assert_ptr_eq(io.key, kept);
    ck_assert_int_eq(kvq_dump_read_layer(d, 1, KVQ_READ_KEY_PRE_ROPE, &fresh, &err), KVQ_OK);
    ck_assert(!memcmp(io.key, fresh.key, n * sizeof(float)) && !memcmp(io.value, fresh.value, n * sizeof(float)) &&
              !memcmp(io.key_pre_rope, fresh.key_pre_rope, n * sizeof(float)) && !io.query);
    kvq_layer_free(&fresh);
    ck_assert_int_eq(kvq_dump_read_layer_reuse(d, 1, KVQ_READ_QUERY, &io, &err),
                     KVQ_OK); /* other tensors: new buffers */
    ck_assert(io.query && !io.key_pre_rope);
    ck_assert_int_eq(kvq_dump_read_layer_reuse(d, 7, 0, &io, &err), KVQ_ERR_USAGE);
    kvq_layer_free(&io);
    kvq_layer_free(&r);
    /* without the flags the optional tensors are not read */
    ck_assert_int_eq(kvq_dump_read_layer(d, 0, 0, &r, &err), KVQ_OK);
    ck_assert_ptr_null(r.query);
    ck_assert_ptr_null(r.key_pre_rope);
    kvq_layer_free(&r);
    ck_assert_int_eq(kvq_dump_read_layer(d, 2, 0, &r, &err), KVQ_ERR_USAGE);
    kvq_dump_close(d);
    kvq_layer_free(&lay);
    free(expect);
    unlink(path);
    free(path);
}

/* A float16 tensor of several slabs (the reader converts one [T][D] slab
 * at a time, in pieces of 32768 values that two threads share, or one
 * thread alone): clean, it reads as its rounding; with non-finite values,
 * the first one in the tensor's order is named by its index, whichever
 * slab and piece holds it. */
START_TEST(f16_slabs_checked)
{
    enum { H = 2, T = 1200, D = 64 }; /* a slab: three pieces */
    kvq_dump_info info = {.num_layers = 1, .num_heads = H, .num_kv_heads = H, .head_dim = D, .seq_len = T};
    snprintf(info.model, sizeof info.model, "unit test");
    size_t n = (size_t)H * T * D;
    const struct {
        int h, t, c;
        float v;
        int h2, t2, c2;
        float v2;
        const char *msg;
    } cases[] = {
        {-1, 0, 0, 0, -1, 0, 0, 0, NULL},
        {1, 1190, 5, INFINITY, -1, 0, 0, 0, "/layer_000/key: expected finite float32 values, got inf at [1,1190,5]"},
        {1, 10, 2, NAN, 1, 1100, 0, -INFINITY, "/layer_000/key: expected finite float32 values, got nan at [1,10,2]"},
        {0, 1199, 63, -INFINITY, 1, 0, 0, NAN,
         "/layer_000/key: expected finite float32 values, got -inf at [0,1199,63]"},
        {0, 1000, 3, NAN, 0, 600, 1, INFINITY, "/layer_000/key: expected finite float32 values, got inf at [0,600,1]"},
        {1, 100, 0, NAN, 1, 600, 0, INFINITY, "/layer_000/key: expected finite float32 values, got nan at [1,100,0]"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        kvq_layer lay, r;
        kvq_error err = {0};
        ck_assert_int_eq(kvq_layer_alloc(&lay, H, H, T, D, 0, &err), KVQ_OK);
        fill_normal(lay.key, n, 5, 2);
        fill_normal(lay.value, n, 6, 1);
        if (cases[k].h >= 0) lay.key[((size_t)cases[k].h * T + cases[k].t) * D + cases[k].c] = cases[k].v;
        if (cases[k].h2 >= 0) lay.key[((size_t)cases[k].h2 * T + cases[k].t2) * D + cases[k].c2] = cases[k].v2;
        char *path = tmp_path();
        kvq_dump_writer *w;
        ck_assert_int_eq(kvq_dump_writer_create(path, &info, KVQ_F16, &w, &err), KVQ_OK);
        ck_assert_msg(kvq_dump_writer_layer(w, 0, &lay, &err) == KVQ_OK, "%s", err.msg);
        ck_assert_int_eq(kvq_dump_writer_finish(w, &err), KVQ_OK);
        kvq_dump *d;
        ck_assert_msg(kvq_dump_open(path, &d, &err) == KVQ_OK, "%s", err.msg);
        for (int rep = 0; rep < 16; rep++) { /* the threads take the pieces in another order each time */
            kvq_dump_set_read_threads(d, rep % 2 ? 1 : 2); /* and one thread alone: the same values and error */
            kvq_status st = kvq_dump_read_layer(d, 0, 0, &r, &err);
            if (!cases[k].msg) {
                ck_assert_msg(st == KVQ_OK, "%s", err.msg);
                for (size_t i = 0; i < n; i++)
                    ck_assert(r.key[i] == kvq_round_f16(lay.key[i]) && r.value[i] == kvq_round_f16(lay.value[i]));
                kvq_layer_free(&r);
            } else {
                ck_assert_int_eq(st, KVQ_ERR_FORMAT);
                ck_assert_msg(strstr(err.msg, cases[k].msg), "%s", err.msg);
            }
        }
        kvq_dump_close(d);
        kvq_layer_free(&lay);
        unlink(path);
        free(path);
    }
}
END_TEST

START_TEST(round_trip_f32) { write_read(KVQ_F32); }
END_TEST
START_TEST(round_trip_f16) { write_read(KVQ_F16); }
END_TEST
START_TEST(round_trip_f64) { write_read(KVQ_F64); }
END_TEST

START_TEST(writer_abort_leaves_nothing)
{
    kvq_dump_info info = {.num_layers = 1, .num_heads = 1, .num_kv_heads = 1, .head_dim = 2, .seq_len = 2};
    char *path = tmp_path();
    unlink(path);
    kvq_dump_writer *w;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_dump_writer_create(path, &info, KVQ_F32, &w, &err), KVQ_OK);
    kvq_dump_writer_abort(w);
    ck_assert_int_ne(access(path, F_OK), 0);
    free(path);
}
END_TEST

START_TEST(gen_is_reproducible)
{
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    o.num_layers = 1, o.seq_len = 40, o.head_dim = 16;
    char *a = tmp_path(), *b = tmp_path();
    kvq_error err = {0};
    ck_assert_int_eq(kvq_gen_write(a, &o, &err), KVQ_OK);
    ck_assert_int_eq(kvq_gen_write(b, &o, &err), KVQ_OK);
    kvq_dump *da, *db;
    kvq_layer la, lb;
    kvq_dump_open(a, &da, &err);
    kvq_dump_open(b, &db, &err);
    kvq_dump_read_layer(da, 0, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &la, &err);
    kvq_dump_read_layer(db, 0, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &lb, &err);
    size_t n = (size_t)la.H * la.T * la.D;
    ck_assert(!memcmp(la.key, lb.key, n * 4) && !memcmp(la.query, lb.query, (size_t)la.Hq * la.T * la.D * 4));
    /* RoPE preserves the norm of each pair: pre/post-RoPE keys have equal norms per token */
    for (int t = 0; t < la.T; t++) {
        double n1 = 0, n2 = 0;
        for (int c = 0; c < la.D; c++)
            n1 += la.key[t * la.D + c] * la.key[t * la.D + c],
                n2 += la.key_pre_rope[t * la.D + c] * la.key_pre_rope[t * la.D + c];
        ck_assert(close_rel(n1, n2, 1e-5, 1e-6));
    }
    /* outlier channels: the largest channel abs-max is well above the median */
    kvq_channel_stats st[4 * 16];
    kvq_channel_stats_compute(la.key_pre_rope, la.H, la.T, la.D, st);
    ck_assert(kvq_channel_absmax_ratio(st, (size_t)la.H * la.D) > 2.5);
    kvq_layer_free(&la), kvq_layer_free(&lb);
    kvq_dump_close(da), kvq_dump_close(db);
    unlink(a), unlink(b);
    free(a), free(b);
}
END_TEST

START_TEST(impossible_sizes_rejected)
{
    kvq_layer l;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_layer_alloc(&l, 1 << 30, 1 << 30, 1 << 30, 1 << 30, 0, &err), KVQ_ERR_NOMEM);
    ck_assert(strstr(err.msg, "overflowing") != NULL);
    ck_assert_int_eq(kvq_layer_alloc(&l, 0, 1, 1, 1, 0, &err), KVQ_ERR_NOMEM);
}
END_TEST

/* A dump in memory (kvq_dump_from_memory) reads as the file it came from:
 * the same info, layers, query rows, RoPE and analysis; and it is checked
 * as a file is (shapes, tensors, attributes, values). */
START_TEST(memory_dump_reads_as_the_file)
{
    kvq_error err = {0};
    char *path = gen_dump(3, 4, 2, 16, 24, 5);
    kvq_dump *f = NULL, *m = NULL;
    ck_assert_int_eq(kvq_dump_open(path, &f, &err), KVQ_OK);
    const kvq_dump_info *fi = kvq_dump_get_info(f);
    kvq_layer L[3];
    unsigned all = KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE;
    for (int l = 0; l < 3; l++) ck_assert_int_eq(kvq_dump_read_layer(f, l, all, &L[l], &err), KVQ_OK);
    kvq_dump_mem mem = {.name = "mem", .model = kvq_dump_model(f), .layers = L, .nlayers = 3,
                        .rope_theta = fi->rope_theta, .rope_style = fi->rope_style,
                        .query_prescaled = fi->query_prescaled};
    ck_assert_msg(kvq_dump_from_memory(&mem, &m, &err) == KVQ_OK, "%s", err.msg);
    const kvq_dump_info *mi = kvq_dump_get_info(m);
    ck_assert(mi->num_layers == 3 && mi->num_heads == 4 && mi->num_kv_heads == 2 && mi->head_dim == 16 &&
              mi->seq_len == 24 && mi->has_query && mi->has_key_pre_rope && mi->rope_theta == fi->rope_theta);
    ck_assert_str_eq(kvq_dump_path(m), "mem");
    /* the same analysis, row for row */
    kvq_spec sp[2];
    ck_assert_int_eq(kvq_spec_parse("kvquant:codebook=uniform", &sp[0], &err), KVQ_OK);
    ck_assert_int_eq(kvq_spec_parse("kivi:bits=2,residual=0", &sp[1], &err), KVQ_OK);
    kvq_analysis_opts o = {.specs = sp, .nspecs = 2, .seed = 1, .nthreads = 2};
    ck_assert_int_eq(kvq_query_sel_parse("all", &o.queries, &err), KVQ_OK);
    char *text[2] = {0};
    for (int k = 0; k < 2; k++) {
        kvq_analysis a;
        ck_assert_msg(kvq_analyze_dump(k ? m : f, &o, &a, &err) == KVQ_OK, "%s", err.msg);
        size_t len;
        FILE *ms = open_memstream(&text[k], &len);
        kvq_report *r = kvq_report_new(ms, KVQ_FMT_CSV, NULL, 0);
        ck_assert_int_eq(kvq_report_analysis(r, "d", &a, sp, KVQ_PER_HEAD, NULL), KVQ_OK);
        ck_assert_int_eq(kvq_report_finish(r), KVQ_OK);
        fclose(ms);
        kvq_analysis_free(&a);
    }
    ck_assert_str_eq(text[0], text[1]);
    ck_assert(strlen(text[0]) > 500);
    free(text[0]), free(text[1]);
    /* query rows, as the file's hyperslab gives them */
    int pos[3] = {0, 7, 23};
    float *qf, *qm;
    ck_assert_int_eq(kvq_dump_read_query_rows(f, 2, pos, 3, &qf, &err), KVQ_OK);
    ck_assert_int_eq(kvq_dump_read_query_rows(m, 2, pos, 3, &qm, &err), KVQ_OK);
    ck_assert(!memcmp(qf, qm, (size_t)4 * 3 * 16 * sizeof(float)));
    free(qf), free(qm);
    ck_assert_int_eq(kvq_dump_has_tokens(m), 0);
    kvq_dump_close(m);

    /* refusals, each naming the object */
    const char *bad[] = {/* i: what the loop changes */
                         "mem: /layer_001: expected the shape of /layer_000",
                         "mem: /layer_002/query: expected a dataset, as in /layer_000",
                         "mem: /layer_000/key: expected finite float32 values, got nan at [1,5,3]",
                         "mem: /rope_theta: expected a positive finite number",
                         "mem: /rope_sin: expected a dataset (/rope_cos is present)",
                         "mem: /layer_001/sliding_window: expected a window of 0 (none)"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvq_layer c[3];
        memcpy(c, L, sizeof c);
        kvq_dump_mem b = mem;
        b.layers = c;
        int windows[3] = {0, -1, 0};
        double cosv[24 * 8] = {0};
        float *k0 = NULL;
        if (i == 0) c[1].T = 23;
        if (i == 1) c[2].query = NULL;
        if (i == 2) {
            k0 = malloc((size_t)2 * 24 * 16 * sizeof *k0);
            memcpy(k0, L[0].key, (size_t)2 * 24 * 16 * sizeof *k0);
            k0[(24 + 5) * 16 + 3] = NAN;
            c[0].key = k0;
        }
        if (i == 3) b.rope_theta = -1;
        if (i == 4) b.rope_cos = cosv;
        if (i == 5) b.windows = windows;
        kvq_error e = {0};
        kvq_status st = kvq_dump_from_memory(&b, &m, &e);
        if (i == 2) { /* values are checked when read, as a file's */
            ck_assert_int_eq(st, KVQ_OK);
            kvq_layer r;
            st = kvq_dump_read_layer(m, 0, 0, &r, &e);
            kvq_dump_close(m);
        }
        free(k0);
        ck_assert_msg(st == KVQ_ERR_FORMAT && strstr(e.msg, bad[i]), "%zu: %s", i, e.msg);
    }
    for (int l = 0; l < 3; l++) kvq_layer_free(&L[l]);
    kvq_dump_close(f);
    unlink(path);
    free(path);
}
END_TEST

START_TEST(kurtosis_and_ratio)
{
    const float x[4] = {-1, -1, 1, 1};
    ck_assert(fabs(kvq_kurtosis(x, 4) - 1.0) < 1e-12);
    kvq_channel_stats s[3] = {{.abs_max = 1}, {.abs_max = 2}, {.abs_max = 6}};
    ck_assert(kvq_channel_absmax_ratio(s, 3) == 3.0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dump");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, round_trip_f32);
    tcase_add_test(tc, round_trip_f16);
    tcase_add_test(tc, round_trip_f64);
    tcase_add_test(tc, f16_slabs_checked);
    tcase_add_test(tc, writer_abort_leaves_nothing);
    tcase_add_test(tc, gen_is_reproducible);
    tcase_add_test(tc, impossible_sizes_rejected);
    tcase_add_test(tc, kurtosis_and_ratio);
    tcase_add_test(tc, memory_dump_reads_as_the_file);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
