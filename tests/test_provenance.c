/* test_provenance.c — the inputs of OUT.meta.json (tools/meta.c, hash.c):
 * SHA-256 through libcrypto equals the FIPS 180-4 test vectors and a
 * streamed hash of a file larger than a read; an input is hashed as it was
 * when the run recorded it, in a background thread, and the record says
 * changed_during_run when it grew, was rewritten in place with its mtime
 * set back (ctime moves), or was replaced; an input the run extends itself
 * (a resumed file) is hashed as it was and may grow. */
#include "cli.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[] = "/tmp/kvq-test-provenance.XXXXXX";

static void write_file(const char *path, const char *bytes, size_t n, const char *mode)
{
    FILE *f = fopen(path, mode);
    ck_assert(f && fwrite(bytes, 1, n, f) == n && fclose(f) == 0);
}

/* The record of one run whose only input is path (extended or not), after `change` ran. */
static char *record(const char *path, int extended, void (*change)(const char *), int no_hash)
{
    char *argv[] = {"kvq-test", NULL};
    cli_meta *m = cli_meta_begin("kvq-test", 1, argv);
    ck_assert(m);
    if (no_hash)
        ck_assert_int_eq(cli_optrow_parse("kvq-test", cli_meta_rows, cli_meta_nrows, CLI_OPT_NO_HASH, NULL, m), CLI_OK);
    if (extended) cli_meta_input_extended(m, "input", path);
    else cli_meta_input(m, "input", path);
    if (change) change(path);
    char *doc = cli_meta_render(m, "kvq-test", "out.csv", NULL, 1);
    cli_meta_free(m);
    return doc;
}

static void append(const char *path) { write_file(path, "more", 4, "ab"); }

/* the same size, other bytes, the modification time set back */
static void rewrite_same_mtime(const char *path)
{
    struct stat st;
    ck_assert(stat(path, &st) == 0);
    usleep(20000); /* a coarse-clock file system: let the ctime move */
    FILE *f = fopen(path, "r+b");
    ck_assert(f && fputc('X', f) != EOF && fclose(f) == 0);
    struct timespec t[2] = {st.st_atim, st.st_mtim};
    ck_assert(utimensat(AT_FDCWD, path, t, 0) == 0);
}

START_TEST(test_sha256_vectors)
{
    char hex[65];
    ck_assert(cli_sha256_mem("abc", 3, hex) == 0);
    ck_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    ck_assert(cli_sha256_mem("", 0, hex) == 0);
    ck_assert_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    /* a million 'a's (FIPS 180-4), streamed from a file in 4 MB reads and in one piece */
    char path[256];
    snprintf(path, sizeof path, "%s/million", dir);
    char *a = malloc(1000000);
    memset(a, 'a', 1000000);
    write_file(path, a, 1000000, "wb");
    int e;
    ck_assert(cli_sha256_file(path, hex, &e) == 0);
    ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    ck_assert(cli_sha256_mem(a, 1000000, hex) == 0);
    ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    /* a prefix, and a prefix longer than the file */
    ck_assert(cli_sha256_file_prefix(path, 3, hex, &e) == 0);
    ck_assert_str_eq(hex, "9834876dcfb05cb167a5c24953eba58c4ac89b1adf57f28f2f9d09af107ee8f0"); /* "aaa" */
    ck_assert(cli_sha256_file_prefix(path, 1000001, hex, &e) == -1 && e == EIO);
    ck_assert(cli_sha256_file(dir, hex, &e) == -1 && e == EISDIR); /* a directory cannot be read */
    /* 9 MB: more than two reads of the background hasher */
    char big[256];
    snprintf(big, sizeof big, "%s/big", dir);
    FILE *f = fopen(big, "wb");
    for (int i = 0; i < 9; i++) ck_assert(fwrite(a, 1, 1000000, f) == 1000000);
    ck_assert(fclose(f) == 0);
    char whole[65], queued[65];
    ck_assert(cli_sha256_file(big, whole, &e) == 0);
    cli_hasher *h = cli_hasher_new();
    cli_hash_job *j1 = cli_hasher_add(h, big, 9000000), *j2 = cli_hasher_add(h, path, 1000000);
    ck_assert(h && j1 && j2);
    ck_assert(cli_hash_job_wait(h, j2, hex, &e) == 0);
    ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    ck_assert(cli_hash_job_wait(h, j1, queued, &e) == 0);
    ck_assert_str_eq(queued, whole);
    cli_hasher_free(h);
    free(a);
}
END_TEST

START_TEST(test_changed_during_run)
{
    char path[256], hex[65];
    snprintf(path, sizeof path, "%s/input", dir);
    const char *orig = "the input as the run began\n";
    ck_assert(cli_sha256_mem(orig, strlen(orig), hex) == 0);
    char want[128];
    snprintf(want, sizeof want, "\"sha256\": \"%s\"", hex);
    /* unchanged: its hash, no flag */
    write_file(path, orig, strlen(orig), "wb");
    char *doc = record(path, 0, NULL, 0);
    ck_assert_msg(doc && strstr(doc, want) && !strstr(doc, "changed_during_run"), "%s", doc);
    free(doc);
    /* appended to: the bytes it had (and their size), flagged */
    doc = record(path, 0, append, 0);
    ck_assert_msg(doc && strstr(doc, want) && strstr(doc, "\"size\": 27,") && strstr(doc, "\"changed_during_run\": true"),
                  "%s", doc);
    free(doc);
    /* rewritten in place at the same size, mtime set back: ctime tells */
    write_file(path, orig, strlen(orig), "wb");
    doc = record(path, 0, rewrite_same_mtime, 0);
    ck_assert_msg(doc && strstr(doc, "\"changed_during_run\": true"), "%s", doc);
    free(doc);
    /* ... also without hashing */
    write_file(path, orig, strlen(orig), "wb");
    doc = record(path, 0, rewrite_same_mtime, 1);
    ck_assert_msg(doc && strstr(doc, "\"sha256\": null") && strstr(doc, "\"changed_during_run\": true"), "%s", doc);
    free(doc);
    /* a file the run extends itself: hashed as it was, growing is no change */
    write_file(path, orig, strlen(orig), "wb");
    doc = record(path, 1, append, 0);
    ck_assert_msg(doc && strstr(doc, want) && !strstr(doc, "changed_during_run"), "%s", doc);
    free(doc);
}
END_TEST

int main(void)
{
    if (!mkdtemp(dir)) return 1;
    Suite *s = suite_create("provenance");
    TCase *tc = tcase_create("provenance");
    tcase_add_test(tc, test_sha256_vectors);
    tcase_add_test(tc, test_changed_during_run);
    suite_add_tcase(s, tc);
    SRunner *r = srunner_create(s);
    srunner_set_fork_status(r, CK_NOFORK);
    srunner_run_all(r, CK_NORMAL);
    int failed = srunner_ntests_failed(r);
    srunner_free(r);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) { /* nothing more to do */ }
    return failed ? 1 : 0;
}
