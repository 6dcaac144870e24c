/* test_alloc.c — kvq_alloc_solve, the exact multiple-choice knapsack of
 * kvq-alloc, against brute force over every assignment: 3–5 layers x 2–4
 * points, random costs (negative ones too, as measured dnll can be) and bit
 * weights from small grids so that ties in cost and in bits occur, layers
 * of equal and of different sizes, budgets from infeasible to loose; and
 * small cases by hand.  Then the rest of kvq-alloc's pipeline in the
 * library: its sensitivity table read back, the allocations and best
 * uniform points by hand, the bits a spec stores. */
#include "testutil.h"

typedef kvq_alloc_point point_t;

/* The best assignment by enumeration in lexicographic order (layer 0 the
 * most significant): lower cost, then lower weight; the first found wins
 * ties.  Returns 0 when none fits. */
static int brute(int L, int G, const double *c, const double *w, double cap, int *best, int *nbest)
{
    int idx[8] = {0}, found = 0;
    double bc = 0, bw = 0;
    for (;;) {
        double sc = 0, sw = 0;
        for (int l = 0; l < L; l++) sc += c[l * G + idx[l]], sw += w[l * G + idx[l]];
        if (sw <= cap && found && sc == bc) ++*nbest; /* another assignment of the best cost so far */
        if (sw <= cap && (!found || sc < bc || (sc == bc && sw < bw))) {
            if (!found || sc < bc) *nbest = 1;
            found = 1, bc = sc, bw = sw;
            memcpy(best, idx, (size_t)L * sizeof *idx);
        }
        int l = L - 1;
        while (l >= 0 && ++idx[l] == G) idx[l--] = 0;
        if (l < 0) break;
    }
    return found;
}

START_TEST(against_brute_force)
{
    kvq_rng r;
    kvq_rng_init(&r, 2025, 1, 2, 3);
    int cases = 0, infeasible = 0, ties = 0;
    for (int it = 0; it < 3000; it++) {
        int L = 3 + (int)(kvq_rng_u64(&r) % 3), G = 2 + (int)(kvq_rng_u64(&r) % 3);
        double c[5 * 4], w[5 * 4], n[5];
        const double levels[] = {2, 3, 4, 4.5, 8.5, 16};
        for (int l = 0; l < L; l++) n[l] = it % 2 ? 1024 : 512 * (1 + (double)(kvq_rng_u64(&r) % 3));
        for (int i = 0; i < L * G; i++) {
            c[i] = ((double)(kvq_rng_u64(&r) % 9) - 2) * 0.25; /* few values: ties */
            w[i] = levels[kvq_rng_u64(&r) % 6] * n[i / G];
        }
        double wmin = 0, wmax = 0, cap;
        for (int l = 0; l < L; l++) {
            double lo = INFINITY, hi = 0;
            for (int g = 0; g < G; g++) lo = fmin(lo, w[l * G + g]), hi = fmax(hi, w[l * G + g]);
            wmin += lo, wmax += hi;
        }
        cap = wmin - 0.1 * (wmax - wmin) - 1 + (1.1 * (wmax - wmin) + 2) * (double)(kvq_rng_u64(&r) % 1000) / 999.0;
        int want[5], got[5], nbest = 0;
        double mw;
        kvq_error err = {0};
        int ok = brute(L, G, c, w, cap, want, &nbest);
        kvq_status st = kvq_alloc_solve(L, G, c, w, cap, got, &mw, &err);
        if (mw != wmin) ck_abort_msg("case %d: min weight %g, expected %g", it, mw, wmin);
        if (!ok) {
            if (st != KVQ_ERR_USAGE || !strstr(err.msg, "cheapest assignment needs"))
                ck_abort_msg("case %d: infeasible budget %g (min %g): status %d '%s'", it, cap, wmin, st, err.msg);
            infeasible++;
            continue;
        }
        if (st) ck_abort_msg("case %d: %s", it, err.msg);
        for (int l = 0; l < L; l++)
            if (got[l] != want[l]) ck_abort_msg("case %d (L %d, G %d): layer %d: chose %d, brute force %d", it, L, G, l,
                                                got[l], want[l]);
        ties += nbest > 1; /* other assignments had the same cost: the tie rules chose */
        cases++;
    }
    ck_assert_int_gt(cases, 1500);
    ck_assert_int_gt(infeasible, 5);
    ck_assert_int_gt(ties, 300);
}
END_TEST

START_TEST(by_hand)
{
    /* 3 layers x 2 points: point 0 = 4 bits (cost 0), point 1 = 2 bits with
     * costs 0.5, 0.1, 0.3; budget 8 bits of 12: two layers at 2 bits, the
     * cheapest two (layers 1 and 2: 0.4) */
    double c[] = {0, 0.5, 0, 0.1, 0, 0.3}, w[] = {4, 2, 4, 2, 4, 2};
    int ch[3];
    kvq_error err = {0};
    ck_assert_int_eq(kvq_alloc_solve(3, 2, c, w, 8, ch, NULL, &err), KVQ_OK);
    ck_assert(ch[0] == 0 && ch[1] == 1 && ch[2] == 1);
    /* a loose budget: no loss, all at 4 bits; equal costs: fewer bits first */
    ck_assert_int_eq(kvq_alloc_solve(3, 2, c, w, 12, ch, NULL, &err), KVQ_OK);
    ck_assert(ch[0] == 0 && ch[1] == 0 && ch[2] == 0);
    double c2[] = {0, 0, 0, 0, 0, 0};
    ck_assert_int_eq(kvq_alloc_solve(3, 2, c2, w, 12, ch, NULL, &err), KVQ_OK);
    ck_assert(ch[0] == 1 && ch[1] == 1 && ch[2] == 1);
    /* equal cost and bits: the lower index, layer by layer */
    double w3[] = {4, 4, 4, 4, 4, 4};
    ck_assert_int_eq(kvq_alloc_solve(3, 2, c2, w3, 12, ch, NULL, &err), KVQ_OK);
    ck_assert(ch[0] == 0 && ch[1] == 0 && ch[2] == 0);
    /* below the minimum (6): says it */
    double mw;
    ck_assert_int_eq(kvq_alloc_solve(3, 2, c, w, 5.5, ch, &mw, &err), KVQ_ERR_USAGE);
    ck_assert(mw == 6 && strstr(err.msg, "needs 6"));
    /* bad input */
    double bad[] = {NAN, 0, 0, 0, 0, 0};
    ck_assert_int_eq(kvq_alloc_solve(3, 2, bad, w, 12, ch, NULL, &err), KVQ_ERR_USAGE);
    mw = 42; /* a NaN cost: *min_weight is still set (NaN), never left as it was (issue #36) */
    ck_assert_int_eq(kvq_alloc_solve(3, 2, bad, w, 12, ch, &mw, &err), KVQ_ERR_USAGE);
    ck_assert(isnan(mw));
    ck_assert_int_eq(kvq_alloc_solve(0, 2, c, w, 12, ch, NULL, &err), KVQ_ERR_USAGE);
}
END_TEST

/* The mix(...) spec of an allocation, by hand; it parses and gives each
 * layer its choice; a buffer too small is a clean error. */
START_TEST(mix_text)
{
    const char *abc[] = {"A", "B", "C"};
    const struct { int L, choice[6]; const char *want; } cases[] = {
        {6, {0, 0, 1, 0, 1, 1}, "mix(0-1,3=A;2,4-=B)"},
        {3, {1, 1, 1}, "mix(0-=B)"},
        {3, {0, 1, 0}, "mix(0,2=A;1=B)"},
        {1, {2}, "mix(0=C)"},
        {4, {2, 0, 0, 2}, "mix(0,3=C;1-2=A)"},
    };
    char buf[128];
    kvq_error err = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ck_assert_int_eq(kvq_alloc_mix_text(abc, cases[i].choice, cases[i].L, buf, sizeof buf, &err), KVQ_OK);
        ck_assert_str_eq(buf, cases[i].want);
    }
    ck_assert_int_eq(kvq_alloc_mix_text(abc, cases[0].choice, 6, buf, 12, &err), KVQ_ERR_USAGE);
    ck_assert(strlen(buf) == 11 && strstr(err.msg, "19 characters"));

    const char *real[] = {"kivi:bits=2,group=8,residual=0", "per-token:bits=4"};
    int choice[] = {0, 1, 1, 0};
    ck_assert_int_eq(kvq_alloc_mix_text(real, choice, 4, buf, sizeof buf, &err), KVQ_OK);
    kvq_spec mix, sub;
    ck_assert_msg(kvq_spec_parse(buf, &mix, &err) == KVQ_OK, "%s: %s", buf, err.msg);
    for (int l = 0; l < 4; l++) {
        ck_assert_int_eq(kvq_spec_for_layer(&mix, l, &sub, &err), KVQ_OK);
        ck_assert_str_eq(sub.text, real[choice[l]]);
    }
}
END_TEST

/* kvq-alloc's table round trip: two points' passes written by
 * kvq_alloc_table_rows read back by kvq_alloc_table_read; a torn last row
 * and an unfinished pass are cut (*keep); a foreign run, a spec outside the
 * grid, wrong bits and a pass twice are refused with what mends them; a
 * merge's shard (whole) records its rows and refuses an unfinished pass. */
enum { TL = 3, TP = 2 };

static void table_points(point_t *pts)
{
    const char *specs[TP] = {"kivi:bits=2", "kivi:bits=4"};
    kvq_error err = {0};
    for (int i = 0; i < TP; i++) {
        memset(&pts[i], 0, sizeof pts[i]);
        ck_assert_int_eq(kvq_spec_parse(specs[i], &pts[i].spec, &err), KVQ_OK);
        ck_assert_int_eq(kvq_alloc_point_init(&pts[i], TL, &err), KVQ_OK);
        pts[i].want_k = 2.5 + 2 * i, pts[i].want_v = 2.25 + 2 * i;
        for (int l = 0; l < TL; l++)
            pts[i].k_bits[l] = pts[i].want_k, pts[i].v_bits[l] = pts[i].want_v,
            pts[i].dnll[l] = 0.125 * (l + 1) / (i + 1), pts[i].dnll_se[l] = l == 2 ? NAN : 0.01 * (l + 1);
    }
}

static void table_free(point_t *pts)
{
    for (int i = 0; i < TP; i++) kvq_alloc_point_free(&pts[i]);
}

/* The header and both passes as one file (malloc'ed), *n its bytes; pass_len[i] the rows of point i. */
static char *table_text(const point_t *pts, const char *run, size_t *n, size_t *pass_len)
{
    const char *const *cols;
    int nc = kvq_alloc_table_columns(&cols);
    char *text = calloc(4096, 1);
    for (int k = 0; k < nc; k++) strcat(text, k ? "," : ""), strcat(text, cols[k]);
    strcat(text, "\n");
    kvq_error err = {0};
    for (int i = 0; i < TP; i++) {
        char *rows;
        ck_assert_int_eq(kvq_alloc_table_rows(&pts[i], TL, run, &rows, &pass_len[i], &err), KVQ_OK);
        strncat(text, rows, pass_len[i]);
        free(rows);
    }
    *n = strlen(text);
    return text;
}

START_TEST(table_round_trip)
{
    point_t w[TP], r[TP];
    table_points(w);
    size_t n, pass[TP], keep;
    char *text = table_text(w, "00000000000000aa", &n, pass);
    ck_assert(strstr(text, "0,kivi:bits=2,2.5,2.25,2.375,0.125,0.01,00000000000000aa\n"));
    size_t head = (size_t)(strchr(text, '\n') + 1 - text);
    kvq_error err = {0};
    kvq_alloc_fix fix;

    /* the whole table: every value back, nothing cut */
    table_points(r);
    for (int i = 0; i < TP; i++) memset(r[i].dnll, 0, TL * sizeof(double));
    ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, n, 0, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_OK);
    ck_assert_uint_eq(keep, n);
    for (int i = 0; i < TP; i++) {
        ck_assert(r[i].done);
        for (int l = 0; l < TL; l++) {
            ck_assert(r[i].dnll[l] == w[i].dnll[l]);
            ck_assert(l == 2 ? isnan(r[i].dnll_se[l]) : r[i].dnll_se[l] == w[i].dnll_se[l]);
        }
    }
    table_free(r);

    /* cut inside the second pass (a torn row, then a whole row short of the pass): the first pass kept */
    for (size_t cut = head + pass[0] + 3; cut < n; cut += 7) {
        table_points(r);
        ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, cut, 0, "00000000000000aa", r, TP, TL, &keep, &fix,
                                              &err), KVQ_OK);
        ck_assert_uint_eq(keep, head + pass[0]);
        ck_assert(r[0].done && !r[1].done);
        /* a shard must be whole */
        table_free(r), table_points(r);
        ck_assert_int_eq(kvq_alloc_table_read("s.csv", text, cut, 1, "00000000000000aa", r, TP, TL, &keep, &fix,
                                              &err), KVQ_ERR_FORMAT);
        ck_assert_int_eq(fix, KVQ_ALLOC_FIX_RESUME);
        ck_assert(strstr(err.msg, "s.csv: ends in an unfinished pass"));
        table_free(r);
    }

    /* a shard: its rows recorded for the merge */
    table_points(r);
    ck_assert_int_eq(kvq_alloc_table_read("s.csv", text, n, 1, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_OK);
    ck_assert(r[1].rows == text + head + pass[0] && r[1].rows_len == pass[1] && !strcmp(r[1].from, "s.csv"));
    /* ... and the same passes again: twice */
    ck_assert_int_eq(kvq_alloc_table_read("s2.csv", text, n, 1, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "kivi:bits=2's pass is in s.csv and here: twice"), "%s", err.msg);
    table_free(r);

    /* another run's fingerprint; a spec outside the grid; bits the spec does not store */
    table_points(r);
    ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, n, 0, "00000000000000bb", r, TP, TL, &keep, &fix, &err),
                     KVQ_ERR_USAGE);
    ck_assert(fix == KVQ_ALLOC_FIX_OPTIONS && strstr(err.msg, "t.csv: line 2: measured in another run"));
    r[0].spec.text[10] = '3';
    ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, n, 0, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_ERR_USAGE);
    ck_assert(fix == KVQ_ALLOC_FIX_REMOVE && strstr(err.msg, "line 2: not a row of this run's grid and model"));
    r[0].spec.text[10] = '2';
    r[1].want_v = 4.5;
    ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, n, 0, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_ERR_FORMAT);
    ck_assert_msg(fix == KVQ_ALLOC_FIX_REMOVE && strstr(err.msg, "line 5: bits 4.5, 4.25, 4.375: kivi:bits=4 stores"),
                  "%s", err.msg);
    table_free(r);
    /* another header */
    table_points(r);
    text[0] = 'L';
    ck_assert_int_eq(kvq_alloc_table_read("t.csv", text, n, 0, "00000000000000aa", r, TP, TL, &keep, &fix, &err),
                     KVQ_ERR_FORMAT);
    ck_assert(fix == KVQ_ALLOC_FIX_REMOVE && strstr(err.msg, "line 1: expected the header"));
    table_free(r);
    free(text);
    table_free(w);
}
END_TEST

/* The allocations by hand: 2 layers x 2 points of 64 elements per layer;
 * point 0 stores 2 bits (cost 0.5, 0.25), point 1 stores 4 bits (cost 0.1,
 * 0.05).  Budget 3: one layer at 4 bits, the one whose cost drops more
 * (layer 0); budget 4: both; budget 1: below the cheapest (2 bits). */
START_TEST(plan_by_hand)
{
    point_t p[2];
    kvq_error err = {0};
    const double cost[2][2] = {{0.5, 0.25}, {0.1, 0.05}};
    for (int i = 0; i < 2; i++) {
        memset(&p[i], 0, sizeof p[i]);
        ck_assert_int_eq(kvq_spec_parse(i ? "per-token:bits=4" : "per-token:bits=2", &p[i].spec, &err), KVQ_OK);
        ck_assert_int_eq(kvq_alloc_point_init(&p[i], 2, &err), KVQ_OK);
        for (int l = 0; l < 2; l++) p[i].k_bits[l] = p[i].v_bits[l] = 2 + 2 * i, p[i].dnll[l] = cost[i][l];
    }
    kvq_allocation a;
    const double budgets[] = {3, 4, 2};
    ck_assert_int_eq(kvq_alloc_plan(p, 2, 2, 64, budgets, 3, &a, &err), KVQ_OK);
    ck_assert_str_eq(a.mix[0].text, "mix(0=per-token:bits=4;1=per-token:bits=2)");
    ck_assert_str_eq(a.mix[1].text, "mix(0-=per-token:bits=4)");
    ck_assert_str_eq(a.mix[2].text, "mix(0-=per-token:bits=2)");
    ck_assert(fabs(a.pred[0] - 0.35) < 1e-15 && fabs(a.pred[1] - 0.15) < 1e-15 && a.pred[2] == 0.75);
    ck_assert(a.ubits[0] == 2 && a.ubits[1] == 4 && a.upred[0] == 0.75 && a.fits[0] && a.fits[1]);
    /* the best uniform point: within the budget, least nll, then fewer bits */
    double nll[2] = {1.0, 0.9};
    ck_assert_int_eq(kvq_alloc_best_uniform(&a, 3, nll), 0);
    ck_assert_int_eq(kvq_alloc_best_uniform(&a, 4, nll), 1);
    nll[1] = 1.0;
    ck_assert_int_eq(kvq_alloc_best_uniform(&a, 4, nll), 0);
    ck_assert_int_eq(kvq_alloc_best_uniform(&a, 1.5, nll), -1);
    kvq_allocation_free(&a);
    /* a budget below the cheapest allocation */
    const double low[] = {3, 1.5};
    ck_assert_int_eq(kvq_alloc_plan(p, 2, 2, 64, low, 2, &a, &err), KVQ_ERR_USAGE);
    ck_assert(a.bad_budget == 1 && a.min_bits == 2);
    ck_assert_str_eq(err.msg, "budget 1.5: below the cheapest allocation of this grid, 2 bits per element");
    kvq_allocation_free(&a);
    /* the largest budget bounds the uniform points evaluated */
    ck_assert_int_eq(kvq_alloc_plan(p, 2, 2, 64, budgets, 1, &a, &err), KVQ_OK);
    ck_assert(a.fits[0] && !a.fits[1]);
    kvq_allocation_free(&a);
    for (int i = 0; i < 2; i++) kvq_alloc_point_free(&p[i]);
}
END_TEST

/* The bits a spec stores on a model's layer, on a synthetic layer: q8_0
 * stores 34 bytes per block of 32 (8.5 bits); a tokens(...) window of the
 * 16 recent of 64 tokens at q8_0, the rest dropped: a quarter of that, plus
 * each kept token's 32-bit position, half in K, half in V (16 bits over 32
 * channels, a quarter of the tokens: 0.125). */
START_TEST(stored_bits)
{
    kvq_model_info in = {.n_kv_heads = 2, .n_heads = 4, .head_dim = 32, .rope_theta = 10000};
    kvq_spec sp;
    kvq_error err = {0};
    double k, v;
    ck_assert_int_eq(kvq_spec_parse("ggml:ktype=q8_0,vtype=q8_0", &sp, &err), KVQ_OK);
    ck_assert_int_eq(kvq_alloc_stored_bits(&sp, &in, 64, NULL, 0, 1, &k, &v, &err), KVQ_OK);
    ck_assert(k == 8.5 && v == 8.5);
    ck_assert_msg(kvq_spec_parse("tokens(window:recent=16; ggml:ktype=q8_0,vtype=q8_0; drop)", &sp, &err) == KVQ_OK,
                  "%s", err.msg);
    ck_assert_int_eq(kvq_alloc_stored_bits(&sp, &in, 64, NULL, 0, 1, &k, &v, &err), KVQ_OK);
    ck_assert_msg(k == 8.5 / 4 + 0.125 && v == 8.5 / 4 + 0.125, "%g %g", k, v);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("alloc");
    TCase *tc = tcase_create("alloc");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, against_brute_force);
    tcase_add_test(tc, by_hand);
    tcase_add_test(tc, mix_text);
    tcase_add_test(tc, table_round_trip);
    tcase_add_test(tc, plan_by_hand);
    tcase_add_test(tc, stored_bits);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
