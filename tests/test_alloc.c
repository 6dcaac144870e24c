/* test_alloc.c — kvq_alloc_solve, the exact multiple-choice knapsack of
 * kvq-alloc, against brute force over every assignment: 3–5 layers x 2–4
 * points, random costs (negative ones too, as measured dnll can be) and bit
 * weights from small grids so that ties in cost and in bits occur, layers
 * of equal and of different sizes, budgets from infeasible to loose; and
 * small cases by hand. */
#include "testutil.h"

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

int main(void)
{
    Suite *s = suite_create("alloc");
    TCase *tc = tcase_create("alloc");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, against_brute_force);
    tcase_add_test(tc, by_hand);
    tcase_add_test(tc, mix_text);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
