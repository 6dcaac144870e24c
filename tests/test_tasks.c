/* test_tasks.c — retrieval task files (SPEC §8, lib/io/tasks.c): the
 * generator (seeded, depths spread over 0..1, the asked fact where its
 * depth says, contexts within their token budget, the answer in the
 * context), the JSON writer read back by the reader, the reader's
 * refusals, and the pooling of per-task results into a row by hand. */
#include "testutil.h"

#include <math.h>

static const kvq_task_kind KINDS[] = {KVQ_TASK_NEEDLE, KVQ_TASK_MULTIKEY, KVQ_TASK_KV, KVQ_TASK_MQAR};

static kvq_task *gen(kvq_task_kind k, size_t n, int L, uint64_t seed)
{
    kvq_task *t = NULL;
    kvq_error err = {0};
    kvq_status st = kvq_tasks_generate(k, n, L, seed, NULL, NULL, &t, &err);
    ck_assert_msg(st == KVQ_OK, "%s", err.msg);
    return t;
}

/* The same seed gives the same tasks; another seed others. */
START_TEST(seeded)
{
    for (int k = 0; k < 4; k++) {
        kvq_task *a = gen(KINDS[k], 5, 200, 7), *b = gen(KINDS[k], 5, 200, 7), *c = gen(KINDS[k], 5, 200, 8);
        int differ = 0;
        for (int i = 0; i < 5; i++) {
            ck_assert_str_eq(a[i].context, b[i].context);
            ck_assert_str_eq(a[i].question, b[i].question);
            ck_assert_str_eq(a[i].answer, b[i].answer);
            differ |= strcmp(a[i].context, c[i].context) != 0;
        }
        ck_assert(differ);
        kvq_tasks_free(a, 5), kvq_tasks_free(b, 5), kvq_tasks_free(c, 5);
    }
}
END_TEST

/* Depths evenly over 0..1; every context within L tokens and not far
 * below it; the asked fact is in the context, once, at its depth. */
START_TEST(shape)
{
    for (int k = 0; k < 4; k++) {
        enum { N = 9, L = 300 };
        kvq_task *t = gen(KINDS[k], N, L, 3);
        for (int i = 0; i < N; i++) {
            ck_assert(fabs(t[i].depth - i / 8.0) < 1e-4);
            size_t n = kvq_task_approx_tokens(t[i].context, strlen(t[i].context));
            ck_assert_msg(n <= L && n > L - 20, "%s: %zu tokens", kvq_task_kind_name(KINDS[k]), n);
            char fact[256];
            if (KINDS[k] == KVQ_TASK_KV) {
                const char *key = t[i].question + strlen("What is the value of ");
                ck_assert(!strncmp(t[i].question, "What is the value of ", 21));
                snprintf(fact, sizeof fact, "%.*s: %s.", (int)(strlen(key) - 1), key, t[i].answer);
            } else if (KINDS[k] == KVQ_TASK_MQAR) {
                snprintf(fact, sizeof fact, "%s %s", t[i].question, t[i].answer);
            } else {
                const char *w = t[i].question + strlen("What is the special magic number for ");
                snprintf(fact, sizeof fact, "The special magic number for %.*s is %s.", (int)(strlen(w) - 1), w,
                         t[i].answer);
                ck_assert_int_eq((int)strlen(t[i].answer), 4);
            }
            const char *at = strstr(t[i].context, fact);
            ck_assert_msg(at, "%s: '%s' not in the context", kvq_task_kind_name(KINDS[k]), fact);
            if (KINDS[k] != KVQ_TASK_MQAR) ck_assert_ptr_null(strstr(at + 1, fact));
            /* its relative place in the context follows the depth */
            double rel = (double)(at - t[i].context) / (double)strlen(t[i].context);
            ck_assert_msg(fabs(rel - t[i].depth) < 0.15, "%s depth %g at %g", kvq_task_kind_name(KINDS[k]),
                          t[i].depth, rel);
        }
        kvq_tasks_free(t, N);
    }
}
END_TEST

/* A token counter that the generator must obey: here 2 per word-ish unit. */
static size_t double_count(void *ud, const char *s, size_t n)
{
    (*(int *)ud)++;
    return 2 * kvq_task_approx_tokens(s, n);
}

START_TEST(counter)
{
    kvq_task *t = NULL;
    kvq_error err = {0};
    int calls = 0;
    ck_assert_int_eq(kvq_tasks_generate(KVQ_TASK_KV, 2, 200, 1, double_count, &calls, &t, &err), KVQ_OK);
    ck_assert_int_gt(calls, 0);
    for (int i = 0; i < 2; i++) {
        size_t n = 2 * kvq_task_approx_tokens(t[i].context, strlen(t[i].context));
        ck_assert(n <= 200 && n > 180);
    }
    kvq_tasks_free(t, 2);
    /* too small a budget for a needle and a sentence of filler */
    ck_assert_int_eq(kvq_tasks_generate(KVQ_TASK_MULTIKEY, 1, 30, 1, NULL, NULL, &t, &err), KVQ_ERR_USAGE);
    ck_assert(strstr(err.msg, "too few"));
    ck_assert_ptr_null(t);
}
END_TEST

START_TEST(json_round_trip)
{
    kvq_task *t = gen(KVQ_TASK_NEEDLE, 3, 120, 5);
    char buf[65536];
    size_t n = 0;
    for (int i = 0; i < 3; i++) {
        char *line = kvq_task_json(&t[i], "needle");
        ck_assert_ptr_nonnull(line);
        n += (size_t)snprintf(buf + n, sizeof buf - n, "%s\n", line);
        free(line);
    }
    /* escapes and characters beyond ASCII survive */
    kvq_task odd = {.id = "odd", .context = "tab\there \"quoted\" back\\slash\nline \xc3\xa9", .question = "q?",
                    .answer = "\xe2\x82\xac", .depth = NAN};
    char *line = kvq_task_json(&odd, NULL);
    n += (size_t)snprintf(buf + n, sizeof buf - n, "\n%s\n", line); /* a blank line is skipped */
    free(line);
    n += (size_t)snprintf(buf + n, sizeof buf - n, "{\"answer\": \"\\u00e9\\ud83d\\ude00\", \"question\": \"\", "
                          "\"context\": \"x\", \"extra\": [1, {\"a\": null}], \"depth\": null}\n");
    kvq_task *r = NULL;
    size_t nr = 0;
    kvq_error err = {0};
    ck_assert_msg(kvq_tasks_parse("mem.jsonl", buf, n, &r, &nr, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_uint_eq(nr, 5);
    for (int i = 0; i < 3; i++) {
        ck_assert_str_eq(r[i].context, t[i].context);
        ck_assert_str_eq(r[i].question, t[i].question);
        ck_assert_str_eq(r[i].answer, t[i].answer);
        ck_assert_str_eq(r[i].id, t[i].id);
        ck_assert(r[i].depth == t[i].depth);
        ck_assert_uint_eq(r[i].line, (size_t)i + 1);
    }
    ck_assert_str_eq(r[3].context, odd.context);
    ck_assert_str_eq(r[3].answer, odd.answer);
    ck_assert(isnan(r[3].depth));
    ck_assert_uint_eq(r[3].line, 5);
    ck_assert_str_eq(r[4].answer, "\xc3\xa9\xf0\x9f\x98\x80");
    ck_assert_ptr_null(r[4].id);
    kvq_tasks_free(r, nr);
    kvq_tasks_free(t, 3);
}
END_TEST

static void refused(const char *text, const char *want)
{
    kvq_task *r = (kvq_task *)1;
    size_t n = 9;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_tasks_parse("t.jsonl", text, strlen(text), &r, &n, &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, want), "'%s' lacks '%s'", err.msg, want);
    ck_assert_msg(strncmp(err.msg, "t.jsonl: ", 9) == 0, "'%s' does not name the file", err.msg);
    ck_assert_ptr_null(r);
    ck_assert_uint_eq(n, 0);
}

START_TEST(refusals)
{
    const char *ok = "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\"}\n";
    char two[256];
    snprintf(two, sizeof two, "%snot json\n", ok);
    refused(two, "line 2: not a JSON object");
    refused("{\"context\": \"c\", \"question\": \"q\"}", "line 1: no \"answer\" field");
    refused("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"\"}", "line 1: \"answer\" is empty");
    refused("{\"context\": 3, \"question\": \"q\", \"answer\": \"a\"}", "\"context\": expected a string");
    refused("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\", \"depth\": 1.5}", "expected a number in 0..1");
    refused("{\"context\": \"c\", \"context\": \"d\", \"question\": \"q\", \"answer\": \"a\"}", "given twice");
    refused("{\"context\": \"c\\u0000\", \"question\": \"q\", \"answer\": \"a\"}", "NUL");
    refused("{\"context\": \"c\\ud800\", \"question\": \"q\", \"answer\": \"a\"}", "unpaired surrogate");
    refused("{\"context\": \"c\\q\", \"question\": \"q\", \"answer\": \"a\"}", "invalid escape");
    refused("{\"context\": \"c, \"question\": \"q\", \"answer\": \"a\"}", "line 1:");
    refused("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\"} {}", "text after the object");
    refused("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\"", "expected ',' or '}'");
    refused("\n\n  \n", "no tasks");
    refused("{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\", \"x\": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
            "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
            "nested deeper than 64");
    char nul[] = "{\"context\": \"c\", \"question\": \"q\", \"answer\": \"a\"}\n\0";
    kvq_task *r = NULL;
    size_t n = 0;
    kvq_error err = {0};
    ck_assert_int_eq(kvq_tasks_parse("t.jsonl", nul, sizeof nul - 1, &r, &n, &err), KVQ_ERR_FORMAT);
    ck_assert(strstr(err.msg, "NUL byte"));
}
END_TEST

/* kvq_task_pool by hand: means, the standard error over tasks, exact
 * rates, bits pooled by elements, and a selection. */
START_TEST(pool_by_hand)
{
    /* three tasks, one item: rows [ref, item] */
    kvq_task_result res[6] = {
        {.nll = 1.0, .exact = 1}, {.nll = 1.5, .exact = 1, .k_bits = 400, .v_bits = 800, .elements = 100},
        {.nll = 2.0, .exact = 1}, {.nll = 3.0, .exact = 0, .k_bits = 100, .v_bits = 100, .elements = 100},
        {.nll = 0.5, .exact = 0}, {.nll = 0.5, .exact = 0, .k_bits = 200, .v_bits = 300, .elements = 200},
    };
    kvq_task_summary s;
    kvq_task_pool(res, 3, 1, 0, NULL, &s);
    ck_assert_int_eq(s.tasks, 3);
    ck_assert(fabs(s.nll_ref - 3.5 / 3) < 1e-12 && fabs(s.nll - 5.0 / 3) < 1e-12);
    ck_assert(fabs(s.dnll - 0.5) < 1e-12);
    /* d = 0.5, 1, 0: mean 0.5, sample variance 0.25, se = 0.5 / sqrt(3) */
    ck_assert(fabs(s.dnll_se - 0.5 / sqrt(3.0)) < 1e-12);
    ck_assert(fabs(s.exact_ref - 2.0 / 3) < 1e-12 && fabs(s.exact - 1.0 / 3) < 1e-12);
    ck_assert(fabs(s.recall_drop - 1.0 / 3) < 1e-12);
    ck_assert(fabs(s.k_bits - 700.0 / 400) < 1e-12 && fabs(s.v_bits - 1200.0 / 400) < 1e-12);
    unsigned char sel[3] = {0, 1, 0};
    kvq_task_pool(res, 3, 1, 0, sel, &s);
    ck_assert_int_eq(s.tasks, 1);
    ck_assert(s.exact_ref == 1 && s.exact == 0 && s.recall_drop == 1 && isnan(s.dnll_se));
    unsigned char none[3] = {0};
    kvq_task_pool(res, 3, 1, 0, none, &s);
    ck_assert_int_eq(s.tasks, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tasks");
    TCase *tc = tcase_create("tasks");
    tcase_add_test(tc, seeded);
    tcase_add_test(tc, shape);
    tcase_add_test(tc, counter);
    tcase_add_test(tc, json_round_trip);
    tcase_add_test(tc, refusals);
    tcase_add_test(tc, pool_by_hand);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
