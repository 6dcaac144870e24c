/* test_golden.c — compares kvq with the golden values of an independent
 * implementation of the same definitions (../shared/data/golden/, made from
 * the project's contract ../shared/SPEC.md, which docs/ follows) on
 * data/stories260K.h5: every column of every row whose quantizer is in the
 * registry, per head and per layer (the FP8/Tender file per head), within
 * the tolerances of docs/README.md.  Skips (exit 77) with a message when
 * ../shared is absent; quantizers not yet registered are listed and
 * skipped. */
#include "testutil.h"

#include <string.h>

#define MAXF 32
#define MAXSPEC 64

typedef struct {
    char *f[MAXF];
    int n;
} csv_row;

/* Splits one CSV line (with "quoted, fields") in place. */
static void csv_split(char *line, csv_row *r)
{
    r->n = 0;
    char *p = line;
    while (r->n < MAXF) {
        char *out = p, *start = p;
        if (*p == '"') {
            p++;
            start = out = p;
            while (*p) {
                if (*p == '"' && p[1] == '"') *out++ = '"', p += 2;
                else if (*p == '"') { p++; break; }
                else *out++ = *p++;
            }
        } else {
            while (*p && *p != ',' && *p != '\n' && *p != '\r') out++, p++;
        }
        char end = *p;
        *out = '\0';
        r->f[r->n++] = start;
        if (end != ',') break;
        p++;
    }
}

/* Column tolerance classes, docs/README.md: reconstruction 3e-5 relative,
 * attention 1e-4, attn_kl 1e-3 (or 1e-9 absolute), bits/top1 exact. */
static double tol_of(const char *col, double *abs_floor)
{
    *abs_floor = 0;
    if (!strcmp(col, "k_bits") || !strcmp(col, "v_bits") || !strcmp(col, "attn_top1")) return 0;
    if (!strcmp(col, "attn_kl")) { *abs_floor = 1e-9; return 1e-3; }
    if (!strncmp(col, "k_", 2) || !strncmp(col, "v_", 2)) return 3e-5;
    return 1e-4;
}

static const char *source_root(void) { return KVQ_SOURCE_ROOT; }

static void metric_array(const kvq_metrics *m, double v[18])
{
    double a[18] = {m->k_bits, m->v_bits, m->k_rel_fro, m->k_rmse, m->k_mae, m->k_max_abs, m->k_sqnr_db,
                    m->v_rel_fro, m->v_rmse, m->v_mae, m->v_max_abs, m->v_sqnr_db, m->score_rel,
                    m->attn_rel, m->attn_kl, m->attn_top1, m->out_rel, m->out_rel_joint};
    memcpy(v, a, sizeof a);
}

/* Compares one golden file; per_layer selects the pooling. */
static void compare_file(const char *golden, int per_layer)
{
    char dump[512];
    snprintf(dump, sizeof dump, "%s/data/stories260K.h5", source_root());
    FILE *f = fopen(golden, "r");
    ck_assert_msg(f != NULL, "cannot open %s", golden);
    char line[4096], header[4096];
    ck_assert(fgets(header, sizeof header, f) != NULL);
    csv_row hdr;
    csv_split(header, &hdr);
    ck_assert_int_eq(hdr.n, 23);
    ck_assert_str_eq(hdr.f[4], "spec");

    /* the golden spec strings, in order, and whether we have them */
    char specs_text[MAXSPEC][KVQ_SPEC_MAX];
    int nspec = 0;
    long pos0 = ftell(f);
    while (fgets(line, sizeof line, f)) {
        csv_row r;
        csv_split(line, &r);
        int known = 0;
        for (int i = 0; i < nspec; i++) known |= !strcmp(specs_text[i], r.f[4]);
        if (!known && nspec < MAXSPEC) snprintf(specs_text[nspec++], KVQ_SPEC_MAX, "%s", r.f[4]);
    }
    kvq_spec specs[MAXSPEC];
    int idx_of[MAXSPEC], nrun = 0;
    for (int i = 0; i < nspec; i++) {
        char name[KVQ_SPEC_MAX];
        memcpy(name, specs_text[i], sizeof name);
        char *c = strchr(name, ':');
        if (c) *c = '\0';
        idx_of[i] = -1;
        if (!kvq_quantizer_find(name)) {
            printf("golden: skipping %s (quantizer %s not in this build's registry)\n", specs_text[i], name);
            continue;
        }
        kvq_error err = {0};
        ck_assert_msg(kvq_spec_parse(specs_text[i], &specs[nrun], &err) == KVQ_OK, "%s", err.msg);
        idx_of[i] = nrun++;
    }
    ck_assert_int_gt(nrun, 0);

    kvq_error err = {0};
    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(dump, &d, &err) == KVQ_OK, "%s", err.msg);
    kvq_analysis a;
    kvq_analysis_opts o = {.specs = specs, .nspecs = nrun, .queries = {KVQ_Q_LAST, 64}};
    ck_assert_msg(kvq_analyze_dump(d, &o, &a, &err) == KVQ_OK, "%s", err.msg);
    kvq_dump_close(d);

    fseek(f, pos0, SEEK_SET);
    int rows = 0, values = 0;
    double worst[18] = {0};
    while (fgets(line, sizeof line, f)) {
        csv_row r;
        csv_split(line, &r);
        int si = -1;
        for (int i = 0; i < nspec; i++) if (!strcmp(specs_text[i], r.f[4])) si = idx_of[i];
        if (si < 0) continue;
        ck_assert_str_eq(r.f[0], "stories260K.h5");
        int layer = atoi(r.f[1]);
        kvq_acc pooled = {0};
        if (per_layer) {
            ck_assert_str_eq(r.f[2], "all");
            for (int h = 0; h < a.nheads; h++)
                kvq_acc_merge(&pooled, &a.acc[((size_t)layer * a.nheads + h) * nrun + si]);
        } else {
            pooled = a.acc[((size_t)layer * a.nheads + atoi(r.f[2])) * nrun + si];
        }
        kvq_metrics m;
        kvq_metrics_finalize(&pooled, &m);
        double v[18];
        metric_array(&m, v);
        for (int c = 0; c < 18; c++) {
            const char *col = hdr.f[5 + c], *cell = r.f[5 + c];
            if (!*cell) { /* empty golden cell: the metric must not apply */
                ck_assert_msg(c < 12 ? 0 : !m.has_attn, "%s %s: golden empty, kvq has a value", r.f[4], col);
                continue;
            }
            double g = strtod(cell, NULL), floor_, tol = tol_of(col, &floor_);
            double rel = fabs(v[c] - g) / (fabs(g) > 0 ? fabs(g) : 1);
            if (rel > worst[c]) worst[c] = rel;
            ck_assert_msg(tol == 0 ? v[c] == g : close_rel(v[c], g, tol, floor_),
                          "%s layer %s head %s %s: kvq %.17g, golden %.17g", r.f[4], r.f[1], r.f[2], col, v[c], g);
            values++;
        }
        rows++;
    }
    fclose(f);
    printf("golden %s: %d rows, %d values match; worst relative difference per column:\n", golden, rows, values);
    for (int c = 0; c < 18; c++) printf("  %-14s %.3g\n", hdr.f[5 + c], worst[c]);
    kvq_analysis_free(&a);
}

static char golden_head[2048], golden_layer[2048], golden_families[2048];

START_TEST(golden_per_head) { compare_file(golden_head, 0); }
END_TEST

START_TEST(golden_per_layer) { compare_file(golden_layer, 1); }
END_TEST

/* FP8 and Tender (docs/quantizers.md), per head */
START_TEST(golden_families_per_head) { compare_file(golden_families, 0); }
END_TEST

int main(void)
{
    const char *dir = getenv("KVQ_GOLDEN_DIR");
    char def[1024];
    snprintf(def, sizeof def, "%s/../shared/data/golden", source_root());
    if (!dir) dir = def;
    snprintf(golden_head, sizeof golden_head, "%s/stories260K.golden.csv", dir);
    snprintf(golden_layer, sizeof golden_layer, "%s/stories260K.layer.golden.csv", dir);
    snprintf(golden_families, sizeof golden_families, "%s/stories260K.families.golden.csv", dir);
    FILE *f = fopen(golden_head, "r");
    if (!f) {
        printf("SKIP: golden values not found at %s (../shared absent); set KVQ_GOLDEN_DIR\n", dir);
        return 77; /* meson: skipped */
    }
    fclose(f);
    Suite *s = suite_create("golden");
    TCase *tc = tcase_create("stories260K");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, golden_per_head);
    tcase_add_test(tc, golden_per_layer);
    tcase_add_test(tc, golden_families_per_head);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
