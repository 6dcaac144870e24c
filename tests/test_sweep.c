/* test_sweep.c — the sweep's library parts: grid order, point specs and
 * validation; the reader of sweep outputs on CSV quoting, JSON escapes,
 * torn files, and every prefix and many corruptions of a real file (no crash,
 * only a clean error); a point's rows as one unit of text. */
#include "testutil.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

START_TEST(grid_order_and_specs)
{
    const char *grids[] = {"group=32,64", "residual=32,64,96", "bits=2,4"};
    const char *fixed[] = {"vbits=3"};
    kvq_grid *g;
    kvq_error err = {0};
    ck_assert_msg(kvq_grid_new("kivi", grids, 3, fixed, 1, &g, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_uint_eq(kvq_grid_size(g), 12);
    ck_assert_int_eq(kvq_grid_nkeys(g), 3);
    ck_assert_str_eq(kvq_grid_key(g, 1), "residual");
    /* nested loops, last key fastest: p = ((group * 3) + residual) * 2 + bits */
    for (size_t p = 0; p < 12; p++) {
        ck_assert_str_eq(kvq_grid_value(g, p, 0), p < 6 ? "32" : "64");
        ck_assert_str_eq(kvq_grid_value(g, p, 2), p % 2 ? "4" : "2");
    }
    ck_assert_str_eq(kvq_grid_value(g, 5, 1), "96");
    kvq_spec sp;
    ck_assert_int_eq(kvq_grid_spec(g, 3, &sp, &err), KVQ_OK);
    ck_assert_str_eq(sp.text, "kivi:bits=4,group=32,residual=64,vbits=3"); /* parameter-table order */
    ck_assert_int_eq(kvq_grid_spec(g, 6, &sp, &err), KVQ_ERR_USAGE);      /* residual 32 % group 64 */
    ck_assert(strstr(err.msg, "multiple of group"));
    kvq_grid_free(g);

    /* no grid: one point, the fixed spec */
    ck_assert_int_eq(kvq_grid_new("absmax", NULL, 0, NULL, 0, &g, &err), KVQ_OK);
    ck_assert_uint_eq(kvq_grid_size(g), 1);
    ck_assert_int_eq(kvq_grid_spec(g, 0, &sp, &err), KVQ_OK);
    ck_assert_str_eq(sp.text, "absmax");
    kvq_grid_free(g);

    const char *bad[][2] = {{"bits", "bits=2,3"}, {"bits=", ""}, {"=2", ""}, {"bits=2,,3", ""}, {"bits=2,", ""},
                            {"nokey=1", ""}, {"bits=2,2.0", ""}, {"bits=0", ""}, {"group=x", ""}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *one[1] = {bad[i][0]};
        ck_assert_msg(kvq_grid_new("kivi", one, 1, NULL, 0, &g, &err) == KVQ_ERR_USAGE, "%s", bad[i][0]);
    }
    const char *twice[2] = {"bits=2", "bits=3"};
    ck_assert_int_eq(kvq_grid_new("kivi", twice, 2, NULL, 0, &g, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_grid_new("kivi", twice, 1, twice + 1, 1, &g, &err), KVQ_ERR_USAGE);
    ck_assert_int_eq(kvq_grid_new("nope", NULL, 0, NULL, 0, &g, &err), KVQ_ERR_USAGE);
    const char *fx[1] = {"group=32,bits"};
    ck_assert_int_eq(kvq_grid_new("kivi", NULL, 0, fx, 1, &g, &err), KVQ_ERR_USAGE);
}
END_TEST

static char *write_tmp(const char *data, size_t n)
{
    char *path = strdup("/tmp/kvq-sweep-XXXXXX");
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    ck_assert(write(fd, data, n) == (ssize_t)n);
    close(fd);
    return path;
}

static const char csv[] =
    "dump,spec,x,point\n"
    "a.h5,\"kivi:bits=2,group=32\",\"say \"\"hi\"\"\",0\n"
    "b.h5,\"kivi:bits=2,group=32\",1,0\n"
    "a.h5,\"kivi:bits=3,group=32\",,1\n"
    "b.h5,\"kivi:bits=3,group=32\",,1\n"
    "a.h5,\"kivi:bits=4,group=32\",,5\n";

static const char jsonl[] =
    "{\"dump\":\"a.h5\",\"spec\":\"kivi:bits=2\",\"v\":null,\"g\":2,\"point\":0}\n"
    "{\"dump\":\"b\\\"\\u0041\",\"spec\":\"kivi:bits=2\",\"v\":1.5e-3,\"g\":2,\"point\":0}\n"
    "{\"dump\":\"a.h5\",\"spec\":\"kivi:bits=3\",\"v\":-1,\"g\":3,\"point\":1}\n";

START_TEST(read_csv_and_jsonl)
{
    kvq_error err = {0};
    kvq_sweep_file f;
    char *path = write_tmp(csv, sizeof csv - 1);
    ck_assert_msg(kvq_sweep_file_read(path, &f, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(f.fmt, KVQ_FMT_CSV);
    ck_assert_str_eq(f.columns, "dump,spec,x,point");
    ck_assert_uint_eq(f.nunits, 3);
    ck_assert_str_eq(f.units[0].spec, "kivi:bits=2,group=32");
    ck_assert_uint_eq(f.units[0].nrows, 2);
    ck_assert_uint_eq(f.units[0].begin, f.body);
    ck_assert_uint_eq(f.units[1].begin, f.units[0].end);
    ck_assert_int_eq(f.units[2].point, 5);
    ck_assert_uint_eq(f.units[2].end, sizeof csv - 1);
    ck_assert(!f.partial && f.end == sizeof csv - 1);
    kvq_sweep_file_free(&f);
    unlink(path), free(path);

    path = write_tmp(csv, sizeof csv - 4); /* torn last row */
    ck_assert_int_eq(kvq_sweep_file_read(path, &f, &err), KVQ_OK);
    ck_assert(f.partial && f.nunits == 2 && f.units[1].nrows == 2);
    kvq_sweep_file_free(&f);
    unlink(path), free(path);

    path = write_tmp(jsonl, sizeof jsonl - 1);
    ck_assert_msg(kvq_sweep_file_read(path, &f, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(f.fmt, KVQ_FMT_JSONL);
    ck_assert_str_eq(f.columns, "dump,spec,v,g,point");
    ck_assert_uint_eq(f.nunits, 2);
    ck_assert_uint_eq(f.units[0].nrows, 2);
    ck_assert_str_eq(f.units[1].spec, "kivi:bits=3");
    kvq_sweep_file_free(&f);
    unlink(path), free(path);

    const char *bad[] = {
        "dump,spec\nx,y\n",                                  /* no point column */
        "spec,point\n\"a,1\n",                               /* open quote */
        "spec,point\na,1,2\n",                               /* field count */
        "spec,point\na,-1\n",                                /* negative point */
        "spec,point\na,1\nb,1\n",                            /* one point, two specs */
        "spec,point\n,1\n",                                  /* empty spec */
        "{\"spec\":\"a\",\"point\":0}\n{\"point\":0,\"spec\":\"a\"}\n", /* keys differ */
        "{\"spec\":\"a\",\"point\":0} x\n",                  /* trailing bytes */
        "{\"spec\":\"a\"\n",                                 /* unterminated */
        "{\"spec\":\"a\",\"point\":\"\\u00zz\"}\n",          /* bad escape */
        "spec,point\na\0,1\n",                               /* NUL byte */
    };
    size_t lens[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        path = write_tmp(bad[i], lens[i] ? lens[i] : strlen(bad[i]));
        ck_assert_msg(kvq_sweep_file_read(path, &f, &err) == KVQ_ERR_FORMAT, "case %zu", i);
        ck_assert(strstr(err.msg, path));
        unlink(path), free(path);
    }
    ck_assert_int_eq(kvq_sweep_file_read("/nonexistent/x.csv", &f, &err), KVQ_ERR_IO);
}
END_TEST

/* A shard's points (kvq_sweep_select) and what --resume keeps of its OUT
 * (kvq_sweep_reconcile): complete points, a torn last point run again,
 * another shard's or a short point in the middle refused naming it. */
static char *sweep_csv(const kvq_grid *g, const size_t *points, const int *rows, int n)
{
    static char buf[4096];
    size_t o = (size_t)snprintf(buf, sizeof buf, "dump,spec,point\n");
    for (int i = 0; i < n; i++) {
        kvq_spec sp;
        kvq_error err = {0};
        ck_assert_int_eq(kvq_grid_spec(g, points[i], &sp, &err), KVQ_OK);
        for (int r = 0; r < rows[i]; r++)
            o += (size_t)snprintf(buf + o, sizeof buf - o, "d%d.h5,\"%s\",%zu\n", r, sp.text, points[i]);
    }
    return write_tmp(buf, o);
}

START_TEST(select_and_reconcile)
{
    const char *grids[] = {"group=32,64", "residual=32,64,96", "bits=2,4"};
    const char *fixed[] = {"vbits=3"};
    kvq_grid *g;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_grid_new("kivi", grids, 3, fixed, 1, &g, &err), KVQ_OK);
    unsigned char state[12];
    size_t nrun, ninvalid, keep, done;
    kvq_sweep_select(g, 0, 2, state, &nrun, &ninvalid); /* points 0, 2, ..., 10; 6 and 10 are invalid */
    ck_assert_uint_eq(nrun, 4);
    ck_assert_uint_eq(ninvalid, 2);
    ck_assert_int_eq(state[1], KVQ_POINT_OTHER);
    ck_assert_int_eq(state[6], KVQ_POINT_INVALID);
    ck_assert_int_eq(state[8], KVQ_POINT_RUN);

    /* points 0 and 2 complete, 4 torn (one of two rows): 0 and 2 kept */
    size_t pts[] = {0, 2, 4};
    int rows[] = {2, 2, 1};
    char *path = sweep_csv(g, pts, rows, 3);
    kvq_sweep_file f;
    ck_assert_msg(kvq_sweep_file_read(path, &f, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_msg(kvq_sweep_reconcile(path, &f, g, state, 2, &keep, &done, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_uint_eq(done, 2);
    ck_assert_uint_eq(keep, f.units[1].end);
    ck_assert(state[0] == KVQ_POINT_DONE && state[2] == KVQ_POINT_DONE && state[4] == KVQ_POINT_RUN);
    kvq_sweep_file_free(&f);
    unlink(path), free(path);

    /* another shard's point, and a short point that is not the last */
    size_t other[] = {1}, mid[] = {4, 8};
    int one[] = {2}, short_mid[] = {1, 2};
    for (int c = 0; c < 2; c++) {
        kvq_sweep_select(g, 0, 2, state, &nrun, &ninvalid);
        path = c ? sweep_csv(g, mid, short_mid, 2) : sweep_csv(g, other, one, 1);
        ck_assert_int_eq(kvq_sweep_file_read(path, &f, &err), KVQ_OK);
        ck_assert_int_eq(kvq_sweep_reconcile(path, &f, g, state, 2, &keep, &done, &err), KVQ_ERR_FORMAT);
        ck_assert_msg(strstr(err.msg, path) && strstr(err.msg, c ? "point 4 has 1 rows" : "point 1 ("), "%s", err.msg);
        kvq_sweep_file_free(&f);
        unlink(path), free(path);
    }
    kvq_grid_free(g);
}
END_TEST

/* Every prefix and 2000 single-byte corruptions of both files: a clean
 * status each time (the sanitizer build checks the memory side). */
/* A point's rows (kvq_sweep_point_rows): the header's columns, one row per
 * layer of each dump, the grid's values and the point after kvq-analyze's
 * cells, the same from a prepared dump as from the file, and an invalid
 * point refused. */
/* kvq_sweep_merge_open on paths; KVQ_OK, or the error whose message holds `needle`. */
static kvq_sweep_merge *merge_of(const char **paths, int n, const char *needle)
{
    kvq_sweep_merge *m = NULL;
    kvq_error err = {0};
    kvq_status st = kvq_sweep_merge_open(paths, n, &m, &err);
    if (!needle) {
        ck_assert_msg(st == KVQ_OK, "%s", err.msg);
        return m;
    }
    ck_assert_int_eq(st, KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, needle), "'%s' lacks '%s'", err.msg, needle);
    ck_assert(m == NULL);
    return NULL;
}

/* --merge: shards in point order, byte for byte; every refusal, and
 * --expect-grid's proof, with their messages. */
START_TEST(merge_shards)
{
    const char *grids[] = {"group=32,64", "residual=32,64,96", "bits=2,4"};
    kvq_grid *g;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_grid_new("kivi", grids, 3, NULL, 0, &g, &err), KVQ_OK); /* 6, 7, 10, 11 invalid */
    size_t pa[] = {2, 0}, pb[] = {1, 3}, pc[] = {4};
    int two[] = {2, 2}, one[] = {1};
    char *a = sweep_csv(g, pa, two, 2), *b = sweep_csv(g, pb, two, 2), *c = sweep_csv(g, pc, one, 1);
    const char *ab[] = {b, a}, *aa[] = {a, a}, *ac[] = {a, c};
    kvq_sweep_merge *m = merge_of(ab, 2, NULL);
    ck_assert_uint_eq(kvq_sweep_merge_points(m), 4);
    ck_assert_uint_eq(kvq_sweep_merge_rows(m), 8);
    ck_assert_int_eq(kvq_sweep_merge_format(m), KVQ_FMT_CSV);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ck_assert_int_eq(kvq_sweep_merge_write(m, f, &err), KVQ_OK);
    fclose(f);
    size_t p0123[] = {0, 1, 2, 3};
    int rows4[] = {2, 2, 2, 2};
    kvq_sweep_file want;
    char *w = sweep_csv(g, p0123, rows4, 4); /* the rows of one run, in point order */
    ck_assert_int_eq(kvq_sweep_file_read(w, &want, &err), KVQ_OK);
    ck_assert_uint_eq(len, want.size);
    ck_assert(!memcmp(text, want.data, len));
    size_t ninvalid = 99;
    ck_assert_int_eq(kvq_sweep_merge_check_grid(m, g, &ninvalid, &err), KVQ_ERR_FORMAT);
    ck_assert_str_eq(err.msg, "4 points of the expected grid are missing: 4, 5, 8, 9");
    kvq_sweep_merge_free(m);
    merge_of(aa, 2, "is in");
    merge_of(aa, 2, ": duplicated");
    merge_of(ac, 2, "has 1 rows, point 0 in");
    /* outside the grid, a point the grid has no spec for, an empty file, a partial row, other columns */
    kvq_spec sp;
    ck_assert_int_eq(kvq_grid_spec(g, 0, &sp, &err), KVQ_OK);
    char line[512];
    int n = snprintf(line, sizeof line, "dump,spec,point\nd.h5,\"%s\",12\n", sp.text);
    char *out12 = write_tmp(line, (size_t)n);
    const char *o12[] = {out12};
    m = merge_of(o12, 1, NULL);
    ck_assert_int_eq(kvq_sweep_merge_check_grid(m, g, &ninvalid, &err), KVQ_ERR_FORMAT);
    ck_assert(strstr(err.msg, "point 12 is outside the expected grid of 12 points"));
    kvq_sweep_merge_free(m);
    n = snprintf(line, sizeof line, "dump,spec,point\nd.h5,\"%s\",6\n", sp.text);
    char *inv = write_tmp(line, (size_t)n);
    const char *o6[] = {inv};
    m = merge_of(o6, 1, NULL);
    ck_assert_int_eq(kvq_sweep_merge_check_grid(m, g, &ninvalid, &err), KVQ_ERR_FORMAT);
    ck_assert(strstr(err.msg, "point 6 is 'kivi:") && strstr(err.msg, "has no valid point there"));
    kvq_sweep_merge_free(m);
    char *empty = write_tmp("", 0), *part = write_tmp("dump,spec,point\nd.h5,x,0", 24);
    char *other = write_tmp("dump,spec,y,point\n", 18);
    const char *oe[] = {empty}, *op[] = {part}, *oo[] = {a, other};
    merge_of(oe, 1, "empty: not a kvq-sweep output");
    merge_of(op, 1, "ends in a partial row");
    merge_of(oo, 2, "columns differ from");
    /* the whole grid but its invalid points: proven, 4 invalid */
    size_t all[] = {0, 1, 2, 3, 4, 5, 8, 9};
    int rows8[] = {1, 1, 1, 1, 1, 1, 1, 1};
    char *full = sweep_csv(g, all, rows8, 8);
    const char *of[] = {full};
    m = merge_of(of, 1, NULL);
    ck_assert_int_eq(kvq_sweep_merge_check_grid(m, g, &ninvalid, &err), KVQ_OK);
    ck_assert_uint_eq(ninvalid, 4);
    kvq_sweep_merge_free(m);
    for (char **p = (char *[]){a, b, c, w, out12, inv, empty, part, other, full, NULL}; *p; p++) unlink(*p), free(*p);
    kvq_sweep_file_free(&want);
    free(text);
    kvq_grid_free(g);
}
END_TEST

/* Points analysed together (kvq_sweep_points_rows, as kvq-sweep runs them
 * when threads outnumber the KV heads) give each point the bytes it gets
 * alone: turboquant over bits and rotations, on a one-KV-head dump with
 * four threads (a spec a thread), from the file and prepared, per head and
 * per layer; a batch holding an invalid point fails whole and returns
 * nothing; kvq_sweep_batch asks for threads over heads. */
START_TEST(points_together_equal_alone)
{
    kvq_error err = {0};
    char *path = gen_dump(2, 4, 1, 16, 70, 21);
    const char *grids[] = {"bits=2,3", "rotate=qr,hadamard"};
    kvq_grid *g = NULL;
    ck_assert_msg(kvq_grid_new("turboquant", grids, 2, NULL, 0, &g, &err) == KVQ_OK, "%s", err.msg);
    kvq_sweep_dump src[1] = {{.name = "a.h5"}};
    ck_assert_int_eq(kvq_dump_open(path, &src[0].dump, &err), KVQ_OK);
    kvq_analysis_opts o = {.seed = 5, .nthreads = 4};
    ck_assert_int_eq(kvq_sweep_batch(src, 1, &o), 4);
    int heads[1] = {0};
    kvq_analysis_opts two = {.seed = 5, .nthreads = 4, .heads = heads, .nheads = 1};
    ck_assert_int_eq(kvq_sweep_batch(src, 1, &two), 4);
    o.nthreads = 1;
    ck_assert_int_eq(kvq_sweep_batch(src, 1, &o), 1);
    o.nthreads = 4;
    size_t pts[4] = {0, 1, 2, 3}, lens[4], len1;
    char *texts[4], *one;
    for (int prepared = 0; prepared < 2; prepared++) {
        if (prepared) ck_assert_int_eq(kvq_prepare_dump(src[0].dump, &o, 0, &src[0].prep, &err), KVQ_OK);
        for (kvq_per per = KVQ_PER_HEAD; per <= KVQ_PER_LAYER; per++) {
            ck_assert_msg(kvq_sweep_points_rows(g, pts, 4, src, 1, &o, per, KVQ_FMT_CSV, texts, lens, &err) == KVQ_OK,
                          "%s", err.msg);
            for (int i = 0; i < 4; i++) {
                ck_assert_msg(kvq_sweep_point_rows(g, pts[i], src, 1, &o, per, KVQ_FMT_CSV, &one, &len1, &err) ==
                                  KVQ_OK,
                              "%s", err.msg);
                ck_assert_msg(len1 == lens[i] && !memcmp(one, texts[i], len1), "point %zu together:\n%s\nalone:\n%s",
                              pts[i], texts[i], one);
                free(one), free(texts[i]);
            }
        }
    }
    kvq_grid *bad = NULL;
    const char *bad_grid[] = {"bits=1,3"}; /* variant=prod needs bits >= 2 */
    ck_assert_int_eq(kvq_grid_new("turboquant", bad_grid, 1, NULL, 0, &bad, &err), KVQ_OK);
    size_t bp[2] = {1, 0};
    ck_assert_int_eq(kvq_sweep_points_rows(bad, bp, 2, src, 1, &o, KVQ_PER_LAYER, KVQ_FMT_CSV, texts, lens, &err),
                     KVQ_ERR_USAGE);
    ck_assert(texts[0] == NULL && texts[1] == NULL && lens[0] == 0);
    kvq_grid_free(bad);
    kvq_prepared_free(src[0].prep), kvq_dump_close(src[0].dump);
    kvq_grid_free(g);
    unlink(path);
    free(path);
}
END_TEST

START_TEST(point_rows)
{
    kvq_error err = {0};
    char *path = gen_dump(3, 4, 2, 16, 40, 9);
    const char *grids[] = {"bits=2,3", "group=8,32"};
    const char *fixed[] = {"residual=0"}; /* else kivi keeps these 40 tokens exact */
    kvq_grid *g = NULL;
    ck_assert_msg(kvq_grid_new("kivi", grids, 2, fixed, 1, &g, &err) == KVQ_OK, "%s", err.msg);
    char *header;
    size_t hlen;
    ck_assert_int_eq(kvq_sweep_header(g, &header, &hlen), KVQ_OK);
    ck_assert_msg(hlen == strlen(header) && !strncmp(header, "dump,layer,head,quantizer,spec,", 31) &&
                      !strcmp(header + hlen - strlen(",bits,group,point"), ",bits,group,point"),
                  "header: %s", header);
    kvq_sweep_dump src[2] = {{.name = "a.h5"}, {.name = "b.h5"}};
    ck_assert_int_eq(kvq_dump_open(path, &src[0].dump, &err), KVQ_OK);
    ck_assert_int_eq(kvq_dump_open(path, &src[1].dump, &err), KVQ_OK);
    kvq_analysis_opts o = {.seed = 3, .nthreads = 1};
    char *text[2];
    size_t len[2];
    for (int prepared = 0; prepared < 2; prepared++) {
        if (prepared)
            for (int i = 0; i < 2; i++)
                ck_assert_int_eq(kvq_prepare_dump(src[i].dump, &o, 0, &src[i].prep, &err), KVQ_OK);
        ck_assert_msg(kvq_sweep_point_rows(g, 3, src, 2, &o, KVQ_PER_LAYER, KVQ_FMT_CSV, &text[prepared],
                                           &len[prepared], &err) == KVQ_OK, "%s", err.msg);
    }
    ck_assert_msg(len[0] == len[1] && !memcmp(text[0], text[1], len[0]), "prepared rows differ:\n%s\n%s", text[0],
                  text[1]);
    int lines = 0, cols = 1;
    for (size_t i = 0; i < len[0]; i++) lines += text[0][i] == '\n';
    for (size_t i = 0; i < hlen; i++) cols += header[i] == ',';
    ck_assert_int_eq(lines, 6); /* 3 layers of 2 dumps */
    const char *row = strstr(text[0], "\nb.h5,2,all,kivi,\"kivi:bits=3,group=32,residual=0\",");
    ck_assert_msg(row && strstr(row, ",3,32,3\n"), "the last row: %s", text[0]);
    int fields = 1, quoted = 0; /* the point's cells line up with the header */
    for (const char *c = text[0]; *c != '\n'; c++) quoted ^= *c == '"', fields += *c == ',' && !quoted;
    ck_assert_int_eq(fields, cols);
    free(text[0]), free(text[1]);
    const char *bad_grid[] = {"group=8,16", "residual=16,24"};
    kvq_grid *bad = NULL;
    ck_assert_int_eq(kvq_grid_new("kivi", bad_grid, 2, NULL, 0, &bad, &err), KVQ_OK);
    char *t = NULL;
    size_t tl = 0;
    ck_assert_int_eq(kvq_sweep_point_rows(bad, 3, src, 2, &o, KVQ_PER_LAYER, KVQ_FMT_CSV, &t, &tl, &err), KVQ_ERR_USAGE);
    ck_assert_msg(t == NULL && strstr(err.msg, "residual=24 must be a multiple of group=16"), "%s", err.msg);
    kvq_grid_free(bad);
    for (int i = 0; i < 2; i++) kvq_prepared_free(src[i].prep), kvq_dump_close(src[i].dump);
    free(header);
    kvq_grid_free(g);
    unlink(path);
    free(path);
}
END_TEST

START_TEST(read_any_input)
{
    const char *files[2] = {csv, jsonl};
    size_t lens[2] = {sizeof csv - 1, sizeof jsonl - 1};
    kvq_rng r;
    kvq_rng_init(&r, 1, 2, 3, 4);
    for (int k = 0; k < 2; k++) {
        char buf[512];
        for (size_t n = 0; n <= lens[k]; n++) {
            char *path = write_tmp(files[k], n);
            kvq_sweep_file f;
            kvq_error err = {0};
            kvq_status st = kvq_sweep_file_read(path, &f, &err);
            ck_assert(st == KVQ_OK || st == KVQ_ERR_FORMAT);
            if (st == KVQ_OK) {
                ck_assert(f.end <= n && f.partial == (f.end < n));
                kvq_sweep_file_free(&f);
            }
            unlink(path), free(path);
        }
        for (int i = 0; i < 1000; i++) {
            memcpy(buf, files[k], lens[k]);
            buf[kvq_rng_below(&r, lens[k])] = (char)kvq_rng_below(&r, 256);
            char *path = write_tmp(buf, lens[k]);
            kvq_sweep_file f;
            kvq_error err = {0};
            kvq_status st = kvq_sweep_file_read(path, &f, &err);
            ck_assert(st == KVQ_OK || st == KVQ_ERR_FORMAT);
            if (st == KVQ_OK) kvq_sweep_file_free(&f);
            unlink(path), free(path);
        }
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("sweep");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, grid_order_and_specs);
    tcase_add_test(tc, read_csv_and_jsonl);
    tcase_add_test(tc, read_any_input);
    tcase_add_test(tc, select_and_reconcile);
    tcase_add_test(tc, point_rows);
    tcase_add_test(tc, points_together_equal_alone);
    tcase_add_test(tc, merge_shards);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
